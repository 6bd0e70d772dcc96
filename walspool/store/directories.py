"""Directories opened once and checked, and the files below them reached by descriptor.

A path is only as safe as every directory on the way to it: whoever can write one of
them can swap what the next name means between a check and a use. So a directory is
opened a component at a time from ``/`` (``O_DIRECTORY | O_NOFOLLOW``), each
component checked on its descriptor: owned by root or by the final directory's owner,
and not writable by group or others unless sticky (``/tmp``: there only an entry's
owner may rename it, and the next component's owner is checked in turn). The final
directory must not be writable by group or others at all. Everything below it is then
reached relative to its descriptor (``dir_fd``), never by the path again.

Writable by its group is the same as writable by its owner alone when that group holds
nobody else: a user-private group, as systems that pair each user with a group of its
own and a umask of 002 make (``_private_group``). Such a directory is trusted. What
makes a group private is read from the user and group databases at each open: an
administrator who adds a member later makes the next open refuse, not the ones before.

A POSIX ACL (``system.posix_acl_access``) counts as the mode does: an entry that lets
a named user other than the owner, or a named group that is not the owner's private
one, write a directory makes it writable by others, whatever the mask (which is what
the mode's group bits show once there is an ACL) lets through today.

Symlinks in the directory's own path are resolved once, before the walk (a symlinked
``HERMES_HOME`` is common); a component that turns into a link during the walk makes
the open fail rather than be followed. Each link followed must be root's or the final
directory's owner's: another user's link could point root (or anyone) at a third
user's directory, whose files an import would take and delete. Not guaranteed: that
the directory still has the path it was opened by afterwards (a rename of a directory
the owner controls).
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import stat
import struct
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from ..errors import UntrustedSpool

#: Enough to ``fstat`` a directory and use it as ``dir_fd``, with search permission
#: only (a 0711 directory on the way); Linux's ``O_PATH`` where there is one.
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Flags for every file opened below a directory: no link followed, no FIFO waited on.
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Directory:
    """A checked directory held open; ``fd`` is the ``dir_fd`` for names below it."""

    def __init__(self, fd: int, path: Path, owner: int) -> None:
        self.fd = fd
        self.path = path
        self.owner = owner

    def lstat(self, name: str) -> os.stat_result | None:
        """What ``name`` is in this directory now, links not followed; None if nothing."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``openat`` of ``name`` below this directory, never following a link or
        waiting on a FIFO; the caller checks what it got with ``fstat``."""
        return os.open(name, flags | FILE_FLAGS, mode, dir_fd=self.fd)

    def sync(self) -> None:
        """fsync this directory (see ``files.sync_directory``)."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            sync_fd(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Directory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_directory(
    directory: Path, about: Path, *, create: bool = False, own: bool = False
) -> Directory:
    """Open ``directory`` component by component from ``/`` and check it (see the
    module docstring); ``about`` is the file errors name.

    ``create`` makes missing components (0700, whatever the umask, each entry
    synced). ``own``: unless the process runs as root, the directory must be the
    effective user's (a spool is written only in a directory of one's own).
    Raises ``UntrustedSpool``, or ``OSError`` when the file system refuses.
    """
    real, links = _resolve(directory)
    fd = os.open("/", _WALK)
    try:
        walked = [_looked_at(fd, Path("/"))]
        here = Path("/")
        for name in real.parts[1:]:
            here = here / name
            nfd = _step(fd, name, here, create)
            os.close(fd)
            fd = nfd
            walked.append(_looked_at(fd, here))
        owner = _check_walk(walked, about, own)
        _check_links(links, owner, real, about)
    except BaseException:
        os.close(fd)
        raise
    return Directory(fd, real, owner)


#: Links followed in one path before it counts as a loop, as Linux counts them.
MAX_LINKS = 40


