"""A spool's streams as a listing (``ls``, ``watch``): one ``Line`` per stream, its
name and errors at most ``CHARS`` characters long whatever their length, read from
indexes only, in one read transaction, a line at a time (``iter_lines``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import apsw
import msgspec

from .paging import as_text, with_text

#: At most this many characters of a stream's name (session id, or key) and of its
#: first and latest error are read per stream; a session id may be 64 MiB. SQLite sorts
#: names up to this long to group rows by stream; the rows of longer ones are grouped
#: in their unique index's order instead (``LONG_SQL``, no sort of whole names), since a
#: sort of huge names holds most of them at once. ``--json`` reads a longer name or error whole when
#: it writes that stream's object, by the id of a row holding it, one at a time.
CHARS = 4096
#: Rows whose stream's name is at most ``CHARS`` long: every query but ``LONG_SQL``.
_SHORT = "length(coalesce(session_id, session_key)) <= :chars"
#: A failed attempt's time: when it was made, or (never recorded) when the row came.
_ATTEMPT_AT = "coalesce(last_attempt_at, created_at)"
#: Every stream's line but its errors' texts, oldest first, in one statement over
#: indexes only, never a row's page: a row per stream (or one per failing row, where a
#: failing row's attempt is dated) from a union of the statistics index (rows, bytes,
#: times; covering), the status index (set-aside counts), the in-flight index and the
#: index of rows with an error (attempts, failing rows, each stream's first error: its
#: lowest seq, and latest: its most recent failed attempt, a row never attempted dated
#: by its arrival; by row id, read after), grouped by stream. SQLite sorts the union
#: and the groups in its temporary files, not in memory: what a listing holds is a
#: line at a time, however many streams there are (``iter_lines``). Times stay epoch
#: seconds until printed, by one rule (``iso``).
#: A name is at most ``CHARS`` long here; rows of streams named longer make one group
#: (NULL, NULL), a name no stream has, ordered by the oldest of them: from it on
#: ``LONG_SQL`` has streams to read. The names are clipped in subqueries that LIMIT
#: keeps apart (SQLite does not merge a subquery with a LIMIT into an aggregate):
#: merged, the sort would carry every row's name whole again. The view reads every
#: row instead.
LINES_SQL = f"""
SELECT CAST(session_id AS BLOB), CAST(session_key AS BLOB), sum(n), sum(size), min(created_at),
       max(created_at), max(attempts), sum(quarantined), sum(superseded), sum(inflight),
       sum(failed), sum(failing), sum(replayable_inflight), max(first_id), max(latest_id)
