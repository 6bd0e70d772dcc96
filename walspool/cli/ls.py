"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import IO, Any

import apsw
import msgspec

from ..text import printable
from ._output import (
    CELL_WIDTH,
    EXIT_OK,
    cli_terms,
    clip,
    dump,
    duration,
    iso,
    plural,
    shell_word,
    size,
    stream_name,
    table_lines,
)
from ._reading import reading

#: At most this many characters of a stream's name (session id, or key) and of its first
#: error are read per stream; a session id may be 64 MiB. SQLite sorts names up to this
#: long to group rows by stream; the rows of longer ones are found in their unique
#: index's order instead (``LONG_SQL``, no sort), since a sort of huge names holds most
#: of them at once. ``--json`` reads a longer name or error whole when it writes that
#: stream's object, by the id of a row holding it, one at a time.
CHARS = 4096
#: ``--json`` text kept in memory before the rest goes to a temporary file: the text is
#: written out only after the reading it comes from is known to be sound (a reading may
#: be done again: ``SpoolReader.read``).
JSON_IN_MEMORY = 8 * 1024 * 1024
#: ``--json`` text is written in slices this long: a huge object's text is never copied
#: whole to be encoded, or into memory before the temporary file takes over.
JSON_SLICE = 1024 * 1024
#: Rows whose stream's name is at most ``CHARS`` long: every query but ``LONG_SQL``.
_SHORT = "length(coalesce(session_id, session_key)) <= :chars"
#: The ``backlog`` view's columns from indexes only, never a row's page: rows, bytes and
#: times per stream from the statistics index (covering, so one walk of it and a sort);
#: set-aside counts from the status index; attempts and each stream's first error from
#: the index of rows with an error (a row's attempts grow only with an error). The view
#: reads every row instead. Times stay epoch seconds until printed, by one rule (``iso``).
#: The rows of streams named longer than ``CHARS`` make one group (NULL, NULL), a name
#: no stream has: it says ``LONG_SQL`` has streams to read. The names are clipped in a
#: subquery that LIMIT keeps apart (SQLite does not merge a subquery with a LIMIT into
#: an aggregate): merged, the sort would carry every row's name whole again.
STREAMS_SQL = """
SELECT session_id, session_key, count(*), sum(size), min(created_at), max(created_at)
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
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, status, count(*)
FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL AND {_SHORT} GROUP BY 1, 2, 3
"""
INFLIGHT_BY_STREAM_SQL = f"""
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*)
FROM records INDEXED BY records_inflight_idx WHERE inflight IS NOT NULL AND {_SHORT}
GROUP BY 1, 2
"""
ERRORS_SQL = f"""
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, seq, attempts, status, id,
       substr(last_error, 1, :chars), length(last_error)
FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL AND {_SHORT}
"""
#: A line's columns over one stream's rows; its first error as the least of its seq and
#: row id, zero-padded (two min() would each pick a row of their own for a bare column).
_LONG_COLUMNS = """min(id), count(*), sum(size), min(created_at), max(created_at),
    coalesce(max(attempts) FILTER (WHERE last_error IS NOT NULL), 0),
    min(format('%020d %d', seq, id)) FILTER (WHERE last_error IS NOT NULL),
    count(*) FILTER (WHERE status = 'quarantined'), count(*) FILTER (WHERE status = 'superseded'),
    count(inflight), count(*) FILTER (WHERE last_error IS NOT NULL AND status IS NULL)"""
#: Streams named longer than ``CHARS``, by id and by key: walked in their unique
#: index's order, so a stream's rows come together and nothing is sorted.
LONG_SQL = (
    f"""SELECT substr(session_id, 1, :chars), NULL, length(session_id), {_LONG_COLUMNS}
    FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL AND length(session_id) > :chars GROUP BY session_id""",
    f"""SELECT NULL, substr(session_key, 1, :chars), length(session_key), {_LONG_COLUMNS}
    FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND length(session_key) > :chars GROUP BY session_key""",
)
ERROR_AT_SQL = (
    "SELECT substr(last_error, 1, :chars), length(last_error) FROM records WHERE id = :id"
)
#: A stream's name and an error whole, from a row that holds it.
NAME_SQL = "SELECT coalesce(session_id, session_key) FROM records WHERE id = ?"
ERROR_SQL = "SELECT last_error FROM records WHERE id = ?"
BACKLOG_KEYS = (
    "session_id",
    "session_key",
    "rows",
    "bytes",
    "oldest",
    "newest",
    "max_attempts",
    "last_error",
    "quarantined",
    "superseded",
)
#: What ``ls --json`` adds to the view's columns: rows out with a replay now, rows with an
#: error still in line (held, waiting for the next try), and the oldest and newest row's
#: ages in seconds at the reading.
MORE_KEYS = ("inflight", "retrying", "oldest_age", "newest_age")


