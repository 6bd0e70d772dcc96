"""The drop-in functions, matching upstream shutdown_flush behaviour on the spool."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from _helpers import STEP, run_python
from _lock_holder import replay_lock_held

import walspool
from walspool import AGENT_HISTORY, CAP_DROP
from walspool import shutdown_flush as sf

hermes_state = pytest.importorskip("hermes_state")


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "hermes"
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setattr(hermes_state, "DEFAULT_DB_PATH", home / "state.db")
    yield home
    sf.close_shared_spools()


@pytest.fixture
def db(home: Path):
    db = hermes_state.SessionDB(db_path=home / "state.db")
    for sid in ("sess-1", "sess-2"):
        db.create_session(sid, "telegram")
    yield db
    db.close()


def spooled(home: Path, **kw) -> list:
    with walspool.Spool(home / "spool.db") as spool:
        return list(spool.records(**kw))


def test_spool_path_follows_hermes_home(home, monkeypatch, tmp_path):
    assert sf.spool_path() == home / "spool.db"
    other = tmp_path / "profiles" / "work"
    monkeypatch.setenv("HERMES_HOME", str(other))
    assert sf.spool_dropped_transcript_message("s", {"role": "user", "content": "x"}) == (
        other / "spool.db"
    )
    assert stat.S_IMODE(os.stat(other).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(other / "spool.db").st_mode) == 0o600


def test_round_trip_in_order(home):
    for i in range(3):
        assert sf.spool_dropped_transcript_message("s", {"role": "user", "content": f"c{i}"})
    seen = []
    assert sf.drain_transcript_spool("s", seen.append) == (3, 0)
    assert [m["content"] for m in seen] == ["c0", "c1", "c2"]
    assert spooled(home) == []


def test_drain_touches_only_its_own_session_and_reason(home):
    sf.spool_dropped_transcript_message("a", {"content": "a0"})
    sf.spool_dropped_transcript_message("b", {"content": "b0"})
    assert sf.flush_pending_to_file({"agent:main:telegram:dm:1": "slot"}) == 1
    seen = []
    assert sf.drain_transcript_spool("a", seen.append) == (1, 0)
    assert seen == [{"content": "a0"}]
    assert [(r.session_id, r.session_key) for r in spooled(home)] == [
        ("b", None),
        (None, "agent:main:telegram:dm:1"),
    ]


def test_drain_stops_at_first_failure_and_keeps_rows(home, caplog):
    for i in range(3):
        sf.spool_dropped_transcript_message("s", {"content": f"c{i}"})

    def replay(message):
        if message["content"] == "c1":
            raise RuntimeError("database is locked")

    with caplog.at_level(logging.WARNING, logger="walspool"):
        assert sf.drain_transcript_spool("s", replay) == (1, 2)
    assert "keeping 2 row(s)" in caplog.text
    assert [r.message["content"] for r in spooled(home)] == ["c1", "c2"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="walspool"):
        assert sf.drain_transcript_spool("s", replay, db_known_failing=True) == (0, 2)
    assert "keeping" not in caplog.text


def test_a_drain_skipped_for_the_spools_sake_or_a_lock_is_told_one_that_failed_on_state_db_is_not(
    home,
):
    """Who retries what: a drain that met another process's replay lock left its rows
    for the spool's sake, and one whose write met state.db's lock held by another
    process past the busy timeout left them for that lock's: each session is told to
    ``retry_skipped_drains``' callback (the plugin retries it with no new message). A
    drain whose write failed for state.db's own sake (an outage) is not: the gateway
    tries it at its next write, as released."""
    told: list[tuple[Path, str]] = []
    sf.retry_skipped_drains(told.append)
    try:
        for sid in ("skipped", "failing", "locked"):
            assert sf.spool_dropped_transcript_message(sid, {"content": f"{sid}-0"})
        with replay_lock_held(home / "spool.db"):
            assert sf.drain_transcript_spool("skipped", lambda m: None) == (0, 1)
            assert not sf.drain_would_run()  # the retries' round waits for it
        assert told == [(home / "spool.db", "skipped")]

        def failing(message):
            raise sqlite3.OperationalError("disk I/O error")

        assert sf.drain_transcript_spool("failing", failing, db_known_failing=True) == (0, 1)
        assert told == [(home / "spool.db", "skipped")]

        state_db = home / "state.db"
        holder = sqlite3.connect(state_db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        waiter = sqlite3.connect(state_db, timeout=0, isolation_level=None)

        def locked(message):
            waiter.execute("CREATE TABLE t (x)")

        assert sf.drain_transcript_spool("locked", locked, db_known_failing=True) == (0, 1)
        holder.execute("ROLLBACK")
        assert told == [(home / "spool.db", "skipped"), (home / "spool.db", "locked")]
        assert sf.drain_would_run()
        assert sf.drain_transcript_spool("skipped", lambda m: None) == (1, 0)
        assert len(told) == 2
    finally:
        sf.retry_skipped_drains(None)


def test_spool_failure_returns_none(home, monkeypatch):
    monkeypatch.setattr(
        sf, "shared_spool", lambda: (_ for _ in ()).throw(walspool.SpoolIOError("disk gone"))
    )
    assert sf.spool_dropped_transcript_message("s", {"content": "x"}) is None
    assert sf.flush_pending_to_file({"k": "x"}) == 0
    sf.flush_agent_history_to_file("s", [{"role": "user"}])  # never raises


def test_flush_pending_strings_and_events(home):
    from gateway.config import Platform
    from gateway.platforms.base import MessageEvent
    from gateway.session import SessionSource

    event = MessageEvent(
        text="from adapter",
        message_id="m1",
        source=SessionSource(platform=Platform.TELEGRAM, chat_id="9"),
    )
    assert (
        sf.flush_pending_to_file(
            {"k1": "hello", "k2": event, "k3": None}, reason="adapter_shutdown"
        )
        == 2
    )
    rows = spooled(home)
    assert [(r.session_key, r.reason) for r in rows] == [
        ("k1", "adapter_shutdown"),
        ("k2", "adapter_shutdown"),
    ]
    assert rows[0].message == {"text": "hello"}
    assert rows[1].message["text"] == "from adapter"
    assert rows[1].message["source"]["chat_id"] == "9"
    assert sf.flush_pending_to_file({}) == 0


def test_one_bad_slot_does_not_lose_the_others(home):
    assert sf.flush_pending_to_file({"": "no key", "good": "kept"}) == 1
    assert [r.message for r in spooled(home)] == [{"text": "kept"}]


def test_recover_writes_rows_once_and_removes_them(home, db):
    sf.spool_dropped_transcript_message(
        "sess-1", {"role": "assistant", "content": "a", "reasoning": "why", "timestamp": 5.0}
    )
    sf.flush_pending_to_file({"k": {"text": "slot", "session_id": "sess-2"}})
    sf.flush_agent_history_to_file("sess-1", [{"role": "user", "content": "h"}])
    assert sf.recover_pending_to_db(db) == 2
    (msg,) = db.get_messages("sess-1")
    assert (msg["role"], msg["content"], msg["reasoning"], msg["timestamp"]) == (
        "assistant",
        "a",
        "why",
        5.0,
    )
    assert [(m["role"], m["content"]) for m in db.get_messages("sess-2")] == [("user", "slot")]
    assert [r.reason for r in spooled(home)] == [AGENT_HISTORY]
    assert sf.recover_pending_to_db(db) == 0


def test_recover_uses_resolver_for_keys(home, db):
    sf.flush_pending_to_file({"agent:main:telegram:dm:1": "hi", "unknown-key": "kept"})
    resolved = sf.recover_pending_to_db(
        db, session_resolver=lambda key: ("sess-1", db) if key.endswith(":1") else None
    )
    assert resolved == 1
    assert [m["content"] for m in db.get_messages("sess-1")] == ["hi"]
    assert [r.session_key for r in spooled(home)] == ["unknown-key"]


def test_recover_holds_back_a_failed_session_only(home, db):
    for i in range(3):
        sf.spool_dropped_transcript_message("missing", {"role": "user", "content": f"x{i}"})
    sf.spool_dropped_transcript_message("sess-2", {"role": "user", "content": "ok"})
    assert sf.recover_pending_to_db(db) == 1
    rows = spooled(home)
    assert [r.message["content"] for r in rows] == ["x0", "x1", "x2"]
    assert "does not exist in state.db" in rows[0].last_error


def test_recover_closes_the_db_it_opened_even_on_interrupt(home, db, monkeypatch):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})
    closed = []

    class Interrupting(hermes_state.SessionDB):
        def append_message(self, *a, **kw):
            raise KeyboardInterrupt

        def close(self):
            closed.append(True)
            super().close()

    monkeypatch.setattr(hermes_state, "SessionDB", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        sf.recover_pending_to_db()
    assert closed == [True]
    assert len(spooled(home)) == 1


def test_agent_history_is_kept_for_operators(home, caplog):
    with caplog.at_level(logging.WARNING, logger="walspool"):
        sf.flush_agent_history_to_file("s", [{"role": "user", "content": "u"}])
        sf.flush_agent_history_to_file("s", [])
    (row,) = spooled(home, reasons=[AGENT_HISTORY])
    assert row.message == {
        "session_id": "s",
        "count": 1,
        "messages": [{"role": "user", "content": "u"}],
    }
    assert "Preserved 1 in-memory message(s) for session s" in caplog.text
    assert CAP_DROP not in {r.reason for r in spooled(home)}


def test_a_home_that_cannot_hold_a_spool_never_raises(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HERMES_HOME", str(blocker / "hermes"))
    try:
        assert sf.spool_dropped_transcript_message("s", {"content": "x"}) is None
        assert sf.drain_transcript_spool("s", lambda m: None) == (0, 0)
        assert sf.flush_pending_to_file({"k": "x"}) == 0
        sf.flush_agent_history_to_file("s", [{"role": "user"}])
    finally:
        sf.close_shared_spools()


def test_queue_overflow_is_spooled_after_its_head_in_order(home, db):
    assert sf.flush_pending_to_file({"k": "head"}, reason="adapter_shutdown") == 1
    assert sf.flush_overflow_to_file({"k": ["t0", None, "t1"], "": ["x"], "e": []}) == 2
    assert sf.flush_overflow_to_file({}) == 0
    assert [(r.session_key, r.message) for r in spooled(home)] == [
        ("k", {"text": "head"}),
        ("k", {"text": "t0"}),
        ("k", {"text": "t1"}),
    ]
    assert sf.recover_pending_to_db(db, session_resolver=lambda key: "sess-1") == 3
    assert [m["content"] for m in db.get_messages("sess-1")] == ["head", "t0", "t1"]


def test_recover_pending_spool_reports_the_sessions_it_held_back(home, db):
    sf.spool_dropped_transcript_message("missing", {"role": "user", "content": "x"})
    sf.spool_dropped_transcript_message("sess-2", {"role": "user", "content": "ok"})
    assert sf.recover_pending_spool(db) == (1, {"missing"})


def test_a_resolver_answer_without_a_store_keeps_the_rows(home, db):
    sf.flush_pending_to_file({"k": "slot"})
    calls = []

    def resolver(key, *, not_after=None):
        calls.append(not_after)
        return ("sess-1", None)  # upstream: no owning store means "preserve"

    assert sf.recover_pending_spool(db, session_resolver=resolver) == (0, set())
    assert len(calls) == 1 and isinstance(calls[0], float)
    assert [r.session_key for r in spooled(home)] == ["k"]


def test_constants_and_row_rejection_as_upstream():
    import sqlite3

    assert (sf.TRANSCRIPT_CAP_DROP_REASON, sf.AGENT_HISTORY_REASON) == (CAP_DROP, AGENT_HISTORY)
    assert sf.QUARANTINE_SUFFIX == ".bad"
    assert sf.is_row_rejection(OverflowError("too big"))
    assert sf.is_row_rejection(sqlite3.InterfaceError("Error binding parameter 1"))
    assert not sf.is_row_rejection(sqlite3.OperationalError("database is locked"))
    assert not sf.is_row_rejection(RuntimeError("no owning session store"))


def test_a_content_rejection_in_the_drain_is_quarantined_and_the_drain_goes_on(home):
    for content in ("a", "bad", "b"):
        sf.spool_dropped_transcript_message("s", {"content": content})
    seen = []

    def replay(message):
        if message["content"] == "bad":
            raise ValueError("cannot bind")
        seen.append(message["content"])

    assert sf.drain_transcript_spool("s", replay) == (2, 0)
    assert seen == ["a", "b"]
    (bad,) = spooled(home)
    assert bad.status == walspool.QUARANTINED and "ValueError" in bad.last_error


def test_leftover_json_files_are_imported_at_recovery_once(home, db, caplog):
    import json

    flush_dir = home / "pending_messages"
    flush_dir.mkdir(parents=True)
    for i in range(2):
        payload = {
            "session_key": "sess-1",
            "reason": CAP_DROP,
            "ts": 100,
            "seq": i,
            "data": {"session_id": "sess-1", "message": {"role": "user", "content": f"j{i}"}},
        }
        (flush_dir / f"pending-{i}.json").write_text(json.dumps(payload))
    (flush_dir / "pending-x.json.bad").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="walspool"):
        assert sf.recover_pending_to_db(db) == 2
    assert [m["content"] for m in db.get_messages("sess-1")] == ["j0", "j1"]
    assert sorted(p.name for p in flush_dir.iterdir()) == ["pending-x.json.bad"]
    assert "Imported 2 pending-message file(s)" in caplog.text
    assert sf.recover_pending_to_db(db) == 0


# -- mutation testing (issue 16): each test below kills mutants that survived the others ----


def logged(caplog, level: int = logging.DEBUG) -> list[str]:
    """The module's own log lines at ``level``, formatted (a mutated format raises here)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "walspool.shutdown_flush" and r.levelno == level
    ]


