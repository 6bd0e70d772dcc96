"""The spool file: where it lives, how a connection to it is set up, its schema.

Every connection is an apsw connection. The stdlib ``sqlite3`` module is never used
on a spool: two SQLite libraries in one process can drop each other's POSIX locks
(https://www.sqlite.org/howtocorrupt.html#_multiple_copies_of_sqlite_linked_into_the_same_application).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import apsw

from .. import text
from ..errors import (
    DiskFull,
    NotASpool,
    SchemaTooNew,
    SchemaTooOld,
    SpoolCorrupt,
    SpoolIOError,
    UntrustedSpool,
    WalspoolError,
)
from . import files, open_guard

log = text.logger("walspool.schema")

# Every file SQLite opens for a spool is checked on its own descriptor (see open_guard).
open_guard.install()

#: ``PRAGMA application_id`` of a spool: "WSPL".
APPLICATION_ID = 0x5753504C
#: ``PRAGMA user_version`` of the schema this module creates.
SCHEMA_VERSION = 5

DURABILITY_SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}
#: ``PRAGMA fullfsync`` and ``checkpoint_fullfsync`` per durability (macOS's F_FULLFSYNC).
DURABILITY_FULLFSYNC = {"full": "ON", "normal": "OFF"}
BUSY_TIMEOUT_MS = 10_000
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024
#: Seconds an opener waits for a process that is moving a damaged spool aside.
OPEN_LOCK_WAIT = 30.0

# Added in schema 2 (``MIGRATE_V1_SQL`` adds them to a schema 1 file).
INDEXES_SQL = """
-- The rows a replay has out: found without a scan after a crash or a failed write.
CREATE INDEX IF NOT EXISTS records_inflight_idx ON records (id) WHERE inflight IS NOT NULL;

-- Statistics without reading payloads: rows, bytes and age by reason (stats) and by
-- stream (ls), each one walk of this index, never of the rows' pages (size is the
-- payload's length in bytes); and the rows with an error. Ordered by time, so an
-- append writes its entry at the end: one leaf per commit, however many sessions a
-- group holds (an index led by the session would write one leaf per session).
CREATE INDEX IF NOT EXISTS records_reason_created_at_size_session_id_session_key_idx
    ON records (reason, created_at, size, session_id, session_key);
CREATE INDEX IF NOT EXISTS records_last_error_idx ON records (id) WHERE last_error IS NOT NULL;
"""

BACKLOG_VIEW_SQL = """
CREATE VIEW backlog AS
SELECT
    session_id,
    CASE WHEN session_id IS NULL THEN session_key END AS session_key,
    count(*) AS rows,
    sum(size) AS bytes,
    strftime('%Y-%m-%dT%H:%M:%fZ', min(created_at), 'unixepoch') AS oldest,
    strftime('%Y-%m-%dT%H:%M:%fZ', max(created_at), 'unixepoch') AS newest,
    max(attempts) AS max_attempts,
    (SELECT h.last_error FROM records AS h
      WHERE h.session_id IS r.session_id
        AND (r.session_id IS NOT NULL OR h.session_key IS r.session_key)
        AND h.last_error IS NOT NULL
      ORDER BY h.seq LIMIT 1) AS last_error,
    count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
    count(*) FILTER (WHERE status = 'superseded') AS superseded
FROM records AS r
GROUP BY session_id, CASE WHEN session_id IS NULL THEN session_key END;
"""
FAILURES_VIEW_SQL = """
CREATE VIEW failures AS
SELECT
    id, session_id, session_key, seq, reason, attempts, last_error,
    strftime('%Y-%m-%dT%H:%M:%fZ', last_attempt_at, 'unixepoch') AS last_attempt,
    strftime('%Y-%m-%dT%H:%M:%fZ', created_at, 'unixepoch') AS created,
    status
