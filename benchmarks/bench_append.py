"""Durable appends: walspool side by side with the physical limit and the design it replaces.

Every benchmark appends a fixed number of ~500-byte JSON messages per round and
reports ``msgs_per_s`` (messages per round over the median round time) in
``extra_info``; pytest-benchmark's own OPS column counts rounds, not messages.
Groups put each walspool case next to its floor, in one benchmark whose rounds
alternate the two (so a change of load on a shared machine hits each), reported as
rates from their medians and the spread of the ratio over the rounds:

- ``1 producer``: walspool ``append`` and a bare ``os.write`` + ``os.fsync`` loop (one
  fsync per message, the physical limit);
- ``64 threads`` / ``64 asyncio tasks``: walspool and the hand-off into bare apsw
  INSERTs, each producer appending to its own session; beside them CPython's hand-off
  alone;
- ``batches of 1000``: walspool ``append_many``, bare apsw INSERTs of the same batches
  and the JSON-file design's loop over a batch.

The JSON-file design also runs on its own in the first three groups, for context.

Walspool cases also record commits per round (an apsw commit hook on the writer's
connection), so ``msgs_per_commit`` shows how well group commit shares fsyncs.
"""

from __future__ import annotations

import _thread
import asyncio
import json
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import apsw
import pytest
from _jsonfile import JsonFileSpool
from report import record

import walspool
from walspool.store import connections
from walspool.store.writer import INSERT_RECORD_SQL

#: About 500 bytes of JSON, shaped like a transcript message.
MESSAGE = {
    "role": "assistant",
    "content": (
        "Here is the summary you asked for. The deployment finished at 14:02 UTC; "
        "all three regions report healthy, error rates are back under 0.1%, and the "
        "rollback plan is no longer needed. Two follow-ups remain: rotate the staging "
        "credentials before Friday, and update the runbook with the new canary step. "
        "I have opened tickets for both and linked them in the channel. Anything else?"
    ),
    "timestamp": 1717171717.123456,
    "tool_calls": None,
}
MESSAGE_BYTES = len(json.dumps(MESSAGE).encode())
assert 450 <= MESSAGE_BYTES <= 550, MESSAGE_BYTES

#: Producers in the concurrent cases, each appending to its own session.
PRODUCERS = 64
SINGLE_MSGS = 2_000
PER_PRODUCER = 100
BATCH = 1_000
WALSPOOL_BATCHES = 20
#: The JSON-file loop writes ~1,500 files/s here; 2 batches keep a round near a second.
JSONFILE_BATCHES = 2
ROUNDS = 7
#: Rounds of the interleaved ``append_many`` comparison (each times both designs).
INTERLEAVED_ROUNDS = 9

#: The results the interleaved benchmarks record, one per design (``run_interleaved``).
WALSPOOL_1 = "test_walspool_1_producer"
WRITE_FSYNC = "test_write_fsync"
WALSPOOL_THREADS = "test_walspool_64_threads"
FLOOR_THREADS = "test_handoff_sql_floor_64_threads"
WALSPOOL_TASKS = "test_walspool_64_async"
FLOOR_TASKS = "test_handoff_sql_floor_64_async"
WALSPOOL_MANY = "test_walspool_append_many"
JSONFILE_MANY = "test_jsonfile_append_many"
FLOOR_MANY = "test_sql_floor_append_many"


def count_commits(spool: walspool.Spool) -> list[int]:
    """A one-item list the spool's writer connection counts its commits in."""
    count = [0]

    def on_commit() -> bool:
        count[0] += 1
        return False  # False lets the commit go ahead

    spool._conn.set_commit_hook(on_commit)
    return count


