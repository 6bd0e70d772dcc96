"""The gateway link under faults and waits, on the real hermes-agent 0.19.0 SessionStore.

Self-healing after an outage with no new message, the retry backoff and its cap, a
spool whose write lock another process holds, a replay lock held by another process
and a real concurrent ``walspool replay``, the background recovery at ``install``,
every replayable reason in the live drain, bad values, and transcript rewrites.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _gateway import (
    BREAK,
    HEAL,
    Clock,
    contents,
    fill_the_writer,
    found_locked,
    msg,
    sql,
    told_drops,
)
from _helpers import ROOT, STEP
from _lock_holder import replay_lock_held, write_lock_held

import walspool
import walspool.link.bounds as bounds
import walspool.store.writer as writer
from walspool.errors import ReplayBusy
from walspool.hermes import Link, install
from walspool.link.repeats import REPEAT_SECONDS

pytest.importorskip("hermes_state")

#: An outage of session "a" only; other sessions write as usual.
BREAK_A = (
    "CREATE TRIGGER broken BEFORE INSERT ON messages WHEN NEW.session_id = 'a' BEGIN "
    "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)
#: What a gateway thread may wait in one append_to_transcript in these tests: the
#: store's lock, in-memory work, a write to a healthy state.db, on a shared machine
#: (the released store's own maximum there is about 0.2 s). Far below every spool
#: wait these tests set up (the busy bound is 60 s in them, the replay lock is held
#: until released), so a call within it did not wait for the spool.
APPEND_BOUND = 1.0
WAIT = STEP


@pytest.fixture
def spool(hermes_home: Path) -> Iterator[walspool.Spool]:
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def timed_append(store: Any, session_id: str, content: str) -> float:
    started = time.monotonic()
    store.append_to_transcript(session_id, msg(content))
    return time.monotonic() - started


class Waits:
    """The waits walspool can make a gateway thread (this test's thread) start, as they
    start: which, its bound (None: unbounded but for the spool's busy bound), and
    whether the spool's writer had found its write lock held elsewhere by then. Each
    is a place of README's table "What a gateway thread can wait for": the link's
    condition (taking a session over, its evictions' commit, a drain's batch), its
    drain lock, room in the spool writer's queue, a blocking put, and a spool
    transaction on the caller's thread."""

    def __init__(self, link: Link, spool: walspool.Spool) -> None:
        self.seen: list[tuple[str, float | None, bool]] = []
        self._thread = threading.current_thread()
        self._writer = spool._writer
        note = self._note

        class Settled(threading.Condition):
            def wait(self, timeout: float | None = None) -> bool:
                note("the link's condition", timeout)
                return super().wait(timeout)

        class Draining:
            def __init__(self, lock: Any) -> None:
                self.lock = lock

            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                note("the drain lock", timeout if blocking and timeout >= 0 else None)
                return bool(self.lock.acquire(blocking, timeout))

            def release(self) -> None:
                self.lock.release()

        link.core.settled = Settled(link.core.lock)
        link.core.draining = Draining(link.core.draining)  # type: ignore[assignment]
        self._record("wait_for_room", bounded=True)
        self._record("notify", bounded=False)
        self._record("call", bounded=False)

    def _record(self, name: str, bounded: bool) -> None:
        original = getattr(self._writer, name)

        def recorded(*args: Any, **kw: Any) -> Any:
            self._note(f"the spool writer's {name}", args[0] if bounded else None)
            return original(*args, **kw)

        setattr(self._writer, name, recorded)

    def _note(self, what: str, bound: float | None) -> None:
        if threading.current_thread() is self._thread:
            self.seen.append((what, bound, self._writer.busy_since is not None))

    def once_found_locked(self) -> list[tuple[str, float | None]]:
        """The waits with a bound above zero started once the writer had found its write
        lock held elsewhere. README's table allows none then for an eviction, a take-over
        or an evictions' commit, and a gateway thread leaves drains to the background
        thread: none is expected at all."""
        return [(w, b) for w, b, locked in self.seen if locked and (b is None or b > 0)]


def settle(link: Link, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Wait on the link's condition (notified at each release and commit) for ``predicate``."""
    with link.core.settled:
        return link.core.settled.wait_for(predicate, timeout)


# -- self-healing ----------------------------------------------------------------------


def test_a_healed_database_receives_everything_with_no_new_message(store, spool):
    """The issue's case: 206 messages during an outage, heal, and nothing else."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.5)
    sql(store, BREAK)
    for i in range(206):
        store.append_to_transcript("s", msg(f"m{i}"))
    assert contents(store, "s") == []
    healed = time.monotonic()
    sql(store, HEAL)
    assert link.wait_idle(link.retry_interval + 5.0)
    assert time.monotonic() - healed < link.retry_interval + 5.0
    assert contents(store, "s") == [f"m{i}" for i in range(206)]
    assert spool.stats().rows == 0 and "s" not in store._dirty_transcripts


def test_retries_back_off_up_to_the_retry_interval(store, spool):
    store._db.create_session("s", "telegram")
    attempts: list[float] = []
    enough = threading.Event()
    write = store._append_transcript_message

    def counting(session_id: str, message: dict[str, Any]) -> None:
        attempts.append(time.monotonic())
        if len(attempts) >= 8:
            enough.set()
        write(session_id, message)

    store._append_transcript_message = counting
    interval = 0.4
    link = install(store, spool, retry_interval=interval)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("m0"))  # fails twice (the store's FTS rebuild retry)
    assert enough.wait(WAIT)
    link.close()
    gaps = [b - a for a, b in zip(attempts[1:], attempts[2:], strict=False)]
    expected = [interval / 8, interval / 4, interval / 2, interval, interval, interval]
    for gap, want in zip(gaps, expected, strict=False):
        assert want * 0.9 <= gap < want + 1.0, (gaps, expected)


def test_a_retry_interval_of_zero_starts_no_background_retries(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    assert link.background.thread is None


# -- a spool locked by another process ---------------------------------------------------


def test_a_locked_spool_never_makes_a_gateway_thread_wait(store, spool, monkeypatch):
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)
    for s in ("a", "h"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.2)
    recorded = Waits(link, spool)
    sql(store, BREAK_A)
    with write_lock_held(spool.path) as holder:
        waits = [timed_append(store, "a", f"a{i}") for i in range(205)]  # 5 evictions
        assert found_locked(spool)
        waits += [timed_append(store, "a", f"a{i}") for i in range(205, 260)]
        assert max(waits) < APPEND_BOUND, max(waits)
        assert recorded.once_found_locked() == []
        # A healthy session writes as usual while the spool is locked.
        assert timed_append(store, "h", "hello") < APPEND_BOUND
        assert contents(store, "h") == ["hello"]
        assert spool.stats().rows == 0  # the 60 evictions wait in the writer's queue
        holder.release()
    sql(store, "DROP TRIGGER broken")
    assert link.wait_idle(WAIT)
    assert contents(store, "a") == [f"a{i}" for i in range(260)]
    assert spool.stats().rows == 0


def test_a_full_spool_queue_keeps_messages_in_memory_then_drops_with_a_warning(
    store, spool, monkeypatch, caplog
):
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 4)
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)
    store._db.create_session("a", "telegram")
    link = install(store, spool, retry_interval=0.2)
    recorded = Waits(link, spool)
    sql(store, BREAK)
    with write_lock_held(spool.path) as holder:
        with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
            waits = [timed_append(store, "a", f"a{i}") for i in range(205)]  # 5 evictions
            assert found_locked(spool)
            waits += [timed_append(store, "a", f"a{i}") for i in range(205, 420)]
        assert max(waits) < APPEND_BOUND, max(waits)
        assert recorded.once_found_locked() == []
        kept = [r.getMessage() for r in caplog.records if "stays in memory" in r.getMessage()]
        dropped = [r.getMessage() for r in caplog.records if "spool writer busy" in r.getMessage()]
        # said once each in the burst; what follows is counted for a line a minute later
        assert len(kept) == 1 and f"the spool {spool.path} is busy" in kept[0]
        assert len(dropped) == 1 and "dropping oldest message" in dropped[0]
        queued = len(store._dirty_transcripts["a"])
        assert queued == 400  # twice the cap, never more
        holder.release()
    sql(store, HEAL)
    assert link.wait_idle(WAIT)
    got = contents(store, "a")
    # what was neither spooled nor kept was dropped, oldest first; the rest is in order
    assert got == sorted(got, key=lambda c: int(c[1:])) and got[-400:] == [
        f"a{i}" for i in range(20, 420)
    ]
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        link.close()  # says the lines held back
    assert told_drops(caplog, "a") == 420 - len(got)


def test_past_twice_the_cap_behind_a_full_spool_queue_a_gateway_thread_waits_its_bound(
    store, spool, monkeypatch, caplog
):
    """The spool's writer is held inside an operation with its queue full (its write
    lock is not held elsewhere: the spool is not busy, room may come soon). Past twice
    the cap a gateway thread waits for room at most ``HANDOFF_WAIT``, then drops the
    oldest message with a WARNING and returns, while the writer is still held. A line
    due before the wait (the keeps' summary, an interval on) is said with the drop."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    monkeypatch.setattr(bounds, "HANDOFF_WAIT", 0.2)
    store._db.create_session("a", "telegram")
    link = install(store, spool, retry_interval=3600)
    # Frozen but for the test's move: the wait's bound is measured in real time
    # (``Core.timer``), the lines' interval on this clock.
    link.clock = clock = Clock()
    sql(store, BREAK)
    go_on, fillers = fill_the_writer(spool)
    for i in range(4):  # up to twice the cap: kept in memory, no room in the spool
        store.append_to_transcript("a", msg(f"a{i}"))
    clock.move(REPEAT_SECONDS)  # the next keep is summed up at once
    recorded: list[Waits] = []

    def past_twice_the_cap() -> None:
        recorded.append(Waits(link, spool))
        store.append_to_transcript("a", msg("a4"))

    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    appender = threading.Thread(target=past_twice_the_cap, daemon=True)
    appender.start()
    appender.join(STEP)
    try:
        assert not appender.is_alive(), "the gateway thread waited for the spool's writer"
        room = [bound for what, bound, _ in recorded[0].seen if "wait_for_room" in what]
        assert room and all(0 < bound <= bounds.HANDOFF_WAIT for bound in room), room
        assert [m["content"] for m in store._dirty_transcripts["a"]] == [
            f"a{i}" for i in range(1, 5)
        ]
        # The first look's summary of the keeps is said, before the wait's drop.
        kept = [r.getMessage() for r in caplog.records if "kept in memory" in r.getMessage()]
        assert kept == [
            f"Session DB transcript pending queue full for a (cap=2); the spool {spool.path} "
            "is still busy: the oldest message was kept in memory 1 more time(s) (2 in 60 s; "
            "the oldest is dropped past 4)"
        ]
        assert told_drops(caplog, "a") == 1
        assert not any(f.done() for f in fillers)  # the writer is still held
    finally:
        go_on.set()
    assert [f.result(STEP).seq for f in fillers] == [1, 2]


def test_a_lock_held_past_the_bound_takes_the_drop_path_and_the_gateway_goes_on(
    store, spool, monkeypatch, caplog
):
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 0.3)
    store._db.create_session("a", "telegram")
    link = install(store, spool, retry_interval=0.2)
    sql(store, BREAK)
    with write_lock_held(spool.path), caplog.at_level(logging.WARNING, logger="walspool"):
        waits = [timed_append(store, "a", f"a{i}") for i in range(205)]
        assert max(waits) < APPEND_BOUND
        # the writer gives up after the bound: every eviction's callback runs
        assert settle(link, lambda: link.core.handoffs.pending("a") == 0)
    drops = [r.getMessage() for r in caplog.records if "dropping oldest" in r.getMessage()]
    assert len(drops) == 1 and "held its write lock for more than 0.3 s" in drops[0]
    sql(store, HEAL)
    assert link.wait_idle(WAIT)
    assert contents(store, "a") == [f"a{i}" for i in range(5, 205)]
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        link.close()  # says the lines held back
    assert told_drops(caplog, "a") == 5


def test_shutdown_flush_with_a_locked_spool_is_bounded(store, spool, monkeypatch, caplog):
    monkeypatch.setattr(writer, "BUSY_RETRY_SECONDS", 60.0)
    monkeypatch.setattr(bounds, "FLUSH_TIMEOUT", 0.5)
    store._db.create_session("a", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(50):
        store.append_to_transcript("a", msg(f"a{i}"))
    with write_lock_held(spool.path) as holder:
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
            assert link.flush_queues() == 0
        assert time.monotonic() - started < 0.5 + bounds.CONFIRM_WAIT + 1.0
        assert "not committed within 0.5 s" in caplog.text
        holder.release()
    spool.flush()  # accepted before the timeout: committed once the lock is free
    assert [r.message["content"] for r in spool.records()] == [f"a{i}" for i in range(50)]


# -- replays elsewhere -----------------------------------------------------------------


def test_a_replay_lock_held_elsewhere_never_blocks_a_drain(store, spool):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.2)
    sql(store, BREAK)
    for i in range(210):
        store.append_to_transcript("s", msg(f"m{i}"))
    with replay_lock_held(spool.path) as holder:
        sql(store, HEAL)
        # Returns while the lock is still held. It may wait, at most HANDOFF_WAIT, for
        # the background thread to finish a state.db write it had started (under load,
        # one failing write includes SessionDB's own FTS rebuild), never for the lock.
        assert timed_append(store, "s", "live") < bounds.HANDOFF_WAIT + 1.0
        assert contents(store, "s") == []  # live rows never overtake the spooled ones
        holder.release()
    assert link.wait_idle(WAIT)  # the background thread drains it, no new message
    assert contents(store, "s") == [f"m{i}" for i in range(210)] + ["live"]


def test_a_concurrent_cli_replay_never_blocks_the_gateway(hermes_home, store, spool):
    """A real ``walspool replay`` of 4,200 rows runs while the gateway appends to a
    session whose spooled rows it would drain: the drains skip, nothing waits."""
    sessions = [f"o{k}" for k in range(3)]
    for s in ["s", *sessions]:
        store._db.create_session(s, "telegram")
    spool.append_many([(s, msg(f"{s}-{i}")) for s in sessions for i in range(1400)])
    link = install(store, spool, recover=False, retry_interval=0)
    sql(store, BREAK_A.replace("'a'", "'s'"))
    for i in range(210):
        store.append_to_transcript("s", msg(f"m{i}"))
    busy = []
    asked: set[bool | float] = set()  # each drain's wait for the replay lock
    replay = link.replayer.replay

    def noting(*args: Any, **kw: Any) -> Any:
        asked.add(kw.get("wait", True))
        try:
            return replay(*args, **kw)
        except ReplayBusy:
            busy.append(time.monotonic())
            raise

    link.replayer.replay = noting
    cli = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "walspool"),  # the installed command
            "replay",
            str(spool.path),
            "--into",
            str(hermes_home / "state.db"),
            "--wait",  # the gateway's own drain may hold the lock when it starts
            str(WAIT),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    waits = []
    i = 210
    while cli.poll() is None and i < 20_000:
        waits.append(timed_append(store, "s", f"m{i}"))
        i += 1
    rc, stderr = cli.wait(WAIT), cli.stderr.read() if cli.stderr else ""
    # The other sessions move; session "s" is broken throughout and has spooled rows
    # from its first 210 appends on, so the CLI holds them (exit 3) and says so.
    assert rc == 3 and re.search(r"[\d,]+ rows held in 1 session$", stderr.strip()), stderr
    assert busy, "the CLI replay never overlapped a drain"
    assert asked == {False}  # no drain on the gateway thread waited for the replay lock
    # each append waited for its eviction's commit, never for the replay's lock
    assert max(waits) < 1.0, max(waits)
    sql(store, "DROP TRIGGER broken")
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == [f"m{k}" for k in range(i)] + ["fin"]
    for s in sessions:
        assert contents(store, s) == [f"{s}-{k}" for k in range(1400)]  # each exactly once
    assert spool.stats().rows == 0


def test_install_returns_at_once_and_recovers_in_the_background(store, spool):
    store._db.create_session("s", "telegram")
    spool.append_many([("s", msg(f"old{i}")) for i in range(300)])
    with replay_lock_held(spool.path) as holder:  # the recovery must wait for it
        started = time.monotonic()
        link = install(store, spool, retry_interval=0.2)
        assert time.monotonic() - started < APPEND_BOUND
        assert timed_append(store, "s", "live") < APPEND_BOUND
        assert contents(store, "s") == []  # live rows wait for the recovery
        assert link.core.recovering
        holder.release()
    assert link.wait_idle(WAIT)
    assert contents(store, "s") == [f"old{i}" for i in range(300)] + ["live"]


def test_the_live_drain_replays_every_replayable_reason_in_seq_order(store, spool):
    store._db.create_session("s", "telegram")
    reasons = [walspool.CAP_DROP, "adapter_shutdown", "imported-upstream", walspool.SHUTDOWN]
    for i in range(12):
        spool.append("s", msg(f"r{i}"), reason=reasons[i % len(reasons)])
        if i == 5:
            spool.append("s", {"count": 1, "messages": [msg("h")]}, reason=walspool.AGENT_HISTORY)
    install(store, spool, recover=False, retry_interval=0)
    store.append_to_transcript("s", msg("live"))
    assert contents(store, "s") == [f"r{i}" for i in range(12)] + ["live"]
    assert [r.reason for r in spool.records()] == [walspool.AGENT_HISTORY]


# -- bad values and unexpected errors ----------------------------------------------------


class Hostile:
    """An object in a message whose every attribute access raises."""

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError(f"no {name} for you")


def test_a_hostile_value_never_escapes_and_is_not_lost(store, spool):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    hostile = {"role": "assistant", "content": "hostile", "tool_calls": [Hostile()]}
    store.append_to_transcript("s", hostile)  # no raise
    for i in range(200):
        store.append_to_transcript("s", msg(f"m{i}"))  # evicts the hostile one
    spool.flush()
    assert spool.stats().rows == 1
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))
    got = contents(store, "s")
    kept = list(spool.records())
    # its text reached state.db (in the form the spool could keep), or it is kept in
    # the spool for operators; the others follow in order
    landed = [c for c in got if "hostile" in str(c)]
    assert len(landed) + len(kept) == 1
    assert [c for c in got if c not in landed] == [f"m{i}" for i in range(200)] + ["fin"]


