"""The gateway link's cap on the spool (``walspool.link.budget``), on the real 0.19.0 store.

A chatty session cannot take the room the others need; the cap counts the ``-wal``
file that a reader's snapshot lets grow; a refused eviction takes the released
gateway's drop-and-warn path with its reason, and nothing already spooled is lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _gateway import BREAK, HEAL, sql, told_drops
from _lock_holder import read_snapshot_held

import walspool
from walspool.hermes import install
from walspool.link import budget

pytest.importorskip("hermes_state")

CAP = 16 * 2**20
PAD = "x" * 8000  # an 8 KB message: the cap is reached in about 2,000 evictions
WAIT = 60.0


@pytest.fixture
def spool(hermes_home: Path) -> Iterator[walspool.Spool]:
    with walspool.Spool(hermes_home / "spool.db") as s:
        yield s


def msg(content: str) -> dict[str, str]:
    return {"role": "user", "content": f"{content} {PAD}"}


def on_disk(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def refusals(caplog: pytest.LogCaptureFixture, session_id: str) -> list[str]:
    """The link's lines saying it dropped messages of the session: the first in full, then
    a summary at most once a minute (``walspool.link.repeats``)."""
    return [
        r.getMessage()
        for r in caplog.records
        if f"pending queue full for {session_id} " in r.getMessage()
        and ("dropping oldest" in r.getMessage() or "more oldest message" in r.getMessage())
    ]


def contents(store: Any, session_id: str) -> list[str]:
    return [m["content"].split()[0] for m in store._db.get_messages(session_id)]


def test_a_chatty_session_cannot_take_the_room_kept_for_the_others(store, spool, caplog):
    for s in ("chatty", "quiet"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.2, max_bytes=CAP)
    sql(store, BREAK)
    caplog.set_level(logging.WARNING, logger="walspool.hermes")
    for i in range(2600):
        store.append_to_transcript("chatty", msg(f"c{i}"))
    spool.flush()
    chatty_refused = refusals(caplog, "chatty")
    # refused once the spool passed 90% of the cap, with the reason named, said once
    assert len(chatty_refused) == 1, chatty_refused
    assert "kept for sessions that spooled less than 1%" in chatty_refused[0]
    assert spool._writer.footprint <= CAP * (1 - budget.RESERVE) + 2**20
    for i in range(215):  # 15 evictions: 120 KB, under 1% of the cap
        store.append_to_transcript("quiet", msg(f"q{i}"))
    spool.flush()
    assert refusals(caplog, "quiet") == []
    rows = [r.session_id for r in spool.records()]
    assert rows.count("quiet") == 15
    dropped = 2400 - rows.count("chatty")
    sql(store, HEAL)
    assert link.wait_idle(WAIT)
    # What was spooled or queued landed, in order; the refused ones are the oldest
    # after the first spooled ones, as the released store drops the oldest.
    assert contents(store, "quiet") == [f"q{i}" for i in range(215)]
    got = contents(store, "chatty")
    assert len(got) == 2600 - dropped
    assert got == sorted(got, key=lambda c: int(c[1:]))
    assert got[-200:] == [f"c{i}" for i in range(2400, 2600)]
    link.close()  # says the lines held back: every refusal is counted in one
    assert told_drops(caplog, "chatty") == dropped


def test_the_cap_counts_the_wal_a_reader_lets_grow(store, spool, caplog):
    """Small messages, one commit each: every commit adds the same few pages to the
    ``-wal`` again, so it grows far faster than the data while a reader's snapshot
    stops checkpoints. Counting only the database's pages (about 0.5 MB here), the
    link would let the files grow past twice the cap."""
    cap = 8 * 2**20
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0.2, max_bytes=cap)
    sql(store, BREAK)
    spool.append("other", {"warm": 1})  # the reader needs a table to read
    with read_snapshot_held(spool.path), caplog.at_level(logging.WARNING, logger="walspool"):
        for i in range(1600):
            store.append_to_transcript("s", {"role": "user", "content": f"m{i}"})
            spool.flush()  # each eviction its own commit
        assert on_disk(spool.path) <= cap + 2**20
        assert refusals(caplog, "s")
    assert os.path.getsize(f"{spool.path}-wal") > cap / 2


def test_no_cap_when_asked_for_none(store, spool, caplog):
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0.2, max_bytes=None)
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for i in range(2600):
            store.append_to_transcript("s", msg(f"m{i}"))
        spool.flush()
    assert refusals(caplog, "s") == []
    assert spool.stats().rows == 2400 and on_disk(spool.path) > CAP


def test_the_link_has_a_cap_by_default(store, spool):
    assert install(store, spool).max_bytes == budget.DEFAULT_MAX_BYTES == 4 * 2**30


def test_a_spool_already_at_the_cap_refuses_the_first_eviction(store, spool, caplog):
    """What earlier runs left counts from the start: the link measures the spool when
    it is installed, not only after its first commit."""
    spool.append_many([("old", msg(f"o{i}")) for i in range(1200)])  # ~10 MB
    assert spool._writer.footprint is None  # a spool without the link measures nothing
    store._db.create_session("s", "telegram")
    install(store, spool, retry_interval=0.2, max_bytes=8 * 2**20, recover=False)
    assert spool._writer.footprint > 8 * 2**20
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for i in range(201):
            store.append_to_transcript("s", msg(f"m{i}"))
        spool.flush()
    refused = refusals(caplog, "s")
    assert len(refused) == 1 and "at the link's cap of 8388608 bytes" in refused[0]
    assert [r.session_id for r in spool.records()].count("s") == 0


def _first_eviction_of(store: Any, spool: walspool.Spool, content: str) -> int:
    """Fill session s's queue to the cap (state.db broken, so nothing is written) and
    return the payload bytes of the message the next one evicts."""
    store._db.create_session("s", "telegram")
    sql(store, BREAK)
    for i in range(store._MAX_PENDING_PER_SESSION):
        store.append_to_transcript("s", {"role": "user", "content": f"{content}{i}"})
    assert spool.stats().rows == 0
    return spool._row("s", store._dirty_transcripts["s"][0], walspool.CAP_DROP, None)[5]


def test_an_eviction_that_brings_the_spool_to_exactly_the_cap_is_spooled(store, spool, caplog):
    """The cap is a limit the spool may reach: counted from the spool as measured and the
    eviction's own bytes, nothing more."""
    link = install(store, spool, retry_interval=3600)  # no retries meanwhile
    nbytes = _first_eviction_of(store, spool, "m")
    link.max_bytes = spool._writer.footprint + budget.ON_DISK * nbytes
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", {"role": "user", "content": "over"})
        spool.flush()
    assert refusals(caplog, "s") == []
    assert [r.message["content"] for r in spool.records()] == ["m0"]


