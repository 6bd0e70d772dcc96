"""The gateway link's per-session state machine: pure decisions, no I/O.

A session of the link (``walspool.hermes``) is described by three explicit states:
who owns it (``Owner``), whether it may hold spooled rows (``Spooled``) and its
backoff (``Backoff``). What its writer does next is a function of those, a few facts
the shell reads under the store's lock, and ``now``, which is an argument: this module
reads no clock, takes no lock and touches no file, so every decision can be tested
from a table (as h11's ``_state.py`` is).

Two invariants hold by construction:

* ``next_step`` returns ``Step.WRITE`` (write the queue's head) only when the session
  may hold no spooled row (``Spooled.NONE``): spooled rows, older than anything
  queued, always go first, and an eviction marks its session ``MAY_HOLD`` before it
  leaves the queue;
* every step is decided for the holder of the session's claim (``Owner.GATEWAY`` or
  ``Owner.BACKGROUND``): a thread that holds no claim only queues (``Entry``).

Not modelled here: the spool, the queue's contents and the threads themselves; the
shell (``Link``) performs the steps and reports their outcome as new facts. The facts
come from the session's record (``walspool.link.state.Session``), where only the
claim's holder changes the backoff and the message in flight, and everyone else
records events (evictions, commits, rewrites, recoveries, waiters) it reads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class Owner(enum.Enum):
    """Who holds the session's claim: only the holder writes or changes the session."""

    NOBODY = "nobody"
    GATEWAY = "gateway"  #: the gateway thread whose message found the session idle
    BACKGROUND = "background"  #: the link's one background thread


class Spooled(enum.Enum):
    """Whether the session may hold rows in the spool (they go before its queue)."""

    NONE = "none"
    MAY_HOLD = "may hold"


class Backoff(enum.Enum):
    """The session's failure state."""

    HEALTHY = "healthy"
    #: A write failed: the background thread retries at ``retry_at``; meanwhile the
    #: session's gateway threads only queue.
    FAILING = "failing"
    #: A drain failed: as ``FAILING``, and no writer drains before ``hold_until``.
    HELD = "held"


class Step(enum.Enum):
    """What the session's writer does next."""

    WRITE = "write the queue's head"
    DRAIN = "drain a chunk of spooled rows"
    CONFIRM = "wait for the session's evictions to commit"
    YIELD = "give the claim up; the background thread goes on at retry_at"
    IDLE = "give the claim up; nothing is left (the backoff is cleared)"


class Entry(enum.Enum):
    """What a gateway thread does with the message it has just queued."""

    CLAIM = "claim the idle session and write it"
    TAKE_OVER = "wait (bounded) for the background thread to hand the session over"
    QUEUE = "leave the message queued for the session's writer"


@dataclass(frozen=True, slots=True)
class Facts:
    """What the claim's holder knows of its session, read under the store's lock."""

    owner: Owner
    spooled: Spooled
    backoff: Backoff
    #: Evictions of the session handed to the spool's writer and not yet committed.
    unconfirmed: bool = False
    #: The session's in-memory queue is not empty.
    queued: bool = False
    #: When the background thread retries (monotonic seconds).
    retry_at: float = 0.0
    #: Until then, after a failed drain, no writer drains.
    hold_until: float = 0.0
    #: A gateway thread waits to take the session over from the background thread.
    waiters: bool = False
    #: The start's recovery runs (it may hold rows of this session, which go first).
    recovering: bool = False
    #: The background thread runs (``retry_interval > 0`` and the link is open).
    background_on: bool = True
    #: Another process holds the spool's write lock, and the link retries in the
    #: background (``retry_interval > 0``): a gateway thread leaves the wait to it.
    spool_busy: bool = False
    #: The gateway thread has drained its budget of spooled rows in this call.
    budget_spent: bool = False
    #: The gateway thread has already waited its bound for its evictions.
    confirm_waited: bool = False


