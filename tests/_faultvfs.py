"""An ``apsw.VFS`` shim that fails the Nth file operation of one kind (fault tests).

Every file SQLite opens through the shim (database, WAL, journals) forwards to the
real VFS underneath, and each call of ``xRead``, ``xWrite``, ``xSync``, ``xLock``,
``xUnlock``, ``xTruncate`` or ``xFileSize`` is counted per kind, across all files
and threads. While armed with a ``Fault(kind, n, error)``, the ``n``-th operation of
``kind`` raises instead of running:

* ``"eio"``: ``apsw.IOError`` with the matching ``SQLITE_IOERR_*`` extended code,
  what the unix VFS returns when the kernel says EIO;
* ``"enospc"``: ``apsw.FullError`` (SQLITE_FULL), what it returns on ENOSPC;
* ``"busy"``: ``apsw.BusyError`` (SQLITE_BUSY), a lock held by someone else.

Not covered: the WAL index (``-shm``), which apsw maps in C below the Python
layer, so its locks and maps cannot be failed from here.

``opened`` lists ``(path, mode)`` for every file the shim opened, the mode read just
after the real VFS opened (and maybe created) it: what the file system showed other
users at that moment.

Use ``installed(vfs)`` to make the shim SQLite's default VFS for a block, so code
that opens ``apsw.Connection(path)`` without a ``vfs=`` argument goes through it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import apsw

KINDS = ("read", "write", "sync", "lock", "unlock", "truncate", "filesize")
ERRORS = ("eio", "enospc", "busy")

_EIO_CODES = {
    "read": apsw.SQLITE_IOERR_READ,
    "write": apsw.SQLITE_IOERR_WRITE,
    "sync": apsw.SQLITE_IOERR_FSYNC,
    "lock": apsw.SQLITE_IOERR_LOCK,
    "unlock": apsw.SQLITE_IOERR_UNLOCK,
    "truncate": apsw.SQLITE_IOERR_TRUNCATE,
    "filesize": apsw.SQLITE_IOERR_FSTAT,
}
_names = itertools.count()


class Fault(NamedTuple):
    """Fail the ``n``-th (1-based) operation of ``kind`` with ``error``."""

    kind: str
    n: int
    error: str


def make_error(fault: Fault) -> apsw.Error:
    """The exception the shim raises for ``fault``; apsw turns it into a result code."""
    text = f"injected {fault.error} on {fault.kind} #{fault.n}"
    if fault.error == "eio":
        exc: apsw.Error = apsw.IOError(text)
        exc.extendedresult = _EIO_CODES[fault.kind]
    elif fault.error == "enospc":
        exc = apsw.FullError(text)
    elif fault.error == "busy":
        exc = apsw.BusyError(text)
    else:
        raise ValueError(f"unknown error {fault.error!r}")
    return exc


class FaultVFS(apsw.VFS):
    """Counts file operations per kind and fails the one ``arm`` chose.

    ``base`` must name a real VFS (not ``""``): once the shim is the default VFS,
    ``""`` would resolve to the shim itself.
    """

    def __init__(self, name: str | None = None, base: str = "unix") -> None:
        self.vfs_name = name or f"walspool-faults-{next(_names)}"
        self.base_name = base
        self.counts: Counter[str] = Counter()
        self.fault: Fault | None = None
        self.every = False
        self.counting = False
        self.injected: list[Fault] = []
        self.opened: list[tuple[str, int]] = []
        #: What ``xGetLastError`` reports, the errno SQLite keeps for a failed write
        #: (``Connection.system_errno``); None: the real VFS's own.
        self.last_errno: int | None = None
        self._lock = threading.Lock()
        super().__init__(self.vfs_name, base)

    def arm(self, fault: Fault | None = None, *, every: bool = False) -> None:
        """Reset the counts and start counting; fail ``fault`` when it comes (with
        ``every``: that operation and every later one of its kind, until ``disarm``)."""
        with self._lock:
            self.counts = Counter()
            self.fault = fault
            self.every = every
            self.counting = True

    def disarm(self) -> None:
        """Stop counting and failing; the counts stay readable."""
        with self._lock:
            self.fault = None
            self.counting = False

    @property
    def fired(self) -> bool:
        """Did the armed fault happen (is the n-th operation of its kind past)?"""
        f = self.fault
        return f is not None and self.counts[f.kind] >= f.n

    def tick(self, kind: str) -> None:
        with self._lock:
            if not self.counting:
                return
            self.counts[kind] += 1
            fault = self.fault
            if fault is None or fault.kind != kind or self.counts[kind] < fault.n:
                return
            if self.counts[kind] > fault.n and not self.every:
                return
            self.injected.append(fault)
        raise make_error(fault)

    def xOpen(self, name: str | apsw.URIFilename | None, flags: list[int]) -> FaultFile:
        return FaultFile(self, name, flags)

    def xGetLastError(self) -> tuple[int, str | None]:
        if self.last_errno is not None:
            return self.last_errno, os.strerror(self.last_errno)
        return super().xGetLastError()


class FaultFile(apsw.VFSFile):
    """One open file of the shim: counts, maybe fails, else forwards to the base file."""

    def __init__(
        self, vfs: FaultVFS, name: str | apsw.URIFilename | None, flags: list[int]
    ) -> None:
        self._vfs = vfs
        super().__init__(vfs.base_name, name, flags)
        path = name.filename() if isinstance(name, apsw.URIFilename) else name
        if path:
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:  # opened and already unlinked (a temp file)
                return
            with vfs._lock:
                vfs.opened.append((path, mode))

    def xRead(self, amount: int, offset: int) -> bytes:
        self._vfs.tick("read")
        return super().xRead(amount, offset)

    def xWrite(self, data: bytes, offset: int) -> None:
        self._vfs.tick("write")
        super().xWrite(data, offset)

    def xSync(self, flags: int) -> None:
        self._vfs.tick("sync")
        super().xSync(flags)

    def xLock(self, level: int) -> None:
        self._vfs.tick("lock")
        super().xLock(level)

    def xUnlock(self, level: int) -> None:
        self._vfs.tick("unlock")
        super().xUnlock(level)

    def xTruncate(self, newsize: int) -> None:
        self._vfs.tick("truncate")
        super().xTruncate(newsize)

    def xFileSize(self) -> int:
        self._vfs.tick("filesize")
        return super().xFileSize()


@contextlib.contextmanager
def installed(vfs: FaultVFS) -> Iterator[FaultVFS]:
    """Make ``vfs`` SQLite's default VFS for the block; always restore the previous one."""
    previous = apsw.vfs_names()[0]
    apsw.set_default_vfs(vfs.vfs_name)
    try:
        yield vfs
    finally:
        apsw.set_default_vfs(previous)
