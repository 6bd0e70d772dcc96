"""What the gateway link's parts share: the gateway's store (as
``walspool.link.transcripts`` names it), its lock and the two conditions on it, the
session table, the spool with the counts kept of it, and the few steps every part
takes on a session (claim it, give it up, schedule its retry, forget it).

The parts (``evict``, ``session_writer``, ``follow``, ``retry``, ``shutdown``) are
given this one object and each other's public methods; none reads another's fields.
Every field is guarded by ``lock`` unless its comment says otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..replay.replayer import Replayer, ReplayReport
from ..replay.sinks import SessionDBSink
from ..store.spool import Spool
from ..store.writer import Row
from . import bounds, budget, machine, outage
from .due import DueBook, Facts
from .handoffs import HandOffs
from .repeats import Repeats
from .shares import Moving
from .state import Claim, Session
from .transcripts import Message, Transcripts

#: A line to log once the lock is released (gathered while it is held).
Note = Callable[[], None]


class Core:
    """A linked SessionStore's shared state; made by ``Link``."""

    def __init__(
        self,
        transcripts: Transcripts,
        spool: Spool,
        retry_interval: float,
        max_bytes: int | None,
    ) -> None:
        #: The gateway's store: its queues, their lock, its writes.
        self.transcripts = transcripts
        #: The link's clock (monotonic seconds), which its decisions read: the machine
        #: is given ``now`` from it, retry times and the lines' intervals are on it.
        self.clock: Callable[[], float] = time.monotonic
        #: The clock the bounds of its waits are measured on: real time, whatever
        #: ``clock`` says (a test's frozen clock never ends a wait, nor shortens one).
        self.timer: Callable[[], float] = time.monotonic
        self.retry_interval = retry_interval
        #: The cap on what evictions may fill (``walspool.link.budget``); None: no cap.
        self.max_bytes = max_bytes
        self.cap = transcripts.cap
        self.outage = outage.OutageLog(spool.path, self.cap)
        #: Repeated conditions of sessions (busy spool, drops, replays), told in a few lines.
        self.repeats = Repeats()
        self.lock = transcripts.lock
        #: Notified when a writer gives its role up, evictions commit, a recovery ends:
        #: what waiting gateway threads (and ``Link.wait_idle``) wait for.
        self.settled = threading.Condition(self.lock)
        #: Notified when the background thread has work sooner than it planned.
        self.due = threading.Condition(self.lock)
        self.sessions: dict[str, Session] = {}
        #: The background thread's schedule of them (``walspool.link.due``).
        self.due_book = DueBook()
        #: Each session's evictions and stop flushes handed to the spool's writer and
        #: not committed yet; the last of a session's commits notifies ``settled``.
        self.handoffs = HandOffs(self.settled)
        #: Payload bytes of evictions the spool's writer accepted and has not committed.
        self.unconfirmed_bytes = 0
        #: Held by a drain step of this link, not under ``lock`` (see
        #: ``SessionWriter.drain_step``); a fresh spool is taken only while it is held.
        self.draining = threading.Lock()
        #: Until a full ``recover`` has succeeded, any session may have rows in the
        #: spool from an earlier run, so each drains before its first live write.
        self.recovered = False
        #: The start's recovery runs: sessions hold their live writes until it ends (it
        #: may write rows spooled by session key, which precede them).
        self.recovering = False
        #: The background thread stops; sessions retry on their next message.
        self.closed = False
        #: Set by the shutdown's flush of the queues: a write that fails after it has its
        #: session's queue spooled at once (``Shutdown.spool_if_stopping``), as nothing
        #: flushes the queues again.
        self.stopping = False
        #: The stop's deadline for its waits for writes in flight (``Shutdown.flush_queues``;
        #: on ``timer``), set by its first flush call; whether it said it gave up on one.
        self.stop_deadline: float | None = None
        self.said_write_outlasted = False
        #: Writes that failed once the stop's flush had begun whose threads have yet to
        #: spool what waited behind them (``Shutdown.spool_if_stopping``).
        self.stop_spools = 0
        #: When the background thread will look next (None: only when notified).
        self.wake_at: float | None = None
        #: Set while state.db failed the link's last write or drain: failing sessions
        #: are tried again one at a time (``machine.pick_due``), the next at this clock
        #: time (at most ``retry_interval`` away); cleared by the next write or drain
        #: that succeeds.
        self.probe_at: float | None = None
        #: Writes and drains that failed in a row, whatever their session: the probe's
        #: backoff.
        self.probe_failures = 0
        #: Set once an eviction failed because the spool's path names another file
        #: (deleted, moved): the background thread opens a fresh spool there
        #: (``Follow.follow_path``) once no eviction is left in the old one's writer.
        self.replaced = False
        #: Rows of the evictions the old spool returned so, in their order: the fresh
        #: spool takes them before any later eviction. Never any unless ``replaced``.
        self.returned: list[Row] = []
        #: Clock time before which a failed eviction is dropped, not returned: a fresh
        #: spool could not be opened at the path (tried again after that).
        self.reopen_after = 0.0
        self.use(spool)

    def use(self, spool: Spool) -> None:
        """Write to ``spool`` from now on, with no session's rows counted in it yet;
        at the start, or (lock held) once a fresh spool replaced a moved one."""
        self.spool = spool
        #: Each session's share of the cap: its bytes in the spool (``walspool.link.budget``).
        self.shares = budget.Shares()
        #: The link's sink: state.db's, noting the rows a replay of the link moves.
        self.moving = Moving(SessionDBSink(self.transcripts.db), spool, self.shares)
        self.replayer = Replayer(
            spool,
            self.moving,
            resolver=self.transcripts.resolve,
            wait_for_bookkeeping=False,
        )

    def replay(self, **kw: Any) -> ReplayReport:
        """``self.replayer.replay(**kw)``, then the rows it moved out of the spool come
        off their sessions' shares of the cap (also when it raised). Not under ``lock``."""
        with self.moving.counting() as noted:
            try:
                return self.replayer.replay(**kw)
            finally:
                gone = noted.gone()
                if gone and noted.epoch is not None:
                    with self.lock:
                        self.shares.removed(gone, noted.epoch)

    # -- one session; the lock is held ---------------------------------------------

    def session(self, session_id: str) -> Session:
        """The session's state, made if the link holds none for it."""
        state = self.sessions.get(session_id)
        if state is None:
            touch = partial(self.due_book.touch, session_id)
            state = self.sessions[session_id] = Session(0 if self.recovered else 1, touch)
            touch()  # it may hold spooled rows: work from the start
        return state

    def candidate(self, session_id: str, state: Session) -> Facts:
        """The session as the background thread sees it (``machine.Candidate``'s fields)."""
        return state.schedule_facts() + (
            self.handoffs.pending(session_id) > 0,
            bool(state.spooled or self.transcripts.queues.get(session_id)),
        )

    def queue(self, session_id: str) -> list[Message] | None:
        """The store's in-memory queue of the session, if it has one."""
        return self.transcripts.queues.get(session_id)

    def has_work(self, session_id: str, state: Session) -> bool:
        return bool(state.spooled or self.queue(session_id))

    def forget_if_idle(self, session_id: str, state: Session) -> None:
        """Drop a session's state once nothing refers to it."""
        if (
            state.writer is None
            and not state.waiters
            and not self.handoffs.pending(session_id)
            and not self.has_work(session_id, state)
            and self.sessions.get(session_id) is state
        ):
            del self.sessions[session_id]
            self.due_book.forget(session_id)
            self.transcripts.queues.pop(session_id, None)

    def claim(self, state: Session, *, background: bool = False) -> Claim | None:
        """Become the session's writer if it has none."""
        return state.claim(background)

    def release(self, session_id: str, state: Session, claim: Claim) -> None:
        """Give the writer role up, if ``claim`` still holds it."""
        if state.writer is not claim:
            return
        state.release(claim)
        if self.has_work(session_id, state):
            self.schedule(self.due_at(state))
        else:
            self.forget_if_idle(session_id, state)
        self.settled.notify_all()

    def failed(self, state: Session, claim: Claim, *, drain: bool, count: bool = True) -> None:
        """Schedule the next attempt after a failure, as the holder of ``claim``."""
        failures = state.failures + (1 if count else 0)
        now = self.clock()
        retry_at = now + self._retry_delay(failures)
        state.backed_off(claim, failures, retry_at, retry_at if drain else None)
        if count and self.retry_interval > 0:
            # The next probe backs off as one session would, by the failures in a row
            # of state.db as a whole: 1/8, 1/4, 1/2 of the interval, then every interval.
            self.probe_failures += 1
            self.probe_at = now + self._retry_delay(self.probe_failures)

    def _retry_delay(self, failures: int) -> float:
        return machine.retry_delay(
            failures, self.retry_interval, bounds.RETRY_STEPS, bounds.MIN_RETRY_SECONDS
        )

    def succeeded(self, state: Session, claim: Claim) -> None:
        """A write or drain of the session succeeded, as the holder of ``claim``: it has
        no failures in a row, and state.db works (``state_db_works``)."""
        state.healthy(claim)
        self.state_db_works()

    def state_db_works(self) -> None:
        """state.db took a write: no outage to probe, so every failing session is due
        again at its own retry time (the background thread looks at once)."""
        self.probe_failures = 0
        if self.probe_at is not None:
            self.probe_at = None
            self.schedule(self.clock())

    def failing(self, state: Session) -> bool:
        """The session's last write or drain failed, and the background thread retries
        it when its delay ends, in an outage not before the next probe (``due_at``): a
        gateway thread only queues its messages (and spools at the cap), so an outage
        costs no failing write, and no wait, per message, however many sessions wait.
        Once the link is closed (no background thread), each message retries again."""
        now = self.clock()
        return machine.failing(
            machine.backoff_of(state.failures, state.hold_until, now),
            self.due_at(state),
            self.background_on(),
            now,
        )

    def run(self, notes: list[Note]) -> None:
        """Log the lines gathered under the lock, once it is released (never under it)."""
        for note in notes:
            note()

    # -- the background thread's schedule; the lock is held ------------------------

    def background_on(self) -> bool:
        """Whether the background thread retries failing sessions."""
        return self.retry_interval > 0 and not self.closed

    def due_at(self, state: Session) -> float:
        """When the background thread may take the session (``machine.due_at``): in
        an outage a failing session waits for the next probe, and is not woken for
        before it (a look at every session, under the store's lock, each time)."""
        return machine.due_at(state.retry_at, self.is_failing_for_probe(state), self.probe_at)

    @staticmethod
    def is_failing_for_probe(state: Session) -> bool:
        """Whether the session waits for the outage's probe: it has failures in a row
        and was not woken since (``Session.wake``: due now)."""
        return state.failures > 0 and not state.woken

    def due_again(self, session_id: str, state: Session) -> None:
        """An event may have made the session due sooner, or free to take (its last
        hand-off settled): the background thread places it again and looks by then."""
        self.due_book.touch(session_id)
        self.schedule(self.due_at(state))

    def schedule(self, at: float) -> None:
        """Make the background thread look at ``at`` (monotonic) or sooner."""
        if self.retry_interval <= 0 or self.closed:
            return
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at
            self.due.notify()
