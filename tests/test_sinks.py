"""SessionDBSink: the gateway's own mapping to append_message, and the landed probe."""

from __future__ import annotations

import datetime
import sqlite3
import threading
import types
from pathlib import Path
from typing import Any

import pytest

import walspool
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import (
    NotAMessage,
    RowRejected,
    SessionDBClosed,
    SessionDBSink,
    SessionMissing,
    append_kwargs,
    as_rejection,
    bindable,
    is_row_rejection,
    met_a_lock,
    raised_by_value,
    rejects_content,
    rejects_live_row,
)
from walspool.store.records import Record

hermes_state = pytest.importorskip("hermes_state")
gateway_session = pytest.importorskip("gateway.session")

T0 = 1_750_000_000.25

ASSISTANT = {
    "role": "assistant",
    "content": "Let me check the weather.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
        }
    ],
    "reasoning": "The user wants weather.",
    "reasoning_content": "thinking...",
    "reasoning_details": [{"type": "reasoning.text", "text": "step 1"}],
    "codex_reasoning_items": [{"id": "rs_1", "summary": []}],
    "codex_message_items": [{"id": "msg_1", "content": []}],
    "finish_reason": "tool_calls",
    "timestamp": T0 + 1,
}
USER = {
    "role": "user",
    "content": "Wie ist das Wetter? ☔ 天气",
    "message_id": "tg-42",
    "observed": 1,
    "api_content": "[note] Wie ist das Wetter?",
    "timestamp": T0,
    "reasoning": "a user row's reasoning is not stored",
}
TOOL = {
    "role": "tool",
    "content": '{"temp": -3.5}',
    "tool_call_id": "call_1",
    "tool_name": "weather",
    "timestamp": T0 + 2,
    "api_content": {"not": "a string"},
}
MULTIMODAL = {
    "role": "user",
    "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}],
    "platform_message_id": "p-7",
    "message_id": "ignored",
    "timestamp": T0 + 3,
}
MESSAGES = [USER, ASSISTANT, TOOL, MULTIMODAL]


#: A ticket as a replay gives one: (spool uid, ticket number, spool row id).
TICKET = ("spool-uid", 1, 1)


def record(message: Any, created_at: float = T0 + 100, rid: int = 1, seq: int = 1) -> Record:
    return Record(rid, "s", seq, walspool.CAP_DROP, None, created_at, message, 0, None)


@pytest.fixture
def state_db(tmp_path: Path):
    db = hermes_state.SessionDB(db_path=tmp_path / "state.db")
    yield db
    db.close()


def stored(db: Any, session_id: str) -> list[dict[str, Any]]:
    """A session's rows as get_messages gives them, without the row id and session."""
    return [
        {k: v for k, v in row.items() if k not in ("id", "session_id")}
        for row in db.get_messages(session_id, include_inactive=True)
    ]


def test_rows_equal_what_the_gateway_itself_writes(spool, state_db, tmp_path):
    direct = hermes_state.SessionDB(db_path=tmp_path / "gateway.db")
    direct.create_session("s", "telegram")
    store = types.SimpleNamespace(_db=direct)
    for message in MESSAGES:
        gateway_session.SessionStore._append_transcript_message(store, "s", dict(message))
    expected = stored(direct, "s")
    direct.close()
    state_db.create_session("s", "telegram")
    for message in MESSAGES:
        spool.append("s", message)
    report = Replayer(spool, SessionDBSink(state_db)).replay()
    assert (report.moved, report.held) == (4, 0)
    assert stored(state_db, "s") == expected
    rows = state_db.get_messages("s")
    assert rows[0]["platform_message_id"] == "tg-42" and rows[0]["observed"] == 1
    assert rows[0]["reasoning"] is None and rows[0]["api_content"] == USER["api_content"]
    assert rows[1]["tool_calls"] == ASSISTANT["tool_calls"]
    assert rows[1]["reasoning_content"] == "thinking..." and rows[1]["finish_reason"] is None
    assert (rows[2]["tool_name"], rows[2]["tool_call_id"], rows[2]["api_content"]) == (
        "weather",
        "call_1",
        None,
    )
    assert rows[3]["content"] == MULTIMODAL["content"]
    assert rows[3]["platform_message_id"] == "p-7"
    assert [r["timestamp"] for r in rows] == [T0, T0 + 1, T0 + 2, T0 + 3]