def test_an_unexpected_error_is_logged_with_the_session_and_the_message_stays(store, spool, caplog):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(200):
        store.append_to_transcript("s", msg(f"m{i}"))

    def boom(*args: Any) -> Any:
        raise RuntimeError("boom")

    spool._row = boom
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        store.append_to_transcript("s", msg("m200"))  # no raise
    assert "oldest queued message of session s; it stays in memory" in caplog.text
    assert len(store._dirty_transcripts["s"]) == 201
    del spool._row
    sql(store, HEAL)
    store.append_to_transcript("s", msg("fin"))
    assert contents(store, "s") == [f"m{i}" for i in range(201)] + ["fin"]


def test_an_unexpected_error_in_the_writer_is_logged_and_the_message_stays(store, spool, caplog):
    store._db.create_session("t", "telegram")
    install(store, spool, retry_interval=0)
    sql(store, BREAK)

    def boom(*args: Any) -> Any:
        raise RuntimeError("boom")

    store._is_fts_corruption_error = boom  # raises inside the session's writer
    with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
        store.append_to_transcript("t", msg("t0"))  # no raise
    assert "could not write session t; its messages stay queued" in caplog.text
    assert store._dirty_transcripts["t"] == [msg("t0")]
    del store._is_fts_corruption_error
    sql(store, HEAL)
    store.append_to_transcript("t", msg("fin"))
    assert contents(store, "t") == ["t0", "fin"]


