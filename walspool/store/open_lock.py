"""The spool's open lock: ``<spool>.open-lock``, held shared by every open ``Spool``,
so a process that takes it exclusively knows it is the spool's only user (and may move
a damaged spool aside). The kernel drops it when the process dies."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from ..errors import SpoolIOError
from . import files

#: Seconds an opener waits for a process that is moving a damaged spool aside.
WAIT = 30.0


def hold(path: Path, owner: int) -> int:
    """Open ``<spool>.open-lock`` and hold it shared.

    Every open ``Spool`` holds it, so a process that gets it exclusively knows it is
    the spool's only user. Waits at most ``WAIT`` seconds for a process
    that is moving a damaged spool aside. The kernel drops it when the process dies.
    """
    lock_path = Path(f"{path}{files.OPEN_LOCK_SUFFIX}")
    fd = files.open_private(lock_path, owner, path, "the open lock")
    deadline = time.monotonic() + WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise SpoolIOError(
                    f"spool {path} stayed locked for {WAIT:g} s by a process "
                    f"moving it aside ({lock_path}); try again",
                    path=path,
                ) from None
            time.sleep(0.01)


def alone(fd: int) -> bool:
    """Turn our shared open lock exclusive if no other process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # A failed conversion may have dropped our shared lock: the caller raises.
        return False
    return True
