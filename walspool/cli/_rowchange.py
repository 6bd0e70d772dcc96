"""What ``requeue`` and ``drop`` share: the rows they take (ids, or a selector), the
lock wait, the preview and the report."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ReplayBusy, WalspoolError
from ..store import lookups
from ..store.maintenance import actor
from ..store.reader import SpoolReader
from ..store.records import QUARANTINED, SUPERSEDED
from ..store.spool import Spool
from ..text import printable
from . import _memory as in_memory
from ._filters import UsageError, has_stream, id_ranges, row_ids, which_stream
from ._lockwait import add_wait_argument, busy_message, say_waiting
from ._output import EXIT_OK, ReplayRunning, clip, dump, plural, stream_name, table
from ._reading import near_sessions, reading, upgraded

Change = Callable[..., list[int]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--id",
        dest="ids",
        type=row_ids,
        action="extend",
        metavar="ID[,ID...]",
        help="rows by id, as `walspool show` and the failures view print them "
        "(repeatable, or comma-separated, with ranges: --id 7,9 or --id 7-9)",
    )
    p.add_argument(
        "--session",
        metavar="S",
        help="instead of ids: the set-aside rows of this session (id, or key:<KEY> as "
        "ls prints it)",
    )
    p.add_argument("--quarantined", action="store_true", help="instead of ids: quarantined rows")
    p.add_argument("--superseded", action="store_true", help="instead of ids: superseded rows")
    add_wait_argument(p)


def selected(reader: SpoolReader, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows the command line names: by --id (each as it is now, missing ones left
    out), or the set-aside rows --session, --quarantined and --superseded select."""
    chose = args.session is not None or args.quarantined or args.superseded
    if bool(args.ids) == chose:
        raise UsageError(
            "name the rows: --id ID[,ID...], or a selector (--session S, --quarantined, "
            "--superseded), not both"
        )
    if args.ids:
        return reader.read(lambda c: lookups.rows_by_id(c, args.ids))
    name, kind = (None, None) if args.session is None else which_stream(reader, args.session)
    if name is not None and not has_stream(reader, name, kind):
        near = near_sessions(reader, args.session)
        held = in_memory.held_of(reader, args.session)
        raise WalspoolError(f"no rows for session {args.session!r} in {args.spool}{held}{near}")
    chosen = ((QUARANTINED, args.quarantined), (SUPERSEDED, args.superseded))
    statuses = [s for s, on in chosen if on] or [QUARANTINED, SUPERSEDED]
    rows = reader.read(lambda c: lookups.set_aside_rows(c, statuses, name, kind))
    if not rows:
        which = f" of session {args.session!r}" if args.session is not None else ""
        raise WalspoolError(f"no {' or '.join(statuses)} rows{which} in {args.spool}")
    return rows


def run_change(args: argparse.Namespace, command: str, change: Change, done: str) -> int:
    """Open the spool for writing (after the read path has reported any damage), make
    the change under the replay lock, and report it."""
    upgraded(command, args.spool)
    with reading(args.spool) as reader:  # a damaged spool is reported, never moved aside
        rows = selected(reader, args)
    ids = args.ids or [row["id"] for row in rows]
    by = actor()
    try:
        with Spool(args.spool) as spool:
            try:
                ids = change(spool, ids, by=by, wait=False)
            except ReplayBusy as busy:
                if not args.wait:
                    raise
                say_waiting(command, args, busy.pid)
                ids = change(spool, ids, by=by, wait=args.wait)
    except ReplayBusy as busy:
        raise ReplayRunning(f"nothing was changed: {busy_message(args, busy.pid)}") from busy
    report(args, ids, by, done)
    return EXIT_OK


def would_change(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What ``command`` would change, printed (a table, or with --json one object), and
    returned: ``{"spool", "would_<command>": ids, "rows": [...], "missing": ids}``. All
    the rows named or none: when --yes would refuse one (``problems``), it would take
    none, and ``rows`` still shows each selected row's state."""
    with reading(args.spool) as reader:
        rows = selected(reader, args)
    found = {row["id"] for row in rows}
    missing = [i for i in dict.fromkeys(args.ids or ()) if i not in found]
    #: Why the change with --yes would refuse (all or none): "ID (why)" for each row.
    problems = [f"{i} (no such row)" for i in missing] + [
        f"{r['id']} ({_refused_because(r)})" for r in rows if not _set_aside(r)
    ]
    out = {
        "spool": str(args.spool),
        f"would_{command}": [] if problems else [row["id"] for row in rows],
        "rows": rows,
        "missing": missing,
        "problems": problems,
    }
    if args.json:
        return out
    spool = printable(args.spool)
    if problems:
        refused = plural(len(problems), "row")
        print(f"{command} would take no rows of {spool} (all or none, and {refused} refused):")
    else:
        print(f"{command} would take {plural(len(rows), 'row')} of {spool}:")
    lines = [
        (
            str(r["id"]),
            stream_name(r["session_id"], r["session_key"]),
            str(r["seq"]),
            r["status"] if _set_aside(r) else f"{_state(r)}: refused",
            r["reason"],
            clip(r["last_error"], 60),
        )
        for r in rows
    ]
    print(table(("ID", "SESSION", "SEQ", "STATUS", "REASON", "LAST ERROR"), lines))
    if missing:
        print(f"no such row: {', '.join(map(str, missing))}")
    return out


def _set_aside(row: dict[str, Any]) -> bool:
    return row["status"] is not None and row["inflight"] is None


def _refused_because(row: dict[str, Any]) -> str:
    """Why ``requeue``/``drop`` refuse a row not set aside, in ``maintenance``'s words."""
    return "a replay has it out" if row["inflight"] is not None else "replayable, not set aside"


def _state(row: dict[str, Any]) -> str:
    return "in flight" if row["inflight"] is not None else "replayable"


def report(args: argparse.Namespace, ids: Sequence[int], by: str, done: str) -> None:
    if args.json:
        print(dump({"spool": str(args.spool), done: list(ids), "by": by}))
    else:
        listed = id_ranges(ids)
        print(f"{done} {plural(len(ids), 'row')} of {printable(args.spool)}: {listed}")
        print(f"recorded in its audit table as done by {printable(by)}")