class Line(msgspec.Struct, frozen=True):
    """One stream as ``ls`` reads it: its name and first error at most ``CHARS``
    characters long. ``name_chars`` and ``error_chars`` are their whole lengths; a
    longer one is read whole from row ``name_row`` (one of the stream's, set only
    then) or ``error_row``. Times are epoch seconds."""

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


def run(args: argparse.Namespace) -> int:
    """List what waits in a spool, one line per session.

    What the `backlog` view shows, oldest first: rows, bytes, oldest, newest, max attempts and
    last error; and of the rows, how many are RETRYING (a failed write holds them, the next
    replay tries again), QUARANTINED (state.db refused their content: kept, never replayed
    unasked), SUPERSEDED (a transcript rewrite replaced them) and IN FLIGHT (out with a
    replay or the gateway's drain, or left by one that failed or was stopped). OLDEST and
    NEWEST are ages (4s, 1m05s, 2h03m, 3d04h); --json has the times, and adds
    `oldest_age` and `newest_age` in seconds, `inflight` and `retrying`. SESSION is the
    session id, or `key:<KEY>` for rows spooled by session key only, quoted as a shell
    word when it needs to be: pasted into `walspool show` it names the same rows. A cell
    wider than 120 characters (once escaped) is clipped, its last character "…": a last
    line then says how many sessions are, whose names --json has whole.
    """
    now = time.time()
    if args.json:
        text = tempfile.SpooledTemporaryFile(JSON_IN_MEMORY, "w+", encoding="utf-8", newline="")
        with text as out:
            with reading(args.spool, walk=True) as reader:
                reader.read(lambda conn: write_json(conn, out, now))
            out.seek(0)
            shutil.copyfileobj(out, sys.stdout)
        return EXIT_OK
    with reading(args.spool, walk=True) as reader:
        lines = reader.read(read_lines)
    if not lines:
        print(f"no rows in {printable(args.spool)}")
        return EXIT_OK
    headers = (
        "SESSION", "ROWS", "RETRYING", "QUARANTINED", "SUPERSEDED", "IN FLIGHT", "BYTES",
        "OLDEST", "NEWEST", "ATTEMPTS", "LAST ERROR",
    )  # fmt: skip
    cells = [_cells(line, now) for line in lines]
    for text in table_lines(headers, cells):
        print(text)
    clipped = sum(len(c[0]) > CELL_WIDTH for c in cells)  # a name is printable already
    if clipped:
        them = "it" if clipped == 1 else "them"
        print(
            f"{plural(clipped, 'session')} clipped (…): "
            f"`walspool ls {shell_word(str(args.spool))} --json` has {them} whole"
        )
    return EXIT_OK


