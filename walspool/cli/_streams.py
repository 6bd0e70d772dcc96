"""The ``ls --json`` objects of a spool's streams (``walspool.store.backlog``), whole,
written one at a time. Not public API."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from typing import IO, Any

import apsw

from ..store import backlog
from ..store.backlog import Line
from ._output import dump, iso

#: ``--json`` text kept in memory before the rest goes to a temporary file: the text is
#: written out only after the reading it comes from is known to be sound (a reading may
#: be done again: ``SpoolReader.read``).
JSON_IN_MEMORY = 8 * 1024 * 1024
#: ``--json`` text is written in slices this long: a huge object's text is never copied
#: whole to be encoded, or into memory before the temporary file takes over.
JSON_SLICE = 1024 * 1024
BACKLOG_KEYS = (
    "session_id",
    "session_key",
    "rows",
    "bytes",
    "oldest",
    "newest",
    "max_attempts",
    "last_error",
    "quarantined",
    "superseded",
)
#: What ``ls --json`` adds to the view's columns: rows out with a replay now, rows with an
#: error still in line (held, waiting for the next try), and the oldest and newest row's
#: ages in seconds at the reading.
MORE_KEYS = ("inflight", "retrying", "oldest_age", "newest_age")


def backlog_object(conn: apsw.Connection, line: Line, now: float) -> dict[str, Any]:
    """``line`` as its ``ls --json`` object, name and error whole (read again from their
    rows when longer than ``CHARS``: in the transaction ``line`` was read in), ages as
    of ``now``."""
    sid, key, error = line.session_id, line.session_key, line.last_error
    if line.name_chars > backlog.CHARS:
        name = backlog.whole_name(conn, line.name_row)
        sid, key = (name, None) if sid is not None else (None, name)
    if line.error_chars > backlog.CHARS:
        error = backlog.whole_error(conn, line.error_row)
    values = (
        sid, key, line.rows, line.bytes, iso(line.oldest), iso(line.newest), line.max_attempts,
        error, line.quarantined, line.superseded, line.inflight, line.retrying,
        max(now - line.oldest, 0.0), max(now - line.newest, 0.0),
    )  # fmt: skip
    return dict(zip(BACKLOG_KEYS + MORE_KEYS, values, strict=True))


def latest_error(conn: apsw.Connection, line: Line, first: str | None) -> str | None:
    """``line``'s latest error whole (read again from its row when longer than
    ``CHARS``), ``first`` when that is the first error's row (``first`` whole)."""
    if line.latest_row is not None and line.latest_row == line.error_row:
        return first
    if line.latest_chars > backlog.CHARS:
        return backlog.whole_error(conn, line.latest_row)
    return line.latest_error


def held_text() -> IO[str]:
    """Where a listing's text (``--json``, or ``ls``'s table) waits until its reading is
    done: memory up to ``JSON_IN_MEMORY``, then a temporary file (in ``TMPDIR``)."""
    return tempfile.SpooledTemporaryFile(JSON_IN_MEMORY, "w+", encoding="utf-8", newline="")


def write_array(out: IO[str], objects: Iterable[dict[str, Any]]) -> None:
    """``objects`` as a JSON array into ``out`` (emptied first: a reading may be done
    again), the same text ``dump`` gives, an object at a time and a member at a time:
    the text held is that of one value (a name, an error), never of a whole object."""
    out.seek(0)
    out.truncate()
    out.write("[")
    for n, value in enumerate(objects):
        out.write(",{" if n else "{")
        for m, key in enumerate(value):
            out.write(f"{',' if m else ''}{dump(key)}:")
            _write_value(out, value[key])
        out.write("}")
        del value  # not held while the next object is read
    out.write("]")


def _write_value(out: IO[str], value: Any) -> None:
    text = dump(value)
    for at in range(0, len(text), JSON_SLICE):
        out.write(text[at : at + JSON_SLICE])
