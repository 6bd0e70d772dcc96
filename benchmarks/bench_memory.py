"""Peak memory of the paths bounded by bytes or by a page (issues 15, 43), each measured
in a child process.

Every case runs in a fresh process and reports its peak RSS growth (the kernel's
``VmHWM`` in that process), next to the bound the code now holds and the figure the
issue reported before the fix; each asserts its bound. A bound counts the payload
copies a path holds at once (a page or batch as read, decoded, encoded, bound by
SQLite), so it does not grow with the number of rows or files.

* 4, the writer's queue: 60 ``submit()`` calls of ~60 MiB payloads from one thread
  while the writer is held up (the child holds the writer's commit lock until the
  producer blocks, then lets it go). Bound: ``QUEUE_BYTES`` queued plus one group
  taken from the queue (``writer.py``'s docstring), plus the copies of the one
  payload in flight. Before: 3.6 GiB, all 60 accepted at once. Then the RSS still held
  while the writer idles after its last group (before: 1.2 GiB): one payload, the
  last row's, which SQLite keeps bound to the cached INSERT until the next insert.
* 5, read paths: ``walspool show``, ``export`` and ``replay`` (into a real
  hermes-agent 0.19.0 ``state.db``) on a spool of 24 rows of ~60 MiB. Bound: a few
  copies of one page (``PAGE_BYTES`` of payloads plus one payload, here one row),
  whatever the row count. Before: 2.9, 1.6 and 3.8 GiB. ``replay`` failed it at first
  (2 GiB): its count of each stream's rows and bad payloads ran
  ``sum(NOT json_valid(payload))`` in a ``GROUP BY`` (``cli/_dryrun.py``
  ``STREAMS_SQL``), whose temp b-tree carried every row's payload; the payloads are
  now kept out of it.
  ``show`` also on rows whose 60 MiB are words in ``content`` (its preview): a prefix
  is previewed, never the whole text split into words (before: 1.7 GiB for 80 MiB).
* 6, ``walspool import-json``: a 2 GiB sparse ``pending-*.json`` (refused from its
  ``fstat`` size, left in place, reported; before: 2.6 GiB) and 16 files of ~60 MiB
  (batches end at ``BATCH_BYTES``; before: one batch held all 16).

* 7, ``walspool ls`` (table and ``--json``) and ``watch --json`` on 300,000 sessions of
  one row each: a listing is read a line at a time, laid out a page of lines at a time
  and held as text up to ``JSON_IN_MEMORY`` before a temporary file takes it. Before:
  353 MiB for ``ls`` (every stream's line in memory, then sorted), growing with the
  number of sessions.

A command's growth is its peak RSS less that of the same command on a one-row input
(the interpreter and its imports). The 60 MiB of each row sit in its message's
``api_content``, which hermes stores but does not index: in ``content`` its two FTS5
tables take ~24 s, ~0.9 GiB of RSS and ~250 MB of ``state.db`` per row, which would
measure hermes rather than walspool. Disk: at most ~4 GB at a time; every case
removes its files when it ends. ``python benchmarks/bench_memory.py queue SPOOL`` is
case 4's child, ``... command PEAK_FILE ARGS`` runs ``python -m walspool ARGS`` for
the others and writes its peak.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from _rss import peak_rss, reset_peak_rss
from report import record

import walspool
from walspool.cli import _streams
from walspool.replay import jsonspool
from walspool.store import codec, paging, spool, writer

MIB = 2**20
GIB = 2**30
#: Text in each big message: with the JSON around it, a payload of ~60 MiB.
BIG = 60 * MIB
SUBMITS = 60
ROWS = 24
FILES = 16
SPARSE = 2 * GIB
#: Seconds any one child may take.
CHILD_TIMEOUT = 600
GROUP = "memory"
#: (case, peak RSS growth, bound it holds, figure before the fix), for the summary.
FIGURES: list[tuple[str, str, str, str]] = []


def message(i: int, size: int = BIG) -> dict[str, Any]:
    """A user message whose ``api_content`` carries ``size`` bytes (distinct per ``i``)."""
    text = f"{i:08d}" + "x" * (size - 8)
    return {"role": "user", "content": f"row {i}", "api_content": text, "timestamp": 1.8e9 + i}


def mib(n: int) -> str:
    return f"{round(n / MIB):,} MiB"  # round(): never "-0"


class BoundExceeded(AssertionError):
    """A figure over the bound its path should hold."""


def within(what: str, measured: int, bound: int) -> None:
    if measured > bound:
        raise BoundExceeded(f"{what}: {mib(measured)} over its bound of {mib(bound)}")


# -- children ------------------------------------------------------------------------


def command(*argv: str | Path, stdout: Path | None = None) -> tuple[int, int, str]:
    """Run ``walspool ARGV`` in a child process; (exit status, peak RSS, stdout text).

    The child is ``python -m walspool`` run by this file's ``command`` mode, which
    writes its ``VmHWM`` when it exits. (``ru_maxrss`` from ``wait4`` would not do: at
    ``exec`` Linux folds the RSS of the process it replaces, this one's copy, into the
    child's.) stdout goes to ``stdout`` (read back) or to ``/dev/null``: ``show`` and
    ``export`` write the spool's whole size.
    """
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        args = [sys.executable, __file__, "command", str(peak_file), *map(str, argv)]
        with open(stdout or os.devnull, "wb") as out:
            proc = subprocess.run(
                args, stdout=out, stderr=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT
            )
        assert proc.returncode in (0, 3), f"{argv}: exit {proc.returncode}: {proc.stderr}"
        peak = int(peak_file.read_text())
    text = stdout.read_text() if stdout is not None else ""
    return proc.returncode, peak, text


def growth(big: tuple[int, int, str], small: tuple[int, int, str]) -> int:
    """Peak RSS of a command on the big input less that on a one-row input."""
    return big[1] - small[1]


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, emptied when the case ends: pytest keeps old runs' directories."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def summary(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the cases' figures as a table when the module ends."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not FIGURES:
        return
    reporter.write_line("")
    reporter.write_line("| case | peak RSS growth | bound it holds | before the fix |")
    reporter.write_line("|---|---:|---|---:|")
    for row in FIGURES:
        reporter.write_line("| " + " | ".join(row) + " |")


def report(
    benchmark: Any,
    name: str,
    case: str,
    measured: int,
    bound: str,
    before: str,
    msgs: int,
    **extra: Any,
) -> None:
    """Keep a case's figures: pytest-benchmark's extra_info, the run's summary, FIGURES."""
    benchmark.extra_info["peak_rss_growth_mib"] = measured / MIB
    benchmark.extra_info.update(extra)
    median = benchmark.stats.stats.median
    record(name, GROUP, msgs, median, peak_rss_growth_mib=measured / MIB)
    FIGURES.append((case, mib(measured), bound, before))
    print(f"\n{case}: {mib(measured)} (bound: {bound}; before: {before})")


# -- 4: the writer's queue ---------------------------------------------------------------

#: Copies of the one payload in flight besides what the queue and the group hold: the
#: producer's message, its encoded bytes and row text (``Spool._row``), and SQLite's
#: bound value and record while the writer inserts it.
IN_FLIGHT_COPIES = 5


def queue_child(path: Path) -> dict[str, int]:
    """Case 4, run in its own process: submit while the writer is held; RSS figures."""
    with walspool.Spool(path, durability="normal") as s:
        s.append("warm", message(0, 1024))  # imports, caches, first pages
        payload = len(codec.encode(message(0)))
        gc.collect()
        base = reset_peak_rss()
        w = s._writer
        futures: list[Future[Any]] = []

        def produce() -> None:
            for i in range(SUBMITS):
                futures.append(s.submit("s", message(i)))

        w._commit_lock.acquire()
        producer = threading.Thread(target=produce)
        producer.start()
        deadline = time.monotonic() + CHILD_TIMEOUT / 2
        with w._cond:
            # Until the queue is full and the producer waits in ``put`` for room (the
            # writer thread waits for the commit lock, not on this condition).
            while w._room_for(BIG) or not w._cond._waiters:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "the producer never blocked"
                w._cond.wait(0.01)
            accepted = len(futures)
            queued_bytes = w._pending_bytes
        blocked = peak_rss() - base
        w._commit_lock.release()
        producer.join(CHILD_TIMEOUT / 2)
        assert not producer.is_alive(), "the producer never finished"
        receipts = [f.result(CHILD_TIMEOUT / 2) for f in futures]
        peak = peak_rss() - base
        futures.clear()
        gc.collect()
        idle = reset_peak_rss() - base  # the RSS now
        assert len(receipts) == SUBMITS
    return {
        "payload_bytes": payload,
        "accepted_while_held": accepted,
        "queued_bytes_while_held": queued_bytes,
        "blocked_growth": blocked,
        "peak_growth": peak,
        "idle_growth": idle,
    }


@pytest.mark.benchmark(group=GROUP)
def test_writer_queue_bounded_by_bytes(benchmark: Any, scratch: Path) -> None:
    args = [sys.executable, __file__, "queue", str(scratch / "spool" / "spool.db")]
    result: dict[str, Any] = {}

    def run() -> None:
        out = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        assert out.returncode == 0, out.stderr
        result.update(json.loads(out.stdout))

    benchmark.pedantic(run, rounds=1)
    payload = result["payload_bytes"]
    group = writer.QUEUE_BYTES  # a group is taken from a queue that held at most this
    bound = writer.QUEUE_BYTES + group + IN_FLIGHT_COPIES * payload
    held_bound = writer.QUEUE_BYTES + IN_FLIGHT_COPIES * payload
    idle_bound = payload + 8 * MIB
    report(
        benchmark,
        "test_writer_queue_bounded_by_bytes",
        f"4: {SUBMITS} submit() of 60 MiB, writer held up then let go",
        result["peak_growth"],
        f"QUEUE_BYTES {mib(writer.QUEUE_BYTES)} + one group (<= QUEUE_BYTES) + "
        f"{IN_FLIGHT_COPIES} copies of the payload in flight = {mib(bound)}",
        "3.6 GiB",
        msgs=SUBMITS,
        **result,
    )
    FIGURES.append(
        (
            f"4: same, while held up ({result['accepted_while_held']} accepted, "
            f"{mib(result['queued_bytes_while_held'])} queued, the producer blocked)",
            mib(result["blocked_growth"]),
            f"QUEUE_BYTES + {IN_FLIGHT_COPIES} copies in flight = {mib(held_bound)}",
            f"3.6 GiB ({SUBMITS} accepted)",
        )
    )
    FIGURES.append(
        (
            "4: held while the writer idles after its last group",
            mib(result["idle_growth"]),
            f"one payload (the last, bound to the cached INSERT) + 8 MiB = {mib(idle_bound)}",
            "1.2 GiB",
        )
    )
    print(json.dumps(result))
    within("bytes queued while held up", result["queued_bytes_while_held"], writer.QUEUE_BYTES)
    within("peak growth while held up", result["blocked_growth"], held_bound)
    within("peak growth", result["peak_growth"], bound)
    within("RSS held while idle", result["idle_growth"], idle_bound)


# -- 5: read paths page by bytes ---------------------------------------------------------

#: Copies of a page each command holds at once: the page being read (SQLite's copy of
#: its row, its text in Python) and the one before it, still referenced until the next
#: arrives (its text, its decoded message); then export's JSON line, and replay's
#: ``append_message`` binding and record in state.db.
READ_COPIES = {"show": 5, "export": 6, "replay": 7}


@pytest.fixture(scope="module")
def big_spool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A spool of ROWS rows of ~60 MiB in session "s", a one-row spool, and a state.db
    with session "s" for each (hermes-agent 0.19.0)."""
    hermes_state = pytest.importorskip("hermes_state")
    root = tmp_path_factory.mktemp("read")
    paths = {
        "big": root / "big" / "spool.db",
        "small": root / "small" / "spool.db",
        "big_state": root / "big_state.db",
        "small_state": root / "small_state.db",
    }
    with walspool.Spool(paths["big"], durability="normal") as s:
        for i in range(ROWS):
            s.append("s", message(i))
    with walspool.Spool(paths["small"], durability="normal") as s:
        s.append("s", message(0, 1024))
    for name in ("big_state", "small_state"):
        db = hermes_state.SessionDB(db_path=paths[name])
        db.create_session("s", "telegram")
        db.close()
    yield paths
    shutil.rmtree(root, ignore_errors=True)


def read_case(
    benchmark: Any,
    name: str,
    paths: dict[str, Path],
    argv: list[str],
    before: str,
    stdout: Path | None = None,
) -> tuple[str, int, int]:
    """Run ``walspool ARGV`` (``{spool}``/``{state}`` filled in) on the one-row spool,
    then on the big one, and report its growth. Returns the big run's stdout (kept
    when ``stdout`` is given), its growth and its bound."""

    def fill(kind: str) -> list[str | Path]:
        state = paths[f"{kind}_state"]
        return [{"{spool}": paths[kind], "{state}": state}.get(a, a) for a in argv]

    small = command(*fill("small"))
    out: dict[str, Any] = {}
    benchmark.pedantic(lambda: out.update(big=command(*fill("big"), stdout=stdout)), rounds=1)
    measured = growth(out["big"], small)
    page = paging.PAGE_BYTES + BIG + 128
    copies = READ_COPIES[argv[0]]
    bound = copies * page
    report(
        benchmark,
        name,
        f"5: walspool {argv[0]}, {ROWS} rows of 60 MiB",
        measured,
        f"{copies} x one page (PAGE_BYTES 8 MiB + one payload) = {mib(bound)}",
        before,
        msgs=ROWS,
        peak_rss_mib=out["big"][1] / MIB,
        baseline_peak_rss_mib=small[1] / MIB,
    )
    return out["big"][2], measured, bound


@pytest.mark.benchmark(group=GROUP)
def test_show_pages_by_bytes(benchmark: Any, big_spool: dict[str, Path]) -> None:
    name, argv = "test_show_pages_by_bytes", ["show", "{spool}", "s"]
    _, measured, bound = read_case(benchmark, name, big_spool, argv, "2.9 GiB")
    within("walspool show", measured, bound)


@pytest.fixture(scope="module")
def wordy_spool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """``big_spool``'s shape, but each row's 60 MiB in its ``content``, as words: what
    ``show`` previews (issue 43: it split the whole text, 1.7 GiB for 80 MiB)."""
    root = tmp_path_factory.mktemp("wordy")
    paths = {"big": root / "big" / "spool.db", "small": root / "small" / "spool.db"}
    words = "w " * (BIG // 2)
    with walspool.Spool(paths["big"], durability="normal") as s:
        for i in range(4):
            s.append("s", {"role": "user", "content": f"{i} {words}"})
    with walspool.Spool(paths["small"], durability="normal") as s:
        s.append("s", {"role": "user", "content": "w " * 512})
    paths["big_state"] = paths["small_state"] = root / "unused"
    yield paths
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.benchmark(group=GROUP)
def test_show_previews_a_prefix_of_each_message(
    benchmark: Any, wordy_spool: dict[str, Path]
) -> None:
    name, argv = "test_show_previews_a_prefix_of_each_message", ["show", "{spool}", "s"]
    _, measured, bound = read_case(benchmark, name, wordy_spool, argv, "1.7 GiB (80 MiB)")
    within("walspool show (60 MiB of words a row)", measured, bound)


@pytest.mark.benchmark(group=GROUP)
def test_export_pages_by_bytes(benchmark: Any, big_spool: dict[str, Path]) -> None:
    name, argv = "test_export_pages_by_bytes", ["export", "{spool}"]
    _, measured, bound = read_case(benchmark, name, big_spool, argv, "1.6 GiB")
    within("walspool export", measured, bound)


@pytest.mark.benchmark(group=GROUP)
def test_replay_batches_by_bytes(benchmark: Any, big_spool: dict[str, Path]) -> None:
    # Last of the three: it moves the rows out of the spool.
    argv = ["replay", "{spool}", "--into", "{state}", "--json"]
    out = big_spool["big_state"].with_name("replay.json")
    name = "test_replay_batches_by_bytes"
    text, measured, bound = read_case(benchmark, name, big_spool, argv, "3.8 GiB", out)
    assert json.loads(text)["moved"] == ROWS
    within("walspool replay", measured, bound)


# -- 6: import-json checks sizes and batches by bytes ---------------------------------------


def pending_file(directory: Path, name: str, payload: dict[str, Any]) -> Path:
    """A file as upstream's gateway writes one (``json.dump``, indent 2), mode 0600."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, ensure_ascii=False)
    return path