FROM records
WHERE last_error IS NOT NULL;
"""

#: Schema 1 -> 2: the payload size column, its statistics indexes and the in-flight
#: index; the backlog view sums the new column.
MIGRATE_V1_SQL = f"""
UPDATE records SET size = length(CAST(payload AS BLOB));
{INDEXES_SQL}
PRAGMA user_version = 2;
"""
ADD_SIZE_SQL = "ALTER TABLE records ADD COLUMN size INTEGER NOT NULL DEFAULT 0 CHECK (size >= 0)"

#: Why a row a replay had out under schema 2 is quarantined by the upgrade: schema 2
#: recorded no ticket, so whether its write reached state.db cannot be known exactly.
UNKNOWN_LANDING_ERROR = (
    "in flight when the spool was upgraded from schema 2: whether it reached state.db "
    "is unknown; check state.db, then replay it with --quarantined if it is missing"
)
SPOOL_META_SQL = """
-- The spool's identity and its replay ticket counter. A replay stamps each row it
-- has out with a ticket (uid, number) that no other row of any spool ever gets; the
-- sink records the ticket in the same transaction as the message, so "did this row
-- land?" is a lookup, never a guess.
CREATE TABLE spool_meta (
    name TEXT PRIMARY KEY,
    value ANY NOT NULL
) STRICT, WITHOUT ROWID;
INSERT INTO spool_meta (name, value) VALUES
    ('uid', lower(hex(randomblob(16)))),
    ('next_ticket', 1);
"""
STATUS_INDEX_SQL = """
-- Rows set aside (quarantined, superseded) are few: counted from a small index.
CREATE INDEX records_status_idx ON records (status) WHERE status IS NOT NULL;
"""
#: Schema 2 -> 3: the status column (quarantined, superseded), the spool's identity
#: and ticket counter, and the views that show both.
MIGRATE_V2_SQL = f"""
ALTER TABLE records ADD COLUMN status TEXT
    CHECK (status IN ('quarantined', 'superseded'));
{STATUS_INDEX_SQL}
{SPOOL_META_SQL}
UPDATE records
   SET status = 'quarantined', inflight = NULL, last_error = :unknown
 WHERE inflight IS NOT NULL;
DROP VIEW backlog;
{BACKLOG_VIEW_SQL}
DROP VIEW failures;
{FAILURES_VIEW_SQL}
PRAGMA user_version = 3;
"""

#: The largest seq a stream's kept next seq is made from (SQLite's INTEGER ends at
#: 2**63 - 1): a hand-edited seq there cannot make the delete that keeps it fail.
MAX_KEPT_SEQ = 2**63 - 2
#: A stream's next seq, kept in ``sequences`` when its rows leave (the replayer's
#: delete, an operator's drop, a hand edit in the ``sqlite3`` shell) instead of on
#: every append: an append takes the larger of the stream's highest seq still in
#: ``records`` plus one and this number, so no seq is ever reused, and an append
#: writes no ``sequences`` page.
_KEEP_NEXT_SEQ_BODY = f"""
BEGIN
    INSERT INTO sequences (stream, name, next_seq)
    VALUES (CASE WHEN old.session_id IS NULL THEN 'session_key' ELSE 'session_id' END,
            coalesce(old.session_id, old.session_key),
            min(old.seq, {MAX_KEPT_SEQ}) + 1)
    ON CONFLICT (stream, name) DO UPDATE SET next_seq = max(next_seq, excluded.next_seq);
END;"""
KEEP_NEXT_SEQ_SQL = f"""
CREATE TRIGGER records_keep_next_seq_on_delete AFTER DELETE ON records{_KEEP_NEXT_SEQ_BODY}
CREATE TRIGGER records_keep_next_seq_on_update
    AFTER UPDATE OF session_id, session_key, seq ON records{_KEEP_NEXT_SEQ_BODY}
"""
#: The spool's next row id, kept in ``spool_meta`` (``next_id``) when rows leave, as
#: the next seq is in ``sequences``: an append takes the larger of the highest id still
#: in ``records`` plus one and this number, so an id once given (noted by an operator,
#: kept in ``audit``) never names another row, even once the spool was emptied.
_KEEP_NEXT_ID_BODY = f"""
BEGIN
    INSERT INTO spool_meta (name, value) VALUES ('next_id', min(old.id, {MAX_KEPT_SEQ}) + 1)
    ON CONFLICT (name) DO UPDATE SET value = max(value, excluded.value);
