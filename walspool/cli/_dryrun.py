"""What a replay would do, for ``replay --dry-run``, from what it would take
(``walspool.store.preview``). Not public API.

Each stream spooled by session id has its first row tried against state.db: the
first row a replay would write, which is a row an interrupted replay left in flight
and state.db does not hold yet, else the stream's first row of those chosen. Rows in
flight that state.db already holds would be removed without a write (``recovered``);
payloads that are not JSON would be quarantined.

The trial takes the real replay's path: walspool's ``SessionDBSink`` (the installed
gateway's mapping, its missing-session, ``--create-missing`` and content rules, its
ticket trigger) calls hermes' own ``SessionDB.append_message``, whose SQL runs on the
dry run's connection. So a trigger, a lock, a read-only file or a value state.db
refuses fails the trial as it would fail the replay. Nothing commits: hermes' write
helper (``_execute_write``) is replaced by a savepoint inside one transaction per
trial, and that transaction is rolled back.

Not guaranteed: that the replay meets the same state.db (the gateway may write in
between), nor rows after the first of a stream (a later row may still be refused).
The ``SessionDB`` is built without hermes' ``__init__`` (which migrates the schema
and sets the journal mode, both writes), with the attributes 0.19.0's ``__init__``
sets that its write path reads.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import SessionMissing, WalspoolError
from ..replay.replayer import ReplayReport, StreamReport, report_of
from ..replay.sinks import (
    LANDED_SQL,
    LANDED_TABLE,
    LANDED_TABLE_EXISTS_SQL,
    SessionDBSink,
    met_a_lock,
    rejects_content,
)
from ..shutdown_flush import routing_resolver
from ..store import codec
from ..store.preview import Plan
from ..store.records import Record
from ._statedb import has_session


def landed(state: sqlite3.Connection, uid: str, tickets: list[int]) -> set[tuple[int, int]]:
    """``(ticket, record id)`` of the given tickets that state.db holds (landed)."""
    if not tickets or not state.execute(LANDED_TABLE_EXISTS_SQL, (LANDED_TABLE,)).fetchone():
        return set()
    return set(state.execute(LANDED_SQL, (uid, codec.encode(tickets).decode())).fetchall())


def dry_run_report(
    plan: Plan,
    state: sqlite3.Connection,
    path: Path,
    create_missing: bool,
    fetch: Callable[[int], Record | None],
) -> ReplayReport:
    """What a replay would do: each session stream's first row tried and rolled back.

    ``fetch(id)``: a row's record from the spool (``fetch_record``), for the one row in
    flight of a stream that is tried."""
    ticket_of = {f.id: f.ticket for fs in plan.inflight.values() for f in fs if f.decodable}
    done = landed(state, plan.uid, list(ticket_of.values()))
    db = trial_session_db(state, path)
    trial = Trial(state, db, create_missing) if db is not None else None
    resolve = routing_resolver(db, path.parent)
    sessions: dict[str, StreamReport] = {}
    keys: dict[str, StreamReport] = {}
    recovered_in_all = 0
    # Session streams first: a key's rows are judged by the session it is routed to.
    for s in sorted(plan.streams, key=lambda s: s.session_id is None):
        recovered, rejected, error = 0, 0, None
        if s.session_id is None:
            routed = resolve(str(s.session_key))
            if routed is None:
                error = f"resolver found no session for session_key {s.session_key!r}"
            elif routed in sessions:
                error = sessions[routed].error
            elif not create_missing and not has_session(state, routed):
                error = str(SessionMissing(routed))
        else:
            out = [f.id for f in plan.inflight.get(s.session_id, []) if f.decodable]
            written = [i for i in out if (ticket_of[i], i) not in done]
            recovered = len(out) - len(written)
            # A replay writes the rows it left in flight before anything later.
            first = fetch(written[0]) if written else None
            first = first or plan.first.get(s.session_id)
            if first is not None:
                error, rejected = _try(trial, state, s.session_id, first, create_missing)
        recovered_in_all += recovered
        if error is not None:
            moved, held, quarantined = 0, s.rows - recovered, 0
        else:
            quarantined = s.bad + rejected
            moved, held = s.rows - recovered - quarantined, 0
        report = StreamReport(s.session_id, s.session_key, moved, held, error, quarantined)
        if s.session_id is not None:
            sessions[s.session_id] = report
        else:
            keys[str(s.session_key)] = report
    return report_of(sessions, keys, recovered_in_all)


def _try(
    trial: Trial | None, state: sqlite3.Connection, session_id: str, record: Record, create: bool
) -> tuple[str | None, int]:
    """Why ``record`` would hold its stream (None: it would move), and 1 when it would
    be quarantined for its content instead (its stream goes on).

    Without hermes (no trial) the judgement is whether the session exists."""
    if trial is None:
        missing = not create and not has_session(state, session_id)
        return (str(SessionMissing(session_id)) if missing else None), 0
    exc = trial(session_id, record)
    if exc is None:
        return None, 0
    if rejects_content(exc):
        return None, 1
    return (str(exc) if isinstance(exc, WalspoolError) else f"{type(exc).__name__}: {exc}"), 0


T = TypeVar("T")
#: The ticket a trial write records; rolled back with it.
TRIAL_TICKET_SPOOL = "walspool-dry-run"
SAVEPOINT_SQL = "SAVEPOINT walspool_trial_write"
ROLLBACK_TO_SQL = "ROLLBACK TO walspool_trial_write"
RELEASE_SQL = "RELEASE walspool_trial_write"


class TrialError(Exception):
    """A trial write was asked for outside its transaction: refused, so nothing commits."""


def trial_session_db(conn: sqlite3.Connection, path: Path) -> Any | None:
    """A hermes ``SessionDB`` writing on ``conn`` in savepoints; None without hermes."""
    try:
        import hermes_state
    except ImportError:
        return None

    class TrialSessionDB(hermes_state.SessionDB):  # type: ignore[misc, name-defined]
        """``SessionDB`` whose writes are savepoints in the trial's transaction."""

        def __init__(self) -> None:  # hermes' own would write (schema, journal mode)
            self.db_path = path
            self.read_only = False
            self._lock = threading.Lock()
            self._write_count = 0
            self._fts_runtime_rebuild_attempted = True  # a trial repairs nothing
            self._fts_enabled = False
            self._trigram_available = False
            self._fts_unavailable_warned = True
            self._conn = conn

        def _execute_write(self, fn: Callable[[sqlite3.Connection], T], *_: Any, **__: Any) -> T:
            # Newer gateways pass more (0.20 and 0.22: ``patience_s``, how long to
            # retry a lock): a trial waits as set on its connection, whatever they ask.
            with self._lock:
                if not self._conn.in_transaction:
                    # A savepoint outside a transaction would commit on release.
                    raise TrialError("a trial write outside the trial's transaction")
                self._conn.execute(SAVEPOINT_SQL)
                try:
                    result = fn(self._conn)
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute(ROLLBACK_TO_SQL)
                        self._conn.execute(RELEASE_SQL)
                    raise
                self._conn.execute(RELEASE_SQL)
                return result

        def __repr__(self) -> str:
            return f"<SessionDB {path} (dry run)>"

    return TrialSessionDB()