# -- transcript rewrites -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["rewrite", "rewind"])
def test_a_rewrite_supersedes_the_spooled_rows(store, spool, how, caplog):
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    store.append_to_transcript("s", msg("before"))
    sql(store, BREAK)
    for i in range(205):
        store.append_to_transcript("s", msg(f"m{i}"))
    sql(store, HEAL)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        if how == "rewrite":  # /retry, /compress
            assert store.rewrite_transcript("s", [msg("rewritten")])
            expected = ["rewritten"]
        else:  # /undo
            assert store.rewind_session("s", 1) is not None
            expected = []
    assert "5 spooled message(s)" in caplog.text and "superseded" in caplog.text
    assert store._dirty_transcripts.get("s") is None
    store.append_to_transcript("s", msg("next"))
    assert link.wait_idle(WAIT)
    assert [m["content"] for m in store._db.get_messages("s")] == expected + ["next"]
    kept = list(spool.records())
    assert [r.message["content"] for r in kept] == [f"m{i}" for i in range(5)]
    assert {r.status for r in kept} == {"superseded"}
    assert walspool.Replayer(spool, walspool.SessionDBSink(store._db)).replay().moved == 0


def test_one_background_thread_retries_every_session(store, spool):
    sessions = [f"s{k}" for k in range(20)]
    for s in sessions:
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.1)
    sql(store, BREAK)
    for s in sessions:
        for i in range(205):
            store.append_to_transcript(s, msg(f"{s}-{i}"))
    mine = [t for t in threading.enumerate() if t.name == f"walspool-link {spool.path}"]
    assert mine == [link.background.thread]
    sql(store, HEAL)
    assert link.wait_idle(WAIT)  # all 20 healed by that one thread, no new message
    for s in sessions:
        assert contents(store, s) == [f"{s}-{i}" for i in range(205)]


