"""The link's evictions and set-asides (``walspool.link.evict``) on the real hermes-agent
0.19.0 store, where the other link tests leave them unchecked:

* a live message state.db refuses for its content: the WARNING that says it was
  quarantined, its bytes in its session's share from the moment the spool's writer takes
  it, the line when the spool cannot keep it (closed, or its commit fails, which leaves
  no share), and a /retry during the refused write, which leaves the new queue alone;
* the lines of a session's repeated conditions when one comes back after a quiet
  interval (a busy spool, a message it cannot spool), and when its drops end.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from _gateway import (
    BREAK,
    HEAL,
    Clock,
    contents,
    fail_conversion,
    fill_the_writer,
    hold_the_writer,
    link_lines,
    msg,
    sql,
)
from _helpers import STEP

import walspool
import walspool.store.writer as writer
from walspool.hermes import REJECTED, install
from walspool.link.repeats import REPEAT_SECONDS

pytest.importorskip("hermes_state")


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def too_deep() -> dict[str, Any]:
    """An assistant message whose tool calls nest 5,000 deep: the gateway's json.dumps
    raises RecursionError (content, by walspool's rule), which the spool's codec takes."""
    calls: list[Any] = []
    for _ in range(5000):
        calls = [calls]
    return {"role": "assistant", "content": "calling", "tool_calls": calls}


REFUSED = (
    "state.db refused it for its content: RecursionError: maximum recursion depth exceeded "
    "while encoding a JSON object"
)


def in_thread(fn: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# -- a live message state.db refuses for its content --------------------------------


def test_a_refused_live_message_is_said_quarantined_and_in_its_share_from_its_hand_over(
    store, spool, caplog
):
    """The spool's writer busy: the refused message is handed to it and the session goes
    on at once; the session's share counts the row before its commit, by the size the
    spool then stores; its commit says, in one WARNING, where it is and why."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    go_on = hold_the_writer(spool)
    store.append_to_transcript("s", too_deep())
    store.append_to_transcript("s", msg("after"))
    assert contents(store, "s") == ["after"]
    with link.core.lock:
        handed = link.core.shares.of("s")
    assert link_lines(caplog, logging.WARNING) == []  # said when it is committed
    go_on.set()
    spool.flush()
    (rec,) = spool.records()
    assert (rec.reason, rec.status, rec.last_error) == (REJECTED, "quarantined", REFUSED)
    [(size,)] = spool.query("SELECT size FROM records", ())
    with link.core.lock:
        assert handed == size == link.core.shares.of("s")
    assert link_lines(caplog, logging.WARNING) == [
        "Session DB transcript append refused a message of s; quarantined it in the spool "
        f"(seq 1, shown by walspool ls), the session goes on: {REFUSED}"
    ]


def test_a_refused_live_message_a_closed_spool_cannot_keep_is_dropped_saying_both_reasons(
    store, spool, caplog
):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    spool.close()
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    store.append_to_transcript("s", too_deep())
    store.append_to_transcript("s", msg("after"))
    assert contents(store, "s") == ["after"]
    assert "s" not in store._dirty_transcripts
    assert link_lines(caplog, logging.WARNING) == [
        "Session DB transcript append refused a message of s and the spool could not keep "
        f"it (spool {spool.path} is closed); dropped it, the session goes on: {REFUSED}"
    ]
    with link.core.lock:
        assert link.core.shares.of("s") == 0


def test_a_refused_live_message_whose_commit_fails_is_said_dropped_and_leaves_no_share(
    hermes_home, store, caplog
):
    """The spool's commit of the set-aside row fails (an I/O error on each write):
    one WARNING says the message was dropped and why (both errors); the session's share
    is back to nothing, and the session went on."""
    from _faultvfs import Fault, FaultVFS, installed

    store._db.create_session("s", "telegram")
    vfs = FaultVFS()
    with installed(vfs), walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=0, recover=False)
        caplog.set_level(logging.WARNING, logger="walspool.hermes")
        vfs.arm(Fault("write", 1, "eio"), every=True)  # its retry alone fails too
        told = threading.Event()  # the set-aside's outcome is logged
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: told.set()  # type: ignore[method-assign]
        logging.getLogger("walspool.hermes").addHandler(handler)
        try:
            store.append_to_transcript("s", too_deep())
            store.append_to_transcript("s", msg("after"))
            assert told.wait(STEP)
        finally:
            logging.getLogger("walspool.hermes").removeHandler(handler)
        assert vfs.fired
        vfs.disarm()
        assert contents(store, "s") == ["after"]
        assert link_lines(caplog, logging.WARNING) == [
            "Session DB transcript append refused a message of s and the spool could not "
            f"keep it ({spool.path}: injected eio on write #1; check the disk); dropped it, "
            f"the session goes on: {REFUSED}"
        ]
        with link.core.lock:
            assert link.core.shares.of("s") == 0
        assert spool.stats().rows == 0
        link.close()


