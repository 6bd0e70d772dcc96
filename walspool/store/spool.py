"""The spool: append messages durably, read them back in drop order."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import apsw

from ..errors import InvalidArgument, PayloadTooLarge, SpoolClosed, SpoolReplaced
from . import codec, files, memory, totals
from .connections import close_quietly, open_reader, open_writer, opened_file
from .paging import PAGE_ROWS, ROW_BYTES_SQL, read_page, record_from_row
from .path_watch import PathWatch, file_identity
from .records import AGENT_HISTORY, CAP_DROP, REASONS, Receipt, Record, Stats
from .sqlite_errors import sqlite_error
from .writer import Append, Operation, Quarantined, Row, Writer

DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: A row as ``Record`` takes it. The payload and the text columns come as their stored
#: bytes, made text by ``paging.read_page``: one that is not UTF-8 (a hand edit, a
#: damaged page) is then one bad row, where apsw's own decoding would fail the page.
RECORD_COLUMNS = (
    "id, CAST(session_id AS BLOB), seq, CAST(reason AS BLOB), CAST(session_key AS BLOB), "
    "created_at, CAST(payload AS BLOB), attempts, CAST(last_error AS BLOB), "
    "last_attempt_at, status"
)
RECORDS_PAGE_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records
WHERE id > :after AND (:reasons IS NULL OR reason IN (SELECT value FROM json_each(:reasons)))
ORDER BY id LIMIT :limit
"""
SESSION_RECORDS_PAGE_SQL = f"""
SELECT {RECORD_COLUMNS}, {ROW_BYTES_SQL} FROM records
WHERE session_id = :session_id AND seq > :after
  AND (:reasons IS NULL OR reason IN (SELECT value FROM json_each(:reasons)))
ORDER BY seq LIMIT :limit
"""
#: A rewrite makes a session's replayable rows obsolete: every reason but agent
#: history, and not the rows a replay has out (it finishes those).
SUPERSEDE_SQL = """
UPDATE records SET status = 'superseded'
WHERE session_id = ? AND status IS NULL AND inflight IS NULL AND reason != ?
"""
#: The same, for a caller that holds the replay lock: no replay has rows out, so rows
#: left in flight are leftovers of failed replays (their writes did not land).
SUPERSEDE_WITH_INFLIGHT_SQL = """
UPDATE records SET status = 'superseded', inflight = NULL
WHERE session_id = ? AND status IS NULL AND reason != ?
"""
#: Whether any row but agent histories is there (a start's recovery has work).
ANY_REPLAYABLE_SQL = "SELECT 1 FROM records WHERE reason != ? LIMIT 1"


#: What a gateway logs (WARNING, with the path) once it has opened a fresh spool at the
#: path of one that was moved or deleted while it ran (``Spool.reopened``).
REOPENED = (
    "The transcript spool %s was moved or deleted while the gateway ran; a fresh one is "
    "open at that path. Rows of the old file stay in it (if it was moved, `walspool "
    "replay OLD_PATH --into STATE_DB` writes them)"
)


def default_path() -> Path:
    """``<HERMES_HOME>/spool.db``; ``HERMES_HOME`` defaults to ``~/.hermes``."""
    home = os.environ.get("HERMES_HOME") or os.path.join(os.path.expanduser("~"), ".hermes")
    return Path(home) / "spool.db"


