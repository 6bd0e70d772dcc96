"""``walspool replay``: move spooled rows into the gateway's state.db."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

import msgspec

from ..errors import WalspoolError
from ..records import AGENT_HISTORY, Record
from ..replay import Replayer, ReplayReport, StreamReport, statuses_filter
from ..sinks import Sink, Ticket
from ..text import printable
from ._dryrun import dry_run_report, plan, replay_streams
from ._filters import check_reasons, check_session
from ._output import EXIT_HELD, EXIT_OK, Progress, as_path, dump, plural, table, warn
from ._reading import INFLIGHT_SQL, reading
from ._statedb import StateDBError, open_state_db, state_db_message


def run(args: argparse.Namespace) -> int:
    """Move spooled rows into the gateway's state.db, in drop order, exactly once.

    Writes through hermes' SessionDB and reports what moved and what was held, and
    why; a failing row holds back the later rows of its session only, but a row
    state.db refuses for its content is quarantined and its session goes on.
    Quarantined and superseded rows move only with --quarantined or --superseded,
    agent histories only when asked for with --reason. --dry-run writes nothing: it tries
    each session's first row against state.db in a transaction it rolls back, so a
    trigger, a lock or a read-only file shows as "would be held", and reports rows in
    flight and payloads that are not JSON. Exit 3 when rows are (or would be) held.
    """
    # state.db first: one that cannot take the rows is reported before the spool is read.
    # A dry run opens it for writing too, to try rows in transactions it rolls back.
    state = open_state_db(args.into, write=True, precheck=not args.dry_run)
    try:
        statuses = statuses_filter(args.quarantined, args.superseded)
        with reading(args.spool) as reader:
            check_reasons(reader, args.reason)
            check_session(reader, args.session, keys=False)
            what = plan if args.dry_run else replay_streams
            found = reader.read(lambda conn: what(conn, args.session, args.reason, statuses))
        if args.dry_run:
            try:
                report = dry_run_report(found, state, args.into, args.create_missing)
            except sqlite3.Error as exc:
                raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
            inflight = sum(s.inflight for s in found.streams)
    finally:
        state.close()
    if not args.dry_run:
        report = _replay(args, total=sum(s.rows for s in found))
        inflight = _inflight(args.spool)
    _print_replay(args, report, inflight)
    if report.held:
        missing = any("FOREIGN KEY" in e for e in report.errors.values())
        hint = "; --create-missing creates missing sessions" if missing else ""
        verb = "would be held" if args.dry_run else "held"
        where = plural(len(report.errors), "session")
        warn("replay", f"{plural(report.held, 'row')} {verb} in {where}{hint}")
        return EXIT_HELD
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--into",
        type=as_path,
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


def _replay(args: argparse.Namespace, total: int) -> ReplayReport:
    try:
        import hermes_state
    except ImportError as exc:
        raise WalspoolError("replay needs hermes-agent: pip install 'walspool[hermes]'") from exc
    from ..sinks import SessionDBSink
    from ..spool import Spool

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


def _inflight(path: Path) -> int:
    """Rows a replay has out now (read-only, after the replay closed the spool)."""
    with reading(path) as reader:
        return int(reader.read(lambda conn: conn.execute(INFLIGHT_SQL).get))


def _print_replay(args: argparse.Namespace, report: ReplayReport, inflight: int) -> None:
    if args.json:
        out = {"spool": str(args.spool), "state_db": str(args.into), "dry_run": args.dry_run}
        print(dump({**out, **msgspec.to_builtins(report), "inflight": inflight}))
        return
    moved, held = ("would move", "would hold") if args.dry_run else ("moved", "held")
    print(
        f"{moved} {plural(report.moved, 'row')} from {printable(args.spool)} "
        f"into {printable(args.into)}"
    )
    if args.dry_run and inflight:
        print(
            f"{plural(inflight, 'row')} in flight from an interrupted replay: "
            f"{report.recovered:,} already in state.db (would be removed without a write), "
            "the rest would be written first"
        )
    elif report.recovered:
        print(f"recovered {plural(report.recovered, 'row')} an interrupted replay had written")
    if report.quarantined and args.dry_run:
        print(
            f"would quarantine {plural(report.quarantined, 'row')}: a payload that is not "
            "JSON, or a first row state.db refuses for its content"
        )
    elif report.quarantined:
        print(
            f"quarantined {plural(report.quarantined, 'row')} state.db refused for its "
            "content (see `walspool show`; replay again with --quarantined once fixed)"
        )
    if report.held:
        print(f"{held} {plural(report.held, 'row')} in {plural(len(report.errors), 'session')}:")
        rows = [
            (_stream(report.sessions[name]), report.sessions[name].held, error)
            for name, error in report.errors.items()
        ]
        print(table(("SESSION", "HELD", "WHY"), rows))
    if inflight and not args.dry_run:
        print(
            f"{plural(inflight, 'row')} still in flight: the next replay checks state.db "
            "for each first and writes only those it does not hold"
        )


def _stream(s: StreamReport) -> str:
    """A stream as ``ls`` shows it: its session id, or ``key:<KEY>``."""
    return s.session_id if s.session_id is not None else f"key:{s.session_key}"


class ProgressSink:
    """A sink that counts successful writes for the progress bar; otherwise the sink."""

    def __init__(self, sink: Sink, progress: Progress, total: int) -> None:
        self.sink = sink
        self.progress = progress
        self.total = total
        self.done = 0

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        self.sink.write(session_id, record, ticket)
        self.done += 1
        self.progress(self.done, self.total)

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None:
        return self.sink.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        forget = getattr(self.sink, "forget", None)
        if forget is not None:
            forget(spool, below, keep)

    def __repr__(self) -> str:
        return repr(self.sink)
