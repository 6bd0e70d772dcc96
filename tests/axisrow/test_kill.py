"""SIGKILL of a real axisrow 0.20 gateway process right after a state.db commit, in the
live drain (the gateway's own callback) and in startup recovery (``recover_pending_to_db()``
with no arguments, as its gateway/run.py calls it).

On 0.20 the gateway writes a session's in-memory backlog (the newest 200) before it
drains the spooled (older) rows: that order is the gateway's, with any module. What
walspool promises here is that every message is in state.db exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _gateways_common import line_of, run, run_and_kill, spool_rows

WORKER = Path(__file__).resolve().parent / "_worker.py"
CAP = 200


def start(home: Path, sessions: int) -> dict[str, Any]:
    return json.loads(line_of(run(WORKER, home, "start", sessions), "ROWS "))


@pytest.mark.parametrize("kill_at", [1, 51])
def test_kill_during_the_live_drain_loses_and_duplicates_nothing(tmp_path, kill_at):
    home = tmp_path / "hermes"
    n = CAP + 60  # 60 evictions per session
    run_and_kill(WORKER, home, "live", 2, n, kill_at)  # outage, heal, drain: killed in it
    result = start(home, 2)
    for sid in ("s0", "s1"):
        rows = result["rows"][sid]
        assert len(rows) == len(set(rows)), [r for r in rows if rows.count(r) > 1][:5]
        assert rows[-1] == f"{sid}-last"
        # The spooled (evicted) rows are all there; s0's in-memory backlog was written
        # before its drain was killed, s1's was still in memory (lost, as released).
        assert {f"{sid}-{i}" for i in range(60)} <= set(rows)
    assert set(result["rows"]["s0"]) >= {f"s0-{i}" for i in range(n)}
    assert spool_rows(home) == 0


@pytest.mark.parametrize("kill_at", [1, 37])
def test_kill_during_startup_recovery_loses_and_duplicates_nothing(tmp_path, kill_at):
    home = tmp_path / "hermes"
    n = CAP + 30
    run(WORKER, home, "outage", 3, n)  # 30 evictions per session, the rest lost in memory
    assert spool_rows(home) == 90
    run_and_kill(WORKER, home, "start", 3, kill_at)
    result = start(home, 3)
    for sid in ("s0", "s1", "s2"):
        assert result["rows"][sid] == [*(f"{sid}-{i}" for i in range(30)), f"{sid}-last"]
    assert spool_rows(home) == 0


def test_a_kill_during_an_untracked_drain_quarantines_the_row_never_writes_it_twice(tmp_path):
    """A drain callback walspool cannot track (not the gateway's own): the row being
    written when the process dies is quarantined for an operator, not written again."""
    import walspool

    home = tmp_path / "hermes"
    n = CAP + 60
    run_and_kill(WORKER, home, "live-foreign", 1, n, 1)
    rows = start(home, 1)["rows"]["s0"]
    assert len(rows) == len(set(rows))  # nothing twice
    assert set(rows) >= {f"s0-{i}" for i in range(n)}  # the quarantined one had landed
    with walspool.Spool(home / "spool.db") as spool:
        (kept,) = spool.records()
    assert kept.message["content"] == "s0-0" and "cannot tell" in (kept.last_error or "")
