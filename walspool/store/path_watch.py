"""Whether the spool's path still names the file a Spool opened, asked before every
commit of appends at the cost of one ``poll`` while nothing changed.

The answer is the path's (device, inode) against the opened file's. Taking it with a
``stat`` right after an ``fdatasync`` costs 8-12 us, a large part of a lone producer's
append; so the kernel is asked to say when the path may name another file (Linux's
inotify), and the ``stat`` is made only then:

* every directory the path is resolved through, each with the one name looked up in
  it (the parents of a symlinked home and of the link's target included), is watched
  for that name being created, deleted or renamed, and for the directory itself going
  (deleted, moved, its file system unmounted);
* ``/proc/self/mounts`` tells of any mount or unmount in the process's namespace (a
  file system mounted over one of those directories changes what the path names
  without touching any of them).

An event about one of those names (created, deleted, renamed, its attributes changed),
a lost event (the kernel's queue overflowed) or any mount change ends the watch: from
then on every check is a ``stat``, as it is where the watch cannot be set up (not Linux,
a relative path that a ``chdir`` would change, inotify's limits reached, a directory that
cannot be read, or one on a file system whose changes by others inotify does not see:
only local file systems are watched, not NFS, SMB, FUSE or a virtual machine's shared
folder). So the answer is the ``stat``'s, only not asked while nothing could change it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import struct
import threading
from typing import Any

#: inotify(7)'s event bits used here.
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
#: What a watched directory is watched for: its name changing under it, or it going.
WATCH_MASK = (
    IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
)
#: Events that end the watch whatever their name: a directory gone, events lost.
WATCH_LOST = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_Q_OVERFLOW | IN_IGNORED
#: statfs(2) ``f_type`` of the local file systems watched (their changes are all made
#: through this kernel): ext2-4, XFS, Btrfs, tmpfs, ramfs, overlayfs, F2FS, ZFS, bcachefs.
LOCAL_FILE_SYSTEMS = frozenset(
    (
        0xEF53,
        0x58465342,
        0x9123683E,
        0x01021994,
        0x858458F6,
        0x794C7630,
        0xF2F52010,
        0x2FC12FC1,
        0xCA451A4E,
    )
)
#: Symlinks followed while resolving a path, as Linux's own limit.
MAX_LINKS = 40
_EVENT = struct.Struct("iIII")


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names now, not following a symlink; None if
    nothing."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def resolution(path: str) -> dict[str, set[bytes]] | None:
    """Each directory ``path`` is resolved through (none of them a symlink) and the
    names looked up in it, as the kernel walks it: a symlink's target is walked in its
    place. None when it cannot be told (a relative path, a loop of links)."""
    if not path.startswith("/"):
        return None
    lookups: dict[str, set[bytes]] = {}
    parts = path.split("/")[1:]
    parts.reverse()  # a stack: the next name last
    current = "/"
    links = 0
    while parts:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)  # ``current`` holds no link: exact
            continue
        lookups.setdefault(current, set()).add(os.fsencode(name))
        step = os.path.join(current, name)
        if parts and os.path.islink(step):  # the last name is the spool's, never followed
            links += 1
            if links > MAX_LINKS:
                return None
            try:
                target = os.readlink(step)
            except OSError:
                return None
            if target.startswith("/"):
                current = "/"
            parts.extend(reversed(target.split("/")))
            continue
        current = step
    return lookups


class PathWatch:
    """Answers whether ``path`` still names the file of ``identity`` (see the module
    docstring). Thread-safe; ``close`` releases its descriptors."""

    def __init__(self, path: str, identity: tuple[int, int] | None) -> None:
        self.path = path
        self.identity = identity
        self._lock = threading.Lock()
        #: Directory watches: inotify's descriptor for each, and the names looked up there.
        self._names: dict[int, set[bytes]] = {}
        self._inotify = -1
        self._mounts: Any = None
        self._poll: Any = None
        if identity is not None:
            self._start()

    @property
    def watching(self) -> bool:
        """Whether a check is a ``poll`` (True) or a ``stat`` every time."""
        return self._poll is not None

    def names_it(self) -> bool:
        """Whether the path names the file of ``identity`` now."""
        with self._lock:
            if self._poll is not None and not self._events():
                return True
            return file_identity(self.path) == self.identity

    def close(self) -> None:
        """Stop watching (a check is a ``stat`` from then on). Idempotent."""
        with self._lock:
            self._stop()

    def _start(self) -> None:
        lookups = resolution(self.path)
        libc = _libc()
        if lookups is None or libc is None:
            return
        try:
            self._mounts = open("/proc/self/mounts", "rb", buffering=0)  # noqa: SIM115 - kept open
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "inotify_init1")
            self._inotify = fd
            for directory, names in lookups.items():
                if _file_system(libc, directory) not in LOCAL_FILE_SYSTEMS:
                    raise OSError(errno.EOPNOTSUPP, "not a local file system", directory)
                wd = libc.inotify_add_watch(fd, os.fsencode(directory), WATCH_MASK)
                if wd < 0:
                    raise OSError(ctypes.get_errno(), "inotify_add_watch")
                self._names.setdefault(wd, set()).update(names)
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            poll.register(self._mounts.fileno(), select.POLLPRI)
            poll.poll(0)  # the mount table as it is now: a change is told from here on
        except OSError:
            self._stop()
            return
        # A change between the caller's ``identity`` and the watches was not told:
        # the path is looked at once more, with every watch in place.
        if file_identity(self.path) != self.identity:
            self._stop()
            return
        self._poll = poll

    def _events(self) -> bool:
        """Whether anything may have changed what the path names since the last check
        (lock held). Ends the watch on an event about one of its names, or on a mount
        change (the path may now be resolved through other directories)."""
        ready = self._poll.poll(0)
        if not ready:
            return False
        for fd, _ in ready:
            if fd != self._inotify or self._read_inotify():
                self._stop()
                return True
        return False

    def _read_inotify(self) -> bool:
        """Read every queued event; whether one is about a watched name or lost the watch."""
        told = False
        while True:
            try:
                data = os.read(self._inotify, 64 * 1024)
            except BlockingIOError:
                return told
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return True
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, size = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + size].rstrip(b"\0")
                offset += _EVENT.size + size
                if mask & WATCH_LOST or name in self._names.get(wd, ()):
                    told = True

    def _stop(self) -> None:
        self._poll = None
        if self._inotify >= 0:
            os.close(self._inotify)
            self._inotify = -1
        if self._mounts is not None:
            self._mounts.close()
            self._mounts = None
        self._names = {}


@functools.cache
def _libc() -> Any:
    """libc with inotify's calls and statfs, or None where it has them not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        init, add, statfs = libc.inotify_init1, libc.inotify_add_watch, libc.statfs
    except (OSError, AttributeError):
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    statfs.argtypes, statfs.restype = [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int
    return libc


def _file_system(libc: Any, directory: str) -> int:
    """statfs(2)'s ``f_type`` of ``directory`` (the struct's first field, a word)."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(directory), buffer) != 0:
        raise OSError(ctypes.get_errno(), "statfs", directory)
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
