"""Who has a spool open: the processes holding its open lock. Not public API.

Every open ``walspool.Spool`` (the gateway's, a replay's, requeue's) holds a shared
``flock`` on ``<spool>.open-lock`` for as long as it is open, and the kernel drops it
when the process dies. Linux lists every lock in ``/proc/locks`` with the pid that took
it and the file's device and inode, so the holders are read there, without opening the
lock file or taking any lock: the protocol stays as it is. A killed gateway then shows
as "no process", where a live one that cannot drain shows its pid.

Not guaranteed: ``/proc/locks`` is Linux's (elsewhere the answer is "unknown"); a pid of
another pid namespace shows as 0 or not at all; read commands (``stats``, ``ls``,
``watch``) open no ``Spool`` and so are not listed; a process that took the lock and
then forked is listed by the pid that took it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ..store.files import OPEN_LOCK_SUFFIX
from ..text import printable

PROC_LOCKS = Path("/proc/locks")
#: The longest command line shown for a holder, in characters.
COMMAND_WIDTH = 120


class Holder(msgspec.Struct, frozen=True):
    """A process that has the spool open: its pid and command line (None if unseen)."""

    pid: int
    command: str | None


def holders(spool: Path, locks: Path = PROC_LOCKS) -> list[Holder] | None:
    """The processes holding ``spool``'s open lock, by pid; [] when none does (or there
    is no lock file), None when this system cannot tell (no ``/proc/locks``)."""
    try:
        st = os.stat(f"{spool}{OPEN_LOCK_SUFFIX}", follow_symlinks=False)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: set[int] = set()
    try:
        # A line at a time: every lock of every user is listed, however many there are.
        with locks.open(encoding="ascii", errors="replace") as table:
            for line in table:
                if device not in line:
                    continue
                fields = line.split()
                # "1: FLOCK  ADVISORY  READ  1234 08:01:5678 0 EOF"; "1: -> FLOCK ..." waits.
                if len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != device:
                    continue
                pids.add(int(fields[4]) if fields[4].lstrip("-").isdigit() else 0)
    except OSError:
        return None
    return [Holder(pid, command_of(pid)) for pid in sorted(pids)]


def command_of(pid: int) -> str | None:
    """The command line of process ``pid``, its arguments joined by spaces, cut to
    ``COMMAND_WIDTH``; None when it cannot be read (gone, or not visible here)."""
    if pid <= 0:
        return None
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    text = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    return text if len(text) <= COMMAND_WIDTH else text[: COMMAND_WIDTH - 1] + "…"


def holders_text(found: Sequence[Holder] | None, waiting: int) -> str:
    """The ``open by`` line of ``watch`` and ``stats``: who, or what none means.
    ``waiting``: the rows a gateway or replay would drain (not those set aside)."""
    if found is None:
        return "unknown (this system has no /proc/locks)"
    if not found:
        idle = "; nothing drains its rows until one opens it" if waiting else ""
        return f"no process (no gateway or replay has the spool open{idle})"
    return "; ".join(
        f"pid {h.pid}" + (f" ({printable(h.command)})" if h.command else "") for h in found
    )