@pytest.fixture
def lock_held(home):
    """The spool's replay lock held (as by a replay elsewhere); yields the wait budgets
    each replay of the spool then asks for, and never lets one wait."""
    from walspool.store import replay_lock as lock_module

    budgets: list[float] = []
    real = lock_module._lock_within

    def no_wait(fd, seconds, spool_path):
        budgets.append(seconds)
        return real(fd, 0, spool_path)

    spool = sf.shared_spool()
    with lock_module.replay_lock(spool, wait=False), pytest.MonkeyPatch.context() as patch:
        patch.setattr(lock_module, "_lock_within", no_wait)
        yield budgets


def test_without_hermes_constants_the_home_is_hermes_home_else_dot_hermes(
    home, monkeypatch, tmp_path
):
    monkeypatch.setitem(sys.modules, "hermes_constants", None)  # its import fails
    assert sf.home() == home
    monkeypatch.setenv("HERMES_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert sf.home() == tmp_path / "user" / ".hermes"
    monkeypatch.delenv("HERMES_HOME")
    assert sf.spool_path() == tmp_path / "user" / ".hermes" / "spool.db"


def test_one_shared_spool_per_home_as_get_hermes_home_says(home, monkeypatch, tmp_path):
    import hermes_constants

    first = sf.shared_spool()
    assert first.path == home / "spool.db"
    assert sf.shared_spool() is first
    other = tmp_path / "override"
    monkeypatch.setattr(hermes_constants, "get_hermes_home", lambda: other)  # env unchanged
    second = sf.shared_spool()
    assert second is not first
    assert second.path == other / "spool.db"
    assert sf.shared_spool() is second


def test_a_message_that_cannot_be_spooled_is_logged_at_debug_word_for_word(home, caplog):
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.spool_dropped_transcript_message("", {"content": "x"}) is None
    assert logged(caplog) == [
        "Failed to spool cap-dropped transcript message for : session_id must not be empty"
    ]


def test_slots_are_spooled_in_one_transaction(home, monkeypatch):
    def no_single_appends(*args, **kwargs):
        raise AssertionError("a slot was spooled on its own")

    monkeypatch.setattr(walspool.Spool, "append", no_single_appends)
    assert sf.flush_pending_to_file({"k1": "a", "k2": "b", "k3": "c"}, reason="x") == 3
    assert sf.flush_overflow_to_file({"k1": ["d", "e"], "": ["no key"], "k4": []}) == 2
    assert [(r.session_key, r.message["text"]) for r in spooled(home)] == [
        ("k1", "a"),
        ("k2", "b"),
        ("k3", "c"),
        ("k1", "d"),
        ("k1", "e"),
    ]


def test_slots_default_to_the_shutdown_reason_and_log_what_they_flushed(home, caplog):
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.flush_pending_to_file({"k1": "a", "k2": None}) == 1
    assert sf.flush_overflow_to_file({"k1": ["b", "c"], "": ["no key"]}) == 2
    assert sf.flush_pending_to_file({"k3": None}) == 0
    assert [r.reason for r in spooled(home)] == ["shutdown"] * 3
    path = home / "spool.db"
    assert logged(caplog) == []  # the empty key is skipped, not tried and refused
    assert logged(caplog, logging.INFO) == [
        f"Flushed 1 pending message(s) to {path} (reason=shutdown)",
        f"Flushed 2 queued overflow message(s) to {path} (reason=shutdown)",
    ]


def test_a_slot_spooled_on_its_own_keeps_its_session_id_and_reason(home, caplog):
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    slots = {"": "no key", "good": {"text": "kept", "session_id": "sess-1"}}
    assert sf.flush_pending_to_file(slots, reason="adapter_shutdown") == 1
    (row,) = spooled(home)
    assert (row.session_id, row.session_key, row.reason) == ("sess-1", "good", "adapter_shutdown")
    assert logged(caplog, logging.ERROR) == [
        "walspool could not spool a pending message for '' at shutdown; it is lost: "
        "session_key must not be empty"
    ]


def test_a_slots_session_id_is_its_own_if_it_is_a_nonempty_string(home):
    from types import SimpleNamespace

    slots = {
        "k1": {"text": "empty id", "session_id": ""},
        "k2": {"text": "int id", "session_id": 5},
        "k3": SimpleNamespace(text="event", session_id="sess-1"),
    }
    assert sf.flush_pending_to_file(slots) == 3
    assert [(r.session_key, r.session_id) for r in spooled(home)] == [
        ("k1", None),
        ("k2", None),
        ("k3", "sess-1"),
    ]


def test_an_agent_history_without_a_session_is_kept_under_unknown(home, caplog):
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    sf.flush_agent_history_to_file(None, [{"role": "user", "content": "u"}])
    (row,) = spooled(home, reasons=[AGENT_HISTORY])
    assert (row.session_id, row.message["session_id"]) == ("unknown", None)
    assert logged(caplog, logging.WARNING) == [
        f"Preserved 1 in-memory message(s) for session None in {home / 'spool.db'} (state.db "
        "did not take them); recover by hand after repairing state.db"
    ]


def test_the_drop_ins_say_word_for_word_when_the_spool_cannot_be_opened(home, monkeypatch, caplog):
    monkeypatch.setattr(
        sf, "shared_spool", lambda: (_ for _ in ()).throw(walspool.SpoolIOError("disk gone"))
    )
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    sf.flush_agent_history_to_file("s", [{"role": "user"}])
    assert sf.drain_transcript_spool("s", lambda m: None) == (0, 0)
    assert sf.recover_pending_spool() == (0, set())
    assert logged(caplog, logging.WARNING) == [
        "Cannot open the transcript spool to drain s: disk gone",
        "Failed to recover pending messages: disk gone",
    ]
    assert logged(caplog, logging.ERROR) == [
        "walspool could not keep the 1 in-memory message(s) of session s at shutdown; they "
        "are lost: disk gone"
    ]


def test_a_drain_of_an_id_the_spool_cannot_hold_is_empty(home):
    sf.spool_dropped_transcript_message("s", {"content": "kept"})
    # empty; a lone surrogate (UTF-8 cannot carry it); not a str (refused by the spool)
    for session_id in ("", "\ud800", 5):
        assert sf.drain_transcript_spool(session_id, lambda m: None) == (0, 0), session_id
    assert [r.message["content"] for r in spooled(home)] == ["kept"]


def test_a_drain_takes_the_sessions_rows_of_every_reason_but_agent_history(home):
    """Cap drops, then a pending slot spooled by the session's id (as the user message
    a replay makes of it); an agent history stays for operators."""
    sf.spool_dropped_transcript_message("a", {"content": "dropped"})
    assert sf.flush_pending_to_file({"k": {"text": "slot", "session_id": "a"}}) == 1
    sf.flush_agent_history_to_file("a", [{"role": "user", "content": "unsaved"}])
    seen = []
    assert sf.drain_transcript_spool("a", seen.append) == (2, 0)
    assert seen[0] == {"content": "dropped"}
    assert {k: seen[1][k] for k in ("role", "content")} == {"role": "user", "content": "slot"}
    assert isinstance(seen[1]["timestamp"], float)
    assert [(r.session_id, r.reason) for r in spooled(home)] == [("a", AGENT_HISTORY)]


def test_a_drain_never_waits_for_a_replay_elsewhere_and_counts_what_remains(
    home, lock_held, caplog
):
    for i in range(2):
        sf.spool_dropped_transcript_message("s", {"content": f"c{i}"})
    sf.spool_dropped_transcript_message("t", {"content": "other"})
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.drain_transcript_spool("s", lambda m: None) == (0, 2)
    assert lock_held == [0]
    assert logged(caplog) == [f"Another replay of {home / 'spool.db'} runs; s keeps 2 row(s)"]


def test_a_drain_that_fails_counts_what_remains_at_least_one(home, monkeypatch, caplog):
    for i in range(3):
        sf.spool_dropped_transcript_message("s", {"content": f"c{i}"})

    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def replay(self, **kwargs):
            raise RuntimeError("boom")

    monkeypatch.setattr(sf, "Replayer", Failing)
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.drain_transcript_spool("s", lambda m: None) == (0, 3)
    # A session with nothing spooled runs no replay (none to fail, no turn to wait for).
    assert sf.drain_transcript_spool("t", lambda m: None) == (0, 0)
    monkeypatch.setattr(
        walspool.Spool, "query", lambda *a: (_ for _ in ()).throw(RuntimeError("no read"))
    )
    # What remains cannot be read: the drain is tried, and at least one row remains.
    assert sf.drain_transcript_spool("t", lambda m: None) == (0, 1)
    assert logged(caplog, logging.WARNING) == [
        f"Cannot drain the transcript spool for {sid}: boom" for sid in ("s", "t")
    ]


def test_a_drain_says_word_for_word_what_it_replayed_and_what_it_kept(home, caplog):
    for i in range(3):
        sf.spool_dropped_transcript_message("s", {"content": f"c{i}"})

    def replay(message):
        if message["content"] == "c1":
            raise RuntimeError("database is locked")

    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.drain_transcript_spool("s", replay) == (1, 2)
    assert sf.drain_transcript_spool("s", replay, db_known_failing=True) == (0, 2)
    kept = (
        f"Replay of spooled transcript message for s failed; keeping 2 row(s) in "
        f"{home / 'spool.db'} for retry: RuntimeError: database is locked"
    )
    assert logged(caplog, logging.WARNING) == [kept]
    assert logged(caplog, logging.DEBUG) == [kept]
    assert logged(caplog, logging.INFO) == [
        "Replayed 1 spooled transcript message(s) for s after DB recovery"
    ]


def test_recovery_with_nothing_to_replay_opens_no_state_db(home):
    sf.flush_agent_history_to_file("s", [{"role": "user", "content": "h"}])
    assert sf.recover_pending_to_db() == 0
    assert not (home / "state.db").exists()


def test_recovery_writes_into_the_session_db_it_is_given(home, tmp_path):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})
    other = hermes_state.SessionDB(db_path=tmp_path / "other.db")
    try:
        other.create_session("sess-1", "telegram")
        assert sf.recover_pending_to_db(other) == 1
        assert [m["content"] for m in other.get_messages("sess-1")] == ["x"]
    finally:
        other.close()
    assert not (home / "state.db").exists()