END;"""
KEEP_NEXT_ID_SQL = f"""
CREATE TRIGGER records_keep_next_id_on_delete AFTER DELETE ON records{_KEEP_NEXT_ID_BODY}
CREATE TRIGGER records_keep_next_id_on_update AFTER UPDATE OF id ON records{_KEEP_NEXT_ID_BODY}
"""
AUDIT_SQL = """
-- What operators did to rows through the command line (walspool drop, requeue):
-- when, who (user, uid, host, pid), the row, and for a dropped row its whole
-- content, so that a drop can be undone by hand.
CREATE TABLE audit (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    record_id INTEGER,
    session_id TEXT,
    session_key TEXT,
    seq INTEGER,
    detail TEXT
) STRICT;
"""
#: Schema 3 -> 4: the next seq kept on delete (triggers) instead of on each append,
#: the operators' audit table, and the statistics index covering streams as well as
#: reasons (built once, from the rows there: seconds on a million). ``sequences`` as schema 3
#: kept it stays valid.
MIGRATE_V3_SQL = f"""
{KEEP_NEXT_SEQ_SQL}
{AUDIT_SQL}
DROP INDEX IF EXISTS records_reason_created_at_size_idx;
{INDEXES_SQL}
PRAGMA user_version = 4;
"""
#: Schema 4 -> 5: the next row id kept when rows leave (triggers). Ids a schema 4
#: spool gave to rows already gone are not known, and may be given again.
MIGRATE_V4_SQL = f"""
{KEEP_NEXT_ID_SQL}
PRAGMA user_version = 5;
"""

SCHEMA_SQL = f"""
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};

-- One row per spooled message. A row belongs to the stream of its session_id, or,
-- when only the routing key is known, to the stream of its session_key; seq orders
-- a stream. inflight holds the row's replay ticket number (see spool_meta) from the
-- moment a replay takes it until the replay knows whether its write landed. status:
-- NULL (replayable), 'quarantined' (the sink refused its content, or whether it landed
-- cannot be known) or 'superseded' (the gateway rewrote the transcript); either is
-- kept for operators and replayed only when asked for.
CREATE TABLE records (
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    seq INTEGER NOT NULL CHECK (seq > 0),
    reason TEXT NOT NULL,
    session_key TEXT,
    created_at REAL NOT NULL,
    payload TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0 CHECK (size >= 0),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    last_attempt_at REAL,
    inflight INTEGER,
    status TEXT CHECK (status IN ('quarantined', 'superseded')),
    UNIQUE (session_id, seq),
    CHECK (session_id IS NOT NULL OR session_key IS NOT NULL)
) STRICT;

CREATE UNIQUE INDEX records_session_key_seq_idx
    ON records (session_key, seq) WHERE session_id IS NULL;

{INDEXES_SQL}
{STATUS_INDEX_SQL}
-- A number above every seq a stream has lost (its rows deleted, or moved by a hand
-- edit), kept after its rows are gone so that a seq is never reused; streams that
-- never lost a row have none. stream is 'session_id' or 'session_key'.
CREATE TABLE sequences (
    stream TEXT NOT NULL CHECK (stream IN ('session_id', 'session_key')),
    name TEXT NOT NULL,
    next_seq INTEGER NOT NULL CHECK (next_seq > 0),
    PRIMARY KEY (stream, name)
) STRICT, WITHOUT ROWID;

{KEEP_NEXT_SEQ_SQL}
{SPOOL_META_SQL}
{KEEP_NEXT_ID_SQL}
{AUDIT_SQL}
{BACKLOG_VIEW_SQL}
{FAILURES_VIEW_SQL}
"""

EXPECTED_OBJECTS = {
    ("table", "records"),
    ("table", "sequences"),
    ("table", "spool_meta"),
    ("table", "audit"),
    ("trigger", "records_keep_next_seq_on_delete"),
    ("trigger", "records_keep_next_seq_on_update"),
    ("trigger", "records_keep_next_id_on_delete"),
    ("trigger", "records_keep_next_id_on_update"),
    ("view", "backlog"),
    ("view", "failures"),
    ("index", "records_session_key_seq_idx"),
    ("index", "records_inflight_idx"),
    ("index", "records_reason_created_at_size_session_id_session_key_idx"),
    ("index", "records_last_error_idx"),
    ("index", "records_status_idx"),
}


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
    lock = hold_open_lock(path, owner)
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
        other = files.sqlite_user(path) if _lock_alone(lock) else 0
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


def hold_open_lock(path: Path, owner: int) -> int:
    """Open ``<spool>.open-lock`` and hold it shared.

    Every open ``Spool`` holds it, so a process that gets it exclusively knows it is
    the spool's only user. Waits at most ``OPEN_LOCK_WAIT`` seconds for a process
    that is moving a damaged spool aside. The kernel drops it when the process dies.
    """
    lock_path = Path(f"{path}{files.OPEN_LOCK_SUFFIX}")
    fd = files.open_private(lock_path, owner, path, "the open lock")
    deadline = time.monotonic() + OPEN_LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise SpoolIOError(
                    f"spool {path} stayed locked for {OPEN_LOCK_WAIT:g} s by a process "
                    f"moving it aside ({lock_path}); try again",
                    path=path,
                ) from None
            time.sleep(0.01)


def _lock_alone(fd: int) -> bool:
    """Turn our shared open lock exclusive if no other process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # A failed conversion may have dropped our shared lock: the caller raises.
        return False
    return True


