"""How close walspool's concurrent appends come to SQLite's own cost for their shape.

The 64-thread and 64-task cases commit groups of ~64 rows, each row of another
session. Every such row writes its own leaf of the ``(session_id, seq)`` index (the
``UNIQUE`` the spool's contract asks for), so a commit writes ~107 WAL pages where a
group of one session writes a handful. This file measures that floor side by side
with walspool, all at ``synchronous=FULL``, ~500-byte messages, 64 sessions:

- ``SQL floor``: the same INSERTs into a spool's schema with a bare apsw loop (one
  prepared ``executemany`` and one commit per group; seqs and ids computed in
  Python beforehand): no queue, no encoding, no hand-off;
- ``walspool append_many``: the same groups through ``append_many`` from one thread
  (encoding, checks, the writer's queue, seq bookkeeping);
- ``walspool 64 asyncio tasks``: each task appends to its own session (the groups
  form by themselves), as ``bench_append``'s case does.

The ratios to the floor show what walspool adds to SQLite's own work for the shape.

And the same for one producer (group ``floor, 1 producer``): a bare apsw loop of one
``INSERT`` and one commit per message into the spool's schema, beside walspool
``append``, beside ``os.write`` + ``os.fsync`` of the payload (the 0.9x target's
baseline): how much of the lone append's cost is SQLite's WAL commit of three pages.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import apsw
from report import record

import walspool
from walspool.store import connections
from walspool.store.writer import INSERT_RECORD_SQL

GROUP = "floor, 64 sessions"
SESSIONS = 64
GROUPS = 200
MESSAGE = {"role": "assistant", "content": "x" * 440, "timestamp": 1717171717.25}
PAYLOAD = json.dumps(MESSAGE, separators=(",", ":"))
NAMES = [f"session-{i:04d}-{'x' * 24}" for i in range(SESSIONS)]
ROUNDS = 5


def fresh(path: Path) -> walspool.Spool:
    return walspool.Spool(path, durability="full")


def test_sql_floor(benchmark: Any, tmp_path: Path) -> None:
    fresh(tmp_path / "spool.db").close()  # the schema, made by walspool
    conn = apsw.Connection(str(tmp_path / "spool.db"))
    connections.set_synchronous(conn, "full")
    state = {"id": 0, "seq": 0}

    def run() -> None:
        for _ in range(GROUPS):
            state["seq"] += 1
            rows = []
            for name in NAMES:
                state["id"] += 1
                rows.append(
                    (state["id"], name, state["seq"], walspool.CAP_DROP, None, time.time(),
                     PAYLOAD, len(PAYLOAD))
                )  # fmt: skip
            with conn:
                conn.executemany(INSERT_RECORD_SQL, rows)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    conn.close()
    _record(benchmark, "test_sql_floor")


def test_walspool_append_many_64_sessions(benchmark: Any, tmp_path: Path) -> None:
    with fresh(tmp_path / "spool.db") as spool:
        group = [(name, MESSAGE) for name in NAMES]

        def run() -> None:
            for _ in range(GROUPS):
                spool.append_many(group)

        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    _record(benchmark, "test_walspool_append_many_64_sessions")


def test_walspool_64_async_tasks(benchmark: Any, tmp_path: Path) -> None:
    with fresh(tmp_path / "spool.db") as spool:

        async def produce(name: str) -> None:
            for _ in range(GROUPS):
                await spool.append_async(name, MESSAGE)

        async def all_tasks() -> None:
            await asyncio.gather(*(produce(name) for name in NAMES))

        loop = asyncio.new_event_loop()
        try:
            benchmark.pedantic(
                lambda: loop.run_until_complete(all_tasks()),
                rounds=ROUNDS,
                iterations=1,
                warmup_rounds=1,
            )
        finally:
            loop.close()
    _record(benchmark, "test_walspool_64_async_tasks")


LONE = 1000


def test_sql_floor_1_producer(benchmark: Any, tmp_path: Path) -> None:
    fresh(tmp_path / "spool.db").close()
    conn = apsw.Connection(str(tmp_path / "spool.db"))
    connections.set_synchronous(conn, "full")
    state = {"id": 0}

    def run() -> None:
        for _ in range(LONE):
            state["id"] += 1
            row = (state["id"], NAMES[0], state["id"], walspool.CAP_DROP, None, time.time(),
                   PAYLOAD, len(PAYLOAD))  # fmt: skip
            with conn:
                conn.execute(INSERT_RECORD_SQL, row)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    conn.close()
    _record(benchmark, "test_sql_floor_1_producer", LONE, "floor, 1 producer")


def test_walspool_1_producer(benchmark: Any, tmp_path: Path) -> None:
    with fresh(tmp_path / "spool.db") as spool:

        def run() -> None:
            for _ in range(LONE):
                spool.append(NAMES[0], MESSAGE)

        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    _record(benchmark, "test_walspool_1_producer_floor", LONE, "floor, 1 producer")


def test_write_fsync_1_producer(benchmark: Any, tmp_path: Path) -> None:
    data = PAYLOAD.encode()
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def run() -> None:
        for _ in range(LONE):
            os.write(fd, data)
            os.fsync(fd)

    try:
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    finally:
        os.close(fd)
    _record(benchmark, "test_write_fsync_1_producer", LONE, "floor, 1 producer")


def _record(benchmark: Any, name: str, msgs: int = GROUPS * SESSIONS, group: str = GROUP) -> None:
    benchmark.extra_info["msgs_per_round"] = msgs
    # Kept for report.py reading the JSON back: these tests have no benchmark group of
    # pytest-benchmark's, and their results are named apart from bench_append's.
    benchmark.extra_info["result_name"] = name
    benchmark.extra_info["group"] = group
    benchmark.extra_info["msgs_per_s"] = record(name, group, msgs, benchmark.stats.stats.median)