def test_a_retry_during_a_refused_write_leaves_the_new_queue_alone(store, spool):
    """The refused message's write is under way when a /retry rewrites the transcript
    (dropping the queue, as the released store does) and a new message queues behind
    it: the refused one belonged to the old transcript and is not set aside, and the new
    one is not taken for it: it reaches state.db."""
    from test_hermes_interleavings import Gate

    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    gate = Gate(store._append_transcript_message)
    store._append_transcript_message = gate
    gate.arm()
    appender = in_thread(lambda: store.append_to_transcript("s", too_deep()))
    assert gate.entered.wait(STEP)
    assert store.rewrite_transcript("s", [msg("rewritten")])
    store.append_to_transcript("s", msg("new"))  # queued: the appender holds the session
    gate.open()
    appender.join(STEP)
    assert not appender.is_alive()
    store.append_to_transcript("s", msg("next"))
    assert contents(store, "s") == ["rewritten", "new", "next"]
    spool.flush()
    assert spool.stats().rows == 0


# -- a session's repeated conditions, after a quiet interval ------------------------


def test_a_busy_spool_met_again_after_a_quiet_interval_is_summed_up_at_once(
    store, spool, monkeypatch, caplog
):
    """The oldest message stays in memory once (the spool's writer busy), then not again
    for a whole interval: the next time is said at once, with the count and the time
    since the first."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 20, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)  # no retry adds a time
    link.clock = clock = Clock()
    sql(store, BREAK)
    go_on, fillers = fill_the_writer(spool)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(21):
        store.append_to_transcript("s", msg(f"m{i}"))
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("m21"))
    assert link_lines(caplog, logging.WARNING) == [
        "Session DB transcript append failed for s (failure_count=1, pending=1); will "
        "retry: database disk image is malformed",
        f"Session DB transcript pending queue full for s (cap=20); the spool {spool.path} "
        "is busy, so the oldest message stays in memory (21 queued; the oldest is dropped "
        "past 40)",
        f"Session DB transcript pending queue full for s (cap=20); the spool {spool.path} "
        "is still busy: the oldest message was kept in memory 1 more time(s) (2 in 60 s; "
        "the oldest is dropped past 40)",
    ]
    go_on.set()
    assert [f.result(STEP).seq for f in fillers] == [1, 2]


def test_a_message_it_cannot_spool_met_again_after_a_quiet_interval_is_summed_up_at_once(
    store, spool, monkeypatch, caplog
):
    """The oldest message cannot be made a spool row (a fault in its conversion): said
    in full, with the error; met again only after a whole interval, said at once with
    the count, the time since the first and the error."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 20, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    link.clock = clock = Clock()
    fault = fail_conversion(spool, monkeypatch)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("bad"))
    caplog.set_level(logging.ERROR, logger="walspool.hermes")
    for i in range(20):
        store.append_to_transcript("s", msg(f"m{i}"))
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("m20"))
    assert link_lines(caplog, logging.ERROR) == [
        "walspool could not spool the oldest queued message of session s; it stays in "
        f"memory: {fault!r}",
        "walspool still could not spool the oldest queued message of session s; it stays "
        f"in memory (1 more time(s), 2 in 60 s): {fault!r}",
    ]
    assert [m["content"] for m in store._dirty_transcripts["s"]][:2] == ["bad", "m0"]
    spool.flush()
    assert spool.stats().rows == 0


