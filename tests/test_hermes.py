"""The gateway link, on the real hermes-agent 0.19.0 SessionStore and SessionDB."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _gateway import BREAK, HEAL, contents, sql
from _helpers import STEP, naming_threads, run_python

import walspool
import walspool.hermes as hermes
import walspool.link.bounds as bounds
import walspool.link.outage as outage
from walspool.gateways.session_store import StoreTranscripts
from walspool.hermes import Link, install, install_runner
from walspool.link.state import Claim

hermes_state = pytest.importorskip("hermes_state")


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def test_released_gateway_loses_all_but_200(store):
    """The baseline this project exists for: 1,001 messages, 200 kept."""
    store._db.create_session("s", "telegram")
    sql(store, BREAK)
    for i in range(1001):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    sql(store, HEAL)
    store.append_to_transcript("s", {"role": "user", "content": "fin"})
    assert contents(store, "s") == [f"m{i}" for i in range(802, 1001)] + ["fin"]  # 200 rows


def test_outage_of_1001_messages_loses_nothing_and_keeps_order(store, spool, caplog):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING, logger="walspool"):
        for i in range(1001):
            store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    spool.flush()
    (spooling,) = [r for r in caplog.records if "spooling the oldest" in r.getMessage()]
    assert str(spool.path) in spooling.getMessage()
    assert spool.stats().rows == 801
    sql(store, HEAL)
    store.append_to_transcript("s", {"role": "user", "content": "fin"})
    assert contents(store, "s") == [f"m{i}" for i in range(1001)] + ["fin"]
    assert spool.stats().rows == 0
    assert "s" not in store._dirty_transcripts


def test_sixteen_sessions_four_threads(store, spool):
    sessions = [f"s{i}" for i in range(16)]
    for s in sessions:
        store._db.create_session(s, "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    per = 300

    def feed(t: int) -> None:
        for i in range(per):
            for s in sessions[t::4]:
                store.append_to_transcript(s, {"role": "user", "content": f"{s}-{i}"})

    threads = [threading.Thread(target=feed, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    spool.flush()
    assert spool.stats().rows == 16 * (per - 200)
    sql(store, HEAL)
    for s in sessions:
        store.append_to_transcript(s, {"role": "user", "content": "fin"})
    for s in sessions:
        assert contents(store, s) == [f"{s}-{i}" for i in range(per)] + ["fin"], s


def test_spool_failure_falls_back_to_drop_and_warn(store, spool, caplog):
    """Five drops in a burst: the first said in full at once, the other four counted and
    said in one summary (here when the link closes, before its minute is up)."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    spool.close()  # the spool can no longer take anything
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool")
    for i in range(205):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    drops = [r.getMessage() for r in caplog.records if "oldest message" in r.getMessage()]
    assert drops == [
        "Session DB transcript pending queue full for s (cap=200); dropping oldest message to "
        f"make room (on-disk spool unavailable: spool {spool.path} is closed)"
    ]
    assert len(store._dirty_transcripts["s"]) == 200
    link.close()
    drops = [r.getMessage() for r in caplog.records if "oldest message" in r.getMessage()]
    assert len(drops) == 2
    assert re.fullmatch(
        r"Session DB transcript pending queue full for s \(cap=200\); dropped 4 more oldest "
        r"message\(s\) \(5 in \d+ s; on-disk spool unavailable: spool .* is closed\)",
        drops[1],
    )
    sql(store, HEAL)
    store.append_to_transcript("s", {"role": "user", "content": "fin"})
    assert contents(store, "s") == [f"m{i}" for i in range(6, 205)] + ["fin"]  # fin evicted m5


def test_replay_failure_keeps_rows_and_live_rows_never_overtake(store, spool):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(203):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    spool.flush()
    assert spool.stats().rows == 3
    # the database heals for everything but the spooled rows' content
    sql(store, HEAL)
    sql(
        store,
        "CREATE TRIGGER picky BEFORE INSERT ON messages WHEN NEW.content = 'm1' "
        "BEGIN SELECT RAISE(ABORT, 'database is locked'); END",
    )
    store.append_to_transcript("s", {"role": "user", "content": "live"})
    assert contents(store, "s") == ["m0"]  # m1 failed; nothing after it was written
    assert [r.message["content"] for r in spool.records()] == ["m1", "m2", "m3"]  # live evicted m3
    held = next(spool.records())
    assert held.attempts == 1 and "locked" in held.last_error
    sql(store, "DROP TRIGGER picky")
    store.append_to_transcript("s", {"role": "user", "content": "fin"})
    assert contents(store, "s") == [f"m{i}" for i in range(203)] + ["live", "fin"]


