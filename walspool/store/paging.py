"""Reading rows a page at a time, with memory bounded by what each row really costs.

A page ends after ``limit`` rows, or once its rows' cost reaches ``PAGE_BYTES`` (at
least one row). A row's cost is every byte it brings into memory as SQLite measures
the stored values (``ROW_BYTES_SQL``: session id, session key, reason, payload and
last error), plus what decoding its payload may make of it (``codec.decoded_bytes``).
Never the ``size`` column: that is the writer's note of the payload's length, and
anyone who can write the file can set it to 0.

Not guaranteed: a bound below one row. The row that ends a page is in it whole, so a
page holds at most ``PAGE_BYTES`` plus one row (whose payload decodes, if at all,
within ``codec.MAX_VALUES``).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ..errors import SpoolCorrupt
from . import codec
from .records import Record

#: Rows fetched per read transaction while iterating, so a slow reader never pins
#: the WAL for long.
PAGE_ROWS = 512
#: A page also ends once its rows cost this many bytes (see the module docstring).
PAGE_BYTES = 8 * 1024 * 1024

#: Payloads up to this many bytes are checked by ``json_valid`` inside a scan. SQLite
#: keeps its parses of the last few payloads a statement has seen (its JSON cache,
#: let go when the statement ends), so a scan over large payloads would hold several
#: of them at once; a larger payload is checked by a statement of its own.
SCAN_JSON_BYTES = 1024 * 1024
#: A row whose payload a scan may check with ``json_valid``, and one it may not.
SMALL_PAYLOAD = f"octet_length(payload) <= {SCAN_JSON_BYTES}"
LARGE_PAYLOAD = f"octet_length(payload) > {SCAN_JSON_BYTES}"
_PAYLOAD_IS_JSON_SQL = "SELECT json_valid(payload) FROM records WHERE id = ?"


def payload_is_json(conn: apsw.Connection, record_id: int) -> bool:
    """Whether row ``record_id``'s payload is JSON, its parse let go at once."""
    return bool(conn.execute(_PAYLOAD_IS_JSON_SQL, (record_id,)).get)


def rows_not_json(
    conn: apsw.Connection, small_sql: str, large_sql: str, params: Any
) -> Iterator[Any]:
    """The rows whose payload is not JSON, in id order, holding at most one large
    payload's parse: ``small_sql`` selects them among ``SMALL_PAYLOAD`` rows with
    ``NOT json_valid(payload)``, ``large_sql`` selects every ``LARGE_PAYLOAD`` row; both
    ``ORDER BY id`` with ``id`` first."""
    small = conn.execute(small_sql, params)
    large = (row for row in conn.execute(large_sql, params) if not payload_is_json(conn, row[0]))
    return heapq.merge(small, large, key=lambda row: row[0])


#: The bytes of a row's variable-length values, measured by SQLite from what is stored
#: (``octet_length`` reads a value's length from its record header). The last column
#: of every query ``read_page`` pages through.
ROW_BYTES_SQL = (
    "(coalesce(octet_length(session_id), 0) + coalesce(octet_length(session_key), 0)"
    " + coalesce(octet_length(reason), 0) + coalesce(octet_length(payload), 0)"
    " + coalesce(octet_length(last_error), 0))"
)
#: Where a ``RECORD_COLUMNS`` row holds its payload.
PAYLOAD = 6
#: Where it holds its text: session id, reason, session key, last error. Each is
#: selected as its stored bytes and made text by ``as_text``.
TEXT_COLUMNS = (1, 3, 4, 8)