def open_reader(path: Path) -> apsw.Connection:
    """Open an existing spool read-only (``mode=ro``); never creates or changes it."""
    files.refuse_symlink(path)
    if not path.exists():
        raise WalspoolError(f"no spool at {path}", path=path)
    owner = files.check_for_reading(path)
    files.refuse_non_sqlite(path)
    conn = None
    try:
        conn = connect(path, owner, apsw.SQLITE_OPEN_READONLY, "mode=ro")
        set_busy_timeout(conn)
        verify_read_only(conn, path)
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
#: longest string or blob SQLite may make for it, and how many thousand virtual machine
#: steps its statements may take in all. SQLite reads the file's statistics tables
#: while it loads the schema, before walspool's first statement: a crafted
#: ``sqlite_stat1`` (a generated column computing a huge value, or many rows) would
#: otherwise run with SQLite's own bounds (1 GB strings, no time limit).
UNVERIFIED_LENGTH = 1 << 20
UNVERIFIED_KILOSTEPS = 20_000


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
    name = _sqlite_name(path)
    open_guard.watch(name, owner)
    open_guard.refused()  # one left from an earlier failure is not this open's
    uri = f"file:{quote(name)}" + (f"?{query}" if query else "")
    conn = apsw.Connection(uri, flags=flags | apsw.SQLITE_OPEN_URI | apsw.SQLITE_OPEN_NOFOLLOW)
    conn.limit(apsw.SQLITE_LIMIT_LENGTH, UNVERIFIED_LENGTH)
    left = [UNVERIFIED_KILOSTEPS]

    def budget() -> bool:
        left[0] -= 1
        return left[0] < 0  # True interrupts the statement

    conn.set_progress_handler(budget, 1000)
    return conn


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
            f"({UNVERIFIED_LENGTH} bytes, {UNVERIFIED_KILOSTEPS} thousand steps): "
            + _OVER_BUDGET_ADVICE,
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


def refused_open(path: Path) -> WalspoolError | None:
    """The error for a file of the spool ``path`` SQLite was about to open in this
    thread and ``open_guard`` refused (a name changed after walspool's own checks),
    naming the file; None if nothing was refused."""
    refusal = open_guard.refused()
    database = _sqlite_name(path)
    if refusal is None or refusal.name not in {database + s for s in ("", *open_guard.SUFFIXES)}:
        return None  # nothing refused, or another spool's file: not why this failed
    name = Path(refusal.name)
    if refusal.stat is None:
        return files.symlink_refused(name, path)
    try:
        owner = refusal.stat.st_uid if refusal.owner is None else refusal.owner
        files.check_stat(refusal.stat, name, owner, path)
    except WalspoolError as exc:
        return exc
    return UntrustedSpool(
        f"{name} changed while SQLite opened it; walspool did not use it: try again",
        path=path,
    )


