"""Text from users on its way to a terminal or a log line: escaped, never obeyed.

Message text, session ids, reasons and file names come from chat users and other
people's files. Printed raw, an escape sequence (``ESC[2K``, a C1 ``CSI``) would
rewrite the operator's screen, a newline would forge a row of a table or a whole log
line, and a bidirectional override would reorder what is shown. ``printable``
spells each such character as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``) and
doubles a backslash, so what it shows reads back one way only; the
``--json`` outputs are JSON, lossless, with the same characters as ``\\uXXXX`` escapes
(``json_safe``), since a JSON line reaches a terminal or a log too.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

#: Every character that is not text to look at: the controls (C0, DEL, C1: category
#: Cc), the format characters (Cf: bidirectional marks, embeddings, overrides and
#: isolates, U+061C, zero-width characters, the BOM, the tag characters), the line and
#: paragraph separators (Zl, Zp) and the surrogates (Cs, which no terminal can show).
#: Unicode 15.1's set; a test checks it covers the running Python's ``unicodedata``.
UNSAFE_RANGES = (
    (0x0000, 0x001F), (0x007F, 0x009F), (0x00AD, 0x00AD), (0x0600, 0x0605),
    (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891),
    (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x2028, 0x202E),
    (0x2060, 0x2064), (0x2066, 0x206F), (0xD800, 0xDFFF), (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)  # fmt: skip
_UNSAFE = [c for first, last in UNSAFE_RANGES for c in range(first, last + 1)]


def _python_escape(c: int) -> str:
    if c < 0x100:
        return f"\\x{c:02x}"
    return f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def _json_escape(c: int) -> str:
    if c < 0x10000:
        return f"\\u{c:04x}"
    high, low = divmod(c - 0x10000, 0x400)  # JSON spells it as its UTF-16 pair
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"


_ESCAPES = {c: _python_escape(c) for c in _UNSAFE}
#: A backslash is doubled: then the escape of a character and the same characters typed
#: as text (ESC, and the four characters ``\\x1b``) never print alike.
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", ord("\\"): "\\\\"})
_ANSI_C_ESCAPES = {
    **{c: _json_escape(c) if c < 0x10000 else _python_escape(c) for c in _UNSAFE},
    # a byte that was not UTF-8, kept as a lone surrogate (surrogateescape): bash's
    # \xHH gives that byte back
    **{c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)},
    **{c: e for c, e in _ESCAPES.items() if c < 0x80},
    ord("\\"): "\\\\",
    ord("'"): "\\'",
}
#: In JSON text: the same characters as ``\\uXXXX`` escapes (C0 never appears raw in
#: valid JSON, and a JSON encoder has already escaped it).
_JSON_ESCAPES = {c: _json_escape(c) for c in _UNSAFE if c >= 0x20}


class Shown(str):
    """Text already made safe to show (a shell word ``ls`` prints to be pasted back):
    ``printable`` gives it back as it is, since escaping it again would double its
    backslashes and change what pasting it gives."""


def printable(text: Any) -> Shown:
    """``str(text)`` with every control, format, separator or surrogate character
    (``UNSAFE_RANGES``) spelled as a Python escape (``\\x1b``, ``\\u202e``), and each
    backslash doubled (``\\\\``): no two texts print alike. The result is ``Shown``,
    so escaping it again gives it back as it is."""
    if isinstance(text, Shown):
        return text
    return Shown(str(text).translate(_ESCAPES))


def ansi_c(text: str) -> str:
    """``text`` for bash's ``$'...'`` quotes, giving ``text`` back: backslash and quote
    escaped, and each ``UNSAFE_RANGES`` character escaped as ``printable`` does, but
    ``\\uHHHH`` from U+0080 on (bash reads ``\\xHH`` as a byte, not a character), and
    a byte that was not UTF-8 (a lone surrogate U+DC80-U+DCFF) as that byte, ``\\xHH``,
    which Python reads back from the command line as the same surrogate."""
    return text.translate(_ANSI_C_ESCAPES)


def json_safe(json_text: str) -> str:
    """Valid JSON text with each ``UNSAFE_RANGES`` character it holds raw (only strings
    can hold them) spelled as a ``\\uXXXX`` escape: the same JSON value, lossless, that
    a terminal or a log shows as it is. What ``json.dumps(ensure_ascii=True)`` does for
    these characters, leaving other non-ASCII text readable."""
    return json_text.translate(_JSON_ESCAPES)


def _escaped(arg: Any) -> Any:
    """A log argument as text with its controls escaped; numbers stay numbers (for %d)."""
    if arg is None or isinstance(arg, (int, float)):
        return arg
    return printable(arg)


def escaped_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as ``logging`` prints it, chained exceptions included, with
    each exception's message (and notes) escaped: a message may quote a session id or
    a file's content, and a newline in it would forge a log line. The frames' lines
    are the program's own source and stay as they are."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    link = ""
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    parts: list[str] = []
    for error, then in reversed(chain):
        if error.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(traceback.format_tb(error.__traceback__))
        kind = type(error)
        name = kind.__qualname__
        if kind.__module__ not in ("builtins", "__main__"):
            name = f"{kind.__module__}.{name}"
        message = printable(error)
        parts.append(f"{name}: {message}\n" if message else f"{name}\n")
        for note in getattr(error, "__notes__", None) or ():
            parts.append(f"{printable(note)}\n")
        if then:
            parts.append(then)
    return "".join(parts).rstrip("\n")


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


class _EscapeArguments(logging.Filter):
    """Escapes the arguments of a record (text, paths, exceptions: anything but a
    number) and the messages in its traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_escaped(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            # Formatters print exc_text, when set, instead of formatting exc_info.
            record.exc_text = escaped_traceback(record.exc_info[1])
        return True


_filter = _EscapeArguments()


def logger(name: str) -> logging.Logger:
    """The module logger ``name``, escaping text arguments (paths, session ids,
    messages) so that none of them can forge a log line."""
    log = logging.getLogger(name)
    if _filter not in log.filters:
        log.addFilter(_filter)
    return log
