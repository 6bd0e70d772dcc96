"""The adapter of ``hermes-agent==0.19.0`` for the plugin: what it hooks, and how.

The plugin's ``register`` runs before the gateway's runner exists (the gateway discovers
plugins while it loads its config), so this wraps ``GatewayRunner.start`` and ``stop``:
at once if ``gateway.run`` is loaded (or runs as ``python -m gateway.run``), else when
it is imported. Each runner, as it starts (before its first transcript write), gets its
``SessionStore`` and its shutdown linked to ``<HERMES_HOME>/spool.db`` as
``walspool.hermes.install`` and ``install_runner`` do (the store's calls mapped onto
the gateway-neutral link, ``walspool.link``); after it stops, the link is closed and
the spool with it. A runner that exists already is linked at once.
"""

from __future__ import annotations

import atexit
import copy
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

from .. import text
from ..hermes import install, install_runner
from ..link.bounds import FLUSH_TIMEOUT
from ..shutdown_flush import spool_path
from ..store.spool import Spool
from . import MARK

log = text.logger("walspool.gateways.hermes_agent")


def link(gateway: str) -> bool:
    """Link every runner of this process as it starts (see the module docstring); the
    runner's own start says whether it could."""
    _link_on_start()
    return True


def _link_on_start() -> None:
    """Wrap ``GatewayRunner.start`` wherever the gateway's runner module is (or will
    be), and link a runner that exists already."""
    for module in _runner_modules():
        _wrap_runner(module)
    if "gateway.run" not in sys.modules:
        sys.meta_path.insert(0, _AfterImport("gateway.run", _wrap_runner))
    log.debug(
        "walspool will link the gateway's transcripts to %s when the gateway starts",
        _spool_path(),
    )


def _runner_modules() -> list[ModuleType]:
    """``gateway.run`` as loaded now: imported, or run as ``python -m gateway.run``."""
    modules = [sys.modules.get("gateway.run")]
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "gateway.run":
        modules.append(main)
    return [m for m in modules if m is not None and hasattr(m, "GatewayRunner")]


def _wrap_runner(module: ModuleType) -> None:
    """Make ``module.GatewayRunner`` link each runner as it starts; link a live one."""
    cls = module.GatewayRunner
    if not getattr(cls.start, MARK, False):
        cls.start = _wrapped_start(cls.start)
        cls.stop = _wrapped_stop(cls.stop)
    ref = getattr(module, "_gateway_runner_ref", None)
    runner = ref() if callable(ref) else None
    if runner is not None and getattr(runner, "session_store", None) is not None:
        link_runner(runner)


def _wrapped_start(start: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(start)
    async def linked_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        link_runner(self)
        return await start(self, *args, **kwargs)

    setattr(linked_start, MARK, True)
    return linked_start


def _wrapped_stop(stop: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(stop)
    async def linked_stop(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await stop(self, *args, **kwargs)
        finally:
            unlink_runner(self)

    setattr(linked_stop, MARK, True)
    return linked_stop


def link_runner(runner: Any) -> Any:
    """Link a 0.19.0 runner's store and shutdown to ``<HERMES_HOME>/spool.db`` once;
    return the link (None when it could not be made: logged at ERROR)."""
    linked = getattr(runner, MARK, None)
    if linked is not None:
        return linked[0]

    path = _spool_path()
    try:
        spool = Spool(path)
    except Exception as exc:  # noqa: BLE001 - the gateway runs as released
        log.error(
            "walspool is not linked: it cannot open the spool %s (%s). The gateway runs as "
            "released until this is fixed and the gateway restarted.",
            path,
            exc,
        )
        return None
    try:
        link = install(runner.session_store, spool)
        install_runner(runner, link)
    except Exception as exc:  # noqa: BLE001
        spool.close()
        log.error("walspool is not linked: %s; the gateway runs as released", exc)
        return None
    setattr(runner, MARK, (link, spool))
    log.info("walspool linked the gateway's transcripts to the spool %s", path)
    return link


def unlink_runner(runner: Any) -> None:
    """After a linked runner stopped (its slots spooled): stop the link, close the spool."""
    linked = getattr(runner, MARK, None)
    if linked is None:
        return
    link, spool = linked
    if not link.close() or not link.wait_for_writes(0.0):
        # A queued message is still being written (the stop waited for it in vain), by
        # the link's thread or a gateway thread: what waits behind that write is spooled
        # once it ends, so the spools stay open until then, or until the interpreter's
        # exit has waited for it.
        atexit.register(_close_at_exit, link, spool)
        return
    _close(link, spool)


def _close_at_exit(link: Any, spool: Any) -> None:
    link.close(FLUSH_TIMEOUT)
    link.wait_for_writes(FLUSH_TIMEOUT)
    _close(link, spool)


def _close(link: Any, spool: Any) -> None:
    try:
        spool.close()
        link.spool.close()  # a fresh one the link opened at the path (``follow_path``)
    except Exception:  # noqa: BLE001 - the gateway is stopping all the same
        log.exception("walspool could not close the spool %s", spool.path)


def _spool_path() -> Any:

    return spool_path()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once ``name`` has been imported (found by the finders
    that follow this one), then leaves ``sys.meta_path``."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _then_after(spec.loader, self.then)
        return spec


def _then_after(loader: Any, then: Callable[[ModuleType], None]) -> Any:
    """A copy of ``loader`` (of its own class: the module's source, resources and
    package state stay its own) that runs ``then(module)`` after the module has run."""
    ours = copy.copy(loader)
    run = ours.exec_module

    def exec_module(module: ModuleType) -> None:
        run(module)
        try:
            then(module)
        except Exception:  # noqa: BLE001 - the gateway's import must succeed
            log.exception("walspool could not link the gateway; it runs as released")

    ours.exec_module = exec_module
    return ours
