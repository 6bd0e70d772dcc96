"""The link's count of each session's bytes in the spool (``walspool.link.shares``):
the start's count, and the rows a drain's sink notes and later finds gone."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import walspool
from walspool.link import shares
from walspool.link.budget import Shares
from walspool.link.shares import Moving, count


class Recording:
    """A sink that records what it is handed, as it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def write(self, session_id: str, record: Any, ticket: Any) -> None:
        self.calls.append(("write", session_id, record.id, ticket))

    def write_many(self, session_id: str, items: Any) -> None:
        self.calls.append(("write_many", session_id, [(r.id, t) for r, t in items]))

    def landed(self, tickets: Any) -> Any:
        return []

    def __str__(self) -> str:
        return "recording sink"

    def __repr__(self) -> str:
        return "<Recording>"


@pytest.fixture
def spool(tmp_path):
    with walspool.Spool(tmp_path / "spool.db") as spool:
        yield spool


def rows(spool: walspool.Spool, session_id: str, n: int) -> list[Any]:
    spool.append_many([(session_id, {"role": "user", "content": f"m{i}"}) for i in range(n)])
    return [r for r in spool.records(session_id=session_id)][-n:]


def sizes(spool: walspool.Spool) -> dict[int, int]:
    """Each row's stored ``size`` (its payload bytes), by id."""
    return dict(spool.query("SELECT id, size FROM records", ()))


def test_count_gives_each_sessions_bytes_and_the_largest_id(spool):
    assert count(spool) == ({}, 0)  # an empty spool: nothing, and no id seen
    a, b = rows(spool, "a", 2), rows(spool, "b", 1)
    by_session, top = count(spool)
    size = sizes(spool)
    assert by_session == {"a": size[a[0].id] + size[a[1].id], "b": size[b[0].id]}
    assert top == b[0].id


def test_the_sink_gets_every_argument_as_handed_and_speaks_as_its_sink(spool):
    """The ticket is the exact landing record: passed on unchanged (a write without it
    could land twice after a crash), outside a counted replay and on any thread."""
    sink = Recording()
    moving = Moving(sink, spool, Shares())
    (record,) = rows(spool, "s", 1)
    ticket = object()
    done = []
    thread = threading.Thread(target=lambda: done.append(moving.write("s", record, ticket)))
    thread.start()  # a thread that never counted a replay
    thread.join(10)
    moving.write_many("s", [(record, ticket)])
    assert sink.calls == [
        ("write", "s", record.id, ticket),
        ("write_many", "s", [(record.id, ticket)]),
    ]
    assert done == [None]
    assert (str(moving), repr(moving)) == ("recording sink", "<Recording>")


def test_rows_written_in_a_counted_replay_that_left_are_told_by_session(spool):
    sink = Recording()
    moving = Moving(sink, spool, Shares())
    a, b = rows(spool, "a", 3), rows(spool, "b", 2)
    with moving.counting() as noted:
        for record in a:
            moving.write("a", record, None)
        moving.write_many("b", [(r, None) for r in b])
        assert noted.gone() == {}  # all still in the spool
        size = sizes(spool)
        spool.transact(lambda conn: conn.execute("DELETE FROM records WHERE id < ?", (b[1].id,)))
        assert noted.gone() == {"a": sum(size[r.id] for r in a), "b": size[b[0].id]}


def test_the_noted_rows_stay_within_their_bound(spool, monkeypatch):
    """Past ``NOTED_ROWS``, the rows that left are told, and of those still there only
    the latest are kept; up to the bound, every row is kept."""
    monkeypatch.setattr(shares, "NOTED_ROWS", 8)
    moving = Moving(Recording(), spool, Shares())
    held = rows(spool, "held", 8)
    with moving.counting() as noted:
        for record in held:
            moving.write("held", record, None)
        assert len(noted.rows) == 8  # at the bound: nothing checked, nothing forgotten
        more = rows(spool, "more", 12)
        for record in more:
            moving.write("more", record, None)
            assert len(noted.rows) <= 8
        assert list(noted.rows)[-1] == more[-1].id
        assert noted.gone() == {}  # forgotten rows are not told as gone


def test_past_the_bound_only_the_latest_half_still_there_is_kept(spool, monkeypatch):
    """Past ``NOTED_ROWS`` (8 here) the rows still in the spool but the latest 4 are
    forgotten before a new row is noted; a batch that alone takes the count past the
    bound forgets none of the fewer than 4 noted before it."""
    monkeypatch.setattr(shares, "NOTED_ROWS", 8)
    moving = Moving(Recording(), spool, Shares())
    held, more = rows(spool, "held", 8), rows(spool, "more", 1)
    with moving.counting() as noted:
        for record in held:
            moving.write("held", record, None)
        moving.write("more", more[0], None)
        assert list(noted.rows) == [r.id for r in held[4:]] + [more[0].id]
    first, big = rows(spool, "first", 3), rows(spool, "big", 7)
    with moving.counting() as noted:
        for record in first:
            moving.write("first", record, None)
        moving.write_many("big", [(r, None) for r in big])
        assert list(noted.rows) == [r.id for r in first + big]


def test_a_spool_that_cannot_be_probed_is_not_taken_for_empty(spool, monkeypatch):
    """``empty`` answers True only when the probe shows no row: a probe that fails says
    False, so the start's count runs and finds out."""

    def fails(sql: str, params: Any) -> Any:
        raise walspool.SpoolIOError("disk I/O error", path=spool.path)

    assert shares.empty(spool)
    monkeypatch.setattr(spool, "query", fails)
    assert shares.empty(spool) is False