def test_sessions_are_isolated(store, spool):
    for s in ("a", "b"):
        store._db.create_session(s, "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(201):
        store.append_to_transcript("a", {"role": "user", "content": f"a{i}"})
        store.append_to_transcript("b", {"role": "user", "content": f"b{i}"})
    sql(store, HEAL)
    store.append_to_transcript("a", {"role": "user", "content": "a-fin"})
    assert contents(store, "a") == [f"a{i}" for i in range(201)] + ["a-fin"]
    assert contents(store, "b") == []
    assert [r.message["content"] for r in spool.records()] == ["b0"]


def test_install_refuses_a_store_it_does_not_know_word_for_word(spool):
    class NotAStore:
        _db = _dirty_transcripts = peek_session_id = append_to_transcript = object()

    with pytest.raises(walspool.UnsupportedGateway) as refused:
        install(NotAStore(), spool)
    assert str(refused.value) == (
        "NotAStore lacks _transcript_retry_lock, _transcript_append_failures, "
        "_append_transcript_message, _clear_dirty_transcript, _MAX_PENDING_PER_SESSION, "
        "_is_fts_corruption_error, _rebuild_fts_once; walspool.hermes supports "
        "hermes-agent 0.19.0's gateway.session.SessionStore"
    )
    assert refused.value.path == str(spool.path)


def test_install_twice_is_refused_word_for_word(store, spool):
    install(store, spool, retry_interval=0)
    with pytest.raises(walspool.UnsupportedGateway) as refused:
        install(store, spool, retry_interval=0)
    assert str(refused.value) == "this SessionStore is linked to a spool already"
    assert refused.value.path == str(spool.path)


@pytest.mark.parametrize("interval", [float("nan"), float("inf"), "1", True, None])
def test_install_refuses_a_retry_interval_that_is_no_finite_number(store, spool, interval):
    """A NaN interval would make every retry time NaN (never due, never later); it is
    refused, and the store stays as released."""
    before = store.append_to_transcript
    with pytest.raises(walspool.InvalidArgument) as refused:
        install(store, spool, retry_interval=interval)
    assert str(refused.value) == (
        f"retry_interval must be a finite number of seconds, not {interval!r}"
    )
    assert store.append_to_transcript == before


def test_install_refuses_a_store_without_state_db_word_for_word(store, spool):
    """The released store runs on when state.db cannot be opened (``_db`` None): there is
    nothing to replay into, so the link refuses rather than spooling forever."""
    db, store._db = store._db, None
    before = store.append_to_transcript
    try:
        with pytest.raises(walspool.UnsupportedGateway) as refused:
            install(store, spool, retry_interval=0)
    finally:
        store._db = db
    assert str(refused.value) == "the SessionStore has no state.db (store._db is None)"
    assert refused.value.path == str(spool.path)
    assert store.append_to_transcript == before  # not linked


class _Adapter:
    """Stands in for a platform adapter: the two calls shutdown teardown makes."""

    def __init__(self) -> None:
        self._pending_messages: dict = {}

    async def cancel_background_tasks(self) -> None:
        self._pending_messages.clear()

    async def disconnect(self) -> None:
        pass


class _Agent:
    def __init__(self, session_id: str, messages: list) -> None:
        self.session_id = session_id
        self._session_messages = messages


def test_shutdown_flush_then_restart_recovery(hermes_home):
    import asyncio

    from gateway.config import GatewayConfig, Platform
    from gateway.platforms.base import MessageEvent
    from gateway.run import GatewayRunner
    from gateway.session import SessionSource

    from walspool.hermes import install_runner

    config = GatewayConfig(sessions_dir=hermes_home / "sessions")
    runner = GatewayRunner(config)
    store = runner.session_store
    source = SessionSource(platform=Platform.TELEGRAM, chat_id="42", user_id="u1")
    entry = store.get_or_create_session(source)
    key, sid = entry.session_key, entry.session_id
    spool = walspool.Spool(hermes_home / "spool.db")
    link = install(store, spool, retry_interval=0)
    install_runner(runner, link)

    adapter = _Adapter()
    adapter._pending_messages[key] = MessageEvent(
        text="pending in adapter", source=source, message_id="m-9"
    )
    runner._pending_messages[key] = "pending in runner"
    agent = _Agent(
        sid,
        [
            {"role": "user", "content": "saved", "_db_persisted": True},
            {"role": "assistant", "content": "never saved"},
        ],
    )

    async def shutdown() -> None:  # the calls GatewayRunner.stop() makes, in its order
        await runner._finalize_shutdown_agents({key: agent})
        await runner._bounded_adapter_teardown(adapter, Platform.TELEGRAM)
        runner._pending_messages.clear()

    asyncio.run(shutdown())
    assert adapter._pending_messages == {} and runner._pending_messages == {}
    rows = list(spool.records())
    assert [(r.reason, r.session_id, r.session_key) for r in rows] == [
        (walspool.AGENT_HISTORY, sid, None),
        ("adapter_shutdown", sid, key),
        ("shutdown", sid, key),
    ]
    assert rows[0].message["messages"] == [{"role": "assistant", "content": "never saved"}]
    spool.close()
    store._db.close()

    # the next start: a new store on the same home recovers the slots
    from gateway.session import SessionStore

    store2 = SessionStore(hermes_home / "sessions", config)
    with walspool.Spool(hermes_home / "spool.db") as spool2:
        link2 = install(store2, spool2)  # recovers in the background
        assert link2.wait_idle(STEP)
        assert contents(store2, sid) == ["pending in adapter", "pending in runner"]
        assert [r.reason for r in spool2.records()] == [walspool.AGENT_HISTORY]
    store2._db.close()


GATEWAY_CHILD = r"""
import os, sys
home = sys.argv[1]
os.environ["HERMES_HOME"] = home
import hermes_state, pathlib
hermes_state.DEFAULT_DB_PATH = pathlib.Path(home) / "state.db"
from gateway.config import GatewayConfig
from gateway.session import SessionStore
import walspool
from walspool.hermes import install
store = SessionStore(pathlib.Path(home) / "sessions",
                     GatewayConfig(sessions_dir=pathlib.Path(home) / "sessions"))
store._db.create_session("s", "telegram")
def say(line):  # one write per line: the writer thread prints too
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
spool = walspool.Spool(pathlib.Path(home) / "spool.db")
import logging
class Committed(logging.Handler):  # the link's WARNING for each committed eviction
    def emit(self, record):
        if "spooled oldest message" in record.msg:
            say(f"spooled {record.args[-1]}")
logging.getLogger("walspool.hermes").addHandler(Committed())
logging.getLogger("walspool.hermes").setLevel(logging.DEBUG)  # that line is DEBUG
install(store, spool)
with store._db._lock:
    store._db._conn.execute(sys.argv[2])
say("ready")
i = 0
while True:
    store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    say(str(i))
    i += 1
"""


def test_gateway_killed_during_outage_loses_nothing_it_spooled(hermes_home):
    import os
    import signal
    import subprocess
    import sys

    from _helpers import ROOT, child_deadline

    proc = subprocess.Popen(
        [sys.executable, "-c", GATEWAY_CHILD, str(hermes_home), BREAK],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    committed = 0
    try:
        # A hung child fails the test, not the run; and it cannot pass for the kill below.
        with child_deadline(proc, what="the gateway"):
            assert proc.stdout.readline() == "ready\n"
            for line in proc.stdout:  # kill once 300 evictions are committed
                if line.startswith("spooled"):
                    committed = int(line.split()[1])
                    if committed >= 300:
                        break
            proc.send_signal(signal.SIGKILL)
            for line in proc.stdout:
                if line.startswith("spooled"):
                    committed = int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    # every message whose eviction the spool committed must reach state.db; the ones
    # still queued in memory are lost to a SIGKILL, as in the released gateway
    must_have = committed
    db = hermes_state.SessionDB(db_path=hermes_home / "state.db")
    with db._lock:
        db._conn.execute(HEAL)
    db.close()
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    store = SessionStore(
        hermes_home / "sessions", GatewayConfig(sessions_dir=hermes_home / "sessions")
    )
    with walspool.Spool(hermes_home / "spool.db") as spool:
        report = install(store, spool, recover=False).recover()
        assert report.held == 0
        got = contents(store, "s")
        assert got == [f"m{i}" for i in range(len(got))]
        assert len(got) >= must_have
        assert spool.stats().rows == 0
    store._db.close()


def test_retry_interval_spares_failing_writes_during_an_outage(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    attempts = []
    write = store._append_transcript_message
    store._append_transcript_message = lambda sid, m: attempts.append(m) or write(sid, m)
    real_write = link.replayer.sink.write
    replays = []
    link.replayer.sink.write = lambda sid, rec, *a: (
        replays.append(rec.seq) or real_write(sid, rec, *a)
    )
    sql(store, BREAK)
    for i in range(500):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    # One live attempt (and the store's one retry after its FTS rebuild) fails; from
    # then on, inside the retry delay, the gateway threads only queue and spool: no
    # failing write, no replay per message
    assert len(attempts) == 2 and replays == []
    spool.flush()
    assert spool.stats().rows == 300
    sql(store, HEAL)
    store.append_to_transcript("s", {"role": "user", "content": "early"})
    assert contents(store, "s") == []  # still inside the retry interval
    report = link.recover()
    assert report.moved == 301 and report.held == 0
    assert contents(store, "s") == [f"m{i}" for i in range(500)] + ["early"]
    assert "s" not in store._dirty_transcripts


def test_a_spool_that_fails_during_a_drain_holds_the_session_and_the_gateway_goes_on(
    store, spool, caplog
):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(201):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    sql(store, HEAL)

    def broken(**kw):
        raise walspool.SpoolIOError("disk gone", path=spool.path)

    link.replayer.replay = broken
    with caplog.at_level(logging.WARNING, logger="walspool"):
        store.append_to_transcript("s", {"role": "user", "content": "live"})  # no raise
    assert "holding back its queued messages: disk gone" in caplog.text
    assert contents(store, "s") == []  # live rows never overtake the spooled m0
    del link.replayer.replay
    store.append_to_transcript("s", {"role": "user", "content": "fin"})
    assert contents(store, "s") == [f"m{i}" for i in range(201)] + ["live", "fin"]


def test_shutdown_during_an_outage_spools_the_in_memory_queue(hermes_home):
    from gateway.config import GatewayConfig
    from gateway.run import GatewayRunner
    from gateway.session import SessionStore

    from walspool.hermes import install_runner

    config = GatewayConfig(sessions_dir=hermes_home / "sessions")
    runner = GatewayRunner(config)
    store = runner.session_store
    store._db.create_session("s", "telegram")
    spool = walspool.Spool(hermes_home / "spool.db")
    install_runner(runner, install(store, spool, retry_interval=0))
    sql(store, BREAK)
    for i in range(250):
        store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
    runner._pending_messages.clear()  # what GatewayRunner.stop() does after the adapters
    assert store._dirty_transcripts.get("s", []) == []
    assert [r.message["content"] for r in spool.records()] == [f"m{i}" for i in range(250)]
    spool.close()
    sql(store, HEAL)
    store._db.close()

    store2 = SessionStore(hermes_home / "sessions", config)
    with walspool.Spool(hermes_home / "spool.db") as spool2:
        assert install(store2, spool2).wait_idle(STEP)  # recovers in the background
        assert contents(store2, "s") == [f"m{i}" for i in range(250)]
    store2._db.close()


def test_queue_overflow_is_spooled_after_its_head_and_replayed(hermes_home):
    from gateway.config import GatewayConfig, Platform
    from gateway.platforms.base import MessageEvent
    from gateway.run import GatewayRunner
    from gateway.session import SessionSource, SessionStore

    config = GatewayConfig(sessions_dir=hermes_home / "sessions")
    runner = GatewayRunner(config)
    store = runner.session_store
    source = SessionSource(platform=Platform.TELEGRAM, chat_id="42", user_id="u1")
    entry = store.get_or_create_session(source)
    key, sid = entry.session_key, entry.session_id
    spool = walspool.Spool(hermes_home / "spool.db")
    install_runner(runner, install(store, spool, retry_interval=0))
    runner._pending_messages[key] = "queued head"
    runner._queued_events[key] = [
        MessageEvent(text=f"queued {i}", source=source, message_id=f"q{i}") for i in (1, 2)
    ]

    async def shutdown() -> None:
        runner._pending_messages.clear()

    asyncio.run(shutdown())
    rows = list(spool.records())
    assert [(r.reason, r.session_key) for r in rows] == [
        ("shutdown", key),
        ("overflow_shutdown", key),
        ("overflow_shutdown", key),
    ]
    spool.close()
    store._db.close()

    store2 = SessionStore(hermes_home / "sessions", config)
    with walspool.Spool(hermes_home / "spool.db") as spool2:
        assert install(store2, spool2).wait_idle(STEP)
        got = [m["content"] for m in store2._db.get_messages(sid)]
        assert got == ["queued head", "queued 1", "queued 2"]
        assert list(spool2.records()) == []
    store2._db.close()


# -- mutation testing (issue 16): each test below kills mutants that survived the others ----


def _lines(caplog, level: int) -> list[str]:
    """The link's own log lines at ``level``, formatted (a mutated format raises here)."""
    return [
        r.getMessage() for r in caplog.records if r.name == "walspool.hermes" and r.levelno == level
    ]


def _m(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def test_an_agent_history_is_one_row_with_its_session_and_count(store, spool, caplog):
    link = install(store, spool, retry_interval=0)
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    assert link.flush_agent_history("s", [_m("a"), _m("b")]) is True
    assert link.flush_agent_history(None, [_m("c")]) is True
    assert link.flush_agent_history("s", []) is False
    rows = list(spool.records(reasons=[walspool.AGENT_HISTORY]))
    assert [(r.session_id, r.message) for r in rows] == [
        ("s", {"session_id": "s", "count": 2, "messages": [_m("a"), _m("b")]}),
        ("unknown", {"session_id": None, "count": 1, "messages": [_m("c")]}),
    ]
    said = "in {} (state.db did not take them); recover by hand after repairing state.db"
    assert _lines(caplog, logging.WARNING) == [
        f"Preserved 2 in-memory message(s) for session s {said.format(spool.path)}",
        f"Preserved 1 in-memory message(s) for session None {said.format(spool.path)}",
    ]


def test_an_agent_history_the_spool_cannot_take_is_said_lost_as_on_every_gateway(
    store, tmp_path, caplog
):
    """The words the drop-in says too (``link.shutdown.preserve_agent_history``): at
    ERROR, with the session and the count, and the stop goes on."""
    spool = walspool.Spool(tmp_path / "closed.db")
    link = install(store, spool, retry_interval=0)
    spool.close()
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    assert link.flush_agent_history("s", [_m("a"), _m("b")]) is False
    (line,) = _lines(caplog, logging.ERROR)
    assert line.startswith(
        "walspool could not keep the 2 in-memory message(s) of session s at shutdown; they "
        "are lost: "
    )
    link.close()


def test_a_rewrite_of_a_session_with_nothing_queued_is_quiet_and_keeps_no_state(
    store, spool, caplog
):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    caplog.set_level(logging.DEBUG, logger="walspool")
    assert store.rewrite_transcript("s", [_m("r")])
    store.append_to_transcript("s", _m("next"))
    assert store.rewrite_transcript("s", [_m("r2")])
    assert contents(store, "s") == ["r2"]
    assert "s" not in link.core.sessions  # an idle session's state is dropped
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_rewrite_resets_a_failing_session_so_the_next_message_is_written_at_once(
    store, spool, caplog
):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)  # no background retry meanwhile
    sql(store, BREAK)
    for i in range(205):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.flush()
    assert store._transcript_append_failures["s"] == 1
    sql(store, HEAL)
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    caplog.clear()
    assert store.rewrite_transcript("s", [_m("rewritten")])
    over, rewritten = _lines(caplog, logging.WARNING)
    assert rewritten == (
        f"Transcript of s rewritten: 5 spooled message(s) in {spool.path} superseded (kept for "
        "operators, not replayed)"
    )
    assert re.fullmatch(
        r"walspool: outage over: 5 spooled, 0 replayed, 5 superseded by rewrites in \d+\.\d s",
        over,
    )
    assert "s" not in store._transcript_append_failures
    store.append_to_transcript("s", _m("next"))  # not held back by the failures before
    assert contents(store, "s") == ["rewritten", "next"]
    # The session's counts start again from 0: later evictions are spooled as before.
    sql(store, BREAK)
    for i in range(205):
        store.append_to_transcript("s", _m(f"n{i}"))
    spool.flush()
    assert [r.message["content"] for r in spool.records() if r.status is None] == [
        f"n{i}" for i in range(5)
    ]
    assert link.core.sessions["s"].spooled == 5


def test_a_rewrite_whose_supersede_fails_says_so_word_for_word(store, spool, caplog):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    spool.close()
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    assert store.rewrite_transcript("s", [_m("r")])  # the rewrite goes on
    assert _lines(caplog, logging.ERROR) == [
        f"walspool could not supersede the spooled rows of session s in {spool.path} after "
        "its transcript was rewritten; a replay would put them after it"
    ]


def test_a_rewrite_never_waits_for_a_replay_elsewhere_and_supersedes_all_it_can(
    store, spool, monkeypatch
):
    from walspool.store import replay_lock as lock_module

    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=3600)  # no drain, no row in flight
    sql(store, BREAK)
    for i in range(203):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.flush()
    sql(store, HEAL)
    budgets: list[float] = []
    real = lock_module._lock_within

    def no_wait(fd, seconds, spool_path):
        budgets.append(seconds)
        return real(fd, 0, spool_path)

    with lock_module.replay_lock(spool, wait=False):
        monkeypatch.setattr(lock_module, "_lock_within", no_wait)
        assert store.rewrite_transcript("s", [_m("r")])
    assert budgets == [0]
    assert [(r.message["content"], r.status) for r in spool.records()] == [
        (f"m{i}", "superseded") for i in range(3)
    ]


def _runner(hermes_home: Path):
    from gateway.config import GatewayConfig
    from gateway.run import GatewayRunner

    return GatewayRunner(GatewayConfig(sessions_dir=hermes_home / "sessions"))


def test_a_runner_the_link_does_not_know_is_refused_word_for_word(store, spool):
    class NotARunner:
        session_store = adapters = _pending_messages = None

    link = install(store, spool, retry_interval=0)
    with pytest.raises(walspool.UnsupportedGateway) as refused:
        install_runner(NotARunner(), link)
    assert str(refused.value) == (
        "NotARunner lacks _queued_events, _bounded_adapter_teardown, _finalize_shutdown_agents; "
        "walspool.hermes supports hermes-agent 0.19.0's gateway.run.GatewayRunner"
    )
    assert refused.value.path == str(spool.path)


def test_slots_are_spooled_as_text_messages_and_logged_word_for_word(store, spool, caplog):
    link = install(store, spool, retry_interval=0)
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    assert link.flush_slots([("k1", "hello"), ("k2", None), ("k3", {"text": "event"})]) == 2
    assert link.flush_slots([("k4", None)]) == 0
    assert [(r.session_key, r.reason, r.message) for r in spool.records()] == [
        ("k1", "shutdown", {"text": "hello"}),
        ("k3", "shutdown", {"text": "event"}),
    ]
    assert _lines(caplog, logging.INFO) == [
        f"Spooled 2 pending message(s) to {spool.path} (reason=shutdown)"
    ]


def test_shutdown_with_a_closed_spool_says_what_is_lost_and_goes_on(hermes_home, caplog):
    runner = _runner(hermes_home)
    spool = walspool.Spool(hermes_home / "spool.db")
    install_runner(runner, install(runner.session_store, spool, retry_interval=0))
    spool.close()
    runner._pending_messages["k"] = "lost"
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    runner._pending_messages.clear()  # never raises
    assert runner._pending_messages == {}
    assert _lines(caplog, logging.ERROR)[0] == (
        "walspool could not spool a pending message for 'k' at shutdown; it is lost: "
        f"spool {spool.path} is closed"
    )
    runner.session_store._db.close()


def test_a_slot_the_spool_refuses_at_shutdown_loses_only_itself(hermes_home, caplog):
    """The stop spools the runner's slots in one transaction; a slot the spool refuses
    (a message past its size limit) made that transaction fail and lost every slot. Now
    the slots go one by one then: only the refused one is lost, with an ERROR naming it,
    and the others keep their order (the drop-in's stop does the same:
    ``link.shutdown.spool_in_order``)."""
    runner = _runner(hermes_home)
    spool = walspool.Spool(hermes_home / "spool.db", max_payload_bytes=1024)
    install_runner(runner, install(runner.session_store, spool, retry_interval=0))
    runner._pending_messages.update({"a": "first", "big": "x" * 4096, "c": "last"})
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    runner._pending_messages.clear()
    rows = list(spool.records(reasons=[walspool.SHUTDOWN]))
    assert [(r.session_key, r.message) for r in rows] == [
        ("a", {"text": "first"}),
        ("c", {"text": "last"}),
    ]
    (lost,) = _lines(caplog, logging.ERROR)
    assert lost.startswith("walspool could not spool a pending message for 'big' at shutdown")
    spool.close()
    runner.session_store._db.close()


def test_shutdown_takes_adapters_and_agents_without_slots_or_ids(hermes_home):
    from gateway.config import Platform

    runner = _runner(hermes_home)
    spool = walspool.Spool(hermes_home / "spool.db")
    install_runner(runner, install(runner.session_store, spool, retry_interval=0))
    torn: list[str] = []

    class Bare:  # no pending slots at all, or None for them
        def __init__(self, name: str, slots: Any = ...) -> None:
            self.name = name
            if slots is not ...:
                self._pending_messages = slots

        async def cancel_background_tasks(self) -> None:
            pass

        async def disconnect(self) -> None:
            torn.append(self.name)

    class Agent:  # one without a session id, one without a history
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    bare, none = Bare("bare"), Bare("none", None)
    agents = {"a": Agent(_session_messages=[_m("unsaved")]), "b": Agent(session_id="s")}

    async def shutdown() -> None:
        await runner._finalize_shutdown_agents(agents)
        await runner._bounded_adapter_teardown(bare, Platform.TELEGRAM)
        await runner._bounded_adapter_teardown(none, Platform.TELEGRAM, profile="work")

    asyncio.run(shutdown())
    assert torn == ["bare", "none"]
    assert none._pending_messages is None and not hasattr(bare, "_pending_messages")
    assert [(r.session_id, r.message["messages"]) for r in spool.records()] == [
        ("unknown", [_m("unsaved")])
    ]
    spool.close()
    runner.session_store._db.close()


def test_the_teardown_passes_its_keywords_on(hermes_home, monkeypatch):
    from gateway.config import Platform
    from gateway.run import GatewayRunner

    seen: list[dict] = []

    async def teardown(self, adapter, platform, **kw):
        seen.append(kw)

    monkeypatch.setattr(GatewayRunner, "_bounded_adapter_teardown", teardown)
    runner = _runner(hermes_home)
    spool = walspool.Spool(hermes_home / "spool.db")
    install_runner(runner, install(runner.session_store, spool, retry_interval=0))
    asyncio.run(runner._bounded_adapter_teardown(object(), Platform.TELEGRAM, profile="work"))
    assert seen == [{"profile": "work"}]
    spool.close()
    runner.session_store._db.close()


def test_close_stops_the_background_thread_and_is_safe_without_one(store, spool, monkeypatch):
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 30.0)
    link = install(store, spool, retry_interval=0.05)
    thread = link.background.thread
    assert thread.is_alive()
    link.close()
    assert not thread.is_alive()  # joined before close returned
    link.close()  # idempotent
    unthreaded = Link(StoreTranscripts(store), spool, retry_interval=0)  # never started a thread
    unthreaded.close()
    assert unthreaded.core.closed


def _recovery_done(link: Link) -> bool:
    """With ``retry_interval=0`` the background thread ends after the start's recovery."""
    link.background.thread.join(STEP)
    return not link.background.thread.is_alive()


def test_a_start_whose_recovery_fails_for_a_session_holds_its_live_rows_behind(
    hermes_home, store, caplog
):
    with walspool.Spool(hermes_home / "spool.db") as first_run:
        for i in range(3):
            first_run.append("s", _m(f"r{i}"))
    store._db.create_session("s", "telegram")
    store._db.create_session("t", "telegram")
    sql(store, BREAK)
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    with walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=0)
        assert _recovery_done(link)
        held = "Held back 3 spooled message(s) for the next start after a failed replay: s ("
        assert [line for line in _lines(caplog, logging.INFO) if line.startswith(held)], _lines(
            caplog, logging.INFO
        )
        sql(store, HEAL)
        replays: list[str | None] = []
        replay = link.replayer.replay

        def counted(*args: Any, **kw: Any) -> Any:
            replays.append(kw.get("session_id"))
            return replay(*args, **kw)

        link.replayer.replay = counted
        store.append_to_transcript("t", _m("t0"))  # a session with nothing spooled
        assert replays == []  # recovered: no drain before its first write
        store.append_to_transcript("s", _m("live"))
        assert contents(store, "s") == ["r0", "r1", "r2", "live"]
        assert contents(store, "t") == ["t0"]


