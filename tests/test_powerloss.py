"""Power loss: every crash state a disk may be left in, opened again with the real VFS.

Each workload runs once on real files through ``_powervfs.PowerVFS``, which logs
every write, truncate, sync, directory entry and directory sync under the test's
directory. Then, for each cut point (power lost just before operation N of that log)
and several sampled crash states per point (only what was synced; everything, as a
killed process leaves it; a random prefix; random per operation, torn sectors
included: see ``_powervfs``), the files are laid out in a fresh directory and opened
with the real unix VFS through ``walspool.Spool``. For every state:

* the spool opens, and is not moved aside as damaged (never silently emptied either:
  see the next points); ``PRAGMA integrity_check`` is ``ok``;
* every row in it is one the workload appended, under the seq its receipt gave;
* ``durability="full"``: every append acknowledged before the cut is there, with its
  seq, and the next append of its session gets a higher seq;
* ``durability="normal"``: what is missing of the acknowledged appends is a tail (no
  acknowledged append is missing while a later one is there), counted as lost;
* a replay cut anywhere, then run again on the recovered spool (into a sink that kept
  exactly the writes it committed before the cut), delivers every message exactly
  once, in seq order per session, and leaves the spool empty (``"full"``).

Workloads: a stream of appends (lone ``append``, concurrent ``submit`` grouped into
one commit, threads appending at once, ``append_many``), a replay (its takes and
deletes), checkpoints (``wal_checkpoint(TRUNCATE)`` and ``PASSIVE`` from a second
connection, with appends between, and the checkpoint ``close`` runs), upgrades from
schema 1 and 2, and the first open of a new spool in a directory that does not yet
exist. The full matrix (every cut point) is marked slow; the default run takes a few
cut points per workload. Each test prints its counts; the module prints a total.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import MemorySink, terminal_line
from _old_schemas import DOWNGRADE_TO_V1_SQL, make_v2_spool
from _powervfs import CrashState, PowerVFS, recording

import walspool
import walspool.store.files
from walspool.replay.replayer import Replayer

Key = tuple[str, int]  # (session_id, seq)

#: Crash states sampled per cut point in the full matrix (0-2 fixed, then random).
SAMPLES = 6
#: A log longer than this is cut at sampled points (see ``every_cut``), every STRIDE-th.
LONG_LOG = 600
STRIDE = 50
#: Cut points per workload in the default (quick) run.
QUICK_CUTS = 6
#: Bound on any one wait for a thread of a workload.
WAIT = 60.0

#: Where crash states are laid out and opened: tmpfs if there is one.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

#: Counts over the module by durability, printed at its end.
TOTALS: dict[str, Counter[str]] = {"full": Counter(), "normal": Counter()}


@pytest.fixture(scope="module", autouse=True)
def power_summary(request: pytest.FixtureRequest):
    yield
    for durability, counts in TOTALS.items():
        if counts:
            report(request, f"power-loss matrix, durability={durability!r}, all tests run", counts)


def report(request: pytest.FixtureRequest, title: str, counts: Counter[str]) -> None:
    """Print a counts line to the terminal, whatever the capture setting."""
    terminal_line(
        request.config, f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )


def message(session: str, i: int, pad: int = 420) -> dict[str, Any]:
    """About 500 bytes of JSON by default, as the design's typical message."""
    return {"role": "user", "content": f"{session}-{i}", "pad": "x" * pad}


# -- workloads ---------------------------------------------------------------------


@dataclass
class Workload:
    """One recorded run: its log, what it appended and when each was acknowledged."""

    name: str
    durability: str
    spool: str  # the spool's path relative to the recorded root
    vfs: PowerVFS
    #: Every row that may be in the spool: (session, seq) -> message content.
    known: dict[Key, str] = field(default_factory=dict)
    #: Rows on the disk before the log began: present at every cut.
    baseline: set[Key] = field(default_factory=set)
    #: Each row's id: commit order (ids only grow while nothing is deleted).
    ids: dict[Key, int] = field(default_factory=dict)
    replay: bool = False

    def acked_before(self, cut: int) -> dict[Key, int]:
        """Appends acknowledged before operation ``cut``, with their log positions."""
        acked = dict.fromkeys(self.baseline, -1)
        for mark in self.vfs.marks:
            if mark.kind == "ack" and mark.at <= cut:
                acked[mark.value] = mark.at
        return acked


