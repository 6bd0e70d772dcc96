"""Replay through the newer gateway's batch write (``append_messages_batch``): the rows
it writes are the rows one ``append_message`` each would write, every batch lands
whole or not at all with its tickets, and a crash anywhere leaves each message once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import walspool
from walspool.replay.sinks import LANDED_TABLE, SessionDBSink

ROOT = Path(__file__).resolve().parents[2]
#: Columns a replay does not choose: the row id, and the durable ids a write mints. A
#: batch also pairs a tool result with its call (``tool_call_uid``, the uid minted for
#: the call in the assistant row), as the gateway's own batch flush does; one
#: ``append_message`` per row cannot see the call and leaves it empty.
MINTED = {
    "id", "message_uid", "tool_call_uids", "tool_call_uid", "display_identity", "display_order"
}  # fmt: skip


def new_db(path: Path) -> Any:
    import hermes_state

    db = hermes_state.SessionDB(db_path=path)
    for s in ("s1", "s2"):
        db.create_session(s, "telegram")
    return db


def traffic() -> list[tuple[str, Any]]:
    """Transcript messages as the gateway spools them: one agent turn's rows share
    one timestamp, user messages carry whole seconds, a message repeats within the
    second, tool calls and their results, reasoning, the 0.22 fields."""
    turn = 1_750_000_100.25
    rows: list[tuple[str, Any]] = []
    for k in range(40):
        s = "s1" if k % 3 else "s2"
        rows += [
            (s, {"role": "user", "content": f"question {k}", "timestamp": 1_750_000_000 + k}),
            (s, {"role": "user", "content": f"question {k}", "timestamp": 1_750_000_000 + k}),
            (
                s,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call-{k}",
                            "type": "function",
                            "function": {"name": "search", "arguments": '{"q": "x"}'},
                        }
                    ],
                    "reasoning": "look it up",
                    "timestamp": turn + k,
                },
            ),
            (
                s,
                {
                    "role": "tool",
                    "content": '{"hits": 3}',
                    "tool_call_id": f"call-{k}",
                    "tool_name": "search",
                    "timestamp": turn + k,
                },
            ),
            (
                s,
                {
                    "role": "assistant",
                    "content": f"answer {k} \u00e9\u4e16",
                    "finish_reason": "stop",
                    "display_kind": "internal_notification" if k % 5 == 0 else None,
                    "display_metadata": {"k": k} if k % 5 == 0 else None,
                    "api_content": f"[api] answer {k}" if k % 7 == 0 else None,
                    "message_uid": f"uid-{k}" if k % 4 == 0 else None,
                    "timestamp": turn + k,
                },
            ),
        ]
    return rows


def rows(db: Any, session_id: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in MINTED} for r in db.get_messages(session_id)]


def replay(spool: walspool.Spool, db: Any, *, batch: bool) -> walspool.ReplayReport:
    sink = SessionDBSink(db)
    if not batch:
        sink._batch = None  # the row-by-row path, as on a gateway without a batch write
    return walspool.Replayer(spool, sink).replay()


def assert_tool_results_paired(messages: list[dict[str, Any]]) -> None:
    """Each tool result carries the uid its call got in the assistant row before it."""
    import json

    calls = {}
    for m in messages:
        if m["role"] == "assistant" and m["tool_call_uids"]:
            calls.update(json.loads(m["tool_call_uids"]))
    results = [m for m in messages if m["role"] == "tool"]
    assert results and all(calls.get(m["tool_call_id"]) == m["tool_call_uid"] for m in results)


def counted(fn: Any, calls: list[int]) -> Any:
    def batch(session_id: str, messages: list[Any], **kw: Any) -> Any:
        calls.append(len(messages))
        return fn(session_id, messages, **kw)

    return batch


def both_ways(tmp_path: Path, payloads: list[tuple[str, Any]]) -> Iterator[tuple[Any, ...]]:
    """Spool ``payloads`` and replay them into a fresh state.db, row by row and then
    batched: ``(batch, spool, db, report, calls)`` for each (``calls``: the sizes of the
    batch writes made); the state.db is closed after each."""
    for batch in (False, True):
        with walspool.Spool(tmp_path / f"spool-{batch}.db") as spool:
            spool.append_many(payloads)
            db = new_db(tmp_path / f"state-{batch}.db")
            try:
                calls: list[int] = []
                db.append_messages_batch = counted(db.append_messages_batch, calls)
                yield batch, spool, db, replay(spool, db, batch=batch), calls
            finally:
                db.close()


def test_a_batched_replay_writes_what_one_append_message_per_row_writes(tmp_path):
    messages = traffic()
    results = {}
    for batch, spool, db, report, calls in both_ways(tmp_path, messages):
        assert (report.moved, report.held, report.quarantined) == (len(messages), 0, 0)
        assert spool.stats().rows == 0
        assert bool(calls) is batch and sum(calls) == (len(messages) if batch else 0)
        if batch:
            assert_tool_results_paired(db.get_messages("s1"))
        results[batch] = (
            rows(db, "s1"),
            rows(db, "s2"),
            [db.get_session(s)["message_count"] for s in ("s1", "s2")],
            [db.get_session(s)["tool_call_count"] for s in ("s1", "s2")],
        )
    assert results[True] == results[False]
    s1 = results[True][0]
    assert [r["content"] for r in s1[:2]] == ["question 1", "question 1"]  # both kept
    assert len(s1) + len(results[True][1]) == len(messages)


def test_one_refused_row_in_a_batch_is_quarantined_and_the_rest_land_once(tmp_path):
    db = new_db(tmp_path / "state.db")
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(5)])
        spool.append("s1", {"role": "assistant", "content": "x", "tool_calls": 5})  # refused
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(5, 9)])
        calls: list[int] = []
        db.append_messages_batch = counted(db.append_messages_batch, calls)
        report = replay(spool, db, batch=True)
        assert (report.moved, report.held, report.quarantined) == (9, 0, 1)
        assert calls == [10]  # one batch failed; its rows then went one by one, once
        (kept,) = spool.records()
        assert (kept.status, kept.message["tool_calls"]) == (walspool.QUARANTINED, 5)
        assert kept.last_error.startswith("RowRejected: ") and "TypeError" in kept.last_error
    assert [m["content"] for m in db.get_messages("s1")] == [f"m{i}" for i in range(9)]
    db.close()


def test_a_batch_into_a_locked_state_db_holds_the_session_and_lands_once_later(tmp_path):
    from _fork import break_db, heal_db

    db = new_db(tmp_path / "state.db")
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(30)])
        spool.append_many([("s2", {"role": "user", "content": f"n{i}"}) for i in range(3)])
        break_db(db, "database is locked", session_id="s1")
        report = replay(spool, db, batch=True)
        assert (report.moved, report.held) == (3, 30)
        assert report.errors["s1"].endswith("Error: database is locked")
        assert db.get_messages("s1") == []
        # The batch is known not to have landed: only the row whose write failed stays
        # in flight; the rest are freed.
        in_flight = "SELECT count(*) FROM records WHERE inflight IS NOT NULL"
        assert spool.query(in_flight, ()) == [(1,)]
        heal_db(db)
        report = replay(spool, db, batch=True)
        assert (report.moved, report.held, report.recovered) == (30, 0, 0)
    assert [m["content"] for m in db.get_messages("s1")] == [f"m{i}" for i in range(30)]
    assert [m["content"] for m in db.get_messages("s2")] == [f"n{i}" for i in range(3)]
    db.close()


def test_ticket_records_of_finished_batches_are_pruned(tmp_path):
    db = new_db(tmp_path / "state.db")
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(100)])
        report = walspool.Replayer(spool, SessionDBSink(db), batch_rows=10).replay()
        assert report.moved == 100
    with db._lock:
        kept = db._conn.execute(f"SELECT count(*) FROM {LANDED_TABLE}").fetchone()[0]
    assert kept == 10  # the last batch's; every earlier one was pruned in a later write
    db.close()


#: A replay in a child process that SIGKILLs itself at one point of a batched write:
#: "insert" after the batch's third insert, before its commit; "commit" right after the
#: batch committed, before the spool learns of it.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import hermes_state, walspool
    from walspool.replay.sinks import SessionDBSink

    spool_path, state_path, point = sys.argv[1:]
    db = hermes_state.SessionDB(db_path=Path(state_path))
    inserted = [0]

    def on_insert():
        inserted[0] += 1
        if point == "insert" and inserted[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    with db._lock:
        db._conn.create_function("walspool_test_insert", 0, on_insert)
        db._conn.execute(
            "CREATE TEMP TRIGGER walspool_test_kill AFTER INSERT ON main.messages "
            "BEGIN SELECT walspool_test_insert(); END"
        )
    sink = SessionDBSink(db)
    write_many = sink.write_many

    def dying(session_id, items):
        write_many(session_id, items)
        if point == "commit":
            os.kill(os.getpid(), signal.SIGKILL)

    sink.write_many = dying
    with walspool.Spool(spool_path) as spool:
        walspool.Replayer(spool, sink, batch_rows=50).replay()
    """
)


