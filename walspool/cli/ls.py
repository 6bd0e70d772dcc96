"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
import time
from typing import Any

import apsw

from ..text import printable
from ._output import (
    EXIT_OK,
    cli_terms,
    clip,
    dump,
    duration,
    iso,
    size,
    stream_name,
    table_lines,
)
from ._reading import INFLIGHT_BY_STREAM_SQL, reading

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
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, seq, attempts, last_error,
       status
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
#: What ``ls --json`` adds to the view's columns: rows out with a replay now, rows with an
#: error still in line (held, waiting for the next try), and the oldest and newest row's
#: ages in seconds at the reading.
MORE_KEYS = ("inflight", "retrying", "oldest_age", "newest_age")


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
    wider than 120 characters (once escaped) is clipped, its last character "…": such
    a session's name is in --json whole.
    """
    with reading(args.spool, walk=True) as reader:
        backlog = reader.read(lambda conn: read_backlog(conn, time.time()))
    if args.json:
        print(dump(backlog))
    elif not backlog:
        print(f"no rows in {printable(args.spool)}")
    else:
        headers = (
            "SESSION", "ROWS", "RETRYING", "QUARANTINED", "SUPERSEDED", "IN FLIGHT", "BYTES",
            "OLDEST", "NEWEST", "ATTEMPTS", "LAST ERROR",
        )  # fmt: skip
        for line in table_lines(headers, [_backlog_line(b) for b in backlog]):
            print(line)
    return EXIT_OK


def read_backlog(conn: apsw.Connection, now: float) -> list[dict[str, Any]]:
    """The ``backlog`` view's rows, one object per stream, oldest first, with
    ``MORE_KEYS`` (ages as of ``now``)."""
    streams: dict[tuple[str | None, str | None], list[Any]] = {}
    with conn:
        for session_id, key, rows, size, oldest, newest in conn.execute(STREAMS_SQL):
            # rows, bytes, oldest, newest, max attempts, first error (seq, text),
            # quarantined, superseded, in flight, retrying
            streams[session_id, key] = [rows, size, oldest, newest, 0, None, 0, 0, 0, 0]
        for session_id, key, status, n in conn.execute(SET_ASIDE_SQL):
            streams[session_id, key][6 if status == "quarantined" else 7] += n
        for session_id, key, n in conn.execute(INFLIGHT_BY_STREAM_SQL):
            streams[session_id, key][8] = n
        for session_id, key, seq, attempts, error, status in conn.execute(ERRORS_SQL):
            s = streams[session_id, key]
            s[4] = max(s[4], attempts)
            if s[5] is None or seq < s[5][0]:
                s[5] = (seq, error)
            s[9] += status is None
    # oldest first; on a tie, NULL (key streams) first, as the view orders them
    ordered = sorted(
        streams.items(), key=lambda i: (i[1][2], i[0][0] is not None, i[0][0] or "", i[0][1] or "")
    )
    return [
        dict(
            zip(
                BACKLOG_KEYS + MORE_KEYS,
                (sid, key, rows, size, iso(oldest), iso(newest), attempts,
                 error[1] if error else None, quarantined, superseded, inflight, retrying,
                 max(now - oldest, 0.0), max(now - newest, 0.0)),
                strict=True,
            )
        )
        for (sid, key), (rows, size, oldest, newest, attempts, error, quarantined, superseded,
                         inflight, retrying)
        in ordered
    ]  # fmt: skip


def _backlog_line(b: dict[str, Any]) -> tuple[Any, ...]:
    return (
        stream_name(b["session_id"], b["session_key"]),
        b["rows"],
        b["retrying"],
        b["quarantined"],
        b["superseded"],
        b["inflight"],
        size(b["bytes"]),
        duration(b["oldest_age"]),
        duration(b["newest_age"]),
        b["max_attempts"],
        clip(cli_terms(b["last_error"])),
    )
