"""A spool's totals, each read in a read transaction of the caller's (so several are
from one moment): rows, sessions, bytes and ages by reason, failing rows, rows in
flight and set aside, rows ever appended, drained and quarantined, the latest errors,
the spool's uid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apsw

from .paging import with_text
from .records import Stats

_BY_REASON_SQL = """
SELECT CAST(reason AS BLOB), count(*), sum(size), min(created_at), max(created_at)
FROM records GROUP BY reason
"""
_SESSIONS_SQL = """
SELECT (SELECT count(DISTINCT session_id) FROM records)
     + (SELECT count(DISTINCT session_key) FROM records WHERE session_id IS NULL)
"""
#: Totals kept in ``spool_meta``, each added to in the transaction that moves its rows:
#: rows a replay or a gateway's drain removed as in state.db (``drained``), and rows
#: quarantined for what state.db or the spool's checks refused in them
#: (``quarantined``; a row requeued and refused again counts again). They only grow:
#: counters, for a rate of drain or of refusals across restarts.
DRAINED = "drained"
QUARANTINED_COUNTER = "quarantined"
#: Messages gateway processes held in memory when they ended without a clean stop,
#: counted when the next start of a gateway on their host takes their entry in
#: (``walspool.store.memory.take_lost``).
MEMORY_LOST = "memory_lost"
#: Every total, in the order ``counters`` gives them.
COUNTERS = (DRAINED, QUARANTINED_COUNTER, MEMORY_LOST)
_ADD_SQL = """
INSERT INTO spool_meta (name, value) VALUES (?, ?)
ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
"""
_COUNTERS_SQL = "SELECT name, value FROM spool_meta WHERE name IN (?, ?, ?)"
_FAILING_SQL = "SELECT count(*) FROM records WHERE last_error IS NOT NULL"
_UID_SQL = "SELECT value FROM spool_meta WHERE name = 'uid'"
_IN_FLIGHT_SQL = "SELECT count(*) FROM records WHERE inflight IS NOT NULL"
_IN_FLIGHT_TICKETS_SQL = "SELECT id, inflight FROM records WHERE inflight IS NOT NULL"
_STATUS_SQL = """
SELECT status, count(*), coalesce(sum(size), 0) FROM records INDEXED BY records_status_idx
WHERE status IS NOT NULL GROUP BY status
"""
#: Streams with a row whose last write failed (read from the index of those rows).
_FAILING_STREAMS_SQL = """
SELECT count(*) FROM (
    SELECT DISTINCT session_id, CASE WHEN session_id IS NULL THEN session_key END
    FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL
)
"""
#: Rows ever appended: an append takes its stream's next seq (1, 2, 3, ...), so a
#: stream has had as many rows as the highest seq it handed out: the larger of its
#: highest seq still in ``records`` and the next seq ``sequences`` keeps for it, less
#: one (kept at least once its rows leave, so the sum never goes back). Nothing is
#: sorted (a sort of names would hold most of them whole, and a name may be 64 MiB): a
#: stream's rows are walked in their unique index's order and its ``sequences`` entry
#: found by its key; then the entries of streams with no rows left.
_APPENDED_SQL = """
SELECT coalesce(sum(last), 0) FROM (
    SELECT max(max(seq), coalesce((SELECT next_seq FROM sequences
                                   WHERE stream = 'session_id' AND name = r.session_id), 1) - 1)
        AS last
    FROM records AS r INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL GROUP BY session_id
    UNION ALL
    SELECT max(max(seq), coalesce((SELECT next_seq FROM sequences
                                   WHERE stream = 'session_key' AND name = r.session_key), 1) - 1)
    FROM records AS r INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL GROUP BY session_key
    UNION ALL
    SELECT next_seq - 1 FROM sequences AS s WHERE stream = 'session_id' AND NOT EXISTS (
        SELECT 1 FROM records INDEXED BY sqlite_autoindex_records_1 WHERE session_id = s.name)
    UNION ALL
    SELECT next_seq - 1 FROM sequences AS s WHERE stream = 'session_key' AND NOT EXISTS (
        SELECT 1 FROM records INDEXED BY records_session_key_seq_idx
        WHERE session_id IS NULL AND session_key = s.name)
)
"""
#: The latest failed attempts, from the index of rows with an error (a sort bounded by
#: the LIMIT), each name and error clipped in SQL; ``stats`` keeps each session's first.
_RECENT_ERRORS_SQL = """
SELECT CAST(substr(session_id, 1, :chars) AS BLOB),
       CAST(CASE WHEN session_id IS NULL THEN substr(session_key, 1, :chars) END AS BLOB),
       length(coalesce(session_id, session_key)) > :chars,
       CAST(substr(last_error, 1, :chars) AS BLOB), coalesce(last_attempt_at, created_at)
FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL
ORDER BY 5 DESC, id DESC LIMIT :limit
"""


def stats(conn: apsw.Connection, path: Path) -> Stats:
    """Rows, sessions (a count of distinct names), bytes, ages, by reason, failing rows;
    the file sizes of ``path`` and its ``-wal``."""
    with conn:
        by_reason = [with_text(r, (0,)) for r in conn.execute(_BY_REASON_SQL)]
        count = conn.execute(_SESSIONS_SQL).get
        failing = conn.execute(_FAILING_SQL).get
    return Stats(
        rows=sum(r[1] for r in by_reason),
        sessions=count,
        bytes=sum(r[2] or 0 for r in by_reason),
        oldest=min((r[3] for r in by_reason), default=None),
        newest=max((r[4] for r in by_reason), default=None),
        by_reason={r[0]: r[1] for r in by_reason},
        failing=failing,
        db_bytes=_size(path),
        wal_bytes=_size(Path(f"{path}-wal")),
        bytes_by_reason={r[0]: r[2] or 0 for r in by_reason},
    )


def uid(conn: apsw.Connection) -> str:
    """The spool's random uid (half of every ticket)."""
    return str(conn.execute(_UID_SQL).get)


def in_flight_rows(conn: apsw.Connection) -> int:
    """Rows a replay has out (marked in flight, not settled)."""
    return int(conn.execute(_IN_FLIGHT_SQL).get)


def in_flight_tickets(conn: apsw.Connection) -> list[tuple[int, int]]:
    """``(id, ticket)`` of every row a replay has out."""
    return [(row_id, ticket) for row_id, ticket in conn.execute(_IN_FLIGHT_TICKETS_SQL)]


def by_status(conn: apsw.Connection) -> dict[str, int]:
    """Rows set aside, by status (quarantined, superseded)."""
    return {status: rows for status, (rows, _) in set_aside_counts(conn).items()}


def set_aside_counts(conn: apsw.Connection) -> dict[str, tuple[int, int]]:
    """Rows set aside and their payload bytes, by status (quarantined, superseded)."""
    return {status: (rows, size) for status, rows, size in conn.execute(_STATUS_SQL)}


def failing_streams(conn: apsw.Connection) -> int:
    """Sessions (streams: by id, or by key only) with a row whose last write failed."""
    return int(conn.execute(_FAILING_STREAMS_SQL).get)


def add(conn: apsw.Connection, name: str, rows: int) -> None:
    """Add ``rows`` to the total ``name`` (one of ``COUNTERS``), in the caller's
    transaction."""
    if rows:
        conn.execute(_ADD_SQL, (name, rows))


def counters(conn: apsw.Connection) -> dict[str, int]:
    """The totals ``COUNTERS`` (0 until something counts)."""
    found = dict(conn.execute(_COUNTERS_SQL, COUNTERS).fetchall())
    return {name: int(found.get(name, 0)) for name in COUNTERS}


def appended(conn: apsw.Connection) -> int:
    """Rows ever appended (see ``_APPENDED_SQL``)."""
    return int(conn.execute(_APPENDED_SQL).get)


def recent_errors(conn: apsw.Connection, chars: int, limit: int) -> list[tuple[Any, ...]]:
    """The latest failed attempts, newest first: ``(session_id, session_key, clipped,
    error, at)``, names and error clipped to ``chars`` (``clipped``: the name was)."""
    rows = conn.execute(_RECENT_ERRORS_SQL, {"chars": chars, "limit": limit})
    return [with_text(row, (0, 1, 3)) for row in rows]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