@pytest.mark.parametrize("point", ["insert", "commit"])
def test_a_replay_killed_inside_a_batch_leaves_every_message_once(tmp_path, point):
    spool_path, state_path = tmp_path / "spool.db", tmp_path / "state.db"
    new_db(state_path).close()
    with walspool.Spool(spool_path) as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(120)])
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(spool_path), str(state_path), point],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    import hermes_state

    db = hermes_state.SessionDB(db_path=state_path)
    landed = len(db.get_messages("s1"))
    assert landed == (50 if point == "commit" else 0)
    with walspool.Spool(spool_path) as spool:
        report = walspool.Replayer(spool, SessionDBSink(db)).replay()
        assert report.recovered == (50 if point == "commit" else 0)
        assert report.moved == 120 - report.recovered and spool.stats().rows == 0
    assert [m["content"] for m in db.get_messages("s1")] == [f"m{i}" for i in range(120)]
    db.close()


def _record(message: Any) -> Any:
    from walspool.store.records import Record

    return Record(1, "s1", 1, walspool.CAP_DROP, None, 1_750_000_000.0, message, 0, None)


def test_only_transcript_messages_go_through_the_batch_write(tmp_path):
    """A transcript message (a role or content, or no adapter ``text``) is batched; an
    adapter's event, a plain text or other payload, and an agent history are not. A
    sink without the gateway's batch write or its row mapping batches nothing."""
    db = new_db(tmp_path / "state.db")
    try:
        sink = SessionDBSink(db)
        batched = {
            "a message": {"role": "user", "content": "hi"},
            "content only": {"content": "hi"},
            "role only": {"role": "assistant"},
            "neither, no text": {"timestamp": 1},
            "role and text": {"role": "user", "text": "t"},
            "content and text": {"content": "c", "text": "t"},
        }
        single = {
            "an adapter event": {"text": "from the adapter", "message_type": "text"},
            "a plain text": "pending slot text",
            "a list": [1, "two"],
            "an agent history": {"messages": [{"role": "user", "content": "x"}], "count": 1},
        }
        assert {k: sink.batchable(_record(m)) for k, m in {**batched, **single}.items()} == {
            **dict.fromkeys(batched, True),
            **dict.fromkeys(single, False),
        }
        message = _record({"role": "user", "content": "hi"})
        no_batch = SessionDBSink(db)
        no_batch._batch = None
        no_mapping = SessionDBSink(db)
        no_mapping.mapping = None
        assert (no_batch.batchable(message), no_mapping.batchable(message)) == (False, False)
    finally:
        db.close()


