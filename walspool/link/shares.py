"""The gateway link's count of each session's bytes in the spool, its share of the cap
(``walspool.link.budget.Shares``): counted once when the link starts, then lowered by the rows
the link's own replays move out of the spool.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator, Sequence

from ..replay.sinks import SessionDBSink, Ticket
from ..store import streams
from ..store.records import Record
from ..store.spool import Spool
from .budget import Shares

#: Rows a replay's sink noted that are looked up again at most; past it the noted rows
#: are checked and those still in the spool but the latest forgotten (see ``Moving``).
NOTED_ROWS = 4096


def empty(spool: Spool) -> bool:
    """True when the spool surely holds no row (one probe); False if it cannot tell."""
    try:
        return streams.empty(spool)
    except Exception:  # noqa: BLE001 - then the background count finds out
        return False


def count(spool: Spool) -> tuple[dict[str, int], int]:
    """Each session's payload bytes in the spool, and the largest row id seen."""
    return streams.bytes_by_session(spool)


class Moving:
    """The link's sink: its own (``sink``, looked up at each call) which, during a replay
    the link counts (``counting``), also notes the id, session and size of every row the
    replay hands it or finds landed, read from the spool while the row is still there.
    Afterwards, the rows noted that are no longer in the spool are those that left."""

    def __init__(self, sink: SessionDBSink, spool: Spool, shares: Shares) -> None:
        self.sink = sink
        self.spool = spool
        self.shares = shares
        #: The noting of the replay running on each thread (the link's drains take
        #: turns, ``recover`` may run beside one).
        self._local = threading.local()

    @contextlib.contextmanager
    def counting(self) -> Iterator[Noted]:
        """Note the rows of the replays this thread runs in the block."""
        noted = self._local.noted = Noted(self.spool)
        try:
            yield noted
        finally:
            self._local.noted = None

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        self._note([record.id])
        self.sink.write(session_id, record, ticket)

    def write_many(self, session_id: str, items: Sequence[tuple[Record, Ticket]]) -> None:
        self._note([record.id for record, _ in items])
        self.sink.write_many(session_id, items)

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None:
        found = self.sink.landed(tickets)
        if found:
            self._note([ticket[2] for ticket in found])  # (spool uid, number, row id)
        return found

    def batchable(self, record: Record) -> bool:
        return self.sink.batchable(record)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        self.sink.forget(spool, below, keep)

    def __str__(self) -> str:
        return str(self.sink)

    def __repr__(self) -> str:
        return repr(self.sink)

    def _note(self, ids: list[int]) -> None:
        noted = getattr(self._local, "noted", None)
        if noted is None:
            return
        if noted.epoch is None:
            noted.epoch = self.shares.epoch
        noted.add(ids)


class Noted:
    """The rows one replay handed the sink: their sessions and sizes, until they left."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        #: The shares' epoch when the replay first handed the sink a row.
        self.epoch: int | None = None
        self.rows: dict[int, tuple[str | None, int]] = {}
        self.left: dict[str, int] = {}

    def add(self, ids: list[int]) -> None:
        new = [i for i in ids if i not in self.rows]
        if not new:
            return
        if len(self.rows) + len(new) > NOTED_ROWS:
            self._check()
            # Rows still there from earlier batches (held, quarantined) stay there in
            # this replay: only the latest, of the batch being written, are kept.
            for row_id in list(self.rows)[: max(len(self.rows) - NOTED_ROWS // 2, 0)]:
                del self.rows[row_id]
        try:
            found = streams.sizes(self.spool, new)
        except Exception:  # noqa: BLE001 - never fail a write for this: they stay counted
            return
        for row_id, session_id, size in found:
            self.rows[row_id] = (session_id, size)

    def _check(self) -> None:
        """Move the noted rows no longer in the spool to ``left``."""
        if not self.rows:
            return
        try:
            present = streams.present(self.spool, self.rows)
        except Exception:  # noqa: BLE001 - then they stay counted
            return
        for row_id in [i for i in self.rows if i not in present]:
            session_id, size = self.rows.pop(row_id)
            if session_id is not None:
                self.left[session_id] = self.left.get(session_id, 0) + size

    def gone(self) -> dict[str, int]:
        """Payload bytes per session of the noted rows that left the spool."""
        self._check()
        return self.left
