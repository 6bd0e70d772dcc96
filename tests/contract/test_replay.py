"""The operator's replay (``walspool replay``, installed in the gateway's environment)
with the gateway stopped: a dry run says what would happen without writing, and the
replay lands every spooled row once, in drop order."""

from __future__ import annotations

import json
from pathlib import Path

from ._gateways import Gateway, configure, heal, run_walspool, run_worker, transcript

#: Rows of agent turns the stopped gateway left in the spool, before its pending slot.
TURNS = 6


def test_a_dry_run_then_the_replay_of_a_stopped_gateways_spool(
    gateway: Gateway, home: Path
) -> None:
    """A gateway stopped during an outage left its queued turns and a pending slot in
    the spool; state.db works again. ``replay --dry-run`` says every row would move
    (exit 0) and writes nothing; the replay then lands them, in order (before: on 0.22
    the dry run said each session's first row "would be quarantined", exit 5: its
    trial ``SessionDB`` refused the ``patience_s`` keyword 0.22's ``append_message``
    passes)."""
    configure(gateway, home, gateway.enable)
    stopped = run_worker(gateway, home, "stop", str(TURNS))
    sid = stopped["session_id"]
    heal(home)
    spool, state_db = str(home / "spool.db"), str(home / "state.db")

    tried = run_walspool(gateway, home, "replay", spool, "--into", state_db, "--dry-run", "--json")
    report = json.loads(tried.stdout)
    assert tried.returncode == 0, tried.stdout + tried.stderr
    assert (report["dry_run"], report["moved"], report["held"]) == (True, TURNS + 1, 0)
    assert report["quarantined"] == 0
    assert transcript(home, sid) == []

    done = run_walspool(gateway, home, "replay", spool, "--into", state_db, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["moved"] == TURNS + 1
    expected = [tuple(turn) for turn in stopped["turns"]] + [("user", stopped["slot"])]
    assert transcript(home, sid) == expected
