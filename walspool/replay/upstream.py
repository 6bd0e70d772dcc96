"""Sinks and helpers for ``walspool.shutdown_flush`` on newer gateways (0.20+).

Two sinks, both driven by ``Replayer`` (one code path for mapping, quarantine and
exactly-once with the 0.19.0 link):

* ``DrainSink``: the live drain. The gateway hands ``drain_transcript_spool`` a
  callback that writes one message its own way. When the store behind that
  callback is known (the callback's ``self``: 0.22's store, through
  ``_db_for_session_id``, or 0.20's, through its one ``_db``; else the store
  ``recover_gateway_pending`` registered), the ticket of each row is recorded by the
  TEMP trigger of ``SessionDBSink`` on that store's ``SessionDB``: the callback's
  insert runs on the draining thread, inside the ``tracking`` block, so landings
  stay exact across a crash. The first write of each drain checks that its ticket
  was recorded; if it was not (the callback writes elsewhere), the drain goes on
  untracked. Untracked, a row is set aside (quarantined, saying its landing is
  unknown) in the spool before the callback runs and deleted once it returned, so
  a crash in between leaves it quarantined for an operator: never written twice.
* ``RoutingSink``: startup recovery. Rows spooled with a session id go to the
  default ``SessionDB``; rows spooled with only a routing key go to the store the
  gateway's resolver named for that key (a multiplexed gateway keeps one state.db
  per profile), each through its own ``SessionDBSink``.

Errors the newer gateway blames on the row (``sinks.is_row_rejection``) become
``RowRejected``, so ``Replayer`` quarantines the row and its session goes on.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .. import text
from ..store import tickets
from ..store.records import Record
from .replayer import UNKNOWN_LANDING
from .sinks import (
    SessionDBSink,
    Ticket,
    as_rejection,
    met_a_lock,
    transcript_message,
    write_bindable,
)

log = text.logger("walspool.upstream")

#: The gateway stores of this process: the one ``recover_gateway_pending`` saw, and
#: every store that has written (or tried to) through the drop-in
#: (``walspool.gateways.drop_in``): their drain callbacks are tracked, their queues
#: published and spooled at shutdown.
_stores: weakref.WeakSet[Any] = weakref.WeakSet()
#: One ticket-recording sink per ``SessionDB`` object, so its trigger is set up once.
_trackers: weakref.WeakKeyDictionary[Any, SessionDBSink] = weakref.WeakKeyDictionary()
_trackers_lock = threading.Lock()


def register_store(store: Any) -> None:
    """Remember ``store`` (a gateway ``SessionStore``; None is no store)."""
    if store is not None:
        _stores.add(store)


def stores() -> list[Any]:
    """The stores registered (``register_store``) and still alive."""
    return list(_stores)


def still_queued(session_id: str, message: Any) -> bool | None:
    """Whether ``message`` (that very object) is in ``session_id``'s in-memory queue
    of a store ``recover_gateway_pending`` registered; None when none was registered."""
    known = stores()
    if not known:
        return None
    for store in known:
        queues = getattr(store, "_dirty_transcripts", None)
        pending = queues.get(session_id) if isinstance(queues, dict) else None
        if pending and any(queued is message for queued in list(pending)):
            return True
    return False


def _is_store(candidate: Any) -> bool:
    """A gateway ``SessionStore``: 0.22's (``_db_for_session_id``) or 0.20's (one
    ``_db`` with ``append_message``)."""
    if callable(getattr(candidate, "_db_for_session_id", None)):
        return True
    db = getattr(candidate, "_db", None)
    return db is not None and callable(getattr(db, "append_message", None))


def db_of(store: Any, session_id: str) -> Any:
    """The ``SessionDB`` ``store`` writes ``session_id``'s transcript to, or None."""
    by_session = getattr(store, "_db_for_session_id", None)
    if callable(by_session):
        return by_session(session_id)
    return getattr(store, "_db", None)


def tracker(session_db: Any) -> SessionDBSink:
    """The ticket-recording sink of ``session_db`` (one per object)."""
    with _trackers_lock:
        sink = _trackers.get(session_db)
        if sink is None:
            sink = _trackers[session_db] = SessionDBSink(session_db)
        return sink


def session_sink(replay: Callable[..., Any], session_id: str) -> SessionDBSink | None:
    """The ticket-recording sink of the ``SessionDB`` that the drain callback's store
    writes ``session_id`` to; None when that store is not known (see ``store_of``)."""
    store = store_of(replay)
    db = None if store is None else db_of(store, session_id)
    return None if db is None else tracker(db)