def test_a_batched_replay_of_mixed_payloads_writes_what_row_by_row_writes(tmp_path):
    """Shutdown slots (an adapter event, a plain text) among transcript messages: the
    batch write takes the messages, the others go one by one, in spool order."""

    def said(content: str, ts: int) -> tuple[str, Any]:
        return ("s1", {"role": "user", "content": content, "timestamp": ts})

    payloads = [
        said("first", 1_750_000_000),
        said("second", 1_750_000_000),
        ("s1", {"text": "from the adapter", "message_type": "text", "message_id": "m-1"}),
        said("third", 1_750_000_001),
        ("s1", "pending slot text"),
        said("fourth", 1_750_000_002),
        said("fifth", 1_750_000_002),
        said("sixth", 1_750_000_003),
    ]
    results = {}
    for batch, _, db, report, calls in both_ways(tmp_path, payloads):
        assert (report.moved, report.held, report.quarantined) == (8, 0, 0)
        assert calls == ([2, 3] if batch else [])  # a lone message goes by itself
        # A slot's time is when it was spooled: different in the two spools.
        results[batch] = [{k: v for k, v in r.items() if k != "timestamp"} for r in rows(db, "s1")]
    assert results[True] == results[False]
    assert [r["content"] for r in results[True]] == [
        "first", "second", "from the adapter", "third", "pending slot text", "fourth",
        "fifth", "sixth",
    ]  # fmt: skip


