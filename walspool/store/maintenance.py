"""Operators' changes to a spool: set-aside rows put back in line or dropped, space
reclaimed.

Rows a replay set aside (``status`` quarantined or superseded) stay until an operator
decides. ``requeue`` makes them replayable again; ``drop`` deletes them. Each is one
transaction that changes every named row or none, and records in the ``audit`` table
who did what; a dropped row's whole content goes into its audit record, so a drop can
be undone by hand. Both take the spool's replay lock, so no replay (the command line's
or the gateway link's) has one of those rows half taken. ``vacuum`` gives the pages of
drained rows back to the file system.

Not guaranteed: an audit record names the operating-system user that ran the command,
not a person; anyone who can write the spool can also edit the audit table.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..errors import InvalidArgument, UntrustedSpool, WalspoolError
from . import codec, connections, files, sqlite_errors
from .directories import changed
from .paging import bound, undecodable, with_text
from .replay_lock import replay_lock
from .spool import Spool
from .writer import LIVE_BYTES_SQL

__all__ = [
    "VACUUM_MAX_LIVE_BYTES",
    "NotSetAside",
    "VacuumReport",
    "actor",
    "drop",
    "requeue",
    "vacuum",
]

#: ``vacuum`` refuses a spool holding more than this in live pages unless forced: it
#: copies them while holding the write lock, and the gateway's writer waits at most
#: ``writer.BUSY_RETRY_SECONDS`` (10 s) for that lock; this much copies in about a
#: second here.
VACUUM_MAX_LIVE_BYTES = 64 * 1024 * 1024
#: How long vacuum's TRUNCATE checkpoint waits for readers (and keeps writers out).
CHECKPOINT_WAIT_MS = 250
#: Seconds ``requeue`` and ``drop`` wait for a running replay's lock by default.
CHANGE_WAIT = 30.0

#: A row whole, its text as stored bytes (made text by ``paging.as_text``: one that is
#: not UTF-8 can be dropped too).
RAW_ROW_SQL = """
SELECT id, CAST(session_id AS BLOB), CAST(session_key AS BLOB), seq, CAST(reason AS BLOB),
       created_at, CAST(payload AS BLOB), attempts, CAST(last_error AS BLOB), last_attempt_at,
       status, inflight
