"""The gateway link: walspool as the overflow and shutdown sink of hermes-agent 0.19.0.

In the released gateway, ``SessionStore.append_to_transcript`` queues each message
per session, drops the oldest past 200 while ``state.db`` refuses writes, and the
runner and adapters clear their pending slots at shutdown. ``install`` changes
exactly that on one live store (and, with ``install_runner``, one runner):

* a message evicted at the cap is spooled (``CAP_DROP``), not dropped; if the spool
  cannot take it, the old drop-and-warn behaviour remains;
* a session's spooled rows are written before its in-memory rows, so ``state.db``
  (``ORDER BY id``) holds the transcript in arrival order;
* pending slots and unflushed agent histories are spooled before they are cleared,
  and ``recover`` (run by ``install``) replays them at the next start.

One thread at a time writes a given session (the first caller that finds the session
idle); the others only queue and return, so the same message is never written twice
by two threads. The store's global ``_transcript_retry_lock`` is held only to queue
and to reserve a spooled message's place in the spool writer's queue. No gateway thread waits
for the spool's fsync: an evicted message is committed by the spool's writer with
the next group (its WARNING is logged then), typically within a millisecond; until
then it is in memory, like the 200 messages still queued.

Not guaranteed: messages still in memory when the process is killed are lost, as in
the released gateway (only spooled rows are durable); ``rewrite_transcript`` does not
remove a session's spooled rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from .errors import UnsupportedGateway, WalspoolError
from .records import AGENT_HISTORY, CAP_DROP, SHUTDOWN, Receipt
from .replay import Replayer, ReplayReport
from .sinks import SessionDBSink
from .spool import Spool

log = logging.getLogger("walspool.hermes")

#: What 0.19.0's SessionStore must have for the link to be correct.
STORE_ATTRIBUTES = (
    "_db",
    "_transcript_retry_lock",
    "_dirty_transcripts",
    "_transcript_append_failures",
    "_append_transcript_message",
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
#: Seconds a session waits after its spooled rows failed to replay before it tries
#: again; meanwhile its new messages only queue (and spool at the cap), so an outage
#: costs no failing write per message.
RETRY_INTERVAL = 1.0
#: Reasons a live session drains before writing its in-memory rows.
LIVE_REASONS = (CAP_DROP, SHUTDOWN, "adapter_shutdown", "overflow_shutdown")


class _Session:
    """The link's state for one session; guarded by the store's retry lock."""

    __slots__ = ("writing", "inflight", "spooled", "retry_at")

    def __init__(self, spooled: int = 0) -> None:
        self.writing = False
        self.inflight: dict[str, Any] | None = None
        #: Messages spooled since the session's spooled rows were last all written;
        #: while not 0, they go to state.db before the session's in-memory rows.
        self.spooled = spooled
        #: ``time.monotonic()`` before which a failed replay is not tried again.
        self.retry_at = 0.0


class Link:
    """A SessionStore linked to a spool; made by ``install``."""

    def __init__(self, store: Any, spool: Spool, retry_interval: float = RETRY_INTERVAL) -> None:
        self.store = store
        self.spool = spool
        self.retry_interval = retry_interval
        self.replayer = Replayer(
            spool,
            SessionDBSink(store._db),
            resolver=store.peek_session_id,
            wait_for_bookkeeping=False,
        )
        self.cap = int(store._MAX_PENDING_PER_SESSION)
        self._lock = store._transcript_retry_lock
        self._changed = threading.Condition(self._lock)
        self._sessions: dict[str, _Session] = {}
        #: Until a full ``recover`` has succeeded, any session may have rows in the
        #: spool from an earlier run, so each drains before its first live write.
        self._recovered = False

    # -- the patched entry point -------------------------------------------------

    def append_to_transcript(
        self, session_id: str, message: dict[str, Any], skip_db: bool = False
    ) -> None:
        """Queue a message for ``state.db``; spool, never drop, what overflows the cap."""
        store = self.store
        if not store._db or skip_db:
            return
        refused: list[WalspoolError] = []
        with self._changed:
            state = self._session(session_id)
            store._dirty_transcripts.setdefault(session_id, []).append(dict(message))
            while True:
                pending = store._dirty_transcripts.get(session_id) or []
                if len(pending) <= self.cap:
                    break
                if state.inflight is not None and pending[0] is state.inflight:
                    # The oldest is being written right now; evicting it could put
                    # it in state.db twice. Wait for that one write to end.
                    self._changed.wait()
                    continue
                try:
                    self.spool._submit_then(
                        session_id,
                        pending.pop(0),
                        reason=CAP_DROP,
                        then=partial(self._report_eviction, session_id),
                    )
                except WalspoolError as exc:
                    refused.append(exc)
                else:
                    state.spooled += 1
            become_writer = not state.writing
            state.writing = True
        for error in refused:
            self._report_drop(session_id, error)
        if become_writer:
            self._write_session(session_id, state)

    def _report_eviction(self, session_id: str, outcome: Receipt | BaseException) -> None:
        """Log a spooled eviction once it is committed (or its drop, if it failed)."""
        if isinstance(outcome, BaseException):
            self._report_drop(session_id, outcome)
            return
        log.warning(
            "Session DB transcript pending queue full for %s (cap=%d); spooled oldest message "
            "to %s (seq %d) for replay after DB recovery",
            session_id,
            self.cap,
            self.spool.path,
            outcome.seq,
        )

    def _report_drop(self, session_id: str, error: BaseException) -> None:
        log.warning(
            "Session DB transcript pending queue full for %s (cap=%d); dropping oldest "
            "message to make room (on-disk spool unavailable: %s)",
            session_id,
            self.cap,
            error,
        )

    # -- the session's writer ------------------------------------------------------

    def _write_session(self, session_id: str, state: _Session) -> None:
        """Write the session's spooled rows, then its queue, until done or a write fails.

        Whenever it decides to stop it clears ``state.writing`` under the same lock
        hold, so a message queued meanwhile is never left without a writer. Nothing
        it meets is raised into the gateway: an unexpected error is logged and the
        messages stay queued or spooled.
        """
        try:
            while True:
                with self._lock:
                    spooled = state.spooled
                    if spooled and time.monotonic() < state.retry_at:
                        self._stop_writing(session_id, state)
                        return
                if spooled:
                    drained = self._drain(session_id, state, spooled)
                    with self._lock:
                        if not drained:
                            state.retry_at = time.monotonic() + self.retry_interval
                            self._stop_writing(session_id, state)
                            return
                    continue
                with self._lock:
                    if state.spooled:
                        continue
                    pending = self.store._dirty_transcripts.get(session_id)
                    if not pending:
                        self.store._dirty_transcripts.pop(session_id, None)
                        self.store._transcript_append_failures.pop(session_id, None)
                        self._stop_writing(session_id, state)
                        return
                    message = state.inflight = pending[0]
                error = self._write_one(session_id, message)
                with self._changed:
                    state.inflight = None
                    self._changed.notify_all()
                    pending = self.store._dirty_transcripts.get(session_id)
                    if error is None:
                        if pending and pending[0] is message:
                            pending.pop(0)
                        continue
                    failures = self.store._transcript_append_failures.get(session_id, 0) + 1
                    self.store._transcript_append_failures[session_id] = failures
                    self._stop_writing(session_id, state)
                log.warning(
                    "Session DB transcript append failed for %s (failure_count=%d, pending=%d); "
                    "will retry: %s",
                    session_id,
                    failures,
                    len(pending or ()),
                    error,
                )
                return
        except Exception:  # noqa: BLE001 - the gateway must go on
            log.exception(
                "walspool could not write session %s; its messages stay queued", session_id
            )
            with self._changed:
                state.inflight = None
                self._changed.notify_all()
                self._stop_writing(session_id, state)

    def _stop_writing(self, session_id: str, state: _Session) -> None:
        """Give up the session's writer role; the caller holds the lock."""
        state.writing = False
        if not state.spooled and self._sessions.get(session_id) is state:
            del self._sessions[session_id]

    def _drain(self, session_id: str, state: _Session, spooled: int) -> bool:
        """Replay the session's spooled rows; True when none is left behind."""
        try:
            self.spool.flush()  # the evictions counted in ``spooled`` are committed
            report = self.replayer.replay(session_id=session_id, reasons=LIVE_REASONS)
        except Exception as exc:  # noqa: BLE001 - the gateway goes on; rows stay spooled
            log.warning(
                "Replay of spooled transcript messages for %s failed in %s; holding back its "
                "queued messages: %s",
                session_id,
                self.spool.path,
                exc,
            )
            return False
        if report.held:
            with self._lock:
                failures = self.store._transcript_append_failures.get(session_id, 0) + 1
                self.store._transcript_append_failures[session_id] = failures
            log.warning(
                "Replay of %d spooled transcript message(s) for %s failed; keeping them in %s "
                "and holding back %d queued message(s): %s",
                report.held,
                session_id,
                self.spool.path,
                len(self.store._dirty_transcripts.get(session_id) or ()),
                report.errors.get(session_id, "unknown error"),
            )
            return False
        with self._lock:
            if state.spooled == spooled:
                state.spooled = 0
        if report.moved:
            log.info(
                "Replayed %d spooled transcript message(s) for %s after DB recovery",
                report.moved,
                session_id,
            )
        return True

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

    def _session(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _Session(0 if self._recovered else 1)
        return state

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
        land). Returns how many were spooled; on a spool error they stay queued.
        """
        with self._lock:
            items: list[tuple[str, Any]] = []
            for session_id, pending in list(self.store._dirty_transcripts.items()):
                state = self._sessions.get(session_id)
                busy = state is not None and pending and pending[0] is state.inflight
                items += [(session_id, m) for m in pending[1 if busy else 0 :]]
            if not items:
                return 0
            try:
                # Under the lock, so no message of these sessions is queued, evicted or
                # written meanwhile: their order in the spool is their arrival order.
                self.spool.append_many(items, reason=SHUTDOWN)
            except WalspoolError:
                log.exception(
                    "could not spool %d queued transcript message(s) at shutdown", len(items)
                )
                return 0
            for session_id in {sid for sid, _ in items}:
                pending = self.store._dirty_transcripts[session_id]
                state = self._sessions.get(session_id)
                busy = state is not None and pending and pending[0] is state.inflight
                del pending[1 if busy else 0 :]
                self._session(session_id).spooled += 1
        log.warning(
            "Spooled %d queued transcript message(s) to %s at shutdown", len(items), self.spool.path
        )
        return len(items)

    def recover(self) -> ReplayReport:
        """Replay everything spooled (but agent histories) into ``state.db`` now.

        Ignores the retry interval. Sessions whose rows all moved write their queued
        messages next; sessions held keep their queue until their rows move.
        """
        with self._lock:
            waiting = {sid: st.spooled for sid, st in self._sessions.items() if st.spooled}
        self.spool.flush()
        report = self.replayer.replay()
        held = {s.session_id for s in report.sessions.values() if s.error and not s.session_key}
        ready = []
        with self._lock:
            self._recovered = True
            for session_id in held:
                state = self._session(session_id)
                state.spooled = state.spooled or 1
            for session_id, spooled in waiting.items():
                state = self._sessions.get(session_id)
                if state is None or session_id in held or state.spooled != spooled:
                    continue
                state.spooled, state.retry_at = 0, 0.0
                if not state.writing and self.store._dirty_transcripts.get(session_id):
                    state.writing = True
                    ready.append((session_id, state))
        for session_id, state in ready:
            self._write_session(session_id, state)
        if report.moved or report.held:
            log.info(
                "Recovered %d spooled message(s) into state.db; %d held back",
                report.moved,
                report.held,
            )
        return report


def install(
    store: Any, spool: Spool, *, recover: bool = True, retry_interval: float = RETRY_INTERVAL
) -> Link:
    """Link a live 0.19.0 ``SessionStore`` to ``spool``; replay what is spooled.

    ``retry_interval``: after a session's spooled rows fail to replay, its new
    messages queue without a write attempt for that many seconds (0: try on every
    message, as the released store does).

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
    link = Link(store, spool, retry_interval)
    store.append_to_transcript = link.append_to_transcript
    if recover:
        try:
            link.recover()
        except Exception:  # noqa: BLE001 - linked all the same; sessions drain their own
            log.exception(
                "could not replay %s at start; each session replays its own spooled rows "
                "before its next write",
                spool.path,
            )
    return link


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
        queued = getattr(runner, "_queued_events", None) or {}
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
