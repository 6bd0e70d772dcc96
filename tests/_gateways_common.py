"""What the tests on the newer gateways (0.20 in tests/axisrow, 0.22 in tests/upstream)
share: running a gateway worker process, killing it right after a state.db commit,
and reading the spool it left."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Seconds any one worker step may take before the test fails (a bound, not a sleep).
STEP_TIMEOUT = 120.0


def run(worker: Path, home: Path, *args: object) -> str:
    """Run ``worker HOME ARGS...`` to its end; its stdout."""
    done = subprocess.run(
        [sys.executable, str(worker), str(home), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_and_kill(worker: Path, home: Path, *args: object) -> None:
    """Start the worker, wait for its LANDED line, SIGKILL it, reap it."""
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(home), *map(str, args)],
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


def line_of(out: str, prefix: str) -> str:
    """The rest of the one line of ``out`` that starts with ``prefix``."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    return line[len(prefix) :]


def spool_rows(home: Path) -> int:
    import walspool

    with walspool.Spool(home / "spool.db") as spool:
        return spool.stats().rows
