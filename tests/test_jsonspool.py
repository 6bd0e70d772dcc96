"""Importing upstream's ``pending_messages/pending-*.json`` spool into a Spool."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import ROOT, child_deadline, run_python

import walspool
from walspool import AGENT_HISTORY, CAP_DROP, SHUTDOWN
from walspool.replay.jsonspool import DEFAULT_BATCH_FILES, ImportReport, import_json_spool

TS = 1_760_000_000


# -- files written the way upstream's gateway/shutdown_flush.py writes them ---------------


@pytest.fixture
def pending(tmp_path: Path) -> Path:
    path = tmp_path / "pending_messages"
    path.mkdir(mode=0o700)
    return path


def write_raw(directory: Path, content: str | bytes, name: str | None = None) -> Path:
    """A spool file named like upstream's (``pending-<uuid4 hex>.json``), mode 0600."""
    path = directory / (name or f"pending-{uuid.uuid4().hex}.json")
    data = content.encode("utf-8") if isinstance(content, str) else content
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
    return path


def write_payload(directory: Path, payload: Any, name: str | None = None) -> Path:
    """As upstream's ``atomic_json_write(..., indent=2, ensure_ascii=False, default=str)``."""
    return write_raw(
        directory, json.dumps(payload, indent=2, ensure_ascii=False, default=str), name
    )


def cap_drop(session_id: str, message: dict[str, Any], *, ts: Any = TS, seq: Any = 0) -> dict:
    return {
        "session_key": session_id,
        "reason": CAP_DROP,
        "ts": ts,
        "seq": seq,
        "data": {"session_id": session_id, "message": message},
    }


def slot(
    session_key: str, data: dict[str, Any], *, reason: str = SHUTDOWN, ts: Any = TS, **extra: Any
) -> dict:
    return {"session_key": session_key, "reason": reason, "ts": ts, "data": data, **extra}


def agent_history(session_id: str | None, messages: list[Any]) -> dict:
    return {
        "reason": AGENT_HISTORY,
        "issue": "#72680",
        "session_id": session_id,
        "count": len(messages),
        "messages": messages,
    }


def left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- each kind ----------------------------------------------------------------------------


def test_cap_drop_imports_its_queued_message_as_is(spool, pending):
    msg = {
        "role": "assistant",
        "content": "hé 🌍",
        "reasoning": "r",
        "timestamp": 0,
        "tool_calls": [{"id": "c1", "args": {"n": None, "big": 10**30}}],
    }
    write_payload(pending, cap_drop("sess-1", msg, seq=7))
    report = import_json_spool(spool, pending)
    assert report == ImportReport(1, [], {CAP_DROP: 1}, [])
    [rec] = spool.records()
    assert (rec.session_id, rec.session_key, rec.reason, rec.seq) == ("sess-1", None, CAP_DROP, 1)
    assert rec.message == msg
    assert left(pending) == []


def test_shutdown_slot_with_session_id_keeps_data_and_adds_ts(spool, pending):
    data = {
        "text": "hello",
        "session_id": "sess-9",
        "platform": "telegram",
        "sender_id": "42",
        "media": ["/tmp/a.png"],
        "raw_event": "{'x': 1}",
    }
    write_payload(pending, slot("agent:main:telegram:dm:42", data, reason="adapter_shutdown"))
    import_json_spool(spool, pending)
    [rec] = spool.records()
    assert (rec.session_id, rec.session_key, rec.reason) == (
        "sess-9",
        "agent:main:telegram:dm:42",
        "adapter_shutdown",
    )
    assert rec.message == {**data, "timestamp": TS}


def test_shutdown_slot_without_session_id_is_keyed_for_replay_resolution(spool, pending):
    write_payload(pending, slot("agent:main:discord:dm:7", {"text": "later"}))
    import_json_spool(spool, pending)
    [rec] = spool.records()
    assert (rec.session_id, rec.session_key, rec.reason) == (
        None,
        "agent:main:discord:dm:7",
        SHUTDOWN,
    )
    assert rec.message == {"text": "later", "timestamp": TS}


def test_slot_keeps_its_own_timestamp_and_an_unusable_ts_is_not_added(spool, pending):
    write_payload(pending, slot("k1", {"text": "own", "timestamp": 5}))
    write_payload(pending, slot("k2", {"text": "bad ts"}, ts="abc"))
    import_json_spool(spool, pending)
    by_key = {r.session_key: r.message for r in spool.records()}
    assert by_key == {"k1": {"text": "own", "timestamp": 5}, "k2": {"text": "bad ts"}}


