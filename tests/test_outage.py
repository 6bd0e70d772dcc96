"""The link's outage lines (``walspool.link.outage``): a few per outage, with its counts and
durations, driven by the times passed in (no clock, no threads)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from walspool.link.outage import QUIET_AFTER, REPORT_SECONDS, OutageLog, repeat_due

SPOOL = Path("/home/h/spool.db")


def said(lines, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Run the lines as the link does once its lock is released; what they logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for line in lines:
            line()
    return [r.getMessage() for r in caplog.records]


def test_an_outage_of_two_sessions_is_told_in_a_few_lines_with_its_totals(caplog):
    """Each session: one line when it starts spooling, a progress line once
    ``REPORT_SECONDS`` have passed (not before), one when it drained; then one
    "outage over" line with the totals, a rewrite's superseded rows counted apart."""
    log = OutageLog(SPOOL, 200)
    a, lines = log.evicted("a", None, 1, 100.0)
    assert said(lines, caplog) == [
        f"Session DB transcript pending queue full for a (cap=200); spooling the oldest "
        f"messages to {SPOOL} until state.db takes them (one line when it has drained)"
    ]
    b, lines = log.evicted("b", None, 2, 110.0)
    assert len(said(lines, caplog)) == 1
    c, _ = log.evicted("c", None, 2, 120.0)
    a, lines = log.evicted("a", a, 4, 100.0 + REPORT_SECONDS - 0.5)
    assert said(lines, caplog) == []  # the first progress line is not due yet
    a, lines = log.evicted("a", a, 5, 100.0 + REPORT_SECONDS)
    assert said(lines, caplog) == [
        "Session DB transcript of a still spooling: 10 message(s) spooled in 60 s, "
        "0 replayed so far"
    ]
    a, lines = log.evicted("a", a, 1, 100.0 + REPORT_SECONDS + 1)
    assert said(lines, caplog) == []  # the next one is a whole REPORT_SECONDS later
    log.replayed_rows(a, 11)
    assert said(log.ended("a", a, 200.0), caplog) == [
        "Session DB transcript of a drained: 11 message(s) spooled, 11 replayed into "
        "state.db in 100.0 s"
    ]
    assert said(log.ended("c", c, 220.0, superseded=True), caplog) == []  # the rewrite says it
    log.replayed_rows(b, 1)  # one of its two, then a rewrite superseded the other
    assert said(log.ended("b", b, 250.0, superseded=True), caplog) == [
        "walspool: outage over: 15 spooled, 12 replayed, 3 superseded by rewrites in 150.0 s"
    ]


def test_a_second_outage_starts_its_totals_afresh(caplog):
    log = OutageLog(SPOOL, 200)
    a, _ = log.evicted("a", None, 3, 0.0)
    log.replayed_rows(a, 3)
    said(log.ended("a", a, 5.0), caplog)
    a, _ = log.evicted("a", None, 2, 50.0)
    log.replayed_rows(a, 2)
    assert said(log.ended("a", a, 52.5), caplog)[-1] == (
        "walspool: outage over: 2 spooled, 2 replayed in 2.5 s"
    )


def test_a_rewrite_after_every_row_was_replayed_supersedes_none(caplog):
    """A session whose spooled rows were all written back before a rewrite ended its
    episode adds nothing to the superseded count: the outage line names none."""
    log = OutageLog(SPOOL, 200)
    a, _ = log.evicted("a", None, 2, 0.0)
    b, _ = log.evicted("b", None, 1, 0.0)
    log.replayed_rows(a, 2)
    assert said(log.ended("a", a, 1.0, superseded=True), caplog) == []
    log.replayed_rows(b, 1)
    assert said(log.ended("b", b, 3.0), caplog)[-1] == (
        "walspool: outage over: 3 spooled, 3 replayed in 3.0 s"
    )


def test_a_session_without_an_episode_ends_nothing(caplog):
    log = OutageLog(SPOOL, 200)
    log.replayed_rows(None, 5)
    assert log.ended("a", None, 1.0) == []
    assert (log.open, log.replayed) == (0, 0)


@pytest.mark.parametrize(
    ("failures", "last", "now", "due"),
    [
        (1, 0.0, 0.0, True),
        (QUIET_AFTER, 0.0, 0.0, True),
        (QUIET_AFTER + 1, 10.0, 10.0 + REPORT_SECONDS - 0.1, False),
        (QUIET_AFTER + 1, 10.0, 10.0 + REPORT_SECONDS, True),
    ],
)
def test_repeated_retry_failures_are_said_at_first_then_once_a_period(failures, last, now, due):
    assert repeat_due(failures, last, now) is due
