"""The spool's files: who may own them, and how they are created, checked and opened.

Trust model. A spool belongs to the owner of its directory. walspool writes a spool
only if that directory is not writable by group or others, and, unless the process
runs as root, belongs to the effective user; then nobody else can create, replace or
rename files in it. Every existing spool file (the database, its ``-wal`` and
``-shm``, the lock files) must be a regular file owned by the spool's owner (root's
files are accepted too when root runs it); otherwise walspool refuses, naming the
file and the fix. Run as root on another user's spool (an operator's replay), files
walspool creates are given to the spool's owner, as SQLite does for ``-wal``/``-shm``.

The directory is checked first, on a descriptor; once it is known that only the
owner can create or rename entries in it, nothing can be swapped in between a check
and a use. The lock files are checked on descriptors opened with ``O_NOFOLLOW`` and
``O_NONBLOCK`` (a FIFO never hangs an open), modes fixed with ``fchmod``. The
database, ``-wal`` and ``-shm`` are checked with ``lstat`` and never opened and
closed behind SQLite's back: closing any descriptor of a file drops every POSIX lock
the process holds on it, SQLite's included
(https://www.sqlite.org/howtocorrupt.html#_posix_advisory_locks_canceled_by_a_separate_thread_doing_close_).
For the same reason the header of a database this process already has open is not
read again (``opened``/``closed`` keep count). Symlinks in the directory's own path
are followed (a symlinked ``HERMES_HOME`` is common); only the spool's last path
component must not be one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import sys
import time
from pathlib import Path

from .errors import DiskFull, NotASpool, SpoolIOError, SymlinkRefused, UntrustedSpool

#: Beside the spool; every open ``Spool`` holds a shared ``flock`` on it.
OPEN_LOCK_SUFFIX = ".open-lock"
#: Beside the spool; an exclusive ``flock`` on it makes replays take turns.
REPLAY_LOCK_SUFFIX = ".replay-lock"
#: The files of a spool besides the database itself.
SUFFIXES = ("-wal", "-shm", OPEN_LOCK_SUFFIX, REPLAY_LOCK_SUFFIX)
SQLITE_MAGIC = b"SQLite format 3\x00"

_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def refuse_symlink(path: Path) -> None:
    """Refuse a spool path that is a symlink: the spool is only ever written in place."""
    if path.is_symlink():
        raise SymlinkRefused(
            f"spool path {path} is a symbolic link; walspool does not follow links, "
            "give the real path",
            path=path,
        )


def prepare(path: Path) -> int:
    """Make the spool's directory and database file if missing; check every file.

    Returns the uid of the spool's owner. Raises ``UntrustedSpool`` for a directory
    or file someone else could have made or could change, ``SymlinkRefused`` for a
    link among the spool's files, ``NotASpool`` for one that is not a regular file,
    and ``SpoolIOError``/``DiskFull`` when the file system refuses.
    """
    refuse_symlink(path)
    try:
        _make_directories(path.parent)
        owner = trusted_directory(path)
        _create_database(path, owner)
        check_files(path, owner)
    except OSError as exc:
        error = DiskFull if exc.errno in (errno.ENOSPC, errno.EFBIG) else SpoolIOError
        raise error(f"cannot prepare spool {path}: {exc}", path=path) from exc
    return owner


def trusted_directory(path: Path) -> int:
    """The uid owning the spool's directory, once it is known nobody else can write it."""
    directory = path.parent
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    euid = os.geteuid()
    if euid != 0 and st.st_uid != euid:
        raise UntrustedSpool(
            f"the spool's directory {directory} belongs to uid {st.st_uid}, not to you "
            f"(uid {euid}); put the spool in a directory of your own",
            path=path,
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedSpool(
            f"the spool's directory {directory} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}), so anyone could replace the spool's files; "
            f"run `chmod go-w {directory}`",
            path=path,
        )
    return st.st_uid


def check_files(path: Path, owner: int) -> None:
    """Check each existing spool file (type, owner) and make it 0600."""
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise SymlinkRefused(
                f"{name} is a symbolic link; walspool does not follow links among a "
                "spool's files: remove it",
                path=path,
            )
        _check_stat(st, name, owner, path)
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.chmod(name, 0o600)  # a regular file in a directory only the owner changes
    # The lock files are checked when they are opened (``open_private``).


def check_descriptor(fd: int, name: Path, owner: int, path: Path) -> None:
    """Refuse an opened lock file that is not a regular file of the spool's owner
    (one root left behind is given back to the owner); make it 0600."""
    st = os.fstat(fd)
    if st.st_uid != owner and st.st_uid == 0 and os.geteuid() == 0 and stat.S_ISREG(st.st_mode):
        _give(fd, owner)  # left by an earlier run as root: the owner's again
        st = os.fstat(fd)
    _check_stat(st, name, owner, path)
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)


