"""``show`` and ``export``'s --limit, --tail, --since and --failing, on the stream of
records in drop order (filters in order: --since and --failing, then --tail or --limit)."""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import re
import time
from collections.abc import Iterator

from ..store.records import Record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=_count, metavar="N", help="only the first N rows")
    p.add_argument("--tail", type=_count, metavar="N", help="only the last N rows (kept in memory)")
    p.add_argument(
        "--since",
        type=_moment,
        metavar="TIME",
        help="only rows spooled at or after TIME: ISO 8601 (UTC unless it says), epoch "
        "seconds, or an age: 30s, 10m, 2h, 1d ago",
    )
    p.add_argument("--failing", action="store_true", help="only rows with a last error")


def narrowed(
    rows: Iterator[tuple[Record, int | None]], args: argparse.Namespace
) -> Iterator[tuple[Record, int | None]]:
    if args.since is not None:
        rows = (r for r in rows if r[0].created_at >= args.since)
    if args.failing:
        rows = (r for r in rows if r[0].last_error is not None)
    if args.tail is not None:
        rows = iter(collections.deque(rows, maxlen=args.tail))
    if args.limit is not None:
        rows = itertools.islice(rows, args.limit)
    return rows


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a count of rows")
    return n


#: An age for --since: a number and its unit (seconds, minutes, hours, days).
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _moment(text: str, now: float | None = None) -> float:
    """A --since TIME as epoch seconds; an age (``10m``) counts back from ``now``."""
    age = _AGE.fullmatch(text.strip())
    if age is not None:
        now = time.time() if now is None else now
        return now - float(age[1]) * _UNIT[age[2]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ISO 8601 (2025-01-31T12:00:00Z), epoch seconds, nor an "
            "age (30s, 10m, 2h, 1d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()