class Recorder:
    """Appends through a spool, noting each acknowledgement in the VFS log."""

    def __init__(self, workload: Workload, spool: walspool.Spool) -> None:
        self.w = workload
        self.spool = spool
        self.lock = threading.Lock()

    def ack(self, receipt: walspool.Receipt, msg: dict[str, Any]) -> None:
        key = (receipt.session_id, receipt.seq)
        self.w.vfs.mark("ack", key)
        with self.lock:
            self.w.known[key] = msg["content"]
            self.w.ids[key] = receipt.id

    def append(self, session: str, i: int) -> None:
        msg = message(session, i)
        self.ack(self.spool.append(session, msg), msg)

    def append_many(self, items: list[tuple[str, int]], pad: int = 420) -> None:
        msgs = [(s, message(s, i, pad)) for s, i in items]
        for receipt, (_, msg) in zip(self.spool.append_many(msgs), msgs, strict=True):
            self.ack(receipt, msg)

    def submit_group(self, items: list[tuple[str, int]]) -> None:
        """Submit all, then wait: the writer commits them together."""
        done = []
        for s, i in items:
            msg = message(s, i)
            future = self.spool.submit(s, msg)
            future.add_done_callback(lambda f, msg=msg: self.ack(f.result(), msg))
            done.append(future)
        for future in done:
            future.result(timeout=WAIT)

    def threads(self, sessions: list[str], each: int, start: int) -> None:
        """One thread per session, all appending at once."""
        barrier = threading.Barrier(len(sessions))
        errors: list[BaseException] = []

        def run(session: str) -> None:
            try:
                barrier.wait(WAIT)
                for i in range(start, start + each):
                    self.append(session, i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(s,)) for s in sessions]
        for t in workers:
            t.start()
        for t in workers:
            t.join(WAIT)
            assert not t.is_alive(), "an appending thread hung"
        assert not errors, errors


def seed_spool(path: Path, durability: str, rows: list[tuple[str, int]]) -> dict[Key, str]:
    """A spool holding ``rows``, closed (on the disk before the log begins)."""
    known = {}
    with walspool.Spool(path, durability=durability) as spool:
        msgs = [(s, message(s, i)) for s, i in rows]
        for receipt, (_, msg) in zip(spool.append_many(msgs), msgs, strict=True):
            known[(receipt.session_id, receipt.seq)] = msg["content"]
    return known


def begin(root: Path, name: str, durability: str, spool: str, known: dict[Key, str]) -> Workload:
    vfs = PowerVFS(root, seed=hash_seed(name, durability))
    return Workload(name, durability, spool, vfs, dict(known), set(known))


def hash_seed(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256(":".join(parts).encode()).digest()[:4], "big")


def appends(root: Path, durability: str) -> Workload:
    path = root / "spool" / "spool.db"
    known = seed_spool(path, durability, [("a", 0), ("b", 0)])
    w = begin(root, "appends", durability, "spool/spool.db", known)
    with recording(w.vfs), walspool.Spool(path, durability=durability) as spool:
        r = Recorder(w, spool)
        for i in range(1, 4):
            r.append("a", i)
        r.submit_group([(s, i) for i in range(1, 4) for s in ("b", "c")])
        r.threads(["d", "e", "f"], each=2, start=0)
        r.append_many([("a", 10), ("b", 10), ("g", 0), ("a", 11)])
        r.append("g", 1)
        r.append_many([("c", 10), ("c", 11)])
    return w


def first_open(root: Path, durability: str) -> Workload:
    w = begin(root, "first_open", durability, "home/spool/spool.db", {})
    with (
        recording(w.vfs),
        walspool.Spool(root / "home" / "spool" / "spool.db", durability=durability) as spool,
    ):
        r = Recorder(w, spool)
        r.append("a", 0)
        r.append("a", 1)
        r.append_many([("b", 0), ("a", 2)])
    return w


def checkpoints(root: Path, durability: str) -> Workload:
    path = root / "spool" / "spool.db"
    known = seed_spool(path, durability, [(s, i) for i in range(8) for s in ("a", "b")])
    w = begin(root, "checkpoint", durability, "spool/spool.db", known)
    with recording(w.vfs), walspool.Spool(path, durability=durability) as spool:
        r = Recorder(w, spool)
        other = apsw.Connection(str(path))  # as an operator's sqlite3 shell would
        try:
            r.append("a", 100)
            r.append("c", 0)
            w.vfs.mark("phase", "checkpoint(TRUNCATE)")
            assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0] == 0
            r.append("a", 101)
            r.append_many([("b", 100), ("c", 1)])
            w.vfs.mark("phase", "checkpoint(PASSIVE)")
            other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            r.append("c", 2)  # restarts the WAL from its start: new salts
            r.append("a", 102)
        finally:
            other.close()
        w.vfs.mark("phase", "close")
    return w


