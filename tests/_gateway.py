"""What the tests on the real hermes-agent 0.19.0 gateway share: an outage of its
``state.db`` (every insert into ``messages`` fails, as a database whose FTS index is
damaged refuses them), statements on the store's own connection, transcripts, and
the spool's writer finding its write lock held by another process."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import STEP

import walspool
import walspool.store.writer as writer

#: The outage: SessionDB reads the error as FTS corruption, rebuilds, and fails again.
BREAK = (
    "CREATE TRIGGER broken BEFORE INSERT ON messages BEGIN "
    "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)
HEAL = "DROP TRIGGER IF EXISTS broken"


def sql(store: Any, statement: str) -> None:
    """Run ``statement`` on the store's SessionDB connection, under its lock."""
    with store._db._lock:
        store._db._conn.execute(statement)


def contents(store: Any, session_id: str) -> list[Any]:
    """The session's transcript in state.db, as its messages' contents."""
    return [m["content"] for m in store._db.get_messages(session_id)]


def msg(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def state_db(path: Path, *sessions: str) -> Path:
    """A closed state.db at ``path`` holding ``sessions``."""
    import hermes_state

    db = hermes_state.SessionDB(db_path=path)
    for session in sessions:
        db.create_session(session, "telegram")
    db.close()
    return path


def found_locked(spool: Any) -> bool:
    """Whether the spool's writer finds its write lock held elsewhere (``busy_since``
    set) within ``STEP``."""
    writer = spool._writer
    with writer._cond:  # notified when a commit finds the lock held
        return writer._cond.wait_for(lambda: writer.busy_since is not None, STEP)


def told_drops(caplog: pytest.LogCaptureFixture, session_id: str) -> int:
    """How many messages of the session the link's lines tell it dropped: one for the
    first line, the count of each summary and of the heal (``walspool.link.repeats``).
    Lines held back are said when the link closes: close it first."""
    told = 0
    for r in caplog.records:
        text = r.getMessage()
        if f"pending queue full for {session_id} " in text and "dropping oldest" in text:
            told += 1
        elif more := re.search(rf"for {session_id} \(cap=\d+\); dropped (\d+) more", text):
            told += int(more.group(1))
        elif healed := re.search(
            rf"transcript of {session_id}: the spool .* takes its evictions again; .*"
            r"\((\d+) not said before\)",
            text,
        ):
            told += int(healed.group(1))
    return told


class Clock:
    """A link's clock (``link.clock = Clock()``): the monotonic time it was made at plus
    what the test moved it by, and nothing else: no result depends on real time
    passing beside it (a loaded machine's slow step is no second on this clock)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.moved = 0.0

    def __call__(self) -> float:
        return self.start + self.moved

    def move(self, seconds: float) -> None:
        self.moved += seconds


def hold_the_writer(spool: walspool.Spool, bound: float = 4 * STEP) -> threading.Event:
    """Hold the spool's writer thread inside an operation until the returned event is
    set (at most ``bound``, which only keeps a failed test from hanging: longer than the
    several ``STEP``-bounded steps a test may take before it lets go)."""
    running, go_on = threading.Event(), threading.Event()
    spool._writer.submit(writer.Operation(lambda conn: running.set() or go_on.wait(bound)))
    assert running.wait(STEP)
    return go_on


def fill_the_writer(spool: walspool.Spool) -> tuple[threading.Event, list[Any]]:
    """Hold the spool's writer (``hold_the_writer``) and fill its queue, made two requests
    long by the caller (``writer.QUEUE_REQUESTS``): nothing more finds room until the
    returned event is set. Also the futures of the two requests that fill it."""
    go_on = hold_the_writer(spool)
    fillers = [spool.submit("z", {"role": "user", "content": f"z{i}"}) for i in range(2)]
    return go_on, fillers


def link_lines(caplog: pytest.LogCaptureFixture, level: int, text: str = "") -> list[str]:
    """The messages the link logged at ``level`` (exactly) that contain ``text``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "walspool.hermes" and r.levelno == level and text in r.getMessage()
    ]


def fail_conversion(spool: walspool.Spool, monkeypatch: pytest.MonkeyPatch) -> Exception:
    """Make the spool unable to turn a message whose content is "bad" into a row (a
    fault in its conversion); the fault it raises."""
    row = spool._row
    fault = RuntimeError("cannot convert")

    def faulty(session_id: str, message: Any, *args: Any) -> Any:
        if message["content"] == "bad":
            raise fault
        return row(session_id, message, *args)

    monkeypatch.setattr(spool, "_row", faulty)
    return fault