def _resolve(directory: Path) -> tuple[Path, list[tuple[Path, int]]]:
    """``os.path.realpath(directory)``, and each symbolic link followed on the way with
    its owner. A component that does not exist is taken as written (``create`` makes it)."""
    todo = list(Path(os.getcwd(), directory).parts[1:])[::-1]  # the next name is last
    here = Path("/")
    links: list[tuple[Path, int]] = []
    while todo:
        name = todo.pop()
        if name == "..":
            here = here.parent
            continue
        candidate = here / name
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            here = candidate
            continue
        if not stat.S_ISLNK(st.st_mode):
            here = candidate
            continue
        if len(links) == MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(directory))
        links.append((candidate, st.st_uid))
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            here = Path("/")
        todo += list(target.parts[1:] if target.is_absolute() else target.parts)[::-1]
    return here, links


def _check_links(links: list[tuple[Path, int]], owner: int, real: Path, about: Path) -> None:
    """Refuse a path that follows a link of someone but root and the directory's owner."""
    for link, uid in links:
        if uid not in (0, owner):
            raise UntrustedSpool(
                f"{link}, on the way to {about}, is a symbolic link of uid {uid} to "
                f"{real}, which belongs to uid {owner}: only root's or the owner's own "
                "links are followed, or another user could point this at files not theirs; "
                f"name {real} itself if that is meant",
                path=about,
            )


def _step(fd: int, name: str, here: Path, create: bool) -> int:
    try:
        return os.open(name, _WALK, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o700, dir_fd=fd)
    except FileExistsError:
        return os.open(name, _WALK, dir_fd=fd)  # made meanwhile: checked as any other
    made = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        os.fchmod(made, 0o700)  # whatever the umask
    finally:
        os.close(made)
    Directory(fd, here.parent, -1).sync()  # the new entry survives a power cut
    return os.open(name, _WALK, dir_fd=fd)


class _Looked(NamedTuple):
    """A directory of the walk, as its descriptor shows it."""

    path: Path
    st: os.stat_result
    #: Its ACL entries that let someone but its owner write it, as ``getfacl`` prints them.
    acl_writers: list[str]


def _looked_at(fd: int, path: Path) -> _Looked:
    st = os.fstat(fd)
    return _Looked(path, st, _acl_writers(fd, st.st_uid))


#: ``system.posix_acl_access``: a version, then (tag, permissions, id) entries.
_ACL_VERSION = 2
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_USER, _ACL_GROUP = 0x02, 0x08
_ACL_WRITE = 0x02


def _acl_writers(fd: int, owner: int) -> list[str]:
    """The ACL entries of the directory open as ``fd`` that let a named user other than
    ``owner``, or a named group that is not ``owner``'s private group, write it. Read
    through the descriptor (``/proc/self/fd``: an ``O_PATH`` descriptor has no xattr
    calls of its own); none where the file system keeps no ACL."""
    try:
        raw = os.getxattr(f"/proc/self/fd/{fd}", "system.posix_acl_access")
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return []
        raise
    if len(raw) < 4 or int.from_bytes(raw[:4], "little") != _ACL_VERSION:
        return [f"an ACL walspool cannot read ({len(raw)} bytes)"]
    writers = []
    for offset in range(4, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size):
        tag, perm, who = _ACL_ENTRY.unpack_from(raw, offset)
        if not perm & _ACL_WRITE:
            continue
        if tag == _ACL_USER and who not in (owner, 0):
            writers.append(f"user:{_user_name(who)}:{_perm_text(perm)}")
        elif tag == _ACL_GROUP and not _private_group(who, owner):
            writers.append(f"group:{_group_name(who)}:{_perm_text(perm)}")
    return writers


