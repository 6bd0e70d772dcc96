"""``walspool replay``: move spooled rows into the gateway's state.db."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from typing import Any

import msgspec

from ..errors import ReplayBusy
from ..replay.replayer import ReplayReport, StreamReport, statuses_filter
from ..replay.sinks import Ticket
from ..store import files
from ..store.preview import fetch_record, plan, replay_streams
from ..store.records import AGENT_HISTORY, Record
from ..text import printable
from ._dryrun import dry_run_report
from ._filters import check_reasons, check_session
from ._interrupt import Interrupted, interruptible
from ._lockwait import add_wait_argument, busy_message
from ._output import (
    EXIT_HELD,
    EXIT_OK,
    EXIT_QUARANTINED,
    Progress,
    ReplayRunning,
    add_progress_argument,
    as_path,
    cli_terms,
    dump,
    plural,
    stream_name,
    table,
    warn,
)
from ._reading import reading, upgraded
from ._replaying import InFlightNow, in_flight, replay_into
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
    flight and payloads that are not JSON. Exit 3 when rows are (or would be) held;
    else 5 when rows were (or would be) quarantined, so `walspool replay && ...` goes
    on only when everything chosen moved.

    Replays of one spool take turns: while another holds the spool's replay lock this
    one exits 4 at once, or waits --wait SECONDS for it first. SIGINT or SIGTERM stops
    the replay: it prints how many rows it wrote into state.db (the count the progress
    line ends on), how many of those left the spool, and the rows left in flight (the
    next replay finishes them, each once) and exits 130 or 143. --progress draws the rows written,
    the rate and an ETA on stderr (by default when stderr is a terminal).
    """
    # A signal before the replay takes any row (the checks, the plan, a dry run) stops
    # it with nothing written, with the status of one that comes later.
    try:
        with interruptible():
            found, report, inflight = _look(args)
    except Interrupted as stop:
        _print_replay(args, ReplayReport(0, 0), InFlightNow(0, 0), stop)
        warn("replay", f"interrupted by {stop.name} before any row moved; nothing was written")
        return stop.status
    if not args.dry_run:
        progress = Progress("replay", sys.stderr, enabled=args.progress)
        written: list[Ticket] = []
        total = sum(s.rows for s in found)
        try:
            with interruptible():
                report = replay_into(args, progress, total, written)
        except ReplayBusy as busy:
            progress.drop()  # it never ran: no "0 rows, took 0s"
            raise ReplayRunning(busy_message(args, busy.pid)) from busy
        except Interrupted as stop:
            # Moved: rows this run wrote that left the spool. The rows it had out stay
            # in flight, some of them already in state.db (the write the signal cut
            # short among them), for the next replay. The progress line ends on what
            # state.db holds of them, as the summary says.
            inflight = in_flight(args.spool, args.into)
            moved = sum((ticket, rid) not in inflight.tickets for _, ticket, rid in written)
            progress.state = (moved + inflight.landed, total)
            progress.close(interrupted=stop.name == "SIGINT")
            _print_replay(args, ReplayReport(moved, 0), inflight, stop)
            warn("replay", f"interrupted by {stop.name}; run the replay again to finish")
            return stop.status
        except BaseException:
            progress.close()
            raise
        # Rows a rerun found already in state.db (recovered) left the spool unwritten:
        # counted, so a finished replay ends on every row it took.
        progress.state = (progress.done + report.recovered, total)
        progress.close()
        inflight = in_flight(args.spool, args.into)
    _print_replay(args, report, inflight)
    if report.held:
        errors = [s.error for s in report.streams() if s.error is not None]
        missing = any("FOREIGN KEY" in e for e in errors)
        hint = "; --create-missing creates missing sessions" if missing else ""
        verb = "would be held" if args.dry_run else "held"
        where = plural(len(errors), "session")
        warn("replay", f"{plural(report.held, 'row')} {verb} in {where}{hint}")
        return EXIT_HELD
    if report.quarantined:
        verb = "would be quarantined" if args.dry_run else "quarantined"
        warn(
            "replay",
            f"{plural(report.quarantined, 'row')} {verb}: kept, not replayed; "
            "`walspool ls` counts them, `walspool show` names them",
        )
        return EXIT_QUARANTINED
    return EXIT_OK


