"""Memory bounded by what a row really costs (issue 29): pages count every stored byte
as SQLite measures it, never the ``size`` column; payloads too deep or too wide to
decode are quarantined or flagged and the rest goes on; export copies payloads as
stored; ls clips wide cells. The bounded-memory tests measure the peak RSS of a real
CLI process (``os.wait4``: that child's own figure)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import apsw
import msgspec
import pytest
from _gateway import state_db
from _helpers import ROOT, MemorySink

import walspool
from walspool.cli import ls, main
from walspool.cli._output import CELL_WIDTH
from walspool.replay.replayer import Replayer
from walspool.store import codec, paging
from walspool.store.spool import RECORD_COLUMNS

MiB = 1024 * 1024
#: A generous bound on the peak RSS of a command here. Measured on these spools: the
#: code before issue 29's fix peaked at 880 MiB (replay), 510 MiB (export), 690 MiB
#: (export of 8 million objects), 1.6 GiB (ls, printing 808 MiB) and 690 MiB
#: (import-json); the fixed code at 210, 175, 150, 85 and 115 MiB. ls and ls --json
#: over ten 24 MiB session ids: 640 and 984 MiB before, 130 and 178 MiB now.
PEAK_BOUND = 320 * MiB


#: Runs ``python -m walspool ARGV`` (stdout inherited, stderr dropped) and prints its
#: peak RSS in KiB. A process started from this small one: Linux counts into a child's
#: ``ru_maxrss`` the memory of the process it was forked from (its mm's high-water mark
#: at exec), so a CLI forked from the test process would carry pytest's own peak.
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-m", "walspool", *sys.argv[1:]],
                        stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, file=sys.stderr)
"""


def peak_rss(argv: list[Any], stdout: Path) -> tuple[int, int]:
    """Run ``walspool ARGV`` with stdout to a file; its exit status and the peak RSS of
    that process in bytes."""
    with open(stdout, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *map(str, argv)],
            stdout=out,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
            timeout=600,
        )
    rc, kib = map(int, done.stderr.split())
    return rc, kib * 1024  # Linux: KiB


def spool_with(path: Path, sessions: list[str], *, per_session: int = 1) -> Path:
    with walspool.Spool(path) as spool:
        for session in sessions:
            for n in range(per_session):
                spool.append(session, {"role": "user", "content": f"{session} {n}"})
    return path


