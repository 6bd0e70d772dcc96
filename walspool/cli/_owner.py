"""Root runs a command on another user's files as that user. Not public API.

SQLite opens a database's ``-wal``, ``-shm`` and ``-journal`` by path when it needs
them, follows a link there, and, run as root, hands each of them to the database
file's owner (``fchown``) so the gateway can go on using them. Whoever owns the
directory can put a link, or a hard link to a file root owns, at one of those names
between any check walspool makes and SQLite's own ``open``. The open hook refuses such
files on SQLite's own descriptor (``walspool.store.open_guard``); running as the owner
is the second wall: SQLite then opens every name with the owner's rights and chowns
nothing, so the most a swapped name can reach is what the owner could reach anyway.

So every command root runs on another user's files runs in a child process that has
given up root for that user (its primary group and groups, as ``su`` gives them)
before it opens anything: the owner of state.db's directory for a replay into it
(``--into``), else the owner of the spool's directory. The child starts clean: every
descriptor above 2 closed, umask 077, and an environment of its own (the owner's
``HOME``, ``USER``, ``LOGNAME``, a plain ``PATH``; of root's, only the locale, the
terminal, ``TZ``, ``SUDO_USER`` and ``HERMES_HOME``). Root waits for it, passing on its
signals, ends it if the owner stops it, and exits with its status. A replay as root
into another user's state.db must find the spool that user's too (else refused: run it
as the spool's owner). What is not done here: a replay as root into root's own
state.db, and any command on root's own files, runs as root.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import os
import pkgutil
import pwd
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ..errors import UntrustedSpool, WalspoolError
from ..store.directories import open_directory
from ..store.maintenance import RUN_BY_ROOT_ENV
from ..text import printable

#: Signals root passes on to the child while it waits (a terminal's Ctrl-C reaches both).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: What the child keeps of root's environment (everything else is root's business).
KEPT_ENVIRONMENT = (
    "HERMES_HOME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "SUDO_USER",
    "TERM",
    "TZ",
)
#: The child's ``PATH``.
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
#: The child's umask: what it creates is the owner's alone.
CHILD_UMASK = 0o077
#: Codecs the commands use (each is a module, imported at its first lookup).
PRELOADED_CODECS = ("ascii", "latin-1", "utf-8")
#: What a replay imports from the gateway when it runs.
PRELOADED_ELSEWHERE = ("hermes_state", "gateway.session_transcript")


def command_owner(args: argparse.Namespace) -> int | None:
    """The user a command must run as, or None to run in this process: when root runs
    it, the owner of state.db's directory for a replay into it (``--into``), else of the
    spool's directory, where that is another user. Where the directory cannot be
    checked, None: the command itself reports why."""
    if os.geteuid() != 0:
        return None
    into = getattr(args, "into", None)
    target = into if isinstance(into, Path) else getattr(args, "spool", None)
    if not isinstance(target, Path):
        return None
    try:
        with open_directory(target.parent, target) as directory:
            owner = directory.owner
    except (OSError, UntrustedSpool):
        return None
    return owner if owner != 0 else None


def run_as(owner: int, args: argparse.Namespace, command: Callable[[], int]) -> int:
    """Run ``command`` in a child process that has become ``owner``; its exit status.

    The paths in ``args`` are made absolute (and their ``..`` resolved) first: the
    owner may not be allowed to look up names in root's working directory.
    """
    for name in ("spool", "into"):
        value = getattr(args, name, None)
        if isinstance(value, Path):
            setattr(args, name, Path(os.path.abspath(value)))
    args.func = _refusing_another_owners_spool(args, owner)
    _preload()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would print root's buffered output a second time
    pid = os.fork()
    if pid == 0:
        _child(owner, command)
    return _wait(pid)


def _refusing_another_owners_spool(
    args: argparse.Namespace, owner: int
) -> Callable[[argparse.Namespace], int]:
    """``args.func``, refusing first (as the command's error) a spool whose directory
    is not ``owner``'s: read as root, before the switch, so the refusal says why
    rather than the owner's "permission denied"."""
    func, spool = args.func, getattr(args, "spool", None)
    found = owner
    if isinstance(spool, Path):
        try:
            with open_directory(spool.parent, spool) as directory:
                found = directory.owner
        except (OSError, UntrustedSpool):
            pass  # the command meets it again, as the owner, and says so

    def checked(args: argparse.Namespace) -> int:
        if found != owner:
            raise WalspoolError(
                f"as root, the replay into {args.into} runs as its owner, uid {owner} (see "
                f"docs/security.md), who does not own the spool {spool} (uid {found}): "
                f"give the spool's directory and files to uid {owner} (chown -R), then replay again"
            )
        return int(func(args))

    return checked


def _preload() -> None:
    """Import, as root, every module a command may import when it runs: a Python
    installed where the owner may not read (root's own, under a 0700 home) can then
    still run it."""
    for package in ("cli", "replay", "store"):
        found = importlib.import_module(f"walspool.{package}")
        for module in pkgutil.iter_modules(found.__path__, f"{found.__name__}."):
            if not module.name.endswith(".__main__"):  # that one runs the command line
                importlib.import_module(module.name)
    for codec in PRELOADED_CODECS:
        codecs.lookup(codec)
    for name in PRELOADED_ELSEWHERE:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the replay says what to install


def _child(owner: int, command: Callable[[], int]) -> None:
    """Become ``owner``, run ``command``, and leave the process with its status: never
    returns into the caller's frames, which are root's."""
    status, doing = 1, "cannot run as"
    try:
        fresh_start(owner)
        become(owner)
        doing = "failed running as"
        status = command()
    except BaseException as exc:  # the child must reach os._exit
        print(f"walspool: {doing} uid {owner}: {printable(repr(exc))}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # exiting regardless
                pass
        os._exit(status)


def fresh_start(owner: int) -> None:
    """Leave root's process state behind before becoming ``owner``: descriptors above
    2 closed (none of root's files reach the owner's process; where ``sys.stdout`` or
    ``sys.stderr`` write elsewhere, those kept), umask ``CHILD_UMASK``,
    the environment made anew (``KEPT_ENVIRONMENT`` of root's, the owner's ``HOME``,
    ``USER`` and ``LOGNAME``, ``CHILD_PATH``, and ``RUN_BY_ROOT_ENV``)."""
    _close_descriptors_above_2()
    os.umask(CHILD_UMASK)
    try:
        entry = pwd.getpwuid(owner)
        name, home = entry.pw_name, entry.pw_dir
    except KeyError:
        name, home = str(owner), "/"
    kept = {key: os.environ[key] for key in KEPT_ENVIRONMENT if key in os.environ}
    os.environ.clear()
    os.environ.update(kept, HOME=home, USER=name, LOGNAME=name, PATH=CHILD_PATH)
    os.environ[RUN_BY_ROOT_ENV] = "1"  # the audit's actor says who asked


def _close_descriptors_above_2() -> None:
    """Close every descriptor above 2 but those ``sys.stdout`` and ``sys.stderr`` write
    to: 1 and 2 themselves, but for a caller that put other files there (a test's
    capture)."""
    kept = set()
    for stream in (sys.stdout, sys.stderr):
        try:
            kept.add(stream.fileno())
        except (AttributeError, OSError, ValueError):
            pass
    start = 3
    for fd in sorted(fd for fd in kept if fd >= 3):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def become(owner: int) -> None:
    """Give up root for ``owner`` for good: its primary group and groups from the
    user database (none but the primary one where it has no entry there), then its
    uid (real, effective and saved, so root cannot be taken back)."""
    try:
        entry = pwd.getpwuid(owner)
        gid, groups = entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)
    except KeyError:
        gid, groups = owner, [owner]
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(owner, owner, owner)


def _wait(pid: int) -> int:
    """Wait for the child, passing on the signals root gets; its exit status (128 +
    the signal's number when a signal ended it, as a shell reports it).

    The child runs as the owner, who may stop it (SIGSTOP): root would then wait for
    ever, and the signals it passes on would wait with the child. A child found
    stopped while root waits is ended (SIGKILL: what it had committed stays, its rows
    in flight are looked up by the next replay), and root says so and fails. A stop
    that ended before root looked (a terminal's Ctrl-Z then ``fg``, which stopped and
    continued root too) is no reason.
    """

    def forward(signum: int, frame: FrameType | None) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            _, status = os.waitpid(pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                break
            if _stopped(pid):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print(
                    f"walspool: the command running as the files' owner (pid {pid}) was "
                    f"stopped ({signal.Signals(os.WSTOPSIG(status)).name}) while root waited "
                    "for it (its owner may stop it); root ended it. What it committed stays; "
                    "run it again (rows a replay had out are looked up first)",
                    file=sys.stderr,
                )
                return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped now (``/proc``: state T or t)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return bool(fields) and fields[0] in (b"T", b"t")
