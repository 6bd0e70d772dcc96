"""What a replay would take and what it would do, for ``replay --dry-run``.

Each stream spooled by session id has its first row tried against state.db (see
``_trial``): the first row a replay would write, which is a row an interrupted
replay left in flight and state.db does not hold yet, else the stream's first row
of those chosen. Rows in flight that state.db already holds would be removed
without a write (``recovered``); payloads that are not JSON would be quarantined.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import apsw

from ..errors import SessionMissing, SpoolCorrupt, WalspoolError
from ..replay.replayer import ReplayReport, StreamReport, report_of
from ..replay.sinks import LANDED_SQL, LANDED_TABLE, LANDED_TABLE_EXISTS_SQL, rejects_content
from ..shutdown_flush import routing_resolver
from ..store import codec, totals
from ..store.paging import (
    LARGE_PAYLOAD,
    SMALL_PAYLOAD,
    payload_is_json,
    record_from_row,
    rows_not_json,
)
from ..store.records import AGENT_HISTORY, Record
from ..store.spool import RECORD_COLUMNS
from ..store.tickets import REASON_FILTER
from ._statedb import session_exists
from ._trial import Trial, trial_session_db

#: A replay takes the rows it chose and every row an interrupted replay left in flight.
# No payload in a GROUP BY: its sorter would hold every row's payload (2 GiB for 24
# rows of 60 MiB). Bad payloads are counted by their own query, for the dry run only.
_STREAM_WHERE = (
    f"(inflight IS NOT NULL OR ({REASON_FILTER})) AND (:session IS NULL OR session_id = :session)"
)
_STREAM_ROWS = f"""
FROM records
WHERE {_STREAM_WHERE}
"""
STREAMS_SQL = f"""
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*),
       sum(inflight IS NOT NULL)
{_STREAM_ROWS}
GROUP BY 1, 2 ORDER BY 1, 2
"""
#: A bad payload's id and stream (``paging.rows_not_json``: no scan holds large parses).
_BAD_PAYLOAD_ROWS = f"""
SELECT id, session_id, CASE WHEN session_id IS NULL THEN session_key END
FROM records WHERE ({_STREAM_WHERE})"""
BAD_SMALL_SQL = f"{_BAD_PAYLOAD_ROWS} AND {SMALL_PAYLOAD} AND NOT json_valid(payload) ORDER BY id"
BAD_LARGE_SQL = f"{_BAD_PAYLOAD_ROWS} AND {LARGE_PAYLOAD} ORDER BY id"
# Rows in flight without their payloads (the sort holds ids, names and seqs only); each
# payload is then read and decoded on its own (``ROW_SQL``) and let go.
INFLIGHT_ROWS_SQL = """
SELECT id, session_id, inflight FROM records
WHERE inflight IS NOT NULL AND session_id IS NOT NULL
  AND (:session IS NULL OR session_id = :session)
ORDER BY session_id, seq
"""
ROW_SQL = f"SELECT {RECORD_COLUMNS} FROM records WHERE id = ? AND json_valid(payload)"
# A stream's rows in seq order, ids only: the first whose payload is JSON is its first
# row (each payload checked on its own, ``paging.payload_is_json``).
STREAM_IDS_SQL = f"""
SELECT id FROM records
WHERE session_id = :session_id AND inflight IS NULL AND {REASON_FILTER}
ORDER BY seq
"""


class StreamCount(NamedTuple):
    """One stream a replay would take: its rows, those in flight, bad payloads."""

    session_id: str | None
    session_key: str | None
    rows: int
    inflight: int
    bad: int


class InFlightRow(NamedTuple):
    """A row a replay has out: its ticket, its id, whether its payload decodes."""

    ticket: int
    id: int
    decodable: bool  # False: its payload is not JSON, or too costly to decode


class Plan(NamedTuple):
    """What the spool holds for a dry run: streams, rows in flight, first rows."""

    uid: str
    streams: list[StreamCount]
    inflight: dict[str, list[InFlightRow]]
    first: dict[str, Record]


def _params(session: str | None, reasons: Sequence[str] | None, statuses: str) -> dict:
    reasons_json = None if reasons is None else codec.encode(list(reasons)).decode()
    return {
        "reasons": reasons_json,
        "agent_history": AGENT_HISTORY,
        "session": session,
        "statuses": statuses,
    }


def replay_streams(
    conn: apsw.Connection,
    session: str | None,
    reasons: Sequence[str] | None,
    statuses: str,
    *,
    bad: bool = False,
) -> list[StreamCount]:
    """Each stream a replay would take, with its rows (chosen or in flight), and with
    ``bad`` how many of them are not JSON (0 without)."""
    params = _params(session, reasons, statuses)
    invalid: Counter[tuple[str | None, str | None]] = Counter()
    if bad:
        for _, session_id, key in rows_not_json(conn, BAD_SMALL_SQL, BAD_LARGE_SQL, params):
            invalid[session_id, key] += 1
    rows = conn.execute(STREAMS_SQL, params).fetchall()
    return [StreamCount(*row, invalid.get((row[0], row[1]), 0)) for row in rows]


def _decoded(row: tuple[Any, ...]) -> Record | None:
    """The row's record, or None when its payload is too costly to decode (a replay
    quarantines it) or not JSON."""
    try:
        return record_from_row(row)
    except SpoolCorrupt:
        return None


def plan(
    conn: apsw.Connection, session: str | None, reasons: Sequence[str] | None, statuses: str
) -> Plan:
    """Read what a dry run needs from the spool, in one read transaction."""
    params = _params(session, reasons, statuses)
    streams = replay_streams(conn, session, reasons, statuses, bad=True)
    inflight: dict[str, list[InFlightRow]] = {}
    for row_id, session_id, ticket in conn.execute(INFLIGHT_ROWS_SQL, params):
        decodable = fetch_record(conn, row_id) is not None  # one row in memory at a time
        inflight.setdefault(session_id, []).append(InFlightRow(ticket, row_id, decodable))
    first = {}
    for stream in streams:
        if stream.session_id is not None:
            ids = conn.execute(STREAM_IDS_SQL, {**params, "session_id": stream.session_id})
            for (row_id,) in ids:
                if payload_is_json(conn, row_id):
                    record = fetch_record(conn, row_id)
                    if record is not None:
                        first[stream.session_id] = record
                    break
    return Plan(totals.uid(conn), streams, inflight, first)


def fetch_record(conn: apsw.Connection, row_id: int) -> Record | None:
    """Row ``row_id``'s record, or None when it is gone or its payload is not JSON or
    too costly to decode."""
    for row in conn.execute(ROW_SQL, (row_id,)):
        return _decoded(row)
    return None


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
            elif not create_missing and not session_exists(state, routed):
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
        missing = not create and not session_exists(state, session_id)
        return (str(SessionMissing(session_id)) if missing else None), 0
    exc = trial(session_id, record)
    if exc is None:
        return None, 0
    if rejects_content(exc):
        return None, 1
    return (str(exc) if isinstance(exc, WalspoolError) else f"{type(exc).__name__}: {exc}"), 0
