"""Connections to a spool: how each is made, set up and checked before use.

Every connection is an apsw connection made by ``connect``. The stdlib ``sqlite3``
module is never used on a spool: two SQLite libraries in one process can drop each
other's POSIX locks
(https://www.sqlite.org/howtocorrupt.html#_multiple_copies_of_sqlite_linked_into_the_same_application).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import apsw

from .. import text
from ..errors import SchemaTooOld, SpoolCorrupt, SpoolIOError, WalspoolError
from . import files, open_guard, open_lock, schema
from .sqlite_errors import sqlite_error

log = text.logger("walspool.connections")

# Every file SQLite opens for a spool is checked on its own descriptor (see open_guard).
open_guard.install_guard()

#: ``PRAGMA synchronous`` per durability.
DURABILITY_SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}
#: ``PRAGMA fullfsync`` and ``checkpoint_fullfsync`` per durability (macOS's F_FULLFSYNC).
DURABILITY_FULLFSYNC = {"full": "ON", "normal": "OFF"}
BUSY_TIMEOUT_MS = 10_000
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024


# -- connection setup, one concern each ----------------------------------------


def set_busy_timeout(conn: apsw.Connection) -> None:
    """Wait for a competing writer instead of failing with "database is locked".

    https://www.sqlite.org/c3ref/busy_timeout.html
    """
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)


def set_wal(conn: apsw.Connection, path: Path) -> None:
    """Use write-ahead logging: readers never block the writer, one fsync per commit.

    https://www.sqlite.org/wal.html
    """
    mode = conn.execute("PRAGMA journal_mode = WAL").get
    if mode != "wal":
        raise SpoolIOError(
            f"{path}: SQLite refused WAL mode (got {mode!r}); put the spool on a local file system",
            path=path,
        )


def set_synchronous(conn: apsw.Connection, durability: str) -> None:
    """FULL fsyncs the WAL at every commit (survives power loss); NORMAL does not
    (survives a killed process only). With FULL, commits and checkpoints also ask for
    ``F_FULLFSYNC`` where the system has it (macOS, where a plain fsync stops at the
    drive's cache); elsewhere these two pragmas change nothing.

    https://www.sqlite.org/pragma.html#pragma_synchronous
    https://www.sqlite.org/pragma.html#pragma_fullfsync
    """
    conn.execute(f"PRAGMA synchronous = {DURABILITY_SYNCHRONOUS[durability]}")
    conn.execute(f"PRAGMA fullfsync = {DURABILITY_FULLFSYNC[durability]}")
    conn.execute(f"PRAGMA checkpoint_fullfsync = {DURABILITY_FULLFSYNC[durability]}")


def set_journal_size_limit(conn: apsw.Connection) -> None:
    """Truncate the WAL back to a bounded size after each checkpoint resets it.

    https://www.sqlite.org/pragma.html#pragma_journal_size_limit
    """
    conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")


def set_max_bytes(conn: apsw.Connection, max_bytes: int | None) -> None:
    """Cap the database at ``max_bytes`` with ``max_page_count``; None leaves it uncapped.

    SQLite enforces the cap itself: an insert that would grow the file past it fails
    with SQLITE_FULL and changes nothing. https://www.sqlite.org/pragma.html#pragma_max_page_count
    """
    if max_bytes is None:
        return
    page_size = conn.execute("PRAGMA page_size").get
    conn.pragma("max_page_count", max(1, int(max_bytes) // page_size))


def set_foreign_keys_off(conn: apsw.Connection) -> None:
    """The spool has no foreign keys; keep SQLite from looking for any."""
    conn.execute("PRAGMA foreign_keys = OFF")


# -- opening -----------------------------------------------------------------


def open_writer(
    path: Path, durability: str, max_bytes: int | None
) -> tuple[apsw.Connection, int, int]:
    """Open (creating if needed) the spool for writing, checked and set up.

    Returns the connection, the descriptor of the spool's open lock, held shared
    for as long as the spool is open (close it after the connection), and the uid
    of the spool's owner (see ``walspool.store.files``). A file that is not a spool, or
    of a newer schema, raises and is left unchanged. A spool SQLite reports as
    damaged is moved aside and a fresh one opened, but only by a process that can
    take the open lock exclusively, which proves that no other process has the
    spool open (its appends would otherwise go on into the renamed file); if one
    has, this raises ``SpoolCorrupt`` and changes nothing.
    """
    files.refuse_read_only(path)
    owner = files.make_and_check(path)
    # Someone else's file is refused before a lock file is made beside it.
    files.refuse_non_sqlite(path)
    lock = open_lock.hold(path, owner)
    try:
        conn = _open_locked(path, owner, durability, max_bytes, lock)
    except BaseException:
        os.close(lock)
        raise
    return conn, lock, owner


def _open_locked(
    path: Path, owner: int, durability: str, max_bytes: int | None, lock: int
) -> apsw.Connection:
    try:
        return _open_checked(path, owner, durability, max_bytes)
    except SpoolCorrupt as exc:
        # No other walspool process has it open (the open lock), and no other program
        # either (SQLite's own locks): Litestream, say, would go on reading the renamed
        # file's successor's -wal as its own.
        why = exc if isinstance(exc, SchemaOverBudget) else exc.__cause__ or exc
        other = files.sqlite_user(path) if open_lock.alone(lock) else 0
        if other is not None:
            who = f" (pid {other})" if other else ""
            raise SpoolCorrupt(
                f"spool {path} is damaged ({why}) and another process has "
                f"it open{who}, so it cannot be moved aside now; stop the other users of it "
                "(the gateway, a replay, Litestream) and open it again, or run `walspool "
                f"check {path}`",
                path=path,
            ) from exc
        try:
            moved = files.move_aside(path)
            log.error(
                "spool %s is damaged (%s); moved it aside to %s and opened a fresh spool",
                path,
                why,
                moved,
            )
            files.make_and_check(path)
            return _open_checked(path, owner, durability, max_bytes)
        finally:
            fcntl.flock(lock, fcntl.LOCK_SH)  # back to sharing it with later openers


def open_reader(path: Path) -> apsw.Connection:
    """Open an existing spool read-only (``mode=ro``); never creates or changes it."""
    files.refuse_symlink(path)
    if not path.exists():
        raise WalspoolError(f"no spool at {path}", path=path)
    owner = files.check_for_reading(path)
    files.refuse_non_sqlite(path)

    def set_up(conn: apsw.Connection) -> None:
        set_busy_timeout(conn)
        verify_read_only(conn, path)

    return _made(path, lambda: connect(path, owner, apsw.SQLITE_OPEN_READONLY, "mode=ro"), set_up)


def _made(
    path: Path, make: Callable[[], apsw.Connection], set_up: Callable[[apsw.Connection], None]
) -> apsw.Connection:
    """The connection ``make`` makes, once ``set_up`` ran on it. On any failure it is
    closed, and an SQLite error raised as walspool's (``SchemaOverBudget`` when
    ``connect``'s bounds stopped it)."""
    conn = None
    try:
        conn = make()
        set_up(conn)
    except apsw.Error as exc:
        close_quietly(conn)
        if over_budget(exc):
            raise SchemaOverBudget(path, exc) from exc
        raise sqlite_error(exc, path) from exc
    except BaseException:
        close_quietly(conn)
        raise
    return conn


#: Until a connection's schema is known to be walspool's (``schema_verified``): the
#: longest string or blob SQLite may make for it, how many thousand virtual machine
#: steps its statements may take in all, and how many seconds of CPU they may use on
#: the threads that run them (a step may be costly: a ``printf`` of a megabyte). SQLite
#: reads the file's statistics tables while it loads the schema, before walspool's
#: first statement: a crafted ``sqlite_stat1`` (a generated column computing a huge
#: value, or many rows of large ones) would otherwise run with SQLite's own bounds (1 GB
#: strings, no time limit). A genuine spool's schema loads in a few thousand steps and
#: milliseconds.
UNVERIFIED_LENGTH = 1 << 20
UNVERIFIED_KILOSTEPS = 20_000
UNVERIFIED_CPU_SECONDS = 1.0
#: Steps between two looks at the budget while the schema is unverified.
_BUDGET_STEPS = 100


def connect(path: Path, owner: int, flags: int, query: str = "") -> apsw.Connection:
    """An apsw connection to the spool ``path`` of the user ``owner``: the only way
    walspool opens one.

    The name is handed to SQLite by URI (``query`` its parameters, ``mode=ro``), no
    link followed; every file SQLite opens for it (the database, ``-journal``, ``-wal``,
    ``-shm``) is checked on the descriptor SQLite keeps (``open_guard``): a regular file
    of ``owner`` with one link, or one SQLite's call just created. It runs within
    ``UNVERIFIED_LENGTH`` and ``UNVERIFIED_KILOSTEPS`` until ``schema_verified``: a
    file that needs more to load its schema fails with ``SchemaOverBudget``.
    """
    name = files.sqlite_name(path)
    open_guard.watch(name, owner)
    open_guard.refused()  # one left from an earlier failure is not this open's
    uri = f"file:{quote(name)}" + (f"?{query}" if query else "")
    conn = apsw.Connection(uri, flags=flags | apsw.SQLITE_OPEN_URI | apsw.SQLITE_OPEN_NOFOLLOW)
    conn.limit(apsw.SQLITE_LIMIT_LENGTH, UNVERIFIED_LENGTH)
    conn.set_progress_handler(_Budget(), _BUDGET_STEPS)
    return conn


class _Budget:
    """``connect``'s progress handler until the schema is verified: True (interrupt)
    once the connection's statements took ``UNVERIFIED_KILOSTEPS`` thousand steps or
    ``UNVERIFIED_CPU_SECONDS`` of CPU, counted on each thread between two of its calls
    (a connection may be used by more than one thread; what a thread does between its
    calls, outside SQLite, is small next to the bound)."""

    __slots__ = ("steps", "cpu", "last")

    def __init__(self) -> None:
        self.steps = 0
        self.cpu = 0.0
        self.last: dict[int, float] = {}

    def __call__(self) -> bool:
        self.steps += _BUDGET_STEPS
        now = time.thread_time()
        thread = threading.get_ident()
        self.cpu += now - self.last.get(thread, now)
        self.last[thread] = now
        return self.steps > UNVERIFIED_KILOSTEPS * 1000 or self.cpu > UNVERIFIED_CPU_SECONDS


#: SQLite instructions between two calls of a long statement's ``tick`` (``ticking``).
TICK_STEPS = 100_000


@contextlib.contextmanager
def ticking(conn: apsw.Connection, tick: Callable[[], object] | None) -> Iterator[None]:
    """For the block, call ``tick`` every ``TICK_STEPS`` SQLite instructions (a
    command's progress line redrawn while one statement runs long: ``check``'s
    integrity_check, ``vacuum``'s copy); None: nothing. Never interrupts."""
    if tick is None:
        yield
        return

    def go_on() -> bool:
        tick()
        return False

    conn.set_progress_handler(go_on, TICK_STEPS)
    try:
        yield
    finally:
        conn.set_progress_handler(None)


@contextlib.contextmanager
def stoppable(conn: apsw.Connection, stop: Callable[[], bool] | None, steps: int) -> Iterator[None]:
    """For the block, ask ``stop`` every ``steps`` SQLite instructions whether to end
    the running statement (True: it raises ``apsw.InterruptError``); None: never."""
    if stop is None:
        yield
        return
    conn.set_progress_handler(stop, steps)
    try:
        yield
    finally:
        conn.set_progress_handler(None)


def schema_verified(conn: apsw.Connection) -> None:
    """Lift ``connect``'s bounds: the file's schema is walspool's (or the file is new)."""
    conn.limit(apsw.SQLITE_LIMIT_LENGTH, 2**31 - 1)  # SQLite keeps its compiled maximum
    conn.set_progress_handler(None)


class SchemaOverBudget(SpoolCorrupt):
    """A spool whose schema SQLite could not load within ``connect``'s bounds."""

    def __init__(self, path: Path, exc: apsw.Error) -> None:
        what = "made a value too long" if isinstance(exc, apsw.TooBigError) else "took too long"
        super().__init__(
            f"{path}: loading its schema {what} for walspool's bounds before any check "
            f"({UNVERIFIED_LENGTH} bytes, {UNVERIFIED_KILOSTEPS} thousand steps, "
            f"{UNVERIFIED_CPU_SECONDS:g} s of CPU): " + _OVER_BUDGET_ADVICE,
            path=path,
        )


#: What ``SchemaOverBudget`` tells the operator to do.
_OVER_BUDGET_ADVICE = (
    "a table SQLite reads on its own (sqlite_stat1, sqlite_stat4) was made to compute "
    "something; nothing of it was used. Drop those tables with the sqlite3 shell "
    "(`DROP TABLE sqlite_stat1`), or move the file aside"
)


def over_budget(exc: apsw.Error) -> bool:
    """Whether ``exc`` is ``connect``'s bounds stopping a statement."""
    return isinstance(exc, (apsw.TooBigError, apsw.InterruptError))


def verify_read_only(conn: apsw.Connection, path: Path) -> None:
    """A read-only connection just made: the file SQLite opened is the one checked, a
    spool of this schema version, and its schema walspool's, before any other statement.

    Raises ``NotASpool``/``SchemaTooNew`` for another file or version, and
    ``ForeignSchema`` naming every object that is not walspool's.
    """
    files.check_opened(path, opened_file(conn))
    schema.check_identity(conn, path, allow_empty=False)
    version = conn.execute("PRAGMA user_version").get
    if version < schema.SCHEMA_VERSION:
        raise SchemaTooOld(version, schema.SCHEMA_VERSION, path=path)
    problems = schema.schema_problems(conn)
    if problems:
        raise ForeignSchema(path, problems)
    schema_verified(conn)


class ForeignSchema(SpoolCorrupt):
    """A spool whose schema has objects walspool did not make, or lacks some of its
    own; ``problems`` names each. None of its statements was run."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(
            f"{path}: the spool's schema is not walspool's ({'; '.join(problems)}); "
            f"nothing was read from it: run `walspool check {path}`",
            path=path,
        )
        self.problems = problems


#: Bytes before ``int h`` (the descriptor) in os_unix.c's ``struct unixFile``: the
#: ``pMethod``, ``pVfs`` and ``pInode`` pointers.
_UNIX_FILE_FD_OFFSET = 3 * ctypes.sizeof(ctypes.c_void_p)


def opened_file(conn: apsw.Connection) -> os.stat_result | None:
    """``fstat`` of the descriptor SQLite holds for ``conn``'s main database, or None
    where it cannot be had (another VFS than SQLite's own ``unix``).

    This proves which file SQLite opened, whatever the path names now or named then.
    """
    if conn.open_vfs != "unix":
        return None
    pointer = ctypes.c_void_p()
    found = conn.file_control("main", apsw.SQLITE_FCNTL_FILE_POINTER, ctypes.addressof(pointer))
    if not found or not pointer.value:
        return None
    fd = ctypes.c_int.from_address(pointer.value + _UNIX_FILE_FD_OFFSET).value
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _open_checked(
    path: Path, owner: int, durability: str, max_bytes: int | None
) -> apsw.Connection:
    files.refuse_non_sqlite(path)

    def set_up(conn: apsw.Connection) -> None:
        # Until the file is known to be a healthy spool, closing must not checkpoint:
        # that would fold a refused or damaged file's -wal into it and delete the -wal.
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        files.check_opened(path, opened_file(conn))
        set_busy_timeout(conn)
        set_foreign_keys_off(conn)
        # Before the schema's first commit or an upgrade's: those are synced as asked.
        set_synchronous(conn, durability)
        if schema.check_identity(conn, path, allow_empty=True):
            schema_verified(conn)  # a new file: the schema made next is walspool's
            set_wal(conn, path)
            schema.create_schema(conn)
        else:
            # Before any statement of the file's own (an upgrade's UPDATE would fire
            # a planted trigger): a schema that is not walspool's is a damaged spool.
            problems = schema.schema_problems(conn)
            if problems:
                raise apsw.CorruptError(f"spool schema: {'; '.join(problems)}")
            schema_verified(conn)
            set_wal(conn, path)
            schema.migrate(conn, path)
        schema.cheap_check(conn)
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 0)
        set_journal_size_limit(conn)
        set_max_bytes(conn, max_bytes)

    flags = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE
    return _made(path, lambda: connect(path, owner, flags), set_up)


def close_quietly(conn: apsw.Connection | None) -> None:
    """Close a connection on an error path, where the first error is the one to report."""
    if conn is not None:
        with contextlib.suppress(apsw.Error):
            conn.close()
