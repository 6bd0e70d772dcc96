"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
from typing import Any

import apsw

from ..text import printable
from ._output import EXIT_OK, clip, dump, iso, table
from ._reading import reading

#: The ``backlog`` view's columns, in one pass over ``records`` (the view finds each
#: stream's last error with a subquery per stream; here it comes from the index of
#: rows with an error). Times stay epoch seconds until printed, by one rule (``iso``).
STREAMS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*), sum(size),
       min(created_at), max(created_at), max(attempts),
       count(*) FILTER (WHERE status = 'quarantined'),
       count(*) FILTER (WHERE status = 'superseded')
FROM records GROUP BY 1, 2
"""
FIRST_ERRORS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, seq, last_error
FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL
"""
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


def run(args: argparse.Namespace) -> int:
    """List what waits in a spool, one line per session.

    What the `backlog` view shows, oldest first: rows, bytes, oldest, newest, max attempts and
    last error. Rows spooled with a session key but no session id show as `key:<KEY>`.
    """
    with reading(args.spool) as reader:
        backlog = reader.read(read_backlog)
    if args.json:
        print(dump(backlog))
    elif not backlog:
        print(f"no rows in {printable(args.spool)}")
    else:
        headers = ("SESSION", "ROWS", "BYTES", "OLDEST", "NEWEST", "ATTEMPTS", "LAST ERROR")
        print(table(headers, [_backlog_line(b) for b in backlog]))
    return EXIT_OK


def read_backlog(conn: apsw.Connection) -> list[dict[str, Any]]:
    """The ``backlog`` view's rows, one object per stream, oldest first."""
    with conn:
        streams = conn.execute(STREAMS_SQL).fetchall()
        first_error: dict[tuple[str | None, str | None], tuple[int, str]] = {}
        for session_id, key, seq, error in conn.execute(FIRST_ERRORS_SQL):
            if (session_id, key) not in first_error or seq < first_error[session_id, key][0]:
                first_error[session_id, key] = (seq, error)
    streams.sort(key=lambda r: (r[4], r[0] is not None, r[0] or "", r[1] or ""))  # NULLs first
    return [
        dict(
            zip(
                BACKLOG_KEYS,
                (sid, key, rows, size, iso(oldest), iso(newest), attempts,
                 first_error.get((sid, key), (0, None))[1], quarantined, superseded),
                strict=True,
            )
        )
        for sid, key, rows, size, oldest, newest, attempts, quarantined, superseded in streams
    ]  # fmt: skip


def _backlog_line(b: dict[str, Any]) -> tuple[Any, ...]:
    name = b["session_id"] if b["session_id"] is not None else f"key:{b['session_key']}"
    return (
        name,
        b["rows"],
        b["bytes"],
        b["oldest"],
        b["newest"],
        b["max_attempts"],
        clip(b["last_error"]),
    )
