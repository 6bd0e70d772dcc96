"""The spool's files: who may own them, and how they are created, checked and opened.

Trust model. A spool belongs to the owner of its directory. walspool writes a spool
only if that directory is not writable by group or others (a group that is its owner's
alone, a user-private group, does not count), and, unless the process runs as root,
belongs to the effective user; every directory on the way to it must be root's or the
owner's, and not writable by others unless sticky (``walspool.store.directories``). Every
existing spool file (the database, its ``-wal`` and ``-shm``, the lock files) must be a
regular file owned by the spool's owner, with one link (root's leftover lock files
are given back when root runs it); otherwise walspool refuses, naming the file and the
fix. Run as root on another user's spool (an operator's replay), files walspool creates
are given to the spool's owner, as SQLite does for ``-wal``/``-shm``.

The owner can change their own directory at any moment, so when root runs walspool
nothing is used by path after a check: the directory is opened and checked once, and
every file below it is opened relative to that descriptor (``O_NOFOLLOW``,
``O_NONBLOCK``: a FIFO never hangs an open), checked with ``fstat`` and changed on the
descriptor (``fchmod``, ``fchown``). The database, ``-wal`` and ``-shm`` are opened
with ``O_PATH`` only: closing any other descriptor of a file drops every POSIX lock the
process holds on it, SQLite's included
(https://www.sqlite.org/howtocorrupt.html#_posix_advisory_locks_canceled_by_a_separate_thread_doing_close_).
SQLite itself is handed the path; once it has opened the file, the descriptor it holds
is compared with what the path names (``check_opened``). For the same reason the
header of a database this process already has open is not read again
(``opened``/``closed`` keep count). Symlinks in the directory's own path are resolved
once (a symlinked ``HERMES_HOME`` is common); only the spool's last path component
must not be one.
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

from ..errors import DiskFull, NotASpool, SpoolIOError, SymlinkRefused, UntrustedSpool
from . import open_guard
from .directories import Directory, changed, open_directory, sync_fd

#: Beside the spool; every open ``Spool`` holds a shared ``flock`` on it.
OPEN_LOCK_SUFFIX = ".open-lock"
#: Beside the spool; an exclusive ``flock`` on it makes replays take turns.
REPLAY_LOCK_SUFFIX = ".replay-lock"
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


def refuse_read_only(path: Path) -> None:
    """Raise ``SpoolIOError`` if the file system of the spool at ``path`` (its
    directory's) is mounted read-only: nothing can be written there, neither the spool
    nor the lock files beside it. Where that cannot be told, the open that follows
    names whatever fails."""
    try:
        flags = os.statvfs(path.parent).f_flag
    except OSError:
        return
    if flags & os.ST_RDONLY:
        raise SpoolIOError(
            f"{path} is on a read-only file system: walspool cannot write to it (stats, "
            "ls, show, export and check read it; to replay or change it, copy it with "
            "its -wal to a writable place)",
            path=path,
        )


def make_and_check(path: Path) -> int:
    """Make the spool's directory and database file if missing; check every file.

    Returns the uid of the spool's owner. Raises ``UntrustedSpool`` for a directory
    or file someone else could have made or could change, ``SymlinkRefused`` for a
    link among the spool's files, ``NotASpool`` for one that is not a regular file,
    and ``SpoolIOError``/``DiskFull`` when the file system refuses.
    """
    refuse_symlink(path)
    try:
        with open_directory(path.parent, path, create=True, own=True) as directory:
            _create_database(directory, path)
            _check_files(directory, path)
            return directory.owner
    except OSError as exc:
        error = DiskFull if exc.errno in (errno.ENOSPC, errno.EFBIG) else SpoolIOError
        raise error(f"cannot prepare spool {path}: {exc}", path=path) from exc


def trusted_directory(path: Path) -> int:
    """The uid owning the spool's directory, once it is known nobody else can write it
    or any directory on the way to it (``walspool.store.directories``)."""
    with open_directory(path.parent, path, own=True) as directory:
        return directory.owner


def _check_files(directory: Directory, path: Path) -> None:
    """Check the database, ``-journal``, ``-wal`` and ``-shm`` in ``directory``; fix modes
    by descriptor.

    Each is opened below the directory with ``O_PATH | O_NOFOLLOW`` (Linux): that
    opens neither a FIFO nor a link's target, and closing it drops none of the POSIX
    locks SQLite holds in this process (see the module docstring). It is checked on
    that descriptor, and its mode changed through it (``/proc/self/fd``, as glibc's
    ``fchmodat`` does): never by the path again.
    """
    for name in sqlite_names(path):
        shown = path.with_name(name)
        try:
            fd = directory.open(name, _PATH_ONLY)
        except FileNotFoundError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                raise symlink_refused(shown, path)
            check_stat(st, shown, directory.owner, path)
            if stat.S_IMODE(st.st_mode) != 0o600:
                _chmod_descriptor(fd, directory, name)
        finally:
            os.close(fd)


#: Opens a name itself (a link, a FIFO) without opening what it leads to.
_PATH_ONLY = getattr(os, "O_PATH", os.O_RDONLY)


def _chmod_descriptor(fd: int, directory: Directory, name: str) -> None:
    """Make the file ``fd`` is open on 0600."""
    if hasattr(os, "O_PATH"):
        os.chmod(f"/proc/self/fd/{fd}", 0o600)  # the inode fd holds, whatever the name
        return
    if not _is_open_here(directory, name):  # else closing it would drop SQLite's locks
        os.fchmod(fd, 0o600)


def _is_open_here(directory: Directory, name: str) -> bool:
    st = directory.lstat(name)
    return st is not None and (st.st_dev, st.st_ino) in _open_here


def check_opened(path: Path, opened: os.stat_result | None) -> None:
    """After SQLite opened the spool: the path names the file that was checked.

    ``opened`` is ``fstat`` of the descriptor SQLite holds (None where it cannot be
    had): the spool's name must still name that very file, and every file of the
    spool must still pass the checks (``-wal``/``-shm`` may have been made, or
    replaced by a checkpoint, meanwhile: their identity is not compared). Raises
    ``UntrustedSpool``/``NotASpool``/``SymlinkRefused`` naming the file.
    """
    with open_directory(path.parent, path) as directory:
        st = directory.lstat(path.name)
        if st is None or (
            opened is not None and (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino)
        ):
            raise changed(path, path)
        for name in sqlite_names(path):
            st = directory.lstat(name)
            if st is None:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise symlink_refused(path.with_name(name), path)
            check_stat(st, path.with_name(name), directory.owner, path)
        if opened is not None:
            check_stat(opened, path, directory.owner, path)


def check_for_reading(path: Path) -> int:
    """Before a read-only open: the directory trusted, and each spool file there a
    regular file of its owner (a FIFO is refused here, before SQLite could wait on
    it). Checked with ``lstat`` only, which never drops a lock. Returns the owner's uid."""
    refuse_symlink(path)
    with open_directory(path.parent, path) as directory:
        for name in sqlite_names(path):
            st = directory.lstat(name)
            if st is not None and not stat.S_ISLNK(st.st_mode):
                check_stat(st, path.with_name(name), directory.owner, path)
            elif st is not None:
                raise symlink_refused(path.with_name(name), path)
        return directory.owner


def sqlite_names(path: Path) -> tuple[str, ...]:
    """The names of the files SQLite keeps for the spool ``path``: the database, and
    the ``-journal``, ``-wal`` and ``-shm`` it opens by name when it needs them."""
    return (path.name, *(path.name + suffix for suffix in open_guard.SUFFIXES))


def symlink_refused(name: Path, path: Path) -> SymlinkRefused:
    """The error for a symbolic link at ``name``, one of the spool ``path``'s files."""
    return SymlinkRefused(
        f"{name} is a symbolic link; walspool does not follow links among a spool's "
        "files: remove it",
        path=path,
    )


def check_stat(st: os.stat_result, name: Path, owner: int, path: Path) -> None:
    """Refuse a spool file that is not a regular file of ``owner`` with one link,
    naming it (``NotASpool``, ``UntrustedSpool``)."""
    if not stat.S_ISREG(st.st_mode):
        raise NotASpool(
            f"{name} is not a regular file; a spool's files are regular files: remove it",
            path=path,
        )
    if st.st_nlink != 1:
        raise UntrustedSpool(
            f"{name} has {st.st_nlink} hard links, so it is also another file's content; "
            f"walspool does not use it: if it is the spool's, run `cp -p {name} {name}.copy && "
            f"mv {name}.copy {name}`",
            path=path,
        )
    if st.st_uid != owner:
        fix = f"`chown {owner} {name}` as root" if st.st_uid == 0 else f"`rm {name}`"
        raise UntrustedSpool(
            f"{name} belongs to uid {st.st_uid}, not to the spool's owner (uid {owner}); "
            f"walspool does not use it: if it is the owner's, run {fix}",
            path=path,
        )


#: A lock file holds at most its holder's pid: a bigger one is not a leftover lock.
_LOCK_LEFTOVER_BYTES = 64


def open_private(name: Path, owner: int, path: Path, what: str) -> int:
    """Open ``what``, a lock file beside the spool, checked; create it (0600, given to
    ``owner``) if missing.

    Opened below the checked directory with ``O_NOFOLLOW | O_NONBLOCK``; an existing
    file is checked on its descriptor (regular, one link, the owner's) before anything
    is changed: a file another user planted, a hard link and a FIFO are refused, never
    chowned, chmodded or truncated. Only a lock file root left behind (regular, one
    link, no more than a pid in it) is given to the owner when root runs this.
    """
    try:
        with open_directory(name.parent, path) as directory:
            if directory.owner != owner:
                raise changed(name.parent, path)
            fd = _open_lock(directory, name, path)
    except OSError as exc:
        exc = OSError(exc.errno, exc.strerror, str(name))  # named in full
        raise SpoolIOError(
            f"cannot open {what} {name} ({exc}); it must be a regular file beside the spool",
            path=path,
        ) from exc
    return fd


def _open_lock(directory: Directory, name: Path, path: Path) -> int:
    for _ in range(100):  # each turn lost to a concurrent create or remove
        try:
            fd = directory.open(name.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                _give(fd, directory.owner)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            fd = directory.open(name.name, os.O_RDWR)  # a link: ELOOP, never followed
        except FileNotFoundError:
            continue
        try:
            check_descriptor(fd, name, directory.owner, path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise changed(name, path)


def check_descriptor(fd: int, name: Path, owner: int, path: Path) -> None:
    """Refuse an opened lock file that is not a regular file of the spool's owner with
    one link (one root left behind is given back to the owner); make it 0600.

    Every check is made before any change, on the descriptor."""
    st = os.fstat(fd)
    leftover = (
        st.st_uid == 0
        and owner != 0
        and os.geteuid() == 0
        and stat.S_ISREG(st.st_mode)
        and st.st_nlink == 1
        and st.st_size <= _LOCK_LEFTOVER_BYTES
    )
    if not leftover:
        check_stat(st, name, owner, path)
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    if leftover:
        _give(fd, owner)  # left by an earlier run as root: the owner's again


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
    """Rename a damaged spool and its ``-wal``/``-shm`` files (made 0600); never delete them.

    Renamed and changed below the checked directory: a link stays a link, never
    followed, and only a regular file of the owner with one link is chmodded."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.damaged-{stamp}-{os.getpid()}")
    with open_directory(path.parent, path) as directory:
        for suffix in ("-wal", "-shm", ""):
            old, new = f"{path.name}{suffix}", f"{target.name}{suffix}"
            try:
                os.rename(old, new, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
            except FileNotFoundError:
                continue
            with contextlib.suppress(OSError):
                fd = directory.open(new, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                        if st.st_uid == directory.owner:
                            os.fchmod(fd, 0o600)
                finally:
                    os.close(fd)
    return target


def _create_database(directory: Directory, path: Path) -> None:
    """Create an empty database file, 0600 and the owner's, unless one exists.

    SQLite gives the ``-wal`` and ``-shm`` files the mode and owner of the database
    file (https://www.sqlite.org/tempfiles.html), so they are private too.
    """
    try:
        fd = directory.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
        _give(fd, directory.owner)
    finally:
        os.close(fd)
    directory.sync()


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
        sync_fd(fd)
    finally:
        os.close(fd)


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


def sqlite_name(path: Path) -> str:
    """The spool's name as SQLite opens it, its directory resolved: SQLite's
    ``NOFOLLOW`` refuses a symlink anywhere in the name, and a symlinked
    ``HERMES_HOME`` is fine (only the spool's own name may not be a link, which
    ``files`` refuses)."""
    return str(Path(os.path.realpath(path.parent)) / path.name)