def autocheckpoint(root: Path, durability: str) -> Workload:
    """Commits that take the WAL past SQLite's 1000 pages: the commit checkpoints."""
    path = root / "spool" / "spool.db"
    known = seed_spool(path, durability, [("a", 0)])
    w = begin(root, "autocheckpoint", durability, "spool/spool.db", known)
    with recording(w.vfs), walspool.Spool(path, durability=durability) as spool:
        r = Recorder(w, spool)
        for batch in range(6):
            r.append_many([("b", batch * 100 + i) for i in range(100)], pad=8000)
        w.vfs.mark("phase", "lone appends after the checkpoint")
        checkpointed = len(w.vfs.ops)
        r.append("a", 1)  # restarts the WAL over the checkpointed frames
        r.append("a", 2)
    db = w.vfs._current[str(path.resolve())]
    assert any(op.kind == "sync" and op.node == db for op in w.vfs.ops[:checkpointed]), (
        "no commit checkpointed"
    )
    return w


def replay(root: Path, durability: str) -> Workload:
    path = root / "spool" / "spool.db"
    known = seed_spool(path, durability, [(s, i) for i in range(5) for s in ("a", "b", "c")])
    w = begin(root, "replay", durability, "spool/spool.db", known)
    w.replay = True
    sink = MarkingSink(w.vfs)
    with recording(w.vfs), walspool.Spool(path, durability=durability) as spool:
        report = Replayer(spool, sink, batch_rows=4).replay()
        assert report.moved == len(known)
    return w


class MarkingSink(MemorySink):
    """A perfectly durable sink: each write is committed, and noted in the log, at once."""

    def __init__(self, vfs: PowerVFS | None = None) -> None:
        super().__init__()
        self.vfs = vfs

    def write(self, session_id: str, record: Any, ticket: tuple[str, int, int]) -> None:
        super().write(session_id, record, ticket)
        if self.vfs is not None:
            self.vfs.mark("sink", (session_id, record.message, ticket))


def upgrade(version: int) -> Callable[[Path, str], Workload]:
    def workload(root: Path, durability: str) -> Workload:
        path = root / "spool" / "spool.db"
        rows = [
            ("a", 1, json.dumps(message("a", 1)), None),
            ("a", 2, json.dumps(message("a", 2)), 7),  # in flight: quarantined by the upgrade
            ("b", 1, json.dumps(message("b", 1)), None),
        ]
        make_v2_spool(path, rows)
        if version == 1:
            conn = apsw.Connection(str(path))
            try:
                conn.execute(DOWNGRADE_TO_V1_SQL)
            finally:
                conn.close()
        known = {(s, seq): json.loads(p)["content"] for s, seq, p, _ in rows}
        w = begin(root, f"upgrade_v{version}", durability, "spool/spool.db", known)
        with recording(w.vfs), walspool.Spool(path, durability=durability) as spool:
            r = Recorder(w, spool)
            r.append("a", 3)
            r.append_many([("b", 2), ("c", 1)])
        return w

    return workload


WORKLOADS: dict[str, Callable[[Path, str], Workload]] = {
    "appends": appends,
    "first_open": first_open,
    "checkpoint": checkpoints,
    "autocheckpoint": autocheckpoint,
    "replay": replay,
    "upgrade_v1": upgrade(1),
    "upgrade_v2": upgrade(2),
}


# -- checking one crash state ---------------------------------------------------------


