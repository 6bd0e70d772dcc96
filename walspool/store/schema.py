"""The spool's schema: its tables, indexes, views and triggers, how a file is told to
be a spool, created, upgraded from an older schema, and checked against what walspool
makes (``schema_problems``: no statement of the file's own runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import apsw

from .. import text
from ..errors import (
    NotASpool,
    SchemaTooNew,
)

log = text.logger("walspool.schema")

#: ``PRAGMA application_id`` of a spool: "WSPL".
APPLICATION_ID = 0x5753504C
#: ``PRAGMA user_version`` of the schema this module creates.
SCHEMA_VERSION = 5


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


def check_identity(conn: apsw.Connection, path: Path, *, allow_empty: bool) -> bool:
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


def create_schema(conn: apsw.Connection) -> None:
    """Create the schema in one transaction; a concurrent creator may have won."""
    with transaction(conn):
        if conn.execute("SELECT count(*) FROM sqlite_schema").get == 0:
            conn.execute(SCHEMA_SQL)


def migrate(conn: apsw.Connection, path: Path) -> None:
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