def test_a_recovery_never_waits_for_a_replay_elsewhere_and_holds_every_session(
    home, db, lock_held, caplog
):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})
    sf.spool_dropped_transcript_message("sess-2", {"role": "user", "content": "y"})
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, {"sess-1", "sess-2"})
    assert lock_held == [0]
    assert logged(caplog, logging.WARNING) == [
        f"Another replay of {home / 'spool.db'} is running; 2 session(s) will drain their "
        "spooled rows before their next message"
    ]


def test_a_recovery_that_fails_holds_every_session_with_rows(home, db, monkeypatch, caplog):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})
    monkeypatch.setattr(sf, "_replay_all", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, {"sess-1"})
    assert logged(caplog, logging.WARNING) == ["Failed to recover pending messages: boom"]


def test_a_state_db_that_cannot_be_opened_holds_every_session_and_never_raises(
    home, monkeypatch, caplog
):
    """hermes' ``SessionDB()`` set-up writes: a state.db locked elsewhere past its patience
    raises from it, and the gateway (0.22 calls ``recover_gateway_pending`` unguarded)
    must start all the same."""
    import sqlite3

    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})

    def locked():
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(sf, "_open_default_db", locked)
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool() == (0, {"sess-1"})
    assert logged(caplog, logging.WARNING) == [
        "Failed to recover pending messages: cannot open state.db: database is locked"
    ]


