"""The gateway link: ``Link`` is what ``install`` puts in a 0.19.0 SessionStore. It
composes the link's parts, each given the shared state (``walspool.link.core``) and
the public methods of the parts it uses:

* ``evict``: the oldest queued messages past the cap go to the spool, and what their
  commits settle; ``lines``: the few lines a session's repeated conditions are told in;
* ``session_writer``: the holder of a session's claim drains its spooled rows and
  writes its queue, as the machine (``walspool.link.machine``) says;
* ``follow``: a fresh spool at the path of one deleted or moved;
* ``retry``: the background thread (the start's count and recovery, due retries);
* ``shutdown``: what the gateway would clear at its stop, spooled;
* ``memory``: what the store's queues hold, published for the operator.

``Link`` itself takes the store's two calls (a message, a rewrite) and answers the
gateway's and the operator's questions. See ``walspool.hermes`` for what it
guarantees and its bounds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ..replay.replayer import Replayer, ReplayReport
from ..store.records import SHUTDOWN
from ..store.spool import Spool
from . import bounds, budget, machine
from .bounds import RETRY_INTERVAL
from .core import Core, Note
from .evict import Evictions
from .follow import Follow
from .lines import KEPT, REPLAYED, UNSPOOLABLE, Lines
from .machine import Entry, Owner
from .memory import MemoryPublisher
from .retry import Background
from .rewrites import supersede_rewritten
from .session_writer import SessionWriter
from .shutdown import Shutdown
from .state import Claim, Session, SessionView, log, owner_of
from .transcripts import Message, Transcripts

__all__ = ["RETRY_INTERVAL", "Link"]


class Link:
    """A SessionStore linked to a spool; made by ``install``."""

    def __init__(
        self,
        transcripts: Transcripts,
        spool: Spool,
        retry_interval: float = RETRY_INTERVAL,
        max_bytes: int | None = budget.DEFAULT_MAX_BYTES,
    ) -> None:
        #: The gateway's store, as the link sees it (``walspool.link.transcripts``).
        self.transcripts = transcripts
        #: The state the parts share (the session table, the store's lock, the spool).
        self.core = core = Core(transcripts, spool, retry_interval, max_bytes)
        self.lines = Lines(core)
        self.evictions = Evictions(core, self.lines)
        self.follow = Follow(core, self.evictions, self.lines)
        self.shutdown = Shutdown(core, self.follow)
        self.writer = SessionWriter(core, self.evictions, self.lines, self.shutdown)
        self.background = Background(core, self.writer, self.follow, self.lines)
        #: Publishes what the store's queues hold into the spool (``walspool.link.memory``);
        #: it holds the link's core weakly, so the link goes once nothing else holds it.
        core_ref = weakref.ref(core)
        self.memory = MemoryPublisher(
            lambda: getattr(core_ref(), "spool", None),
            lambda: None if (held := core_ref()) is None else (held.transcripts,),
        )

    # -- what the gateway, its operator and the tests read or set -----------------

    @property
    def spool(self) -> Spool:
        """The spool the link writes to now (a fresh one once the path was replaced)."""
        return self.core.spool

    @property
    def replayer(self) -> Replayer:
        """The replayer of ``spool`` into the store's state.db."""
        return self.core.replayer

    @property
    def clock(self) -> Callable[[], float]:
        """The link's clock (monotonic seconds); tests set a fake one."""
        return self.core.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.core.clock = clock

    @property
    def max_bytes(self) -> int | None:
        """The cap on what evictions may fill (``walspool.link.budget``); None: no cap."""
        return self.core.max_bytes

    @max_bytes.setter
    def max_bytes(self, max_bytes: int | None) -> None:
        self.core.max_bytes = max_bytes

    @property
    def retry_interval(self) -> float:
        return self.core.retry_interval

    def view(self, session_id: str) -> SessionView | None:
        """Session ``session_id`` as it stands, or None when the link holds nothing for
        it (no writer, no queued or spooled work, nobody waiting). Takes the store's
        lock: not for a caller that holds it."""
        with self.core.lock:
            state = self.core.sessions.get(session_id)
            return None if state is None else state.view(self.core.handoffs.pending(session_id))

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until the start's count and recovery are
        done and no session has a writer, queued or spooled work; True if so (for
        tests and shutdowns)."""
        core = self.core
        deadline = core.timer() + timeout
        with core.lock:
            while (
                core.recovering
                or core.shares.counting
                or any(
                    s.writer is not None or core.handoffs.pending(sid) or core.has_work(sid, s)
                    for sid, s in core.sessions.items()
                )
            ):
                left = deadline - core.timer()
                if left <= 0:
                    return False
                core.settled.wait(left)
            return True

    # -- the link's life -------------------------------------------------------------

    def start(self, *, recover: bool, recovery: bool, count: bool = False) -> None:
        """Start the link (``install``); see ``Background.start``."""
        self.memory.start()
        self.background.start(recover=recover, recovery=recovery, count=count)

    def close(self, wait: float = bounds.HANDOFF_WAIT) -> bool:
        """Stop the background thread (at its next look), waiting ``wait`` seconds at
        most for it to end (it ends its write in flight first, and spools what waited
        behind it at a stop); whether it ended. Idempotent. The link goes on spooling
        evictions; sessions retry on their next message. The repeated conditions' lines
        held back are said now, so every count is told."""
        ended = self.background.close(wait)
        self.memory.stop()
        return ended

    def wait_for_writes(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until the queued messages being written to
        state.db now are written, and what a write that failed at a stop left behind
        it is spooled; whether so (before a stop closes the spool). Takes the store's lock."""
        with self.core.lock:
            writes = self.shutdown.in_flight()
            return self.shutdown.wait_for_writes(writes, self.core.timer() + timeout)

    def recover(self) -> ReplayReport:
        """Replay everything spooled into state.db now; see ``Background.recover``."""
        return self.background.recover()

    def count_shares(self) -> None:
        """Count each session's bytes in the spool; see ``Background.count_shares``."""
        self.background.count_shares()

    def follow_path(self) -> bool:
        """Open a fresh spool at a replaced path; see ``Follow.follow_path``."""
        return self.follow.follow_path()

    # -- the gateway's stop (``walspool.link.shutdown``) -----------------------------

    def flush_pending(self, pending: Mapping[str, Any], *, reason: str = SHUTDOWN) -> int:
        return self.shutdown.flush_pending(pending, reason=reason)

    def flush_slots(self, slots: list[tuple[str, Any]], *, reason: str = SHUTDOWN) -> int:
        return self.shutdown.flush_slots(slots, reason=reason)

    def flush_agent_history(self, session_id: str | None, history: list[Any]) -> bool:
        return self.shutdown.flush_agent_history(session_id, history)

    def flush_queues(self) -> int:
        return self.shutdown.flush_queues()

    # -- the store's two calls -----------------------------------------------------

    def append_to_transcript(
        self, session_id: str, message: Message, skip_db: bool = False
    ) -> None:
        """Queue a message for ``state.db``; spool, never drop, what overflows the cap.

        Never raises: an unexpected error is logged with the session id, and the
        message stays queued.
        """
        if not self.transcripts.db or skip_db:
            return
        try:
            self._append(session_id, message)
        except Exception:  # noqa: BLE001 - the gateway must go on
            log.exception(
                "walspool could not handle a transcript message for session %s; "
                "what is queued stays queued",
                session_id,
            )

    def _append(self, session_id: str, message: Message) -> None:
        copy = dict(message)
        notes: list[Note] = []
        claim: Claim | None = None
        queued = False
        # Past twice the cap (messages arriving faster than the spool or one state.db
        # write takes them), wait at most this long, then drop the oldest with a WARNING.
        deadline = self.core.timer() + bounds.HANDOFF_WAIT
        while True:
            with self.core.lock:
                # Looked up again after every wait: a rewrite may have emptied the
                # queue, and an idle session's state may have been dropped.
                state = self.core.session(session_id)
                pending = self.transcripts.queues.setdefault(session_id, [])
                if not queued:
                    pending.append(copy)
                    queued = True
                    self.core.due_book.touch(session_id)  # it may have had no work
                late = self.core.timer() >= deadline
                notes += self.evictions.evict(session_id, state, pending, drops=late)
                if len(pending) <= 2 * self.core.cap or late:
                    claim = self._enter(state)
                    break
                if pending[0] is state.inflight:
                    self.evictions.wait_for_head(state, deadline)
                    continue
            # The spool writer's queue is full: wait for room, outside the store's lock,
            # unless another process holds the spool's write lock (no room soon), or
            # there is room and the oldest message itself cannot be spooled.
            if self.core.spool.busy() or self.core.spool.has_room():
                deadline = 0.0
            else:
                self.core.spool.wait_for_room(max(deadline - self.core.timer(), 0.0))
        try:
            self.core.run(notes)
        finally:
            if claim is not None:
                budget = bounds.GATEWAY_DRAIN_ROWS if self.core.retry_interval > 0 else None
                self.writer.write_session(session_id, state, claim, budget=budget)

    def clear_dirty_transcript(self, session_id: str) -> None:
        """The store's rewrite hook (/retry, /undo, /compress): forget the queue, as the
        released store does, and mark the session's spooled rows superseded."""
        with self.core.lock:
            self.transcripts.queues.pop(session_id, None)
            self.transcripts.forget_failures(session_id)
            state = self.core.sessions.get(session_id)
            # Its queue is gone, and its spooled rows are not replayed any more.
            ended = self.lines.ended(session_id, (KEPT, UNSPOOLABLE))
            replayed = self.core.repeats.ended(
                (REPLAYED, session_id), self.core.clock(), at_once=True
            )
            if replayed is not None:
                ended.append(self.lines.line((REPLAYED, session_id), replayed))
            if state is not None:
                # An event: a writer that wrote or drained meanwhile re-reads it and
                # stops. Its share of the cap stays: the superseded rows stay in the spool.
                # Its evictions a replaced spool returned would land after the rewrite.
                kept = [row for row in self.core.returned if row.session_id != session_id]
                for _ in range(len(self.core.returned) - len(kept)):
                    self.core.handoffs.settled(session_id)
                self.core.returned = kept
                state.rewritten()
                self.core.handoffs.rewritten(session_id)
                ended += self.core.outage.ended(
                    session_id, state.episode, self.core.clock(), superseded=True
                )
                state.episode = None
                self.core.forget_if_idle(session_id, state)
            self.core.settled.notify_all()
        self.core.run(ended)
        # The queue was just emptied, so no eviction of this session can be submitted
        # before this runs: every row it spooled until now is superseded (the spool's
        # writer commits in submission order). This link's drains are held off.
        supersede_rewritten(self.core.spool, session_id, log, own_drains=self.core.draining)

    def _enter(self, state: Session) -> Claim | None:
        """After queueing a message: claim the session, take it over, or leave the
        message queued, as the machine says (``Entry``); the lock is held."""
        owner = owner_of(state)
        step = machine.entry(
            owner,
            self.core.failing(state),
            self.core.closed,
            owner is Owner.BACKGROUND and self.core.spool.busy(),
        )
        if step is Entry.CLAIM:
            return self.core.claim(state)
        if step is Entry.TAKE_OVER:
            return self._take_over(state)
        return None

    def _take_over(self, state: Session) -> Claim | None:
        """Wait (at most ``bounds.HANDOFF_WAIT``) for the background writer to hand the session
        to this gateway thread, then claim it; the lock is held."""
        if state.writer is None or not state.writer.background or self.core.closed:
            return None
        if self.core.spool.busy():
            # The background writer may be waiting for the spool's write lock held by
            # another process: do not wait behind it; the message stays queued.
            return None
        deadline = self.core.timer() + bounds.HANDOFF_WAIT
        with state.waiting():  # the background writer sees it at its next step
            while state.writer is not None and state.writer.background:
                left = deadline - self.core.timer()
                if left <= 0:
                    return None
                self.core.settled.wait(left)
            # Decided on the state as it is now: another gateway thread may have
            # claimed the session meanwhile; then this message is queued for it.
            return self.core.claim(state)
