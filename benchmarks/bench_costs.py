"""What each per-append guarantee costs: walspool whole, walspool with one guarantee
switched off, all of them off, and the case's floor, interleaved in the same rounds.

The switches exist only here, on this benchmark's own spools (a guarantee is never
optional in walspool); each takes away one piece of per-message work the floors of
``bench_append.py`` do not do:

- ``path check``: the look at the spool's path once per group, which refuses to
  acknowledge appends into a file the next start would not open (``SpoolReplaced``);
- ``data_version``: the ``PRAGMA data_version`` per transaction that lets the writer
  keep ids and seqs across transactions only while no other connection wrote;
- ``checks and encoding``: every argument checked, each message encoded and measured
  (the floors encode one payload once, beforehand);
- ``statistics index``: the index ``stats`` and ``ls`` read instead of the rows (one
  leaf page more per commit).

Each result's ``us_per_msg_over`` is, round by round, its time per message less the
time per message of the design beside it (``whole`` less each switch-off: what that
guarantee costs; ``all off`` less the floor: walspool's own machinery, the request,
group, numbering and receipts); the median over the rounds is reported.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from bench_append import (
    BATCH,
    MESSAGE,
    PER_PRODUCER,
    PRODUCERS,
    _BareInserts,
    _HandoffFloor,
    batch,
    in_tasks,
    in_threads,
)
from report import record

import walspool
from walspool.store.writer import Row

ROUNDS = 15
SINGLE = 1_000
BATCHES = 10

WHOLE = "whole"
ALL_OFF = "all off"
FLOOR = "floor"
STATS_INDEX = "records_reason_created_at_size_session_id_session_key_idx"


def _no_path_check(spool: walspool.Spool) -> None:
    spool._writer._check = None


def _no_data_version(spool: walspool.Spool) -> None:
    spool._writer._numbers.check = lambda conn: None  # type: ignore[method-assign]


def _no_checks_or_encoding(spool: walspool.Spool) -> None:
    payload = json.dumps(MESSAGE)
    size = len(payload.encode())

    def row(session_id: str | None, message: Any, reason: str, key: str | None) -> Any:
        return Row(session_id, key, reason, time.time(), payload, size)

    def rows(items: Any, reason: str) -> list[Any]:
        now = time.time()
        return [Row(item[0], None, reason, now, payload, size) for item in items]

    spool._row = row  # type: ignore[method-assign]
    spool._rows = rows  # type: ignore[method-assign]


def _no_statistics_index(spool: walspool.Spool) -> None:
    spool.transact(lambda conn: conn.execute(f"DROP INDEX {STATS_INDEX}"))


SWITCHES: dict[str, Callable[[walspool.Spool], None]] = {
    "path check": _no_path_check,
    "data_version": _no_data_version,
    "checks and encoding": _no_checks_or_encoding,
    "statistics index": _no_statistics_index,
}


@pytest.fixture
def spools(tmp_path: Path) -> Iterator[dict[str, walspool.Spool]]:
    """A fresh ``durability="full"`` spool per design: whole, each switch off, all off."""
    out: dict[str, walspool.Spool] = {}
    try:
        for name in [WHOLE, *SWITCHES, ALL_OFF]:
            spool = out[name] = walspool.Spool(tmp_path / f"{len(out)}.db", durability="full")
            for switch, off in SWITCHES.items():
                if switch == name or name == ALL_OFF:
                    off(spool)
        yield out
    finally:
        for spool in out.values():
            spool.close()


@pytest.fixture
def inserts(tmp_path: Path) -> Iterator[_BareInserts]:
    """The floors' bare apsw INSERTs, into a file of their own."""
    floor = _BareInserts(tmp_path / "floor.db")
    try:
        yield floor
    finally:
        floor.close()