def _look(args: argparse.Namespace) -> tuple[Any, ReplayReport | None, InFlightNow | None]:
    """What the replay will take, checked: state.db, the spool, the arguments; for a
    dry run, what it would do (its report and the rows in flight). Writes nothing."""
    report: ReplayReport | None = None
    inflight: InFlightNow | None = None
    # state.db first: one that cannot take the rows is reported before the spool is read.
    # A dry run opens it for writing too, to try rows in transactions it rolls back.
    state = open_state_db(args.into, write=True, precheck=not args.dry_run)
    try:
        # A replay writes the spool (each row leaves it once written): a dry run says
        # so too, rather than what would move, when it cannot.
        files.refuse_read_only(args.spool)
        if not args.dry_run:
            upgraded("replay", args.spool)
        statuses = statuses_filter(args.quarantined, args.superseded)
        with reading(args.spool) as reader:
            check_reasons(reader, args.reason)
            check_session(reader, args.session, keys=False)
            what = plan if args.dry_run else replay_streams
            found = reader.read(lambda conn: what(conn, args.session, args.reason, statuses))
            if args.dry_run:

                def fetch(row_id: int) -> Record | None:
                    return reader.read(lambda conn: fetch_record(conn, row_id))

                try:
                    report = dry_run_report(found, state, args.into, args.create_missing, fetch)
                except sqlite3.Error as exc:
                    raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
                inflight = InFlightNow(sum(s.inflight for s in found.streams), report.recovered)
    finally:
        state.close()
    return found, report, inflight


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--into",
        type=as_path,
        metavar="STATE_DB",
        help="the gateway's state.db; must exist (default: state.db beside SPOOL, so "
        "$HERMES_HOME/state.db with the default SPOOL)",
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
    add_wait_argument(p)
    add_progress_argument(p)


def _print_replay(
    args: argparse.Namespace,
    report: ReplayReport,
    inflight: InFlightNow,
    stop: Interrupted | None = None,
) -> None:
    if args.json:
        out = {"spool": str(args.spool), "state_db": str(args.into), "dry_run": args.dry_run}
        extra = {
            "inflight": inflight.rows,
            "inflight_landed": inflight.landed,
            "interrupted": stop.name if stop else None,
        }
        if stop is not None:
            extra["written"] = report.moved + inflight.landed
        print(dump({**out, **msgspec.to_builtins(report), **extra}))
        return
    moved, held = ("would move", "would hold") if args.dry_run else ("moved", "held")
    spool, into = printable(args.spool), printable(args.into)
    if stop is not None:
        # The count the progress line ended on: rows state.db holds now.
        written = plural(report.moved + inflight.landed, "row")
        print(
            f"interrupted by {stop.name} after writing {written} into {into}: "
            f"{report.moved:,} of them left {spool}"
        )
    else:
        print(f"{moved} {plural(report.moved, 'row')} from {spool} into {into}")
    if args.dry_run and inflight.rows:
        print(
            f"{plural(inflight.rows, 'row')} in flight (out with a replay or the gateway's "
            "drain now, or left by one that failed or was stopped): "
            f"{inflight.landed:,} already in state.db (would be removed without a write), "
            "the rest would be written first"
        )
    elif report.recovered:
        print(
            f"recovered {plural(report.recovered, 'row')} left in flight that state.db "
            "already held (written by an earlier replay or drain): removed, not written again"
        )
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
        failing = [s for s in report.streams() if s.error is not None]
        print(f"{held} {plural(report.held, 'row')} in {plural(len(failing), 'session')}:")
        rows = [(_stream(s), s.held, cli_terms(s.error)) for s in failing]
        print(table(("SESSION", "HELD", "WHY"), rows))
    if inflight.rows and not args.dry_run:
        print(
            f"{plural(inflight.rows, 'row')} still in flight, {inflight.landed:,} of them "
            "already in state.db: the next replay removes those without writing them again "
            "and writes the others first"
        )


def _stream(s: StreamReport) -> str:
    """A stream as ``ls`` shows it: its session id, or ``key:<KEY>``, quoted to paste."""
    return stream_name(s.session_id if s.session_key is None else None, s.session_key)
