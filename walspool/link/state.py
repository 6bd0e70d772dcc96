"""The gateway link's state for one session, and the claim on its writer role.

Both are plain records guarded by the store's lock; what the writer does next with
them is decided by ``walspool.link.machine``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .. import text
from . import outage
from .machine import Owner

#: The link's one logger, for every module of it (operators filter on this name).
log = text.logger("walspool.hermes")


class NotTheHolder(RuntimeError):
    """A change only the holder of the session's claim may make, asked by another."""


class Claim:
    """A claim on a session's writer role: only the holder of this object may write
    the session or give the role up (so a stale thread can never release a newer
    writer's claim)."""

    __slots__ = ("background",)

    def __init__(self, background: bool) -> None:
        #: Held by the link's background thread (a gateway thread may take it over).
        self.background = background

    @property
    def owner(self) -> Owner:
        return Owner.BACKGROUND if self.background else Owner.GATEWAY


class SessionView(NamedTuple):
    """One session of the link as it stands (``Link.view``): who holds its writer role,
    its evictions since its spooled rows were last all written (``spooled``) and those
    not yet committed (``unconfirmed``, from ``Core.handoffs``), its rewrites
    (``generation``), its failed
    attempts in a row and when the background thread retries (``time.monotonic()``;
    0: due now), and whether a queued message is being written to state.db now."""

    owner: Owner
    spooled: int
    unconfirmed: int
    generation: int
    failures: int
    retry_at: float
    writing: bool


