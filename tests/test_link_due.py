"""The background thread's schedule kept as sessions change (``walspool.link.due``)
against ``machine.pick_due`` of every session, its specification: from a table, and by
a Hypothesis state machine whose sessions change as the link's do. A change that can
make a session due sooner, or free to take, is told (``touch``), as the link's events
tell it; any other change may or may not be; sessions are forgotten and come back as
new objects under the same id."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from walspool.link.due import DueBook
from walspool.link.machine import Candidate, Owner, due_at, pick_due

NOW = 100.0
IDLE = dict(owner=Owner.NOBODY, waiters=False, unconfirmed=False, has_work=True, failing=False)


class Table:
    """Sessions by id, each a fresh object with its facts."""

    def __init__(self) -> None:
        self.sessions: dict[str, object] = {}
        self.facts: dict[str, Candidate] = {}
        self.book = DueBook()

    def set(self, session_id: str, facts: Candidate, *, touch: bool = True) -> None:
        if session_id not in self.sessions:
            self.sessions[session_id] = object()
        self.facts[session_id] = facts
        if touch:
            self.book.touch(session_id)

    def pick(self, now: float, probe_at: float | None = None) -> tuple[str | None, float | None]:
        return self.book.pick(self.sessions, self.facts_of, now, probe_at)

    def facts_of(self, session_id: str, state: object) -> tuple:
        return tuple(self.facts[session_id])


def test_the_book_picks_as_pick_due_does_from_a_table() -> None:
    table = Table()
    rows = {
        "late": Candidate(**IDLE, retry_at=NOW - 1),
        "later": Candidate(**IDLE, retry_at=NOW - 5),
        "future": Candidate(**IDLE, retry_at=NOW + 50),
        "writing": Candidate(**{**IDLE, "owner": Owner.GATEWAY}, retry_at=0.0),
        "waited": Candidate(**{**IDLE, "waiters": True}, retry_at=0.0),
        "evicting": Candidate(**{**IDLE, "unconfirmed": True}, retry_at=0.0),
        "idle": Candidate(**{**IDLE, "has_work": False}, retry_at=0.0),
        "probe": Candidate(**{**IDLE, "failing": True}, retry_at=NOW - 9),
    }
    for session_id, facts in rows.items():
        table.set(session_id, facts)
    assert table.pick(NOW) == ("probe", NOW) == pick_due(rows, NOW)
    assert table.pick(NOW, NOW + 1) == ("later", NOW) == pick_due(rows, NOW, NOW + 1)
    # Taken (no touch: the change only makes it unavailable), then found so at the top.
    table.set("later", rows["later"]._replace(owner=Owner.BACKGROUND), touch=False)
    assert table.pick(NOW, NOW + 1) == ("late", NOW)
    # Given up again with a later retry: told, as a release is.
    table.set("later", rows["later"]._replace(retry_at=NOW + 3))
    table.set("late", rows["late"]._replace(has_work=False), touch=False)
    assert table.pick(NOW, NOW + 1) == (None, NOW + 1)  # the probe, before "later"
    assert table.pick(NOW) == ("probe", NOW)
    table.set("probe", rows["probe"]._replace(retry_at=NOW + 2), touch=False)
    assert table.pick(NOW) == (None, NOW + 2)
    assert table.pick(NOW + 2.5) == ("probe", NOW + 2.5)
    del table.sessions["probe"]  # forgotten: its entry goes when it reaches the top
    assert table.pick(NOW + 2.5) == (None, NOW + 3)
    assert table.pick(NOW + 60) == ("later", NOW + 60)  # "future" retries later than it
    assert len(table.book) == 2


def test_a_forgotten_session_back_under_its_id_is_a_new_one() -> None:
    table = Table()
    table.set("s", Candidate(**IDLE, retry_at=NOW + 5))
    assert table.pick(NOW) == (None, NOW + 5)
    del table.sessions["s"]
    table.set("s", Candidate(**IDLE, retry_at=NOW + 5))  # the same facts, a new object
    assert table.pick(NOW + 5) == ("s", NOW + 5)


def test_what_the_book_keeps_is_bounded_by_the_sessions_without_a_look() -> None:
    """A link without a background thread never looks: the sessions it forgets leave
    the book, touched or placed, and a closed book keeps nothing."""
    table = Table()
    for n in range(1_000):
        table.set(f"s{n}", Candidate(**IDLE, retry_at=NOW))
        table.book.forget(f"s{n}")
        del table.sessions[f"s{n}"]
    table.set("kept", Candidate(**IDLE, retry_at=NOW))
    assert table.pick(NOW) == ("kept", NOW) and len(table.book) == 1
    table.book.forget("kept")
    assert len(table.book) == 0 and table.book.held() <= 1
    table.book.close()
    table.book.touch("late")
    assert table.pick(NOW) == (None, None)


def test_stale_entries_do_not_pile_up() -> None:
    """A session placed again and again (each release) leaves its old entries behind
    until they reach a top, or the heap is rebuilt: it never holds many more entries
    than sessions."""
    table = Table()
    for n in range(100):
        table.set(f"s{n}", Candidate(**IDLE, retry_at=NOW + 1000 + n))
    for k in range(900):
        table.set("s0", Candidate(**IDLE, retry_at=NOW + 999 - k))  # sooner each time
        assert table.pick(NOW)[0] is None
    assert table.book.held() <= 64 + 2 * 100 + 1


TIMES = st.sampled_from([0.0, NOW - 3, NOW - 1, NOW, NOW + 1, NOW + 2, NOW + 4])


@st.composite
def candidates(draw: st.DrawFn) -> Candidate:
    return Candidate(
        owner=draw(st.sampled_from(list(Owner))),
        waiters=draw(st.booleans()),
        retry_at=draw(TIMES),
        failing=draw(st.booleans()),
        unconfirmed=draw(st.booleans()),
        has_work=draw(st.booleans()),
    )


def takeable(facts: Candidate) -> bool:
    return (
        facts.owner is Owner.NOBODY
        and not facts.waiters
        and not facts.unconfirmed
        and facts.has_work
    )


class Book(RuleBasedStateMachine):
    """Sessions change at random; every look of the book answers as ``pick_due``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = Table()
        self.now = NOW
        self.probe_at: float | None = None

    @rule(
        session=st.sampled_from("abcdef"),
        facts=candidates(),
        told=st.booleans(),
    )
    def change(self, session: str, facts: Candidate, told: bool) -> None:
        """A change is told when it may make the session due sooner or takeable (as
        the link's events are); otherwise it may or may not be."""
        old = self.table.facts.get(session) if session in self.table.sessions else None
        sooner = takeable(facts) and (
            old is None
            or not takeable(old)
            or due_at(facts.retry_at, facts.failing, self.probe_at)
            < due_at(old.retry_at, old.failing, self.probe_at)
            or facts.retry_at < old.retry_at
            or facts.failing != old.failing
        )
        self.table.set(session, facts, touch=sooner or told)

    @rule(session=st.sampled_from("abcdef"))
    def forget(self, session: str) -> None:
        self.table.sessions.pop(session, None)

    @rule(probe_at=st.one_of(st.none(), TIMES), step=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def time_passes(self, probe_at: float | None, step: float) -> None:
        self.now += step
        self.probe_at = probe_at

    @invariant()
    def picks_as_pick_due(self) -> None:
        facts = {sid: self.table.facts[sid] for sid in self.table.sessions}
        expected, expected_at = pick_due(facts, self.now, self.probe_at)
        picked, at = self.table.pick(self.now, self.probe_at)
        assert at == expected_at
        assert (picked is None) == (expected is None)
        if picked is not None:
            assert facts[picked].retry_at == facts[expected].retry_at
            assert takeable(facts[picked])


Book.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_book_answers_as_pick_due_of_every_session = Book.TestCase
