"""A second process that holds a spool's replay lock, as a running ``walspool replay`` does.

As a script (``python _hermes_replay_lock.py SPOOL_PATH``) it takes the exclusive
``flock`` on ``SPOOL_PATH.replay-lock``, prints ``locked``, waits for a line on stdin,
and exits (the kernel drops the lock). Tests use ``replay_lock_held``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

#: Bound on every wait for the child.
CHILD_TIMEOUT = 60.0


def main(path: str) -> None:
    fd = os.open(f"{path}.replay-lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.readline()
    os.close(fd)


class ReplayLockHolder:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def release(self) -> None:
        """Let go of the lock and wait for the child's exit."""
        if self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.proc.wait(CHILD_TIMEOUT)


@contextlib.contextmanager
def replay_lock_held(spool_path: Path) -> Iterator[ReplayLockHolder]:
    """Hold ``spool_path``'s replay lock in another process for the block."""
    proc = subprocess.Popen(
        [sys.executable, __file__, str(spool_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    killer = threading.Timer(CHILD_TIMEOUT * 2, proc.kill)  # a hung child fails the test
    killer.start()
    holder = ReplayLockHolder(proc)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "locked\n"
        yield holder
        holder.release()
    finally:
        killer.cancel()
        proc.kill()
        proc.wait(CHILD_TIMEOUT)


if __name__ == "__main__":
    main(sys.argv[1])