def verify_read_only(conn: apsw.Connection, path: Path) -> None:
    """A read-only connection just made: the file SQLite opened is the one checked, a
    spool of this schema version, and its schema walspool's, before any other statement.

    Raises ``NotASpool``/``SchemaTooNew`` for another file or version, and
    ``ForeignSchema`` naming every object that is not walspool's.
    """
    files.check_opened(path, opened_file(conn))
    _check_identity(conn, path, allow_empty=False)
    version = conn.execute("PRAGMA user_version").get
    if version < SCHEMA_VERSION:
        raise SchemaTooOld(version, SCHEMA_VERSION, path=path)
    problems = schema_problems(conn)
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
    conn = None
    try:
        conn = connect(path, owner, apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE)
        # Until the file is known to be a healthy spool, closing must not checkpoint:
        # that would fold a refused or damaged file's -wal into it and delete the -wal.
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        files.check_opened(path, opened_file(conn))
        set_busy_timeout(conn)
        set_foreign_keys_off(conn)
        # Before the schema's first commit or an upgrade's: those are synced as asked.
        set_synchronous(conn, durability)
        if _check_identity(conn, path, allow_empty=True):
            schema_verified(conn)  # a new file: the schema made next is walspool's
            set_wal(conn, path)
            _create_schema(conn)
        else:
            # Before any statement of the file's own (an upgrade's UPDATE would fire
            # a planted trigger): a schema that is not walspool's is a damaged spool.
            problems = schema_problems(conn)
            if problems:
                raise apsw.CorruptError(f"spool schema: {'; '.join(problems)}")
            schema_verified(conn)
            set_wal(conn, path)
            _migrate(conn, path)
        cheap_check(conn)
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 0)
        set_journal_size_limit(conn)
        set_max_bytes(conn, max_bytes)
    except apsw.Error as exc:
        close_quietly(conn)
        if over_budget(exc):
            raise SchemaOverBudget(path, exc) from exc
        raise sqlite_error(exc, path) from exc
    except BaseException:
        close_quietly(conn)
        raise
    return conn


def close_quietly(conn: apsw.Connection | None) -> None:
    """Close a connection on an error path, where the first error is the one to report."""
    if conn is not None:
        with contextlib.suppress(apsw.Error):
            conn.close()


def _sqlite_name(path: Path) -> str:
    """The spool's name as SQLite opens it, its directory resolved: SQLite's
    ``NOFOLLOW`` refuses a symlink anywhere in the name, and a symlinked
    ``HERMES_HOME`` is fine (only the spool's own name may not be a link, which
    ``files`` refuses)."""
    return str(Path(os.path.realpath(path.parent)) / path.name)


def _check_identity(conn: apsw.Connection, path: Path, *, allow_empty: bool) -> bool:
    """Return True for an empty database (a new spool); raise unless it is a spool."""
    app_id = conn.execute("PRAGMA application_id").get
    version = conn.execute("PRAGMA user_version").get
    objects = conn.execute("SELECT count(*) FROM sqlite_schema").get
    if app_id == 0 and version == 0 and objects == 0 and allow_empty:
        return True
    if app_id != APPLICATION_ID:
        raise NotASpool(
            f"{path} is a SQLite database but not a walspool spool "
            f"(application_id={app_id}); it was left unchanged",
            path=path,
        )
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(version, SCHEMA_VERSION, path=path)
    return False


def _create_schema(conn: apsw.Connection) -> None:
    """Create the schema in one transaction; a concurrent creator may have won."""
    with transaction(conn):
        if conn.execute("SELECT count(*) FROM sqlite_schema").get == 0:
            conn.execute(SCHEMA_SQL)


def _migrate(conn: apsw.Connection, path: Path) -> None:
    """Bring an older spool up to ``SCHEMA_VERSION`` in place, in one transaction."""
    found = conn.execute("PRAGMA user_version").get
    if found >= SCHEMA_VERSION:
        return
    with transaction(conn):
        version = conn.execute("PRAGMA user_version").get  # another process may have won
        if version == 1:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(records)")}
            if "size" not in columns:
                conn.execute(ADD_SIZE_SQL)
            conn.execute(MIGRATE_V1_SQL)
            version = 2
        if version == 2:
            quarantined = conn.execute(
                "SELECT count(*) FROM records WHERE inflight IS NOT NULL"
            ).get
            conn.execute(MIGRATE_V2_SQL, {"unknown": UNKNOWN_LANDING_ERROR})
            if quarantined:
                log.warning(
                    "%s: %d row(s) were in flight under schema 2 and are quarantined: "
                    "whether they reached state.db is unknown (see `walspool show`)",
                    path,
                    quarantined,
                )
            version = 3
        if version == 3:
            conn.execute(MIGRATE_V3_SQL)
            version = 4
        if version == 4:
            conn.execute(MIGRATE_V4_SQL)
    log.warning("upgraded spool %s from schema %d to %d", path, found, SCHEMA_VERSION)