def cap_drop(i: int, size: int) -> dict[str, Any]:
    data = {"session_id": "s", "message": message(i, size)}
    return {"session_key": "s", "reason": walspool.CAP_DROP, "ts": 1.8e9, "seq": i, "data": data}


def import_case(
    scratch: Path, label: str, files: list[tuple[str, int | None]]
) -> tuple[int, int, str]:
    """``walspool import-json`` of a new directory ``label`` holding ``files``: (name,
    text size), or (name, None) for a sparse file of SPARSE bytes that is not JSON."""
    directory = scratch / label
    directory.mkdir(mode=0o700)
    for i, (name, size) in enumerate(files):
        if size is None:
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, SPARSE)
            os.close(fd)
        else:
            pending_file(directory, name, cap_drop(i, size))
    spool_path = scratch / f"{label}-spool" / "spool.db"
    out = scratch / f"{label}.json"
    return command("import-json", spool_path, directory, "--json", stdout=out)


@pytest.mark.benchmark(group=GROUP)
def test_import_json_refuses_a_sparse_file_by_size(benchmark: Any, scratch: Path) -> None:
    small = import_case(scratch, "small", [("pending-small.json", 1024)])
    out: dict[str, Any] = {}
    sparse = [("pending-big.json", None)]
    benchmark.pedantic(lambda: out.update(big=import_case(scratch, "sparse", sparse)), rounds=1)
    rc, _, text = out["big"]
    result = json.loads(text)
    assert rc == 3 and result["imported"] == 0
    assert [line.split(":")[0] for line in result["skipped"]] == ["pending-big.json"]
    assert (Path(result["directory"]) / "pending-big.json").stat().st_size == SPARSE
    measured = growth(out["big"], small)
    bound = 16 * MIB
    report(
        benchmark,
        "test_import_json_refuses_a_sparse_file_by_size",
        "6: import-json, a 2 GiB sparse file (left in place, reported)",
        measured,
        "nothing read: refused by fstat over 2 x max_payload_bytes + 64 KiB "
        f"({mib(2 * spool.DEFAULT_MAX_PAYLOAD_BYTES + 64 * 1024)}); asserted < {mib(bound)}",
        "2.6 GiB",
        msgs=1,
        skipped=result["skipped"],
    )
    within("import-json of a sparse file", measured, bound)


