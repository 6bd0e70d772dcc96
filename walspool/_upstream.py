"""Sinks and helpers for ``walspool.shutdown_flush`` on newer gateways (0.20+).

Two sinks, both driven by ``Replayer`` (one code path for mapping, quarantine and
exactly-once with the 0.19.0 link):

* ``DrainSink``: the live drain. The gateway hands ``drain_transcript_spool`` a
  callback that writes one message its own way. When the store behind that
  callback is known (the callback's ``self``, or the store ``recover_gateway_pending``
  registered), the ticket of each row is recorded by the TEMP trigger of
  ``SessionDBSink`` on that store's ``SessionDB``: the callback's insert runs on the
  draining thread, inside the ``tracking`` block, so landings stay exact across a
  crash. Otherwise the callback's raise is trusted and a row a crash left in
  flight is quarantined (``landed`` answers None).
* ``RoutingSink``: startup recovery. Rows spooled with a session id go to the
  default ``SessionDB``; rows spooled with only a routing key go to the store the
  gateway's resolver named for that key (a multiplexed gateway keeps one state.db
  per profile), each through its own ``SessionDBSink``.

Errors the newer gateway blames on the row (``sinks.is_row_rejection``) become
``RowRejected``, so ``Replayer`` quarantines the row and its session goes on.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import text
from .records import Record
from .sinks import SessionDBSink, Ticket, as_rejection

log = text.logger("walspool.shutdown_flush")

#: Stores ``recover_gateway_pending`` saw: a drain callback of theirs is tracked.
_stores: weakref.WeakSet[Any] = weakref.WeakSet()
#: One ticket-recording sink per ``SessionDB`` object, so its trigger is set up once.
_trackers: weakref.WeakKeyDictionary[Any, SessionDBSink] = weakref.WeakKeyDictionary()
_trackers_lock = threading.Lock()


def register_store(store: Any) -> None:
    """Remember ``store`` (a gateway ``SessionStore``) for tracking its drains."""
    if callable(getattr(store, "_db_for_session_id", None)):
        _stores.add(store)


def tracker(session_db: Any) -> SessionDBSink:
    """The ticket-recording sink of ``session_db`` (one per object)."""
    with _trackers_lock:
        sink = _trackers.get(session_db)
        if sink is None:
            sink = _trackers[session_db] = SessionDBSink(session_db)
        return sink


def store_of(replay: Callable[..., Any]) -> Any:
    """The ``SessionStore`` behind a drain callback, or None.

    The gateway's callback is a closure over its store (``self`` in
    ``SessionTranscriptMixin._drain_spooled_drops``); failing that, for a callback
    defined in the gateway's own modules, the one store ``recover_gateway_pending``
    registered in this process.
    """
    code = getattr(replay, "__code__", None)
    cells = getattr(replay, "__closure__", None) or ()
    if code is not None:
        for name, cell in zip(code.co_freevars, cells, strict=False):
            if name != "self":
                continue
            try:
                candidate = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(getattr(candidate, "_db_for_session_id", None)):
                return candidate
    # Only the gateway's own callbacks write through its store; anything else is
    # trusted on its raise rather than assumed to record tickets.
    if not str(getattr(replay, "__module__", "")).startswith("gateway."):
        return None
    stores = list(_stores)
    return stores[0] if len(stores) == 1 else None


class DrainSink:
    """``drain_transcript_spool``'s sink: each message goes through the gateway's
    callback; landings are exact when the callback's store is known (see module)."""

    def __init__(self, replay: Callable[[dict[str, Any]], Any], session_id: str) -> None:
        self.replay = replay
        self.session_id = session_id
        self._store = store_of(replay)

    def _tracker(self) -> SessionDBSink | None:
        if self._store is None:
            return None
        db = self._store._db_for_session_id(self.session_id)
        return None if db is None else tracker(db)

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        track = self._tracker()
        # Outside the try: a state.db that cannot be prepared holds the row, whatever
        # the error's type (never a rejection of the row).
        tracked = track is not None and track.prepare()
        try:
            if track is not None and tracked:
                with track.tracking(ticket):
                    self.replay(record.message)
            else:
                self.replay(record.message)
        except Exception as exc:
            rejected = as_rejection(exc)
            if rejected is None:
                raise
            raise rejected from exc

    def landed(self, tickets: Sequence[Ticket]) -> set[Ticket] | None:
        track = self._tracker()
        return None if track is None else track.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        track = self._tracker()
        if track is not None:
            track.forget(spool, below, keep)

    def __repr__(self) -> str:
        return f"DrainSink({self.session_id!r}, tracked={self._store is not None})"


class RoutingSink:
    """Startup recovery's sink: the default ``SessionDB``, or the resolver's per key."""

    def __init__(self, default_db: Any, key_dbs: dict[str, Any]) -> None:
        self.default = tracker(default_db)
        self.by_key = {key: tracker(db) for key, db in key_dbs.items()}

    def _sinks(self) -> list[SessionDBSink]:
        unique: dict[int, SessionDBSink] = {id(self.default): self.default}
        for sink in self.by_key.values():
            unique.setdefault(id(sink), sink)
        return list(unique.values())

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        sink = self.default
        if record.session_id is None and record.session_key is not None:
            sink = self.by_key.get(record.session_key, self.default)
        sink.write(session_id, record, ticket)

    def landed(self, tickets: Sequence[Ticket]) -> set[Ticket] | None:
        found: set[Ticket] = set()
        for sink in self._sinks():
            answer = sink.landed(tickets)
            if answer is None:
                return None  # one target cannot tell: nobody can
            found |= answer
        return found

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        for sink in self._sinks():
            sink.forget(spool, below, keep)

    def __repr__(self) -> str:
        return f"RoutingSink({self.default.session_db!r}, {len(self.by_key)} routed keys)"


def resolve_key(
    resolver: Callable[..., Any], session_key: str, not_after: float | None
) -> tuple[str, Any] | None:
    """Ask the gateway's resolver for ``(session_id, db)``; None keeps the rows.

    Called as the newer gateway does, ``resolver(key, not_after=ts)``; a resolver
    without ``not_after`` gets the key alone. A ``(session_id, None)`` answer keeps
    the rows (upstream: "preserve", never the ambient store); a bare session id
    (older resolvers) routes to the default ``SessionDB`` (db None here).
    """
    try:
        if _takes_not_after(resolver):
            found = resolver(session_key, not_after=not_after)
        else:
            found = resolver(session_key)
    except Exception as exc:  # noqa: BLE001 - unresolved: the rows stay, as upstream
        log.debug("Session key->id resolution failed for %s: %s", session_key, exc)
        return None
    if isinstance(found, tuple) and len(found) == 2:
        session_id, db = found
        if isinstance(session_id, str) and session_id and db is not None:
            return session_id, db
        return None
    if isinstance(found, str) and found:
        return found, None
    return None


def _takes_not_after(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "not_after" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
