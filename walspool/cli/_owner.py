"""Root's ``walspool replay`` runs as the owner of state.db. Not public API.

SQLite opens a database's ``-wal``, ``-shm`` and ``-journal`` by path when it needs
them, follows a link there, and, run as root, hands each of them to the database
file's owner (``fchown``) so the gateway can go on using them. Whoever owns
state.db's directory can put a link, or a hard link to a file root owns, at one of
those names between any check walspool makes and SQLite's own ``open``: root's
replay would then give that file away. No check made beforehand closes that race.
Running as the owner does: SQLite then opens those names with the owner's rights and
chowns nothing, so the most a swapped name can reach is what the owner could reach
anyway.

So a replay started as root, into a state.db whose directory another user owns, runs
in a child process that has given up root for that user (its primary group and
groups, as ``su`` gives them) before it opens anything; root waits for it and exits
with its status. The spool must then be that user's too (a replay as root of a spool
another user owns is refused by the child: run it as the spool's owner). What is not
done here: a replay as root into root's own state.db runs as root, as before.
"""

from __future__ import annotations

import argparse
import os
import pwd
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ..errors import UntrustedSpool, WalspoolError
from ..store.directories import open_directory

#: Signals root passes on to the child while it waits (a terminal's Ctrl-C reaches both).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def state_db_owner(args: argparse.Namespace) -> int | None:
    """The user a command must run as, or None to run in this process: the owner of
    state.db's directory when root runs a command that opens it (``--into``) and that
    directory is another user's. Where the directory cannot be checked, None: the
    command itself reports why."""
    into = getattr(args, "into", None)
    if os.geteuid() != 0 or not isinstance(into, Path):
        return None
    try:
        with open_directory(into.parent, into) as directory:
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
    """Import, as root, what a replay imports when it runs: a Python installed where
    the owner may not read (root's own, under a 0700 home) can then still run it."""
    from . import _replaying  # noqa: F401

    try:
        import hermes_state  # noqa: F401
    except ImportError:
        pass  # the replay says what to install


def _child(owner: int, command: Callable[[], int]) -> None:
    """Become ``owner``, run ``command``, and leave the process with its status: never
    returns into the caller's frames, which are root's."""
    status, doing = 1, "cannot run as"
    try:
        become(owner)
        doing = "failed running as"
        status = command()
    except BaseException as exc:  # the child must reach os._exit
        print(f"walspool: {doing} uid {owner}: {exc!r}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # exiting regardless
                pass
        os._exit(status)


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
                    f"walspool: the replay running as state.db's owner (pid {pid}) was stopped "
                    f"({signal.Signals(os.WSTOPSIG(status)).name}) while root waited for it "
                    "(its owner may stop it); root ended it. What it committed stays; run "
                    "the replay again (rows it had out are looked up first)",
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