#: Copies of a batch import-json holds at once: the next file as read and parsed (it is
#: read before the batch commits), the batch's parsed messages, their encoded rows and
#: row text, and SQLite's bound value and record.
IMPORT_COPIES = 7


@pytest.mark.benchmark(group=GROUP)
def test_import_json_batches_by_bytes(benchmark: Any, scratch: Path) -> None:
    small = import_case(scratch, "small", [("pending-small.json", 1024)])
    out: dict[str, Any] = {}
    files: list[tuple[str, int | None]] = [(f"pending-{i:02d}.json", BIG) for i in range(FILES)]
    benchmark.pedantic(lambda: out.update(big=import_case(scratch, "files", files)), rounds=1)
    rc, _, text = out["big"]
    result = json.loads(text)
    assert (rc, result["imported"], result["skipped"]) == (0, FILES, [])
    measured = growth(out["big"], small)
    file_bytes = BIG + 512
    batch = jsonspool.BATCH_BYTES + file_bytes  # a batch ends past BATCH_BYTES
    bound = IMPORT_COPIES * batch
    report(
        benchmark,
        "test_import_json_batches_by_bytes",
        f"6: import-json, {FILES} files of 60 MiB",
        measured,
        f"one batch (BATCH_BYTES 16 MiB + one file) x {IMPORT_COPIES} copies = {mib(bound)}",
        f"the whole batch ({FILES} x 60 MiB = {mib(FILES * file_bytes)} of text; not measured)",
        msgs=FILES,
    )
    within("import-json of 16 files", measured, bound)