def test_the_links_log_lines_escape_session_ids(store, spool, caplog):
    """A session id is a chat platform's text: its newline or ESC must not forge or
    rewrite a log line (every walspool logger escapes its arguments)."""
    evil = "s\n2026-12-01 WARNING forged line \x1b[2K\u202e"
    store._db.create_session(evil, "telegram")
    link = install(store, spool, retry_interval=0.1)
    sql(store, BREAK)
    with caplog.at_level(logging.DEBUG, logger="walspool"):  # a line per eviction is DEBUG
        for i in range(205):
            store.append_to_transcript(evil, msg(f"m{i}"))
        spool.flush()
        assert settle(link, lambda: link.core.handoffs.pending(evil) == 0)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("walspool")]
    spooled = [line for line in lines if "spooled oldest message" in line]
    assert len(spooled) == 5
    assert all("s\\n2026-12-01 WARNING forged line \\x1b[2K\\u202e" in line for line in spooled)
    assert not any(c in line for line in lines for c in "\n\x1b\u202e")
    sql(store, HEAL)
    assert link.wait_idle(WAIT)
    assert contents(store, evil) == [f"m{i}" for i in range(205)]


def test_after_an_outage_sessions_with_backlogs_take_turns(store, spool, monkeypatch):
    """The background thread drains a slice of GATEWAY_DRAIN_ROWS rows of a session,
    then the session longest due: a small session is not held behind a large backlog."""
    monkeypatch.setattr(bounds, "GATEWAY_DRAIN_ROWS", 100)
    for s in ("big", "small"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=3600)  # no retry unless made due
    sql(store, BREAK)
    for i in range(700):
        store.append_to_transcript("big", msg(f"big-{i}"))
    for i in range(210):
        store.append_to_transcript("small", msg(f"small-{i}"))
    spool.flush()
    assert settle(link, lambda: not any(link.core.handoffs.pending(s) for s in link.core.sessions))
    sql(store, HEAL)
    with link.core.lock:  # both due now, "big" longest
        for session_id, at in (("big", 1.0), ("small", 2.0)):
            state = link.core.sessions[session_id]
            claim = state.claim(background=True)
            state.due_at(claim, at)
            state.release(claim)
        link.core.probe_at = 0.0  # and the outage's next probe
        link.core.schedule(0.0)
    assert link.wait_idle(WAIT)
    assert contents(store, "big") == [f"big-{i}" for i in range(700)]
    assert contents(store, "small") == [f"small-{i}" for i in range(210)]
    with store._db._lock:
        ids = store._db._conn.execute("SELECT session_id, id FROM messages").fetchall()
    last = {s: max(i for sid, i in ids if sid == s) for s in ("big", "small")}
    first_big = min(i for sid, i in ids if sid == "big")
    # "small" went after big's first slice, long before big's 500 spooled rows were all in
    assert first_big < last["small"] < last["big"]


