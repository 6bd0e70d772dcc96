"""An ``apsw.VFS`` shim that records what a disk holds, and cuts the power (crash tests).

``PowerVFS`` forwards every call to the real unix VFS, so the workload runs on real
files; alongside, it keeps a log of every operation that changes what a disk may
hold, across all files under one directory tree (``root``) and all threads, in the
order they happened (the shim runs them one at a time under one lock):

* ``write`` (offset, bytes) and ``truncate`` (size) of a file, through SQLite;
* ``sync`` of a file (``xSync`` returned): every earlier write and truncate of that
  file is on the disk from then on;
* ``create`` and ``delete`` of a directory entry: a file SQLite opens that did not
  exist, a file or directory created with ``os.open(O_CREAT)`` or ``os.mkdir`` (by path,
  or relative to a directory descriptor)
  while ``recording`` (walspool's own files), a file SQLite deletes (``xDelete``);
* ``dirsync`` of a directory: the entries it holds at that moment are on the disk.
  Observed three ways: ``os.fsync`` of a directory descriptor while ``recording``;
  ``xDelete`` with ``syncdir`` (the unix VFS fsyncs the directory after the unlink);
  and the first ``xSync`` of a journal or WAL that SQLite opened with
  ``SQLITE_OPEN_CREATE`` (the unix VFS then opens the directory and fsyncs it, once
  per handle: its ``UNIXFILE_DIRSYNC`` flag).

``crash_state(cut, sample)`` gives the files as a disk may hold them if the power
had failed just before operation number ``cut`` (0 = before anything): everything
synced is there; each write or truncate since its file's last sync independently
either did not happen, happened, or (a write over several 512-byte sectors) was
torn, some sectors new and the others old; a write that extended its file may also
have left the new length holding zeros (the size reached the disk, the data did not,
as ext4 ``data=writeback`` allows). Each directory entry created or deleted since its
directory's last sync may or may not be there (a deleted file coming back with
whatever of its contents reached the disk). Sample 0 keeps only what was synced,
sample 1 applies everything (what a killed process leaves), sample 2 applies a
random prefix of the log (a disk that keeps order), later samples are random per
operation, all seeded from (``seed``, cut, sample), so a failing state is
reproducible.

What the model covers, then: lost, applied and torn writes since a file's last sync,
in any order among themselves (independent choices include every reordering within
a sync interval); lost truncations; a file's length without its data; directory
entries created or removed since the directory's last observed sync; a completed
sync as a barrier for its own file only (a sync of the WAL says nothing of the
database file).

What it does not cover:

* the ``-shm`` wal-index: SQLite maps it below the Python layer, so its writes are
  not seen; crash states leave it out. This matches a reboot: SQLite never trusts a
  ``-shm`` that no live process holds, and rebuilds it from the WAL on the first open.
* writes that reach the disk although no sync asked for them are covered (as
  "applied"), but a sync that the disk acknowledges without making the data
  durable (a lying drive cache, or macOS ``fsync`` without ``F_FULLFSYNC``) is not:
  the model takes a completed ``xSync`` at its word.
* sector contents other than old or new bytes (garbage after a torn write), and
  damage to bytes outside the range written (SQLite's unix VFS declares
  ``SQLITE_IOCAP_POWERSAFE_OVERWRITE``, the same assumption).
* renames, ``unlink`` outside SQLite, hard links, file modes and owners, and
  metadata other than length; changes made outside ``root``; directory syncs not
  made through ``os.fsync`` or SQLite's unix VFS.
* memory-mapped writes (SQLite writes the database through ``xWrite`` only; mmap is
  off here anyway, ``mmap_size`` 0).

Use ``recording(vfs)`` around the workload: it makes the shim SQLite's default VFS
and watches ``os.open``, ``os.mkdir`` and ``os.fsync`` for the block; ``mark(...)``
notes an event of the workload (an acknowledged append) at the current position.
``unregister()`` the shim once done: SQLite holds a registered VFS (and its log).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw

SECTOR = 512
_names = itertools.count()
#: Journals and WALs the unix VFS opens with a pending directory sync (``syncDir``).
_DIRSYNC_TYPES = (
    apsw.SQLITE_OPEN_WAL | apsw.SQLITE_OPEN_MAIN_JOURNAL | apsw.SQLITE_OPEN_SUPER_JOURNAL
)
_NOT_MODELLED_SUFFIXES = ("-shm",)


@dataclass
class Node:
    """One incarnation of a directory entry: a file (or directory) as created once."""

    id: int
    path: str
    is_dir: bool
    initial: bytes = b""


@dataclass(frozen=True)
class Op:
    """One logged operation. ``node`` for write/truncate/sync, ``path`` for the rest."""

    kind: str  # write, truncate, sync, create, delete, dirsync
    node: int = -1
    path: str = ""
    offset: int = 0
    data: bytes = b""


@dataclass(frozen=True)
class Mark:
    """An event of the workload at log position ``at`` (that many operations done)."""

    at: int
    kind: str
    value: Any


@dataclass
class CrashState:
    """Files and directories (relative to ``root``) as the disk holds them after a cut."""

    cut: int
    sample: int
    files: dict[str, bytes]
    dirs: set[str]
    #: Pending writes by outcome: skipped, applied, torn, zeros; entries lost/kept.
    outcomes: dict[str, int] = field(default_factory=dict)

    def write_to(self, dest: Path) -> None:
        """Lay the state out under ``dest`` (directories 0700, files 0600)."""
        dest.mkdir(mode=0o700, exist_ok=True)
        os.chmod(dest, 0o700)
        for rel in sorted(self.dirs, key=lambda p: p.count("/")):
            (dest / rel).mkdir(mode=0o700)
        for rel, data in self.files.items():
            fd = os.open(dest / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


class PowerVFS(apsw.VFS):
    """Forwards to ``base`` and logs what the disk would hold, for files under ``root``.

    ``base`` must name a real VFS (not ``""``): once the shim is the default VFS,
    ``""`` would resolve to the shim itself.
    """

    def __init__(self, root: Path, *, seed: int = 0, base: str = "unix") -> None:
        self.vfs_name = f"walspool-power-{next(_names)}"
        self.base_name = base
        self.root = os.path.realpath(root)
        self.seed = seed
        self.ops: list[Op] = []
        self.marks: list[Mark] = []
        self.nodes: dict[int, Node] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        #: What each path names now, and what it named when the log began.
        self._current: dict[str, int] = {}
        self._baseline: dict[str, int] = {}
        self._scan_baseline()
        super().__init__(self.vfs_name, base)

    # -- recording -------------------------------------------------------------

    def _scan_baseline(self) -> None:
        """Everything under ``root`` when the log begins is taken as on the disk."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames:
                self._new_node(os.path.join(dirpath, name), is_dir=True, baseline=True)
            for name in filenames:
                path = os.path.join(dirpath, name)
                if name.endswith(_NOT_MODELLED_SUFFIXES):
                    continue
                with open(path, "rb") as f:
                    self._new_node(path, is_dir=False, baseline=True, initial=f.read())

    def _new_node(
        self, path: str, *, is_dir: bool, baseline: bool = False, initial: bytes = b""
    ) -> int:
        node = Node(next(self._ids), path, is_dir, initial)
        self.nodes[node.id] = node
        self._current[path] = node.id
        if baseline:
            self._baseline[path] = node.id
        else:
            self.ops.append(Op("create", path=path, node=node.id))
        return node.id

    def inside(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def normal(self, path: Any) -> str:
        """An absolute path with its directory's symlinks resolved (the entry itself kept)."""
        path = os.fspath(path)
        head, tail = os.path.split(os.path.abspath(path))
        return os.path.join(os.path.realpath(head), tail)

    def node_for(self, path: str) -> int | None:
        """The node ``path`` names now, registering it (created now) if the log lacks it."""
        if not self.inside(path) or path.endswith(_NOT_MODELLED_SUFFIXES):
            return None
        with self._lock:
            found = self._current.get(path)
            if found is None:
                found = self._new_node(path, is_dir=os.path.isdir(path))
            return found

    def log(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def dirsync(self, directory: str) -> None:
        if self.inside(directory):
            self.log(Op("dirsync", path=directory))

    def mark(self, kind: str, value: Any = None) -> None:
        """Note a workload event (an acknowledged append, a sink commit) here in the log."""
        with self._lock:
            self.marks.append(Mark(len(self.ops), kind, value))

    @contextlib.contextmanager
    def serial(self) -> Iterator[None]:
        with self._lock:
            yield

    def xOpen(self, name: str | apsw.URIFilename | None, flags: list[int]) -> PowerFile:
        return PowerFile(self, name, flags)

    def xDelete(self, filename: str, syncdir: bool) -> None:
        path = self.normal(filename)
        with self._lock:
            super().xDelete(filename, syncdir)
            if self.inside(path) and not path.endswith(_NOT_MODELLED_SUFFIXES):
                self._current.pop(path, None)
                self.ops.append(Op("delete", path=path))
                if syncdir:
                    self.ops.append(Op("dirsync", path=os.path.dirname(path)))

    # -- os calls walspool makes itself -----------------------------------------

    def _os_open(self, real: Any) -> Any:
        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            if isinstance(path, int):
                return real(path, flags, mode, dir_fd=dir_fd)
            full = self.normal(_at(path, dir_fd))
            watched = bool(flags & os.O_CREAT) and self.inside(full)
            with self._lock if watched else contextlib.nullcontext():
                existed = watched and os.path.lexists(full)
                fd = real(path, flags, mode, dir_fd=dir_fd)
                if watched and not existed:
                    self._new_node(full, is_dir=False)
            return fd

        return open_

    def _os_mkdir(self, real: Any) -> Any:
        def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
            full = self.normal(_at(path, dir_fd))
            with self._lock:
                real(path, mode, dir_fd=dir_fd)
                if self.inside(full):
                    self._new_node(full, is_dir=True)

        return mkdir

    def _os_fsync(self, real: Any) -> Any:
        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            with self._lock:
                real(fd)
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    return
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    self.dirsync(target)
                elif (node := self._current.get(target)) is not None:
                    self.ops.append(Op("sync", node=node))

        return fsync

    # -- crash states ------------------------------------------------------------

    def crash_state(self, cut: int, sample: int) -> CrashState:
        """The files as a disk may hold them after a power cut before operation ``cut``."""
        rng = random.Random(f"{self.seed}:{cut}:{sample}")
        mode = ("synced", "all", "prefix")[sample] if sample < 3 else "random"
        ops = self.ops[:cut]
        horizon = rng.randrange(cut + 1) if mode == "prefix" else cut
        durable = {nid: bytearray(n.initial) for nid, n in self.nodes.items()}
        pending: dict[int, list[tuple[int, Op]]] = {}
        current = dict(self._baseline)
        on_disk = dict(self._baseline)  # path -> node, as of its directory's last sync
        changed_at: dict[str, int] = {}
        for i, op in enumerate(ops):
            if op.kind in ("write", "truncate"):
                pending.setdefault(op.node, []).append((i, op))
            elif op.kind == "sync":
                for _, done in pending.pop(op.node, []):
                    _apply(durable[op.node], done)
            elif op.kind == "create":
                current[op.path] = op.node
                changed_at[op.path] = i
            elif op.kind == "delete":
                current.pop(op.path, None)
                changed_at[op.path] = i
            elif op.kind == "dirsync":
                for path in set(current) | set(on_disk):
                    if os.path.dirname(path) == op.path:
                        if path in current:
                            on_disk[path] = current[path]
                        else:
                            on_disk.pop(path, None)
        outcomes = dict.fromkeys(
            ("skipped", "applied", "torn", "zeros", "entries_lost", "entries_kept"), 0
        )
        chosen: dict[str, int] = {}
        for path in set(current) | set(on_disk):
            old, new = on_disk.get(path), current.get(path)
            if old == new:
                pick = new
            else:
                if mode == "synced":
                    take_new = False
                elif mode == "all":
                    take_new = True
                elif mode == "prefix":
                    take_new = changed_at.get(path, -1) < horizon
                else:
                    take_new = rng.random() < 0.5
                pick = new if take_new else old
                outcomes["entries_kept" if take_new else "entries_lost"] += 1
            if pick is not None:
                chosen[path] = pick
        files: dict[str, bytes] = {}
        dirs: set[str] = set()
        for path, nid in chosen.items():
            if not _parents_present(path, chosen, self.root):
                continue
            rel = os.path.relpath(path, self.root)
            node = self.nodes[nid]
            if node.is_dir:
                dirs.add(rel)
                continue
            data = durable[nid]
            for i, op in pending.get(nid, []):
                outcome = _outcome(rng, mode, i, horizon, op, len(data))
                outcomes[outcome] += 1
                _apply(data, op, outcome, rng)
            files[rel] = bytes(data)
        return CrashState(cut, sample, files, dirs, outcomes)


def _parents_present(path: str, chosen: dict[str, int], root: str) -> bool:
    parent = os.path.dirname(path)
    while parent != root and len(parent) > len(root):
        if parent not in chosen:
            return False
        parent = os.path.dirname(parent)
    return True


def _outcome(rng: random.Random, mode: str, i: int, horizon: int, op: Op, size: int) -> str:
    if mode == "synced":
        return "skipped"
    if mode == "all":
        return "applied"
    if mode == "prefix":
        return "applied" if i < horizon else "skipped"
    if op.kind == "truncate":
        return rng.choice(("skipped", "applied"))
    multi_sector = op.offset // SECTOR != (op.offset + len(op.data) - 1) // SECTOR
    extends = op.offset + len(op.data) > size
    choices = ["skipped", "applied"]
    if multi_sector:
        choices.append("torn")
    if extends:
        choices.append("zeros")
    return rng.choice(choices)


def _apply(
    data: bytearray, op: Op, outcome: str = "applied", rng: random.Random | None = None
) -> None:
    if outcome == "skipped":
        return
    if op.kind == "truncate":
        if op.offset < len(data):
            del data[op.offset :]
        else:
            data.extend(bytes(op.offset - len(data)))
        return
    end = op.offset + len(op.data)
    if len(data) < end:
        data.extend(bytes(end - len(data)))
    if outcome == "zeros":
        return
    if outcome == "applied":
        data[op.offset : end] = op.data
        return
    assert outcome == "torn" and rng is not None
    start = op.offset
    while start < end:
        stop = min(end, (start // SECTOR + 1) * SECTOR)
        if rng.random() < 0.5:
            data[start:stop] = op.data[start - op.offset : stop - op.offset]
        start = stop


class PowerFile(apsw.VFSFile):
    """One open file of the shim: forwards to the base file, logging what it changes."""

    def __init__(
        self, vfs: PowerVFS, name: str | apsw.URIFilename | None, flags: list[int]
    ) -> None:
        self._vfs = vfs
        path = name.filename() if isinstance(name, apsw.URIFilename) else name
        self._node: int | None = None
        self._dirsync = False
        with vfs.serial():
            super().__init__(vfs.base_name, name, flags)
            if path:
                full = vfs.normal(path)
                self._node = vfs.node_for(full)
                self._dirsync = bool(
                    self._node is not None
                    and flags[0] & apsw.SQLITE_OPEN_CREATE
                    and flags[0] & _DIRSYNC_TYPES
                )
                self._dir = os.path.dirname(full)

    def xWrite(self, data: bytes, offset: int) -> None:
        if self._node is None:
            super().xWrite(data, offset)
            return
        with self._vfs.serial():
            super().xWrite(data, offset)
            self._vfs.log(Op("write", node=self._node, offset=offset, data=bytes(data)))

    def xTruncate(self, newsize: int) -> None:
        if self._node is None:
            super().xTruncate(newsize)
            return
        with self._vfs.serial():
            super().xTruncate(newsize)
            self._vfs.log(Op("truncate", node=self._node, offset=newsize))

    def xSync(self, flags: int) -> None:
        if self._node is None:
            super().xSync(flags)
            return
        with self._vfs.serial():
            super().xSync(flags)
            self._vfs.log(Op("sync", node=self._node))
            if self._dirsync:
                self._dirsync = False
                self._vfs.dirsync(self._dir)


def _at(path: Any, dir_fd: int | None) -> Any:
    """The path ``path`` names, relative to ``dir_fd`` (an ``*at()`` call) or as it is."""
    if dir_fd is None or os.path.isabs(path):
        return path
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fspath(path))


@contextlib.contextmanager
def recording(vfs: PowerVFS) -> Iterator[PowerVFS]:
    """Make ``vfs`` SQLite's default VFS and watch walspool's own file calls for the block."""
    previous = apsw.vfs_names()[0]
    real = (os.open, os.mkdir, os.fsync)
    os.open, os.mkdir, os.fsync = (
        vfs._os_open(real[0]),
        vfs._os_mkdir(real[1]),
        vfs._os_fsync(real[2]),
    )
    apsw.set_default_vfs(vfs.vfs_name)
    try:
        yield vfs
    finally:
        apsw.set_default_vfs(previous)
        os.open, os.mkdir, os.fsync = real
