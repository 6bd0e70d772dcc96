"""What the spool holds, stream by stream (``walspool.store.streams``), on a real spool
changed the ways it is in use: replays out in flight, rows set aside, agent histories,
payloads past the scan's JSON bound."""

from __future__ import annotations

from typing import Any

import apsw

import walspool
from walspool import AGENT_HISTORY
from walspool.store import paging, streams

BIG = "x" * (paging.SCAN_JSON_BYTES + 1)


def msg(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **extra}


def sql(spool: walspool.Spool, statement: str) -> None:
    """Change the file as an operator would, with a connection of its own."""
    conn = apsw.Connection(str(spool.path))
    try:
        conn.execute(statement)
    finally:
        conn.close()


def test_left_to_replay_counts_what_a_replay_would_still_write(spool):
    for i in range(3):
        spool.append("s", msg(str(i)))
    spool.append("s", msg("history"), reason=AGENT_HISTORY)
    spool.append(None, msg("keyed"), session_key="k")
    sql(spool, "UPDATE records SET status = 'quarantined' WHERE session_id = 's' AND seq = 1")
    sql(spool, "UPDATE records SET status = 'superseded', inflight = 7 WHERE seq = 2")
    # seq 1 set aside (waits for an operator), seq 2 in flight (a replay has it out).
    assert streams.left_to_replay(spool, ("session_id", "s")) == 2
    assert streams.left_to_replay(spool, ("session_key", "k")) == 1
    assert streams.left_to_replay(spool, ("session_key", "s")) == 0
    assert streams.sessions_left(spool) == {"s"}
    assert streams.any_left_to_replay(spool)


def test_agent_history_alone_is_nothing_left_to_replay(spool):
    spool.append("s", msg("history"), reason=AGENT_HISTORY)
    assert not streams.any_left_to_replay(spool)
    assert streams.sessions_left(spool) == set()
    assert not streams.empty(spool)


def test_keys_to_resolve_at_their_oldest_rows_time_large_payloads_too(spool):
    spool.append(None, msg("late", timestamp=200.0), session_key="b")
    spool.append(None, msg(BIG, timestamp=150.5), session_key="b")
    spool.append(None, msg(BIG, timestamp=90), session_key="a")
    spool.append(None, msg("no time"), session_key="c")
    spool.append("s", msg("has a session", timestamp=1.0))
    conn = apsw.Connection(str(spool.path), flags=apsw.SQLITE_OPEN_READONLY)
    (c_created,) = (conn.execute("SELECT created_at FROM records WHERE session_key = 'c'").get,)
    conn.close()
    # Each key at its oldest row's own timestamp, else the time it was spooled.
    assert streams.keys_to_resolve(spool) == [("a", 90), ("b", 150.5), ("c", c_created)]


def test_bytes_by_session_and_the_largest_id(spool):
    a = spool.append("a", msg("12345"))
    spool.append("b", msg("1"))
    last = spool.append(None, msg("keyed"), session_key="k")
    by_session, top = streams.bytes_by_session(spool)
    assert set(by_session) == {"a", "b"} and by_session["a"] > by_session["b"] > 0
    assert top == last.id
    assert [(i, s) for i, s, _ in streams.sizes(spool, [a.id, 999])] == [(a.id, "a")]
    assert streams.present(spool, [a.id, last.id, 999]) == {a.id, last.id}


def test_an_empty_spool(spool):
    assert streams.empty(spool)
    assert streams.bytes_by_session(spool) == ({}, 0)
    assert streams.keys_to_resolve(spool) == []


def test_names_under_a_key_in_small_and_large_payloads(spool):
    spool.append("s", msg("one", source="pending-1.json"))
    spool.append("s", msg(BIG, source="pending-2.json"))
    spool.append("s", msg("no name"))
    spool.append("s", msg("not a string", source=3))
    sql(
        spool,
        "INSERT INTO records (session_id, seq, reason, created_at, size, payload) "
        "SELECT 's', 99, reason, created_at, 1, '{broken' FROM records LIMIT 1",
    )
    assert streams.names_under(spool, "source") == {"pending-1.json", "pending-2.json"}
