"""walspool.shutdown_flush as the newer gateway's module, on its real store and database."""

from __future__ import annotations

import inspect
import json
import logging
import re
import types
import weakref
from pathlib import Path
from typing import Any

from _fork import break_db, heal_db, upstream_module

import walspool
from walspool import shutdown_flush as wsf


def spooled(home: Path, **kw: Any) -> list[walspool.Record]:
    with walspool.Spool(home / "spool.db") as spool:
        return list(spool.records(**kw))


def contents(db: Any, session_id: str) -> list[Any]:
    return [m["content"] for m in db.get_messages(session_id)]


def runner_for(store: Any) -> Any:
    return types.SimpleNamespace(session_store=store, config=store.config)


def _public(module: Any) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and (not callable(value) or getattr(value, "__module__", None) == module.__name__)
        and not (isinstance(value, type) or name in {"annotations", "logger"})
    }


def _shape(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_public_name_of_the_fork_module_with_its_signature() -> None:
    theirs = _public(upstream_module())
    assert set(theirs) == {
        "AGENT_HISTORY_REASON",
        "QUARANTINE_SUFFIX",
        "TRANSCRIPT_CAP_DROP_REASON",
        "drain_transcript_spool",
        "flush_agent_history_to_file",
        "flush_overflow_to_file",
        "flush_pending_to_file",
        "is_row_rejection",
        "recover_gateway_pending",
        "recover_pending_spool",
        "recover_pending_to_db",
        "spool_dropped_transcript_message",
    }
    assert set(wsf.__all__) == set(theirs)
    for name, value in theirs.items():
        ours = getattr(wsf, name)
        if callable(value):
            assert _shape(ours) == _shape(value), name
        else:
            assert ours == value, name


def test_is_row_rejection_agrees_with_the_fork() -> None:
    import sqlite3

    theirs = upstream_module().is_row_rejection
    for exc in (
        sqlite3.InterfaceError("Error binding parameter 2: type 'dict' is not supported"),
        sqlite3.ProgrammingError("Error binding parameter 1"),
        sqlite3.InterfaceError("no more rows available"),
        sqlite3.OperationalError("database is locked"),
        sqlite3.DatabaseError("database disk image is malformed"),
        sqlite3.IntegrityError("FOREIGN KEY constraint failed"),
        TypeError("x"),
        ValueError("x"),
        AttributeError("x"),
        OverflowError("Python int too large to convert to SQLite INTEGER"),
        RuntimeError("no owning session store"),
        KeyError("x"),
    ):
        assert wsf.is_row_rejection(exc) == theirs(exc), exc


def test_every_name_the_gateway_imports_from_the_module_exists() -> None:
    import gateway

    root = Path(gateway.__file__).parent
    pattern = re.compile(r"from gateway\.shutdown_flush import (\([^)]*\)|[^\n]+)")
    imported = {
        name.strip()
        for path in root.rglob("*.py")
        if path.name != "shutdown_flush.py"
        for match in pattern.finditer(path.read_text(encoding="utf-8"))
        for name in match.group(1).strip("()").split(",")
        if name.strip()
    }
    imported = {name.split(" as ")[0].strip() for name in imported}
    assert {"recover_gateway_pending", "flush_overflow_to_file"} <= imported
    assert imported <= set(wsf.__all__)


def test_transient_outage_spools_and_drains_in_order_when_the_database_heals(home, store):
    db = store._db
    db.create_session("s1", "telegram")
    db.create_session("s2", "telegram")
    break_db(db)
    sent = {sid: [f"{sid}-{i}" for i in range(230)] for sid in ("s1", "s2")}
    for i in range(230):
        for sid in sent:
            store.append_to_transcript(sid, {"role": "user", "content": sent[sid][i]})
    assert contents(db, "s1") == []
    assert len(spooled(home, session_id="s1")) >= 30  # cap evictions and a stalled backlog
    heal_db(db)
    for sid in sent:
        store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
        assert contents(db, sid) == [*sent[sid], f"{sid}-last"]
    assert spooled(home) == []
    assert not (home / "pending_messages").exists()


def test_restart_recovery_marks_held_back_sessions_so_live_rows_never_overtake(home, store):
    db = store._db
    db.create_session("s1", "telegram")
    db.create_session("s2", "telegram")
    for i in range(3):
        wsf.spool_dropped_transcript_message("s1", {"role": "user", "content": f"old{i}"})
    wsf.spool_dropped_transcript_message("s2", {"role": "user", "content": "other"})
    break_db(db, session_id="s1")  # s1 alone cannot take writes
    assert wsf.recover_pending_spool(db) == (1, {"s1"})
    assert wsf.recover_gateway_pending(runner_for(store)) == 0
    assert "s1" in store._spooled_drop_sessions
    assert contents(db, "s2") == ["other"]
    heal_db(db)
    store.append_to_transcript("s1", {"role": "user", "content": "live"})
    assert contents(db, "s1") == ["old0", "old1", "old2", "live"]
    assert spooled(home) == []


def test_a_held_slot_spooled_by_key_lands_before_the_live_rows_of_its_session(home, store):
    """A slot spooled by routing key that resolves to a session state.db refuses at the
    start: recovery reports that session held back (the gateway marks it), and the
    session's drain writes the slot before its live rows; a session with nothing held
    is not reported."""
    db = store._db
    for sid in ("s1", "s2"):
        db.create_session(sid, "telegram")
    keys = {"agent:main:telegram:dm:9": "s1", "agent:main:telegram:dm:8": "s2"}
    assert wsf.flush_pending_to_file({key: f"slot {sid}" for key, sid in keys.items()}) == 2

    def resolver(key: str, *, not_after: float | None = None) -> tuple[str, Any] | None:
        return (keys[key], db) if key in keys else None

    break_db(db, session_id="s1")
    assert wsf.recover_pending_spool(db, session_resolver=resolver) == (1, {"s1"})
    assert contents(db, "s2") == ["slot s2"]
    store.mark_spooled_drop_sessions({"s1"})  # as recover_gateway_pending does
    store.append_to_transcript("s1", {"role": "user", "content": "during"})
    assert contents(db, "s1") == []  # still broken: the slot, then the live row, wait
    heal_db(db)
    store.append_to_transcript("s1", {"role": "user", "content": "live"})
    assert contents(db, "s1") == ["slot s1", "during", "live"]
    assert spooled(home) == []
    assert wsf.recover_pending_spool(db, session_resolver=resolver) == (0, set())


def test_a_spool_deleted_while_the_gateway_runs_is_opened_fresh_and_nothing_more_is_lost(
    home, store, caplog
):
    """An operator deletes spool.db (and its -wal, -shm) while a session is stalled: the
    next eviction goes to a fresh spool at the path, with a WARNING, and lands once
    state.db works again; a moved spool keeps its rows where it was moved."""
    import os

    db = store._db
    db.create_session("s1", "telegram")
    first = {"role": "user", "content": "before the move"}
    assert wsf.spool_dropped_transcript_message("s1", first) == home / "spool.db"
    wsf.shared_spool().flush()
    moved = home / "moved.db"
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{home / 'spool.db'}{suffix}"):
            os.rename(f"{home / 'spool.db'}{suffix}", f"{moved}{suffix}")
    later = {"role": "user", "content": "after the move"}
    with caplog.at_level(logging.WARNING, logger="walspool.shutdown_flush"):
        assert wsf.spool_dropped_transcript_message("s1", later) == home / "spool.db"
    (warning,) = [r.getMessage() for r in caplog.records if "moved or deleted" in r.getMessage()]
    assert str(home / "spool.db") in warning
    wsf.shared_spool().flush()  # handed off at once, as an eviction is: committed behind
    assert [r.message for r in spooled(home)] == [later]
    with walspool.Spool(moved) as old:
        assert [r.message for r in old.records()] == [first]
    assert wsf.drain_transcript_spool("s1", lambda m: db.append_message("s1", **m)) == (1, 0)
    assert contents(db, "s1") == ["after the move"]


def test_a_row_state_db_cannot_bind_as_it_is_lands_as_a_replay_writes_it(home, store):
    """A spooled row whose content is 2**70, which the gateway's own write cannot bind:
    the drain writes it once more with its values made bindable, as any replay does, so
    it lands in its place as its decimal text (one verdict, live or replayed)."""
    db = store._db
    db.create_session("s1", "telegram")
    wsf.spool_dropped_transcript_message("s1", {"role": "user", "content": 2**70})
    for i in range(20):
        wsf.spool_dropped_transcript_message("s1", {"role": "user", "content": f"after{i}"})
    store.mark_spooled_drop_sessions({"s1"})
    store.append_to_transcript("s1", {"role": "user", "content": "live"})
    assert contents(db, "s1") == [str(2**70), *(f"after{i}" for i in range(20)), "live"]
    assert spooled(home) == []


def test_recovery_writes_what_the_gateway_itself_writes(home, store, tmp_path):
    """New fields travel (display_kind, display_metadata, api_content, message_uid), and a
    dict in a TEXT column becomes its JSON text, as the gateway's own mapping does."""
    import hermes_state
    from gateway.session_transcript import transcript_append_kwargs

    messages = [
        {
            "role": "user",
            "content": "[background task finished]",
            "display_kind": "internal_notification",
            "display_metadata": {"task": "t1", "ok": True},
            "api_content": "[note] finished",
            "timestamp": 1_750_000_000.5,
        },
        {"role": "tool", "content": "{}", "tool_name": {"odd": "name"}, "tool_call_id": "c1"},
        {"role": "assistant", "content": "ok", "reasoning": "because", "message_uid": "uid-1"},
    ]
    direct = hermes_state.SessionDB(db_path=tmp_path / "direct.db")
    direct.create_session("s1", "telegram")
    for message in messages:
        direct.append_message(**transcript_append_kwargs("s1", dict(message), fallback_ts=7.0))
    store._db.create_session("s1", "telegram")
    for message in messages:
        wsf.spool_dropped_transcript_message("s1", message)
    assert wsf.recover_pending_to_db(store._db) == 3

    def rows(db: Any) -> list[dict[str, Any]]:
        skip = {"id", "timestamp", "message_uid", "display_identity", "display_order"}
        return [{k: v for k, v in r.items() if k not in skip} for r in db.get_messages("s1")]

    assert rows(store._db) == rows(direct)
    got = store._db.get_messages("s1")
    assert got[0]["display_kind"] == "internal_notification"
    assert got[0]["timestamp"] == 1_750_000_000.5
    assert got[1]["tool_name"] == json.dumps({"odd": "name"})
    assert got[2]["message_uid"] == "uid-1"
    direct.close()


def test_shutdown_slots_and_queue_overflow_recover_head_first(home, store):
    from gateway.config import Platform
    from gateway.platforms.base import MessageEvent
    from gateway.session import SessionSource

    db = store._db
    db.create_session("s1", "telegram")
    source = SessionSource(platform=Platform.TELEGRAM, chat_id="9")
    head = MessageEvent(text="head", message_id="m1", source=source)
    tail = [MessageEvent(text=f"tail{i}", message_id=f"m{i + 2}", source=source) for i in range(3)]
    assert wsf.flush_pending_to_file({"agent:main:telegram:dm:9": head}, reason="adapter_shutdown")
    assert wsf.flush_overflow_to_file({"agent:main:telegram:dm:9": tail, "empty": []}) == 3
    assert wsf.flush_pending_to_file({"agent:main:telegram:dm:8": "runner slot"}) == 1
    resolved = []

    def resolver(key: str, *, not_after: float | None = None) -> tuple[str, Any] | None:
        resolved.append((key, not_after))
        return ("s1", db) if key.endswith(":9") else None

    recovered, held = wsf.recover_pending_spool(db, session_resolver=resolver)
    assert (recovered, held) == (4, set())
    assert contents(db, "s1") == ["head", "tail0", "tail1", "tail2"]
    assert all(isinstance(ts, float) for _, ts in resolved)
    (left,) = spooled(home)
    assert (left.session_key, left.message) == ("agent:main:telegram:dm:8", {"text": "runner slot"})


def test_agent_histories_are_kept_for_operators(home, store):
    store._db.create_session("s1", "telegram")
    wsf.flush_agent_history_to_file("s1", [{"role": "user", "content": "unsaved"}])
    assert wsf.recover_gateway_pending(runner_for(store)) == 0
    (row,) = spooled(home)
    assert row.reason == wsf.AGENT_HISTORY_REASON
    assert contents(store._db, "s1") == []


def test_files_the_upstream_module_left_are_imported_once_in_order(home, store, caplog):
    theirs = upstream_module()
    db = store._db
    db.create_session("s1", "telegram")
    for i in range(3):
        assert theirs.spool_dropped_transcript_message("s1", {"role": "user", "content": f"j{i}"})
    assert theirs.flush_pending_to_file({"agent:main:telegram:dm:1": "slot"}) == 1
    theirs.flush_agent_history_to_file("s1", [{"role": "user", "content": "h"}])
    flush_dir = home / "pending_messages"
    (flush_dir / "pending-quarantined.json.bad").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="walspool"):
        recovered = wsf.recover_pending_to_db(
            db, session_resolver=lambda key, not_after=None: ("s1", db)
        )
    assert recovered == 4
    assert contents(db, "s1") == ["j0", "j1", "j2", "slot"]
    assert sorted(p.name for p in flush_dir.iterdir()) == ["pending-quarantined.json.bad"]
    assert "1 quarantined file(s) left alone" in caplog.text
    assert [r.reason for r in spooled(home)] == [wsf.AGENT_HISTORY_REASON]
    assert wsf.recover_pending_to_db(db) == 0
    assert len(contents(db, "s1")) == 4


