"""What every command prints with: exit codes, the stderr line, tables, times, sizes,
JSON and the progress bar. Not public API.

Text from users (session ids, reasons, errors, file names) goes through ``printable``
before it reaches the terminal; ``--json`` output is JSON and so already unambiguous.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import msgspec

from ..errors import WalspoolError
from ..text import Shown, ansi_c, json_safe, printable

EXIT_OK = 0
#: An error: one line on stderr.
EXIT_ERROR = 1
#: Bad usage: an argument that cannot be right.
EXIT_USAGE = 2
#: The command ran but left something behind (rows held, files left in place).
EXIT_HELD = 3
#: Another replay of the spool holds its lock (and --wait did not outlast it).
EXIT_BUSY = 4
#: The replay ran, held nothing, but quarantined rows (kept, never replayed unasked).
EXIT_QUARANTINED = 5


class ReplayRunning(WalspoolError):
    """Another replay of the spool holds its replay lock (exit status 4): reported as
    any error, a line on stderr and, with --json, the error object."""


#: Redraw the progress bar at most this often, in seconds.
PROGRESS_INTERVAL = 0.1


def warn(command: str, message: str) -> None:
    """One line on stderr, prefixed ``walspool COMMAND:``, its text escaped."""
    print(f"walspool {command}: {printable(message)}", file=sys.stderr)


class _Prefixed(logging.Handler):
    """Log records as ``warn`` lines: one line each, prefixed, escaped."""

    def __init__(self, command: str) -> None:
        super().__init__(logging.ERROR)
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            warn(self.command, text)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def log_lines(command: str) -> Iterator[None]:
    """While a command runs, every log line of ERROR and above (walspool's, hermes')
    reaches stderr as a ``walspool COMMAND:`` line. Lower ones are not shown: the
    warnings a command can meet (a row held, a file left in place) are in its report."""
    handler = _Prefixed(command)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO 8601 UTC with milliseconds, as the views print them."""
    if ts is None:
        return None
    moment = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def size(n: int) -> str:
    """Bytes for people: 512 B, 4.0 KiB, 1.2 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


#: The widest cell a text table prints, in characters once escaped: a wider one (a
#: session id of 4 MiB) is clipped to this, its last character "…". ``--json`` has it
#: whole.
CELL_WIDTH = 120


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None prints as "-"; cells clipped to
    ``CELL_WIDTH``."""
    return "\n".join(table_lines(headers, rows))


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Iterator[str]:
    """``table`` a line at a time: each column as wide as its widest clipped cell."""
    return table_pages(headers, [rows])


def table_pages(headers: Sequence[str], pages: Iterable[Sequence[Sequence[Any]]]) -> Iterator[str]:
    """``table_lines`` a page of rows at a time, the headers once above the first: each
    column as wide as its widest clipped cell so far, so a wider cell on a later page
    widens its column from that page on. What is held is one page's cells."""
    widths = [len(str(h)) for h in headers]
    above: list[list[str]] = [[str(h) for h in headers]]
    for rows in pages:
        cells = above + [[_cell(c) for c in row] for row in rows]
        above = []
        widths = [max([w, *(len(r[i]) for r in cells)]) for i, w in enumerate(widths)]
        for r in cells:
            yield "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    text = str(value)
    # never the whole of a huge value escaped; text made printable is shown already
    shown = text if isinstance(value, Shown) else printable(text[: CELL_WIDTH + 1])
    if len(text) > CELL_WIDTH or len(shown) > CELL_WIDTH:
        return shown[: CELL_WIDTH - 1] + "…"
    return shown


