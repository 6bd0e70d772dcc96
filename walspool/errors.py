"""The errors walspool raises: one base class, one subclass per condition.

Every error carries the spool path and, where one is involved, the session it is
about, so a log line or a caller can say exactly what failed.
"""

from __future__ import annotations

import os
from typing import Any


class WalspoolError(Exception):
    """Base class of every error walspool raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        session_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = os.fspath(path) if path is not None else None
        self.session_id = session_id


class InvalidArgument(WalspoolError, ValueError):
    """A session id, reason or option that walspool cannot store as given."""


class PayloadTooLarge(WalspoolError):
    """One message encodes to more than the spool's ``max_payload_bytes``."""

    def __init__(
        self,
        size: int,
        limit: int,
        *,
        path: str,
        session_id: str | None,
        session_key: str | None = None,
    ) -> None:
        whose = (
            f"session {session_id!r}"
            if session_id is not None or session_key is None
            else f"session key {session_key!r}"
        )
        super().__init__(
            f"message for {whose} is {size} bytes as JSON, over the "
            f"spool's max_payload_bytes={limit}; raise the limit or trim the message",
            path=path,
            session_id=session_id,
        )
        self.size = size
        self.limit = limit


class SpoolFull(WalspoolError):
    """The spool has reached its ``max_bytes``; nothing stored was dropped."""

    def __init__(self, limit: int, *, path: str, session_id: str | None = None) -> None:
        super().__init__(
            f"spool {path} is full (max_bytes={limit}); replay it into state.db or raise max_bytes",
            path=path,
            session_id=session_id,
        )
        self.limit = limit


class DiskFull(WalspoolError):
    """The disk (or the process's file-size limit) has no room for the write."""


class SpoolIOError(WalspoolError):
    """The operating system reported an I/O error on the spool file."""


class NotASpool(WalspoolError):
    """The file exists but is not a walspool spool; it was left unchanged."""


class SchemaTooOld(NotASpool):
    """A spool of an older schema, refused by a read-only open (which cannot upgrade
    it); a write open (``walspool.Spool``) upgrades it."""

    def __init__(self, found: int, current: int, *, path: str | os.PathLike[str]) -> None:
        super().__init__(
            f"{path} has spool schema {found}; a read-only open cannot upgrade it to "
            f"{current}: a command that writes it (walspool replay, requeue, drop, vacuum, "
            "import-json), the gateway's next start or walspool.Spool(path) does",
            path=path,
        )
        self.found = found
        self.current = current


class SchemaTooNew(NotASpool):
    """The spool was written by a newer walspool; it was left unchanged."""

    def __init__(self, found: int, supported: int, *, path: str) -> None:
        super().__init__(
            f"{path} has spool schema version {found}, newer than this walspool "
            f"understands ({supported}); upgrade walspool to open it",
            path=path,
        )
        self.found = found
        self.supported = supported


class UntrustedSpool(WalspoolError):
    """The spool's directory or one of its files could be made or changed by someone
    other than the spool's owner; walspool does not use it."""


class SymlinkRefused(WalspoolError):
    """The spool path is a symbolic link, which walspool never follows."""


class SpoolClosed(WalspoolError):
    """The spool was closed; open a new ``Spool`` to append or read."""


class SpoolCorrupt(WalspoolError):
    """SQLite reports the spool as damaged."""


class SpoolReplaced(WalspoolError):
    """The spool's path no longer names the file this ``Spool`` opened."""


class ReplayBusy(WalspoolError):
    """Another replay of the spool is running and the caller asked not to wait for it.

    ``pid``: the process that holds the replay lock, as it wrote it into the lock
    file, or None if it could not be read.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str], pid: int | None) -> None:
        super().__init__(message, path=path)
        self.pid = pid


class UnsupportedGateway(WalspoolError):
    """The gateway object is not the hermes-agent release walspool links into."""


class SessionMissing(WalspoolError):
    """The target session has no row in state.db, so its messages cannot be written."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id} does not exist in state.db (FOREIGN KEY constraint "
            "failed); replay with create_missing=True to create it",
            session_id=session_id,
        )


class NotAMessage(WalspoolError):
    """A record holds something other than one transcript message (an agent history)."""

    def __init__(self, record: Any) -> None:
        super().__init__(
            f"record {record.id} (session {record.session_id}, seq {record.seq}) holds a list "
            "of messages, not one message; export it and recover it by hand",
            session_id=record.session_id,
        )