def test_drops_that_end_are_said_with_their_count_once_the_spool_takes_evictions(
    store, spool, monkeypatch, caplog
):
    """Evictions dropped at the link's cap: the first said in full; after a quiet interval
    the next drop comes with the summary that was due (said, not lost to that drop); the
    cap raised, the next eviction is spooled, and an interval after the summary one line
    says the spool takes the session's evictions again, with how many were dropped, in
    how long, and how many of them no line had told."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600, max_bytes=1)
    link.clock = clock = Clock()
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(5):  # m0, m1 and m2 dropped at the cap
        store.append_to_transcript("s", msg(f"m{i}"))
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("m5"))  # the drops' summary is due; m3 dropped
    link.max_bytes = None
    store.append_to_transcript("s", msg("m6"))  # m4 is spooled
    clock.move(REPEAT_SECONDS)  # the end waits an interval after the summary
    store.append_to_transcript("s", msg("m7"))  # m5 is spooled
    lines = link_lines(caplog, logging.WARNING)
    assert lines[1:3] == [
        "Session DB transcript pending queue full for s (cap=2); dropping oldest message to "
        "make room (on-disk spool unavailable: the spool is at the link's cap of 1 bytes)",
        "Session DB transcript pending queue full for s (cap=2); dropped 2 more oldest "
        "message(s) (3 in 60 s; on-disk spool unavailable: the spool is at the link's cap "
        "of 1 bytes)",
    ]
    assert re.fullmatch(
        rf"Session DB transcript of s: the spool {re.escape(str(spool.path))} takes its "
        r"evictions again; 4 oldest message\(s\) were dropped in 60\.\d s \(1 not said "
        r"before\)",
        lines[3],
    ), lines
    spool.flush()
    assert [r.message["content"] for r in spool.records()] == ["m4", "m5"]


def test_an_eviction_whose_commit_fails_is_said_dropped_and_the_session_goes_on(
    hermes_home, store, monkeypatch, caplog
):
    """The spool cannot commit an eviction (an I/O error on each write): the message is
    dropped with the released store's WARNING and the spool's reason, nothing of it stays
    counted (bytes in flight, the session's share), and once the disk and state.db work
    again the session's next messages land in order."""
    from _faultvfs import Fault, FaultVFS, installed

    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    vfs = FaultVFS()
    with installed(vfs), walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=3600, recover=False)
        sql(store, BREAK)
        for i in range(2):
            store.append_to_transcript("s", msg(f"m{i}"))
        caplog.set_level(logging.WARNING, logger="walspool.hermes")
        caplog.clear()
        vfs.arm(Fault("write", 1, "eio"), every=True)
        store.append_to_transcript("s", msg("m2"))  # evicts m0: its commit fails
        spool.flush()
        vfs.disarm()
        assert link_lines(caplog, logging.WARNING) == [
            "Session DB transcript pending queue full for s (cap=2); dropping oldest message "
            f"to make room (on-disk spool unavailable: {spool.path}: injected eio on write "
            "#1; check the disk)"
        ]
        with link.core.lock:
            assert link.core.unconfirmed_bytes == 0 and link.core.shares.of("s") == 0
            assert link.core.handoffs.pending("s") == 0
        store.append_to_transcript("s", msg("m3"))  # evicts m1: spooled
        spool.flush()
        with link.core.lock:
            [(size,)] = spool.query("SELECT size FROM records", ())
            assert link.core.unconfirmed_bytes == 0 and link.core.shares.of("s") == size
        sql(store, HEAL)
        link.recover()
        store.append_to_transcript("s", msg("m4"))
        assert link.wait_idle(STEP)
        assert contents(store, "s") == ["m1", "m2", "m3", "m4"]
        link.close()


