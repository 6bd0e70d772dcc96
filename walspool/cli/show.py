"""``walspool show``: one session's rows in drop order."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import msgspec

from ..errors import WalspoolError
from ..store import codec
from ..store.reader import BadPayload, iter_records
from ..store.records import QUARANTINED, SUPERSEDED, Record
from ..text import json_safe, printable
from . import _memory as in_memory
from ._filters import add_narrowing_arguments, has_stream, narrowed, stream_rows, which_stream
from ._output import (
    cli_terms,
    clip,
    dump,
    iso,
    plural,
    shell_word,
    stream_name,
    table,
)
from ._reading import near_sessions, reading, record_line, report_bad

#: The mark after ``attempts`` in ``show`` for a row of each status.
STATUS_MARKS = {QUARANTINED: "Q", SUPERSEDED: "S"}


def run(args: argparse.Namespace) -> int:
    """Show one session's rows in drop order, with attempts and last error.

    SESSION is a session id; with --key, or when no row has that session id, the
    session key of rows spooled without one (`key:<KEY>` as ls prints it names that
    key too). The two are different streams and never shown together. The header names
    the stream as ls does, a shell word that pasted back into show names the same rows.
    ID is what requeue and drop take (--id). The message column previews each payload;
    --full prints the payloads whole.
    """
    bad: list[str] = []
    with reading(args.spool) as reader:
        name, kind = which_stream(reader, args.session, key=args.key)
        # Streamed: one page of rows in memory at a time, whatever their size.
        copied = args.json and args.full  # payloads go out as stored, never decoded
        rows = iter_records(reader, name, bad=bad, kinds=(kind,), raw=copied)
        first = next(rows, None)
        if first is not None:
            rows = narrowed(itertools.chain([first], rows), args)
            first = next(rows, None)
            if first is None:
                raise WalspoolError(f"no rows of session {args.session!r} match the filters")
        if first is None:
            what = "session key" if args.key else "session"
            near = near_sessions(reader, args.session)
            held = "" if args.key else in_memory.held_of(reader, args.session)
            raise WalspoolError(f"no rows for {what} {args.session!r} in {args.spool}{held}{near}")
        rows = itertools.chain([first], rows)
        # The stream as ls names it, a shell word: pasted into show, it names these rows.
        shown = stream_name(name, None) if kind == "id" else stream_name(None, name)
        if args.json:
            _show_json(rows, args.full)
        elif args.full:
            _show_full(args, shown, rows)
        else:
            _show_table(args, shown, rows, stream_rows(reader, name, kind))
        if kind == "id" and not args.json and has_stream(reader, args.session, "key"):
            print(
                f"rows spooled with session key {shell_word(args.session)} and no session id "
                "are another stream: show it with --key"
            )
    return report_bad("show", bad)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", metavar="SESSION", help="session id (or key)")
    p.add_argument("--full", action="store_true", help="print each row's payload")
    add_narrowing_arguments(p)
    p.add_argument(
        "--key",
        action="store_true",
        help="SESSION is the session key of rows spooled without a session id",
    )


def _show_json(rows: Iterator[tuple[Record, int | None]], full: bool) -> None:
    out = sys.stdout
    out.write("[")
    for n, (r, inflight) in enumerate(rows):
        out.write(("," if n else "") + record_line(r, inflight, message=full))
    out.write("]\n")


def _show_full(
    args: argparse.Namespace, shown: str, rows: Iterator[tuple[Record, int | None]]
) -> None:
    print(f"session {shown} in {printable(args.spool)}")
    for r, inflight in rows:
        print(
            f"\nseq {r.seq}  id {r.id}  {printable(r.reason)}  {iso(r.created_at)}  "
            f"attempts {r.attempts}{'  in flight' if inflight is not None else ''}"
            f"{'  ' + r.status if r.status else ''}"
        )
        if r.last_error is not None:
            print(f"last error ({iso(r.last_attempt_at)}): {printable(cli_terms(r.last_error))}")
        print(pretty(r.message))


def _show_table(
    args: argparse.Namespace, shown: str, rows: Iterator[tuple[Record, int | None]], total: int
) -> None:
    lines, marks = [], set()
    for r, inflight in rows:  # only the short preview of each row is kept
        lines.append(_show_line(r, inflight))
        marks.add("*" if inflight is not None else r.status)
    # Rows appended meanwhile can make the stream longer than when it was counted.
    count = plural(len(lines), "row")
    if len(lines) < total:
        count = f"{len(lines):,} of {plural(total, 'row')}"
    print(f"session {shown}: {count} in {printable(args.spool)}")
    headers = ("SEQ", "ID", "REASON", "CREATED", "ATTEMPTS", "LAST ERROR", "MESSAGE")
    print(table(headers, lines))
    if "*" in marks:
        print("* in flight: out with a replay, or left to be checked against state.db first")
    if QUARANTINED in marks:
        print("Q quarantined: kept, not replayed; replay --quarantined once the cause is fixed")
    if SUPERSEDED in marks:
        print("S superseded by a transcript rewrite: kept, not replayed unless --superseded")


def _show_line(r: Record, inflight: int | None) -> tuple[Any, ...]:
    mark = "*" if inflight is not None else STATUS_MARKS.get(r.status or "", "")
    attempts = f"{r.attempts}{mark}"
    # As text: ids and seqs print as the commands take them back, without separators.
    return (
        str(r.seq),
        str(r.id),
        r.reason,
        iso(r.created_at),
        attempts,
        clip(cli_terms(r.last_error), 60),
        preview(r.message),
    )


def preview(message: Any, width: int = 60) -> str:
    """A one-line glimpse of a message: its role and the start of its text."""
    if isinstance(message, BadPayload):
        text = f"[{message.label}] {message.raw}"
    elif isinstance(message, dict):
        text = message.get("content", message.get("text"))
        if not isinstance(text, str):
            text = _json(message) if text is None else _json(text)
        role = message.get("role")
        text = f"{role}: {text}" if isinstance(role, str) else text
    elif isinstance(message, str):
        text = message
    else:
        text = _json(message)
    return clip(text, width) or ""  # a prefix of it: never the whole message split


def pretty(value: Any) -> str:
    """Indented JSON text of a value (``show --full``), controls JSON leaves raw
    (DEL, C1, bidi) escaped too; a row walspool cannot read, flagged, as stored."""
    if isinstance(value, BadPayload):
        return f"[{value.label}: {printable(value.error)}]\n{printable(value.raw)}"
    return json_safe(msgspec.json.format(dump(value), indent=2))


def _json(value: Any) -> str:
    return codec.encode(value).decode("utf-8")
