"""``walspool ls``: what waits in a spool, one line per stream."""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

import apsw

# ls's own names still: the keys of its --json objects and what it holds of a name.
from ..store import memory
from ..store.backlog import CHARS as CHARS
from ..store.backlog import Line, iter_lines
from ..text import printable
from . import _memory as in_memory
from ._output import (
    CELL_WIDTH,
    EXIT_OK,
    cli_terms,
    clip,
    duration,
    plural,
    shell_word,
    size,
    stream_name,
    table_pages,
)
from ._reading import reading
from ._streams import BACKLOG_KEYS as BACKLOG_KEYS
from ._streams import backlog_object, held_text, write_array


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
    line then says how many sessions are, whose names --json has whole. Sessions are
    laid out a thousand at a time, so a listing of any length takes the same memory: a
    column wider on a later thousand widens from there on. A last line
    says what linked gateways hold in memory, not spooled yet (lost if the process is
    killed; `stats --json` names those sessions), or once such a process is gone, what
    it lost.
    """
    now = time.time()
    with held_text() as out:
        with reading(args.spool, walk=True) as reader:
            if args.json:
                reader.read(lambda conn: write_json(conn, out, now))
            else:
                (listed, clipped), held = reader.read(
                    lambda conn: (write_table(conn, out, now), memory.read(conn))
                )
        if not args.json and not listed:
            print(f"no rows in {printable(args.spool)}")
        out.seek(0)
        shutil.copyfileobj(out, sys.stdout)
    if args.json:
        return EXIT_OK
    if clipped:
        them = "it" if clipped == 1 else "them"
        print(
            f"{plural(clipped, 'session')} clipped (…): "
            f"`walspool ls {shell_word(str(args.spool))} --json` has {them} whole"
        )
    _print_memory(held, now)
    return EXIT_OK


#: Streams laid out at a time (``table_pages``): what ``ls`` holds of a listing,
#: however many sessions the spool has.
PAGE_LINES = 1000
HEADERS = (
    "SESSION", "ROWS", "RETRYING", "QUARANTINED", "SUPERSEDED", "IN FLIGHT", "BYTES", "OLDEST",
    "NEWEST", "ATTEMPTS", "LAST ERROR",
)  # fmt: skip


def write_table(conn: apsw.Connection, out: IO[str], now: float) -> tuple[int, int]:
    """The table of every stream into ``out`` (emptied first: a reading may be done
    again), a page of ``PAGE_LINES`` streams at a time, from one read transaction;
    ``(streams listed, names clipped)``."""
    out.seek(0)
    out.truncate()
    listed = clipped = 0

    def pages(lines: Iterator[Line]) -> Iterator[list[tuple[Any, ...]]]:
        nonlocal listed, clipped
        while page := [_cells(line, now) for line in itertools.islice(lines, PAGE_LINES)]:
            listed += len(page)
            clipped += sum(len(cells[0]) > CELL_WIDTH for cells in page)  # printable already
            yield page

    with conn:
        for text in table_pages(HEADERS, pages(iter_lines(conn))):
            out.write(text + "\n")
    return listed, clipped


def _print_memory(held: list[memory.Published], now: float) -> None:
    """What gateway processes hold in memory, one line each (nothing if none)."""
    if held:
        for text in in_memory.lines(in_memory.as_json(held, now)):
            print(f"in memory: {text}")


def write_json(conn: apsw.Connection, out: IO[str], now: float) -> None:
    """The ``ls --json`` array into ``out`` (emptied first: a reading may be done
    again), an object at a time, from one read transaction."""
    with conn:
        write_array(out, (backlog_object(conn, line, now) for line in iter_lines(conn)))
    out.write("\n")


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
