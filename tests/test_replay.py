"""Replaying through the public API: order, holds, reasons, resolver, crashes, concurrency."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import MemorySink, child_deadline
from _helpers import read_spool as query
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import walspool
from walspool import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from walspool.replay.replayer import Replayer, ReplayReport, StreamReport
from walspool.replay.sinks import SessionDBSink
from walspool.store.records import Record

hermes_state = pytest.importorskip("hermes_state")

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).with_name("_replay_child.py")
TIMEOUT = 60


def msg(session: str, i: int) -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": f"{session}-{i}"}


@pytest.fixture
def sink() -> MemorySink:
    return MemorySink()


@pytest.fixture
def state_db(tmp_path: Path):
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    yield db
    db.close()


def contents(db: Any, session_id: str) -> list[str]:
    return [row["content"] for row in db.get_messages(session_id, include_inactive=True)]


# -- order and bookkeeping ------------------------------------------------------


def replay_dying_after(spool: walspool.Spool, sink: MemorySink, at: tuple[str, int], **kw: Any):
    """A replay whose process dies (``Crash``) right after the sink wrote ``at``
    (session id, seq): that row landed, its spool row is still in flight."""
    write = sink.write

    def write_then_die(session_id: str, record: Record, ticket: Any) -> None:
        write(session_id, record, ticket)
        if (record.session_id, record.seq) == at:
            raise Crash

    sink.write = write_then_die  # type: ignore[method-assign]
    try:
        with pytest.raises(Crash):
            Replayer(spool, sink, **kw).replay()
    finally:
        sink.write = write  # type: ignore[method-assign]


def test_rows_move_in_drop_order_per_session(spool, sink):
    spool.append_many([(s, msg(s, i)) for i in range(300) for s in ("b", "a", "c")])
    report = Replayer(spool, sink, batch_rows=64).replay()
    assert (report.moved, report.held, report.errors, report.recovered) == (900, 0, {}, 0)
    for s in ("a", "b", "c"):
        assert sink.messages(s) == [msg(s, i) for i in range(300)]
    assert report.sessions["a"] == StreamReport("a", None, moved=300, held=0)
    assert list(spool.records()) == []


def test_order_into_a_real_session_db(spool, state_db):
    for s in ("a", "b"):
        state_db.create_session(s, "telegram")
    spool.append_many([(s, msg(s, i)) for i in range(40) for s in ("a", "b")])
    report = Replayer(spool, SessionDBSink(state_db), batch_rows=16).replay()
    assert report.moved == 80
    for s in ("a", "b"):
        assert contents(state_db, s) == [f"{s}-{i}" for i in range(40)]


def test_one_spool_transaction_per_batch_not_per_row(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(1000)])
    calls = []
    execute = spool.transact
    spool.transact = lambda fn: calls.append(fn) or execute(fn)
    assert Replayer(spool, sink, batch_rows=250).replay().moved == 1000
    # take + settle per batch, then one empty take to end the session_id streams and
    # one for the session_key streams (the in-flight check is a read, no transaction)
    assert len(calls) == 2 * 4 + 2


def test_limit_caps_the_rows_written(spool, sink):
    spool.append_many([(s, msg(s, i)) for s in ("a", "b") for i in range(10)])
    replayer = Replayer(spool, sink, batch_rows=4)
    assert replayer.replay(limit=7).moved == 7
    assert sink.messages("a") == [msg("a", i) for i in range(7)]
    assert replayer.replay(limit=0).moved == 0
    assert replayer.replay().moved == 13
    assert sink.messages("b") == [msg("b", i) for i in range(10)]


def test_session_id_limits_the_replay(spool, sink):
    spool.append_many([(s, msg(s, i)) for s in ("a", "b") for i in range(3)])
    spool.append(None, "by key", session_key="k", reason=SHUTDOWN)
    report = Replayer(spool, sink, resolver=lambda key: "a").replay(session_id="b")
    assert report.moved == 3 and set(report.sessions) == {"b"}
    assert [r.session_id for r in spool.records()] == ["a", "a", "a", None]


def test_invalid_arguments(spool, sink):
    with pytest.raises(walspool.InvalidArgument, match="batch_rows"):
        Replayer(spool, sink, batch_rows=0)
    with pytest.raises(walspool.InvalidArgument, match="limit"):
        Replayer(spool, sink).replay(limit=-1)


# -- failures hold their own stream only -------------------------------------------


def test_failure_holds_later_rows_of_its_session_only(spool, sink):
    spool.append_many([(s, msg(s, i)) for i in range(5) for s in ("a", "b", "c")])
    sink.refuse = lambda sid, rec: (
        OSError("disk on fire") if sid == "b" and rec.message == msg("b", 2) else None
    )
    report = Replayer(spool, sink, batch_rows=4).replay()
    assert (report.moved, report.held) == (12, 3)
    assert report.errors == {"b": "OSError: disk on fire"}
    assert report.sessions["b"] == StreamReport(
        "b", None, moved=2, held=3, error="OSError: disk on fire"
    )
    assert sink.messages("b") == [msg("b", 0), msg("b", 1)]
    assert sink.messages("a") == [msg("a", i) for i in range(5)]
    left = list(spool.records())
    assert [(r.seq, r.attempts, r.last_error) for r in left] == [
        (3, 1, "OSError: disk on fire"),
        (4, 0, None),
        (5, 0, None),
    ]
    assert left[0].last_attempt_at is not None
    failures = query(spool, "SELECT session_id, seq, attempts, last_error FROM failures")
    assert failures == [("b", 3, 1, "OSError: disk on fire")]

    assert Replayer(spool, sink).replay().held == 3
    assert next(spool.records()).attempts == 2
    sink.refuse = lambda sid, rec: None
    assert Replayer(spool, sink).replay().moved == 3
    assert sink.messages("b") == [msg("b", i) for i in range(5)]


def test_missing_session_is_held_while_others_move(spool, state_db):
    state_db.create_session("here", "telegram")
    spool.append_many([(s, msg(s, i)) for i in range(3) for s in ("gone", "here")])
    report = Replayer(spool, SessionDBSink(state_db)).replay()
    assert (report.moved, report.held) == (3, 3)
    assert report.errors == {
        "gone": (
            "session gone does not exist in state.db (FOREIGN KEY constraint failed); "
            "replay with create_missing=True to create it"
        )
    }
    assert contents(state_db, "here") == ["here-0", "here-1", "here-2"]

    report = Replayer(spool, SessionDBSink(state_db, create_missing=True)).replay()
    assert (report.moved, report.held) == (3, 0)
    assert contents(state_db, "gone") == ["gone-0", "gone-1", "gone-2"]


def test_a_state_db_moved_away_while_open_holds_its_rows_and_says_why(spool, state_db, tmp_path):
    """state.db is renamed and another file put at its path while the replay's
    SessionDB has it open: SQLite writes nothing into either (it refuses a moved
    database), the rows are held, and the error says the file moved, not merely
    "readonly", which would send the operator to the permissions."""
    state_db.create_session("s", "cli")
    # in rollback-journal mode, as hermes runs state.db where WAL fails (NFS, SMB):
    # SQLite refuses to write a moved database there
    assert state_db._conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    spool.append_many([("s", msg("s", i)) for i in range(3)])
    path = tmp_path / "state.db"
    os.rename(path, tmp_path / "moved.db")
    other = sqlite3.connect(path)
    other.execute("CREATE TABLE mine (x)")
    other.commit()
    other.close()
    report = Replayer(spool, SessionDBSink(state_db)).replay()
    assert (report.moved, report.held) == (0, 3)
    assert "SQLITE_READONLY_DBMOVED: the database was moved" in report.errors["s"]
    assert contents(state_db, "s") == []
    with sqlite3.connect(path) as check:
        assert [r[0] for r in check.execute("SELECT name FROM sqlite_master")] == ["mine"]


def test_broken_state_db_holds_everything_until_healed(spool, state_db):
    state_db.create_session("s", "cli")
    spool.append_many([("s", msg("s", i)) for i in range(4)])
    state_db._conn.execute(
        "CREATE TRIGGER broken BEFORE INSERT ON messages BEGIN "
        "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
    )
    report = Replayer(spool, SessionDBSink(state_db)).replay()
    assert (report.moved, report.held) == (0, 4)
    assert "database disk image is malformed" in report.errors["s"]
    state_db._conn.execute("DROP TRIGGER broken")
    assert Replayer(spool, SessionDBSink(state_db)).replay().moved == 4
    assert contents(state_db, "s") == [f"s-{i}" for i in range(4)]


# -- reasons and resolution ------------------------------------------------------


def test_agent_history_is_left_alone_unless_asked_for(spool, sink):
    spool.append("s", msg("s", 0))
    spool.append("s", {"role": "user", "content": "history"}, reason=AGENT_HISTORY)
    spool.append("s", msg("s", 2), reason=SHUTDOWN)
    spool.append("s", msg("s", 3), reason="adapter_shutdown")
    assert Replayer(spool, sink).replay().moved == 3
    assert sink.messages("s") == [msg("s", 0), msg("s", 2), msg("s", 3)]
    assert [r.reason for r in spool.records()] == [AGENT_HISTORY]
    assert Replayer(spool, sink).replay(reasons=[AGENT_HISTORY]).moved == 1
    assert sink.messages("s")[-1] == {"role": "user", "content": "history"}


def test_reasons_choose_rows(spool, sink):
    spool.append("s", msg("s", 0), reason=CAP_DROP)
    spool.append("s", msg("s", 1), reason=SHUTDOWN)
    assert Replayer(spool, sink).replay(reasons=[SHUTDOWN]).moved == 1
    assert [r.reason for r in spool.records()] == [CAP_DROP]


def test_rows_by_session_key_go_through_the_resolver(spool, sink):
    spool.append(None, "one", session_key="agent:main:tg:dm:1", reason=SHUTDOWN)
    spool.append(None, "two", session_key="agent:main:tg:dm:1", reason=SHUTDOWN)
    spool.append(None, "lost", session_key="agent:main:tg:dm:2", reason=SHUTDOWN)
    spool.append("sess-1", "cap drop first")
    keys = {"agent:main:tg:dm:1": "sess-1"}
    report = Replayer(spool, sink, resolver=keys.get).replay()
    assert (report.moved, report.held) == (3, 1)
    assert sink.messages("sess-1") == ["cap drop first", "one", "two"]
    assert report.keys["agent:main:tg:dm:1"] == StreamReport(
        "sess-1", "agent:main:tg:dm:1", moved=2, held=0
    )
    assert report.key_errors == {
        "agent:main:tg:dm:2": "resolver found no session for session_key 'agent:main:tg:dm:2'"
    }
    assert report.errors == {} and list(report.sessions) == ["sess-1"]
    (left,) = spool.records()
    assert (left.session_key, left.attempts) == ("agent:main:tg:dm:2", 1)


def test_rows_by_session_key_without_a_resolver_stay(spool, sink):
    spool.append(None, "x", session_key="k", reason=SHUTDOWN)
    report = Replayer(spool, sink).replay()
    assert report.held == 1
    assert report.key_errors["k"] == (
        "rows spooled with session_key 'k' but no session_id need a resolver "
        "(Replayer(..., resolver=...)) to find their session"
    )


def test_a_resolver_that_raises_is_unresolvable(spool, sink):
    spool.append(None, "x", session_key="k", reason=SHUTDOWN)

    def resolver(key: str) -> str:
        raise LookupError(key)

    assert Replayer(spool, sink, resolver=resolver).replay().key_errors == {
        "k": "resolver found no session for session_key 'k'"
    }


def test_a_session_id_equal_to_a_key_keeps_its_own_report(spool, sink):
    """Rows spooled with session id "k" and rows spooled with only the key "k" are two
    streams: the report keeps them apart (issue 13, defect 10)."""
    spool.append_many([("k", msg("k", i)) for i in range(2)])
    spool.append_many([(None, msg("key", i), "k") for i in range(3)])
    sink.refuse = lambda sid, rec: OSError("down") if rec.session_id is None else None
    report = Replayer(spool, sink, resolver={"k": "other"}.get).replay()
    assert (report.moved, report.held) == (2, 3)
    assert report.sessions == {"k": StreamReport("k", None, moved=2, held=0)}
    assert report.keys == {"k": StreamReport("other", "k", 0, 3, "OSError: down")}
    assert (report.errors, report.key_errors) == ({}, {"k": "OSError: down"})
    assert report.streams() == [report.sessions["k"], report.keys["k"]]


# -- exactly once across crashes -------------------------------------------------


class Crash(BaseException):
    """Stands in for the process dying: nothing after it runs."""


def test_recovery_removes_what_landed_and_writes_the_rest_among_identical_rows(spool, sink):
    """Five identical messages, a crash after two landed, the same message written by
    another writer meanwhile: recovery finds exactly the two by their tickets."""
    same = {"role": "user", "content": "ok", "timestamp": 1700000000.0}
    spool.append_many([("s", same)] * 5)
    write = sink.write

    def write_then_die(session_id: str, record: Record, ticket: Any) -> None:
        write(session_id, record, ticket)
        sink.rows.append(("s", same))  # another writer, same message, same second
        if record.seq == 2:
            raise Crash

    sink.write = write_then_die  # type: ignore[method-assign]
    with pytest.raises(Crash):
        Replayer(spool, sink).replay()
    sink.write = write  # type: ignore[method-assign]
    assert query(spool, "SELECT count(*) FROM records WHERE inflight IS NOT NULL") == [(5,)]
    report = Replayer(spool, sink).replay()
    assert (report.recovered, report.moved) == (2, 3)
    assert len(sink.tickets) == 5  # each spooled row written exactly once
    assert sink.messages("s") == [same] * 7  # 5 spooled + 2 from the other writer


def test_recovery_reads_rows_in_flight_a_page_at_a_time_in_seq_order(spool, sink):
    """Eight rows of one session left in flight by a crash (two of them landed), read
    back a page of ``batch_rows`` at a time: each lookup covers one page; a failure in
    the second page holds the session with every later row still in flight (so none
    can move before them); once healed each row lands once, in seq order, before the
    rows spooled after the crash."""
    spool.append_many([("s", msg("s", i)) for i in range(8)])
    replay_dying_after(spool, sink, ("s", 2))
    spool.append_many([("s", msg("s", i)) for i in range(8, 10)])
    lookups: list[int] = []
    landed = sink.landed

    def counted(tickets: list[Any]) -> set[Any]:
        if tickets:  # a lookup, not the replayer's question whether the sink can look up
            lookups.append(len(tickets))
        return landed(tickets)

    sink.landed = counted  # type: ignore[method-assign]
    locked = sqlite3.OperationalError("database is locked")
    sink.refuse = lambda sid, rec: locked if rec.seq == 5 else None
    report = Replayer(spool, sink, batch_rows=3).replay()
    assert (report.recovered, report.moved, report.held) == (2, 2, 6)
    assert lookups == [3, 3, 1]  # a page, a page, then the failed write's own row
    inflight = "SELECT seq FROM records WHERE inflight IS NOT NULL ORDER BY seq"
    assert query(spool, inflight) == [(5,), (6,), (7,), (8,)]
    sink.refuse = lambda sid, rec: None
    lookups.clear()
    report = Replayer(spool, sink, batch_rows=3).replay()
    assert (report.recovered, report.moved, report.held) == (0, 6, 0)
    assert lookups == [3, 1]
    assert sink.contents("s") == [f"s-{i}" for i in range(10)]
    assert len(sink.tickets) == 10 and list(spool.records()) == []


def test_a_failing_probe_keeps_the_stream_in_flight(spool, sink):
    spool.append_many([("s", msg("s", 0)), ("t", msg("t", 0))])
    spool.transact(
        lambda conn: conn.execute("UPDATE records SET inflight = 0 WHERE session_id = 's'")
    )
    spool.append("s", msg("s", 1))

    def landed(tickets: list[Any]) -> set[Any]:
        raise TimeoutError("state.db unreachable")

    sink.landed = landed  # type: ignore[method-assign]
    report = Replayer(spool, sink).replay()
    assert report.moved == 1 and sink.messages("t") == [msg("t", 0)]
    assert report.held == 2
    assert report.errors["s"] == (
        "1 rows of an interrupted replay could not be checked "
        "against the sink: TimeoutError: state.db unreachable"
    )
    assert query(spool, "SELECT seq, inflight FROM records ORDER BY seq") == [(1, 0), (2, None)]


def test_an_interrupted_replay_in_process_is_recovered(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(6)])
    replay_dying_after(spool, sink, ("s", 3), batch_rows=4)
    report = Replayer(spool, sink).replay()
    assert (report.recovered, report.moved) == (3, 3)
    assert sink.messages("s") == [msg("s", i) for i in range(6)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.sampled_from("abc"), st.integers(1, 6)),
            st.tuples(
                st.just("replay"),
                st.sampled_from(["ok", "before", "after", "refuse"]),
                st.integers(1, 8),
                st.sampled_from("abc"),
            ),
        ),
        max_size=12,
    )
)
def test_model_of_append_replay_and_crash(ops):
    """Whatever appends, failures and crashes happen, a clean replay ends exactly once."""
    expected: dict[str, list[Any]] = {s: [] for s in "abc"}
    sink = MemorySink()
    with (
        tempfile.TemporaryDirectory() as tmp,
        walspool.Spool(Path(tmp) / "spool.db", durability="normal") as spool,
    ):
        replayer = Replayer(spool, sink, batch_rows=3)
        for op in ops:
            if op[0] == "append":
                _, s, n = op
                items = [{"s": s, "i": len(expected[s]) + i} for i in range(n)]
                spool.append_many([(s, m) for m in items])
                expected[s] += items
                continue
            _, kind, k, bad = op
            writes = [0]

            def refuse(sid: str, rec: Record, kind=kind, k=k, bad=bad, writes=writes) -> Any:
                writes[0] += 1
                if kind == "before" and writes[0] == k:
                    raise Crash
                if kind == "refuse" and sid == bad:
                    return RuntimeError("no")
                return None

            sink.refuse = refuse
            inner = MemorySink.write

            def write(
                self: MemorySink, sid: str, rec: Record, kind=kind, k=k, writes=writes, inner=inner
            ) -> None:
                inner(self, sid, rec)
                if kind == "after" and writes[0] == k:
                    raise Crash

            sink.write = write.__get__(sink)  # type: ignore[method-assign]
            try:
                replayer.replay()
            except Crash:
                pass
        sink.refuse = lambda sid, rec: None
        sink.write = MemorySink.write.__get__(sink)  # type: ignore[method-assign]
        report = replayer.replay()
        assert report.held == 0
        assert list(spool.records()) == []
    for s in "abc":
        assert sink.messages(s) == expected[s]


def fill_for_crash(spool_path: Path, state_path: Path, per_session: int) -> dict[str, list[str]]:
    """Three sessions in state.db, their messages interleaved in the spool."""
    db = hermes_state.SessionDB(db_path=state_path)
    for s in ("s0", "s1", "s2"):
        db.create_session(s, "telegram")
    db.close()
    expected: dict[str, list[str]] = {s: [] for s in ("s0", "s1", "s2")}
    with walspool.Spool(spool_path) as spool:
        for i in range(per_session):
            for s in expected:
                message = msg(s, i)
                if i % 3 == 0:
                    message["timestamp"] = 1_700_000_000 + i  # its own time, else spool time
                spool.append(s, message)
                expected[s].append(message["content"])
    return expected


def run_child(
    spool_path: Path, state_path: Path, crash: str | None, batch_rows: int = 8
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HERMES_HOME": str(spool_path.parent)}
    env.pop("WALSPOOL_CRASH", None)
    if crash is not None:
        env["WALSPOOL_CRASH"] = crash
    return subprocess.run(
        [sys.executable, str(CHILD), str(spool_path), str(state_path), str(batch_rows)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )


def check_exactly_once(
    spool_path: Path, state_path: Path, expected: dict[str, list[str]]
) -> ReplayReport:
    done = run_child(spool_path, state_path, None)
    assert done.returncode == 0, done.stderr
    db = hermes_state.SessionDB(db_path=state_path)
    try:
        for s, want in expected.items():
            assert contents(db, s) == want, s
    finally:
        db.close()
    with walspool.Spool(spool_path) as spool:
        assert list(spool.records()) == []
    return ReplayReport(**json.loads(done.stdout))


@pytest.mark.parametrize(
    "crash, recovered",
    [
        ("after_commit:5", 5),  # sink committed, spool delete not done, mid-batch
        ("after_commit:8", 8),  # the last row of a batch
        ("before_write:4", 3),  # in flight, the first three written
        ("after_mark:2", 0),  # the second batch marked in flight, nothing of it written
        ("during_settle:1", 8),  # the delete transaction never commits
    ],
)
def test_sigkill_at_one_point_loses_and_duplicates_nothing(tmp_path, crash, recovered):
    spool_path, state_path = tmp_path / "spool.db", tmp_path / "state.db"
    expected = fill_for_crash(spool_path, state_path, 12)
    killed = run_child(spool_path, state_path, crash)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    report = check_exactly_once(spool_path, state_path, expected)
    assert report.recovered == recovered


def test_sigkill_again_and_again_then_a_clean_replay(tmp_path):
    spool_path, state_path = tmp_path / "spool.db", tmp_path / "state.db"
    expected = fill_for_crash(spool_path, state_path, 30)
    for crash in [
        "after_commit:3",
        "before_write:6",
        "after_mark:2",
        "during_settle:1",
        "after_commit:11",
        "during_settle:2",
        "before_write:1",
        "after_commit:1",
        "after_mark:1",
        "during_settle:3",
    ]:
        killed = run_child(spool_path, state_path, crash, batch_rows=7)
        assert killed.returncode == -signal.SIGKILL, (crash, killed.stderr)
    check_exactly_once(spool_path, state_path, expected)


# -- concurrency ---------------------------------------------------------------------

APPENDER = """
import sys, walspool
spool = walspool.Spool(sys.argv[1], durability="normal")
n = int(sys.argv[2])
def part(lo, hi):
    for i in range(lo, hi):
        s = f"p{i % 4}"
        spool.append(s, {"role": "user", "content": f"{s}-{i // 4}"})
