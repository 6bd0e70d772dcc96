"""Worker processes for the multi-process load test.

    python tests/_load_worker.py append SPOOL PROCESS THREADS PER_THREAD SESSIONS_PER_THREAD
    python tests/_load_worker.py replay SPOOL STATE_DB

``append``: THREADS threads each append PER_THREAD messages of about 500 bytes,
round-robin over sessions of their own (``l<PROCESS>-<T>-<K>``); one thread in four
uses ``submit`` (windows of 32), the others ``append``. Prints ``done N`` and exits 0,
or prints the first error and exits 1.

``replay``: moves rows into ``state.db`` (a real ``hermes_state.SessionDB``) while the
appenders run; when a line arrives on stdin (the appenders are done) it replays until
the spool is empty, prints ``moved N`` and exits 0. A replay that holds rows is an
error (every session exists), and exits 1.
"""

from __future__ import annotations

import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

import walspool

DURABILITY = "full"
PAD = "x" * 440  # a message of about 500 bytes of JSON
#: How long the replayer waits for the "done" line when a replay found nothing.
IDLE_WAIT = 0.05


def message(p: int, t: int, i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"{p}:{t}:{i}", "pad": PAD}


def main_append(spool_path: str, p: str, threads: str, per_thread: str, sessions: str) -> int:
    proc, count, spt = int(p), int(per_thread), int(sessions)
    spool = walspool.Spool(spool_path, durability=DURABILITY)
    errors: list[BaseException] = []
    done = [0] * int(threads)

    def work(t: int) -> None:
        mine = [f"l{proc}-{t}-{k}" for k in range(spt)]
        try:
            if t % 4 == 3:
                for lo in range(0, count, 32):
                    futures = [
                        spool.submit(mine[i % spt], message(proc, t, i))
                        for i in range(lo, min(lo + 32, count))
                    ]
                    for future in futures:
                        future.result()
                        done[t] += 1
            else:
                for i in range(count):
                    spool.append(mine[i % spt], message(proc, t, i))
                    done[t] += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(int(threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    spool.close()
    if errors:
        print(f"error {type(errors[0]).__name__}: {errors[0]}", flush=True)
        return 1
    print(f"done {sum(done)}", flush=True)
    return 0


def main_replay(spool_path: str, state_db: str) -> int:
    from hermes_state import SessionDB

    from walspool.replay.replayer import Replayer
    from walspool.replay.sinks import SessionDBSink

    db = SessionDB(db_path=Path(state_db))
    # state.db's own durability is not under test; NORMAL (WAL) halves its fsyncs.
    with db._lock:
        db._conn.execute("PRAGMA synchronous=NORMAL")
    spool = walspool.Spool(spool_path, durability=DURABILITY)
    replayer = Replayer(spool, SessionDBSink(db))
    moved, replays, started = 0, 0, time.monotonic()
    appenders_done = False
    while True:
        report = replayer.replay()
        replays += 1
        if report.held:
            print(f"held {report.held}: {report.errors}", flush=True)
            return 1
        moved += report.moved
        if report.moved:
            continue
        if appenders_done:
            if spool.stats().rows == 0:
                break
            continue
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_WAIT)
        if ready:
            sys.stdin.readline()
            appenders_done = True
    spool.close()
    db.close()
    print(f"moved {moved} replays {replays} seconds {time.monotonic() - started:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    sys.exit(main_append(*args) if mode == "append" else main_replay(*args))
