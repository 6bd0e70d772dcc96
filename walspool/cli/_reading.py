"""Reading a spool without writing to it: the read-only open every read command
uses, and the records in drop order a page at a time. Not public API.

Every spool connection made here is apsw and read-only, and creates no file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apsw

from ..errors import NotASpool, SchemaTooOld, SpoolCorrupt, WalspoolError
from ..store import files, schema
from ..store.files import SQLITE_MAGIC
from ..store.paging import PAGE_ROWS, ROW_BYTES_SQL, read_page, record_from_row
from ..store.records import Record
from ..store.schema import sqlite_error
from ..store.spool import RECORD_COLUMNS, Spool, check_lookup, reasons_filter
from ..text import json_safe
from ._damage import quick_check as _quick_check
from ._damage import walk_check
from ._near import near_files
from ._output import EXIT_OK, dump, plural, warn
from ._readonly import SpoolReader


def upgraded(command: str, path: Path) -> None:
    """For a command about to write the spool: one of an older schema, which a
    read-only open refuses, is upgraded first, as the gateway's next start would
    (``walspool.Spool``, every check of a write open made), and a line says so.
    Anything else a read-only open raises is left to the command's own reading."""
    try:
        SpoolReader(path).close()
    except SchemaTooOld as old:
        with Spool(path):
            pass
        warn(command, f"{path} has spool schema {old.found}: upgraded to schema {old.current}")
    except (WalspoolError, apsw.Error, OSError):
        pass


@contextlib.contextmanager
def reading(
    path: Path, *, cheap_check: bool = True, quick_check: bool = True, walk: bool = False
) -> Iterator[SpoolReader]:
    """The spool opened read-only, creating no file (see ``_readonly``); SQLite
    failures become one-line walspool errors.

    ``cheap_check`` touches the schema and each table's root (constant time);
    ``quick_check`` then walks every page (``QUICK_CHECK_SQL``), so that every command
    refuses a damaged spool alike, before any output, wherever the damage is: not
    only the commands whose own reads happen to reach the damaged pages.

    ``walk`` (with ``quick_check``): the cheaper ``walk_check`` instead, for ``stats``
    and ``ls``, which read a million rows' index in a fraction of a second. Damage it
    or the block's reads meet is then named by ``QUICK_CHECK_SQL`` all the same, so the
    error says what every other command says.
    """
    if not path.exists() and not path.is_symlink():
        raise WalspoolError(
            f"no spool at {path} (no such file{near_files(path)}); give the path of a spool "
            "(the gateway's is <HERMES_HOME>/spool.db)",
            path=path,
        )
    try:
        head = files.read_head(path)
        if head != SQLITE_MAGIC:
            what = "an empty file" if not head else "not a SQLite database"
            raise NotASpool(f"{path} is {what}, so not a walspool spool", path=path)
        reader = SpoolReader(path)
    except OSError as exc:
        raise WalspoolError(f"cannot read {path}: {exc.strerror or exc}", path=path) from exc
    except apsw.Error as exc:
        raise spool_error(exc, path) from exc
    except SpoolCorrupt as exc:
        if isinstance(exc.__cause__, apsw.Error) and not isinstance(exc, schema.SchemaOverBudget):
            raise spool_error(exc.__cause__, path) from exc.__cause__
        raise
    try:
        if cheap_check:
            reader.read(schema.cheap_check)
        if cheap_check and quick_check and walk:
            try:
                reader.read(walk_check)
                yield reader
            except apsw.CorruptError:
                _quick_check(reader)  # names the damage, as every command does
                raise
        else:
            if cheap_check and quick_check:
                _quick_check(reader)
            yield reader
    except apsw.Error as exc:
        raise spool_error(exc, path) from exc
    finally:
        reader.close()


def spool_error(exc: apsw.Error, path: Path) -> WalspoolError:
    """A damaged spool gets a message saying so; other errors as the engine maps them."""
    if isinstance(exc, (apsw.CorruptError, apsw.NotADBError)):
        return SpoolCorrupt(
            f"spool {path} is damaged ({exc}); run `walspool check {path}` and keep a copy "
            "of the file before any repair",
            path=path,
        )
    if isinstance(exc, (apsw.ReadOnlyError, apsw.CantOpenError)):
        return WalspoolError(
            f"cannot read spool {path} ({exc}): a gateway left its -wal or -shm file and "
            f"this user can neither use it nor create it in {path.parent}; run as the "
            "spool's owner",
            path=path,
        )
    return sqlite_error(exc, path)


# -- records in drop order ------------------------------------------------------

