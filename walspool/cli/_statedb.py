"""Opening and checking the gateway's state.db for a replay. Not public API.

state.db is hermes' own SQLite file, opened here with the stdlib ``sqlite3`` module
(as hermes opens it); the spool is never opened with ``sqlite3``. walspool never
creates a state.db.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

from .. import files
from ..errors import NotASpool, WalspoolError
from ..files import SQLITE_MAGIC

#: Seconds a replay waits for the gateway to release state.db's write lock.
STATE_DB_WAIT_SECONDS = 5.0


class StateDBError(WalspoolError):
    """state.db is missing, locked, unreadable or not a hermes state.db."""


def open_state_db(
    path: Path, *, write: bool, wait: float | None = None, precheck: bool = True
) -> sqlite3.Connection:
    """Open the gateway's state.db with the stdlib, checked; never creates it.

    ``write`` opens it for writing (SQLite opens a file this user cannot write
    read-only all the same). With ``precheck`` too, take and release its write lock
    (``BEGIN IMMEDIATE``, waiting up to ``wait`` seconds), so a gateway holding it is
    reported before the replay starts rather than as one held session after another,
    and make one write that is rolled back, so a state.db this user cannot write is
    reported before the spool is touched (``BEGIN IMMEDIATE`` alone succeeds on a
    read-only file).
    """
    wait = STATE_DB_WAIT_SECONDS if wait is None else wait
    if not path.exists():
        raise StateDBError(
            f"no state.db at {path} (no such file); give the gateway's state.db "
            "(<HERMES_HOME>/state.db); walspool does not create one",
            path=path,
        )
    if not path.is_file():
        raise StateDBError(f"{path} is not a file; give the gateway's state.db", path=path)
    try:
        head = files.read_head(path)
    except (OSError, NotASpool) as exc:
        raise StateDBError(
            f"cannot read state.db at {path}: {exc.strerror or exc}; check its permissions",
            path=path,
        ) from exc
    if head != SQLITE_MAGIC:
        raise StateDBError(f"{path} is not a SQLite database, so not a hermes state.db", path=path)
    mode = "rw" if write else "ro"
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(
            f"file:{quote(str(path.absolute()))}?mode={mode}",
            uri=True,
            timeout=wait,
            isolation_level=None,
        )
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name IN ('sessions', 'messages')"
            )
        }
        if tables != {"sessions", "messages"}:
            raise StateDBError(
                f"{path} is a SQLite database but not a hermes state.db "
                "(it has no sessions and messages tables)",
                path=path,
            )
        if write and precheck:
            try_write(conn)
    except BaseException as exc:
        if conn is not None:
            conn.close()
        if isinstance(exc, sqlite3.Error):
            raise StateDBError(state_db_message(exc, path), path=path) from exc
        raise
    return conn


def try_write(conn: sqlite3.Connection) -> None:
    """Write state.db's header in a transaction that is rolled back; raise if refused.

    SQLite opens a file this user cannot write read-only without saying so, and takes
    the write lock all the same; only a write tells. The value written is the one
    already there, so not even a failed rollback could change anything.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute(f"PRAGMA user_version = {int(version)}")
    finally:
        conn.execute("ROLLBACK")


def state_db_message(exc: sqlite3.Error, path: Path) -> str:
    """One line saying what is wrong with state.db, for any stdlib sqlite3 error."""
    text = str(exc)
    low = text.lower()
    if "locked" in low or "busy" in low:
        return (
            f"state.db at {path} is locked by another process ({text}); wait for the "
            "gateway to finish writing, or stop it, and run the replay again"
        )
    if "readonly" in low or "read-only" in low:
        return (
            f"cannot write state.db at {path} ({text}); check the permissions of it, its "
            "-wal and -shm files and its directory, or run as the gateway's user"
        )
    if "unable to open" in low:
        return (
            f"cannot open state.db at {path} for writing ({text}); check the permissions "
            "of the file and its directory, or run as the gateway's user"
        )
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return f"state.db at {path} is damaged ({text}); repair it before replaying into it"
    return f"state.db at {path}: {type(exc).__name__}: {text}"


def session_exists(conn: sqlite3.Connection, session_id: str) -> bool:
    """Whether state.db has a ``sessions`` row for ``session_id``."""
    return conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is not None
