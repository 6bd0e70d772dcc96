"""Reading a spool that creates no file beside it: the read-only open every read
command uses, and the records in drop order a page at a time.

A ``mode=ro`` open of a WAL database whose ``-wal`` is gone (a spool closed
cleanly) creates a ``-wal`` and a ``-shm`` beside it, and fails in a directory this
user cannot write ("attempt to write a readonly database"). Such a spool's database
file holds every row, so it is read with ``immutable=1``, which opens nothing else
(https://www.sqlite.org/wal.html#readonly). Immutable means SQLite takes no lock and
trusts the file not to change, so while it is open this module holds a shared lock
on the file's SQLite SHARED byte range itself, as a reader would: a writer that
opens meanwhile cannot finish closing (that needs the exclusive lock) and so cannot
remove its ``-wal``; and a writer only ever changes the database file by
checkpointing from a ``-wal``. Each read is therefore checked afterwards: if a
``-wal`` exists by then, the read may have seen a checkpoint half done, so the
spool is reopened ``mode=ro`` (using the writer's ``-wal`` and ``-shm``) and the
read done again.

The lock is an open-file-description lock, taken only when there is no ``-wal``:
then no SQLite connection of this process has the spool open, so closing the lock's
descriptor cannot drop a POSIX lock SQLite holds (the classic fcntl pitfall).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import apsw

from ..errors import NotASpool, SpoolCorrupt
from . import connections, files, sqlite_errors
from .connections import open_reader
from .directories import open_directory
from .paging import PAGE_ROWS, ROW_BYTES_SQL, bound, read_page, record_from_row, undecodable
from .records import Record
from .spool import RECORD_COLUMNS, check_lookup, reasons_filter

T = TypeVar("T")

#: SQLite's SHARED lock range on a database file (os_unix.c: PENDING_BYTE + 2, 510 bytes).
SHARED_FIRST = 0x40000000 + 2
SHARED_SIZE = 510
#: ``struct flock`` on Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
FLOCK = "hhqqi4x"


class SpoolReader:
    """The spool at ``path`` open for reading; ``read(fn)`` runs ``fn(conn)``.

    Raises what ``open_reader`` raises (``apsw.Error``, ``NotASpool``, ...).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock: int | None = None
        self.conn = self._open()

    @property
    def immutable(self) -> bool:
        return self.lock is not None

    def read(self, fn: Callable[[apsw.Connection], T]) -> T:
        """``fn(conn)``, done again on a ``mode=ro`` connection if a writer came meanwhile."""
        result = fn(self.conn)
        if self.immutable and _has_wal(self.path):
            self._reopen()
            result = fn(self.conn)
        return result

    def close(self) -> None:
        connections.close_quietly(self.conn)
        self._unlock()

    def _open(self) -> apsw.Connection:
        # Before SQLite opens anything: a FIFO or a stranger's file is refused here.
        files.check_for_reading(self.path)
        if not _has_wal(self.path):
            self.lock = _lock_shared(self.path)
            if self.lock is not None and not _has_wal(self.path):
                try:
                    conn = _open_immutable(self.path)
                except BaseException:
                    self._unlock()
                    raise
                if not _has_wal(self.path):
                    return conn
                connections.close_quietly(conn)
            self._unlock()
        return open_reader(self.path)

    def _reopen(self) -> None:
        connections.close_quietly(self.conn)
        # Unlocked first: from here this process holds SQLite's own locks on the file.
        self._unlock()
        self.conn = open_reader(self.path)

    def _unlock(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def _has_wal(path: Path) -> bool:
    return os.path.lexists(f"{path}-wal")


def _lock_shared(path: Path) -> int | None:
    """A descriptor of ``path`` holding a shared lock on SQLite's SHARED range, or
    None when it cannot be had now (a writer is closing the spool) or here.

    Opened below the checked directory with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
    swapped in never hangs the open) and refused unless it is a regular file."""
    if not hasattr(fcntl, "F_OFD_SETLK"):
        return None
    with open_directory(path.parent, path) as directory:
        fd = directory.open(path.name, os.O_RDONLY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotASpool(f"{path} is not a regular file, so not a spool", path=path)
        lock = struct.pack(FLOCK, fcntl.F_RDLCK, os.SEEK_SET, SHARED_FIRST, SHARED_SIZE, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EINVAL):
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_immutable(path: Path) -> apsw.Connection:
    """``open_reader``'s checks on an ``immutable=1`` connection."""
    owner = files.check_for_reading(path)
    files.refuse_non_sqlite(path)
    conn = None
    try:
        conn = connections.connect(path, owner, apsw.SQLITE_OPEN_READONLY, "mode=ro&immutable=1")
        connections.verify_read_only(conn, path)
    except apsw.Error as exc:
        connections.close_quietly(conn)
        refused = sqlite_errors.refused_open(path)  # a file swapped in after the check
        if refused is not None:
            raise refused from exc
        if connections.over_budget(exc):
            raise connections.SchemaOverBudget(path, exc) from exc
        raise
    except BaseException:
        connections.close_quietly(conn)
        raise
    return conn


# -- records in drop order -----------------------------------------------------------


#: Each row's columns, whether its payload is JSON (as SQLite reads it, in C: no Python
#: object per value) and what it costs to hold (``paging``): never the ``size`` column.
_ROW = f"SELECT {RECORD_COLUMNS}, inflight, json_valid(payload), {ROW_BYTES_SQL} FROM records"
_BY_REASON = "(:reasons IS NULL OR reason IN (SELECT value FROM json_each(:reasons)))"
#: Keyset pages: streams spooled by session_id, then those spooled by key only,
#: each in seq order; or one name's two streams. One short read per page.
_PAGES_SQL = {
    (False, "id"): f"""{_ROW} WHERE session_id IS NOT NULL
        AND (session_id, seq) > (CAST(:name AS TEXT), :seq) AND {_BY_REASON}
        ORDER BY session_id, seq LIMIT :limit""",
    (False, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND (session_key, seq) > (CAST(:name AS TEXT), :seq) AND {_BY_REASON}
        ORDER BY session_key, seq LIMIT :limit""",
    (
        True,
        "id",
    ): f"""{_ROW} WHERE session_id = CAST(:session AS TEXT) AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
    (True, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND session_key = CAST(:session AS TEXT) AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
}
_COUNT_SQL = f"""SELECT count(*) FROM records WHERE {_BY_REASON}
    AND (:session IS NULL OR session_id = CAST(:session AS TEXT)
         OR (session_id IS NULL AND session_key = CAST(:session AS TEXT)))"""


class BadPayload:
    """In place of the message of a row walspool cannot read: its payload is not JSON,
    or too costly to decode (``codec.MAX_DEPTH``, ``codec.MAX_VALUES``), or its
    session id, reason or key is not UTF-8. Its raw text, flagged: ``label`` says
    which ("NOT JSON", "NOT UTF-8")."""

    __slots__ = ("raw", "error", "label")

    def __init__(self, raw: Any, error: str, label: str = "NOT JSON") -> None:
        self.raw = raw if isinstance(raw, str) else repr(raw)
        self.error = error
        self.label = label


class RawPayload:
    """In place of a message that is only copied (``export``, ``show --json --full``):
    its stored JSON text, which SQLite found valid, never decoded."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def iter_records(
    reader: SpoolReader,
    session: str | None = None,
    reasons: Sequence[str] | None = None,
    bad: list[str] | None = None,
    kinds: Sequence[str] = ("id", "key"),
    *,
    raw: bool = False,
) -> Iterator[tuple[Record, int | None]]:
    """Yield ``(record, inflight)`` in drop order, a page per read transaction.

    ``session`` selects the rows spooled with that session_id and then those spooled
    with that session_key but no session_id; ``kinds`` narrows it to streams
    spooled by session id (``"id"``) or by key only (``"key"``). Rows appended
    meanwhile may or may not be seen; none is seen twice. A row whose payload is
    not JSON, or is too costly to decode, is yielded all the same, its message a
    ``BadPayload``, and named in ``bad``. With ``raw``, a payload that is JSON is not
    decoded at all: its message is a ``RawPayload`` of the stored text, whatever its
    depth or size (a page is bounded by what its rows cost: ``paging``).
    """
    path = reader.path
    if session is not None:
        check_lookup(session, "session", path, stored_bytes=True)
    params: dict[str, Any] = {
        "reasons": reasons_filter(reasons, path),
        "session": bound(session),
        "limit": PAGE_ROWS,
    }
    for kind in kinds:
        sql = _PAGES_SQL[(session is not None, kind)]
        name, seq = "", 0
        while True:
            page = {**params, "name": bound(name), "seq": seq}
            rows, full = reader.read(lambda c, sql=sql, page=page: read_page(c, sql, page))
            for row in rows:
                columns, inflight, valid = row[:-3], row[-3], row[-2]
                if raw and valid and isinstance(columns[6], str) and not _odd_text(columns):
                    record = Record(*columns[:6], RawPayload(columns[6]), *columns[7:])
                else:
                    record = _record_or_flagged(columns, path, bad)
                yield record, inflight
            if not full:
                break
            last = rows[-1]
            name, seq = (last[1] if kind == "id" else last[4]), last[2]


def _odd_text(columns: tuple[Any, ...]) -> bool:
    """Whether the row's session id, reason or session key is not UTF-8."""
    return any(undecodable(columns[i]) for i in (1, 3, 4))


def _record_or_flagged(row: tuple[Any, ...], path: Path, bad: list[str] | None) -> Record:
    try:
        return record_from_row(row, path)
    except SpoolCorrupt as exc:
        row_id, session_id, seq = row[0], row[1] if row[1] is not None else row[4], row[2]
        if bad is not None:
            bad.append(f"id {row_id} (session {session_id}, seq {seq})")
        label = "NOT UTF-8" if _odd_text(row) else "NOT JSON"
        flagged = BadPayload(row[6], str(exc.__cause__ or exc), label)
        return Record(*row[:6], flagged, *row[7:])


def count_records(reader: SpoolReader, session: str | None, reasons: Sequence[str] | None) -> int:
    """How many rows ``iter_records`` would yield now (for the progress bar)."""
    if session is not None:
        check_lookup(session, "session", reader.path, stored_bytes=True)
    params = {"reasons": reasons_filter(reasons, reader.path), "session": bound(session)}
    return int(reader.read(lambda c: c.execute(_COUNT_SQL, params).get))
