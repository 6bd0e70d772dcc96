"""The gateway link: walspool as the overflow and shutdown sink of hermes-agent 0.19.0.

In the released gateway, ``SessionStore.append_to_transcript`` queues each message
per session, drops the oldest past 200 while ``state.db`` refuses writes, and the
runner and adapters clear their pending slots at shutdown. ``install`` changes
exactly that on one live store (and, with ``install_runner``, one runner):

* a message evicted at the cap is spooled (``CAP_DROP``), not dropped; if the spool
  cannot take it, the old drop-and-warn behaviour remains;
* a session's spooled rows (every reason but ``AGENT_HISTORY``, in seq order) are
  written before its in-memory rows, so ``state.db`` (``ORDER BY id``) holds the
  transcript in arrival order;
* pending slots and unflushed agent histories are spooled before they are cleared,
  and the next ``install`` replays them, in the background;
* a live message ``state.db`` refuses for its content (``sinks.rejects_live_row``: a
  value it cannot bind or serialise) never blocks its session: it is set aside in the
  spool as a quarantined row (reason ``REJECTED``; ``walspool ls`` shows it, replayed
  only when asked for) and the session's next message is written at once;
* a transcript rewrite (/retry, /undo, /compress: the store's ``_clear_dirty_transcript``)
  marks the session's spooled rows superseded: kept in the spool for operators, never
  replayed unless asked for, as the released store forgets its queue.

One writer per session. A session's writer is whoever claimed ``_Session.writer``
under the store's ``_transcript_retry_lock``: the gateway thread whose message found
the session idle, or the link's one background thread. Only the holder of the claim
writes the session or gives the claim up, and it makes every decision on the state it
reads under the lock after each write or wait. A session's state object is never
replaced, and is dropped only when nobody refers to it (no writer, no waiter, no
uncommitted eviction, no work); a thread that waited without a claim looks its
session up again, so every thread wakes to the current state.

Waits a gateway thread can meet because of walspool, with their bounds:

* the store's lock, held only for in-memory work: never a blocking put, never SQLite
  or file I/O (an eviction costs one ``stat`` of the spool's path, no more).
  An eviction is handed to the spool's writer with ``Spool.put_nowait``; when its
  queue is full, or the oldest message is being written right now, the message stays
  in memory over the cap (WARNING when the spool is the reason). ``put_nowait`` makes
  the checks ``Spool.append`` makes: a closed spool, or one whose path no longer names
  its file (deleted, moved), refuses the eviction, which takes the drop-and-warn path;
* past twice the cap only (messages arriving faster than the spool or one state.db
  write takes them): at most ``HANDOFF_WAIT`` for room in the spool writer's queue or
  for that write to end, and no wait at all while another process holds the spool's
  write lock; then the oldest takes the old drop-and-warn path (WARNING);
* as the writer of a healthy session, its own ``state.db`` writes (as in the released
  store) and a drain of its spooled rows: at most ``GATEWAY_DRAIN_ROWS`` rows per call, then the
  background thread goes on. Before a drain it waits at most ``CONFIRM_WAIT`` for its
  own evictions to commit, and at most ``HANDOFF_WAIT`` for this link's drain of
  another session to finish its batch; a drain never waits for a replay lock held
  elsewhere (``ReplayBusy``: retried later) and is left to the background thread
  while another process holds the spool's write lock. A spool transaction of a
  drain waits at most ``walspool.writer.BUSY_RETRY_SECONDS`` for that lock;
* taking a session over from the background thread: at most ``HANDOFF_WAIT``, in
  practice the rest of one ``state.db`` write or one drain batch of
  ``DRAIN_CHUNK_ROWS`` rows; none while another process holds the spool's write lock;
* a transcript rewrite: at most ``HANDOFF_WAIT`` for a drain batch of this link,
  then its supersede transaction (at most ``BUSY_RETRY_SECONDS``); shutdown's
  ``flush_queues`` waits at most ``FLUSH_TIMEOUT`` (plus ``CONFIRM_WAIT``).

Self-healing: while a session has queued or spooled work, the background thread
retries it when its retry time passes, with no new message needed, a slice of at most
``GATEWAY_DRAIN_ROWS`` spooled rows at a time, the session longest due first. The delay after
the k-th failure in a row is ``retry_interval`` * 2 ** (k - 4), capped at
``retry_interval``: 1/8, 1/4, 1/2, then every ``retry_interval``, so a healed
``state.db`` receives everything within ``retry_interval`` plus the time the writes
take. Meanwhile, from its first failed write or drain until a retry succeeds, a
session's gateway threads only queue its new messages (and spool at the cap): an
outage costs no failing write, and no wait, per message. ``retry_interval=0`` turns
the background thread off (as does ``Link.close``): each message retries at once, as
in the released store.

Logs (``walspool.outage``): one WARNING when a session starts spooling (naming the
spool), one when its spooled rows are all written back and one when the outage is over,
with counts and durations; a progress line at most once a minute; the released store's
retry WARNING for the first ``outage.QUIET_AFTER`` failures in a row, then at most once a
minute. Drops and errors are said each time, with their detail. The line per eviction
is DEBUG.

Not guaranteed: messages still in memory when the process is killed are lost, as in
the released gateway (only spooled rows are durable). A message the store or a drain
is writing at the moment of a rewrite may land after the rewritten transcript, as in
the released store. An eviction or a quarantined message the spool accepted but then
failed to commit (disk full, its write lock held elsewhere past the bound, closed) is
dropped with a WARNING; so is a refused message the spool cannot take at all.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from . import _link_machine as machine
from . import budget, outage, text
from ._link_machine import Entry, Facts, Owner, Spooled, Step
from .errors import ReplayBusy, UnsupportedGateway, WalspoolError
from .records import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from .replay import LOCK_SUFFIX, Replayer, ReplayReport, _exclusive
from .sinks import SessionDBSink, rejects_live_row
from .spool import Spool
from .writer import Batched, Request

log = text.logger("walspool.hermes")

#: What 0.19.0's SessionStore must have for the link to be correct.
STORE_ATTRIBUTES = (
    "_db",
    "_transcript_retry_lock",
    "_dirty_transcripts",
    "_transcript_append_failures",
    "_append_transcript_message",
    "_clear_dirty_transcript",
    "_MAX_PENDING_PER_SESSION",
    "_is_fts_corruption_error",
    "_rebuild_fts_once",
    "peek_session_id",
    "append_to_transcript",
)
#: What 0.19.0's GatewayRunner must have for ``install_runner``.
RUNNER_ATTRIBUTES = (
    "session_store",
    "adapters",
    "_pending_messages",
    "_queued_events",
    "_bounded_adapter_teardown",
    "_finalize_shutdown_agents",
)
#: The reason of a live message state.db refused for its content, quarantined at once.
REJECTED = "transcript_rejected"
#: Seconds: the cap of a failing session's retry delay (see the module docstring).
RETRY_INTERVAL = 1.0
#: Failures in a row until the retry delay reaches ``retry_interval``.
RETRY_STEPS = 4
#: Shortest delay between two background retries of one session, whatever the interval.
MIN_RETRY_SECONDS = 0.01
#: Spooled rows one drain step moves; the writer re-reads its session's state between
#: steps, so a rewrite, a shutdown or a waiting gateway thread is seen this often.
DRAIN_CHUNK_ROWS = 128
#: Spooled rows a gateway thread drains in one ``append_to_transcript`` before it leaves
#: the rest to the background thread (about 0.6 s of writes on the reference machine).
GATEWAY_DRAIN_ROWS = 1024
#: Seconds a gateway thread waits for its session's evictions to commit before a drain.
CONFIRM_WAIT = 0.25
#: How often that wait looks whether the spool's write lock is held elsewhere.
BUSY_LOOK_SECONDS = 0.01
#: Seconds a gateway thread waits to take its session over from the background thread.
HANDOFF_WAIT = 2.0
#: Seconds ``flush_queues`` waits for the spool at shutdown.
FLUSH_TIMEOUT = 10.0
#: Longest the background thread sleeps before it looks for work again (it is woken
#: whenever there is some; this only bounds the life of a forgotten link's thread).
IDLE_WAKE_SECONDS = 60.0


class _Writer:
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


class _Session:
    """The link's state for one session; every field is guarded by the store's lock."""

    __slots__ = (
        "writer",
        "inflight",
        "spooled",
        "unconfirmed",
        "retry_at",
        "hold_until",
        "failures",
        "generation",
        "waiters",
        "spooled_bytes",
        "episode",
        "said_at",
    )

    def __init__(self, spooled: int) -> None:
        #: The current writer's claim, or None: the session has no writer.
        self.writer: _Writer | None = None
        #: The queued message being written to state.db right now, if any.
        self.inflight: dict[str, Any] | None = None
        #: Evictions (and shutdown flushes) since the session's spooled rows were last
        #: all written: while not 0 they go to state.db before its in-memory rows.
        self.spooled = spooled
        #: Evictions handed to the spool's writer and not yet committed (or failed).
        self.unconfirmed = 0
        #: ``time.monotonic()`` when the background thread retries after a failure.
        self.retry_at = 0.0
        #: Until then, after a failed drain, new messages only queue (and spool).
        self.hold_until = 0.0
        #: Failed attempts in a row, for the retry delay.
        self.failures = 0
        #: Bumped by a transcript rewrite: what a writer learned before it is stale.
        self.generation = 0
        #: Threads waiting on this object (a gateway thread taking over, a writer
        #: waiting for its evictions): it stays in ``Link._sessions`` meanwhile.
        self.waiters = 0
        #: Payload bytes of the evictions since ``spooled`` was last 0 (its share of
        #: the link's cap, see ``walspool.budget``).
        self.spooled_bytes = 0
        #: Its spooling since its first eviction committed, for the operator's lines.
        self.episode: outage.Episode | None = None
        #: When a failed retry past ``outage.QUIET_AFTER`` was last logged.
        self.said_at = 0.0


class Link:
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
        self.retry_interval = retry_interval
        #: The cap on what evictions may fill (``walspool.budget``); None: no cap.
        self.max_bytes = max_bytes
        #: Payload bytes of evictions the spool's writer accepted and has not committed.
        self._unconfirmed_bytes = 0
        self.replayer = Replayer(
            spool,
            SessionDBSink(store._db),
            resolver=store.peek_session_id,
            wait_for_bookkeeping=False,
        )
        self.cap = int(store._MAX_PENDING_PER_SESSION)
        self._outage = outage.OutageLog(spool.path, self.cap)
        self._lock = store._transcript_retry_lock
        #: Notified when a writer gives its role up, evictions commit, a recovery ends:
        #: what waiting gateway threads (and ``wait_idle``) wait for.
        self._settled = threading.Condition(self._lock)
        #: Notified when the background thread has work sooner than it planned.
        self._due = threading.Condition(self._lock)
        self._sessions: dict[str, _Session] = {}
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
        #: When the background thread will look next (None: only when notified).
        self._wake_at: float | None = None
        self._thread: threading.Thread | None = None

    # -- the patched entry points --------------------------------------------------

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
        claim: _Writer | None = None
        queued = False
        # Past twice the cap (messages arriving faster than the spool or one state.db
        # write takes them), wait at most this long, then drop the oldest with a WARNING.
        deadline = time.monotonic() + HANDOFF_WAIT
        while True:
            with self._lock:
                # Looked up again after every wait: a rewrite may have emptied the
                # queue, and an idle session's state may have been dropped.
                state = self._session(session_id)
                pending = self.store._dirty_transcripts.setdefault(session_id, [])
                if not queued:
                    pending.append(copy)
                    queued = True
                late = time.monotonic() >= deadline
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
                self.spool.wait_for_room(max(deadline - time.monotonic(), 0.0))
        try:
            _run(notes)
        finally:
            if claim is not None:
                budget = GATEWAY_DRAIN_ROWS if self.retry_interval > 0 else None
                self._write_session(session_id, state, claim, budget=budget)

    def _clear_dirty_transcript(self, session_id: str) -> None:
        """The store's rewrite hook (/retry, /undo, /compress): forget the queue, as the
        released store does, and mark the session's spooled rows superseded."""
        with self._lock:
            self.store._dirty_transcripts.pop(session_id, None)
            self.store._transcript_append_failures.pop(session_id, None)
            state = self._sessions.get(session_id)
            if state is not None:
                # A writer that wrote or drained meanwhile re-reads this and stops.
                state.generation += 1
                state.spooled = state.failures = state.spooled_bytes = 0
                state.retry_at = state.hold_until = 0.0
                ended = self._outage.ended(
                    session_id, state.episode, time.monotonic(), superseded=True
                )
                state.episode = None
                self._forget_if_idle(session_id, state)
            else:
                ended = []
            self._settled.notify_all()
        _run(ended)
        try:
            # The queue was just emptied, so no eviction of this session can be
            # submitted before this runs: every row it spooled until now is
            # superseded (the spool's writer commits in submission order).
            superseded = self._supersede(session_id)
        except Exception:  # noqa: BLE001 - the rewrite goes on; the rows stay, reported
            log.exception(
                "walspool could not supersede the spooled rows of session %s in %s after "
                "its transcript was rewritten; a replay would put them after it",
                session_id,
                self.spool.path,
            )
            return
        if superseded:
            log.warning(
                "Transcript of %s rewritten: %d spooled message(s) in %s superseded (kept for "
                "operators, not replayed)",
                session_id,
                superseded,
                self.spool.path,
            )

    def _supersede(self, session_id: str) -> int:
        """Supersede the session's replayable rows, those a failed drain left in flight too.

        ``Spool.supersede`` leaves rows in flight to the replay that has them out. A
        row this link's failed drain left in flight has no replay: with the replay lock
        taken (not waited for) and this link's drains held off, every in-flight row of
        the session is such a leftover, and it is superseded with the rest.
        """
        if self._draining.acquire(timeout=HANDOFF_WAIT):
            try:
                with _exclusive(Path(f"{self.spool.path}{LOCK_SUFFIX}"), wait=False):
                    return self.spool.supersede(session_id, inflight=True)
            except ReplayBusy:
                pass  # another replay has rows out: leave those to it
            finally:
                self._draining.release()
        return self.spool.supersede(session_id)

    # -- evictions -------------------------------------------------------------------

    def _evict(
        self,
        session_id: str,
        state: _Session,
        pending: list[dict[str, Any]],
        *,
        drops: bool = False,
    ) -> list[Callable[[], None]]:
        """Spool the oldest queued messages past the cap; the lock is held.

        Returns the WARNINGs to log once the lock is released. Never waits: a message
        the spool's writer has no room for stays queued over the cap. With ``drops``
        (a gateway thread that waited its bounded time), past twice the cap the oldest
        (the second oldest while the oldest is being written) is dropped with a
        WARNING, as the released store drops at the cap.
        """
        notes: list[Callable[[], None]] = []
        while len(pending) > self.cap:
            over = len(pending) > 2 * self.cap
            if state.inflight is not None and pending[0] is state.inflight:
                # The oldest is being written right now: evicting it could put it in
                # state.db twice, and spooling a later one would put that one ahead
                # of it if the write fails. The writer evicts when its write ends.
                if not (over and drops):
                    break
                pending.pop(1)
                notes.append(partial(self._report_drop, session_id, "oldest being written"))
                continue
            try:
                row = self.spool.prepare(session_id, pending[0], CAP_DROP)
                refused = budget.refusal(
                    self.max_bytes,
                    self.spool.footprint(),
                    self._unconfirmed_bytes,
                    state.spooled_bytes,
                    row[5],
                )
                if refused is not None:
                    pending.pop(0)
                    notes.append(partial(self._report_drop, session_id, refused))
                    continue
                # The checks ``Spool.append`` makes (closed, the path still names the
                # spool's file) raise here, before the message leaves the queue.
                self.spool.put_nowait((row,), self._evicted)
            except queue.Full:
                if over and drops:
                    pending.pop(0)
                    notes.append(partial(self._report_drop, session_id, "spool writer busy"))
                    continue
                if not over:
                    notes.append(partial(self._report_kept, session_id, len(pending)))
                break
            except WalspoolError as exc:  # closed, too big, a session id it cannot store
                pending.pop(0)
                notes.append(partial(self._report_drop, session_id, str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - a bad value: it stays queued
                if over and drops:
                    pending.pop(0)
                    notes.append(partial(self._report_drop, session_id, repr(exc)))
                    continue
                notes.append(partial(self._report_unspoolable, session_id, exc))
                break
            # Off the queue only now that the spool's writer has accepted it.
            pending.pop(0)
            state.spooled += 1
            state.unconfirmed += 1
            state.spooled_bytes += row[5]
            self._unconfirmed_bytes += row[5]
        return notes

    def _wait_for_head(self, state: _Session, deadline: float) -> None:
        """Wait until the write of the queue's head ends (or ``deadline``); lock held."""
        state.waiters += 1
        try:
            left = deadline - time.monotonic()
            if left > 0:
                self._settled.wait(left)
        finally:
            state.waiters -= 1

    def _evictions_done(self, requests: list[Request]) -> None:
        """On the spool's writer: a group of evictions committed (or failed); count
        them under one take of the lock, then log each."""
        settled = False
        lines: list[list[Callable[[], None]]] = []  # the operator's lines, per request
        now = time.monotonic()
        with self._lock:
            self._unconfirmed_bytes -= sum(r.payload_bytes for r in requests)
            for request in requests:
                session_id = request.session_id
                state = self._sessions.get(session_id)
                said: list[Callable[[], None]] = []
                lines.append(said)
                if state is None:  # never: ``unconfirmed`` keeps it there
                    continue
                if request.error is None and state.spooled:
                    state.episode, said[:] = self._outage.evicted(session_id, state.episode, 1, now)
                state.unconfirmed -= 1
                if not state.unconfirmed:
                    settled = True
                    if state.writer is None:
                        if self._has_work(session_id, state):
                            self._schedule(state.retry_at)
                        else:
                            self._forget_if_idle(session_id, state)
            if settled:
                self._settled.notify_all()
        for request, said in zip(requests, lines, strict=True):
            _run(said)
            if request.error is not None:
                self._report_drop(request.session_id, str(request.error))
                continue
            # One line per eviction only for debugging: operators get the session's
            # start, progress and drained lines (``walspool.outage``).
            log.debug(
                "Session DB transcript pending queue full for %s (cap=%d); spooled oldest "
                "message to %s (seq %d) for replay after DB recovery",
                request.session_id,
                self.cap,
                self.spool.path,
                request.result.seq,
            )

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

    # -- the writer role -----------------------------------------------------------

    def _enter(self, state: _Session) -> _Writer | None:
        """After queueing a message: claim the session, take it over, or leave the
        message queued, as the machine says (``Entry``); the lock is held."""
        owner = _owner(state)
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

    def _claim(self, state: _Session, *, background: bool = False) -> _Writer | None:
        """Become the session's writer if it has none; the lock is held."""
        if state.writer is not None:
            return None
        state.writer = _Writer(background)
        return state.writer

    def _failing(self, state: _Session) -> bool:
        """The session's last write or drain failed, and the background thread retries
        it when its delay ends: a gateway thread only queues its messages (and spools
        at the cap), so an outage costs no failing write, and no wait, per message.
        Once the link is closed (no background thread), each message retries again."""
        now = time.monotonic()
        return machine.failing(
            machine.backoff_of(state.failures, state.hold_until, now),
            state.retry_at,
            self._background_on(),
            now,
        )

    def _background_on(self) -> bool:
        """Whether the background thread retries failing sessions."""
        return self.retry_interval > 0 and not self._closed

    def _take_over(self, state: _Session) -> _Writer | None:
        """Wait (at most ``HANDOFF_WAIT``) for the background writer to hand the session
        to this gateway thread, then claim it; the lock is held."""
        if state.writer is None or not state.writer.background or self._closed:
            return None
        if self.spool.busy():
            # The background writer may be waiting for the spool's write lock held by
            # another process: do not wait behind it; the message stays queued.
            return None
        deadline = time.monotonic() + HANDOFF_WAIT
        state.waiters += 1  # the background writer sees it at its next step
        try:
            while state.writer is not None and state.writer.background:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._settled.wait(left)
            # Decided on the state as it is now: another gateway thread may have
            # claimed the session meanwhile; then this message is queued for it.
            return self._claim(state)
        finally:
            state.waiters -= 1

    def _release(self, session_id: str, state: _Session, claim: _Writer) -> None:
        """Give the writer role up, if ``claim`` still holds it; the lock is held."""
        if state.writer is not claim:
            return
        state.writer = None
        state.inflight = None
        if self._has_work(session_id, state):
            self._schedule(state.retry_at)
        else:
            self._forget_if_idle(session_id, state)
        self._settled.notify_all()

    def _has_work(self, session_id: str, state: _Session) -> bool:
        return bool(state.spooled or self.store._dirty_transcripts.get(session_id))

    def _forget_if_idle(self, session_id: str, state: _Session) -> None:
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

    def _session(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _Session(0 if self._recovered else 1)
        return state

    def _failed(self, state: _Session, *, drain: bool, count: bool = True) -> None:
        """Schedule the next attempt after a failure; the lock is held."""
        if count:
            state.failures += 1
        delay = machine.retry_delay(
            state.failures, self.retry_interval, RETRY_STEPS, MIN_RETRY_SECONDS
        )
        state.retry_at = time.monotonic() + delay
        if drain:
            state.hold_until = state.retry_at

    # -- the session's writer ------------------------------------------------------

    def _write_session(
        self, session_id: str, state: _Session, claim: _Writer, *, budget: int | None
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
                with self._lock:
                    step, notes = self._next_step(session_id, state, claim, moved, budget)
                _run(notes)
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
            with self._lock:
                if state.writer is claim:
                    self._failed(state, drain=False)
                self._release(session_id, state, claim)

    def _next_step(
        self, session_id: str, state: _Session, claim: _Writer, moved: int, budget: int | None
    ) -> tuple[Step | None, list[Callable[[], None]]]:
        """What the writer does next (``Step.DRAIN``, ``Step.WRITE``), or None after
        giving the role up; and the WARNINGs to log. The machine decides
        (``_link_machine.next_step``); this performs its waits and its release. The
        lock is held."""
        notes: list[Callable[[], None]] = []
        pending = self.store._dirty_transcripts.get(session_id)
        if pending:
            notes = self._evict(session_id, state, pending)
        confirm_waited = False
        while True:
            now = time.monotonic()
            facts = self._facts(session_id, state, claim, moved, budget, confirm_waited)
            decision = machine.next_step(facts, now)
            if decision.retry_at is not None:
                state.retry_at = decision.retry_at
            step = decision.step
            if step is Step.CONFIRM:
                # Decided again on the state after the wait.
                self._wait_for_evictions(state)
                confirm_waited = True
                continue
            if step is Step.IDLE:
                self.store._transcript_append_failures.pop(session_id, None)
                state.failures = 0
                state.retry_at = state.hold_until = 0.0
            if step is Step.IDLE or step is Step.YIELD:
                self._release(session_id, state, claim)
                return None, notes
            return step, notes

    def _facts(
        self,
        session_id: str,
        state: _Session,
        claim: _Writer,
        moved: int,
        budget: int | None,
        confirm_waited: bool,
    ) -> Facts:
        """What the machine needs to know of the session, read now; the lock is held."""
        now = time.monotonic()
        return Facts(
            owner=claim.owner,
            spooled=Spooled.MAY_HOLD if state.spooled else Spooled.NONE,
            backoff=machine.backoff_of(state.failures, state.hold_until, now),
            unconfirmed=bool(state.unconfirmed),
            queued=bool(self.store._dirty_transcripts.get(session_id)),
            retry_at=state.retry_at,
            hold_until=state.hold_until,
            waiters=bool(state.waiters),
            recovering=self._recovering,
            background_on=self._background_on(),
            spool_busy=(
                bool(state.spooled)
                and not claim.background
                and self.retry_interval > 0
                and self.spool.busy()
            ),
            budget_spent=budget is not None and moved >= budget,
            confirm_waited=confirm_waited,
        )

    def _wait_for_evictions(self, state: _Session) -> None:
        """Wait at most ``CONFIRM_WAIT`` for the session's evictions to commit, and not
        at all once the spool's writer finds its write lock held elsewhere; lock held."""
        deadline = time.monotonic() + CONFIRM_WAIT
        state.waiters += 1
        try:
            while state.unconfirmed and not self.spool.busy():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                # A commit notifies; a busy write lock does not, so look again soon.
                self._settled.wait(min(left, BUSY_LOOK_SECONDS))
        finally:
            state.waiters -= 1

    def _drain_step(self, session_id: str, state: _Session, claim: _Writer) -> int | None:
        """Replay one chunk of the session's spooled rows; rows moved, or None when the
        writer gave its role up."""
        with self._lock:
            seen, generation = state.spooled, state.generation
            if self.spool.closed:
                # Nothing to drain from (the spool's owner closed it); the rows wait
                # for the next start's recovery, and the queue behind them.
                self._failed(state, drain=True)
                self._release(session_id, state, claim)
                return None
        # Drains of this link take turns here, each for one chunk, so that only
        # another process's replay (or ``recover``) can make one skip.
        if not self._draining.acquire(timeout=HANDOFF_WAIT):
            return self._busy(session_id, state, claim)
        try:
            report = self.replayer.replay(session_id=session_id, limit=DRAIN_CHUNK_ROWS, wait=False)
        except ReplayBusy:
            # Another replay (the CLI, a recovery) has the spool's replay lock: never
            # wait for it here; try again soon.
            return self._busy(session_id, state, claim)
        except Exception as exc:  # noqa: BLE001 - the gateway goes on; rows stay spooled
            log.warning(
                "Replay of spooled transcript messages for %s failed in %s; holding back its "
                "queued messages: %s",
                session_id,
                self.spool.path,
                exc,
            )
            with self._lock:
                self._failed(state, drain=True)
                self._release(session_id, state, claim)
            return None
        finally:
            self._draining.release()
        ended: list[Callable[[], None]] = []
        with self._lock:
            if state.generation != generation:
                return 0  # rewritten meanwhile: the next step decides afresh
            now = time.monotonic()
            if report.held or session_id in report.errors:
                self._failed(state, drain=True)
                failures = self.store._transcript_append_failures.get(session_id, 0) + 1
                self.store._transcript_append_failures[session_id] = failures
                queued = len(self.store._dirty_transcripts.get(session_id) or ())
                say = self._say_again(state, now)
                self._release(session_id, state, claim)
            else:
                state.failures = 0
                self._outage.replayed_rows(state.episode, report.moved)
                touched = report.moved + report.recovered + report.quarantined
                if not touched and state.spooled == seen:
                    # Nothing left: the rows counted in ``seen`` were all committed
                    # before this replay looked (``unconfirmed`` was 0), so all moved.
                    state.spooled = state.spooled_bytes = 0
                    ended = self._outage.ended(session_id, state.episode, now)
                    state.episode = None
        _run(ended)
        if report.held or session_id in report.errors:
            if not say:
                return None
            log.warning(
                "Replay of %d spooled transcript message(s) for %s failed; keeping them in %s "
                "and holding back %d queued message(s): %s",
                report.held,
                session_id,
                self.spool.path,
                queued,
                report.errors.get(session_id, "unknown error"),
            )
            return None
        if report.moved:
            log.info(
                "Replayed %d spooled transcript message(s) for %s after DB recovery",
                report.moved,
                session_id,
            )
        return report.moved

    def _say_again(self, state: _Session, now: float) -> bool:
        """Whether to log the session's latest failed retry (rate-limited, see
        ``walspool.outage.repeat_due``); the lock is held, ``_failed`` has counted it."""
        if not outage.repeat_due(state.failures, state.said_at, now):
            return False
        if state.failures >= outage.QUIET_AFTER:
            state.said_at = now  # the next is said no sooner than REPORT_SECONDS after
        return True

    def _busy(self, session_id: str, state: _Session, claim: _Writer) -> None:
        """Give a drain up for now (another replay runs); the background thread tries
        again after the first retry delay, and a new message may try at once."""
        with self._lock:
            self._failed(state, drain=False, count=False)
            self._release(session_id, state, claim)
        return None

    def _write_head(self, session_id: str, state: _Session, claim: _Writer) -> bool:
        """Write the head of the session's queue; True to go on, False when stopped."""
        with self._lock:
            pending = self.store._dirty_transcripts.get(session_id)
            if not pending or state.spooled:
                return True  # the next step decides again
            message = state.inflight = pending[0]
        error = self._write_one(session_id, message)
        with self._lock:
            state.inflight = None
            if state.waiters:
                self._settled.notify_all()  # appenders held back by this write
            pending = self.store._dirty_transcripts.get(session_id)
            if error is None:
                if pending and pending[0] is message:
                    pending.pop(0)
                state.failures = 0
                return True
            aside = None
            if rejects_live_row(error, self.store._db):
                aside = self._set_aside(session_id, pending, message, error)
            if aside is not None:
                state.failures = 0  # state.db works: the session goes on at once
            else:
                failures = self.store._transcript_append_failures.get(session_id, 0) + 1
                self.store._transcript_append_failures[session_id] = failures
                queued = len(pending or ())
                self._failed(state, drain=False)
                say = self._say_again(state, time.monotonic())
                # Messages that arrived during the write waited for it to be evicted.
                notes = self._evict(session_id, state, pending) if pending else []
                self._release(session_id, state, claim)
        if aside is not None:
            _run(aside)
            return True
        _run(notes)
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
        why = f"state.db refused it for its content: {type(error).__name__}: {error}"
        try:
            row = self.spool.prepare(session_id, message, REJECTED)
            self.spool.put_nowait((row,), partial(self._set_aside_done, why), quarantine=why)
        except queue.Full:
            return None
        except Exception as exc:  # noqa: BLE001 - closed, replaced, too big: cannot keep it
            pending.pop(0)
            return [partial(self._report_lost_rejection, session_id, why, exc)]
        pending.pop(0)
        return []

    def _set_aside_done(self, why: str, request: Request) -> None:
        """On the spool's writer: a quarantined live message committed (or failed)."""
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

    def _write_one(self, session_id: str, message: dict[str, Any]) -> Exception | None:
        """Write one queued message as the released store does, FTS repair included."""
        store = self.store
        try:
            store._append_transcript_message(session_id, message)
            return None
        except Exception as exc:  # noqa: BLE001 - the store's own policy: retry later
            if not (store._is_fts_corruption_error(exc) and store._rebuild_fts_once()):
                return exc
        try:
            store._append_transcript_message(session_id, message)
            return None
        except Exception as exc:  # noqa: BLE001
            return exc

    # -- the background thread -----------------------------------------------------

    def _schedule(self, at: float) -> None:
        """Make the background thread look at ``at`` (monotonic) or sooner; lock held."""
        if self.retry_interval <= 0 or self._closed:
            return
        if self._wake_at is None or at < self._wake_at:
            self._wake_at = at
            self._due.notify()

    def _start(self) -> None:
        if self.retry_interval <= 0 and not self._recovering:
            return
        self._thread = threading.Thread(
            target=_background,
            args=(weakref.ref(self), self._due),
            daemon=True,
            name=f"walspool-link {self.spool.path}",
        )
        self._thread.start()

    def _due_sessions(self) -> tuple[list[tuple[str, _Session, _Writer]], float | None]:
        """Claim the session longest due (its retry time passed first); when to look
        next. One at a time: a claim held while the thread works on another session
        would make a gateway thread wait for that one too. A session given a slice
        of ``GATEWAY_DRAIN_ROWS`` rows is due again from then on, so sessions with
        backlogs take turns. Lock held."""
        now = time.monotonic()
        candidates = {
            session_id: machine.Candidate(
                owner=_owner(state),
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
        spooling evictions; sessions retry on their next message."""
        with self._lock:
            self._closed = True
            self._due.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(HANDOFF_WAIT)

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until no recovery runs and no session has
        a writer, queued or spooled work; True if so (for tests and shutdowns)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._recovering or any(
                s.writer is not None or s.unconfirmed or self._has_work(sid, s)
                for sid, s in self._sessions.items()
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)
            return True

    # -- shutdown and startup --------------------------------------------------------

    def flush_pending(self, pending: Mapping[str, Any], *, reason: str = SHUTDOWN) -> int:
        """Spool pending slots (session key -> text or MessageEvent); return how many."""
        return self.flush_slots(list(pending.items()), reason=reason)

    def flush_slots(self, slots: list[tuple[str, Any]], *, reason: str = SHUTDOWN) -> int:
        """Spool ``(session_key, text or event)`` pairs in order, in one transaction.

        The session id is resolved now, through the store, while the gateway still
        knows it; the key is kept too. Values that are None are skipped.
        """
        items = [
            (_resolve(self.store, key), slot_message(value), key)
            for key, value in slots
            if value is not None
        ]
        if not items:
            return 0
        self.spool.append_many(items, reason=reason)
        log.info(
            "Spooled %d pending message(s) to %s (reason=%s)", len(items), self.spool.path, reason
        )
        return len(items)

    def flush_agent_history(self, session_id: str | None, history: list[Any]) -> bool:
        """Spool an agent's unpersisted history as one ``AGENT_HISTORY`` row."""
        if not history:
            return False
        self.spool.append(
            session_id or "unknown",
            agent_history_message(session_id, history),
            reason=AGENT_HISTORY,
        )
        log.warning(
            "Preserved %d in-memory message(s) for session %s in %s (state.db did not take "
            "them); recover by hand after repairing state.db",
            len(history),
            session_id,
            self.spool.path,
        )
        return True

    def flush_queues(self) -> int:
        """Spool every session's in-memory queue (``SHUTDOWN``), oldest first; empty it.

        For a shutdown while state.db refuses writes: what the released gateway loses
        with the process. A message being written right now stays queued (it may
        land). Returns how many were spooled. Waits at most ``FLUSH_TIMEOUT`` for room
        in the spool and for the commit; on a spool error the messages go back to the
        front of their queues, and a message the spool cannot take at all stays queued
        (both logged at ERROR).
        """
        deadline = time.monotonic() + FLUSH_TIMEOUT
        committed = threading.Event()
        #: The spool's request, once committed or failed (``_flushed`` adds it).
        requests: list[Request] = []
        while True:
            with self._lock:
                taken, rows, notes = self._queued_rows()
                if not rows:
                    _run(notes)
                    return 0
                # Filled below; ``_flushed`` reads it under the lock held here.
                generations: dict[str, int] = {}
                try:
                    # Under the lock, so no message of these sessions is queued, evicted
                    # or written meanwhile: the spool gets them in arrival order.
                    self.spool.put_nowait(
                        rows,
                        partial(self._flushed, taken, generations, committed, requests),
                        single=False,
                    )
                except queue.Full:
                    pass
                except WalspoolError as exc:  # closed, or its path names another file
                    refused: WalspoolError | None = exc
                    break
                else:
                    refused = None
                    for session_id, messages in taken.items():
                        ids = {id(m) for m in messages}
                        pending = self.store._dirty_transcripts[session_id]
                        pending[:] = [m for m in pending if id(m) not in ids]
                        state = self._session(session_id)
                        state.spooled += 1
                        state.unconfirmed += 1
                        generations[session_id] = state.generation
                    break
            if time.monotonic() >= deadline:
                log.error(
                    "could not spool %d queued transcript message(s) at shutdown: the spool "
                    "%s had no room for them within %g s",
                    len(rows),
                    self.spool.path,
                    FLUSH_TIMEOUT,
                )
                return 0
            self.spool.wait_for_room(max(deadline - time.monotonic(), 0.0))
        _run(notes)
        if refused is not None:
            log.error(
                "could not spool %d queued transcript message(s) at shutdown; they stay queued: %s",
                len(rows),
                refused,
            )
            return 0
        if not committed.wait(max(deadline - time.monotonic(), 0.0) + CONFIRM_WAIT):
            log.error(
                "%d queued transcript message(s) were handed to %s at shutdown but not "
                "committed within %g s; they are spooled if the spool commits them later",
                len(rows),
                self.spool.path,
                FLUSH_TIMEOUT,
            )
            return 0
        (request,) = requests
        if request.error is not None:
            log.error(
                "could not spool %d queued transcript message(s) at shutdown to %s; they "
                "stay queued: %s",
                len(rows),
                self.spool.path,
                request.error,
            )
            return 0
        log.warning(
            "Spooled %d queued transcript message(s) to %s at shutdown", len(rows), self.spool.path
        )
        return len(rows)

    def _flushed(
        self,
        taken: dict[str, list[dict[str, Any]]],
        generations: dict[str, int],
        committed: threading.Event,
        requests: list[Request],
        request: Request,
    ) -> None:
        """On the spool's writer: a shutdown flush committed (or failed)."""
        with self._lock:
            for session_id, messages in taken.items():
                state = self._sessions[session_id]  # ``unconfirmed`` keeps it there
                state.unconfirmed -= 1
                if request.error is not None and state.generation == generations[session_id]:
                    # Not in the spool: back to the front of their queue, so they stay
                    # with the process as in the released store; unless the transcript
                    # was rewritten meanwhile, which dropped the queue they were in.
                    self.store._dirty_transcripts.setdefault(session_id, [])[0:0] = messages
                if state.writer is None and self._has_work(session_id, state):
                    self._schedule(state.retry_at)
            self._settled.notify_all()
        requests.append(request)
        committed.set()

    def _queued_rows(
        self,
    ) -> tuple[dict[str, list[dict[str, Any]]], list[Any], list[Callable[[], None]]]:
        """Every queue's messages but one being written, as spool rows; lock held."""
        taken: dict[str, list[dict[str, Any]]] = {}
        rows: list[Any] = []
        notes: list[Callable[[], None]] = []
        for session_id, pending in self.store._dirty_transcripts.items():
            state = self._sessions.get(session_id)
            busy = state is not None and pending and pending[0] is state.inflight
            for message in pending[1 if busy else 0 :]:
                try:
                    rows.append(self.spool.prepare(session_id, message, SHUTDOWN))
                except Exception as exc:  # noqa: BLE001 - the others are spooled all the same
                    notes.append(partial(self._report_unspoolable, session_id, exc))
                    continue
                taken.setdefault(session_id, []).append(message)
        return taken, rows, notes

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
            report = self.replayer.replay()
        except BaseException:
            with self._lock:
                self._end_recovery()
            raise
        held = {s.session_id for s in report.sessions.values() if s.error}
        ready: list[tuple[str, _Session, _Writer]] = []
        background = threading.current_thread() is self._thread
        moved = {s.session_id: s.moved for s in report.sessions.values() if s.session_key is None}
        ended: list[Callable[[], None]] = []
        with self._lock:
            now = time.monotonic()
            self._recovered = True
            for session_id in held:
                state = self._session(session_id)
                state.spooled = state.spooled or 1
            for session_id, (spooled, generation) in waiting.items():
                state = self._sessions.get(session_id)
                if state is None or session_id in held:
                    continue
                if state.spooled != spooled or state.generation != generation:
                    continue
                state.spooled, state.failures, state.spooled_bytes = 0, 0, 0
                state.retry_at = state.hold_until = 0.0
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
        _run(ended)
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
                state.retry_at = state.hold_until = 0.0
                self._schedule(0.0)
        self._settled.notify_all()


def _background(link_ref: weakref.ref[Link], due: threading.Condition) -> None:
    """The link's one background thread: the start's recovery, then the retries of
    every session whose retry time has passed. It holds the link only while it works,
    so a link nobody refers to any more is collected and this thread ends."""
    link = link_ref()
    if link is None:
        return
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
        with due:
            if link._closed or link.spool.closed:
                return  # a closed spool can take and give back nothing any more
            claimed, soonest = link._due_sessions()
            link._wake_at = soonest
            if not claimed:
                timeout = IDLE_WAKE_SECONDS
                if soonest is not None:
                    timeout = min(max(soonest - time.monotonic(), 0.0), IDLE_WAKE_SECONDS)
                del link
                due.wait(timeout)
                continue
        for session_id, state, claim in claimed:
            # A bounded slice, then the session waits its turn behind the others due.
            link._write_session(session_id, state, claim, budget=GATEWAY_DRAIN_ROWS)
        del link


def install(
    store: Any,
    spool: Spool,
    *,
    recover: bool = True,
    retry_interval: float = RETRY_INTERVAL,
    max_bytes: int | None = budget.DEFAULT_MAX_BYTES,
) -> Link:
    """Link a live 0.19.0 ``SessionStore`` to ``spool``; replay what is spooled.

    Returns at once: the replay of what earlier runs spooled (``recover=True``) runs
    on the link's background thread, and each session writes its spooled rows before
    its live ones. ``retry_interval`` caps a failing session's retry delay (see the
    module docstring); 0 retries on every message and starts no background retries.
    ``max_bytes`` caps what evictions may fill, with room kept for quiet sessions
    (``walspool.budget``; default 4 GiB, None for no cap). ``link.wait_idle(timeout)``
    waits for the recovery and every session's work.

    Raises ``UnsupportedGateway`` at once if the store is not what the link was
    written for, rather than misbehaving later.
    """
    missing = [name for name in STORE_ATTRIBUTES if not hasattr(store, name)]
    if missing:
        raise UnsupportedGateway(
            f"{type(store).__name__} lacks {', '.join(missing)}; walspool.hermes supports "
            "hermes-agent 0.19.0's gateway.session.SessionStore",
            path=spool.path,
        )
    if isinstance(getattr(store.append_to_transcript, "__self__", None), Link):
        raise UnsupportedGateway("this SessionStore is linked to a spool already", path=spool.path)
    if store._db is None:
        raise UnsupportedGateway(
            "the SessionStore has no state.db (store._db is None)", path=spool.path
        )
    link = Link(store, spool, retry_interval, max_bytes)
    if max_bytes is not None:
        spool.track_footprint()
    if recover:
        if _nothing_to_replay(spool):
            link._recovered = True
        else:
            link._recovering = True
    store.append_to_transcript = link.append_to_transcript
    store._clear_dirty_transcript = link._clear_dirty_transcript
    link._start()
    return link


def _nothing_to_replay(spool: Spool) -> bool:
    """True when the spool surely holds no row a recovery would move (one index probe)."""
    try:
        return not spool.has_replayable()
    except Exception:  # noqa: BLE001 - then the background recovery finds out
        return False


def _owner(state: _Session) -> Owner:
    """Who holds the session's claim."""
    return Owner.NOBODY if state.writer is None else state.writer.owner


def _run(notes: list[Callable[[], None]]) -> None:
    """Log the WARNINGs gathered under the lock."""
    for note in notes:
        note()


def install_runner(runner: Any, link: Link) -> None:
    """Spool a 0.19.0 ``GatewayRunner``'s pending slots and unflushed histories at shutdown."""
    missing = [name for name in RUNNER_ATTRIBUTES if not hasattr(runner, name)]
    if missing:
        raise UnsupportedGateway(
            f"{type(runner).__name__} lacks {', '.join(missing)}; walspool.hermes supports "
            "hermes-agent 0.19.0's gateway.run.GatewayRunner",
            path=link.spool.path,
        )

    def runner_cleared(slots: dict[str, Any]) -> None:
        # GatewayRunner.stop() clears its own slots after tearing the adapters down,
        # so the /queue overflow (each key's tail, after the adapter slot that holds
        # its head) and the store's queues are spooled here, in that order.
        _never_raise(link.flush_pending, slots, reason=SHUTDOWN)
        queued = runner._queued_events or {}  # checked above: 0.19.0 has it
        overflow = [(key, event) for key, events in list(queued.items()) for event in events]
        _never_raise(link.flush_slots, overflow, reason="overflow_shutdown")
        _never_raise(link.flush_queues)

    runner._pending_messages = SpoolOnClear(runner._pending_messages, runner_cleared)
    teardown = runner._bounded_adapter_teardown
    finalize = runner._finalize_shutdown_agents

    async def bounded_adapter_teardown(adapter: Any, platform: Any, **kw: Any) -> None:
        slots = getattr(adapter, "_pending_messages", None)
        if isinstance(slots, dict) and not isinstance(slots, SpoolOnClear):
            adapter._pending_messages = SpoolOnClear(
                slots, partial(link.flush_pending, reason="adapter_shutdown")
            )
        await teardown(adapter, platform, **kw)

    async def finalize_shutdown_agents(active_agents: dict[str, Any]) -> None:
        await finalize(active_agents)
        for agent in list(active_agents.values()):
            history = getattr(agent, "_session_messages", None)
            if isinstance(history, list):
                unsaved = [m for m in history if isinstance(m, dict) and not m.get("_db_persisted")]
                _never_raise(link.flush_agent_history, getattr(agent, "session_id", None), unsaved)

    runner._bounded_adapter_teardown = bounded_adapter_teardown
    runner._finalize_shutdown_agents = finalize_shutdown_agents


class SpoolOnClear(dict):  # type: ignore[type-arg]
    """A pending-slot dict whose ``clear()`` hands its contents to ``on_clear`` first."""

    def __init__(self, items: Mapping[str, Any], on_clear: Callable[[dict[str, Any]], Any]) -> None:
        super().__init__(items)
        self._on_clear = on_clear

    def clear(self) -> None:
        _never_raise(self._on_clear, dict(self))
        super().clear()


def _never_raise(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Shutdown must go on: log a spool failure at ERROR instead of raising it."""
    try:
        return fn(*args, **kw)
    except Exception:  # noqa: BLE001
        log.exception("walspool could not spool at shutdown; these messages are lost")
        return None


def _resolve(store: Any, session_key: str) -> str | None:
    try:
        return store.peek_session_id(session_key)
    except Exception:  # noqa: BLE001 - an unknown key is resolved again at replay
        return None


def slot_message(value: Any) -> Any:
    """A pending slot's value as spooled: text as ``{"text": ...}``, events as they are."""
    return {"text": value} if isinstance(value, str) else value


def agent_history_message(session_id: str | None, history: list[Any]) -> dict[str, Any]:
    """The one row an agent's unpersisted history is spooled as (``AGENT_HISTORY``)."""
    return {"session_id": session_id, "count": len(history), "messages": history}
