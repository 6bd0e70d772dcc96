"""The link's per-session state machine (``walspool.link.machine``), without threads:
from a table (state x facts -> step) and by a Hypothesis state machine that plays a
session's writer, its spool and state.db against the pure transition function; and the
session record (``walspool.link.state.Session``): only its claim's holder changes its
fields, events recorded by others only change what the holder reads."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from walspool.link.machine import (
    Backoff,
    Candidate,
    Decision,
    Entry,
    Facts,
    Owner,
    Spooled,
    Step,
    backoff_of,
    due_at,
    entry,
    failing,
    gateway_write,
    next_step,
    pick_due,
    retry_delay,
)
from walspool.link.state import Claim, NotTheHolder, SessionView
from walspool.link.state import Session as LinkSession

G, B = Owner.GATEWAY, Owner.BACKGROUND
NONE, HOLD = Spooled.NONE, Spooled.MAY_HOLD
OK, FAIL = Backoff.HEALTHY, Backoff.FAILING
NOW = 100.0

# (owner, spooled, backoff, other facts) -> decision, at ``NOW``.
TABLE = [
    # Nothing spooled: write the queue, or give the claim up when it is empty.
    (G, NONE, OK, {"queued": True}, Decision(Step.WRITE)),
    (B, NONE, OK, {"queued": True}, Decision(Step.WRITE)),
    (G, NONE, OK, {}, Decision(Step.IDLE)),
    # A retry time matters only to a failing session.
    (G, NONE, OK, {"queued": True, "retry_at": NOW + 1}, Decision(Step.WRITE)),
    (B, NONE, OK, {}, Decision(Step.IDLE)),
    # Spooled rows go first, whoever writes.
    (G, HOLD, OK, {"queued": True}, Decision(Step.DRAIN)),
    (B, HOLD, OK, {"queued": True}, Decision(Step.DRAIN)),
    (B, HOLD, OK, {}, Decision(Step.DRAIN)),
    # ... once the session's evictions have committed: a gateway thread waits for
    # them (once, bounded), the background thread comes back when they commit.
    (G, HOLD, OK, {"queued": True, "unconfirmed": True}, Decision(Step.CONFIRM)),
    (
        G,
        HOLD,
        OK,
        {"queued": True, "unconfirmed": True, "confirm_waited": True},
        Decision(Step.YIELD, retry_at=NOW),
    ),
    (B, HOLD, OK, {"unconfirmed": True}, Decision(Step.YIELD, retry_at=NOW)),
    # A failing session: gateway threads only queue until its retry time.
    (G, NONE, FAIL, {"queued": True, "retry_at": NOW + 1}, Decision(Step.YIELD)),
    (G, NONE, FAIL, {"queued": True, "retry_at": NOW}, Decision(Step.WRITE)),
    (B, NONE, FAIL, {"queued": True, "retry_at": NOW + 1}, Decision(Step.WRITE)),
    (
        G,
        NONE,
        FAIL,
        {"queued": True, "retry_at": NOW + 1, "background_on": False},
        Decision(Step.WRITE),
    ),
    # A failed drain holds the session's drains until ``hold_until``, for everyone.
    (B, HOLD, Backoff.HELD, {"hold_until": NOW + 1}, Decision(Step.YIELD)),
    (B, HOLD, FAIL, {"hold_until": NOW}, Decision(Step.DRAIN)),
    # A gateway thread's budget of drained rows: the background thread goes on.
    (G, HOLD, OK, {"budget_spent": True}, Decision(Step.YIELD, retry_at=NOW)),
    # Another process holds the spool's write lock: only the background thread waits.
    (G, HOLD, OK, {"spool_busy": True}, Decision(Step.YIELD, retry_at=NOW)),
    (B, HOLD, OK, {"spool_busy": True}, Decision(Step.DRAIN)),
    # A gateway thread waits to take over: the background thread hands over.
    (B, HOLD, OK, {"waiters": True}, Decision(Step.YIELD)),
    (B, NONE, OK, {"waiters": True, "queued": True}, Decision(Step.YIELD)),
    (G, NONE, OK, {"waiters": True, "queued": True}, Decision(Step.WRITE)),
    # The start's recovery may hold rows that go first: everyone waits for it.
    (G, NONE, OK, {"recovering": True, "queued": True}, Decision(Step.YIELD)),
    (B, HOLD, OK, {"recovering": True}, Decision(Step.YIELD)),
]


@pytest.mark.parametrize(("owner", "spooled", "backoff", "facts", "decision"), TABLE)
def test_next_step_from_the_table(owner, spooled, backoff, facts, decision):
    assert next_step(Facts(owner, spooled, backoff, **facts), NOW) == decision


@pytest.mark.parametrize(
    ("spooled", "unconfirmed", "busy", "step"),
    [
        (Spooled.NONE, False, False, Step.WRITE),
        (Spooled.NONE, True, True, Step.WRITE),  # nothing spooled: nothing to wait for
        (Spooled.MAY_HOLD, False, False, Step.DRAIN),
        # The drain's probe was the wait: hand-offs still pending or a write lock held
        # elsewhere leave the drain for later, never a second wait.
        (Spooled.MAY_HOLD, True, False, Step.YIELD),
        (Spooled.MAY_HOLD, False, True, Step.YIELD),
    ],
)
def test_a_drop_in_gateway_write_from_the_table(spooled, unconfirmed, busy, step):
    assert next_step(gateway_write(spooled, unconfirmed, busy), NOW).step is step


def test_only_the_claims_holder_decides():
    with pytest.raises(
        ValueError, match="^only the holder of the session's claim decides its next step$"
    ):
        next_step(Facts(Owner.NOBODY, NONE, OK, queued=True), NOW)


@pytest.mark.parametrize(
    ("owner", "is_failing", "closed", "busy", "expected"),
    [
        (Owner.NOBODY, False, False, False, Entry.CLAIM),
        (Owner.NOBODY, True, False, False, Entry.QUEUE),
        (G, False, False, False, Entry.QUEUE),
        (B, False, False, False, Entry.TAKE_OVER),
        (B, False, True, False, Entry.QUEUE),
        (B, False, False, True, Entry.QUEUE),
        (B, True, False, False, Entry.QUEUE),
    ],
)
def test_entry_from_the_table(owner, is_failing, closed, busy, expected):
    assert entry(owner, is_failing, closed, busy) is expected


@pytest.mark.parametrize(
    ("failures", "delays"),
    [(1, 1 / 8), (2, 1 / 4), (3, 1 / 2), (4, 1.0), (9, 1.0), (0, 1 / 8)],
)
def test_retry_delay_doubles_up_to_the_interval(failures, delays):
    assert retry_delay(failures, 1.0, 4, 0.01) == delays


def test_retry_delay_has_a_floor_only_with_background_retries():
    assert retry_delay(1, 0.04, 4, 0.01) == 0.01
    assert retry_delay(1, 0.0, 4, 0.01) == 0.0


@pytest.mark.parametrize(
    ("failures", "hold_until", "expected"),
    [(0, 0.0, OK), (0, NOW + 1, OK), (2, 0.0, FAIL), (2, NOW + 1, Backoff.HELD), (2, NOW, FAIL)],
)
def test_backoff_of(failures, hold_until, expected):
    assert backoff_of(failures, hold_until, NOW) is expected


def test_failing_only_before_the_retry_time_and_with_a_background_thread():
    assert failing(FAIL, NOW + 1, True, NOW)
    assert not failing(FAIL, NOW, True, NOW)
    assert not failing(FAIL, NOW + 1, False, NOW)
    assert not failing(OK, NOW + 1, True, NOW)


def test_pick_due_takes_the_session_longest_due_and_says_when_to_look_next():
    idle = dict(owner=Owner.NOBODY, waiters=False, unconfirmed=False, has_work=True, failing=False)
    candidates = {
        "late": Candidate(**idle, retry_at=NOW - 1),
        "later": Candidate(**idle, retry_at=NOW - 5),
        "future": Candidate(**{**idle}, retry_at=NOW + 50),
        "writing": Candidate(**{**idle, "owner": G}, retry_at=0.0),
        "waited": Candidate(**{**idle, "waiters": True}, retry_at=0.0),
        "evicting": Candidate(**{**idle, "unconfirmed": True}, retry_at=0.0),
        "idle": Candidate(**{**idle, "has_work": False}, retry_at=0.0),
    }
    assert pick_due(candidates, NOW) == ("later", NOW)
    del candidates["later"], candidates["late"]
    assert pick_due(candidates, NOW) == (None, NOW + 50)
    assert pick_due({}, NOW) == (None, None)


@pytest.mark.parametrize(
    ("retry_at", "failing", "probe_at", "due"),
    [
        (NOW + 1, False, NOW + 5, NOW + 1),  # healthy: its own retry time
        (NOW + 1, True, None, NOW + 1),  # failing, state.db not known failing
        (NOW + 1, True, NOW + 5, NOW + 5),  # failing in an outage: the next probe
        (NOW + 9, True, NOW + 5, NOW + 9),  # its own later retry time still counts
    ],
)
def test_due_at_holds_a_failing_session_for_the_outages_next_probe(
    retry_at, failing, probe_at, due
):
    assert due_at(retry_at, failing, probe_at) == due


@pytest.mark.parametrize(
    ("probe_at", "picked"),
    [
        (None, ("failing long", NOW)),  # state.db works: the one longest due
        (NOW + 1, ("healthy", NOW)),  # an outage: no failing session before the probe
        (NOW, ("failing long", NOW)),  # the probe: one failing session, longest due
        (NOW - 3, ("failing long", NOW)),
    ],
)
def test_pick_due_in_an_outage_tries_one_failing_session_per_probe(probe_at, picked):
    """While state.db failed the link's last write (``probe_at`` set), failing sessions
    wait for the probe time, healthy ones with work do not; at the probe time the
    failing session longest due is the one tried."""
    idle = dict(owner=Owner.NOBODY, waiters=False, unconfirmed=False, has_work=True)
    candidates = {
        "failing": Candidate(**idle, retry_at=NOW - 1, failing=True),
        "failing long": Candidate(**idle, retry_at=NOW - 9, failing=True),
        "healthy": Candidate(**idle, retry_at=NOW - 2, failing=False),
    }
    assert pick_due(candidates, NOW, probe_at) == picked
    del candidates["healthy"]
    expected = (None, probe_at) if probe_at is not None and probe_at > NOW else picked
    assert pick_due(candidates, NOW, probe_at) == expected
    # a failing session's own retry time still counts when it is later than the probe
    later = {"failing": Candidate(**idle, retry_at=NOW + 7, failing=True)}
    assert pick_due(later, NOW, probe_at) == (None, max(NOW + 7, probe_at or 0))


def test_pick_due_at_the_edges():
    """Due at its retry time exactly; the soonest of several later retries, whatever
    their order; a skipped session does not end the search; of two equally due, the
    one the link has known longest (first in its dict)."""
    idle = dict(owner=Owner.NOBODY, waiters=False, unconfirmed=False, has_work=True, failing=False)
    assert pick_due({"s": Candidate(**idle, retry_at=NOW)}, NOW) == ("s", NOW)
    soon, late = Candidate(**idle, retry_at=NOW + 2), Candidate(**idle, retry_at=NOW + 5)
    assert pick_due({"soon": soon, "late": late}, NOW) == (None, NOW + 2)
    assert pick_due({"late": late, "soon": soon}, NOW) == (None, NOW + 2)
    busy = Candidate(**{**idle, "owner": B}, retry_at=0.0)
    assert pick_due({"busy": busy, "s": Candidate(**idle, retry_at=NOW)}, NOW) == ("s", NOW)
    tie = {"old": Candidate(**idle, retry_at=NOW - 1), "new": Candidate(**idle, retry_at=NOW - 1)}
    assert pick_due(tie, NOW) == ("old", NOW)


class Session(RuleBasedStateMachine):
    """One session played against ``next_step``: its queue, evictions in flight, the
    spool and state.db. Messages are numbered in arrival order; state.db must always
    hold a prefix of them, in order, and nothing is lost."""

    CAP = 3

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.arrived = 0
        self.queue: list[int] = []
        self.evicting: list[int] = []  # handed to the spool's writer, not committed
        self.spool: list[int] = []
        self.db: list[int] = []
        self.spooled = NONE
        self.owner = Owner.NOBODY
        self.failures = 0
        self.retry_at = 0.0
        self.hold_until = 0.0
        self.db_ok = True
        self.confirm_waited = False
        self.background_on = True

    def facts(self) -> Facts:
        return Facts(
            owner=self.owner,
            spooled=self.spooled,
            backoff=backoff_of(self.failures, self.hold_until, self.now),
            unconfirmed=bool(self.evicting),
            queued=bool(self.queue),
            retry_at=self.retry_at,
            hold_until=self.hold_until,
            background_on=self.background_on,
            confirm_waited=self.confirm_waited,
        )

    def fail(self, *, drain: bool) -> None:
        self.failures += 1
        self.retry_at = self.now + retry_delay(self.failures, 1.0, 4, 0.01)
        if drain:
            self.hold_until = self.retry_at
        self.release()

    def release(self) -> None:
        self.owner = Owner.NOBODY
        self.confirm_waited = False

    @rule(dt=st.sampled_from([0.0, 0.01, 0.2, 2.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(ok=st.booleans())
    def set_db(self, ok: bool) -> None:
        self.db_ok = ok

    @rule()
    def arrive(self) -> None:
        """A gateway thread queues a message, evicts past the cap, and enters."""
        self.queue.append(self.arrived)
        self.arrived += 1
        while len(self.queue) > self.CAP:
            self.spooled = HOLD  # before the message leaves the queue
            self.evicting.append(self.queue.pop(0))
        is_failing = failing(
            backoff_of(self.failures, self.hold_until, self.now),
            self.retry_at,
            self.background_on,
            self.now,
        )
        if entry(self.owner, is_failing, False, False) is Entry.CLAIM:
            self.owner = Owner.GATEWAY

    @precondition(lambda self: self.evicting)
    @rule()
    def commit_evictions(self) -> None:
        self.spool += self.evicting
        self.evicting.clear()

    @precondition(lambda self: self.owner is Owner.NOBODY)
    @rule()
    def background_looks(self) -> None:
        candidate = Candidate(
            owner=self.owner,
            waiters=False,
            retry_at=self.retry_at,
            failing=False,
            unconfirmed=bool(self.evicting),
            has_work=self.spooled is HOLD or bool(self.queue),
        )
        chosen, _ = pick_due({"s": candidate}, self.now)
        if chosen is not None:
            self.owner = Owner.BACKGROUND

    @precondition(lambda self: self.owner is not Owner.NOBODY)
    @rule()
    def writer_steps(self) -> None:
        """The claim's holder performs the step the machine returns."""
        decision = next_step(self.facts(), self.now)
        step = decision.step
        if decision.retry_at is not None:
            self.retry_at = decision.retry_at
        if step is Step.WRITE:
            assert self.spooled is NONE and not self.evicting and not self.spool
            if self.db_ok:
                self.db.append(self.queue.pop(0))
                self.failures = 0
            else:
                self.fail(drain=False)
        elif step is Step.DRAIN:
            if not self.db_ok:
                self.fail(drain=True)
                return
            self.db += self.spool
            self.spool.clear()
            self.failures = 0
            self.spooled = NONE  # everything committed before this drain is out
        elif step is Step.CONFIRM:
            self.confirm_waited = True
        elif step is Step.IDLE:
            self.failures, self.retry_at, self.hold_until = 0, 0.0, 0.0
            self.release()
        else:
            self.release()

    @invariant()
    def state_db_holds_a_prefix_in_arrival_order(self) -> None:
        assert self.db == list(range(len(self.db)))

    @invariant()
    def nothing_is_lost(self) -> None:
        held = self.db + self.spool + self.evicting + self.queue
        assert sorted(held) == list(range(self.arrived))

    @invariant()
    def rows_may_be_spooled_only_while_the_session_says_so(self) -> None:
        if self.spool or self.evicting:
            assert self.spooled is HOLD

    def teardown(self) -> None:
        """Healed, with time passing, the background thread writes everything."""
        self.db_ok = True
        for _ in range(1000):
            self.now += 2.0
            if self.evicting:
                self.commit_evictions()
            if self.owner is Owner.NOBODY:
                self.background_looks()
                if self.owner is Owner.NOBODY:
                    break
            self.writer_steps()
        assert self.db == list(range(self.arrived))
        assert self.spooled is NONE