def test_overflow_files_keep_their_seq_order(spool, pending):
    for seq, name in [(1, "pending-0.json"), (0, "pending-1.json")]:
        write_payload(pending, slot("k", {"text": f"q{seq}"}, seq=seq), name)
    import_json_spool(spool, pending)
    assert [r.message["text"] for r in spool.records()] == ["q0", "q1"]


def test_agent_history_keeps_the_whole_file(spool, pending):
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    write_payload(pending, agent_history("sess-h", history))
    write_payload(pending, agent_history(None, ["x"]))
    report = import_json_spool(spool, pending)
    assert report.by_reason == {AGENT_HISTORY: 2}
    recs = {r.session_id: r for r in spool.records(reasons=[AGENT_HISTORY])}
    assert recs["sess-h"].message == agent_history("sess-h", history)
    assert recs["unknown"].message == agent_history(None, ["x"])
    assert recs["sess-h"].session_key is None


def test_all_kinds_together_are_counted_by_reason(spool, pending):
    write_payload(pending, cap_drop("s", {"role": "user", "content": "c"}))
    write_payload(pending, slot("k", {"text": "t"}))
    write_payload(pending, slot("k", {"text": "t"}, reason="adapter_shutdown"))
    write_payload(pending, agent_history("s", []))
    report = import_json_spool(spool, pending)
    assert report.imported == 4
    assert report.by_reason == {CAP_DROP: 1, SHUTDOWN: 1, "adapter_shutdown": 1, AGENT_HISTORY: 1}
    assert spool.stats().by_reason == report.by_reason


# -- order ----------------------------------------------------------------------------------


def test_order_is_ts_then_seq_then_name_not_file_name(spool, pending):
    # names sort z, y, x, ... but ts says the opposite; same-second ties go by seq
    files = [
        ("pending-a.json", TS + 2, 0, "m5"),
        ("pending-b.json", TS + 1, 1, "m4"),
        ("pending-c.json", TS + 1, 0, "m3"),
        ("pending-e.json", TS, 10, "m2"),
        ("pending-f.json", TS, 2, "m1"),
        ("pending-z.json", TS, None, "m0"),  # no seq sorts as -1
    ]
    for name, ts, seq, content in files:
        payload = cap_drop("s", {"role": "user", "content": content}, ts=ts, seq=seq)
        if seq is None:
            del payload["seq"]
        write_payload(pending, payload, name)
    import_json_spool(spool, pending)
    assert [r.message["content"] for r in spool.records(session_id="s")] == [
        "m0",
        "m1",
        "m2",
        "m3",
        "m4",
        "m5",
    ]
    assert [r.seq for r in spool.records(session_id="s")] == [1, 2, 3, 4, 5, 6]


def test_equal_keys_fall_back_to_file_name(spool, pending):
    for name in ["pending-c.json", "pending-a.json", "pending-b.json"]:
        write_payload(pending, cap_drop("s", {"content": name}, seq=3), name)
    import_json_spool(spool, pending)
    assert [r.message["content"] for r in spool.records()] == [
        "pending-a.json",
        "pending-b.json",
        "pending-c.json",
    ]


@pytest.mark.parametrize(
    "bad",
    [str(10**400), '"abc"', "true", "NaN", "Infinity", "null", "1e999"],
    ids=["10**400", "text", "true", "NaN", "Infinity", "null", "1e999"],
)
def test_unusable_ts_sorts_as_zero_and_does_not_abort(spool, pending, bad):
    write_payload(pending, cap_drop("s", {"content": "later"}, ts=5, seq=0), "pending-a.json")
    raw = json.dumps(cap_drop("s", {"content": "first"}, ts="@@", seq=0)).replace('"@@"', bad)
    write_raw(pending, raw, "pending-b.json")
    write_payload(pending, cap_drop("s", {"content": "tie"}, ts=0, seq=1), "pending-c.json")
    report = import_json_spool(spool, pending)
    assert report.imported == 3 and report.skipped == []
    assert [r.message["content"] for r in spool.records()] == ["first", "tie", "later"]


def test_unusable_seq_sorts_as_zero(spool, pending):
    write_payload(pending, cap_drop("s", {"content": "b"}, seq=True), "pending-a.json")
    write_payload(pending, cap_drop("s", {"content": "a"}, seq=None), "pending-b.json")
    write_payload(pending, cap_drop("s", {"content": "c"}, seq=0.5), "pending-0.json")
    slot_head = slot("s", {"text": "head", "session_id": "s"})  # no seq: -1, first
    write_payload(pending, slot_head, "pending-z.json")
    import_json_spool(spool, pending)
    assert [r.message.get("content", r.message.get("text")) for r in spool.records()] == [
        "head",
        "b",
        "a",
        "c",
    ]


