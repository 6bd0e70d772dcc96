"""Multi-process load: four processes of eight threads append 100,000 messages to one
spool while a fifth process replays them into a real ``hermes_state.SessionDB``.

Then: none lost, none duplicated, each session's order kept, no "database is locked"
(or any other error) surfaced in any process, and ``walspool check`` passes.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _helpers import ROOT

import walspool
from walspool.cli import main as cli_main

hermes_state = pytest.importorskip("hermes_state")

WORKER = Path(__file__).with_name("_load_worker.py")
PROCESSES, THREADS, SESSIONS_PER_THREAD = 4, 8, 2  # 64 sessions, each owned by one thread
MESSAGES = 100_000
PER_THREAD = MESSAGES // (PROCESSES * THREADS)
TIMEOUT = 600
#: What a caller must never see, whatever the contention.
FORBIDDEN = ("database is locked", "BusyError", "SQLITE_BUSY", "Traceback", "Error:")


def spawn(*args: object, stdin: int | None = None) -> tuple[subprocess.Popen[str], object]:
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc, err


def finish(proc: subprocess.Popen[str], err, what: str) -> str:
    """Wait for a worker; return its stdout after checking its exit and its stderr."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    err.seek(0)
    stderr = err.read()
    err.close()
    assert proc.returncode == 0, (what, proc.returncode, out, stderr[-3000:])
    waits = stderr.count("write lock busy")
    if waits:
        print(f"{what}: waited past the busy timeout {waits} times (retried, not surfaced)")
    for word in FORBIDDEN:
        assert word not in stderr and word not in out, (what, word, stderr[-3000:])
    return out


@pytest.mark.slow
def test_four_appending_processes_and_a_replaying_one(tmp_path):
    spool_path, state_db = tmp_path / "spool" / "spool.db", tmp_path / "state.db"
    sessions = {
        (p, t, k): f"l{p}-{t}-{k}"
        for p in range(PROCESSES)
        for t in range(THREADS)
        for k in range(SESSIONS_PER_THREAD)
    }
    db = hermes_state.SessionDB(db_path=state_db)
    for s in sessions.values():
        db.create_session(s, "telegram")
    db.close()
    walspool.Spool(spool_path).close()  # created once, before the processes race to it

    started = time.monotonic()
    replayer, replayer_err = spawn("replay", spool_path, state_db, stdin=subprocess.PIPE)
    appenders = [
        spawn("append", spool_path, p, THREADS, PER_THREAD, SESSIONS_PER_THREAD)
        for p in range(PROCESSES)
    ]
    try:
        outs = [finish(proc, err, f"appender {p}") for p, (proc, err) in enumerate(appenders)]
        appended = time.monotonic() - started
        assert outs == [f"done {THREADS * PER_THREAD}\n"] * PROCESSES
        replayer.stdin.write("done\n")
        replayer.stdin.flush()
        out = finish(replayer, replayer_err, "replayer")
    finally:
        for proc, _ in [*appenders, (replayer, None)]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
    elapsed = time.monotonic() - started
    assert out.startswith(f"moved {MESSAGES} "), out
    print(
        f"load: {MESSAGES} messages appended in {appended:.1f} s, all replayed in {elapsed:.1f} s"
    )

    conn = sqlite3.connect(state_db)
    try:
        rows = conn.execute("SELECT session_id, content FROM messages ORDER BY id").fetchall()
    finally:
        conn.close()
    assert len(rows) == MESSAGES
    got: dict[str, list[str]] = {}
    for session_id, content in rows:
        got.setdefault(session_id, []).append(content)
    for (p, t, k), s in sessions.items():
        want = [f"{p}:{t}:{i}" for i in range(k, PER_THREAD, SESSIONS_PER_THREAD)]
        assert got.get(s) == want, s  # none lost, none twice, append order
    assert cli_main(["check", str(spool_path)]) == 0
    with walspool.Spool(spool_path) as spool:
        assert spool.stats().rows == 0