def test_recovery_counts_a_write_that_landed_before_a_crash_once(home, db, caplog):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "x"})
    real = db.append_message

    def landed_then_crashed(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    db.append_message = landed_then_crashed
    with pytest.raises(KeyboardInterrupt):
        sf.recover_pending_spool(db)
    db.append_message = real
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, set())
    assert [m["content"] for m in db.get_messages("sess-1")] == ["x"]
    assert spooled(home) == []
    assert logged(caplog, logging.INFO) == [
        f"Recovered 1 pending message(s) from {home / 'spool.db'}"
    ]


def test_recovery_says_word_for_word_what_it_held_back_and_quarantined(home, db, caplog):
    sf.spool_dropped_transcript_message("sess-1", {"role": "user", "content": "ok"})
    history = {"session_id": "sess-2", "count": 1, "messages": [{"role": "user"}]}
    sf.spool_dropped_transcript_message("sess-2", history)  # not one message: refused
    for sid in ("gone-1", "gone-2"):
        sf.spool_dropped_transcript_message(sid, {"role": "user", "content": "lost"})
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (1, {"gone-1", "gone-2"})
    path = home / "spool.db"
    missing = (
        "session {0} does not exist in state.db (FOREIGN KEY constraint failed); replay with "
        "create_missing=True to create it"
    )
    assert logged(caplog, logging.INFO) == [
        f"Recovered 1 pending message(s) from {path}",
        "Held back 2 spooled message(s) for the next start after a failed replay: "
        f"gone-1 ({missing.format('gone-1')}), gone-2 ({missing.format('gone-2')})",
    ]
    assert logged(caplog, logging.WARNING) == [
        f"Quarantined 1 spooled message(s) in {path} that state.db refused; see `walspool ls`"
    ]


