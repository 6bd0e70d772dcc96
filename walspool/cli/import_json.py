"""``walspool import-json``: take over upstream's JSON-file spool."""

from __future__ import annotations

import argparse
import sys

import msgspec

from ..text import printable
from ._output import (
    EXIT_HELD,
    EXIT_OK,
    Progress,
    add_progress_argument,
    as_path,
    dump,
    plural,
    warn,
)
from ._reading import reading, upgraded


def run(args: argparse.Namespace) -> int:
    """Import upstream hermes-agent's JSON-file spool (DIR/pending-*.json).

    DIR is usually <HERMES_HOME>/pending_messages; SPOOL_PATH is created if missing.
    Files are appended in upstream's drop order, each removed once its row is
    committed; files that cannot be used stay (exit 3). Stop the gateway first.
    """
    from ..replay.jsonspool import check_directory, import_json_spool
    from ..store.spool import Spool

    check_directory(args.directory)  # before the spool is made, or an empty file taken
    if args.spool.is_file() and args.spool.stat().st_size:
        # A damaged spool is reported, as every command reports it, not moved aside.
        upgraded("import-json", args.spool)
        with reading(args.spool):
            pass
    progress = Progress("import", sys.stderr, enabled=args.progress, unit="files")
    try:
        with Spool(args.spool) as spool:
            report = import_json_spool(spool, args.directory, progress=progress)
    finally:
        progress.close()
    if args.json:
        out = {"spool": str(args.spool), "directory": str(args.directory)}
        print(dump({**out, **msgspec.to_builtins(report)}))
    else:
        print(
            f"imported {plural(report.imported, 'file')} from {printable(args.directory)} "
            f"into {printable(args.spool)}"
        )
        for reason, n in sorted(report.by_reason.items()):
            print(f"  {n:,} {printable(reason)}")
        for line in report.skipped:
            print(f"left in place: {printable(line)}")
        for name in report.quarantined:
            print(f"quarantined by upstream, left alone: {printable(name)}")
    if report.skipped:
        left = plural(len(report.skipped), "file")
        warn("import-json", f"{left} left in place in {args.directory}")
        return EXIT_HELD
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=as_path, metavar="DIR", help="the pending_messages directory")
    add_progress_argument(p)
