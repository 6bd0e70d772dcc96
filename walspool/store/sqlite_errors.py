"""SQLite's failures as walspool's errors, each named for its condition: a file
``open_guard`` refused, a damaged spool, a full disk, other I/O."""

from __future__ import annotations

import errno
from pathlib import Path

import apsw

from ..errors import DiskFull, SpoolCorrupt, SpoolIOError, UntrustedSpool, WalspoolError
from . import files, open_guard


def refused_open(path: Path) -> WalspoolError | None:
    """The error for a file of the spool ``path`` SQLite was about to open in this
    thread and ``open_guard`` refused (a name changed after walspool's own checks),
    naming the file; None if nothing was refused."""
    refusal = open_guard.refused()
    database = files.sqlite_name(path)
    if refusal is None or refusal.name not in {database + s for s in ("", *open_guard.SUFFIXES)}:
        return None  # nothing refused, or another spool's file: not why this failed
    name = Path(refusal.name)
    if refusal.stat is None:
        return files.symlink_refused(name, path)
    try:
        owner = refusal.stat.st_uid if refusal.owner is None else refusal.owner
        files.check_stat(refusal.stat, name, owner, path)
    except WalspoolError as exc:
        return exc
    return UntrustedSpool(
        f"{name} changed while SQLite opened it; walspool did not use it: try again",
        path=path,
    )


def sqlite_error(
    exc: apsw.Error,
    path: Path,
    session_id: str | None = None,
    conn: apsw.Connection | None = None,
) -> WalspoolError:
    """Map an apsw error to the walspool error named for its condition.

    A file of the spool that ``open_guard`` refused in this thread is named first
    (``refused_open``): it is why SQLite failed. ``conn``, when given, supplies the
    operating system's errno of the failure, which tells a full disk (ENOSPC) or a
    file-size limit (EFBIG) from other I/O errors.
    """
    refused = refused_open(path)
    if refused is not None:
        return refused
    os_errno = _system_errno(conn)
    text = f"{path}: {exc}"
    if isinstance(exc, (apsw.CorruptError, apsw.NotADBError)):
        return SpoolCorrupt(
            f"{text}; run `walspool check {path}`", path=path, session_id=session_id
        )
    if isinstance(exc, apsw.FullError) or os_errno in (errno.ENOSPC, errno.EFBIG):
        return DiskFull(
            f"{path}: no room to write ({exc}); free disk space, nothing stored was lost",
            path=path,
            session_id=session_id,
        )
    if isinstance(exc, apsw.IOError):
        return SpoolIOError(f"{text}; check the disk", path=path, session_id=session_id)
    return WalspoolError(text, path=path, session_id=session_id)


def _system_errno(conn: apsw.Connection | None) -> int:
    if conn is None:
        return 0
    try:
        return int(conn.system_errno)
    except apsw.Error:
        return 0