def test_an_interrupted_import_is_not_imported_twice(home, store, monkeypatch):
    from walspool.replay import jsonspool

    theirs = upstream_module()
    db = store._db
    db.create_session("s1", "telegram")
    for i in range(4):
        theirs.spool_dropped_transcript_message("s1", {"role": "user", "content": f"j{i}"})
    # The first import commits its rows, then "dies" before removing any file.
    with monkeypatch.context() as patched:
        patched.setattr(jsonspool._Import, "_remove", lambda self, names: None)
        patched.setattr(jsonspool._Import, "_end_journal", lambda self: None)
        wsf._import_leftover_files(wsf.shared_spool())
    assert len(spooled(home)) == 4
    assert wsf.recover_pending_to_db(db) == 4
    assert contents(db, "s1") == ["j0", "j1", "j2", "j3"]
    assert list((home / "pending_messages").iterdir()) == []


def test_the_ticket_trigger_is_exact_on_the_fork_in_rollback_mode(home, store):
    db = store._db
    with db._lock:
        assert db._conn.execute("PRAGMA journal_mode").fetchone()[0] in {"delete", "wal"}
    db.create_session("s1", "telegram")
    sink = walspool.SessionDBSink(db)
    rec = walspool.Record(1, "s1", 1, walspool.CAP_DROP, None, 5.0, {"role": "user"}, 0, None)
    sink.write("s1", rec, ("u", 1, 1))
    db.append_message("s1", role="user")  # the gateway's own write records nothing
    assert sink.landed([("u", 1, 1), ("u", 2, 2)]) == {("u", 1, 1)}
    db.close()  # 0.22 reopens its connection at the next write
    sink.write("s1", rec, ("u", 3, 3))
    assert sink.landed([("u", 1, 1), ("u", 3, 3)]) == {("u", 1, 1), ("u", 3, 3)}


