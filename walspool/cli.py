"""The ``walspool`` command line: inspect a spool, replay it into state.db, export it.

Usage: ``walspool COMMAND SPOOL_PATH [options]``. Read commands (stats, ls, show,
export, check) open the spool read-only and never block or disturb a gateway writing
to it. Exit status: 0 done; 1 error (one line on stderr); 2 bad usage; 3 done, but
rows were held back (replay) or files left in place (import-json).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import apsw
import msgspec

from ._cli_output import (
    Progress,
    ProgressSink,
    StateDBError,
    check_result,
    clip,
    count_records,
    dry_run_report,
    dump,
    iso,
    iter_records,
    open_state_db,
    plural,
    pretty,
    preview,
    read_backlog,
    read_stats,
    reading,
    record_json,
    replay_streams,
    run_check,
    size,
    spool_error,
    state_db_message,
    table,
)
from .errors import SpoolCorrupt, WalspoolError
from .records import AGENT_HISTORY, QUARANTINED, SUPERSEDED, Record
from .replay import Replayer, ReplayReport, statuses_filter
from .text import printable

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_HELD = 3


def cmd_stats(args: argparse.Namespace) -> int:
    """Summarize a spool.

    Rows, sessions, payload bytes, oldest and newest row, rows by reason, rows with
    errors, rows in flight, and the sizes of the db and WAL files.
    """
    with reading(args.spool) as conn:
        stats = read_stats(conn, args.spool)
    if args.json:
        print(dump(stats))
        return EXIT_OK
    reasons = [f"{n:,} {printable(reason)}" for reason, n in stats["by_reason"].items()] or ["-"]
    lines = [
        ("spool", printable(stats["spool"])),
        ("rows", f"{stats['rows']:,} in {plural(stats['sessions'], 'session')}"),
        ("payload", size(stats["bytes"])),
        ("oldest", stats["oldest"] or "-"),
        ("newest", stats["newest"] or "-"),
        ("by reason", reasons[0]),
        *(("", r) for r in reasons[1:]),
        ("with errors", plural(stats["failing"], "row")),
        ("in flight", plural(stats["inflight"], "row")),
        ("quarantined", plural(stats["quarantined"], "row")),
        ("superseded", plural(stats["superseded"], "row")),
        ("files", f"db {size(stats['db_bytes'])}, WAL {size(stats['wal_bytes'])}"),
    ]
    print("\n".join(f"{k:<12}{v}" for k, v in lines))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """List what waits in a spool, one line per session.

    The `backlog` view, oldest first: rows, bytes, oldest, newest, max attempts and
    last error. Rows spooled with a session key but no session id show as `key:<KEY>`.
    """
    with reading(args.spool) as conn:
        backlog = read_backlog(conn)
    if args.json:
        print(dump(backlog))
    elif not backlog:
        print(f"no rows in {printable(args.spool)}")
    else:
        headers = ("SESSION", "ROWS", "BYTES", "OLDEST", "NEWEST", "ATTEMPTS", "LAST ERROR")
        print(table(headers, [_backlog_line(b) for b in backlog]))
    return EXIT_OK


def _backlog_line(b: dict[str, Any]) -> tuple[Any, ...]:
    name = b["session_id"] if b["session_id"] is not None else f"key:{b['session_key']}"
    return (
        name,
        b["rows"],
        b["bytes"],
        b["oldest"],
        b["newest"],
        b["max_attempts"],
        clip(b["last_error"]),
    )


def cmd_show(args: argparse.Namespace) -> int:
    """Show one session's rows in drop order, with attempts and last error.

    SESSION is a session id, or the session key of rows spooled without one. The
    message column previews each payload; --full prints the payloads whole.
    """
    bad: list[str] = []
    with reading(args.spool) as conn:
        # Streamed: one page of rows in memory at a time, whatever their size.
        rows = iter_records(conn, args.session, bad=bad)
        first = next(rows, None)
        if first is None:
            raise WalspoolError(f"no rows for session {args.session!r} in {args.spool}")
        rows = itertools.chain([first], rows)
        if args.json:
            _show_json(rows, args.full)
        elif args.full:
            _show_full(args, rows)
        else:
            _show_table(args, rows)
    return _bad_payloads("show", bad)


def _bad_payloads(command: str, bad: list[str]) -> int:
    """Name the rows shown flagged because their payload is not JSON; exit 1 if any."""
    if not bad:
        return EXIT_OK
    listed = ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
    _warn(
        command,
        f"{plural(len(bad), 'row')} with a payload that is not valid JSON, shown flagged: "
        f"{listed}; `walspool check` names them too",
    )
    return EXIT_ERROR


def _show_json(rows: Iterator[tuple[Record, int | None]], full: bool) -> None:
    out = sys.stdout
    out.write("[")
    for n, (r, inflight) in enumerate(rows):
        out.write(("," if n else "") + dump(record_json(r, inflight, message=full)))
    out.write("]\n")


def _show_full(args: argparse.Namespace, rows: Iterator[tuple[Record, int | None]]) -> None:
    print(f"session {printable(args.session)} in {printable(args.spool)}")
    for r, inflight in rows:
        print(
            f"\nseq {r.seq}  id {r.id}  {printable(r.reason)}  {iso(r.created_at)}  "
            f"attempts {r.attempts}{'  in flight' if inflight is not None else ''}"
            f"{'  ' + r.status if r.status else ''}"
        )
        if r.last_error is not None:
            print(f"last error ({iso(r.last_attempt_at)}): {printable(r.last_error)}")
        print(pretty(r.message))


def _show_table(args: argparse.Namespace, rows: Iterator[tuple[Record, int | None]]) -> None:
    lines, marks = [], set()
    for r, inflight in rows:  # only the short preview of each row is kept
        lines.append(_show_line(r, inflight))
        marks.add("*" if inflight is not None else r.status)
    session, spool = printable(args.session), printable(args.spool)
    print(f"session {session}: {plural(len(lines), 'row')} in {spool}")
    headers = ("SEQ", "ID", "REASON", "CREATED", "ATTEMPTS", "LAST ERROR", "MESSAGE")
    print(table(headers, lines))
    if "*" in marks:
        print("* in flight: out with a replay, or left to be checked against state.db first")
    if QUARANTINED in marks:
        print("Q quarantined: kept, not replayed; replay --quarantined once the cause is fixed")
    if SUPERSEDED in marks:
        print("S superseded by a transcript rewrite: kept, not replayed unless --superseded")


#: The mark after ``attempts`` in ``show`` for a row of each status.
STATUS_MARKS = {QUARANTINED: "Q", SUPERSEDED: "S"}


def _show_line(r: Record, inflight: int | None) -> tuple[Any, ...]:
    mark = "*" if inflight is not None else STATUS_MARKS.get(r.status or "", "")
    attempts = f"{r.attempts}{mark}"
    return (
        r.seq,
        r.id,
        r.reason,
        iso(r.created_at),
        attempts,
        clip(r.last_error, 60),
        preview(r.message),
    )


def cmd_replay(args: argparse.Namespace) -> int:
    """Move spooled rows into the gateway's state.db, in drop order, exactly once.

    Writes through hermes' SessionDB and reports what moved and what was held, and
    why; a failing row holds back the later rows of its session only, but a row
    state.db refuses for its content is quarantined and its session goes on.
    Quarantined and superseded rows move only with --quarantined or --superseded,
    agent histories only when asked for with --reason. --dry-run writes nothing: it reports what
    would move, judging by which sessions exist in state.db. Exit 3 when rows are held.
    """
    with reading(args.spool) as conn:
        streams = replay_streams(
            conn, args.session, args.reason, statuses_filter(args.quarantined, args.superseded)
        )
    if args.dry_run:
        state = open_state_db(args.into, write=False)
        try:
            report = dry_run_report(streams, state, args.create_missing)
        except sqlite3.Error as exc:
            raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
        finally:
            state.close()
    else:
        open_state_db(args.into, write=True).close()
        report = _replay(args, total=sum(n for *_, n in streams))
    _print_replay(args, report)
    if report.held:
        missing = any("FOREIGN KEY" in e for e in report.errors.values())
        hint = "; --create-missing creates missing sessions" if missing else ""
        verb = "would be held" if args.dry_run else "held"
        where = plural(len(report.errors), "session")
        _warn("replay", f"{plural(report.held, 'row')} {verb} in {where}{hint}")
        return EXIT_HELD
    return EXIT_OK


def _replay(args: argparse.Namespace, total: int) -> ReplayReport:
    try:
        import hermes_state
    except ImportError as exc:
        raise WalspoolError("replay needs hermes-agent: pip install 'walspool[hermes]'") from exc
    from .sinks import SessionDBSink
    from .spool import Spool

    try:
        db = hermes_state.SessionDB(db_path=args.into)
    except sqlite3.Error as exc:
        raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
    progress = Progress("replay", sys.stderr)
    try:
        with Spool(args.spool) as spool:
            sink = SessionDBSink(db, create_missing=args.create_missing)
            counted = ProgressSink(sink, progress, total)
            return Replayer(spool, counted).replay(
                session_id=args.session,
                reasons=args.reason,
                quarantined=args.quarantined,
                superseded=args.superseded,
            )
    finally:
        progress.close()
        db.close()


def _print_replay(args: argparse.Namespace, report: ReplayReport) -> None:
    if args.json:
        out = {"spool": str(args.spool), "state_db": str(args.into), "dry_run": args.dry_run}
        print(dump({**out, **msgspec.to_builtins(report)}))
        return
    moved, held = ("would move", "would hold") if args.dry_run else ("moved", "held")
    print(
        f"{moved} {plural(report.moved, 'row')} from {printable(args.spool)} "
        f"into {printable(args.into)}"
    )
    if report.recovered:
        print(f"recovered {plural(report.recovered, 'row')} an interrupted replay had written")
    if report.quarantined:
        print(
            f"quarantined {plural(report.quarantined, 'row')} state.db refused for its "
            "content (see `walspool show`; replay again with --quarantined once fixed)"
        )
    if report.held:
        print(f"{held} {plural(report.held, 'row')} in {plural(len(report.errors), 'session')}:")
        rows = [(name, report.sessions[name].held, error) for name, error in report.errors.items()]
        print(table(("SESSION", "HELD", "WHY"), rows))


def cmd_export(args: argparse.Namespace) -> int:
    """Write spooled records to stdout as JSON lines, one record per line.

    Each session in drop order (rows spooled by session id first, then rows spooled
    by session key only). Every reason is exported unless --reason is given.
    """
    bad: list[str] = []
    with reading(args.spool) as conn:
        progress = Progress("export", sys.stderr)
        total = count_records(conn, args.session, args.reason) if progress.enabled else 0
        out = sys.stdout
        try:
            for n, (record, inflight) in enumerate(
                iter_records(conn, args.session, args.reason, bad=bad), 1
            ):
                out.write(dump(record_json(record, inflight)) + "\n")
                progress(n, total)
        finally:
            progress.close()
    out.flush()
    return _bad_payloads("export", bad)


def cmd_import_json(args: argparse.Namespace) -> int:
    """Import upstream hermes-agent's JSON-file spool (DIR/pending-*.json).

    DIR is usually <HERMES_HOME>/pending_messages; SPOOL_PATH is created if missing.
    Files are appended in upstream's drop order, each removed once its row is
    committed; files that cannot be used stay (exit 3). Stop the gateway first.
    """
    from .jsonspool import import_json_spool
    from .spool import Spool

    progress = Progress("import", sys.stderr)
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
        _warn("import-json", f"{left} left in place in {args.directory}")
        return EXIT_HELD
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """Check a spool in full; exit 1 on any problem.

    PRAGMA integrity_check, application id and schema version, bookkeeping (every
    stream has its `sequences` row, no seq at or past next_seq), seq order and
    duplicates, payloads that are not JSON. Read-only, like stats, ls, show, export.
    """
    try:
        with reading(args.spool, cheap_check=False) as conn:
            result = run_check(conn, args.spool)
    except SpoolCorrupt as exc:
        result = check_result(args.spool, None, None, None, [str(exc)], [])
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
        _warn("check", f"spool {args.spool} has {n}: {clip(result['problems'][0], 200)}")
        return EXIT_ERROR
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo: a gateway outage with and without walspool.

    Spools messages during a simulated outage of a real hermes-agent 0.19.0 gateway
    and replays them into state.db, side by side with the released gateway.
    """
    from .demo import run_demo

    return run_demo(sys.stdout)


