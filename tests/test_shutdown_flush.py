"""The drop-in functions, matching upstream shutdown_flush behaviour on the spool."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

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
