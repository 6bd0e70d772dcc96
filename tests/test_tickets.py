"""The spool's side of a replay (``walspool.store.tickets``): rows taken out with a
ticket, found again in flight, settled; the file read back as an operator would."""

from __future__ import annotations

import apsw
import pytest
from _helpers import read_spool as raw

import walspool
from walspool.store import paging, tickets
from walspool.store.tickets import Scope, Settlement

EVERY = Scope(reasons=None, statuses="[]")
FIRST = ("", 0)


def in_flight(spool: walspool.Spool) -> list[tuple[str, int, int]]:
    return raw(spool, "SELECT session_id, seq, inflight FROM records WHERE inflight IS NOT NULL")


def next_ticket(spool: walspool.Spool) -> int:
    return raw(spool, "SELECT value FROM spool_meta WHERE name = 'next_ticket'")[0][0]


def test_take_gives_each_row_the_next_ticket_in_stream_order(spool):
    for session in ("b", "a"):
        for i in range(3):
            spool.append(session, {"role": "user", "content": f"{session}{i}"})
    first = next_ticket(spool)
    batch = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=4)
    assert [(r.session_id, r.seq, t) for r, t in batch.taken] == [
        ("a", 1, first),
        ("a", 2, first + 1),
        ("a", 3, first + 2),
        ("b", 1, first + 3),
    ]
    assert batch.full and batch.older == [] and batch.undecodable == {}
    assert sorted(in_flight(spool)) == sorted((r.session_id, r.seq, t) for r, t in batch.taken)
    assert next_ticket(spool) == first + 4
    # The rest, after the last row taken; rows in flight are not taken twice.
    rest = tickets.take(spool, EVERY, keyed=False, after=("b", 1), limit=4)
    assert [(r.session_id, r.seq) for r, _ in rest.taken] == [("b", 2), ("b", 3)]
    assert not rest.full and sorted(rest.older) == [t for _, t in batch.taken]


def test_take_of_one_stream_and_of_keyed_rows(spool):
    spool.append("s", {"role": "user", "content": "by id"})
    spool.append(None, {"role": "user", "content": "by key"}, session_key="k")
    by_id = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=10)
    by_key = tickets.take(spool, EVERY, keyed=True, after=FIRST, limit=10)
    assert [r.session_id for r, _ in by_id.taken] == ["s"]
    assert [(r.session_id, r.session_key) for r, _ in by_key.taken] == [(None, "k")]
    spool.append("t", {"role": "user", "content": "other"})
    only_t = Scope(reasons=None, statuses="[]", session_id="t")
    assert [
        r.session_id
        for r, _ in tickets.take(spool, only_t, keyed=False, after=FIRST, limit=10).taken
    ] == ["t"]


def test_a_batch_ends_at_its_byte_bound(spool, monkeypatch):
    monkeypatch.setattr(paging, "PAGE_BYTES", 1000)
    for i in range(5):
        spool.append("s", {"role": "user", "content": "x" * 600 + str(i)})
    batch = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=5)
    assert 1 <= len(batch.taken) < 5 and batch.full
    assert len(in_flight(spool)) == len(batch.taken)  # only the rows of the page are out


def test_a_payload_that_is_not_json_is_taken_and_said(spool):
    spool.append("s", {"role": "user", "content": "fine"})
    spool.append("s", {"role": "user", "content": "spoiled"})
    conn = apsw.Connection(str(spool.path))
    conn.execute("UPDATE records SET payload = '{not json' WHERE seq = 2")
    conn.close()
    batch = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=10)
    (first, _), (second, _) = batch.taken
    assert first.message == {"role": "user", "content": "fine"}
    assert second.message is None and list(batch.undecodable) == [second.id]


def test_rows_in_flight_are_found_again_by_stream_with_their_tickets(spool):
    for session in ("a", "b"):
        for i in range(3):
            spool.append(session, {"role": "user", "content": f"{session}{i}"})
    batch = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=6)
    found = tickets.next_in_flight(spool, EVERY, after=0)
    assert found is not None and found[1] == ("session_id", "a")
    page = tickets.in_flight_page(spool, ("session_id", "b"), after_seq=1, limit=10)
    assert [(r.seq, t) for r, t in page.taken] == [
        (r.seq, t) for r, t in batch.taken if r.session_id == "b" and r.seq > 1
    ]
    assert not page.full
    only_b = Scope(reasons=None, statuses="[]", session_id="b")
    row_id, stream = tickets.next_in_flight(spool, only_b, after=0)
    assert stream == ("session_id", "b")
    assert tickets.next_in_flight(spool, only_b, after=batch.taken[-1][0].id) is None


def test_settle_deletes_frees_fails_and_quarantines_in_one_go(spool):
    for i in range(4):
        spool.append("s", {"role": "user", "content": str(i)})
    batch = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=4)
    ids = [r.id for r, _ in batch.taken]
    done = Settlement()
    done.delete.append(ids[0])
    done.quarantine.append(("refused", 1.0, ids[1]))
    done.failures.append(("locked", 2.0, ids[2]))
    done.release += [ids[2], ids[3]]
    tickets.settle(spool, done)
    assert raw(spool, "SELECT id, inflight, status, attempts, last_error FROM records") == [
        (ids[1], None, "quarantined", 1, "refused"),
        (ids[2], None, None, 1, "locked"),
        (ids[3], None, None, 0, None),
    ]
    scope_s = Scope(reasons=None, statuses="[]")
    assert tickets.count_held(spool, scope_s, ("session_id", "s")) == 2  # quarantined: not
    with_quarantined = Scope(reasons=None, statuses='["quarantined"]')
    assert tickets.count_held(spool, with_quarantined, ("session_id", "s")) == 3


def test_failures_alone_may_wait_for_the_writers_next_group(spool):
    spool.append("s", {"role": "user", "content": "0"})
    ((rec, _),) = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=1).taken
    done = Settlement()
    done.failures.append(("locked", 2.0, rec.id))
    tickets.settle(spool, done, wait=False)
    spool.append("s", {"role": "user", "content": "1"})  # the next group commits it
    assert raw(spool, f"SELECT attempts, last_error FROM records WHERE id = {rec.id}") == [
        (1, "locked")
    ]


@pytest.mark.parametrize("session_id", [None, "a"])
def test_stream_of_names_a_row_by_its_session_else_its_key(session_id):
    stream = tickets.stream_of(session_id, "k")
    assert stream == (("session_id", "a") if session_id else ("session_key", "k"))


def test_a_row_set_aside_for_an_untracked_write_and_put_back(spool):
    spool.append("s", {"role": "user", "content": "0"})
    ((rec, _),) = tickets.take(spool, EVERY, keyed=False, after=FIRST, limit=1).taken
    tickets.set_aside(spool, rec.id, "cannot tell", 5.0)
    # Committed before the write: a crash now leaves it quarantined, out of flight.
    assert raw(spool, "SELECT inflight, status, last_error, last_attempt_at FROM records") == [
        (None, "quarantined", "cannot tell", 5.0)
    ]
    tickets.put_back(spool, rec.id)
    assert raw(spool, "SELECT inflight, status FROM records") == [(None, None)]
    # Only a quarantined row is put back: one an operator superseded meanwhile stays so.
    tickets.set_aside(spool, rec.id, "cannot tell", 6.0)
    with apsw.Connection(str(spool.path)) as conn:
        conn.execute("UPDATE records SET status = 'superseded'")
    tickets.put_back(spool, rec.id)
    assert raw(spool, "SELECT status FROM records") == [("superseded",)]
