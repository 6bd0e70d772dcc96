"""Text from users on its way to a terminal or a log line: escaped, never obeyed.

Message text, session ids, reasons and file names come from chat users and other
people's files. Printed raw, an escape sequence (``ESC[2K``, a C1 ``CSI``) would
rewrite the operator's screen, a newline would forge a row of a table or a whole log
line, and a bidirectional override would reorder what is shown. ``printable``
spells each such character as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``); the
``--json`` outputs are JSON, which is already unambiguous.
"""

from __future__ import annotations

import logging
from typing import Any

#: C0 controls, DEL, C1 controls and the bidirectional embedding, override and
#: isolate characters.
_UNSAFE = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F),
           *range(0x2066, 0x206A)]  # fmt: skip
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def printable(text: Any) -> str:
    """``str(text)`` with every control or bidi character spelled as an escape."""
    return str(text).translate(_ESCAPES)


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