# -- the parser ----------------------------------------------------------------------


def _spool_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("spool", type=_path, metavar="SPOOL_PATH", help="the spool file")


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (see the README contract)")


def _args_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", metavar="SESSION", help="session id (or key)")
    p.add_argument("--full", action="store_true", help="print each row's payload")


def _args_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--into",
        type=_path,
        required=True,
        metavar="STATE_DB",
        help="the gateway's state.db (<HERMES_HOME>/state.db); must exist",
    )
    p.add_argument("--session", metavar="S", help="only rows spooled with this session id")
    p.add_argument(
        "--reason",
        action="append",
        metavar="R",
        help=f"only rows of this reason (repeatable); default: all but {AGENT_HISTORY}",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="report what would move and what would be held; write nothing",
    )
    p.add_argument(
        "--create-missing",
        action="store_true",
        help="create sessions missing from state.db instead of holding their rows",
    )
    p.add_argument(
        "--quarantined",
        action="store_true",
        help="also replay quarantined rows (after fixing what made state.db refuse them)",
    )
    p.add_argument(
        "--superseded",
        action="store_true",
        help="also replay rows a transcript rewrite superseded",
    )


def _args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session", metavar="S", help="only this session (id or key)")
    p.add_argument(
        "--reason",
        action="append",
        metavar="R",
        help="only rows of this reason (repeatable); default: every reason",
    )


