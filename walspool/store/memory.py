"""What linked gateways hold in memory, published into the spool: the messages a
SIGKILL or a power loss would lose, which the spool itself does not hold yet.

Each gateway process keeps one entry in ``spool_meta``, named ``memory:<pid>@<host>``,
whose value is a ``Held`` encoded as JSON (``walspool.link.memory`` writes it at most
once a second while it changes, and removes it at a clean stop). An entry whose
process is gone is what that process lost: readers show it as lost until the next
gateway on its host starts publishing, which takes it in (``take_lost``): says what
was lost in its log, adds its messages to the total ``memory_lost``
(``walspool.store.totals``) and removes it. Read and written in the caller's
transaction.
"""

from __future__ import annotations

import errno
import os
import socket

import apsw
import msgspec

from . import totals

#: The prefix of the entries' names in ``spool_meta``.
PREFIX = "memory:"
#: Sessions an entry names one by one, those holding the most messages first; the
#: totals count them all.
TOP_SESSIONS = 50

_PUT_SQL = """
INSERT INTO spool_meta (name, value) VALUES (?, ?)
ON CONFLICT (name) DO UPDATE SET value = excluded.value
"""
_DELETE_SQL = "DELETE FROM spool_meta WHERE name = ?"
_READ_SQL = "SELECT name, CAST(value AS BLOB) FROM spool_meta WHERE name >= ? AND name < ?"


class HeldSession(msgspec.Struct, array_like=True, frozen=True):
    """One session's queue: messages, their bytes (as JSON), and when the oldest of
    them was first seen there (epoch seconds)."""

    session_id: str
    messages: int
    bytes: int
    oldest_at: float


class Held(msgspec.Struct, frozen=True):
    """A gateway process's in-memory transcript queues at ``at`` (epoch seconds)."""

    pid: int
    host: str
    #: The process's start time (``/proc/<pid>/stat``, clock ticks since boot): a
    #: later process given the same pid is not this one. None where unknown.
    started: int | None
    at: float
    sessions: int
    messages: int
    bytes: int
    oldest_at: float | None
    top: list[HeldSession]


class Published(msgspec.Struct, frozen=True):
    """A published ``Held`` as a reader sees it: ``alive`` is False once its process
    is gone (what it held was lost with it), None where that cannot be told (another
    host)."""

    held: Held
    alive: bool | None


def name_of(pid: int, host: str) -> str:
    return f"{PREFIX}{pid}@{host}"


def this_host() -> str:
    return socket.gethostname()


def publish(conn: apsw.Connection, pid: int, host: str, held: Held | None) -> None:
    """Put ``held`` as process ``pid``'s entry; None (nothing in memory) removes it."""
    if held is None:
        conn.execute(_DELETE_SQL, (name_of(pid, host),))
    else:
        conn.execute(_PUT_SQL, (name_of(pid, host), msgspec.json.encode(held).decode()))


def read(conn: apsw.Connection) -> list[Published]:
    """Every entry, the largest first; one that does not decode is skipped (an
    operator's edit: it names no messages walspool can count)."""
    found = []
    upper = PREFIX[:-1] + chr(ord(PREFIX[-1]) + 1)
    for _, value in conn.execute(_READ_SQL, (PREFIX, upper)):
        try:
            held = msgspec.json.decode(bytes(value), type=Held)
        except (msgspec.DecodeError, TypeError):
            continue
        found.append(Published(held, _alive(held)))
    found.sort(key=lambda e: (-e.held.messages, e.held.pid))
    return found


def take_lost(conn: apsw.Connection) -> list[Held]:
    """Remove the entries of processes of this host that are gone, adding their messages
    to the total ``MEMORY_LOST``; what each held. In the caller's write transaction,
    so two gateways starting at once take each entry once."""
    lost = [e.held for e in read(conn) if e.alive is False]
    for held in lost:
        conn.execute(_DELETE_SQL, (name_of(held.pid, held.host),))
        totals.add(conn, totals.MEMORY_LOST, held.messages)
    return lost


def _alive(held: Held) -> bool | None:
    if held.host != this_host():
        return None
    try:
        os.kill(held.pid, 0)
    except OSError as exc:
        if exc.errno != errno.EPERM:  # EPERM: someone else's process, alive
            return False
    return held.started is None or started(held.pid) in (None, held.started)


def started(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot, or None (no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold any byte: count after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22
    except (IndexError, ValueError):
        return None