def as_text(value: Any) -> Any:
    """A text column selected as its stored bytes (``CAST(... AS BLOB)``) as ``str``.

    SQLite never checks that TEXT is UTF-8: a hand edit (``CAST(X'ff' AS TEXT)`` in the
    ``sqlite3`` shell) or a damaged page can store any bytes, and apsw's own decoding of
    such a value fails the whole statement, so one row would stop every reader. Bytes
    that are not UTF-8 keep each bad byte as a lone surrogate (``surrogateescape``):
    nothing is lost, ``printable`` shows it as ``\\udcXX``, ``undecodable`` tells such
    text apart and ``bound`` gives the very bytes back as a parameter. None and other
    values are given back as they are."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value


def undecodable(text: str | None) -> bool:
    """Whether ``text`` (from ``as_text``) holds bytes that are not UTF-8."""
    if text is None:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def readable(text: str | None) -> str | None:
    """``text`` with each byte that was not UTF-8 as U+FFFD: for messages that are
    stored or sent on as text (a row's last error); the row's id names it exactly."""
    if not undecodable(text):
        return text
    assert text is not None
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def bound(text: str | None) -> str | bytes | None:
    """``text`` as a parameter that SQL reads with ``CAST(:param AS TEXT)``: the text
    itself, or for text ``as_text`` made of bytes that are not UTF-8, those bytes (a
    blob cast to text is its bytes as they are), so such a row can be found again."""
    if not undecodable(text):
        return text
    assert text is not None
    return text.encode("utf-8", "surrogateescape")


def with_text(selected: Sequence[Any], columns: Collection[int]) -> tuple[Any, ...]:
    """``selected`` with its ``columns`` (selected as stored bytes) made text by
    ``as_text``."""
    return tuple(as_text(v) if i in columns else v for i, v in enumerate(selected))


def as_selected(selected: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row selected as ``RECORD_COLUMNS`` (and more columns after them) with its
    text columns made text (``as_text``) and its payload made text when it is UTF-8
    (kept as stored bytes when not: decoding it finds it is not JSON, one bad row)."""
    row = list(with_text(selected, TEXT_COLUMNS))
    payload = row[PAYLOAD]
    if isinstance(payload, bytes):
        try:
            row[PAYLOAD] = payload.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return tuple(row)


def read_page(
    conn: apsw.Connection, sql: str, params: Any, limit: int = PAGE_ROWS
) -> tuple[list[tuple[Any, ...]], bool]:
    """The next page of ``sql``, whose rows start with ``RECORD_COLUMNS`` and end with
    ``ROW_BYTES_SQL``; ``full`` says whether more may follow.

    Reading stops at the page's end, so the rest is never fetched into memory, and the
    read transaction ends with it.
    """
    rows: list[tuple[Any, ...]] = []
    total = 0
    cursor = conn.execute(sql, params)
    try:
        for selected in cursor:
            row = as_selected(selected)
            payload = row[PAYLOAD]
            rows.append(row)
            decoded = codec.decoded_bytes(payload) if isinstance(payload, (str, bytes)) else 0
            total += row[-1] + decoded
            if total >= PAGE_BYTES or len(rows) >= limit:
                return rows, True
    finally:
        cursor.close()
    return rows, False


def record_from_row(row: tuple[Any, ...], path: Path | None = None) -> Record:
    """Build a Record from a row selected as ``RECORD_COLUMNS``, its payload decoded
    within ``codec``'s budget.

    Raises ``SpoolCorrupt`` naming the row when its session id, reason or session key
    is not UTF-8, its payload is not JSON (a hand edit or a damaged page: walspool
    writes UTF-8 and JSON only), or is nested too deep or holds too many values to
    decode (``codec.MAX_DEPTH``, ``codec.MAX_VALUES``).
    """
    row_id, session_id, seq, payload = row[0], row[1], row[2], row[PAYLOAD]
    # stored as its last error: text that UTF-8 can encode, a bad byte as U+FFFD
    name = readable(session_id if session_id is not None else row[4])
    where = f"row {row_id} (session {name}, seq {seq}) of {path or 'the spool'}"
    for what, text in (("session id", session_id), ("reason", row[3]), ("session key", row[4])):
        if undecodable(text):
            raise SpoolCorrupt(
                f"{where} has a {what} that is not UTF-8 text (a hand edit or a damaged "
                "page: walspool writes UTF-8 only); export the others and delete it by hand",
                path=path,
                session_id=session_id,
            )
    try:
        message = codec.decode(payload)
    except codec.OverBudget as exc:
        raise SpoolCorrupt(
            f"{where} has a payload too costly to decode ({exc}); it is kept, not decoded: "
            "`walspool export` copies it as stored",
            path=path,
            session_id=session_id,
        ) from exc
    except (msgspec.DecodeError, TypeError) as exc:
        raise SpoolCorrupt(
            f"{where} has a payload that is not valid JSON ({exc}); export the others "
            "and delete it by hand",
            path=path,
            session_id=session_id,
        ) from exc
    return Record(*row[:PAYLOAD], message, *row[PAYLOAD + 1 :])
