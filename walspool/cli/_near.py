""" "Did you mean": the names near a mistyped spool path or session, for the error that
says it does not exist. Bounded: a directory's first ``NEAR_NAMES`` entries, a spool's
first ``NEAR_NAMES`` session ids and keys (in their index's order, no sort)."""

from __future__ import annotations

import difflib
import itertools
import os
from pathlib import Path

from ..store import lookups
from ..store.reader import SpoolReader

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
