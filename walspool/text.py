"""Text from users on its way to a terminal or a log line: escaped, never obeyed.

Message text, session ids, reasons and file names come from chat users and other
people's files. Printed raw, an escape sequence (``ESC[2K``, a C1 ``CSI``) would
rewrite the operator's screen, a newline would forge a row of a table or a whole log
line, and a bidirectional override would reorder what is shown. ``printable``
spells each such character as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``); the
``--json`` outputs are JSON, lossless, with the same characters as ``\\uXXXX`` escapes
(``json_safe``), since a JSON line reaches a terminal or a log too.
"""

from __future__ import annotations

import logging
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
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
_ANSI_C_ESCAPES = {
    **{c: _json_escape(c) if c < 0x10000 else _python_escape(c) for c in _UNSAFE},
    **{c: e for c, e in _ESCAPES.items() if c < 0x80},
    ord("\\"): "\\\\",
    ord("'"): "\\'",
}
#: In JSON text: the same characters as ``\\uXXXX`` escapes (C0 never appears raw in
#: valid JSON, and a JSON encoder has already escaped it).
_JSON_ESCAPES = {c: _json_escape(c) for c in _UNSAFE if c >= 0x20}


def printable(text: Any) -> str:
    """``str(text)`` with every control, format, separator or surrogate character
    (``UNSAFE_RANGES``) spelled as a Python escape (``\\x1b``, ``\\u202e``)."""
    return str(text).translate(_ESCAPES)


def ansi_c(text: str) -> str:
    """``text`` for bash's ``$'...'`` quotes, giving ``text`` back: backslash and quote
    escaped, and each ``UNSAFE_RANGES`` character escaped as ``printable`` does, but
    ``\\uHHHH`` from U+0080 on (bash reads ``\\xHH`` as a byte, not a character)."""
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


class _EscapeArguments(logging.Filter):
    """Escapes the arguments of a record (text, paths, exceptions: anything but a
    number) before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_escaped(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        return True


_filter = _EscapeArguments()


def logger(name: str) -> logging.Logger:
    """The module logger ``name``, escaping text arguments (paths, session ids,
    messages) so that none of them can forge a log line."""
    log = logging.getLogger(name)
    if _filter not in log.filters:
        log.addFilter(_filter)
    return log
