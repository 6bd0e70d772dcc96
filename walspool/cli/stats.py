"""``walspool stats``: one summary of a spool."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import apsw
import msgspec

from ..store import memory, totals
from ..store.records import QUARANTINED, SUPERSEDED
from ..text import printable
from . import _memory as in_memory
from ._frame import drain_eta, eta_text, rates_text
from ._holders import holders, holders_text
from ._lockwait import seconds as seconds_argument
from ._output import (
    EXIT_OK,
    RED,
    YELLOW,
    cli_terms,
    clip,
    dump,
    duration,
    iso,
    paint,
    plural,
    size,
    stream_name,
)
from ._reading import reading
from ._watching import Rates, rates, read_snapshot

#: Sessions whose latest error ``stats`` shows, the most recent first.
LAST_ERRORS = 5
#: Characters of a session's name and of its error read per row (a session id may be
#: 64 MiB): enough to name and show it; ``ls``/``show`` have it whole.
LAST_ERROR_CHARS = 1024


def run(args: argparse.Namespace) -> int:
    """Summarize a spool.

    Rows, sessions, payload bytes, oldest and newest row (time and age), rows by reason,
    rows with errors, rows in flight, and the sizes of the db and WAL files; and who has
    the spool open (pid and command of each process holding its open lock, as watch
    shows); the latest error of the sessions that failed most recently, with its age;
    and, with --sample SECONDS, the rates rows arrive and leave at over that many
    seconds (a second reading) and the drain's ETA, as watch measures them. On a
    terminal what needs a look is in colour (not with NO_COLOR set). --json has
    `oldest_age` and `newest_age` in seconds (null for an empty spool), `open_by`
    ([{"pid", "command"}]; null where the system cannot tell), `last_errors` and, with
    --sample, `rates` and `drain_eta` (see docs/cli.md).
    """
    rate = eta = None
    if args.sample:
        rate, eta = sample(args.spool, args.sample)
    with reading(args.spool, walk=True) as reader:
        stats = reader.read(lambda conn: read_stats(conn, args.spool, time.time()))
    found = holders(args.spool)
    stats["open_by"] = None if found is None else [msgspec.to_builtins(h) for h in found]
    if args.sample:
        stats["rates"] = None if rate is None else msgspec.to_builtins(rate)
        stats["drain_eta"] = eta
    if args.json:
        print(dump(stats))
        return EXIT_OK
    colour = _colour(sys.stdout)
    # Rows set aside (quarantined, superseded) never drain by themselves: not waiting.
    waiting = stats["rows"] - stats["quarantined"] - stats["superseded"]
    reasons = [f"{n:,} {printable(reason)}" for reason, n in stats["by_reason"].items()] or ["-"]
    # What gateway processes hold in memory; red once one of them is gone (lost).
    held = in_memory.lines(stats["memory"])
    lost = (RED,) if any(o["alive"] is False for o in stats["memory"]) else ()
    lines = [
        ("spool", printable(stats["spool"])),
        ("open by", holders_text(found, waiting)),
        ("rows", f"{stats['rows']:,} in {plural(stats['sessions'], 'session')}"),
        ("payload", size(stats["bytes"])),
        ("oldest", _when(stats["oldest"], stats["oldest_age"])),
        ("newest", _when(stats["newest"], stats["newest_age"])),
        ("by reason", reasons[0]),
        *(("", r) for r in reasons[1:]),
        ("with errors", plural(stats["failing"], "row"), YELLOW),
        ("in flight", plural(stats["inflight"], "row")),
        ("quarantined", plural(stats["quarantined"], "row"), YELLOW),
        ("superseded", plural(stats["superseded"], "row")),
        ("last errors", "-" if not stats["last_errors"] else "latest first"),
        *(("", _error_line(e), YELLOW) for e in stats["last_errors"]),
        ("files", f"db {size(stats['db_bytes'])}, WAL {size(stats['wal_bytes'])}"),
        ("in memory", held[0], *lost),
        *(("", line, *lost) for line in held[1:]),
    ]
    if args.sample and rate is None:
        lines += [
            ("rates", "- (the spool was replaced or edited between the two readings)"),
            ("drain ETA", "-"),
        ]
    elif args.sample and rate is not None:
        in_memory_now = sum(o["messages"] for o in stats["memory"] if o["alive"] is not False)
        lines += [
            ("rates", rates_text(rate, f"over {args.sample:g}s")),
            ("drain ETA", eta_text(eta, stats["rows"], in_memory_now)),
        ]
    idle = found is not None and not found and waiting > 0
    for key, value, *colours in lines:
        line = f"{key:<12}{value}"
        counted = key == "in memory" or (key in _KEYS and stats[_KEYS[key]] > 0)
        if colour and ((colours and (counted or not key)) or (key == "open by" and idle)):
            line = paint(line, colours[0] if colours else RED, True)
        print(line)
    return EXIT_OK


_KEYS = {"with errors": "failing", "quarantined": "quarantined"}


def _colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and not when the user said NO_COLOR (no-color.org)."""
    try:
        return stream.isatty() and not os.environ.get("NO_COLOR")
    except ValueError:  # closed
        return False


