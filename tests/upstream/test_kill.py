"""SIGKILL of a real gateway process during the live drain and during startup recovery.

Each kill lands right after a state.db commit and before the spool forgot the row
(the worst moment: the message is written, its spool row still there). The next
start must leave every spooled message in state.db exactly once, in order.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).resolve().parent / "_worker.py"
#: Seconds any one worker step may take before the test fails (a bound, not a sleep).
STEP_TIMEOUT = 120.0


def run(home: Path, *args: object) -> str:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(home), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_and_kill(home: Path, *args: object) -> None:
    """Start the worker, wait for its LANDED line, SIGKILL it, reap it."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(home), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + STEP_TIMEOUT
        assert proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the worker never reached the kill point"
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            line = proc.stdout.readline()
            assert line, f"the worker exited early: {proc.wait(5)} {proc.stderr.read()[-3000:]}"
            if line.startswith("LANDED"):
                break
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(STEP_TIMEOUT) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def start(home: Path, sessions: int) -> dict[str, Any]:
    out = run(home, "start", sessions)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("ROWS ")]
    return json.loads(line[len("ROWS ") :])


def spool_rows(home: Path) -> int:
    import walspool

    with walspool.Spool(home / "spool.db") as spool:
        return spool.stats().rows


@pytest.mark.parametrize("kill_at", [1, 37])
def test_kill_during_startup_recovery_loses_and_duplicates_nothing(tmp_path, kill_at):
    home = tmp_path / "hermes"
    run(home, "outage", "corrupt", 3, 30)  # every message diverted to the spool
    assert spool_rows(home) == 90
    run_and_kill(home, "start", 3, kill_at)
    result = start(home, 3)
    for sid in ("s0", "s1", "s2"):
        assert result["rows"][sid] == [*(f"{sid}-{i}" for i in range(30)), f"{sid}-last"]
    assert spool_rows(home) == 0


@pytest.mark.parametrize("kill_at", [1, 45])
def test_kill_during_the_live_drain_loses_and_duplicates_nothing(tmp_path, kill_at):
    home = tmp_path / "hermes"
    run_and_kill(home, "live", 2, 40, kill_at)  # outage, heal, drain: killed in the drain
    result = start(home, 2)
    for sid in ("s0", "s1"):
        rows = result["rows"][sid]
        # The trigger message was only in memory when the process died (as in the
        # released gateway); everything spooled is there exactly once, in order.
        if f"{sid}-trigger" in rows:
            rows.remove(f"{sid}-trigger")
        assert rows == [*(f"{sid}-{i}" for i in range(40)), f"{sid}-last"]
    assert spool_rows(home) == 0
