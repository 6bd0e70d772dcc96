"""SIGKILL of a real gateway process during the live drain and during startup recovery.

Each kill lands right after a state.db commit and before the spool forgot the row
(the worst moment: the message is written, its spool row still there). The next
start must leave every spooled message in state.db exactly once, in order.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import _gateways_common as common
import pytest

WORKER = Path(__file__).resolve().parent / "_worker.py"
run = partial(common.run, WORKER)
run_and_kill = partial(common.run_and_kill, WORKER)


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