def _args_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=_path, metavar="DIR", help="the pending_messages directory")


Command = Callable[[argparse.Namespace], int]
#: name, function, and the function that adds its own arguments
COMMANDS: tuple[tuple[str, Command, Callable[[argparse.ArgumentParser], None] | None], ...] = (
    ("stats", cmd_stats, None),
    ("ls", cmd_ls, None),
    ("show", cmd_show, _args_show),
    ("replay", cmd_replay, _args_replay),
    ("export", cmd_export, _args_export),
    ("import-json", cmd_import_json, _args_import),
    ("check", cmd_check, None),
    ("demo", cmd_demo, None),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per ``cmd_*`` function, its docstring its help."""
    parser = argparse.ArgumentParser(
        prog="walspool", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, add_args in COMMANDS:
        doc = inspect.cleandoc(fn.__doc__ or "")
        sub = commands.add_parser(
            name,
            help=doc.split("\n")[0],
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "demo":
            _spool_arg(sub)
        if add_args is not None:
            add_args(sub)
        if name != "demo":
            _json_arg(sub)
        sub.set_defaults(func=fn)
    return parser


def _path(text: str) -> Path:
    return Path(os.path.expanduser(text))


def _warn(command: str, message: str) -> None:
    print(f"walspool {command}: {printable(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except WalspoolError as exc:
        _warn(args.command, str(exc))
    except apsw.Error as exc:
        _warn(args.command, str(spool_error(exc, getattr(args, "spool", Path("?")))))
    except BrokenPipeError:
        # The reader went away (`walspool export ... | head`): stop quietly.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        _warn(args.command, f"cannot access{where}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        _warn(args.command, "interrupted")
        return 130
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
