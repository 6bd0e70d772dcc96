"""The link's one-writer rule under forced interleavings, on the real 0.19.0 SessionStore.

Threads are stepped through the link's write and wait points with events (no sleeps):
a ``Gate`` stands in front of a write and holds it until the test lets it go, while it
counts how many threads are inside at once, so "one writer per session" is asserted,
not hoped for.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _gateway import (
    BREAK,
    HEAL,
    contents,
    fail_conversion,
    found_locked,
    hold_the_writer,
    msg,
    sql,
)
from _helpers import STEP, naming_threads
from _lock_holder import write_lock_held

import walspool
import walspool.link.bounds as bounds
import walspool.link.flush as link_flush
import walspool.link.shares as link_shares
import walspool.store.writer as writer
from walspool.errors import ReplayBusy
from walspool.hermes import Link, install
from walspool.link.machine import Owner

pytest.importorskip("hermes_state")


class Gate:
    """Wraps a write function: counts writers inside it and holds the armed call.

    ``arm()`` makes the next call (``arm(skip=n)``: the one after the next ``n``;
    ``arm(content=c)``: the first that writes a message whose content is ``c``) stop
    at the gate (``entered`` is set) until ``open()``; ``inside`` and ``most`` count
    concurrent calls, ``contents`` lists what each call wrote.
    """

    def __init__(self, write: Callable[..., Any]) -> None:
        self.write = write
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.contents: list[Any] = []
        self.armed = False
        self.skip = 0
        self.wanted: Any = None  # arm(content=...)
        self.entered = threading.Event()
        self.release = threading.Event()

    def arm(self, skip: int = 0, content: Any = None) -> None:
        self.entered.clear()
        self.release.clear()
        self.skip = skip
        self.wanted = content
        self.armed = True

    def open(self) -> None:
        self.release.set()

    def __call__(self, *args: Any, **kw: Any) -> Any:
        message = args[1] if len(args) > 1 else None
        content = message.get("content") if isinstance(message, dict) else None
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.contents.append(content)
            if not self.armed:
                hold = False
            elif self.wanted is not None:
                hold = content == self.wanted
            elif self.skip:
                self.skip -= 1
                hold = False
            else:
                hold = True
            if hold:
                self.armed = False
        try:
            if hold:
                self.entered.set()
                assert self.release.wait(STEP), "the test never opened the gate"
            return self.write(*args, **kw)
        finally:
            with self.lock:
                self.inside -= 1


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _linked_with_an_earlier_row(
    store: Any, spool: walspool.Spool, retry_interval: float
) -> tuple[Link, list[str]]:
    """Session s with one row an earlier run spooled, linked without the start's
    recovery (the session's next message drains it); and the names of the threads that
    replay, in order."""
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))
    link = install(store, spool, recover=False, retry_interval=retry_interval)
    replays: list[str] = []
    link.replayer.replay = naming_threads(link.replayer.replay, replays)
    return link, replays


def _a_commit_finds_the_write_lock_held(spool: walspool.Spool) -> Any:
    """Submit an append and wait until its commit finds the spool's write lock held by
    another process (``busy_since`` set); its future."""
    blocked = spool.submit("z", msg("z"))
    assert found_locked(spool)
    return blocked


def joined(thread: threading.Thread, timeout: float = STEP) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


def gate_live_writes(store: Any) -> Gate:
    gate = Gate(store._append_transcript_message)
    store._append_transcript_message = gate
    return gate


def gate_drain_writes(link: Link) -> Gate:
    gate = Gate(link.replayer.sink.write)
    link.replayer.sink.write = gate
    return gate


def test_a_write_that_fails_while_others_queue_leaves_exactly_one_writer(store, spool):
    """The issue's duplicate: a failed write, with appenders arriving meanwhile."""
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(200):
        store.append_to_transcript("s", msg(f"m{i}"))
    sql(store, HEAL)
    gate = gate_live_writes(store)
    gate.arm()
    # A: m200 evicts m0, drains it, then stops in the write of m1.
    a = in_thread(lambda: store.append_to_transcript("s", msg("m200")))
    assert gate.entered.wait(STEP)
    # B and C arrive while the head is in flight: over the cap, they return at once.
    b = in_thread(lambda: store.append_to_transcript("s", msg("b")))
    assert joined(b)
    c = in_thread(lambda: store.append_to_transcript("s", msg("c")))
    assert joined(c)
    assert len(store._dirty_transcripts["s"]) == 202  # nothing evicted under the write
    sql(store, BREAK)
    gate.open()  # m1's write fails on the broken database
    assert joined(a)
    spool.flush()
    assert [r.message["content"] for r in spool.records()] == ["m1", "m2"]
    assert len(store._dirty_transcripts["s"]) == 200
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == [f"m{i}" for i in range(201)] + ["b", "c", "fin"]
    assert gate.most == 1 and spool.stats().rows == 0


def test_a_waiter_wakes_to_the_current_state_after_a_reset(store, spool):
    """A gateway thread waits to take a session over from the background thread; the
    session's state is reset by a rewrite meanwhile; it decides on what it finds."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.05)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("first"))  # fails: the background retries it
    store.append_to_transcript("s", msg("old"))  # the session is failing: queued only
    gate = gate_live_writes(store)
    # By content: a retry of "first" that fails before the heal also passes the gate.
    gate.arm(content="old")
    sql(store, HEAL)
    # The background thread's retry wrote "first" (the session is healthy again) and
    # is writing "old": a new message waits to take the session over.
    assert gate.entered.wait(STEP)
    view = link.view("s")
    assert view is not None and view.owner is Owner.BACKGROUND and view.failures == 0
    waiting = threading.Event()
    take_over = link._take_over

    def announce(state: Any) -> Any:
        waiting.set()  # the store's lock is held until the wait releases it
        return take_over(state)

    link._take_over = announce
    g = in_thread(lambda: store.append_to_transcript("s", msg("new")))
    assert waiting.wait(STEP)
    # The rewrite takes the store's lock only once g waits: it resets the state g waits on.
    assert store.rewrite_transcript("s", [msg("rewritten")])
    assert store._dirty_transcripts.get("s") is None
    gate.open()  # "old" lands (it was in flight, as in the released store)
    assert joined(g)
    store.append_to_transcript("s", msg("after"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["rewritten", "old", "after"]
    assert gate.most == 1 and "new" not in gate.contents  # cleared with the queue
    assert gate.contents[-2:] == ["old", "after"]
    assert link.view("s") is None  # nothing left behind for the session


def test_heal_during_a_drain(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(210):
        store.append_to_transcript("s", msg(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 10
    drains = gate_drain_writes(link)
    drains.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m210")))  # its drain stops
    assert drains.entered.wait(STEP)
    sql(store, HEAL)  # heals while the drain's first write is held
    # More messages meanwhile: they queue and evict behind the drain, never write.
    for i in range(211, 215):
        store.append_to_transcript("s", msg(f"m{i}"))
    drains.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(215)]
    assert drains.most == 1 and spool.stats().rows == 0


def test_a_failed_write_never_drops_what_a_waiting_thread_may_still_spool(
    store, spool, monkeypatch, caplog
):
    """Past twice the cap while the head is being written, a gateway thread waits (its
    bounded wait) to evict; the write fails while the spool writer's queue is full.
    The failed writer keeps the messages in memory: only the waiting thread, once its
    own bound has passed, may drop, and here room comes before that."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 4)
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", STEP)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # A is the writer; m0 is in flight
    # The spool's writer stops inside a transaction; four requests fill its queue.
    go_on = hold_the_writer(spool)
    fillers = [spool.submit("z", msg(f"z{i}")) for i in range(4)]
    for i in range(1, 400):  # over the cap with the head in flight: nothing evicted
        store.append_to_transcript("s", msg(f"m{i}"))
    waiting = threading.Event()
    wait_for_head = link.evictions.wait_for_head

    def announce(state: Any, deadline: float) -> None:
        waiting.set()  # the store's lock is held until the wait releases it
        wait_for_head(state, deadline)

    link.evictions.wait_for_head = announce
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        b = in_thread(lambda: store.append_to_transcript("s", msg("m400")))
        assert waiting.wait(STEP)  # B: 401 queued, past twice the cap, waits for m0
        sql(store, BREAK)
        gate.open()
        assert joined(a)  # m0's write failed; the queue is full: all 401 stay queued
        with link.core.lock:
            assert len(store._dirty_transcripts["s"]) == 401
        go_on.set()
        assert joined(b)
    assert "dropping oldest" not in caplog.text
    assert [f.result(STEP).seq for f in fillers] == [1, 2, 3, 4]
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))  # retry_interval=0: it retries now
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(401)] + ["fin"]