def _perm_text(perm: int) -> str:
    return "".join(c if perm & bit else "-" for c, bit in (("r", 4), ("w", 2), ("x", 1)))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _check_walk(walked: list[_Looked], about: Path, own: bool) -> int:
    """The final directory's owner, once every directory on the way is trusted."""
    directory, st, acl = walked[-1]
    euid = os.geteuid()
    if own and euid != 0 and st.st_uid != euid:
        raise UntrustedSpool(
            f"the spool's directory {directory} belongs to uid {st.st_uid}, not to you "
            f"(uid {euid}); put the spool in a directory of your own",
            path=about,
        )
    if _writable_by_others(st):
        raise UntrustedSpool(
            f"the directory {directory} of {about.name} is writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}{_group_note(st)}), so anyone could replace "
            f"the files in it; run `chmod go-w {directory}`",
            path=about,
        )
    if acl:
        raise UntrustedSpool(
            f"the directory {directory} of {about.name} may be written by others through "
            f"its ACL ({', '.join(acl)}), so they could replace the files in it; run "
            f"`setfacl -b {directory}` (or remove those entries)",
            path=about,
        )
    owner = st.st_uid
    for above, ast, above_acl in walked[:-1]:
        if ast.st_uid not in (0, owner):
            raise UntrustedSpool(
                f"{above}, on the way to {about}, belongs to uid {ast.st_uid}, neither root "
                f"nor the directory's owner (uid {owner}), who could swap what the path "
                "names; move the files to a path only root and their owner control",
                path=about,
            )
        if _writable_by_others(ast) and not ast.st_mode & stat.S_ISVTX:
            raise UntrustedSpool(
                f"{above}, on the way to {about}, is writable by group or others (mode "
                f"{stat.S_IMODE(ast.st_mode):o}{_group_note(ast)}) and not sticky, so anyone "
                f"could swap what the path names; run `chmod go-w {above}` or "
                f"`chmod +t {above}`",
                path=about,
            )
        if above_acl and not ast.st_mode & stat.S_ISVTX:
            raise UntrustedSpool(
                f"{above}, on the way to {about}, may be written by others through its ACL "
                f"({', '.join(above_acl)}) and is not sticky, so they could swap what the "
                f"path names; run `setfacl -b {above}` (or remove those entries)",
                path=about,
            )
    return owner


def _writable_by_others(st: os.stat_result) -> bool:
    """Whether anyone but the directory's owner (and root) may write it: others, or a
    group that is not the owner's private group."""
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _private_group(st.st_gid, st.st_uid)


def _private_group(gid: int, owner: int) -> bool:
    """Whether group ``gid`` can hold nobody but ``owner``: the owner's primary group,
    named as the owner (the user-private group convention), listing no other member,
    and no other user's primary group. Never group 0: containers hand it to processes
    no user database lists (an arbitrary uid run with gid 0, as OpenShift does).

    Read from the user and group databases now (NSS: files, LDAP, ...). Not seen, so
    not guaranteed: a process that still holds the group from before an administrator
    removed its user from it, a group password (``newgrp``), and users a database does
    not list (``pwd.getpwall`` lists only what NSS enumerates; the name rule keeps
    shared primary groups such as ``users`` out all the same).
    """
    if gid == 0:
        return False
    try:
        user = pwd.getpwuid(owner)
        group = grp.getgrgid(gid)
    except KeyError:  # a uid or gid no database names: nobody can say who is in it
        return False
    if user.pw_gid != gid or group.gr_name != user.pw_name:
        return False
    if any(member != user.pw_name for member in group.gr_mem):
        return False
    return not any(entry.pw_gid == gid and entry.pw_uid != owner for entry in pwd.getpwall())


def _group_note(st: os.stat_result) -> str:
    """Why a group-writable directory's group is not trusted, for the message."""
    if st.st_mode & stat.S_IWOTH or not st.st_mode & stat.S_IWGRP:
        return ""
    try:
        name = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        name = str(st.st_gid)
    return f"; its group {name} is not its owner's alone"


def changed(name: Path, about: Path) -> UntrustedSpool:
    """The error for a file that was swapped between its check and its use."""
    return UntrustedSpool(
        f"{name} changed while walspool was opening it (replaced, or linked "
        "elsewhere); nothing was used from it: if nobody else changes the spool's "
        "directory, try again",
        path=about,
    )


def sync_fd(fd: int) -> None:
    """fsync an open directory (``sync_directory``)."""
    try:
        if _full_fsync(fd):
            return
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise


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