class Attempts:
    """Each write of a message hermes' store tries (``_append_transcript_message``), by
    session, waited for with ``wait``."""

    def __init__(self, store: Any) -> None:
        self.sessions: list[str] = []
        self.tried = threading.Condition()
        write = store._append_transcript_message

        def counted(session_id: str, message: Any) -> Any:
            with self.tried:
                self.sessions.append(session_id)
                self.tried.notify_all()
            return write(session_id, message)

        store._append_transcript_message = counted

    def wait(self, count: int) -> bool:
        with self.tried:
            return self.tried.wait_for(lambda: len(self.sessions) == count, STEP)


def five_failing_then_a_probe(store: Any, spool: Any) -> tuple[Any, Clock, Attempts, str]:
    """Five sessions each fail a write; once their retry times have passed, the
    background thread tries one of them (the probe), which fails. The link, its clock,
    the attempts and the probe's session."""
    sessions = [f"s{i}" for i in range(5)]
    for s in sessions:
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=8.0)
    link.clock = clock = Clock()
    attempts = Attempts(store)
    sql(store, BREAK)
    for s in sessions:
        store.append_to_transcript(s, msg(f"{s}-m"))
    # each failed on its gateway thread (the first twice: hermes' FTS repair retries)
    assert sorted(set(attempts.sessions)) == sessions
    first = len(attempts.sessions)
    clock.move(8.0)  # every retry time and the probe time passed
    with link.core.lock:
        link.core.due.notify_all()
    assert attempts.wait(first + 1)
    probe = attempts.sessions[-1]
    assert settle(link, lambda: link.core.sessions[probe].failures == 2)
    return link, clock, attempts, probe