def test_shutdown_during_a_drain(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(260):
        store.append_to_transcript("s", msg(f"m{i}"))
    sql(store, HEAL)
    drains = gate_drain_writes(link)
    drains.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m260")))
    assert drains.entered.wait(STEP)  # the drain of m0.. holds its first write
    # Shutdown spools the in-memory queue at once: it does not wait for the drain.
    flusher = in_thread(link.flush_queues)
    assert joined(flusher)
    assert store._dirty_transcripts.get("s", []) == []
    drains.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    # The drain took the flushed rows too, after the evicted ones: arrival order.
    assert contents(store, "s") == [f"m{i}" for i in range(261)]
    assert drains.most == 1 and spool.stats().rows == 0


def test_shutdown_during_a_drain_then_restart(hermes_home, store, spool):
    """The same shutdown, but the process stops while the drain's state.db is broken:
    the next start replays evicted and flushed rows in arrival order."""
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(230):
        store.append_to_transcript("s", msg(f"m{i}"))
    drains = gate_drain_writes(link)
    drains.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m230")))
    assert drains.entered.wait(STEP)
    assert link.flush_queues() == 200
    drains.open()  # the held write fails: state.db is still broken
    assert joined(a)
    sql(store, HEAL)
    spool.close()
    store._db.close()
    store2 = SessionStore(
        hermes_home / "sessions", GatewayConfig(sessions_dir=hermes_home / "sessions")
    )
    with walspool.Spool(hermes_home / "spool.db") as spool2:
        assert install(store2, spool2).wait_idle(STEP)
        assert contents(store2, "s") == [f"m{i}" for i in range(231)]
        assert spool2.stats().rows == 0
    store2._db.close()


# -- mutation testing (issue 16): each test below kills mutants that survived the others ----


class _CountedWaits(threading.Condition):
    """The link's ``_settled`` condition, counting the waits on it (``waits``) and
    naming the threads that waited."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waits = threading.Semaphore(0)
        self.waiters: set[int] = set()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiters.add(threading.get_ident())
        self.waits.release()  # the store's lock is held until the wait releases it
        return super().wait(timeout)

    def waited_in(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` waits here within ``STEP``. Another thread's wait that
        ran out and began again (a short bound on the real clock) does not count."""
        deadline = time.monotonic() + STEP
        while thread.ident not in self.waiters:
            if not self.waits.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
        return True


def _stop_the_clock(monkeypatch: pytest.MonkeyPatch, link: Link) -> None:
    """Stop the link's clock: a bound it waits for never runs out by itself (each wait
    is cut short only by a notification), so a wait given up early shows. With a short
    bound (0.5 s) this checks every part of the bound is waited for, not only what is
    left over 1 s."""
    now = time.monotonic()
    monkeypatch.setattr(link, "clock", lambda: now)


#: A bound waited for in full: the whole default, or 0.5 s on a stopped clock.
BOUNDS = [pytest.param(STEP, id="bound"), pytest.param(0.5, id="short-bound-stopped-clock")]


@pytest.mark.parametrize("bound", BOUNDS)
def test_gateway_threads_past_twice_the_cap_wait_for_the_head_counted_as_waiters(
    store, spool, monkeypatch, bound
):
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", bound)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    if bound < 1:
        _stop_the_clock(monkeypatch, link)
    link.core.settled = counted = _CountedWaits(link.core.lock)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # A writes m0
    for i in range(1, 6):  # up to twice the cap: queued at once, nothing evicted
        store.append_to_transcript("s", msg(f"m{i}"))
    state = link.core.sessions["s"]
    b = in_thread(lambda: store.append_to_transcript("s", msg("m6")))
    assert counted.waited_in(b)  # B waits for m0's write to end
    c = in_thread(lambda: store.append_to_transcript("s", msg("m7")))
    assert counted.waited_in(c)  # and C
    with link.core.lock:
        assert state.waiters == 2
        assert len(store._dirty_transcripts["s"]) == 8
    gate.open()
    assert joined(a) and joined(b) and joined(c)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(8)]
    assert state.waiters == 0
    assert link.view("s") is None


@pytest.mark.parametrize(
    "bound", [pytest.param(0.01, id="bound"), pytest.param(0.0, id="none-stopped-clock")]
)
def test_a_gateway_thread_waits_for_the_head_at_most_its_bound_then_drops(
    store, spool, monkeypatch, caplog, bound
):
    """Past twice the cap, with the oldest message being written: a gateway thread
    waits for that write at most ``HANDOFF_WAIT``, then drops the oldest it can. With
    no wait at all (on a stopped clock) it drops at once, at its deadline exactly."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", bound)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)
    for i in range(1, 6):
        store.append_to_transcript("s", msg(f"m{i}"))
    if not bound:
        _stop_the_clock(monkeypatch, link)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        b = in_thread(lambda: store.append_to_transcript("s", msg("m6")))
        assert joined(b)  # while m0 is still being written
    assert gate.entered.is_set() and not gate.release.is_set()
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
        "Session DB transcript pending queue full for s (cap=3); dropping oldest message to "
        "make room (on-disk spool unavailable: oldest being written)"
    ]
    gate.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", *(f"m{i}" for i in range(2, 7))]


def test_a_shutdown_flush_gives_each_wait_only_what_is_left_of_its_bound(store, spool, monkeypatch):
    """On a timer the test moves (``Core.timer``, which bounded waits are measured on): the
    spool's queue is full twice, then takes the flush. Each wait for room gets what is
    left of ``FLUSH_TIMEOUT``, and the wait for the commit what is left of it plus
    ``CONFIRM_WAIT``, so the flush as a whole stays within its bound."""
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.5)
    clock = [1000.0]
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("m0"))  # fails: queued, retried in an hour
    monkeypatch.setattr(link.core, "timer", lambda: clock[0])
    full = [2]
    notify_nowait = spool._writer.notify_nowait

    def full_twice(request: Any, callback: Any) -> None:
        if full[0]:
            full[0] -= 1
            raise queue.Full
        notify_nowait(request, callback)

    room_waits: list[float] = []

    def wait_for_room(timeout: float) -> bool:
        room_waits.append(timeout)
        clock[0] += 0.2  # room after 0.2 s each time
        return True

    commit_waits: list[float] = []

    class Event(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            commit_waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(spool._writer, "notify_nowait", full_twice)
    monkeypatch.setattr(spool._writer, "wait_for_room", wait_for_room)
    monkeypatch.setattr(
        link_flush, "threading", SimpleNamespace(**{**vars(threading), "Event": Event})
    )
    assert link.flush_queues() == 1
    assert room_waits == pytest.approx([0.5, 0.3])
    assert commit_waits == pytest.approx([0.1 + bounds.CONFIRM_WAIT])
    assert [r.message["content"] for r in spool.records()] == ["m0"]


def test_a_shutdown_flush_the_spool_has_no_room_for_gives_up_at_its_bound(
    store, spool, monkeypatch, caplog
):
    """On a timer the test moves (``Core.timer``, which bounded waits are measured on): the
    spool's queue stays full. The flush waits for room until ``FLUSH_TIMEOUT`` is
    reached exactly, no longer, then says so; the message stays queued in memory."""
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.5)
    clock = [1000.0]
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("m0"))  # fails: queued, retried in an hour
    monkeypatch.setattr(link.core, "timer", lambda: clock[0])

    def full(request: Any, callback: Any) -> None:
        raise queue.Full

    room_waits: list[float] = []

    def wait_for_room(timeout: float) -> bool:
        room_waits.append(timeout)
        clock[0] += 0.25  # no room; the clock reaches the deadline exactly
        return False

    monkeypatch.setattr(spool._writer, "notify_nowait", full)
    monkeypatch.setattr(spool._writer, "wait_for_room", wait_for_room)
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        assert link.flush_queues() == 0
    assert room_waits == [0.5, 0.25]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"could not spool 1 queued transcript message(s) at shutdown: the spool "
        f"{spool.path} had no room for them within 0.5 s"
    ]
    with link.core.lock:
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0"]
    assert spool.stats().rows == 0


def test_a_recovery_leaves_alone_a_session_that_evicted_while_it_replayed(
    store, spool, monkeypatch
):
    """Step by step: a recovery's replay has moved "s"'s and "t"'s spooled rows; before
    it settles them, "s" evicts another message (state.db broken again, so its drain
    holds it). The recovery must not count "s" as replayed, nor stop at it: it writes
    "t"'s queue (no background thread here), and "s" drains its new row before its queue
    at its next message."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    for sid in ("s", "t"):
        store._db.create_session(sid, "telegram")
    link = install(store, spool, recover=False, retry_interval=0)
    sql(store, BREAK)
    for sid in ("s", "t"):
        for i in range(4):
            store.append_to_transcript(sid, msg(f"{sid}{i}"))  # {sid}0 evicted at the cap
    spool.flush()
    sql(store, HEAL)
    replayed, go_on = threading.Event(), threading.Event()
    replay = link.replayer.replay

    def pausing(*args: Any, **kw: Any) -> Any:
        report = replay(*args, **kw)
        replayed.set()
        assert go_on.wait(STEP)
        return report

    link.replayer.replay = pausing
    recovery = in_thread(link.recover)
    assert replayed.wait(STEP)  # s0 and t0 moved
    link.replayer.replay = replay
    sql(store, BREAK)
    store.append_to_transcript("s", msg("s4"))  # evicts s1; its drain fails: held
    spool.flush()
    sql(store, HEAL)
    go_on.set()
    assert joined(recovery)
    assert contents(store, "t") == ["t0", "t1", "t2", "t3"]  # written by the recovery
    assert contents(store, "s") == ["s0"]
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == ["s0", "s1", "s2", "s3", "s4", "fin"]
    assert spool.stats().rows == 0