Session.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestSession = Session.TestCase


# -- who changes a session: the holder's fields and events (walspool.link.state) --

HOLDER_CHANGES = {
    "release": (),
    "writing": ({"role": "user"},),
    "written": (),
    "backed_off": (3, 150.0, 160.0),
    "due_at": (120.0,),
    "healthy": (),
    "idle": (),
    "said": (130.0,),
    "drained": (),
}


def holder_record(state: LinkSession) -> tuple[object, ...]:
    return (
        state.writer,
        state.inflight,
        state.failures,
        state.retry_at,
        state.hold_until,
        state.said_at,
        state.spooled,
    )


@pytest.mark.parametrize("change", sorted(HOLDER_CHANGES))
@pytest.mark.parametrize("holder", ["nobody", "another"])
def test_only_the_claims_holder_changes_its_fields(change, holder):
    """Each of the holder's changes, asked with a claim that is not the session's (none
    held, or another's), raises ``NotTheHolder`` and changes nothing."""
    state = LinkSession(spooled=1)
    if holder == "another":
        mine = state.claim(background=False)
        state.backed_off(mine, 2, 140.0, 145.0)
        state.writing(mine, {"role": "user", "content": "x"})
    before = holder_record(state)
    with pytest.raises(NotTheHolder) as refused:
        getattr(state, change)(Claim(background=True), *HOLDER_CHANGES[change])
    assert str(refused.value) == "only the holder of the session's claim changes it"
    assert holder_record(state) == before