def test_imported_rows_follow_a_sessions_existing_rows(spool, pending):
    spool.append("s", {"content": "live"})
    write_payload(pending, cap_drop("s", {"content": "old"}))
    import_json_spool(spool, pending)
    assert [(r.seq, r.message["content"]) for r in spool.records(session_id="s")] == [
        (1, "live"),
        (2, "old"),
    ]


# -- files left in place ------------------------------------------------------------------------


def test_unusable_files_stay_with_a_warning_naming_them(spool, pending, caplog):
    good = [write_payload(pending, cap_drop("s", {"content": f"ok{i}"}, seq=i)) for i in range(3)]
    bad = {
        "pending-garbage.json": b"\x00\xff not json {",
        "pending-list.json": b"[1, 2]",
        "pending-int.json": b"42",
        "pending-empty.json": b"",
        "pending-nosid.json": json.dumps(
            {
                "session_key": "s",
                "reason": CAP_DROP,
                "ts": TS,
                "seq": 0,
                "data": {"message": {"content": "x"}},
            }
        ).encode(),
        "pending-msgstr.json": json.dumps(cap_drop("s", "not a dict")).encode(),
        "pending-noreason.json": json.dumps({"session_key": "k", "data": {"text": "t"}}).encode(),
        "pending-notext.json": json.dumps(slot("k", {"text": ""})).encode(),
        "pending-nokey.json": json.dumps({"reason": SHUTDOWN, "data": {"text": "t"}}).encode(),
        "pending-nodata.json": json.dumps(slot("k", "text")).encode(),
        "pending-nohistory.json": json.dumps({"reason": AGENT_HISTORY, "session_id": "s"}).encode(),
    }
    for name, content in bad.items():
        write_raw(pending, content, name)
    (pending / "pending-dir.json").mkdir()
    os.mkfifo(pending / "pending-fifo.json")
    os.symlink(good[0], pending / "pending-link.json")
    with caplog.at_level(logging.WARNING, logger="walspool.jsonspool"):
        report = import_json_spool(spool, pending)
    assert report.imported == 3
    assert [r.message["content"] for r in spool.records()] == ["ok0", "ok1", "ok2"]
    stay = sorted([*bad, "pending-dir.json", "pending-fifo.json", "pending-link.json"])
    assert left(pending) == stay
    assert sorted(s.split(":")[0] for s in report.skipped) == stay
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for name in stay:
        assert str(pending / name) in warned
    why = dict(s.split(": ", 1) for s in report.skipped)
    assert why["pending-garbage.json"].startswith("not JSON")
    assert why["pending-list.json"] == "not a JSON object but list"
    assert why["pending-int.json"] == "not a JSON object but int"
    assert why["pending-nosid.json"] == "a transcript_cap_drop file needs data.session_id"
    assert why["pending-dir.json"] == "not a regular file"
    assert why["pending-fifo.json"] == "not a regular file"
    assert why["pending-link.json"] == "cannot read it: it is a symbolic link"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file anyway")
def test_permission_denied_file_stays(spool, pending):
    path = write_payload(pending, cap_drop("s", {"content": "x"}))
    path.chmod(0)
    report = import_json_spool(spool, pending)
    assert report.imported == 0 and path.exists()
    assert report.skipped == [f"{path.name}: cannot read it: Permission denied"]


def test_rows_the_spool_refuses_stay_and_the_rest_of_the_batch_imports(spool_path, pending):
    with walspool.Spool(spool_path, max_payload_bytes=2000) as spool:
        write_payload(pending, cap_drop("s", {"content": "a"}, seq=0))
        too_big = write_payload(pending, cap_drop("s", {"content": "x" * 5000}, seq=1))
        write_payload(pending, cap_drop("s", {"content": "b"}, seq=2))
        surrogate = write_raw(pending, json.dumps(cap_drop("\ud800", {"content": "c"}, seq=3)))
        report = import_json_spool(spool, pending)
        assert [r.message["content"] for r in spool.records()] == ["a", "b"]
    assert report.imported == 2
    assert left(pending) == sorted([too_big.name, surrogate.name])
    why = dict(s.split(": ", 1) for s in report.skipped)
    assert "max_payload_bytes=2000" in why[too_big.name]
    assert "surrogate" in why[surrogate.name]