def test_the_start_recovery_writes_as_the_background_thread_and_a_gateway_thread_takes_over(
    store, spool, monkeypatch
):
    """The start's recovery runs on the background thread, and writes the queue of a
    session it found waiting as the background thread does: a gateway thread with a
    new message waits for the session (counted) and writes its own message itself."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", STEP)
    store._db.create_session("s", "telegram")
    spool.append("s", msg("r0"))  # spooled by an earlier run
    gate = gate_live_writes(store)
    gate.arm()
    with store._transcript_retry_lock:  # the recovery looks once this is released
        link = install(store, spool, retry_interval=3600)
        link.core.settled = counted = _CountedWaits(link.core.lock)
        # What a gateway thread's message did before the recovery looked: queued, and
        # the session's state counts rows spooled by an earlier run.
        link.core.session("s")
        store._dirty_transcripts["s"] = [msg("live")]
    assert gate.entered.wait(STEP)  # the recovery moved r0 and writes "live"
    assert link.view("s").owner is Owner.BACKGROUND
    g = threading.Thread(
        target=lambda: store.append_to_transcript("s", msg("new")), name="gateway", daemon=True
    )
    writers: list[str] = []
    gate.write = naming_threads(gate.write, writers)
    g.start()
    assert counted.waits.acquire(timeout=STEP)  # g waits to take the session over
    gate.open()
    assert joined(g)
    assert contents(store, "s") == ["r0", "live", "new"]  # written before g returned
    assert writers[-1] == "gateway"
    assert link.wait_idle(STEP) and link.view("s") is None


def test_a_wait_for_evictions_looks_again_often_and_gives_up_at_its_bound(
    store, spool, monkeypatch
):
    """On a timer the test moves (``Core.timer``, which bounded waits are measured on): a
    gateway thread's eviction cannot commit (the spool's writer is busy). Before it
    drains, the thread waits for it in looks of at most ``BUSY_LOOK_SECONDS`` (a write
    lock held elsewhere would not wake it), ``CONFIRM_WAIT`` in all; then it goes on and
    leaves its message queued."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", msg(f"m{i}"))  # each fails: queued
    sql(store, HEAL)
    go_on = hold_the_writer(spool)  # the eviction queues behind this
    clock = [1000.0]
    looks: list[float | None] = []

    class Looks(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            looks.append(timeout)
            if len(looks) > 1000:
                pytest.fail("the wait for the evictions never gave up")
            clock[0] += timeout or 0.0  # a look that found nothing
            return False

    settled = link.core.handoffs.condition
    link.core.handoffs.condition = Looks(link.core.lock)
    monkeypatch.setattr(link.core, "timer", lambda: clock[0])
    store.append_to_transcript("s", msg("m3"))  # evicts m0, then waits for its commit
    link.core.handoffs.condition = settled
    monkeypatch.undo()
    assert looks and all(w is not None and 0 < w <= bounds.BUSY_LOOK_SECONDS for w in looks)
    assert sum(looks) == pytest.approx(bounds.CONFIRM_WAIT)
    go_on.set()
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == ["m0", "m1", "m2", "m3", "fin"]


def test_a_drain_on_a_closed_spool_fails_quietly_and_the_message_stays_queued(store, spool, caplog):
    """The spool's owner closed it while the link still counts rows of a session in it
    (an earlier run's, not recovered yet): the next message's drain fails as an
    expected failure (no error logged, nothing raised into the gateway), the message
    stays queued, and the session's drains are held back until its retry time."""
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))
    link = install(store, spool, recover=False, retry_interval=3600)
    spool.close()
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("new"))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None  # the gateway thread gave its role up
        assert state.failures == 1 and state.retry_at > time.monotonic()
        assert state.hold_until == state.retry_at
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["new"]
    assert contents(store, "s") == []


def test_a_drain_whose_replay_fails_says_so_and_holds_the_session(store, spool, caplog):
    """The replay of a session's spooled rows raises something unexpected: a WARNING
    says so word for word (no error, nothing raised into the gateway), the message
    stays queued behind the rows, and the session's drains are held back until its
    retry time; once that comes and the replay works, everything lands in order."""
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))  # an earlier run's row: the next message drains it
    link = install(store, spool, recover=False, retry_interval=3600)
    replay = link.replayer.replay

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("replay broke")

    link.replayer.replay = broken
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("new"))
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
        f"Replay of spooled transcript messages for s failed in {spool.path}; holding back "
        "its queued messages: replay broke"
    ]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None
        assert state.failures == 1 and state.retry_at > time.monotonic()
        assert state.hold_until == state.retry_at
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["new"]
        state.wake()  # its retry time has come
    link.replayer.replay = replay
    store.append_to_transcript("s", msg("next"))
    assert contents(store, "s") == ["old", "new", "next"]


def test_a_drain_whose_rows_state_db_refuses_holds_them_and_counts_the_failure(
    store, spool, caplog
):
    """state.db refuses the session's spooled rows: the drain keeps them in the spool,
    says so word for word (a WARNING, nothing raised into the gateway), counts one
    failure in the store's own counter per try, and holds the session until its retry
    time; the queued messages wait behind the rows, and land after them once healed."""
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))  # an earlier run's row: the next message drains it
    link = install(store, spool, recover=False, retry_interval=3600)
    sql(store, BREAK)
    for attempt in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
            store.append_to_transcript("s", msg(f"new{attempt}"))
        assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
            f"Replay of 1 spooled transcript message(s) for s failed; keeping them in "
            f"{spool.path} and holding back {attempt} queued message(s): IntegrityError: "
            "database disk image is malformed"
        ]
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        with link.core.lock:
            state = link.core.sessions["s"]
            assert state.writer is None
            assert store._transcript_append_failures["s"] == attempt
            assert state.failures == attempt and state.retry_at > time.monotonic()
            assert state.hold_until == state.retry_at
            state.wake()  # its retry time has come
    assert [r.message["content"] for r in spool.records()] == ["old"]
    sql(store, HEAL)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == ["old", "new1", "new2", "fin"]
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
        "Replayed 1 spooled transcript message(s) for s after DB recovery"
    ]
    with link.core.lock:  # all written: the store's own failure count is cleared, as it does
        assert "s" not in store._transcript_append_failures and "s" not in link.core.sessions


@pytest.mark.parametrize("chunk", [1, 2])
def test_a_quarantined_row_in_a_drain_chunk_does_not_end_the_drain(
    store, spool, monkeypatch, chunk
):
    """A chunk that quarantines a row (a payload that is not JSON), alone or beside
    one it moves, touched the spool: the drain goes on with the next chunk instead of
    taking the session for drained, so no row is left behind its queue."""
    monkeypatch.setattr(bounds, "DRAIN_CHUNK_ROWS", chunk)
    store._db.create_session("s", "telegram")
    receipts = spool.append_many([("s", msg(c)) for c in ("a", "bad", "c", "d")])
    bad = receipts[1].id
    spool.transact(
        lambda conn: conn.execute("UPDATE records SET payload = '{not json' WHERE id = ?", (bad,))
    )
    install(store, spool, recover=False, retry_interval=0)
    store.append_to_transcript("s", msg("new"))
    assert contents(store, "s") == ["a", "c", "d", "new"]
    # kept for an operator (``records`` refuses to decode it)
    assert spool.query("SELECT id, status FROM records", ()) == [(bad, "quarantined")]


class _Crash(BaseException):
    """A process dying in the middle of a replay (nothing catches it)."""


def test_a_drain_chunk_that_recovers_as_many_rows_as_it_moves_does_not_end_the_drain(
    store, spool, monkeypatch
):
    """An earlier replay died right after writing r2 (its batch left in flight). The
    link's drain takes chunks of 2: the first finds r1 and r2 landed (recovered, not
    written again) and writes r3 and r4. It touched the spool, so the drain goes on,
    and r5 lands before the queue; each row once."""
    monkeypatch.setattr(bounds, "DRAIN_CHUNK_ROWS", 2)
    store._db.create_session("s", "telegram")
    spool.append_many([("s", msg(f"r{i}")) for i in range(1, 6)])
    sink = walspool.SessionDBSink(store._db)
    write = sink.write

    def write_then_die(session_id: str, record: Any, ticket: Any) -> None:
        write(session_id, record, ticket)
        if record.seq == 2:
            raise _Crash

    sink.write = write_then_die
    with pytest.raises(_Crash):
        walspool.Replayer(spool, sink, batch_rows=4).replay()
    assert contents(store, "s") == ["r1", "r2"]
    link = install(store, spool, recover=False, retry_interval=0)
    replay = link.replayer.replay
    reports: list[tuple[int, int]] = []

    def counted(*args: Any, **kw: Any) -> Any:
        report = replay(*args, **kw)
        reports.append((report.recovered, report.moved))
        return report

    link.replayer.replay = counted
    store.append_to_transcript("s", msg("new"))
    assert reports[0] == (2, 2)
    assert contents(store, "s") == ["r1", "r2", "r3", "r4", "r5", "new"]
    assert spool.stats().rows == 0


def test_an_eviction_that_commits_after_its_writer_gave_up_wakes_the_session(
    store, spool, monkeypatch
):
    """Step by step: while A writes m0, m1-m4 queue; A, done with m0, evicts m1 at the
    cap, but the spool's writer is busy. A must drain m1 first; it gives up waiting for
    the eviction's commit (``CONFIRM_WAIT``), leaving the session due. The commit then
    wakes the background thread, which drains m1 and writes the rest, no new message
    needed."""
    monkeypatch.setattr(bounds, "CONFIRM_WAIT", 0.0)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # A writes m0
    go_on = hold_the_writer(spool)  # the eviction queues behind this
    for i in range(1, 5):
        store.append_to_transcript("s", msg(f"m{i}"))  # queued: A holds the session
    gate.open()
    assert joined(a)
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None and state.spooled == 1
        assert link.core.handoffs.pending("s") == 1
    go_on.set()
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", "m1", "m2", "m3", "m4"]


