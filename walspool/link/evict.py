"""The gateway link's evictions: the oldest queued messages past the cap go to the
spool's writer without blocking, and a live message state.db refuses for its content is
set aside there as a quarantined row (docs/gateway.md has the bounds); and
the writer's report of each group of them, which settles their sessions.
"""

from __future__ import annotations

import logging
import queue
from functools import partial
from typing import Any

from ..errors import InvalidArgument, PayloadTooLarge, SpoolReplaced, WalspoolError
from ..replay.sinks import is_row_rejection, rejects_content
from ..store.records import CAP_DROP
from ..store.writer import Batched, Request, Row
from . import bounds, budget
from .core import Core, Note
from .lines import DROPPED, KEPT, UNSPOOLABLE, Lines
from .state import Session, log

#: The reason of a live message state.db refused for its content, quarantined at once.
REJECTED = "transcript_rejected"

#: Drops for the message itself (its session id, its size), not the spool's state:
#: each is said in full, as the one message it lost.
OWN_FAULT = (InvalidArgument, PayloadTooLarge)


class Evictions:
    """The link's evictions and set-asides, and what their commits settle."""

    def __init__(self, core: Core, lines: Lines) -> None:
        self.core = core
        self.lines = lines
        #: The spool writer's callback for evictions, once per committed group.
        self._committed = Batched(self._done)

    def evict(
        self,
        session_id: str,
        state: Session,
        pending: list[dict[str, Any]],
        *,
        drops: bool = False,
    ) -> list[Note]:
        """Spool the oldest queued messages past the cap; the lock is held.

        Returns the lines to log once the lock is released: a session's repeated
        conditions (busy spool, drops, a message it cannot spool) are said in full the
        first time, then counted into a line at most every ``REPEAT_SECONDS``
        (``walspool.link.repeats``), and the lines held back that are due now. Never
        waits: a message the spool's writer has no room for stays queued over the cap.
        With ``drops`` (a gateway thread that waited its bounded time), past twice the
        cap the oldest (the second oldest while the oldest is being written) is dropped
        with a WARNING, as the released store drops at the cap.
        """
        notes = self.lines.due()
        while len(pending) > self.core.cap:
            over = len(pending) > 2 * self.core.cap
            if state.inflight is not None and pending[0] is state.inflight:
                # The oldest is being written right now: evicting it could put it in
                # state.db twice, and spooling a later one would put that one ahead
                # of it if the write fails. The writer evicts when its write ends.
                if not (over and drops):
                    break
                pending.pop(1)
                notes += self.lines.dropped(session_id, "oldest being written")
                continue
            try:
                if self.core.replaced:
                    # The spool's path names another file: until the background thread
                    # has a fresh spool there with the evictions the old one returned,
                    # the message stays queued behind them, as for a writer with no room.
                    raise queue.Full
                row = self.core.spool.prepare(session_id, pending[0], CAP_DROP)
                refused = budget.refusal(
                    self.core.max_bytes,
                    self.core.spool.footprint(),
                    self.core.unconfirmed_bytes,
                    self.core.shares.of(session_id),
                    row.size,
                )
                if refused is not None:
                    pending.pop(0)
                    notes += self.lines.dropped(session_id, refused)
                    continue
                # The checks ``Spool.append`` makes (closed, the path still names the
                # spool's file) raise here, before the message leaves the queue.
                self.core.spool.put_nowait((row,), self._committed)
            except queue.Full:
                if over and drops:
                    pending.pop(0)
                    notes += self.lines.dropped(session_id, "spool writer busy")
                    continue
                if not over:
                    notes += self.lines.kept(session_id, len(pending))
                break
            except WalspoolError as exc:  # closed, too big, a session id it cannot store
                pending.pop(0)
                notes += self.lines.dropped(session_id, str(exc), own=isinstance(exc, OWN_FAULT))
                continue
            except Exception as exc:  # noqa: BLE001 - a bad value: it stays queued
                if over and drops:
                    pending.pop(0)
                    notes += self.lines.dropped(session_id, repr(exc))
                    continue
                notes += self.lines.unspoolable(session_id, exc)
                break
            # Off the queue only now that the spool's writer has accepted it.
            pending.pop(0)
            state.evicted()
            self.core.handoffs.handed(session_id)
            self.core.shares.accepted(session_id, row.size)
            self.core.unconfirmed_bytes += row.size
            notes += self.lines.ended(session_id, (KEPT, DROPPED, UNSPOOLABLE))
        if len(pending) <= self.core.cap:
            notes += self.lines.ended(session_id, (KEPT, UNSPOOLABLE))
        return notes

    def wait_for_head(self, state: Session, deadline: float) -> None:
        """Wait until the write of the queue's head ends (or ``deadline``, on
        ``Core.timer``); lock held."""
        with state.waiting():
            left = deadline - self.core.timer()
            if left > 0:
                self.core.settled.wait(left)

    def _done(self, requests: list[Request]) -> None:
        """On the spool's writer: a group of evictions committed (or failed); count
        them, ``bounds.SETTLE_CHUNK`` at a time under the lock, then log each."""
        lines: list[list[Note]] = []  # the operator's lines, per request
        for start in range(0, len(requests), bounds.SETTLE_CHUNK):
            # A group may hold thousands: a gateway thread waits for the lock behind
            # one chunk at most. Each settle is whole on its own, in the writer's order.
            lines += self._settle(requests[start : start + bounds.SETTLE_CHUNK])
        for request, said in zip(requests, lines, strict=True):
            self.core.run(said)
            if request.error is not None:
                continue
            # One line per eviction only for debugging: operators get the session's
            # start, progress and drained lines (``walspool.link.outage``).
            log.debug(
                "Session DB transcript pending queue full for %s (cap=%d); spooled oldest "
                "message to %s (seq %d) for replay after DB recovery",
                request.session_id,
                self.core.cap,
                self.core.spool.path,
                request.result.seq,
            )

    def _settle(self, requests: list[Request]) -> list[list[Note]]:
        """Count ``requests`` (settled by the writer, in order) under one take of the
        lock; the lines to log for each."""
        settled = False
        lines: list[list[Note]] = []
        now = self.core.clock()
        with self.core.lock:
            for request in requests:
                session_id = request.session_id
                nbytes = _payload_bytes(request)
                self.core.unconfirmed_bytes -= nbytes
                committed = None if request.error is not None else request.result.id
                self.core.shares.settled(session_id, nbytes, committed)
                said: list[Note] = []
                lines.append(said)
                state = self.core.sessions.get(session_id)
                superseded = self.core.handoffs.superseded(session_id)
                if self._returns(request, superseded):
                    # Still the session's unconfirmed eviction: it goes to the fresh
                    # spool ahead of anything evicted later (``Follow.follow_path``).
                    self.core.returned.extend(request.rows)
                    self.core.replaced = True
                    continue
                if request.error is not None and not superseded:
                    said += self.lines.dropped(session_id, str(request.error))
                if state is not None and request.error is None and state.spooled:
                    state.episode, said[:] = self.core.outage.evicted(
                        session_id, state.episode, 1, now
                    )
                settled = self.settled(session_id, state) or settled
            if settled:
                self.core.settled.notify_all()
            if self.core.replaced and not self.core.unconfirmed_bytes:
                self.core.settled.notify_all()  # a stop's flush waits for this
                self.core.due.notify()  # the background thread opens the fresh spool
        return lines

    def _returns(self, request: Request, superseded: bool) -> bool:
        """Whether a failed eviction goes to a fresh spool rather than being dropped:
        it failed because the spool's path names another file now (deleted, moved),
        the background thread is there to open one, the last try did not fail, and
        no rewrite of its session came after it (``superseded``)."""
        return (
            isinstance(request.error, SpoolReplaced)
            and not superseded
            and self.core.background_on()
            and self.core.clock() >= self.core.reopen_after
        )

    def settled(self, session_id: str, state: Session | None) -> bool:
        """One of the session's evictions committed or failed for good: the session
        (``state``; None once it is gone, never while a hand-off keeps it) goes on once
        none is left; whether none is. The lock is held."""
        if not self.core.handoffs.settled(session_id):
            return False
        if state is not None and state.writer is None:
            if self.core.has_work(session_id, state):
                self.core.due_again(session_id, state)
            else:
                self.core.forget_if_idle(session_id, state)
        return True

    def hand_over(self, rows: list[Row]) -> list[Note]:
        """Queue the returned evictions' ``rows`` in the (fresh) spool, in order;
        what finds no room is dropped with a WARNING. The lock is held."""
        lines: list[Note] = []
        for row in rows:
            session_id = row.session_id
            try:
                self.core.spool.put_nowait((row,), self._committed)
            except Exception as exc:  # noqa: BLE001 - no room, closed: it cannot be kept
                lines += self.lines.dropped(session_id, f"a fresh spool could not take it: {exc!r}")
                self.settled(session_id, self.core.sessions.get(session_id))
                continue
            self.core.shares.accepted(session_id, row.size)
            self.core.unconfirmed_bytes += row.size
        return lines

    def set_aside(
        self,
        session_id: str,
        pending: list[dict[str, Any]] | None,
        message: dict[str, Any],
        error: Exception,
    ) -> list[Note] | None:
        """Take the queue's head, which state.db refused for its content, off the queue
        into the spool as a quarantined row (``walspool ls`` shows it; replayed only when
        asked for), so the session goes on; the lock is held. Never waits: None when
        the spool's writer has no room now (then it is a failed write, retried later).
        A spool that cannot take it at all (closed, its path replaced) drops it with a
        WARNING that says why, as the released store drops at the cap. Returns the
        lines to log once the lock is released."""
        if not pending or pending[0] is not message:
            return []  # a rewrite dropped the queue meanwhile, as the released store does
        why = rejection_why(error)
        try:
            if self.core.replaced:
                raise queue.Full  # as an eviction would wait for the fresh spool
            row = self.core.spool.prepare(session_id, message, REJECTED)
            self.core.spool.put_nowait((row,), partial(self._set_aside_done, why), quarantine=why)
        except queue.Full:
            return None
        except Exception as exc:  # noqa: BLE001 - closed, replaced, too big: cannot keep it
            pending.pop(0)
            return [partial(self._report_lost_rejection, session_id, why, exc)]
        pending.pop(0)
        self.core.shares.accepted(session_id, row.size)
        return []

    def _set_aside_done(self, why: str, request: Request) -> None:
        """On the spool's writer: a quarantined live message committed (or failed)."""
        committed = None if request.error is not None else request.result.id
        with self.core.lock:
            self.core.shares.settled(request.session_id, _payload_bytes(request), committed)
        if request.error is not None:
            self._report_lost_rejection(request.session_id, why, request.error)
            return
        say_set_aside(log, request.session_id, request.result.seq, why)

    def _report_lost_rejection(self, session_id: str | None, why: str, exc: BaseException) -> None:
        say_lost_rejection(log, session_id, why, exc)


