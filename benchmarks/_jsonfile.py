"""The design walspool replaces: one JSON file per payload, written atomically.

For each message: write a temp file in the spool directory, fsync it, rename it to
``pending-<uuid>.json``, fsync the directory. That is the textbook way to make one
file durable (https://lwn.net/Articles/457667/), so each message costs two fsyncs
and four metadata operations (create, rename, and the directory entry updates).

The class has walspool's call shapes so the benchmarks can drive both the same way.
It is a baseline to measure against, not a supported spool: it keeps no per-session
order and has no replay.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class JsonFileSpool:
    """Spool each message as ``<dir>/pending-<uuid>.json``, durably, one at a time."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Opened once and shared by every thread: fsync on one directory fd is
        # thread-safe, and reopening it per message would only make the baseline slower.
        self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)

    def append(self, session_id: str, message: Any, *, reason: str = "transcript_cap_drop") -> str:
        """Write one message durably; return its file name once it is on disk."""
        data = json.dumps(
            {
                "session_id": session_id,
                "reason": reason,
                "created_at": time.time(),
                "message": message,
            },
            ensure_ascii=False,
        ).encode("utf-8")
        name = f"pending-{uuid.uuid4().hex}.json"
        tmp = self.directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.directory / name)
        os.fsync(self._dir_fd)
        return name

    def append_many(
        self, items: Iterable[tuple[str, Any]], *, reason: str = "transcript_cap_drop"
    ) -> list[str]:
        """The batch shape: a plain loop, one durable file per item."""
        return [self.append(session_id, message, reason=reason) for session_id, message in items]

    async def append_async(
        self, session_id: str, message: Any, *, reason: str = "transcript_cap_drop"
    ) -> str:
        """``append`` off the event loop, on the loop's default executor."""
        return await asyncio.to_thread(self.append, session_id, message, reason=reason)

    def close(self) -> None:
        os.close(self._dir_fd)

    def __enter__(self) -> JsonFileSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
