"""The single writer: one thread owns the write connection and commits in groups.

Callers put requests on a bounded queue and wait for them. The writer takes
everything queued, runs it in one ``BEGIN IMMEDIATE`` transaction (one fsync), and
only after ``COMMIT`` returns does it wake the callers. A lone caller pays one commit
per request; N concurrent callers share about one commit per N requests. The queue
is bounded by requests and by payload bytes; a full queue blocks the caller that puts
(backpressure), so memory stays bounded; ``notify_nowait`` raises ``queue.Full``
instead, for callers that must not wait. Once a group's waiters are woken the writer
drops its requests, so an idle writer holds no payload of its own (SQLite keeps the
last row's text bound to its cached INSERT until the next insert: one payload).
Not guaranteed: payloads held at once are bounded by ``QUEUE_BYTES`` queued plus one
group being committed (taken from the queue, so at most as large again), not by
``QUEUE_BYTES`` alone.

If a group fails, its requests are retried one by one, so one bad request fails
alone and the others still commit.

Waits are bounded. While another connection holds the spool's write lock, a group
waits for it at most ``BUSY_RETRY_SECONDS`` (then each of its requests fails with
``SpoolBusy``, so every waiter wakes). A caller that must hear within a bound
(``call(request, within=s)``) gets the commit, its failure, or ``NotInTime`` with
nothing written: taken back from the queue, or failed at its deadline by a commit
still waiting for the lock; it waits longer only for a commit already under way;
``close`` waits at most ``CLOSE_TIMEOUT`` for
what was accepted, then fails the rest and logs at ERROR how many messages were not
committed. Not guaranteed: a commit stuck inside the operating system (an fsync on a
hung disk) is not interrupted; ``close`` then returns with the thread still running.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import apsw

from .. import text
from ..errors import SpoolClosed, SpoolFull, SpoolReplaced, WalspoolError
from . import totals
from .records import Receipt
from .sqlite_errors import sqlite_error

log = text.logger("walspool.writer")

_LockType = type(_thread.allocate_lock())

#: Requests the queue holds before ``put`` blocks.
QUEUE_REQUESTS = 4096
#: Payload bytes the queue holds before ``put`` blocks. A request larger than this is
#: still taken when the queue holds no payload, so no size is refused for the bound.
QUEUE_BYTES = 256 * 1024 * 1024
#: The spool's pages in use, in bytes (the gateway link's cap counts these).
LIVE_BYTES_SQL = (
    "SELECT (p.page_count - f.freelist_count) * s.page_size "
    "FROM pragma_page_count() p, pragma_freelist_count() f, pragma_page_size() s"
)
#: A group stops growing at this many rows (one request is never split).
GROUP_ROWS = 8192
#: Seconds a group waits for a write lock held by another connection (an operator's
#: ``sqlite3`` shell, a stopped import) before its requests fail with ``SpoolBusy``.
BUSY_RETRY_SECONDS = 10.0
#: Seconds ``close`` waits for accepted requests to commit before it gives up on them.
CLOSE_TIMEOUT = 10.0
#: Seconds ``close`` then waits for the writer to fail the rest (no SQLite wait is
#: left by then: a busy wait ends at once, queued requests fail without a try).
CLOSE_GRACE = 2.0
#: Longest pause between two looks at a busy write lock; short enough that a
#: released lock is taken at once, long enough not to spin.
BUSY_POLL_SECONDS = 0.05

# A stream's next seq: one above its highest seq in records, but never below the
# number ``sequences`` kept when its rows left (schema.KEEP_NEXT_SEQ_SQL), so a drained
# stream never reuses a seq and an append never writes ``sequences``.
NEXT_SEQ_BY_ID_SQL = """
SELECT max(
    coalesce((SELECT next_seq FROM sequences WHERE stream = 'session_id' AND name = ?1), 1),
    coalesce((SELECT max(seq) + 1 FROM records WHERE session_id = ?1), 1))
"""
NEXT_SEQ_BY_KEY_SQL = """
SELECT max(
    coalesce((SELECT next_seq FROM sequences WHERE stream = 'session_key' AND name = ?1), 1),
    coalesce((SELECT max(seq) + 1 FROM records WHERE session_id IS NULL AND session_key = ?1), 1))
