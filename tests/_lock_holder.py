"""A second process that holds one of a spool's locks until told to let go.

As a script (``python _lock_holder.py write|replay PATH``) it takes the lock, prints
``locked``, waits for a line on stdin, lets go, prints ``released`` and exits:

* ``write``: PATH's SQLite write lock, with apsw ``BEGIN IMMEDIATE`` (as an
  operator's ``sqlite3 spool.db`` shell in a transaction, or another writer of a
  ``state.db``, would hold it);
* ``exclusive``: PATH's SQLite lock with ``BEGIN EXCLUSIVE`` (in rollback-journal
  mode, as 0.20's state.db, readers wait too; in WAL mode, writers only);
* ``replay``: the exclusive ``flock`` on ``PATH.replay-lock``, as a running
  ``walspool replay`` holds it (with its pid written in the file, as walspool does;
  ``replay-anonymous``: without, as a process that is not walspool might);
* ``read``: a read transaction on PATH (an operator's ``sqlite3 -readonly`` shell in
  the middle of a long query): the snapshot it holds stops checkpoints from
  resetting the ``-wal`` file, which grows meanwhile.

Tests use ``write_lock_held``, ``replay_lock_held`` and ``read_snapshot_held``.
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

#: Bound on every wait for the child (start, lock, release, exit).
CHILD_TIMEOUT = 60.0


def main(kind: str, path: str) -> None:
    if kind in ("write", "exclusive"):
        import apsw

        conn = apsw.Connection(path)
        conn.set_busy_timeout(int(CHILD_TIMEOUT * 1000))
        conn.execute("BEGIN IMMEDIATE" if kind == "write" else "BEGIN EXCLUSIVE")
        release = lambda: (conn.execute("ROLLBACK"), conn.close())  # noqa: E731
    elif kind == "read":
        import apsw

        conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        conn.execute("BEGIN")
        assert conn.execute("SELECT count(*) FROM records").get is not None
        release = lambda: (conn.execute("ROLLBACK"), conn.close())  # noqa: E731
    else:
        fd = os.open(f"{path}.replay-lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        if kind == "replay":
            os.write(fd, f"{os.getpid()}\n".encode())
        release = lambda: os.close(fd)  # noqa: E731
    print("locked", flush=True)
    sys.stdin.readline()
    release()
    print("released", flush=True)


class LockHolder:
    """The running child; ``release()`` lets go of the lock and waits for its exit."""

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
def _held(kind: str, path: Path) -> Iterator[LockHolder]:
    proc = subprocess.Popen(
        [sys.executable, __file__, kind, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
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


def write_lock_held(path: Path) -> contextlib.AbstractContextManager[LockHolder]:
    """Hold ``path``'s SQLite write lock in another process for the block."""
    return _held("write", path)


def replay_lock_held(
    spool_path: Path, *, anonymous: bool = False
) -> contextlib.AbstractContextManager[LockHolder]:
    """Hold ``spool_path``'s replay lock in another process for the block (its pid
    written in the lock file, as walspool's replay does, unless ``anonymous``)."""
    return _held("replay-anonymous" if anonymous else "replay", spool_path)


def read_snapshot_held(path: Path) -> contextlib.AbstractContextManager[LockHolder]:
    """Hold a read transaction (a snapshot) on the spool at ``path`` in another process."""
    return _held("read", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