def test_reasoning_fields_only_for_assistant_rows():
    for role in ("user", "tool", "system"):
        kwargs = append_kwargs(record({**ASSISTANT, "role": role}))
        assert all(
            kwargs[name] is None
            for name in (
                "reasoning",
                "reasoning_content",
                "reasoning_details",
                "codex_reasoning_items",
                "codex_message_items",
            )
        ), role
    assert append_kwargs(record(ASSISTANT))["reasoning_details"] == ASSISTANT["reasoning_details"]


def test_role_defaults_to_unknown_and_observed_is_a_bool():
    kwargs = append_kwargs(record({"content": "hi", "observed": "yes"}))
    assert (kwargs["role"], kwargs["observed"], kwargs["platform_message_id"]) == (
        "unknown",
        True,
        None,
    )


def test_non_transcript_payloads_become_user_messages():
    assert append_kwargs(record("pending slot text", created_at=T0)) == {
        "role": "user",
        "content": "pending slot text",
        "timestamp": T0,
    }
    event = {
        "text": "from the adapter",
        "message_type": "text",
        "message_id": "m-1",
        "source": {"platform": "telegram"},
        "raw_message": None,
    }
    assert append_kwargs(record(event, created_at=T0)) == {
        "role": "user",
        "content": "from the adapter",
        "platform_message_id": "m-1",
        "timestamp": T0,
    }
    assert append_kwargs(record([1, "two"], created_at=T0)) == {
        "role": "user",
        "content": '[1,"two"]',
        "timestamp": T0,
    }


def test_a_transcript_message_keeps_only_text_api_content_and_a_text_uid():
    """``api_content`` is text in state.db and ``message_uid`` a non-empty str; other
    values are left out, not converted."""
    kwargs = append_kwargs(
        record({"role": "user", "content": "hi", "api_content": {"a": 1}, "message_uid": 7})
    )
    assert kwargs["api_content"] is None and "message_uid" not in kwargs
    kwargs = append_kwargs(
        record({"role": "user", "content": "hi", "api_content": "x", "message_uid": "u-1"})
    )
    assert (kwargs["api_content"], kwargs["message_uid"]) == ("x", "u-1")


@pytest.mark.parametrize(
    "value, expected",
    [
        (T0, T0),
        (1_750_000_000, 1_750_000_000.0),
        ("1750000000.5", 1_750_000_000.5),
        ("2025-06-15T12:00:00+00:00", 1_749_988_800.0),
        (None, T0 + 100),
        ("not a time", T0 + 100),
        (True, T0 + 100),
        ({"nested": 1}, T0 + 100),
    ],
)
def test_timestamp_is_always_an_explicit_float(value, expected):
    assert append_kwargs(record({"role": "user", "timestamp": value}))["timestamp"] == expected


def test_a_spooled_datetime_keeps_its_time(spool, state_db):
    when = datetime.datetime(2025, 6, 15, 12, 0, tzinfo=datetime.UTC)
    state_db.create_session("s", "cli")
    spool.append("s", {"role": "user", "content": "x", "timestamp": when})
    Replayer(spool, SessionDBSink(state_db)).replay()
    assert state_db.get_messages("s")[0]["timestamp"] == when.timestamp()