def test_a_multiplex_gateway_recovers_each_served_profile_in_its_own_home(
    home, store, tmp_path, monkeypatch, caplog
):
    """As upstream: the launch home, then each served profile with a spool or JSON files,
    inside its own home (its spool, its state.db); held-back sessions are marked on the
    store; a profile whose recovery fails is logged and the others go on."""
    import gateway.run
    import hermes_state
    from hermes_constants import get_hermes_home, reset_hermes_home_override
    from hermes_constants import set_hermes_home_override as inside

    db = store._db
    db.create_session("s1", "telegram")
    wsf.spool_dropped_transcript_message("s1", {"role": "user", "content": "launch"})
    names = ("work", "idle", "legacy", "broken")
    served = {name: tmp_path / "profiles" / name for name in names}
    for name, profile in served.items():
        profile.mkdir(parents=True)
        with hermes_state.SessionDB(db_path=profile / "state.db") as profile_db:
            profile_db.create_session(f"{name}-1", "telegram")
    token = inside(str(served["work"]))
    wsf.spool_dropped_transcript_message("work-1", {"role": "user", "content": "w"})
    wsf.spool_dropped_transcript_message("work-gone", {"role": "user", "content": "held"})
    reset_hermes_home_override(token)
    token = inside(str(served["legacy"]))
    assert upstream_module().spool_dropped_transcript_message(
        "legacy-1", {"role": "user", "content": "j"}
    )
    reset_hermes_home_override(token)
    token = inside(str(served["broken"]))
    wsf.spool_dropped_transcript_message("broken-1", {"role": "user", "content": "b"})
    reset_hermes_home_override(token)
    wsf.close_shared_spools()
    runner = types.SimpleNamespace(
        session_store=store, config=types.SimpleNamespace(multiplex_profiles=True)
    )

    def profiles(config: Any) -> list[tuple[str, Path]]:
        assert config is runner.config  # the gateway's own config, as upstream passes it
        # The launch home is served too (skipped: recovered first); "broken" fails
        # before "legacy", which must still be recovered.
        order = ("idle", "work", "broken", "legacy")
        return [("default", home), *((name, served[name]) for name in order)]

    monkeypatch.setattr(gateway.run, "_multiplex_profile_homes", profiles)
    recover = wsf.recover_pending_spool
    homes_recovered: list[Path] = []

    def failing_in_broken(**kw: Any) -> Any:
        homes_recovered.append(Path(get_hermes_home()))
        if Path(get_hermes_home()) == served["broken"]:
            raise RuntimeError("profile recovery failed")
        return recover(**kw)

    monkeypatch.setattr(wsf, "recover_pending_spool", failing_in_broken)
    with caplog.at_level(logging.WARNING, logger="walspool"):
        assert wsf.recover_gateway_pending(runner) == 3  # launch, work-1, legacy-1
    # Each home once: the launch home first, then each served profile with something
    # to recover, in the gateway's order.
    assert homes_recovered == [home, served["work"], served["broken"], served["legacy"]]
    assert Path(get_hermes_home()) == home  # every override undone
    assert contents(db, "s1") == ["launch"]
    for name, expected in (("work", ["w"]), ("legacy", ["j"]), ("broken", [])):
        with hermes_state.SessionDB(db_path=served[name] / "state.db") as profile_db:
            assert contents(profile_db, f"{name}-1") == expected
    assert "work-gone" in store._spooled_drop_sessions
    assert [r.session_id for r in spooled(served["work"])] == ["work-gone"]
    assert [r.session_id for r in spooled(served["broken"])] == ["broken-1"]
    assert not (served["idle"] / "spool.db").exists()  # nothing to recover: never opened
    failed = [r for r in caplog.records if r.name == "walspool.shutdown_flush" and r.exc_info]
    assert [r.getMessage() for r in failed] == [
        "Pending-message recovery failed for profile broken"
    ]


