"""What a replay would do, for ``replay --dry-run``, from what it would take
(``walspool.store.preview``).

Each stream spooled by session id has its first row tried against state.db (see
``_trial``): the first row a replay would write, which is a row an interrupted
replay left in flight and state.db does not hold yet, else the stream's first row
of those chosen. Rows in flight that state.db already holds would be removed
without a write (``recovered``); payloads that are not JSON would be quarantined.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from ..errors import SessionMissing, WalspoolError
from ..replay.replayer import ReplayReport, StreamReport, report_of
from ..replay.sinks import LANDED_SQL, LANDED_TABLE, LANDED_TABLE_EXISTS_SQL, rejects_content
from ..shutdown_flush import routing_resolver
from ..store import codec
from ..store.preview import Plan
from ..store.records import Record
from ._statedb import has_session
from ._trial import Trial, trial_session_db


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
