"""Shutdown slots keyed by session key on axisrow 0.20, whose gateway/run.py calls
``recover_pending_to_db()`` with no arguments: walspool resolves each key from the
routing the gateway keeps on disk (state.db's ``gateway_routing``, then the
``sessions.json`` mirror), and reports a key nothing routes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from _axisrow import close_store, contents, keyed_session, new_store

import walspool
import walspool.shutdown_flush as wsf

UNKNOWN = "agent:main:telegram:dm:nobody\x1b[2J"


def shutdown_with_slots(home: Path, chats: int) -> list[Any]:
    """A gateway that routed ``chats`` chats stops with a pending slot for each and one
    for a key it never routed; its spool is closed, as at exit."""
    store = new_store(home)
    entries = [keyed_session(store, str(c)) for c in range(chats)]
    pending = {e.session_key: f"slot {c}" for c, e in enumerate(entries)}
    pending[UNKNOWN] = "slot of an unknown key"
    assert wsf.flush_pending_to_file(pending) == chats + 1
    close_store(store)
    wsf.close_shared_spools()
    return entries


def spooled(home: Path) -> list[walspool.Record]:
    with walspool.Spool(home / "spool.db") as spool:
        return list(spool.records())


def test_slots_land_in_the_routed_sessions_and_an_unrouted_key_is_reported(home, caplog):
    entries = shutdown_with_slots(home, 3)
    with caplog.at_level(logging.WARNING, logger="walspool.shutdown_flush"):
        assert wsf.recover_pending_to_db() == 3  # as gateway/run.py calls it
    store = new_store(home)
    try:
        for c, entry in enumerate(entries):
            assert contents(store._db, entry.session_id) == [f"slot {c}"]
    finally:
        close_store(store)
    (kept,) = spooled(home)
    assert kept.session_key == UNKNOWN and kept.attempts == 1
    assert "no session" in (kept.last_error or "")
    (warning,) = [r.getMessage() for r in caplog.records if "routing table" in r.getMessage()]
    assert "1 spooled message(s) of 1 session key(s)" in warning
    assert "nobody\\x1b[2J" in warning and "\x1b" not in warning  # escaped, never raw


def test_the_sessions_json_mirror_routes_keys_the_routing_table_lost(home):
    entries = shutdown_with_slots(home, 2)
    import hermes_state

    db = hermes_state.SessionDB()
    with db._lock:
        db._conn.execute("DELETE FROM gateway_routing")
        db._conn.commit()
    db.close()
    assert (home / "sessions" / "sessions.json").exists()
    assert wsf.recover_pending_to_db() == 2
    store = new_store(home)
    try:
        assert [contents(store._db, e.session_id) for e in entries] == [["slot 0"], ["slot 1"]]
    finally:
        close_store(store)


def test_a_key_routed_after_the_first_start_lands_at_the_next(home):
    shutdown_with_slots(home, 1)
    assert wsf.recover_pending_to_db() == 1
    assert [r.session_key for r in spooled(home)] == [UNKNOWN]
    # A message from that chat routes the key: the next start writes the slot there.
    store = new_store(home)
    entry = keyed_session(store, "0")
    with store._lock:
        store._entries[UNKNOWN] = entry  # as get_or_create_session keys it
    store._save()
    close_store(store)
    assert wsf.recover_pending_to_db() == 1
    assert spooled(home) == []
    store = new_store(home)
    try:
        assert contents(store._db, entry.session_id) == ["slot 0", "slot of an unknown key"]
    finally:
        close_store(store)


def test_a_key_routed_differently_by_other_scopes_is_resolved_only_where_they_agree(home):
    """Routing entries for a key outside the home's own scope (other profiles' sessions
    directories): one session they all name is taken; two that disagree resolve to
    none of them (the slot stays, reported), never to either at random."""
    import hermes_state

    (entry,) = shutdown_with_slots(home, 1)
    db = hermes_state.SessionDB()
    db.create_session("other", "telegram")
    with db._lock:
        (entry_json,) = db._conn.execute(
            "SELECT entry_json FROM gateway_routing WHERE session_key = ?", (entry.session_key,)
        ).fetchone()
        other_json = entry_json.replace(entry.session_id, "other")
        assert other_json != entry_json
        db._conn.execute("DELETE FROM gateway_routing")
        db._conn.executemany(
            "INSERT INTO gateway_routing (scope, session_key, entry_json, updated_at) "
            "VALUES (?, ?, ?, 0)",
            [
                ("/profiles/a/sessions", entry.session_key, entry_json),
                ("/profiles/b/sessions", entry.session_key, other_json),
            ],
        )
        db._conn.commit()
    db.close()
    (home / "sessions" / "sessions.json").unlink()
    assert wsf.recover_pending_to_db() == 0  # they disagree: the slot stays
    assert entry.session_key in {r.session_key for r in spooled(home)}
    db = hermes_state.SessionDB()
    with db._lock:
        db._conn.execute(
            "UPDATE gateway_routing SET entry_json = ? WHERE scope = ?",
            (entry_json, "/profiles/b/sessions"),
        )
        db._conn.commit()
    db.close()
    assert wsf.recover_pending_to_db() == 1  # they agree
    store = new_store(home)
    try:
        assert contents(store._db, entry.session_id) == ["slot 0"]
        assert contents(store._db, "other") == []
    finally:
        close_store(store)