def gateway_write(spooled: Spooled, unconfirmed: bool = False, spool_busy: bool = False) -> Facts:
    """The facts of a 0.20 or 0.22 gateway thread about to write its message (the
    drop-in, ``walspool.gateways.drop_in``): it holds the session (its store's drain
    lock), has the message queued, keeps no backoff of walspool's (the gateway retries
    in its own way), and has had its wait for its hand-offs (the drain's probe)."""
    return Facts(
        owner=Owner.GATEWAY,
        spooled=spooled,
        backoff=Backoff.HEALTHY,
        unconfirmed=unconfirmed,
        queued=True,
        spool_busy=spool_busy,
        confirm_waited=True,
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """A step and, when not None, the session's new ``retry_at``."""

    step: Step
    retry_at: float | None = None


def failing(backoff: Backoff, retry_at: float, background_on: bool, now: float) -> bool:
    """Whether the session's gateway threads only queue: a write or drain failed and
    the background thread retries it once ``retry_at`` passes (so an outage costs no
    failing write, and no wait, per message). Without a background thread each
    message retries again."""
    return backoff is not Backoff.HEALTHY and background_on and now < retry_at


def next_step(facts: Facts, now: float) -> Decision:
    """What the claim's holder does next (see ``Step``)."""
    if facts.owner is Owner.NOBODY:
        raise ValueError("only the holder of the session's claim decides its next step")
    gateway = facts.owner is Owner.GATEWAY
    if not gateway and facts.waiters:
        # A gateway thread with a new message waits to take the session over.
        return Decision(Step.YIELD)
    if facts.recovering:
        # The start's recovery wakes the session when it ends.
        return Decision(Step.YIELD)
    if gateway and failing(facts.backoff, facts.retry_at, facts.background_on, now):
        return Decision(Step.YIELD)
    if facts.spooled is Spooled.MAY_HOLD:
        if now < facts.hold_until:
            return Decision(Step.YIELD)
        if facts.budget_spent:
            return Decision(Step.YIELD, retry_at=now)  # the background thread goes on
        if facts.unconfirmed:
            if gateway and not facts.confirm_waited:
                return Decision(Step.CONFIRM)
            # The drain must see those rows; their last commit wakes the session.
            return Decision(Step.YIELD, retry_at=now)
        if gateway and facts.spool_busy:
            # The background thread, not a gateway thread, waits for the write lock.
            return Decision(Step.YIELD, retry_at=now)
        return Decision(Step.DRAIN)
    if not facts.queued:
        return Decision(Step.IDLE)
    return Decision(Step.WRITE)


def entry(owner: Owner, is_failing: bool, closed: bool, spool_busy: bool) -> Entry:
    """What a gateway thread does after queueing a message (see ``Entry``)."""
    if is_failing:
        return Entry.QUEUE
    if owner is Owner.NOBODY:
        return Entry.CLAIM
    if owner is Owner.BACKGROUND and not closed and not spool_busy:
        # Not behind a writer that may wait for a write lock held by another process.
        return Entry.TAKE_OVER
    return Entry.QUEUE


def retry_delay(failures: int, retry_interval: float, steps: int, floor: float) -> float:
    """Seconds until the retry after ``failures`` failures in a row: ``retry_interval``
    * 2 ** (k - ``steps``), capped at ``retry_interval``, at least ``floor`` while
    retries run in the background."""
    exponent = min(max(failures, 1), steps) - steps
    delay = retry_interval * 2.0**exponent
    if retry_interval > 0:
        delay = max(delay, floor)
    return delay


def backoff_of(failures: int, hold_until: float, now: float) -> Backoff:
    """The backoff state a session's counters describe at ``now``."""
    if not failures:
        return Backoff.HEALTHY
    return Backoff.HELD if now < hold_until else Backoff.FAILING


class Candidate(NamedTuple):
    """A session as the background thread sees it when it looks for work. The thread
    makes one for every session at every look: it passes plain tuples of these fields,
    in this order (a named tuple costs several times as much to make)."""

    owner: Owner
    waiters: bool
    retry_at: float
    #: Its last write or drain failed (it has failures in a row), and it was not woken.
    failing: bool
    unconfirmed: bool
    has_work: bool


def due_at(retry_at: float, failing: bool, probe_at: float | None) -> float:
    """When the background thread may take a session: its retry time, and for a
    failing session in an outage (``probe_at`` set) not before the next probe."""
    if failing and probe_at is not None:
        return max(retry_at, probe_at)
    return retry_at


def pick_due(
    candidates: Mapping[str, tuple[Owner, bool, float, bool, bool, bool]],
    now: float,
    probe_at: float | None = None,
) -> tuple[str | None, float | None]:
    """The session the background thread claims (the one longest due) of
    ``candidates`` (``Candidate``s, or plain tuples of their fields), and when to look
    next (``now`` after a claim; the soonest retry otherwise, None for never).

    ``probe_at`` (not None while state.db failed the link's last write or drain): a
    failing session is not due before it, so in an outage the background thread tries
    one failing session at a time (the probe, the one longest due), the probes
    backing off as one session's retries do, not every session each interval; the
    first that succeeds clears it and the others follow at once."""
    due: tuple[float, str] | None = None
    later: float | None = None
    nobody = Owner.NOBODY
    for session_id, facts in candidates.items():
        owner, waiters, retry_at, failing, unconfirmed, has_work = facts
        if owner is not nobody or waiters or unconfirmed or not has_work:
            continue
        at = due_at(retry_at, failing, probe_at)
        if at > now:
            if later is None or at < later:
                later = at
        elif due is None or retry_at < due[0]:
            due = (retry_at, session_id)
    if due is None:
        return None, later
    return due[1], now