def test_a_rewrite_while_an_eviction_is_in_flight_forgets_the_session_once_it_commits(
    store, spool, monkeypatch, caplog
):
    """The transcript is rewritten (/retry) while an eviction of the session waits for
    the spool's writer: the rewrite drops the queue and resets the session, and once
    the eviction commits the link forgets the session (its row superseded)."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", msg(f"m{i}"))  # fail: queued
    go_on = hold_the_writer(spool)  # the eviction queues behind this
    store.append_to_transcript("s", msg("m3"))  # m0 evicted, not committed yet
    rewriter = in_thread(lambda: store._clear_dirty_transcript("s"))  # its supersede queues
    with link.core.lock:
        assert link.core.settled.wait_for(lambda: link.core.sessions["s"].generation == 1, STEP)
        assert link.core.handoffs.pending("s") == 1
    with caplog.at_level(logging.WARNING):
        go_on.set()
        assert joined(rewriter)
        spool.flush()
    with link.core.lock:
        assert "s" not in link.core.sessions
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [(r.message["content"], r.status) for r in spool.records()] == [("m0", "superseded")]


def test_evictions_that_fail_and_commit_in_one_group_are_each_reported_word_for_word(
    hermes_home, store, monkeypatch, caplog
):
    """Two sessions' evictions commit in one group: a's is too big for the room left in
    the spool and fails alone (dropped, as the released store drops, and said so); b's
    commits (spooled, and said so, with its seq)."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 1, raising=False)
    for sid in ("a", "b"):
        store._db.create_session(sid, "telegram")
    big = "x" * 200_000
    with walspool.Spool(hermes_home / "spool.db", max_bytes=128 * 1024) as spool:
        install(store, spool, retry_interval=3600, max_bytes=None)
        sql(store, BREAK)
        store.append_to_transcript("a", msg(f"a0{big}"))  # fails: queued
        store.append_to_transcript("b", msg("b0"))  # fails: queued
        go_on = hold_the_writer(spool)  # both evictions queue behind this, for one group
        caplog.clear()
        # DEBUG: the line per eviction too (the session's start line is a WARNING)
        with caplog.at_level(logging.DEBUG, logger="walspool.hermes"):
            store.append_to_transcript("a", msg("a1"))  # evicts a0
            store.append_to_transcript("b", msg("b1"))  # evicts b0
            go_on.set()
            spool.flush()
        assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
            "Session DB transcript pending queue full for a (cap=1); dropping oldest message "
            f"to make room (on-disk spool unavailable: spool {spool.path} is full "
            "(max_bytes=131072); replay it into state.db or raise max_bytes)",
            "Session DB transcript pending queue full for b (cap=1); spooling the oldest "
            f"messages to {spool.path} until state.db takes them (one line when it has "
            "drained)",
            "Session DB transcript pending queue full for b (cap=1); spooled oldest message "
            f"to {spool.path} (seq 1) for replay after DB recovery",
        ]
        assert [(r.session_id, r.message["content"]) for r in spool.records()] == [("b", "b0")]


def test_a_message_the_spool_cannot_take_is_reported_then_dropped_past_twice_the_cap(
    store, spool, monkeypatch, caplog
):
    """The oldest message cannot be made a spool row (a fault in its conversion): under
    twice the cap it stays in memory, said at ERROR; past twice the cap the next call
    finds it again (counted, not said again within the minute), then drops it (the
    released store's drop, said), and the next is spooled. Closing the link says the
    count held back: the fault was met twice, and the spool takes evictions again."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 1, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    fault = fail_conversion(spool, monkeypatch)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("bad"))  # fails: queued
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("a"))  # over the cap: "bad" stays in memory
        store.append_to_transcript("s", msg("b"))  # past twice the cap
        spool.flush()
        said = [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"]
        link.close()
    assert said[:2] == [
        "walspool could not spool the oldest queued message of session s; it stays in "
        f"memory: {fault!r}",
        "Session DB transcript pending queue full for s (cap=1); dropping oldest message to "
        f"make room (on-disk spool unavailable: {fault!r})",
    ]
    assert [r.message["content"] for r in spool.records()] == ["a"]
    held = [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"][len(said) :]
    assert any(
        re.fullmatch(
            r"The queue of session s no longer holds a message walspool could not spool over "
            r"the cap: its oldest could not be spooled 2 time\(s\) in \d+\.\d s \(1 not said "
            r"before\)",
            line,
        )
        for line in held
    ), held


def test_a_gateway_thread_waits_for_room_in_the_spool_at_most_its_bound_then_drops(
    store, spool, monkeypatch, caplog
):
    """Past twice the cap, with the spool's queue full behind a long commit (no write
    lock held elsewhere, so room may come soon): a gateway thread waits for room at
    most ``HANDOFF_WAIT``, then drops the oldest, says so, and returns while the
    commit still runs."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 1)
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 0.01)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    for i in range(2):
        store.append_to_transcript("s", msg(f"m{i}"))  # fail: queued
    go_on = hold_the_writer(spool)
    filler = spool.submit("z", msg("z"))  # the spool's queue is full
    for i in range(2, 4):
        store.append_to_transcript("s", msg(f"m{i}"))  # over the cap: kept in memory
    room_waits: list[float] = []
    wait_for_room = spool._writer.wait_for_room
    # The link's clock moves only while it waits for room: however late the thread
    # runs, the bound is spent in that wait, not before it.
    clock = [0.0]  # from 0, deadline - now is the bound itself, not a rounding of it
    monkeypatch.setattr(link, "clock", lambda: clock[0])

    def recorded(timeout: float) -> bool:
        room_waits.append(timeout)
        try:
            return wait_for_room(timeout)
        finally:
            clock[0] += timeout

    monkeypatch.setattr(spool._writer, "wait_for_room", recorded)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        b = in_thread(lambda: store.append_to_transcript("s", msg("m4")))
        assert joined(b)  # the commit still runs
    assert not go_on.is_set()
    assert room_waits and all(0.0 <= w <= 0.01 for w in room_waits), room_waits
    assert [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()] == [
        "Session DB transcript pending queue full for s (cap=2); dropping oldest message to "
        "make room (on-disk spool unavailable: spool writer busy)"
    ]
    go_on.set()
    assert filler.result(STEP).seq == 1
    sql(store, HEAL)
    with link.core.lock:
        link.core.sessions["s"].wake()
    store.append_to_transcript("s", msg("fin"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m1", "m2", "m3", "m4", "fin"]


def test_after_a_rewrite_under_a_write_the_new_queue_is_evicted_at_the_cap(
    store, spool, monkeypatch
):
    """Step by step: A writes m0; the transcript is rewritten meanwhile (/retry), which
    drops the queue. The messages queued after it do not start with the message being
    written, so past the cap the oldest of them is spooled at once, as usual."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # A writes m0
    rewriter = in_thread(lambda: store._clear_dirty_transcript("s"))  # /retry
    assert joined(rewriter)
    for i in range(3):
        store.append_to_transcript("s", msg(f"n{i}"))  # queued: A holds the session
    spool.flush()
    assert [r.message["content"] for r in spool.records()] == ["n0"]  # spooled at the cap
    with link.core.lock:
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["n1", "n2"]
    gate.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", "n0", "n1", "n2"]


def test_a_message_too_big_for_the_spool_is_dropped_at_the_cap_word_for_word(
    hermes_home, store, monkeypatch, caplog
):
    """At the cap, the oldest message is over the spool's ``max_payload_bytes``: it is
    dropped, as the released store drops, with the spool's reason; the next one past
    the cap is spooled."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 1, raising=False)
    store._db.create_session("s", "telegram")
    with walspool.Spool(hermes_home / "spool.db", max_payload_bytes=1000) as spool:
        install(store, spool, retry_interval=3600, max_bytes=None)
        sql(store, BREAK)
        store.append_to_transcript("s", msg("x" * 2000))  # fails: queued
        caplog.clear()
        # DEBUG: the line per eviction too (the session's start line is a WARNING)
        with caplog.at_level(logging.DEBUG, logger="walspool.hermes"):
            store.append_to_transcript("s", msg("a"))  # evicts the big one
            store.append_to_transcript("s", msg("b"))  # evicts "a"
            spool.flush()
        assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"] == [
            "Session DB transcript pending queue full for s (cap=1); dropping oldest message "
            "to make room (on-disk spool unavailable: message for session 's' is 2028 bytes "
            "as JSON, over the spool's max_payload_bytes=1000; raise the limit or trim the "
            "message)",
            "Session DB transcript pending queue full for s (cap=1); spooling the oldest "
            f"messages to {spool.path} until state.db takes them (one line when it has "
            "drained)",
            "Session DB transcript pending queue full for s (cap=1); spooled oldest message "
            f"to {spool.path} (seq 1) for replay after DB recovery",
        ]
        assert [r.message["content"] for r in spool.records()] == ["a"]


def test_an_unexpected_error_while_writing_a_session_is_logged_and_retried(store, spool, caplog):
    """A bug in the link's write step: logged at ERROR word for word with the
    traceback, the message stays queued, the session counts a failure (not held back
    as a failed drain is) and is scheduled for its retry, which writes it."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    write_head = link.writer._write_head
    calls: list[int] = []

    def broken_once(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("link bug")
        return write_head(*args)

    link.writer._write_head = broken_once
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("m0"))
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == "walspool could not write session s; its messages stay queued"
    assert record.exc_info and record.exc_info[0] is RuntimeError
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None and state.failures == 1
        assert state.retry_at > time.monotonic() and state.hold_until == 0.0
        assert link.core.wake_at == state.retry_at  # the background thread looks then
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0"]
        state.wake()  # its retry time has come
        link.core.schedule(0.0)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0"]


def test_a_drain_release_with_work_left_wakes_the_background_thread_beside_a_later_retry(
    store, spool, monkeypatch, caplog
):
    """A gateway thread gives the session up at its drain budget, with rows left: the
    background thread is woken for it at once, though it already waits for another
    session's later retry; it moves the rest and the message, no error on the way."""
    monkeypatch.setattr(bounds, "DRAIN_CHUNK_ROWS", 10)
    monkeypatch.setattr(bounds, "GATEWAY_DRAIN_ROWS", 10)
    for sid in ("s", "t"):
        store._db.create_session(sid, "telegram")
    spool.append_many([("s", msg(f"old{i}")) for i in range(25)])  # an earlier run's
    link = install(store, spool, recover=False, retry_interval=3600)
    sql(store, BREAK)
    store.append_to_transcript("t", msg("t0"))  # fails: its retry is minutes away
    sql(store, HEAL)
    with link.core.lock:
        assert link.core.wake_at is not None and link.core.wake_at > time.monotonic()
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("new"))  # moves 10 rows, then gives up
        with link.core.lock:
            assert link.core.settled.wait_for(lambda: "s" not in link.core.sessions, STEP)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert contents(store, "s") == [f"old{i}" for i in range(25)] + ["new"]


