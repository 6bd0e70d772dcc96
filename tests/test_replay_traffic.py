"""Exactly once on the traffic the gateway really sends, on hermes-agent 0.19.0's SessionDB.

Every row of an agent turn carries one timestamp; platform user messages carry whole
seconds; users send the same text twice within a second; /retry, /undo and /compress
rewrite transcripts; other writers hold state.db's lock. A replay that guessed "did
this land?" from look-alike rows lost or duplicated messages on each of these; these
tests make each happen for real (a second process holding the lock, a SIGKILL, a
time-zone change between processes) and count every row.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import ROOT, run_python
from _lock_holder import write_lock_held

import walspool
from walspool.cli import main
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import SessionDBSink, rejects_content

hermes_state = pytest.importorskip("hermes_state")

TURN = 1_767_225_600.0  # one agent turn's timestamp, shared by all its rows
REPLAY_CHILD = ROOT / "tests" / "_replay_child.py"


def tool(content: str, ts: float = TURN) -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": f"call-{content}", "timestamp": ts}


def rows(db: Any, session_id: str) -> list[tuple[str, Any, float]]:
    return [(m["role"], m["content"], m["timestamp"]) for m in db.get_messages(session_id)]


def quick_to_give_up(db: Any) -> None:
    """Make SessionDB give up on a held lock at once instead of after ~16 s."""
    db._WRITE_MAX_RETRIES = 1
    with db._lock:
        db._conn.execute("PRAGMA busy_timeout = 50")


class LockAfterFirstWrite:
    """Wraps a sink: after its first successful write, another process takes
    state.db's write lock (held until ``release``)."""

    def __init__(self, sink: SessionDBSink, state_path: Path) -> None:
        self.sink = sink
        self.state_path = state_path
        self.holder: Any = None
        self._lock_cm: Any = None

    def write(self, session_id: str, record: Any, ticket: Any) -> None:
        self.sink.write(session_id, record, ticket)
        if self._lock_cm is None:
            self._lock_cm = write_lock_held(self.state_path)
            self.holder = self._lock_cm.__enter__()

    def landed(self, tickets: Any) -> Any:
        return self.sink.landed(tickets)

    def forget(self, *args: Any) -> None:
        self.sink.forget(*args)

    def release(self) -> None:
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)


# -- a failed write inside a same-timestamp turn -----------------------------------------


def test_a_write_failing_halfway_through_a_turn_loses_nothing(tmp_path, spool, session_db):
    """A and B: two tool results of one turn (same role, same timestamp). A lands; a
    second process holds state.db's lock, so B fails. The next replay writes B once."""
    session_db.create_session("s", "telegram")
    quick_to_give_up(session_db)
    spool.append_many([("s", tool("A")), ("s", tool("B"))])
    sink = LockAfterFirstWrite(SessionDBSink(session_db), tmp_path / "state.db")
    try:
        report = Replayer(spool, sink).replay()
    finally:
        sink.release()
    assert (report.moved, report.held) == (1, 1)
    assert "locked" in report.errors["s"]
    report = Replayer(spool, SessionDBSink(session_db)).replay()
    assert (report.moved, report.held, report.recovered) == (1, 0, 0)
    assert rows(session_db, "s") == [("tool", "A", TURN), ("tool", "B", TURN)]
    assert list(spool.records()) == []


def test_a_rewrite_between_the_failed_write_and_the_retry_loses_nothing(
    tmp_path, spool, session_db
):
    """/retry rewrites the transcript (A re-inserted above any old mark) before the
    retry: B is still written, exactly once, and A is not written again."""
    session_db.create_session("s", "telegram")
    quick_to_give_up(session_db)
    spool.append_many([("s", tool("A")), ("s", tool("B"))])
    sink = LockAfterFirstWrite(SessionDBSink(session_db), tmp_path / "state.db")
    try:
        Replayer(spool, sink).replay()
    finally:
        sink.release()
    kept = [{"role": r, "content": c, "timestamp": t} for r, c, t in rows(session_db, "s")]
    session_db.replace_messages("s", [{"role": "user", "content": "hi", "timestamp": TURN}, *kept])
    report = Replayer(spool, SessionDBSink(session_db)).replay()
    assert (report.moved, report.recovered) == (1, 0)
    assert [c for _, c, _ in rows(session_db, "s")] == ["hi", "A", "B"]


def test_the_same_message_twice_in_one_second_lands_twice(tmp_path, spool_path, session_db):
    """Identical role, content and whole-second time; the replay is killed right after
    the first one committed. Recovery removes that one and writes the second."""
    session_db.create_session("s", "telegram")
    same = {"role": "user", "content": "ok", "timestamp": 1_767_225_600}
    with walspool.Spool(spool_path) as spool:
        spool.append_many([("s", same), ("s", same)])
    killed = replay_child(spool_path, tmp_path / "state.db", crash="after_commit:1")
    assert killed.returncode == -signal.SIGKILL
    assert [c for _, c, _ in rows(session_db, "s")] == ["ok"]
    with walspool.Spool(spool_path) as spool:
        report = Replayer(spool, SessionDBSink(session_db)).replay()
    assert (report.moved, report.recovered) == (1, 1)
    assert [c for _, c, _ in rows(session_db, "s")] == ["ok", "ok"]