def test_a_recovery_during_an_outage_keeps_this_runs_evictions_ahead(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(203):
        store.append_to_transcript("s", _m(f"m{i}"))
    report = link.recover()  # still broken: the session is held
    assert (report.moved, report.held) == (0, 3)
    sql(store, HEAL)
    store.append_to_transcript("s", _m("live"))
    assert contents(store, "s") == [f"m{i}" for i in range(203)] + ["live"]


def test_a_starts_recovery_warns_of_the_rows_state_db_refused(hermes_home, store, caplog):
    """A start's recovery on 0.19.0 said only how many rows moved and were held; the
    drop-in's said what it quarantined too. Both say it now (``outage.say_recovered``):
    a row state.db refuses for its content is quarantined, with a WARNING."""
    store._db.create_session("s", "telegram")
    with walspool.Spool(hermes_home / "spool.db") as first_run:
        first_run.append("s", _m("fine"))
        first_run.append("s", {"role": None, "content": "role missing"})  # refused
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    with walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=0)
        assert _recovery_done(link)
        assert _lines(caplog, logging.WARNING) == [
            f"Quarantined 1 spooled message(s) in {spool.path} that state.db refused; "
            "see `walspool ls`"
        ]
    assert contents(store, "s") == ["fine"]


def test_a_recovery_that_moves_a_sessions_rows_forgets_its_state(store, spool, caplog):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(203):
        store.append_to_transcript("s", _m(f"m{i}"))
    assert link.flush_queues() == 200  # nothing left in memory: all 203 spooled
    sql(store, HEAL)
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    caplog.clear()
    assert link.recover().moved == 203
    assert contents(store, "s") == [f"m{i}" for i in range(203)]
    assert "s" not in link.core.sessions
    assert _lines(caplog, logging.INFO) == [f"Recovered 203 spooled message(s) from {spool.path}"]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.fixture