def test_a_message_the_gateway_skips_for_state_db_is_neither_written_nor_queued(store, spool):
    """``skip_db=True`` (the agent already wrote the message itself): the link leaves it
    out, as the released store does, so it is never written twice."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    store.append_to_transcript("s", msg("skipped"), skip_db=True)
    with link.core.lock:
        assert "s" not in store._dirty_transcripts and "s" not in link.core.sessions
    store.append_to_transcript("s", msg("written"))
    assert contents(store, "s") == ["written"]


@pytest.mark.parametrize(
    ("interval", "delays"),
    [(8.0, [1.0, 2.0, 4.0, 8.0, 8.0]), (0.05, [0.01, 0.0125, 0.025, 0.05, 0.05])],
)
def test_a_failing_sessions_retry_delay_doubles_up_to_the_retry_interval(
    store, spool, monkeypatch, interval, delays
):
    """On a stopped clock: after each failed write the session's next try is due after
    ``retry_interval`` / 8, doubling per failure up to ``retry_interval``, and never
    sooner than ``MIN_RETRY_SECONDS``."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=interval)
    _stop_the_clock(monkeypatch, link)
    now = link.clock()
    sql(store, BREAK)
    got = []
    for i in range(len(delays)):
        with link.core.lock:
            if "s" in link.core.sessions:
                link.core.sessions["s"].wake()  # due: this message tries again
        store.append_to_transcript("s", msg(f"m{i}"))  # fails
        with link.core.lock:
            got.append(link.core.sessions["s"].retry_at - now)
    assert got == pytest.approx(delays)
    store.append_to_transcript("s", msg("early"))  # before the retry time: queued only
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.failures == len(delays) and state.retry_at - now == pytest.approx(delays[-1])


def test_a_drain_behind_another_of_this_link_gives_up_at_its_bound_quietly(
    store, spool, monkeypatch, caplog
):
    """Drains of one link take turns; one that waits ``HANDOFF_WAIT`` for its turn
    gives up as an expected outcome: no error, the message stays queued, the session
    is not counted as failing, and the next message drains and writes in order."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 0.01)
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))  # an earlier run's row: the next message drains it
    link = install(store, spool, recover=False, retry_interval=0)
    with link.core.draining:  # another drain of this link has its turn
        with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
            store.append_to_transcript("s", msg("new"))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None and state.failures == 0
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["new"]
    store.append_to_transcript("s", msg("next"))
    assert contents(store, "s") == ["old", "new", "next"]


def test_a_gateway_thread_never_waits_for_another_drain_when_the_background_thread_can(
    store, spool, monkeypatch
):
    """With a background thread, a gateway thread whose session must drain first does
    not wait for this link's drain of another session (in an outage each failing drain
    costs two spool commits; threads queued behind them were the slowest calls): it
    leaves its message queued and returns at once, and the background thread drains
    the session, in order, once the other drain is done."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 4 * STEP)  # a wait would outlast the join
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))  # an earlier run's row: the next message drains it
    link = install(store, spool, recover=False, retry_interval=0.05)
    with link.core.draining:  # another drain of this link has its turn
        g = threading.Thread(target=lambda: store.append_to_transcript("s", msg("new")))
        g.start()
        assert joined(g), "the gateway thread waited for another session's drain"
        with link.core.lock:
            assert [m["content"] for m in store._dirty_transcripts["s"]] == ["new"]
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["old", "new"]


