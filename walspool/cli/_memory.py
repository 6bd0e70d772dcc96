"""What linked gateways hold in memory (``walspool.store.memory``), as the commands
show it: ``stats``, ``ls``, ``watch`` and ``metrics``."""

from __future__ import annotations

from typing import Any

from ..store import memory
from ..store.reader import SpoolReader
from ._output import duration, plural


def as_json(entries: list[memory.Published], now: float) -> list[dict[str, Any]]:
    """The ``memory`` array of ``stats --json`` and ``watch --json``: one object per
    gateway process, the largest first (see docs/cli.md)."""
    return [
        {
            "pid": e.held.pid,
            "host": e.held.host,
            "alive": e.alive,
            "at": e.held.at,
            "age": max(now - e.held.at, 0.0),
            "sessions": e.held.sessions,
            "messages": e.held.messages,
            "bytes": e.held.bytes,
            "oldest_age": None if e.held.oldest_at is None else max(now - e.held.oldest_at, 0.0),
            "top": [
                {
                    "session_id": s.session_id,
                    "messages": s.messages,
                    "bytes": s.bytes,
                    "oldest_age": max(now - s.oldest_at, 0.0),
                }
                for s in e.held.top
            ],
        }
        for e in entries
    ]


def lines(objects: list[dict[str, Any]]) -> list[str]:
    """One line per gateway process (``as_json``'s objects): what its memory holds,
    lost if it is killed; or, once it is gone, what it lost. None published: one line
    that says so."""
    if not objects:
        return ["nothing (no linked gateway holds transcript messages in memory)"]
    out = []
    for o in objects:
        held = f"{o['messages']:,} messages in {plural(o['sessions'], 'session')}"
        if o["oldest_age"] is not None:
            held += f", oldest {duration(o['oldest_age'])}"
        if o["alive"] is False:
            out.append(
                f"LOST: {held}, in the memory of pid {o['pid']}, which is gone (it "
                f"published them {duration(o['age'])} ago)"
            )
        else:
            where = _process(o["pid"], o["host"], o["alive"])
            out.append(f"{held}, in the memory of {where} (lost if the process is killed)")
    return out


def held_of(reader: SpoolReader, session_id: str) -> str:
    """``; N messages of it ...``: what gateway processes published holding of a session
    with no row in the spool (in memory, not spooled yet; or lost with a process that is
    gone), or nothing. Each process names its ``memory.TOP_SESSIONS`` largest sessions."""
    notes = []
    for entry in reader.read(memory.read):
        for held in entry.held.top:
            if held.session_id != session_id:
                continue
            of = f"{plural(held.messages, 'message')} of it"
            if entry.alive is False:
                notes.append(f"{of} were lost with pid {entry.held.pid}, which is gone")
            else:
                where = _process(entry.held.pid, entry.held.host, entry.alive)
                notes.append(
                    f"{of} {'is' if held.messages == 1 else 'are'} in the memory of {where}, "
                    "not spooled yet (lost if the process is killed)"
                )
    return "".join(f"; {note}" for note in notes)


def _process(pid: int, host: str, alive: bool | None) -> str:
    """A live gateway process as the lines name it: its host too when it is another
    one (``alive`` None: it cannot be told from here)."""
    return f"pid {pid}" if alive else f"pid {pid} on {host}"
