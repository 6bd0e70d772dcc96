"""Spool files as older walspool versions wrote them, for the upgrade tests.

The SQL is the schema text those versions created, copied here so the tests keep
building the old files whatever the current schema becomes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apsw

SCHEMA_V2_SQL = """
PRAGMA application_id = 1465077836;
PRAGMA user_version = 2;
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
    UNIQUE (session_id, seq),
    CHECK (session_id IS NOT NULL OR session_key IS NOT NULL)
) STRICT;
CREATE UNIQUE INDEX records_session_key_seq_idx
    ON records (session_key, seq) WHERE session_id IS NULL;
CREATE INDEX IF NOT EXISTS records_inflight_idx ON records (id) WHERE inflight IS NOT NULL;
CREATE INDEX IF NOT EXISTS records_reason_created_at_size_idx
    ON records (reason, created_at, size);
CREATE INDEX IF NOT EXISTS records_last_error_idx ON records (id) WHERE last_error IS NOT NULL;
CREATE TABLE sequences (
    stream TEXT NOT NULL CHECK (stream IN ('session_id', 'session_key')),
    name TEXT NOT NULL,
    next_seq INTEGER NOT NULL CHECK (next_seq > 0),
    PRIMARY KEY (stream, name)
) STRICT, WITHOUT ROWID;
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
      ORDER BY h.seq LIMIT 1) AS last_error
FROM records AS r
GROUP BY session_id, CASE WHEN session_id IS NULL THEN session_key END;
CREATE VIEW failures AS
SELECT
    id, session_id, session_key, seq, reason, attempts, last_error,
    strftime('%Y-%m-%dT%H:%M:%fZ', last_attempt_at, 'unixepoch') AS last_attempt,
    strftime('%Y-%m-%dT%H:%M:%fZ', created_at, 'unixepoch') AS created
FROM records
WHERE last_error IS NOT NULL;
"""

#: Schema 2 -> schema 1, as ``test_schema`` has always rewritten it: no size column,
#: no statistics or in-flight indexes, a simpler backlog view.
DOWNGRADE_TO_V1_SQL = """
DROP VIEW backlog; DROP INDEX records_reason_created_at_size_idx;
DROP INDEX records_last_error_idx; DROP INDEX records_inflight_idx;
ALTER TABLE records DROP COLUMN size; PRAGMA user_version = 1;
CREATE VIEW backlog AS SELECT session_id, count(*) AS rows FROM records GROUP BY session_id;
"""


def make_v2_spool(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """Write a schema 2 spool at ``path`` holding ``rows``.

    Each row is ``(session_id, seq, payload_json, inflight)``; reason CAP_DROP.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    conn = apsw.Connection(str(path))
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(SCHEMA_V2_SQL)
        with conn:
            for i, (session_id, seq, payload, inflight) in enumerate(rows, 1):
                conn.execute(
                    "INSERT INTO records (id, session_id, seq, reason, created_at, payload, "
                    "size, inflight) VALUES (?, ?, ?, 'transcript_cap_drop', ?, ?, ?, ?)",
                    (i, session_id, seq, 1000.0 + i, payload, len(payload.encode()), inflight),
                )
            streams: dict[str, int] = {}
            for session_id, seq, _, _ in rows:
                streams[session_id] = max(streams.get(session_id, 0), seq + 1)
            for name, next_seq in streams.items():
                conn.execute("INSERT INTO sequences VALUES ('session_id', ?, ?)", (name, next_seq))
        path.chmod(0o600)
    finally:
        conn.close()


#: Schema 2 -> 3 as walspool's upgrade wrote it: the status column and its index, the
#: spool's identity and ticket counter, the views that show both.
UPGRADE_V2_TO_V3_SQL = """
ALTER TABLE records ADD COLUMN status TEXT CHECK (status IN ('quarantined', 'superseded'));
CREATE INDEX records_status_idx ON records (status) WHERE status IS NOT NULL;
CREATE TABLE spool_meta (name TEXT PRIMARY KEY, value ANY NOT NULL) STRICT, WITHOUT ROWID;
INSERT INTO spool_meta (name, value) VALUES
    ('uid', lower(hex(randomblob(16)))), ('next_ticket', 1);
DROP VIEW backlog;
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
DROP VIEW failures;
CREATE VIEW failures AS
SELECT
    id, session_id, session_key, seq, reason, attempts, last_error,
    strftime('%Y-%m-%dT%H:%M:%fZ', last_attempt_at, 'unixepoch') AS last_attempt,
    strftime('%Y-%m-%dT%H:%M:%fZ', created_at, 'unixepoch') AS created,
    status
FROM records
WHERE last_error IS NOT NULL;
PRAGMA user_version = 3;
"""


def make_v3_spool(
    path: Path, rows: list[tuple[Any, ...]], drained: dict[str, int] | None = None
) -> None:
    """Write a schema 3 spool at ``path`` holding ``rows`` (as ``make_v2_spool``, none
    in flight), whose ``sequences`` also keeps ``drained``: streams whose rows all left,
    by name, with their next seq (schema 3 kept every stream's next seq on append)."""
    make_v2_spool(path, rows)
    conn = apsw.Connection(str(path))
    try:
        with conn:
            conn.execute(UPGRADE_V2_TO_V3_SQL)
            for name, next_seq in (drained or {}).items():
                conn.execute("INSERT INTO sequences VALUES ('session_id', ?, ?)", (name, next_seq))
    finally:
        conn.close()
