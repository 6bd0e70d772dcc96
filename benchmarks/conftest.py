"""Fixtures for the benchmarks, and a summary of rates and ratios at the end of a run.

``benchmarks/`` is not part of the default ``pytest`` run (``testpaths = ["tests"]``).
Files here are named ``bench_*.py``; this conftest collects them when ``benchmarks``
is given as a path, and pytest collects a file named on the command line anyway.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _jsonfile import JsonFileSpool
from report import RESULTS, format_report

import walspool


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Module | None:
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)  # named on the command line: already collected
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if RESULTS:
        terminalreporter.write_sep("-", "walspool append benchmarks: messages/s and ratios")
        terminalreporter.write_line(format_report(RESULTS))


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[walspool.Spool]:
    """A fresh ``durability="full"`` spool in ``tmp_path`` (same disk as the repo here)."""
    with walspool.Spool(tmp_path / "spool.db", durability="full") as s:
        yield s


@pytest.fixture
def jsonfile(tmp_path: Path) -> Iterator[JsonFileSpool]:
    """A fresh JSON-file-per-payload spool directory in ``tmp_path``."""
    with JsonFileSpool(tmp_path / "jsonspool") as s:
        yield s


@pytest.fixture(scope="module")
def producers(request: pytest.FixtureRequest) -> Iterator[ThreadPoolExecutor]:
    """The module's ``PRODUCERS`` threads, all started before any round is timed."""
    n = request.module.PRODUCERS
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(n, thread_name_prefix="producer") as pool:
        for f in [pool.submit(barrier.wait) for _ in range(n)]:
            f.result()
        yield pool


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop kept across rounds (its default executor too)."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
