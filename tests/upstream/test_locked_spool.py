"""A spool whose write lock another process holds (an operator's ``sqlite3 spool.db`` in a
transaction, a long vacuum), on the real 0.22 gateway: no gateway thread waits on it.

Evictions are handed to the spool's writer without waiting; drains are skipped while
the lock is held and retried at the session's next write. The waits are recorded
exactly where walspool could start one (see ``_gateways_common.DropInWaits``).
"""

from __future__ import annotations

import logging
import time

from _fork import break_db, heal_db
from _gateway import found_locked
from _gateways_common import DropInWaits
from _helpers import STEP
from _lock_holder import write_lock_held

import walspool.shutdown_flush as wsf
import walspool.writer as writer

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
        # Before the writer found the lock held: at most the drain's CONFIRM_WAIT.
        assert all(
            b is not None and b <= wsf.CONFIRM_WAIT for _, b in waits.before_found_locked()
        ), waits.before_found_locked()
        assert max(times) < APPEND_BOUND, max(times)
        assert spool.stats().rows == 0  # the hand-offs wait in the writer's queue
        holder.release()
    spool.flush()  # the hand-offs commit once the lock is free
    heal_db(store._db)
    store.append_to_transcript("a", {"role": "user", "content": "a-last"})
    got = [m["content"] for m in store._db.get_messages("a")]
    assert got == [*(f"a{i}" for i in range(60)), "a-last"]
    assert spool.stats().rows == 0


def test_a_hand_off_the_lock_outlasts_is_dropped_with_a_warning_and_no_more_are_made(
    home, store, monkeypatch, caplog
):
    """The writer waits at most BUSY_RETRY_SECONDS for the lock (on its own thread); a
    hand-off it then fails is dropped with a WARNING, as upstream drops what its spool
    fails to take. Once the lock is known held nothing more is handed off: the
    gateway keeps its stalled backlog in memory, and it all lands after the hold."""
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 0.2)
    store._db.create_session("a", "telegram")
    spool = wsf.shared_spool()
    break_db(store._db)
    sent = [f"a{i}" for i in range(50)]
    with write_lock_held(spool.path), caplog.at_level(logging.WARNING, "walspool"):
        # The third failure spools the stalled backlog (0.22): handed off, then failed.
        times = [timed_append(store, "a", m) for m in sent[:3]]
        with wsf._handoffs:
            assert wsf._handoffs.wait_for(lambda: not wsf._unconfirmed, STEP)
        assert found_locked(spool)
        times += [timed_append(store, "a", m) for m in sent[3:]]
        assert not wsf._unconfirmed  # nothing handed off once the lock is known held
        kept = len(store._dirty_transcripts["a"])  # kept in memory instead
    assert max(times) < APPEND_BOUND, max(times)
    dropped = [r.getMessage() for r in caplog.records if "could not be committed" in r.getMessage()]
    # The stalled backlog the third failure spools is handed off up to the moment the
    # writer finds the lock held (its first hand-off at least): those are dropped, each
    # with a WARNING; every later message stays in memory.
    assert 1 <= len(dropped) <= 3, dropped
    assert all("evicted for a" in m and "dropped" in m for m in dropped)
    assert kept == len(sent) - len(dropped)
    spool.flush()
    heal_db(store._db)
    store.append_to_transcript("a", {"role": "user", "content": "a-last"})
    got = [m["content"] for m in store._db.get_messages("a")]
    assert got == [*sent[len(dropped) :], "a-last"]
    assert spool.stats().rows == 0
