"""Litestream for the replication tests (tests/test_litestream.py): finding the binary,
``litestream replicate`` of one spool to a ``file`` replica as a child process, restores,
and the gateway host the host-loss test kills, which this file also is:

    python tests/_litestream.py gateway HOME THREADS RATE

runs the released hermes-agent 0.19.0 ``SessionStore`` linked to ``HOME/spool.db``
during an outage of its state.db (every insert fails): THREADS threads, two sessions
each, each thread sending RATE messages a second, until it is killed. Past each
session's 200 queued messages the link spools the oldest; ``S SESSION RUN I ID`` is
printed once such an eviction is committed in the spool (the crash matrix's
``report_evictions``), ID being its record's id: commit order, which the order of the
lines need not be.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import apsw

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.5.17"
#: Where scripts/test (``litestream_bin`` in scripts/_env.sh) puts the binary.
CACHED = ROOT / ".cache" / "litestream" / VERSION / "litestream"
#: Bound on every wait for Litestream (a snapshot, a sync, a restore) on a loaded machine.
WAIT = 60.0
#: How often a wait for the replica restores it again.
POLL = 0.1

#: A restored spool's rows, in id (commit) order: (session_id, seq, content).
Row = tuple[str, int, str]


def binary() -> Path | None:
    """The Litestream binary: ``$WALSPOOL_LITESTREAM``, else the one scripts/test fetched."""
    named = os.environ.get("WALSPOOL_LITESTREAM")
    path = Path(named) if named else CACHED
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_reason() -> str:
    named = os.environ.get("WALSPOOL_LITESTREAM")
    if named:
        return f"WALSPOOL_LITESTREAM={named} is not an executable file"
    return (
        f"needs the Litestream {VERSION} binary: scripts/test fetches it into "
        f"{CACHED.parent.relative_to(ROOT)}/ (or set WALSPOOL_LITESTREAM to one)"
    )


def read_rows(path: Path) -> list[Row]:
    """The rows of a restored spool nobody else has open, without changing the file."""
    conn = apsw.Connection(
        f"file:{path}?immutable=1",
        flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI,
    )
    try:
        return conn.execute(
            "SELECT session_id, seq, json_extract(payload, '$.content') FROM records ORDER BY id"
        ).fetchall()
    finally:
        conn.close()


class Replication:
    """``litestream replicate -config CONFIG`` of the spool ``db`` to the ``file``
    replica ``replica``, as a child process of the test; its log beside the config.

    ``settings`` are database options of Litestream's configuration file, by their YAML
    names (``monitor-interval``, ``checkpoint-interval``, ...), except ``sync-interval``,
    which is the replica's; ``config`` replaces the whole file (as written in README).
    """

    def __init__(
        self,
        litestream: Path,
        db: Path,
        replica: Path,
        *,
        config: str | None = None,
        **settings: str | int,
    ) -> None:
        self.litestream, self.db, self.replica = litestream, db, replica
        replica.parent.mkdir(parents=True, exist_ok=True)
        self.config = replica.with_name(replica.name + ".yml")
        self.log = replica.with_name(replica.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None
        self._scratch = replica.with_name(replica.name + ".restores")
        self._restores = 0
        if config is None:
            sync = settings.pop("sync_interval", None)
            lines = ["dbs:", f"  - path: {json.dumps(str(db))}"]
            lines += [f"    {k.replace('_', '-')}: {v}" for k, v in settings.items()]
            lines += ["    replica:", "      type: file", f"      path: {json.dumps(str(replica))}"]
            if sync is not None:
                lines.append(f"      sync-interval: {sync}")
            config = "\n".join(lines) + "\n"
        self.config.write_text(config)

    @property
    def url(self) -> str:
        return self.replica.as_uri()

    def start(self) -> None:
        assert self.proc is None, "Litestream is running already"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.litestream), "replicate", "-config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self, *, check: bool = True) -> None:
        """SIGTERM: Litestream syncs what it has not replicated yet, then exits (with 0
        when ``check``)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(WAIT)
        self.proc = None
        assert status == 0 or not check, f"litestream exited with {status}\n{self.tail()}"

    def kill(self) -> None:
        """SIGKILL, as a lost host: nothing more reaches the replica."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(WAIT)
            self.proc = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def restore(self, out: Path, *, txid: str | None = None) -> subprocess.CompletedProcess[str]:
        """``litestream restore -o OUT [-txid TXID] REPLICA_URL``, as on a new host that
        knows only where the replica is."""
        args = [str(self.litestream), "restore", "-o", str(out)]
        if txid is not None:
            args += ["-txid", txid]
        return subprocess.run(
            [*args, self.url], capture_output=True, text=True, timeout=WAIT, check=False
        )

    def restored(self, out: Path, *, txid: str | None = None) -> Path:
        done = self.restore(out, txid=txid)
        assert done.returncode == 0, (done.stdout, done.stderr, self.tail())
        return out

    def rows(self) -> list[Row] | None:
        """What a restore of the replica holds now; None while it holds nothing yet."""
        self._restores += 1
        out = self._scratch / str(self._restores) / "spool.db"
        try:
            if self.restore(out).returncode != 0:
                return None
            return read_rows(out)
        finally:
            shutil.rmtree(out.parent, ignore_errors=True)

    def wait_for(self, predicate: Callable[[list[Row]], bool], what: str) -> list[Row]:
        """Restore the replica again and again until its rows satisfy ``predicate``;
        at most ``WAIT`` seconds."""
        deadline = time.monotonic() + WAIT
        rows: list[Row] | None = None
        while time.monotonic() < deadline:
            rows = self.rows()
            if rows is not None and predicate(rows):
                return rows
            time.sleep(POLL)
        raise AssertionError(
            f"the replica did not show {what} within {WAIT:g} s (last restore: "
            f"{'nothing' if rows is None else f'{len(rows)} rows'})\n{self.tail()}"
        )

    def txid(self) -> str:
        """The newest transaction id the replica holds (``litestream ltx``)."""
        done = subprocess.run(
            [str(self.litestream), "ltx", self.url],
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=True,
        )
        # Lines: level, min_txid, max_txid, size, created; a header first.
        return max(line.split()[2] for line in done.stdout.splitlines()[1:] if line.strip())

    def __enter__(self) -> Replication:
        """Start Litestream unless it runs already; kill it on the way out."""
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


# -- the gateway host (test side) --------------------------------------------------------


class GatewayHost:
    """The gateway process of the host-loss test, and its acknowledgements: each
    ``(session_id, run, i)`` with the ``time.monotonic()`` at which its line arrived."""

    def __init__(self, home: Path, threads: int, rate: int) -> None:
        #: Each acknowledged eviction and when it was read, in the order printed.
        self.acks: list[tuple[tuple[str, int, int], float]] = []
        #: Each acknowledged eviction's record id in the spool: its commit order.
        self.record_ids: dict[tuple[str, int, int], int] = {}
        self._cond = threading.Condition()
        self._err = open(home.parent / "gateway.err", "w+b")  # closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "gateway", str(home), str(threads), str(rate)],
            stdout=subprocess.PIPE,
            stderr=self._err,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.monotonic()
            line = raw.decode()
            if line.startswith("S ") and line.endswith("\n"):
                session, run, i, record_id = line.split()[1:]
                key = (session, int(run), int(i))
                with self._cond:
                    self.acks.append((key, now))
                    self.record_ids[key] = int(record_id)
                    self._cond.notify_all()

    def wait_acks(self, count: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.acks) >= count, WAIT):
                raise AssertionError(
                    f"the gateway acknowledged {len(self.acks)} evictions, not {count}, "
                    f"within {WAIT:g} s\n{self.stderr()}"
                )

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL; then read what it printed before it died."""
        self.proc.kill()
        self.proc.wait(WAIT)
        self._reader.join(WAIT)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._err.close()


# -- the gateway host (its own process) ---------------------------------------------------


def main_gateway(home: str, threads: str, rate: str) -> None:
    from _crash_worker import gateway_store, message, report_evictions, say, set_db_state

    import walspool
    from walspool.hermes import install

    home_path = Path(home)
    store = gateway_store(home_path)
    spool = walspool.Spool(home_path / "spool.db")
    report_evictions(spool)
    install(store, spool, recover=False, retry_interval=0)
    set_db_state(store, broken=True)
    period = 1.0 / int(rate)

    def feed(t: int) -> None:
        sessions = [f"g{t}-0", f"g{t}-1"]
        due = time.monotonic()
        i = 0
        while True:
            store.append_to_transcript(sessions[i % 2], message(1, t, i))
            i += 1
            due += period  # pace the load: a steady rate, as users send messages
            time.sleep(max(0.0, due - time.monotonic()))

    for t in range(int(threads)):
        threading.Thread(target=feed, args=(t,), daemon=True).start()
    say("P ready")
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    if sys.argv[1] == "gateway":
        main_gateway(*sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
