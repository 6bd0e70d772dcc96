"""What ``walspool watch`` reads and draws: a snapshot of the spool, the rates between two
snapshots, and the frame (lines fitted to a terminal). Not public API.

Reading goes through ``_reading.reading``, as every read command's does: read-only,
creating no file, holding nothing between readings. Rendering is pure: a snapshot (and
the rates) in, lines out.
"""

from __future__ import annotations

import os
import textwrap
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..errors import WalspoolError
from ..records import QUARANTINED, SUPERSEDED
from ..spool import STATS_BY_REASON_SQL, STATS_FAILING_SQL, UID_SQL, stats_from
from ..text import printable
from ._output import duration, iso, plural, size, table
from ._reading import INFLIGHT_SQL, reading
from .stats import STATUS_COUNT_SQL

#: Streams read per snapshot, oldest first: more than any terminal shows.
MAX_STREAMS = 500
#: SQLite steps between two calls of a reading's ``stop`` (a few ms of work): a long
#: reading (a million rows take seconds) still notices q or Ctrl-C at once.
STOP_STEPS = 10_000
#: One line per stream (as ``ls``), with its rows in flight and failing, and the
#: number of streams on every line (a window over the groups, so one pass counts them).
STREAMS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, count(*), sum(size),
       min(created_at), count(*) FILTER (WHERE inflight IS NOT NULL),
       count(*) FILTER (WHERE last_error IS NOT NULL), count(*) OVER ()
FROM records GROUP BY 1, 2
ORDER BY 5, session_id IS NOT NULL, session_id, 2 LIMIT :limit
"""
#: Rows ever appended: an append takes its stream's next seq (1, 2, 3, ...), so a
#: stream has had as many rows as the highest seq it handed out: the larger of its
#: highest seq still in ``records`` and the next seq ``sequences`` keeps for it, less
#: one (kept at least once its rows leave, so the sum never goes back).
APPENDED_SQL = """
SELECT coalesce(sum(last), 0) FROM (
    SELECT max(last) AS last FROM (
        SELECT 'session_id' AS stream, session_id AS name, max(seq) AS last
        FROM records WHERE session_id IS NOT NULL GROUP BY session_id
        UNION ALL
        SELECT 'session_key', session_key, max(seq) FROM records
        INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL GROUP BY session_key
        UNION ALL
        SELECT stream, name, next_seq - 1 FROM sequences
    ) GROUP BY stream, name
)
"""


class Stream(msgspec.Struct, frozen=True):
    """One stream's backlog: spooled by session id, or (``session_id`` None) by key."""

    session_id: str | None
    session_key: str | None
    rows: int
    bytes: int
    oldest: float
    inflight: int
    failing: int


class Snapshot(msgspec.Struct, frozen=True):
    """One reading of a spool, or why it could not be read (``error``)."""

    spool: str
    #: ``time.monotonic()`` and ``time.time()`` as the reading began, and its seconds.
    taken: float
    at: float
    took: float = 0.0
    error: str | None = None
    #: The spool file's identity (``spool_meta``): a new file is a new count.
    uid: str | None = None
    rows: int = 0
    sessions: int = 0
    bytes: int = 0
    oldest: float | None = None
    inflight: int = 0
    failing: int = 0
    quarantined: int = 0
    superseded: int = 0
    appended: int = 0
    db_bytes: int = 0
    wal_bytes: int = 0
    #: The oldest ``MAX_STREAMS`` streams, oldest first.
    streams: tuple[Stream, ...] = ()


class Rates(msgspec.Struct, frozen=True):
    """Rows per second between two readings ``seconds`` apart."""

    seconds: float
    appended: float
    replayed: float


def read_snapshot(
    path: Path, stop: Callable[[], bool] | None = None, *, quick_check: bool = False
) -> Snapshot:
    """A reading of the spool at ``path``; raises what ``reading`` raises.

    ``stop`` is called every ``STOP_STEPS`` steps of SQLite while it reads (and so
    is any signal handler): when it returns True the reading ends with an error.
    Without ``quick_check`` damage is found where the reading goes: every row and
    the indexes it counts with, not every page.
    """
    taken, at = time.monotonic(), time.time()
    with reading(path, quick_check=quick_check) as reader:
        snap = reader.read(lambda conn: _read(conn, path, taken, at, stop))
    return msgspec.structs.replace(snap, took=time.monotonic() - taken)


def try_snapshot(path: Path, stop: Callable[[], bool] | None = None) -> Snapshot:
    """A reading, or a snapshot saying why there is none (no spool yet, moved aside,
    damaged, unreadable); never raises for those."""
    taken, at = time.monotonic(), time.time()
    if not os.path.lexists(path):
        missing = "no spool there: not created yet, or moved aside"
        return Snapshot(str(path), taken, at, error=missing)
    try:
        return read_snapshot(path, stop)
    except (WalspoolError, OSError) as exc:
        return Snapshot(str(path), taken, at, time.monotonic() - taken, error=str(exc))


