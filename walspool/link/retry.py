"""The gateway link's background thread: the start's recovery, then the retries of
every session whose retry time has passed, with no new message needed.
"""

from __future__ import annotations

import os
import threading
import weakref

from ..errors import ReplayBusy, SpoolClosed
from ..replay.replayer import ReplayReport, report_of
from ..store import streams
from . import bounds, machine, shares
from .core import Core, Note
from .follow import Follow
from .lines import Lines
from .outage import say_left_to_running_replay, say_recovered
from .session_writer import SessionWriter
from .state import Claim, Session, log

#: Set (``WALSPOOL_CHECK_DUE=1``, as the test suite does): each look of the background
#: thread is checked against ``machine.pick_due`` of every session, as the schedule
#: was found before ``walspool.link.due`` kept it (O(sessions) a look).
CHECK_DUE = os.environ.get("WALSPOOL_CHECK_DUE") == "1"


class Background:
    """The link's background thread and the work it does: the start's count and
    recovery, each due session's retry, opening a fresh spool at a replaced path."""

    def __init__(self, core: Core, writer: SessionWriter, follow: Follow, lines: Lines) -> None:
        self.core = core
        self.writer = writer
        self.follow = follow
        self.lines = lines
        #: The thread, once started (None while the link has no work for one).
        self.thread: threading.Thread | None = None

    def start(self, *, recover: bool, recovery: bool, count: bool = False) -> None:
        """Start the link (``install``): with ``recover``, the replay of what earlier
        runs spooled runs first on the background thread when ``recovery`` (the spool
        may hold such rows); without it, sessions drain their own before writing. With
        ``count`` (the spool holds rows), the background thread first counts each
        session's bytes in it (``count_shares``)."""
        if recover:
            if recovery:
                self.core.recovering = True
            else:
                self.core.recovered = True
        if count:
            # Not under the store's lock: ``install`` may be called with it held. A
            # commit settled before this is not kept apart, and needs not be: it came
            # before the count, which sees it.
            self.core.shares.start_count()
        core = self.core
        if core.retry_interval <= 0 and not core.recovering and not core.shares.counting:
            return
        self.thread = threading.Thread(
            target=background,
            args=(weakref.ref(self), core.due),
            daemon=True,
            name=f"walspool-link {core.spool.path}",
        )
        self.thread.start()

    def due_sessions(self) -> tuple[list[tuple[str, Session, Claim]], float | None]:
        """Claim the session longest due (its retry time passed first); when to look
        next. One at a time: a claim held while the thread works on another session
        would make a gateway thread wait for that one too. A session given a slice
        of ``bounds.GATEWAY_DRAIN_ROWS`` rows is due again from then on, so sessions with
        backlogs take turns. Lock held."""
        now = self.core.clock()
        core = self.core
        session_id, look_at = core.due_book.pick(core.sessions, core.candidate, now, core.probe_at)
        if CHECK_DUE:
            _check_due(self.core, now, session_id, look_at)
        if session_id is None:
            return [], look_at
        state = self.core.sessions[session_id]
        claim = self.core.claim(state, background=True)
        assert claim is not None  # no writer: checked above, under the same lock
        return [(session_id, state, claim)], look_at

    def close(self, wait: float = bounds.HANDOFF_WAIT) -> bool:
        """Stop the background thread (at its next look), waiting ``wait`` seconds at
        most for it to end; whether it ended (or never ran). Idempotent. The link goes
        on spooling evictions; sessions retry on their next message. The repeated
        conditions' lines held back are said now, so every count is told."""
        core = self.core
        with core.lock:
            core.closed = True
            core.due_book.close()
            core.due.notify_all()
            held = [self.lines.line(key, said) for key, said in core.repeats.flush(core.clock())]
        self.core.run(held)
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(wait)
        return not thread.is_alive()

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
            log.debug("%s was closed before its rows were counted", self.core.spool.path)
            with self.core.lock:
                self.core.shares.give_up()
                self.core.settled.notify_all()
        except Exception:  # noqa: BLE001 - the link goes on with this run's shares
            log.exception(
                "could not count what each session holds in %s; until the next start a "
                "session's share of the cap is what it spooled since this one",
                self.core.spool.path,
            )
            with self.core.lock:
                self.core.shares.give_up()
                self.core.settled.notify_all()

    def _count(self) -> None:
        counted, max_id = shares.count(self.core.spool)
        self.core.spool.flush()  # every commit the count saw has been reported (settled)
        with self.core.lock:
            self.core.shares.load(counted, max_id)
            self.core.settled.notify_all()

    def recover(self, wait: bool = True) -> ReplayReport:
        """Replay everything spooled (but agent histories) into ``state.db`` now.

        Runs on the calling thread; ignores the retry delays. Sessions whose rows all
        moved write their queued messages next; sessions held keep their queue until
        their rows move. While another replay holds the spool's replay lock, waits for
        it (at most ``REPLAY_WAIT``), or without ``wait`` (the start's recovery) leaves
        the rows to it: nothing moves, and only the sessions with rows left (their own,
        or a spooled key's the store routes to them) wait for them before their next
        message (as on every gateway), the others write at once.
        """
        with self.core.lock:
            waiting = {
                sid: (st.spooled, st.generation)
                for sid, st in self.core.sessions.items()
                if st.spooled
            }
        busy = False  # another replay holds the spool: the rows are left to it
        try:
            self.core.spool.flush()  # every eviction counted in ``waiting`` is committed
            try:
                report = self.core.replay(wait=wait)
                held = {s.session_id for s in report.sessions.values() if s.error}
            except ReplayBusy:
                if wait:
                    raise
                busy, report = True, report_of({}, {}, 0)
                held = streams.sessions_left(self.core.spool) | self._routed_by_keys()
        except BaseException:
            with self.core.lock:
                self._end_recovery()
            raise
        ready: list[tuple[str, Session, Claim]] = []
        background = threading.current_thread() is self.thread
        moved = {s.session_id: s.moved for s in report.sessions.values() if s.session_key is None}
        ended: list[Note] = []
        with self.core.lock:
            now = self.core.clock()
            self.core.recovered = True
            if report.moved:
                self.core.state_db_works()
            for session_id in held:
                state = self.core.session(session_id)
                state.may_hold()
            for session_id, (spooled, generation) in waiting.items():
                state = self.core.sessions.get(session_id)
                if state is None or session_id in held:
                    continue
                if state.spooled != spooled or state.generation != generation:
                    continue
                state.recovered()
                self.core.outage.replayed_rows(state.episode, moved.get(session_id, 0))
                ended += self.core.outage.ended(session_id, state.episode, now)
                state.episode = None
                claim = None
                if self.core.queue(session_id):
                    claim = self.core.claim(state, background=background)
                if claim is not None:
                    ready.append((session_id, state, claim))
                else:
                    self.core.forget_if_idle(session_id, state)
            self._end_recovery()
        self.core.run(ended)
        for session_id, state, claim in ready:
            self.writer.write_session(session_id, state, claim, budget=None)
        if busy:
            say_left_to_running_replay(self.core.spool.path, len(held), log)
        else:
            say_recovered(
                report, self.core.spool.path, "Recovered %d spooled message(s) from %s", log
            )
        return report

    def _routed_by_keys(self) -> set[str]:
        """The sessions the store routes the spool's keys to now: a slot spooled by key
        goes before its session's next live message too."""
        routed = set()
        for key, _ in streams.keys_to_resolve(self.core.spool):
            try:
                session_id = self.core.transcripts.resolve(key)
            except Exception:  # noqa: BLE001 - unknown: the key's rows wait for a replay
                continue
            if session_id:
                routed.add(session_id)
        return routed

    def _end_recovery(self) -> None:
        """Let the sessions that waited for the start's recovery go on; lock held."""
        if not self.core.recovering:
            return
        self.core.recovering = False
        for session_id, state in self.core.sessions.items():
            if self.core.has_work(session_id, state):
                state.wake()
                self.core.schedule(0.0)
        self.core.settled.notify_all()


