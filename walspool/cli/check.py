"""``walspool check``: the full check of a spool, read-only."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpoolCorrupt, WalspoolError
from ..store.checks import check_result, full_check
from ..text import printable
from ._output import EXIT_ERROR, EXIT_OK, Steps, add_progress_argument, clip, dump, plural, warn
from ._reading import reading


def run(args: argparse.Namespace) -> int:
    """Check a spool in full; exit 1 on any problem.

    PRAGMA integrity_check, application id and schema version, walspool's own schema
    (tables, views, indexes, the triggers that keep each stream's next seq), seq order
    and duplicates, payloads that are not JSON and sizes that are not the payload's, each
    bad row named (id, session, seq). --json prints its object whatever is wrong,
    even when the file is no spool at all. Read-only, like stats, ls, show, export.
    --progress names each step on stderr as it begins (a million rows take seconds).
    """
    steps = Steps("check", sys.stderr, enabled=args.progress)
    try:
        with reading(args.spool, cheap_check=False) as reader:
            result = reader.read(lambda conn: full_check(conn, args.spool, steps, steps.ticker))
    except WalspoolError as exc:
        if not (args.json or isinstance(exc, SpoolCorrupt)):
            raise
        # Not advice to run check itself, which is running.
        text = str(exc).replace(f"; run `walspool check {args.spool}`", "")
        # A schema that is not walspool's: each object named, none of its SQL run.
        problems = getattr(exc, "problems", None) or [text]
        result = check_result(args.spool, None, None, None, problems, [])
    finally:
        steps.close()
    if args.json:
        print(dump(result))
    else:
        print(f"spool          {printable(result['spool'])}")
        print(f"application_id {result['application_id']}")
        print(f"schema version {result['schema_version']}")
        print(f"rows           {'-' if result['rows'] is None else format(result['rows'], ',')}")
        for note in result["notes"]:
            print(f"note: {printable(note)}")
        for problem in result["problems"]:
            print(f"problem: {printable(problem)}")
        print("ok" if result["ok"] else plural(len(result["problems"]), "problem"))
    if not result["ok"]:
        n = plural(len(result["problems"]), "problem")
        warn("check", f"spool {args.spool} has {n}: {clip(result['problems'][0], 200)}")
        return EXIT_ERROR
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_progress_argument(p)
