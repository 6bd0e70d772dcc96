"""The gateway link's shell: ``Link`` holds the store's lock, feeds the session's facts
to the machine (``walspool.link.machine``), performs the step it returns and logs after
unlocking. Its halves live beside it, one concern each: evictions (``evict``), the
session writer (``session_writer``), the background thread (``retry``), shutdown
(``shutdown``) and each session's share of the cap (``shares``). See
``walspool.hermes`` for what it guarantees and its bounds.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..replay.replayer import Replayer, ReplayReport
from ..replay.sinks import SessionDBSink
from ..store.spool import REOPENED, Spool
from ..store.writer import Batched, Row
from . import bounds, budget, machine, outage
from .evict import KEPT, REPLAYED, UNSPOOLABLE, Evictions
from .machine import Entry, Owner
from .memory import MemoryPublisher
from .repeats import Repeats
from .retry import Retries
from .rewrites import supersede_rewritten
from .session_writer import SessionWriter
from .shares import Moving
from .shutdown import ShutdownFlushes
from .state import Claim, Session, log, owner_of

#: Seconds: the cap of a failing session's retry delay (see ``walspool.hermes``).
RETRY_INTERVAL = 1.0


class Link(SessionWriter, Evictions, Retries, ShutdownFlushes):
    """A SessionStore linked to a spool; made by ``install``."""

    def __init__(
        self,
        store: Any,
        spool: Spool,
        retry_interval: float = RETRY_INTERVAL,
        max_bytes: int | None = budget.DEFAULT_MAX_BYTES,
    ) -> None:
        self.store = store
        self.spool = spool
        #: The link's clock (monotonic seconds), the only one its modules read: the
        #: machine is given ``now`` from it. Waits on conditions still take real time.
        self.clock: Callable[[], float] = time.monotonic
        self.retry_interval = retry_interval
        #: The cap on what evictions may fill (``walspool.link.budget``); None: no cap.
        self.max_bytes = max_bytes
        #: Payload bytes of evictions the spool's writer accepted and has not committed.
        self._unconfirmed_bytes = 0
        #: Each session's share of the cap: its bytes in the spool (``walspool.link.budget``).
        self._shares = budget.Shares()
        #: The link's sink: state.db's, noting the rows a replay of the link moves.
        self._moving = Moving(SessionDBSink(store._db), spool, self._shares)
        self.replayer = Replayer(
            spool,
            self._moving,
            resolver=store.peek_session_id,
            wait_for_bookkeeping=False,
        )
        self.cap = int(store._MAX_PENDING_PER_SESSION)
        self._outage = outage.OutageLog(spool.path, self.cap)
        #: Repeated conditions of sessions (busy spool, drops, replays), told in a few lines.
        self._repeats = Repeats()
        self._lock = store._transcript_retry_lock
        #: Notified when a writer gives its role up, evictions commit, a recovery ends:
        #: what waiting gateway threads (and ``wait_idle``) wait for.
        self._settled = threading.Condition(self._lock)
        #: Notified when the background thread has work sooner than it planned.
        self._due = threading.Condition(self._lock)
        self._sessions: dict[str, Session] = {}
        #: The spool writer's callback for evictions, once per committed group.
        self._evicted = Batched(self._evictions_done)
        #: Held by a drain step of this link (see ``_drain_step``).
        self._draining = threading.Lock()
        #: Until a full ``recover`` has succeeded, any session may have rows in the
        #: spool from an earlier run, so each drains before its first live write.
        self._recovered = False
        #: The start's recovery runs: sessions hold their live writes until it ends (it
        #: may write rows spooled by session key, which precede them).
        self._recovering = False
        self._closed = False
        #: Set by the shutdown's flush of the queues: a write that fails after it has its
        #: session's queue spooled at once (``spool_if_stopping``), as nothing flushes
        #: the queues again.
        self._stopping = False
        #: When the background thread will look next (None: only when notified).
        self._wake_at: float | None = None
        self._thread: threading.Thread | None = None
        #: Set once an eviction failed because the spool's path names another file
        #: (deleted, moved): the background thread opens a fresh spool there
        #: (``follow_path``) once no eviction is left in the old one's writer.
        self._replaced = False
        #: Rows of the evictions the old spool returned so, in their order: the fresh
        #: spool takes them before any later eviction. Never any unless ``_replaced``.
        self._returned: list[Row] = []
        #: Clock time before which a failed eviction is dropped, not returned: a fresh
        #: spool could not be opened at the path (tried again after that).
        self._reopen_after = 0.0
        #: Publishes what the store's queues hold into the spool (``walspool.link.memory``);
        #: it holds neither the link nor the store, so both go once nothing else holds them.
        link, store_ref = weakref.ref(self), weakref.ref(store)
        self.memory = MemoryPublisher(
            lambda: getattr(link(), "spool", None),
            lambda: None if (held := store_ref()) is None else (held,),
        )

    def append_to_transcript(
        self, session_id: str, message: dict[str, Any], skip_db: bool = False
    ) -> None:
        """Queue a message for ``state.db``; spool, never drop, what overflows the cap.

        Never raises: an unexpected error is logged with the session id, and the
        message stays queued.
        """
        store = self.store
        if not store._db or skip_db:
            return
        try:
            self._append(session_id, message)
        except Exception:  # noqa: BLE001 - the gateway must go on
            log.exception(
                "walspool could not handle a transcript message for session %s; "
                "what is queued stays queued",
                session_id,
            )

    def _append(self, session_id: str, message: dict[str, Any]) -> None:
        copy = dict(message)
        notes: list[Callable[[], None]] = []
        claim: Claim | None = None
        queued = False
        # Past twice the cap (messages arriving faster than the spool or one state.db
        # write takes them), wait at most this long, then drop the oldest with a WARNING.
        deadline = self.clock() + bounds.HANDOFF_WAIT
        while True:
            with self._lock:
                # Looked up again after every wait: a rewrite may have emptied the
                # queue, and an idle session's state may have been dropped.
                state = self._session(session_id)
                pending = self.store._dirty_transcripts.setdefault(session_id, [])
                if not queued:
                    pending.append(copy)
                    queued = True
                late = self.clock() >= deadline
                notes += self._evict(session_id, state, pending, drops=late)
                if len(pending) <= 2 * self.cap or late:
                    claim = self._enter(state)
                    break
                if pending[0] is state.inflight:
                    self._wait_for_head(state, deadline)
                    continue
            # The spool writer's queue is full: wait for room, outside the store's lock,
            # unless another process holds the spool's write lock (no room soon), or
            # there is room and the oldest message itself cannot be spooled.
            if self.spool.busy() or self.spool.has_room():
                deadline = 0.0
            else:
                self.spool.wait_for_room(max(deadline - self.clock(), 0.0))
        try:
            self._run(notes)
        finally:
            if claim is not None:
                budget = bounds.GATEWAY_DRAIN_ROWS if self.retry_interval > 0 else None
                self._write_session(session_id, state, claim, budget=budget)

    def _clear_dirty_transcript(self, session_id: str) -> None:
        """The store's rewrite hook (/retry, /undo, /compress): forget the queue, as the
        released store does, and mark the session's spooled rows superseded."""
        with self._lock:
            self.store._dirty_transcripts.pop(session_id, None)
            self.store._transcript_append_failures.pop(session_id, None)
            state = self._sessions.get(session_id)
            # Its queue is gone, and its spooled rows are not replayed any more.
            ended = self._repeats_end(session_id, (KEPT, UNSPOOLABLE))
            replayed = self._repeats.ended((REPLAYED, session_id), self.clock(), at_once=True)
            if replayed is not None:
                ended.append(self._repeat_line((REPLAYED, session_id), replayed))
            if state is not None:
                # An event: a writer that wrote or drained meanwhile re-reads it and
                # stops. Its share of the cap stays: the superseded rows stay in the spool.
                # Its evictions a replaced spool returned would land after the rewrite.
                kept = [row for row in self._returned if row.session_id != session_id]
                for _ in range(len(self._returned) - len(kept)):
                    state.settled()
                self._returned = kept
                state.rewritten()
                ended += self._outage.ended(
                    session_id, state.episode, self.clock(), superseded=True
                )
                state.episode = None
                self._forget_if_idle(session_id, state)
            self._settled.notify_all()
        self._run(ended)
        # The queue was just emptied, so no eviction of this session can be submitted
        # before this runs: every row it spooled until now is superseded (the spool's
        # writer commits in submission order). This link's drains are held off.
        supersede_rewritten(self.spool, session_id, log, own_drains=self._draining)

    def follow_path(self) -> bool:
        """Open a fresh spool at the path of one that names another file now, as the
        next start would, once the old spool's writer holds no eviction of this link;
        hand it the evictions the old one returned, in their order, then close the
        old one (its rows stay in its file: a moved one can be replayed by hand). True
        if the link writes to a fresh spool now. Runs on the background thread, or
        at shutdown; never on a gateway thread (it opens files)."""
        with self._draining:  # no drain has a chunk of the old spool out
            with self._lock:
                if not self._replaced or self._unconfirmed_bytes:
                    return False
                old = self.spool
            try:
                fresh = old.reopened()
            except Exception as exc:  # noqa: BLE001 - the evictions it returned drop
                self._not_followed(exc)
                return False
            if self.max_bytes is not None:
                fresh.track_footprint()
            with self._lock:
                self.spool = fresh
                self._shares = budget.Shares()  # the fresh file holds no session's rows
                self._moving = Moving(SessionDBSink(self.store._db), fresh, self._shares)
                self.replayer = Replayer(
                    fresh,
                    self._moving,
                    resolver=self.store.peek_session_id,
                    wait_for_bookkeeping=False,
                )
                self._replaced = False
                returned, self._returned = self._returned, []
                lost = self._hand_over(returned)
                self._settled.notify_all()
        log.warning(REOPENED, old.path)
        self._run(lost)
        old.close()
        return True

    def _hand_over(self, rows: list[Row]) -> list[Callable[[], None]]:
        """Queue the returned evictions' ``rows`` in the (fresh) spool, in order;
        what finds no room is dropped with a WARNING. The lock is held."""
        lines: list[Callable[[], None]] = []
        for row in rows:
            session_id = row.session_id
            try:
                self.spool.put_nowait((row,), self._evicted)
            except Exception as exc:  # noqa: BLE001 - no room, closed: it cannot be kept
                lines += self._dropped(session_id, f"a fresh spool could not take it: {exc!r}")
                state = self._sessions.get(session_id)
                if state is not None:
                    self._eviction_settled(session_id, state)
                continue
            self._shares.accepted(session_id, row.size)
            self._unconfirmed_bytes += row.size
        return lines

    def _not_followed(self, exc: Exception) -> None:
        """No fresh spool could be opened at the path: the returned evictions are
        dropped, and later ones too until ``retry_interval`` has passed."""
        with self._lock:
            self._replaced = False
            self._reopen_after = self.clock() + max(self.retry_interval, RETRY_INTERVAL)
            returned, self._returned = self._returned, []
            lines: list[Callable[[], None]] = []
            for row in returned:
                lines += self._dropped(row.session_id, f"no fresh spool could be opened: {exc}")
                state = self._sessions.get(row.session_id)
                if state is not None:
                    self._eviction_settled(row.session_id, state)
            self._settled.notify_all()
        log.warning(
            "The transcript spool %s was moved or deleted while the gateway ran, and no "
            "fresh one can be opened at that path (tried again in %g s): %s",
            self.spool.path,
            max(self.retry_interval, RETRY_INTERVAL),
            exc,
        )
        self._run(lines)

    def _replay(self, **kw: Any) -> ReplayReport:
        """``self.replayer.replay(**kw)``, then the rows it moved out of the spool come
        off their sessions' shares of the cap (also when it raised)."""
        with self._moving.counting() as noted:
            try:
                return self.replayer.replay(**kw)
            finally:
                gone = noted.gone()
                if gone and noted.epoch is not None:
                    with self._lock:
                        self._shares.removed(gone, noted.epoch)

    def _enter(self, state: Session) -> Claim | None:
        """After queueing a message: claim the session, take it over, or leave the
        message queued, as the machine says (``Entry``); the lock is held."""
        owner = owner_of(state)
        step = machine.entry(
            owner,
            self._failing(state),
            self._closed,
            owner is Owner.BACKGROUND and self.spool.busy(),
        )
        if step is Entry.CLAIM:
            return self._claim(state)
        if step is Entry.TAKE_OVER:
            return self._take_over(state)
        return None

    def _claim(self, state: Session, *, background: bool = False) -> Claim | None:
        """Become the session's writer if it has none; the lock is held."""
        return state.claim(background)

    def _failing(self, state: Session) -> bool:
        """The session's last write or drain failed, and the background thread retries
        it when its delay ends: a gateway thread only queues its messages (and spools
        at the cap), so an outage costs no failing write, and no wait, per message.
        Once the link is closed (no background thread), each message retries again."""
        now = self.clock()
        return machine.failing(
            machine.backoff_of(state.failures, state.hold_until, now),
            state.retry_at,
            self._background_on(),
            now,
        )

    def _background_on(self) -> bool:
        """Whether the background thread retries failing sessions."""
        return self.retry_interval > 0 and not self._closed

    def _take_over(self, state: Session) -> Claim | None:
        """Wait (at most ``bounds.HANDOFF_WAIT``) for the background writer to hand the session
        to this gateway thread, then claim it; the lock is held."""
        if state.writer is None or not state.writer.background or self._closed:
            return None
        if self.spool.busy():
            # The background writer may be waiting for the spool's write lock held by
            # another process: do not wait behind it; the message stays queued.
            return None
        deadline = self.clock() + bounds.HANDOFF_WAIT
        with state.waiting():  # the background writer sees it at its next step
            while state.writer is not None and state.writer.background:
                left = deadline - self.clock()
                if left <= 0:
                    return None
                self._settled.wait(left)
            # Decided on the state as it is now: another gateway thread may have
            # claimed the session meanwhile; then this message is queued for it.
            return self._claim(state)

    def _release(self, session_id: str, state: Session, claim: Claim) -> None:
        """Give the writer role up, if ``claim`` still holds it; the lock is held."""
        if state.writer is not claim:
            return
        state.release(claim)
        if self._has_work(session_id, state):
            self._schedule(state.retry_at)
        else:
            self._forget_if_idle(session_id, state)
        self._settled.notify_all()

    def _has_work(self, session_id: str, state: Session) -> bool:
        return bool(state.spooled or self.store._dirty_transcripts.get(session_id))

    def _forget_if_idle(self, session_id: str, state: Session) -> None:
        """Drop a session's state once nothing refers to it; the lock is held."""
        if (
            state.writer is None
            and not state.waiters
            and not state.unconfirmed
            and not self._has_work(session_id, state)
            and self._sessions.get(session_id) is state
        ):
            del self._sessions[session_id]
            self.store._dirty_transcripts.pop(session_id, None)

    def _session(self, session_id: str) -> Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = Session(0 if self._recovered else 1)
        return state

    def _failed(self, state: Session, claim: Claim, *, drain: bool, count: bool = True) -> None:
        """Schedule the next attempt after a failure, as the holder of ``claim``; the
        lock is held."""
        failures = state.failures + (1 if count else 0)
        delay = machine.retry_delay(
            failures, self.retry_interval, bounds.RETRY_STEPS, bounds.MIN_RETRY_SECONDS
        )
        retry_at = self.clock() + delay
        state.backed_off(claim, failures, retry_at, retry_at if drain else None)

    def _run(self, notes: list[Callable[[], None]]) -> None:
        """Log the lines gathered under the lock, once it is released."""
        for note in notes:
            note()