def run(
    benchmark: Any,
    fn: Callable[[], object],
    msgs: int,
    rounds: int = ROUNDS,
    spool: walspool.Spool | None = None,
) -> None:
    """Time ``rounds`` calls of ``fn`` (after one warm-up) and record the message rate."""
    commits: list[int] = []
    count = count_commits(spool) if spool is not None else [0]

    def round_() -> None:
        before = count[0]
        fn()
        commits.append(count[0] - before)

    benchmark.extra_info["msgs_per_round"] = msgs
    benchmark.extra_info["message_bytes"] = MESSAGE_BYTES
    benchmark.pedantic(round_, rounds=rounds, warmup_rounds=1, iterations=1)
    extra: dict[str, Any] = {}
    if spool is not None:
        timed = commits[1:]  # the first round is the warm-up
        extra["commits_per_round"] = sum(timed) / len(timed)
        extra["msgs_per_commit"] = msgs / extra["commits_per_round"]
        benchmark.extra_info.update(extra)
    if benchmark.stats is not None:  # None under --benchmark-disable
        rate = record(benchmark.name, benchmark.group, msgs, benchmark.stats.stats.median, **extra)
        benchmark.extra_info["msgs_per_s"] = rate


def run_interleaved(
    benchmark: Any,
    designs: dict[str, tuple[Callable[[], object], int]],
    ratio: tuple[str, str],
    rounds: int = INTERLEAVED_ROUNDS,
    pieces: int = 2,
    spool: tuple[str, walspool.Spool] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time several designs in the same rounds, alternating, and record each one's rate.

    ``designs`` maps a result name to (one piece of a round, messages in that piece).
    A round runs each design's piece ``pieces`` times, taking turns; which design goes
    first alternates from round to round (with two designs and two pieces: BABA, then
    ABAB), so a change of load on the shared machine lands on every design rather than
    on whichever benchmark ran at the time. A design's round time is the sum of its
    pieces. One warm-up round, then ``rounds`` timed.

    Each design is recorded under its own name with its median round, as ``run`` does
    (``report.py`` prints it in the benchmark's group). For ``ratio`` (numerator,
    denominator) the two rates within each round give the spread: ``round_ratios`` and
    their min, median and max, kept with the numerator's result. ``spool`` (the name of
    a walspool design, its spool) adds that design's commits per round. Returns the
    results by name, also kept in ``extra_info["designs"]``.
    """
    names = list(designs)
    times: dict[str, list[float]] = {name: [] for name in names}
    commits: list[int] = []
    count = count_commits(spool[1]) if spool is not None else [0]

    def round_() -> None:
        order = names if len(commits) % 2 else names[::-1]
        took = dict.fromkeys(names, 0.0)
        before = count[0]
        for name in order * pieces:
            piece = designs[name][0]
            start = time.perf_counter()
            piece()
            took[name] += time.perf_counter() - start
        commits.append(count[0] - before)
        for name, seconds in took.items():
            times[name].append(seconds)

    benchmark.extra_info["message_bytes"] = MESSAGE_BYTES
    benchmark.pedantic(round_, rounds=rounds, warmup_rounds=1, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: one untimed call, nothing to report
        return {}
    timed = {name: seconds[1:] for name, seconds in times.items()}  # the first: warm-up
    msgs = {name: designs[name][1] * pieces for name in names}
    extras: dict[str, dict[str, Any]] = {name: {} for name in names}
    if spool is not None:
        per_round = sum(commits[1:]) / len(commits[1:])
        extras[spool[0]] = {
            "commits_per_round": per_round,
            "msgs_per_commit": msgs[spool[0]] / per_round,
        }
    top, bottom = ratio
    round_ratios = [
        (msgs[top] / t) / (msgs[bottom] / b) for t, b in zip(timed[top], timed[bottom], strict=True)
    ]
    spread = {
        "ratio_to": bottom,
        "rounds": len(round_ratios),
        "round_ratios": round_ratios,
        "round_ratio_min": min(round_ratios),
        "round_ratio_median": statistics.median(round_ratios),
        "round_ratio_max": max(round_ratios),
    }
    extras[top].update(spread)
    results = {}
    for name in names:
        median = statistics.median(timed[name])
        rate = record(name, benchmark.group, msgs[name], median, **extras[name])
        results[name] = {
            "msgs_per_round": msgs[name],
            "round_s": timed[name],
            "median_s": median,
            "msgs_per_s": rate,
            **extras[name],
        }
    benchmark.extra_info["designs"] = results
    benchmark.extra_info["ratio_of_medians"] = (
        results[top]["msgs_per_s"] / results[bottom]["msgs_per_s"]
    )
    benchmark.extra_info.update(spread)
    return results


def in_threads(
    pool: ThreadPoolExecutor, append: Callable[[str, Any], object]
) -> Callable[[], None]:
    def produce(i: int) -> None:
        session = f"session-{i}"
        for _ in range(PER_PRODUCER):
            append(session, MESSAGE)

    def round_() -> None:
        done, _ = wait([pool.submit(produce, i) for i in range(PRODUCERS)])
        for f in done:
            f.result()

    return round_


def in_tasks(
    loop: asyncio.AbstractEventLoop, append_async: Callable[..., Any]
) -> Callable[[], None]:
    async def produce(i: int) -> None:
        session = f"session-{i}"
        for _ in range(PER_PRODUCER):
            await append_async(session, MESSAGE)

    async def all_tasks() -> None:
        await asyncio.gather(*(produce(i) for i in range(PRODUCERS)))

    return lambda: loop.run_until_complete(all_tasks())


def batch() -> list[tuple[str, Any]]:
    return [(f"session-{k % PRODUCERS}", MESSAGE) for k in range(BATCH)]


# -- one producer ----------------------------------------------------------------


# Each walspool case runs interleaved with its floor (``run_interleaved``): a change of
# load on the shared machine lands on both, and the ratio's spread round by round is
# recorded beside it.


@pytest.mark.benchmark(group="1 producer")
def test_1_producer_interleaved(benchmark: Any, spool: walspool.Spool, tmp_path: Path) -> None:
    """walspool ``append`` beside a bare ``os.write`` + ``os.fsync`` of ~500 bytes per
    message to one file (the physical limit), alternating within each round; recorded
    as ``test_walspool_1_producer`` and ``test_write_fsync``."""
    data = json.dumps(MESSAGE).encode() + b"\n"
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    half = SINGLE_MSGS // 2

    def walspool_half() -> None:
        for _ in range(half):
            spool.append("session-0", MESSAGE)

    def fsync_half() -> None:
        for _ in range(half):
            os.write(fd, data)
            os.fsync(fd)

    try:
        run_interleaved(
            benchmark,
            {WALSPOOL_1: (walspool_half, half), WRITE_FSYNC: (fsync_half, half)},
            ratio=(WALSPOOL_1, WRITE_FSYNC),
            spool=(WALSPOOL_1, spool),
        )
    finally:
        os.close(fd)


@pytest.mark.benchmark(group="1 producer")
def test_jsonfile_1_producer(benchmark: Any, jsonfile: JsonFileSpool) -> None:
    def round_() -> None:
        for _ in range(SINGLE_MSGS):
            jsonfile.append("session-0", MESSAGE)

    run(benchmark, round_, SINGLE_MSGS, rounds=5)


# -- 64 producer threads -----------------------------------------------------------


@pytest.mark.benchmark(group="64 threads")
def test_jsonfile_64_threads(
    benchmark: Any, jsonfile: JsonFileSpool, producers: ThreadPoolExecutor
) -> None:
    run(benchmark, in_threads(producers, jsonfile.append), PRODUCERS * PER_PRODUCER, rounds=5)


@pytest.mark.benchmark(group="64 threads")
def test_64_threads_interleaved(
    benchmark: Any,
    spool: walspool.Spool,
    producers: ThreadPoolExecutor,
    bare_inserts: _BareInserts,
) -> None:
    """walspool ``append`` from 64 threads beside its floor: the same threads handing
    their appends to one thread that commits each batch with bare apsw (``_HandoffFloor``
    with ``_BareInserts``); recorded as ``test_walspool_64_threads`` and
    ``test_handoff_sql_floor_64_threads``."""
    msgs = PRODUCERS * PER_PRODUCER
    run_interleaved(
        benchmark,
        {
            WALSPOOL_THREADS: (in_threads(producers, spool.append), msgs),
            FLOOR_THREADS: (in_threads(producers, _HandoffFloor(bare_inserts).append), msgs),
        },
        ratio=(WALSPOOL_THREADS, FLOOR_THREADS),
        pieces=1,
        spool=(WALSPOOL_THREADS, spool),
    )


# -- 64 asyncio tasks --------------------------------------------------------------


@pytest.mark.benchmark(group="64 asyncio tasks")
def test_jsonfile_64_async(
    benchmark: Any, jsonfile: JsonFileSpool, loop: asyncio.AbstractEventLoop
) -> None:
    """``asyncio.to_thread``: the loop's default executor (min(32, cores + 4) threads)."""
    run(benchmark, in_tasks(loop, jsonfile.append_async), PRODUCERS * PER_PRODUCER, rounds=5)


