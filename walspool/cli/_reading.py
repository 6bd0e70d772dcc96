"""The command line's reading of a spool: opened read-only (``walspool.store.reader``)
with the checks every command makes before any output and SQLite's failures as one-line
errors; records as ``export`` and ``show`` print them; and "did you mean", the names
near a mistyped spool path or session for the error that says it does not exist
(bounded: a directory's first ``NEAR_NAMES`` entries, a spool's first ``NEAR_NAMES``
session ids and keys, in their index's order, no sort). Not public API.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw

from ..errors import NotASpool, SchemaTooOld, SpoolCorrupt, WalspoolError
from ..store import connections, files, lookups, schema
from ..store.checks import quick_check as _quick_check
from ..store.checks import walk_check
from ..store.files import SQLITE_MAGIC
from ..store.reader import BadPayload, RawPayload, SpoolReader
from ..store.records import Record
from ..store.spool import Spool
from ..store.sqlite_errors import sqlite_error
from ..text import json_safe
from ._output import EXIT_OK, dump, plural, warn


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
    """The spool opened read-only, creating no file (see ``walspool.store.reader``); SQLite
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
        if isinstance(exc.__cause__, apsw.Error) and not isinstance(
            exc, connections.SchemaOverBudget
        ):
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
    """Name the rows shown flagged because their payload is not JSON (or too costly to
    decode) or a name of theirs is not UTF-8: raise (exit 1, after the output) if any."""
    if not bad:
        return EXIT_OK
    listed = ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
    raise WalspoolError(
        f"{plural(len(bad), 'row')} with a payload that is not valid JSON or too costly to "
        f"decode, or a session id, reason or key that is not UTF-8, shown flagged: "
        f"{listed}; `walspool check` names them too"
    )


NEAR_NAMES = 10_000
#: Names longer than this are no typo's target.
NEAR_CHARS = 200


def near_files(path: Path) -> str:
    """``; near that name: NAME, ...``: files beside a missing spool at ``path`` whose
    name is close to its name (a typo's likely target), or nothing."""
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for e in itertools.islice(entries, NEAR_NAMES)]
    except OSError:
        return ""
    near = difflib.get_close_matches(path.name, names, n=3)
    return f"; near that name: {', '.join(near)}" if near else ""


def near_sessions(reader: SpoolReader, name: str) -> str:
    """``; did you mean: S, key:K?``: sessions of the spool whose name is close to
    ``name`` (keys as ``ls`` prints them), or nothing."""
    if len(name) > NEAR_CHARS:
        return ""
    ids = reader.read(lambda c: lookups.session_ids(c, NEAR_CHARS, NEAR_NAMES))
    keys = [
        f"key:{k}" for k in reader.read(lambda c: lookups.session_keys(c, NEAR_CHARS, NEAR_NAMES))
    ]
    near = difflib.get_close_matches(name, ids + keys, n=3)
    return f"; did you mean: {', '.join(near)}?" if near else ""
