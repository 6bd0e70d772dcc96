"""``walspool demo`` on the real 0.19.0 store: the released gateway loses, walspool does not."""

from __future__ import annotations

import io

import pytest

from walspool.demo import run_demo

pytest.importorskip("hermes_state")


def test_demo_reports_the_outage_and_loses_nothing():
    out = io.StringIO()
    assert run_demo(out, sessions=4, messages=301, threads=2) == 0
    released = out.getvalue().split("released gateway")[1].split()
    linked = out.getvalue().split("with walspool")[1].split()
    # columns: in state.db, lost, duplicates, order kept, burst time; 4 sessions x
    # (301 + 1) messages; the released store keeps the last 200 of each
    assert released[0] == "800/1,208" and released[1] == "408"
    assert linked[0] == "1,208/1,208" and linked[1] == "0" and linked[2] == "0"
    assert linked[3] == "yes"
    assert "evicted at the 200-message cap went to the spool" in out.getvalue()