def read_lines(conn: apsw.Connection) -> list[Line]:
    """Every stream's ``Line``, oldest first; on a tie, key streams first, as the view
    orders them. What it holds per stream is bounded by ``CHARS``, whatever the names."""
    params = {"chars": CHARS}
    streams: dict[tuple[str | None, str | None], list[Any]] = {}
    with conn:
        for session_id, key, rows, size, oldest, newest in conn.execute(STREAMS_SQL, params):
            # rows, bytes, oldest, newest, max attempts, first error (seq, row, text,
            # length), quarantined, superseded, in flight, retrying
            streams[session_id, key] = [rows, size, oldest, newest, 0, None, 0, 0, 0, 0]
        long_names = streams.pop((None, None), None) is not None
        for session_id, key, status, n in conn.execute(SET_ASIDE_SQL, params):
            streams[session_id, key][6 if status == "quarantined" else 7] += n
        for session_id, key, n in conn.execute(INFLIGHT_BY_STREAM_SQL, params):
            streams[session_id, key][8] = n
        for session_id, key, seq, attempts, status, *error in conn.execute(ERRORS_SQL, params):
            s = streams[session_id, key]
            s[4] = max(s[4], attempts)
            if s[5] is None or seq < s[5][0]:
                s[5] = (seq, *error)
            s[9] += status is None
        lines = [
            Line(sid, key, rows, size, oldest, newest, attempts, error and error[2], quarantined,
                 superseded, inflight, retrying, len(sid if sid is not None else key), None,
                 *((error[3], error[1]) if error else ()))
            for (sid, key), (rows, size, oldest, newest, attempts, error, quarantined, superseded,
                             inflight, retrying)
            in streams.items()
        ]  # fmt: skip
        if long_names:
            lines += [
                _long_line(conn, row) for sql in LONG_SQL for row in conn.execute(sql, params)
            ]
    lines.sort(
        key=lambda s: (s.oldest, s.session_id is not None, s.session_id or "",
                       s.session_key or "", s.name_chars, s.name_row or 0)
    )  # fmt: skip
    return lines


def _long_line(conn: apsw.Connection, row: tuple[Any, ...]) -> Line:
    sid, key, chars, first, rows, size, oldest, newest, attempts, error_at, *counts = row
    if error_at is None:
        return Line(sid, key, rows, size, oldest, newest, attempts, None, *counts, chars, first)
    error_row = int(error_at.split()[1])
    error, error_chars = conn.execute(ERROR_AT_SQL, {"chars": CHARS, "id": error_row}).fetchone()
    return Line(sid, key, rows, size, oldest, newest, attempts, error, *counts, chars, first,
                error_chars, error_row)  # fmt: skip


def backlog_object(conn: apsw.Connection, line: Line, now: float) -> dict[str, Any]:
    """``line`` as its ``ls --json`` object, name and error whole (read again from their
    rows when longer than ``CHARS``: in the transaction ``line`` was read in), ages as
    of ``now``."""
    sid, key, error = line.session_id, line.session_key, line.last_error
    if line.name_chars > CHARS:
        name = conn.execute(NAME_SQL, (line.name_row,)).get
        sid, key = (name, None) if sid is not None else (None, name)
    if line.error_chars > CHARS:
        error = conn.execute(ERROR_SQL, (line.error_row,)).get
    values = (
        sid, key, line.rows, line.bytes, iso(line.oldest), iso(line.newest), line.max_attempts,
        error, line.quarantined, line.superseded, line.inflight, line.retrying,
        max(now - line.oldest, 0.0), max(now - line.newest, 0.0),
    )  # fmt: skip
    return dict(zip(BACKLOG_KEYS + MORE_KEYS, values, strict=True))


def read_backlog(conn: apsw.Connection, now: float) -> list[dict[str, Any]]:
    """The ``ls --json`` objects, one per stream, oldest first, ages as of ``now``.

    Every object at once, each name and error whole, so what it holds grows with the
    names (``write_json`` holds one object at a time)."""
    with conn:
        return [backlog_object(conn, line, now) for line in read_lines(conn)]


def write_json(conn: apsw.Connection, out: IO[str], now: float) -> None:
    """The ``ls --json`` array into ``out`` (emptied first: a reading may be done
    again), an object at a time, from one read transaction."""
    out.seek(0)
    out.truncate()
    with conn:
        out.write("[")
        for n, line in enumerate(read_lines(conn)):
            if n:
                out.write(",")
            text = dump(backlog_object(conn, line, now))
            for at in range(0, len(text), JSON_SLICE):
                out.write(text[at : at + JSON_SLICE])
        out.write("]\n")


def _cells(line: Line, now: float) -> tuple[Any, ...]:
    return (
        stream_name(line.session_id, line.session_key),
        line.rows,
        line.retrying,
        line.quarantined,
        line.superseded,
        line.inflight,
        size(line.bytes),
        duration(max(now - line.oldest, 0.0)),
        duration(max(now - line.newest, 0.0)),
        line.max_attempts,
        clip(cli_terms(line.last_error)),
    )
