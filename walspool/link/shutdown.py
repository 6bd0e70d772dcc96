"""The gateway link at shutdown: pending slots, /queue overflow, in-memory queues and
unflushed agent histories are spooled before the gateway clears them
(``install_runner``); the next start replays them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ..errors import WalspoolError
from ..store.records import AGENT_HISTORY, SHUTDOWN, agent_history_message, slot_message
from ..store.writer import Request
from . import bounds
from .core import Core, Note
from .follow import Follow
from .lines import Lines
from .state import log
from .transcripts import Transcripts


class Shutdown:
    """Spools what the gateway would lose at its stop: slots, queues, histories."""

    def __init__(self, core: Core, lines: Lines, follow: Follow) -> None:
        self.core = core
        self.lines = lines
        self.follow = follow

    def flush_pending(self, pending: Mapping[str, Any], *, reason: str = SHUTDOWN) -> int:
        """Spool pending slots (session key -> text or MessageEvent); return how many."""
        return self.flush_slots(list(pending.items()), reason=reason)

    def flush_slots(self, slots: list[tuple[str, Any]], *, reason: str = SHUTDOWN) -> int:
        """Spool ``(session_key, text or event)`` pairs in order, in one transaction.

        The store's queues are spooled first (``flush_queues``): a session's queued
        turns go before the slots that arrived after them. The session id is resolved
        now, through the store, while the gateway still knows it; the key is kept too.
        Values that are None are skipped.
        """
        never_raise(self.flush_queues)
        items = [
            (_resolve(self.core.transcripts, key), slot_message(value), key)
            for key, value in slots
            if value is not None
        ]
        if not items:
            return 0
        self.core.spool.append_many(items, reason=reason)
        log.info(
            "Spooled %d pending message(s) to %s (reason=%s)",
            len(items),
            self.core.spool.path,
            reason,
        )
        return len(items)

    def flush_agent_history(self, session_id: str | None, history: list[Any]) -> bool:
        """Spool an agent's unpersisted history as one ``AGENT_HISTORY`` row."""
        if not history:
            return False
        self.core.spool.append(
            session_id or "unknown",
            agent_history_message(session_id, history),
            reason=AGENT_HISTORY,
        )
        log.warning(
            "Preserved %d in-memory message(s) for session %s in %s (state.db did not take "
            "them); recover by hand after repairing state.db",
            len(history),
            session_id,
            self.core.spool.path,
        )
        return True

    def flush_queues(self) -> int:
        """Spool every session's in-memory queue (``SHUTDOWN``), oldest first; empty it.

        For a shutdown while state.db refuses writes: what the released gateway loses
        with the process. A session whose oldest message is being written right now is
        left to that write: its whole queue stays, and is spooled in order once the
        write ends (``spool_if_stopping``: the failed message first, or what follows
        one that landed). Returns how many were spooled. Waits at most
        ``bounds.FLUSH_TIMEOUT`` for room in the spool and for the commit; on a spool
        error the messages go back to the front of their queues, and a message the
        spool cannot take at all stays queued (both logged at ERROR).
        """
        deadline = self.core.clock() + bounds.FLUSH_TIMEOUT
        committed = threading.Event()
        #: The spool's request, once committed or failed (``_flushed`` adds it).
        requests: list[Request] = []
        self.core.stopping = True
        self.follow.before_flush(deadline)
        while True:
            with self.core.lock:
                taken, rows, notes = self._queued_rows()
                if not rows:
                    self.core.run(notes)
                    return 0
                # Filled below; ``_flushed`` reads it under the lock held here.
                generations: dict[str, int] = {}
                try:
                    # A replaced spool is refused before the queue is touched.
                    self.core.spool.check_path()
                    # Under the lock, so no message of these sessions is queued, evicted
                    # or written meanwhile: the spool gets them in arrival order.
                    self.core.spool.put_nowait(
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
                    for row in rows:
                        self.core.shares.accepted(row.session_id, row.size)
                    for session_id, messages in taken.items():
                        ids = {id(m) for m in messages}
                        pending = self.core.transcripts.queues[session_id]
                        pending[:] = [m for m in pending if id(m) not in ids]
                        state = self.core.session(session_id)
                        state.evicted()
                        generations[session_id] = state.generation
                    self.core.settled.notify_all()  # the queues changed: for whoever waits on them
                    break
            if self.core.clock() >= deadline:
                log.error(
                    "could not spool %d queued transcript message(s) at shutdown: the spool "
                    "%s had no room for them within %g s",
                    len(rows),
                    self.core.spool.path,
                    bounds.FLUSH_TIMEOUT,
                )
                return 0
            self.core.spool.wait_for_room(max(deadline - self.core.clock(), 0.0))
        self.core.run(notes)
        if refused is not None:
            log.error(
                "could not spool %d queued transcript message(s) at shutdown; they stay queued: %s",
                len(rows),
                refused,
            )
            return 0
        if not committed.wait(max(deadline - self.core.clock(), 0.0) + bounds.CONFIRM_WAIT):
            log.error(
                "%d queued transcript message(s) were handed to %s at shutdown but not "
                "committed within %g s; they are spooled if the spool commits them later",
                len(rows),
                self.core.spool.path,
                bounds.FLUSH_TIMEOUT,
            )
            return 0
        (request,) = requests
        if request.error is not None:
            log.error(
                "could not spool %d queued transcript message(s) at shutdown to %s; they "
                "stay queued: %s",
                len(rows),
                self.core.spool.path,
                request.error,
            )
            return 0
        log.warning(
            "Spooled %d queued transcript message(s) to %s at shutdown",
            len(rows),
            self.core.spool.path,
        )
        return len(rows)

    def spool_if_stopping(self) -> None:
        """After a failed write: once the shutdown has flushed the queues, spool what
        is queued now (the message that was being written then among it), since no
        later flush comes."""
        if self.core.stopping:
            never_raise(self.flush_queues)

    def _flushed(
        self,
        taken: dict[str, list[dict[str, Any]]],
        generations: dict[str, int],
        committed: threading.Event,
        requests: list[Request],
        request: Request,
    ) -> None:
        """On the spool's writer: a shutdown flush committed (or failed)."""
        receipts = request.result if request.error is None else None
        with self.core.lock:
            for i, row in enumerate(request.rows):
                self.core.shares.settled(
                    row.session_id, row.size, None if receipts is None else receipts[i].id
                )
            for session_id, messages in taken.items():
                state = self.core.sessions[session_id]  # ``unconfirmed`` keeps it there
                state.settled()
                if request.error is not None and state.generation == generations[session_id]:
                    # Not in the spool: back to the front of their queue, so they stay
                    # with the process as in the released store; unless the transcript
                    # was rewritten meanwhile, which dropped the queue they were in.
                    self.core.transcripts.queues.setdefault(session_id, [])[0:0] = messages
                if state.writer is None and self.core.has_work(session_id, state):
                    self.core.schedule(state.retry_at)
            self.core.settled.notify_all()
        requests.append(request)
        committed.set()

    def _queued_rows(
        self,
    ) -> tuple[dict[str, list[dict[str, Any]]], list[Any], list[Note]]:
        """Every queue's messages, as spool rows, but the queues of sessions whose
        oldest message is being written (left to that write); lock held."""
        taken: dict[str, list[dict[str, Any]]] = {}
        rows: list[Any] = []
        notes: list[Note] = []
        for session_id, pending in self.core.transcripts.queues.items():
            state = self.core.sessions.get(session_id)
            if state is not None and pending and pending[0] is state.inflight:
                notes.append(partial(_say_writing, session_id))
                continue
            for message in pending:
                try:
                    rows.append(self.core.spool.prepare(session_id, message, SHUTDOWN))
                except Exception as exc:  # noqa: BLE001 - the others are spooled all the same
                    notes.append(partial(self.lines.report_unspoolable, session_id, exc))
                    continue
                taken.setdefault(session_id, []).append(message)
        return taken, rows, notes


def _say_writing(session_id: str) -> None:
    log.warning(
        "A gateway thread is writing the oldest queued message of %s at shutdown; the "
        "session's queue is left to that write, and spooled, in order, once it ends",
        session_id,
    )


def never_raise(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Shutdown must go on: log a spool failure at ERROR instead of raising it."""
    try:
        return fn(*args, **kw)
    except Exception:  # noqa: BLE001
        log.exception("walspool could not spool at shutdown; these messages are lost")
        return None


def _resolve(transcripts: Transcripts, session_key: str) -> str | None:
    try:
        return transcripts.resolve(session_key)
    except Exception:  # noqa: BLE001 - an unknown key is resolved again at replay
        return None
