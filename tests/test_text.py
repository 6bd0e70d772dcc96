"""Every byte that reaches a terminal, a log line or JSON output is escaped for that sink
(issue 29): C0, DEL, C1, bidirectional controls, line and paragraph separators and the
other format characters, in the text views, the log lines and every --json output."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT

import walspool
from walspool import text
from walspool.cli import main
from walspool.cli._output import dump

#: One character of each class, by name.
CLASSES = {
    "C0 ESC": "\x1b",
    "DEL": "\x7f",
    "C1 NEL": "\x85",
    "C1 CSI": "\x9b",
    "bidi override RLO": "\u202e",
    "bidi isolate RLI": "\u2067",
    "bidi mark LRM": "\u200e",
    "Arabic letter mark": "\u061c",
    "line separator": "\u2028",
    "paragraph separator": "\u2029",
    "zero width space": "\u200b",
    "BOM": "\ufeff",
    "tag letter": "\U000e0041",
}
EVIL = "".join(CLASSES.values())


def raw_in(out: str) -> list[str]:
    """The classes whose character appears raw in ``out``."""
    return [name for name, c in CLASSES.items() if c in out]


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_escaped_set_covers_every_control_format_separator_and_surrogate():
    escaped = {c for first, last in text.UNSAFE_RANGES for c in range(first, last + 1)}
    wanted = {
        c
        for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) in ("Cc", "Cf", "Cs", "Zl", "Zp")
    }
    assert wanted <= escaped


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_is_escaped_for_the_terminal_and_for_json(name):
    c = CLASSES[name]
    shown = text.printable(f"a{c}b")
    assert c not in shown and shown.isprintable() and shown.isascii()
    line = dump({"s": f"a{c}b"})
    assert c not in line and line.isascii()
    assert json.loads(line) == {"s": f"a{c}b"}  # lossless, valid JSON


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_is_escaped_in_a_log_line(name, caplog):
    c = CLASSES[name]
    log = text.logger("walspool.test_text")
    with caplog.at_level(logging.INFO, logger="walspool.test_text"):
        log.info("session %s: %s", f"s{c}", ValueError(f"e{c}"))
    [record] = caplog.records
    assert c not in record.getMessage() and record.getMessage().isprintable()


def test_json_safe_spells_astral_characters_as_their_utf16_pair():
    assert text.json_safe('"\U000e0041"') == '"\\udb40\\udc41"'
    assert json.loads(text.json_safe('"\U000e0041"')) == "\U000e0041"


def test_every_cli_sink_escapes_each_class(tmp_path, capsys):
    """ls, show, show --full and a replay's report as text; ls --json, show --json,
    export and stats --json as JSON: no class raw anywhere, the JSON lossless."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append(EVIL, {"role": "user", "content": f"text {EVIL}"}, reason=f"r{EVIL}")
    for argv in (["ls"], ["show", EVIL], ["show", EVIL, "--full"], ["stats"]):
        rc, out, err = run(capsys, argv[0], path, *argv[1:])
        assert rc == 0 and raw_in(out) == [] and raw_in(err) == [], argv
    rc, out, _ = run(capsys, "ls", path, "--json")
    assert rc == 0 and raw_in(out) == [] and json.loads(out)[0]["session_id"] == EVIL
    rc, out, _ = run(capsys, "show", path, EVIL, "--json", "--full")
    assert rc == 0 and raw_in(out) == []
    [row] = json.loads(out)
    assert (row["session_id"], row["reason"], row["message"]["content"]) == (
        EVIL,
        f"r{EVIL}",
        f"text {EVIL}",
    )
    rc, out, _ = run(capsys, "export", path)
    assert rc == 0 and raw_in(out) == [] and out.isascii()
    assert json.loads(out)["message"] == {"role": "user", "content": f"text {EVIL}"}
    rc, out, _ = run(capsys, "stats", path, "--json")
    assert rc == 0 and raw_in(out) == [] and f"r{EVIL}" in json.loads(out)["by_reason"]


def test_a_control_and_its_escape_typed_as_text_never_print_alike(tmp_path, capsys, caplog):
    """A session id holding ESC and one holding the four characters ``\\x1b`` (chat
    users choose ids) differ wherever they are shown: the escape, a log line, ``ls``
    and an error line. A backslash is doubled; before, both printed ``\\x1b``."""
    esc, typed = "s\x1b", "s\\x1b"
    assert text.printable(esc) != text.printable(typed)
    assert text.printable(typed) == "s\\\\x1b"
    log = text.logger("walspool.test_text")
    with caplog.at_level(logging.WARNING, logger="walspool.test_text"):
        log.warning("session %s", esc)
        log.warning("session %s", typed)
    first, second = (r.getMessage() for r in caplog.records)
    assert first != second and "\x1b" not in first + second
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for session in (esc, typed):
            spool.append(session, {"role": "user", "content": "x"})
    rc, out, _ = run(capsys, "ls", path)
    words = sorted(line.split("  ")[0] for line in out.splitlines()[1:])
    assert rc == 0 and len(set(words)) == 2, out
    errors = set()
    for session in (esc + "?", typed + "?"):
        rc, _, err = run(capsys, "show", path, session)
        assert rc == 1 and raw_in(err) == [] and err.count("\n") == 1
        errors.add(err)
    assert len(errors) == 2, errors


def test_an_error_line_escapes_each_class(tmp_path, capsys):
    rc, out, err = run(capsys, "show", tmp_path / f"no{EVIL}.db", "s")
    assert rc == 1 and raw_in(err) == [] and err.count("\n") == 1


def test_a_session_id_with_each_class_pastes_back_through_a_shell(tmp_path, capsys):
    """The shell word ls prints for an id holding C1 and other non-ASCII controls gives
    the id back in bash (``$'\\u0085'``: bash reads ``\\x85`` as a byte)."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append(EVIL, {"role": "user", "content": "evil"})
    rc, out, _ = run(capsys, "ls", path)
    word = out.splitlines()[1].split("  ")[0]
    assert rc == 0 and word.startswith("$'") and raw_in(word) == []
    command = f"{shlex.quote(sys.executable)} -m walspool show {shlex.quote(str(path))} "
    done = subprocess.run(
        ["bash", "-c", command + word + " --json --full"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LC_ALL": "C.UTF-8"},
        cwd=Path(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert [r["message"]["content"] for r in json.loads(done.stdout)] == ["evil"]


def test_an_exception_logged_with_its_traceback_cannot_forge_a_log_line():
    """``log.exception`` with a message (and a chained cause) holding a newline and an
    escape sequence: the formatted record is the message line plus the traceback's
    own lines; no line starts with the forged text, and the escapes show."""
    log = text.logger("walspool.test_text.traceback")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    forged = "\nERROR walspool forged line\x1b[2K"
    try:
        try:
            raise KeyError(f"cause{forged}")
        except KeyError as cause:
            raise ValueError(f"session s{forged}") from cause
    except ValueError:
        log.exception("could not spool")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ERROR could not spool"
    assert not any(line.startswith("ERROR walspool forged") for line in lines), lines
    assert "\x1b" not in stream.getvalue()
    assert lines[-1] == "ValueError: session s\\nERROR walspool forged line\\x1b[2K"
    assert any(line.startswith("KeyError: ") and "\\n" in line for line in lines)
    assert "The above exception was the direct cause" in stream.getvalue()