CHEAP_CHECK_SQL = (
    "SELECT max(id) FROM records",
    "SELECT 1 FROM records ORDER BY session_id, seq LIMIT 1",
    "SELECT 1 FROM sequences LIMIT 1",
    "SELECT value FROM spool_meta WHERE name = 'uid'",
)


def cheap_check(conn: apsw.Connection) -> None:
    """Check the schema's definitions and touch each table's b-tree without scanning it.

    Catches a damaged header, schema or root page in constant time, and a schema
    that is not walspool's (see ``schema_problems``); ``walspool check`` runs the
    full ``integrity_check``.
    """
    problems = schema_problems(conn)
    if problems:
        raise apsw.CorruptError(f"spool schema: {'; '.join(problems)}")
    for sql in CHEAP_CHECK_SQL:
        conn.execute(sql).fetchall()


def schema_problems(conn: apsw.Connection) -> list[str]:
    """What in the file's schema is not walspool's, read from ``sqlite_schema`` and the
    tables' column lists only (no statement of the file's own runs): objects missing,
    objects walspool did not make (tables, views, indexes, triggers), views, indexes or
    triggers whose stored SQL differs from walspool's definitions, and tables whose
    columns (generated ones included) or options (STRICT, WITHOUT ROWID) differ.

    A spool of an older schema version is held to what an upgrade may meet: the
    objects any version made, no trigger but walspool's, no column walspool never
    made, none generated; the upgraded file is then checked in full.

    A crafted spool could otherwise run its own SQL whenever walspool reads a view
    (an endless recursive ``backlog``), a generated column, or appends (a trigger).
    """
    current = conn.execute("PRAGMA user_version").get >= SCHEMA_VERSION
    found = {(kind, name): sql for kind, name, sql in conn.execute(SCHEMA_OBJECTS_SQL)}
    expected = _expected_definitions()
    problems = []
    if current:
        problems = [
            f"the schema lacks the {kind} `{name}`"
            for kind, name in sorted(EXPECTED_OBJECTS - found.keys())
        ]
    for (kind, name), sql in sorted(found.items()):
        if kind == "table" and name in _SQLITE_OWN_TABLES:
            if _words(sql) != _SQLITE_OWN_TABLES[name]:
                problems.append(f"the table `{name}` is not SQLite's definition")
            continue
        if kind == "table" and _words(sql) == _LITESTREAM_TABLES.get(name):
            continue  # Litestream's, as it makes them: walspool never reads them
        known = (kind, name) in EXPECTED_OBJECTS or (not current and (kind, name) in _OLDER_OBJECTS)
        if not known:
            problems.append(f"the {kind} `{name}` is not walspool's")
        elif kind == "table":
            problems.extend(_table_problems(conn, name, current))
        elif kind == "view" and not current:
            continue  # an upgrade drops and remakes the views; it never reads them
        elif _words(sql) != expected.get((kind, name)):
            problems.append(f"the {kind} `{name}` is not walspool's definition")
    return problems


SCHEMA_OBJECTS_SQL = "SELECT type, name, sql FROM sqlite_schema WHERE sql IS NOT NULL"
TABLE_COLUMNS_SQL = (
    'SELECT name, type, "notnull", dflt_value, pk, hidden FROM pragma_table_xinfo(?)'
)
TABLE_OPTIONS_SQL = "SELECT strict, wr FROM pragma_table_list(?) WHERE schema = 'main'"
#: Tables SQLite itself makes (``ANALYZE``): statistics, as SQLite defines them. SQLite
#: reads them while it loads the schema, so one defined otherwise (a generated column,
#: by ``writable_schema``) runs SQL of whoever made it.
_SQLITE_OWN_TABLES = {
    "sqlite_stat1": "CREATE TABLE sqlite_stat1(tbl,idx,stat)",
    "sqlite_stat4": "CREATE TABLE sqlite_stat4(tbl,idx,neq,nlt,ndlt,sample)",
}
#: The tables Litestream (0.5) makes in a database it replicates, as it makes them:
#: plain tables, no SQL of theirs runs when walspool reads or writes the spool.
_LITESTREAM_TABLES = {
    "_litestream_seq": "CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)",
    "_litestream_lock": "CREATE TABLE _litestream_lock (id INTEGER)",
}
#: Objects only older schema versions have (dropped or replaced by an upgrade).
_OLDER_OBJECTS = {("index", "records_reason_created_at_size_idx")}
_OLDER_DEFINITIONS = (
    "CREATE INDEX IF NOT EXISTS records_reason_created_at_size_idx "
    "ON records (reason, created_at, size)",
)
_definitions: dict[tuple[str, str], str] = {}
_tables: dict[str, tuple[list[tuple[object, ...]], tuple[object, ...]]] = {}


