"""walspool beside the queues a user would pick instead, at the same durability.

Each library is driven like ``bench_append.py`` drives walspool (its ``MESSAGE``,
``SINGLE_MSGS``, ``PRODUCERS`` x ``PER_PRODUCER`` and ``in_threads``): one producer,
and 64 threads each appending to its own session. Each case is one peer and walspool
``append`` side by side in the same rounds (``run_interleaved``: the two take turns
within every round, so a change of load on the shared machine hits both), recorded as
two results in the case's group: ``<case>[<peer>]`` and ``<case>[<peer>]/walspool``,
the peer's with its ratio to walspool (of the medians, and round by round). Install
the peers with ``pip install -e ".[bench]"``; a peer that is not installed is skipped,
saying so.

Same durability: an acknowledged append survives power loss. walspool runs with
``durability="full"`` (``PRAGMA synchronous = FULL`` in WAL mode: the WAL is synced at
each commit). Each peer keeps its data in SQLite in WAL mode, and each is set to
``synchronous = FULL`` here, the closest honest way its API allows; read back and
checked before timing. What one ``put`` does, read in each library's source (the
versions pinned in ``pyproject.toml``'s ``bench`` extra):

- ``persist-queue`` 1.1.0, ``SQLiteAckQueue(auto_commit=True, multithreading=True)``
  (a second connection for ``put``, usable from any thread): pickles the item, then
  takes a queue-wide lock and runs one ``INSERT`` in a transaction of its own that
  commits before ``put`` returns. The table has ``AUTOINCREMENT``, so each commit also
  rewrites ``sqlite_sequence``. It sets WAL and leaves ``synchronous`` at the SQLite
  build's default (FULL for the system library here); set to FULL here on both of its
  connections all the same. No group commit: 64 threads take turns at the lock.
- ``diskcache`` 5.6.3, ``Deque.fromcache(Cache(eviction_policy="none",
  sqlite_synchronous=2))``: pickles the item; ``BEGIN IMMEDIATE``, the last key, an
  ``INSERT`` into a table with two indexes plus two triggers that update a settings
  row, the count read back, ``COMMIT``. One connection per thread; 64 threads contend
  for SQLite's write lock through its busy handler (a ``Timeout`` is retried). Its
  default is ``synchronous = NORMAL`` (1): in WAL mode a power loss may take back the
  last commits. ``sqlite_synchronous=2`` is its own setting, stored in the cache and
  applied to every thread's new connection. Values of 32 KiB and more go to files of
  their own, written without fsync: at that size FULL does not make an append durable
  (our 500-byte messages stay in SQLite).
- ``litequeue`` 0.9, ``LiteQueue``: the item must be text (``json.dumps`` here); one
  autocommit ``INSERT`` into a table with two indexes. One connection shared by every
  thread (``check_same_thread=False``; SQLite serializes it). It sets
  ``synchronous = NORMAL`` itself, with no option: ``PRAGMA synchronous = FULL`` is
  set on its ``conn`` after it opens. No group commit.

walspool stores the session id with each message; the peers have no such field, so
each peer appends the message wrapped with its session id, as a user replaying to
sessions would. Peers use the stdlib ``sqlite3`` with the system SQLite; walspool uses
the SQLite that apsw bundles. Cases of one producer also count the WAL pages one
append writes (``wal_frames_per_append``), for both designs: each is a page written
and synced per acknowledged append, besides the one fsync every design pays.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bench_append import (
    MESSAGE,
    PER_PRODUCER,
    PRODUCERS,
    ROUNDS,
    SINGLE_MSGS,
    in_threads,
    run_interleaved,
)
from report import RESULTS

import walspool

#: Appends counted for WAL pages per append: few enough that no auto-checkpoint
#: (1,000 pages) resets the WAL meanwhile.
FRAME_PROBE_APPENDS = 100
SYNCHRONOUS_FULL = 2
#: The peers, each a case of its own beside walspool.
PEERS = ["persist-queue", "diskcache", "litequeue"]
INSTALL = 'pip install -e ".[bench]"'


@dataclass
class Design:
    """One library opened for a benchmark, with what the benchmark needs of it."""

    append: Callable[[str, Any], object]
    #: The SQLite database file the appends go to (its ``-wal`` is measured).
    db: Path
    #: Runs one PRAGMA on the library's own write connection; returns its first column.
    pragma: Callable[[str], Any]
    durability: str
    spool: walspool.Spool | None = None


def _peer(module: str, package: str) -> Any:
    return pytest.importorskip(module, reason=f"{package} is not installed ({INSTALL})")


def _with_session(session_id: str, message: Any) -> dict[str, Any]:
    return {"session_id": session_id, "message": message}


def _walspool(spool: walspool.Spool) -> Design:
    return Design(
        append=spool.append,
        db=spool.path,
        pragma=lambda sql: spool._conn.execute(sql).get,
        durability='durability="full": synchronous=FULL',
        spool=spool,
    )


@contextlib.contextmanager
def _persist_queue(directory: Path) -> Iterator[Design]:
    persistqueue = _peer("persistqueue", "persist-queue")
    queue = persistqueue.SQLiteAckQueue(
        str(directory / "pq"), auto_commit=True, multithreading=True
    )
    try:
        for conn in (queue._putter, queue._getter):
            conn.execute("PRAGMA synchronous = FULL")

        def append(session_id: str, message: Any) -> None:
            queue.put(_with_session(session_id, message))

        yield Design(
            append=append,
            db=directory / "pq" / "data.db",
            pragma=lambda sql: queue._putter.execute(sql).fetchone()[0],
            durability="synchronous=FULL set on its connections (its default here too)",
        )
    finally:
        queue.close()


@contextlib.contextmanager
def _diskcache(directory: Path) -> Iterator[Design]:
    diskcache = _peer("diskcache", "diskcache")
    cache = diskcache.Cache(
        str(directory / "dc"), eviction_policy="none", sqlite_synchronous=SYNCHRONOUS_FULL
    )
    try:
        deque = diskcache.Deque.fromcache(cache)

        def append(session_id: str, message: Any) -> None:
            deque.append(_with_session(session_id, message))

        yield Design(
            append=append,
            db=directory / "dc" / diskcache.core.DBNAME,
            pragma=lambda sql: cache._sql(sql).fetchone()[0],
            durability="sqlite_synchronous=2 (FULL; its default is NORMAL)",
        )
    finally:
        cache.close()


@contextlib.contextmanager
def _litequeue(directory: Path) -> Iterator[Design]:
    litequeue = _peer("litequeue", "litequeue")
    path = directory / "litequeue.db"
    queue = litequeue.LiteQueue(str(path))
    try:
        queue.conn.execute("PRAGMA synchronous = FULL")

        def append(session_id: str, message: Any) -> None:
            queue.put(json.dumps(_with_session(session_id, message)))

        yield Design(
            append=append,
            db=path,
            pragma=lambda sql: queue.conn.execute(sql).fetchone()[0],
            durability="PRAGMA synchronous=FULL on its conn (it sets NORMAL)",
        )
    finally:
        queue.close()


OPENERS: dict[str, Callable[[Path], contextlib.AbstractContextManager[Design]]] = {
    "persist-queue": _persist_queue,
    "diskcache": _diskcache,
    "litequeue": _litequeue,
}


def _checked(design: Design) -> Design:
    assert design.pragma("PRAGMA journal_mode").lower() == "wal"
    assert design.pragma("PRAGMA synchronous") == SYNCHRONOUS_FULL
    return design


@pytest.fixture(params=PEERS)
def peer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Design]:
    """Each peer in turn, opened in ``tmp_path``, WAL and synchronous=FULL checked."""
    with OPENERS[request.param](tmp_path) as opened:
        yield _checked(opened)


@pytest.fixture
def ours(spool: walspool.Spool) -> Design:
    """walspool, the conftest's ``durability="full"`` spool, checked the same way."""
    return _checked(_walspool(spool))