@dataclass
class Tally:
    """What the states of one test showed."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seen: set[tuple[str, frozenset[Key]]] = field(default_factory=set)

    def fail(self, w: Workload, state: CrashState, what: str) -> None:
        self.failures.append(
            f"{w.name}/{w.durability} cut {state.cut} ({describe(w, state.cut)}) "
            f"sample {state.sample} {state.outcomes}: {what}"
        )


def describe(w: Workload, cut: int) -> str:
    """The operation a cut comes before, and the last phase mark before it."""
    ops = w.vfs.ops
    if cut >= len(ops):
        op_text = "after the last operation"
    else:
        op = ops[cut]
        target = op.path or w.vfs.nodes[op.node].path
        op_text = f"before {op.kind} {Path(target).name}"
        if op.kind == "write":
            op_text += f" @{op.offset}+{len(op.data)}"
    phases = [m.value for m in w.vfs.marks if m.kind == "phase" and m.at <= cut]
    return op_text + (f", after {phases[-1]}" if phases else "")


def check_state(w: Workload, state: CrashState, dest: Path, tally: Tally) -> None:
    acked = w.acked_before(state.cut)
    h = hashlib.blake2b(repr(sorted(state.dirs)).encode())
    for rel, data in sorted(state.files.items()):
        h.update(f"\0{rel}\0{len(data)}\0".encode())
        h.update(data)
    digest = h.hexdigest()
    key = (digest, frozenset(acked))
    if key in tally.seen:
        tally.counts["duplicate states skipped"] += 1
        return
    tally.seen.add(key)
    tally.counts["states tried"] += 1
    state.write_to(dest)
    try:
        _check_opened(w, state, dest, acked, tally)
    finally:
        shutil.rmtree(dest)


def _check_opened(
    w: Workload, state: CrashState, dest: Path, acked: dict[Key, int], tally: Tally
) -> None:
    path = dest / w.spool
    try:
        spool = walspool.Spool(path, durability=w.durability)
    except Exception as exc:  # noqa: BLE001 - every failure to open is reported
        tally.fail(w, state, f"does not open: {type(exc).__name__}: {exc}")
        return
    try:
        damaged = sorted(p.name for p in path.parent.glob(f"{path.name}.damaged-*"))
        if damaged:
            tally.counts["moved aside"] += 1
            tally.fail(w, state, f"moved aside as damaged: {damaged}")
            return
        present = {(r.session_id, r.seq): r.message["content"] for r in spool.records()}
        strange = {k: v for k, v in present.items() if w.known.get(k) != v}
        if strange:
            tally.fail(w, state, f"rows no append made: {strange}")
        if w.replay:
            _check_replay(w, state, spool, present, tally)
        else:
            _check_appends(w, state, spool, present, acked, tally)
    finally:
        spool.close()
    problems = integrity(path)
    if problems != ["ok"]:
        tally.fail(w, state, f"integrity_check: {problems[:5]}")


def _check_appends(
    w: Workload,
    state: CrashState,
    spool: walspool.Spool,
    present: dict[Key, str],
    acked: dict[Key, int],
    tally: Tally,
) -> None:
    tally.counts["acknowledged appends checked"] += len(acked)
    missing = sorted(k for k in acked if k not in present)
    tally.counts["lost"] += len(missing)
    if w.durability == "full" or any(acked[k] < 0 for k in missing):
        if missing:
            tally.fail(w, state, f"acknowledged appends lost: {missing}")
    else:
        # A tail in commit order (row ids), not in the order callers were woken.
        kept = [w.ids[k] for k in acked if k in present and acked[k] >= 0]
        lost = [w.ids[k] for k in missing]
        if lost and kept and min(lost) <= max(kept):
            tally.fail(w, state, f"lost {missing}, not only a tail (kept later ones)")
        if missing:
            tally.counts["states that lost a tail"] += 1
    if acked:
        # Sequence numbers go on after the highest acknowledged (full) or present one.
        session = max(acked, key=lambda k: (acked[k], k))[0]
        floor = max(
            [seq for (s, seq) in present if s == session]
            + ([seq for (s, seq) in acked if s == session] if w.durability == "full" else []),
            default=0,
        )
        receipt = spool.append(session, {"content": "after the cut"})
        if receipt.seq <= floor:
            tally.fail(w, state, f"next seq of {session} is {receipt.seq}, not above {floor}")


def _check_replay(
    w: Workload,
    state: CrashState,
    spool: walspool.Spool,
    present: dict[Key, str],
    tally: Tally,
) -> None:
    sink = MarkingSink()
    for mark in w.vfs.marks:
        if mark.kind == "sink" and mark.at <= state.cut:
            session_id, msg, ticket = mark.value
            sink.rows.append((session_id, msg))
            sink.tickets.add(ticket)
    Replayer(spool, sink).replay()
    tally.counts["replayed messages checked"] += len(w.baseline)
    left = list(spool.records())
    delivered = Counter((s, m["content"]) for s, m in sink.rows)
    dups = {k: n for k, n in delivered.items() if n > 1}
    lost = [k for k in sorted(w.baseline) if delivered[(k[0], w.known[k])] == 0]
    tally.counts["duplicated"] += sum(n - 1 for n in dups.values())
    tally.counts["lost"] += len(lost)
    if w.durability == "normal":
        tally.counts["states that duplicated"] += bool(dups)
        return
    if dups or lost or left:
        tally.fail(w, state, f"replay: duplicated {dups}, lost {lost}, left {len(left)} rows")
    for session in {s for s, _ in w.baseline}:
        expected = [w.known[k] for k in sorted(k for k in w.baseline if k[0] == session)]
        if [m["content"] for m in sink.messages(session)] != expected:
            tally.fail(w, state, f"replay: session {session} out of order")


def integrity(path: Path) -> list[str]:
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return [row[0] for row in conn.execute("PRAGMA integrity_check")]
    finally:
        conn.close()


# -- the matrix ---------------------------------------------------------------------


def run_matrix(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    name: str,
    durability: str,
    cuts: Callable[[Workload], list[int]],
    samples: int,
) -> Tally:
    root = tmp_path / "recorded"
    root.mkdir(mode=0o700)
    w = WORKLOADS[name](root, durability)
    w.vfs.unregister()  # its log stays; SQLite lets go of it
    tally = Tally()
    tally.counts["operations logged"] = len(w.vfs.ops)
    points = cuts(w)
    tally.counts["cut points"] = len(points)
    # The states are opened on tmpfs where there is one: their fsyncs prove nothing
    # (the state is already what the disk held) and cost most of the time.
    scratch = Path(tempfile.mkdtemp(prefix="walspool-power-", dir=SCRATCH))
    try:
        for n, cut in enumerate(points):
            for sample in range(samples):
                state = w.vfs.crash_state(cut, sample)
                check_state(w, state, scratch / f"state-{n}-{sample}", tally)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    TOTALS[durability].update(tally.counts)
    report(request, f"power loss {name}/{durability}", tally.counts)
    return tally


def every_cut(w: Workload) -> list[int]:
    """Every cut point; for a long log (thousands of page writes), those near a sync,
    truncate, directory change or acknowledgement and every ``STRIDE``-th other one."""
    ops = w.vfs.ops
    if len(ops) <= LONG_LOG:
        return list(range(len(ops) + 1))
    near = [i for i, op in enumerate(ops) if op.kind != "write"]
    near += [m.at for m in w.vfs.marks]
    points = {c for i in near for c in range(i - 1, i + 3)} | set(range(0, len(ops), STRIDE))
    return sorted(c for c in points if 0 <= c <= len(ops))


def quick_cuts(w: Workload) -> list[int]:
    """A few cut points: spread over the log, each just after an acknowledgement."""
    acks = sorted({m.at for m in w.vfs.marks if m.kind in ("ack", "sink")})
    spread = [acks[i * (len(acks) - 1) // (QUICK_CUTS - 2)] for i in range(QUICK_CUTS - 1)]
    return sorted({*spread, len(w.vfs.ops) // 2, len(w.vfs.ops)})


QUICK = [(name, "full") for name in WORKLOADS] + [("appends", "normal")]


@pytest.mark.parametrize(("name", "durability"), QUICK)
def test_power_cut_quick(request, tmp_path, name, durability):
    tally = run_matrix(request, tmp_path, name, durability, quick_cuts, samples=4)
    assert tally.counts["states tried"] > 0
    assert not tally.failures, "\n".join(tally.failures[:20])


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["full", "normal"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_power_cut_matrix(request, tmp_path, name, durability):
    tally = run_matrix(request, tmp_path, name, durability, every_cut, samples=SAMPLES)
    assert tally.counts["states tried"] > 0
    assert not tally.failures, f"{len(tally.failures)} failing states; first ones:\n" + "\n".join(
        tally.failures[:20]
    )


def test_the_matrix_sees_a_commit_without_fsync(request, tmp_path):
    """The same states, judged by "full"'s rule, for commits that were not synced
    (``durability="normal"``): acknowledged appends go missing, and the check says so."""
    root = tmp_path / "recorded"
    root.mkdir(mode=0o700)
    w = appends(root, "normal")
    w.vfs.unregister()
    w.durability = "full"  # judged as if it had promised to survive power loss
    tally = Tally()
    for cut in quick_cuts(w):
        check_state(w, w.vfs.crash_state(cut, 0), tmp_path / f"state-{cut}", tally)
    assert any("acknowledged appends lost" in f for f in tally.failures), tally.counts


def test_a_new_spool_cut_before_its_first_page_was_synced_opens(tmp_path):
    """The file has its length but zeros for data, beside the hot journal SQLite
    synced first: SQLite rolls it back to empty, so walspool must let it (before, it
    refused the file as someone else's: NotASpool at every start)."""
    root = tmp_path / "recorded"
    root.mkdir(mode=0o700)
    w = first_open(root, "full")
    w.vfs.unregister()
    db = w.vfs.nodes[w.vfs._current[str(root.resolve() / w.spool)]].id
    cut = next(i for i, op in enumerate(w.vfs.ops) if op.kind == "sync" and op.node == db)
    state = w.vfs.crash_state(cut, 1)
    state.files[w.spool] = bytes(len(state.files[w.spool]))
    assert state.files[w.spool] and w.spool + "-journal" in state.files
    state.write_to(tmp_path / "state")
    path = tmp_path / "state" / w.spool
    with walspool.Spool(path) as spool:
        assert list(spool.records()) == []
        assert spool.append("a", {"content": "after"}).seq == 1
    assert not list(path.parent.glob("*.damaged-*"))
    # Zeros without SQLite's journal beside them are still someone else's file.
    other = tmp_path / "other" / "spool.db"
    other.parent.mkdir(mode=0o700)
    other.write_bytes(bytes(4096))
    with pytest.raises(walspool.NotASpool, match="not a SQLite database"):
        walspool.Spool(other)
    assert other.read_bytes() == bytes(4096)


# -- the model itself -----------------------------------------------------------------


def model_root(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir(mode=0o700)
    return root


def test_a_sync_keeps_what_came_before_it_and_later_writes_vary_by_sector(tmp_path):
    root = model_root(tmp_path)
    (root / "f").write_bytes(bytes(2048))
    vfs = PowerVFS(root, seed=1)
    flags = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_MAIN_DB
    f = vfs.xOpen(str(root / "f"), [flags, 0])
    f.xWrite(b"A" * 1024, 0)
    f.xSync(apsw.SQLITE_SYNC_NORMAL)
    synced = len(vfs.ops)
    f.xWrite(b"B" * 1536, 512)
    f.xClose()
    old, new = b"A" * 1024 + bytes(1024), b"A" * 512 + b"B" * 1536
    assert vfs.crash_state(synced - 1, 0).files == {"f": bytes(2048)}  # before the sync
    assert vfs.crash_state(synced, 1).files == {"f": b"A" * 1024 + bytes(1024)}
    assert vfs.crash_state(len(vfs.ops), 0).files == {"f": old}
    assert vfs.crash_state(len(vfs.ops), 1).files == {"f": new}
    seen = set()
    for sample in range(3, 60):
        data = vfs.crash_state(len(vfs.ops), sample).files["f"]
        sectors = tuple(data[i : i + 512] == new[i : i + 512] for i in range(0, 2048, 512))
        assert all(
            data[i : i + 512] in (old[i : i + 512], new[i : i + 512]) for i in (512, 1024, 1536)
        )
        assert sectors[0]  # written before the sync
        seen.add(sectors)
    assert len(seen) > 2, "some torn states: some sectors new, others old"


def test_a_new_entry_needs_its_directory_synced(tmp_path):
    root = model_root(tmp_path)
    vfs = PowerVFS(root)
    with recording(vfs):
        os.mkdir(root / "d", 0o700)
        os.close(os.open(root / "d" / "x", os.O_CREAT | os.O_WRONLY, 0o600))
    state = vfs.crash_state(len(vfs.ops), 0)
    assert (state.dirs, state.files) == (set(), {})
    assert vfs.crash_state(len(vfs.ops), 1).files == {"d/x": b""}
    with recording(vfs):
        walspool.store.files.sync_directory(root)
    state = vfs.crash_state(len(vfs.ops), 0)
    assert (state.dirs, state.files) == ({"d"}, {})
    with recording(vfs):
        walspool.store.files.sync_directory(root / "d")
    state = vfs.crash_state(len(vfs.ops), 0)
    assert (state.dirs, state.files) == ({"d"}, {"d/x": b""})


def test_a_deleted_file_comes_back_unless_its_directory_was_synced(tmp_path):
    root = model_root(tmp_path)
    for name in ("a", "b"):
        (root / name).mkdir(mode=0o700)
        (root / name / "f").write_bytes(b"x")
    vfs = PowerVFS(root)
    vfs.xDelete(str(root / "a" / "f"), False)
    vfs.xDelete(str(root / "b" / "f"), True)  # the unix VFS fsyncs b/ (all of it)
    assert vfs.crash_state(len(vfs.ops), 0).files == {"a/f": b"x"}
    assert vfs.crash_state(len(vfs.ops), 1).files == {}