"""
#: The highest row id given so far: in ``records``, or kept in ``spool_meta`` once its
#: row left (``schema.KEEP_NEXT_ID_SQL``).
MAX_ID_SQL = """
SELECT max(coalesce((SELECT max(id) FROM records), 0),
           coalesce((SELECT value FROM spool_meta WHERE name = 'next_id'), 1) - 1)
"""
INSERT_RECORD_SQL = """
INSERT INTO records (id, session_id, seq, reason, session_key, created_at, payload, size)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
QUARANTINE_NEW_SQL = """
UPDATE records SET status = 'quarantined', attempts = 1, last_error = ?, last_attempt_at = ?
WHERE id = ?
"""


class Row(NamedTuple):
    """One row to append, its arguments checked and its payload encoded
    (``Spool.prepare``); ``size`` is the payload's length in bytes."""

    session_id: str | None
    session_key: str | None
    reason: str
    created_at: float
    payload: str
    size: int


class SpoolBusy(WalspoolError):
    """Another connection held the spool's write lock past ``BUSY_RETRY_SECONDS``."""

    def __init__(self, seconds: float, *, path: Path, session_id: str | None = None) -> None:
        super().__init__(
            f"spool {path}: another connection held its write lock for more than "
            f"{seconds:g} s; close it (an sqlite3 shell must use -readonly) and retry",
            path=path,
            session_id=session_id,
        )
        self.seconds = seconds


class _Numbers:
    """The next row id and next seqs this writer handed out, kept across transactions.

    Valid while no other connection has committed (``PRAGMA data_version`` is
    unchanged) and every group since was appends only; otherwise they are read again
    from the file. Saves two lookups per session per transaction.
    """

    LIMIT = 100_000  # streams remembered before the cache starts afresh
    #: Characters of stream names remembered past which it starts afresh, once the group
    #: that added them has committed (``_Group.committed``): a name may be as long as a
    #: payload, so a count alone would let a few huge names stay for good.
    NAME_CHARS = 8 * 1024 * 1024

    def __init__(self) -> None:
        self.version: int | None = None
        self.next_id: int | None = None
        #: Next seqs of the streams named by a session id, and of those named by a
        #: session key alone.
        self.by_id: dict[str, int] = {}
        self.by_key: dict[str, int] = {}
        #: Characters of the names in ``by_id`` and ``by_key``.
        self.name_chars = 0

    def check(self, conn: apsw.Connection) -> None:
        version = conn.execute("PRAGMA data_version").get
        if version != self.version or len(self.by_id) + len(self.by_key) > self.LIMIT:
            self.forget()
            self.version = version

    def forget(self) -> None:
        self.version = self.next_id = None
        self.by_id = {}
        self.by_key = {}
        self.name_chars = 0


class _Group:
    """What one transaction has done so far: the seqs it handed out, its inserts."""

    def __init__(self, conn: apsw.Connection, numbers: _Numbers) -> None:
        self.conn = conn
        self.numbers = numbers
        self.next_id = numbers.next_id or conn.execute(MAX_ID_SQL).get + 1
        self.inserts: list[tuple[Any, ...]] = []
        self.operations = False

    def add(self, rows: Sequence[Row]) -> list[Receipt]:
        """Number ``rows`` (each its id and its stream's next seq), gather their inserts,
        and return their receipts, in order."""
        receipts = []
        inserts = self.inserts
        # The next seqs are kept in ``numbers`` as they are handed out: a transaction
        # that fails makes ``_commit`` forget them all.
        conn, by_id, by_key = self.conn, self.numbers.by_id, self.numbers.by_key
        row_id = self.next_id
        for session_id, session_key, reason, created_at, payload, size in rows:
            if session_id is not None:
                known, name, sql = by_id, session_id, NEXT_SEQ_BY_ID_SQL
            else:
                known, name, sql = by_key, session_key, NEXT_SEQ_BY_KEY_SQL
            seq = known.get(name)
            if seq is None:
                seq = conn.execute(sql, (name,)).get
                self.numbers.name_chars += len(name)
            known[name] = seq + 1
            inserts.append(
                (row_id, session_id, seq, reason, session_key, created_at, payload, size)
            )
            receipts.append(Receipt(row_id, session_id, seq, reason, session_key, created_at))
            row_id += 1
        self.next_id = row_id
        return receipts

    def flush(self) -> None:
        """Write the inserts gathered so far (before another kind of request runs)."""
        if self.inserts:
            self.conn.executemany(INSERT_RECORD_SQL, self.inserts)
            self.inserts = []

    def finish(self) -> None:
        self.flush()

    def committed(self) -> None:
        """Keep what this group handed out for the next one, unless it ran other SQL or
        its names took the cache past ``_Numbers.NAME_CHARS``."""
        if self.operations or self.numbers.name_chars > self.numbers.NAME_CHARS:
            self.numbers.forget()
            return
        self.numbers.next_id = self.next_id