def replay_lock(spool):
    """Take and release the spool's replay lock, as a replay elsewhere holds it."""
    import contextlib

    from walspool.store import replay_lock as lock_module

    stack = contextlib.ExitStack()
    yield lambda: stack.enter_context(lock_module.replay_lock(spool, wait=False)), stack.close
    stack.close()


def test_a_drain_that_finds_a_replay_elsewhere_gives_up_and_the_next_message_goes_on(
    hermes_home, store, spool, replay_lock, caplog
):
    take, release = replay_lock
    for i in range(3):
        spool.append("s", _m(f"r{i}"))  # an earlier run's rows
    store._db.create_session("s", "telegram")
    link = install(store, spool, recover=False, retry_interval=3600)
    take()
    store.append_to_transcript("s", _m("a"))  # its drain finds the lock held: queued
    assert contents(store, "s") == []
    release()
    store.append_to_transcript("s", _m("b"))  # not held back: a busy lock is no failure
    assert contents(store, "s") == ["r0", "r1", "r2", "a", "b"]
    assert "s" not in store._transcript_append_failures
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    link.close()


def test_messages_that_waited_for_the_starts_recovery_are_written_when_it_ends(
    hermes_home, store, spool, replay_lock
):
    take, release = replay_lock
    for i in range(3):
        spool.append("s", _m(f"r{i}"))
    store._db.create_session("s", "telegram")
    take()  # the start's recovery waits for it
    link = install(store, spool, retry_interval=0.05)
    store.append_to_transcript("s", _m("live"))  # queued until the recovery ends
    assert contents(store, "s") == []
    release()
    assert link.wait_idle(STEP)  # no new message needed
    assert contents(store, "s") == ["r0", "r1", "r2", "live"]
    link.close()