def test_in_an_outage_the_background_thread_tries_one_failing_session_per_probe(store, spool):
    """Five sessions each fail a write, then nothing arrives. Once their retry times
    have passed, the background thread tries one of them (the probe), not all five, and
    after it fails the others stay untried until the next probe, their own retry times
    long past. Once state.db heals, the next probe succeeds and the rest follow at once."""
    link, clock, attempts, probe = five_failing_then_a_probe(store, spool)
    sessions = sorted(link.core.sessions)
    tried = len(attempts.sessions)
    with link.core.lock:
        now = clock()
        others = [link.core.sessions[s] for s in sessions if s != probe]
        assert all(state.retry_at <= now and state.writer is None for state in others)
        claimed, look_at = link.background.due_sessions()
        assert claimed == [] and look_at == link.core.probe_at > now
    assert len(attempts.sessions) == tried
    sql(store, HEAL)
    clock.move(8.0)
    with link.core.lock:
        link.core.due.notify_all()
    assert link.wait_idle(WAIT)
    for s in sessions:
        assert contents(store, s) == [f"{s}-m"]
    assert sorted(attempts.sessions[tried:]) == sessions  # once each: the probe, then the rest
    assert link.core.probe_at is None


def test_in_an_outage_a_message_to_a_failing_session_waits_for_the_probe(store, spool):
    """As above, after the probe failed: a message to another failing session, whose
    own retry time has passed, is queued behind its earlier one on the gateway thread
    with no write tried (a failing write per message would cost each message of an
    outage hermes' whole failing transaction, under the store's lock). Once state.db
    heals, the next probe lands both, in order."""
    link, clock, attempts, probe = five_failing_then_a_probe(store, spool)
    other = next(s for s in sorted(link.core.sessions) if s != probe)
    tried = len(attempts.sessions)
    with link.core.lock:
        assert link.core.sessions[other].retry_at <= clock() < link.core.probe_at
    store.append_to_transcript(other, msg(f"{other}-next"))
    assert len(attempts.sessions) == tried
    assert [m["content"] for m in store._dirty_transcripts[other]] == [
        f"{other}-m",
        f"{other}-next",
    ]
    sql(store, HEAL)
    clock.move(8.0)
    with link.core.lock:
        link.core.due.notify_all()
    assert link.wait_idle(WAIT)
    assert contents(store, other) == [f"{other}-m", f"{other}-next"]


