"""hermes-agent's ``gateway.session.SessionStore`` mapped onto ``Transcripts``
(``walspool.link.transcripts``). The queue, its lock, its cap and state.db carry the
same names in 0.19.0, 0.20 (axisrow) and 0.22 (iot); the write and its FTS repair are
0.19.0's (the link runs there; the others write with their own loop). ``StoreQueues``
is a 0.20 or 0.22 store's side of a stop's flush of its queues; ``retry_session`` the
next write of such a store's session, with no new message.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..link.transcripts import Message
from ..replay.sinks import write_bindable
from ..store.records import Receipt
from ..store.writer import Row


class StoreTranscripts:
    """One ``SessionStore``, as ``Transcripts``."""

    __slots__ = ("store",)

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def lock(self) -> threading.Lock:
        lock: threading.Lock = self.store._transcript_retry_lock
        return lock

    @property
    def cap(self) -> int:
        return int(self.store._MAX_PENDING_PER_SESSION)

    @property
    def queues(self) -> dict[str, list[Message]]:
        queues: dict[str, list[Message]] = self.store._dirty_transcripts
        return queues

    @property
    def db(self) -> Any:
        return self.store._db

    def resolve(self, session_key: str) -> str | None:
        session_id: str | None = self.store.peek_session_id(session_key)
        return session_id

    def count_failure(self, session_id: str) -> int:
        failures = self.store._transcript_append_failures
        failures[session_id] = count = failures.get(session_id, 0) + 1
        return int(count)

    def failures(self, session_id: str) -> int:
        """The session's failed writes in a row, as the gateway counts them (lock held)."""
        return int(self.store._transcript_append_failures.get(session_id, 0))

    def forget_failures(self, session_id: str) -> None:
        self.store._transcript_append_failures.pop(session_id, None)

    def write(self, session_id: str, message: Message) -> Exception | None:
        store = self.store
        try:
            write_bindable(store._append_transcript_message, session_id, message)
            return None
        except Exception as exc:  # noqa: BLE001 - the store's own policy: retry later
            if not (store._is_fts_corruption_error(exc) and store._rebuild_fts_once()):
                return exc
        try:
            write_bindable(store._append_transcript_message, session_id, message)
            return None
        except Exception as exc:  # noqa: BLE001
            return exc


def drain_lock(store: Any) -> Any:
    """The lock every transcript write of a 0.20 or 0.22 store holds (its
    ``append_to_transcript``, its rewrites on 0.22): 0.22 makes it at first use."""
    made_on_use = getattr(store, "_get_transcript_drain_lock", None)
    return made_on_use() if callable(made_on_use) else store._transcript_drain_lock


def retry_session(store: Any, session_id: str) -> None:
    """Write a 0.20 or 0.22 store's session as its next ``append_to_transcript`` would,
    with no new message: its spooled rows (the store's own ``_drain_spooled_drops``,
    through walspool's drain), then its queued messages, oldest first, each taken off
    the queue once written (as the store does). Under the store's drain lock, so no
    live write of any session runs meanwhile. Stops at the first failure, for the
    store's next write to try again (it repairs and counts; this does neither)."""
    transcripts = StoreTranscripts(store)
    with drain_lock(store):
        store._drain_spooled_drops(session_id)
        with transcripts.lock:
            if session_id in (getattr(store, "_spooled_drop_sessions", None) or ()):
                return  # rows stay spooled: the queue waits behind them
        while True:
            with transcripts.lock:
                pending = transcripts.queues.get(session_id)
                if not pending:
                    return
                message = pending[0]
            # 0.20's live write drains first (``walspool.gateways.axisrow``): unmarked rows of an
            # earlier run are drained here, and what remains refuses the write.
            if transcripts.write(session_id, message) is not None:
                return
            with transcripts.lock:
                if pending and pending[0] is message:
                    pending.pop(0)
                if not pending and transcripts.queues.get(session_id) is pending:
                    del transcripts.queues[session_id]
                    transcripts.forget_failures(session_id)


class StoreQueues:
    """A 0.20 or 0.22 store's side of a stop's flush (``walspool.link.flush.Queues``),
    for a caller that holds the store's transcript drain lock meanwhile: no head is
    being written then, and only a rewrite (/retry, /undo, /compress) replaces a
    session's queue list, so the list taken is the token."""

    __slots__ = ("transcripts",)

    def __init__(self, store: Any) -> None:
        self.transcripts = StoreTranscripts(store)

    def writing(self, session_id: str, pending: list[Message]) -> bool:
        return False

    def taken(self, session_id: str, rows: Sequence[Row]) -> object:
        return self.transcripts.queues.get(session_id)

    def rewritten(self, session_id: str, token: object) -> bool:
        return self.transcripts.queues.get(session_id) is not token

    def settled(self, session_id: str, rows: Sequence[Row], receipts: list[Receipt] | None) -> None:
        return None