def test_a_flush_while_a_drain_finds_nothing_is_not_taken_for_what_that_drain_saw(
    store, spool, monkeypatch
):
    """Step by step: the background thread drains a session with one spooled row, but
    another replay moved that row just before it looked, so it moves nothing; while it
    settles, a shutdown flush spools the session's queue. Finding nothing clears the
    session's count only if nothing was spooled since it looked: the flushed rows are
    drained next, not left in the spool."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 4, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, recover=False, retry_interval=0.05)
    sql(store, BREAK)
    for i in range(5):
        store.append_to_transcript("s", msg(f"m{i}"))  # m0 evicted at the cap
    spool.flush()
    replay = link.replayer.replay
    armed, flushed = threading.Event(), []

    def elsewhere_then_flush(*args: Any, **kw: Any) -> Any:
        if not armed.is_set():
            return replay(*args, **kw)
        armed.clear()
        # Another process's replay moves m0 just before this drain looks.
        assert walspool.Replayer(spool, walspool.SessionDBSink(store._db)).replay().moved == 1
        report = replay(*args, **kw)
        assert report.moved == 0
        flusher = in_thread(lambda: flushed.append(link.flush_queues()))
        assert joined(flusher)
        return report

    link.replayer.replay = elsewhere_then_flush
    # Armed (and healed) between two drains: every drain holds ``_draining`` across its
    # replay. One that had begun (with this wrapper, or before it was put in place)
    # would otherwise go on unarmed, move m0 itself after the heal, and leave the armed
    # one nothing to find moved by "another process".
    with link.core.draining, link.core.lock:
        assert link.core.sessions["s"].spooled == 1
        armed.set()
        sql(store, HEAL)
    assert link.wait_idle(STEP)
    assert not armed.is_set() and flushed == [4]
    assert contents(store, "s") == [f"m{i}" for i in range(5)]
    assert spool.stats().rows == 0


@pytest.mark.parametrize(
    "failure",
    [
        lambda path: ReplayBusy("another replay has the spool", path=path, pid=None),
        lambda path: OSError(5, "disk I/O error"),
    ],
    ids=["busy", "error"],
)
def test_a_message_queued_behind_a_failed_drain_after_a_rewrite_is_written_unasked(
    store, spool, failure
):
    """Step by step: a gateway thread drains its session's row an earlier run spooled;
    while its replay runs, a /retry rewrites the transcript (it forgets the queue at
    once, and supersedes the row once the drain has let the spool go or HANDOFF_WAIT
    has passed) and then a message is queued behind the drain; then the replay fails
    (another replay has the spool's lock, or an error). The drain gives the session up
    with nothing spooled and one message queued: the background thread writes it once
    the retry delay ends, with no further message (not at its idle wake, a minute on)."""
    link, _ = _linked_with_an_earlier_row(store, spool, retry_interval=0.05)
    replay, failed = link.replayer.replay, []

    def rewritten_then_failing(*args: Any, **kw: Any) -> Any:
        if failed:
            return replay(*args, **kw)
        assert joined(in_thread(lambda: store.rewrite_transcript("s", [msg("rewritten")])))
        assert joined(in_thread(lambda: store.append_to_transcript("s", msg("after"))))
        with link.core.lock:
            assert [m["content"] for m in store._dirty_transcripts["s"]] == ["after"]
        failed.append(threading.current_thread())
        raise failure(spool.path)

    link.replayer.replay = rewritten_then_failing
    store.append_to_transcript("s", msg("first"))  # drains first; the /retry forgets it
    assert failed == [threading.current_thread()]
    assert link.wait_idle(STEP), "the queued message waited for another message"
    assert contents(store, "s") == ["rewritten", "after"]


@contextlib.contextmanager
def _a_flush_the_spool_refuses(
    hermes_home: Path, store: Any
) -> Iterator[tuple[walspool.Spool, Link, threading.Event, threading.Thread, list[int]]]:
    """Step by step to a shutdown flush the spool will refuse: session "s" has three
    ~40 KB messages queued (state.db broken), the spool (``max_bytes`` 128 KiB) has its
    writer held by an operation, and a thread's ``flush_queues`` has taken the queue and
    waits behind it. Yields (spool, link, go_on, flusher, flushed): ``go_on.set()`` lets
    the writer go on and refuse the flush's rows; ``flushed`` gets its return value."""
    store._db.create_session("s", "telegram")
    big = "x" * 40_000
    with walspool.Spool(hermes_home / "spool.db", max_bytes=128 * 1024) as spool:
        link = install(store, spool, retry_interval=0.05, max_bytes=None)
        sql(store, BREAK)
        for i in range(3):
            store.append_to_transcript("s", msg(f"m{i}{big}"))
        go_on = hold_the_writer(spool)  # the flush's rows queue behind this
        flushed: list[int] = []
        flusher = in_thread(lambda: flushed.append(link.flush_queues()))
        with link.core.lock:
            assert link.core.settled.wait_for(lambda: store._dirty_transcripts.get("s") == [], STEP)
        yield spool, link, go_on, flusher, flushed


def test_a_shutdown_flush_the_spool_refuses_goes_back_in_front_and_is_retried(
    hermes_home, store, monkeypatch, caplog
):
    """The flush's rows fail to commit (the spool is full): its messages go back to the
    front of their queue, ahead of one queued meanwhile, and the background thread
    writes them once state.db heals (no new message needed)."""
    with _a_flush_the_spool_refuses(hermes_home, store) as (spool, link, go_on, flusher, flushed):
        with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
            store.append_to_transcript("s", msg("late"))  # queued while the flush waits
            go_on.set()
            assert joined(flusher)
        assert flushed == [0]

        # The background thread's retries fail on the broken state.db meanwhile, and each
        # spools the queue again (the stop's flush has run) and is refused alike, putting
        # it back: looked at while no such flush holds it.
        def queue() -> list[str]:
            return [m["content"][:2] for m in store._dirty_transcripts.get("s") or ()]

        with link.core.lock:
            assert link.core.settled.wait_for(lambda: queue() != [], STEP)
            assert queue() == ["m0", "m1", "m2", "la"]
        errors = [
            r.getMessage()
            for r in caplog.records
            if r.name == "walspool.hermes" and r.levelno == logging.ERROR
        ]
        refused = (
            f"could not spool {{}} queued transcript message(s) at shutdown to {spool.path}; "
            f"they stay queued: spool {spool.path} is full (max_bytes=131072); replay it into "
            "state.db or raise max_bytes"
        )
        assert errors[0] == refused.format(3)
        assert set(errors[1:]) <= {refused.format(4)}  # a retry's flush: "late" too
        sql(store, HEAL)
        assert link.wait_idle(STEP)  # the background thread wrote them: nothing new came
        assert [c[:2] for c in contents(store, "s")] == ["m0", "m1", "m2", "la"]
        link.close()


def test_a_busy_spool_keeps_the_oldest_in_memory_and_says_so_word_for_word(
    store, spool, monkeypatch, caplog
):
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    go_on = hold_the_writer(spool)
    fillers = [spool.submit("z", msg(f"z{i}")) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for i in range(5):
            store.append_to_transcript("s", msg(f"m{i}"))
    kept = [r.getMessage() for r in caplog.records if "stays in memory" in r.getMessage()]
    assert kept == [  # said at its first time; the second is counted for a later line
        f"Session DB transcript pending queue full for s (cap=3); the spool {spool.path} is "
        "busy, so the oldest message stays in memory (4 queued; the oldest is dropped past 6)"
    ]
    go_on.set()
    assert [f.result(STEP).seq for f in fillers] == [1, 2]
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(5)] + ["fin"]


def _held_by_the_background_thread(store, spool):
    """A session whose background retry is writing its queue's head, held at the gate."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.05)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("first"))  # fails: the background retries it
    store.append_to_transcript("s", msg("old"))  # the session is failing: queued only
    gate = gate_live_writes(store)
    writers: list[str] = []
    gate.write = naming_threads(gate.write, writers)
    # By content: a retry of "first" that fails before the heal also passes the gate.
    gate.arm(content="old")
    sql(store, HEAL)
    assert gate.entered.wait(STEP)  # the background thread wrote "first", holds "old"
    assert link.core.sessions["s"].writer.background
    link.core.settled = counted = _CountedWaits(link.core.lock)
    return link, gate, counted, writers


def test_a_shutdown_flush_the_spool_refuses_after_a_rewrite_does_not_bring_back_its_messages(
    hermes_home, store
):
    """Step by step: a shutdown flush takes the queue; the transcript is rewritten
    (/retry) before the spool refuses the flush's rows. The rewrite dropped the queue,
    as the released store does: the refused messages do not go back into it, and
    state.db never gets them after the rewrite."""
    with _a_flush_the_spool_refuses(hermes_home, store) as (spool, link, go_on, flusher, flushed):
        # The rewrite's own supersede queues behind the flush: it runs in a thread.
        rewriter = in_thread(lambda: store._clear_dirty_transcript("s"))
        with link.core.lock:
            assert link.core.settled.wait_for(lambda: link.core.sessions["s"].generation == 1, STEP)
        go_on.set()
        assert joined(flusher) and joined(rewriter)
        assert flushed == [0]
        with link.core.lock:
            assert not store._dirty_transcripts.get("s")
        sql(store, HEAL)
        store.append_to_transcript("s", msg("after"))
        assert link.wait_idle(STEP)
        assert contents(store, "s") == ["after"]
        link.close()


def test_a_rewrite_while_a_writer_holds_the_session_starts_its_bookkeeping_afresh(store, spool):
    """The session's state outlives a rewrite while its writer holds it (here the
    background thread, held writing "old"): the rewrite still resets what the state
    counted (spooled rows, failures, retry times) and bumps its generation past every
    value a writer may have read, once per rewrite. Its share of the cap stays: the
    superseded rows stay in the spool."""
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    with link.core.lock:
        state = link.core.sessions["s"]
        state.spooled = 3
        link.core.shares.accepted("s", 1234)
        link.core.shares.settled("s", 1234, row_id=1)
        later = time.monotonic() + 3600
        state.backed_off(state.writer, 2, later, later)  # as its holder
        generations = [state.generation]
    for text in ("rewritten", "rewritten again"):
        assert store.rewrite_transcript("s", [msg(text)])
        with link.core.lock:
            assert link.core.sessions["s"] is state  # kept: its writer still holds it
            assert (state.spooled, state.failures) == (0, 0)
            assert link.core.shares.of("s") == 1234
            assert state.retry_at == state.hold_until == 0.0
            generations.append(state.generation)
    assert generations == sorted(set(generations))  # rose with each rewrite
    gate.open()  # "old" lands (it was in flight, as in the released store)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["rewritten again", "old"]
    assert "s" not in link.core.sessions


def test_a_rewrite_forgets_the_state_of_a_session_it_leaves_idle(store, spool):
    """A failing session waits for its retry with a message queued; the rewrite drops
    the queue, and with nothing left the link forgets the session at once."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("first"))  # fails: queued, retried in an hour
    with link.core.lock:
        assert link.core.sessions["s"].failures == 1 and link.core.sessions["s"].writer is None
    store._clear_dirty_transcript("s")  # what a rewrite calls (state.db refuses the rewrite)
    with link.core.lock:
        assert "s" not in link.core.sessions
        assert "s" not in store._dirty_transcripts
    link.close()


class _HeldAfterWaking(threading.Condition):
    """The link's ``_settled`` condition; the first wait on it by the thread named
    ``name`` stays held once it ends (notified or timed out), as a thread that woke but
    has not taken the store's lock again yet: the lock is free until ``go_on`` is set.
    ``waits`` counts that thread's waits as they begin."""

    def __init__(self, lock: Any, name: str) -> None:
        super().__init__(lock)
        self.store_lock = lock
        self.name = name
        self.waits = threading.Semaphore(0)
        self.woken = threading.Event()
        self.go_on = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        mine = threading.current_thread().name == self.name and not self.woken.is_set()
        if mine:
            self.waits.release()
        result = super().wait(timeout)
        if mine:
            self.woken.set()
            self.store_lock.release()
            try:
                self.go_on.wait(STEP)
            finally:
                self.store_lock.acquire()
        return result


def test_a_session_a_waiter_keeps_after_it_is_written_out_starts_its_bookkeeping_afresh(
    store, spool, monkeypatch, caplog
):
    """Step by step: B waits for the head's write past twice the cap; A writes the whole
    queue out while B, woken, has not taken the lock again, so the session's state
    outlives A. What A leaves in it is a session with nothing to retry: a new message
    that fails is its first failure (first retry step, no error), and rows spooled
    after it drain once state.db heals (no hold left over)."""
    interval = 3600.0
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=interval)
    link.core.settled = held = _HeldAfterWaking(link.core.lock, "waiter")
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # A writes m0
    for i in range(1, 6):  # up to twice the cap: queued
        store.append_to_transcript("s", msg(f"m{i}"))
    b = threading.Thread(
        target=lambda: store.append_to_transcript("s", msg("m6")), name="waiter", daemon=True
    )
    b.start()
    assert held.waits.acquire(timeout=STEP)  # B waits for m0's write to end
    gate.open()
    assert joined(a)  # A wrote m0-m6 and gave the session up
    assert held.woken.is_set() and b.is_alive()
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.waiters == 1 and state.writer is None
    assert contents(store, "s") == [f"m{i}" for i in range(7)]
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING):
        before = link.clock()
        store.append_to_transcript("s", msg("m7"))  # fails: queued
        after = link.clock()
        with link.core.lock:
            assert link.core.sessions["s"] is state
            first = interval * 2.0 ** (1 - bounds.RETRY_STEPS)
            assert state.failures == 1
            assert before + first <= state.retry_at <= after + first
        for i in range(8, 11):  # past the cap: m7 spooled
            store.append_to_transcript("s", msg(f"m{i}"))
        spool.flush()
        held.go_on.set()
        assert joined(b)  # B finds the session failing: its message stays queued
        sql(store, HEAL)
        with link.core.lock:
            assert state.spooled == 1
            state.wake()  # due now rather than in an hour
            link.core.schedule(0.0)
        assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(11)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    link.close()


@pytest.mark.parametrize("bound", BOUNDS)
def test_a_gateway_thread_takes_the_session_over_and_writes_its_own_message(
    store, spool, monkeypatch, bound
):
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", bound)
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    if bound < 1:
        _stop_the_clock(monkeypatch, link)  # the background thread's retry is under way
    g = threading.Thread(
        target=lambda: store.append_to_transcript("s", msg("new")), name="gateway", daemon=True
    )
    g.start()
    assert counted.waits.acquire(timeout=STEP)  # g waits for the background writer
    with link.core.lock:
        assert link.core.sessions["s"].waiters == 1
    gate.open()
    assert joined(g)
    assert contents(store, "s") == ["first", "old", "new"]  # written before g returned
    assert writers[-1] == "gateway"
    assert link.wait_idle(STEP) and "s" not in link.core.sessions


