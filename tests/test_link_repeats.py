"""The link's repeated conditions (``walspool.link.repeats``): said at first, then at most
once per interval with the count since, and once when over, every occurrence counted in
exactly one line; from tables and a Hypothesis model with no threads. Then on the real
hermes-agent 0.19.0 store with the link's clock moved by the test: a burst of drops, of
messages kept in memory by a busy spool, and of replayed chunks, each in a few lines.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
from _gateway import (
    BREAK,
    HEAL,
    Clock,
    contents,
    fill_the_writer,
    link_lines,
    msg,
    sql,
)
from _helpers import STEP
from hypothesis import given, settings
from hypothesis import strategies as st

import walspool
import walspool.store.writer as writer
from walspool.hermes import install
from walspool.link import outage
from walspool.link.repeats import REPEAT_SECONDS, Kind, Repeats, Said

T = 1000.0
INTERVAL = REPEAT_SECONDS


def test_a_burst_is_one_line_then_one_summary_with_its_count_once_the_interval_passed():
    repeats = Repeats()
    said = [repeats.seen("k", T + i / 100) for i in range(50)]
    assert said[0] == Said(Kind.FIRST, 1, 1, 0.0, None)
    assert said[1:] == [None] * 49
    assert repeats.seen("k", T + INTERVAL - 0.001) is None  # not yet
    assert repeats.seen("k", T + INTERVAL, detail="why") == Said(
        Kind.AGAIN, 51, 52, INTERVAL, "why"
    )
    assert repeats.seen("k", T + INTERVAL + 1) is None  # the next interval starts at that line


def test_a_first_occurrence_may_count_several_and_keys_are_apart():
    repeats = Repeats()
    assert repeats.seen(("replayed", "a"), T, 128) == Said(Kind.FIRST, 128, 128, 0.0, None)
    assert repeats.seen(("replayed", "b"), T, 3) == Said(Kind.FIRST, 3, 3, 0.0, None)
    assert repeats.seen(("replayed", "a"), T + 1, 128) is None
    assert repeats.ended(("replayed", "a"), T + 2, at_once=True) == Said(
        Kind.ENDED, 128, 256, 2.0, None
    )
    assert not repeats.going_on(("replayed", "a")) and repeats.going_on(("replayed", "b"))


def test_a_heal_after_the_interval_is_said_at_once_and_the_next_occurrence_is_a_first():
    repeats = Repeats()
    repeats.seen("k", T)
    repeats.seen("k", T + 1)
    assert repeats.ended("k", T + INTERVAL) == Said(Kind.ENDED, 1, 2, INTERVAL, None)
    assert not repeats.active and repeats.due(T + 2 * INTERVAL) == []
    assert repeats.ended("k", T + INTERVAL) is None  # not going on: nothing to say
    assert repeats.seen("k", T + INTERVAL + 1) == Said(Kind.FIRST, 1, 1, 0.0, None)


def test_a_heal_within_the_interval_waits_for_it_and_a_return_meanwhile_only_counts():
    """A condition that comes and goes (a spool writer's queue full now and then) is said
    no more often than once per interval: its heal waits, and coming back cancels it."""
    repeats = Repeats()
    assert repeats.seen("k", T).kind is Kind.FIRST
    assert repeats.ended("k", T + 1) is None
    assert repeats.holding and repeats.due(T + 2) == []
    assert repeats.seen("k", T + 3) is None  # back: counted
    assert repeats.ended("k", T + 4) is None
    assert repeats.seen("k", T + 5) is None
    assert repeats.ended("k", T + 6) is None
    assert repeats.due(T + INTERVAL - 0.001) == []
    assert repeats.due(T + INTERVAL) == [("k", Said(Kind.ENDED, 2, 3, 6.0, None))]
    assert not repeats.active and not repeats.holding
    assert repeats.due(T + 2 * INTERVAL) == []


def test_a_summary_is_due_without_a_new_occurrence_and_a_quiet_condition_says_nothing():
    repeats = Repeats()
    repeats.seen("quiet", T)  # said, nothing since: no summary
    repeats.seen("busy", T, detail="a")
    repeats.seen("busy", T + 1, detail="b")
    assert repeats.due(T + INTERVAL) == [("busy", Said(Kind.AGAIN, 1, 2, INTERVAL, "b"))]
    assert repeats.going_on("busy") and repeats.going_on("quiet")
    assert repeats.due(T + 10 * INTERVAL) == []


def test_flush_says_every_count_held_back_whatever_the_interval():
    repeats = Repeats()
    repeats.seen("on", T)
    repeats.seen("on", T + 1, 4)
    repeats.seen("healed", T)
    repeats.ended("healed", T + 2)
    repeats.seen("said", T)
    assert sorted(repeats.flush(T + 3)) == [
        ("healed", Said(Kind.ENDED, 0, 1, 2.0, None)),
        ("on", Said(Kind.AGAIN, 4, 5, 3.0, None)),
    ]
    assert not repeats.holding
    assert repeats.flush(T + 4) == []  # "on" goes on, with nothing unsaid


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["seen", "ended", "due", "wait"]),
        st.sampled_from(["a", "b"]),
        st.integers(1, 5),
        st.floats(0, 2 * REPEAT_SECONDS),
    ),
    max_size=60,
)


@settings(deadline=None)
@given(EVENTS)
def test_every_occurrence_is_counted_in_exactly_one_line_and_lines_are_an_interval_apart(
    events: list[tuple[str, str, int, float]],
) -> None:
    """Any sequence of occurrences, heals, looks and waits, then ``flush``: the counts said
    per key add up to its occurrences; two lines of a key are an interval apart, but a
    first line right after a heal (a new episode) and what ``flush`` says."""
    repeats = Repeats()
    now = T
    occurred = {"a": 0, "b": 0}
    lines: list[tuple[str, float, Said]] = []
    for op, key, count, wait in events:
        if op == "seen":
            occurred[key] += count
            said = repeats.seen(key, now, count)
            lines += [(key, now, said)] if said else []
        elif op == "ended":
            said = repeats.ended(key, now)
            lines += [(key, now, said)] if said else []
        elif op == "due":
            lines += [(k, now, said) for k, said in repeats.due(now)]
        else:
            now += wait
    for key in occurred:
        mine = [(at, said) for k, at, said in lines if k == key]
        for (at, said), (next_at, next_said) in zip(mine, mine[1:], strict=False):
            if said.kind is Kind.ENDED and next_said.kind is Kind.FIRST:
                continue
            assert next_at - at >= REPEAT_SECONDS, mine
    lines += [(k, now, said) for k, said in repeats.flush(now)]
    for key, total in occurred.items():
        assert sum(said.count for k, _, said in lines if k == key) == total


# -- on the real 0.19.0 store, with the link's clock moved by the test -----------------


@pytest.fixture
def spool(hermes_home: Path):
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def test_a_burst_of_drops_is_one_line_then_one_summary_with_the_count_since(store, spool, caplog):
    """A spool that cannot take anything (closed) and 50 evictions in a burst: one
    WARNING, in full. The clock past the interval, the link's next use says the 49 since
    it; the 11 after that are said when the link closes. 61 dropped, 61 told."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.clock = clock = Clock()
    spool.close()
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(250):
        store.append_to_transcript("s", msg(f"m{i}"))
    assert link_lines(caplog, logging.WARNING, "oldest message") == [
        "Session DB transcript pending queue full for s (cap=200); dropping oldest message to "
        f"make room (on-disk spool unavailable: spool {spool.path} is closed)"
    ]
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("m250"))
    for i in range(251, 261):
        store.append_to_transcript("s", msg(f"m{i}"))
    link.close()
    lines = link_lines(caplog, logging.WARNING, "oldest message")
    assert len(lines) == 3, lines
    assert re.fullmatch(
        r"Session DB transcript pending queue full for s \(cap=200\); dropped 49 more oldest "
        r"message\(s\) \(50 in 60 s; on-disk spool unavailable: spool .* is closed\)",
        lines[1],
    )
    assert re.fullmatch(r".*; dropped 11 more oldest message\(s\) \(61 in 60 s; .*", lines[2])
    assert [m["content"] for m in store._dirty_transcripts["s"]] == [
        f"m{i}" for i in range(61, 261)
    ]