class Trial:
    """Writes one row at a time into state.db through the replay's sink, rolled back."""

    def __init__(self, conn: sqlite3.Connection, db: Any, create_missing: bool) -> None:
        self.conn = conn
        self.db = db
        self.create_missing = create_missing
        # As hermes opens state.db: a message of a missing session is refused.
        conn.execute("PRAGMA foreign_keys = ON")

    def __call__(self, session_id: str, record: Record) -> Exception | None:
        """Write ``record`` to ``session_id`` and roll it back; what it raised, or None.

        A fresh sink each time: its ticket table and trigger are set up again in the
        trial's own transaction, as a first replay into this state.db would.
        """
        sink = SessionDBSink(self.db, create_missing=self.create_missing)
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._lock_met(exc)
            return exc
        # Rows as hermes reads them on its own connection (0.20 indexes them by name).
        self.conn.row_factory = sqlite3.Row
        try:
            sink.write(session_id, record, (TRIAL_TICKET_SPOOL, 0, record.id))
        except Exception as exc:  # noqa: BLE001 - the trial's answer
            self._lock_met(exc)
            return exc
        finally:
            self.conn.row_factory = None
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
        return None

    def _lock_met(self, exc: BaseException) -> None:
        """After one wait for a lock, later trials do not wait again: each would meet
        the same gateway, and a dry run of many sessions would take minutes."""
        if met_a_lock(exc):
            self.conn.execute("PRAGMA busy_timeout = 0")