def test_a_routing_key_the_resolver_does_not_know_is_held_and_reported_word_for_word(
    home, db, caplog
):
    """0.22 passes its own resolver: a key it does not know stays, and the operator is
    told at WARNING (how many, which keys, what to do), as on 0.20."""
    sf.flush_pending_to_file({"agent:main:telegram:dm:1": "hi", "unknown-key": "kept"})
    caplog.set_level(logging.INFO, logger="walspool")
    resolver = lambda key: ("sess-1", db) if key.endswith(":1") else None  # noqa: E731
    assert sf.recover_pending_spool(db, session_resolver=resolver) == (1, set())
    assert logged(caplog, logging.INFO)[-1] == (
        "Held back 1 spooled message(s) for the next start after a failed replay: "
        "key:unknown-key (resolver found no session for session_key 'unknown-key')"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "1 spooled message(s) of 1 session key(s) found no session in the gateway's routing "
        f"table and stay in {home / 'spool.db'}; each start tries again (a new message from "
        "that chat routes its key), `walspool ls` shows them as key:<KEY>, `walspool export "
        "--session key:<KEY>` gives their text: unknown-key"
    ]


def test_imported_files_say_word_for_word_what_was_imported(home, db, caplog):
    import json

    flush_dir = home / "pending_messages"
    flush_dir.mkdir(parents=True)
    payload = {
        "session_key": "missing",
        "reason": CAP_DROP,
        "ts": 100,
        "seq": 0,
        "data": {"session_id": "missing", "message": {"role": "user", "content": "j"}},
    }
    (flush_dir / "pending-0.json").write_text(json.dumps(payload))
    (flush_dir / "pending-x.json.bad").write_text("{}")
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, {"missing"})
    (row,) = spooled(home)
    assert row.message[sf.IMPORT_SOURCE_KEY] == "pending-0.json"  # imported exactly once
    assert logged(caplog, logging.WARNING)[0] == (
        f"Imported 1 pending-message file(s) from {flush_dir} into {home / 'spool.db'}; "
        "0 left in place, 1 quarantined file(s) left alone"
    )


