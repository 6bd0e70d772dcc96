"""A gateway start (axisrow 0.20: ``recover_pending_to_db()``) while another process holds
the spool's replay lock, as a running ``walspool replay`` does: the start never waits
for it, nothing is written twice or lost, and the next start (or that replay) lands
everything."""

from __future__ import annotations

import time

from _axisrow import break_db, close_store, contents, heal_db, new_store
from _gateways_common import replay_running, start_beside
from _lock_holder import replay_lock_held

import walspool
import walspool.shutdown_flush as wsf

#: Generous: the start skips the replay at once (the lock is tried without waiting).
START_BOUND = 5.0


def test_a_start_during_a_running_replay_skips_it_and_the_next_start_lands_all(home):
    store = new_store(home)
    store._db.create_session("s", "telegram")
    break_db(store._db)
    for i in range(230):  # 30 evictions
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    heal_db(store._db)
    close_store(store)
    wsf.close_shared_spools()
    with replay_lock_held(home / "spool.db"):
        started = time.monotonic()
        assert wsf.recover_pending_to_db() == 0
        assert time.monotonic() - started < START_BOUND
        with walspool.Spool(home / "spool.db") as spool:
            assert spool.stats().rows == 30
    assert wsf.recover_pending_to_db() == 30
    store = new_store(home)
    try:
        assert contents(store._db, "s") == [f"m{i}" for i in range(30)]
    finally:
        close_store(store)


SESSIONS, ROWS = 200, 3


def test_a_start_while_a_real_walspool_replay_runs_skips_it_and_nothing_lands_twice(home):
    """A real ``walspool replay`` process, stopped in the middle of its replay by a state.db
    lock another process holds, while the gateway starts (``recover_pending_to_db()``): the
    start returns at once without touching state.db, the replay lands every row once and
    in order when the lock goes, and the next start finds nothing to write."""
    store = new_store(home)
    ids = [f"s{i}" for i in range(SESSIONS)]
    for sid in ids:
        store._db.create_session(sid, "telegram")
    for i in range(ROWS):
        for sid in ids:  # as the gateway hands over its cap evictions
            assert wsf.spool_dropped_transcript_message(
                sid, {"role": "user", "content": f"{sid}-{i}"}
            )
    close_store(store)
    wsf.close_shared_spools()
    with replay_running(home) as replay:
        with walspool.Spool(home / "spool.db") as spool:
            assert spool.stats().rows > 0  # the replay waits in the middle of its rows
        took, started, status, report = start_beside(replay, wsf.recover_pending_to_db, START_BOUND)
        assert took < START_BOUND, f"the start waited {took:.1f} s for the running replay"
        assert started == [0]
    assert (status, report["moved"], report["held"]) == (0, SESSIONS * ROWS, 0)
    assert wsf.recover_pending_to_db() == 0  # nothing left: nothing written twice
    store = new_store(home)
    try:
        for sid in ids:
            assert contents(store._db, sid) == [f"{sid}-{i}" for i in range(ROWS)]
    finally:
        close_store(store)
    with walspool.Spool(home / "spool.db") as spool:
        assert spool.stats().rows == 0