def test_a_busy_spool_is_said_once_then_summed_up_and_its_end_said_once(
    store, spool, monkeypatch, caplog
):
    """The spool's writer busy (its queue full) while a session's queue is over the cap:
    its oldest message stays in memory, said once; the clock past the interval, one
    summary with the count since; once the spool takes the session's evictions again,
    one line says so (after the interval, as it came right after the summary)."""
    monkeypatch.setattr(writer, "QUEUE_REQUESTS", 2)
    monkeypatch.setattr(store, "_MAX_PENDING_PER_SESSION", 20, raising=False)
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.clock = clock = Clock()
    sql(store, BREAK)
    go_on, fillers = fill_the_writer(spool)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(35):  # 15 over the cap, under twice the cap: nothing is dropped
        store.append_to_transcript("s", msg(f"m{i}"))
    kept = link_lines(caplog, logging.WARNING, "the oldest message")
    assert kept == [
        f"Session DB transcript pending queue full for s (cap=20); the spool {spool.path} is "
        "busy, so the oldest message stays in memory (21 queued; the oldest is dropped past 40)"
    ]
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("m35"))
    summary = link_lines(caplog, logging.WARNING, "still busy")
    assert len(summary) == 1, summary
    more, total = map(
        int, re.search(r"kept in memory (\d+) more time\(s\) \((\d+) in 60 s", summary[0]).groups()
    )
    assert more + 1 == total >= 16  # each append past the cap, at least once
    go_on.set()
    assert [f.result(STEP).seq for f in fillers] == [1, 2]
    sql(store, HEAL)
    store.append_to_transcript("s", msg("m36"))  # state.db takes the queue: within the cap
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(37)]
    assert link_lines(caplog, logging.WARNING, "back within its cap") == []  # a line is recent
    clock.move(REPEAT_SECONDS)
    store.append_to_transcript("s", msg("fin"))  # the link's next use says what is due
    (healed,) = link_lines(caplog, logging.WARNING, "back within its cap")
    told = re.fullmatch(
        r"Session DB transcript pending queue of s is back within its cap \(20\): the oldest "
        r"message was kept in memory (\d+) time\(s\) in 60\.\d s while the spool "
        rf"{re.escape(str(spool.path))} was busy \((\d+) not said before\)",
        healed,
    )
    assert told, healed
    all_told, unsaid = map(int, told.groups())
    assert all_told == 1 + more + unsaid  # each time in exactly one line
    assert link_lines(caplog, logging.WARNING, "dropping") == []
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(37)] + ["fin"]