def test_quarantined_files_alone_are_reported_word_for_word(home, db, caplog):
    flush_dir = home / "pending_messages"
    flush_dir.mkdir(parents=True)
    (flush_dir / "pending-x.json.bad").write_text("{}")
    (flush_dir / "notes.txt").write_text("")
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, set())
    assert logged(caplog, logging.WARNING) == [
        f"1 quarantined file(s) (*.json.bad) in {flush_dir} are left alone; inspect them by hand"
    ]


def test_an_import_that_fails_is_reported_word_for_word(home, db, monkeypatch, caplog):
    flush_dir = home / "pending_messages"
    flush_dir.mkdir(parents=True)
    (flush_dir / "pending-0.json").write_text("{}")
    monkeypatch.setattr(
        sf,
        "import_json_spool",
        lambda *a, **kw: (_ for _ in ()).throw(walspool.WalspoolError("cannot list")),
    )
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.recover_pending_spool(db) == (0, set())
    assert logged(caplog, logging.WARNING) == [
        f"Cannot import the JSON spool files in {flush_dir}: cannot list"
    ]


# -- memory bounded by what a row really costs (issue 29) ---------------------------------

MiB = 1024 * 1024


def keyed_rows(home: Path, keys: list[str]) -> Path:
    """A spool holding one shutdown slot per entry of ``keys``, spooled by routing key."""
    path = home / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append_many(
            [(None, {"text": f"slot {n}"}, k) for n, k in enumerate(keys)], reason="shutdown"
        )
    return path


def edit(path: Path, sql: str, params: tuple = ()) -> None:
    """Change the spool behind walspool's back (payloads no append would take)."""
    import apsw

    conn = apsw.Connection(str(path))
    try:
        with conn:
            conn.execute(sql, params)
    finally:
        conn.close()


def asked_keys(home: Path, db) -> list[tuple[str, object]]:
    """The keys a recovery asks the resolver about, with their times; it resolves none."""
    asked = []
    resolver = lambda key, not_after=None: asked.append((key, not_after))  # noqa: E731
    assert sf.recover_pending_spool(db, session_resolver=resolver) == (0, set())
    return asked