class Session:
    """The link's state for one session; every field is guarded by the store's lock.

    Only the holder of the session's claim (``writer``) changes the session's decisions,
    by construction: its fields are of two kinds, each changed only by its own methods.

    * The holder's: the message it is writing (``inflight``) and its backoff
      (``failures``, ``retry_at``, ``hold_until``, ``said_at``). Read by anyone; changed
      only by the methods that take the claim and check that it is the session's
      (``NotTheHolder`` otherwise): ``writing``, ``written``, ``backed_off``, ``due_at``,
      ``healthy``, ``idle``, ``said``, ``drained``, ``release``.
    * Events, recorded by anyone for the holder to read at its next step (it re-reads
      the session after every write or wait): evictions and shutdown flushes handed to
      the spool (``spooled``; those not yet committed are counted in ``Core.handoffs``), rewrites
      (``generation``), resets and wakes of the backoff, and threads waiting on the
      session (``waiters``). An event never writes the holder's fields: a reset (a
      rewrite, a recovery that moved the session's rows) or a wake (the start's recovery
      ended) is a counter, and the backoff the holder set before it reads as cleared.

    ``episode`` is the operator's log record of the session's spooling
    (``walspool.link.outage``), not an input of any decision.
    """

    __slots__ = (
        "writer",
        "spooled",
        "generation",
        "waiters",
        "episode",
        "_inflight",
        "_failures",
        "_retry_at",
        "_hold_until",
        "_said_at",
        "_resets",
        "_wakes",
        "_seen",
        "_touch",
    )

    def __init__(self, spooled: int, touch: Callable[[], None] | None = None) -> None:
        #: The current writer's claim, or None: the session has no writer.
        self.writer: Claim | None = None
        #: Evictions (and shutdown flushes) since the session's spooled rows were last
        #: all written: while not 0 they go to state.db before its in-memory rows.
        self.spooled = spooled
        #: Bumped by a transcript rewrite: what a writer learned before it is stale.
        self.generation = 0
        #: Threads waiting on this object (a gateway thread taking over, a writer
        #: waiting for its evictions): it stays in ``Core.sessions`` meanwhile.
        self.waiters = 0
        #: Its spooling since its first eviction committed, for the operator's lines.
        self.episode: outage.Episode | None = None
        self._inflight: dict[str, Any] | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._hold_until = 0.0
        self._said_at = 0.0
        self._resets = 0
        self._wakes = 0
        #: The resets and wakes the holder's backoff was set after.
        self._seen = (0, 0)
        #: Told of every event that may make the session due sooner for the background
        #: thread, or free for it to take (``walspool.link.due``).
        self._touch = touch

    # -- read by anyone --------------------------------------------------------

    def view(self, unconfirmed: int) -> SessionView:
        """The session as it stands, with its ``unconfirmed`` hand-offs (the caller
        holds the store's lock)."""
        owner = Owner.NOBODY if self.writer is None else self.writer.owner
        return SessionView(
            owner,
            self.spooled,
            unconfirmed,
            self.generation,
            self.failures,
            self.retry_at,
            self._inflight is not None,
        )

    @property
    def inflight(self) -> dict[str, Any] | None:
        """The queued message being written to state.db right now, if any."""
        return self._inflight

    @property
    def failures(self) -> int:
        """Failed attempts in a row, for the retry delay (0 after a reset)."""
        return self._failures if self._seen[0] == self._resets else 0

    @property
    def retry_at(self) -> float:
        """``time.monotonic()`` when the background thread retries after a failure (0
        after a reset or a wake: due now)."""
        return self._retry_at if self._seen == (self._resets, self._wakes) else 0.0

    def schedule_facts(self) -> tuple[Owner, bool, float, bool]:
        """Who holds the claim, whether a thread waits on the session, ``retry_at``, and
        whether it waits for an outage's probe (failures in a row, not woken since): the
        first fields of a ``machine.Candidate``, read together at each look of the
        background thread at every session (``walspool.link.retry``)."""
        owner = Owner.NOBODY if self.writer is None else self.writer.owner
        if self._seen == (self._resets, self._wakes):  # as ``retry_at`` reads it
            return owner, self.waiters > 0, self._retry_at, self._failures > 0
        return owner, self.waiters > 0, 0.0, False  # reset or woken: due now

    @property
    def woken(self) -> bool:
        """Woken (``wake``) since its holder last set its backoff: due now."""
        return self._seen[1] != self._wakes

    @property
    def hold_until(self) -> float:
        """Until then, after a failed drain, new messages only queue (and spool)."""
        return self._hold_until if self._seen == (self._resets, self._wakes) else 0.0

    @property
    def said_at(self) -> float:
        """When a failed retry past ``outage.QUIET_AFTER`` was last logged."""
        return self._said_at

    # -- the holder's changes --------------------------------------------------

    def claim(self, background: bool) -> Claim | None:
        """Become the session's writer if it has none (None if it has one)."""
        if self.writer is not None:
            return None
        self.writer = Claim(background)
        return self.writer

    def release(self, claim: Claim) -> None:
        """Give the writer role up."""
        self._check(claim)
        self.writer = None
        self._inflight = None
        self._touched()

    def writing(self, claim: Claim, message: dict[str, Any]) -> None:
        """The holder writes ``message`` (the queue's head) to state.db now."""
        self._check(claim)
        self._inflight = message

    def written(self, claim: Claim) -> None:
        """The holder's write of ``inflight`` ended."""
        self._check(claim)
        self._inflight = None

    def backed_off(
        self, claim: Claim, failures: int, retry_at: float, hold_until: float | None
    ) -> None:
        """After a failure: the failures in a row, the retry time and, after a failed
        drain, the time until which no writer drains (None: as it was)."""
        self._backoff(claim)
        self._failures, self._retry_at = failures, retry_at
        if hold_until is not None:
            self._hold_until = hold_until

    def due_at(self, claim: Claim, retry_at: float) -> None:
        """The background thread goes on with the session at ``retry_at``."""
        self._backoff(claim)
        self._retry_at = retry_at

    def healthy(self, claim: Claim) -> None:
        """A write or drain succeeded: no failures in a row."""
        self._backoff(claim)
        self._failures = 0

    def idle(self, claim: Claim) -> None:
        """Nothing is left: the backoff is cleared."""
        self._backoff(claim)
        self._failures, self._retry_at, self._hold_until = 0, 0.0, 0.0

    def said(self, claim: Claim, now: float) -> None:
        """A failed retry was logged at ``now``."""
        self._check(claim)
        self._said_at = now

    def drained(self, claim: Claim) -> None:
        """Every row the session had spooled is written."""
        self._check(claim)
        self.spooled = 0

    def _check(self, claim: Claim) -> None:
        if claim is None or self.writer is not claim:
            raise NotTheHolder("only the holder of the session's claim changes it")

    def _backoff(self, claim: Claim) -> None:
        """Before the holder changes its backoff: the events since it was set apply."""
        self._check(claim)
        self._failures, self._retry_at, self._hold_until = (
            self.failures,
            self.retry_at,
            self.hold_until,
        )
        self._seen = (self._resets, self._wakes)

    # -- events ----------------------------------------------------------------

    def evicted(self) -> None:
        """A row of the session was handed to the spool's writer (counted, until it
        commits, in ``Core.handoffs``)."""
        self.spooled += 1
        self._touched()

    def may_hold(self) -> None:
        """The spool may hold rows of the session (a recovery held them)."""
        self.spooled = self.spooled or 1
        self._touched()

    def rewritten(self) -> None:
        """The transcript was rewritten: the spooled rows are superseded, what a writer
        learned before is stale, and the backoff is reset."""
        self.generation += 1
        self.spooled = 0
        self._resets += 1
        self._touched()

    def recovered(self) -> None:
        """A recovery moved every row the session had spooled: the backoff is reset."""
        self.spooled = 0
        self._resets += 1
        self._touched()

    def wake(self) -> None:
        """The session is due now (its failures in a row are kept)."""
        self._wakes += 1
        self._touched()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A thread waits on the session for the block (it stays known meanwhile)."""
        self.waiters += 1
        try:
            yield
        finally:
            self.waiters -= 1
            self._touched()

    def _touched(self) -> None:
        if self._touch is not None:
            self._touch()


def owner_of(state: Session) -> Owner:
    """Who holds the session's claim."""
    return Owner.NOBODY if state.writer is None else state.writer.owner
