"""The link's background work (``walspool.link.retry``) on the real hermes-agent 0.19.0
store, where the other link tests leave it unchecked: the start's count of each session's
share when it fails or the spool closes first, what a recovery tells of each session's
outage (the rows it moved, session by session) and the outage's end, and the sessions
that waited for a start's recovery that failed.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from _gateway import BREAK, HEAL, contents, link_lines, msg, sql
from _helpers import STEP

import walspool
import walspool.link.retry as link_retry
from walspool.hermes import Link, install
from walspool.link.core import Core

pytest.importorskip("hermes_state")


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def test_a_count_of_the_shares_that_fails_is_one_error_and_the_link_goes_on(
    store, spool, monkeypatch, caplog
):
    """The start's count of what each session holds raises: one ERROR with the error's
    traceback says what the shares are until the next start; the count is no longer
    awaited, and the link works."""

    def broken(spool: Any) -> Any:
        raise RuntimeError("no index for you")

    monkeypatch.setattr(link_retry.shares, "count", broken)
    spool.append("earlier", msg("x"))  # rows of an earlier run: the start counts them
    store._db.create_session("s", "telegram")
    caplog.set_level(logging.ERROR, logger="walspool.hermes")
    link = install(store, spool, recover=False, retry_interval=0)
    assert link.wait_idle(STEP)
    assert link_lines(caplog, logging.ERROR) == [
        f"could not count what each session holds in {spool.path}; until the next start a "
        "session's share of the cap is what it spooled since this one"
    ]
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.exc_info is not None and "no index for you" in str(record.exc_info[1])
    assert not link.core.shares.counting
    store.append_to_transcript("s", msg("m0"))
    assert contents(store, "s") == ["m0"]


def test_a_spool_closed_before_its_rows_are_counted_is_said_quietly(
    store, spool, monkeypatch, caplog
):
    """The spool is closed while the start's count waits to read it: one DEBUG line
    names it, no ERROR (nothing is spooled any more), and the count is not awaited."""
    entered, go_on = threading.Event(), threading.Event()
    count = link_retry.shares.count

    def late(spool: Any) -> Any:
        entered.set()
        assert go_on.wait(STEP)
        return count(spool)

    monkeypatch.setattr(link_retry.shares, "count", late)
    spool.append("earlier", msg("x"))
    store._db.create_session("s", "telegram")
    caplog.set_level(logging.DEBUG, logger="walspool.hermes")
    link = install(store, spool, recover=False, retry_interval=0)
    assert entered.wait(STEP)
    spool.close()
    go_on.set()
    assert link.wait_idle(STEP)
    assert f"{spool.path} was closed before its rows were counted" in link_lines(
        caplog, logging.DEBUG
    )
    assert link_lines(caplog, logging.ERROR) == []
    assert not link.core.shares.counting


def test_a_recovery_tells_each_sessions_drain_and_the_outage_over_with_the_rows_it_moved(
    store, spool, monkeypatch, caplog
):
    """An outage spools 3 evictions of a and 2 of b; state.db heals and ``recover``
    moves them: one line per session with its own counts, then one line for the whole
    outage; each session's queue is written after its rows."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    for sid in ("a", "b"):
        store._db.create_session(sid, "telegram")
    link = install(store, spool, retry_interval=3600)  # nothing drains but the recovery
    sql(store, BREAK)
    for i in range(5):
        store.append_to_transcript("a", msg(f"a{i}"))
    for i in range(4):
        store.append_to_transcript("b", msg(f"b{i}"))
    spool.flush()
    sql(store, HEAL)
    caplog.clear()
    report = link.recover()
    assert report.moved == 5
    lines = link_lines(caplog, logging.WARNING)
    assert len(lines) == 3, lines
    for line, (sid, n) in zip(lines, (("a", 3), ("b", 2)), strict=False):
        assert re.fullmatch(
            rf"Session DB transcript of {sid} drained: {n} message\(s\) spooled, {n} "
            r"replayed into state.db in \d+\.\d s",
            line,
        ), line
    assert re.fullmatch(r"walspool: outage over: 5 spooled, 5 replayed in \d+\.\d s", lines[2])
    assert contents(store, "a") == [f"a{i}" for i in range(5)]
    assert contents(store, "b") == [f"b{i}" for i in range(4)]
    assert spool.stats().rows == 0
    # A second outage of a is an outage of its own: its start is said again.
    sql(store, BREAK)
    caplog.clear()
    for i in range(5, 8):
        store.append_to_transcript("a", msg(f"a{i}"))
    spool.flush()
    assert link_lines(caplog, logging.WARNING)[-1] == (
        "Session DB transcript pending queue full for a (cap=2); spooling the oldest "
        f"messages to {spool.path} until state.db takes them (one line when it has drained)"
    )