def background(ref: weakref.ref[Background], due: threading.Condition) -> None:
    """The link's one background thread: the start's recovery, then the retries of
    every session whose retry time has passed. It holds the link's parts only while it
    works, so a link nobody refers to any more is collected and this thread ends."""
    work = ref()
    if work is None:
        return
    core = work.core
    if core.shares.counting:
        work.count_shares()
    if core.recovering:
        try:
            work.recover(wait=False)
        except Exception:  # noqa: BLE001 - linked all the same; sessions drain their own
            log.exception(
                "could not replay %s at start; each session replays its own spooled rows "
                "before its next write",
                core.spool.path,
            )
    if core.retry_interval <= 0:
        return
    del work, core
    while True:
        work = ref()
        if work is None:
            return
        core = work.core
        if core.replaced:
            work.follow.follow_path()
        with due:
            if core.closed or core.spool.closed:
                core.due_book.close()
                return  # a closed spool can take and give back nothing any more
            claimed, soonest = work.due_sessions()
            core.wake_at = soonest
            if not claimed:
                if core.replaced and not core.unconfirmed_bytes:
                    del work, core
                    continue  # its old spool's evictions all settled: follow the path
                timeout = bounds.IDLE_WAKE_SECONDS
                if soonest is not None:
                    timeout = min(max(soonest - core.clock(), 0.0), bounds.IDLE_WAKE_SECONDS)
                del work, core
                due.wait(timeout)
                continue
        for session_id, state, claim in claimed:
            # A bounded slice, then the session waits its turn behind the others due.
            work.writer.write_session(session_id, state, claim, budget=bounds.GATEWAY_DRAIN_ROWS)
        del work, core


def _check_due(core: Core, now: float, session_id: str | None, look_at: float | None) -> None:
    """Raise if the look's answer is not ``machine.pick_due``'s of every session (the
    same time; a session of the same ``retry_at`` when one is due)."""
    candidates = {sid: core.candidate(sid, state) for sid, state in core.sessions.items()}
    expected, expected_at = machine.pick_due(candidates, now, core.probe_at)
    same = look_at == expected_at and (session_id is None) == (expected is None)
    if same and session_id is not None and expected is not None:
        same = candidates[session_id][2] == candidates[expected][2]
    if not same:
        message = (
            f"walspool.link.due picked {session_id!r} at {look_at!r}; every session "
            f"says {expected!r} at {expected_at!r} (now {now!r}, probe {core.probe_at!r})"
        )
        log.critical(message)
        raise AssertionError(message)
