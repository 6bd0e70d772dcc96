"""How the read commands tell a damaged spool, before any output. Not public API.

``quick_check`` is SQLite's walk of every page with every record decoded, about 1 s per
million rows; ``walk_check`` loads every page of every b-tree without decoding a
record, about a third of that, for ``stats`` and ``ls`` (see ``_reading.reading``).
"""

from __future__ import annotations

import apsw

from ..store.reader import SpoolReader

#: Every page of the file walked, each b-tree's structure checked (not each index
#: against its table: that is ``check``'s integrity_check), every record decoded and its
#: columns checked. About 0.6 s per million rows (1 KB each).
QUICK_CHECK_SQL = "PRAGMA quick_check(1)"

#: SQLite checks each b-tree page it loads against the page's own bounds (every cell
#: within the page, none overlapping): https://www.sqlite.org/pragma.html#pragma_cell_size_check
CELL_SIZE_CHECK_SQL = "PRAGMA cell_size_check = ON"
#: ``walk_check``: each b-tree of the spool (by name), every one of its pages loaded.
#: ``count(*)`` without a WHERE clause counts cells page by page (no record decoded);
#: the partial indexes are walked by a cursor. Older schemas' b-trees are not listed:
#: a spool that has one gets ``QUICK_CHECK_SQL`` instead.
WALK_SQL = {
    "records": "SELECT count(*) FROM records NOT INDEXED",
    "sqlite_autoindex_records_1": (
        "SELECT count(*) FROM records INDEXED BY sqlite_autoindex_records_1"
    ),
    "records_reason_created_at_size_session_id_session_key_idx": (
        "SELECT count(*) FROM records "
        "INDEXED BY records_reason_created_at_size_session_id_session_key_idx"
    ),
    "records_inflight_idx": (
        "SELECT count(*) FROM records INDEXED BY records_inflight_idx WHERE inflight IS NOT NULL"
    ),
    "records_last_error_idx": (
        "SELECT count(*) FROM records INDEXED BY records_last_error_idx "
        "WHERE last_error IS NOT NULL"
    ),
    "records_status_idx": (
        "SELECT count(*) FROM records INDEXED BY records_status_idx WHERE status IS NOT NULL"
    ),
    "records_session_key_seq_idx": (
        "SELECT count(*) FROM records INDEXED BY records_session_key_seq_idx "
        "WHERE session_id IS NULL"
    ),
    # Small tables: checked whole, their own b-trees and indexes.
    "sequences": "PRAGMA quick_check(sequences)",
    "spool_meta": "PRAGMA quick_check(spool_meta)",
    "audit": "PRAGMA quick_check(audit)",
}
BTREES_SQL = "SELECT name FROM sqlite_schema WHERE type IN ('table', 'index')"


def quick_check(reader: SpoolReader) -> None:
    """Raise ``apsw.CorruptError`` saying what ``QUICK_CHECK_SQL`` found, unless "ok"."""
    _verdict(reader.read(lambda c: c.execute(QUICK_CHECK_SQL).get))


def _verdict(found: object) -> None:
    if found != "ok":
        lines = str(found).splitlines()
        said = "; ".join(x for x in lines if not x.startswith("*** in database"))
        raise apsw.CorruptError(f"quick_check: {said}")


def walk_check(conn: apsw.Connection) -> None:
    """Load every page of every b-tree of the spool with ``cell_size_check`` on: a page
    whose header, cell pointers or cell sizes do not fit raises ``apsw.CorruptError``.

    About a third of ``QUICK_CHECK_SQL``'s time: no record is decoded. Not checked, as
    ``QUICK_CHECK_SQL`` would: the free-page list, a page used twice or never, and
    each record's header and column types. A spool with a b-tree not in ``WALK_SQL``
    (an older schema) gets ``QUICK_CHECK_SQL``.
    """
    conn.execute(CELL_SIZE_CHECK_SQL)
    names = [name for (name,) in conn.execute(BTREES_SQL)]
    if any(name not in WALK_SQL for name in names):
        _verdict(conn.execute(QUICK_CHECK_SQL).get)
        return
    for sql in dict.fromkeys(WALK_SQL[name] for name in names):
        conn.execute(sql).fetchall()