def test_a_key_is_resolved_at_its_oldest_rows_time_whatever_its_payloads_size(home, db):
    """Payloads over ``paging.SCAN_JSON_BYTES`` are parsed one at a time, the rest in a
    scan: a key's time is still its oldest row's own timestamp, else its spool time,
    among rows of either size (as one scan of every row found it)."""
    path = keyed_rows(home, ["a", "a", "b", "b", "c"])
    junk = f"printf('%.*c', {3 * MiB // 2}, 'x')"  # over SCAN_JSON_BYTES
    for row_id, payload in [
        (1, f"json_object('text', 'a', 'timestamp', 50, 'junk', {junk})"),
        (2, "json_object('text', 'a', 'timestamp', 70)"),
        (4, f"json_object('text', 'b', 'timestamp', 10.5, 'junk', {junk})"),
        (5, f"'not JSON ' || {junk}"),
    ]:
        edit(path, f"UPDATE records SET payload = {payload} WHERE id = {row_id}")
    assert asked_keys(home, db) == [("a", 50), ("b", 10.5), ("c", spool_time(path, 5))]


def spool_time(path: Path, row_id: int) -> float:
    import apsw

    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return conn.execute("SELECT created_at FROM records WHERE id = ?", (row_id,)).get
    finally:
        conn.close()


#: A gateway's start on HERMES_HOME=ARGV[1] (0.22's call: its state.db and a resolver,
#: which knows none of the keys). Prints the keys and times the resolver was asked
#: about, and the process's peak RSS (``VmHWM``) when it was first asked: every key's
#: time is found by then, and the replay (``test_paging`` bounds it) has not begun.
_KEY_RECOVERY = """
import os, sys
from pathlib import Path
os.environ["HERMES_HOME"] = sys.argv[1]
import hermes_state
from walspool import shutdown_flush as sf

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

db = hermes_state.SessionDB(db_path=Path(sys.argv[1], "state.db"))
asked, peaks = [], []
def resolver(key, not_after):
    peaks.append(peak())
    asked.append((key, not_after))
assert sf.recover_pending_spool(db, session_resolver=resolver) == (0, set())
print(peaks[0], asked)
"""