def wal_frames_per_append(design: Design, appends: int = FRAME_PROBE_APPENDS) -> float:
    """WAL frames (pages) one append writes: the WAL's growth over ``appends`` appends.

    The WAL is checkpointed and truncated first, so its size afterwards is its header
    and the frames (a 24-byte header and a page each) those appends wrote.
    """
    design.pragma("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = Path(f"{design.db}-wal")
    if wal.exists() and wal.stat().st_size:
        pytest.fail(f"{wal} was not truncated by the checkpoint")
    page = design.pragma("PRAGMA page_size")
    for _ in range(appends):
        design.append("session-0", MESSAGE)
    frames = (os.path.getsize(wal) - 32) / (24 + page)
    return frames / appends


def side_by_side(
    benchmark: Any,
    peer: Design,
    ours: Design,
    piece: Callable[[Design], Callable[[], object]],
    msgs: int,
    pieces: int,
) -> tuple[str, str]:
    """Time ``piece`` (``msgs`` appends) of the peer and of walspool in the same rounds.

    Returns the two results' names: the peer's (the case's own name, with the ratio
    to walspool) and walspool's.
    """
    theirs, mine = benchmark.name, f"{benchmark.name}/walspool"
    run_interleaved(
        benchmark,
        {mine: (piece(ours), msgs), theirs: (piece(peer), msgs)},
        ratio=(theirs, mine),
        rounds=ROUNDS,
        pieces=pieces,
        spool=(mine, ours.spool) if ours.spool is not None else None,
    )
    for design in (peer, ours):
        _note(benchmark, theirs if design is peer else mine, durability=design.durability)
    return theirs, mine


def _note(benchmark: Any, name: str, **extra: Any) -> None:
    """Add to one design's result: in ``extra_info`` and at the end of the run."""
    benchmark.extra_info.get("designs", {}).get(name, {}).update(extra)
    if name in RESULTS:
        RESULTS[name].update(extra)


@pytest.mark.benchmark(group="peers: 1 producer")
def test_peer_1_producer(benchmark: Any, peer: Design, ours: Design) -> None:
    """One producer, ``SINGLE_MSGS`` appends per round, in two halves each design."""

    def piece(design: Design) -> Callable[[], None]:
        def appends() -> None:
            for _ in range(SINGLE_MSGS // 2):
                design.append("session-0", MESSAGE)

        return appends

    names = side_by_side(benchmark, peer, ours, piece, SINGLE_MSGS // 2, pieces=2)
    if benchmark.stats is not None:
        for design, name in zip((peer, ours), names, strict=True):
            _note(benchmark, name, wal_frames_per_append=wal_frames_per_append(design))


@pytest.mark.benchmark(group="peers: 64 threads")
def test_peer_64_threads(
    benchmark: Any, peer: Design, ours: Design, producers: ThreadPoolExecutor
) -> None:
    """64 threads, ``PER_PRODUCER`` appends each per round: one piece each design."""
    side_by_side(
        benchmark,
        peer,
        ours,
        lambda design: in_threads(producers, design.append),
        PRODUCERS * PER_PRODUCER,
        pieces=1,
    )