def test_a_gateway_config_without_multiplexing_recovers_the_launch_home_only(
    home, store, monkeypatch
):
    """A config that predates ``multiplex_profiles`` (no such attribute) serves one home."""
    import gateway.run

    def profiles(config: Any) -> list[tuple[str, Path]]:
        raise AssertionError("profiles listed for a gateway that does not multiplex")

    monkeypatch.setattr(gateway.run, "_multiplex_profile_homes", profiles)
    store._db.create_session("s1", "telegram")
    wsf.spool_dropped_transcript_message("s1", {"role": "user", "content": "launch"})
    runner = types.SimpleNamespace(session_store=store, config=types.SimpleNamespace())
    assert wsf.recover_gateway_pending(runner) == 1
    assert contents(store._db, "s1") == ["launch"]


def test_a_restart_routes_slots_spooled_by_key_through_the_stores_own_resolver(home, store, caplog):
    """A shutdown slot is spooled under its routing key; the restart's recovery asks the
    gateway's store (``resolve_session_id_for_key``) which session it belongs to. A key it
    does not know stays, reported at WARNING with the count and what to do."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    entry = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="9"))
    assert wsf.flush_pending_to_file({entry.session_key: "slot text", "agent:gone": "kept"}) == 2
    with caplog.at_level(logging.WARNING, "walspool"):
        assert wsf.recover_gateway_pending(runner_for(store)) == 1
    assert contents(store._db, entry.session_id) == ["slot text"]
    assert [r.session_key for r in spooled(home)] == ["agent:gone"]
    (warning,) = [r.getMessage() for r in caplog.records if "routing table" in r.getMessage()]
    assert warning.startswith("1 spooled message(s) of 1 session key(s) found no session")
    assert "`walspool export --session key:<KEY>`" in warning and warning.endswith("agent:gone")


def test_recovery_registers_the_store_for_the_gateways_own_callbacks(home, store, monkeypatch):
    """A drain callback from the gateway's modules that does not close over its store is
    tied to the one store ``recover_gateway_pending`` registered (the store whose
    state.db its drains record tickets in)."""
    from walspool.replay import upstream

    monkeypatch.setattr(upstream, "_stores", weakref.WeakSet())

    def replay(message: Any) -> None:
        pass

    replay.__module__ = "gateway.session_transcript"
    assert upstream.store_of(replay) is None
    assert wsf.recover_gateway_pending(runner_for(store)) == 0
    assert upstream.store_of(replay) is store
