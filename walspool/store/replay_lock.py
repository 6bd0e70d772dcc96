"""The spool's replay lock: replays, drains and operators' changes of rows take turns.

An exclusive ``flock`` on a private file beside the spool (``spool.db.replay-lock``);
the holder writes its pid into it, so whoever finds it held can say who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ReplayBusy, SpoolIOError
from . import files

if TYPE_CHECKING:
    from .spool import Spool

#: Beside the spool; an exclusive ``flock`` on it makes replays take turns.
LOCK_SUFFIX = files.REPLAY_LOCK_SUFFIX
#: Seconds a replay waits for another replay of the same spool before ``ReplayBusy``.
REPLAY_WAIT = 600.0


def replay_lock(spool: Spool, wait: bool | float = True) -> contextlib.AbstractContextManager[None]:
    """Hold ``spool``'s replay lock for the block: no replay, drain or change of rows
    out in flight runs meanwhile, in this process or another.

    ``wait``: True waits at most ``REPLAY_WAIT`` seconds, a number that many, False not
    at all; then ``ReplayBusy``.
    """
    return _exclusive(Path(f"{spool.path}{LOCK_SUFFIX}"), wait, owner=spool.owner)


@contextlib.contextmanager
def _exclusive(path: Path, wait: bool | float = True, owner: int | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (a private file beside the spool) for the
    block.

    flock locks belong to an open file description, so two replays in one process
    exclude each other too; the kernel drops the lock when the process dies.
    ``wait``: True waits at most ``REPLAY_WAIT`` seconds, a number that many, False
    not at all; then ``ReplayBusy``. ``owner``: the spool owner's uid (default: the
    owner of the spool's directory, checked as ``walspool.store.files`` does).
    """
    spool_path = Path(str(path)[: -len(LOCK_SUFFIX)])
    if owner is None:
        try:
            owner = files.trusted_directory(spool_path)
        except OSError as exc:
            raise SpoolIOError(f"cannot check {path.parent}: {exc}", path=path) from exc
    fd = files.open_private(path, owner, spool_path, "the replay lock")
    budget = REPLAY_WAIT if wait is True else float(wait or 0)
    held = False
    try:
        _lock_within(fd, budget, spool_path)
        held = True
        # Who holds it, for the message of whoever finds it held.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no stale pid for a later holder that writes none
        os.close(fd)


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote into the lock file, if it reads as one."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _lock_within(fd: int, seconds: float, spool_path: Path) -> None:
    deadline = time.monotonic() + seconds
    pause = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                waited = f" for {seconds:g} s" if seconds else ""
                pid = _holder(fd)
                then = (
                    f"when it ends (process {pid} holds it)"
                    if pid is not None
                    else "when it ends, or find the process holding it (`fuser` on the lock file)"
                )
                raise ReplayBusy(
                    f"another replay of {spool_path} is running (its lock "
                    f"{spool_path}{LOCK_SUFFIX} stayed held{waited}); try again {then}",
                    path=spool_path,
                    pid=pid,
                ) from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)
