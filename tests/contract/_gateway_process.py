"""A real gateway process for the contract suite, run by the python of one gateway's
environment (``.venv``: hermes-agent 0.19.0, ``.venv-axisrow``: 0.20.1.2,
``.venv-upstream``: 0.22.2.post1) in a ``HERMES_HOME`` where the test enabled (or did
not enable) the plugin the user's way.

    python _gateway_process.py OUT probe             start a GatewayRunner, report, stop
    python _gateway_process.py OUT outage N quiet    the same, with an outage of state.db in
    python _gateway_process.py OUT outage N message  between: N messages to each of 3 sessions
                                                 while every insert fails, then heal; then
                                                 nothing more is sent (quiet), or one more
                                                 message to each session (message)
    python _gateway_process.py OUT rewrite N         an outage as above, during which s1's
                                                 transcript is rewritten (emptied, as a
                                                 /compress or /retry replaces it), then
                                                 heal and one more message to each
    python _gateway_process.py OUT drop-tickets N    an outage, heal and one more message to
                                                 each as ``outage N message``; then the
                                                 table of replay tickets is dropped from
                                                 state.db by another connection, and each
                                                 session gets one more message
    python _gateway_process.py OUT operator N        an outage as ``outage N message``, during
                                                 which the operator runs ``walspool replay``
                                                 into the broken state.db beside the gateway
    python _gateway_process.py OUT kill N K          an outage with N messages to each of 3
                                                 sessions (what was sent written to OUT),
                                                 heal, one more message each; after the
                                                 K-th state.db commit from there, OUT.landed
                                                 is made and the process waits for SIGKILL
    python _gateway_process.py OUT beside N          an outage as ``outage N message``, with the
                                                 operator's ``walspool replay`` running over
                                                 and over beside the gateway meanwhile
    python _gateway_process.py OUT values            a healthy session gets a turn whose values
                                                 a TEXT column cannot take as they are (an
                                                 integer past 64 bits, one in a list)
    python _gateway_process.py OUT full N            the disk under HERMES_HOME fills up (a
                                                 file written until ENOSPC), then N
                                                 messages to each of 3 sessions; the
                                                 file is removed (room again) and each
                                                 session gets one more message
    python _gateway_process.py OUT held-replay N     an outage past the cap as ``outage N``;
                                                 then, while another process holds the
                                                 spool's replay lock (as a running
                                                 ``walspool replay`` does), state.db
                                                 heals and each session gets a message;
                                                 released, one more to each
    python _gateway_process.py OUT held-quiet N      the same, nothing sent once released
    python _gateway_process.py OUT statedb-locked-quiet N
                                                 an outage past the cap; state.db heals,
                                                 another process holds its lock and each
                                                 session gets a message; nothing is sent
                                                 once the lock goes
    python _gateway_process.py OUT spool-locked N    an outage as ``outage N message``, during
                                                 which another process holds the spool's
                                                 write lock (an operator's ``sqlite3``
                                                 shell in a transaction) for the first
                                                 half of the messages
    python _gateway_process.py OUT spool-deleted N   an outage as ``outage N message``; after
                                                 two thirds of the messages, the spool's
                                                 files are deleted (an operator's rm), the
                                                 rows each session had in them counted
    python _gateway_process.py OUT outage-stop N     N messages to each of 3 sessions while
                                                 every insert fails, then a graceful stop,
                                                 state.db still broken
    python _gateway_process.py OUT deleted-stop N    the same, the spool's files deleted (as
                                                 ``spool-deleted``) just before the stop
    python _gateway_process.py OUT held-start N      a start on that broken state.db (the
                                                 spooled rows are held), then heal and
                                                 ``held-replay``'s two messages a session
                                                 (N: the rows sent a session before)
    python _gateway_process.py OUT locked-start N    the same, the replay lock held by
                                                 another process from before the start
    python _gateway_process.py OUT in-flight N       a session gets N turns while every insert
                                                 fails; then another process holds
                                                 state.db's write lock, one more message
                                                 is being written by a gateway thread
                                                 (inside SessionDB's write) when the
                                                 gateway stops; the lock is let go after
    python _gateway_process.py OUT long-write N      a session gets N turns while every insert
                                                 fails; one more message's write is held
                                                 inside SessionDB's write until the
                                                 graceful stop has returned
    python _gateway_process.py OUT locked-heal-stop N   N messages to each of 3 sessions
                                                 while every insert fails; then another
                                                 process holds the spool's write lock
                                                 while state.db heals and each session
                                                 gets one more message; the lock is let
                                                 go, nothing more is sent, and the
                                                 gateway stops
    python _gateway_process.py OUT memory N kill|stop   N messages to each of 3 sessions
                                                 while every insert fails and another
                                                 process holds the spool's write lock
                                                 (so every gateway keeps them in memory);
                                                 the lock is let go, each session's queue
                                                 length is written to OUT; then the
                                                 process waits for its SIGKILL (kill), or
                                                 for OUT.stop and stops (stop)
    python _gateway_process.py OUT memory-past N kill   the same without the spool's lock,
                                                 and 50 messages to the third session:
                                                 past the cap the evictions are spooled,
                                                 what a gateway queues stays there; what
                                                 was sent is written to OUT too
    python _gateway_process.py OUT stop N            a routed chat's session gets N turns
                                                 while every insert fails (they wait in
                                                 the store's queue), then a message for it
                                                 arrives while its agent is busy (the
                                                 runner's pending slot), then the gateway
                                                 stops, state.db still broken

``WALSPOOL_TEST_PREFIX`` (default ``s``) names the three sessions ``PREFIX1`` to
``PREFIX3``, so two gateways on one home send to sessions of their own.
``WALSPOOL_TEST_TOGETHER=DIR:N`` makes N such processes meet in DIR before an outage
begins and before the heal: their outages are one, their evictions overlap.

Nothing here touches walspool: the gateway's own plugin discovery loads it (or not). Writes
one JSON object to the file OUT (the 0.22 gateway takes stdout over): what the test asserts
on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

#: A deterministic outage every gateway treats as transient: inserts fail until healed.
BREAK = (
    "CREATE TRIGGER IF NOT EXISTS walspool_test_broken BEFORE INSERT ON messages "
    "BEGIN SELECT RAISE(ABORT, 'walspool test outage'); END"
)
HEAL = "DROP TRIGGER IF EXISTS walspool_test_broken"
#: ``memory-past``: messages to the last session, under the 200 cap.
MEMORY_PAST_LAST = 50
T = TypeVar("T")
#: The sessions a process sends to; ``WALSPOOL_TEST_PREFIX`` names them apart when two
#: gateways share one home.
SESSIONS = tuple(f"{os.environ.get('WALSPOOL_TEST_PREFIX', 's')}{i}" for i in (1, 2, 3))
#: Bound on the wait for a healed state.db to receive everything.
SETTLE_SECONDS = 60.0
#: Bound on the wait for the other processes at a meeting point (``together``).
MEET_SECONDS = 120.0


class Lines(logging.Handler):
    """Keeps what walspool logs, as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def beside_other_writers(do: Callable[[], T]) -> T:
    """``do()``, tried again while state.db is locked, for ``SETTLE_SECONDS``: another
    process writing state.db (a second gateway, its drain or retry) may hold its lock
    past the gateway connection's busy timeout (0.20 runs state.db in rollback-journal
    mode on this SQLite, where a write keeps readers and other writers out), as an
    operator's statement beside a running gateway waits for it."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        try:
            return do()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def messages(db: Any, session_id: str) -> list[dict[str, Any]]:
    """A session's rows in state.db, read through the gateway's ``SessionDB``
    (``beside_other_writers``)."""
    return beside_other_writers(lambda: db.get_messages(session_id))


def sql(db: Any, statement: str) -> None:
    """``statement`` on state.db through the gateway's own connection (a trigger that
    breaks every insert, dropped to heal), ``beside_other_writers``."""

    def run() -> None:
        with db._lock:
            db._conn.execute(statement)

    beside_other_writers(run)


#: The line ``healed`` logs: what follows it says how the heal went.
HEALED = "test: state.db healed"


def healed(db: Any) -> None:
    """``HEAL`` on state.db (``sql``); from here walspool logs at DEBUG too (a skipped
    drain says why), after a line ``HEALED``, for a test that fails to show."""
    sql(db, HEAL)
    logging.getLogger("walspool").setLevel(logging.DEBUG)
    logging.getLogger("walspool").info(HEALED)


def traffic(n: int) -> dict[str, list[dict[str, Any]]]:
    """What real traffic looks like: each turn is a user message with a whole-second
    timestamp and an assistant reply stamped with the same time; identical messages
    ("ok") within a second."""
    now = int(time.time())
    sent: dict[str, list[dict[str, Any]]] = {}
    for sid in SESSIONS:
        rows = []
        for i in range(n):
            content = "ok" if i % 50 == 7 else f"{sid}-{i}"
            role = "user" if i % 2 == 0 else "assistant"
            rows.append({"role": role, "content": content, "timestamp": now + i // 2})
        sent[sid] = rows
    return sent


#: The modes that run ``during_an_outage`` and then heal it (see the module).
OUTAGE_MODES = (
    "outage",
    "rewrite",
    "drop-tickets",
    "operator",
    "beside",
    "spool-locked",
    "spool-deleted",
)


async def together(stage: str) -> None:
    """Wait until every process named by ``WALSPOOL_TEST_TOGETHER`` reached ``stage``
    (nothing to wait for without it); the gateway's loop runs meanwhile."""
    meeting = os.environ.get("WALSPOOL_TEST_TOGETHER")
    if not meeting:
        return
    where, count = meeting.rsplit(":", 1)
    here = Path(where) / stage
    here.mkdir(parents=True, exist_ok=True)
    (here / SESSIONS[0]).touch()
    deadline = time.monotonic() + MEET_SECONDS
    while len(list(here.iterdir())) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other processes never reached {stage}")
        await asyncio.sleep(0.01)


