"""The gateway link at shutdown: pending slots, /queue overflow, in-memory queues
(``link.flush``) and unflushed agent histories are spooled before the gateway clears
them (``walspool.hermes.install_runner`` hooks 0.19.0's runner); the next start
replays them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from ..store.records import AGENT_HISTORY, SHUTDOWN, Receipt, agent_history_message, slot_message
from ..store.spool import Spool
from ..store.writer import Row
from . import bounds
from .core import Core
from .flush import spool_queues
from .follow import Follow
from .state import Session, log
from .transcripts import Message, Transcripts


class Shutdown:
    """Spools what the gateway would lose at its stop: slots, queues, histories."""

    def __init__(self, core: Core, follow: Follow) -> None:
        self.core = core
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
        spooled = spool_in_order(self.core.spool, items, reason, partial(slot_lost, log))
        if spooled:
            log.info(
                "Spooled %d pending message(s) to %s (reason=%s)",
                spooled,
                self.core.spool.path,
                reason,
            )
        return spooled

    def flush_agent_history(self, session_id: str | None, history: list[Any]) -> bool:
        """Spool an agent's unpersisted history as one ``AGENT_HISTORY`` row
        (``preserve_agent_history``)."""
        return preserve_agent_history(log, lambda: self.core.spool, session_id, history)

    def flush_queues(self) -> int:
        """Spool every session's in-memory queue (``SHUTDOWN``), oldest first; empty it
        (``walspool.link.flush.spool_queues``; how many were spooled).

        For a shutdown while state.db refuses writes: what the released gateway loses
        with the process. The writes in flight when it begins are waited for, until
        the stop's deadline (``FLUSH_TIMEOUT`` from its first flush call: the stop waits
        for writes that long at most, whatever its number of calls); a session still
        being written then is left to that write: its whole queue stays, and is spooled
        in order once the write ends (``spool_if_stopping``: the failed message first,
        or what follows one that landed). Each call waits ``FLUSH_TIMEOUT`` at most for
        the spool's room and for the commit (``walspool.link.flush.spool_queues``). If
        the spool's path names another file now, the evictions in the old spool's
        writer come back first and a fresh spool takes them, then the queues
        (``Follow.before_flush``).
        """
        self.core.stopping = True
        deadline = self.core.timer() + bounds.FLUSH_TIMEOUT
        self.follow.before_flush(deadline)
        with self.core.lock:
            if self.core.stop_deadline is None:
                self.core.stop_deadline = deadline
            done = self.wait_for_writes(self.in_flight(), self.core.stop_deadline)
            said, self.core.said_write_outlasted = self.core.said_write_outlasted, not done
        if not done and not said:
            write_outlasted_stop(log)
        return spool_queues(self.core.spool, _LinkQueues(self.core), clock=self.core.timer)

    def in_flight(self) -> list[tuple[Session, Message]]:
        """The queued messages being written to state.db now, each with its session
        (lock held)."""
        return [
            (state, state.inflight)
            for state in self.core.sessions.values()
            if state.inflight is not None
        ]

    def wait_for_writes(self, writes: list[tuple[Session, Message]], deadline: float) -> bool:
        """Wait until none of ``writes`` (``in_flight``) is being written any more, and
        every write that failed since the stop's flush began has spooled what waited
        behind it (``spool_if_stopping``), or ``deadline`` (on ``Core.timer``); whether
        so. Lock held (released while waiting)."""
        while True:
            writing = next((s for s, message in writes if s.inflight is message), None)
            if writing is None and not self.core.stop_spools:
                return True
            left = deadline - self.core.timer()
            if left <= 0:
                return False
            if writing is None:
                self.core.settled.wait(left)  # ``spool_if_stopping`` notifies at its end
                continue
            with writing.waiting():  # its write's end notifies ``settled``
                self.core.settled.wait(left)

    def spool_if_stopping(self) -> None:
        """After a write that failed once the stop's flush had begun (counted in
        ``Core.stop_spools`` by the writer): spool what is queued now (the message that
        was being written then among it), since no later flush comes, within
        ``FLUSH_TIMEOUT`` of now (the write may end past the stop's own deadline)."""
        try:
            self.follow.before_flush(self.core.timer() + bounds.FLUSH_TIMEOUT)
            queues = _LinkQueues(self.core)
            never_raise(spool_queues, self.core.spool, queues, clock=self.core.timer)
        finally:
            with self.core.lock:
                self.core.stop_spools -= 1
                self.core.settled.notify_all()


#: A slot to spool: its session id (None: resolved at replay), its message, its key.
Slot = tuple[str | None, Any, str]


def spool_in_order(
    spool: Spool, items: Sequence[Slot], reason: str, lost: Callable[[Slot, Exception], None]
) -> int:
    """Spool ``items`` in order in one transaction; if the spool refuses that, one by
    one, so a slot it refuses (a payload past its limit, an empty key) loses only
    itself, ``lost(item, error)`` told of it. How many were spooled. What the gateways'
    stops share: the 0.19.0 link's and the drop-in's."""
    try:
        spool.append_many(list(items), reason=reason)
        return len(items)
    except Exception:  # noqa: BLE001 - one by one: each slot stands on its own
        pass
    spooled = 0
    for item in items:
        session_id, message, key = item
        try:
            spool.append(session_id, message, reason=reason, session_key=key)
        except Exception as exc:  # noqa: BLE001 - the rest are spooled all the same
            lost(item, exc)
        else:
            spooled += 1
    return spooled


def spool_agent_history(spool: Spool, session_id: str | None, history: list[Any]) -> bool:
    """Spool an agent's unpersisted history as its one ``AGENT_HISTORY`` row (under
    ``unknown`` when it has no session), never replayed unless asked for; False when
    there is none. Raises what the spool raises."""
    if not history:
        return False
    spool.append(
        session_id or "unknown", agent_history_message(session_id, history), reason=AGENT_HISTORY
    )
    return True


def write_outlasted_stop(logger: logging.Logger) -> None:
    """Say on ``logger`` (the adapter's) that a stop gave up waiting for a transcript
    write in flight, in every gateway's words."""
    logger.warning(
        "a transcript message was still being written to state.db after %g s at shutdown; "
        "what waits behind that write is spooled, in order, once it ends",
        bounds.FLUSH_TIMEOUT,
    )


def slot_lost(logger: logging.Logger, item: Slot, exc: Exception) -> None:
    """Say on ``logger`` (the adapter's) that a stop's slot is lost (the spool refused
    it), in every gateway's words."""
    logger.error(
        "walspool could not spool a pending message for %r at shutdown; it is lost: %s",
        item[2],
        exc,
    )


def preserve_agent_history(
    logger: logging.Logger,
    spool: Callable[[], Spool],
    session_id: str | None,
    history: list[Any],
) -> bool:
    """Spool an agent's unpersisted history (``spool_agent_history``) and say so, or say
    that it is lost, in every gateway's words; whether it was spooled. Never raises:
    the gateway is stopping."""
    if not history:
        return False
    try:
        target = spool()
        spool_agent_history(target, session_id, history)
    except Exception as exc:  # noqa: BLE001 - shutdown must go on
        logger.error(
            "walspool could not keep the %d in-memory message(s) of session %s at shutdown; "
            "they are lost: %s",
            len(history),
            session_id,
            exc,
        )
        return False
    logger.warning(
        "Preserved %d in-memory message(s) for session %s in %s (state.db did not take "
        "them); recover by hand after repairing state.db",
        len(history),
        session_id,
        target.path,
    )
    return True


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


class _LinkQueues:
    """The link's side of the stop's flush (``walspool.link.flush.Queues``): what a
    session's state says, and what it counts, of its queue going to the spool."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.transcripts = core.transcripts

    def writing(self, session_id: str, pending: list[Message]) -> bool:
        state = self.core.sessions.get(session_id)
        return state is not None and pending[0] is state.inflight

    def taken(self, session_id: str, rows: Sequence[Row]) -> object:
        for row in rows:
            self.core.shares.accepted(session_id, row.size)
        state = self.core.session(session_id)
        state.evicted()  # its spooled rows drain before its queue
        self.core.handoffs.handed(session_id)
        self.core.settled.notify_all()  # the queues changed: for whoever waits on them
        return state.generation

    def rewritten(self, session_id: str, token: object) -> bool:
        # Its pending hand-off keeps the session there.
        return self.core.sessions[session_id].generation != token

    def settled(self, session_id: str, rows: Sequence[Row], receipts: list[Receipt] | None) -> None:
        for i, row in enumerate(rows):
            committed = None if receipts is None else receipts[i].id
            self.core.shares.settled(session_id, row.size, committed)
        state = self.core.sessions[session_id]  # its pending hand-off keeps it there
        self.core.handoffs.settled(session_id)
        if state.writer is None and self.core.has_work(session_id, state):
            self.core.due_again(session_id, state)
        self.core.settled.notify_all()
