"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
from typing import Any

import apsw

from ..text import printable
from ._output import EXIT_OK, clip, dump, iso, table
from ._reading import reading

#: The ``backlog`` view's columns from indexes only, never a row's page: rows, bytes and
#: times per stream from the statistics index (covering, so one walk of it and a sort);
#: set-aside counts from the status index; attempts and each stream's first error from
#: the index of rows with an error (a row's attempts grow only with an error). The view
#: reads every row instead. Times stay epoch seconds until printed, by one rule (``iso``).
STREAMS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*), sum(size),
       min(created_at), max(created_at)
FROM records INDEXED BY records_reason_created_at_size_session_id_session_key_idx
GROUP BY 1, 2
"""
SET_ASIDE_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, status, count(*)
FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL GROUP BY 1, 2, 3
"""
ERRORS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, seq, attempts, last_error
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
    streams: dict[tuple[str | None, str | None], list[Any]] = {}
    with conn:
        for session_id, key, rows, size, oldest, newest in conn.execute(STREAMS_SQL):
            # rows, bytes, oldest, newest, max attempts, first error (seq, text),
            # quarantined, superseded
            streams[session_id, key] = [rows, size, oldest, newest, 0, None, 0, 0]
        for session_id, key, status, n in conn.execute(SET_ASIDE_SQL):
            streams[session_id, key][6 if status == "quarantined" else 7] += n
        for session_id, key, seq, attempts, error in conn.execute(ERRORS_SQL):
            s = streams[session_id, key]
            s[4] = max(s[4], attempts)
            if s[5] is None or seq < s[5][0]:
                s[5] = (seq, error)
    # oldest first; on a tie, NULL (key streams) first, as the view orders them
    ordered = sorted(
        streams.items(), key=lambda i: (i[1][2], i[0][0] is not None, i[0][0] or "", i[0][1] or "")
    )
    return [
        dict(
            zip(
                BACKLOG_KEYS,
                (sid, key, rows, size, iso(oldest), iso(newest), attempts,
                 error[1] if error else None, quarantined, superseded),
                strict=True,
            )
        )
        for (sid, key), (rows, size, oldest, newest, attempts, error, quarantined, superseded)
        in ordered
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