def test_two_gateway_threads_waiting_to_take_a_session_over_are_both_counted(
    store, spool, monkeypatch
):
    """Both wait for the background writer, counted as two waiters; once it lets go,
    one of them writes both messages, in order, and the session is forgotten."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", STEP)
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    g1 = in_thread(lambda: store.append_to_transcript("s", msg("new1")))
    assert counted.waits.acquire(timeout=STEP)
    g2 = in_thread(lambda: store.append_to_transcript("s", msg("new2")))
    assert counted.waits.acquire(timeout=STEP)
    with link.core.lock:
        assert link.core.sessions["s"].waiters == 2
    gate.open()
    assert joined(g1) and joined(g2)
    assert contents(store, "s") == ["first", "old", "new1", "new2"]
    assert link.wait_idle(STEP) and "s" not in link.core.sessions


def test_a_wait_for_the_head_takes_only_itself_off_the_waiters(store, spool):
    """``waiters`` counts every thread inside a wait of the session; one that leaves
    (here at once: its deadline has passed) takes only itself off the count."""
    link = install(store, spool)
    with link.core.lock:
        state = link.core.session("s")
        state.waiters = 2  # two others wait, for the head or to take the session over
        link.evictions.wait_for_head(state, time.monotonic())
        assert state.waiters == 2
        state.waiters = 0
    link.close()


def test_a_gateway_thread_that_takes_over_a_session_whose_write_just_failed_leaves_it_queued(
    store, spool, monkeypatch, caplog
):
    """Step by step: a gateway thread waits to take the session over from the
    background thread, whose write then fails. The thread takes over a failing
    session: it does not write before the retry time (no extra failing write), gives
    the role up and leaves the retry scheduled; no error on the way."""
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", STEP)
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    g = in_thread(lambda: store.append_to_transcript("s", msg("new")))
    assert counted.waits.acquire(timeout=STEP)  # g waits for the background writer
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        gate.open()  # "old" fails
        assert joined(g)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert "new" not in gate.contents and gate.contents[-1] == "old"  # nothing tried for g
    with link.core.lock:
        state = link.core.sessions["s"]
        assert state.writer is None and state.retry_at > time.monotonic()
        assert link.core.wake_at is not None and link.core.wake_at <= state.retry_at
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["old", "new"]
    sql(store, HEAL)
    link.close()
    store.append_to_transcript("s", msg("fin"))  # closed: retries at once
    assert contents(store, "s") == ["first", "old", "new", "fin"]


def test_a_gateway_thread_leaves_a_drain_to_the_background_thread_while_the_spool_is_locked(
    store, spool, monkeypatch, caplog
):
    """Another process holds the spool's write lock (a commit has found it held): a
    gateway thread whose session has spooled rows does not drain them itself (its
    deletes would wait for the lock); it leaves its message queued and the session due,
    and once the lock is released the background thread drains and writes, in order."""
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)
    link, replays = _linked_with_an_earlier_row(store, spool, retry_interval=0.5)
    with write_lock_held(spool.path):
        blocked = _a_commit_finds_the_write_lock_held(spool)
        g = threading.Thread(
            target=lambda: store.append_to_transcript("s", msg("new")), name="gateway"
        )
        with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
            g.start()
            assert joined(g)  # while the lock is still held
        assert "gateway" not in replays
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        with link.core.lock:
            state = link.core.sessions["s"]
            assert state.writer is None or state.writer.background
            assert [m["content"] for m in store._dirty_transcripts["s"]] == ["new"]
    assert blocked.result(STEP).seq == 1
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["old", "new"]
    assert "gateway" not in replays


def test_a_take_over_waits_at_most_its_bound_then_leaves_the_message_queued(
    store, spool, monkeypatch
):
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 0.01)
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    g = in_thread(lambda: store.append_to_transcript("s", msg("new")))
    assert joined(g)  # while "old" is still being written
    assert not gate.release.is_set()
    with link.core.lock:
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["old", "new"]
    gate.open()
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["first", "old", "new"]
    assert "gateway" not in writers


def test_after_close_a_gateway_thread_never_waits_for_the_background_writer(
    store, spool, monkeypatch
):
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", STEP)
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    with link.core.lock:  # what close() does first; its join would wait for the gate
        link.core.closed = True
    store.append_to_transcript("s", msg("new"))  # returns at once: queued
    assert not counted.waits.acquire(blocking=False)
    gate.open()
    assert joined(link.background.thread)
    store.append_to_transcript("s", msg("after"))  # closed: each message retries at once
    assert contents(store, "s") == ["first", "old", "new", "after"]


def test_wait_idle_waits_its_whole_bound_for_a_write_to_end(store, spool, monkeypatch):
    """On a stopped clock, ``wait_idle(0.5)`` returns True once a held write ends."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)
    link.core.settled = counted = _CountedWaits(link.core.lock)
    _stop_the_clock(monkeypatch, link)
    idle: list[bool] = []
    w = in_thread(lambda: idle.append(link.wait_idle(0.5)))
    assert counted.waits.acquire(timeout=STEP)  # w waits for the write
    gate.open()
    assert joined(a) and joined(w)
    assert idle == [True]
    assert contents(store, "s") == ["m0"]


def test_close_waits_for_a_busy_background_thread_at_most_its_bound(store, spool, monkeypatch):
    """``close`` while the background thread is inside a write that does not end
    returns after ``HANDOFF_WAIT`` with the thread still running; the write then ends
    and the thread stops at its next look."""
    link, gate, counted, writers = _held_by_the_background_thread(store, spool)
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 0.2)
    link.close()
    assert link.background.thread.is_alive() and not gate.release.is_set()
    gate.open()
    assert joined(link.background.thread)
    assert contents(store, "s") == ["first", "old"]


def test_flush_queues_with_nothing_queued_spools_nothing(store, spool):
    link = install(store, spool, retry_interval=0)
    assert link.flush_queues() == 0
    assert list(spool.records()) == []


@pytest.mark.parametrize(("flush_timeout", "confirm_wait"), [(STEP, 0.0), (0.0, STEP)])
def test_a_shutdown_flush_waits_for_a_slow_commit_up_to_its_bound(
    store, spool, monkeypatch, caplog, flush_timeout, confirm_wait
):
    """The commit is waited for ``FLUSH_TIMEOUT`` (less the time waiting for room) plus
    ``CONFIRM_WAIT``: either one alone is enough for a slow commit."""
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", flush_timeout)
    monkeypatch.setattr(bounds, "CONFIRM_WAIT", confirm_wait)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", msg(f"m{i}"))
    go_on = hold_the_writer(spool)
    flushed: list[int] = []
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        flusher = in_thread(lambda: flushed.append(link.flush_queues()))
        with link.core.lock:
            assert link.core.settled.wait_for(lambda: not store._dirty_transcripts.get("s"), STEP)
        go_on.set()
        assert joined(flusher)
    assert flushed == [3]
    assert [r.message["content"] for r in spool.records()] == ["m0", "m1", "m2"]
    assert [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"][-1] == (
        f"Spooled 3 queued transcript message(s) to {spool.path} at shutdown"
    )


def test_a_shutdown_flush_not_committed_within_its_bound_says_so(store, spool, monkeypatch, caplog):
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.0)
    monkeypatch.setattr(bounds, "CONFIRM_WAIT", 0.0)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("m0"))
    go_on = hold_the_writer(spool)
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        assert link.flush_queues() == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"1 queued transcript message(s) were handed to {spool.path} at shutdown but not "
        "committed within 0 s; they are spooled if the spool commits them later"
    ]
    go_on.set()
    spool.flush()
    assert [r.message["content"] for r in spool.records()] == ["m0"]


def test_a_shutdown_flush_with_no_room_within_its_bound_keeps_the_queue(
    store, spool, monkeypatch, caplog
):
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.01)
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 1)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", msg(f"m{i}"))
    go_on = hold_the_writer(spool)
    filler = spool.submit("z", msg("z"))  # the queue is full
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        assert link.flush_queues() == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"could not spool 3 queued transcript message(s) at shutdown: the spool {spool.path} "
        "had no room for them within 0.01 s"
    ]
    with link.core.lock:
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0", "m1", "m2"]
    go_on.set()
    assert filler.result(STEP).seq == 1


def test_a_shutdown_flush_leaves_a_session_whose_head_is_being_written_to_that_write(
    store, spool, caplog, monkeypatch
):
    """m0 is being written when the flush runs, and past ``FLUSH_TIMEOUT``: the
    session's whole queue stays with that write (spooling m1 and m2 now would put them
    before m0 if m0's write failed), and a WARNING says so; m0 lands, and the same
    thread writes the rest, each once, in order."""
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.2)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)  # m0 is being written: it may land
    for i in (1, 2):
        store.append_to_transcript("s", msg(f"m{i}"))
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        assert link.flush_queues() == 0
    assert [r.getMessage() for r in caplog.records] == [
        "a transcript message was still being written to state.db after 0.2 s at shutdown; "
        "what waits behind that write is spooled, in order, once it ends"
    ]
    assert list(spool.records()) == []
    with link.core.lock:
        assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0", "m1", "m2"]
    gate.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", "m1", "m2"]  # each once, in order
    assert gate.most == 1