# -- crashes ----------------------------------------------------------------------------


def replay_child(
    spool_path: Path, state_path: Path, crash: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPLAY_CHILD), str(spool_path), str(state_path), "16"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "WALSPOOL_CRASH": crash, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_crash_after_the_mark_while_another_writer_adds_a_look_alike(
    tmp_path, spool_path, session_db
):
    """Killed after its rows were marked in flight, before any write; meanwhile the
    gateway writes a user message of the same role and second. Recovery must not take
    that message for the spooled one."""
    session_db.create_session("s", "telegram")
    spooled = {"role": "user", "content": "spooled", "timestamp": 1_767_225_600}
    with walspool.Spool(spool_path) as spool:
        spool.append("s", spooled)
    killed = replay_child(spool_path, tmp_path / "state.db", crash="after_mark:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    session_db.append_message("s", "user", "live, same second", timestamp=1_767_225_600)
    with walspool.Spool(spool_path) as spool:
        assert spool.stats().rows == 1
        report = Replayer(spool, SessionDBSink(session_db)).replay()
        assert (report.moved, report.recovered) == (1, 0)
    assert sorted(c for _, c, _ in rows(session_db, "s")) == ["live, same second", "spooled"]


def test_a_naive_time_is_read_once_in_the_appending_zone(tmp_path, spool_path, session_db):
    """A platform event stamped with a naive ``datetime.now()`` in Tokyo, spooled and
    replayed there by a replay killed right after the commit; ``walspool replay`` then
    runs in UTC. The message is in state.db once, at its Tokyo time."""
    session_db.create_session("s", "telegram")
    append = run_python(
        "import datetime, sys, walspool\n"
        "from gateway.platforms.base import MessageEvent\n"
        "event = MessageEvent(text='from Tokyo', timestamp=datetime.datetime(2026, 1, 1, 9, 0))\n"
        "with walspool.Spool(sys.argv[1]) as spool:\n"
        "    spool.append('s', event, reason=walspool.SHUTDOWN)\n",
        str(spool_path),
        env={"TZ": "Asia/Tokyo"},
    )
    assert append.returncode == 0, append.stderr
    killed = replay_child(
        spool_path, tmp_path / "state.db", crash="after_commit:1", env={"TZ": "Asia/Tokyo"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    session_db.close()
    done = run_python(
        "import sys\nfrom walspool.cli import main\nsys.exit(main(sys.argv[1:]))",
        "replay", str(spool_path), "--into", str(tmp_path / "state.db"), "--json",
        env={"TZ": "UTC"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["moved"], report["recovered"]) == (0, 1)
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    try:
        tokyo_nine = datetime.datetime(2026, 1, 1, 0, 0, tzinfo=datetime.UTC).timestamp()
        assert rows(db, "s") == [("user", "from Tokyo", tokyo_nine)]
    finally:
        db.close()


# -- rows state.db refuses for their content --------------------------------------------


def provoke(db: Any, tmp_path: Path, case: str) -> BaseException:
    """Make 0.19.0's ``append_message`` raise one of the errors it can raise."""
    db.create_session("s", "cli")
    kwargs: dict[str, Any] = {"session_id": "s", "role": "user", "content": "x"}
    if case == "integer beyond 64 bits":
        kwargs["content"] = 2**70
    elif case == "dict in a text column":
        kwargs["tool_name"] = {"name": "search"}
    elif case == "no role":
        kwargs["role"] = None
    elif case == "too big":
        with db._lock:
            db._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1000)
        kwargs["content"] = "x" * 5000
    elif case == "missing session":
        kwargs["session_id"] = "nobody"
    elif case == "locked":
        quick_to_give_up(db)
        holder = write_lock_held(tmp_path / "state.db")
        holder.__enter__()
        try:
            db.append_message(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - the error is the result
            return exc
        finally:
            holder.__exit__(None, None, None)
    elif case == "malformed":
        with db._lock:
            db._conn.execute(
                "CREATE TRIGGER broken BEFORE INSERT ON messages "
                "BEGIN SELECT RAISE(ABORT, 'database disk image is malformed'); END"
            )
    elif case == "disk full":
        with db._lock:
            pages = db._conn.execute("PRAGMA page_count").fetchone()[0]
            db._conn.execute(f"PRAGMA max_page_count = {pages}")
        kwargs["content"] = "x" * 100_000
    elif case == "read-only":
        db = hermes_state.SessionDB(db_path=tmp_path / "state.db", read_only=True)
    elif case == "closed":
        db.close()
    try:
        db.append_message(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return exc
    raise AssertionError(f"{case}: append_message did not fail")


CONTENT = ["integer beyond 64 bits", "dict in a text column", "no role", "too big"]
STATE = ["missing session", "locked", "malformed", "disk full", "read-only", "closed"]


@pytest.mark.parametrize("case", CONTENT + STATE)
def test_the_classifier_on_every_error_append_message_raises(tmp_path, session_db, case):
    exc = provoke(session_db, tmp_path, case)
    assert rejects_content(exc) is (case in CONTENT), f"{case}: {type(exc).__name__}: {exc}"


def test_values_a_text_column_cannot_take_land_as_their_json_text(spool, session_db):
    session_db.create_session("s", "cli")
    spool.append("s", {"role": "user", "content": 2**70})
    spool.append("s", {"role": "tool", "content": "r", "tool_name": {"name": "search"}})
    report = Replayer(spool, SessionDBSink(session_db)).replay()
    assert (report.moved, report.quarantined) == (2, 0)
    landed = session_db.get_messages("s")
    assert landed[0]["content"] == str(2**70)
    assert json.loads(landed[1]["tool_name"]) == {"name": "search"}


def test_a_row_refused_for_its_content_is_quarantined_and_its_session_goes_on(
    tmp_path, spool, spool_path, session_db
):
    """A row without a role (NOT NULL in state.db) between two good ones: it is kept,
    visible to operators, its session goes on; once fixed with the sqlite3 shell,
    ``walspool replay --quarantined`` moves it."""
    session_db.create_session("s", "cli")
    spool.append("s", {"role": "user", "content": "before"})
    spool.append("s", {"role": None, "content": "roleless"})
    spool.append("s", {"role": "user", "content": "after"})
    report = Replayer(spool, SessionDBSink(session_db)).replay()
    assert (report.moved, report.held, report.quarantined) == (2, 0, 1)
    assert [m["content"] for m in session_db.get_messages("s")] == ["before", "after"]
    (kept,) = spool.records()
    assert kept.status == walspool.QUARANTINED and "NOT NULL" in kept.last_error
    assert Replayer(spool, SessionDBSink(session_db)).replay().moved == 0  # stays aside
    spool.close()
    session_db.close()
    fixed = subprocess.run(
        ["sqlite3", str(spool_path),
         "UPDATE records SET payload = json_set(payload, '$.role', 'user') WHERE seq = 2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    argv = ["replay", str(spool_path), "--into", str(tmp_path / "state.db"), "--json"]
    assert main(argv) == 0  # without --quarantined: nothing to do
    assert main([*argv, "--quarantined"]) == 0
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    try:
        assert [m["content"] for m in db.get_messages("s")] == ["before", "after", "roleless"]
    finally:
        db.close()
    conn = apsw.Connection(str(spool_path), flags=apsw.SQLITE_OPEN_READONLY)
    assert conn.execute("SELECT count(*) FROM records").get == 0
    conn.close()


def test_one_bad_message_never_blocks_its_session_in_the_linked_gateway(store, spool):
    """Linked into the real store: a message state.db cannot take as it is, then 400
    normal ones. Every one of the 400 lands, in order."""
    from walspool.hermes import install

    store._db.create_session("s", "telegram")
    link = install(store, spool)
    assert link.wait_idle(30)
    store.append_to_transcript("s", {"role": "user", "content": 2**70})
    for i in range(400):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    assert link.wait_idle(30)
    link.recover()
    contents = [m["content"] for m in store._db.get_messages("s")]
    assert [c for c in contents if c.startswith("m")] == [f"m{i}" for i in range(400)]


def test_a_write_failing_halfway_through_a_turn_in_the_linked_gateway(tmp_path, store, spool):
    """The same turn through the gateway link: A and B spooled by an earlier run, the
    session's next live message C drains them; B fails on a lock another process
    holds. Once the lock is gone the link retries by itself: A, B, C, each once."""
    from walspool.hermes import install

    store._db.create_session("s", "telegram")
    quick_to_give_up(store._db)
    spool.append_many([("s", tool("A")), ("s", tool("B"))])
    link = install(store, spool, recover=False, retry_interval=0.2)
    sink = LockAfterFirstWrite(link.replayer.sink, tmp_path / "hermes" / "state.db")
    link.replayer.sink = sink
    try:
        store.append_to_transcript("s", tool("C"))
        assert [c for _, c, _ in rows(store._db, "s")] == ["A"]  # B held, C waits behind
    finally:
        sink.release()
    assert link.wait_idle(30)
    assert rows(store._db, "s") == [("tool", c, TURN) for c in "ABC"]
    assert list(spool.records()) == []


def test_ticket_records_do_not_pile_up_in_state_db(spool, session_db):
    """Each replay's later batches prune the records of rows already gone from the
    spool: after many batches state.db keeps only the last batch's records."""
    session_db.create_session("s", "telegram")
    for round_ in range(3):
        spool.append_many([("s", tool(f"{round_}-{i}")) for i in range(40)])
        assert Replayer(spool, SessionDBSink(session_db), batch_rows=8).replay().moved == 40
    with session_db._lock:
        left = session_db._conn.execute("SELECT count(*) FROM walspool_landed").fetchone()[0]
    assert 0 < left <= 8
    assert len(session_db.get_messages("s")) == 120
