"""Exactly once across a crash: a gateway SIGKILLed right after a commit of the drain
that moves its spooled rows into state.db loses none of them and doubles none when it
starts again."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import walspool

from ._gateways import (
    WORKER,
    Gateway,
    configure,
    gateway_process,
    gateway_running,
    transcript,
    wait_for,
)

#: Messages sent to each of three sessions during the outage: past the 200 cap.
BURST = 450


def spooled_rows(home: Path) -> dict[str, list[tuple[str, str]]]:
    """Each session's rows in the spool, as they would land: (role, content)."""
    rows: dict[str, list[tuple[str, str]]] = {}
    with walspool.Spool(home / "spool.db") as spool:
        for record in spool.records():
            rows.setdefault(str(record.session_id), []).append(
                (record.message["role"], record.message["content"])
            )
    return rows


def is_subsequence(rows: list[tuple[str, str]], of: list[tuple[str, str]]) -> bool:
    found = iter(of)
    return all(row in found for row in rows)


@pytest.mark.parametrize("commits", [1, 120])
def test_a_sigkill_right_after_a_drains_commit_loses_and_doubles_no_spooled_row(
    gateway: Gateway, home: Path, commits: int
) -> None:
    """An outage past the cap, then state.db heals and the drain begins; the gateway
    is SIGKILLed right after the drain's ``commits``-th commit. Whatever the spool
    held then (rows in flight included) lands at the next start, each row once, in
    drop order among what was sent; nothing is left in the spool. Messages that were
    only in the gateway's memory may be lost, as with the released gateway."""
    configure(gateway, home, gateway.enable)
    out = home.parent / "sent.json"
    argv = [str(gateway.python()), str(WORKER), str(out), "kill", str(BURST), str(commits)]
    with gateway_process(home, *argv) as process:
        wait_for("killed in the drain", Path(f"{out}.landed").exists, process)
        process.kill()  # SIGKILL, right after the drain's commit
    sent = {
        sid: [tuple(row) for row in rows] + [("user", f"{sid}-last")]
        for sid, rows in json.loads(out.read_text()).items()
    }
    before = {sid: transcript(home, sid) for sid in sent}
    waiting = spooled_rows(home)
    assert waiting, "the crash came after the spool was drained: nothing was tested"

    def landed_all() -> bool:  # what state.db held, and every row the spool held
        return all(
            Counter(transcript(home, sid)) >= Counter(before[sid]) | Counter(waiting.get(sid, []))
            for sid in sent
        )

    with gateway_running(gateway, home) as process:
        wait_for("recovered", landed_all, process)
    for sid, rows in sent.items():
        assert is_subsequence(transcript(home, sid), rows), sid  # in order, nothing twice
    with walspool.Spool(home / "spool.db") as spool:
        assert spool.stats().rows == 0