def test_a_drain_of_a_thousand_rows_is_told_in_two_lines_not_one_per_chunk(store, spool, caplog):
    """1,001 spooled rows drain in chunks of 128: the first chunk is said at once, the
    rest in one line when the session has drained (its heal), with the count since and
    the total; nothing is left out (before: one line per chunk)."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    sql(store, BREAK)
    for i in range(1200):
        store.append_to_transcript("s", msg(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 1000
    sql(store, HEAL)
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    store.append_to_transcript("s", msg("fin"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(1200)] + ["fin"]
    first, rest = link_lines(caplog, logging.INFO, "Replayed")
    moved = re.fullmatch(
        r"Replayed (\d+) spooled transcript message\(s\) for s after DB recovery", first
    )
    assert moved and int(moved.group(1)) < 1001
    # 1,001 replayed: "fin" evicted one more on its way in
    assert re.fullmatch(
        rf"Replayed {1001 - int(moved.group(1))} more spooled transcript message\(s\) for s "
        r"after DB recovery \(1001 in all, in \d+\.\d s\)",
        rest,
    )


def test_a_drain_longer_than_the_interval_is_summed_up_between_its_chunks(store, spool, caplog):
    """A drain whose second chunk comes a whole interval (on the link's clock) after its
    first: the first chunk said at once, the second summed up at once with the count and
    the time since the first, the rest in the line that says the session has drained."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.clock = clock = Clock()
    sql(store, BREAK)
    for i in range(500):
        store.append_to_transcript("s", msg(f"m{i}"))
    spool.flush()
    assert spool.stats().rows == 300
    write, written = link.replayer.sink.write, []

    def late_second_chunk(*args, **kw):
        written.append(args)
        if len(written) == 129:  # the first row after the first chunk of 128
            clock.move(REPEAT_SECONDS)
            # and a loaded machine's slow row: real time, which the link's clock does
            # not count (the summary says 60 s, not 61)
            time.sleep(0.6)
        return write(*args, **kw)

    link.replayer.sink.write = late_second_chunk
    sql(store, HEAL)
    caplog.set_level(logging.INFO, logger="walspool.hermes")
    store.append_to_transcript("s", msg("fin"))  # evicts one more on its way in: 301
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(500)] + ["fin"]
    first, again, rest = link_lines(caplog, logging.INFO, "Replayed")
    n1 = int(
        re.fullmatch(
            r"Replayed (\d+) spooled transcript message\(s\) for s after DB recovery", first
        ).group(1)
    )
    n2, total = map(
        int,
        re.fullmatch(
            r"Replayed (\d+) more spooled transcript message\(s\) for s after DB recovery "
            r"\((\d+) in 60 s\)",
            again,
        ).groups(),
    )
    assert total == n1 + n2 and n1 <= 128 < total
    assert re.fullmatch(
        rf"Replayed {301 - total} more spooled transcript message\(s\) for s after DB "
        r"recovery \(301 in all, in 60\.\d s\)",
        rest,
    ), rest


