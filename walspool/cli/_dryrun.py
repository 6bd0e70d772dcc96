"""What a replay would take and what it would do, for ``replay --dry-run``."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import apsw

from .. import codec
from ..records import AGENT_HISTORY
from ..replay import REASON_FILTER, ReplayReport, StreamReport
from ..sinks import SessionMissing
from ._statedb import session_exists

STREAMS_SQL = f"""
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*) FROM records
WHERE {REASON_FILTER} AND (:session IS NULL OR session_id = :session)
GROUP BY 1, 2 ORDER BY 1, 2
"""


def replay_streams(
    conn: apsw.Connection, session: str | None, reasons: Sequence[str] | None, statuses: str
) -> list[tuple[str | None, str | None, int]]:
    """``(session_id, session_key, rows)`` of each stream a replay would take."""
    reasons_json = None if reasons is None else codec.encode(list(reasons)).decode()
    params = {
        "reasons": reasons_json,
        "agent_history": AGENT_HISTORY,
        "session": session,
        "statuses": statuses,
    }
    return conn.execute(STREAMS_SQL, params).fetchall()


def dry_run_report(
    streams: list[tuple[str | None, str | None, int]],
    state: sqlite3.Connection,
    create_missing: bool,
) -> ReplayReport:
    """What a replay would do, judged by which sessions exist in state.db."""
    sessions: dict[str, StreamReport] = {}
    ids = {session_id for session_id, _, _ in streams if session_id is not None}
    for session_id, session_key, rows in streams:
        if session_id is None:
            error: str | None = (
                f"rows spooled with session_key {session_key!r} but no session_id need a "
                "resolver to find their session; the gateway's link replays them"
            )
        elif create_missing or session_exists(state, session_id):
            error = None
        else:
            error = str(SessionMissing(session_id))
        moved, held = (0, rows) if error else (rows, 0)
        # A key stream named like a session id stays apart from it (``key:`` prefix).
        name = session_id if session_id is not None else str(session_key)
        if session_id is None and name in ids:
            name = f"key:{name}"
        sessions[name] = StreamReport(session_id, session_key, moved, held, error)
    return ReplayReport(
        moved=sum(s.moved for s in sessions.values()),
        held=sum(s.held for s in sessions.values()),
        errors={n: s.error for n, s in sessions.items() if s.error is not None},
        sessions=sessions,
    )