part(0, n // 2)
print("half", flush=True)
sys.stdin.readline()
part(n // 2, n)
spool.close()
"""


def test_replay_while_another_process_appends(tmp_path, state_db):
    spool_path, n = tmp_path / "spool.db", 1200
    for s in ("p0", "p1", "p2", "p3"):
        state_db.create_session(s, "cli")
    with walspool.Spool(spool_path) as spool:
        replayer = Replayer(spool, SessionDBSink(state_db), batch_rows=50)
        child = subprocess.Popen(
            [sys.executable, "-c", APPENDER, str(spool_path), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            with child_deadline(child, what="the appender"):
                assert child.stdout.readline() == "half\n"
            moved = replayer.replay().moved
            assert moved == n // 2  # the child waits for "go" after the first half
            child.stdin.write("go\n")
            child.stdin.flush()
            while child.poll() is None:
                moved += replayer.replay().moved
            assert child.wait(TIMEOUT) == 0, child.stderr.read()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(TIMEOUT)
        moved += replayer.replay().moved
    assert moved == n
    for s in range(4):
        assert contents(state_db, f"p{s}") == [f"p{s}-{i}" for i in range(n // 4)]


def test_replay_while_threads_append_and_another_replayer_runs(spool, sink):
    per, threads = 300, 4
    start = threading.Barrier(threads + 2)
    appended = threading.Event()

    def append(t: int) -> None:
        start.wait()
        for i in range(per):
            spool.append(f"t{t}", {"t": t, "i": i})

    def replay_until_done() -> None:
        start.wait()
        replayer = Replayer(spool, sink, batch_rows=32)
        while not appended.is_set():
            replayer.replay()

    appenders = [threading.Thread(target=append, args=(t,)) for t in range(threads)]
    replayers = [threading.Thread(target=replay_until_done) for _ in range(2)]
    for th in appenders + replayers:
        th.start()
    for th in appenders:
        th.join(TIMEOUT)
    appended.set()
    for th in replayers:
        th.join(TIMEOUT)
    Replayer(spool, sink).replay()
    for t in range(threads):
        assert sink.messages(f"t{t}") == [{"t": t, "i": i} for i in range(per)]


def test_a_failed_row_stays_in_flight_and_retries_cost_no_transaction(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(5)])
    sink.refuse = lambda sid, rec: OSError("down") if rec.seq == 1 else None
    assert Replayer(spool, sink).replay().held == 5
    assert query(spool, "SELECT seq FROM records WHERE inflight IS NOT NULL") == [(1,)]
    calls = []
    execute = spool.transact
    spool.transact = lambda fn: calls.append(fn) or execute(fn)
    replayer = Replayer(spool, sink, wait_for_bookkeeping=False)
    reports = [replayer.replay(session_id="s") for _ in range(3)]
    assert all(r.held == 5 and r.errors == {"s": "OSError: down"} for r in reports)
    assert calls == []  # no transaction waited for on a failed retry
    spool.transact = execute
    spool.transact_later(lambda conn: None).result(10)  # the background group has committed
    assert next(spool.records()).attempts == 4
    sink.refuse = lambda sid, rec: None
    assert Replayer(spool, sink).replay(session_id="s").moved == 5
    assert sink.messages("s") == [msg("s", i) for i in range(5)]


def test_an_agent_history_asked_for_by_reason_does_not_wedge_its_session(spool, state_db):
    state_db.create_session("s", "cli")
    spool.append("s", msg("s", 0))
    spool.append(
        "s", {"session_id": "s", "count": 1, "messages": [msg("s", 9)]}, reason=AGENT_HISTORY
    )
    spool.append("s", msg("s", 2))
    sink = SessionDBSink(state_db)
    report = Replayer(spool, sink).replay(reasons=[AGENT_HISTORY])
    assert (report.held, report.quarantined) == (0, 1)
    (kept,) = [r for r in spool.records() if r.status is not None]
    assert kept.reason == AGENT_HISTORY and "not one message" in kept.last_error
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held) == (2, 0)
    assert contents(state_db, "s") == ["s-0", "s-2"]
    assert [r.reason for r in spool.records()] == [AGENT_HISTORY]


# -- what a replay tells operators, and the paths the crash tests rarely take --------


class UntrackedSink(MemorySink):
    """A sink that cannot look tickets up: ``landed`` answers None."""

    def landed(self, tickets: list[tuple[str, int, int]]) -> None:
        return None


def crash_before_writing(spool: walspool.Spool, sink: MemorySink, **replay: Any) -> None:
    """Run a replay that dies at its first write: every row it took stays in flight."""

    def die(session_id: str, record: Record, ticket: Any) -> None:
        raise Crash

    write = sink.write
    sink.write = die  # type: ignore[method-assign]
    with pytest.raises(Crash):
        Replayer(spool, sink).replay(**replay)
    sink.write = write  # type: ignore[method-assign]


def messages_logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "walspool.replay"]


def test_a_crash_leaves_in_doubt_only_the_row_an_untracked_sink_was_handed(spool, caplog):
    spool.append_many([("s", msg("s", i)) for i in range(3)] + [("t", msg("t", 0))])
    sink = UntrackedSink()
    crash_before_writing(spool, sink)
    # Only the row handed to the sink is in flight: the rest were never taken.
    assert query(spool, "SELECT session_id, seq FROM records WHERE inflight IS NOT NULL") == [
        ("s", 1)
    ]
    spool.append("s", msg("s", 3))
    caplog.set_level("INFO", logger="walspool.replay")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held, report.quarantined, report.recovered) == (4, 0, 1, 0)
    assert report.sessions["s"] == StreamReport("s", None, moved=3, held=0, quarantined=1)
    assert report.sessions["t"] == StreamReport("t", None, moved=1, held=0, quarantined=0)
    assert sink.messages("s") == [msg("s", i) for i in (1, 2, 3)]  # the stream went on
    assert sink.messages("t") == [msg("t", 0)]
    (kept,) = spool.records()
    assert (kept.session_id, kept.seq) == ("s", 1)
    assert (kept.status, kept.attempts, kept.last_error) == (
        "quarantined",
        1,
        walspool.replay.replayer.UNKNOWN_LANDING,
    )
    assert query(spool, "SELECT count(*) FROM records WHERE inflight IS NOT NULL") == [(0,)]
    warnings = [text for level, text in messages_logged(caplog) if level == "WARNING"]
    assert warnings == [
        f"{spool.path}: quarantined row {kept.id} (session_id s, seq 1), its stream goes "
        f"on: {walspool.replay.replayer.UNKNOWN_LANDING}"
    ]


def test_landed_rows_of_several_streams_are_all_removed_and_counted(spool, sink, caplog):
    spool.append_many(
        [("a", msg("a", i)) for i in range(2)] + [("b", msg("b", i)) for i in range(3)]
    )
    replay_dying_after(spool, sink, ("b", 2))
    caplog.set_level("INFO", logger="walspool.replay")
    report = Replayer(spool, sink).replay()
    assert (report.recovered, report.moved, report.held) == (4, 1, 0)
    assert list(spool.records()) == []
    assert sink.messages("a") == [msg("a", i) for i in range(2)]
    assert sink.messages("b") == [msg("b", i) for i in range(3)]
    assert (
        "WARNING",
        (
            f"{spool.path}: interrupted replay of session_id b recovered: 2 of 3 in-flight "
            "rows had landed and were removed, the rest will be written"
        ),
    ) in messages_logged(caplog)


def test_a_limit_caps_the_rows_resumed_and_leaves_the_rest_in_flight(spool, sink):
    spool.append_many(
        [("a", msg("a", i)) for i in range(3)] + [("b", msg("b", i)) for i in range(2)]
    )
    crash_before_writing(spool, sink)
    spool.append("c", msg("c", 0))
    report = Replayer(spool, sink).replay(limit=4)
    assert (report.moved, report.held) == (4, 0)
    assert sink.messages("a") == [msg("a", i) for i in range(3)]
    assert sink.messages("b") == [msg("b", 0)] and sink.messages("c") == []
    assert query(spool, "SELECT session_id, seq FROM records WHERE inflight IS NOT NULL") == [
        ("b", 2)
    ]
    assert Replayer(spool, sink).replay(limit=0).moved == 0
    assert Replayer(spool, sink).replay().moved == 2
    assert sink.messages("b") == [msg("b", i) for i in range(2)]
    assert sink.messages("c") == [msg("c", 0)]


def test_a_write_that_raised_after_its_commit_counts_as_moved(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(3)])
    write = sink.write

    def write_then_raise(session_id: str, record: Record, ticket: Any) -> None:
        write(session_id, record, ticket)
        if record.seq == 2:
            raise OSError("connection reset after commit")

    sink.write = write_then_raise  # type: ignore[method-assign]
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held, report.errors) == (3, 0, {})
    assert list(spool.records()) == []
    assert sink.messages("s") == [msg("s", i) for i in range(3)]  # each exactly once


def test_a_failed_write_whose_probe_raises_stays_in_flight(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(2)])
    sink.refuse = lambda sid, rec: OSError("down")

    def landed(tickets: list[Any]) -> set[Any]:
        raise TimeoutError("state.db unreachable")

    sink.landed = landed  # type: ignore[method-assign]
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held, report.errors) == (0, 2, {"s": "OSError: down"})
    assert query(spool, "SELECT seq, attempts FROM records WHERE inflight IS NOT NULL") == [(1, 1)]


def test_a_failed_write_to_a_sink_that_cannot_look_it_up_is_freed(spool):
    sink = UntrackedSink()
    spool.append_many([("s", msg("s", i)) for i in range(2)])
    sink.refuse = lambda sid, rec: OSError("down")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held, report.errors) == (0, 2, {"s": "OSError: down"})
    assert query(spool, "SELECT count(*) FROM records WHERE inflight IS NOT NULL") == [(0,)]
    assert [r.attempts for r in spool.records()] == [1, 0]
    sink.refuse = lambda sid, rec: None
    assert Replayer(spool, sink).replay().moved == 2
    assert sink.messages("s") == [msg("s", i) for i in range(2)]


def test_each_quarantined_row_is_counted_and_logged(spool, sink, caplog):
    from walspool.replay.sinks import RowRejected

    spool.append_many([("s", msg("s", i)) for i in range(4)])
    sink.refuse = lambda sid, rec: RowRejected("bad row") if rec.seq in (1, 3) else None
    caplog.set_level("INFO", logger="walspool.replay")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.quarantined) == (2, 2)
    assert report.sessions["s"].quarantined == 2
    ids = [r.id for r in spool.records()]
    assert messages_logged(caplog)[:2] == [
        (
            "WARNING",
            f"{spool.path}: quarantined row {ids[0]} (session_id s, seq 1), its stream goes on: "
            "RowRejected: bad row",
        ),
        (
            "WARNING",
            f"{spool.path}: quarantined row {ids[1]} (session_id s, seq 3), its stream goes on: "
            "RowRejected: bad row",
        ),
    ]


def test_a_held_stream_is_logged_with_its_row_and_error(spool, sink, caplog):
    spool.append_many([("s", msg("s", i)) for i in range(3)])
    sink.refuse = lambda sid, rec: OSError("down") if rec.seq == 2 else None
    caplog.set_level("INFO", logger="walspool.replay")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held) == (1, 2)
    assert ("INFO", f"{spool.path}: replay of session_id s held at seq 2: OSError: down") in (
        messages_logged(caplog)
    )
    failed = [r for r in spool.records() if r.attempts]
    assert [(r.seq, r.last_error) for r in failed] == [(2, "OSError: down")]
    assert failed[0].last_attempt_at is not None


def test_a_resolver_that_raises_is_logged_with_the_key(spool, sink, caplog):
    spool.append(None, msg("k", 0), session_key="agent:main:telegram:dm:7")

    def resolver(key: str) -> str:
        raise LookupError("sessions.json unreadable")

    caplog.set_level("INFO", logger="walspool.replay")
    Replayer(spool, sink, resolver=resolver).replay()
    assert (
        "WARNING",
        "resolver failed for session_key 'agent:main:telegram:dm:7': sessions.json unreadable",
    ) in messages_logged(caplog)


def test_limits_apply_to_one_session_to_key_streams_and_across_batches(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(4)] + [("t", msg("t", 0))])
    spool.append_many([(None, msg("k", i), "k") for i in range(3)])
    replayer = Replayer(spool, sink, resolver=lambda key: "k-session", batch_rows=2)
    assert replayer.replay(session_id="s", limit=3).moved == 3
    assert sink.messages("s") == [msg("s", i) for i in range(3)]
    assert replayer.replay(limit=3).moved == 3  # s-3, t-0, then one row by key
    assert sink.messages("k-session") == [msg("k", 0)]
    assert replayer.replay(limit=1).moved == 1
    assert sink.messages("k-session") == [msg("k", 0), msg("k", 1)]


def test_session_ids_that_sort_before_letters_are_replayed(spool, sink):
    names = ["20260101_093000_ab12cd", "-100123", "A", " lead", "s"]
    spool.append_many([(name, msg(name, 0)) for name in names])
    assert Replayer(spool, sink).replay().moved == 5
    assert {s for s, _ in sink.rows} == set(names)


def test_by_default_a_failed_attempt_is_committed_before_replay_returns(spool, sink):
    spool.append("s", msg("s", 0))
    sink.refuse = lambda sid, rec: OSError("down")
    replayer = Replayer(spool, sink)
    assert replayer.wait_for_bookkeeping is True
    later = []
    execute_later = spool.transact_later
    spool.transact_later = lambda fn: later.append(fn) or execute_later(fn)
    assert replayer.replay().held == 1
    spool.transact_later = execute_later
    assert later == []  # nothing left for the writer's next group
    assert query(spool, "SELECT attempts, last_error FROM records") == [(1, "OSError: down")]


def test_quarantined_and_superseded_rows_move_only_when_asked_for(spool, sink):
    from walspool.replay.sinks import RowRejected

    spool.append_many([("q", msg("q", 0)), ("r", msg("r", 0))])
    sink.refuse = lambda sid, rec: RowRejected("bad row") if sid == "q" else None
    assert Replayer(spool, sink).replay().quarantined == 1
    spool.append("r", msg("r", 1))
    assert spool.supersede("r") == 1
    sink.refuse = lambda sid, rec: None
    assert Replayer(spool, sink).replay().moved == 0
    assert Replayer(spool, sink).replay(superseded=True).moved == 1
    assert sink.messages("r") == [msg("r", 0), msg("r", 1)] and sink.messages("q") == []
    assert Replayer(spool, sink).replay(quarantined=True).moved == 1
    assert sink.messages("q") == [msg("q", 0)]
    assert list(spool.records()) == []


def test_a_resumed_row_reaches_the_sink_as_it_did_the_first_time(spool, sink):
    """A quarantined row replayed on request, interrupted, then resumed: the sink gets
    the same record (its status included) both times."""
    from walspool.replay.sinks import RowRejected

    spool.append("s", msg("s", 0))
    sink.refuse = lambda sid, rec: RowRejected("bad row")
    Replayer(spool, sink).replay()
    seen: list[Record] = []

    def record_then_die(session_id: str, record: Record, ticket: Any) -> None:
        seen.append(record)
        raise Crash

    sink.write = record_then_die  # type: ignore[method-assign]
    with pytest.raises(Crash):
        Replayer(spool, sink).replay(quarantined=True)
    with pytest.raises(Crash):
        Replayer(spool, sink).replay()
    first, resumed = seen
    assert first.status == "quarantined"
    assert resumed == first


class ForgetfulSink(MemorySink):
    """A sink that offers ``forget``: it records what the replayer lets it drop."""

    def __init__(self) -> None:
        super().__init__()
        self.forgets: list[tuple[str, int, list[int]]] = []

    def forget(self, spool: str, below: int, keep: list[int]) -> None:
        self.forgets.append((spool, below, list(keep)))


def test_the_sink_may_forget_the_tickets_of_earlier_batches_but_those_in_flight(spool):
    sink = ForgetfulSink()
    spool.append_many([("a", msg("a", 0))] + [("b", msg("b", i)) for i in range(3)])
    sink.refuse = lambda sid, rec: OSError("down") if sid == "a" else None
    report = Replayer(spool, sink, batch_rows=2).replay()
    assert (report.moved, report.held) == (3, 1)
    # Batch 1: a-0 (ticket 1, fails, stays in flight) and b-0 (2); batch 2: b-1, b-2.
    assert sink.forgets == [(spool.uid, 1, []), (spool.uid, 3, [1])]


def test_a_held_streams_later_rows_are_skipped_not_taken(spool):
    sink = ForgetfulSink()
    spool.append_many([("a", msg("a", i)) for i in range(5)] + [("b", msg("b", 0))])
    sink.refuse = lambda sid, rec: OSError("down") if sid == "a" else None
    report = Replayer(spool, sink, batch_rows=2).replay()
    assert (report.moved, report.held) == (1, 5)
    # Batch 1: a-0 (fails) and a-1 (freed); batch 2 starts past stream a: b-0, ticket 3.
    assert sink.forgets == [(spool.uid, 1, []), (spool.uid, 3, [1])]
    assert query(spool, "SELECT session_id, seq FROM records WHERE inflight IS NOT NULL") == [
        ("a", 1)
    ]


def test_rows_freed_by_two_held_streams_in_one_batch_are_all_freed(spool, sink):
    """Stream b is held by its unverifiable leftover, stream a by a failed write: the
    later rows of both leave the batch free, only the two unsettled rows stay in flight."""
    spool.append("b", msg("b", 0))
    crash_before_writing(spool, sink)
    spool.append_many([("a", msg("a", 0)), ("a", msg("a", 1)), ("b", msg("b", 1))])

    def landed(tickets: list[Any]) -> set[Any]:
        raise TimeoutError("state.db unreachable")

    sink.landed = landed  # type: ignore[method-assign]
    sink.refuse = lambda sid, rec: OSError("down")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held) == (0, 4)
    assert query(
        spool, "SELECT session_id, seq FROM records WHERE inflight IS NOT NULL ORDER BY 1, 2"
    ) == [("a", 1), ("b", 1)]


def test_rows_freed_by_two_key_streams_in_one_batch_are_all_freed(spool, sink):
    """k1 resolves and fails at its first row (its second is freed); k2 resolves to no
    session (both its rows are freed): only k1's failed row stays in flight."""
    spool.append_many([(None, msg("k1", i), "k1") for i in range(2)])
    spool.append_many([(None, msg("k2", i), "k2") for i in range(2)])
    sink.refuse = lambda sid, rec: OSError("down")
    report = Replayer(spool, sink, resolver={"k1": "session-1"}.get).replay()
    assert (report.moved, report.held) == (0, 4)
    assert report.key_errors == {
        "k1": "OSError: down",
        "k2": "resolver found no session for session_key 'k2'",
    }
    assert query(
        spool, "SELECT session_key, seq FROM records WHERE inflight IS NOT NULL ORDER BY 1, 2"
    ) == [("k1", 1)]


def test_a_row_whose_payload_is_not_json_is_quarantined_and_its_stream_goes_on(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(3)])
    spool.transact(
        lambda conn: conn.execute("UPDATE records SET payload = '{not json' WHERE seq = 2")
    )
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held, report.quarantined) == (2, 0, 1)
    assert report.sessions["s"] == StreamReport("s", None, moved=2, held=0, quarantined=1)
    assert sink.messages("s") == [msg("s", 0), msg("s", 2)]
    (kept,) = query(spool, "SELECT id, seq, status, last_error FROM records")
    assert kept[1:3] == (2, "quarantined")
    assert kept[3].startswith(
        f"row {kept[0]} (session s, seq 2) of {spool.path} has a payload that is not valid JSON"
    )


