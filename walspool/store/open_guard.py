"""Every file SQLite opens for a spool is checked on the descriptor SQLite will keep.

SQLite opens a spool's ``-journal``, ``-wal`` and ``-shm`` by path whenever it needs
them (a hot-journal check at every connection's first read, WAL databases included),
and, run as root, hands each journal and WAL it opens to the database file's owner
(``fchown``). Whoever owns the spool's directory can put any name there at any moment:
a hard link to a file of root's as ``spool.db-journal``, a FIFO, a file exchanged
(``renameat2``) with the genuine ``-wal`` between a check by name and SQLite's
``open()``. No check made before that ``open()`` closes such a race; a check of the
descriptor it returns does.

SQLite lets a program replace the system calls of its ``unix`` VFS
(https://www.sqlite.org/c3ref/vfs.html, ``xSetSystemCall``). ``install`` replaces
``open`` for apsw's SQLite (the spool's), for the whole process:

- every file is opened with ``O_NONBLOCK`` and a FIFO refused on its descriptor (a
  read-only open would otherwise wait for a writer for ever, Ctrl-C included);
- a file of a spool ``watch`` was told about (the database, ``-journal``, ``-wal``,
  ``-shm``) is opened with ``O_NOFOLLOW`` and must be a regular file of the spool's
  owner with one link, checked with ``fstat`` on the descriptor before SQLite has it.
  A file this very call created (``O_CREAT|O_EXCL`` succeeded) is the caller's own and
  passes: SQLite then gives it to the database's owner itself.

A refused open fails with ``EPERM`` (SQLite reports ``SQLITE_CANTOPEN`` or an I/O
error: the statement fails and nothing of the file is used or changed); ``refused``
tells the thread what was refused, so walspool's error can name it. Not covered: other
VFSes than the ``unix`` family, and a process where ``ctypes`` cannot call the C
library (``install`` returns False; walspool's checks by name still run).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import threading
from typing import Any, NamedTuple

import apsw

_OPEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, use_errno=True)
_state = threading.local()
#: ``PyErr_Fetch`` with its three out-slots made in advance (see ``_guarded_open``).
_pyerr_fetch = ctypes.pythonapi.PyErr_Fetch
_pyerr_fetch.restype = None
_SLOTS = (ctypes.py_object(), ctypes.py_object(), ctypes.py_object())
_PENDING = tuple(ctypes.byref(slot) for slot in _SLOTS)
_installed: list[Any] = []  # the callback and the C function: alive as long as SQLite

#: The names SQLite gives a database's other files.
SUFFIXES = ("-journal", "-wal", "-shm")
#: Spool databases by the name SQLite opens them with, and their owner's uid. A name
#: stays watched for the life of the process (a process opens a few spools).
_owners: dict[str, int] = {}
#: Turns lost to a name created or removed between the two opens of ``_open_watched``.
_TURNS = 16


class Refusal(NamedTuple):
    """A file the guard refused: its name, its ``fstat`` (None: a symbolic link), and
    the uid it had to belong to (None: a file of no watched spool)."""

    name: str
    stat: os.stat_result | None
    owner: int | None


def watch(database: str, owner: int) -> None:
    """Check every file SQLite opens for the spool ``database`` (named as SQLite
    names it: absolute, symlinks in its directory resolved) against ``owner``."""
    _owners[database] = owner


def _owner_of(name: str) -> int | None:
    owner = _owners.get(name)
    if owner is None:
        for suffix in SUFFIXES:
            if name.endswith(suffix):
                return _owners.get(name[: -len(suffix)])
    return owner


def _guarded_open(path: bytes, flags: int, mode: int) -> int:
    # SQLite may open a file while a Python exception is pending in this thread (an
    # apsw VFS written in Python failed just before): every C call made here would
    # then fail. It is taken out first (apsw has it no more; SQLite has the error
    # code); nothing in this function may call C before this line.
    _pyerr_fetch(_PENDING[0], _PENDING[1], _PENDING[2])
    try:
        name = os.fsdecode(path)
        owner = _owner_of(name)
        if owner is None:
            fd, made = _libc_open(path, flags | os.O_NONBLOCK, mode), False
        else:
            fd, made = _open_watched(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW, mode)
        if fd < 0:
            if owner is not None and ctypes.get_errno() == errno.ELOOP:
                return _refuse(Refusal(name, None, owner), errno.EPERM)
            return fd
    except BaseException:  # never let an exception cross into SQLite's C frames
        ctypes.set_errno(errno.EIO)
        return -1
    try:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode):
            os.close(fd)
            return _refuse(Refusal(name, st, owner), errno.ENXIO)
        if owner is not None and not made and not _trusted(st, owner):
            os.close(fd)
            return _refuse(Refusal(name, st, owner), errno.EPERM)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as exc:
        os.close(fd)
        ctypes.set_errno(exc.errno or errno.EIO)
        return -1
    except BaseException:
        os.close(fd)
        ctypes.set_errno(errno.EIO)
        return -1
    return fd


def _open_watched(path: bytes, flags: int, mode: int) -> tuple[int, bool]:
    """Open a watched file; the descriptor (or -1, errno set) and whether this call
    created the file. With ``O_CREAT`` a new file is made with ``O_EXCL`` so that it
    is known to be ours; an existing one is opened without ``O_CREAT`` and checked."""
    for _ in range(_TURNS):
        if flags & os.O_CREAT:
            fd = _libc_open(path, flags | os.O_EXCL, mode)
            if fd >= 0:
                return fd, True
            if ctypes.get_errno() != errno.EEXIST:
                return -1, False
        fd = _libc_open(path, flags & ~os.O_CREAT, mode)
        if fd >= 0 or not flags & os.O_CREAT or ctypes.get_errno() != errno.ENOENT:
            return fd, False
    ctypes.set_errno(errno.EAGAIN)  # made and removed again, turn after turn
    return -1, False


def _trusted(st: os.stat_result, owner: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == owner


def _refuse(refusal: Refusal, code: int) -> int:
    _state.refused = refusal
    ctypes.set_errno(code)
    return -1


def refused() -> Refusal | None:
    """The last file an open in this thread refused (and forget it)."""
    refusal = getattr(_state, "refused", None)
    _state.refused = None
    return refusal


def install_guard() -> bool:
    """Replace the ``open`` of apsw's ``unix`` VFS (once per process); False if it cannot."""
    if _installed:
        return True
    global _libc_open
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _libc_open = libc.open
        _libc_open.restype = ctypes.c_int
        _libc_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        callback = _OPEN(_guarded_open)
        # A VFS on top of "unix" only to reach its xSetSystemCall: the table it changes
        # is the unix VFS family's own, and stays changed after this one is gone.
        shim = apsw.VFS("walspool-open-guard", base="unix")
        try:
            done = shim.xSetSystemCall("open", ctypes.cast(callback, ctypes.c_void_p).value)
        finally:
            shim.unregister()
    except (OSError, AttributeError, apsw.Error):
        return False
    if done:
        _installed.append(callback)
    return bool(done)


_libc_open: Any = None
