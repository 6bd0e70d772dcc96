"""``walspool demo``: a state.db outage on the real hermes-agent 0.19.0 gateway store.

The same burst runs twice, each time in a fresh temporary ``HERMES_HOME``: once on the
released ``SessionStore`` as it is, once linked to a spool. Every insert into
``messages`` fails while the burst runs (a trigger raises SQLite's "database disk
image is malformed", as FTS corruption does); then the database heals and each session
gets one more message, which is when the released store writes its queue. The
linked store also drains by itself after a heal (it retries a failing session at
least every ``DEMO_RETRY_INTERVAL`` seconds); the demo waits for it to be idle, at most
``IDLE_WAIT`` seconds, before it counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .store.spool import Spool

BREAK_SQL = (
    "CREATE TRIGGER walspool_demo_outage BEFORE INSERT ON messages BEGIN "
    "SELECT RAISE(ABORT, 'database disk image is malformed'); END"
)
HEAL_SQL = "DROP TRIGGER walspool_demo_outage"
QUIET_LOGGERS = ("gateway", "hermes_state", "walspool", "agent", "root")
DEMO_RETRY_INTERVAL = 0.25
#: Seconds the demo waits, after the heal, for the linked store to drain everything.
IDLE_WAIT = 120.0


@dataclass
class Outcome:
    """What one run of the burst left in state.db."""

    sent: int
    stored: int
    in_order: bool
    duplicates: int
    seconds: float
    spooled: int = 0


def run_demo(out: TextIO, sessions: int = 16, messages: int = 1001, threads: int = 4) -> int:
    """Run the burst on the released store and on the linked one; report; 0 if nothing lost."""
    out.write(
        f"walspool demo: {sessions} sessions x {messages:,} messages from {threads} threads "
        "while state.db refuses every insert,\nthen state.db heals and each session gets one "
        "more message. Real hermes-agent 0.19.0 SessionStore and SessionDB.\n\n"
    )
    released = _run(sessions, messages, threads, linked=False)
    linked = _run(sessions, messages, threads, linked=True)
    out.write(
        f"{'':18}{'in state.db':>17}{'lost':>9}{'duplicates':>12}{'order kept':>12}"
        f"{'burst time':>12}\n"
    )
    for name, o in (("released gateway", released), ("with walspool", linked)):
        out.write(
            f"{name:18}{f'{o.stored:,}/{o.sent:,}':>17}{o.sent - o.stored:>9,}"
            f"{o.duplicates:>12,}{'yes' if o.in_order else 'NO':>12}{o.seconds:>11.2f}s\n"
        )
    out.write(
        f"\nwith walspool, {linked.spooled:,} messages evicted at the 200-message cap went to "
        "the spool (SQLite, WAL, synchronous=FULL)\nand were replayed into state.db in drop "
        "order, before the messages still queued in memory.\n"
    )
    ok = linked.stored == linked.sent and linked.in_order and not linked.duplicates
    return 0 if ok else 1


def _run(sessions: int, messages: int, threads: int, *, linked: bool) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="walspool-demo-") as tmp, _hermes_home(Path(tmp)):
        from gateway.config import GatewayConfig
        from gateway.session import SessionStore

        home = Path(tmp)
        store = SessionStore(home / "sessions", GatewayConfig(sessions_dir=home / "sessions"))
        names = [f"demo-{n:02d}" for n in range(sessions)]
        for name in names:
            store._db.create_session(name, "telegram")
        spool = Spool(home / "spool.db") if linked else None
        link = None
        try:
            if spool is not None:
                from .hermes import install

                link = install(store, spool, retry_interval=DEMO_RETRY_INTERVAL)
            _sql(store, BREAK_SQL)
            started = time.perf_counter()
            _burst(store, names, messages, threads)
            seconds = time.perf_counter() - started
            spooled = 0
            if spool is not None:
                spool.flush()
                spooled = spool.stats().rows
            _sql(store, HEAL_SQL)
            for name in names:
                store.append_to_transcript(name, _message(name, messages))
            if link is not None:
                # The link drains the rest by itself (no message needed): wait for it,
                # within a bound; whatever it has not written by then counts as lost.
                link.wait_idle(IDLE_WAIT)
            return _outcome(store, names, messages + 1, seconds, spooled)
        finally:
            if spool is not None:
                spool.close()
            store._db.close()


def _burst(store: Any, names: list[str], messages: int, threads: int) -> None:
    """Each thread feeds its own sessions, so each session's arrival order is defined."""

    def feed(mine: list[str]) -> None:
        for i in range(messages):
            for name in mine:
                store.append_to_transcript(name, _message(name, i))

    workers = [threading.Thread(target=feed, args=(names[t::threads],)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _message(session: str, i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"{session} message {i}", "n": i}


def _outcome(
    store: Any, names: list[str], per_session: int, seconds: float, spooled: int
) -> Outcome:
    stored = duplicates = 0
    in_order = True
    for name in names:
        got = [int(m["content"].rsplit(" ", 1)[1]) for m in store._db.get_messages(name)]
        stored += len(set(got))
        duplicates += len(got) - len(set(got))
        in_order = in_order and got == sorted(got)
    return Outcome(len(names) * per_session, stored, in_order, duplicates, seconds, spooled)


def _sql(store: Any, statement: str) -> None:
    with store._db._lock:
        store._db._conn.execute(statement)


@contextlib.contextmanager
def _hermes_home(home: Path) -> Iterator[None]:
    """Point hermes at ``home`` and quiet its per-message warnings, then restore both."""
    import hermes_state

    saved_env = os.environ.get("HERMES_HOME")
    saved_db = hermes_state.DEFAULT_DB_PATH
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    os.environ["HERMES_HOME"] = str(home)
    hermes_state.DEFAULT_DB_PATH = home / "state.db"
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hermes_state.DEFAULT_DB_PATH = saved_db
        if saved_env is None:
            os.environ.pop("HERMES_HOME", None)
        else:
            os.environ["HERMES_HOME"] = saved_env
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