INFLIGHT_SQL = "SELECT count(*) FROM records WHERE inflight IS NOT NULL"
STATUS_COUNT_SQL = "SELECT status, count(*) FROM records WHERE status IS NOT NULL GROUP BY status"
#: Each row's columns, whether its payload is JSON (as SQLite reads it, in C: no Python
#: object per value) and what it costs to hold (``paging``): never the ``size`` column.
_ROW = f"SELECT {RECORD_COLUMNS}, inflight, json_valid(payload), {ROW_BYTES_SQL} FROM records"
_BY_REASON = "(:reasons IS NULL OR reason IN (SELECT value FROM json_each(:reasons)))"
#: Keyset pages: streams spooled by session_id, then those spooled by key only,
#: each in seq order; or one name's two streams. One short read per page.
PAGES_SQL = {
    (False, "id"): f"""{_ROW} WHERE session_id IS NOT NULL
        AND (session_id, seq) > (:name, :seq) AND {_BY_REASON}
        ORDER BY session_id, seq LIMIT :limit""",
    (False, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND (session_key, seq) > (:name, :seq) AND {_BY_REASON}
        ORDER BY session_key, seq LIMIT :limit""",
    (True, "id"): f"""{_ROW} WHERE session_id = :session AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
    (True, "key"): f"""{_ROW} INDEXED BY records_session_key_seq_idx WHERE session_id IS NULL
        AND session_key = :session AND seq > :seq AND {_BY_REASON}
        ORDER BY seq LIMIT :limit""",
}
COUNT_SQL = f"""SELECT count(*) FROM records WHERE {_BY_REASON}
    AND (:session IS NULL OR session_id = :session
         OR (session_id IS NULL AND session_key = :session))"""


class BadPayload:
    """In place of a message whose stored payload is not JSON, or too costly to decode
    (``codec.MAX_DEPTH``, ``codec.MAX_VALUES``): its raw text, flagged."""

    __slots__ = ("raw", "error")

    def __init__(self, raw: Any, error: str) -> None:
        self.raw = raw if isinstance(raw, str) else repr(raw)
        self.error = error


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
        check_lookup(session, "session", path)
    params: dict[str, Any] = {
        "reasons": reasons_filter(reasons, path),
        "session": session,
        "limit": PAGE_ROWS,
    }
    for kind in kinds:
        sql = PAGES_SQL[(session is not None, kind)]
        name, seq = "", 0
        while True:
            page = {**params, "name": name, "seq": seq}
            rows, full = reader.read(lambda c, sql=sql, page=page: read_page(c, sql, page))
            for row in rows:
                columns, inflight, valid = row[:-3], row[-3], row[-2]
                if raw and valid and isinstance(columns[6], str):
                    record = Record(*columns[:6], RawPayload(columns[6]), *columns[7:])
                else:
                    record = _record_or_flagged(columns, path, bad)
                yield record, inflight
            if not full:
                break
            last = rows[-1]
            name, seq = (last[1] if kind == "id" else last[4]), last[2]


def _record_or_flagged(row: tuple[Any, ...], path: Path, bad: list[str] | None) -> Record:
    try:
        return record_from_row(row, path)
    except SpoolCorrupt as exc:
        row_id, session_id, seq = row[0], row[1] if row[1] is not None else row[4], row[2]
        if bad is not None:
            bad.append(f"id {row_id} (session {session_id}, seq {seq})")
        return Record(*row[:6], BadPayload(row[6], str(exc.__cause__ or exc)), *row[7:])


def count_records(reader: SpoolReader, session: str | None, reasons: Sequence[str] | None) -> int:
    """How many rows ``iter_records`` would yield now (for the progress bar)."""
    if session is not None:
        check_lookup(session, "session", reader.path)
    params = {"reasons": reasons_filter(reasons, reader.path), "session": session}
    return int(reader.read(lambda c: c.execute(COUNT_SQL, params).get))


def record_json(record: Record, inflight: int | None, *, message: bool = True) -> dict[str, Any]:
    """One record as an ``export`` line / ``show --json`` row (see docs/cli.md)."""
    out: dict[str, Any] = {
        "id": record.id,
        "session_id": record.session_id,
        "session_key": record.session_key,
        "seq": record.seq,
        "reason": record.reason,
        "created_at": record.created_at,
        "attempts": record.attempts,
        "last_error": record.last_error,
        "last_attempt_at": record.last_attempt_at,
        "inflight": inflight is not None,
        "status": record.status,
    }
    if isinstance(record.message, BadPayload):
        out["bad_payload"] = {"raw": record.message.raw, "error": record.message.error}
        if message:
            out["message"] = None
    elif message:
        out["message"] = record.message
    return out


def record_line(record: Record, inflight: int | None, *, message: bool = True) -> str:
    """``record_json`` as JSON text (``dump``); a ``RawPayload`` goes in as stored, its
    controls escaped (``json_safe``), never decoded and encoded again."""
    if not (message and isinstance(record.message, RawPayload)):
        return dump(record_json(record, inflight, message=message))
    head = dump(record_json(record, inflight, message=False))
    return f'{head[:-1]},"message":{json_safe(record.message.text)}}}'


def report_bad(command: str, bad: list[str]) -> int:
    """Name the rows shown flagged because their payload is not JSON: raise (exit 1,
    after the output) if any."""
    if not bad:
        return EXIT_OK
    listed = ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
    raise WalspoolError(
        f"{plural(len(bad), 'row')} with a payload that is not valid JSON or too costly to "
        f"decode, shown flagged: "
        f"{listed}; `walspool check` names them too"
    )
