"""``walspool watch``: a live view of a spool for an incident, redrawn in place."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator
from types import TracebackType
from typing import Any, TextIO

import msgspec

from ..errors import WalspoolError
from . import _memory as in_memory
from ._frame import drain_eta, render, render_reading
from ._interrupt import Interrupted, interruptible
from ._output import EXIT_OK, dump, iso
from ._reading import near_files
from ._streams import held_text
from ._watching import Rates, Snapshot, rates, read_snapshot, try_snapshot

#: Shortest --interval, in seconds: each reading opens the spool and counts its rows.
MIN_INTERVAL = 0.1
#: The alternate screen with the cursor hidden, as top and watch(1) draw; and back.
ENTER = "\x1b[?1049h\x1b[?25l"
LEAVE = "\x1b[?25h\x1b[?1049l"
QUIT_KEYS = (b"q", b"Q")
QUIT, RESIZE, TIMEOUT = "quit", "resize", "timeout"


def run(args: argparse.Namespace) -> int:
    """Watch a spool live: backlog per session, rows in flight and failing, rates.

    Reads the spool every --interval seconds and redraws in place: who has the spool
    open (pid and command of each process holding its open lock: the gateway, a
    replay; "no process" for a gateway that was killed or stopped, whose rows nothing
    drains), rows, sessions and payload bytes, the oldest row's age, rows in flight
    (out with a replay or the gateway's drain, or left to be checked against state.db)
    and failing (with a last error), quarantined and superseded rows, the rates and
    the drain's ETA, the db and WAL file sizes, then one line per session, oldest
    first, with its latest error, as many as the terminal holds (the rest counted as
    "+N more"). On a terminal, what needs a look is in colour (not with NO_COLOR set).
    q or Ctrl-C quits, exit status 0.

    appended: rows appended per second between the last two readings, counted from
    each stream's sequence numbers (every append takes the next one; they never go
    back, even after rows leave). replayed or dropped: rows that left the spool per
    second, that is rows appended less the growth of the row count; rows leave when a
    replay moves them into state.db (or finds them there already) and when they are
    dropped (walspool drop, or by hand). Both show "-" until the second reading, and
    when the spool file was replaced (or edited to count backwards) in between. drain
    ETA: the rows left over the rate they shrink by (replayed less appended), "not
    draining" when they do not shrink.

    A reading takes its time (about a second for a million rows: it reads what ls
    reads); one slower than --interval is followed by a pause as long as it took, and
    q and Ctrl-C work during it.

    Read-only, as stats and ls: nothing is written or created beside the spool, and
    nothing is held between readings. A spool that does not exist when watch starts
    is an error (exit 1, naming files of a close name beside it: mistyped?) unless
    --wait-for-spool, when it is said so on the screen and watched for, as is a spool
    moved aside while watching; a directory that does not exist is always an error.
    When stdout is not a terminal, watch reads the spool twice, --interval apart,
    prints one frame (no terminal codes, no width or height limit, the 500 oldest
    sessions) and exits; a spool it cannot read is then an error, as in stats, with
    --wait-for-spool or without. --json prints that one reading as a JSON object, with
    "open_by" ([{"pid", "command"}], null where the system cannot tell), "drain_eta"
    (seconds, null when not draining) and "streams": the 500 oldest sessions, each as
    ls --json gives it, plus "failing" (its rows with a last error) and "latest_error"
    (its most recent failed attempt's, as the frame shows; "last_error" is ls's).
    """
    if not args.spool.parent.is_dir():
        raise WalspoolError(
            f"no directory {args.spool.parent} for the spool {args.spool.name} (mistyped?): "
            "watch waits for a spool to appear only in a directory that exists"
        )
    if not args.wait_for_spool and not os.path.lexists(args.spool):
        raise WalspoolError(
            f"no spool at {args.spool} (no such file{near_files(args.spool)}): mistyped? "
            "--wait-for-spool watches for it to be created"
        )
    if args.json or not _isatty(sys.stdout):
        return _once(args)
    with interruptible():
        try:
            with Screen(sys.stdin, sys.stdout) as screen:
                _live(args, screen)
        except Interrupted as exc:
            if exc.signum != signal.SIGINT:
                raise  # SIGTERM: the terminal is back; main reports it (exit 143)
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=interval_seconds,
        default=1.0,
        metavar="SECONDS",
        help=f"seconds between readings (default: %(default)g, at least {MIN_INTERVAL:g})",
    )
    p.add_argument(
        "--wait-for-spool",
        action="store_true",
        help="on a terminal, watch for a spool that does not exist yet to be created "
        "(without it, a missing spool is an error)",
    )


def interval_seconds(text: str) -> float:
    """An --interval: a number of seconds, at least ``MIN_INTERVAL``."""
    value = float(text)
    if not math.isfinite(value) or value < MIN_INTERVAL:
        raise argparse.ArgumentTypeError(f"at least {MIN_INTERVAL:g} seconds, not {text}")
    return value


def _once(args: argparse.Namespace) -> int:
    first = read_snapshot(args.spool, quick_check=True)  # damage refused as stats does
    time.sleep(args.interval)
    if not args.json:
        last = read_snapshot(args.spool)
        print("\n".join(render(last, rates(first, last), "walspool watch")))  # no colour
        return EXIT_OK
    with held_text() as streams:
        last = read_snapshot(args.spool, streams=streams)
        head = dump(_json(last, rates(first, last)))
        sys.stdout.write(head[:-1] + ',"streams":')  # the last key, as read: whole
        streams.seek(0)
        shutil.copyfileobj(streams, sys.stdout)
        sys.stdout.write("}\n")
    return EXIT_OK


def _json(snap: Snapshot, rate: Rates | None) -> dict[str, Any]:
    """The ``watch --json`` object (see docs/cli.md) but its last key, ``streams``."""
    return {
        "spool": snap.spool,
        "at": iso(snap.at),
        "rows": snap.rows,
        "sessions": snap.sessions,
        "bytes": snap.bytes,
        "oldest": iso(snap.oldest),
        "oldest_age": None if snap.oldest is None else max(snap.at - snap.oldest, 0.0),
        "inflight": snap.inflight,
        "failing": snap.failing,
        "quarantined": snap.quarantined,
        "superseded": snap.superseded,
        "db_bytes": snap.db_bytes,
        "wal_bytes": snap.wal_bytes,
        "appended": snap.appended,
        "seconds": None if rate is None else rate.seconds,
        "append_rate": None if rate is None else rate.appended,
        "replay_rate": None if rate is None else rate.replayed,
        "drain_eta": drain_eta(snap, rate),
        "open_by": None if snap.open_by is None else [msgspec.to_builtins(h) for h in snap.open_by],
        "memory": in_memory.as_json(list(snap.memory), snap.at),
    }


def _live(args: argparse.Namespace, screen: Screen) -> None:
    title = f"walspool watch  every {args.interval:g}s  q or Ctrl-C quits"
    base: Snapshot | None = None  # the last reading that succeeded
    width, height = screen.size()
    # A big spool takes seconds to read: say so at once.
    screen.draw(render_reading(title, str(args.spool), width, height), height)
    while True:
        snap = try_snapshot(args.spool, stop=screen.quit_typed)
        if screen.quitting:
            return
        rate = rates(base, snap)
        if snap.error is None:
            base = snap
        # A slow reading is followed by a pause as long: at most half the time reading.
        deadline = snap.taken + max(args.interval, 2 * snap.took)
        event = RESIZE
        while event == RESIZE:  # a resized terminal is redrawn at once, not read again
            width, height = screen.size()
            screen.draw(render(snap, rate, title, width, height, colour=screen.colour), height)
            event = screen.wait(deadline)
        if event == QUIT:
            return


class Screen:
    """The terminal while watching: keys read as typed (cbreak: no echo, no Enter
    needed; Ctrl-C stays a signal), the alternate screen, the cursor hidden, a
    resize noticed at once. Leaving puts every one of these back."""

    def __init__(self, keys: TextIO, out: TextIO) -> None:
        self.out = out
        self.keys = keys.fileno() if _isatty(keys) else None
        self.saved: list[object] | None = None
        self.previous_winch: object = None
        self.wake = (-1, -1)  # a pipe the SIGWINCH handler writes to, wakes ``wait``
        #: q was typed (or the terminal went away) during a reading.
        self.quitting = False
        #: Colour, on this terminal, unless the user said NO_COLOR (https://no-color.org).
        self.colour = not os.environ.get("NO_COLOR")

    def __enter__(self) -> Screen:
        with _signals_held():
            self.wake = os.pipe()
            for fd in self.wake:
                os.set_blocking(fd, False)
            self.previous_winch = signal.signal(signal.SIGWINCH, self._resized)
            if self.keys is not None:
                self.saved = termios.tcgetattr(self.keys)
                tty.setcbreak(self.keys, termios.TCSANOW)
            self.out.write(ENTER)
            self.out.flush()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A signal now would leave the terminal half restored: it waits until the end.
        with _signals_held():
            try:
                self.out.write(LEAVE)
                self.out.flush()
            finally:
                if self.saved is not None:
                    termios.tcsetattr(self.keys, termios.TCSADRAIN, self.saved)
                signal.signal(signal.SIGWINCH, self.previous_winch)  # type: ignore[arg-type]
                for fd in self.wake:
                    os.close(fd)

    def size(self) -> tuple[int, int]:
        """Columns and lines of the terminal (80 by 24 when it cannot say)."""
        try:
            return tuple(os.get_terminal_size(self.out.fileno()))  # type: ignore[return-value]
        except (OSError, ValueError):
            return 80, 24

    def draw(self, lines: list[str], height: int) -> None:
        """``lines`` (at most ``height``) over the screen from its top, each line cleared
        first, the screen below them cleared; no line feeds, so nothing scrolls."""
        parts = [f"\x1b[{row};1H\x1b[2K{line}" for row, line in enumerate(lines, 1)]
        if len(lines) < height:
            parts.append(f"\x1b[{len(lines) + 1};1H\x1b[J")
        self.out.write("".join(parts))
        self.out.flush()

    def wait(self, deadline: float) -> str:
        """Until ``deadline`` (``time.monotonic()``): ``QUIT`` on q (or the terminal
        gone), ``RESIZE`` when the terminal was resized, else ``TIMEOUT``."""
        readers = [self.wake[0]] + ([self.keys] if self.keys is not None else [])
        while True:  # looks at the keys at least once, however late the reading was
            left = max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select(readers, [], [], left)
            if self.wake[0] in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake[0], 512)
                return RESIZE
            if self.keys is not None and self.keys in ready:
                if self._quit(os.read(self.keys, 512)):
                    return QUIT
            if time.monotonic() >= deadline:
                return TIMEOUT

    def quit_typed(self) -> bool:
        """Whether q was typed: a look at the keys that does not wait (during a reading)."""
        if self.keys is not None and not self.quitting:
            if select.select([self.keys], [], [], 0)[0]:
                self.quitting = self._quit(os.read(self.keys, 512))
        return self.quitting

    def _quit(self, typed: bytes) -> bool:
        return not typed or any(k in typed for k in QUIT_KEYS)

    def _resized(self, signum: int, frame: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake[1], b"w")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
