"""The command line as an operator meets it in an incident (issue: operators)."""

from __future__ import annotations

import json
from pathlib import Path

import apsw
from _helpers import run_python

import walspool
from walspool.cli import main


def spool_with_a_bad_payload(path: Path, rows: int = 3200, bad_at: int = 802) -> None:
    with walspool.Spool(path) as spool:
        spool.append_many([("s", {"role": "user", "content": f"m{i}"}) for i in range(rows)])
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE records SET payload = 'not json {' WHERE seq = ?", (bad_at + 1,))
    conn.close()


def test_one_payload_that_is_not_json_does_not_stop_export_or_show(tmp_path, capsys):
    """Every row comes out, the bad one flagged with its raw text; exit 1 naming it."""
    path = tmp_path / "spool.db"
    spool_with_a_bad_payload(path)
    assert main(["export", str(path)]) == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 3200
    assert lines[802]["message"] is None
    assert lines[802]["bad_payload"]["raw"] == "not json {"
    assert [r["message"]["content"] for r in lines[803:805]] == ["m803", "m804"]
    assert err.startswith("walspool export: 1 row with a payload that is not valid JSON")
    assert "(session s, seq 803)" in err
    assert main(["show", str(path), "s"]) == 1
    out, err = capsys.readouterr()
    assert "[NOT JSON] not json {" in out and "user: m3199" in out
    assert "(session s, seq 803)" in err
    assert main(["show", str(path), "s", "--full"]) == 1
    assert "not json {" in capsys.readouterr().out


def test_python_m_walspool_and_python_m_walspool_cli_run_the_command(tmp_path):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    for module in ("walspool", "walspool.cli"):
        done = run_python(f"import runpy; runpy.run_module({module!r}, run_name='__main__')",
                          "stats", str(path), "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == 1