def plural(n: int, word: str) -> str:
    """``1 row``, ``2 rows``, with thousands separators."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def clip(text: str | None, width: int = 80) -> Shown | None:
    """One line of at most ``width`` characters, made ``printable``."""
    if text is None:
        return None
    # A prefix only: whitespace runs shrink, escapes grow, and the rest is never shown.
    joined = " ".join(text[: 8 * width + 64].split())
    shown = Shown(joined) if isinstance(text, Shown) else printable(joined)
    return shown if len(shown) <= width else Shown(shown[: width - 1] + "…")


#: The library's words in stored errors, and the command line's for the same thing.
_CLI_TERMS = (("replay with create_missing=True", "replay with --create-missing"),)


def cli_terms(text: str | None) -> str | None:
    """An error text (a row's last error, a replay's reason) in the command line's
    words: a keyword argument of the API named as the flag that sets it."""
    if text is None:
        return None
    for api, flag in _CLI_TERMS:
        text = text.replace(api, flag)
    return text


def dump(value: Any) -> str:
    """Compact JSON text of a value (the ``--json`` outputs), lossless, with control,
    format and separator characters as ``\\uXXXX`` escapes (``json_safe``). Text the
    spool held as bytes that are not UTF-8 (``store.paging.as_text``) has each bad byte
    as its lone surrogate's escape (``\\udcff``)."""
    try:
        return json_safe(msgspec.json.encode(value).decode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates: JSON spells them, UTF-8 cannot
        builtins = msgspec.to_builtins(value)
        return json_safe(json.dumps(builtins, ensure_ascii=False, separators=(",", ":")))


class Progress:
    """A one-line progress report redrawn with ``\\r``:
    ``label: done/total (pct%), rate unit/s, ETA 1m05s``.

    Drawn when ``enabled`` (by default, when ``stream`` is a terminal), at most every
    ``PROGRESS_INTERVAL`` seconds; the rate is the average since the report was made,
    so the ETA assumes the rest goes as fast. ``close`` draws the final count and the
    time taken, and ends the line; ``drop`` only ends a line already drawn (a command
    that never started its work has no count to give).
    """

    def __init__(
        self, label: str, stream: TextIO, enabled: bool | None = None, unit: str = "rows"
    ) -> None:
        self.label = label
        self.stream = stream
        self.unit = unit
        self.enabled = _isatty(stream) if enabled is None else enabled
        self.drawn = 0
        self.started = time.monotonic()
        self.last = float("-inf")  # the first count is drawn at once
        self.state = (0, 0)

    @property
    def done(self) -> int:
        """The latest count reported."""
        return self.state[0]

    def __call__(self, done: int, total: int) -> None:
        self.state = (done, total)
        now = time.monotonic()
        if self.enabled and now - self.last >= PROGRESS_INTERVAL:
            self.last = now
            self._draw(final=False)

    def _draw(self, final: bool, echoed: int = 0) -> None:
        done, total = self.state
        elapsed = time.monotonic() - self.started
        text = (
            f"{self.label}: {done:,}/{total:,} ({100 * done // total}%)"
            if total
            else f"{self.label}: {done:,} {self.unit}"
        )
        rate = done / elapsed if elapsed > 0 else 0.0
        if done:
            text += f", {rate:,.0f} {self.unit}/s"
        if final:
            text += f", took {duration(elapsed)}"
        elif rate and total > done:
            text += f", ETA {duration((total - done) / rate)}"
        self.drawn = redraw(self.stream, text, self.drawn + echoed)

    def close(self, *, interrupted: bool = False) -> None:
        """Draw the final count and time taken; after a Ctrl-C (``interrupted``) over
        the ``^C`` the terminal echoed at the end of the line too."""
        if self.enabled:
            self._draw(final=True, echoed=2 if interrupted else 0)
            self.stream.write("\n")
            self.stream.flush()

    def drop(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def redraw(stream: TextIO, text: str, drawn: int) -> int:
    """Draw ``text`` over the line's last ``drawn`` characters (with ``\\r``); its
    length. Spaces cover what a longer previous line left (and what the terminal echoed
    after it): no terminal codes, as stderr may be a file when --progress is forced."""
    stream.write(f"\r{text}{' ' * max(drawn - len(text), 0)}")
    stream.flush()
    return len(text)


class Steps:
    """A one-line report of a task done in named steps of unknown length (``check``'s
    phases, ``vacuum``'s copy): ``label: step 3/8, what, 5s``, redrawn at each step
    and, while a step runs, at most every ``PROGRESS_INTERVAL`` seconds (``tick``).
    Drawn when ``enabled`` (by default, when ``stream`` is a terminal); ``close`` draws
    the steps done and the time taken, and ends the line."""

    def __init__(self, label: str, stream: TextIO, enabled: bool | None = None) -> None:
        self.label = label
        self.stream = stream
        self.enabled = _isatty(stream) if enabled is None else enabled
        self.started = self.last = time.monotonic()
        self.drawn = 0
        self.state: tuple[int, int, str] = (0, 0, "")

    def __call__(self, what: str, done: int, total: int) -> None:
        """Step ``done`` of ``total`` (counted from 1), ``what``, begins."""
        self.state = (done, total, what)
        self._draw()

    def tick(self) -> None:
        """The step under way goes on: the time shown is redrawn, at most so often."""
        if time.monotonic() - self.last >= PROGRESS_INTERVAL:
            self._draw()

    @property
    def ticker(self) -> Callable[[], None] | None:
        """``tick`` for a long statement to call (``store.connections.ticking``), or None
        when nothing is drawn (then SQLite calls nothing)."""
        return self.tick if self.enabled else None

    def _draw(self) -> None:
        if not self.enabled:
            return
        self.last = now = time.monotonic()
        done, total, what = self.state
        steps = f"step {done}/{total}, " if total > 1 else ""
        self.drawn = redraw(
            self.stream,
            f"{self.label}: {steps}{what}, {duration(now - self.started)}",
            self.drawn,
        )

    def close(self) -> None:
        if self.enabled:
            done, total, what = self.state
            steps = f"{done} steps, " if total > 1 else f"{what}, " if what else ""
            took = duration(time.monotonic() - self.started)
            self.drawn = redraw(self.stream, f"{self.label}: {steps}took {took}", self.drawn)
            self.stream.write("\n")
            self.stream.flush()


#: SGR colours, drawn only on a terminal: red for rows nobody drains and for what a
#: gateway lost, yellow for errors and rows set aside.
RED, YELLOW = "31", "33"


def paint(line: str, sgr: str, on: bool) -> str:
    """``line`` in colour ``sgr`` when ``on``."""
    return f"\x1b[{sgr}m{line}\x1b[0m" if on else line


def duration(seconds: float) -> str:
    """Seconds for people: ``4s``, ``1m05s``, ``2h03m``, ``3d04h``: every command's
    ages and ETAs. (``--since`` takes ``30s``, ``10m``, ``2h``, ``1d`` back.)"""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    """``--progress/--no-progress``; None (the default) means: when stderr is a terminal."""
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw progress with rate and ETA on stderr (default: when it is a terminal)",
    )


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def as_path(text: str) -> Path:
    """A path argument, ``~`` expanded."""
    return Path(os.path.expanduser(text))


#: Characters a shell reads as themselves in a word: such a name prints as it is.
_PLAIN = re.compile(r"[\w@%+=:,./-]+", re.ASCII)


def shell_word(text: str) -> Shown:
    """``text`` as one shell word that gives ``text`` back when pasted into a command
    line: as it is when plain, else in single quotes, or, when it holds a control or
    bidi character, in bash's ``$'...'`` quotes with those characters escaped (so the
    terminal shows it safely, as ``printable`` does)."""
    if _PLAIN.fullmatch(text):
        return Shown(text)
    if printable(text) == text:
        return Shown(shlex.quote(text))
    return Shown("$'" + ansi_c(text) + "'")


def stream_name(session_id: str | None, session_key: str | None) -> Shown:
    """A stream as ``ls`` names it, ready to paste into ``show``: its session id, or
    ``key:<KEY>`` for rows spooled by session key only; quoted by ``shell_word``."""
    return shell_word(session_id if session_id is not None else f"key:{session_key}")