def test_a_replay_makes_malformed_fields_text_as_the_gateways_own_writer_does(tmp_path):
    """A spooled message from disk may carry JSON where the gateway binds text (a dict
    tool name, a list platform id, an assistant's dict reasoning with non-ASCII text):
    the replay, batched or row by row, makes each the text the gateway's own mapping
    makes (its JSON spelling, not walspool's), so the row is the one its live writer
    writes for the same message."""
    from gateway.session_transcript import transcript_append_kwargs

    messages = [
        {"role": "tool", "content": "ok", "tool_name": {"name": "search", "v": 2},
         "tool_call_id": ["call", 1], "timestamp": 1_750_000_000.5},
        {"role": "assistant", "content": "done", "reasoning": {"why": "caf\u00e9 \u4e16"},
         "platform_message_id": [7, "x"], "timestamp": 1_750_000_001.5},
        {"role": "user", "content": "next", "message_id": {"chat": 3, "id": 9},
         "timestamp": 1_750_000_002.0},
    ]  # fmt: skip
    live = new_db(tmp_path / "live.db")
    try:
        for message in messages:  # what 0.22's SessionStore._append_transcript_message does
            live.append_message(**transcript_append_kwargs("s1", message))
        expected = rows(live, "s1")
    finally:
        live.close()
    assert expected[0]["tool_name"] == '{"name": "search", "v": 2}'  # the gateway's spelling
    for batch, _, db, report, calls in both_ways(tmp_path, [("s1", m) for m in messages]):
        assert (report.moved, report.held, report.quarantined) == (3, 0, 0)
        assert calls == ([3] if batch else [])
        assert rows(db, "s1") == expected, f"batch={batch}"


def test_write_many_refuses_what_it_cannot_write_as_one_batch_word_for_word(tmp_path):
    from walspool.replay.sinks import NotBatchable

    db = new_db(tmp_path / "state.db")
    try:
        sink = SessionDBSink(db)
        message = {"role": "user", "content": "hi"}
        refusals = [
            ([], "this SessionDB has no batch write that records tickets"),
            (
                [(_record(message), ("u", 1, 1)), (_record("slot text"), ("u", 2, 2))],
                "record 1 is not a transcript message",
            ),
            (
                [(_record(message), ("u", 1, 1)), (_record(message), ("v", 1, 2))],
                "a batch's tickets come from one spool",
            ),
        ]
        for items, text in refusals:
            with pytest.raises(NotBatchable) as info:
                sink.write_many("s1", items)
            assert str(info.value) == text
        assert db.get_messages("s1") == []
    finally:
        db.close()


def test_write_many_of_one_record_lands_it_with_its_ticket(tmp_path):
    db = new_db(tmp_path / "state.db")
    try:
        sink = SessionDBSink(db)
        sink.write_many("s1", [(_record({"role": "user", "content": "hi"}), ("u", 7, 1))])
        assert [m["content"] for m in db.get_messages("s1")] == ["hi"]
        assert sink.landed([("u", 7, 1), ("u", 8, 1)]) == {("u", 7, 1)}
    finally:
        db.close()


def _counting_appends(db: Any) -> list[str]:
    """Record the content of each row ``append_message`` writes (one by one)."""
    written: list[str] = []
    append = db.append_message

    def counted_append(session_id: str, **kw: Any) -> Any:
        written.append(kw.get("content"))
        return append(session_id, **kw)

    db.append_message = counted_append
    return written