def test_closing_the_link_says_the_lines_held_back(store, spool, caplog):
    """Nothing waits for a timer: a count not said yet is said when the link closes."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    spool.close()
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(203):
        store.append_to_transcript("s", msg(f"m{i}"))
    assert len(link_lines(caplog, logging.WARNING, "oldest message")) == 1
    link.close()
    link.close()  # idempotent: nothing said twice
    lines = link_lines(caplog, logging.WARNING, "oldest message")
    assert len(lines) == 2 and "dropped 2 more oldest message(s) (3 in " in lines[1]


def test_due_says_each_key_at_its_own_time_and_keeps_the_others_held():
    """Two keys held to different times: ``due`` at the sooner says that key only and
    keeps the other held to its own time (it is said then, not lost, not early), and a
    summary keeps the detail of the key's last occurrence that had one."""
    r = Repeats(interval=60)
    assert r.seen("x", 0.0, detail="disk full").kind is Kind.FIRST
    assert r.seen("x", 60.0).kind is Kind.AGAIN  # said at 60: next not before 120
    assert r.seen("y", 10.0).kind is Kind.FIRST
    assert r.seen("y", 20.0) is None  # held to 70
    assert r.seen("x", 61.0) is None  # held to 120
    assert r.due(69.9) == []
    [(key, line)] = r.due(70.0)
    assert (key, line.kind, line.count) == ("y", Kind.AGAIN, 1)
    assert r.due(119.9) == []
    [(key, line)] = r.due(120.0)
    assert (key, line.kind, line.count, line.total, line.detail) == (
        "x", Kind.AGAIN, 1, 3, "disk full"
    )  # fmt: skip


def test_a_drain_that_keeps_failing_is_said_again_once_per_interval(store, spool, caplog):
    """state.db broken with a session's rows spooled: each message tries the drain first
    (it fails: the message waits, the oldest is evicted), and each failure counts. Past
    the first few (said while the queue filled), a failed drain is said once per
    ``REPORT_SECONDS`` on the link's clock, word for word with its counts, and not in
    between."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.clock = clock = Clock()
    sql(store, BREAK)
    for i in range(201):  # the 201st evicts the oldest: the session has a spooled row
        store.append_to_transcript("s", msg(f"m{i}"))
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(201, 211):
        store.append_to_transcript("s", msg(f"m{i}"))
    assert link_lines(caplog, logging.WARNING, "Replay of") == []  # within the interval
    said = []
    for k, i in enumerate(range(211, 215)):
        if k % 2 == 0:
            clock.move(outage.REPORT_SECONDS)
        store.append_to_transcript("s", msg(f"m{i}"))
        said.append(link_lines(caplog, logging.WARNING, "Replay of"))
    spooled = 11 + 1  # m0-m10 before the first said drain, then one per message
    assert [len(lines) for lines in said] == [1, 1, 2, 2]
    for n, line in enumerate(said[-1]):
        assert line == (
            f"Replay of {spooled + 2 * n} spooled transcript message(s) for s failed; keeping "
            f"them in {spool.path} and holding back 200 queued message(s): IntegrityError: "
            "database disk image is malformed"
        )
    sql(store, HEAL)
    store.append_to_transcript("s", msg("m215"))
    assert link.wait_idle(STEP)
    assert contents(store, "s") == [f"m{i}" for i in range(216)]


def test_the_first_failures_in_a_row_are_said_each_and_the_next_waits_for_the_interval(
    store, spool, caplog
):
    """state.db broken, no background retries: each message's write fails. The first
    ``QUIET_AFTER`` failures are said each, word for word with their count; the next
    ones only once ``REPORT_SECONDS`` have passed on the link's clock since the last."""
    store._db.create_session("s", "telegram")
    link = install(store, spool, retry_interval=0)
    link.clock = clock = Clock()
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(outage.QUIET_AFTER + 3):
        store.append_to_transcript("s", msg(f"m{i}"))
    failed = link_lines(caplog, logging.WARNING, "append failed")
    assert failed == [
        f"Session DB transcript append failed for s (failure_count={n}, pending={n}); will "
        "retry: database disk image is malformed"
        for n in range(1, outage.QUIET_AFTER + 1)
    ]
    clock.move(outage.REPORT_SECONDS)
    store.append_to_transcript("s", msg("late"))
    n = outage.QUIET_AFTER + 4
    assert link_lines(caplog, logging.WARNING, "append failed")[len(failed) :] == [
        f"Session DB transcript append failed for s (failure_count={n}, pending={n}); will "
        "retry: database disk image is malformed"
    ]
    # A failure not said ends its writer's turn as one that is: no second attempt by a
    # writer that gave its role up (which the claim refuses, an ERROR).
    assert link_lines(caplog, logging.ERROR) == []
    assert store._transcript_append_failures["s"] == n