def edit(path: Path, *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Change the spool behind walspool's back, as anyone who can write the file can."""
    conn = apsw.Connection(str(path))
    try:
        with conn:
            for sql, params in statements:
                conn.execute(sql, params)
    finally:
        conn.close()


def big_content_sql(nbytes: int, field: str = "content") -> str:
    """A payload with ``nbytes`` of text in ``field``, made by SQLite itself (no Python
    copy), its size set to 0."""
    head = '{"role":"user",' + ('"content":"hi",' if field != "content" else "")
    return f"""UPDATE records SET payload = '{head}"{field}":"' ||
        printf('%.*c', {nbytes}, 'x') || '"}}', size = 0"""


# -- pages ----------------------------------------------------------------------------


def test_a_page_counts_names_errors_and_payloads_measured_by_sqlite(tmp_path):
    """Rows whose session key and last error are 3 MiB each and whose size says 0: a page
    ends once what SQLite measures reaches PAGE_BYTES, not after PAGE_ROWS rows."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for n in range(40):
            spool.append(None, {"n": n}, session_key=f"k{n:02d}")
    edit(
        path,
        (
            "UPDATE records SET session_key = session_key || printf('%.*c', ?, 'k'), "
            "last_error = printf('%.*c', ?, 'e'), size = 0",
            (3 * MiB, 3 * MiB),
        ),
    )
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        sql = f"SELECT {RECORD_COLUMNS}, {paging.ROW_BYTES_SQL} FROM records ORDER BY id"
        rows, full = paging.read_page(conn, sql, {})
    finally:
        conn.close()
    row_bytes = 6 * MiB + 3 + len('{"n":0}') + len("transcript_cap_drop")
    assert full and len(rows) == -(-paging.PAGE_BYTES // row_bytes) == 2
    assert rows[0][-1] == row_bytes


def test_a_page_counts_what_decoding_makes_of_a_payload(tmp_path):
    """Payloads of 300,000 empty objects (900 KB each, about 19 MiB once decoded): one
    row per page, where their stored bytes alone would put nine in one."""
    path = spool_with(tmp_path / "spool.db", ["s"], per_session=12)
    edit(path, ("UPDATE records SET payload = '[' || replace(printf('%.*c', ?, 'x'), 'x', "
                "'{},') || '{}]'", (300_000 - 1,)))  # fmt: skip
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        sql = f"SELECT {RECORD_COLUMNS}, {paging.ROW_BYTES_SQL} FROM records ORDER BY id"
        rows, full = paging.read_page(conn, sql, {})
    finally:
        conn.close()
    assert full and len(rows) == 1


def test_replay_takes_rows_a_page_at_a_time_whatever_the_size_column_says(tmp_path):
    """12 rows of 32 MiB with size set to 0: replay peaks far below the 12 rows' 384 MiB
    plus their decoded form. Each session is missing in state.db, so nothing is written,
    and the 32 MiB are in a field the sink does not pass on: what is measured is the
    replay's own memory, not state.db's full-text index of the content."""
    sessions = [f"s{n:02d}" for n in range(12)]
    path = spool_with(tmp_path / "spool.db", sessions)
    edit(path, (big_content_sql(32 * MiB, field="junk"), ()))
    state = state_db(tmp_path / "state.db")
    rc, peak = peak_rss(["replay", path, "--into", state], tmp_path / "out")
    assert rc == 3  # held: no session in state.db
    assert peak < PEAK_BOUND, f"replay peaked at {peak / MiB:.0f} MiB"
    with walspool.Spool(path) as spool:
        assert [r.attempts for r in spool.records()] == [1] * 12  # each one was tried


def big_rows_in_flight(path: Path) -> Path:
    """12 rows of session s, each 32 MiB in a field the sink does not pass on (content:
    its seq), size 0, all left in flight with their tickets as a crashed replay leaves
    them."""
    spool_with(path, ["s"], per_session=12)
    edit(
        path,
        (
            "UPDATE records SET payload = json_object('role', 'user', 'content', "
            "CAST(seq AS TEXT), 'junk', printf('%.*c', ?, 'x')), size = 0",
            (32 * MiB,),
        ),
        ("UPDATE records SET inflight = id", ()),
        ("UPDATE spool_meta SET value = 100 WHERE name = 'next_ticket'", ()),
    )
    return path


def test_replay_recovers_rows_left_in_flight_a_page_at_a_time(tmp_path):
    """12 rows of 32 MiB of one session, left in flight as a crashed replay leaves them
    (each with its ticket), size set to 0: the replay that recovers them peaks far below
    the 12 rows' 384 MiB plus their decoded form (before: every row in flight read at
    once), and writes each once, in order. The 32 MiB are in a field the sink does not
    pass on, as above."""
    path = big_rows_in_flight(tmp_path / "spool.db")
    state = state_db(tmp_path / "state.db", "s")
    rc, peak = peak_rss(["replay", path, "--into", state], tmp_path / "out")
    assert rc == 0
    assert peak < PEAK_BOUND, f"replay peaked at {peak / MiB:.0f} MiB"
    with walspool.Spool(path) as spool:
        assert list(spool.records()) == []
    import hermes_state

    db = hermes_state.SessionDB(db_path=state)
    try:
        assert [m["content"] for m in db.get_messages("s")] == [str(n) for n in range(1, 13)]
    finally:
        db.close()


def test_rows_in_flight_cost_a_dry_run_no_more_than_rows_waiting(tmp_path):
    """The same 12 rows, in flight and then waiting (not in flight): replay --dry-run
    peaks no higher with them in flight, give or take two rows (it decodes each on its
    own and keeps only its id; before: every row in flight sorted and decoded at once,
    738 MiB against 354). Not ``PEAK_BOUND``: either way the dry run's json_valid scans
    of every row peaked at about 355 MiB (SQLite kept its parses of the last few
    payloads), now under ``PEAK_BOUND`` too."""
    path = big_rows_in_flight(tmp_path / "spool.db")
    state = state_db(tmp_path / "state.db", "s")
    out = tmp_path / "out"
    argv = ["replay", path, "--into", state, "--dry-run", "--json"]
    rc, in_flight = peak_rss(argv, out)
    report = json.loads(out.read_text())
    assert rc == 0 and (report["moved"], report["inflight"], report["recovered"]) == (12, 12, 0)
    edit(path, ("UPDATE records SET inflight = NULL", ()))
    rc, waiting = peak_rss(argv, out)
    assert rc == 0 and json.loads(out.read_text())["inflight"] == 0
    assert in_flight < waiting + 2 * 32 * MiB, (in_flight // MiB, waiting // MiB)
    assert waiting < PEAK_BOUND and in_flight < PEAK_BOUND, (in_flight // MiB, waiting // MiB)


def test_check_and_a_dry_run_find_bad_payloads_without_holding_large_parses(tmp_path):
    """12 payloads of 32 MiB, one of them not JSON, and a small one not JSON: `check`
    names both and `replay --dry-run` counts both, each peaking under ``PEAK_BOUND``
    (a json_valid scan kept SQLite's parses of the last few payloads: 370 MiB)."""
    path = spool_with(tmp_path / "spool.db", ["s"], per_session=13)
    edit(
        path,
        (
            "UPDATE records SET payload = json_object('role', 'user', 'content', "
            "CAST(seq AS TEXT), 'junk', printf('%.*c', ?, 'x')) WHERE seq <= 12",
            (32 * MiB,),
        ),
        ("UPDATE records SET payload = substr(payload, 2) WHERE seq IN (5, 13)", ()),
    )
    out = tmp_path / "out"
    rc, peak = peak_rss(["check", path, "--json"], out)
    problems = json.loads(out.read_text())["problems"]
    assert rc == 1 and peak < PEAK_BOUND, peak // MiB
    assert (
        "2 rows whose payload is not valid JSON: id 5 (session s, seq 5), id 13 (session s, seq 13)"
    ) in problems
    state = state_db(tmp_path / "state.db", "s")
    rc, peak = peak_rss(["replay", path, "--into", state, "--dry-run", "--json"], out)
    report = json.loads(out.read_text())
    assert peak < PEAK_BOUND, peak // MiB
    assert report["quarantined"] == 2, report


def test_export_reads_a_page_at_a_time_whatever_the_size_column_says(tmp_path):
    path = spool_with(tmp_path / "spool.db", [f"s{n:02d}" for n in range(12)])
    edit(path, (big_content_sql(32 * MiB), ()))
    out = tmp_path / "export.jsonl"
    rc, peak = peak_rss(["export", path], out)
    assert rc == 0
    assert peak < PEAK_BOUND, f"export peaked at {peak / MiB:.0f} MiB"
    with open(out, "rb") as f:
        lines = f.read().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 13
    first = json.loads(lines[0])
    assert first["session_id"] == "s00" and len(first["message"]["content"]) == 32 * MiB


# -- decoding within a budget --------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def deep_spool(path: Path) -> tuple[Path, int]:
    """Sessions a and c healthy; session b's second of three rows nested 100,000 deep."""
    spool_with(path, ["a", "b", "c"], per_session=3)
    edit(path, ("UPDATE records SET payload = ? WHERE session_id = 'b' AND seq = 2", (DEEP,)))
    conn = apsw.Connection(str(path))
    try:
        deep_id = conn.execute("SELECT id FROM records WHERE session_id = 'b' AND seq = 2").get
    finally:
        conn.close()
    return path, deep_id


def test_replay_quarantines_a_row_nested_too_deep_and_every_session_goes_on(tmp_path):
    path, deep_id = deep_spool(tmp_path / "spool.db")
    sink = MemorySink()
    with walspool.Spool(path) as spool:
        report = Replayer(spool, sink).replay()
        assert (report.moved, report.held, report.quarantined) == (8, 0, 1)
        assert sink.contents("a") == ["a 0", "a 1", "a 2"]
        assert sink.contents("b") == ["b 0", "b 2"]
        assert sink.contents("c") == ["c 0", "c 1", "c 2"]
    conn = apsw.Connection(str(path))
    try:
        kept = conn.execute("SELECT id, status, last_error, payload FROM records").fetchall()
    finally:
        conn.close()
    [(row_id, status, error, payload)] = kept
    assert (row_id, status, payload) == (deep_id, "quarantined", DEEP)
    assert f"nested 100,000 levels deep, over the {codec.MAX_DEPTH}" in error


def test_export_and_show_flag_a_row_nested_too_deep_and_go_on(tmp_path, capsys):
    path, deep_id = deep_spool(tmp_path / "spool.db")
    capsys.readouterr()
    rc = main(["export", str(path)])
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and len(lines) == 9
    [flagged] = [line for line in lines if "bad_payload" in line]
    assert flagged["id"] == deep_id and flagged["message"] is None
    assert "nested 100,000 levels deep" in flagged["bad_payload"]["error"]
    assert [line["message"]["content"] for line in lines if line["session_id"] == "c"] == [
        "c 0",
        "c 1",
        "c 2",
    ]
    assert "too costly to decode, or a session id, reason or key that is not UTF-8" in err
    assert f"shown flagged: id {deep_id} (session b, seq 2)" in err
    rc = main(["show", str(path), "b"])
    out, err = capsys.readouterr()
    assert rc == 1 and "user: b 0" in out and "user: b 2" in out and "Traceback" not in err


def test_a_payload_too_wide_to_decode_is_exported_as_stored(tmp_path):
    """24 MiB of ``[{},{},...]`` (8 million objects, about 600 MiB decoded): export
    copies the stored text, never decoded, and stays small."""
    path = spool_with(tmp_path / "spool.db", ["wide", "after"])
    objects = 8 * 1024 * 1024
    edit(path, ("UPDATE records SET payload = '[' || replace(printf('%.*c', ?, 'x'), 'x', "
                "'{},') || '{}]' WHERE session_id = 'wide'", (objects - 1,)))  # fmt: skip
    out = tmp_path / "export.jsonl"
    rc, peak = peak_rss(["export", path], out)
    assert rc == 0
    assert peak < PEAK_BOUND, f"export peaked at {peak / MiB:.0f} MiB"
    with open(out, "rb") as f:
        after, wide, end = f.read().split(b"\n")  # in session order
    assert end == b"" and json.loads(after)["message"]["content"] == "after 0"
    head, _, message = wide.partition(b',"message":')
    assert json.loads(head + b"}")["session_id"] == "wide"
    assert message == b"[" + b"{}," * (objects - 1) + b"{}]}"


def test_import_json_leaves_a_file_too_wide_to_decode_in_place(tmp_path):
    """A pending file of 8 million objects is refused from its text, before parsing;
    the other file is imported."""
    pending = tmp_path / "pending_messages"
    pending.mkdir()
    good = {"reason": "shutdown", "session_key": "k", "ts": 1.0, "data": {"text": "hi"}}
    (pending / "pending-1.json").write_text(json.dumps(good))
    junk = b"[" + b"{}," * (8 * 1024 * 1024 - 1) + b"{}]"
    wide = b'{"reason":"shutdown","session_key":"k","ts":2.0,"data":{"text":"x","junk":'
    (pending / "pending-2.json").write_bytes(wide + junk + b"}}")
    spool = tmp_path / "spool.db"
    rc, peak = peak_rss(["import-json", spool, pending, "--json"], tmp_path / "out")
    report = json.loads((tmp_path / "out").read_text())
    assert rc == 3 and report["imported"] == 1, report
    assert peak < PEAK_BOUND, f"import-json peaked at {peak / MiB:.0f} MiB"
    [skipped] = report["skipped"]
    assert skipped.startswith("pending-2.json: too costly to decode: ")
    assert f"over the {codec.MAX_VALUES:,} a payload may decode to" in skipped
    assert sorted(p.name for p in pending.iterdir()) == ["pending-2.json"]


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ("[" * 513 + "]" * 513, "nested 513 levels deep"),
        ("[" + "0," * codec.MAX_VALUES + "0]", "2,000,002 JSON values or more"),
    ],
)
def test_decode_refuses_past_its_budget_and_takes_what_is_within(payload, why):
    with pytest.raises(codec.OverBudget, match=why):
        codec.decode(payload)
    assert codec.decode("[" * 512 + "]" * 512) is not None
    # Brackets and commas inside strings are text, not structure.
    text = '["' + "[{,:" * codec.MAX_VALUES + '"]'
    assert codec.decode(text) == ["[{,:" * codec.MAX_VALUES]