FROM (
    SELECT iif(length(session_id) > :chars, NULL, session_id) AS session_id,
           CASE WHEN session_id IS NULL AND length(session_key) <= :chars
                THEN session_key END AS session_key,
           1 AS n, size, created_at, 0 AS attempts, 0 AS quarantined, 0 AS superseded,
           0 AS inflight, 0 AS failed, 0 AS failing, 0 AS replayable_inflight,
           NULL AS first_id, NULL AS latest_id
    FROM records INDEXED BY records_reason_created_at_size_session_id_session_key_idx
    UNION ALL
    SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END,
           0, 0, NULL, 0, status = 'quarantined', status = 'superseded', 0, 0, 0, 0, NULL, NULL
    FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL AND {_SHORT}
    UNION ALL
    SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END,
           0, 0, NULL, 0, 0, 0, 1, 0, 0, status IS NULL, NULL, NULL
    FROM records INDEXED BY records_inflight_idx WHERE inflight IS NOT NULL AND {_SHORT}
    UNION ALL
    SELECT session_id, session_key, 0, 0, NULL, attempts, 0, 0, 0, status IS NULL, 1, 0,
           iif(row_number() OVER (PARTITION BY session_id, session_key ORDER BY seq) = 1,
               id, NULL),
           iif(row_number() OVER (PARTITION BY session_id, session_key
                                  ORDER BY attempt_at DESC, id DESC) = 1, id, NULL)
    FROM (
        SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END AS session_key,
               seq, id, attempts, status, {_ATTEMPT_AT} AS attempt_at
        FROM records INDEXED BY records_last_error_idx
        WHERE last_error IS NOT NULL AND {_SHORT} LIMIT -1
    )
    LIMIT -1
)
GROUP BY session_id, session_key
ORDER BY min(created_at), session_id IS NOT NULL, session_id, session_key
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
#: index's order, so a stream's rows come together unsorted; the streams then sorted
#: as ``iter_lines`` lists them, by SQLite (its temporary files, not memory).
LONG_SQL = (
    f"""SELECT CAST(substr(session_id, 1, :chars) AS BLOB), NULL, length(session_id),
    {_LONG_COLUMNS}
    FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL AND length(session_id) > :chars GROUP BY session_id
    ORDER BY min(created_at), 1, 3, min(id)""",
    f"""SELECT NULL, CAST(substr(session_key, 1, :chars) AS BLOB), length(session_key),
    {_LONG_COLUMNS}
    FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND length(session_key) > :chars GROUP BY session_key
    ORDER BY min(created_at), 2, 3, min(id)""",
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


def iter_lines(conn: apsw.Connection) -> Iterator[Line]:
    """Every stream's ``Line``, oldest first; on a tie, key streams first, then by name,
    as the view orders them. One line is held at a time, and what it holds is bounded
    by ``CHARS`` whatever the names: the caller's memory does not grow with the number
    of streams. In a read transaction of its own unless the caller is in one."""
    params = {"chars": CHARS}
    with conn:
        lines = (_line(conn, row) for row in _named(conn, LINES_SQL, params))
        for line in lines:
            if line.session_id is None and line.session_key is None:
                # Streams named longer than CHARS, none older than this group: from here
                # on their lines, each walk in its own order, merge with the rest.
                walks = [
                    (_long_line(conn, row) for row in _named(conn, sql, params)) for sql in LONG_SQL
                ]
                yield from heapq.merge(lines, *walks, key=order)
                return
            yield line


def order(line: Line) -> tuple[Any, ...]:
    """Where ``line`` comes in a listing (``iter_lines``)."""
    return (
        line.oldest, line.session_id is not None, line.session_id or "", line.session_key or "",
        line.name_chars, line.name_row or 0,
    )  # fmt: skip


def _line(conn: apsw.Connection, row: tuple[Any, ...]) -> Line:
    sid, key, rows, size, oldest, newest, attempts, *counts, first_row, latest_row = row
    quarantined, superseded, inflight, failed, failing, replayable_inflight = counts
    waiting = rows - quarantined - superseded - replayable_inflight
    name = sid if sid is not None else key  # None: the group of names past CHARS
    line = Line(
        sid, key, rows, size, oldest, newest, attempts, None, quarantined, superseded, inflight,
        held(failed, waiting), 0 if name is None else len(name), failing=failing,
    )  # fmt: skip
    if first_row is None:
        return line
    error, error_chars = _error_at(conn, first_row)
    latest, latest_chars = (
        (error, error_chars) if latest_row == first_row else _error_at(conn, latest_row)
    )
    return msgspec.structs.replace(
        line, last_error=error, error_chars=error_chars, error_row=first_row,
        latest_error=latest, latest_chars=latest_chars, latest_row=latest_row,
    )  # fmt: skip


def _error_at(conn: apsw.Connection, row_id: int) -> tuple[str | None, int]:
    """Row ``row_id``'s error, at most ``CHARS`` characters, and its whole length."""
    params = {"chars": CHARS, "id": row_id}
    error, chars = next(_named(conn, ERROR_AT_SQL, params, 0, names=()))
    return error, chars


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
    error, error_chars = _error_at(conn, error_row)
    params = {"chars": CHARS, "id": first}
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
    if columns == (0, 1):  # a stream's name alone: the listing's every line
        for session_id, session_key, *rest in conn.execute(sql, params):
            yield (as_text(session_id), as_text(session_key), *rest)
        return
    for selected in conn.execute(sql, params):
        yield with_text(selected, columns)