def rejection_why(error: BaseException) -> str:
    """Why a live message the gateway's write refused is set aside, said the same by
    every gateway's path."""
    what = (
        "state.db refused it for its content"
        if rejects_content(error) or is_row_rejection(error)
        else "the gateway's write fails on one of its values"
    )
    return f"{what}: {type(error).__name__}: {error}"


def say_set_aside(logger: logging.Logger, session_id: str | None, seq: int, why: str) -> None:
    """A live message the gateway's write refused is in the spool, quarantined."""
    logger.warning(
        "Session DB transcript append refused a message of %s; quarantined it in the "
        "spool (seq %d, shown by walspool ls), the session goes on: %s",
        session_id,
        seq,
        why,
    )


def say_lost_rejection(
    logger: logging.Logger, session_id: str | None, why: str, exc: BaseException
) -> None:
    """A live message the gateway's write refused could not be kept by the spool either."""
    logger.warning(
        "Session DB transcript append refused a message of %s and the spool could not "
        "keep it (%s); dropped it, the session goes on: %s",
        session_id,
        exc,
        why,
    )


def _payload_bytes(request: Any) -> int:
    """The payload bytes of a request's rows (the spool's ``size``, which the link
    counts), not ``payload_bytes``, which counts their names too."""
    return sum(row.size for row in request.rows)