async def during_an_outage(
    store: Any, n: int, before: Any = None, last: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``n`` messages (``traffic``) to each session (``last`` to the last one, when
    given), made in state.db first, while every insert fails (the outage stays);
    ``before(i)`` runs before the ``i``-th of each session. What was sent. Each is
    appended on a worker thread, as the gateway's own handlers do
    (``AsyncSessionStore``): its loop runs meanwhile, and its liveness watchdog ends a
    process whose loop stalls behind a write waiting for state.db."""
    db = store._db
    for sid in SESSIONS:
        db.create_session(sid, "telegram")
    sent = traffic(n)
    if last is not None:
        sent[SESSIONS[-1]] = sent[SESSIONS[-1]][:last]
    sql(db, BREAK)
    for i in range(n):
        if before is not None:
            before(i)
        for sid in SESSIONS:
            if i < len(sent[sid]):
                await asyncio.to_thread(store.append_to_transcript, sid, sent[sid][i])
    return sent


def linked(runner: Any) -> dict[str, Any]:
    """How walspool is linked into this gateway, as seen from outside it."""
    store = runner.session_store
    bound = getattr(store.append_to_transcript, "__self__", None)
    module = sys.modules.get("gateway.shutdown_flush")
    return {
        "store_linked": isinstance(bound, getattr(sys.modules.get("walspool.hermes"), "Link", ())),
        "shutdown_flush": getattr(module, "__name__", None),
        # What walspool's register did here (None: never called).
        "registered": getattr(sys.modules.get("walspool.plugin"), "_registered", None),
        # Where the walspool the gateway loaded comes from (a clone, an installed wheel).
        "walspool_file": getattr(sys.modules.get("walspool"), "__file__", None),
    }


def gateway_recovery_after_start() -> None:
    """What the gateway's own start does once ``runner.start()`` has returned: 0.20's
    ``start_gateway`` recovers the spool then (0.19.0's link and 0.22 do inside it)."""
    import inspect

    import gateway.run

    if "recover_pending_to_db()" in inspect.getsource(gateway.run.start_gateway):
        from gateway.shutdown_flush import recover_pending_to_db

        recover_pending_to_db()


async def run(mode: str, n: int, after: str) -> dict[str, Any]:
    from gateway.run import GatewayRunner

    # ``locked-start``: another replay holds the spool before the gateway starts.
    holder = LockHolder("replay") if mode == "locked-start" else None
    runner = GatewayRunner()
    await runner.start()
    result: dict[str, Any] = {"before": linked(runner)}
    store = runner.session_store
    if mode == "stop":
        result.update(await stop_during_outage(runner, n))
        return result
    if mode == "stop-refused":
        result.update(await stop_with_a_slot_refused(runner, n))
        return result
    if mode == "in-flight":
        result.update(await stop_with_a_write_in_flight(runner, n))
        return result
    if mode == "long-write":
        result.update(await stop_during_a_long_write(runner, n))
        return result
    if mode == "values":
        result.update(await odd_values(store))
        await runner.stop()
        return result
    if mode == "sdk-object":
        result.update(await an_sdk_object(store))
        await runner.stop()
        return result
    if mode == "kill":
        await killed_in_the_drain(store, n, int(after))  # never returns: SIGKILLed
    if mode in ("memory", "memory-past"):
        await holding_in_memory(store, n, after, locked=mode == "memory")
        await runner.stop()
        return result
    if mode == "full":
        result.update(await on_a_full_disk(store, n))
        await runner.stop()
        return result
    if mode in ("held-start", "locked-start"):
        gateway_recovery_after_start()
    if mode in ("held-replay", "held-quiet", "held-start", "locked-start"):
        restarted = mode in ("held-start", "locked-start")
        quiet = mode == "held-quiet"
        result.update(await beside_a_held_replay_lock(store, n, restarted, holder, quiet=quiet))
        await runner.stop()
        return result
    if mode == "locked-heal-stop":
        result.update(await heal_beside_a_locked_spool(store, n))
    if mode == "statedb-locked-quiet":
        result.update(await heal_beside_a_locked_state_db(store, n))
        await runner.stop()
        return result
    if mode in ("outage-stop", "deleted-stop"):
        sent = await during_an_outage(store, n)
        if mode == "deleted-stop":
            result["deleted_rows"] = delete_the_spool(runner)
        await runner.stop()
        result["sent"] = {sid: [(m["role"], m["content"]) for m in sent[sid]] for sid in SESSIONS}
        return result
    if mode in OUTAGE_MODES:
        db = store._db
        beside = replays_beside(db.db_path) if mode == "beside" else None
        lock = LockHolder("write") if mode == "spool-locked" else None

        def before(i: int) -> None:
            if lock is not None and i == n // 2:
                lock.release()
            if mode == "spool-deleted" and i == 2 * n // 3:
                result["deleted_rows"] = delete_the_spool(runner)

        await together("outage")
        sent = await during_an_outage(store, n, before)
        if beside is not None:
            result["replays"] = beside()
        result["during"] = {sid: len(messages(db, sid)) for sid in SESSIONS}
        if mode == "rewrite":
            result["rewritten"] = store.rewrite_transcript("s1", [])
            sent["s1"] = []
        if mode == "operator":
            result["replay_status"] = operator_replay(db.db_path)
        await together("heal")
        healed(db)
        if after == "message" or mode != "outage":
            await one_more_each(store, sent)
        if mode == "spool-deleted":  # fewer land than were sent: each session's last, then
            await settle_last(db)
        else:
            await settle(db, sent)
        if mode == "drop-tickets":
            # An operator drops the table of replay tickets with the sqlite3 shell.
            other = sqlite3.connect(db.db_path, timeout=30)
            other.execute("DROP TABLE IF EXISTS walspool_landed")
            other.commit()
            other.close()
            for sid in SESSIONS:
                after_drop = {"role": "user", "content": f"{sid}-after", "timestamp": 0}
                sent[sid].append(after_drop)
                store.append_to_transcript(sid, after_drop)
            await settle(db, sent)
        result.update(sent_and_landed(db, sent))
    await runner.stop()
    return result


def delete_the_spool(runner: Any) -> dict[str, int]:
    """``spool-deleted``: once what was handed to the spool is committed, the rows each
    session has in it; then its files are deleted, as ``rm spool.db*`` would."""
    home = os.environ["HERMES_HOME"]
    path = f"{home}/spool.db"
    gateways = sys.modules["walspool.gateways"]
    linked = getattr(runner, gateways.MARK, None)  # 0.19.0: (link, the spool it writes)
    for spool in filter(None, [linked and linked[1], _drop_in_spool()]):
        spool.flush()  # the hand-offs still in the writer's queue
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = dict(conn.execute("SELECT session_id, count(*) FROM records GROUP BY 1"))
    finally:
        conn.close()
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    return {sid: rows.get(sid, 0) for sid in SESSIONS}


def _drop_in_spool() -> Any:
    module = sys.modules.get("gateway.shutdown_flush")
    if getattr(module, "__name__", None) != "walspool.shutdown_flush":
        return None
    return module.shared_spool()


class LockHolder:
    """Another process holding one of the spool's locks (``tests/_lock_holder.py``:
    ``write``, its SQLite write lock, as an operator's ``sqlite3`` shell in a
    transaction; ``replay``, its replay lock, as a running ``walspool replay``) until
    ``release``. The spool is made first if the gateway has not made it yet. With
    ``path``, that database's lock instead (``exclusive``: state.db's, as another
    gateway's write holds it)."""

    def __init__(self, kind: str, path: str | None = None) -> None:
        import subprocess

        import walspool

        path = path or f"{os.environ['HERMES_HOME']}/spool.db"
        if kind == "write":
            walspool.Spool(path).close()
        self.process = subprocess.Popen(
            [sys.executable, str(LOCK_HOLDER), kind, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "locked"

    def release(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "released"
        self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


async def beside_a_held_replay_lock(
    store: Any, n: int, restarted: bool, holder: LockHolder | None, *, quiet: bool = False
) -> dict[str, Any]:
    """``held-replay``: spooled rows of an outage wait while another process holds the
    spool's replay lock; the live messages sent meanwhile must wait behind them.
    ``held-quiet``: the same, and nothing is sent once the lock is let go.
    ``held-start``, ``locked-start`` (``restarted``): the rows are from the last run,
    held at this start; ``holder``: the lock held from before the start."""
    db = store._db
    sent: dict[str, list[dict[str, Any]]] = {sid: [] for sid in SESSIONS}
    if not restarted:
        sent = await during_an_outage(store, n)
    # The replay lock is taken before state.db heals: no drain can run in between.
    fresh = None
    if holder is not None:
        # The start found the replay lock held: it says so once its recovery is over.
        await wait_for_line(LEFT_TO_THE_RUNNING_REPLAY)
    holder = holder or LockHolder("replay")
    try:
        healed(db)
        if restarted and fresh is None and holder is not None:
            fresh = await a_fresh_session_writes(store)
        await one_more_each(store, sent, "while-held")
        while_held = {sid: len(messages(db, sid)) for sid in SESSIONS}
        holder.release()
    finally:
        holder.kill()
    if not quiet:
        await one_more_each(store, sent)
    # A restart's rows were sent by the last run: n of them a session, before these.
    earlier = n if restarted else 0
    await settle(db, {sid: [{}] * earlier + rows for sid, rows in sent.items()})
    return {"while_held": while_held, "fresh_while_held": fresh, **sent_and_landed(db, sent)}


#: What a start says when another replay holds the spool (``locked-start``).
LEFT_TO_THE_RUNNING_REPLAY = "Another replay of "


async def wait_for_line(text: str) -> None:
    """Until walspool has logged a line holding ``text`` (``Lines``), bounded."""
    deadline = time.monotonic() + SETTLE_SECONDS
    handlers = [h for h in logging.getLogger("walspool").handlers if isinstance(h, Lines)]
    while not any(text in line for h in handlers for line in h.lines):
        if time.monotonic() > deadline:
            raise TimeoutError(f"walspool never logged {text!r}")
        await asyncio.sleep(0.01)


async def a_fresh_session_writes(store: Any) -> int:
    """A session with nothing spooled gets a message (on a worker thread, as the
    gateway's handlers send): how many of its rows state.db holds once that call
    returned and the gateway had ``SETTLE_SECONDS`` to write it (it has no reason to wait
    for the replay that holds the spool)."""
    db = store._db
    db.create_session("fresh", "telegram")
    message = {"role": "user", "content": "fresh", "timestamp": int(time.time())}
    await asyncio.to_thread(store.append_to_transcript, "fresh", message)
    deadline = time.monotonic() + SETTLE_SECONDS
    while not messages(db, "fresh") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return len(messages(db, "fresh"))


async def heal_beside_a_locked_spool(store: Any, n: int) -> dict[str, Any]:
    """``locked-heal-stop``: an outage of ``n`` messages a session; state.db heals while
    another process holds the spool's write lock (an operator's ``sqlite3`` shell in a
    transaction), and each session's next message meets it. The lock is let go and
    nothing more is sent: what the gateway keeps in memory now waits for the stop."""
    db = store._db
    sent = await during_an_outage(store, n)
    holder = LockHolder("write")
    try:
        healed(db)
        await one_more_each(store, sent, threads=True)
        holder.release()
    finally:
        holder.kill()
    return sent_and_landed(db, sent)


async def heal_beside_a_locked_state_db(store: Any, n: int) -> dict[str, Any]:
    """``statedb-locked-quiet``: an outage of ``n`` messages a session; state.db heals,
    then another process takes its lock (``BEGIN EXCLUSIVE``, as a second gateway's
    write holds it: on 0.20's rollback journal readers wait too) and each session's next
    message meets it. The lock goes ``HOLD_SECONDS`` after it was taken and nothing more
    is sent: everything must land all the same."""
    import threading

    db = store._db
    sent = await during_an_outage(store, n)
    healed(db)
    holder = LockHolder("exclusive", str(db.db_path))
    letting_go = threading.Timer(HOLD_SECONDS, holder.release)
    letting_go.start()
    try:
        await one_more_each(store, sent, threads=True)
        letting_go.join()
    finally:
        letting_go.cancel()
        holder.kill()
    await settle(db, sent)
    return sent_and_landed(db, sent)


#: Seconds ``statedb-locked-quiet`` holds state.db's lock: past 0.20's busy timeout
#: of 1 s, so the first sessions' drains give up on it.
HOLD_SECONDS = 2.5
#: Holds one of a spool's locks in another process until told (``tests/_lock_holder.py``).
LOCK_HOLDER = Path(__file__).resolve().parent.parent / "_lock_holder.py"


async def on_a_full_disk(store: Any, n: int) -> dict[str, Any]:
    """``full``: ``n`` messages to each session while the disk is full, then one more
    each once there is room; what was sent and what state.db holds once every
    session's last message landed."""
    import errno

    home = os.environ["HERMES_HOME"]
    db = store._db
    for sid in SESSIONS:
        db.create_session(sid, "telegram")
    sent = traffic(n)
    filler = f"{home}/filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):  # to the last byte tmpfs gives
            try:
                while True:
                    os.write(fd, b"x" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    for i in range(n):
        for sid in SESSIONS:
            store.append_to_transcript(sid, sent[sid][i])
    during = {sid: len(messages(db, sid)) for sid in SESSIONS}
    os.unlink(filler)
    await one_more_each(store, sent)
    await settle_last(db)
    return {"during": during, **sent_and_landed(db, sent)}


#: Holds a SQLite database's write lock (``argv[1]``) from "locked" to a line on stdin.
WRITE_LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


def turns_queued_in_an_outage(runner: Any, n: int) -> tuple[Any, str, list[dict[str, Any]]]:
    """Session ``s1`` gets ``n`` turns while every insert fails (they wait in the
    store's queue): the store, the session, what was sent."""
    store = runner.session_store
    sid = "s1"
    store._db.create_session(sid, "telegram")
    sent = turn_rows(sid, n)
    sql(store._db, BREAK)
    for message in sent:
        store.append_to_transcript(sid, message)
    return store, sid, sent


def one_more_being_written(
    store: Any,
    sid: str,
    sent: list[dict[str, Any]],
    content: str,
    held: threading.Event | None = None,
) -> threading.Thread:
    """One more message to ``sid`` (added to ``sent``) from a thread of its own; returns
    once a write into SessionDB has begun. With ``held``, that first write waits for it
    (or ``SETTLE_SECONDS``), whichever thread makes it: the message's own gateway thread
    (0.20, 0.22), the link's probe of the failing session (0.19.0: its gateway thread
    only queues). The thread, to join."""
    import hermes_state

    entered, first = threading.Event(), threading.Lock()
    original = hermes_state.SessionDB.append_message

    def append_message(self: Any, *args: Any, **kwargs: Any) -> Any:
        if first.acquire(blocking=False):
            entered.set()
            if held is not None:
                held.wait(SETTLE_SECONDS)
        return original(self, *args, **kwargs)

    hermes_state.SessionDB.append_message = append_message
    message = {"role": "user", "content": content, "timestamp": int(time.time())}
    sent.append(message)
    writer = threading.Thread(target=store.append_to_transcript, args=(sid, message))
    writer.start()
    assert entered.wait(SETTLE_SECONDS), "no write began"
    return writer


async def stop_with_a_write_in_flight(runner: Any, n: int) -> dict[str, Any]:
    """``in-flight``: queued turns, then a write a gateway thread is inside of (state.db
    locked by another process) when the gateway stops gracefully."""
    import subprocess

    store, sid, sent = turns_queued_in_an_outage(runner, n)
    db = store._db
    holder = subprocess.Popen(
        [sys.executable, "-c", WRITE_LOCK_HOLDER, str(db.db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "locked"
        # The trigger goes with the lock held elsewhere: from here the outage is the lock.
        other = sqlite3.connect(db.db_path, timeout=0.1, isolation_level=None)
        writer = one_more_being_written(store, sid, sent, "in flight")
        await runner.stop()
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(SETTLE_SECONDS)
    writer.join(SETTLE_SECONDS)
    other.execute(HEAL)  # the outage's trigger, for the next start
    other.close()
    return {"session_id": sid, "sent": [(m["role"], m["content"]) for m in sent]}


async def stop_during_a_long_write(runner: Any, n: int) -> dict[str, Any]:
    """``long-write``: queued turns and one more message, then the next write of the
    session held inside SessionDB's write until the graceful stop has returned (or
    ``SETTLE_SECONDS``, should a stop wait for it that long); then it goes on, and fails
    as the outage goes on."""
    import threading

    store, sid, sent = turns_queued_in_an_outage(runner, n)
    stopped = threading.Event()
    writer = one_more_being_written(store, sid, sent, "held in flight", held=stopped)
    try:
        await runner.stop()
    finally:
        stopped.set()
    writer.join(SETTLE_SECONDS)
    return {"session_id": sid, "sent": [(m["role"], m["content"]) for m in sent]}


#: The pending slot of ``stop``: a user message that arrived while the agent was busy.
SLOT_TEXT = "sent while the agent was busy"


async def stop_during_outage(runner: Any, n: int) -> dict[str, Any]:
    """``stop``: queued turns, then a pending slot, then a graceful stop, state.db broken."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    store = runner.session_store
    entry = store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id="42"))
    sid = entry.session_id
    sql(store._db, BREAK)
    turns = [(m["role"], m["content"]) for m in turn_rows(sid, n)]
    for message in turn_rows(sid, n):
        store.append_to_transcript(sid, message)
    runner._pending_messages[entry.session_key] = SLOT_TEXT
    await runner.stop()
    return {"session_id": sid, "turns": turns, "slot": SLOT_TEXT}


#: ``stop-refused``: a pending slot past the spool's payload limit (64 MiB, the default).
BIG_SLOT_BYTES = 64 * 1024 * 1024 + 1


async def stop_with_a_slot_refused(runner: Any, n: int) -> dict[str, Any]:
    """``stop-refused``: two sessions' queued turns, then a pending slot each (the
    first past the spool's payload limit), then a graceful stop, state.db broken."""
    from gateway.config import Platform
    from gateway.session import SessionSource

    store = runner.session_store
    entries = [
        store.get_or_create_session(SessionSource(platform=Platform.TELEGRAM, chat_id=chat))
        for chat in ("41", "42")
    ]
    sql(store._db, BREAK)
    result: dict[str, Any] = {"sessions": [], "turns": [], "keys": [], "slot": SLOT_TEXT}
    for entry in entries:
        for message in turn_rows(entry.session_id, n):
            store.append_to_transcript(entry.session_id, message)
        result["sessions"].append(entry.session_id)
        result["keys"].append(entry.session_key)
        result["turns"].append([(m["role"], m["content"]) for m in turn_rows(entry.session_id, n)])
    runner._pending_messages[entries[0].session_key] = "x" * BIG_SLOT_BYTES
    runner._pending_messages[entries[1].session_key] = SLOT_TEXT
    await runner.stop()
    return result


#: ``values``: a turn whose reply holds values a TEXT column cannot take as they are.
ODD_VALUES = [
    {"role": "user", "content": "how big?"},
    {"role": "assistant", "content": 2**70},
    {"role": "assistant", "content": "and a list", "tool_calls": [{"id": "t1", "n": 2**70}]},
    {"role": "user", "content": "thanks"},
]


async def odd_values(store: Any) -> dict[str, Any]:
    """``values``: ``ODD_VALUES`` sent to a healthy session; what state.db holds."""
    store._db.create_session("s1", "telegram")
    for message in ODD_VALUES:
        store.append_to_transcript("s1", dict(message))
    await settle(store._db, {"s1": ODD_VALUES, "s2": [], "s3": []})
    return {"landed": [(m["role"], m["content"]) for m in messages(store._db, "s1")]}


class SdkToolCall:
    """A tool call as an SDK object, not a dict: no JSON serialiser takes it."""

    def __init__(self, call_id: str) -> None:
        self.id = call_id

    def __repr__(self) -> str:
        return f"SdkToolCall({self.id!r})"


async def an_sdk_object(store: Any) -> dict[str, Any]:
    """``sdk-object``: on a healthy session, a reply whose tool call is an SDK object,
    then the next turn: what state.db holds of the session once the next turn had
    ``SETTLE_SECONDS`` to land."""
    db = store._db
    db.create_session("s1", "telegram")
    sent = [
        {"role": "user", "content": "call a tool"},
        {"role": "assistant", "content": "calling", "tool_calls": [SdkToolCall("t1")]},
        {"role": "user", "content": "next turn"},
    ]
    for message in sent:
        await asyncio.to_thread(store.append_to_transcript, "s1", message)
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        if any(m["content"] == "next turn" for m in messages(db, "s1")):
            break
        await asyncio.sleep(0.05)
    return {"landed": [(m["role"], m["content"]) for m in messages(db, "s1")]}


def turn_rows(sid: str, n: int) -> list[dict[str, Any]]:
    """``n`` rows of agent turns (a user message and the reply, one timestamp per turn)."""
    now = int(time.time())
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"{sid} turn {i}",
            "timestamp": now + i // 2,
        }
        for i in range(n)
    ]


async def killed_in_the_drain(store: Any, n: int, commits: int) -> None:
    """``kill``: an outage past the cap, its traffic saved to ``OUT``; then heal, and
    after the ``commits``-th state.db commit from there (the drain's: the spooled rows
    go first), ``OUT.landed`` is made and the process waits to be SIGKILLed."""
    import threading

    import hermes_state

    db = store._db
    sent = await during_an_outage(store, n)
    with open(OUT, "w") as f:
        json.dump({sid: [(m["role"], m["content"]) for m in rows] for sid, rows in sent.items()}, f)
    original = hermes_state.SessionDB.append_message
    seen = [0]

    def append_message(self: Any, *args: Any, **kwargs: Any) -> Any:
        row = original(self, *args, **kwargs)
        seen[0] += 1
        if seen[0] == commits:
            with open(f"{OUT}.landed", "w"):
                pass
            threading.Event().wait()
        return row

    hermes_state.SessionDB.append_message = append_message
    healed(db)
    for sid in SESSIONS:  # 0.20 and 0.22 drain at a session's next write
        store.append_to_transcript(sid, {"role": "user", "content": f"{sid}-last"})
    threading.Event().wait()


async def holding_in_memory(store: Any, n: int, then: str, locked: bool) -> None:
    """``memory``: ``n`` messages a session while state.db refuses them and another
    process holds the spool's write lock (``locked``), so that each gateway keeps them in
    its queues (0.22 spools a stalled backlog, unless its spool is locked); the lock is
    let go. ``OUT`` gets the process id, each session's queue length and what was sent;
    then the process waits for its SIGKILL (``kill``), or for ``OUT.stop`` (``stop``:
    then it stops)."""
    holder = LockHolder("write") if locked else None
    try:
        # Unlocked, the last session gets fewer than the cap: every gateway holds them.
        sent = await during_an_outage(store, n, last=None if locked else MEMORY_PAST_LAST)
        if holder is not None:
            holder.release()
    finally:
        if holder is not None:
            holder.kill()
    with store._transcript_retry_lock:
        queues = {sid: len(store._dirty_transcripts.get(sid) or ()) for sid in SESSIONS}
    sent_pairs = {sid: [(m["role"], m["content"]) for m in sent[sid]] for sid in SESSIONS}
    with open(f"{OUT}.tmp", "w") as f:
        json.dump({"pid": os.getpid(), "queues": queues, "sent": sent_pairs}, f)
    os.rename(f"{OUT}.tmp", OUT)
    while then == "kill" or not os.path.exists(f"{OUT}.stop"):
        await asyncio.sleep(0.05)


def replays_beside(state_db: Any) -> Any:
    """``beside``: the operator's ``walspool replay`` run over and over beside the gateway
    (each takes the spool's write lock for moments) until the returned function is
    called; it returns how many ran."""
    import threading

    stop = threading.Event()
    ran = [0]

    def loop() -> None:
        while not stop.is_set():
            operator_replay(state_db)
            ran[0] += 1

    thread = threading.Thread(target=loop)
    thread.start()

    def done() -> int:
        stop.set()
        thread.join()
        return ran[0]

    return done


def operator_replay(state_db: Any) -> int:
    """``operator``: the operator's ``walspool replay`` into the broken state.db, from
    beside the running gateway, waiting its turn while a drain of the gateway's holds
    the replay lock (``--wait``); its exit status."""
    import subprocess

    home = os.environ["HERMES_HOME"]
    wait = str(SETTLE_SECONDS)
    done = subprocess.run(
        [sys.executable, "-m", "walspool", "replay", f"{home}/spool.db", "--into", str(state_db)]
        + ["--wait", wait],
        capture_output=True,
        text=True,
        timeout=SETTLE_SECONDS * 4,
    )
    return done.returncode


async def settle(db: Any, sent: dict[str, list[dict[str, Any]]]) -> None:
    """Wait, at most ``SETTLE_SECONDS``, until state.db holds as many rows as were sent
    to each session (the test then compares them)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        if all(len(messages(db, sid)) >= len(sent[sid]) for sid in SESSIONS):
            return
        await asyncio.sleep(0.05)


async def settle_last(db: Any) -> None:
    """Wait, at most ``SETTLE_SECONDS``, until each session's last message (``PREFIX1-last``
    and so on, sent after everything else) is in state.db."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and not all(
        any(m["content"] == f"{sid}-last" for m in messages(db, sid)) for sid in SESSIONS
    ):
        await asyncio.sleep(0.05)


async def one_more_each(
    store: Any, sent: dict[str, list[dict[str, Any]]], label: str = "last", *, threads: bool = False
) -> None:
    """One more message to each session (``SESSIONS``), ``PREFIXn-label``, kept in
    ``sent``; each on a thread of its own with ``threads`` (a call that may wait for a
    lock held elsewhere, while the loop goes on)."""
    for sid in SESSIONS:
        message = {"role": "user", "content": f"{sid}-{label}", "timestamp": int(time.time())}
        sent[sid].append(message)
        if threads:
            await asyncio.to_thread(store.append_to_transcript, sid, message)
        else:
            store.append_to_transcript(sid, message)


def sent_and_landed(db: Any, sent: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What was sent to each session and what state.db holds of it, as (role, content)."""
    return {
        "sent": {sid: [(m["role"], m["content"]) for m in sent[sid]] for sid in SESSIONS},
        "landed": {sid: [(m["role"], m["content"]) for m in messages(db, sid)] for sid in SESSIONS},
    }


#: The file the result is written to (``sys.argv[1]``).
OUT = sys.argv[1] if __name__ == "__main__" else ""


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    after = sys.argv[4] if len(sys.argv) > 4 else "quiet"
    lines = Lines()
    logging.getLogger("walspool").addHandler(lines)
    logging.getLogger("walspool").setLevel(logging.INFO)
    result = asyncio.run(run(mode, n, after))
    result["log"] = lines.lines
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