def test_rows_freed_by_two_failing_streams_in_one_batch_are_all_freed(spool, sink):
    spool.append_many([(s, msg(s, i)) for s in ("a", "b") for i in range(2)])
    sink.refuse = lambda sid, rec: OSError("down")
    report = Replayer(spool, sink).replay()
    assert (report.moved, report.held) == (0, 4)
    assert query(
        spool, "SELECT session_id, seq FROM records WHERE inflight IS NOT NULL ORDER BY 1, 2"
    ) == [("a", 1), ("b", 1)]


def test_a_replay_finding_the_lock_held_says_by_whom_and_how_long_it_waited(spool, sink):
    from walspool.store.replay_lock import LOCK_SUFFIX, replay_lock

    spool.append("s", msg("s", 0))
    lock = Path(f"{spool.path}{LOCK_SUFFIX}")
    with replay_lock(spool):  # another replay, in this process: flock excludes it too
        with pytest.raises(walspool.ReplayBusy) as busy:
            Replayer(spool, sink).replay(wait=False)
        assert str(busy.value) == (
            f"another replay of {spool.path} is running (its lock {lock} stayed held); "
            f"try again when it ends (process {os.getpid()} holds it)"
        )
        assert busy.value.pid == os.getpid()
        with pytest.raises(walspool.ReplayBusy, match=r"stayed held for 0\.05 s\)"):
            Replayer(spool, sink).replay(wait=0.05)
    assert sink.messages("s") == []