def test_a_session_may_spool_exactly_its_small_share_into_the_reserve(store, spool, caplog):
    """In the last 10% of the cap a session may still spool while its evictions stay
    within 1% of the cap: that share is counted from what it spooled, nothing more."""
    link = install(store, spool, retry_interval=3600)
    footprint = spool._writer.footprint
    # An eviction of n bytes with the cap at 100 n: exactly the 1% share, and the spool
    # (its footprint plus 3 n) lands inside the reserve, between 90 n and 100 n.
    size = len('{"role":"user","content":"0"}')  # the evicted message, without its pad
    pad = next(
        k
        for k in range(1, footprint)
        if 87 * (size + k) < footprint <= 97 * (size + k)
        and 100 * (size + k) * budget.SMALL >= size + k
    )
    nbytes = _first_eviction_of(store, spool, "x" * pad)
    assert nbytes == size + pad
    link.max_bytes = 100 * nbytes
    after = footprint + budget.ON_DISK * nbytes
    assert link.max_bytes * (1 - budget.RESERVE) < after <= link.max_bytes
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("s", {"role": "user", "content": "over"})
        spool.flush()
    assert refusals(caplog, "s") == []
    assert spool.stats().rows == 1


def chatty_rows(spool: walspool.Spool) -> int:
    return [r.session_id for r in spool.records()].count("chatty")