class Spool:
    """A durable, ordered spool of messages in one SQLite file (WAL mode).

    ``durability="full"``: an acknowledged append survives a power cut.
    ``durability="normal"``: it survives a killed process, not a power cut.

    Thread-safe; several processes may share one spool file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        durability: str = "full",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_bytes: int | None = None,
    ) -> None:
        if durability not in ("full", "normal"):
            raise InvalidArgument(
                f"durability must be 'full' or 'normal', not {durability!r}", path=path
            )
        for name, value in (("max_payload_bytes", max_payload_bytes), ("max_bytes", max_bytes)):
            if value is None and name == "max_bytes":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"{name} must be an int, not {value!r}", path=path)
            if value <= 0:
                raise InvalidArgument(f"{name} must be positive, not {value}", path=path)
        self.path = Path(path) if path is not None else default_path()
        self._path_name = os.fspath(self.path)  # for the path check: no Path per append
        self.durability = durability
        self.max_payload_bytes = max_payload_bytes
        self.max_bytes = max_bytes
        self._conn, self._open_lock, self._owner = open_writer(self.path, durability, max_bytes)
        try:
            held = opened_file(self._conn)  # the file SQLite holds, whatever the path names
            self._identity = (
                (held.st_dev, held.st_ino) if held is not None else file_identity(self.path)
            )
            self._watch = PathWatch(self._path_name, self._identity)
            try:
                self._writer = Writer(self._conn, self.path, max_bytes, check=self._check_path)
            except BaseException:
                self._watch.close()
                raise
        except BaseException:
            close_quietly(self._conn)
            os.close(self._open_lock)
            raise
        if self._identity is not None:
            files.opened(self._identity)
        self._reader: apsw.Connection | None = None
        self._reader_lock = threading.Lock()
        self._closed = False
        self._uid: str | None = None

    # -- appending -----------------------------------------------------------

    def append(
        self,
        session_id: str | None,
        message: Any,
        *,
        reason: str = CAP_DROP,
        session_key: str | None = None,
    ) -> Receipt:
        """Spool one message; return once it is committed."""
        row = self._row(session_id, message, reason, session_key)
        return self._writer.call(Append((row,), single=True))

    def append_many(
        self,
        items: Iterable[tuple[str | None, Any] | tuple[str | None, Any, str | None]],
        *,
        reason: str = CAP_DROP,
    ) -> list[Receipt]:
        """Spool ``(session_id, message[, session_key])`` items in one transaction.

        All or nothing: either every item is committed, in order, or none is.
        """
        rows = self._rows(items, reason)
        if not rows:
            return []
        return self._writer.call(Append(rows, single=False))

    def submit(
        self,
        session_id: str | None,
        message: Any,
        *,
        reason: str = CAP_DROP,
        session_key: str | None = None,
    ) -> concurrent.futures.Future[Receipt]:
        """Take the message's place in its session's order now; commit in the background.

        A bad argument or an oversized message raises here; a storage failure
        (disk full, spool full, I/O error, a path that names another file by then)
        arrives through the future.
        """
        row = self._row(session_id, message, reason, session_key)
        return self._writer.submit(Append((row,), single=True))

    async def append_async(
        self,
        session_id: str | None,
        message: Any,
        *,
        reason: str = CAP_DROP,
        session_key: str | None = None,
    ) -> Receipt:
        """Spool one message from asyncio; the event loop never runs SQLite.

        Cancelling the awaiting task does not take the message back.
        """
        row = self._row(session_id, message, reason, session_key)
        return await self._writer.call_async(Append((row,), single=True))

    def _check_path(self) -> None:
        """Refuse to append once the spool's path names another file (or none).

        An operator's ``mv``, or a move-aside by a process that did not honour the
        open lock, would otherwise leave acknowledged appends in a file the next
        start does not open. The writer calls it once per group of appends, just
        before their transaction, off the callers' threads: a ``poll`` while nothing
        may have changed what the path names, else a ``stat`` (``path_watch``).
        """
        if not self._watch.names_it():
            raise SpoolReplaced(
                f"spool {self.path} no longer names the file this Spool opened (it was "
                "moved, replaced or deleted); nothing more is appended to it: open the "
                "spool again, and look for the old file beside it",
                path=self.path,
            )

    def _rows(self, items: Iterable[Any], reason: str) -> list[Row]:
        """The rows of ``append_many``'s items (``_row`` for one message): every
        argument checked, each message encoded and measured, one time for them all."""
        limit = self.max_payload_bytes
        if not (type(reason) is str and reason in REASONS):
            check_name(reason, "reason", self.path, limit)
        now = time.time()
        rows = []
        for index, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise InvalidArgument(
                    f"append_many item {index} must be a (session_id, message) or "
                    f"(session_id, message, session_key) tuple, not {type(item).__name__}",
                    path=self.path,
                )
            session_id, message = item[0], item[1]
            session_key = item[2] if len(item) == 3 else None
            # The common names (non-empty ASCII within the limit) without check_name.
            if session_id is not None and not (
                type(session_id) is str and session_id.isascii() and 0 < len(session_id) <= limit
            ):
                check_name(session_id, "session_id", self.path, limit)
            if session_key is not None:
                check_name(session_key, "session_key", self.path, limit)
            elif session_id is None:
                raise InvalidArgument(
                    "a message needs a session_id or a session_key", path=self.path
                )
            try:
                # A plain dict whose timestamp is no datetime needs no conversion.
                stamp = message.get("timestamp") if type(message) is dict else _DATE
                if type(stamp) not in _NOT_DATES:
                    message = codec.with_epoch_timestamp(message)
            except Exception:  # noqa: BLE001 - a timestamp that raises when inspected is no time
                pass  # encoded as it is: ``codec.encode`` converts any value, never raises
            payload = codec.encode(message)
            size = len(payload)
            if size > limit:
                raise PayloadTooLarge(
                    size, limit, path=str(self.path), session_id=session_id, session_key=session_key
                )
            rows.append(Row(session_id, session_key, reason, now, payload.decode("utf-8"), size))
        return rows

    def _row(
        self, session_id: str | None, message: Any, reason: str, session_key: str | None
    ) -> Row:
        return self._rows(((session_id, message, session_key),), reason)[0]

    def flush(self) -> None:
        """Block until everything submitted so far (``submit``, ``append_async``) is committed."""
        self._writer.call(Operation(_nothing))

    # -- for walspool's own modules (the gateway link, the drop-in) ---------------
    # Not public API: the small surface they need instead of this class's private
    # attributes. Every path that appends makes the checks ``append`` makes.

    def prepare(
        self, session_id: str | None, message: Any, reason: str, session_key: str | None = None
    ) -> Row:
        """The row ``append`` would write for this message (its arguments checked, its
        payload encoded and measured: ``row.size`` bytes); nothing is queued yet."""
        return self._row(session_id, message, reason, session_key)

    def put_nowait(
        self,
        rows: Sequence[Row],
        callback: Callable[[Any], None],
        *,
        single: bool = True,
        quarantine: str | None = None,
    ) -> None:
        """Queue ``rows`` (from ``prepare``) as one ``Append`` without waiting: their
        place in order is taken now, and ``callback(request)`` runs once they are
        committed or have failed (see ``Writer.notify``). With ``quarantine`` (one row),
        the row is committed already set aside, that text as its error. Raises
        ``queue.Full`` when the writer's queue has no room, and ``SpoolClosed`` for a
        closed spool. The path check ``append`` gets is made the same way, by the writer
        when the group commits: rows queued for a path that names another file by then
        fail there (``request.error`` is ``SpoolReplaced``). ``check_path`` asks now.
        """
        if quarantine is not None:
            (row,) = rows
            request: Append = Quarantined(row, quarantine)
        else:
            request = Append(rows, single=single)
        self._writer.notify_nowait(request, callback)

    def put_within(self, row: Row, seconds: float) -> Receipt:
        """Commit ``row`` (from ``prepare``) within ``seconds``, or not at all.

        ``NotInTime`` when the queue ahead of it or a write lock held elsewhere kept it
        waiting past the bound (nothing was written); ``queue.Full`` at once when the
        writer's queue has no room; a storage failure (a full disk) as ``append``. It
        waits longer only for a commit already under way. For a caller that keeps what
        the spool cannot take (see ``Writer.call``).
        """
        return self._writer.call(Append((row,), single=True), within=seconds)

    def reopened(self) -> Spool:
        """A new ``Spool`` at this one's path, with its settings: what the path names
        now, opened as the next start would open it, for a caller whose spool's path
        names another file (``SpoolReplaced``). This one stays open: close it once
        nothing of the caller's is left in its writer."""
        return Spool(
            self.path,
            durability=self.durability,
            max_payload_bytes=self.max_payload_bytes,
            max_bytes=self.max_bytes,
        )

    def check_path(self) -> None:
        """Raise ``SpoolReplaced`` now if the spool's path names another file (or none):
        the check the writer makes for each group of appends, for a caller that must
        know before it hands rows over (a shutdown's flush keeps its queue then)."""
        self._check_path()

    def confirm_nowait(self, callback: Callable[[Any], None]) -> None:
        """Queue an empty transaction without waiting: ``callback(request)`` runs once
        everything queued before it has committed or failed, and the write lock was
        taken for it (``request.error`` is set if not: held elsewhere past the bound).
        Raises ``queue.Full`` as ``put_nowait`` does."""
        self._check_path()
        self._writer.notify_nowait(Operation(_nothing), callback)

    def has_room(self) -> bool:
        """Whether a ``put_nowait`` now would find room (``Writer.has_room``)."""
        return self._writer.has_room()

    def wait_for_room(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for room (``Writer.wait_for_room``)."""
        return self._writer.wait_for_room(timeout)

    def busy(self) -> bool:
        """Whether the writer's last commit found the write lock held by another
        connection (and none has succeeded since): no room comes soon."""
        return self._writer.busy_since is not None

    def track_footprint(self) -> None:
        """Measure the spool's bytes on disk after every commit from now on."""
        self._writer.track_footprint()

    def footprint(self) -> int:
        """Bytes the spool takes on disk after the last commit (0 until tracked)."""
        return self._writer.footprint or 0

    @property
    def owner(self) -> int:
        """The uid that owns the spool's files (its directory's owner, checked at open)."""
        return self._owner

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run: nothing can be appended or read any more."""
        return self._closed

    def has_replayable(self) -> bool:
        """Whether the spool holds any row but agent histories (one index probe)."""
        return bool(self.query(ANY_REPLAYABLE_SQL, (AGENT_HISTORY,)))

    # -- writing on the replayer's behalf ----------------------------------------

    def transact(self, fn: Any) -> Any:
        """Run ``fn(conn)`` in the writer's next transaction; return its result.

        Internal: for the store's own modules, which keep the spool's invariants. Unlike
        the appends, it makes no path check (``SpoolReplaced``): it acts on the file
        this Spool opened after its path names another file or none, because what it
        does there (a replay taking rows out into the sink, a quarantine, a supersede)
        only changes or removes rows of that file. A deleted file's rows can still be
        replayed only through it, and a moved one keeps its statuses for an operator.
        A function that adds rows must check the path as ``append`` does.
        """
        return self._writer.call(Operation(fn))

    def transact_later(self, fn: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(conn)`` for the writer's next group; do not wait for the commit."""
        return self._writer.submit(Operation(fn))

    def supersede(self, session_id: str, *, inflight: bool = False) -> int:
        """Mark ``session_id``'s replayable rows superseded (kept, not replayed); count them.

        For a transcript rewrite (/retry, /undo, /compress): the gateway replaced the
        session's transcript, so rows spooled before it would land out of place.
        Rows a replay has out at this moment are left to it; with ``inflight`` (for a
        caller holding the replay lock, so that no replay has any out) rows left in
        flight by failed replays are superseded too. Like ``transact``, it acts on the
        file this Spool opened even once its path names another (a moved spool's rows
        are marked, so an operator's replay of it does not put them after the rewrite).
        """
        check_lookup(session_id, "session_id", self.path)
        sql = SUPERSEDE_WITH_INFLIGHT_SQL if inflight else SUPERSEDE_SQL

        def supersede(conn: apsw.Connection) -> int:
            conn.execute(sql, (session_id, AGENT_HISTORY))
            return conn.changes()

        return self.transact(supersede)

    def publish_memory(
        self, pid: int, host: str, held: memory.Held | None
    ) -> concurrent.futures.Future[Any]:
        """Queue process ``pid``'s in-memory queues as its entry (``walspool.store.memory``;
        None removes it) for the writer's next group, without waiting for room or for
        the commit: the future is done once it committed or failed. Raises
        ``queue.Full`` when the writer's queue is full, as ``put_nowait`` does."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def committed(request: Any) -> None:
            if request.error is None:
                done.set_result(None)
            else:
                done.set_exception(request.error)

        operation = Operation(lambda conn: memory.publish(conn, pid, host, held))
        self._writer.notify_nowait(operation, committed)
        return done

    def memory(self) -> list[memory.Published]:
        """What gateway processes published as held in memory (``walspool.store.memory``)."""
        return self._with_reader(memory.read)

    def take_lost_memory(self) -> list[memory.Held]:
        """Take in the entries of this host's gateway processes that ended holding
        messages in memory (``walspool.store.memory.take_lost``); what each held.
        Looks first with a read: only when there is one does it wait for the writer, as
        ``append`` does (not for a gateway thread)."""
        if not any(entry.alive is False for entry in self.memory()):
            return []
        lost: list[memory.Held] = self.transact(memory.take_lost)
        return lost

    @property
    def uid(self) -> str:
        """The spool's identity, random and fixed when the file was created."""
        if self._uid is None:
            self._uid = self._with_reader(totals.uid)
        return self._uid

    # -- reading ---------------------------------------------------------------

    def records(
        self, session_id: str | None = None, reasons: Sequence[str] | None = None
    ) -> Iterator[Record]:
        """Yield spooled records: all of them by id, or one session's by seq.

        Rows are read a page at a time, each page in its own short read
        transaction: rows appended or removed during the iteration may or may not
        be seen, but no row is seen twice and a session's order is kept.
        """
        reasons_json = reasons_filter(reasons, self.path)
        if session_id is not None:
            check_lookup(session_id, "session_id", self.path)
        if session_id is None:
            sql, params = RECORDS_PAGE_SQL, {"reasons": reasons_json}
        else:
            sql, params = (
                SESSION_RECORDS_PAGE_SQL,
                {"reasons": reasons_json, "session_id": session_id},
            )
        after = 0
        while True:
            query = {**params, "after": after, "limit": PAGE_ROWS}
            rows, full = self._with_reader(partial(read_page, sql=sql, params=query))
            for row in rows:
                yield record_from_row(row[:-1], self.path)
            if not full:
                return
            after = rows[-1][0] if session_id is None else rows[-1][2]

    def stats(self) -> Stats:
        """Count what the spool holds: rows, sessions, bytes, age, by reason, failing."""

        return self._with_reader(lambda conn: totals.stats(conn, self.path))

    def query(self, sql: str, params: Any) -> list[tuple[Any, ...]]:
        """Run a read-only ``sql`` on the spool's reader connection; all its rows.

        Internal: for the store's own modules (tickets, streams, maintenance).
        """
        return self._with_reader(lambda conn: conn.execute(sql, params).fetchall())

    def read_page(
        self, sql: str, params: Any, limit: int = PAGE_ROWS
    ) -> tuple[list[tuple[Any, ...]], bool]:
        """``paging.read_page`` of ``sql`` on the spool's reader connection: the next
        page (bounded by what its rows cost) and whether more may follow.

        Internal: for the store's own modules (tickets: a crashed replay's rows).
        """
        return self._with_reader(partial(read_page, sql=sql, params=params, limit=limit))

    def _with_reader(self, fn: Any) -> Any:
        with self._reader_lock:
            if self._closed:
                raise SpoolClosed(f"spool {self.path} is closed", path=self.path)
            if self._reader is None:
                self._reader = self._open_reader()
            try:
                return fn(self._reader)
            except apsw.Error as exc:
                raise sqlite_error(exc, self.path) from exc

    def _open_reader(self) -> apsw.Connection:
        """A read-only connection to the very file this Spool opened, or
        ``SpoolReplaced``: opened by path, it would otherwise read whatever file the
        path names now (another spool renamed over it), while the writes of a replay
        reading through it go to this one."""
        reader = open_reader(self.path)
        opened = opened_file(reader)  # None under another VFS: then what the path names
        now = (opened.st_dev, opened.st_ino) if opened is not None else file_identity(self.path)
        if self._identity is not None and now != self._identity:
            close_quietly(reader)
            raise SpoolReplaced(
                f"spool {self.path} no longer names the file this Spool opened (it was "
                "moved or replaced); reading the path would show another file's rows: "
                "open the spool again, and look for the old file beside it",
                path=self.path,
            )
        return reader

    # -- life cycle ------------------------------------------------------------

    def close(self) -> None:
        """Commit everything already accepted, then close the files. Idempotent."""
        self._writer.close()
        with self._reader_lock:
            if self._closed:
                return
            self._closed = True
            reader, self._reader = self._reader, None
        errors = []
        for conn in (reader, self._conn):  # the write connection last: it checkpoints
            if conn is None:
                continue
            try:
                conn.close()
            except apsw.Error as exc:
                errors.append(exc)
        os.close(self._open_lock)  # after the last connection: others may now move it
        self._watch.close()
        if self._identity is not None:
            files.closed(self._identity)
        if errors:
            raise sqlite_error(errors[0], self.path) from errors[0]

    def __enter__(self) -> Spool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Spool({str(self.path)!r}, durability={self.durability!r})"


def _nothing(conn: apsw.Connection) -> None:
    """An empty request: the writer commits it after everything queued before it."""


def reasons_filter(reasons: Sequence[str] | None, path: Path) -> str | None:
    """The ``reasons`` argument as a JSON array for ``json_each``; None means all."""
    if reasons is None:
        return None
    if isinstance(reasons, str):
        raise InvalidArgument(
            f"reasons must be a list of reasons, not the string {reasons!r}; "
            f"write reasons=[{reasons!r}]",
            path=path,
        )
    names = list(reasons)
    for name in names:
        check_lookup(name, "reason", path)
    return codec.encode(names).decode()


#: Types of a plain dict's ``timestamp`` that ``codec.with_epoch_timestamp`` leaves as
#: they are (the common case, without its call).
_NOT_DATES = frozenset((float, int, type(None), str))
#: Stands for the timestamp of a message that is not a plain dict: always converted.
_DATE = object()


def check_name(value: Any, what: str, path: Path, limit: int) -> None:
    """Refuse a session id, session key or reason that the spool cannot store.

    Any length state.db takes is taken, up to ``limit`` bytes (the spool's
    ``max_payload_bytes``: a name is stored like a payload).
    """
    check_lookup(value, what, path)
    if not value:
        raise InvalidArgument(f"{what} must not be empty", path=path)
    if len(value) > limit // 4 and len(value.encode("utf-8")) > limit:
        raise InvalidArgument(
            f"{what} is {len(value.encode('utf-8'))} bytes, over the spool's "
            f"max_payload_bytes={limit}",
            path=path,
        )


def check_lookup(value: Any, what: str, path: Path, *, stored_bytes: bool = False) -> None:
    """Refuse a name to look up that SQLite cannot even be asked about.

    An empty or overlong name simply finds nothing; a non-str or a str with a lone
    surrogate (which UTF-8 cannot carry) is an error. With ``stored_bytes`` (for a
    lookup whose SQL reads it with ``CAST(:param AS TEXT)``, bound by ``paging.bound``),
    surrogates that stand for bytes that are not UTF-8 (U+DC80-U+DCFF, as Python reads
    them from a command line and ``paging.as_text`` from the spool) look those bytes up.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, not {type(value).__name__}", path=path)
    if not value.isascii():
        try:
            value.encode("utf-8", "surrogateescape" if stored_bytes else "strict")
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"{what} {value!r} contains a lone surrogate, which UTF-8 cannot store",
                path=path,
            ) from None
