"""A spool whose write lock another process holds (an operator's ``sqlite3 spool.db`` in a
transaction, a long vacuum), on the real 0.22 gateway: no gateway thread waits on it.

An eviction waits for its commit at most ``HANDOFF_SECONDS``, and none is handed off
once the lock is known held (the gateway keeps them in memory); drains are skipped
while the lock is held and retried at the session's next write. The waits are recorded
exactly where walspool could start one (see ``_gateways_common.DropInWaits``).
"""

from __future__ import annotations

import logging
import threading
import time

from _fork import break_db, heal_db
from _gateway import found_locked
from _gateways_common import DropInWaits
from _helpers import STEP
from _lock_holder import write_lock_held

import walspool.shutdown_flush as wsf
import walspool.store.writer as writer
from walspool.gateways.session_store import StoreQueues
from walspool.link.flush import spool_queues

#: A generous wall-clock bound on one transcript write of a healthy session while the
#: spool is locked (it was up to 10 s per eviction before; the exact check is the
#: recorded waits).
APPEND_BOUND = 5.0


def timed_append(store, session_id: str, content: str) -> float:
    started = time.monotonic()
    store.append_to_transcript(session_id, {"role": "user", "content": content})
    return time.monotonic() - started


def test_a_locked_spool_never_makes_a_gateway_thread_wait(home, store, monkeypatch):
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)  # the hold ends first
    for sid in ("a", "h"):
        store._db.create_session(sid, "telegram")
    spool = wsf.shared_spool()
    waits = DropInWaits(spool, monkeypatch)
    break_db(store._db, session_id="a")
    with write_lock_held(spool.path) as holder:
        # The third failure hands the stalled backlog to the spool (0.22), whose writer
        # then finds the lock held; later messages stay in the gateway's memory.
        times = [timed_append(store, "a", f"a{i}") for i in range(3)]
        assert found_locked(spool)
        times += [timed_append(store, "a", f"a{i}") for i in range(3, 60)]
        # A healthy session writes at once while the spool is locked.
        times.append(timed_append(store, "h", "hello"))
        assert [m["content"] for m in store._db.get_messages("h")] == ["hello"]
        assert waits.once_found_locked() == []
        assert ("_probe", 0.0, True) in waits.seen  # drains were tried, and skipped
        # Before the writer found the lock held: at most the drain's CONFIRM_WAIT, or
        # the hand-off's HANDOFF_SECONDS.
        bound = max(wsf.CONFIRM_WAIT, wsf.HANDOFF_SECONDS)
        assert all(b is not None and b <= bound for _, b in waits.before_found_locked()), (
            waits.before_found_locked()
        )
        assert max(times) < APPEND_BOUND, max(times)
        assert spool.stats().rows == 0  # nothing was handed off: all kept in memory
        assert len(store._dirty_transcripts["a"]) == 60
        holder.release()
    spool.flush()  # the hand-offs commit once the lock is free
    heal_db(store._db)
    store.append_to_transcript("a", {"role": "user", "content": "a-last"})
    got = [m["content"] for m in store._db.get_messages("a")]
    assert got == [*(f"a{i}" for i in range(60)), "a-last"]
    assert spool.stats().rows == 0


def test_a_hand_off_the_lock_outlasts_is_kept_by_the_gateway_and_lands_after_the_hold(
    home, store, monkeypatch, caplog
):
    """The hand-off that meets the lock waits for it at most BUSY_RETRY_SECONDS (below
    HANDOFF_SECONDS here): then nothing is written and the gateway keeps the message,
    as it keeps what its own spool fails to take. Nothing is dropped; once the lock is
    known held nothing more is handed off, and it all lands after the hold."""
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 0.2)
    store._db.create_session("a", "telegram")
    spool = wsf.shared_spool()
    break_db(store._db)
    sent = [f"a{i}" for i in range(50)]
    with write_lock_held(spool.path), caplog.at_level(logging.WARNING, "walspool"):
        # The third failure spools the stalled backlog (0.22): refused, kept.
        times = [timed_append(store, "a", m) for m in sent]
        assert found_locked(spool)
        assert wsf.hand_offs("a") == (0, 0)
        kept = len(store._dirty_transcripts["a"])
    assert max(times) < APPEND_BOUND, max(times)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("walspool")]
    assert not [m for m in said if "dropped" in m], said
    assert kept == len(sent)
    assert spool.stats().rows == 0
    heal_db(store._db)
    store.append_to_transcript("a", {"role": "user", "content": "a-last"})
    got = [m["content"] for m in store._db.get_messages("a")]
    assert got == [*sent, "a-last"]
    assert spool.stats().rows == 0


def test_a_stops_flush_holds_no_gateway_thread_while_the_lock_is_held(home, store, monkeypatch):
    """At a stop, the queues go to a spool whose write lock another process holds: the
    flush takes them under the store's lock and waits for the commit outside it, so a
    gateway thread's message meanwhile queues at once; the flush lands once the lock
    goes, its messages ahead of the later one."""
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)  # the hold ends first
    store._db.create_session("a", "telegram")
    spool = wsf.shared_spool()
    break_db(store._db, session_id="a")
    store.append_to_transcript("a", {"role": "user", "content": "a0"})  # stays queued
    assert [m["content"] for m in store._dirty_transcripts["a"]] == ["a0"]
    with write_lock_held(spool.path) as holder:
        flushed: list[int] = []
        flusher = threading.Thread(
            target=lambda: flushed.append(spool_queues(spool, StoreQueues(store)))
        )
        flusher.start()
        lock = store._transcript_retry_lock
        deadline = time.monotonic() + STEP
        taken = False
        while not taken and time.monotonic() < deadline:  # until the flush took the queue
            # Not held across the commit the flush waits for (the old plugin held it).
            assert lock.acquire(timeout=STEP)
            taken = store._dirty_transcripts["a"] == []
            lock.release()
            time.sleep(0.01)
        assert taken
        with lock:  # a gateway thread's message, queued as append_to_transcript queues it
            store._dirty_transcripts["a"].append({"role": "user", "content": "a1"})
        assert flusher.is_alive() and spool.stats().rows == 0
        holder.release()
        flusher.join(STEP)
    assert flushed == [1]
    assert [r.message["content"] for r in spool.records()] == ["a0"]
    assert [m["content"] for m in store._dirty_transcripts["a"]] == ["a1"]
