"""The gateway link's session writer: the holder of a session's claim asks the machine
(``walspool.link.machine``) for its next step and performs it: drain a chunk of spooled
rows, write the queue's head, wait for its evictions, or give the claim up.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import ReplayBusy
from ..replay.sinks import rejects_live_row
from . import bounds, machine, outage
from .core import Core, Note
from .evict import Evictions
from .lines import REPLAYED, Lines
from .machine import Facts, Spooled, Step
from .state import Claim, Session, log


class Stopping(Protocol):
    """What the writer tells the shutdown (``walspool.link.shutdown.Shutdown``)."""

    def spool_if_stopping(self) -> None:
        """A write failed once the stop's flush had begun (counted in
        ``Core.stop_spools``): spool what is queued now."""


class SessionWriter:
    """Writes a session as the holder of its claim."""

    def __init__(self, core: Core, evictions: Evictions, lines: Lines, shutdown: Stopping) -> None:
        self.core = core
        self.evictions = evictions
        self.lines = lines
        self.shutdown = shutdown

    def write_session(
        self, session_id: str, state: Session, claim: Claim, *, budget: int | None
    ) -> None:
        """Write the session's spooled rows, then its queue, as its writer.

        The caller holds ``claim``. Runs until the session has nothing left, a write
        fails, it must wait, or ``budget`` spooled rows moved on a gateway thread; then
        gives the role up (the background thread goes on). Every decision is made on
        the state read under the lock after the last write or wait. Never raises: an
        unexpected error is logged with the session id, and the messages stay queued
        or spooled.
        """
        moved = 0
        try:
            while True:
                with self.core.lock:
                    step, notes = self._next_step(session_id, state, claim, moved, budget)
                self.core.run(notes)
                if step is None:
                    return
                if step is Step.DRAIN:
                    done = self._drain_step(session_id, state, claim)
                    if done is None:
                        return
                    moved += done
                elif not self._write_head(session_id, state, claim):
                    return
        except Exception:  # noqa: BLE001 - the gateway must go on
            log.exception(
                "walspool could not write session %s; its messages stay queued", session_id
            )
            with self.core.lock:
                if state.writer is claim:
                    self.core.failed(state, claim, drain=False)
                self.core.release(session_id, state, claim)

    def _next_step(
        self, session_id: str, state: Session, claim: Claim, moved: int, budget: int | None
    ) -> tuple[Step | None, list[Note]]:
        """What the writer does next (``Step.DRAIN``, ``Step.WRITE``), or None after
        giving the role up; and the WARNINGs to log. The machine decides
        (``machine.next_step``); this performs its waits and its release. The
        lock is held."""
        notes: list[Note] = []
        pending = self.core.queue(session_id)
        if pending:
            notes = self.evictions.evict(session_id, state, pending)
        confirm_waited = False
        while True:
            now = self.core.clock()
            facts = self._facts(session_id, state, claim, moved, budget, confirm_waited)
            decision = machine.next_step(facts, now)
            if decision.retry_at is not None:
                state.due_at(claim, decision.retry_at)
            step = decision.step
            if step is Step.CONFIRM:
                # Decided again on the state after the wait.
                with state.waiting():  # a waiter keeps the session known
                    self.core.handoffs.wait(
                        session_id, bounds.CONFIRM_WAIT, self.core.spool.busy, self.core.timer
                    )
                confirm_waited = True
                continue
            if step is Step.IDLE:
                self.core.transcripts.forget_failures(session_id)
                state.idle(claim)
            if step is Step.IDLE or step is Step.YIELD:
                self.core.release(session_id, state, claim)
                return None, notes
            return step, notes

    def _facts(
        self,
        session_id: str,
        state: Session,
        claim: Claim,
        moved: int,
        budget: int | None,
        confirm_waited: bool,
    ) -> Facts:
        """What the machine needs to know of the session, read now; the lock is held."""
        now = self.core.clock()
        return Facts(
            owner=claim.owner,
            spooled=Spooled.MAY_HOLD if state.spooled else Spooled.NONE,
            backoff=machine.backoff_of(state.failures, state.hold_until, now),
            unconfirmed=bool(self.core.handoffs.pending(session_id)),
            queued=bool(self.core.queue(session_id)),
            retry_at=state.retry_at,
            hold_until=state.hold_until,
            waiters=bool(state.waiters),
            recovering=self.core.recovering,
            background_on=self.core.background_on(),
            spool_busy=(
                bool(state.spooled)
                and not claim.background
                and self.core.retry_interval > 0
                and self.core.spool.busy()
            ),
            budget_spent=budget is not None and moved >= budget,
            confirm_waited=confirm_waited,
        )

    def _drain_step(self, session_id: str, state: Session, claim: Claim) -> int | None:
        """Replay one chunk of the session's spooled rows; rows moved, or None when the
        writer gave its role up."""
        with self.core.lock:
            seen, generation = state.spooled, state.generation
            if self.core.spool.closed:
                # Nothing to drain from (the spool's owner closed it); the rows wait
                # for the next start's recovery, and the queue behind them.
                self.core.failed(state, claim, drain=True)
                self.core.release(session_id, state, claim)
                return None
        # Drains of this link take turns here, each for one chunk. A gateway thread
        # does not wait for another session's turn when the background thread can
        # drain this session later: in an outage each failing drain costs two spool
        # commits, and gateway threads queued here were the slowest calls.
        wait = bounds.HANDOFF_WAIT
        if not claim.background and self.core.background_on():
            wait = 0.0
        if not self.core.draining.acquire(timeout=wait):
            return self._busy(session_id, state, claim)
        try:
            report = self.core.replay(
                session_id=session_id, limit=bounds.DRAIN_CHUNK_ROWS, wait=False
            )
        except ReplayBusy:
            # Another replay (the CLI, a recovery) has the spool's replay lock: never
            # wait for it here; try again soon.
            return self._busy(session_id, state, claim)
        except Exception as exc:  # noqa: BLE001 - the gateway goes on; rows stay spooled
            log.warning(
                "Replay of spooled transcript messages for %s failed in %s; holding back its "
                "queued messages: %s",
                session_id,
                self.core.spool.path,
                exc,
            )
            with self.core.lock:
                self.core.failed(state, claim, drain=True)
                self.core.release(session_id, state, claim)
            return None
        finally:
            self.core.draining.release()
        lines: list[Note] = []
        with self.core.lock:
            if state.generation != generation:
                return 0  # rewritten meanwhile: the next step decides afresh
            now = self.core.clock()
            if report.moved:
                # The first chunk said at once, then a line at most every REPEAT_SECONDS.
                said = self.core.repeats.seen((REPLAYED, session_id), now, report.moved)
                if said is not None:
                    lines.append(self.lines.line((REPLAYED, session_id), said))
            if report.held or session_id in report.errors:
                self.core.failed(state, claim, drain=True)
                self.core.transcripts.count_failure(session_id)
                queued = len(self.core.queue(session_id) or ())
                say = self._say_again(state, claim, now)
                self.core.release(session_id, state, claim)
            else:
                self.core.succeeded(state, claim)
                self.core.outage.replayed_rows(state.episode, report.moved)
                touched = report.moved + report.recovered + report.quarantined
                if not touched and state.spooled == seen:
                    # Nothing left: the rows counted in ``seen`` were all committed
                    # before this replay looked (``unconfirmed`` was 0), so all moved.
                    state.drained(claim)
                    said = self.core.repeats.ended((REPLAYED, session_id), now, at_once=True)
                    if said is not None:
                        lines.append(self.lines.line((REPLAYED, session_id), said))
                    lines += self.core.outage.ended(session_id, state.episode, now)
                    state.episode = None
        self.core.run(lines)
        if report.held or session_id in report.errors:
            if not say:
                return None
            log.warning(
                "Replay of %d spooled transcript message(s) for %s failed; keeping them in %s "
                "and holding back %d queued message(s): %s",
                report.held,
                session_id,
                self.core.spool.path,
                queued,
                report.errors.get(session_id, "unknown error"),
            )
            return None
        return report.moved

    def _say_again(self, state: Session, claim: Claim, now: float) -> bool:
        """Whether to log the session's latest failed retry (rate-limited, see
        ``walspool.link.outage.repeat_due``); the lock is held, ``_failed`` has counted it."""
        if not outage.repeat_due(state.failures, state.said_at, now):
            return False
        if state.failures >= outage.QUIET_AFTER:
            state.said(claim, now)  # the next is said no sooner than REPORT_SECONDS after
        return True

    def _busy(self, session_id: str, state: Session, claim: Claim) -> None:
        """Give a drain up for now (another replay runs); the background thread tries
        again after the first retry delay, and a new message may try at once."""
        with self.core.lock:
            self.core.failed(state, claim, drain=False, count=False)
            self.core.release(session_id, state, claim)
        return None

    def _write_head(self, session_id: str, state: Session, claim: Claim) -> bool:
        """Write the head of the session's queue; True to go on, False when stopped."""
        with self.core.lock:
            pending = self.core.queue(session_id)
            if not pending or state.spooled:
                return True  # the next step decides again
            message = pending[0]
            state.writing(claim, message)
        error = self.core.transcripts.write(session_id, message)
        with self.core.lock:
            state.written(claim)
            if state.waiters:
                self.core.settled.notify_all()  # appenders held back by this write
            pending = self.core.queue(session_id)
            if error is None:
                if pending and pending[0] is message:
                    pending.pop(0)
                self.core.succeeded(state, claim)
                return True
            aside = None
            if rejects_live_row(error, self.core.transcripts.db, message):
                aside = self.evictions.set_aside(session_id, pending, message, error)
            if aside is not None:
                self.core.succeeded(state, claim)  # state.db works: the session goes on at once
            else:
                failures = self.core.transcripts.count_failure(session_id)
                queued = len(pending or ())
                self.core.failed(state, claim, drain=False)
                say = self._say_again(state, claim, self.core.clock())
                # Messages that arrived during the write waited for it to be evicted.
                notes = self.evictions.evict(session_id, state, pending) if pending else []
                self.core.release(session_id, state, claim)
                # Once the stop's flush began, no later flush comes: this thread spools
                # what waited behind the write (counted, so a stop's close waits for it).
                stopping = self.core.stopping
                self.core.stop_spools += stopping
        if aside is not None:
            self.core.run(aside)
            return True
        self.core.run(notes)
        if stopping:
            self.shutdown.spool_if_stopping()
        if not say:
            return False
        log.warning(
            "Session DB transcript append failed for %s (failure_count=%d, pending=%d); "
            "will retry: %s",
            session_id,
            failures,
            queued,
            error,
        )
        return False