# -- 7: ls and watch hold a page of streams, whatever the number of sessions ------------

#: Sessions of one row each in ``many_sessions``' spool (issue 43: 353 MiB for ``ls``).
SESSIONS = 300_000
#: What a listing may hold besides the interpreter: its text until the reading is done
#: (``JSON_IN_MEMORY``, then a temporary file), a page of lines (``ls.PAGE_LINES``), or
#: ``watch``'s 500, and SQLite's page cache and sorter (2 MiB each by default).
LISTING_BOUND = _streams.JSON_IN_MEMORY + 24 * MIB


@pytest.fixture(scope="module")
def many_sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A spool of ``SESSIONS`` sessions of one small row each, and a one-row spool."""
    root = tmp_path_factory.mktemp("sessions")
    paths = {"big": root / "big" / "spool.db", "small": root / "small" / "spool.db"}
    with walspool.Spool(paths["big"], durability="normal") as s:
        for start in range(0, SESSIONS, 10_000):
            s.append_many(
                (f"session-{i:07d}", {"role": "user", "content": f"m {i}"})
                for i in range(start, start + 10_000)
            )
    with walspool.Spool(paths["small"], durability="normal") as s:
        s.append("session-0000000", {"role": "user", "content": "m 0"})
    paths["big_state"] = paths["small_state"] = root / "unused"
    yield paths
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    "argv", [["ls", "{spool}"], ["ls", "{spool}", "--json"], ["watch", "{spool}", "--json"]]
)
@pytest.mark.benchmark(group=GROUP)
def test_listings_hold_a_page_of_streams(
    benchmark: Any, many_sessions: dict[str, Path], argv: list[str]
) -> None:
    """``ls`` (table and ``--json``) and ``watch --json`` (one reading when stdout is not a
    terminal) on ``SESSIONS`` sessions: each lists or counts every one of them."""
    small = command(*[{"{spool}": many_sessions["small"]}.get(a, a) for a in argv])
    out = many_sessions["big"].with_name("listing.txt")
    big: dict[str, Any] = {}
    filled = [{"{spool}": many_sessions["big"]}.get(a, a) for a in argv]
    benchmark.pedantic(lambda: big.update(run=command(*filled, stdout=out)), rounds=1)
    text = big["run"][2]
    if argv[0] == "watch":
        assert json.loads(text)["sessions"] == SESSIONS
    elif "--json" in argv:
        assert len(json.loads(text)) == SESSIONS
    else:
        assert len(text.splitlines()) == SESSIONS + 1  # and the header
    measured = growth(big["run"], small)
    what = " ".join(argv[:1] + argv[2:])
    report(
        benchmark,
        f"test_listings_hold_a_page_of_streams[{what}]",
        f"7: walspool {what}, {SESSIONS:,} sessions of one row",
        measured,
        f"JSON_IN_MEMORY (8 MiB) of text + 24 MiB (a page of lines, SQLite) = {mib(LISTING_BOUND)}",
        "353 MiB (ls)",
        msgs=SESSIONS,
    )
    within(f"walspool {what}", measured, LISTING_BOUND)


def command_child(peak_file: Path, argv: list[str]) -> None:
    """``python -m walspool ARGV``, then this process's peak RSS into ``peak_file``."""
    atexit.register(lambda: peak_file.write_text(str(peak_rss())))
    sys.argv = ["walspool", *argv]
    runpy.run_module("walspool", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["queue"] and len(sys.argv) == 3:
        print(json.dumps(queue_child(Path(sys.argv[2]))))
    elif sys.argv[1:2] == ["command"] and len(sys.argv) > 3:
        command_child(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(
            "usage: python benchmarks/bench_memory.py queue SPOOL_PATH\n"
            "       python benchmarks/bench_memory.py command PEAK_FILE WALSPOOL_ARGS..."
        )