@pytest.mark.parametrize("landed_raises", [False, True])
def test_a_batch_that_committed_then_raised_is_not_written_again(tmp_path, caplog, landed_raises):
    """The batch write commits, then raises (a failure after its commit). When the
    tickets show the batch landed it counts as written: nothing goes again row by row
    and nothing is logged as failed. When they cannot be looked up, the rows go one by
    one: the first meets its ticket's record, which keeps it from landing twice, the
    session is held, and every row of the batch stays in flight with its ticket until a
    replay can look them up (found: a bug where the rows after the first were freed,
    took new tickets and landed twice)."""
    db = new_db(tmp_path / "state.db")
    batch = db.append_messages_batch

    def commit_then_raise(session_id: str, messages: list[Any], **kw: Any) -> Any:
        batch(session_id, messages, **kw)
        raise RuntimeError("after the commit")

    db.append_messages_batch = commit_then_raise
    written = _counting_appends(db)
    contents = [f"m{i}" for i in range(4)]
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": c}) for c in contents])
        sink = SessionDBSink(db)
        if landed_raises:

            def cannot_look(tickets: Any) -> Any:
                raise RuntimeError("state.db unreadable")

            sink.landed = cannot_look
        caplog.set_level("INFO", logger="walspool.replay")
        report = walspool.Replayer(spool, sink).replay()
        failed = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
        if landed_raises:
            assert (report.moved, report.held) == (0, 4)
            assert written == ["m0"]  # refused by its ticket's record: not written twice
            assert failed == [
                f"{spool.path}: a batch of 4 rows for s1 failed (RuntimeError: after the "
                "commit); writing them one by one"
            ]
            # The batch's rows stayed in flight with their tickets (it may have landed;
            # freed, they would get new tickets and land again): once the tickets can be
            # looked up, all four are found landed.
            again = walspool.Replayer(spool, SessionDBSink(db)).replay()
            assert (again.recovered, again.moved, again.held) == (4, 0, 0)
        else:
            assert (report.moved, report.held, written, failed) == (4, 0, [], [])
        assert spool.stats().rows == 0
    assert [m["content"] for m in db.get_messages("s1")] == contents
    db.close()


def test_a_batch_that_lands_is_not_written_again_row_by_row(tmp_path):
    db = new_db(tmp_path / "state.db")
    written = _counting_appends(db)
    with walspool.Spool(tmp_path / "spool.db") as spool:
        spool.append_many([("s1", {"role": "user", "content": f"m{i}"}) for i in range(3)])
        assert replay(spool, db, batch=True).moved == 3
    assert written == []
    assert [m["content"] for m in db.get_messages("s1")] == ["m0", "m1", "m2"]
    db.close()


def test_a_batch_prunes_only_its_own_spools_finished_tickets(tmp_path):
    """One state.db, two spools (two hosts replaying into it): the records a replay of
    spool A no longer needs are pruned by A's next write, never by a batch of spool B,
    whose records of rows still in its spool must stay for its own lookups."""
    db = new_db(tmp_path / "state.db")
    try:
        sink = SessionDBSink(db)

        def said(content: str) -> Any:
            return _record({"role": "user", "content": content})

        sink.write("s1", said("a1"), ("A", 1, 1))
        sink.write("s1", said("b1"), ("B", 1, 1))
        sink.forget("A", 2, [])  # A's rows under ticket 2 have left its spool
        sink.write_many("s1", [(said("b2"), ("B", 2, 2)), (said("b3"), ("B", 3, 3))])
        assert sink.landed([("A", 1, 1), ("B", 1, 1)]) == {("A", 1, 1), ("B", 1, 1)}
        sink.write_many("s1", [(said("a2"), ("A", 2, 2)), (said("a3"), ("A", 3, 3))])
        assert sink.landed([("A", n, n) for n in (1, 2, 3)] + [("B", 1, 1)]) == {
            ("A", 2, 2),
            ("A", 3, 3),
            ("B", 1, 1),
        }
        assert [m["content"] for m in db.get_messages("s1")] == [
            "a1", "b1", "b2", "b3", "a2", "a3"
        ]  # fmt: skip
    finally:
        db.close()
