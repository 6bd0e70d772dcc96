"""The frame ``walspool watch`` draws: a reading (and the rates) in, lines out, fitted
to a terminal. Pure: no reading, no I/O. Not public API."""

from __future__ import annotations

import textwrap
import unicodedata
from typing import Any

from ..text import printable
from . import _memory as in_memory
from ._holders import holders_text
from ._output import (
    RED,
    YELLOW,
    cli_terms,
    clip,
    duration,
    iso,
    paint,
    plural,
    size,
    stream_name,
    table,
)
from ._watching import Rates, Snapshot, Stream


def render(
    snap: Snapshot,
    rate: Rates | None,
    title: str,
    width: int | None = None,
    height: int | None = None,
    colour: bool = False,
) -> list[str]:
    """The frame: ``title`` and the time, the spool, who has it open, the totals, the
    rates and the drain's ETA, then one line per stream, oldest first; at most
    ``height`` lines of at most ``width`` columns (None: no bound), streams that do not
    fit counted in a last ``+N more`` line. With ``colour`` (a terminal), what needs a
    look is red (no reading, rows but no process to drain them) or yellow (rows with
    an error, quarantined)."""
    head = [f"{title}  {iso(snap.at)}", f"spool        {printable(snap.spool)}"]
    if snap.error is not None:
        head += textwrap.wrap(printable(snap.error), width or 1_000_000) or [""]
        head.append("(read again at each refresh)")
        lines = _fitted(head, width, height)
        return [paint(line, RED, colour) if i == 2 else line for i, line in enumerate(lines)]
    age = duration(max(snap.at - snap.oldest, 0.0)) if snap.oldest is not None else "-"
    # Rows set aside (quarantined, superseded) never drain by themselves: not waiting.
    waiting = snap.rows - snap.quarantined - snap.superseded
    idle = snap.open_by is not None and not snap.open_by and waiting > 0
    eta = drain_eta(snap, rate)
    memory_json = in_memory.as_json(list(snap.memory), snap.at)
    lost = any(e.alive is False for e in snap.memory)
    held = sum(e.held.messages for e in snap.memory if e.alive is not False)
    head += [
        paint(f"open by      {holders_text(snap.open_by, waiting)}", RED, colour and idle),
        f"rows         {snap.rows:,} in {plural(snap.sessions, 'session')}, "
        f"{size(snap.bytes)}; oldest row {age} old",
        paint(
            f"in flight    {snap.inflight:,}; failing {snap.failing:,} (with a last error); "
            f"quarantined {snap.quarantined:,}; superseded {snap.superseded:,}",
            YELLOW,
            colour and bool(snap.failing or snap.quarantined),
        ),
        "rates        "
        + (
            "appended -, replayed or dropped - (from the next reading)"
            if rate is None
            else rates_text(rate, f"over the last {rate.seconds:.1f}s")
        ),
        "drain ETA    " + ("-" if rate is None else eta_text(eta, snap.rows, held)),
        f"files        db {size(snap.db_bytes)}, WAL {size(snap.wal_bytes)}; "
        f"read in {snap.took:.2f}s",
        # What gateway processes hold in memory, once one published any.
        *(
            paint(f"{'in memory' if i == 0 else '':<13}{line}", RED, colour and lost)
            for i, line in enumerate(in_memory.lines(memory_json) if memory_json else ())
        ),
        "",
    ]
    if not snap.streams:
        return _fitted([*head, "no rows in the spool"], width, height)
    shown = list(snap.streams)
    if height is not None:
        room = height - len(head) - 1  # the table's header line
        if room < len(shown) or snap.sessions > len(shown):
            shown = shown[: max(room - 1, 0)]  # one line for "+N more"
    headers = ("ROWS", "BYTES", "OLDEST", "IN FLIGHT", "FAILING", "LAST ERROR", "SESSION")
    rows = table(headers, [_stream_line(s, snap.at) for s in shown]).split("\n")
    lines = _fitted([*head, *rows], width, None)
    for i, s in enumerate(shown, len(head) + 1):
        lines[i] = paint(lines[i], YELLOW, colour and s.failing > 0)
    if snap.sessions > len(shown):
        lines.append(_fitted([f"+{snap.sessions - len(shown):,} more sessions"], width, None)[0])
    return lines if height is None else lines[: max(height, 0)]


def drain_eta(snap: Snapshot, rate: Rates | None) -> float | None:
    """Seconds until the spool is empty if rows keep leaving and arriving at the
    current rates; None when it is not draining (or there are no rates yet)."""
    if rate is None or snap.rows == 0:
        return 0.0 if rate is not None else None
    net = rate.replayed - rate.appended
    return snap.rows / net if net > 0 else None


def eta_text(eta: float | None, rows: int, held: int) -> str:
    """The drain's ETA (``drain_eta``) of a spool of ``rows`` rows, as ``watch`` and
    ``stats --sample`` say it; ``held``: messages live gateways hold in memory, not
    spooled (an empty spool is drained, but they are not)."""
    if rows == 0:
        if held:
            return f"drained; {held:,} messages still in a gateway's memory, not spooled"
        return "drained"
    if eta is None:
        return "not draining (no more rows leave than arrive)"
    return f"{duration(eta)} at the current rates"


def render_reading(title: str, spool: str, width: int, height: int) -> list[str]:
    """The frame before the first reading is done."""
    lines = [title, f"spool        {printable(spool)}", "reading it..."]
    return _fitted(lines, width, height)


def rates_text(rate: Rates, over: str) -> str:
    """The rates rows arrived and left at, over ``over``, as ``watch`` and ``stats
    --sample`` say them."""
    return (
        f"appended {rate.appended:,.1f} rows/s, replayed or dropped {rate.replayed:,.1f} "
        f"rows/s ({over})"
    )


def _stream_line(s: Stream, now: float) -> tuple[Any, ...]:
    age = duration(max(now - s.oldest, 0.0))
    name = stream_name(s.session_id, s.session_key)
    error = clip(cli_terms(s.last_error), 40)
    return (s.rows, size(s.bytes), age, s.inflight, s.failing, error, name)


def _fitted(lines: list[str], width: int | None, height: int | None) -> list[str]:
    lines = lines if height is None else lines[: max(height, 0)]
    return lines if width is None else [fit(line, width) for line in lines]


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal columns (a wide character takes two, a
    combining one none), ``…`` marking a cut."""
    if sum(map(_columns, text)) <= width:
        return text
    out, used = [], 0
    for ch in text:
        used += _columns(ch)
        if used > width - 1:
            break
        out.append(ch)
    return "".join(out) + "…" if width > 0 else ""


def _columns(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
