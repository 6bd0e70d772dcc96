"""A gateway's in-memory transcript queues spooled at its stop: one implementation for
every gateway (the 0.19.0 link's ``Shutdown.flush_queues``, the plugin's stop on 0.20
and 0.22), each telling it only what its side knows (``Queues``).

The queues are taken under the store's lock, in arrival order, and handed to the
spool's writer without waiting, so no message of theirs is queued, evicted or written
meanwhile and no gateway thread waits on the spool: the commit is waited for outside
the lock. A session whose oldest message is being written is left to that write. A
flush the spool fails to commit puts its messages back at the front of their queues
(they stay with the process, as in the released store), unless the transcript was
rewritten meanwhile, which dropped the queue they were in.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from typing import Protocol

from ..errors import WalspoolError
from ..store.records import SHUTDOWN, Receipt
from ..store.spool import Spool
from ..store.writer import Request, Row
from . import bounds
from .lines import report_unspoolable
from .state import log
from .transcripts import Message, Transcripts


class Queues(Protocol):
    """A gateway's side of the flush; each method is called with the store's lock held."""

    @property
    def transcripts(self) -> Transcripts:
        """The store whose queues are flushed."""

    def writing(self, session_id: str, pending: list[Message]) -> bool:
        """Whether the session's oldest message is being written now (its queue is left
        to that write)."""

    def taken(self, session_id: str, rows: Sequence[Row]) -> object:
        """The spool's writer accepted ``rows``, the session's queue: a token for
        ``rewritten``."""

    def rewritten(self, session_id: str, token: object) -> bool:
        """Whether the session's transcript was rewritten since ``taken`` gave ``token``."""

    def settled(self, session_id: str, rows: Sequence[Row], receipts: list[Receipt] | None) -> None:
        """The flush committed ``rows`` (``receipts``) or failed (None)."""


def spool_queues(
    spool: Spool,
    queues: Queues,
    *,
    clock: Callable[[], float] = time.monotonic,
    deadline: float | None = None,
) -> int:
    """Spool every queue of ``queues.transcripts`` (``SHUTDOWN``), oldest first, and
    take them out of the queues; how many messages were spooled.

    Waits until ``deadline`` (on ``clock``, the caller's monotonic seconds; default
    ``bounds.FLUSH_TIMEOUT`` from now) for room in the spool's writer and for the
    commit (``bounds.CONFIRM_WAIT`` more); a message the spool cannot take at all
    stays queued. Every failure is logged at ERROR; none raises.
    """
    transcripts = queues.transcripts
    if deadline is None:
        deadline = clock() + bounds.FLUSH_TIMEOUT
    committed = threading.Event()
    requests: list[Request] = []  # the spool's request, once committed or failed
    while True:
        with transcripts.lock:
            taken, rows, notes = _queued_rows(spool, queues)
            if not rows:
                _run(notes)
                return 0
            #: Each session's token when its queue was taken (filled below, before
            #: ``settled`` can read it: the lock is held).
            tokens: dict[str, object] = {}
            settled = _settler(queues, taken, tokens, committed, requests)
            try:
                spool.check_path()  # a replaced spool is refused before a queue is touched
                spool.put_nowait(rows, settled, single=False)
            except queue.Full:
                pass
            except WalspoolError as exc:  # closed, or its path names another file
                refused: WalspoolError | None = exc
                break
            else:
                refused = None
                for session_id, (messages, session_rows) in taken.items():
                    ids = {id(m) for m in messages}
                    pending = transcripts.queues[session_id]
                    pending[:] = [m for m in pending if id(m) not in ids]
                    tokens[session_id] = queues.taken(session_id, session_rows)
                break
        if clock() >= deadline:
            log.error(
                "could not spool %d queued transcript message(s) at shutdown: the spool "
                "%s had no room for them within %g s",
                len(rows),
                spool.path,
                bounds.FLUSH_TIMEOUT,
            )
            return 0
        spool.wait_for_room(max(deadline - clock(), 0.0))
    _run(notes)
    if refused is not None:
        log.error(
            "could not spool %d queued transcript message(s) at shutdown; they stay queued: %s",
            len(rows),
            refused,
        )
        return 0
    if not committed.wait(max(deadline - clock(), 0.0) + bounds.CONFIRM_WAIT):
        log.error(
            "%d queued transcript message(s) were handed to %s at shutdown but not "
            "committed within %g s; they are spooled if the spool commits them later",
            len(rows),
            spool.path,
            bounds.FLUSH_TIMEOUT,
        )
        return 0
    (request,) = requests
    if request.error is not None:
        log.error(
            "could not spool %d queued transcript message(s) at shutdown to %s; they "
            "stay queued: %s",
            len(rows),
            spool.path,
            request.error,
        )
        return 0
    log.warning("Spooled %d queued transcript message(s) to %s at shutdown", len(rows), spool.path)
    return len(rows)


#: A session's queue as taken: its messages, and their rows.
TakenQueues = dict[str, tuple[list[Message], list[Row]]]


def _queued_rows(
    spool: Spool, queues: Queues
) -> tuple[TakenQueues, list[Row], list[Callable[[], None]]]:
    """Every queue's messages, as spool rows, but the queues of sessions whose oldest
    message is being written; and the lines to log. The lock is held."""
    taken: TakenQueues = {}
    rows: list[Row] = []
    notes: list[Callable[[], None]] = []
    for session_id, pending in queues.transcripts.queues.items():
        if pending and queues.writing(session_id, pending):
            continue  # left to that write (the stop waited for it, and said so)
        for message in pending:
            try:
                row = spool.prepare(session_id, message, SHUTDOWN)
            except Exception as exc:  # noqa: BLE001 - the others are spooled all the same
                notes.append(partial(report_unspoolable, session_id, exc))
                continue
            messages, session_rows = taken.setdefault(session_id, ([], []))
            messages.append(message)
            session_rows.append(row)
            rows.append(row)
    return taken, rows, notes


def _settler(
    queues: Queues,
    taken: TakenQueues,
    tokens: dict[str, object],
    committed: threading.Event,
    requests: list[Request],
) -> Callable[[Request], None]:
    """The spool writer's callback for the flush (on its thread)."""

    def settled(request: Request) -> None:
        # The receipts in the rows' order: each session's, in turn.
        receipts = None if request.error is not None else iter(request.result)
        transcripts = queues.transcripts
        with transcripts.lock:
            for session_id, (messages, rows) in taken.items():
                mine = None if receipts is None else list(islice(receipts, len(rows)))
                if receipts is None and not queues.rewritten(session_id, tokens[session_id]):
                    transcripts.queues.setdefault(session_id, [])[0:0] = messages
                queues.settled(session_id, rows, mine)
        requests.append(request)
        committed.set()

    return settled


def _run(notes: list[Callable[[], None]]) -> None:
    for note in notes:
        note()
