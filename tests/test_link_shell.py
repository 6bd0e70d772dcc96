"""The link's shell (``walspool.link.link``) on the real hermes-agent 0.19.0 store, where
the other link tests leave it unchecked: a transcript rewrite (/retry, /undo, /compress)
ends the session's repeated conditions and says so, with their counts: a drain under
way (the rows it replayed), a busy spool that kept the oldest message in memory.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from _gateway import (
    BREAK,
    HEAL,
    Clock,
    contents,
    fill_the_writer,
    link_lines,
    msg,
    sql,
)
from _helpers import STEP

import walspool
import walspool.store.writer as writer
from walspool.hermes import install
from walspool.link.repeats import REPEAT_SECONDS

pytest.importorskip("hermes_state")


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def test_a_rewrite_during_a_drain_says_at_once_what_the_drain_replayed(store, spool, caplog):
    """A drain of 500 spooled rows stops in its third chunk while a /retry rewrites the
    transcript: the rewrite says at once how many rows were replayed since the first
    chunk's line (the second chunk's, held back) and in all; the drain's own end line
    never comes (its rows are superseded)."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(700):
        store.append_to_transcript("s", msg(f"m{i}"))
    spool.flush()
    write, written = link.replayer.sink.write, []
    entered, go_on = threading.Event(), threading.Event()

    def stops_in_the_second_chunk(*args: Any, **kw: Any) -> Any:
        written.append(args)
        if len(written) == 300:
            entered.set()
            assert go_on.wait(STEP)
        return write(*args, **kw)

    link.replayer.sink.write = stops_in_the_second_chunk
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    sql(store, HEAL)
    drainer = threading.Thread(target=lambda: store.append_to_transcript("s", msg("fin")))
    drainer.start()
    assert entered.wait(STEP)
    try:
        (first,) = link_lines(caplog, logging.INFO, "Replayed")
        n1 = int(re.match(r"Replayed (\d+) spooled", first).group(1))
        store.rewrite_transcript("s", [msg("rewritten")])  # /retry
        lines = link_lines(caplog, logging.INFO, "Replayed")
        assert len(lines) == 2, lines
        moved = re.fullmatch(
            r"Replayed (\d+) more spooled transcript message\(s\) for s after DB recovery "
            r"\((\d+) in all, in \d+\.\d s\)",
            lines[1],
        )
        assert moved, lines[1]
        more, total = map(int, moved.groups())
        assert total == n1 + more and n1 < total < 300  # the rows committed, not the one held
    finally:
        go_on.set()
        drainer.join(STEP)
    assert not drainer.is_alive()
    assert link_lines(caplog, logging.INFO, "Replayed") == lines  # nothing said twice


def test_a_rewrite_ends_a_busy_spool_condition_and_says_so(store, spool, monkeypatch, caplog):
    """The oldest message stayed in memory once (the spool's writer busy); a whole
    interval later a /retry drops the queue: that condition is over, said at once with
    its count, beside the rewrite's own lines."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 20, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=3600)
    link.clock = clock = Clock()
    sql(store, BREAK)
    go_on, fillers = fill_the_writer(spool)
    for i in range(21):
        store.append_to_transcript("s", msg(f"m{i}"))
    go_on.set()  # the rewrite's supersede is a transaction of the spool's writer
    assert [f.result(STEP).seq for f in fillers] == [1, 2]
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    caplog.clear()
    clock.move(REPEAT_SECONDS)
    sql(store, HEAL)
    assert store.rewrite_transcript("s", [msg("rewritten")])
    assert link_lines(caplog, logging.WARNING, "back within its cap") == [
        "Session DB transcript pending queue of s is back within its cap (20): the oldest "
        f"message was kept in memory 1 time(s) in 60.0 s while the spool {spool.path} was "
        "busy (0 not said before)"
    ]


def test_a_gateway_thread_waits_for_a_stuck_background_writer_at_most_its_bound(store, spool):
    """The background thread's retry of a session is stuck in a state.db write; a new
    message for that session waits for the hand-over at most ``HANDOFF_WAIT``: it returns
    (queued) while the write is still stuck, and lands after it, in order."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0.01)
    sql(store, BREAK)
    store.append_to_transcript("s", msg("m0"))  # fails: queued, retried in the background
    write, entered, release = store._append_transcript_message, threading.Event(), threading.Event()

    def stuck_once(*args: Any, **kw: Any) -> Any:
        if not entered.is_set():
            entered.set()
            release.wait(4 * STEP)  # far longer than the appender is given below
        return write(*args, **kw)

    store._append_transcript_message = stuck_once
    sql(store, HEAL)
    assert entered.wait(STEP)  # the background thread writes m0
    appender = threading.Thread(target=lambda: store.append_to_transcript("s", msg("m1")))
    appender.start()
    try:
        appender.join(STEP)
        assert not appender.is_alive()  # while m0's write is still stuck
    finally:
        release.set()
    assert link.wait_idle(STEP)
    assert contents(store, "s") == ["m0", "m1"]