def test_two_messages_too_big_at_the_head_are_both_dropped_in_one_eviction(
    hermes_home, store, monkeypatch, caplog
):
    """The queue grew past the cap while the spool's writer was busy; once it has room,
    the next message's eviction spools the oldest, then drops the two after it, each too
    big for the spool (each said in full, as its own fault), and the queue is within the
    cap again, in order."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    with walspool.Spool(hermes_home / "spool.db", max_payload_bytes=1000) as spool:
        install(store, spool, retry_interval=3600, max_bytes=None)
        sql(store, BREAK)
        go_on, fillers = fill_the_writer(spool)
        for content in ("m0", "x" * 2000, "y" * 2000, "m3"):  # kept: the spool is busy
            store.append_to_transcript("s", msg(content))
        go_on.set()
        assert [f.result(STEP).seq for f in fillers] == [1, 2]
        caplog.set_level(logging.WARNING, logger="walspool.hermes")
        caplog.clear()
        store.append_to_transcript("s", msg("m4"))
        queued = [m["content"] for m in store._dirty_transcripts["s"]]
        assert queued == ["m3", "m4"]
        spool.flush()
        assert [r.message["content"] for r in spool.records() if r.session_id == "s"] == ["m0"]
        drops = [
            line
            for line in link_lines(caplog, logging.WARNING)
            if "dropping oldest message" in line
        ]
        assert drops == [
            "Session DB transcript pending queue full for s (cap=2); dropping oldest message "
            f"to make room (on-disk spool unavailable: message for session 's' is {n} bytes as "
            "JSON, over the spool's max_payload_bytes=1000; raise the limit or trim the "
            "message)"
            for n in (2028, 2028)
        ]


def test_a_large_group_of_evictions_is_settled_a_chunk_at_a_time_under_the_stores_lock(
    store, spool, monkeypatch
):
    """The spool's writer reports a group of 300 evictions (queued behind a held
    operation, then committed together). It settles them ``bounds.SETTLE_CHUNK`` at most
    under one take of the store's lock, so a gateway thread waits behind one chunk of
    them, never behind the whole group; every one is settled, once."""
    from walspool.link import bounds
    from walspool.link.handoffs import HandOffs

    takes: list[int] = [0]  # the spool writer's takes of the store's lock
    settled_in: list[int] = []  # per settle on the writer's thread: the take it was in

    def on_writer() -> bool:
        return threading.current_thread().name.startswith("walspool-writer")

    class Counted:
        """The store's lock, counting the spool writer's takes (``Condition`` falls back
        to acquire and release)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            got = self.inner.acquire(blocking, timeout)
            if got and on_writer():
                takes[0] += 1
            return got

        def release(self) -> None:
            self.inner.release()

        __enter__ = acquire

        def __exit__(self, *exc: object) -> None:
            self.release()

    settled = HandOffs.settled

    def noted(self: HandOffs, key: Any) -> bool:
        if on_writer():
            settled_in.append(takes[0])
        return settled(self, key)

    monkeypatch.setattr(HandOffs, "settled", noted)
    monkeypatch.setattr(store, "_transcript_retry_lock", Counted(store._transcript_retry_lock))
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600, recover=False)
    sql(store, BREAK)
    for i in range(2):  # up to the cap: the session drains (nothing) and fails
        store.append_to_transcript("s", msg(f"m{i}"))
    go_on = hold_the_writer(spool)
    for i in range(2, 302):  # each evicts the oldest: 300 queued behind the hold
        store.append_to_transcript("s", msg(f"m{i}"))
    go_on.set()
    spool.flush()
    with link.core.lock:
        assert link.core.handoffs.pending("s") == 0
    per_take = collections.Counter(settled_in)
    assert sum(per_take.values()) == 300
    assert max(per_take.values()) == bounds.SETTLE_CHUNK
    assert len(per_take) >= 300 // bounds.SETTLE_CHUNK
    assert spool.stats().rows == 300
    link.close()