class StoreWrite:
    """A drain callback of walspool's own (the plugin's drain before a live write):
    ``write(store, session_id, message)``, the store's write, with its store named, so
    the drain's landings are exact (``store_of``)."""

    __slots__ = ("store", "session_id", "write")

    def __init__(self, store: Any, session_id: str, write: Callable[..., Any]) -> None:
        self.store = store
        self.session_id = session_id
        self.write = write

    def __call__(self, message: Any) -> Any:
        return self.write(self.store, self.session_id, message)


def store_of(replay: Callable[..., Any]) -> Any:
    """The ``SessionStore`` behind a drain callback, or None.

    The gateway's callback is a closure over its store: ``self`` in 0.22's
    ``SessionTranscriptMixin._drain_spooled_drops`` and in 0.20's
    ``SessionStore._drain_spooled_drops`` (a lambda writing through
    ``self._append_transcript_message``), or a bound method of it; failing that,
    the one store ``recover_gateway_pending`` registered in this process. Only a
    callback defined in the gateway's own modules counts: anything else is not
    assumed to write through the store it closes over, but walspool's ``StoreWrite``.
    """
    if isinstance(replay, StoreWrite):
        return replay.store if _is_store(replay.store) else None
    if not str(getattr(replay, "__module__", "")).startswith("gateway."):
        return None
    owner = getattr(replay, "__self__", None)
    if owner is not None and _is_store(owner):
        return owner
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
            if _is_store(candidate):
                return candidate
    known = stores()
    return known[0] if len(known) == 1 else None


class DrainSink:
    """``drain_transcript_spool``'s sink: each message goes through the gateway's
    callback; landings are exact when the callback's store is known, and an untracked
    row is set aside while it is written (see module)."""

    def __init__(
        self, replay: Callable[[dict[str, Any]], Any], session_id: str, spool: Any
    ) -> None:
        self.replay = replay
        self.session_id = session_id
        self.spool = spool
        self._store = store_of(replay)
        self._checked = False
        #: Whether a statement on state.db met its lock held elsewhere (``met_a_lock``):
        #: what the drain held then waits for the lock, not for state.db to heal.
        self.met_a_lock = False

    def _tracker(self) -> SessionDBSink | None:
        if self._store is None:
            return None
        db = db_of(self._store, self.session_id)
        return None if db is None else tracker(db)

    @contextlib.contextmanager
    def _noting_locks(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if met_a_lock(exc):
                self.met_a_lock = True
            raise

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        with self._noting_locks():
            self._write(session_id, record, ticket)

    def _write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        track = self._tracker()
        # Outside the try: a state.db whose tickets cannot be set up holds the row, whatever
        # the error's type (never a rejection of the row).
        tracked = track is not None and track.set_up_tickets()
        if not tracked:
            self._set_aside(record)
        try:
            message = transcript_message(record)
            if track is not None and tracked:
                with track.tracking(ticket):
                    write_bindable(self._replay, session_id, message)
            else:
                write_bindable(self._replay, session_id, message)
        except Exception as exc:
            if not tracked:
                self._put_back(record)
            rejected = as_rejection(exc)
            if rejected is None:
                raise
            raise rejected from exc
        if track is not None and tracked and not self._checked:
            self._checked = True
            if ticket not in (track.landed([ticket]) or ()):
                # The callback wrote somewhere else: this drain's later rows are set
                # aside while they are written instead.
                log.warning(
                    "The drain callback for %s does not write through its store's "
                    "state.db connection; its rows are tracked in the spool instead",
                    self.session_id,
                )
                self._store = None

    def _replay(self, session_id: str, message: Any) -> None:
        """The gateway's callback as ``write_bindable`` calls a write (its session is
        this drain's)."""
        self.replay(message)

    def _set_aside(self, record: Record) -> None:
        tickets.set_aside(self.spool, record.id, UNKNOWN_LANDING, time.time())

    def _put_back(self, record: Record) -> None:
        try:
            tickets.put_back(self.spool, record.id)
        except Exception as exc:  # noqa: BLE001 - it stays set aside, for an operator
            log.warning(
                "Row %d of %s stays quarantined in %s (its write failed, and putting it "
                "back failed too: %s); replay it with --quarantined",
                record.id,
                self.session_id,
                self.spool.path,
                exc,
            )

    def landed(self, tickets: Sequence[Ticket]) -> set[Ticket] | None:
        track = self._tracker()
        with self._noting_locks():
            return None if track is None else track.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        track = self._tracker()
        if track is not None:
            with self._noting_locks():
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