def costs(
    benchmark: Any,
    designs: dict[str, tuple[Callable[[], object], int]],
) -> None:
    """Time ``designs`` in the same rounds, taking turns (the order reversed every other
    round), and record each one's rate and its cost over the design beside it."""
    names = list(designs)
    per_msg: dict[str, list[float]] = {name: [] for name in names}

    def round_() -> None:
        order = names if len(per_msg[WHOLE]) % 2 else names[::-1]
        for name in order:
            piece, msgs = designs[name]
            start = time.perf_counter()
            piece()
            per_msg[name].append((time.perf_counter() - start) / msgs)

    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable
        return
    timed = {name: seconds[1:] for name, seconds in per_msg.items()}  # the first: warm-up
    results = {}
    for name in names:
        beside = FLOOR if name == ALL_OFF else WHOLE
        extra: dict[str, Any] = {"costs_of": name}
        if name not in (WHOLE, FLOOR):
            over = [
                (a - b if name == ALL_OFF else b - a) * 1e6
                for a, b in zip(timed[name], timed[beside], strict=True)
            ]
            extra["us_per_msg_over"] = statistics.median(over)
            extra["over"] = beside
        msgs = designs[name][1]
        median = statistics.median(timed[name]) * msgs
        rate = record(f"{benchmark.group}: {name}", benchmark.group, msgs, median, **extra)
        results[f"{benchmark.group}: {name}"] = {
            "msgs_per_round": msgs,
            "median_s": median,
            "msgs_per_s": rate,
            **extra,
        }
    benchmark.extra_info["designs"] = results


@pytest.mark.benchmark(group="costs: 1 producer")
def test_costs_1_producer(
    benchmark: Any, spools: dict[str, walspool.Spool], tmp_path: Path
) -> None:
    data = json.dumps(MESSAGE).encode() + b"\n"
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write_fsync() -> None:
        for _ in range(SINGLE):
            os.write(fd, data)
            os.fsync(fd)

    def appends(spool: walspool.Spool) -> Callable[[], None]:
        def piece() -> None:
            for _ in range(SINGLE):
                spool.append("session-0", MESSAGE)

        return piece

    designs = {name: (appends(s), SINGLE) for name, s in spools.items()}
    designs[FLOOR] = (write_fsync, SINGLE)
    try:
        costs(benchmark, designs)
    finally:
        os.close(fd)


@pytest.mark.benchmark(group="costs: 64 threads")
def test_costs_64_threads(
    benchmark: Any,
    spools: dict[str, walspool.Spool],
    producers: ThreadPoolExecutor,
    inserts: _BareInserts,
) -> None:
    msgs = PRODUCERS * PER_PRODUCER
    designs = {name: (in_threads(producers, s.append), msgs) for name, s in spools.items()}
    designs[FLOOR] = (in_threads(producers, _HandoffFloor(inserts).append), msgs)
    costs(benchmark, designs)


@pytest.mark.benchmark(group="costs: 64 asyncio tasks")
def test_costs_64_async(
    benchmark: Any, spools: dict[str, walspool.Spool], loop: Any, inserts: _BareInserts
) -> None:
    msgs = PRODUCERS * PER_PRODUCER
    designs = {name: (in_tasks(loop, s.append_async), msgs) for name, s in spools.items()}
    designs[FLOOR] = (in_tasks(loop, _HandoffFloor(inserts).append_async), msgs)
    costs(benchmark, designs)


@pytest.mark.benchmark(group="costs: append_many 1000")
def test_costs_append_many(
    benchmark: Any, spools: dict[str, walspool.Spool], inserts: _BareInserts
) -> None:
    items = batch()
    sessions = [session_id for session_id, _ in items]

    def many(spool: walspool.Spool) -> Callable[[], None]:
        def piece() -> None:
            for _ in range(BATCHES):
                spool.append_many(items)

        return piece

    def floor() -> None:
        for _ in range(BATCHES):
            inserts(sessions)

    designs = {name: (many(s), BATCHES * BATCH) for name, s in spools.items()}
    designs[FLOOR] = (floor, BATCHES * BATCH)
    costs(benchmark, designs)