def _table_problems(conn: apsw.Connection, name: str, current: bool) -> list[str]:
    columns, options = _expected_tables()[name]
    found = sorted(tuple(row) for row in conn.execute(TABLE_COLUMNS_SQL, (name,)))
    if current and found != columns:
        return [f"the table `{name}` does not have walspool's columns"]
    known = {column[0]: column for column in columns}
    for column in found:
        if column[5] != 0:  # generated or hidden: computed whenever it is read
            return [f"the table `{name}` has a generated column `{column[0]}`"]
        if column[0] not in known:
            return [f"the table `{name}` has a column `{column[0]}` walspool never made"]
    if tuple(conn.execute(TABLE_OPTIONS_SQL, (name,)).fetchall()[0]) != options:
        return [f"the table `{name}` is not STRICT as walspool makes it"]
    return []


def _expected_definitions() -> dict[tuple[str, str], str]:
    """The stored SQL of walspool's own views, indexes and triggers, from a scratch
    database."""
    _scratch()
    return _definitions


def _expected_tables() -> dict[str, tuple[list[tuple[object, ...]], tuple[object, ...]]]:
    """Each of walspool's tables: its ``table_xinfo`` rows and (strict, without rowid)."""
    _scratch()
    return _tables


def _scratch() -> None:
    if _definitions:
        return
    scratch = apsw.Connection(":memory:")
    try:
        scratch.execute(SCHEMA_SQL)
        for sql in _OLDER_DEFINITIONS:
            scratch.execute(sql)
        for kind, name, sql in scratch.execute(SCHEMA_OBJECTS_SQL).fetchall():
            if kind in ("view", "index", "trigger"):
                _definitions[(kind, name)] = _words(sql)
            elif kind == "table":
                columns = sorted(tuple(r) for r in scratch.execute(TABLE_COLUMNS_SQL, (name,)))
                options = tuple(scratch.execute(TABLE_OPTIONS_SQL, (name,)).fetchall()[0])
                _tables[name] = (columns, options)
    finally:
        scratch.close()


def _words(sql: str) -> str:
    return " ".join(sql.split())


@contextlib.contextmanager
def transaction(conn: apsw.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if not conn.get_autocommit():
            with contextlib.suppress(apsw.Error):
                conn.execute("ROLLBACK")
        raise


def sqlite_error(
    exc: apsw.Error,
    path: Path,
    session_id: str | None = None,
    conn: apsw.Connection | None = None,
) -> WalspoolError:
    """Map an apsw error to the walspool error named for its condition.

    A file of the spool that ``open_guard`` refused in this thread is named first
    (``refused_open``): it is why SQLite failed. ``conn``, when given, supplies the
    operating system's errno of the failure, which tells a full disk (ENOSPC) or a
    file-size limit (EFBIG) from other I/O errors.
    """
    refused = refused_open(path)
    if refused is not None:
        return refused
    os_errno = _system_errno(conn)
    text = f"{path}: {exc}"
    if isinstance(exc, (apsw.CorruptError, apsw.NotADBError)):
        return SpoolCorrupt(
            f"{text}; run `walspool check {path}`", path=path, session_id=session_id
        )
    if isinstance(exc, apsw.FullError) or os_errno in (errno.ENOSPC, errno.EFBIG):
        return DiskFull(
            f"{path}: no room to write ({exc}); free disk space, nothing stored was lost",
            path=path,
            session_id=session_id,
        )
    if isinstance(exc, apsw.IOError):
        return SpoolIOError(f"{text}; check the disk", path=path, session_id=session_id)
    return WalspoolError(text, path=path, session_id=session_id)


def _system_errno(conn: apsw.Connection | None) -> int:
    if conn is None:
        return 0
    try:
        return int(conn.system_errno)
    except apsw.Error:
        return 0
