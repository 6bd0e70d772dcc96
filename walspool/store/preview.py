"""What a replay would take, read from the spool in one read transaction of the
caller's: the streams with their rows (chosen or in flight), the rows an interrupted
replay left in flight with their tickets, and each session stream's first row. For
``replay --dry-run`` and the replay's progress; nothing here writes.

Nothing here holds more than one payload at a time: no payload is ever in a sort, and
each is read and decoded on its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import apsw

from ..errors import SpoolCorrupt
from . import codec, totals
from .paging import (
    LARGE_PAYLOAD,
    SMALL_PAYLOAD,
    as_selected,
    as_text,
    bound,
    payload_is_json,
    record_from_row,
    rows_not_json,
    undecodable,
)
from .records import Record
from .spool import RECORD_COLUMNS
from .tickets import REASON_FILTER, Scope

#: A replay takes the rows it chose and every row an interrupted replay left in flight.
# No payload in a GROUP BY: its sorter would hold every row's payload (2 GiB for 24
# rows of 60 MiB). Bad payloads are counted by their own query, for the dry run only.
_STREAM_WHERE = (
    f"(inflight IS NOT NULL OR ({REASON_FILTER}))"
    " AND (:session_id IS NULL OR session_id = CAST(:session_id AS TEXT))"
)
_STREAM_ROWS = f"""
FROM records
WHERE {_STREAM_WHERE}
"""
STREAMS_SQL = f"""
SELECT CAST(session_id AS BLOB), CAST(CASE WHEN session_id IS NULL THEN session_key END AS BLOB),
       count(*), sum(inflight IS NOT NULL)
{_STREAM_ROWS}
GROUP BY 1, 2 ORDER BY 1, 2
"""
#: A bad payload's id and stream (``paging.rows_not_json``: no scan holds large parses).
_BAD_PAYLOAD_ROWS = f"""
SELECT id, CAST(session_id AS BLOB),
       CAST(CASE WHEN session_id IS NULL THEN session_key END AS BLOB)
FROM records WHERE ({_STREAM_WHERE})"""
BAD_SMALL_SQL = f"{_BAD_PAYLOAD_ROWS} AND {SMALL_PAYLOAD} AND NOT json_valid(payload) ORDER BY id"
BAD_LARGE_SQL = f"{_BAD_PAYLOAD_ROWS} AND {LARGE_PAYLOAD} ORDER BY id"
# Rows in flight without their payloads (the sort holds ids, names and seqs only); each
# payload is then read and decoded on its own (``JSON_RECORD_SQL``) and let go.
INFLIGHT_ROWS_SQL = """
SELECT id, CAST(session_id AS BLOB), inflight FROM records
WHERE inflight IS NOT NULL AND session_id IS NOT NULL
  AND (:session_id IS NULL OR session_id = CAST(:session_id AS TEXT))
ORDER BY session_id, seq
"""
JSON_RECORD_SQL = f"SELECT {RECORD_COLUMNS} FROM records WHERE id = ? AND json_valid(payload)"
# A stream's rows in seq order, ids only: the first whose payload is JSON is its first
# row (each payload checked on its own, ``paging.payload_is_json``).
STREAM_IDS_SQL = f"""
SELECT id FROM records
WHERE session_id = CAST(:session_id AS TEXT) AND inflight IS NULL AND {REASON_FILTER}
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
    """The named parameters of ``REASON_FILTER`` and the session, as a replay's."""
    reasons_json = None if reasons is None else codec.encode(list(reasons)).decode()
    return Scope(reasons_json, statuses, session_id=session).params()


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
            invalid[as_text(session_id), as_text(key)] += 1
    out = []
    for session_id, key, rows, inflight in conn.execute(STREAMS_SQL, params):
        session_id, key = as_text(session_id), as_text(key)
        # a stream whose name is not UTF-8: a replay quarantines each of its rows
        wrong = rows if undecodable(session_id) or undecodable(key) else 0
        out.append(StreamCount(session_id, key, rows, inflight, wrong or invalid[session_id, key]))
    return out


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
    for row_id, name, ticket in conn.execute(INFLIGHT_ROWS_SQL, params):
        session_id = as_text(name)
        decodable = fetch_record(conn, row_id) is not None  # one row in memory at a time
        inflight.setdefault(session_id, []).append(InFlightRow(ticket, row_id, decodable))
    first = {}
    for stream in streams:
        if stream.session_id is not None:
            ids = conn.execute(STREAM_IDS_SQL, {**params, "session_id": bound(stream.session_id)})
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
    for row in conn.execute(JSON_RECORD_SQL, (row_id,)):
        return _decoded(as_selected(row))
    return None