class LookAlike:
    """A SessionDB stand-in whose append_message takes fewer keywords, no _conn."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.sessions = {"s"}

    def append_message(
        self,
        session_id: str,
        role: str,
        content: Any = None,
        timestamp: Any = None,
        tool_calls: Any = None,
    ) -> int:
        self.rows.append(
            {
                "id": len(self.rows) + 1,
                "session_id": session_id,
                "role": role,
                "content": content,
                "timestamp": timestamp,
                "tool_calls": tool_calls,
            }
        )
        return len(self.rows)

    def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["session_id"] == session_id]


def test_only_keywords_the_installed_append_message_accepts(spool):
    db = LookAlike()
    spool.append("s", ASSISTANT)
    spool.append("s", USER)
    sink = SessionDBSink(db)
    assert sink.landed([("spool", 1, 1)]) is None  # no ticket records: cannot tell
    assert Replayer(spool, sink).replay().moved == 2
    assert db.rows[0]["tool_calls"] == ASSISTANT["tool_calls"]
    assert [(r["role"], r["timestamp"]) for r in db.rows] == [("assistant", T0 + 1), ("user", T0)]


def test_append_message_with_var_keywords_gets_everything():
    seen: dict[str, Any] = {}

    class Open:
        def append_message(self, session_id: str, **kwargs: Any) -> int:
            seen.update(kwargs)
            return 1

    SessionDBSink(Open()).write("s", record(ASSISTANT), TICKET)
    assert seen["codex_message_items"] == ASSISTANT["codex_message_items"]
    assert seen["api_content"] is None and seen["timestamp"] == T0 + 1


def test_missing_session_raises_a_clear_error_and_writes_nothing(state_db):
    sink = SessionDBSink(state_db)
    with pytest.raises(SessionMissing) as info:
        sink.write("nope", record(USER), TICKET)
    assert str(info.value) == (
        "session nope does not exist in state.db (FOREIGN KEY constraint failed); "
        "replay with create_missing=True to create it"
    )
    assert info.value.session_id == "nope"
    assert isinstance(info.value, walspool.WalspoolError)


def test_create_missing_creates_the_session_once(state_db, caplog):
    sink = SessionDBSink(state_db, create_missing=True)
    caplog.set_level("WARNING", logger="walspool.sinks")
    sink.write("new", record(USER), ("u", 1, 1))
    sink.write("new", record(TOOL), ("u", 2, 2))
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.sinks"] == [
        "creating missing session new in state.db for replayed messages"
    ]
    assert sink.landed([("u", 1, 1), ("u", 2, 2)]) == {("u", 1, 1), ("u", 2, 2)}
    assert [r["role"] for r in state_db.get_messages("new")] == ["user", "tool"]
    assert state_db.get_session("new")["source"] == "walspool"


def test_create_missing_leaves_an_existing_session_alone(state_db):
    state_db.create_session("s", "telegram")
    SessionDBSink(state_db, create_missing=True).write("s", record(USER), TICKET)
    assert state_db.get_session("s")["source"] == "telegram"


def test_landed_is_exact_among_identical_rows_of_other_writers(state_db):
    """Same role, content and whole-second timestamp, written by the sink and by the
    gateway in between: only the tickets the sink wrote are found."""
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    same = {"role": "user", "content": "ok", "timestamp": T0}
    tickets = [("u", n, n) for n in range(1, 5)]
    assert sink.landed(tickets) == set()
    sink.write("s", record(same, rid=1, seq=1), tickets[0])
    state_db.append_message("s", "user", "ok", timestamp=T0)  # the gateway, same second
    sink.write("s", record(same, rid=2, seq=2), tickets[1])
    state_db.append_message("s", "user", "ok", timestamp=T0)
    assert sink.landed(tickets) == set(tickets[:2])
    assert sink.landed([("other spool", 1, 1)]) == set()
    # The same number on another row (a hand edit) is not taken for this row.
    assert sink.landed([("u", 1, 99)]) == set()
    assert len(state_db.get_messages("s")) == 4


def test_a_rewrite_of_the_transcript_does_not_unland_a_row(state_db):
    """/retry, /undo and /compress replace the session's rows: a row that landed is
    still known to have landed, so it is never written twice."""
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    sink.write("s", record(USER), TICKET)
    state_db.replace_messages("s", [{"role": "user", "content": "rewritten", "timestamp": T0}])
    assert sink.landed([TICKET]) == {TICKET}


def test_a_failed_write_records_no_ticket(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    sink.write("s", record(USER), ("u", 1, 1))
    with state_db._lock:
        state_db._conn.execute(
            "CREATE TRIGGER broken BEFORE INSERT ON messages "
            "BEGIN SELECT RAISE(ABORT, 'database disk image is malformed'); END"
        )
    with pytest.raises(Exception, match="malformed"):
        sink.write("s", record(TOOL), ("u", 2, 2))
    assert sink.landed([("u", 1, 1), ("u", 2, 2)]) == {("u", 1, 1)}


def test_only_the_replaying_thread_records_tickets(state_db):
    """The gateway's own writes through the same SessionDB, concurrently: none of
    them records a ticket, and every replayed write records its own."""
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    sink.write("s", record(USER, rid=1, seq=1), ("u", 1, 1))  # sets up the trigger
    other = threading.Thread(
        target=lambda: [state_db.append_message("s", "assistant", str(i)) for i in range(200)]
    )
    other.start()
    tickets = [("u", n, n) for n in range(2, 202)]
    for ticket in tickets:
        sink.write("s", record(USER, rid=ticket[2], seq=ticket[1]), ticket)
    other.join(30)
    assert not other.is_alive()
    with state_db._lock:
        recorded = state_db._conn.execute("SELECT count(*) FROM walspool_landed").fetchone()[0]
    assert sink.landed(tickets) == set(tickets)
    assert recorded == len(tickets) + 1
    # The gateway's writes, on a thread that never replayed, all landed.
    gateway = [r["content"] for r in state_db.get_messages("s") if r["role"] == "assistant"]
    assert gateway == [str(i) for i in range(200)]


def test_ticket_records_are_pruned_in_a_later_write(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    for n in range(1, 6):
        sink.write("s", record(USER, rid=n, seq=n), ("u", n, n))
    sink.forget("u", below=6, keep=[2])  # rows 1, 3, 4, 5 have left the spool
    sink.write("s", record(USER, rid=6, seq=6), ("u", 6, 6))
    with state_db._lock:
        left = state_db._conn.execute("SELECT ticket FROM walspool_landed ORDER BY 1").fetchall()
    assert [tuple(row) for row in left] == [(2,), (6,)]


def test_locked_state_db_holds_the_row_and_the_next_replay_moves_it(spool, state_db, tmp_path):
    import sqlite3

    state_db.create_session("s", "cli")
    state_db._WRITE_MAX_RETRIES = 1
    state_db._conn.execute("PRAGMA busy_timeout = 50")
    spool.append("s", USER)
    spool.append("s", TOOL)
    blocker = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        report = Replayer(spool, SessionDBSink(state_db)).replay()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert (report.moved, report.held) == (0, 2)
    assert "database is locked" in report.errors["s"]
    assert [r.attempts for r in spool.records()] == [1, 0]
    assert Replayer(spool, SessionDBSink(state_db)).replay().moved == 2
    assert [r["role"] for r in state_db.get_messages("s")] == ["user", "tool"]


def test_sink_write_is_thread_safe_with_the_gateway_writing(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    other = threading.Thread(
        target=lambda: [state_db.append_message("s", "assistant", str(i)) for i in range(50)]
    )
    other.start()
    for i in range(50):
        message = record({"role": "user", "content": str(i)}, created_at=T0 + i)
        sink.write("s", message, ("u", i + 1, i + 1))
    other.join(30)
    assert not other.is_alive()
    rows = state_db.get_messages("s")
    assert [r["content"] for r in rows if r["role"] == "user"] == [str(i) for i in range(50)]
    assert [r["content"] for r in rows if r["role"] == "assistant"] == [str(i) for i in range(50)]


def test_an_agent_history_spooled_whole_is_quarantined_not_written(spool, state_db):
    state_db.create_session("s", "cli")
    history = {"session_id": "s", "count": 2, "messages": [USER, TOOL]}
    spool.append("s", history, reason=walspool.AGENT_HISTORY)
    report = Replayer(spool, SessionDBSink(state_db)).replay(reasons=[walspool.AGENT_HISTORY])
    assert (report.moved, report.held, report.quarantined) == (0, 0, 1)
    (kept,) = spool.records()
    assert kept.status == walspool.QUARANTINED
    assert kept.last_error == (
        "record 1 (session s, seq 1) holds a list of messages, not one message; "
        "export it and recover it by hand"
    )
    assert state_db.get_messages("s") == []
    with pytest.raises(NotAMessage):
        SessionDBSink(state_db).write("s", record(history), TICKET)


def test_the_gateways_own_mapping_is_used_where_it_has_one():
    seen: list[tuple[str, dict[str, Any], Any]] = []

    def transcript_append_kwargs(session_id, message, *, fallback_ts=None):
        seen.append((session_id, message, fallback_ts))
        return {"session_id": session_id, "role": message["role"], "display_kind": "x"}

    message = {"role": "user", "content": "hi", "message_uid": "u-1", "timestamp": "bad"}
    kwargs = append_kwargs(record(message), transcript_append_kwargs)
    assert seen == [("", message, T0 + 100)]
    assert kwargs == {
        "role": "user",
        "display_kind": "x",
        "message_uid": "u-1",
        "timestamp": T0 + 100,  # normalised as on 0.19.0: an unusable time falls back
    }
    # Slot payloads keep walspool's mapping: the gateway maps transcript rows only.
    assert append_kwargs(record({"text": "slot"}), transcript_append_kwargs)["content"] == "slot"


def test_newer_fields_travel_only_where_the_message_has_them():
    kwargs = append_kwargs(
        record({"role": "user", "display_kind": "internal_notification", "message_uid": "u"})
    )
    assert (kwargs["display_kind"], kwargs["message_uid"]) == ("internal_notification", "u")
    assert "display_metadata" not in kwargs
    assert (
        not {"display_kind", "display_metadata", "message_uid"} & append_kwargs(record(USER)).keys()
    )


def test_on_0_19_the_installed_gateway_has_no_mapping_of_its_own(state_db):
    from walspool.replay.sinks import gateway_mapping

    assert gateway_mapping() is None
    assert SessionDBSink(state_db).mapping is None


def test_a_row_the_newer_gateway_blames_is_a_content_rejection(state_db):
    from walspool.replay.sinks import RowRejected, rejects_content

    state_db.create_session("s", "telegram")

    def mapping(session_id, message, *, fallback_ts=None):
        raise TypeError("unhashable")

    sink = SessionDBSink(state_db, mapping=mapping)
    with pytest.raises(RowRejected) as info:
        sink.write("s", record(USER), TICKET)
    assert rejects_content(info.value) and isinstance(info.value.__cause__, TypeError)
    assert str(info.value) == "the gateway cannot map this message: TypeError('unhashable')"
    assert state_db.get_messages("s") == []


# -- the classifiers, the binding rule and the ticket bookkeeping, one case at a time --

ERRORS = {
    "not a message": (NotAMessage(record({"messages": []})), True, False),
    "row rejected": (RowRejected("TypeError: x"), True, True),
    "interface": (sqlite3.InterfaceError("Error binding parameter 1"), True, True),
    "interface, other": (sqlite3.InterfaceError("bad parameter"), True, False),
    "data": (sqlite3.DataError("string or blob too big"), True, False),
    "programming, binding": (sqlite3.ProgrammingError("Error binding parameter :x"), True, True),
    "programming, Binding": (sqlite3.ProgrammingError("Binding parameter 2 failed"), False, True),
    "programming, type": (sqlite3.ProgrammingError("type 'dict' is not supported"), True, False),
    "programming, closed": (
        sqlite3.ProgrammingError("Cannot operate on a closed db"),
        False,
        False,
    ),
    "not null": (sqlite3.IntegrityError("NOT NULL constraint failed: messages.role"), True, False),
    "check": (sqlite3.IntegrityError("CHECK constraint failed: role"), True, False),
    "mismatch": (sqlite3.IntegrityError("datatype mismatch"), True, False),
    "foreign key": (sqlite3.IntegrityError("FOREIGN KEY constraint failed"), False, False),
    "unique": (sqlite3.IntegrityError("UNIQUE constraint failed: messages.id"), False, False),
    "locked": (sqlite3.OperationalError("database is locked"), False, False),
    "malformed": (sqlite3.DatabaseError("database disk image is malformed"), False, False),
    "overflow": (OverflowError("Python int too large"), True, True),
    "unicode": (UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates"), True, True),
    "recursion": (RecursionError("maximum recursion depth"), True, False),
    "type": (TypeError("unhashable"), False, True),
    "value": (ValueError("bad"), False, True),
    "attribute": (AttributeError("no attribute"), False, True),
    "os": (OSError("disk gone"), False, False),
    "key": (KeyError("role"), False, False),
}


@pytest.mark.parametrize("case", ERRORS)
def test_which_errors_blame_the_row(case):
    """``rejects_content`` (walspool's rule) and ``is_row_rejection`` (the newer
    gateway's), on each kind of error."""
    exc, content, gateway = ERRORS[case]
    assert rejects_content(exc) is content
    assert is_row_rejection(exc) is gateway


class _Raises:
    """A value whose ``__class__``, attributes, truth, length, iteration and comparison
    all raise the same RuntimeError."""

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError("hostile")

    def __bool__(self) -> bool:
        raise RuntimeError("hostile")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("hostile")

    __hash__ = None  # type: ignore[assignment]


# (error of the live write, the message) -> whether the message raised it
RAISED_BY_VALUE = {
    "the value raises it": (RuntimeError("hostile"), {"tool_calls": [_Raises()]}, True),
    "at the top": (RuntimeError("hostile"), {"tool_calls": _Raises()}, True),
    "in the role": (RuntimeError("hostile"), {"role": _Raises(), "content": "c"}, True),
    "another text": (RuntimeError("other"), {"tool_calls": [_Raises()]}, False),
    "another type": (KeyError("hostile"), {"tool_calls": [_Raises()]}, False),
    "no value raises": (RuntimeError("hostile"), {"role": "user", "content": "c"}, False),
    "a bug's error, plain values": (
        RuntimeError("the store's own bug"),
        {"role": "user", "content": "c", "timestamp": datetime.datetime(2026, 1, 1)},
        False,
    ),
    "sqlite's error": (
        sqlite3.OperationalError("database is locked"),
        {"tool_calls": [_Raises()]},
        False,
    ),
    "not a dict": (RuntimeError("hostile"), _Raises(), True),
}


@pytest.mark.parametrize("case", RAISED_BY_VALUE)
def test_an_error_is_the_messages_when_one_of_its_values_raises_it_again(case):
    """``raised_by_value``: an error no rule classifies is blamed on the message only when
    one of its values, inspected alone, raises the same error (type and text) again."""
    exc, message, raised = RAISED_BY_VALUE[case]
    assert raised_by_value(exc, message) is raised
    assert rejects_live_row(exc, None, message) is raised
    assert rejects_live_row(exc, None) is False  # without the message, not the row's


def test_a_row_only_the_newer_gateway_blames_becomes_a_row_rejected():
    rejected = as_rejection(TypeError("unhashable type: 'dict'"))
    assert isinstance(rejected, RowRejected)
    assert str(rejected) == "TypeError: unhashable type: 'dict'"
    assert as_rejection(OverflowError("too big")) is None  # walspool's rule already blames it
    assert as_rejection(sqlite3.OperationalError("database is locked")) is None


def test_bindable_turns_what_sqlite_cannot_bind_into_text():
    kwargs = {
        "role": {"r": 1},
        "tool_name": ["a"],
        "tool_call_id": 2**63,
        "platform_message_id": -(2**63) - 1,
        "reasoning": 2**63 - 1,
        "reasoning_content": -(2**63),
        "content": 2**64,
        "tool_calls": {"kept": True},
    }
    assert bindable(kwargs) == {
        "role": '{"r":1}',
        "tool_name": '["a"]',
        "tool_call_id": "9223372036854775808",
        "platform_message_id": "-9223372036854775809",
        "reasoning": 2**63 - 1,
        "reasoning_content": -(2**63),
        "content": "18446744073709551616",
        "tool_calls": {"kept": True},
    }
    same = {"role": None, "tool_name": 1.5, "tool_call_id": True, "content": True}
    assert bindable(same) == same
    assert bindable({"content": 2**63 - 1}) == {"content": 2**63 - 1}
    assert bindable({"content": -(2**63) - 1}) == {"content": "-9223372036854775809"}
    assert bindable({"content": [1]}) == {"content": [1]}  # SessionDB stores lists itself


def test_keywords_of_an_append_message_without_a_signature_all_pass():
    seen: dict[str, Any] = {}

    class Unsigned:
        __signature__ = "not a signature"  # inspect.signature raises TypeError

        def __call__(self, session_id: str, **kwargs: Any) -> int:
            seen.update(kwargs)
            return 1

    SessionDBSink(types.SimpleNamespace(append_message=Unsigned())).write("s", record(USER), TICKET)
    assert seen["api_content"] == USER["api_content"] and seen["observed"] is True


def test_keyword_only_parameters_are_accepted_and_positional_only_are_not():
    seen: dict[str, Any] = {}

    class Db:
        def append_message(
            self, timestamp=None, /, *, session_id, role, content=None, observed=None
        ):
            seen.update(timestamp=timestamp, role=role, content=content, observed=observed)
            return 1

    SessionDBSink(Db()).write("s", record(USER), TICKET)
    assert seen == {"timestamp": None, "role": "user", "content": USER["content"], "observed": True}


def test_landed_answers_for_several_spools_at_once(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    sink.write("s", record(USER, rid=1), ("a", 1, 1))
    sink.write("s", record(USER, rid=1), ("b", 1, 1))
    sink.write("s", record(USER, rid=2), ("b", 2, 2))
    asked = [("a", 1, 1), ("b", 1, 1), ("b", 2, 2), ("a", 2, 2), ("b", 3, 3)]
    assert sink.landed(asked) == {("a", 1, 1), ("b", 1, 1), ("b", 2, 2)}


def test_pruning_touches_only_its_own_spool_and_happens_once(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    for n in (1, 2):
        sink.write("s", record(USER, rid=n), ("u", n, n))
    sink.forget("u", below=3, keep=[])
    sink.write("s", record(USER, rid=1), ("v", 1, 1))  # another spool's write: no prune
    assert sink.landed([("u", 1, 1), ("u", 2, 2)]) == {("u", 1, 1), ("u", 2, 2)}
    sink.write("s", record(USER, rid=3), ("u", 3, 3))  # prunes 1 and 2
    assert sink.landed([("u", 1, 1), ("u", 2, 2), ("u", 3, 3)]) == {("u", 3, 3)}
    sink.write("s", record(USER, rid=4), ("u", 4, 4))  # nothing left to prune: 3 stays
    assert sink.landed([("u", 3, 3), ("u", 4, 4)]) == {("u", 3, 3), ("u", 4, 4)}
    assert sink.landed([("v", 1, 1)]) == {("v", 1, 1)}


def test_a_closed_session_db_cannot_be_asked_and_is_not_written_untracked(state_db):
    state_db.create_session("s", "cli")
    sink = SessionDBSink(state_db)
    sink.write("s", record(USER), TICKET)
    state_db.close()
    with pytest.raises(SessionDBClosed, match="has no open connection; its rows stay in flight"):
        sink.landed([TICKET])
    with pytest.raises(SessionDBClosed, match="is closed"):
        sink.write("s", record(TOOL, rid=2, seq=2), ("spool-uid", 2, 2))


def test_an_agent_history_is_a_list_of_messages_and_nothing_else():
    history = {"session_id": "s", "messages": [USER]}
    with pytest.raises(NotAMessage):
        SessionDBSink(LookAlike()).write("s", record(history), TICKET)
    for message in (
        {"messages": "not a list"},
        {"messages": [USER], "role": "user"},
        {"messages": [USER], "content": "x"},
        {"messages": [USER], "text": "x"},
    ):
        db = LookAlike()
        SessionDBSink(db).write("s", record(message), TICKET)
        assert len(db.rows) == 1, message


def test_an_event_whose_text_is_not_a_string_is_stored_as_json_text():
    kwargs = append_kwargs(record({"text": ["a", 1], "platform_message_id": "p"}, created_at=T0))
    assert kwargs == {
        "role": "user",
        "content": '["a",1]',
        "platform_message_id": "p",
        "timestamp": T0,
    }


class PrivateParts(LookAlike):
    """A look-alike with some of SessionDB's private parts (``_conn``, ``_lock``,
    ``_execute_write``): only all three, with ``_conn`` None, make a closed SessionDB."""

    def __init__(self, **parts: Any) -> None:
        super().__init__()
        for name, value in parts.items():
            setattr(self, name, value)


def _execute_write(fn: Any) -> None:
    raise sqlite3.ProgrammingError("Cannot operate on a closed database.")


@pytest.mark.parametrize(
    "parts, closed",
    [
        ({"_conn": None, "_lock": threading.Lock(), "_execute_write": _execute_write}, True),
        ({"_conn": object(), "_lock": threading.Lock(), "_execute_write": _execute_write}, False),
        ({"_lock": threading.Lock(), "_execute_write": _execute_write}, False),
        ({"_execute_write": _execute_write}, False),
        ({"_conn": None, "_execute_write": _execute_write}, False),
        ({"_conn": None, "_lock": threading.Lock()}, False),
        ({"_conn": None, "_lock": object(), "_execute_write": _execute_write}, False),
        ({"_conn": None, "_lock": threading.Lock(), "_execute_write": "not callable"}, False),
    ],
)
def test_only_a_sessiondb_with_its_connection_closed_counts_as_closed(parts, closed):
    sink = SessionDBSink(PrivateParts(**parts))
    if closed:
        with pytest.raises(SessionDBClosed):
            sink.landed([TICKET])
        with pytest.raises(SessionDBClosed, match="is closed: Cannot operate on a closed"):
            sink.write("s", record(USER), TICKET)
    else:
        assert sink.landed([TICKET]) is None  # a look-alike: cannot tell
        sink.write("s", record(USER), TICKET)
        assert len(sink.session_db.rows) == 1


class Reopening(hermes_state.SessionDB):
    """0.22's ``SessionDB``: a write after ``close()`` opens a new connection first."""

    def _execute_write(self, fn: Any) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    str(self.db_path), check_same_thread=False, timeout=1.0, isolation_level=None
                )
                self._conn.row_factory = sqlite3.Row
        return super()._execute_write(fn)


def test_a_session_db_that_reopens_at_its_next_write_is_written_with_tickets(tmp_path):
    db = Reopening(db_path=tmp_path / "state.db")
    try:
        db.create_session("s", "cli")
        sink = SessionDBSink(db)
        sink.write("s", record(USER), ("u", 1, 1))
        db.close()
        sink.write("s", record(TOOL, rid=2, seq=2), ("u", 2, 2))
        assert sink.landed([("u", 1, 1), ("u", 2, 2)]) == {("u", 1, 1), ("u", 2, 2)}
        assert [r["role"] for r in db.get_messages("s")] == ["user", "tool"]
    finally:
        db.close()


class Refusing(LookAlike):
    """A look-alike whose ``append_message`` raises what the newer gateway blames on
    the row."""

    def append_message(self, session_id: str, role: str, **kwargs: Any) -> int:
        raise ValueError("bad value for role")


def test_an_append_error_the_gateway_blames_is_a_row_rejection_only_with_its_mapping():
    def mapping(session_id, message, *, fallback_ts=None):
        return {"role": message["role"], "content": message["content"]}

    with pytest.raises(RowRejected, match="^ValueError: bad value for role$") as info:
        SessionDBSink(Refusing(), mapping=mapping).write("s", record(USER), TICKET)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="^bad value for role$") as plain:
        SessionDBSink(Refusing(), mapping=None).write("s", record(USER), TICKET)
    assert not isinstance(plain.value, RowRejected)


def test_a_look_alike_is_not_prepared_for_tickets_and_a_closed_one_that_stays_closed_fails():
    assert SessionDBSink(LookAlike()).set_up_tickets() is False
    stays_closed = PrivateParts(_conn=None, _lock=threading.Lock(), _execute_write=lambda fn: None)
    sink = SessionDBSink(stays_closed)
    with pytest.raises(SessionDBClosed, match=r"^<.*PrivateParts object at .*> is closed$"):
        sink.write("s", record(USER), TICKET)
    assert stays_closed.rows == []


def test_an_unusable_timestamp_is_logged_at_debug(caplog):
    caplog.set_level("DEBUG", logger="walspool.sinks")
    assert append_kwargs(record({"role": "user", "timestamp": "soon"}))["timestamp"] == T0 + 100
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.sinks"] == [
        "ignoring message timestamp 'soon'; using the spool time"
    ]


