"""A gateway start (axisrow 0.20: ``recover_pending_to_db()``) while another process holds
the spool's replay lock, as a running ``walspool replay`` does: the start never waits
for it, nothing is written twice or lost, and the next start lands everything."""

from __future__ import annotations

import time

from _axisrow import break_db, close_store, contents, heal_db, new_store
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