def test_quarantined_and_temp_files_are_left_alone(spool, pending, caplog):
    bad = write_payload(pending, cap_drop("s", {"content": "q"}), "pending-abc.json.bad")
    tmp = write_payload(pending, cap_drop("s", {"content": "t"}), ".pending-abc_x1.tmp")
    other = write_payload(pending, cap_drop("s", {"content": "o"}), "notes.json")
    write_payload(pending, cap_drop("s", {"content": "ok"}))
    with caplog.at_level(logging.WARNING, logger="walspool.jsonspool"):
        report = import_json_spool(spool, pending)
    assert report.imported == 1 and report.skipped == []
    assert report.quarantined == [bad.name]
    assert left(pending) == sorted([bad.name, tmp.name, other.name])
    assert "quarantined" in caplog.text and str(pending) in caplog.text


# -- removal, repetition, locking ---------------------------------------------------------------


def test_each_file_is_unlinked_only_after_its_row_is_committed(spool, pending, monkeypatch):
    names = {}
    for i in range(40):
        kind = i % 3
        if kind == 0:
            payload = cap_drop(f"s{i % 4}", {"content": f"m{i}"}, seq=i)
        elif kind == 1:
            payload = slot(f"k{i % 4}", {"text": f"m{i}"}, seq=i)
        else:
            payload = agent_history(f"s{i % 4}", [f"m{i}"])
            payload["ts"], payload["seq"] = TS, i
        names[write_payload(pending, payload).name] = f"m{i}"
    real_unlink = os.unlink
    seen: list[str] = []

    def checking_unlink(name: str, *, dir_fd: int | None = None) -> None:
        # a fresh reader sees only committed rows
        with walspool.Spool(spool.path) as other:
            stored = {_text(r.message) for r in other.records()}
        assert names[name] in stored, name
        seen.append(name)
        real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", checking_unlink)
    report = import_json_spool(spool, pending, batch_files=4)
    assert report.imported == 40 and sorted(seen) == sorted(names)
    assert left(pending) == []


def _text(message: Any) -> str:
    if "messages" in message:
        return message["messages"][0]
    return message.get("content") or message.get("text")


def test_a_second_run_imports_nothing(spool, pending):
    for i in range(10):
        write_payload(pending, cap_drop("s", {"content": i}, seq=i))
    assert import_json_spool(spool, pending).imported == 10
    assert import_json_spool(spool, pending) == ImportReport(0, [], {}, [])
    assert spool.stats().rows == 10


def test_a_second_run_keeps_skipping_bad_files_and_takes_new_ones(spool, pending):
    write_raw(pending, "{", "pending-bad.json")
    write_payload(pending, cap_drop("s", {"content": 1}))
    assert import_json_spool(spool, pending).imported == 1
    write_payload(pending, cap_drop("s", {"content": 2}))
    report = import_json_spool(spool, pending)
    assert report.imported == 1 and [s.split(":")[0] for s in report.skipped] == [
        "pending-bad.json"
    ]
    assert [r.message["content"] for r in spool.records()] == [1, 2]


def test_batches_split_at_reason_changes_and_at_batch_files(spool, pending, monkeypatch):
    calls: list[tuple[str, int]] = []
    real = walspool.Spool.append_many

    def counting(self, items, *, reason=CAP_DROP):
        items = list(items)
        calls.append((reason, len(items)))
        return real(self, items, reason=reason)

    monkeypatch.setattr(walspool.Spool, "append_many", counting)
    for i in range(7):
        write_payload(pending, cap_drop("s", {"content": i}, seq=i))
    write_payload(pending, slot("k", {"text": "t"}, seq=100))
    write_payload(pending, cap_drop("s", {"content": 9}, seq=101))
    import_json_spool(spool, pending, batch_files=3)
    assert calls == [(CAP_DROP, 3), (CAP_DROP, 3), (CAP_DROP, 1), (SHUTDOWN, 1), (CAP_DROP, 1)]


def test_progress_reports_done_and_total(spool, pending):
    for i in range(5):
        write_payload(pending, cap_drop("s", {"content": i}, seq=i))
    write_raw(pending, "[]")
    calls: list[tuple[int, int]] = []
    import_json_spool(
        spool, pending, progress=lambda done, total: calls.append((done, total)), batch_files=2
    )
    assert calls[0] == (0, 6) and calls[-1] == (6, 6)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert {t for _, t in calls} == {6}


