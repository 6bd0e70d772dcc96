"""Helpers for the tests on the newer gateway (import as ``from _fork import ...``)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _gateways_common import TRANSIENT, break_db, heal_db, own_module  # noqa: F401 - shared

#: One it treats as corruption (handle quarantined, every message diverted).
CORRUPT = "database disk image is malformed"


#: The fork's own ``gateway/shutdown_flush.py``, loaded under another name.
upstream_module = own_module


def new_store(home: Path) -> Any:
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    return SessionStore(home / "sessions", GatewayConfig())


def close_store(store: Any) -> None:
    store.close_all_db_handles()
    from hermes_state_registry import release_or_close

    release_or_close(store._db)


#: A second process holding state.db's write lock from a line on stdin to the next (an
#: operator's ``sqlite3 state.db`` shell in a transaction, another process's VACUUM).
STATE_DB_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
sys.stdin.readline()
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""
#: Bound on every wait for the replay or the holder (start, first row, lock, exit).
CHILD_TIMEOUT = 120.0


class RunningReplay:
    """A real ``walspool replay SPOOL --into STATE_DB`` process, held in the middle of
    its replay: another process holds state.db's write lock, so its next write waits
    (hermes' own patience for a transcript write, 60 s)."""

    def __init__(self, replay: Any, holder: Any) -> None:
        self.replay = replay
        self.holder = holder

    def finish(self) -> tuple[int, dict[str, Any]]:
        """Let go of state.db; the replay's exit status and its ``--json`` report."""
        if self.holder.poll() is None:
            self.holder.stdin.write("go\n")
            self.holder.stdin.flush()
            self.holder.wait(CHILD_TIMEOUT)
        out, err = self.replay.communicate(timeout=CHILD_TIMEOUT)
        assert out, err[-3000:]
        return self.replay.returncode, json.loads(out)


@contextlib.contextmanager
def replay_running(home: Path) -> Iterator[RunningReplay]:
    """``walspool replay <home>/spool.db --into <home>/state.db`` running in another
    process, stopped by a state.db lock right after its first row landed."""
    state_db = home / "state.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", STATE_DB_HOLDER, str(state_db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "walspool",
            "replay",
            str(home / "spool.db"),
            "--into",
            str(state_db),
            "--json",
            "--progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HERMES_HOME": str(home)},
    )
    try:
        _wait_for_first_row(replay)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("lock\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "locked\n"
        yield RunningReplay(replay, holder)
    finally:
        for proc in (holder, replay):
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=CHILD_TIMEOUT)


def _wait_for_first_row(replay: Any) -> None:
    """Wait for the replay's first progress line (drawn once its first row landed)."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    seen = b""
    fd = replay.stderr.fileno()
    while b"replay: 1/" not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"the replay wrote no row: {seen[-3000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"the replay exited early: {replay.wait(5)} {seen[-3000:]!r}"
            seen += chunk
