"""A spool opened for reading that creates no file beside it. Not public API.

A ``mode=ro`` open of a WAL database whose ``-wal`` is gone (a spool closed
cleanly) creates a ``-wal`` and a ``-shm`` beside it, and fails in a directory this
user cannot write ("attempt to write a readonly database"). Such a spool's database
file holds every row, so it is read with ``immutable=1``, which opens nothing else
(https://www.sqlite.org/wal.html#readonly). Immutable means SQLite takes no lock and
trusts the file not to change, so while it is open this module holds a shared lock
on the file's SQLite SHARED byte range itself, as a reader would: a writer that
opens meanwhile cannot finish closing (that needs the exclusive lock) and so cannot
remove its ``-wal``; and a writer only ever changes the database file by
checkpointing from a ``-wal``. Each read is therefore checked afterwards: if a
``-wal`` exists by then, the read may have seen a checkpoint half done, so the
spool is reopened ``mode=ro`` (using the writer's ``-wal`` and ``-shm``) and the
read done again.

The lock is an open-file-description lock, taken only when there is no ``-wal``:
then no SQLite connection of this process has the spool open, so closing the lock's
descriptor cannot drop a POSIX lock SQLite holds (the classic fcntl pitfall).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import apsw

from ..errors import NotASpool
from ..store import files, schema
from ..store.directories import open_directory
from ..store.schema import open_reader

T = TypeVar("T")

#: SQLite's SHARED lock range on a database file (os_unix.c: PENDING_BYTE + 2, 510 bytes).
SHARED_FIRST = 0x40000000 + 2
SHARED_SIZE = 510
#: ``struct flock`` on Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
FLOCK = "hhqqi4x"


class SpoolReader:
    """The spool at ``path`` open for reading; ``read(fn)`` runs ``fn(conn)``.

    Raises what ``open_reader`` raises (``apsw.Error``, ``NotASpool``, ...).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock: int | None = None
        self.conn = self._open()

    @property
    def immutable(self) -> bool:
        return self.lock is not None

    def read(self, fn: Callable[[apsw.Connection], T]) -> T:
        """``fn(conn)``, done again on a ``mode=ro`` connection if a writer came meanwhile."""
        result = fn(self.conn)
        if self.immutable and _has_wal(self.path):
            self._reopen()
            result = fn(self.conn)
        return result

    def close(self) -> None:
        schema.close_quietly(self.conn)
        self._unlock()

    def _open(self) -> apsw.Connection:
        # Before SQLite opens anything: a FIFO or a stranger's file is refused here.
        files.check_for_reading(self.path)
        if not _has_wal(self.path):
            self.lock = _lock_shared(self.path)
            if self.lock is not None and not _has_wal(self.path):
                try:
                    conn = _open_immutable(self.path)
                except BaseException:
                    self._unlock()
                    raise
                if not _has_wal(self.path):
                    return conn
                schema.close_quietly(conn)
            self._unlock()
        return open_reader(self.path)

    def _reopen(self) -> None:
        schema.close_quietly(self.conn)
        # Unlocked first: from here this process holds SQLite's own locks on the file.
        self._unlock()
        self.conn = open_reader(self.path)

    def _unlock(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def _has_wal(path: Path) -> bool:
    return os.path.lexists(f"{path}-wal")


def _lock_shared(path: Path) -> int | None:
    """A descriptor of ``path`` holding a shared lock on SQLite's SHARED range, or
    None when it cannot be had now (a writer is closing the spool) or here.

    Opened below the checked directory with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
    swapped in never hangs the open) and refused unless it is a regular file."""
    if not hasattr(fcntl, "F_OFD_SETLK"):
        return None
    with open_directory(path.parent, path) as directory:
        fd = directory.open(path.name, os.O_RDONLY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotASpool(f"{path} is not a regular file, so not a spool", path=path)
        lock = struct.pack(FLOCK, fcntl.F_RDLCK, os.SEEK_SET, SHARED_FIRST, SHARED_SIZE, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EINVAL):
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_immutable(path: Path) -> apsw.Connection:
    """``open_reader``'s checks on an ``immutable=1`` connection."""
    owner = files.check_for_reading(path)
    files.refuse_non_sqlite(path)
    conn = None
    try:
        conn = schema.connect(path, owner, apsw.SQLITE_OPEN_READONLY, "mode=ro&immutable=1")
        schema.verify_read_only(conn, path)
    except apsw.Error as exc:
        schema.close_quietly(conn)
        refused = schema.refused_open(path)  # a file swapped in after the check
        if refused is not None:
            raise refused from exc
        if schema.over_budget(exc):
            raise schema.SchemaOverBudget(path, exc) from exc
        raise
    except BaseException:
        schema.close_quietly(conn)
        raise
    return conn
