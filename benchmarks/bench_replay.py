"""Replay into a real ``SessionDB``, side by side with calling its ``append_message``.

Both cases write the same ``REPLAY_ROWS`` ~500-byte messages (8 sessions,
interleaved) into a fresh ``state.db`` of ``hermes-agent==0.19.0``:

- ``append_message direct``: a loop over ``SessionDB.append_message`` with keywords
  mapped beforehand, outside the timing: the physical limit (one state.db commit
  per message, FTS triggers included);
- ``sink write direct``: the same loop through ``SessionDBSink.write`` with a ticket per
  row, no spool: ``append_message`` plus what makes a landing exact (the ticket row
  the sink's trigger writes into ``walspool_landed`` in the same state.db transaction,
  one more B-tree leaf per commit). This is the floor of an exactly-once replay on a
  gateway without a batch write;
- ``replay into SessionDB``: ``Replayer(spool, SessionDBSink(db)).replay()`` over a
  spool filled beforehand (``durability="full"``), so its time includes reading and
  decoding rows, mapping each message, the in-flight marks and the spool deletes.

- ``append_messages_batch direct`` (newer gateways only, run in ``.venv-upstream``):
  the same rows written by the gateway's own batch write, per session, in chunks of
  the replayer's batch size: the limit of a replay that writes batches, which it does
  where the gateway has one (target there: at least 10x ``append_message`` direct);
- ``replay overhead only``: the same replay into a ``SessionDBSink`` over a
  ``SessionDB`` stand-in whose ``append_message`` does nothing: what walspool itself
  costs per row. On a shared disk the two state.db rounds above can differ by more
  than this overhead, so it bounds the ratio: direct / (direct + overhead).

Target (DESIGN.md section 6): replay at least 0.8x the direct rate. One round each
(a round is long); ``WALSPOOL_BENCH_REPLAY_ROWS`` changes the row count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from report import RESULTS, record

import walspool
from walspool.replay.replayer import DEFAULT_BATCH_ROWS, Replayer
from walspool.replay.sinks import SessionDBSink, append_kwargs
from walspool.store.records import Record

hermes_state = pytest.importorskip("hermes_state")

REPLAY_ROWS = int(os.environ.get("WALSPOOL_BENCH_REPLAY_ROWS", "100000"))
SESSIONS = 8
GROUP = "replay"
CONTENT = (
    "Here is the summary you asked for. The deployment finished at 14:02 UTC; all three "
    "regions report healthy, error rates are back under 0.1%, and the rollback plan is no "
    "longer needed. Two follow-ups remain: rotate the staging credentials before Friday, "
    "and update the runbook with the new canary step. I have opened tickets for both."
)


def rows() -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            f"session-{i % SESSIONS}",
            {
                "role": "assistant" if i % 2 else "user",
                "content": CONTENT,
                "timestamp": 1_717_171_717.0 + i / 1000,
                "message_id": f"m-{i}",
            },
        )
        for i in range(REPLAY_ROWS)
    ]


def fresh_state_db(path: Path) -> Any:
    db = hermes_state.SessionDB(db_path=path)
    for s in range(SESSIONS):
        db.create_session(f"session-{s}", "telegram")
    return db


def test_append_message_direct(benchmark: Any, tmp_path: Path) -> None:
    calls = [
        (sid, append_kwargs(Record(0, sid, 1, walspool.CAP_DROP, None, 0.0, m, 0, None)))
        for sid, m in rows()
    ]
    db = fresh_state_db(tmp_path / "state.db")

    def run() -> None:
        for sid, kwargs in calls:
            db.append_message(sid, **kwargs)

    benchmark.pedantic(run, rounds=1, iterations=1)
    db.close()
    _record(benchmark, "test_append_message_direct")


def test_sink_write_direct(benchmark: Any, tmp_path: Path) -> None:
    writes = [
        (sid, Record(n, sid, n + 1, walspool.CAP_DROP, None, 0.0, m, 0, None), ("bench", n, n))
        for n, (sid, m) in enumerate(rows())
    ]
    db = fresh_state_db(tmp_path / "state.db")
    sink = SessionDBSink(db)
    assert sink.set_up_tickets()  # a real SessionDB: every write records its ticket

    def run() -> None:
        for sid, rec, ticket in writes:
            sink.write(sid, rec, ticket)

    benchmark.pedantic(run, rounds=1, iterations=1)
    assert len(sink.landed([ticket for _, _, ticket in writes])) == REPLAY_ROWS
    db.close()
    _record(benchmark, "test_sink_write_direct")


def test_append_messages_batch_direct(benchmark: Any, tmp_path: Path) -> None:
    db = fresh_state_db(tmp_path / "state.db")
    if not hasattr(db, "append_messages_batch"):
        db.close()
        pytest.skip("this gateway has no batch write (hermes-agent 0.19.0)")
    by_session: dict[str, list[dict[str, Any]]] = {}
    for sid, message in rows():
        by_session.setdefault(sid, []).append(message)

    def run() -> None:
        for sid, messages in by_session.items():
            for lo in range(0, len(messages), DEFAULT_BATCH_ROWS):
                db.append_messages_batch(sid, messages[lo : lo + DEFAULT_BATCH_ROWS])

    benchmark.pedantic(run, rounds=1, iterations=1)
    db.close()
    _record(benchmark, "test_append_messages_batch_direct")


def test_replay_into_sessiondb(benchmark: Any, tmp_path: Path) -> None:
    db = fresh_state_db(tmp_path / "state.db")
    with walspool.Spool(tmp_path / "spool.db", durability="full") as spool:
        items = rows()
        for lo in range(0, len(items), 10_000):
            spool.append_many(items[lo : lo + 10_000])
        replayer = Replayer(spool, SessionDBSink(db))
        reports = []
        benchmark.pedantic(lambda: reports.append(replayer.replay()), rounds=1, iterations=1)
        assert (reports[0].moved, reports[0].held) == (REPLAY_ROWS, 0)
        assert spool.stats().rows == 0
    assert len(db.get_messages("session-0")) == REPLAY_ROWS // SESSIONS
    db.close()
    _record(benchmark, "test_replay_into_sessiondb")
    replayed = RESULTS["test_replay_into_sessiondb"]
    for baseline, key in (
        ("test_append_message_direct", "ratio_vs_direct"),
        ("test_append_messages_batch_direct", "ratio_vs_batch_direct"),
        ("test_sink_write_direct", "ratio_vs_sink_write_direct"),
    ):
        if baseline in RESULTS:
            replayed[key] = replayed["msgs_per_s"] / RESULTS[baseline]["msgs_per_s"]
            benchmark.extra_info[key] = replayed[key]


class NullSessionDB:
    """Takes every keyword ``append_message`` takes and stores nothing."""

    def append_message(self, session_id: str, role: str, **kwargs: Any) -> int:
        return 0


def test_replay_overhead_only(benchmark: Any, tmp_path: Path) -> None:
    with walspool.Spool(tmp_path / "spool.db", durability="full") as spool:
        items = rows()
        for lo in range(0, len(items), 10_000):
            spool.append_many(items[lo : lo + 10_000])
        replayer = Replayer(spool, SessionDBSink(NullSessionDB()))
        reports = []
        benchmark.pedantic(lambda: reports.append(replayer.replay()), rounds=1, iterations=1)
        assert reports[0].moved == REPLAY_ROWS
    _record(benchmark, "test_replay_overhead_only")
    direct = RESULTS.get("test_append_message_direct")
    if direct is not None:
        per_row = benchmark.stats.stats.median / REPLAY_ROWS
        bound = 1 / (1 + per_row * direct["msgs_per_s"])
        RESULTS["test_replay_overhead_only"]["ratio_bound"] = bound
        benchmark.extra_info["ratio_bound"] = bound


def _record(benchmark: Any, name: str) -> None:
    median = benchmark.stats.stats.median
    benchmark.extra_info["msgs_per_round"] = REPLAY_ROWS
    benchmark.extra_info["group"] = GROUP  # report.py reads it from the JSON file
    benchmark.extra_info["msgs_per_s"] = record(name, GROUP, REPLAY_ROWS, median)