def test_messages_evicted_while_the_start_recovers_are_written_in_order_when_it_ends(
    hermes_home, store, spool, replay_lock, monkeypatch, caplog
):
    """At the cap while the start's recovery waits for the replay lock: the evictions
    commit (and ask the background thread to look) before the recovery ends; then the
    recovery ends cleanly and everything lands in order, no new message needed."""
    take, release = replay_lock
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    for i in range(3):
        spool.append("s", _m(f"r{i}"))
    store._db.create_session("s", "telegram")
    take()  # the start's recovery waits for it
    link = install(store, spool, retry_interval=0.05)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for i in range(5):
            store.append_to_transcript("s", _m(f"live{i}"))  # 2 evicted at the cap
        spool.flush()
        assert contents(store, "s") == []
        release()
        assert link.wait_idle(STEP)
    assert contents(store, "s") == ["r0", "r1", "r2"] + [f"live{i}" for i in range(5)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    link.close()


def test_a_recovery_that_holds_one_session_still_settles_and_writes_the_next(store, spool):
    """``recover`` goes through every session that waited for it: one whose rows fail
    (held, first in line) does not stop the next one's rows and queue being written
    before it returns."""
    for session_id in "ab":
        spool.append(session_id, _m(f"r{session_id}"))  # an earlier run's rows
        store._db.create_session(session_id, "telegram")
    link = install(store, spool, recover=False, retry_interval=3600)
    sql(store, BREAK)
    for session_id in "ab":
        store.append_to_transcript(session_id, _m(f"live {session_id}"))  # fail: queued
    sql(store, HEAL)
    write = link.replayer.sink.write

    def refuse_a(session_id: str, *args: Any, **kw: Any) -> Any:
        if session_id == "a":
            raise RuntimeError("refused for the test")
        return write(session_id, *args, **kw)

    link.replayer.sink.write = refuse_a
    with link.core.lock:
        assert list(link.core.sessions) == ["a", "b"]
    report = link.recover()
    assert (report.moved, report.held) == (1, 1)
    assert contents(store, "b") == ["rb", "live b"]  # written before recover returned
    assert contents(store, "a") == []
    with link.core.lock:
        assert "b" not in link.core.sessions and link.core.sessions["a"].spooled
    link.close()


def test_wait_idle_is_false_at_its_bound_while_a_session_has_a_queue(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    store.append_to_transcript("s", _m("queued"))  # fails: retried in 450 s
    assert link.wait_idle(0.01) is False
    sql(store, HEAL)
    link.close()  # closed: the next message retries at once
    store.append_to_transcript("s", _m("next"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["queued", "next"]


def test_the_background_thread_claims_only_the_session_longest_due_with_nothing_in_the_way(
    store, spool
):
    """The background thread's choice, one look (``_due_sessions``) with the lock held:
    of the sessions with work, it skips one with a writer, one a gateway thread waits
    on, one with evictions not yet committed (their commit wakes it) and one not due
    yet, and claims the one whose retry time passed first; with none due, it looks
    again at the earliest retry time."""
    link = install(store, spool, recover=False, retry_interval=0)  # no thread of its own
    now = link.clock()
    with link.core.lock:
        states = {}
        names = ("writing", "waited", "unconfirmed", "idle", "sooner", "later", "due", "first")
        for session_id in names:
            state = states[session_id] = link.core.session(session_id)
            state.spooled = 0
            if session_id != "idle":
                store._dirty_transcripts[session_id] = [{"role": "user", "content": "q"}]
        states["writing"].writer = Claim(background=False)
        states["waited"].waiters = 1
        link.core.handoffs.handed("unconfirmed")
        for session_id, at in (("later", 100), ("sooner", 50), ("due", -1), ("first", -2)):
            claim = states[session_id].claim(background=True)
            states[session_id].due_at(claim, now + at)
            states[session_id].release(claim)
        claimed, _ = link.background.due_sessions()
        assert [(sid, state) for sid, state, _ in claimed] == [("first", states["first"])]
        assert states["first"].writer is claimed[0][2] and claimed[0][2].background
        claimed, _ = link.background.due_sessions()
        assert [sid for sid, _, _ in claimed] == ["due"]
        assert link.background.due_sessions() == ([], now + 50)
        for state in states.values():  # leave nothing for the store's own shutdown
            state.writer, state.waiters = None, 0
        link.core.handoffs.settled("unconfirmed")
        store._dirty_transcripts.clear()


def test_a_flush_on_top_of_a_held_eviction_is_drained_once_state_db_heals(
    store, spool, monkeypatch
):
    """A shutdown flush counts as spooled work on top of what the session had spooled
    already (here one eviction its drain could not write): with the link still running
    and state.db healed, the background thread writes both, in order, with no new
    message."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 3, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.05)
    sql(store, BREAK)
    for i in range(4):
        store.append_to_transcript("s", _m(f"m{i}"))  # m0 evicted at the cap
    spool.flush()
    assert [r.message["content"] for r in spool.records()] == ["m0"]
    assert link.flush_queues() == 3
    sql(store, HEAL)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", "m1", "m2", "m3"]
    assert spool.stats().rows == 0


def test_the_background_thread_ends_once_its_store_and_link_are_gone(
    hermes_home, spool, monkeypatch
):
    """The thread holds the link only while it works, and wakes at least every
    ``IDLE_WAKE_SECONDS`` when idle: once nothing refers to the store and its link
    any more, it ends by itself."""
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    monkeypatch.setattr(bounds, "IDLE_WAKE_SECONDS", 0.05)
    sessions = hermes_home / "sessions"
    store = SessionStore(sessions, GatewayConfig(sessions_dir=sessions))
    link = install(store, spool, retry_interval=3600)
    assert link.wait_idle(STEP)
    thread = link.background.thread
    assert thread.is_alive()
    store._db.close()
    del store, link
    gc.collect()
    thread.join(STEP)
    assert not thread.is_alive()


def test_a_start_recovery_that_fails_says_so_and_each_session_drains_its_own(
    store, spool, monkeypatch, caplog
):
    store._db.create_session("s", "telegram")
    spool.append("s", _m("old"))  # spooled by an earlier run

    def broken(self: Any, *args: Any, **kw: Any) -> Any:
        raise RuntimeError("replay broke")

    monkeypatch.setattr(walspool.replay.replayer.Replayer, "replay", broken)
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        link = install(store, spool, retry_interval=0)
        link.background.thread.join(STEP)  # with no retries, the thread ends after the recovery
    assert not link.background.thread.is_alive()
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        f"could not replay {spool.path} at start; each session replays its own spooled "
        "rows before its next write"
    )
    assert record.exc_info and record.exc_info[0] is RuntimeError
    monkeypatch.undo()  # the replayer works again
    store.append_to_transcript("s", _m("new"))
    assert contents(store, "s") == ["old", "new"]
    assert spool.stats().rows == 0


def test_a_start_whose_quick_look_at_the_spool_fails_still_recovers(store, spool, monkeypatch):
    """``install`` first looks whether the spool holds anything to replay (one index
    probe); when that look fails, it cannot know, so the background recovery runs."""
    store._db.create_session("s", "telegram")
    spool.append("s", _m("old"))  # spooled by an earlier run
    read = spool.query
    looks = []

    def failing_once(*args: Any, **kw: Any) -> Any:
        looks.append(args)
        if len(looks) == 1:
            raise walspool.SpoolIOError("disk I/O error", path=spool.path)
        return read(*args, **kw)

    monkeypatch.setattr(spool, "query", failing_once)
    link = install(store, spool, retry_interval=0.05)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["old"]
    assert spool.stats().rows == 0


def test_the_background_thread_waits_no_longer_than_until_the_next_retry(store, spool):
    """A failing session's retry is due in well under a second (``retry_interval``
    0.05 s caps the delay): the background thread's wait for it lasts until then,
    not longer."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.05)
    waits: list[float] = []
    waited = threading.Semaphore(0)
    wait = link.core.due.wait

    def recorded(timeout: float | None = None) -> bool:
        if timeout != bounds.IDLE_WAKE_SECONDS:  # not the wait with nothing scheduled
            waits.append(timeout)
            waited.release()
        return wait(timeout)

    link.core.due.wait = recorded
    sql(store, BREAK)
    store.append_to_transcript("s", _m("m0"))  # fails: retried within 0.05 s
    assert waited.acquire(timeout=STEP)
    sql(store, HEAL)
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0"]
    assert waits and all(w is not None and w <= 0.05 for w in waits), waits


@pytest.mark.parametrize("interval", [3600, 0.05])
def test_a_gateway_thread_drains_a_backlog_in_chunks_up_to_its_budget(
    store, spool, monkeypatch, interval
):
    """A message whose session has a backlog in the spool drains it in chunks of
    ``DRAIN_CHUNK_ROWS``, at most ``GATEWAY_DRAIN_ROWS`` rows on the gateway's thread
    (whatever the retry interval, short ones too); the background thread moves the
    rest."""
    monkeypatch.setattr(bounds, "DRAIN_CHUNK_ROWS", 10)
    monkeypatch.setattr(bounds, "GATEWAY_DRAIN_ROWS", 20)
    store._db.create_session("s", "telegram")
    spool.append_many([("s", _m(f"old{i}")) for i in range(50)])  # an earlier run's
    link = install(store, spool, recover=False, retry_interval=interval)
    replay = link.replayer.replay
    moved: list[tuple[str, int]] = []

    def counted(*args: Any, **kw: Any) -> Any:
        report = replay(*args, **kw)
        moved.append((threading.current_thread().name, report.moved))
        return report

    link.replayer.replay = counted
    store.append_to_transcript("s", _m("new"))
    gateway = threading.current_thread().name
    assert [n for name, n in moved if name == gateway] == [10, 10]
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"old{i}" for i in range(50)] + ["new"]


def test_an_unexpected_error_in_the_link_never_reaches_the_gateway(store, spool, caplog):
    """A bug in the link's own handling of a message is logged at ERROR with the
    session id and the traceback; the gateway's call returns as usual."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)

    def broken(session_id: str, message: Any) -> None:
        raise RuntimeError("link bug")

    link._append = broken
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        store.append_to_transcript("s", _m("m0"))
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        "walspool could not handle a transcript message for session s; what is queued stays queued"
    )
    assert record.exc_info and record.exc_info[0] is RuntimeError


def test_a_gateway_thread_under_its_drain_budget_writes_its_own_message(store, spool, monkeypatch):
    """A backlog one row under the gateway thread's drain budget: the thread drains it
    all and writes its own message itself before it returns."""
    monkeypatch.setattr(bounds, "DRAIN_CHUNK_ROWS", 10)
    monkeypatch.setattr(bounds, "GATEWAY_DRAIN_ROWS", 20)
    store._db.create_session("s", "telegram")
    spool.append_many([("s", _m(f"old{i}")) for i in range(19)])  # an earlier run's
    install(store, spool, recover=False, retry_interval=3600)
    writers: list[str] = []
    store._append_transcript_message = naming_threads(store._append_transcript_message, writers)
    store.append_to_transcript("s", _m("new"))
    assert contents(store, "s") == [f"old{i}" for i in range(19)] + ["new"]
    assert writers == [threading.current_thread().name]


def test_a_failing_write_is_counted_in_the_stores_counter_and_logged_word_for_word(
    store, spool, caplog
):
    """A write of the queue's head that state.db refuses: the store's own failure count
    goes up once per attempt, the WARNING is the released store's, word for word, and
    the message stays queued for the retry."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)  # the test makes the retry due
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for attempt, content in ((1, "first"), (2, "second")):
        caplog.clear()
        store.append_to_transcript("s", _m(content))
        assert _lines(caplog, logging.WARNING) == [
            f"Session DB transcript append failed for s (failure_count={attempt}, "
            f"pending={attempt}); will retry: database disk image is malformed"
        ]
        assert store._transcript_append_failures == {"s": attempt}
        with link.core.lock:
            link.core.sessions["s"].wake()  # its retry time has come
    assert [m["content"] for m in store._dirty_transcripts["s"]] == ["first", "second"]
    sql(store, HEAL)
    store.append_to_transcript("s", _m("third"))
    assert contents(store, "s") == ["first", "second", "third"]
    assert spool.stats().rows == 0


#: FTS damage the store's own rebuild repairs: inserts fail as SQLite fails them on a
#: damaged FTS index until ``SessionDB.rebuild_fts`` has made the index whole again.
FTS_OUT_OF_STEP = (
    "CREATE TRIGGER fts_out_of_step BEFORE INSERT ON messages "
    "WHEN (SELECT count(*) FROM messages_fts_docsize) != (SELECT count(*) FROM messages) "
    "BEGIN SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)


def test_a_write_fts_damage_fails_is_written_once_after_the_stores_own_rebuild(
    store, spool, caplog
):
    """SessionDB repairs FTS damage once by itself; damage after that reaches the store,
    whose own one rebuild lets the link write the message again, to its session, once."""
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    store.append_to_transcript("s", _m("first"))
    sql(store, FTS_OUT_OF_STEP)
    sql(store, "DELETE FROM messages_fts_docsize")  # the index lost its rows
    store.append_to_transcript("s", _m("before"))  # SessionDB's own repair
    assert store._db._fts_runtime_rebuild_attempted
    sql(store, "DELETE FROM messages_fts_docsize")  # damaged again
    caplog.set_level(logging.WARNING)
    caplog.clear()
    store.append_to_transcript("s", _m("after"))
    assert contents(store, "s") == ["first", "before", "after"]
    assert store._fts_rebuild_attempted
    assert "s" not in store._transcript_append_failures and "s" not in store._dirty_transcripts
    assert spool.stats().rows == 0  # written at once, not spooled
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "Rebuilt 2 Session DB FTS index(es) after append corruption"
    ]


LINKED_THEN_EXITING = """
import sys
from pathlib import Path
import walspool
from gateway.config import GatewayConfig
from gateway.session import SessionStore
from walspool.hermes import install

home = Path(sys.argv[1])
store = SessionStore(home / "sessions", GatewayConfig(sessions_dir=home / "sessions"))
link = install(store, walspool.Spool(home / "spool.db"))
thread = link.background.thread
print("retrying in the background:", thread is not None and thread.is_alive())
"""


def test_a_gateway_that_exits_without_closing_its_link_is_not_kept_alive(hermes_home):
    """The background thread is a daemon: a gateway process that ends without closing
    the link (a crash path, a script) exits instead of hanging on it."""
    done = run_python(
        LINKED_THEN_EXITING, str(hermes_home), timeout=STEP, env={"HERMES_HOME": str(hermes_home)}
    )
    assert (done.returncode, done.stdout) == (0, "retrying in the background: True\n"), done.stderr


class _Hostile:
    """An SDK object in a tool call whose every attribute access raises."""

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")

    def __repr__(self) -> str:
        return "<Hostile>"


def test_an_evicted_message_holding_a_value_that_raises_lands_as_itself(store, spool, monkeypatch):
    """An assistant message whose tool_calls hold an object whose attribute access raises,
    evicted during an outage before the gateway's write ever saw it (a write would set
    it aside as quarantined): it lands in state.db as an assistant message with its
    content and readable fields; only the object became text."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _Hostile()}}
    assistant = {
        "role": "assistant",
        "content": "calling f",
        "tool_calls": [call],
        "reasoning": "because",
    }
    # m0 is the head whose write fails; m1 evicts m0, and from then on the session holds
    # spooled rows, so its queue is not written; m2 evicts the assistant message.
    for message in (_m("m0"), assistant, _m("m1"), _m("m2")):
        store.append_to_transcript("s", message)
    spool.flush()
    assert spool.stats().rows == 2
    sql(store, HEAL)
    store.append_to_transcript("s", _m("fin"))
    m0, first, *rest = store._db.get_messages("s")
    assert m0["content"] == "m0"
    assert (first["role"], first["content"], first["reasoning"]) == (
        "assistant",
        "calling f",
        "because",
    )
    tool_calls = first["tool_calls"]
    if isinstance(tool_calls, str):
        tool_calls = json.loads(tool_calls)
    assert tool_calls == [{**call, "function": {"name": "f", "arguments": "<Hostile>"}}]
    assert [m["content"] for m in rest] == ["m1", "m2", "fin"]


def _replace(path: Path, how: str) -> None:
    """An operator's ``rm`` or ``mv`` of the spool file while the gateway runs."""
    if how == "deleted":
        path.unlink()
    else:
        path.rename(path.with_name("moved.db"))


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_rows_spooled_before_the_spool_file_was_replaced_are_still_drained(store, spool, how):
    """Rows spooled during an outage, then the spool file deleted or moved: when state.db
    heals, the link still drains them from the file it opened (which only it can still
    reach once deleted), in order, before the queue; nothing is lost. Its drains and
    their bookkeeping (``Spool.transact``) do not refuse a replaced path as appends do:
    they only take rows out of that file, and refusing them would strand its rows."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.1)  # a background thread
    sql(store, BREAK)
    for i in range(205):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 5
    _replace(spool.path, how)
    sql(store, HEAL)
    assert link.wait_idle(STEP)  # the background thread drains it, no message needed
    assert contents(store, "s") == [f"m{i}" for i in range(205)]
    assert spool.stats().rows == 0  # taken out of the file it opened
    assert not spool.path.exists()  # and nothing written at the path


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_evictions_into_a_replaced_spool_are_dropped_and_say_why(store, spool, caplog, how):
    """The spool's path no longer names its file, and the link has no background thread
    to open a fresh one (``retry_interval=0``): an eviction is not handed to the old
    file (where the next start would never find it) nor reported as spooled; it takes
    the drop-and-warn path, and the WARNING says why."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    _replace(spool.path, how)
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool")
    for i in range(203):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 0  # nothing went into the old file
    lines = [r.getMessage() for r in caplog.records if r.name == "walspool.hermes"]
    assert not [line for line in lines if "spooled" in line]
    drops = [line for line in lines if "dropping oldest" in line]
    assert len(drops) == 1  # the first of 3; the others are counted for the next line
    assert f"spool {spool.path} no longer names the file this Spool opened" in drops[0]
    link.close()
    (summary,) = [r.getMessage() for r in caplog.records if "more oldest" in r.getMessage()]
    assert "dropped 2 more oldest message(s) (3 in " in summary
    sql(store, HEAL)
    store.append_to_transcript("s", _m("fin"))
    assert contents(store, "s") == [f"m{i}" for i in range(4, 203)] + ["fin"]  # fin evicted m3


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_shutdown_flush_after_the_spool_was_replaced_goes_to_a_fresh_spool(
    store, spool, caplog, how
):
    """The spool's path no longer names its file when the gateway stops: the queue is
    spooled into a fresh spool opened at the path (as the next start would open it),
    with a WARNING, not into the old file; ``link.spool`` is that fresh spool."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", _m(f"m{i}"))
    _replace(spool.path, how)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    assert link.flush_queues() == 3
    assert link.spool is not spool and spool.closed
    try:
        assert [r.message["content"] for r in link.spool.records()] == ["m0", "m1", "m2"]
        fresh = [m for m in _lines(caplog, logging.WARNING) if "a fresh one is open at" in m]
        assert len(fresh) == 1
        assert not store._dirty_transcripts.get("s")
    finally:
        link.spool.close()


def test_a_shutdown_flush_keeps_the_queue_when_no_fresh_spool_can_be_opened(store, spool, caplog):
    """The spool file was deleted and a directory stands at its path: no fresh spool
    can be opened there, so the queue stays in memory (as in the released store) and
    the ERROR says why."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(3):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.path.unlink()
    spool.path.mkdir()
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    assert link.flush_queues() == 0
    (error,) = _lines(caplog, logging.ERROR)
    assert error.startswith("could not spool 3 queued transcript message(s) at shutdown; ")
    assert "no longer names the file this Spool opened" in error
    assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0", "m1", "m2"]
    assert link.spool is spool


class _SdkObject:
    """An SDK object in a tool call, which json.dumps (and so state.db) cannot take."""

    def __init__(self) -> None:
        self.name = "lookup"


def one_bad_live_message(store: Any, spool: walspool.Spool, retry_interval: float, bad: Any):
    """A healthy state.db; one bad live message between "before" and 20 more: the 21
    good ones reach state.db at once and in order, the session left clean; the one row
    left in the spool (the bad message, set aside)."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=retry_interval)
    store.append_to_transcript("s", _m("before"))
    store.append_to_transcript("s", bad)
    for i in range(20):
        store.append_to_transcript("s", _m(f"m{i}"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["before"] + [f"m{i}" for i in range(20)]
    assert "s" not in store._dirty_transcripts
    spool.flush()
    (rec,) = spool.records()
    return rec


@pytest.mark.parametrize("retry_interval", [1.0, 0], ids=["retrying", "no-retries"])
def test_a_live_value_past_64_bits_lands_as_its_text_as_a_replay_writes_it(
    store, spool, retry_interval
):
    """A live message whose content is 2**70 (SQLite refuses to bind it) is written once
    more with its values made bindable, as a replay writes the same row: it lands in
    its place as its decimal text, nothing is spooled, the 20 after it follow."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=retry_interval)
    store.append_to_transcript("s", _m("before"))
    store.append_to_transcript("s", {"role": "user", "content": 2**70})
    for i in range(20):
        store.append_to_transcript("s", _m(f"m{i}"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["before", str(2**70)] + [f"m{i}" for i in range(20)]
    spool.flush()
    assert spool.stats().rows == 0


@pytest.mark.parametrize("retry_interval", [1.0, 0], ids=["retrying", "no-retries"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            {"role": "assistant", "content": "calling", "tool_calls": [_SdkObject()]},
            "TypeError: Object of type _SdkObject is not JSON serializable",
        ),
    ],
    ids=["sdk-object"],
)
def test_a_live_message_refused_for_its_content_is_quarantined_and_its_session_goes_on(
    store, spool, capsys, retry_interval, bad, error
):
    """A healthy state.db refuses one live message for its content: it is set aside in the
    spool as quarantined (``walspool ls`` shows it, the quarantined total counts it), and
    the 20 messages after it reach state.db at once, in order, with no retry delay and
    no 201st message needed."""
    rec = one_bad_live_message(store, spool, retry_interval, bad)
    assert (rec.session_id, rec.reason, rec.status, rec.attempts) == (
        "s",
        hermes.REJECTED,
        "quarantined",
        1,
    )
    assert rec.last_error.startswith(f"state.db refused it for its content: {error}")
    assert rec.message["role"] == bad["role"]
    assert spool.stats().rows == 1
    from walspool.cli import main

    assert main(["ls", str(spool.path), "--json"]) == 0
    (stream,) = json.loads(capsys.readouterr().out)
    assert (stream["session_id"], stream["rows"], stream["quarantined"]) == ("s", 1, 1)
    # counted as quarantined by the metrics' total (issue 44)
    assert main(["stats", str(spool.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined_total"] == 1


class _ClassRaises:
    """An SDK object whose ``__class__`` raises (``json.dumps`` names its type)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("no __class__ for you")


class _ListRaises(list):
    """A list whose iteration and length raise."""

    def __iter__(self) -> Any:
        raise RuntimeError("no iteration for you")

    def __len__(self) -> int:
        raise RuntimeError("no length for you")


class _EqRaises:
    """A value whose comparison and hash raise."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparison for you")

    def __hash__(self) -> int:
        raise RuntimeError("no hash for you")


@pytest.mark.parametrize("retry_interval", [1.0, 0], ids=["retrying", "no-retries"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            {"role": "assistant", "content": "calling", "tool_calls": [_ClassRaises()]},
            "RuntimeError: no __class__ for you",
        ),
        (
            {"role": "assistant", "content": "calling", "tool_calls": [_Hostile()]},
            "RuntimeError: no __class__",
        ),
        (
            {"role": "assistant", "content": "calling", "tool_calls": _ListRaises([{"id": "c1"}])},
            "RuntimeError: no length for you",
        ),
        ({"role": _EqRaises(), "content": "calling"}, "RuntimeError: no comparison for you"),
        (
            {"role": "user", "content": "calling", "timestamp": _Hostile()},
            "RuntimeError: no timestamp",
        ),
    ],
    ids=["class-raises", "getattribute-raises", "len-raises", "eq-raises", "timestamp-raises"],
)
def test_a_live_message_whose_value_raises_when_inspected_is_quarantined_and_its_session_goes_on(
    store, spool, retry_interval, bad, error
):
    """A healthy state.db; the gateway's own write of one live message raises an error no
    rule classifies (a RuntimeError from a value of the message: its ``__class__``,
    attributes, iteration, length or comparison raise), then 20 messages follow. The bad
    message is kept in the spool, quarantined with that error, and the 20 reach state.db
    at once, in order: the session is not retried forever behind it."""
    rec = one_bad_live_message(store, spool, retry_interval, bad)
    assert (rec.session_id, rec.seq, rec.reason, rec.status, rec.attempts) == (
        "s",
        1,
        hermes.REJECTED,
        "quarantined",
        1,
    )
    assert rec.last_error == f"the gateway's write fails on one of its values: {error}"
    assert rec.message["content"] == "calling"
    if isinstance(bad["role"], str):
        assert rec.message["role"] == bad["role"]


def test_a_closed_state_db_is_not_taken_for_content_it_refuses(store, spool):
    """A closed SessionDB fails every write with an AttributeError, which the gateway's
    wider rule would blame on the row: that is the database's state, so the message stays
    queued for the retry, never quarantined."""
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    store._db.close()
    store.append_to_transcript("s", _m("m0"))
    assert [m["content"] for m in store._dirty_transcripts["s"]] == ["m0"]
    spool.flush()
    assert spool.stats().rows == 0


def test_an_outage_of_a_thousand_evictions_is_told_in_a_few_lines(store, spool, caplog):
    """The operator's log of a real burst: no line per eviction or per failed retry, but
    the first few failures word for word, one line when the session starts spooling
    (naming the spool, once), one when it has drained and one when the outage is over,
    with counts; no object reprs."""
    store._db.create_session("s", "telegram")
    link = install(store, spool)  # the default retry interval
    sql(store, BREAK)
    caplog.set_level(logging.INFO, logger="walspool")
    for i in range(1200):
        store.append_to_transcript("s", _m(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 1000
    sql(store, HEAL)
    assert link.wait_idle(STEP)  # the background thread drains it, no message needed
    assert contents(store, "s") == [f"m{i}" for i in range(1200)]
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("walspool") and r.levelno >= logging.WARNING
    ]
    retries = [line for line in lines if "failed" in line]
    assert 1 <= len(retries) <= outage.QUIET_AFTER, retries  # however many retries
    assert retries[0] == (
        "Session DB transcript append failed for s (failure_count=1, pending=1); "
        "will retry: database disk image is malformed"
    )
    rest = [line for line in lines if line not in retries]
    assert len(rest) == 3, rest
    started, drained, over = rest
    assert started == (
        "Session DB transcript pending queue full for s (cap=200); spooling the oldest "
        f"messages to {spool.path} until state.db takes them (one line when it has drained)"
    )
    assert re.fullmatch(
        r"Session DB transcript of s drained: 1000 message\(s\) spooled, 1000 replayed into "
        r"state\.db in \d+\.\d s",
        drained,
    )
    assert re.fullmatch(r"walspool: outage over: 1000 spooled, 1000 replayed in \d+\.\d s", over)
    assert sum(str(spool.path) in line for line in rest) == 1  # a held retry names it too
    assert not [r for r in caplog.records if " object at 0x" in r.getMessage()]


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_evictions_into_a_replaced_spool_go_to_a_fresh_spool_in_order(store, spool, caplog, how):
    """The spool's path no longer names its file during an outage, and the link's
    background thread runs: the eviction the old spool returns, and every later one,
    go to a fresh spool opened at the path (one WARNING says so), and once state.db
    heals the whole transcript lands once, in order."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.1)
    _replace(spool.path, how)
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(205):
        store.append_to_transcript("s", _m(f"m{i}"))
    deadline = time.monotonic() + STEP
    while link.spool is spool or link.spool.stats().rows < 5:
        assert time.monotonic() < deadline, "no fresh spool took the evictions"
        time.sleep(0.01)
    assert spool.closed
    fresh = link.spool
    assert [r.message["content"] for r in fresh.records()] == [f"m{i}" for i in range(5)]
    sql(store, HEAL)
    store.append_to_transcript("s", _m("fin"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(205)] + ["fin"]
    lines = _lines(caplog, logging.WARNING)
    assert len([line for line in lines if "a fresh one is open at that path" in line]) == 1
    assert not [line for line in lines if "dropping oldest" in line]
    link.close()
    fresh.close()


def test_the_plugin_links_a_runner_module_imported_after_it(tmp_path: Path) -> None:
    """The plugin comes first (discovery) and ``gateway.run`` later: the runner module,
    once imported, is linked, and stays a module of its own loader (its source, for
    tracebacks and ``inspect``, and its spec)."""
    code = """
import inspect, sys
from walspool import plugin
from walspool.gateways import MARK
plugin.register(None)
assert "gateway.run" not in sys.modules
import gateway.run as run
print(getattr(run.GatewayRunner.start, MARK, False))
print(type(run.__loader__).__name__, run.__spec__.loader is run.__loader__)
print("class GatewayRunner" in inspect.getsource(run))
print([f for f in sys.meta_path if type(f).__module__.startswith("walspool")])
"""
    done = run_python(code, env={"HOME": str(tmp_path), "HERMES_HOME": str(tmp_path / "h")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["True", "SourceFileLoader True", "True", "[]"]
