"""What ``walspool watch`` reads: a snapshot of the spool (with who has it open) and
the rates between two snapshots; ``_frame`` draws them. Not public API.

Reading goes through ``_reading.reading``, as every read command's does: read-only,
creating no file, holding nothing between readings.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import apsw
import msgspec

from ..errors import WalspoolError
from ..store import memory, totals
from ..store.backlog import Line, iter_lines
from ..store.connections import stoppable
from ..store.records import QUARANTINED, SUPERSEDED
from ._holders import Holder, holders
from ._reading import reading
from ._streams import backlog_object, latest_error, write_array

#: Streams read per snapshot, oldest first: more than any terminal shows.
MAX_STREAMS = 500
#: SQLite steps between two calls of a reading's ``stop`` (a few ms of work): a long
#: reading (a million rows take seconds) still notices q or Ctrl-C at once.
STOP_STEPS = 10_000


class Stream(msgspec.Struct, frozen=True):
    """One stream's backlog: spooled by session id, or (``session_id`` None) by key;
    its name and latest error at most ``backlog.CHARS`` characters (the frame shows
    less)."""

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
    #: What linked gateway processes published as held in memory (``store.memory``).
    memory: tuple[memory.Published, ...] = ()


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
    streams: IO[str] | None = None,
) -> Snapshot:
    """A reading of the spool at ``path``; raises what ``reading`` raises.

    ``stop`` is called every ``STOP_STEPS`` steps of SQLite while it reads (and so
    is any signal handler): when it returns True the reading ends with an error.
    Without ``quick_check`` damage is found where the reading goes: every row and
    the indexes it counts with, not every page. With ``streams`` it writes there, in
    the same transaction, the ``watch --json`` streams: a JSON array of the oldest
    ``MAX_STREAMS`` streams, each its ``ls --json`` object with ``failing`` and
    ``latest_error``, names and errors whole, one object held at a time.
    """
    taken, at = time.monotonic(), time.time()
    with reading(path, quick_check=quick_check) as reader:
        snap = reader.read(lambda conn: _read(conn, path, taken, at, stop, streams))
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


def _read(
    conn: apsw.Connection,
    path: Path,
    taken: float,
    at: float,
    stop: Callable[[], bool] | None,
    out: IO[str] | None,
) -> Snapshot:
    # One read transaction: every count from the same moment.
    with stoppable(conn, stop, STOP_STEPS), conn:
        s = totals.stats(conn, path)
        inflight = totals.in_flight_rows(conn)
        by_status = totals.by_status(conn)
        appended = totals.appended(conn)
        uid = totals.uid(conn)
        held = memory.read(conn)
        # The oldest lines only: the sessions are counted by the totals, not by
        # reading each one's line (and its errors) to drop it.
        with contextlib.closing(iter_lines(conn)) as lines:
            oldest = list(itertools.islice(lines, MAX_STREAMS))
        if out is not None:
            write_array(out, (_json_stream(conn, line, at) for line in oldest))
    return Snapshot(
        spool=str(path),
        taken=taken,
        at=at,
        uid=str(uid),
        rows=s.rows,
        sessions=s.sessions,
        bytes=s.bytes,
        oldest=s.oldest,
        inflight=inflight,
        failing=s.failing,
        quarantined=by_status.get(QUARANTINED, 0),
        superseded=by_status.get(SUPERSEDED, 0),
        appended=appended,
        db_bytes=s.db_bytes,
        wal_bytes=s.wal_bytes,
        streams=tuple(_stream(line) for line in oldest),
        memory=tuple(held),
    )


def _stream(line: Line) -> Stream:
    return Stream(
        line.session_id, line.session_key, line.rows, line.bytes, line.oldest, line.inflight,
        line.failing, line.latest_error,
    )  # fmt: skip


def _json_stream(conn: apsw.Connection, line: Line, now: float) -> dict[str, Any]:
    """A ``watch --json`` stream: ``line``'s ``ls --json`` object with ``failing`` and
    ``latest_error`` (whole, as its name and first error)."""
    listed = backlog_object(conn, line, now)
    latest = latest_error(conn, line, listed["last_error"])
    return {**listed, "failing": line.failing, "latest_error": latest}


def rates(before: Snapshot | None, after: Snapshot) -> Rates | None:
    """Appended and replayed rows per second from ``before`` to ``after``.

    Appended: the growth of the rows ever appended (``totals.appended``). Replayed: the
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
