"""Opening and checking the gateway's state.db for a replay. Not public API.

state.db is hermes' own SQLite file, opened here with the stdlib ``sqlite3`` module
(as hermes opens it); the spool is never opened with ``sqlite3``. walspool never
creates a state.db.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import stat
from pathlib import Path
from urllib.parse import quote

from ..errors import UntrustedSpool, WalspoolError
from ..replay.sinks import met_a_lock
from ..store.directories import open_directory
from ..store.files import SQLITE_MAGIC

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
    checked = check_state_db(path)
    before = open_descriptors()
    mode = "rw" if write else "ro"
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(
            f"file:{quote(str(path.absolute()))}?mode={mode}",
            uri=True,
            timeout=wait,
            isolation_level=None,
        )
        checked.verify(before, writable=write)  # before any statement: the file checked
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


class CheckedStateDB:
    """A state.db checked on a descriptor opened below its checked directory: its
    identity, to prove that what SQLite opens by the path is that very file."""

    def __init__(self, path: Path, identity: tuple[int, int], owner: int) -> None:
        self.path = path
        self.identity = identity
        self.owner = owner

    def verify(self, before: dict[int, tuple[int, int]] | None, writable: bool = False) -> None:
        """Raise ``StateDBError`` unless SQLite, having opened the path since the
        descriptors ``before`` were listed (``open_descriptors``), holds the file checked.

        The path must still name the checked file, and SQLite must hold it: open on a
        descriptor made since (a link swapped in after the check, or a file renamed
        over it, shows as another file). SQLite may instead reuse a descriptor of a
        connection it closed while another connection of this process held a lock on
        that file, but only for the very file its path names then: so where this
        process held the checked file before, the descriptors made since may be only
        its ``-wal``, ``-shm`` or ``-journal``; another file among them is what SQLite
        opened (the path named it for that moment), and refused. Refused before the
        first write. Where descriptors cannot be listed, only the path is compared.

        ``writable``: SQLite was asked to open the file for writing. When its first open
        meets a file this user cannot write it opens the path again read-only: if the
        path named another file for the first (a link swapped in and out), the second
        opens the checked file read-only, and every write would fail as if the user
        could not write it. Refused too, where this user can write the checked file.
        """
        try:
            with open_directory(self.path.parent, self.path) as directory:
                st = directory.lstat(self.path.name)
                companions = set()
                for suffix in ("-wal", "-shm", "-journal"):
                    found = directory.lstat(self.path.name + suffix)
                    if found is not None:
                        companions.add((found.st_dev, found.st_ino))
        except (OSError, UntrustedSpool) as exc:
            raise StateDBError(f"cannot check state.db at {self.path}: {exc}") from exc
        if st is None or (st.st_dev, st.st_ino) != self.identity:
            raise self._changed()
        now = open_descriptors()
        if before is None or now is None:
            return
        # A descriptor number reused since for another file counts as made since.
        made = {fd: identity for fd, identity in now.items() if before.get(fd) != identity}
        opened = set(made.values())
        if self.identity in opened:
            if writable and not _opened_for_writing(made, self.identity):
                raise self._changed()
            return
        if self.identity in before.values() and opened <= companions:
            return  # SQLite reused its descriptor of the checked file
        raise self._changed()

    def _changed(self) -> StateDBError:
        return StateDBError(
            f"state.db at {self.path} changed while walspool was opening it (replaced, or "
            "a link put in its place); nothing was written: if nobody else changes its "
            "directory, run the command again",
            path=self.path,
        )


def _opened_for_writing(made: dict[int, tuple[int, int]], identity: tuple[int, int]) -> bool:
    """Whether SQLite's new descriptor of the file ``identity`` is open for writing, or
    this user cannot write that file (then read-only is the file's own answer)."""
    for fd, found in made.items():
        if found != identity:
            continue
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR:
                return True
            # Not opened for writing: was it this user's right (no open, no lock lost)?
            return not os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True)
        except OSError:
            return True  # closed meanwhile: nothing to tell
    return True


def check_state_db(path: Path) -> CheckedStateDB:
    """Open ``path`` below its checked directory (``O_NOFOLLOW | O_NONBLOCK``) and
    check it on the descriptor: a regular file of the directory's owner, one link,
    SQLite's header. Raises ``StateDBError`` saying what it is instead."""
    try:
        directory = open_directory(path.parent, path)
    except FileNotFoundError as exc:
        raise _missing(path) from exc
    except OSError as exc:
        raise StateDBError(
            f"cannot open the directory of state.db at {path}: {exc.strerror or exc}",
            path=path,
        ) from exc
    except UntrustedSpool as exc:
        raise StateDBError(str(exc), path=path) from exc
    with directory:
        try:
            fd = directory.open(path.name, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise _missing(path) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateDBError(
                    f"{path} is a symbolic link; give the real path of the gateway's "
                    "state.db (walspool does not follow a link to it)",
                    path=path,
                ) from exc
            if exc.errno == errno.EISDIR:
                raise StateDBError(
                    f"{path} is not a file; give the gateway's state.db", path=path
                ) from exc
            raise StateDBError(
                f"cannot read state.db at {path}: {exc.strerror or exc}; check its permissions",
                path=path,
            ) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StateDBError(f"{path} is not a file; give the gateway's state.db", path=path)
            if st.st_uid != directory.owner or st.st_nlink != 1:
                raise StateDBError(
                    f"{path} belongs to uid {st.st_uid} and has {st.st_nlink} link(s); a "
                    f"state.db must be its directory owner's (uid {directory.owner}) with "
                    "one link, or it may be another user's file: walspool does not write it",
                    path=path,
                )
            head = os.pread(fd, len(SQLITE_MAGIC), 0)
        finally:
            os.close(fd)  # before SQLite opens it: closing later would drop its locks
        if head != SQLITE_MAGIC:
            raise StateDBError(
                f"{path} is not a SQLite database, so not a hermes state.db", path=path
            )
        return CheckedStateDB(path, (st.st_dev, st.st_ino), directory.owner)


def _missing(path: Path) -> StateDBError:
    return StateDBError(
        f"no state.db at {path} (no such file); give the gateway's state.db "
        "(<HERMES_HOME>/state.db); walspool does not create one",
        path=path,
    )


def open_descriptors() -> dict[int, tuple[int, int]] | None:
    """(device, inode) of the regular file on each descriptor this process has open,
    or None where they cannot be listed (no ``/proc``)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    found = {}
    for name in names:
        try:
            st = os.fstat(int(name))
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if stat.S_ISREG(st.st_mode):
            found[int(name)] = (st.st_dev, st.st_ino)
    return found


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
    if met_a_lock(exc):
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


def has_session(conn: sqlite3.Connection, session_id: str) -> bool:
    """Whether state.db has a ``sessions`` row for ``session_id``."""
    return conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is not None
