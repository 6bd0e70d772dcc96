"""A second process that holds a spool's write lock until told to let go.

As a script (``python _hermes_lock_holder.py SPOOL_PATH``) it opens the spool with
apsw, takes the write lock with ``BEGIN IMMEDIATE`` (as an operator's ``sqlite3
spool.db`` shell in a transaction would), prints ``locked``, waits for a line on
stdin, rolls back, prints ``released`` and exits. Tests use ``write_lock_held``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

#: Bound on every wait for the child (start, lock, release, exit).
CHILD_TIMEOUT = 60.0


def main(path: str) -> None:
    import apsw

    conn = apsw.Connection(path)
    conn.execute("BEGIN IMMEDIATE")
    print("locked", flush=True)
    sys.stdin.readline()
    conn.execute("ROLLBACK")
    conn.close()
    print("released", flush=True)


class LockHolder:
    """The running child; ``release()`` ends its transaction and waits for its exit."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def release(self) -> None:
        if self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "released\n"
        self.proc.wait(CHILD_TIMEOUT)


@contextlib.contextmanager
def write_lock_held(spool_path: Path) -> Iterator[LockHolder]:
    """Hold ``spool_path``'s write lock in another process for the block."""
    proc = subprocess.Popen(
        [sys.executable, __file__, str(spool_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    # A child that hangs fails the test instead of hanging the run.
    killer = threading.Timer(CHILD_TIMEOUT * 2, proc.kill)
    killer.start()
    holder = LockHolder(proc)
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
