"""What the link needs of a gateway's transcript store, named for what it is: its lock,
its per-session queues, its failure counts, one write, and its state.db. An adapter maps
its gateway's store onto this (``walspool.gateways.session_store`` for hermes-agent's
``SessionStore``); nothing under ``walspool.link`` names a gateway's attributes.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

#: A queued transcript message, as the gateway queued it.
Message = dict[str, Any]


class Transcripts(Protocol):
    """A gateway's transcript store, as the link and the memory publisher use it."""

    #: The store's one lock over every session's queue (the link's too).
    lock: threading.Lock
    #: The store's cap on a session's queue (past it the released gateway drops).
    cap: int
    #: Session id -> its queued messages, oldest first; guarded by ``lock``. The
    #: gateway's own mapping: what is in it is what a kill of the process loses.
    queues: dict[str, list[Message]]

    @property
    def db(self) -> Any:
        """The store's state.db handle (``hermes_state.SessionDB``); falsy once the
        store has none (closed, or never opened)."""

    def resolve(self, session_key: str) -> str | None:
        """The session id a routing key names now, as the gateway resolves it."""

    def count_failure(self, session_id: str) -> int:
        """Count a failed write or drain of the session where the gateway counts its
        own (lock held); the count in a row."""

    def forget_failures(self, session_id: str) -> None:
        """The session writes again (or was rewritten): its failure count goes (lock held)."""

    def write(self, session_id: str, message: Message) -> Exception | None:
        """Write one queued message to state.db as the gateway writes it (its own
        repairs included); the error if it failed. Not under ``lock``."""
