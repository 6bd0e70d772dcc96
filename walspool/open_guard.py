"""SQLite's own opens in this process never wait on a FIFO.

walspool checks every file before SQLite opens it, but whoever owns the spool's
directory can swap a FIFO in between the check and SQLite's ``open()``: a read-only
connection opens with ``O_RDONLY``, which blocks until a writer comes (for ever), and
retries on ``EINTR``, so not even Ctrl-C ends it. SQLite lets a program replace the
system calls of its ``unix`` VFS (https://www.sqlite.org/c3ref/vfs.html,
``xSetSystemCall``); ``install`` replaces ``open`` with one that adds ``O_NONBLOCK``,
refuses a FIFO on the descriptor it got (``ENXIO``: SQLite reports
``SQLITE_CANTOPEN``), and clears ``O_NONBLOCK`` again for everything else, so SQLite
sees exactly the descriptor it would have had.

This applies to apsw's SQLite only (the spool's), for the whole process, and only to
the ``unix`` VFS family (every VFS that does not replace ``xOpen``). It is not
installed where ``ctypes`` cannot call the C library.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import threading
from typing import Any

import apsw

_OPEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, use_errno=True)
_state = threading.local()
#: ``PyErr_Fetch`` with its three out-slots made in advance (see ``_guarded_open``).
_pyerr_fetch = ctypes.pythonapi.PyErr_Fetch
_pyerr_fetch.restype = None
_SLOTS = (ctypes.py_object(), ctypes.py_object(), ctypes.py_object())
_PENDING = tuple(ctypes.byref(slot) for slot in _SLOTS)
_installed: list[Any] = []  # the callback and the C function: alive as long as SQLite


def _guarded_open(path: bytes, flags: int, mode: int) -> int:
    # SQLite may open a file while a Python exception is pending in this thread (an
    # apsw VFS written in Python failed just before): every C call made here would
    # then fail. It is taken out first (apsw has it no more; SQLite has the error
    # code); nothing in this function may call C before this line.
    _pyerr_fetch(_PENDING[0], _PENDING[1], _PENDING[2])
    fd = _libc_open(path, flags | os.O_NONBLOCK, mode)
    if fd < 0:
        return fd
    try:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode):
            os.close(fd)
            _state.refused = os.fsdecode(path)
            ctypes.set_errno(errno.ENXIO)
            return -1
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as exc:
        os.close(fd)
        ctypes.set_errno(exc.errno or errno.EIO)
        return -1
    except BaseException:  # never let an exception cross into SQLite's C frames
        os.close(fd)
        ctypes.set_errno(errno.EIO)
        return -1
    return fd


def refused() -> str | None:
    """The last file an open in this thread refused as a FIFO (and forget it)."""
    name = getattr(_state, "refused", None)
    _state.refused = None
    return name


def install() -> bool:
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