def spooled_bytes(spool: walspool.Spool, session_id: str, status: str | None = None) -> int:
    """The payload bytes of the session's rows in the spool: of ``status``, or all."""
    query = (
        "SELECT coalesce(sum(size), 0) FROM records WHERE session_id = ? "
        "AND (? IS NULL OR status = ?)"
    )
    return spool.query(query, (session_id, status, status))[0][0]


def flood(store: Any, session_id: str, count: int, prefix: str) -> None:
    for i in range(count):
        store.append_to_transcript(session_id, msg(f"{prefix}{i}"))


def test_undo_after_a_flood_gives_a_chatty_session_no_room_kept_for_the_others(
    store, spool, caplog
):
    """/undo (the store's ``rewind_session``) supersedes the session's spooled rows, which
    stay in the spool: its share of the cap stays what they hold. A flood of 2,000
    evictions, then cycles of 30 more and /undo with the spool in the cap's reserve: the
    chatty session is refused each time, and a quiet session keeps every one of its
    evictions. (Were the share reset by the /undo, each cycle would take another 1% of
    the cap, and twenty all of the reserve.)

    The cap is set from the spool as the first /undo left it (that /undo rewrites the
    flooded rows into the ``-wal``, which the cap counts): 90.5% full."""
    for s in ("chatty", "quiet"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.2)
    sql(store, BREAK)
    flood(store, "chatty", 2200, "c")
    store.rewind_session("chatty")
    spool.flush()
    flooded = chatty_rows(spool)
    link.max_bytes = int(spool.footprint() / 0.905)
    kept = []
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for cycle in range(20):
            flood(store, "chatty", 230, f"u{cycle}-")
            spool.flush()
            kept.append(chatty_rows(spool) - flooded)
            store.rewind_session("chatty")
        flood(store, "quiet", 215, "q")  # 15 evictions: 120 KB, under 1% of the cap
        spool.flush()
    assert refusals(caplog, "quiet") == []
    assert [r.session_id for r in spool.records()].count("quiet") == 15
    assert kept == [0] * 20  # refused: it holds most of the spool
    link.close()  # says the lines held back: every refusal is counted in one
    assert told_drops(caplog, "chatty") == 20 * 30
    with link.core.lock:
        assert link.core.shares.of("chatty") == spooled_bytes(spool, "chatty")


