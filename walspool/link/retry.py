"""The gateway link's background thread: the start's recovery, then the retries of
every session whose retry time has passed, with no new message needed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import SpoolClosed
from ..replay.replayer import ReplayReport
from . import bounds, machine, shares
from .state import Claim, Session, SessionView, log, owner_of


class Retries:
    """The background half of ``Link`` (a mixin: it shares the link's state)."""

    def _schedule(self, at: float) -> None:
        """Make the background thread look at ``at`` (monotonic) or sooner; lock held."""
        if self.retry_interval <= 0 or self._closed:
            return
        if self._wake_at is None or at < self._wake_at:
            self._wake_at = at
            self._due.notify()

    def start(self, *, recover: bool, recovery: bool, count: bool = False) -> None:
        """Start the link (``install``): with ``recover``, the replay of what earlier
        runs spooled runs first on the background thread when ``recovery`` (the spool
        may hold such rows); without it, sessions drain their own before writing. With
        ``count`` (the spool holds rows), the background thread first counts each
        session's bytes in it (``count_shares``)."""
        if recover:
            if recovery:
                self._recovering = True
            else:
                self._recovered = True
        if count:
            # Not under the store's lock: ``install`` may be called with it held. A
            # commit settled before this is not kept apart, and needs not be: it came
            # before the count, which sees it.
            self._shares.start_count()
        self.memory.start()
        self._start()

    def _start(self) -> None:
        if self.retry_interval <= 0 and not self._recovering and not self._shares.counting:
            return
        self._thread = threading.Thread(
            target=background,
            args=(weakref.ref(self), self._due),
            daemon=True,
            name=f"walspool-link {self.spool.path}",
        )
        self._thread.start()

    def _due_sessions(self) -> tuple[list[tuple[str, Session, Claim]], float | None]:
        """Claim the session longest due (its retry time passed first); when to look
        next. One at a time: a claim held while the thread works on another session
        would make a gateway thread wait for that one too. A session given a slice
        of ``bounds.GATEWAY_DRAIN_ROWS`` rows is due again from then on, so sessions with
        backlogs take turns. Lock held."""
        now = self.clock()
        candidates = {
            session_id: machine.Candidate(
                owner=owner_of(state),
                waiters=bool(state.waiters),
                unconfirmed=bool(state.unconfirmed),
                has_work=self._has_work(session_id, state),
                retry_at=state.retry_at,
            )
            for session_id, state in self._sessions.items()
        }
        session_id, look_at = machine.pick_due(candidates, now)
        if session_id is None:
            return [], look_at
        state = self._sessions[session_id]
        claim = self._claim(state, background=True)
        assert claim is not None  # no writer: checked above, under the same lock
        return [(session_id, state, claim)], look_at

    def close(self) -> None:
        """Stop the background thread (at its next look). Idempotent. The link goes on
        spooling evictions; sessions retry on their next message. The repeated
        conditions' lines held back are said now, so every count is told."""
        with self._lock:
            self._closed = True
            self._due.notify_all()
            held = [self._repeat_line(key, said) for key, said in self._repeats.flush(self.clock())]
        self._run(held)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(bounds.HANDOFF_WAIT)
        self.memory.stop()

    def view(self, session_id: str) -> SessionView | None:
        """Session ``session_id`` as it stands, or None when the link holds nothing for
        it (no writer, no queued or spooled work, nobody waiting). Takes the store's
        lock: not for a caller that holds it."""
        with self._lock:
            state = self._sessions.get(session_id)
            return None if state is None else state.view()

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until the start's count and recovery are
        done and no session has a writer, queued or spooled work; True if so (for
        tests and shutdowns)."""
        deadline = self.clock() + timeout
        with self._lock:
            while (
                self._recovering
                or self._shares.counting
                or any(
                    s.writer is not None or s.unconfirmed or self._has_work(sid, s)
                    for sid, s in self._sessions.items()
                )
            ):
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def count_shares(self) -> None:
        """Count each session's bytes in the spool, its share of the cap (once, at the
        start, on the background thread: one walk of an index, 0.6 to 0.8 s for a
        million rows; see ``walspool.link.budget.Shares`` for how it is kept exact).

        Nothing waits for it: sessions go on writing and draining meanwhile. Once
        counted, it waits for the spool's writer to report every commit the count may
        have seen, then applies the count. A failure leaves the shares at what this run
        spooled, logged (quietly once the spool is closed: nothing is spooled any more).
        """
        try:
            self._count()
        except SpoolClosed:
            log.debug("%s was closed before its rows were counted", self.spool.path)
            with self._lock:
                self._shares.give_up()
                self._settled.notify_all()
        except Exception:  # noqa: BLE001 - the link goes on with this run's shares
            log.exception(
                "could not count what each session holds in %s; until the next start a "
                "session's share of the cap is what it spooled since this one",
                self.spool.path,
            )
            with self._lock:
                self._shares.give_up()
                self._settled.notify_all()

    def _count(self) -> None:
        counted, max_id = shares.count(self.spool)
        self.spool.flush()  # every commit the count saw has been reported (settled)
        with self._lock:
            self._shares.load(counted, max_id)
            self._settled.notify_all()

    def recover(self) -> ReplayReport:
        """Replay everything spooled (but agent histories) into ``state.db`` now.

        Runs on the calling thread and waits for a replay that holds the spool's
        replay lock elsewhere; ignores the retry delays. Sessions whose rows all moved
        write their queued messages next; sessions held keep their queue until their
        rows move.
        """
        with self._lock:
            waiting = {
                sid: (st.spooled, st.generation) for sid, st in self._sessions.items() if st.spooled
            }
        try:
            self.spool.flush()  # every eviction counted in ``waiting`` is committed
            report = self._replay()
        except BaseException:
            with self._lock:
                self._end_recovery()
            raise
        held = {s.session_id for s in report.sessions.values() if s.error}
        ready: list[tuple[str, Session, Claim]] = []
        background = threading.current_thread() is self._thread
        moved = {s.session_id: s.moved for s in report.sessions.values() if s.session_key is None}
        ended: list[Callable[[], None]] = []
        with self._lock:
            now = self.clock()
            self._recovered = True
            for session_id in held:
                state = self._session(session_id)
                state.may_hold()
            for session_id, (spooled, generation) in waiting.items():
                state = self._sessions.get(session_id)
                if state is None or session_id in held:
                    continue
                if state.spooled != spooled or state.generation != generation:
                    continue
                state.recovered()
                self._outage.replayed_rows(state.episode, moved.get(session_id, 0))
                ended += self._outage.ended(session_id, state.episode, now)
                state.episode = None
                claim = None
                if self.store._dirty_transcripts.get(session_id):
                    claim = self._claim(state, background=background)
                if claim is not None:
                    ready.append((session_id, state, claim))
                else:
                    self._forget_if_idle(session_id, state)
            self._end_recovery()
        self._run(ended)
        for session_id, state, claim in ready:
            self._write_session(session_id, state, claim, budget=None)
        if report.moved or report.held:
            log.info(
                "Recovered %d spooled message(s) into state.db; %d held back",
                report.moved,
                report.held,
            )
        return report

    def _end_recovery(self) -> None:
        """Let the sessions that waited for the start's recovery go on; lock held."""
        if not self._recovering:
            return
        self._recovering = False
        for session_id, state in self._sessions.items():
            if self._has_work(session_id, state):
                state.wake()
                self._schedule(0.0)
        self._settled.notify_all()