# -- ls -----------------------------------------------------------------------------------


def test_ls_clips_a_wide_session_id_and_json_keeps_it_whole(tmp_path, capsys):
    """One 4 MiB session id among 200 sessions: the text view clips it to CELL_WIDTH
    (ending in …), does not pad the other rows to it and says where it is whole;
    --json has it whole."""
    huge = "h" * (4 * MiB)
    path = spool_with(tmp_path / "spool.db", [huge, *(f"s{n:03d}" for n in range(200))])
    rc, peak = peak_rss(["ls", path], tmp_path / "ls.txt")
    assert rc == 0 and peak < PEAK_BOUND
    lines = (tmp_path / "ls.txt").read_text().splitlines()
    assert len(lines) == 203 and max(map(len, lines)) < CELL_WIDTH + 200
    [row] = [line for line in lines if line.startswith("h")]
    assert row.split("  ")[0] == "h" * (CELL_WIDTH - 1) + "…"
    assert lines[-1] == f"1 session clipped (…): `walspool ls {path} --json` has it whole"
    capsys.readouterr()
    assert main(["ls", str(path), "--json"]) == 0
    streams = json.loads(capsys.readouterr().out)
    assert huge in [s["session_id"] for s in streams]


def test_ls_holds_a_bounded_prefix_of_each_session_id_and_error(tmp_path):
    """Ten session ids of 24 MiB (two of them with an error) and four sessions whose
    error is 16 MiB: ls and ls --json peak under PEAK_BOUND (before: 640 and 984 MiB,
    from SQLite sorting the whole ids to group rows and Python keeping every id and
    first error whole). The text view clips every long id and says so; --json has
    each id and error whole, read one stream at a time."""
    wide = [f"w{n}" for n in range(10)]
    path = spool_with(tmp_path / "spool.db", [*wide, *(f"e{n}" for n in range(4))])
    edit(
        path,
        (
            "UPDATE records SET session_id = session_id || printf('%.*c', ?, 'x') || '!' "
            "WHERE session_id LIKE 'w%'",
            (24 * MiB,),
        ),
        ("UPDATE records SET last_error = 'boom', attempts = 1 WHERE session_id GLOB 'w[01]*'", ()),
        (
            "UPDATE records SET last_error = printf('%.*c', ?, 'e'), attempts = 1 "
            "WHERE session_id LIKE 'e%'",
            (16 * MiB,),
        ),
    )
    text, json_out = tmp_path / "ls.txt", tmp_path / "ls.json"
    rc, peak = peak_rss(["ls", path], text)
    assert rc == 0 and peak < PEAK_BOUND, f"ls peaked at {peak / MiB:.0f} MiB"
    rc, peak = peak_rss(["ls", path, "--json"], json_out)
    assert rc == 0 and peak < PEAK_BOUND, f"ls --json peaked at {peak / MiB:.0f} MiB"

    lines = text.read_text().splitlines()
    assert len(lines) == 16 and max(map(len, lines)) < CELL_WIDTH + 200
    cells = {line.split()[0][:2]: line.split("  ")[0] for line in lines[1:-1]}
    assert all(cells[w] == w + "x" * (CELL_WIDTH - 3) + "…" for w in wide)
    assert lines[-1] == f"10 sessions clipped (…): `walspool ls {path} --json` has them whole"
    streams = msgspec.json.decode(json_out.read_bytes())
    names = {s["session_id"][:2]: s for s in streams}
    assert len(streams) == 14 and set(names) == {*wide, "e0", "e1", "e2", "e3"}
    for w in wide:
        sid = names[w]["session_id"]
        assert len(sid) == 24 * MiB + 3 and sid.endswith("x!")
        assert names[w]["last_error"] == ("boom" if w in ("w0", "w1") else None)
    assert all(names[f"e{n}"]["last_error"] == "e" * (16 * MiB) for n in range(4))


