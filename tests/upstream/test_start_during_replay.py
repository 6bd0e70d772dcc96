"""A gateway start (0.22: ``recover_gateway_pending``) while a real ``walspool replay``
runs in another process: the start never waits for it, marks the sessions it leaves to
it (so their live rows wait behind the spooled ones), and every row lands once, in order."""

from __future__ import annotations

import types

from _gateways_common import replay_running, start_beside

import walspool
import walspool.shutdown_flush as wsf

#: Generous: the start skips the replay at once (the lock is tried without waiting).
START_BOUND = 5.0
SESSIONS, ROWS = 200, 3


def contents(db, session_id):
    return [m["content"] for m in db.get_messages(session_id)]


def test_a_start_while_a_real_walspool_replay_runs_skips_it_and_nothing_lands_twice(home, store):
    """The replay is stopped in the middle of its rows by a state.db lock another process
    holds while the gateway, its store open, starts."""
    ids = [f"s{i}" for i in range(SESSIONS)]
    for sid in ids:
        store._db.create_session(sid, "telegram")
    for i in range(ROWS):
        for sid in ids:  # as the gateway hands over its cap evictions
            message = {"role": "user", "content": f"{sid}-{i}"}
            assert wsf.spool_dropped_transcript_message(sid, message)
    wsf.close_shared_spools()
    runner = types.SimpleNamespace(session_store=store, config=store.config)
    with replay_running(home) as replay:
        with walspool.Spool(home / "spool.db") as spool:
            assert spool.stats().rows > 0  # the replay waits in the middle of its rows
        took, started, status, report = start_beside(
            replay, lambda: wsf.recover_gateway_pending(runner), START_BOUND
        )
        assert took < START_BOUND, f"the start waited {took:.1f} s for the running replay"
        assert started == [0]
    assert (status, report["moved"], report["held"]) == (0, SESSIONS * ROWS, 0)
    # The sessions left to the replay were marked: a live row drains first, then lands last.
    assert store._spooled_drop_sessions
    for sid in ids:
        store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-live"})
    assert wsf.recover_gateway_pending(runner) == 0  # nothing left: nothing written twice
    for sid in ids:
        assert contents(store._db, sid) == [*(f"{sid}-{i}" for i in range(ROWS)), f"{sid}-live"]
    with walspool.Spool(home / "spool.db") as spool:
        assert spool.stats().rows == 0
