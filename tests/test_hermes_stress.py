"""Randomized stress of the gateway link on the real 0.19.0 SessionStore.

8 threads append to a few sessions (one shared by all of them) while another thread
breaks and heals state.db at random (the trigger stand-in for a broken database), and
the link's background thread retries meanwhile. Afterwards state.db heals, the link
settles, and every message must be in state.db exactly once, each thread's messages
to a session in the order it sent them, with nothing left in the spool; at no moment
may two threads write one session.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _gateway import BREAK, HEAL, sql

import walspool
from walspool.hermes import install

pytest.importorskip("hermes_state")

THREADS = 8
SESSIONS = ["shared", "s1", "s2", "s3"]
WAIT = 120.0
TOGGLES = 8  # the least number of breaks and heals while the threads send


class Writers:
    """Counts threads inside a session's writes; records any overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside: collections.Counter[str] = collections.Counter()
        self.overlaps: list[str] = []

    def wrap(self, write: Callable[..., Any]) -> Callable[..., Any]:
        def counted(session_id: str, *args: Any, **kw: Any) -> Any:
            with self.lock:
                self.inside[session_id] += 1
                if self.inside[session_id] > 1:
                    self.overlaps.append(session_id)
            try:
                return write(session_id, *args, **kw)
            finally:
                with self.lock:
                    self.inside[session_id] -= 1

        return counted


class Drops(logging.Handler):
    """Counts the link's drop-and-warn WARNINGs (none are expected here)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "dropping oldest" in record.getMessage():
            self.count += 1


@pytest.fixture
def quiet() -> Iterator[Drops]:
    """Thousands of per-message WARNINGs: count the drops, keep the rest out of pytest."""
    drops = Drops()
    loggers = [logging.getLogger(n) for n in ("walspool", "gateway", "hermes_state")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.propagate = False
    loggers[0].addHandler(drops)
    yield drops
    loggers[0].removeHandler(drops)
    for lg, (propagate, level) in zip(loggers, saved, strict=True):
        lg.propagate, lg.level = propagate, level


@pytest.mark.parametrize(
    "per_thread, seed",
    [
        pytest.param(300, 1, id="quick"),
        pytest.param(2500, 7, id="full", marks=pytest.mark.slow),
        pytest.param(2500, 11, id="full-2", marks=pytest.mark.slow),
    ],
)
def test_random_outages_lose_nothing_duplicate_nothing_and_keep_order(
    hermes_home: Path, store: Any, quiet: Drops, per_thread: int, seed: int
) -> None:
    for s in SESSIONS:
        store._db.create_session(s, "telegram")
    writers = Writers()
    store._append_transcript_message = writers.wrap(store._append_transcript_message)
    with walspool.Spool(hermes_home / "spool.db") as spool:
        link = install(store, spool, retry_interval=0.05)
        link.replayer.sink.write = writers.wrap(link.replayer.sink.write)
        done = threading.Event()
        turned = threading.Condition()
        toggles = 0

        def toggle() -> None:
            nonlocal toggles
            rng = random.Random(seed)
            broken = False
            while not done.wait(rng.uniform(0.0, 0.03)):
                broken = not broken
                sql(store, BREAK if broken else HEAL)
                with turned:
                    toggles += 1
                    turned.notify_all()

        def turned_at_least(n: int) -> bool:
            with turned:
                return turned.wait_for(lambda: toggles >= n, WAIT)

        def feed(t: int) -> None:
            rng = random.Random(seed * 100 + t)
            for i in range(per_thread):
                # The toggler takes the SessionDB lock the feeders contend for, and a lock
                # is not fair: pace the feeders so that the outage comes and goes at least
                # TOGGLES times while they send, however the threads are scheduled.
                assert turned_at_least(TOGGLES * (i + 1) // per_thread)
                # half of each thread's messages go to the session all threads share
                s = "shared" if rng.random() < 0.5 else rng.choice(SESSIONS[1:])
                store.append_to_transcript(s, {"role": "user", "content": f"{t}:{i}"})

        toggler = threading.Thread(target=toggle)
        feeders = [threading.Thread(target=feed, args=(t,)) for t in range(THREADS)]
        toggler.start()
        for thread in feeders:
            thread.start()
        for thread in feeders:
            thread.join(WAIT)
            assert not thread.is_alive()
        done.set()
        toggler.join(WAIT)
        sql(store, HEAL)
        assert link.wait_idle(WAIT)  # healed: everything lands with no new message
        assert spool.stats().rows == 0
        link.close()

    sent = THREADS * per_thread
    rows = {s: [m["content"] for m in store._db.get_messages(s)] for s in SESSIONS}
    everything = [c for got in rows.values() for c in got]
    assert len(everything) == len(set(everything)), "a message was written twice"
    assert len(everything) == sent, f"{sent - len(everything)} message(s) lost, {quiet.count} drops"
    for s, got in rows.items():
        by_thread: dict[str, list[int]] = collections.defaultdict(list)
        for content in got:
            t, i = content.split(":")
            by_thread[t].append(int(i))
        for t, seen in by_thread.items():
            assert seen == sorted(seen), f"session {s}: thread {t}'s messages out of order"
    assert writers.overlaps == [], "two threads wrote one session at once"
    assert quiet.count == 0
    assert toggles >= TOGGLES  # the outage really came and went while they sent