class Request:
    """One unit of work for the writer; ``run`` executes inside the group's transaction."""

    __slots__ = ("result", "error", "session_id", "payload_bytes", "size", "deadline")

    def __init__(
        self, session_id: str | None = None, payload_bytes: int = 0, size: int = 1
    ) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.session_id = session_id
        #: Bytes of payload the request holds (what the queue's byte bound counts).
        self.payload_bytes = payload_bytes
        #: Rows it adds to a group (``GROUP_ROWS``); 1 for one that adds none.
        self.size = size
        #: ``(time.monotonic() bound, seconds)`` for a ``call(within=...)``: no commit
        #: of it begins after the bound.
        self.deadline: tuple[float, float] | None = None

    def run(self, group: _Group) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Wake whoever waits; called after commit, or after the request failed."""


def row_bytes(row: Row) -> int:
    """What a row holds until it is committed: its payload's bytes and its names' (a
    session id, key or reason may be as long as a payload: counted in characters), not
    the payload alone."""
    session_id, session_key, reason = row.session_id, row.session_key, row.reason
    return (
        row.size
        + len(reason)
        + (len(session_id) if session_id is not None else 0)
        + (len(session_key) if session_key is not None else 0)
    )


class Append(Request):
    """Append rows; the result is a list of receipts, or one receipt when ``single``."""

    __slots__ = ("rows", "single")

    def __init__(self, rows: Sequence[Row], single: bool) -> None:
        nbytes = row_bytes(rows[0]) if len(rows) == 1 else sum(map(row_bytes, rows))
        super().__init__(rows[0].session_id if rows else None, nbytes, len(rows))
        self.rows = rows
        self.single = single

    def run(self, group: _Group) -> None:
        receipts = group.add(self.rows)
        self.result = receipts[0] if self.single else receipts


class Quarantined(Append):
    """Append one row already set aside for operators: status ``quarantined``, one
    attempt, ``why`` as its last error (a message its target refused for its content
    before it was ever spooled). Never replayed unless asked for."""

    __slots__ = ("why",)

    def __init__(self, row: Row, why: str) -> None:
        super().__init__((row,), single=True)
        self.why = why

    def run(self, group: _Group) -> None:
        super().run(group)
        group.flush()  # the row exists before its status is set
        group.conn.execute(QUARANTINE_NEW_SQL, (self.why, time.time(), self.result.id))
        totals.add(group.conn, totals.QUARANTINED_COUNTER, 1)


class Operation(Request):
    """Run ``fn(conn)`` inside the group's transaction; the result is its return value."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[apsw.Connection], Any]) -> None:
        super().__init__()
        self.fn = fn

    def run(self, group: _Group) -> None:
        group.flush()
        group.operations = True
        self.result = self.fn(group.conn)


class NotInTime(WalspoolError):
    """A request that had to be committed within a bound was not: nothing of it was
    written (it waited in the queue, or for a write lock held elsewhere, too long)."""

    def __init__(self, seconds: float, *, path: Path, session_id: str | None = None) -> None:
        super().__init__(
            f"spool {path}: not committed within {seconds:g} s; nothing was written",
            path=path,
            session_id=session_id,
        )
        self.seconds = seconds