def test_a_chatty_sessions_rows_from_an_earlier_run_count_after_a_restart(hermes_home, caplog):
    """A new link on the same spool counts each session's rows left by earlier runs (here
    a chatty session's flood of 2,000 evictions, superseded by /undo) before it reports
    ready: with the spool in the cap's reserve, twelve restarts give the chatty session no
    room there, and a quiet session then keeps every one of its evictions. (Counted from 0
    at each start, each restart would give it another 1% of the cap, and twelve all of
    the reserve.)"""
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore

    config = GatewayConfig(sessions_dir=hermes_home / "sessions")

    def run(*sessions: str) -> tuple[Any, walspool.Spool, Any]:
        store = SessionStore(hermes_home / "sessions", config)
        for s in sessions:
            store._db.create_session(s, "telegram")
        spool = walspool.Spool(hermes_home / "spool.db")
        link = install(store, spool, retry_interval=0.2)
        assert link.wait_idle(WAIT)  # the start's count is done
        if not sessions:
            # The spool as the first run left it (its -wal checkpointed away): 90.5% full.
            link.max_bytes = int(spool.footprint() / 0.905)
        return store, spool, link

    def stop(store: Any, spool: walspool.Spool, link: Any) -> None:
        link.close()
        spool.close()
        store._db.close()

    store, spool, link = run("chatty", "quiet")
    sql(store, BREAK)  # in state.db: every later run finds it broken too
    flood(store, "chatty", 2200, "c")
    store.rewind_session("chatty")
    spool.flush()
    flooded = chatty_rows(spool)
    assert flooded == 2000
    stop(store, spool, link)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        for restart in range(12):
            store, spool, link = run()
            flood(store, "chatty", 230, f"r{restart}-")  # 30 evictions
            spool.flush()
            kept = chatty_rows(spool) - flooded
            stop(store, spool, link)
            # Refused: it holds most of the spool. (Had it spooled any, they would stay
            # replayable, and the next start's recovery would be held by state.db.)
            assert kept == 0, f"restart {restart}: {kept} rows of the chatty session kept"
        store, spool, link = run()
        try:
            flood(store, "quiet", 215, "q")  # 15 evictions: 120 KB, under 1% of the cap
            spool.flush()
            assert refusals(caplog, "quiet") == []
            assert [r.session_id for r in spool.records()].count("quiet") == 15
            with link.core.lock:
                assert link.core.shares.of("chatty") == spooled_bytes(spool, "chatty")
        finally:
            stop(store, spool, link)
    assert told_drops(caplog, "chatty") == 12 * 30  # each link's close said its held lines


def test_a_drain_lowers_the_share_by_the_rows_it_moved(store, spool, caplog):
    """Rows the link drains into state.db leave its share of the cap; its superseded rows,
    which stay in the spool, do not. A session holding k superseded and k replayable
    rows is past 1% of the cap and refused in the reserve; once the k replayable ones
    are drained it holds the k superseded ones, under 1%, and may spool again."""
    for s in ("big", "chatty"):
        store._db.create_session(s, "telegram")
    link = install(store, spool, retry_interval=0.2)
    sql(store, BREAK)
    flood(store, "big", 1500, "b")  # 1,300 evictions, about 11 MB: most of the spool
    store.rewind_session("big")
    spool.flush()
    # 1% of a cap with the spool 93% full is about 1.5 k of the chatty session's rows.
    k = round(spool.footprint() / 0.93 * budget.SMALL / (1.5 * len(PAD)))
    flood(store, "chatty", 200 + k, "s")  # k evictions, superseded next
    store.rewind_session("chatty")
    flood(store, "chatty", 200 + k, "c")  # k evictions, replayable
    spool.flush()
    held = spooled_bytes(spool, "chatty")
    link.max_bytes = int(spool.footprint() / 0.93)  # in the reserve
    superseded = spooled_bytes(spool, "chatty", "superseded")
    # With its k superseded rows and one more it is under 1% of the cap, with all 2 k over.
    assert superseded + len(PAD) + 100 < link.max_bytes * budget.SMALL < held
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        store.append_to_transcript("chatty", msg("refused"))
        spool.flush()
    (refused,) = refusals(caplog, "chatty")
    assert "kept for sessions that spooled less than 1%" in refused
    with link.core.lock:
        assert link.core.shares.of("chatty") == held
    caplog.clear()
    sql(store, HEAL)
    assert link.wait_idle(WAIT)
    assert contents(store, "chatty")[-1] == "refused"  # its k rows drained, then its queue
    with link.core.lock:
        assert link.core.shares.of("chatty") == spooled_bytes(spool, "chatty") == superseded
        assert spool.footprint() > link.max_bytes * (1 - budget.RESERVE)  # still the reserve
    sql(store, BREAK)
    with caplog.at_level(logging.WARNING, logger="walspool.hermes"):
        flood(store, "chatty", 201, "again")
        spool.flush()
    assert refusals(caplog, "chatty") == []
    assert chatty_rows(spool) == k + 1