def test_a_replay_waits_for_the_lock_within_its_bound(spool, sink, monkeypatch):
    """The other replay ends while this one waits (at its first pause): it goes on."""
    import contextlib
    import time

    from walspool.store.replay_lock import replay_lock

    spool.append("s", msg("s", 0))
    other = contextlib.ExitStack()
    other.enter_context(replay_lock(spool))
    pauses: list[float] = []
    sleep = time.sleep

    def pause_then_end_the_other(seconds: float) -> None:
        pauses.append(seconds)
        other.close()
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", pause_then_end_the_other)
    report = Replayer(spool, sink).replay(wait=0.5)
    monkeypatch.undo()
    assert report.moved == 1 and sink.messages("s") == [msg("s", 0)]
    assert pauses and 0 < pauses[0] <= 0.5


def _undecodable(spool: walspool.Spool) -> None:
    """Make every row's payload text that is not JSON (an operator's hand edit)."""
    conn = apsw.Connection(str(spool.path))
    conn.execute("UPDATE records SET payload = '{not json'")
    conn.close()


@pytest.mark.parametrize(
    "setup, summary",
    [
        (lambda spool, sink: spool.append("ok", msg("ok", 0)), "1 rows; 0 held in 0 streams, 0"),
        (
            lambda spool, sink: (
                spool.append("bad", msg("bad", 0)),
                setattr(sink, "refuse", lambda sid, rec: RuntimeError("refused")),
            ),
            "0 rows; 1 held in 1 streams, 0",
        ),
        (
            lambda spool, sink: (spool.append("q", msg("q", 0)), _undecodable(spool)),
            "0 rows; 0 held in 0 streams, 1",
        ),
        (
            lambda spool, sink: (
                spool.append_many([("ok", msg("ok", i)) for i in range(2)]),
                spool.append("bad", msg("bad", 0)),
                spool.append(None, msg("k", 0), session_key="k"),  # no resolver: held
                setattr(
                    sink,
                    "refuse",
                    lambda sid, rec: RuntimeError("refused") if sid == "bad" else None,
                ),
            ),
            "2 rows; 2 held in 2 streams, 0",
        ),
    ],
    ids=["moved", "held", "quarantined", "all"],
)
def test_a_replay_that_did_anything_ends_with_one_summary_line(spool, sink, caplog, setup, summary):
    setup(spool, sink)
    caplog.set_level("INFO", logger="walspool.replay")
    Replayer(spool, sink).replay()
    moved, rest = summary.split(" rows; ")
    assert messages_logged(caplog)[-1:] == [
        (
            "INFO",
            f"replayed {moved} rows from {spool.path} into {sink!r}; {rest} quarantined",
        )
    ]
    assert [text for _, text in messages_logged(caplog) if text.startswith("replayed ")] == [
        f"replayed {moved} rows from {spool.path} into {sink!r}; {rest} quarantined"
    ]