def test_resolving_keys_holds_one_large_payload_at_a_time(tmp_path):
    """12 slots of 32 MiB over three routing keys: a start has found each key's time
    within three such payloads (12 pages) of its peak over small slots: 97 MiB against
    33 (before: every payload held by the GROUP BY's sorter and SQLite's JSON cache,
    801 MiB)."""
    peaks = []
    for filler in (0, 32 * MiB):
        home = tmp_path / f"hermes-{filler}"
        path = keyed_rows(home, [f"key{n % 3}" for n in range(12)])
        edit(
            path,
            "UPDATE records SET payload = json_object('text', 'x', 'timestamp', 1000 + id, "
            "'junk', printf('%.*c', ?, 'x'))",
            (filler,),
        )
        done = run_python(_KEY_RECOVERY, str(home), timeout=600)
        assert done.returncode == 0, done.stderr
        peak, asked = done.stdout.split(" ", 1)
        assert asked == "[('key0', 1001), ('key1', 1002), ('key2', 1003)]\n"
        peaks.append(int(peak))
    small, large = peaks
    assert large < small + 3 * 32 * MiB, (small // MiB, large // MiB)


# -- the routing mirror, read checked and bounded ----------------------------------------


def mirror(home: Path, entries: dict) -> Path:
    """The gateway's legacy routing mirror, ``<home>/sessions/sessions.json``."""
    sessions = home / "sessions"
    sessions.mkdir(parents=True, exist_ok=True)
    path = sessions / "sessions.json"
    path.write_text(json.dumps(entries))
    return path


def test_the_routing_mirror_routes_a_key_the_routing_table_does_not_hold(home, db):
    mirror(home, {"k": {"session_id": "sess-1"}, "bad": {"session_id": 7}})
    assert [sf.routed_session_id(db, key) for key in ("k", "bad", "other")] == [
        "sess-1",
        None,
        None,
    ]


def test_a_routing_mirror_over_its_bound_is_not_read(home, db, caplog):
    """It is read whole and parsed (about five times its size in memory): at
    ``SESSIONS_JSON_MAX_BYTES`` it is read, one byte over it is refused from its size."""
    path = mirror(home, {"k": {"session_id": "sess-1"}})
    text = path.read_bytes()
    path.write_bytes(text + b" " * (sf.SESSIONS_JSON_MAX_BYTES - len(text)))  # still JSON
    assert sf.routed_session_id(db, "k") == "sess-1"
    with open(path, "ab") as f:
        f.write(b" ")
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.routed_session_id(db, "k") is None
    assert logged(caplog, logging.WARNING) == [
        f"Not reading the gateway's routing mirror {path} ({sf.SESSIONS_JSON_MAX_BYTES + 1} "
        f"bytes, more than {sf.SESSIONS_JSON_MAX_BYTES}); keys only it routes stay in the spool"
    ]


def test_a_recovery_reads_the_routing_mirror_once_for_all_its_keys(home, db, caplog, monkeypatch):
    """Twelve slots under four keys, resolved from disk (0.20 passes no resolver): the
    mirror is opened once (it was read again, up to 16 MiB, for every key), and a mirror
    that cannot be used says so in one line, not one per key."""
    keyed_rows(home, [f"key{n % 4}" for n in range(12)])
    path = mirror(home, {"key0": {"session_id": "sess-1"}, "key1": {"session_id": "sess-2"}})
    reads = []
    read = sf._read_sessions_json
    monkeypatch.setattr(sf, "_read_sessions_json", lambda d: reads.append(d) or read(d))
    assert sf.recover_pending_to_db(db) == 6  # key0's and key1's three slots each
    assert reads == [home / "sessions"]
    sf.close_shared_spools()
    keyed_rows(home, [f"key{n % 4}" for n in range(12)])  # key2, key3 and these twelve
    path.unlink()
    path.symlink_to(home / "elsewhere.json")
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    reads.clear()
    sf.recover_pending_to_db(db)
    assert len(reads) == 1
    assert [line for line in logged(caplog, logging.WARNING) if "routing mirror" in line] == [
        f"Not reading the gateway's routing mirror {path} (it is a symbolic link); keys only "
        "it routes stay in the spool"
    ]


def test_a_routing_mirror_that_is_a_link_is_not_followed(home, db, tmp_path, caplog):
    elsewhere = mirror(tmp_path / "elsewhere", {"k": {"session_id": "sess-1"}})
    path = mirror(home, {})
    path.unlink()
    path.symlink_to(elsewhere)
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.routed_session_id(db, "k") is None
    assert logged(caplog, logging.WARNING) == [
        f"Not reading the gateway's routing mirror {path} (it is a symbolic link); keys only "
        "it routes stay in the spool"
    ]


def test_a_routing_mirror_that_is_a_fifo_never_holds_a_start_up(home, db, caplog):
    """Before, ``open()`` waited for a writer for ever (the gateway's start with it)."""
    path = mirror(home, {})
    path.unlink()
    os.mkfifo(path)
    found: list[object] = []
    reader = threading.Thread(target=lambda: found.append(sf.routed_session_id(db, "k")))
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    reader.start()
    reader.join(STEP)
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # lets the stuck open() return
        reader.join(STEP)
        pytest.fail("reading the routing mirror waited on a FIFO")
    assert found == [None]
    assert logged(caplog, logging.WARNING) == [
        f"Not reading the gateway's routing mirror {path} (not a regular file); keys only "
        "it routes stay in the spool"
    ]


def test_a_routing_mirror_others_can_replace_is_not_read(home, db, caplog):
    path = mirror(home, {"k": {"session_id": "sess-1"}})
    os.chmod(path.parent, 0o777)
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    assert sf.routed_session_id(db, "k") is None
    (warning,) = logged(caplog, logging.WARNING)
    assert warning.startswith(
        f"Not reading the gateway's routing mirror {path} (the directory {path.parent} of "
        "sessions.json is writable by group or others (mode 777)"
    )


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_hand_off_that_fails_after_a_rewrite_of_its_session_is_not_reported_lost(
    home, caplog, monkeypatch, rewritten
):
    """The drop-in keeps the link's account of hand-offs (``walspool.link.handoffs``): an
    eviction handed to the writer meets the spool's write lock held by another process
    and fails when the spool closes. Reported dropped, with a WARNING; but not when the
    session's transcript was rewritten after it was handed off, as its row would have
    been superseded."""
    from _gateway import found_locked
    from _lock_holder import write_lock_held

    import walspool.store.writer as writer

    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 3600.0)  # it fails at the close
    monkeypatch.setattr(writer, "CLOSE_TIMEOUT", 0.1)
    spool = sf.shared_spool()
    rewrite = None
    with write_lock_held(spool.path), caplog.at_level(logging.WARNING, "walspool"):
        assert sf.spool_dropped_transcript_message("s", {"role": "user", "content": "m"})
        assert found_locked(spool) and sf.hand_offs("s") == (1, 0)
        if rewritten:  # its supersede queues behind the eviction: on a thread
            rewrite = threading.Thread(target=sf.transcript_rewritten, args=("s",))
            rewrite.start()
            marked = time.monotonic() + STEP
            while sf.hand_offs("s") != (1, 1):  # marked before its supersede waits
                assert time.monotonic() < marked, sf.hand_offs("s")
                time.sleep(0.001)
        sf.close_shared_spools()
        if rewrite is not None:
            rewrite.join(STEP)
            assert not rewrite.is_alive()
    assert sf.hand_offs("s") == (0, 0)
    dropped = [
        m
        for m in logged(caplog, logging.WARNING)
        if "dropping oldest message" in m and "was closed before this message was committed" in m
    ]
    assert len(dropped) == (0 if rewritten else 1), dropped


def test_a_message_the_drop_in_cannot_spool_is_said_once_with_why_then_counted(home, caplog):
    """The gateway drops what this module refuses, in a line of its own that does not say
    why: the first refusal of a session is said at WARNING with the reason, in the link's
    words; the next ones within ``REPEAT_SECONDS`` only count towards its summary."""
    caplog.set_level(logging.DEBUG, logger="walspool.shutdown_flush")
    for _ in range(5):
        assert sf.spool_dropped_transcript_message("", {"role": "user", "content": "x"}) is None
    (line,) = logged(caplog, logging.WARNING)
    assert line.startswith(
        "Session DB transcript pending queue full for  (cap=200); dropping oldest message to "
        "make room (on-disk spool unavailable: "
    )
    assert "session_id" in line
