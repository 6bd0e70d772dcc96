"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
from typing import Any

import apsw

from ..text import printable
from ._output import EXIT_OK, clip, dump, table
from ._reading import reading

BACKLOG_SQL = """
SELECT session_id, session_key, rows, bytes, oldest, newest, max_attempts, last_error,
       quarantined, superseded
FROM backlog ORDER BY oldest, session_id, session_key
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

    The `backlog` view, oldest first: rows, bytes, oldest, newest, max attempts and
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
    """The ``backlog`` view, one object per stream, oldest first."""
    return [dict(zip(BACKLOG_KEYS, row, strict=True)) for row in conn.execute(BACKLOG_SQL)]


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