def _error_line(error: dict[str, Any]) -> str:
    name = stream_name(error["session_id"], error["session_key"])
    name = clip(name, 40) + (" (clipped)" if error["clipped"] else "")
    return f"{name}  {duration(error['age'])} ago: {clip(cli_terms(error['error']), 80)}"


def sample(path: Path, seconds: float) -> tuple[Rates | None, float | None]:
    """Two readings ``seconds`` apart (as watch takes them): the rates between them
    and the drain's ETA at those rates (None: not draining, or no rates)."""
    before = read_snapshot(path)
    time.sleep(seconds)
    after = read_snapshot(path)
    rate = rates(before, after)
    return rate, drain_eta(after, rate) if rate is not None else None


def _when(moment: str | None, age: float | None) -> str:
    return "-" if moment is None or age is None else f"{moment} ({duration(age)} ago)"


def read_stats(conn: apsw.Connection, path: Path, now: float) -> dict[str, Any]:
    """The ``stats --json`` object (see docs/cli.md); ages as of ``now``."""
    with conn:
        s = totals.stats(conn, path)
        inflight = totals.in_flight_rows(conn)
        set_aside = totals.set_aside_counts(conn)
        failing_sessions = totals.failing_streams(conn)
        recent = totals.recent_errors(conn, LAST_ERROR_CHARS, LAST_ERRORS * 40)
        counted = totals.counters(conn)
        held = memory.read(conn)
    quarantined, quarantined_bytes = set_aside.get(QUARANTINED, (0, 0))
    superseded, superseded_bytes = set_aside.get(SUPERSEDED, (0, 0))
    return {
        "spool": str(path),
        "rows": s.rows,
        "sessions": s.sessions,
        "bytes": s.bytes,
        "oldest": iso(s.oldest),
        "newest": iso(s.newest),
        "by_reason": dict(sorted(s.by_reason.items())),
        "bytes_by_reason": dict(sorted(s.bytes_by_reason.items())),
        "failing": s.failing,
        "failing_sessions": failing_sessions,
        "inflight": inflight,
        "db_bytes": s.db_bytes,
        "wal_bytes": s.wal_bytes,
        "quarantined": quarantined,
        "superseded": superseded,
        "quarantined_bytes": quarantined_bytes,
        "superseded_bytes": superseded_bytes,
        "oldest_age": None if s.oldest is None else max(now - s.oldest, 0.0),
        "newest_age": None if s.newest is None else max(now - s.newest, 0.0),
        "last_errors": _latest_per_session(recent, now),
        "drained_total": counted[totals.DRAINED],
        "quarantined_total": counted[totals.QUARANTINED_COUNTER],
        "memory_lost_total": counted[totals.MEMORY_LOST],
        "memory": in_memory.as_json(held, now),
    }


def _latest_per_session(recent: list[Any], now: float) -> list[dict[str, Any]]:
    """The first ``LAST_ERRORS`` sessions among the latest failed attempts, each with
    its latest error (the rows come latest first)."""
    found: dict[tuple[Any, Any], dict[str, Any]] = {}
    for session_id, session_key, clipped, error, at in recent:
        if (session_id, session_key) not in found and len(found) < LAST_ERRORS:
            found[session_id, session_key] = {
                "session_id": session_id,
                "session_key": session_key,
                "clipped": bool(clipped),
                "error": error,
                "at": iso(at),
                "age": max(now - at, 0.0),
            }
    return list(found.values())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sample",
        type=seconds_argument,
        default=0.0,
        metavar="SECONDS",
        help="read the spool again after this many seconds, for the rates and the "
        "drain's ETA (default: one reading, no rates)",
    )