def test_a_message_with_text_and_a_role_or_content_is_a_transcript_message():
    kwargs = append_kwargs(record({"role": "assistant", "text": "t"}))
    assert (kwargs["role"], kwargs["content"]) == ("assistant", None)
    kwargs = append_kwargs(record({"content": "c", "text": "t"}))
    assert (kwargs["role"], kwargs["content"]) == ("unknown", "c")


def test_the_gateway_mapping_keeps_its_own_message_uid_and_gets_none_it_lacks():
    def mapping(session_id, message, *, fallback_ts=None):
        return {"role": message["role"], **message.get("mapped", {})}

    given = {"role": "user", "message_uid": "mine", "mapped": {"message_uid": "theirs"}}
    assert append_kwargs(record(given), mapping)["message_uid"] == "theirs"
    mine = append_kwargs(record({"role": "user", "message_uid": "mine"}), mapping)
    assert mine["message_uid"] == "mine"
    for uid in (None, "", 7):
        kwargs = append_kwargs(record({"role": "user", "message_uid": uid}), mapping)
        assert "message_uid" not in kwargs, uid
    assert "message_uid" not in append_kwargs(record({"role": "user"}), mapping)


def test_a_lock_held_elsewhere_is_told_from_other_state_db_failures(tmp_path):
    """``met_a_lock``: what a statement on state.db raises when another process keeps its
    lock past the busy timeout (SQLITE_BUSY), and only that, by the error's code."""
    path = tmp_path / "state.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    waiter = sqlite3.connect(path, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        waiter.execute("SELECT * FROM t")
    holder.execute("ROLLBACK")
    with pytest.raises(sqlite3.OperationalError) as missing:
        waiter.execute("SELECT * FROM nowhere")
    with pytest.raises(sqlite3.IntegrityError) as refused:
        holder.execute("CREATE TABLE u (x NOT NULL)")
        holder.execute("INSERT INTO u VALUES (NULL)")
    assert met_a_lock(locked.value)
    assert not met_a_lock(missing.value)
    assert not met_a_lock(refused.value)
    assert met_a_lock(RuntimeError("database is locked"))  # no code: by its text
