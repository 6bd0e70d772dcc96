""" "Did you mean": the names near a mistyped spool path or session, for the error that
says it does not exist. Bounded: a directory's first ``NEAR_NAMES`` entries, a spool's
first ``NEAR_NAMES`` session ids and keys (in their index's order, no sort)."""

from __future__ import annotations

import difflib
import itertools
import os
from pathlib import Path

from ..store.reader import SpoolReader

NEAR_NAMES = 10_000
#: Distinct session ids, then distinct keys of rows spooled without one, each walked in
#: its unique index (names longer than ``NEAR_CHARS`` are no typo's target).
NEAR_CHARS = 200
_IDS_SQL = """SELECT DISTINCT session_id FROM records INDEXED BY sqlite_autoindex_records_1
    WHERE session_id IS NOT NULL AND length(session_id) <= :chars LIMIT :n"""
_KEYS_SQL = """SELECT DISTINCT session_key FROM records INDEXED BY records_session_key_seq_idx
    WHERE session_id IS NULL AND length(session_key) <= :chars LIMIT :n"""


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
    params = {"chars": NEAR_CHARS, "n": NEAR_NAMES}
    ids = reader.read(lambda c: [s for (s,) in c.execute(_IDS_SQL, params)])
    keys = reader.read(lambda c: [f"key:{k}" for (k,) in c.execute(_KEYS_SQL, params)])
    near = difflib.get_close_matches(name, ids + keys, n=3)
    return f"; did you mean: {', '.join(near)}?" if near else ""