def test_a_replay_with_nothing_to_do_logs_nothing(spool, sink, caplog):
    caplog.set_level("DEBUG", logger="walspool.replay")
    Replayer(spool, sink).replay()
    assert messages_logged(caplog) == []


@pytest.mark.parametrize("batch_rows", [0, -1])
def test_a_replayer_needs_a_positive_batch(spool, sink, batch_rows):
    with pytest.raises(walspool.InvalidArgument) as info:
        Replayer(spool, sink, batch_rows=batch_rows)
    assert str(info.value) == f"batch_rows must be positive, not {batch_rows}"
    assert info.value.path == str(spool.path)


def test_a_batch_of_one_row_replays_every_row(spool, sink):
    spool.append_many([("s", msg("s", i)) for i in range(3)])
    assert Replayer(spool, sink, batch_rows=1).replay().moved == 3
    assert sink.messages("s") == [msg("s", i) for i in range(3)]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"limit": -1}, "limit must not be negative, not -1"),
        ({"session_id": 42}, "session_id must be a str, not int"),
        (
            {"reasons": "shutdown"},
            "reasons must be a list of reasons, not the string 'shutdown'; "
            "write reasons=['shutdown']",
        ),
    ],
)
def test_a_replay_asked_for_what_it_cannot_do_refuses_word_for_word(spool, sink, kwargs, text):
    spool.append("s", msg("s", 0))
    with pytest.raises(walspool.InvalidArgument) as info:
        Replayer(spool, sink).replay(**kwargs)
    assert str(info.value) == text
    assert info.value.path == str(spool.path)
    assert spool.stats().rows == 1 and sink.rows == []