def test_a_shutdown_flush_whose_commit_fails_puts_the_messages_back_in_order(
    hermes_home, store, caplog
):
    """The spool's commit of a shutdown flush fails (an I/O error on its first write):
    every message goes back to the front of its queue, in order, with one ERROR that
    says they stay queued; the next flush spools them all, once, in arrival order."""
    from _faultvfs import Fault, FaultVFS, installed

    for sid in ("a", "b"):
        store._db.create_session(sid, "telegram")
    vfs = FaultVFS()
    with installed(vfs), walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=60, recover=False)
        sql(store, BREAK)
        for i in range(3):
            store.append_to_transcript("a", msg(f"a{i}"))
        for i in range(2):
            store.append_to_transcript("b", msg(f"b{i}"))
        queued = {s: [m["content"] for m in q] for s, q in store._dirty_transcripts.items() if q}
        assert queued == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"]}
        vfs.arm(Fault("write", 1, "eio"))
        with caplog.at_level(logging.ERROR, logger="walspool.hermes"):
            assert link.flush_queues() == 0
        assert vfs.fired
        vfs.disarm()
        back = {s: [m["content"] for m in q] for s, q in store._dirty_transcripts.items() if q}
        assert back == queued
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.startswith("could not spool 5 queued transcript message(s) at shutdown to ")
        assert "they stay queued" in line
        assert link.flush_queues() == 5
        assert [(r.session_id, r.message["content"], r.reason) for r in spool.records()] == [
            (s, c, walspool.SHUTDOWN) for s in ("a", "b") for c in queued[s]
        ]
        link.close()


def test_a_stop_while_a_gateway_thread_writes_into_a_locked_state_db_spools_that_message(
    store, spool, hermes_home, caplog
):
    """Another process holds state.db's write lock; a gateway thread is inside the
    write of a session's message (0.19.0's SessionDB retries about 16 s) when the
    shutdown flushes the queues: the flush leaves it to that write and says so, and
    once the write fails the message is spooled at once, nothing queued left (before:
    it went back to a queue nobody flushed again, lost with the process, unsaid)."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=1.0)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    with write_lock_held(hermes_home / "state.db"):
        gateway_thread = threading.Thread(
            target=store.append_to_transcript, args=("s", {"role": "user", "content": "late"})
        )
        gateway_thread.start()
        deadline = time.monotonic() + STEP
        while not store._dirty_transcripts.get("s"):  # queued: its write has begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
        link.flush_queues()  # as the runner's stop() does
        gateway_thread.join(120)
        assert not gateway_thread.is_alive()
    spool.flush()
    assert [(r.reason, r.message["content"]) for r in spool.records()] == [
        (walspool.SHUTDOWN, "late")
    ]
    assert not store._dirty_transcripts.get("s")
    link.close()
