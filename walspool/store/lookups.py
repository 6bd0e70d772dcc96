"""Lookups an operator's arguments need, each read in a read transaction of the
caller's: whether a reason, a session or a routing key has rows, the names near a
typo's, the rows an ``--id`` list or a selector of set-aside rows names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import apsw

from .paging import as_text, bound, with_text

_REASON_EXISTS_SQL = "SELECT EXISTS (SELECT 1 FROM records WHERE reason = CAST(? AS TEXT))"
_REASONS_SQL = "SELECT DISTINCT CAST(reason AS BLOB) FROM records ORDER BY reason"
_STREAM_EXISTS_SQL = {
    "id": "SELECT EXISTS (SELECT 1 FROM records WHERE session_id = CAST(? AS TEXT))",
    "key": "SELECT EXISTS (SELECT 1 FROM records "
    "WHERE session_id IS NULL AND session_key = CAST(? AS TEXT))",
}
_STREAM_ROWS_SQL = {
    "id": "SELECT count(*) FROM records WHERE session_id = CAST(? AS TEXT)",
    "key": "SELECT count(*) FROM records INDEXED BY records_session_key_seq_idx "
    "WHERE session_id IS NULL AND session_key = CAST(? AS TEXT)",
}
_SESSION_EXISTS_SQL = """SELECT EXISTS (SELECT 1 FROM records
                      WHERE session_id = CAST(:session AS TEXT))
    OR (:keys AND EXISTS (SELECT 1 FROM records
                          WHERE session_id IS NULL AND session_key = CAST(:session AS TEXT)))"""
#: Distinct session ids, then distinct keys of rows spooled without one, each walked in
#: its unique index (no sort), names at most ``:chars`` long.
_IDS_SQL = """SELECT DISTINCT CAST(session_id AS BLOB)
    FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL AND length(session_id) <= :chars LIMIT :n"""
_KEYS_SQL = """SELECT DISTINCT CAST(session_key AS BLOB)
    FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND length(session_key) <= :chars LIMIT :n"""
#: What a change of rows shows of each row it names.
ROW_KEYS = ("id", "session_id", "session_key", "seq", "reason", "status", "inflight", "last_error")
#: Selected as stored bytes, made text by ``paging.as_text``.
_TEXTS = {"session_id", "session_key", "reason", "last_error"}
_COLUMNS = ", ".join(f"CAST({k} AS BLOB)" if k in _TEXTS else k for k in ROW_KEYS)
_TEXT_COLUMNS = {i for i, k in enumerate(ROW_KEYS) if k in _TEXTS}
#: The rows named by id, whatever they are (the change itself refuses the wrong ones).
_BY_ID_SQL = f"""SELECT {_COLUMNS} FROM records
    WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id"""
#: Set-aside rows of the chosen statuses, of one stream or all.
_SET_ASIDE_SQL = f"""SELECT {_COLUMNS} FROM records INDEXED BY records_status_idx
    WHERE status IS NOT NULL AND status IN (SELECT value FROM json_each(:statuses))
    AND (:session IS NULL
         OR (:kind = 'id' AND session_id = CAST(:session AS TEXT))
         OR (:kind = 'key' AND session_id IS NULL AND session_key = CAST(:session AS TEXT)))
    ORDER BY id"""


def reason_exists(conn: apsw.Connection, reason: str) -> bool:
    """Whether a row has ``reason``."""
    return bool(conn.execute(_REASON_EXISTS_SQL, (bound(reason),)).get)


def reasons(conn: apsw.Connection) -> list[str]:
    """Every reason the spool's rows have, sorted."""
    return [as_text(reason) for (reason,) in conn.execute(_REASONS_SQL)]


def session_exists(conn: apsw.Connection, session: str, *, keys: bool) -> bool:
    """Whether rows were spooled with session id ``session`` or (with ``keys``) with
    session key ``session`` and no id."""
    params = {"session": bound(session), "keys": keys}
    return bool(conn.execute(_SESSION_EXISTS_SQL, params).get)


def stream_exists(conn: apsw.Connection, name: str, kind: str) -> bool:
    """Whether rows were spooled with session id ``name`` (``kind`` "id") or with
    session key ``name`` and no id ("key")."""
    return bool(conn.execute(_STREAM_EXISTS_SQL[kind], (bound(name),)).get)


def stream_rows(conn: apsw.Connection, name: str, kind: str) -> int:
    """How many rows the stream has (``kind`` as in ``stream_exists``)."""
    return int(conn.execute(_STREAM_ROWS_SQL[kind], (bound(name),)).get)


def session_ids(conn: apsw.Connection, chars: int, n: int) -> list[str]:
    """The first ``n`` distinct session ids at most ``chars`` long, in index order."""
    return [as_text(s) for (s,) in conn.execute(_IDS_SQL, {"chars": chars, "n": n})]


def session_keys(conn: apsw.Connection, chars: int, n: int) -> list[str]:
    """The first ``n`` distinct keys of rows spooled without a session id, at most
    ``chars`` long, in index order."""
    return [as_text(k) for (k,) in conn.execute(_KEYS_SQL, {"chars": chars, "n": n})]


def rows_by_id(conn: apsw.Connection, ids: Sequence[int]) -> list[dict[str, Any]]:
    """The rows among ``ids`` still in the spool, in id order (``ROW_KEYS``)."""
    return _rows(conn.execute(_BY_ID_SQL, {"ids": json.dumps(list(ids))}))


def set_aside_rows(
    conn: apsw.Connection, statuses: Sequence[str], session: str | None, kind: str | None
) -> list[dict[str, Any]]:
    """The set-aside rows of ``statuses``, of stream (``session``, ``kind``) or of all
    streams (``session`` None), in id order (``ROW_KEYS``)."""
    params = {"statuses": json.dumps(list(statuses)), "session": bound(session), "kind": kind}
    return _rows(conn.execute(_SET_ASIDE_SQL, params))


def _rows(cursor: Any) -> list[dict[str, Any]]:
    return [dict(zip(ROW_KEYS, with_text(row, _TEXT_COLUMNS), strict=True)) for row in cursor]