def _check_stat(st: os.stat_result, name: Path, owner: int, path: Path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotASpool(
            f"{name} is not a regular file; a spool's files are regular files: remove it",
            path=path,
        )
    if st.st_uid != owner:
        fix = f"`chown {owner} {name}` as root" if st.st_uid == 0 else f"`rm {name}`"
        raise UntrustedSpool(
            f"{name} belongs to uid {st.st_uid}, not to the spool's owner (uid {owner}); "
            f"walspool does not use it: if it is the owner's, run {fix}",
            path=path,
        )


def open_private(name: Path, owner: int, path: Path, what: str) -> int:
    """Open (creating 0600, given to ``owner``) ``what``, a file beside the spool, checked."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError as exc:
        raise SpoolIOError(
            f"cannot open {what} {name} ({exc}); it must be a regular file beside the spool",
            path=path,
        ) from exc
    try:
        _give(fd, owner)
        check_descriptor(fd, name, owner, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: (device, inode) of each database this process has open as a spool, with a count.
_open_here: dict[tuple[int, int], int] = {}


def opened(identity: tuple[int, int]) -> None:
    """Count a spool database this process now has open (see the module docstring)."""
    _open_here[identity] = _open_here.get(identity, 0) + 1


def closed(identity: tuple[int, int]) -> None:
    left = _open_here.get(identity, 0) - 1
    if left > 0:
        _open_here[identity] = left
    else:
        _open_here.pop(identity, None)


#: The POSIX locks SQLite holds while a connection has a database open in WAL mode
#: (os_unix.c): a read lock on the database file's shared range, and one on the
#: ``-shm`` file's "DMS" byte for as long as it maps the WAL index.
_SHARED_RANGE = (0x40000000 + 2, 510)
_SHM_DMS = (120 + 8, 1)
_FLOCK = "qqihh" if sys.platform == "darwin" else "hhqqi"


def sqlite_user(path: Path) -> int | None:
    """The pid of another process that has the SQLite database ``path`` open, whatever
    program it is (Litestream, the sqlite3 shell, a copy tool using SQLite), seen in the
    locks SQLite holds; None if there is none.

    It opens and closes descriptors of the database and its ``-shm``, which drops this
    process's own POSIX locks on them: call it only for a database this process does
    not have open (a spool counted by ``opened`` is reported as in use, by this pid).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if (st.st_dev, st.st_ino) in _open_here:
        return os.getpid()
    for name, (start, length) in ((path, _SHARED_RANGE), (Path(f"{path}-shm"), _SHM_DMS)):
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            if sys.platform == "darwin":
                probe = struct.pack(_FLOCK, start, length, 0, fcntl.F_WRLCK, os.SEEK_SET)
                *_, pid, kind, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
            else:
                probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
                kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
        finally:
            os.close(fd)
        if kind != fcntl.F_UNLCK:
            return pid
    return None


def read_head(path: Path) -> bytes:
    """The first bytes of a regular file, as far as SQLite's header goes.

    Never blocks (a FIFO is refused, not read), never follows a final symlink, and
    never opens a database this process has open already (its header was read then).
    """
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in _open_here:
        return SQLITE_MAGIC
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotASpool(f"{path} is not a regular file, so not a spool", path=path)
        return os.read(fd, len(SQLITE_MAGIC))
    finally:
        os.close(fd)


def refuse_non_sqlite(path: Path) -> None:
    """A non-empty file without SQLite's header is someone else's file: leave it alone
    (unless SQLite's own journal says it is a new database, see ``_being_created``)."""
    try:
        head = read_head(path)
    except OSError as exc:
        raise SpoolIOError(f"cannot open spool {path}: {exc}", path=path) from exc
    if head and head != SQLITE_MAGIC and not _being_created(path, head):
        raise NotASpool(
            f"{path} is not a SQLite database, so not a walspool spool; "
            "give the path of a spool or of a file that does not exist yet",
            path=path,
        )


#: The first bytes of a valid SQLite rollback journal header.
JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


def _being_created(path: Path, head: bytes) -> bool:
    """Is ``path`` a database whose creation a power cut interrupted?

    SQLite writes the first page of a new database under a rollback journal. After a
    power cut before that page was synced, the file may have its new length but not
    its data (zeros: XFS and ext4 ``data=writeback`` allow it), while the journal,
    synced first, is there and is hot: opening rolls the file back to empty. Such a
    file is SQLite's, not someone else's (found by ``tests/test_powerloss.py``).
    """
    if head.strip(b"\0"):
        return False
    try:
        return read_head(Path(f"{path}-journal"))[: len(JOURNAL_MAGIC)] == JOURNAL_MAGIC
    except (OSError, NotASpool):
        return False


def move_aside(path: Path) -> Path:
    """Rename a damaged spool and its ``-wal``/``-shm`` files (made 0600); never delete them."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.damaged-{stamp}-{os.getpid()}")
    for suffix in ("-wal", "-shm", ""):
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{path}{suffix}", f"{target}{suffix}")
            with contextlib.suppress(OSError):  # a link stays a link: never followed
                fd = os.open(f"{target}{suffix}", os.O_RDONLY | _NOFOLLOW)
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        os.fchmod(fd, 0o600)
                finally:
                    os.close(fd)
    return target


def _make_directories(directory: Path) -> None:
    """Create the missing directories of the spool's path, each 0700."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o700)
        except FileExistsError:
            continue
        fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)  # whatever the umask
        finally:
            os.close(fd)
        sync_directory(new.parent)


