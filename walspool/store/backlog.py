"""A spool's streams as a listing (``ls``, ``watch``): one ``Line`` per stream, its
name and errors at most ``CHARS`` characters long whatever their length, read from
indexes only, in one read transaction of the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apsw
import msgspec

from .paging import as_text, with_text

#: At most this many characters of a stream's name (session id, or key) and of its
#: first and latest error are read per stream; a session id may be 64 MiB. SQLite sorts
#: names up to this long to group rows by stream; the rows of longer ones are found in
#: their unique index's order instead (``LONG_SQL``, no sort), since a sort of huge
#: names holds most of them at once. ``--json`` reads a longer name or error whole when
#: it writes that stream's object, by the id of a row holding it, one at a time.
CHARS = 4096
#: Rows whose stream's name is at most ``CHARS`` long: every query but ``LONG_SQL``.
_SHORT = "length(coalesce(session_id, session_key)) <= :chars"
#: The ``backlog`` view's columns from indexes only, never a row's page: rows, bytes and
#: times per stream from the statistics index (covering, so one walk of it and a sort);
#: set-aside counts from the status index; attempts, failing rows and each stream's
#: first and latest error from the index of rows with an error (a row's attempts grow
#: only with an error). The view reads every row instead. Times stay epoch seconds
#: until printed, by one rule (``iso``).
#: The rows of streams named longer than ``CHARS`` make one group (NULL, NULL), a name
#: no stream has: it says ``LONG_SQL`` has streams to read. The names are clipped in a
#: subquery that LIMIT keeps apart (SQLite does not merge a subquery with a LIMIT into
#: an aggregate): merged, the sort would carry every row's name whole again.
STREAMS_SQL = """
SELECT CAST(session_id AS BLOB), CAST(session_key AS BLOB), count(*), sum(size), min(created_at),
       max(created_at)
FROM (
    SELECT iif(length(session_id) > :chars, NULL, session_id) AS session_id,
           CASE WHEN session_id IS NULL AND length(session_key) <= :chars
                THEN session_key END AS session_key,
           size, created_at
    FROM records INDEXED BY records_reason_created_at_size_session_id_session_key_idx
    LIMIT -1
)
GROUP BY 1, 2
"""
SET_ASIDE_SQL = f"""
SELECT CAST(session_id AS BLOB), CAST(CASE WHEN session_id IS NULL THEN session_key END AS BLOB),
       status, count(*)
FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL AND {_SHORT} GROUP BY 1, 2, 3
"""
#: In-flight rows per stream, and of them the replayable ones (a page read per row in
#: flight: a replay's batch at most).
INFLIGHT_BY_STREAM_SQL = f"""
SELECT CAST(session_id AS BLOB), CAST(CASE WHEN session_id IS NULL THEN session_key END AS BLOB),
    count(*),
    count(*) FILTER (WHERE status IS NULL)
FROM records INDEXED BY records_inflight_idx WHERE inflight IS NOT NULL AND {_SHORT}
GROUP BY 1, 2
"""
#: A failed attempt's time: when it was made, or (never recorded) when the row came.
_ATTEMPT_AT = "coalesce(last_attempt_at, created_at)"
ERRORS_SQL = f"""
SELECT CAST(session_id AS BLOB), CAST(CASE WHEN session_id IS NULL THEN session_key END AS BLOB),
       seq, attempts, status, id, CAST(substr(last_error, 1, :chars) AS BLOB), length(last_error),
       {_ATTEMPT_AT}
FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL AND {_SHORT}
"""
#: A line's columns over one stream's rows; its first error as the least of its seq and
#: row id, zero-padded (two min() would each pick a row of their own for a bare column).
_LONG_COLUMNS = """min(id), count(*), sum(size), min(created_at), max(created_at),
    coalesce(max(attempts) FILTER (WHERE last_error IS NOT NULL), 0),
    min(format('%020d %d', seq, id)) FILTER (WHERE last_error IS NOT NULL),
    count(*) FILTER (WHERE status = 'quarantined'), count(*) FILTER (WHERE status = 'superseded'),
    count(inflight), count(*) FILTER (WHERE last_error IS NOT NULL AND status IS NULL),
    count(*) FILTER (WHERE status IS NULL AND inflight IS NULL),
    count(*) FILTER (WHERE last_error IS NOT NULL)"""
#: Streams named longer than ``CHARS``, by id and by key: walked in their unique
#: index's order, so a stream's rows come together and nothing is sorted.
LONG_SQL = (
    f"""SELECT CAST(substr(session_id, 1, :chars) AS BLOB), NULL, length(session_id),
    {_LONG_COLUMNS}
    FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL AND length(session_id) > :chars GROUP BY session_id""",
    f"""SELECT NULL, CAST(substr(session_key, 1, :chars) AS BLOB), length(session_key),
    {_LONG_COLUMNS}
    FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND length(session_key) > :chars GROUP BY session_key""",
)
#: The latest error of a stream named longer than ``CHARS``, by id and by key, the
#: stream named by one of its rows (its name read once): a sort its LIMIT bounds.
LATEST_SQL = (
    f"""SELECT id, CAST(substr(last_error, 1, :chars) AS BLOB), length(last_error)
    FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id = (SELECT session_id FROM records WHERE id = :id)
      AND last_error IS NOT NULL ORDER BY {_ATTEMPT_AT} DESC, id DESC LIMIT 1""",
    f"""SELECT id, CAST(substr(last_error, 1, :chars) AS BLOB), length(last_error)
    FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND session_key = (SELECT session_key FROM records WHERE id = :id)
      AND last_error IS NOT NULL ORDER BY {_ATTEMPT_AT} DESC, id DESC LIMIT 1""",
)
ERROR_AT_SQL = (
    "SELECT CAST(substr(last_error, 1, :chars) AS BLOB), length(last_error) FROM records "
    "WHERE id = :id"
)
#: A stream's name and an error whole, from a row that holds it.
NAME_SQL = "SELECT CAST(coalesce(session_id, session_key) AS BLOB) FROM records WHERE id = ?"
ERROR_SQL = "SELECT CAST(last_error AS BLOB) FROM records WHERE id = ?"


def held(failed: int, waiting: int) -> int:
    """A stream's RETRYING rows: with a replayable row whose write failed (``failed``),
    every replayable row not in flight (``waiting``) waits for the next replay, the
    rows behind it too (a stream moves in order); without one, none."""
    return waiting if failed else 0


class Line(msgspec.Struct, frozen=True):
    """One stream as ``ls`` and ``watch`` read it: its name, first error (the lowest
    seq's) and latest error (the most recent failed attempt's; a row never attempted
    dated by its arrival) at most ``CHARS`` characters long. ``name_chars``,
    ``error_chars`` and ``latest_chars`` are their whole lengths; a longer one is read
    whole from row ``name_row`` (one of the stream's, set only then), ``error_row`` or
    ``latest_row``. ``failing``: its rows with an error; ``retrying``: the rows a failed
    write holds (``held``). Times are epoch seconds."""

    session_id: str | None
    session_key: str | None
    rows: int
    bytes: int
    oldest: float
    newest: float
    max_attempts: int
    last_error: str | None
    quarantined: int
    superseded: int
    inflight: int
    retrying: int
    name_chars: int
    name_row: int | None = None
    error_chars: int = 0
    error_row: int | None = None
    failing: int = 0
    latest_error: str | None = None
    latest_chars: int = 0
    latest_row: int | None = None


def read_lines(conn: apsw.Connection) -> list[Line]:
    """Every stream's ``Line``, oldest first; on a tie, key streams first, as the view
    orders them. What it holds per stream is bounded by ``CHARS``, whatever the names."""
    params = {"chars": CHARS}
    streams: dict[tuple[str | None, str | None], list[Any]] = {}
    with conn:
        for session_id, key, rows, size, oldest, newest in _named(conn, STREAMS_SQL, params):
            # rows, bytes, oldest, newest, max attempts, first error (seq, row, text,
            # length), quarantined, superseded, in flight, replayable rows that failed,
            # failing, latest error (time, row, text, length), replayable in flight
            streams[session_id, key] = [
                rows, size, oldest, newest, 0, None, 0, 0, 0, 0, 0, None, 0,
            ]  # fmt: skip
        long_names = streams.pop((None, None), None) is not None
        for session_id, key, status, n in _named(conn, SET_ASIDE_SQL, params):
            streams[session_id, key][6 if status == "quarantined" else 7] += n
        for session_id, key, n, replayable in _named(conn, INFLIGHT_BY_STREAM_SQL, params):
            streams[session_id, key][8] = n
            streams[session_id, key][12] = replayable
        for session_id, key, seq, attempts, status, row, *error, at in _named(
            conn, ERRORS_SQL, params, 6
        ):
            s = streams[session_id, key]
            s[4] = max(s[4], attempts)
            if s[5] is None or seq < s[5][0]:
                s[5] = (seq, row, *error)
            s[9] += status is None
            s[10] += 1
            if s[11] is None or (at, row) > s[11][:2]:
                s[11] = (at, row, *error)
        lines = [
            Line(sid, key, rows, size, oldest, newest, attempts, first and first[2], quarantined,
                 superseded, inflight,
                 held(failed, rows - quarantined - superseded - replayable_inflight),
                 len(sid if sid is not None else key),
                 error_chars=first[3] if first else 0, error_row=first and first[1],
                 failing=failing, latest_error=latest and latest[2],
                 latest_chars=latest[3] if latest else 0, latest_row=latest and latest[1])
            for (sid, key), (rows, size, oldest, newest, attempts, first, quarantined, superseded,
                             inflight, failed, failing, latest, replayable_inflight)
            in streams.items()
        ]  # fmt: skip
        if long_names:
            # each walk done before a stream's errors are looked up: its memory then freed
            found = [row for sql in LONG_SQL for row in _named(conn, sql, params)]
            lines += [_long_line(conn, row) for row in found]
    lines.sort(
        key=lambda s: (s.oldest, s.session_id is not None, s.session_id or "",
                       s.session_key or "", s.name_chars, s.name_row or 0)
    )  # fmt: skip
    return lines


def _long_line(conn: apsw.Connection, row: tuple[Any, ...]) -> Line:
    sid, key, chars, first, rows, size, oldest, newest, attempts, error_at, *counts, failing = row
    quarantined, superseded, inflight, failed, waiting = counts
    retrying = held(failed, waiting)
    line = Line(
        sid, key, rows, size, oldest, newest, attempts, None, quarantined, superseded, inflight,
        retrying, chars, first,
    )  # fmt: skip
    if error_at is None:
        return line
    error_row = int(error_at.split()[1])
    params = {"chars": CHARS, "id": error_row}
    error, error_chars = next(_named(conn, ERROR_AT_SQL, params, 0, names=()))
    params["id"] = first
    latest_row, latest, latest_chars = next(
        _named(conn, LATEST_SQL[sid is None], params, 1, names=())
    )
    return msgspec.structs.replace(
        line, last_error=error, error_chars=error_chars, error_row=error_row, failing=failing,
        latest_error=latest, latest_chars=latest_chars, latest_row=latest_row,
    )  # fmt: skip


def whole_name(conn: apsw.Connection, row_id: int | None) -> str:
    """A stream's name whole, from row ``row_id`` of it (``Line.name_row``)."""
    return as_text(conn.execute(NAME_SQL, (row_id,)).get)


def whole_error(conn: apsw.Connection, row_id: int | None) -> str | None:
    """An error whole, from the row that holds it (``Line.error_row``, ``latest_row``)."""
    return as_text(conn.execute(ERROR_SQL, (row_id,)).get)


def _named(
    conn: apsw.Connection, sql: str, params: Any, *texts: int, names: tuple[int, ...] = (0, 1)
) -> Iterator[tuple[Any, ...]]:
    """The rows of ``sql``, whose columns ``names`` and ``texts`` are selected as their
    stored bytes, with those made text (``paging.as_text``): a name or an error that
    is not UTF-8 is one odd line, not a failed listing."""
    columns = (*names, *texts)
    for selected in conn.execute(sql, params):
        yield with_text(selected, columns)