def test_a_shutdown_flush_waits_for_a_write_in_flight_then_spools_the_queue(store, spool, caplog):
    """m0 is being written (state.db broken) when the flush runs: the flush waits for
    that write, and once it failed the whole queue is spooled, m0 first, each once,
    with nothing said of a write outlasting the stop."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.core.settled = counted = _CountedWaits(link.core.lock)
    sql(store, BREAK)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("s", msg("m0")))
    assert gate.entered.wait(STEP)
    for i in (1, 2):
        store.append_to_transcript("s", msg(f"m{i}"))
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        flush = in_thread(link.flush_queues)
        assert counted.waited_in(flush)  # for m0's write
        gate.open()
        assert joined(flush) and joined(a)
    assert [r.message["content"] for r in spool.records()] == ["m0", "m1", "m2"]
    assert not [r for r in caplog.records if "still being written" in r.getMessage()]
    with link.core.lock:
        assert not store._dirty_transcripts.get("s")


def test_a_shutdown_flush_of_several_sessions_keeps_each_ones_share_exact(store, spool):
    """Three sessions' queues of 1, 3 and 2 messages of different sizes go to the spool
    in one flush: once it committed, each session's share of the cap is what the spool
    holds of it, as the start's count would find (each row settled as its own)."""
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    for session, n in (("a", 1), ("b", 3), ("c", 2)):
        store._db.create_session(session, "telegram")
        for i in range(n):
            store.append_to_transcript(session, msg(f"{session}{i}" + "x" * (100 * n + i)))
    assert link.flush_queues() == 6
    counted, _ = link_shares.count(spool)
    with link.core.lock:
        shares = {s: link.core.shares.of(s) for s in ("a", "b", "c")}
        assert all(not link.core.handoffs.pending(s) for s in ("a", "b", "c"))
    assert shares == counted and sorted(counted) == ["a", "b", "c"]
    link.close()


def test_a_message_the_spool_cannot_take_stays_queued_at_shutdown_the_others_go(
    hermes_home, store, caplog
):
    store._db.create_session("s", "telegram")
    with walspool.Spool(hermes_home / "spool.db", max_payload_bytes=1000) as spool:
        link = install(store, spool, retry_interval=0, max_bytes=None)
        sql(store, BREAK)
        big = msg("x" * 2000)
        for message in (big, msg("m1"), msg("m2")):
            store.append_to_transcript("s", message)
        with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
            assert link.flush_queues() == 2
        assert [r.message["content"] for r in spool.records()] == ["m1", "m2"]
        with link.core.lock:
            assert store._dirty_transcripts["s"] == [big]
        (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert error == (
            "walspool could not spool the oldest queued message of session s; it stays in "
            "memory: PayloadTooLarge(\"message for session 's' is 2028 bytes as JSON, over "
            "the spool's max_payload_bytes=1000; raise the limit or trim the message\")"
        )


def test_a_shutdown_flush_while_evictions_are_uncommitted_counts_each_once(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.05)
    sql(store, BREAK)
    go_on = hold_the_writer(spool)
    for i in range(202):  # two evictions handed to the stuck writer
        store.append_to_transcript("s", msg(f"m{i}"))
    flushed: list[int] = []
    flusher = in_thread(lambda: flushed.append(link.flush_queues()))
    with link.core.lock:
        assert link.core.settled.wait_for(lambda: not store._dirty_transcripts.get("s"), STEP)
        assert link.core.handoffs.pending("s") == 3
    go_on.set()
    assert joined(flusher) and flushed == [200]
    sql(store, HEAL)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(202)]
    link.close()


def test_the_background_thread_retries_a_due_session_while_another_has_a_writer(store, spool):
    for s in ("a", "b"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.05)
    gate = gate_live_writes(store)
    gate.arm()
    a = in_thread(lambda: store.append_to_transcript("a", msg("a0")))
    assert gate.entered.wait(STEP)  # "a" has a writer (first in the link's sessions)
    sql(store, BREAK)
    store.append_to_transcript("b", msg("b0"))  # fails: the background thread retries it
    sql(store, HEAL)
    with link.core.lock:
        assert link.core.settled.wait_for(lambda: "b" not in link.core.sessions, STEP)
    assert contents(store, "b") == ["b0"]  # while "a" is still being written
    assert not gate.release.is_set()
    gate.open()
    assert joined(a)
    assert link.wait_idle(STEP)
    assert contents(store, "a") == ["a0"]
    link.close()


# -- between the writer's decision and its write ---------------------------------------


def test_a_rewrite_after_the_writer_chose_to_write_leaves_it_nothing_to_write(
    store, spool, monkeypatch, caplog
):
    """The session's writer chose to write the queue's head and let the lock go; before
    it takes the lock again a /retry rewrites the transcript, dropping the queue (as the
    released store does). The writer writes nothing, logs nothing, and gives its role up:
    the next message is written at once."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    decided = Gate(link.core.run)  # called right after each decision, outside the lock
    monkeypatch.setattr(link.core, "run", decided)
    decided.arm(skip=1)  # the first call is the appender's own, before it writes
    caplog.set_level(logging.WARNING, logger="walspool")
    appender = in_thread(lambda: store.append_to_transcript("s", msg("dropped")))
    assert decided.entered.wait(STEP)
    assert store.rewrite_transcript("s", [msg("rewritten")])
    decided.open()
    assert joined(appender)
    with link.core.lock:
        assert "s" not in link.core.sessions  # no writer left behind, nothing to do
    store.append_to_transcript("s", msg("next"))
    assert contents(store, "s") == ["rewritten", "next"]
    assert [r.getMessage() for r in caplog.records] == []


def test_a_rewrite_during_a_failing_write_leaves_nothing_to_evict(store, spool, caplog):
    """The head's write fails after a /retry emptied the queue during it: the failure
    is logged as the released store logs it (nothing pending) and the writer stops
    cleanly; the rewritten transcript stands and the next message is written."""
    import sqlite3

    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    write = store._append_transcript_message

    def locked_once(*args: Any, **kw: Any) -> Any:
        store._append_transcript_message = write
        raise sqlite3.OperationalError("database is locked")

    gate = Gate(locked_once)
    store._append_transcript_message = gate
    gate.arm()
    caplog.set_level(logging.WARNING, logger="walspool")
    appender = in_thread(lambda: store.append_to_transcript("s", msg("dropped")))
    assert gate.entered.wait(STEP)
    assert store.rewrite_transcript("s", [msg("rewritten")])
    gate.open()
    assert joined(appender)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "Session DB transcript append failed for s (failure_count=1, pending=0); "
            "will retry: database is locked",
        )
    ]
    store.append_to_transcript("s", msg("next"))
    assert contents(store, "s") == ["rewritten", "next"]


def test_a_failed_drain_on_a_gateway_thread_does_not_wait_to_record_its_failure(store, spool):
    """A drain whose rows state.db refuses records the failure (attempts, last error)
    with the spool writer's next group, not in a commit of its own that the gateway
    thread waits for: with the spool's writer busy by then, the gateway thread returns."""
    store._db.create_session("s", "telegram")
    spool.append("s", msg("old"))  # an earlier run's row: the next message drains it
    link = install(store, spool, recover=False, retry_interval=0)
    sql(store, BREAK)
    gate = gate_drain_writes(link)
    gate.arm()
    appender = in_thread(lambda: store.append_to_transcript("s", msg("new")))
    assert gate.entered.wait(STEP)  # the row is taken; its write to state.db comes next
    go_on = hold_the_writer(spool, bound=3 * STEP)
    try:
        gate.open()
        assert joined(appender)  # while the spool's writer is still held
        assert spool.query("SELECT attempts FROM records", ()) == [(0,)]  # not recorded yet
    finally:
        go_on.set()
    spool.flush()
    assert spool.query("SELECT attempts, last_error FROM records", ()) == [
        (1, "IntegrityError: database disk image is malformed")
    ]
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == ["old", "new", "fin"]


def test_rows_spooled_by_key_alone_reach_the_session_the_store_resolves_them_to(hermes_home):
    """A row spooled with only a session key (its session was not known then) is written,
    at the next start, into the session the store's own ``peek_session_id`` names."""
    from gateway.config import GatewayConfig, Platform
    from gateway.session import SessionSource, SessionStore

    config = GatewayConfig(sessions_dir=hermes_home / "sessions")
    store = SessionStore(hermes_home / "sessions", config)
    entry = store.get_or_create_session(
        SessionSource(platform=Platform.TELEGRAM, chat_id="42", user_id="u1")
    )
    try:
        with walspool.Spool(hermes_home / "spool.db") as spool:
            spool.append(None, msg("by key"), reason="shutdown", session_key=entry.session_key)
            link = install(store, spool)
            assert link.wait_idle(STEP)
            assert contents(store, entry.session_id) == ["by key"]
            assert spool.stats().rows == 0
    finally:
        store._db.close()


def test_without_a_background_thread_a_gateway_thread_drains_itself_once_the_lock_is_free(
    store, spool, monkeypatch
):
    """``retry_interval=0`` starts no background thread: a gateway thread whose session has
    spooled rows while another process holds the spool's write lock drains them itself
    once the lock is free (nobody else would), rather than leaving them and its message
    behind until the session's next message. Both the blocked append and the drain wait
    for the lock with the writer's own bound: the lock is released only after the gateway
    thread has decided, and how long that takes depends on the machine."""
    link, replays = _linked_with_an_earlier_row(store, spool, retry_interval=0)
    decided = Gate(link.core.run)  # called right after each decision, outside the lock
    monkeypatch.setattr(link.core, "run", decided)
    with write_lock_held(spool.path):
        blocked = _a_commit_finds_the_write_lock_held(spool)
        decided.arm(skip=1)  # the first call is the appender's own, before it writes
        g = threading.Thread(
            target=lambda: store.append_to_transcript("s", msg("new")), name="gateway"
        )
        g.start()
        assert decided.entered.wait(STEP)  # decided while the lock is held
        decided.open()
    assert joined(g)
    assert blocked.result(STEP).seq == 1
    assert set(replays) == {"gateway"}
    assert contents(store, "s") == ["old", "new"]