def _create_database(path: Path, owner: int) -> None:
    """Create an empty database file, 0600 and the owner's, unless one exists.

    SQLite gives the ``-wal`` and ``-shm`` files the mode and owner of the database
    file (https://www.sqlite.org/tempfiles.html), so they are private too.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
        _give(fd, owner)
    finally:
        os.close(fd)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """fsync a directory, so the entries just made in it survive a power cut.

    A new file or directory is on the disk only once the directory holding its
    entry is synced; SQLite syncs the directory when it creates a ``-wal`` or a
    journal, but not for a database file or a directory it did not make. Without
    this, a power cut soon after the first open of a new spool could take the spool's
    directory, and every acknowledged append in it, away (found by
    ``tests/test_powerloss.py``). File systems that cannot sync a directory (EINVAL)
    are left as they are, as SQLite does. On macOS a plain fsync does not reach the
    media, so ``F_FULLFSYNC`` is asked for first, as SQLite's ``fullfsync`` does.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _full_fsync(fd):
            return
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _full_fsync(fd: int) -> bool:
    """``fcntl(F_FULLFSYNC)`` where the system has it (macOS); False if not done."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is None:
        return False
    try:
        fcntl.fcntl(fd, full)
    except OSError:
        return False  # not supported by this file system: a plain fsync then
    return True


def _give(fd: int, owner: int) -> None:
    """As root, hand a file walspool made to the spool's owner (and its group)."""
    if os.geteuid() != 0 or owner == 0:
        return
    st = os.fstat(fd)
    if st.st_uid != owner:
        try:
            import pwd

            group = pwd.getpwuid(owner).pw_gid
        except KeyError:
            group = -1
        os.fchown(fd, owner, group)
