"""The gateway link's evictions: the oldest queued messages past the cap go to the
spool's writer without blocking, and a live message state.db refuses for its content is
set aside there as a quarantined row (see ``walspool.hermes`` for the bounds). Also the
lines of a session's repeated conditions, counted by ``walspool.link.repeats``.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from functools import partial
from typing import Any

from ..errors import InvalidArgument, PayloadTooLarge, SpoolReplaced, WalspoolError
from ..replay.sinks import is_row_rejection, rejects_content
from ..store.records import CAP_DROP
from ..store.writer import Request
from . import budget
from .outage import Line
from .repeats import Kind, Said
from .state import Session, log

#: The reason of a live message state.db refused for its content, quarantined at once.
REJECTED = "transcript_rejected"

#: The link's repeated conditions of a session (``walspool.link.repeats``), each told in
#: a few lines: its spool busy (the oldest message stays in memory), its evictions
#: dropped, its oldest message not spoolable, its spooled rows replayed.
KEPT, DROPPED, UNSPOOLABLE, REPLAYED = "kept", "dropped", "unspoolable", "replayed"
#: The summary lines of a session's repeated conditions (but replays), by condition and
#: whether it goes on (a summary of the occurrences since the last line) or has ended:
#: their level and text. Fields: the session, the cap and twice it (``limit``), the
#: spool's ``path``, the occurrences since the last line (``count``) and since the
#: condition began (``total``) in ``seconds``, and the latest one's ``detail``.
REPEAT_LINES: dict[tuple[str, bool], tuple[int, str]] = {
    (DROPPED, True): (
        logging.WARNING,
        "Session DB transcript pending queue full for %(session)s (cap=%(cap)d); dropped "
        "%(count)d more oldest message(s) (%(total)d in %(seconds).0f s; on-disk spool "
        "unavailable: %(detail)s)",
    ),
    (DROPPED, False): (
        logging.WARNING,
        "Session DB transcript of %(session)s: the spool %(path)s takes its evictions again; "
        "%(total)d oldest message(s) were dropped in %(seconds).1f s (%(count)d not said "
        "before)",
    ),
    (KEPT, True): (
        logging.WARNING,
        "Session DB transcript pending queue full for %(session)s (cap=%(cap)d); the spool "
        "%(path)s is still busy: the oldest message was kept in memory %(count)d more "
        "time(s) (%(total)d in %(seconds).0f s; the oldest is dropped past %(limit)d)",
    ),
    (KEPT, False): (
        logging.WARNING,
        "Session DB transcript pending queue of %(session)s is back within its cap "
        "(%(cap)d): the oldest message was kept in memory %(total)d time(s) in "
        "%(seconds).1f s while the spool %(path)s was busy (%(count)d not said before)",
    ),
    (UNSPOOLABLE, True): (
        logging.ERROR,
        "walspool still could not spool the oldest queued message of session %(session)s; "
        "it stays in memory (%(count)d more time(s), %(total)d in %(seconds).0f s): "
        "%(detail)s",
    ),
    (UNSPOOLABLE, False): (
        logging.WARNING,
        "The queue of session %(session)s no longer holds a message walspool could not "
        "spool over the cap: its oldest could not be spooled %(total)d time(s) in "
        "%(seconds).1f s (%(count)d not said before)",
    ),
}
#: Drops for the message itself (its session id, its size), not the spool's state:
#: each is said in full, as the one message it lost.
OWN_FAULT = (InvalidArgument, PayloadTooLarge)


class Evictions:
    """The eviction half of ``Link`` (a mixin: it shares the link's state)."""

    def _evict(
        self,
        session_id: str,
        state: Session,
        pending: list[dict[str, Any]],
        *,
        drops: bool = False,
    ) -> list[Callable[[], None]]:
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
        notes = self._due_lines()
        while len(pending) > self.cap:
            over = len(pending) > 2 * self.cap
            if state.inflight is not None and pending[0] is state.inflight:
                # The oldest is being written right now: evicting it could put it in
                # state.db twice, and spooling a later one would put that one ahead
                # of it if the write fails. The writer evicts when its write ends.
                if not (over and drops):
                    break
                pending.pop(1)
                notes += self._dropped(session_id, "oldest being written")
                continue
            try:
                if self._replaced:
                    # The spool's path names another file: until the background thread
                    # has a fresh spool there with the evictions the old one returned,
                    # the message stays queued behind them, as for a writer with no room.
                    raise queue.Full
                row = self.spool.prepare(session_id, pending[0], CAP_DROP)
                refused = budget.refusal(
                    self.max_bytes,
                    self.spool.footprint(),
                    self._unconfirmed_bytes,
                    self._shares.of(session_id),
                    row.size,
                )
                if refused is not None:
                    pending.pop(0)
                    notes += self._dropped(session_id, refused)
                    continue
                # The checks ``Spool.append`` makes (closed, the path still names the
                # spool's file) raise here, before the message leaves the queue.
                self.spool.put_nowait((row,), self._evicted)
            except queue.Full:
                if over and drops:
                    pending.pop(0)
                    notes += self._dropped(session_id, "spool writer busy")
                    continue
                if not over:
                    notes += self._kept(session_id, len(pending))
                break
            except WalspoolError as exc:  # closed, too big, a session id it cannot store
                pending.pop(0)
                notes += self._dropped(session_id, str(exc), own=isinstance(exc, OWN_FAULT))
                continue
            except Exception as exc:  # noqa: BLE001 - a bad value: it stays queued
                if over and drops:
                    pending.pop(0)
                    notes += self._dropped(session_id, repr(exc))
                    continue
                notes += self._unspoolable(session_id, exc)
                break
            # Off the queue only now that the spool's writer has accepted it.
            pending.pop(0)
            state.evicted()
            self._shares.accepted(session_id, row.size)
            self._unconfirmed_bytes += row.size
            notes += self._repeats_end(session_id, (KEPT, DROPPED, UNSPOOLABLE))
        if len(pending) <= self.cap:
            notes += self._repeats_end(session_id, (KEPT, UNSPOOLABLE))
        return notes

    # -- the repeated conditions (``walspool.link.repeats``); the lock is held -----

    def _dropped(self, session_id: str, why: str, *, own: bool = False) -> list[Line]:
        """The oldest message of the session was dropped: its first drop said in full,
        then a summary at most every ``REPEAT_SECONDS``; ``own`` (the message's own
        fault, ``OWN_FAULT``) is said each time."""
        if own:
            return [partial(self._report_drop, session_id, why)]
        said = self._repeats.seen((DROPPED, session_id), self.clock(), detail=why)
        return [] if said is None else [self._repeat_line((DROPPED, session_id), said)]

    def _kept(self, session_id: str, queued: int) -> list[Line]:
        said = self._repeats.seen((KEPT, session_id), self.clock())
        if said is None:
            return []
        if said.kind is Kind.FIRST:
            return [partial(self._report_kept, session_id, queued)]
        return [self._repeat_line((KEPT, session_id), said)]

    def _unspoolable(self, session_id: str, exc: BaseException) -> list[Line]:
        said = self._repeats.seen((UNSPOOLABLE, session_id), self.clock(), detail=repr(exc))
        if said is None:
            return []
        if said.kind is Kind.FIRST:
            return [partial(self._report_unspoolable, session_id, exc)]
        return [self._repeat_line((UNSPOOLABLE, session_id), said)]

    def _repeats_end(self, session_id: str, conditions: tuple[str, ...]) -> list[Line]:
        """The session's ``conditions`` are over: their heals (held back while a line of
        theirs is recent: see ``Repeats.ended``)."""
        if not self._repeats.active:
            return []
        now = self.clock()
        lines = []
        for condition in conditions:
            said = self._repeats.ended((condition, session_id), now)
            if said is not None:
                lines.append(self._repeat_line((condition, session_id), said))
        return lines

    def _due_lines(self) -> list[Line]:
        """The held-back lines whose time has come (one comparison when none is)."""
        if not self._repeats.holding:
            return []
        return [self._repeat_line(key, said) for key, said in self._repeats.due(self.clock())]

    def _repeat_line(self, key: Any, said: Said) -> Line:
        """The line that tells ``said`` of ``key`` (a condition and a session)."""
        condition, session_id = key
        if condition == REPLAYED:
            return partial(self._report_replayed, session_id, said)
        if said.kind is Kind.FIRST and condition == DROPPED:
            return partial(self._report_drop, session_id, said.detail or "")
        return partial(self._report_repeat, condition, session_id, said)

    def _report_repeat(self, condition: str, session_id: str, said: Said) -> None:
        level, line = REPEAT_LINES[condition, said.kind is Kind.AGAIN]
        fields = {
            "session": session_id,
            "cap": self.cap,
            "path": self.spool.path,
            "count": said.count,
            "total": said.total,
            "seconds": said.seconds,
            "detail": said.detail,
            "limit": 2 * self.cap,
        }
        log.log(level, line, fields)

    def _report_replayed(self, session_id: str, said: Said) -> None:
        if said.kind is Kind.FIRST:
            log.info(
                "Replayed %d spooled transcript message(s) for %s after DB recovery",
                said.count,
                session_id,
            )
        elif said.kind is Kind.AGAIN:
            log.info(
                "Replayed %d more spooled transcript message(s) for %s after DB recovery "
                "(%d in %.0f s)",
                said.count,
                session_id,
                said.total,
                said.seconds,
            )
        elif said.count:
            log.info(
                "Replayed %d more spooled transcript message(s) for %s after DB recovery "
                "(%d in all, in %.1f s)",
                said.count,
                session_id,
                said.total,
                said.seconds,
            )

    def _wait_for_head(self, state: Session, deadline: float) -> None:
        """Wait until the write of the queue's head ends (or ``deadline``); lock held."""
        with state.waiting():
            left = deadline - self.clock()
            if left > 0:
                self._settled.wait(left)

    def _evictions_done(self, requests: list[Request]) -> None:
        """On the spool's writer: a group of evictions committed (or failed); count
        them under one take of the lock, then log each."""
        settled = False
        lines: list[list[Callable[[], None]]] = []  # the operator's lines, per request
        now = self.clock()
        with self._lock:
            for request in requests:
                session_id = request.session_id
                nbytes = _payload_bytes(request)
                self._unconfirmed_bytes -= nbytes
                committed = None if request.error is not None else request.result.id
                self._shares.settled(session_id, nbytes, committed)
                said: list[Callable[[], None]] = []
                lines.append(said)
                if self._returns(request, state := self._sessions.get(session_id)):
                    # Still the session's unconfirmed eviction: it goes to the fresh
                    # spool ahead of anything evicted later (``follow_path``).
                    self._returned.extend(request.rows)
                    self._replaced = True
                    continue
                if request.error is not None and not _superseded(request, state):
                    said += self._dropped(session_id, str(request.error))
                if state is None:  # never: ``unconfirmed`` keeps it there
                    continue
                if request.error is None and state.spooled:
                    state.episode, said[:] = self._outage.evicted(session_id, state.episode, 1, now)
                settled = self._eviction_settled(session_id, state) or settled
            if settled:
                self._settled.notify_all()
            if self._replaced and not self._unconfirmed_bytes:
                self._settled.notify_all()  # a stop's flush waits for this
                self._due.notify()  # the background thread opens the fresh spool
        for request, said in zip(requests, lines, strict=True):
            self._run(said)
            if request.error is not None:
                continue
            # One line per eviction only for debugging: operators get the session's
            # start, progress and drained lines (``walspool.link.outage``).
            log.debug(
                "Session DB transcript pending queue full for %s (cap=%d); spooled oldest "
                "message to %s (seq %d) for replay after DB recovery",
                request.session_id,
                self.cap,
                self.spool.path,
                request.result.seq,
            )

    def _returns(self, request: Request, state: Session | None) -> bool:
        """Whether a failed eviction goes to a fresh spool rather than being dropped:
        it failed because the spool's path names another file now (deleted, moved),
        the background thread is there to open one, the last try did not fail, and
        no rewrite of its session came after it (then it is superseded)."""
        return (
            isinstance(request.error, SpoolReplaced)
            and not _superseded(request, state)
            and self._background_on()
            and self.clock() >= self._reopen_after
        )

    def _eviction_settled(self, session_id: str, state: Session) -> bool:
        """One of the session's evictions committed or failed for good: the session
        goes on once none is left; whether none is. The lock is held."""
        state.settled()
        if state.unconfirmed:
            return False
        if state.writer is None:
            if self._has_work(session_id, state):
                self._schedule(state.retry_at)
            else:
                self._forget_if_idle(session_id, state)
        return True

    def _report_drop(self, session_id: str, why: str) -> None:
        log.warning(
            "Session DB transcript pending queue full for %s (cap=%d); dropping oldest "
            "message to make room (on-disk spool unavailable: %s)",
            session_id,
            self.cap,
            why,
        )

    def _report_kept(self, session_id: str, queued: int) -> None:
        log.warning(
            "Session DB transcript pending queue full for %s (cap=%d); the spool %s is busy, "
            "so the oldest message stays in memory (%d queued; the oldest is dropped past %d)",
            session_id,
            self.cap,
            self.spool.path,
            queued,
            2 * self.cap,
        )

    def _report_unspoolable(self, session_id: str, exc: BaseException) -> None:
        log.error(
            "walspool could not spool the oldest queued message of session %s; it stays in "
            "memory: %s",
            session_id,
            repr(exc),  # formatted here: the log filter makes every argument text first
        )

    def _set_aside(
        self,
        session_id: str,
        pending: list[dict[str, Any]] | None,
        message: dict[str, Any],
        error: Exception,
    ) -> list[Callable[[], None]] | None:
        """Take the queue's head, which state.db refused for its content, off the queue
        into the spool as a quarantined row (``walspool ls`` shows it; replayed only when
        asked for), so the session goes on; the lock is held. Never waits: None when
        the spool's writer has no room now (then it is a failed write, retried later).
        A spool that cannot take it at all (closed, its path replaced) drops it with a
        WARNING that says why, as the released store drops at the cap. Returns the
        lines to log once the lock is released."""
        if not pending or pending[0] is not message:
            return []  # a rewrite dropped the queue meanwhile, as the released store does
        what = (
            "state.db refused it for its content"
            if rejects_content(error) or is_row_rejection(error)
            else "the gateway's write fails on one of its values"
        )
        why = f"{what}: {type(error).__name__}: {error}"
        try:
            if self._replaced:
                raise queue.Full  # as an eviction would wait for the fresh spool
            row = self.spool.prepare(session_id, message, REJECTED)
            self.spool.put_nowait((row,), partial(self._set_aside_done, why), quarantine=why)
        except queue.Full:
            return None
        except Exception as exc:  # noqa: BLE001 - closed, replaced, too big: cannot keep it
            pending.pop(0)
            return [partial(self._report_lost_rejection, session_id, why, exc)]
        pending.pop(0)
        self._shares.accepted(session_id, row.size)
        return []

    def _set_aside_done(self, why: str, request: Request) -> None:
        """On the spool's writer: a quarantined live message committed (or failed)."""
        committed = None if request.error is not None else request.result.id
        with self._lock:
            self._shares.settled(request.session_id, _payload_bytes(request), committed)
        if request.error is not None:
            self._report_lost_rejection(request.session_id, why, request.error)
            return
        log.warning(
            "Session DB transcript append refused a message of %s; quarantined it in the "
            "spool (seq %d, shown by walspool ls), the session goes on: %s",
            request.session_id,
            request.result.seq,
            why,
        )

    def _report_lost_rejection(self, session_id: str | None, why: str, exc: BaseException) -> None:
        log.warning(
            "Session DB transcript append refused a message of %s and the spool could not "
            "keep it (%s); dropped it, the session goes on: %s",
            session_id,
            exc,
            why,
        )


def _superseded(request: Request, state: Session | None) -> bool:
    """A failed eviction the session's transcript rewrite came after: it would have been
    superseded in the spool, so it is neither kept nor reported as lost."""
    return request.error is not None and state is not None and state.superseded > 0


def _payload_bytes(request: Any) -> int:
    """The payload bytes of a request's rows (the spool's ``size``, which the link
    counts), not ``payload_bytes``, which counts their names too."""
    return sum(row.size for row in request.rows)