def test_missing_directory_is_a_clear_error(spool, tmp_path):
    with pytest.raises(walspool.WalspoolError, match="does not exist") as err:
        import_json_spool(spool, tmp_path / "nope")
    assert err.value.path == str(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(walspool.WalspoolError, match="is not a directory"):
        import_json_spool(spool, tmp_path / "file")
    with pytest.raises(walspool.InvalidArgument, match="batch_files"):
        import_json_spool(spool, tmp_path, batch_files=0)


def test_a_second_concurrent_import_is_refused(spool, pending):
    write_payload(pending, cap_drop("s", {"content": 1}))
    fd = os.open(pending, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(walspool.WalspoolError, match="another walspool import"):
            import_json_spool(spool, pending)
    finally:
        os.close(fd)
    assert import_json_spool(spool, pending).imported == 1


# -- crash ----------------------------------------------------------------------------------------

CRASH_CHILD = r"""
import sys, walspool
from walspool.replay.jsonspool import import_json_spool
spool = walspool.Spool(sys.argv[1])
import_json_spool(spool, sys.argv[2], progress=lambda done, total: print(done, flush=True))
print("finished", flush=True)
"""

SESSIONS = 5


def _write_crash_fixture(
    directory: Path, count: int, *, slots: bool = True
) -> dict[str, list[int]]:
    """Cap drops (and slots) over several sessions; returns each session's expected order."""
    expected: dict[str, list[int]] = {}
    for i in range(count):
        session = f"s{i % SESSIONS}"
        # ts in blocks of 50 with seq restarting, names random: the sort key matters
        ts, seq = TS + i // 50, i % 50
        if slots and i % 7 == 3:
            payload = slot(
                session, {"text": "x" * 200, "i": i, "session_id": session}, seq=seq, ts=ts
            )
        else:
            payload = cap_drop(
                session, {"role": "user", "content": "y" * 200, "i": i}, ts=ts, seq=seq
            )
        write_payload(directory, payload)
        expected.setdefault(session, []).append(i)
    return expected


def _kill_after(spool_path: Path, directory: Path, files_done: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(spool_path), str(directory)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        with child_deadline(proc, what="the import child"):
            for line in proc.stdout:
                assert line.strip() != b"finished", "the import ended before the kill"
                if int(line) >= files_done:
                    break
            else:
                raise AssertionError(f"the import child exited ({proc.wait(30)}) early")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_import_loses_nothing_and_duplicates_at_most_a_batch_per_kill(
    spool_path, pending
):
    count = 3000
    expected = _write_crash_fixture(pending, count)
    kills = [400, 700, 500]  # files each restarted child gets through before its kill
    for done in kills:
        _kill_after(spool_path, pending, done)
    with walspool.Spool(spool_path) as spool:
        assert spool.stats().rows >= sum(kills)
        assert import_json_spool(spool, pending).imported > 0
        stored = {s: [r.message["i"] for r in spool.records(session_id=s)] for s in expected}
    assert left(pending) == []
    occurrences = Counter(i for ids in stored.values() for i in ids)
    # none lost
    assert set(occurrences) == set(range(count))
    # a duplicate comes only from a batch committed just before a kill and re-imported
    duplicated = [i for i, n in occurrences.items() if n > 1]
    assert max(occurrences.values()) <= 1 + len(kills)
    assert len(duplicated) <= len(kills) * DEFAULT_BATCH_FILES
    # each session's first occurrences keep drop order
    for session, ids in stored.items():
        first = list(dict.fromkeys(ids))
        assert first == expected[session], session


WINDOW_CHILD = r"""
import os, signal, sys, walspool
from walspool.replay.jsonspool import import_json_spool
spool_path, directory = sys.argv[1], sys.argv[2]
die_at, batch_files = int(sys.argv[3]), int(sys.argv[4])
real_unlink, unlinks = os.unlink, 0

def unlink_then_die(name, *, dir_fd=None):
    global unlinks
    unlinks += 1
    if unlinks == die_at:  # the batch is committed, this file and the rest are not unlinked
        os.kill(os.getpid(), signal.SIGKILL)
    real_unlink(name, dir_fd=dir_fd)

os.unlink = unlink_then_die
import_json_spool(walspool.Spool(spool_path), directory, batch_files=batch_files)
"""


@pytest.mark.parametrize(("batch_files", "die_at", "duplicates"), [(100, 110, 91), (1, 50, 1)])
def test_a_kill_between_commit_and_unlink_duplicates_that_batchs_remaining_files_only(
    spool_path, pending, batch_files, die_at, duplicates
):
    count = 300
    expected = _write_crash_fixture(pending, count, slots=False)  # one reason: full batches
    out = run_python(WINDOW_CHILD, str(spool_path), str(pending), str(die_at), str(batch_files))
    assert out.returncode == -signal.SIGKILL, out.stderr
    with walspool.Spool(spool_path) as spool:
        report = import_json_spool(spool, pending)
        stored = {s: [r.message["i"] for r in spool.records(session_id=s)] for s in expected}
    assert report.imported == count - die_at + 1
    occurrences = Counter(i for ids in stored.values() for i in ids)
    assert set(occurrences) == set(range(count))
    assert sorted(occurrences.values()) == [1] * (count - duplicates) + [2] * duplicates
    for session, ids in stored.items():
        assert list(dict.fromkeys(ids)) == expected[session], session


# -- exactly once (source_key): what an interrupted import committed ---------------------

SOURCE_KEY = "_walspool_import"
MiB = 1024 * 1024


def interrupted_import(spool_path: Path, directory: Path, big: list[int], filler: int) -> None:
    """What a killed ``source_key`` import leaves: 12 rows committed, each carrying its
    file's name (rows ``big`` with ``filler`` bytes more), 3 of their files not removed
    yet, the journal, and a file it had not reached."""
    with walspool.Spool(spool_path) as spool:
        spool.append_many(
            [("s", {"role": "user", "content": str(n), SOURCE_KEY: f"pending-{n}.json"})
             for n in range(12)]
        )  # fmt: skip
    conn = apsw.Connection(str(spool_path))
    try:
        with conn:
            conn.execute(
                "UPDATE records SET payload = json_set(payload, '$.junk', printf('%.*c', ?, 'x')) "
                "WHERE seq - 1 IN (SELECT value FROM json_each(?))",
                (filler, json.dumps(big)),
            )
    finally:
        conn.close()
    for n in (0, 5, 11):
        write_payload(
            directory, cap_drop("s", {"role": "user", "content": str(n)}), f"pending-{n}.json"
        )
    new = cap_drop("s", {"role": "user", "content": "new"}, ts=TS + 1)
    write_payload(directory, new, "pending-new.json")
    write_raw(directory, "", ".walspool-import")


def test_files_an_interrupted_import_committed_are_removed_not_imported_again(spool_path, pending):
    """Names carried by payloads of any size are found (those over
    ``paging.SCAN_JSON_BYTES`` each by a statement of its own)."""
    interrupted_import(spool_path, pending, [5, 6], 3 * MiB // 2)
    with walspool.Spool(spool_path) as spool:
        report = import_json_spool(spool, pending, source_key=SOURCE_KEY)
        contents = [r.message["content"] for r in spool.records()]
    assert (report.imported, report.skipped, left(pending)) == (4, [], [])
    assert contents == [str(n) for n in range(12)] + ["new"]


#: An import of ARGV[2] into the spool ARGV[1] with a source key; prints what it
#: imported and the process's peak RSS (``VmHWM``) once it is done.
IMPORT_CHILD = r"""
import sys, walspool
from walspool.replay.jsonspool import import_json_spool
with walspool.Spool(sys.argv[1]) as spool:
    report = import_json_spool(spool, sys.argv[2], source_key=sys.argv[3])
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(peak, report.imported, report.skipped)
"""


def test_finding_what_an_interrupted_import_committed_holds_one_large_payload_at_a_time(
    tmp_path,
):
    """12 committed rows of 32 MiB: the import after the kill peaks within three such
    payloads (12 pages) of the same import over small rows (before: SQLite's JSON cache
    kept the last few payloads' parses through the scan, 350 MiB)."""
    peaks = []
    for filler in (0, 32 * MiB):
        directory = tmp_path / f"pending-{filler}"
        directory.mkdir(mode=0o700)
        spool_path = tmp_path / f"spool-{filler}" / "spool.db"
        interrupted_import(spool_path, directory, list(range(12)), filler)
        done = run_python(IMPORT_CHILD, str(spool_path), str(directory), SOURCE_KEY, timeout=600)
        assert done.returncode == 0, done.stderr
        peak, imported = done.stdout.split(" ", 1)
        assert imported == "4 []\n" and left(directory) == []
        peaks.append(int(peak))
    small, large = peaks
    assert large < small + 3 * 32 * MiB, (small // MiB, large // MiB)
