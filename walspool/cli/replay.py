"""``walspool replay``: move spooled rows into the gateway's state.db, through hermes'
SessionDB, taking turns with other replays, with progress."""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple
from urllib.parse import quote

import msgspec

from ..errors import ReplayBusy, WalspoolError
from ..replay.replayer import Replayer, ReplayReport, StreamReport, statuses_filter
from ..replay.sinks import ForgetsTickets, SessionDBSink, Sink, Ticket
from ..shutdown_flush import routing_resolver
from ..store import files, totals
from ..store.preview import fetch_record, plan, replay_streams
from ..store.records import AGENT_HISTORY, Record
from ..store.spool import Spool
from ..text import printable
from ._dryrun import dry_run_report, landed
from ._filters import check_reasons, check_session
from ._interrupt import Interrupted, interruptible, raise_kept
from ._lockwait import add_wait_argument, busy_message, say_waiting
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
from ._statedb import (
    CheckedStateDB,
    StateDBError,
    check_state_db,
    open_descriptors,
    open_state_db,
    state_db_message,
)


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


def replay_into(
    args: argparse.Namespace, progress: Progress, total: int, written: list[Ticket]
) -> ReplayReport:
    """Replay ``args.spool`` into ``args.into`` through hermes' SessionDB.

    Another replay holding the spool's replay lock raises ``ReplayBusy`` at once, or,
    with ``--wait``, after saying so and waiting that long for it. ``progress`` counts
    the rows written into state.db, whose tickets are added to ``written`` (kept after
    an interruption); the caller closes it.
    """
    try:
        import hermes_state
    except ImportError as exc:
        raise WalspoolError("replay needs hermes-agent: pip install 'walspool[hermes]'") from exc

    checked = check_state_db(args.into)
    before = open_descriptors()
    try:
        with connecting_checked(hermes_state, checked):
            db = hermes_state.SessionDB(db_path=args.into)
    except sqlite3.Error as exc:
        raise StateDBError(state_db_message(exc, args.into), path=args.into) from exc
    try:
        checked.verify(before)  # the rows go into the state.db checked, or nowhere
    except BaseException:
        db.close()
        raise
    try:
        with Spool(args.spool) as spool:
            sink = SessionDBSink(db, create_missing=args.create_missing)
            # Rows spooled by routing key go where the gateway routes that key now.
            resolver = routing_resolver(db, args.into.parent)
            replayer = Replayer(
                spool, ProgressSink(sink, progress, total, written), resolver=resolver
            )
            options = {
                "session_id": args.session,
                "reasons": args.reason,
                "quarantined": args.quarantined,
                "superseded": args.superseded,
            }
            try:
                return replayer.replay(**options, wait=False)
            except ReplayBusy as busy:
                if not args.wait:
                    raise
                say_waiting("replay", args, busy.pid)
            return replayer.replay(**options, wait=args.wait)
    finally:
        db.close()


def _checked_sqlite3(checked: CheckedStateDB) -> ModuleType:
    """The stdlib ``sqlite3`` module as ``hermes_state`` sees it while ``SessionDB()``
    runs: a copy of its names whose ``connect`` of the checked state.db opens it
    ``mode=rw`` (never creating a file where a link or a rename sent the path) and
    proves, before handing the connection over, that SQLite holds the checked file
    (``CheckedStateDB.verify``)."""
    path = checked.path

    def connect(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        if str(database) not in (str(path), str(path.absolute())):
            return sqlite3.connect(database, *args, **kwargs)  # e.g. hermes' ":memory:" probe
        kwargs["uri"] = True
        before = open_descriptors()  # this connection's own descriptor is the new one
        conn = sqlite3.connect(f"file:{quote(str(path.absolute()))}?mode=rw", *args, **kwargs)
        try:
            checked.verify(before, writable=True)  # before any statement of hermes
        except BaseException:
            conn.close()
            raise
        return conn

    module = ModuleType(sqlite3.__name__, sqlite3.__doc__)
    module.__dict__.update(vars(sqlite3))
    module.connect = connect  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def connecting_checked(hermes_state: Any, checked: CheckedStateDB) -> Iterator[None]:
    """For the block, hermes' ``SessionDB()`` opens state.db only as the file checked.

    ``SessionDB.__init__`` opens its path and runs its set-up (journal mode, schema
    ``CREATE ... IF NOT EXISTS``, migrations) on that connection at once: a link or a
    rename swapped in after ``check_state_db`` would have those statements run on
    another file. The stdlib module ``hermes_state`` calls is replaced for the block
    by ``_checked_sqlite3``'s copy, which refuses (``StateDBError``) before any of them runs.
    Not thread-safe: for the command line, which builds one SessionDB and nothing else
    of hermes meanwhile.
    """
    original = hermes_state.sqlite3
    hermes_state.sqlite3 = _checked_sqlite3(checked)
    try:
        yield
    finally:
        hermes_state.sqlite3 = original


class InFlightNow(NamedTuple):
    """Rows a replay has out now, and how many of them state.db already holds."""

    rows: int
    landed: int
    tickets: frozenset[tuple[int, int]] = frozenset()  # (ticket, record id)


def in_flight(spool: Path, state_db: Path) -> InFlightNow:
    """The spool's rows in flight now (read-only, after the replay closed the spool),
    and those whose ticket state.db holds (read-only)."""
    with reading(spool, quick_check=False) as reader:  # checked before the replay
        uid, rows = reader.read(lambda conn: (totals.uid(conn), totals.in_flight_tickets(conn)))
    tickets = frozenset((ticket, rid) for rid, ticket in rows)
    if not tickets:
        return InFlightNow(0, 0)
    state = open_state_db(state_db, write=False)
    try:
        found = landed(state, str(uid), sorted({ticket for ticket, _ in tickets}))
    finally:
        state.close()
    return InFlightNow(len(tickets), len(found & tickets), tickets)


class ProgressSink:
    """A sink that counts successful writes for the progress report; otherwise the sink."""

    def __init__(self, sink: Sink, progress: Progress, total: int, written: list[Ticket]) -> None:
        self.sink = sink
        self.progress = progress
        self.total = total
        self.written = written
        self.done = 0

    def write(self, session_id: str, record: Record, ticket: Ticket) -> None:
        try:
            self.sink.write(session_id, record, ticket)
        except BaseException:
            raise_kept()  # a signal that came during the write ends the replay now
            raise
        self.written.append(ticket)
        self.done += 1
        self.progress(self.done, self.total)
        raise_kept()

    def landed(self, tickets: Sequence[Ticket]) -> Collection[Ticket] | None:
        return self.sink.landed(tickets)

    def forget(self, spool: str, below: int, keep: Sequence[int]) -> None:
        if isinstance(self.sink, ForgetsTickets):
            self.sink.forget(spool, below, keep)

    def __repr__(self) -> str:
        return repr(self.sink)
