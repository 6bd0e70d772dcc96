"""What ``walspool watch`` reads: a snapshot of the spool (with who has it open) and
the rates between two snapshots; ``_frame`` draws them. Not public API.

Reading goes through ``_reading.reading``, as every read command's does: read-only,
creating no file, holding nothing between readings.
"""

from __future__ import annotations

import difflib
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..errors import WalspoolError
from ..records import QUARANTINED, SUPERSEDED
from ..spool import STATS_BY_REASON_SQL, STATS_FAILING_SQL, UID_SQL, stats_from
from ._holders import Holder, holders
from ._reading import INFLIGHT_SQL, reading
from .ls import read_backlog
from .stats import STATUS_COUNT_SQL

#: Streams read per snapshot, oldest first: more than any terminal shows.
MAX_STREAMS = 500
#: Names looked at in a missing spool's directory for one close to its name.
NEAR_NAMES = 10_000
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


#: Each stream's latest error: the one row of the most recent failed attempt (a bare
#: column beside a lone max() comes from that row), from the index of rows with one;
#: and how many of its rows have one.
LAST_ERRORS_SQL = """
SELECT session_id, CASE WHEN session_id IS NULL THEN session_key END, last_error,
       max(last_attempt_at), count(*)
FROM records INDEXED BY records_last_error_idx WHERE last_error IS NOT NULL GROUP BY 1, 2
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
    last_error: str | None = None


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
    #: The processes that have the spool open (see ``_holders``); None: unknown here.
    open_by: tuple[Holder, ...] | None = ()
    #: When asked for (``watch --json``): the oldest ``MAX_STREAMS`` streams as ``ls
    #: --json`` gives them, each with ``failing`` and ``latest_error`` added.
    backlog: tuple[dict[str, Any], ...] | None = None


class Rates(msgspec.Struct, frozen=True):
    """Rows per second between two readings ``seconds`` apart."""

    seconds: float
    appended: float
    replayed: float


def read_snapshot(
    path: Path,
    stop: Callable[[], bool] | None = None,
    *,
    quick_check: bool = False,
    backlog: bool = False,
) -> Snapshot:
    """A reading of the spool at ``path``; raises what ``reading`` raises.

    ``stop`` is called every ``STOP_STEPS`` steps of SQLite while it reads (and so
    is any signal handler): when it returns True the reading ends with an error.
    Without ``quick_check`` damage is found where the reading goes: every row and
    the indexes it counts with, not every page. With ``backlog`` it reads the
    streams as ``ls`` does too, in the same transaction (``Snapshot.backlog``).
    """
    taken, at = time.monotonic(), time.time()
    with reading(path, quick_check=quick_check) as reader:
        snap = reader.read(lambda conn: _read(conn, path, taken, at, stop, backlog))
    found = holders(path)
    open_by = None if found is None else tuple(found)
    return msgspec.structs.replace(snap, took=time.monotonic() - taken, open_by=open_by)


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


def near_names(path: Path) -> str:
    """``; near that name: NAME, ...``: files beside a missing spool at ``path`` whose
    name is close to its name (a typo's likely target), or nothing."""
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for e in itertools.islice(entries, NEAR_NAMES)]
    except OSError:
        return ""
    near = difflib.get_close_matches(path.name, names, n=3)
    return f"; near that name: {', '.join(near)}" if near else ""


def _read(
    conn: apsw.Connection,
    path: Path,
    taken: float,
    at: float,
    stop: Callable[[], bool] | None,
    backlog: bool,
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
            errors = {(s, k): (e, n) for s, k, e, _, n in conn.execute(LAST_ERRORS_SQL)}
            listed = read_backlog(conn, at)[:MAX_STREAMS] if backlog else None
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
        streams=tuple(
            Stream(*row[:-1], errors.get((row[0], row[1]), (None, 0))[0]) for row in streams
        ),
        backlog=None if listed is None else tuple(_with_errors(b, errors) for b in listed),
    )


def _with_errors(
    stream: dict[str, Any], errors: dict[tuple[str | None, str | None], tuple[str, int]]
) -> dict[str, Any]:
    """An ``ls --json`` stream with watch's ``failing`` and ``latest_error`` added."""
    latest, failing = errors.get((stream["session_id"], stream["session_key"]), (None, 0))
    return {**stream, "failing": failing, "latest_error": latest}


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