# (event, its effect on (failures, retry_at, hold_until) set by the holder at
# (3, 150.0, 160.0), and on spooled from 2)
EVENTS = [
    ("evicted", (3, 150.0, 160.0), 3),
    ("may_hold", (3, 150.0, 160.0), 2),
    ("wake", (3, 0.0, 0.0), 2),
    ("recovered", (0, 0.0, 0.0), 0),
    ("rewritten", (0, 0.0, 0.0), 0),
]


@pytest.mark.parametrize("event, backoff, spooled", EVENTS)
def test_an_event_changes_what_the_holder_reads_never_what_it_wrote(event, backoff, spooled):
    """Events are recorded by anyone (no claim): a reset or a wake makes the holder's
    backoff read as cleared, without writing it; its message in flight and its last
    report stay, and its next change of the backoff starts from what it reads."""
    state = LinkSession(spooled=2)
    claim = state.claim(background=True)
    state.backed_off(claim, 3, 150.0, 160.0)
    state.writing(claim, message := {"role": "user"})
    state.said(claim, 99.0)
    getattr(state, event)()
    assert (state.failures, state.retry_at, state.hold_until) == backoff
    assert state.spooled == spooled and state.writer is claim
    assert state.inflight is message and state.said_at == 99.0
    state.due_at(claim, 170.0)  # only the time: the failures are as read
    assert (state.failures, state.retry_at) == (backoff[0], 170.0)