def test_a_session_that_waited_for_a_start_recovery_that_failed_is_written(
    store, spool, monkeypatch, caplog
):
    """The start's recovery fails while a session with no spooled rows waits for it (its
    message queued: any session may hold spooled rows until the recovery has run): the
    failure is said, and the waiting session drains its own rows (none) and writes its
    message with no other message, not after its retry delay."""
    entered, go_on = threading.Event(), threading.Event()
    replay, calls = Core.replay, []

    def first_fails(self: Core, **kw: Any) -> Any:
        calls.append(kw)
        if len(calls) > 1:  # the sessions' own drains work
            return replay(self, **kw)
        entered.set()
        assert go_on.wait(STEP)
        raise RuntimeError("replay failed")

    monkeypatch.setattr(Core, "replay", first_fails)
    spool.append("earlier", msg("x"))  # an earlier run's row: the start recovers
    store._db.create_session("t", "telegram")
    caplog.set_level(logging.ERROR, logger="walspool.hermes")
    link = install(store, spool, retry_interval=3600)
    assert entered.wait(STEP)
    store.append_to_transcript("t", msg("new"))
    assert contents(store, "t") == []  # it waits for the recovery
    go_on.set()
    assert link.wait_idle(STEP)
    assert contents(store, "t") == ["new"]
    assert link_lines(caplog, logging.ERROR) == [
        f"could not replay {spool.path} at start; each session replays its own spooled rows "
        "before its next write"
    ]


def _spooled_then_moved_elsewhere(
    store: Any, spool: walspool.Spool, monkeypatch: pytest.MonkeyPatch
) -> Link:
    """An outage of s (cap 2) spools m0-m2 and keeps m3, m4 queued; state.db heals and
    another replay (an operator's, say), not the link's, moves the three rows. Returns
    the link, which retries in an hour: only the test's own calls recover."""
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 2, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    sql(store, BREAK)
    for i in range(5):
        store.append_to_transcript("s", msg(f"m{i}"))
    spool.flush()
    sql(store, HEAL)
    assert link.replayer.replay().moved == 3  # not through the link: it is not told
    return link


def test_a_recovery_after_another_replay_moved_the_rows_tells_none_replayed_by_it(
    store, spool, monkeypatch, caplog
):
    """An outage spools 3 evictions of s; another replay (an operator's, say) moves them
    before the link's recovery runs: the recovery still ends the session's outage, saying
    that it replayed none of them, and the session's queue follows."""
    link = _spooled_then_moved_elsewhere(store, spool, monkeypatch)
    caplog.clear()
    assert link.recover().moved == 0
    lines = link_lines(caplog, logging.WARNING)
    assert len(lines) == 2, lines
    assert re.fullmatch(
        r"Session DB transcript of s drained: 3 message\(s\) spooled, 0 replayed into "
        r"state.db in \d+\.\d s",
        lines[0],
    ), lines
    assert re.fullmatch(r"walspool: outage over: 3 spooled, 0 replayed in \d+\.\d s", lines[1])
    assert contents(store, "s") == [f"m{i}" for i in range(5)]


def test_a_recovery_that_ends_an_outage_on_a_broken_state_db_leaves_the_next_its_own(
    store, spool, monkeypatch, caplog
):
    """Another replay moves the 3 rows an outage of s spooled, and state.db breaks again
    before the link's recovery: the recovery ends that outage, its write of the queue
    fails, and the evictions that follow begin a second outage, said as it begins (the
    first one's record is gone); once state.db heals, everything lands in order."""
    link = _spooled_then_moved_elsewhere(store, spool, monkeypatch)
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    caplog.clear()
    assert link.recover().moved == 0
    assert len(link_lines(caplog, logging.WARNING, "outage over")) == 1
    caplog.clear()
    for i in range(5, 8):
        store.append_to_transcript("s", msg(f"m{i}"))  # m3, m4, m5 evicted at the cap
    spool.flush()
    assert link_lines(caplog, logging.ERROR) == []
    assert link_lines(caplog, logging.WARNING, "queue full") == [
        "Session DB transcript pending queue full for s (cap=2); spooling the oldest "
        f"messages to {spool.path} until state.db takes them (one line when it has drained)"
    ]
    sql(store, HEAL)
    assert link.recover().moved == 3
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(8)]


def test_a_start_beside_another_replay_holds_the_sessions_a_spooled_key_routes_to(
    store, spool, monkeypatch, caplog
):
    """A slot of the last run spooled by its routing key waits in the spool; the link
    starts while another replay holds the spool: the start leaves the rows to that
    replay, and the session the key routes to waits for it (its live message stays
    queued behind the slot, as on 0.20 and 0.22), while a session with nothing spooled
    writes at once; an embedder's own ``recover()`` waits for that replay. Once the
    lock is free the slot lands first."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    import walspool.store.replay_lock
    from walspool.store.replay_lock import replay_lock

    entry = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="42"))
    store._db.create_session("other", "telegram")
    spool.append(None, msg("slot"), reason=walspool.SHUTDOWN, session_key=entry.session_key)
    spool.flush()
    caplog.set_level(logging.WARNING, logger="walspool")
    with replay_lock(spool, wait=False):
        link = install(store, spool, retry_interval=3600)
        with link.core.lock:
            assert link.core.settled.wait_for(lambda: not link.core.recovering, STEP)
        store.append_to_transcript(entry.session_id, msg("live"))
        store.append_to_transcript("other", msg("at once"))
        assert contents(store, entry.session_id) == []
        assert contents(store, "other") == ["at once"]
        # An embedder's own recover waits for that replay (``REPLAY_WAIT``, short here).
        monkeypatch.setattr(walspool.store.replay_lock, "REPLAY_WAIT", 0.2)
        with pytest.raises(walspool.ReplayBusy):
            link.recover()
    assert any(
        "Another replay of" in line and "1 session(s) will drain" in line
        for line in link_lines(caplog, logging.WARNING)
    )
    link.recover()
    assert contents(store, entry.session_id) == ["slot", "live"]
    link.close()
