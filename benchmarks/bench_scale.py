"""A million rows: memory stays flat, opening and ``stats`` stay fast, the WAL stays bounded.

* spooling 1,000,000 messages (~500 bytes, 64 sessions, ``append_many`` batches of
  1,000): peak RSS growth, measured with ``/proc/self/clear_refs`` + ``VmHWM``
  (target < 32 MiB);
* opening that spool (target < 0.2 s: nothing is scanned at open);
* ``Spool.stats()`` on it (target < 1 s: answered from indexes);
* 200,000 more appends while a reader keeps paging through ``records()``: the largest
  ``-wal`` file seen (bounded by checkpoints and ``journal_size_limit``).

The million-row spool is built once per run and shared by the tests in this module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _rss import peak_rss, reset_peak_rss
from report import record

import walspool

ROWS = 1_000_000
BATCH = 1_000
SESSIONS = 64
MESSAGE = {"role": "user", "content": "x" * 450, "timestamp": 1_795_000_000.0}


def _batches(n: int) -> Iterator[list[tuple[str, Any]]]:
    for start in range(0, n, BATCH):
        yield [(f"s{i % SESSIONS}", MESSAGE) for i in range(start, start + BATCH)]


@pytest.fixture(scope="module")
def million(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Spool ROWS messages once, measuring peak RSS growth while doing it."""
    path = tmp_path_factory.mktemp("scale") / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many(next(_batches(BATCH)))  # warm up: imports, caches, first pages
        before = reset_peak_rss()
        for batch in _batches(ROWS - BATCH):
            spool.append_many(batch)
        growth = peak_rss() - before
    return {"path": path, "rss_growth": growth}


@pytest.mark.benchmark(group="scale")
def test_peak_rss_over_a_million_appends(benchmark: Any, million: dict[str, Any]) -> None:
    growth_mib = million["rss_growth"] / 2**20
    benchmark.pedantic(lambda: None, rounds=1)
    benchmark.extra_info["peak_rss_growth_mib"] = growth_mib
    record(
        "test_peak_rss_over_a_million_appends", "scale", ROWS, 1.0, peak_rss_growth_mib=growth_mib
    )
    assert growth_mib < 32


@pytest.mark.benchmark(group="scale")
def test_open_a_million_row_spool(benchmark: Any, million: dict[str, Any]) -> None:
    def open_and_close() -> None:
        walspool.Spool(million["path"]).close()

    benchmark.pedantic(open_and_close, rounds=5, warmup_rounds=1)
    record("test_open_a_million_row_spool", "scale", 1, benchmark.stats.stats.median)
    assert benchmark.stats.stats.median < 0.2


@pytest.mark.benchmark(group="scale")
def test_stats_on_a_million_rows(benchmark: Any, million: dict[str, Any]) -> None:
    with walspool.Spool(million["path"]) as spool:
        stats = benchmark.pedantic(spool.stats, rounds=3, warmup_rounds=1)
    record("test_stats_on_a_million_rows", "scale", 1, benchmark.stats.stats.median)
    assert stats.rows == ROWS and stats.sessions == SESSIONS
    assert benchmark.stats.stats.median < 1.0


@pytest.mark.benchmark(group="scale")
def test_wal_bounded_while_a_reader_pages(benchmark: Any, tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    wal = Path(f"{path}-wal")
    largest = 0
    with walspool.Spool(path, durability="normal") as spool:
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                for _ in spool.records(session_id="s1"):
                    pass

        def write() -> None:
            nonlocal largest
            for batch in _batches(200_000):
                spool.append_many(batch)
                largest = max(largest, wal.stat().st_size)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            benchmark.pedantic(write, rounds=1)
        finally:
            done.set()
            reader.join(60)
    mib = largest / 2**20
    benchmark.extra_info["largest_wal_mib"] = mib
    record(
        "test_wal_bounded_while_a_reader_pages",
        "scale",
        200_000,
        benchmark.stats.stats.median,
        largest_wal_mib=mib,
    )
    assert mib < 96