class SessionRecord(RuleBasedStateMachine):
    """The link's session record under any interleaving of claims, the holder's changes,
    changes asked by non-holders and events: the holder's fields read as a model says
    (events clear them, only the holder sets them), and a non-holder changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.state = LinkSession(spooled=0)
        self.claim: Claim | None = None
        self.model = (0, 0.0, 0.0)  # failures, retry_at, hold_until as read
        self.spooled = 0

    @precondition(lambda self: self.claim is None)
    @rule(background=st.booleans())
    def take(self, background):
        self.claim = self.state.claim(background)
        assert self.claim is not None and self.state.writer is self.claim

    @precondition(lambda self: self.claim is not None)
    @rule()
    def release(self):
        self.state.release(self.claim)
        self.claim = None
        assert self.state.claim(False) is not None  # free again
        self.state.release(self.state.writer)

    @precondition(lambda self: self.claim is not None)
    @rule(
        failures=st.integers(0, 9),
        retry_at=st.floats(0, 1e6),
        hold=st.none() | st.floats(0, 1e6),
    )
    def back_off(self, failures, retry_at, hold):
        self.state.backed_off(self.claim, failures, retry_at, hold)
        self.model = (failures, retry_at, self.model[2] if hold is None else hold)

    @precondition(lambda self: self.claim is not None)
    @rule(retry_at=st.floats(0, 1e6))
    def due(self, retry_at):
        self.state.due_at(self.claim, retry_at)
        self.model = (self.model[0], retry_at, self.model[2])

    @precondition(lambda self: self.claim is not None)
    @rule()
    def healthy(self):
        self.state.healthy(self.claim)
        self.model = (0, *self.model[1:])

    @precondition(lambda self: self.claim is not None)
    @rule()
    def idle(self):
        self.state.idle(self.claim)
        self.model = (0, 0.0, 0.0)

    @precondition(lambda self: self.claim is not None)
    @rule()
    def drained(self):
        self.state.drained(self.claim)
        self.spooled = 0

    @rule(change=st.sampled_from(sorted(HOLDER_CHANGES)))
    def a_non_holder_asks(self, change):
        before = holder_record(self.state)
        with pytest.raises(NotTheHolder):
            getattr(self.state, change)(Claim(background=False), *HOLDER_CHANGES[change])
        assert holder_record(self.state) == before

    @rule()
    def evicted(self):
        self.state.evicted()
        self.spooled += 1

    @rule()
    def wake(self):
        self.state.wake()
        self.model = (self.model[0], 0.0, 0.0)

    @rule(event=st.sampled_from(["rewritten", "recovered"]))
    def reset(self, event):
        generation = self.state.generation
        getattr(self.state, event)()
        self.model, self.spooled = (0, 0.0, 0.0), 0
        assert self.state.generation == generation + (event == "rewritten")

    @invariant()
    def reads_as_the_model(self):
        state = self.state
        assert (state.failures, state.retry_at, state.hold_until) == self.model
        assert state.spooled == self.spooled and state.writer is self.claim


SessionRecord.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestSessionRecord = SessionRecord.TestCase


def test_a_sessions_view_says_who_holds_it_and_what_waits():
    """``Session.view``: the holder, the evictions and rewrites, the backoff as the
    holder set it, and whether a queued message is out being written."""
    state = LinkSession(spooled=1)
    assert state.view(0) == SessionView(Owner.NOBODY, 1, 0, 0, 0, 0.0, False)
    claim = state.claim(background=True)
    assert claim is not None
    state.writing(claim, {"role": "user", "content": "x"})
    state.rewritten()
    view = state.view(2)
    assert view.unconfirmed == 2
    assert view.owner is Owner.BACKGROUND and view.writing and view.generation == 1
    gateway = Claim(background=False)
    assert gateway.owner is Owner.GATEWAY
