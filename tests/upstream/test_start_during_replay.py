"""A gateway start (0.22: ``recover_gateway_pending``) while a real ``walspool replay``
runs in another process: the start never waits for it, marks the sessions it leaves to
it (so their live rows wait behind the spooled ones), and every row lands once, in order."""

from __future__ import annotations

import types

from _gateways_common import replay_running, start_beside
from _lock_holder import replay_lock_held

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


def test_a_start_while_a_replay_runs_holds_the_session_of_a_slot_spooled_by_key(home, store):
    """A slot spooled at the last shutdown by session key only (0.22's slots carry no
    session id); the gateway starts while a real ``walspool replay`` runs: the session
    the key routes to is marked with the others, so its first live row waits behind the
    slot (before: only sessions with rows of their own were marked, and a live message
    of the slot's session overtook it)."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    entry = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="42"))
    store._db.create_session("other", "telegram")
    assert wsf.spool_dropped_transcript_message("other", {"role": "user", "content": "x"})
    assert wsf.flush_pending_to_file({entry.session_key: "the slot"}) == 1
    wsf.close_shared_spools()
    runner = types.SimpleNamespace(session_store=store, config=store.config)
    with replay_running(home) as replay:
        _, started, _, _ = start_beside(
            replay, lambda: wsf.recover_gateway_pending(runner), START_BOUND
        )
    assert started == [0]
    assert {"other", entry.session_id} <= set(store._spooled_drop_sessions)


def test_a_live_row_of_a_slots_session_waits_while_another_replay_holds_the_spool(home, store):
    """The start finds another replay holding the spool (its lock held by another
    process) and leaves the slot spooled by key to it; a live message of the slot's
    session arrives meanwhile: it waits in the gateway's queue (the drain counts the
    slot as remaining), and once the replay lock is free the session's next write puts
    the slot first."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    entry = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="42"))
    sid = entry.session_id
    assert wsf.flush_pending_to_file({entry.session_key: "the slot"}) == 1
    runner = types.SimpleNamespace(session_store=store, config=store.config)
    with replay_lock_held(home / "spool.db"):
        assert wsf.recover_gateway_pending(runner) == 0
        assert sid in store._spooled_drop_sessions
        store.append_to_transcript(sid, {"role": "user", "content": "live 1"})
        assert contents(store._db, sid) == []  # behind the slot, in the gateway's queue
    store.append_to_transcript(sid, {"role": "user", "content": "live 2"})
    assert contents(store._db, sid) == ["the slot", "live 1", "live 2"]
    with walspool.Spool(home / "spool.db") as spool:
        assert spool.stats().rows == 0