def background(link_ref: weakref.ref[Any], due: threading.Condition) -> None:
    """The link's one background thread: the start's recovery, then the retries of
    every session whose retry time has passed. It holds the link only while it works,
    so a link nobody refers to any more is collected and this thread ends."""
    link = link_ref()
    if link is None:
        return
    if link._shares.counting:
        link.count_shares()
    if link._recovering:
        try:
            link.recover()
        except Exception:  # noqa: BLE001 - linked all the same; sessions drain their own
            log.exception(
                "could not replay %s at start; each session replays its own spooled rows "
                "before its next write",
                link.spool.path,
            )
    if link.retry_interval <= 0:
        return
    del link
    while True:
        link = link_ref()
        if link is None:
            return
        if link._replaced:
            link.follow_path()
        with due:
            if link._closed or link.spool.closed:
                return  # a closed spool can take and give back nothing any more
            claimed, soonest = link._due_sessions()
            link._wake_at = soonest
            if not claimed:
                if link._replaced and not link._unconfirmed_bytes:
                    del link
                    continue  # its old spool's evictions all settled: follow the path
                timeout = bounds.IDLE_WAKE_SECONDS
                if soonest is not None:
                    timeout = min(max(soonest - link.clock(), 0.0), bounds.IDLE_WAKE_SECONDS)
                del link
                due.wait(timeout)
                continue
        for session_id, state, claim in claimed:
            # A bounded slice, then the session waits its turn behind the others due.
            link._write_session(session_id, state, claim, budget=bounds.GATEWAY_DRAIN_ROWS)
        del link
