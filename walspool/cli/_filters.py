"""Which records a command takes: the ``--reason``, ``--session`` and ``--id`` filters,
checked before use, and the narrowing of ``show`` and ``export``.

A filter that can match nothing is a typo far more often than a question, and an
operator in an incident reads "moved 0 rows" as "nothing was waiting". So a reason
that is neither one of walspool's nor found in the spool is refused with the list of
known ones, and a session with no row at all is reported, as ``show`` reports it. An
``--id`` list that could be one number or several is refused rather than guessed.

``show`` and ``export`` narrow the stream of records in drop order further with
--limit, --tail, --since and --failing (in order: --since and --failing, then --tail
or --limit).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import re
import time
from collections.abc import Iterator, Sequence

from ..errors import WalspoolError
from ..store import lookups
from ..store.reader import SpoolReader
from ..store.records import AGENT_HISTORY, CAP_DROP, SHUTDOWN, Record
from ..store.spool import check_lookup
from . import _memory as in_memory
from ._reading import near_sessions

#: The reasons walspool itself spools rows with.
KNOWN_REASONS = (CAP_DROP, SHUTDOWN, AGENT_HISTORY)
#: How ``ls`` names a stream spooled by session key only: ``key:<KEY>``.
KEY_PREFIX = "key:"
#: An --id list that also reads as one number written with thousands separators.
THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")


class UsageError(WalspoolError):
    """An argument that cannot be right (exit status 2)."""


#: The most ids one ``A-B`` range of --id may name.
MAX_RANGE = 1_000_000


def row_ids(text: str) -> list[int]:
    """An --id argument: one row id or several, comma-separated, each a range ``A-B``
    if need be (``7``, ``7,9``, ``7-9,12``), as ``drop`` and ``requeue`` print them.

    A list that reads as one number written with thousands separators too (``1,041``:
    row 1041, or rows 1 and 41?) is refused, naming both readings: walspool prints ids
    without separators, but counts and sizes with them, and either reading is a guess.
    """
    ids: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            ids = []
            break
        if not 1 <= low <= high:
            ids = []
            break
        if high - low >= MAX_RANGE:
            raise argparse.ArgumentTypeError(
                f"{part!r} names more than {MAX_RANGE:,} rows; give smaller ranges"
            )
        ids.extend(range(low, high + 1))
    if not ids:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a row id (a positive integer, or several: 7,9 or 7-9)"
        )
    if THOUSANDS.fullmatch(text):
        whole = int(text.replace(",", ""))
        rows = ", ".join(map(str, ids[:-1])) + f" and {ids[-1]}"
        each = " ".join(f"--id {i}" for i in ids)
        raise argparse.ArgumentTypeError(
            f"{text!r} is ambiguous: row {whole} written with a thousands separator, or "
            f"rows {rows}? ids print without separators: give --id {whole}, or {each}"
        )
    return ids


def id_ranges(ids: Sequence[int]) -> str:
    """``ids`` as --id takes them back: runs of three or more consecutive ids as
    ``A-B`` (``1198-1200, 5``), in the order given."""
    parts: list[str] = []
    run: list[int] = []
    for i in [*ids, None]:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if len(run) >= 3:
            parts.append(f"{run[0]}-{run[-1]}")
        else:
            parts.extend(map(str, run))
        run = [] if i is None else [i]
    return ", ".join(parts)


def check_reasons(reader: SpoolReader, reasons: Sequence[str] | None) -> None:
    """Refuse a ``--reason`` that is neither walspool's nor in the spool."""
    for reason in reasons or ():
        check_lookup(reason, "reason", reader.path)
        if reason in KNOWN_REASONS:
            continue
        if not reader.read(lambda c, r=reason: lookups.reason_exists(c, r)):
            found = reader.read(lookups.reasons)
            known = ", ".join(dict.fromkeys([*KNOWN_REASONS, *found]))
            raise UsageError(f"unknown reason {reason!r}; known reasons: {known}")


def check_session(reader: SpoolReader, session: str | None, *, keys: bool = True) -> None:
    """Raise when ``session`` has no row: no row spooled with that session id, nor
    (with ``keys``) with that session key and no id."""
    if session is None:
        return
    check_lookup(session, "session", reader.path, stored_bytes=True)
    if not reader.read(lambda c: lookups.session_exists(c, session, keys=keys)):
        held = in_memory.held_of(reader, session)
        near = near_sessions(reader, session)
        raise WalspoolError(f"no rows for session {session!r} in {reader.path}{held}{near}")


def has_stream(reader: SpoolReader, name: str, kind: str) -> bool:
    """Whether rows were spooled with session id ``name`` (``kind`` "id") or with
    session key ``name`` and no id ("key")."""
    check_lookup(name, "session", reader.path, stored_bytes=True)
    return reader.read(lambda c: lookups.stream_exists(c, name, kind))


def stream_rows(reader: SpoolReader, name: str, kind: str) -> int:
    """How many rows the stream has (``kind`` as in ``has_stream``)."""
    check_lookup(name, "session", reader.path, stored_bytes=True)
    return reader.read(lambda c: lookups.stream_rows(c, name, kind))


def which_stream(reader: SpoolReader, name: str, *, key: bool = False) -> tuple[str, str]:
    """The stream a SESSION argument names, as ``(name, kind)``: with ``key`` the
    session key ``name``; else the session id ``name`` if it has rows, else the key
    ``<KEY>`` of a ``key:<KEY>`` as ``ls`` prints it, else the session key ``name``."""
    if key:
        return name, "key"
    if has_stream(reader, name, "id"):
        return name, "id"
    if name.startswith(KEY_PREFIX) and not has_stream(reader, name, "key"):
        return name[len(KEY_PREFIX) :], "key"
    return name, "key"


def add_narrowing_arguments(p: argparse.ArgumentParser) -> None:
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