def test_a_replay_waits_for_the_lock_by_default(spool, sink, monkeypatch):
    """Without ``wait``, a replay finding another one running waits for it (at most
    ``REPLAY_WAIT``) instead of giving up at once."""
    import contextlib
    import time

    from walspool.store.replay_lock import replay_lock

    spool.append("s", msg("s", 0))
    other = contextlib.ExitStack()
    other.enter_context(replay_lock(spool))
    sleep = time.sleep

    def pause_then_end_the_other(seconds: float) -> None:
        other.close()
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", pause_then_end_the_other)
    report = Replayer(spool, sink).replay()
    monkeypatch.undo()
    assert report.moved == 1 and sink.messages("s") == [msg("s", 0)]


def test_a_replay_lock_held_without_a_pid_says_how_to_find_the_holder(spool, sink):
    """A process that is not walspool holds the replay lock and wrote no pid in it: the
    refusal names the lock and how to find its holder, and knows no pid."""
    import fcntl

    from walspool.store.replay_lock import LOCK_SUFFIX

    spool.append("s", msg("s", 0))
    lock = Path(f"{spool.path}{LOCK_SUFFIX}")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(walspool.ReplayBusy) as info:
            Replayer(spool, sink).replay(wait=False)
    finally:
        os.close(fd)
    assert str(info.value) == (
        f"another replay of {spool.path} is running (its lock {lock} stayed held); try "
        "again when it ends, or find the process holding it (`fuser` on the lock file)"
    )
    assert (info.value.path, info.value.pid) == (str(spool.path), None)
    assert sink.rows == [] and spool.stats().rows == 1