@pytest.mark.benchmark(group="64 asyncio tasks")
def test_64_async_interleaved(
    benchmark: Any,
    spool: walspool.Spool,
    loop: asyncio.AbstractEventLoop,
    bare_inserts: _BareInserts,
) -> None:
    """walspool ``append_async`` from 64 tasks beside the same floor, the tasks awaiting
    the hand-off; recorded as ``test_walspool_64_async`` and
    ``test_handoff_sql_floor_64_async``."""
    msgs = PRODUCERS * PER_PRODUCER
    floor = _HandoffFloor(bare_inserts).append_async
    run_interleaved(
        benchmark,
        {
            WALSPOOL_TASKS: (in_tasks(loop, spool.append_async), msgs),
            FLOOR_TASKS: (in_tasks(loop, floor), msgs),
        },
        ratio=(WALSPOOL_TASKS, FLOOR_TASKS),
        pieces=1,
        spool=(WALSPOOL_TASKS, spool),
    )


# -- batches of 1,000 ----------------------------------------------------------------


@pytest.mark.benchmark(group="batches of 1000")
def test_append_many_interleaved(
    benchmark: Any, spool: walspool.Spool, jsonfile: JsonFileSpool, bare_inserts: _BareInserts
) -> None:
    """walspool ``append_many``, the JSON-file loop and the same batches as bare apsw
    INSERTs (SQLite's own work for them, the floor), alternating within each round.

    Recorded as three results, ``test_walspool_append_many``,
    ``test_jsonfile_append_many`` and ``test_sql_floor_append_many`` (see
    ``run_interleaved``): each round is one JSON-file batch and half of walspool's (and
    the floor's) batches, twice over.
    """
    items = batch()
    sessions = [session_id for session_id, _ in items]

    def walspool_half() -> None:
        for _ in range(WALSPOOL_BATCHES // 2):
            spool.append_many(items)

    def jsonfile_half() -> None:
        for _ in range(JSONFILE_BATCHES // 2):
            jsonfile.append_many(items)

    def floor_half() -> None:
        for _ in range(WALSPOOL_BATCHES // 2):
            bare_inserts(sessions)

    run_interleaved(
        benchmark,
        {
            WALSPOOL_MANY: (walspool_half, WALSPOOL_BATCHES // 2 * BATCH),
            JSONFILE_MANY: (jsonfile_half, JSONFILE_BATCHES // 2 * BATCH),
            FLOOR_MANY: (floor_half, WALSPOOL_BATCHES // 2 * BATCH),
        },
        ratio=(WALSPOOL_MANY, FLOOR_MANY),
        spool=(WALSPOOL_MANY, spool),
    )


# -- where the time goes ------------------------------------------------------------
# Not targets: they bound what the 64-way cases can reach on this interpreter and disk.


class _HandoffFloor:
    """The thinnest group commit there is: queue a lock, the writer releases it.

    No SQLite, no fsync, no encoding: what is left is CPython's thread hand-off
    (one lock per caller, a condition for the writer, the GIL passed around). With
    ``commit``, the writer thread first calls ``commit(session_ids)`` for each batch it
    takes: hand-off and SQL together, with nothing of walspool's own in between.
    """

    def __init__(self, commit: Callable[[list[str]], None] | None = None) -> None:
        self._pending: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._commit = commit
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                batch = list(self._pending)
                self._pending.clear()
            if self._commit is not None:
                self._commit([session_id for session_id, _ in batch])
            loops: dict[Any, list[Any]] = {}
            for _, waiter in batch:
                if isinstance(waiter, tuple):
                    loops.setdefault(waiter[0], []).append(waiter[1])
                else:
                    waiter.release()
            for loop, futures in loops.items():
                loop.call_soon_threadsafe(_resolve_all, futures)

    def append(self, session_id: str, message: Any) -> None:
        lock = _thread.allocate_lock()
        lock.acquire()
        with self._cond:
            self._pending.append((session_id, lock))
            self._cond.notify()
        lock.acquire()

    async def append_async(self, session_id: str, message: Any) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._pending.append((session_id, (loop, future)))
            self._cond.notify()
        await future


class _BareInserts:
    """The spool's INSERTs with a bare apsw connection at ``synchronous=FULL``: one
    ``executemany`` and one commit per batch, ids and seqs counted in Python, the
    payload encoded once beforehand. SQLite's own work for a batch's shape."""

    def __init__(self, path: Path) -> None:
        walspool.Spool(path, durability="full").close()  # the schema, made by walspool
        self._conn = apsw.Connection(str(path))
        connections.set_synchronous(self._conn, "full")
        self._payload = json.dumps(MESSAGE)
        self._next_id = 1
        self._seqs: dict[str, int] = {}

    def __call__(self, session_ids: list[str]) -> None:
        rows = []
        now = time.time()
        for session_id in session_ids:
            seq = self._seqs[session_id] = self._seqs.get(session_id, 0) + 1
            rows.append((self._next_id, session_id, seq, walspool.CAP_DROP, None, now,
                         self._payload, len(self._payload)))  # fmt: skip
            self._next_id += 1
        with self._conn:
            self._conn.executemany(INSERT_RECORD_SQL, rows)

    def close(self) -> None:
        self._conn.close()


@pytest.fixture
def bare_inserts(tmp_path: Path) -> Iterator[_BareInserts]:
    inserts = _BareInserts(tmp_path / "floor.db")
    try:
        yield inserts
    finally:
        inserts.close()


def _resolve_all(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        future.set_result(None)


@pytest.mark.benchmark(group="64 threads")
def test_handoff_floor_64_threads(benchmark: Any, producers: ThreadPoolExecutor) -> None:
    run(benchmark, in_threads(producers, _HandoffFloor().append), PRODUCERS * PER_PRODUCER)


@pytest.mark.benchmark(group="64 asyncio tasks")
def test_handoff_floor_64_async(benchmark: Any, loop: asyncio.AbstractEventLoop) -> None:
    run(benchmark, in_tasks(loop, _HandoffFloor().append_async), PRODUCERS * PER_PRODUCER)


@pytest.mark.benchmark(group="groups of 64")
@pytest.mark.parametrize("sessions", [1, 64])
def test_walspool_group_of_64(benchmark: Any, spool: walspool.Spool, sessions: int) -> None:
    """The group a 64-way case commits, from one thread: rows of 1 session vs 64.

    The difference is walspool's per-session work in a transaction (next-seq lookup,
    one index leaf per session), without any thread hand-off.
    """
    items = [(f"session-{k % sessions}", MESSAGE) for k in range(PRODUCERS)]

    def round_() -> None:
        for _ in range(PER_PRODUCER):
            spool.append_many(items)

    run(benchmark, round_, PRODUCERS * PER_PRODUCER, spool=spool)