class Writer:
    """Owns the spool's write connection; commits queued requests in groups.

    Whoever holds ``_commit_lock`` is the writer of the moment: usually the writer
    thread, but a blocking caller that finds the queue empty and the lock free
    commits on its own thread, saving two thread hand-offs (about 90 us per append:
    4,400 against 3,300 lone appends/s when measured while writing this). Whoever
    commits first takes everything queued, in order, so no request ever overtakes one
    queued before it.
    """

    def __init__(
        self,
        conn: apsw.Connection,
        path: Path,
        max_bytes: int | None,
        check: Callable[[], None] | None = None,
    ) -> None:
        self._conn = conn
        self._path = path
        self._max_bytes = max_bytes
        #: Called once per group that appends, before its transaction (the spool's
        #: path check): what it raises fails the group's appends, its other requests
        #: still run.
        self._check = check
        self._pending: deque[tuple[Request, Any]] = deque()
        #: Payload bytes of the requests in ``_pending``.
        self._pending_bytes = 0
        #: Per thread: the payload bytes of the request its last non-blocking put found
        #: no room for (0 after a put that found room), so ``has_room`` and
        #: ``wait_for_room`` answer for that request.
        self._refused = threading.local()
        self._cond = threading.Condition(threading.Lock())
        #: Whether the writer thread waits on ``_cond`` for requests: a put wakes it
        #: only then (a notify is Python code, paid per request otherwise).
        self._idle = False
        #: Per thread: the event loop whose tasks queued requests without waking the
        #: writer, and which wakes it at the end of its pass (``call_async``), until
        #: that wake runs. A loop runs on one thread, so each sets and clears only its
        #: own. Weak: a loop closed first is not kept alive.
        self._wakes = threading.local()
        self._commit_lock = threading.Lock()
        self._numbers = _Numbers()
        self._closed = False
        #: Set by ``close`` once its timeout has passed: busy waits end at once and
        #: queued requests fail without a try.
        self._abandon = threading.Event()
        #: ``time.monotonic()`` after which the current commit stops waiting for a
        #: write lock held elsewhere.
        self._busy_deadline = 0.0
        #: When a commit first found the write lock held elsewhere; None once a commit
        #: succeeds again.
        self.busy_since: float | None = None
        #: Messages accepted but failed because ``close`` gave up on them.
        self._abandoned = 0
        #: Bytes the spool takes on disk after the last commit: its pages in use
        #: (free pages left by replays do not count) plus its ``-wal`` file, which a
        #: reader holding a snapshot lets grow. None until ``track_footprint``: only
        #: the gateway link's cap needs it, so other commits do not pay for it.
        self.footprint: int | None = None
        # A busy handler rather than the connection's busy timeout: its waits are
        # bounded per group, not per statement, and ``close`` can end them.
        conn.set_busy_handler(self._on_busy)
        self._thread = threading.Thread(
            target=self._run, name=f"walspool-writer {path}", daemon=True
        )
        self._thread.start()

    # -- the callers' side --------------------------------------------------

    def call(self, request: Request, within: float | None = None) -> Any:
        """Run ``request`` and block until it is committed; return its result.

        ``within``: seconds the caller can wait. Then a full queue raises
        ``queue.Full`` at once, and a request not committed by then fails with
        ``NotInTime``, nothing of it written, unless its commit is already under way
        (the write lock taken): that commit is waited for.
        """
        if within is not None:
            request.deadline = (time.monotonic() + within, within)
        if not self._pending and self._commit_lock.acquire(blocking=False):
            try:
                self._check_open(request)
                with self._cond:
                    batch = self._take()
                batch.append((request, None))
                self._commit_group([r for r, _ in batch])
            finally:
                self._commit_lock.release()
            if len(batch) > 1:
                _wake(batch[:-1])
        else:
            done = _thread.allocate_lock()  # the writer releases it: see ``_wake``
            done.acquire()
            if within is None:
                self._put(request, done)
                done.acquire()
            elif not self._put(request, done, block=False):
                raise queue.Full
            elif not done.acquire(timeout=max(within, 0.0)):
                if self._take_back(request, done):
                    request.error = NotInTime(
                        within, path=self._path, session_id=request.session_id
                    )
                else:
                    done.acquire()  # taken by a commit, which fails it at its deadline
        if request.error is not None:
            raise request.error
        return request.result

    def _take_back(self, request: Request, waiter: Any) -> bool:
        """Remove ``request`` from the queue; False if a commit has taken it already."""
        with self._cond:
            try:
                self._pending.remove((request, waiter))
            except ValueError:
                return False
            self._pending_bytes = max(self._pending_bytes - request.payload_bytes, 0)
            self._cond.notify_all()  # room for blocked producers
            return True

    def notify(self, request: Request, callback: Callable[[Request], None]) -> None:
        """Queue ``request`` (its place in order is taken now); after it is committed,
        or has failed, whoever committed it (the writer thread, or a caller committing
        on its own thread) calls ``callback(request)``. Lighter than a future;
        ``callback`` must be quick and must not raise.
        """
        self._put(request, callback)

    def notify_nowait(self, request: Request, callback: Callable[[Request], None]) -> None:
        """``notify`` that never waits: raises ``queue.Full`` when the queue is full."""
        if not self._put(request, callback, block=False):
            raise queue.Full

    def has_room(self) -> bool:
        """Whether a ``notify_nowait`` now would find room in the queue: for the request
        this thread last saw refused with ``queue.Full``, else for one with no payload."""
        nbytes = getattr(self._refused, "nbytes", 0)
        with self._cond:
            return self._room_for(nbytes)

    def wait_for_room(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until the queue has room (as ``has_room`` means it),
        the spool is closed, or a commit finds the write lock held elsewhere (no room
        soon); True if there is room."""
        nbytes = getattr(self._refused, "nbytes", 0)
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self.busy_since is not None or self._room_for(nbytes),
                timeout,
            )
            return self._room_for(nbytes)

    def submit(self, request: Request) -> concurrent.futures.Future[Any]:
        """Queue ``request`` (its place in order is taken now) and return a future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self._put(request, future)
        return future

    def call_async(self, request: Request) -> Awaitable[Any]:
        """Run ``request`` without blocking the event loop (no SQLite work runs on it):
        called from the running loop, returns what to await for its result.

        The request is queued at once, but the writer thread is woken only once the
        loop has run the rest of its ready callbacks: the requests its other tasks make
        meanwhile join the same group, where waking the writer at the first would let it
        take that one alone while the loop still holds the GIL for the rest. Raises at
        once what ``notify`` raises for a closed writer.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiter = (loop, future)
        if not self._put(request, waiter, block=False, wake=False):
            return self._call_when_room(loop, request, waiter, future)
        wakes = self._wakes
        scheduled = getattr(wakes, "loop", None)
        if scheduled is None or scheduled() is not loop:
            wakes.loop = weakref.ref(loop)
            loop.call_soon(self._wake_for, loop)
        return future

    async def _call_when_room(
        self,
        loop: asyncio.AbstractEventLoop,
        request: Request,
        waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]],
        future: asyncio.Future[Any],
    ) -> Any:
        """``call_async`` for a full queue: wait for room off the loop, then as usual."""
        await loop.run_in_executor(None, self._put, request, waiter)
        return await future

    def _wake_for(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the writer for what ``loop``'s tasks queued in its last pass."""
        scheduled = getattr(self._wakes, "loop", None)
        if scheduled is not None and scheduled() is loop:
            self._wakes.loop = None
        with self._cond:
            if self._idle:
                self._cond.notify_all()

    def _put(self, request: Request, waiter: Any, block: bool = True, wake: bool = True) -> bool:
        """Queue a request; False if the queue is full and ``block`` is False. With
        ``wake`` False the writer is not woken for it: the caller wakes it later (a
        queued request is taken by the next group all the same, whoever starts it)."""
        nbytes = request.payload_bytes
        with self._cond:
            while True:
                self._check_open(request)
                if self._room_for(nbytes):
                    break
                if not block:
                    self._refused.nbytes = nbytes
                    return False
                self._cond.wait()
            self._pending.append((request, waiter))
            self._pending_bytes += nbytes
            if wake and self._idle:
                self._cond.notify_all()
        self._refused.nbytes = 0
        return True

    def _room_for(self, nbytes: int) -> bool:
        """Would a request of ``nbytes`` payload bytes fit now? ``_cond`` is held."""
        queued = self._pending_bytes
        return len(self._pending) < QUEUE_REQUESTS and (
            queued == 0 or queued + nbytes <= QUEUE_BYTES
        )

    def _check_open(self, request: Request) -> None:
        if self._closed:
            raise SpoolClosed(
                f"spool {self._path} is closed", path=self._path, session_id=request.session_id
            )

    def close(self) -> None:
        """Commit everything accepted so far, then stop the thread. Idempotent.

        Waits at most ``CLOSE_TIMEOUT`` seconds for the accepted requests to commit.
        Past it (another connection holds the write lock), the rest fail with
        ``SpoolClosed``, their waiters wake, and an ERROR says how many accepted
        messages were not committed.
        """
        timeout = CLOSE_TIMEOUT
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abandon.set()
            self._thread.join(CLOSE_GRACE)
        # A caller committing on its own thread finishes first (bounded the same way).
        if self._commit_lock.acquire(timeout=timeout + CLOSE_GRACE):
            self._commit_lock.release()
        if self._abandon.is_set():
            with self._cond:
                lost = self._abandoned + sum(_messages(r) for r, _ in self._pending)
            stuck = " (the writer thread is still stuck in a commit)"
            log.error(
                "spool %s: closed after waiting %g s for its write lock; %d accepted "
                "message(s) were not committed%s",
                self._path,
                timeout,
                lost,
                stuck if self._thread.is_alive() else "",
            )

    def _on_busy(self, prior_calls: int) -> bool:
        """SQLite's busy handler: wait a little and try again, until the commit's
        deadline passes or ``close`` gives up (then SQLite raises ``BusyError``)."""
        now = time.monotonic()
        if self.busy_since is None:
            self.busy_since = now
            with self._cond:  # producers waiting for room: none comes soon
                self._cond.notify_all()
        if self._abandon.is_set() or now >= self._busy_deadline:
            return False
        # 1, 2, 4 ... ms up to BUSY_POLL_SECONDS: a lock held for an instant (another
        # process's commit) costs little, a long hold costs few wake-ups.
        pause = min(BUSY_POLL_SECONDS, 0.001 * 2 ** min(prior_calls, 10), self._busy_deadline - now)
        return not self._abandon.wait(pause)

    # -- the writer's side --------------------------------------------------

    def _take(self) -> list[tuple[Request, Any]]:
        """Take queued requests, up to about GROUP_ROWS rows; ``_cond`` is held."""
        batch: list[tuple[Request, Any]] = []
        rows = taken = 0
        pending = self._pending
        while pending and rows < GROUP_ROWS:
            item = pending.popleft()
            batch.append(item)
            rows += item[0].size
            taken += item[0].payload_bytes
        # Exact whatever a caller did to its rows meanwhile once nothing is queued.
        self._pending_bytes = self._pending_bytes - taken if pending else 0
        if batch:
            self._cond.notify_all()  # room for blocked producers
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if not self._pending and self._closed:
                    return
            self._commit_queued()

    def _commit_queued(self) -> None:
        """Commit one group of what is queued and wake its waiters.

        Its requests (and their payloads) are referenced only by this call's frame, so
        once the waiters are woken the writer holds none of them while it waits for more.
        """
        batch: list[tuple[Request, Any]] = []
        try:
            with self._commit_lock:
                with self._cond:
                    batch = self._take()
                if batch:
                    self._commit_group([r for r, _ in batch])
        finally:
            _wake(batch)

    def _commit_group(self, requests: list[Request]) -> None:
        """Commit ``requests`` together; if that fails, one by one. Never raises: each
        request ends with a result or an error, so no waiter is left behind."""
        if self._check is not None:
            for request in requests:
                if isinstance(request, Append):
                    requests = self._checked(requests)
                    break
            if not requests:
                return
        try:
            self._commit(requests)
        except BaseException as exc:  # noqa: BLE001 - every failure reaches a caller
            if len(requests) == 1 or isinstance(exc, (SpoolBusy, SpoolClosed)):
                # A busy lock or a closing spool fails the group as a whole: one by
                # one, each request would wait for the lock again.
                for request in requests:
                    if request.error is None:  # not failed at its deadline already
                        request.error = self._safe_error(exc, request)
            else:
                for request in requests:
                    if request.error is not None:
                        continue
                    try:
                        self._commit([request])
                    except BaseException as one:  # noqa: BLE001
                        request.error = self._safe_error(one, request)
            if self._abandon.is_set():
                self._abandoned += sum(
                    _messages(r)
                    for r in requests
                    if r.error is not None and not isinstance(r.error, NotInTime)
                )

    def _checked(self, requests: list[Request]) -> list[Request]:
        """``requests`` if the check passes; else the appends among them fail with what
        it raised, and the others are left to run."""
        try:
            self._check()
        except BaseException as exc:  # noqa: BLE001 - each append's caller gets it
            for request in requests:
                if isinstance(request, Append):
                    request.error = self._safe_error(exc, request)
            return [r for r in requests if not isinstance(r, Append)]
        return requests

    def _safe_error(self, exc: BaseException, request: Request) -> BaseException:
        """``_error``, which asks SQLite about the failure, on a disk that may fail again."""
        try:
            return self._error(exc, request)
        except BaseException:  # noqa: BLE001 - keep the original failure
            if isinstance(exc, apsw.Error):
                return sqlite_error(exc, self._path, request.session_id)
            return exc

    def _commit(self, requests: list[Request]) -> None:
        """Commit ``requests`` in one transaction, waiting for a write lock held
        elsewhere at most ``BUSY_RETRY_SECONDS`` (then ``SpoolBusy``). Those two errors
        name no session: ``_error`` names each request's own."""
        started = time.monotonic()
        lock_deadline = started + BUSY_RETRY_SECONDS
        self._busy_deadline = lock_deadline
        while True:
            if any(r.deadline is not None for r in requests):
                requests = self._in_time(requests)
                if not requests:
                    return
                self._busy_deadline = min(
                    [lock_deadline] + [r.deadline[0] for r in requests if r.deadline]
                )
            if self._abandon.is_set():
                raise SpoolClosed(
                    f"spool {self._path} was closed before this message was committed "
                    "(its write lock was held elsewhere)",
                    path=self._path,
                )
            try:
                # schema.transaction, written out: this is every append's path.
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    self._numbers.check(self._conn)
                    group = _Group(self._conn, self._numbers)
                    for request in requests:
                        request.run(group)
                    group.finish()
                    self._conn.execute("COMMIT")
                except BaseException:
                    if not self._conn.get_autocommit():
                        with contextlib.suppress(apsw.Error):
                            self._conn.execute("ROLLBACK")
                    raise
            except apsw.BusyError as exc:
                self._numbers.forget()
                if self.busy_since is None:
                    self.busy_since = started
                now = time.monotonic()
                if now >= lock_deadline or self._abandon.is_set():
                    if self._abandon.is_set():
                        continue  # fails above, as SpoolClosed
                    raise SpoolBusy(BUSY_RETRY_SECONDS, path=self._path) from exc
                if now >= self._busy_deadline:
                    continue  # a request's own deadline: it fails above, the rest try again
                # SQLite may report busy without asking the handler (a WAL snapshot
                # or recovery in another process): look again shortly.
                self._abandon.wait(min(BUSY_POLL_SECONDS, self._busy_deadline - now))
            except BaseException:
                self._numbers.forget()
                raise
            else:
                group.committed()
                self.busy_since = None
                if self.footprint is not None:
                    self._measure()
                return

    def _in_time(self, requests: list[Request]) -> list[Request]:
        """Fail with ``NotInTime`` the requests whose deadline has passed (no commit
        of theirs is under way); the others."""
        now = time.monotonic()
        kept = []
        for request in requests:
            if request.deadline is not None and now >= request.deadline[0]:
                seconds = request.deadline[1]
                request.error = NotInTime(seconds, path=self._path, session_id=request.session_id)
            else:
                kept.append(request)
        return kept

    def track_footprint(self) -> None:
        """Keep ``footprint`` up to date from now on: measured now, unless a commit is
        running (never waited for; then after it), and after every commit."""
        if self.footprint is None:
            self.footprint = 0
        if self._commit_lock.acquire(blocking=False):
            try:
                self._measure()
            finally:
                self._commit_lock.release()

    def _measure(self) -> None:
        """``footprint`` now; the commit lock is held. A failed look keeps the last."""
        try:
            self.footprint = self._conn.execute(LIVE_BYTES_SQL).get + _size(f"{self._path}-wal")
        except apsw.Error:
            pass

    def _error(self, exc: BaseException, request: Request) -> BaseException:
        group_wide = (SpoolBusy, SpoolClosed, SpoolReplaced)
        if isinstance(exc, group_wide) and exc.session_id != request.session_id:
            # Raised for a whole group (``_commit``, the path check): name each
            # request's session.
            error: BaseException
            if isinstance(exc, SpoolBusy):
                error = SpoolBusy(exc.seconds, path=self._path, session_id=request.session_id)
            else:
                error = type(exc)(str(exc), path=self._path, session_id=request.session_id)
            error.__cause__ = exc.__cause__
            return error
        if isinstance(exc, WalspoolError):
            return exc
        if isinstance(exc, apsw.FullError) and self._at_max_bytes(request):
            error = SpoolFull(
                self._max_bytes or 0, path=str(self._path), session_id=request.session_id
            )
        elif isinstance(exc, apsw.Error):
            error = sqlite_error(exc, self._path, request.session_id, self._conn)
        else:
            return exc
        error.__cause__ = exc
        return error

    def _at_max_bytes(self, request: Request) -> bool:
        """Did SQLITE_FULL come from the ``max_bytes`` cap rather than the disk?

        True when the pages in use plus those the request needs reach the cap.
        """
        if self._max_bytes is None:
            return False
        page_size = self._conn.execute("PRAGMA page_size").get
        pages = self._conn.execute("PRAGMA page_count").get
        limit = self._conn.execute("PRAGMA max_page_count").get
        needed = request.payload_bytes // page_size + 8
        return pages + needed >= limit


def _size(path: str) -> int:
    """A file's size, 0 if it is not there."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _messages(request: Request) -> int:
    """How many messages a request would have spooled (none for an operation)."""
    return len(request.rows) if isinstance(request, Append) else 0


class Batched:
    """A callback called once per finished group with all of its requests (in order)
    that named it, instead of once per request: ``fn(requests)``. For many small
    requests whose callback takes a lock the callers contend for."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[list[Request]], None]) -> None:
        self.fn = fn


def _wake(items: list[tuple[Request, Any]]) -> None:
    """Wake every waiter of a finished group: each ``Batched`` callback once, first
    (whoever wakes next sees them done), then the rest; asyncio waiters once per loop."""
    batched: dict[Batched, list[Request]] = {}
    for request, waiter in items:
        if isinstance(waiter, Batched):
            batched.setdefault(waiter, []).append(request)
    for callback, requests in batched.items():
        try:
            callback.fn(requests)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the writer
            log.exception("callback for %d committed spool requests failed", len(requests))
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, asyncio.Future[Any]]]] = {}
    for request, waiter in items:
        if type(waiter) is _LockType:  # a blocking caller's (``call``): the most common
            waiter.release()
        elif isinstance(waiter, Batched):
            continue
        elif isinstance(waiter, tuple):
            by_loop.setdefault(waiter[0], []).append((request, waiter[1]))
        elif isinstance(waiter, concurrent.futures.Future):
            if request.error is not None:
                waiter.set_exception(request.error)
            else:
                waiter.set_result(request.result)
        else:
            try:
                waiter(request)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the writer
                log.exception("callback for a committed spool request failed")
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, pairs)
        except RuntimeError:
            log.debug("event loop closed before its appends were acknowledged")


def _resolve(pairs: list[tuple[Request, asyncio.Future[Any]]]) -> None:
    for request, future in pairs:
        if future.cancelled():
            continue
        if request.error is not None:
            future.set_exception(request.error)
        else:
            future.set_result(request.result)