def _read(
    conn: apsw.Connection, path: Path, taken: float, at: float, stop: Callable[[], bool] | None
) -> Snapshot:
    if stop is not None:
        conn.set_progress_handler(stop, STOP_STEPS)
    try:
        with conn:  # one read transaction: every count from the same moment
            by_reason = conn.execute(STATS_BY_REASON_SQL).fetchall()
            failing = conn.execute(STATS_FAILING_SQL).get
            inflight = conn.execute(INFLIGHT_SQL).get
            by_status = dict(conn.execute(STATUS_COUNT_SQL).fetchall())
            appended = conn.execute(APPENDED_SQL).get
            uid = conn.execute(UID_SQL).get
            streams = conn.execute(STREAMS_SQL, {"limit": MAX_STREAMS}).fetchall()
    finally:
        conn.set_progress_handler(None)
    s = stats_from(by_reason, 0, failing, path)
    return Snapshot(
        spool=str(path),
        taken=taken,
        at=at,
        uid=str(uid),
        rows=s.rows,
        sessions=streams[0][-1] if streams else 0,
        bytes=s.bytes,
        oldest=s.oldest,
        inflight=inflight,
        failing=failing,
        quarantined=by_status.get(QUARANTINED, 0),
        superseded=by_status.get(SUPERSEDED, 0),
        appended=appended,
        db_bytes=s.db_bytes,
        wal_bytes=s.wal_bytes,
        streams=tuple(Stream(*row[:-1]) for row in streams),
    )


def rates(before: Snapshot | None, after: Snapshot) -> Rates | None:
    """Appended and replayed rows per second from ``before`` to ``after``.

    Appended: the growth of the rows ever appended (``APPENDED_SQL``). Replayed: the
    rows that left the spool, those appended less the growth of the row count (a
    replay moved them into state.db or found them there, or they were dropped).
    None when either reading failed, the file was replaced in between (another spool
    ``uid``), or a count went back (the spool edited by hand).
    """
    if before is None or before.error is not None or after.error is not None:
        return None
    seconds = after.taken - before.taken
    appended = after.appended - before.appended
    left = appended - (after.rows - before.rows)
    if before.uid != after.uid or seconds <= 0 or appended < 0 or left < 0:
        return None
    return Rates(seconds, appended / seconds, left / seconds)


def render(
    snap: Snapshot,
    rate: Rates | None,
    title: str,
    width: int | None = None,
    height: int | None = None,
) -> list[str]:
    """The frame: ``title`` and the time, the spool, the totals, the rates, then one
    line per stream, oldest first; at most ``height`` lines of at most ``width`` columns
    (None: no bound), streams that do not fit counted in a last ``+N more`` line."""
    head = [f"{title}  {iso(snap.at)}", f"spool        {printable(snap.spool)}"]
    if snap.error is not None:
        head += textwrap.wrap(printable(snap.error), width or 1_000_000) or [""]
        head.append("(read again at each refresh)")
        return _fitted(head, width, height)
    age = duration(max(snap.at - snap.oldest, 0.0)) if snap.oldest is not None else "-"
    head += [
        f"rows         {snap.rows:,} in {plural(snap.sessions, 'session')}, "
        f"{size(snap.bytes)}; oldest row {age} old",
        f"in flight    {snap.inflight:,}; failing {snap.failing:,} (with a last error); "
        f"quarantined {snap.quarantined:,}; superseded {snap.superseded:,}",
        "rates        " + _rates_text(rate),
        f"files        db {size(snap.db_bytes)}, WAL {size(snap.wal_bytes)}; "
        f"read in {snap.took:.2f}s",
        "",
    ]
    if not snap.streams:
        return _fitted([*head, "no rows in the spool"], width, height)
    shown = list(snap.streams)
    if height is not None:
        room = height - len(head) - 1  # the table's header line
        if room < len(shown) or snap.sessions > len(shown):
            shown = shown[: max(room - 1, 0)]  # one line for "+N more"
    headers = ("ROWS", "BYTES", "OLDEST", "IN FLIGHT", "FAILING", "SESSION")
    lines = [*head, *table(headers, [_stream_line(s, snap.at) for s in shown]).split("\n")]
    if snap.sessions > len(shown):
        lines.append(f"+{snap.sessions - len(shown):,} more sessions")
    return _fitted(lines, width, height)


def render_reading(title: str, spool: str, width: int, height: int) -> list[str]:
    """The frame before the first reading is done."""
    lines = [title, f"spool        {printable(spool)}", "reading it..."]
    return _fitted(lines, width, height)


def _rates_text(rate: Rates | None) -> str:
    if rate is None:
        return "appended -, replayed or dropped - (from the next reading)"
    return (
        f"appended {rate.appended:,.1f} rows/s, replayed or dropped {rate.replayed:,.1f} "
        f"rows/s (over the last {rate.seconds:.1f}s)"
    )


def _stream_line(s: Stream, now: float) -> tuple[Any, ...]:
    name = s.session_id if s.session_id is not None else f"key:{s.session_key}"
    return (s.rows, size(s.bytes), duration(max(now - s.oldest, 0.0)), s.inflight, s.failing, name)


def _fitted(lines: list[str], width: int | None, height: int | None) -> list[str]:
    lines = lines if height is None else lines[: max(height, 0)]
    return lines if width is None else [fit(line, width) for line in lines]


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal columns (a wide character takes two, a
    combining one none), ``…`` marking a cut."""
    if sum(map(_columns, text)) <= width:
        return text
    out, used = [], 0
    for ch in text:
        used += _columns(ch)
        if used > width - 1:
            break
        out.append(ch)
    return "".join(out) + "…" if width > 0 else ""


def _columns(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