FROM records WHERE id = ?
"""
_ROW_TEXTS = (1, 2, 4, 6, 8)
REQUEUE_SQL = """
UPDATE records SET status = NULL, attempts = 0, last_error = NULL, last_attempt_at = NULL
WHERE id = ?
"""
DROP_SQL = "DELETE FROM records WHERE id = ?"
AUDIT_INSERT_SQL = """
INSERT INTO audit (at, actor, action, record_id, session_id, session_key, seq, detail)
VALUES (?, ?, ?, ?, CAST(? AS TEXT), CAST(? AS TEXT), ?, ?)
"""
FREELIST_SQL = "PRAGMA freelist_count"


class NotSetAside(WalspoolError):
    """A row named for ``requeue`` or ``drop`` is missing, replayable or in flight."""


class VacuumReport(msgspec.Struct, frozen=True):
    """What ``vacuum`` did: file sizes before and after, in bytes."""

    db_bytes_before: int
    wal_bytes_before: int
    db_bytes: int
    wal_bytes: int
    #: False when a reader's snapshot kept the checkpoint from finishing: the file
    #: shrinks at a later checkpoint.
    checkpointed: bool


#: Set in the environment of a command root runs as the owner of the files
#: (``walspool.cli._owner``): the actor is then root, through that user.
RUN_BY_ROOT_ENV = "WALSPOOL_RUN_BY_ROOT"


def actor() -> str:
    """Who runs this: the effective user (root, when root runs it as the files' owner),
    the user sudo ran as, the host and pid."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    via = os.environ.get("SUDO_USER")
    name = f"{user} (uid {os.geteuid()}{f', via sudo from {via}' if via else ''})"
    if os.environ.get(RUN_BY_ROOT_ENV) == "1":
        name = f"root as {name}"
    return f"{name} on {socket.gethostname()}, pid {os.getpid()}"


def requeue(
    spool: Spool, ids: Sequence[int], *, by: str | None = None, wait: float = CHANGE_WAIT
) -> list[int]:
    """Make the set-aside rows ``ids`` replayable again (attempts and error cleared);
    all or none. Returns the ids. Raises ``NotSetAside`` naming every id that is
    missing, replayable or in flight, and ``ReplayBusy`` if a replay held the lock
    past ``wait`` seconds."""
    return _change(spool, ids, "requeue", by, wait)


def not_set_aside(path: Any, action: str, problems: Sequence[str]) -> NotSetAside:
    """The error of a ``requeue``/``drop`` naming rows it may not take (``problems``:
    "ID (why)"): all or none, so nothing was changed."""
    return NotSetAside(
        f"spool {path}: nothing was changed; {action} takes only rows set aside "
        f"(quarantined or superseded): {', '.join(problems)}",
        path=path,
    )


def drop(
    spool: Spool, ids: Sequence[int], *, by: str | None = None, wait: float = CHANGE_WAIT
) -> list[int]:
    """Delete the set-aside rows ``ids``, each copied whole into its audit record; all
    or none. Their streams never reuse their seqs. Raises as ``requeue`` does."""
    return _change(spool, ids, "drop", by, wait)


def _change(
    spool: Spool, ids: Sequence[int], action: str, by: str | None, wait: float
) -> list[int]:
    wanted = _ids(ids, spool.path)
    who = by if by is not None else actor()

    def change(conn: apsw.Connection) -> list[int]:
        rows = {}
        problems = []
        for record_id in wanted:
            row = conn.execute(RAW_ROW_SQL, (record_id,)).fetchone()
            if row is not None:
                row = with_text(row, _ROW_TEXTS)
            if row is None:
                problems.append(f"{record_id} (no such row)")
            elif row[11] is not None:
                problems.append(f"{record_id} (a replay has it out)")
            elif row[10] is None:
                problems.append(f"{record_id} (replayable, not set aside)")
            else:
                rows[record_id] = row
        if problems:
            raise not_set_aside(spool.path, action, problems)
        now = time.time()
        for record_id, row in rows.items():
            conn.execute(
                AUDIT_INSERT_SQL,
                (
                    now,
                    who,
                    action,
                    record_id,
                    bound(row[1]),
                    bound(row[2]),
                    row[3],
                    _detail(row, action),
                ),  # fmt: skip
            )
            conn.execute(DROP_SQL if action == "drop" else REQUEUE_SQL, (record_id,))
        return list(rows)

    with replay_lock(spool, wait):
        return spool.transact(change)


def _ids(ids: Sequence[int], path: Path) -> list[int]:
    if not ids:
        raise InvalidArgument("name at least one row id", path=path)
    wanted = []
    for record_id in ids:
        if isinstance(record_id, bool) or not isinstance(record_id, int) or record_id < 1:
            raise InvalidArgument(f"a row id is a positive integer, not {record_id!r}", path=path)
        if record_id not in wanted:
            wanted.append(record_id)
    return wanted


def _detail(row: tuple[Any, ...], action: str) -> str:
    """The audit record's detail: what the row was, whole for a drop."""
    detail: dict[str, Any] = {
        "status": row[10],
        "attempts": row[7],
        "last_error": _exact(row[8]),
        "last_attempt_at": row[9],
    }
    if action == "drop":
        detail |= {"reason": _exact(row[4]), "created_at": row[5], "payload": _exact(row[6])}
    return codec.encode(detail).decode()


def _exact(text: Any) -> Any:
    """A value for the audit's JSON as it was stored: text, or for bytes that are not
    UTF-8 (JSON text cannot hold them) ``{"hex": "..."}`` of those bytes."""
    if isinstance(text, bytes):
        return {"hex": text.hex()}
    if undecodable(text):
        return {"hex": text.encode("utf-8", "surrogateescape").hex()}
    return text


def vacuum(
    spool: Spool,
    *,
    force: bool = False,
    step: Callable[[str, int, int], object] | None = None,
    tick: Callable[[], object] | None = None,
) -> VacuumReport:
    """Rewrite the spool without its free pages, then checkpoint and truncate its
    ``-wal``: the space drained rows held goes back to the file system. ``step`` is
    told each of the two steps as it begins (what, its number, 2), ``tick`` called
    while the copy runs (``connections.ticking``).

    Refuses (``InvalidArgument``) a spool with more than ``VACUUM_MAX_LIVE_BYTES`` of
    live pages unless ``force``: the gateway's appends would wait for the copy. Runs on
    the very file ``spool`` holds open, or not at all (``UntrustedSpool``,
    ``SymlinkRefused``: its path names another file now, see ``_connect``).
    """
    path = spool.path
    conn = _connect(spool)
    before = (_size(path), _size(Path(f"{path}-wal")))
    try:
        connections.set_busy_timeout(conn)
        connections.set_synchronous(conn, spool.durability)
        live = conn.execute(LIVE_BYTES_SQL).get
        if live > VACUUM_MAX_LIVE_BYTES and not force:
            raise InvalidArgument(
                f"spool {path} holds {live / 2**20:.0f} MiB of live rows: a vacuum copies "
                f"them while the gateway's appends wait (at most 10 s); replay it first, "
                f"or stop the gateway and force it",
                path=path,
            )
        free = conn.execute(FREELIST_SQL).get
        if step is not None:
            step(f"copying {live / 2**20:.1f} MiB of rows" if free else "no free pages", 1, 2)
        if free:
            with connections.ticking(conn, tick):
                conn.execute("VACUUM")
        if step is not None:
            step("truncating the -wal", 2, 2)
        # A TRUNCATE checkpoint keeps new writers out while it waits for readers; a
        # reader that stays (Litestream holds one between its own checkpoints) would
        # keep the gateway's appends out for the whole busy timeout, past the
        # writer's own bound. Wait a moment, then leave the WAL to a later checkpoint.
        conn.set_busy_timeout(CHECKPOINT_WAIT_MS)
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    except apsw.Error as exc:
        raise sqlite_errors.sqlite_error(exc, path) from exc
    finally:
        with contextlib.suppress(apsw.Error):
            conn.close()
    return VacuumReport(
        db_bytes_before=before[0],
        wal_bytes_before=before[1],
        db_bytes=_size(path),
        wal_bytes=_size(Path(f"{path}-wal")),
        checkpointed=not busy,
    )


def _connect(spool: Spool) -> apsw.Connection:
    """A second connection to the very file ``spool`` holds open, for a statement that
    cannot run inside the spool writer's transactions (``VACUUM``).

    The spool's own connection, checked when the spool was opened, says which file it
    holds (``connections.opened_file``). The new connection is opened by the spool's path,
    no link followed, and before any statement runs must hold that same file, its
    directory and files passing the checks the spool's open made (``files.check_opened``):
    a name swapped since (another file, a link, a directory replaced by a link) is
    refused with ``UntrustedSpool`` or ``SymlinkRefused``, the file it names untouched.
    Where SQLite's descriptor cannot be had (a VFS other than its ``unix``), refused too.
    """
    path = spool.path
    files.refuse_symlink(path)
    held = spool.transact(connections.opened_file)
    conn = None
    try:
        conn = connections.connect(path, spool.owner, apsw.SQLITE_OPEN_READWRITE)
        # Until it is known to be the spool's file, closing must not checkpoint.
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        opened = connections.opened_file(conn)
        if held is None or opened is None:
            raise UntrustedSpool(
                f"cannot tell which file SQLite opened as {path} (VFS {conn.open_vfs!r}, not "
                "'unix'), so it cannot be proved to be the spool's; nothing was changed",
                path=path,
            )
        if _identity(opened) != _identity(held):
            raise changed(path, path)
        files.check_opened(path, opened)
        connections.schema_verified(conn)  # the file the spool opened, its schema checked then
        conn.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 0)
    except apsw.Error as exc:
        connections.close_quietly(conn)
        raise sqlite_errors.sqlite_error(exc, path) from exc
    except BaseException:
        connections.close_quietly(conn)
        raise
    return conn


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