def test_ls_reads_a_stream_named_past_what_it_holds_as_any_other(tmp_path, capsys):
    """Streams whose id or key is longer than ls.CHARS are read another way (their
    unique index's order): each --json object is the one an ordinary name gets, name
    and first error whole; the first error is the lowest seq's (seq 9 before seq 10).
    In the text view a name over 120 characters is clipped, whichever way it was
    read, and the last line says --json has it whole."""
    long_id, long_key, mid = "L" * (ls.CHARS + 10) + "end", "K" * (ls.CHARS + 5), "m" * 200
    error = "nine " + "e" * ls.CHARS
    with walspool.Spool(tmp_path / "spool.db") as spool:
        for seq in range(1, 12):
            for name in (long_id, "short"):
                spool.append(name, {"role": "user", "content": f"{seq}"})
        spool.append(None, {"role": "user", "content": "k"}, session_key=long_key)
        spool.append(mid, {"role": "user", "content": "m"})
    edit(
        tmp_path / "spool.db",
        ("UPDATE records SET last_error = ?, attempts = 3 WHERE seq = 9 AND id < 23", (error,)),
        ("UPDATE records SET last_error = 'ten', attempts = 2 WHERE seq = 10 AND id < 23", ()),
        ("UPDATE records SET status = 'quarantined' WHERE seq = 10 AND id < 23", ()),
        ("UPDATE records SET status = 'superseded' WHERE seq = 11 AND id < 23", ()),
        ("UPDATE records SET inflight = id WHERE seq IN (2, 3) AND id < 23", ()),
    )
    path = str(tmp_path / "spool.db")
    assert main(["ls", path, "--json"]) == 0
    streams = json.loads(capsys.readouterr().out)
    by_name = {s["session_id"] or s["session_key"]: s for s in streams}
    assert set(by_name) == {long_id, "short", long_key, mid}
    assert by_name[long_id]["last_error"] == by_name["short"]["last_error"] == error
    assert by_name[long_key]["session_id"] is None
    times = {"oldest", "newest", "oldest_age", "newest_age"}
    same = {k: v for k, v in by_name["short"].items() if k not in times | {"session_id"}}
    assert {k: v for k, v in by_name[long_id].items() if k in same} == same
    assert same["rows"] == 11 and same["max_attempts"] == 3 and same["inflight"] == 2
    # Retrying: seq 9 failed; its stream's 7 replayable rows not in flight wait with it.
    assert (same["quarantined"], same["superseded"], same["retrying"]) == (1, 1, 7)

    assert main(["ls", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and "short" in [line.split()[0] for line in lines]
    clipped = {line.split()[0][:4] for line in lines if line.split()[0].endswith("…")}
    assert clipped == {"LLLL", "key:", "mmmm"}
    assert lines[-1] == f"3 sessions clipped (…): `walspool ls {path} --json` has them whole"
    assert "nine eeee" in lines[1 + [s["session_id"] for s in streams].index(long_id)]


def test_watch_holds_a_bounded_prefix_of_each_session_id_and_error(tmp_path):
    """Ten session ids of 24 MiB (w0 with two failed rows, the later one's error 16 MiB)
    and four sessions whose error is 16 MiB: watch (one frame, not on a terminal) and
    watch --json peak under PEAK_BOUND (before: 1,042 and 1,890 MiB, from SQLite sorting
    the whole ids to group rows and to count appends, every id and latest error read
    whole, and --json holding every stream's object at once; now 178 and 179 MiB). The
    frame clips each id and error; --json has each id, first and latest error whole."""
    wide = [f"w{n}" for n in range(10)]
    path = spool_with(tmp_path / "spool.db", ["w0", *wide, *(f"e{n}" for n in range(4))])
    edit(
        path,
        (
            "UPDATE records SET session_id = session_id || printf('%.*c', ?, 'x') || '!' "
            "WHERE session_id LIKE 'w%'",
            (24 * MiB,),
        ),
        (
            "UPDATE records SET last_error = 'boom', attempts = 1, last_attempt_at = 5 "
            "WHERE session_id GLOB 'w[01]*' AND seq = 1",
            (),
        ),
        (
            "UPDATE records SET last_error = printf('%.*c', ?, 'E'), attempts = 2, "
            "last_attempt_at = 9 WHERE session_id GLOB 'w0*' AND seq = 2",
            (16 * MiB,),
        ),
        (
            "UPDATE records SET last_error = printf('%.*c', ?, 'e'), attempts = 1 "
            "WHERE session_id LIKE 'e%'",
            (16 * MiB,),
        ),
    )
    text, json_out = tmp_path / "watch.txt", tmp_path / "watch.json"
    rc, peak = peak_rss(["watch", path, "--interval", "0.1"], text)
    assert rc == 0 and peak < PEAK_BOUND, f"watch peaked at {peak / MiB:.0f} MiB"
    rc, peak = peak_rss(["watch", path, "--interval", "0.1", "--json"], json_out)
    assert rc == 0 and peak < PEAK_BOUND, f"watch --json peaked at {peak / MiB:.0f} MiB"

    lines = text.read_text().splitlines()
    assert "rows         15 in 14 sessions, " in lines[3] and "failing 7 " in lines[4]
    header = lines.index(next(line for line in lines if line.startswith("ROWS ")))
    cells = {c[-1][:2]: c for c in (re.split(r" {2,}", line) for line in lines[header + 1 :])}
    assert len(cells) == 14 and max(map(len, lines)) < CELL_WIDTH + 200
    assert all(cells[w][-1] == w + "x" * (CELL_WIDTH - 3) + "…" for w in wide)
    assert [cells[w][4:6] for w in ("w0", "w1", "w2")] == [
        ["2", "E" * 39 + "…"],  # the latest error, clipped
        ["1", "boom"],
        ["0", "-"],
    ]
    assert all(cells[f"e{n}"][4:] == ["1", "e" * 39 + "…", f"e{n}"] for n in range(4))

    got = msgspec.json.decode(json_out.read_bytes())
    assert (got["sessions"], got["failing"], len(got["streams"])) == (14, 7, 14)
    streams = {s["session_id"][:2]: s for s in got["streams"]}
    for w in wide:
        assert len(streams[w]["session_id"]) == 24 * MiB + 3
        assert streams[w]["session_id"].endswith("x!")
    w0 = streams["w0"]
    assert (w0["rows"], w0["failing"], w0["max_attempts"]) == (2, 2, 2)
    assert (w0["last_error"], w0["latest_error"]) == ("boom", "E" * (16 * MiB))
    assert streams["w1"]["last_error"] == streams["w1"]["latest_error"] == "boom"
    assert streams["w2"]["last_error"] is streams["w2"]["latest_error"] is None
    for n in range(4):
        e = streams[f"e{n}"]
        assert e["last_error"] == e["latest_error"] == "e" * (16 * MiB) and e["failing"] == 1


def test_payloads_not_json_are_found_on_both_sides_of_the_scan_bound(tmp_path):
    """A payload that is not JSON is found whatever its size: one byte under, exactly
    at and one byte over ``SCAN_JSON_BYTES`` (a small and a large row each belong to
    exactly one of the two queries)."""
    path = tmp_path / "spool.db"
    sizes = [paging.SCAN_JSON_BYTES - 1, paging.SCAN_JSON_BYTES, paging.SCAN_JSON_BYTES + 1]
    with walspool.Spool(path) as spool:
        ids = [spool.append("s", {"n": n}).id for n in range(len(sizes) + 1)]
    with apsw.Connection(str(path)) as conn:
        for row_id, size in zip(ids[:-1], sizes, strict=True):  # the last row stays JSON
            conn.execute("UPDATE records SET payload = ? WHERE id = ?", ("{" * size, row_id))
        small = (
            f"SELECT id FROM records WHERE {paging.SMALL_PAYLOAD} AND NOT json_valid(payload) "
            "ORDER BY id"
        )
        large = f"SELECT id FROM records WHERE {paging.LARGE_PAYLOAD} ORDER BY id"
        found = [row[0] for row in paging.rows_not_json(conn, small, large, ())]
    assert found == ids[:-1]


def test_ls_and_watch_list_streams_oldest_first_a_page_at_a_time(tmp_path, capsys, monkeypatch):
    """Streams come oldest first, key streams before id streams at the same age, then
    by name, whichever way they were read: short names grouped by SQLite, names past
    ``CHARS`` by their unique index, merged at their place. ``ls`` lays them out a page
    at a time (``PAGE_LINES``, 2 here): the headers once, a column as wide as the widest
    cell so far, so a wide name on a later page moves the columns from its line on.
    ``ls --json`` and ``watch --json`` give the same order."""
    monkeypatch.setattr(ls, "PAGE_LINES", 2)
    long_id, long_key = "L" * (ls.CHARS + 3), "K" * (ls.CHARS + 2)
    wide = "w" * 40
    # (session id, session key, created_at): ties at 20 and 30, long names among them.
    streams = [
        ("b", None, 30.0), (None, "k1", 30.0), ("a", None, 30.0), (long_id, None, 20.0),
        ("c", None, 20.0), (None, long_key, 20.0), (wide, None, 40.0), ("d", None, 10.0),
        (None, "k0", 12.0),
    ]  # fmt: skip
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        for sid, key, _ in streams:
            spool.append(sid, {"role": "user", "content": "x"}, session_key=key)
    for sid, key, at in streams:
        where = "session_id = ?" if sid is not None else "session_id IS NULL AND session_key = ?"
        edit(path, (f"UPDATE records SET created_at = ? WHERE {where}", (at, sid or key)))
    order = sorted(streams, key=lambda s: (s[2], s[0] is not None, s[0] or "", s[1] or ""))
    names = [sid if sid is not None else key for sid, key, _ in order]

    assert main(["ls", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [
        s["session_id"] if s["session_id"] is not None else s["session_key"] for s in listed
    ] == names
    assert main(["watch", str(path), "--json", "--interval", "0.1"]) == 0
    watched = json.loads(capsys.readouterr().out)
    assert watched["sessions"] == len(streams)
    assert [s["session_id"] or s["session_key"] for s in watched["streams"]] == names

    assert main(["ls", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0].startswith("SESSION ") and sum(line.startswith("SESSION ") for line in lines) == 1
    )
    shown = [line.split()[0] for line in lines[1 : len(streams) + 1]]
    expected = [
        (sid if sid is not None else f"key:{key}")[: CELL_WIDTH - 1] for sid, key, _ in order
    ]
    assert [name.rstrip("…") for name in shown] == expected
    rows_at = [line.index("  1  ") for line in lines[1 : len(streams) + 1]]
    # Page 1 (d, key:k0) is as wide as its headers; page 2 brings the long names,
    # clipped to CELL_WIDTH, and SESSION is that wide from there on.
    assert names[:3] == ["d", "k0", long_key]
    assert rows_at[:2] == [len("SESSION")] * 2 == [lines[0].index("ROWS") - 2] * 2
    assert rows_at[2:] == [CELL_WIDTH] * (len(streams) - 2)


def test_ls_and_watch_list_a_session_id_edited_to_the_empty_string(tmp_path, capsys):
    """A hand edit leaves a session id empty (''): a name like any other, listed by
    ``ls`` (as ``''``, pasteable), ``ls --json`` and ``watch --json``, not taken for
    the group of names too long to sort."""
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("x", {"role": "user", "content": "a"})
        spool.append("y", {"role": "user", "content": "b"})
    edit(path, ("UPDATE records SET session_id = '' WHERE session_id = 'x'", ()))
    assert main(["ls", str(path)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["''", "y"]
    assert main(["ls", str(path), "--json"]) == 0
    assert [s["session_id"] for s in json.loads(capsys.readouterr().out)] == ["", "y"]
    assert main(["watch", str(path), "--json", "--interval", "0.1"]) == 0
    watched = json.loads(capsys.readouterr().out)
    assert (watched["sessions"], [s["session_id"] for s in watched["streams"]]) == (2, ["", "y"])
