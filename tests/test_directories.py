"""Files trusted by descriptor (``directories``, ``files`` and ``open_guard`` of
``walspool.store``), against a real attacker.

The tests run as root; the attacker is a real second process switched with
``setpriv`` to ``nobody``, the owner of the spool's directory (a gateway user that
wants root's powers), swapping names in its own directory with
``renameat2(RENAME_EXCHANGE)`` as fast as it can while root runs walspool. Each race
is run for many tries: the code before issue 29 lost each of them within a few
hundred (a chmod, chown, truncate or write through the swapped name, or a hang).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import apsw
import pytest
from _helpers import ROOT, MemorySink
from _lock_holder import replay_lock_held
from _users import NOBODY, SETPRIV, as_root, shared_directory
from _users import python_as as as_user

import walspool
from walspool.cli import main
from walspool.replay.replayer import Replayer
from walspool.replay.sinks import RowRejected
from walspool.store import maintenance, open_guard, sqlite_errors
from walspool.store.directories import open_directory

OWNER = NOBODY
NEIGHBOUR = 1  # daemon
#: Tries per race; each race ends early once it is lost.
TRIES = 400
#: Seconds any one command may take before it counts as hung (generous: a loaded machine).
BOUND = 60

SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
os.chdir(sys.argv[1])
a, b = sys.argv[2].encode(), sys.argv[3].encode()
exec(sys.argv[4])  # setup(): put both names in place; called again when one is gone
setup()
each = globals().get("each", lambda: None)  # done before every exchange
print("ready", flush=True)
while True:
    try:
        each()
    except OSError:
        pass
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        try:
            setup()
        except OSError:
            pass  # root's walspool made or removed a name meanwhile: next turn
"""


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    with shared_directory("walspool-dirs-", 0o711) as top:
        yield top


def owned_dir(path: Path, uid: int, mode: int = 0o700) -> Path:
    path.mkdir(parents=True)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


@contextlib.contextmanager
def as_owner(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``code`` run by ``nobody``, the spool's owner (a real second process), for the
    block, once it has printed ``ready``; killed afterwards."""
    assert SETPRIV is not None
    proc = subprocess.Popen(
        [SETPRIV, f"--reuid={OWNER}", f"--regid={OWNER}", "--clear-groups", sys.executable]
        + ["-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], BOUND)
        assert ready and proc.stdout.readline() == "ready\n", proc.stderr.read()
        yield proc
    finally:
        proc.kill()
        proc.wait(BOUND)


@contextlib.contextmanager
def swapping(directory: Path, a: str, b: str, setup: str) -> Iterator[subprocess.Popen[str]]:
    """``nobody`` exchanging the names ``a`` and ``b`` in ``directory`` in a loop (a
    real second process) for the block; ``setup`` defines ``setup()``, which (re)makes
    them."""
    with as_owner(SWAPPER, str(directory), a, b, textwrap.dedent(setup)) as proc:
        yield proc
        assert proc.poll() is None, f"the swapper stopped: {proc.stderr.read()}"


def gateway_spool(home: Path) -> Path:
    """A spool the gateway's user made, with one row."""
    path = home / "spool.db"
    done = as_user(
        OWNER,
        "import sys, walspool\n"
        "with walspool.Spool(sys.argv[1]) as s: s.append('s', {'role': 'user', 'content': 'x'})",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    return path


def root_file(directory: Path, mode: int, text: str = "root's own") -> Path:
    victim = directory / "victim"
    victim.write_text(text)
    os.chmod(victim, mode)
    return victim


def state(path: Path) -> tuple[int, int, str]:
    st = path.stat()
    return st.st_uid, stat.S_IMODE(st.st_mode), path.read_text()


# -- a check, then a use by path ------------------------------------------------------------


@as_root
def test_root_never_chmods_through_a_link_swapped_in_after_the_check(shared_tmp):
    """The owner swaps a loose ``-wal`` for a link to root's file, over and over, while
    root opens the spool: root's file keeps its mode (before: chmodded to 0600)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    victim = root_file(shared_tmp, 0o644)
    setup = f"""
        def setup():  # one link, one loose file: SQLite's close may have unlinked either
            if not any(os.path.islink(n) for n in ("spool.db-wal", "link")):
                if os.path.lexists("link"):
                    os.unlink("link")
                os.symlink({str(victim)!r}, "link")
            for name in ("spool.db-wal", "link"):
                if not os.path.lexists(name):
                    os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o644))
        def each():
            for name in ("spool.db-wal", "link"):
                if not os.path.islink(name):
                    os.chmod(name, 0o644)  # loose again: root's walspool fixes the mode
        """
    refused = 0
    with swapping(home, "spool.db-wal", "link", setup):
        for _ in range(TRIES):
            try:
                walspool.Spool(spool_path).close()
            except walspool.WalspoolError:
                refused += 1
            assert state(victim) == (0, 0o644, "root's own")
    assert refused < TRIES  # the race ran against opens that also succeed


@as_root
def test_a_lock_file_hard_linked_to_another_file_is_refused_untouched(shared_tmp):
    """``.open-lock`` and ``.replay-lock`` hard links to a file of root's (one any user
    can write, so the kernel lets the owner link it): refused by name; the file is not
    chowned, chmodded or truncated (before: all three, by root's walspool)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    victim = root_file(shared_tmp, 0o666)
    for lock in ("spool.db.open-lock", "spool.db.replay-lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(home / lock)
        done = as_user(
            OWNER, "import os, sys; os.link(*sys.argv[1:])", str(victim), str(home / lock)
        )
        assert done.returncode == 0, done.stderr
        with pytest.raises(walspool.UntrustedSpool, match=f"{lock} has 2 hard links"):
            with walspool.Spool(spool_path) as spool:
                Replayer(spool, MemorySink()).replay()
        assert state(victim) == (0, 0o666, "root's own")
        os.unlink(home / lock)


@as_root
@pytest.mark.parametrize("lock", ["spool.db.open-lock", "spool.db.replay-lock"])
def test_a_lock_file_a_third_user_planted_is_refused_not_adopted(shared_tmp, lock):
    """Root runs walspool on the owner's spool; a neighbour's file at a lock's name is
    refused, never handed to the owner (before: chowned to the owner, made 0600)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    planted = home / lock
    planted.write_text("neighbour's")
    os.chown(planted, NEIGHBOUR, NEIGHBOUR)
    os.chmod(planted, 0o644)
    with pytest.raises(walspool.UntrustedSpool, match=f"{lock} belongs to uid {NEIGHBOUR}"):
        with walspool.Spool(spool_path) as spool:
            Replayer(spool, MemorySink()).replay()
    assert state(planted) == (NEIGHBOUR, 0o644, "neighbour's")


@as_root
def test_a_lock_file_root_left_with_more_than_a_pid_in_it_is_not_adopted(shared_tmp):
    """Root's leftover lock files are given back to the owner; a root file with more
    in it than a pid is no leftover lock (some root file moved there): refused."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    lock = home / "spool.db.replay-lock"
    lock.write_text("x" * 4096)
    with walspool.Spool(spool_path) as spool:
        with pytest.raises(walspool.UntrustedSpool, match="belongs to uid 0"):
            Replayer(spool, MemorySink()).replay()
    assert state(lock) == (0, 0o644, "x" * 4096)


# -- FIFOs never hang a command --------------------------------------------------------


def walspool_cli(*argv: object) -> subprocess.CompletedProcess[str]:
    """``python -m walspool ARGV`` in a child, waited for at most ``BOUND`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "walspool", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("fifo", ["spool.db-wal", "spool.db-shm"])
def test_a_fifo_beside_the_spool_makes_every_command_refuse_at_once(tmp_path, fifo):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    os.mkfifo(tmp_path / fifo)
    for command in ("stats", "ls", "check", "export", "show"):
        argv = [command, path, "s"] if command == "show" else [command, path]
        done = walspool_cli(*argv)  # a hang fails here (TimeoutExpired), never blocks
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert f"{fifo} is not a regular file" in done.stderr, (command, done.stderr)
    done = walspool_cli("check", path, "--json")
    assert done.returncode == 1 and "is not a regular file" in done.stdout
    with pytest.raises(walspool.NotASpool, match=f"{fifo} is not a regular file"):
        walspool.Spool(path)


@pytest.mark.parametrize("lock", ["spool.db.open-lock", "spool.db.replay-lock"])
def test_a_fifo_as_a_lock_file_is_refused_at_once(tmp_path, lock):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "x"})
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp_path / lock)
    os.mkfifo(tmp_path / lock)
    done = walspool_cli("requeue", path, "--id", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not a regular file" in done.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / lock).st_mode)


READ_LOOP = """
import sys
from walspool.cli import main
codes = {main(["stats", sys.argv[1], "--json"]) for _ in range(int(sys.argv[2]))}
print("codes", sorted(codes))
"""
#: ``READ_LOOP`` through the library, in root's own process (the CLI runs root's
#: commands on another user's spool in a child that became the owner): SQLite opens
#: every file as root here, and only the open hook stands between it and a chown.
LIBRARY_READ_LOOP = """
import sys
import walspool

def read():
    try:
        with walspool.Spool(sys.argv[1]) as spool:
            spool.stats()
        return 0
    except walspool.WalspoolError:
        return 1

codes = {read() for _ in range(int(sys.argv[2]))}
print("codes", sorted(codes))
"""


@as_root
def test_a_fifo_swapped_in_after_the_check_never_hangs_roots_reads(shared_tmp):
    """The owner exchanges the spool with a FIFO over and over while root runs
    ``stats``: every run returns (refused or read), none waits on the FIFO (before:
    root's ``stats`` hung for good once it opened the FIFO)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    setup = """
        def setup():
            if not os.path.lexists("fifo"):
                os.mkfifo("fifo", 0o600)
        """
    with swapping(home, "spool.db", "fifo", setup):
        done = subprocess.run(
            [sys.executable, "-c", READ_LOOP, str(spool_path), str(TRIES)],
            capture_output=True,
            text=True,
            timeout=BOUND * 3,  # a hang fails the test here
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert done.returncode == 0, done.stderr[-2000:]
    (last,) = [line for line in done.stdout.splitlines() if line.startswith("codes ")]
    assert set(json.loads(last[len("codes ") :])) <= {0, 1}


# -- SQLite's own opens: every file it keeps is checked on its descriptor -------------------

#: The commands root may run on the owner's spool, each of which makes SQLite read it.
ROOTS_COMMANDS = [
    ["stats"],
    ["ls"],
    ["show", "s"],
    ["export"],
    ["vacuum"],
    ["requeue", "--session", "s", "--quarantined"],
    ["drop", "--session", "s", "--superseded", "--yes"],
]

GATEWAY_HOLDING = """
import sys, walspool
spool = walspool.Spool(sys.argv[1])
spool.append("s", {"role": "user", "content": "x"})
print("ready", flush=True)
sys.stdin.read()
spool.close()
"""


@contextlib.contextmanager
def gateway_running(path: Path) -> Iterator[None]:
    """The owner's process holding the spool open, as a gateway does (its ``-wal`` and
    ``-shm`` exist), for the block."""
    with as_owner(GATEWAY_HOLDING, str(path)):
        assert os.path.exists(f"{path}-wal")
        yield


def link_as_owner(target: Path, name: Path) -> None:
    done = as_user(OWNER, "import os, sys; os.link(*sys.argv[1:])", str(target), str(name))
    assert done.returncode == 0, done.stderr


@as_root
@pytest.mark.parametrize("running", [False, True], ids=["stopped", "gateway running"])
@pytest.mark.parametrize("command", ROOTS_COMMANDS, ids=lambda argv: argv[0])
def test_a_hard_link_planted_as_the_journal_is_never_given_away(shared_tmp, command, running):
    """The owner hard-links a file of root's (one it may write, so the kernel lets it)
    as ``spool.db-journal``: every command root runs refuses, naming it; the file stays
    root's (before: SQLite's hot-journal check at the first read chowned it to the
    owner, for every write command, and for every read while a gateway ran)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    victim = root_file(shared_tmp, 0o666)
    with gateway_running(spool_path) if running else contextlib.nullcontext():
        link_as_owner(victim, home / "spool.db-journal")
        done = walspool_cli(command[0], spool_path, *command[1:])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "spool.db-journal has 2 hard links" in done.stderr
    assert state(victim) == (0, 0o666, "root's own")
    with pytest.raises(walspool.UntrustedSpool, match="spool.db-journal has 2 hard links"):
        walspool.Spool(spool_path)
    assert state(victim) == (0, 0o666, "root's own")


@as_root
@pytest.mark.parametrize("reader", ["cli", "library"])
@pytest.mark.parametrize("name", ["spool.db-journal", "spool.db-wal"])
def test_a_hard_link_swapped_in_after_the_check_is_never_given_away(shared_tmp, name, reader):
    """The owner puts a hard link to a file of root's at ``-journal`` (linked and
    unlinked) or exchanges it with the running gateway's genuine ``-wal``, as fast as
    it can, while root reads the spool over and over: with ``stats`` (run in a child
    that became the owner) or the library in root's own process (``walspool.Spool``,
    SQLite opening files as root: only the open hook, checking SQLite's own descriptor,
    refuses the link). Every reading returns (read or refused) and root's file stays
    root's (before: given to the owner within a few hundred readings)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    victim = root_file(shared_tmp, 0o666)
    setup = f"""
        def link():
            if not os.path.lexists("link"):
                os.link({str(victim)!r}, "link")
        """
    if name == "spool.db-wal":  # renameat2 exchanges the two names
        setup += """
        setup = link
        """
    else:  # the journal appears and goes, and is exchanged with "link" while it exists
        setup += """
        def setup():
            link()
            if not os.path.lexists("spool.db-journal"):
                os.link("link", "spool.db-journal")
        def each():
            if os.path.lexists("spool.db-journal"):
                os.unlink("spool.db-journal")
            else:
                os.link("link", "spool.db-journal")
        """
    loop = READ_LOOP if reader == "cli" else LIBRARY_READ_LOOP
    with gateway_running(spool_path), swapping(home, name, "link", setup):
        done = subprocess.run(
            [sys.executable, "-c", loop, str(spool_path), str(TRIES)],
            capture_output=True,
            text=True,
            timeout=BOUND * 3,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert done.returncode == 0, done.stderr[-2000:]
    (last,) = [line for line in done.stdout.splitlines() if line.startswith("codes ")]
    assert set(json.loads(last[len("codes ") :])) <= {0, 1}
    assert state(victim) == (0, 0o666, "root's own")


def test_a_refused_open_is_never_blamed_for_another_spools_error(tmp_path):
    """A file ``open_guard`` refused for one spool (its error surfaced elsewhere) is not
    named as the cause of a later failure of another spool in the same thread
    (before: an injected I/O error on a commit was reported as another spool's
    ``-wal`` being a symbolic link)."""
    refused = tmp_path / "a" / "spool.db"
    with walspool.Spool(refused):
        pass
    open_guard.watch(str(refused.resolve()), os.geteuid() + 1)  # as if another's file
    with pytest.raises(apsw.CantOpenError):
        apsw.Connection(str(refused)).execute("SELECT 1")
    other = tmp_path / "b" / "spool.db"
    error = sqlite_errors.sqlite_error(apsw.IOError("disk I/O error"), other)
    assert isinstance(error, walspool.SpoolIOError) and "check the disk" in str(error)
    assert sqlite_errors.refused_open(refused) is None  # consumed, by the look above


# -- replay writes into the state.db it checked ----------------------------------------


def hermes_state_db(path: Path, uid: int) -> Path:
    done = as_user(
        uid,
        "import sys, hermes_state\n"
        "from pathlib import Path\n"
        "db = hermes_state.SessionDB(db_path=Path(sys.argv[1])); db.create_session('s', 'cli')\n"
        "db.close()",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    return path


def messages(path: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    finally:
        conn.close()


@as_root
def replayed_or_refused(code: int, out: str) -> bool:
    """Whether a racing ``replay --json`` moved its rows (0), refused (1), or held them
    only because SQLite refused to write a state.db whose path names another file now
    (exit 3, ``SQLITE_READONLY_DBMOVED``: nothing written anywhere)."""
    if code in (0, 1):
        return True
    report = json.loads(out)
    errors = list(report["errors"].values())
    return code == 3 and bool(errors) and all("SQLITE_READONLY_DBMOVED" in e for e in errors)


def held_why(outcome: tuple[int, str]) -> str:
    """A refused outcome as the test's failure says it: the exit code, and what the run
    reported as each session's error (CI's log cuts a long assertion's values short)."""
    code, out = outcome
    try:
        report = json.loads(out)
    except ValueError:
        return f"exit {code}: {out}"
    return f"exit {code}: errors {report.get('errors')}, key errors {report.get('key_errors')}"


def test_roots_replay_never_writes_through_a_state_db_link_swapped_in_after_the_check(
    shared_tmp, capfd
):
    """The owner exchanges its state.db with a link to another user's state.db while
    root replays its spool into it: no row lands in the other user's state.db (before:
    a forged row did), each run moves its row into the checked one, refuses, or holds
    it because SQLite saw the path change (``replayed_or_refused``)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    state_db = hermes_state_db(home / "state.db", OWNER)
    other = owned_dir(shared_tmp / "other", NEIGHBOUR, 0o755)
    victim = hermes_state_db(other / "state.db", NEIGHBOUR)
    setup = f"""
        def setup():
            if not os.path.lexists("link"):
                os.symlink({str(victim)!r}, "link")
        """
    outcomes = []
    with swapping(home, "state.db", "link", setup):
        for i in range(TRIES // 4):
            with walspool.Spool(spool_path) as spool:
                spool.append("s", {"role": "user", "content": f"forged {i}"})
            argv = ["replay", str(spool_path), "--into", str(home / "state.db"), "--json"]
            code = main(argv)
            outcomes.append((code, capfd.readouterr().out))  # the child's, on the descriptor
            assert messages(victim) == 0
    refused = [o for o in outcomes if not replayed_or_refused(*o)]
    assert not refused, "\n".join(map(held_why, refused))  # each run's errors in full
    # every row went into the checked state.db (wherever the swaps left its name) or
    # stayed spooled: none lost, none elsewhere
    (real,) = [p for p in (state_db, home / "link") if not p.is_symlink()]
    with walspool.Spool(spool_path) as spool:
        left = sum(1 for _ in spool.records())
    assert messages(real) + left == TRIES // 4 + 1


@as_root
@pytest.mark.parametrize("name", ["state.db-wal", "state.db-shm", "state.db-journal"])
@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_roots_replay_never_gives_away_a_file_linked_at_a_state_db_side_file(
    shared_tmp, capfd, name, link
):
    """The owner of the gateway's directory puts a link to a file of root's at a name
    SQLite opens beside state.db (``-wal``, ``-shm``, ``-journal``) and asks root to
    replay: SQLite follows such names and, run as root, chowns what it opens to
    state.db's owner (before: the owner got root's file). Root's replay runs as the
    owner instead: root's file keeps its owner, mode and content, and the replay
    fails loudly or writes into state.db only."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    state_db = hermes_state_db(home / "state.db", OWNER)
    roots = owned_dir(shared_tmp / "roots", 0, 0o755)
    secret = roots / "secret"
    secret.write_bytes(b"root's own")
    secret.chmod(0o600)
    planted = home / name
    if link == "symlink":
        planted.symlink_to(secret)
        os.lchown(planted, OWNER, OWNER)
    else:  # fs.protected_hardlinks stops the owner making it; one made before, or by root
        os.link(secret, planted)
    code = main(["replay", str(spool_path), "--into", str(state_db)])
    err = capfd.readouterr().err
    st = os.stat(secret)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600), (code, err)
    assert secret.read_bytes() == b"root's own"
    planted.unlink()  # or this check's own SQLite would open it
    with walspool.Spool(spool_path) as spool:
        left = sum(1 for _ in spool.records())
    assert messages(state_db) + left == 1  # the row landed or stayed spooled, once


@as_root
def test_roots_replay_into_another_users_state_db_runs_as_that_user(shared_tmp, capfd, monkeypatch):
    """Root's replay moves the row and leaves every file in the gateway's directory
    (state.db's -wal and -shm, the spool's lock files) to its user: the replay ran as
    that user, not as root."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    gateway_spool(home)
    state_db = hermes_state_db(home / "state.db", OWNER)
    # relative paths, from a working directory of root's that the owner cannot search
    monkeypatch.chdir(owned_dir(shared_tmp / "roots", 0, 0o700))
    code = main(["replay", "../hermes/spool.db", "--into", "../hermes/state.db", "--json"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert json.loads(out)["moved"] == 1
    assert messages(state_db) == 1
    owners = {p.name: p.lstat().st_uid for p in home.iterdir()}
    assert set(owners.values()) == {OWNER}, owners


@as_root
def test_roots_replay_shows_a_payload_of_raw_bytes_escaped_and_moves_the_rest(
    shared_tmp, capfdbinary
):
    """The owner's spool holds a row whose payload is bytes that are not UTF-8, with a
    terminal's escape sequence among them (a hand edit), before a good row. Root's
    replay into the owner's state.db, run in a child as the owner, quarantines that
    row and moves the other; nothing root's terminal receives (the child's lines, and
    root's own) carries the raw bytes: the escape and the bad byte arrive escaped."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    done = as_user(
        OWNER,
        "import sys, apsw, walspool\n"
        "with walspool.Spool(sys.argv[1]) as s: s.append('s', {'role': 'user', 'content': 'y'})\n"
        "conn = apsw.Connection(sys.argv[1])\n"
        "conn.execute(\"UPDATE records SET payload = CAST(X'ff1b5b33316d7b' AS TEXT) \"\n"
        '             "WHERE seq = 1")\n'
        "conn.close()",
        str(spool_path),
    )
    assert done.returncode == 0, done.stderr
    state_db = hermes_state_db(home / "state.db", OWNER)
    code = main(["replay", str(spool_path), "--into", str(state_db)])
    said = capfdbinary.readouterr()
    shown = said.out + said.err
    assert code != 0 and messages(state_db) == 1, shown
    assert b"\x1b" not in shown and b"\xff" not in shown, shown
    assert b"quarantined" in shown, shown
    assert main(["show", str(spool_path), "s"]) == 1  # one bad row among them
    said = capfdbinary.readouterr()
    shown = said.out + said.err
    assert b"\x1b" not in shown and b"\xff" not in shown, shown
    assert b"[NOT JSON]" in shown and b"\\x1b" in shown, shown


@as_root
def test_roots_replay_of_its_own_spool_into_another_users_state_db_says_why_it_cannot(
    shared_tmp, capfd
):
    """The replay would run as state.db's owner, who cannot own root's spool: refused at
    once, saying so and what to do (not the owner's bare "permission denied"); both
    files untouched."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    state_db = hermes_state_db(home / "state.db", OWNER)
    roots = owned_dir(shared_tmp / "roots", 0, 0o700)
    with walspool.Spool(roots / "spool.db") as spool:
        spool.append("s", {"role": "user", "content": "x"})
    code = main(["replay", str(roots / "spool.db"), "--into", str(state_db)])
    err = capfd.readouterr().err  # the child's, on the descriptor
    assert code == 1
    assert err == (
        f"walspool replay: as root, the replay into {state_db} runs as its owner, uid "
        f"{OWNER} (see docs/security.md), who does not own the spool {roots / 'spool.db'} "
        f"(uid 0): give the spool's directory and files to uid {OWNER} (chown -R), then "
        "replay again\n"
    )
    assert messages(state_db) == 0
    with walspool.Spool(roots / "spool.db") as spool:
        assert sum(1 for _ in spool.records()) == 1


@contextlib.contextmanager
def roots_replay_waiting(
    shared_tmp: Path,
) -> Iterator[tuple[subprocess.Popen[str], int, Path, Path]]:
    """Root's replay into the owner's state.db, its child (running as the owner) waiting
    for the spool's replay lock, which another process holds throughout: (root's
    process, the child's pid, the spool, state.db). Both are killed if the block has not
    ended them within ``BOUND * 2`` (a stopped child would hold stderr open)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    state_db = hermes_state_db(home / "state.db", OWNER)
    lock = home / "spool.db.replay-lock"  # the owner's, as the gateway's own replays leave it
    lock.touch(0o600)
    os.chown(lock, OWNER, OWNER)
    argv = ["replay", spool_path, "--into", state_db, "--wait", str(BOUND)]
    with replay_lock_held(spool_path):
        proc = subprocess.Popen(
            [sys.executable, "-m", "walspool", *map(str, argv)],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        pids = [proc.pid]

        def kill_all() -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        killer = threading.Timer(BOUND * 2, kill_all)
        killer.start()
        try:
            assert proc.stderr is not None
            waiting = proc.stderr.readline()  # the child, as the owner, waits for the lock
            assert "waiting for another replay" in waiting, waiting
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            (child,) = map(int, children)
            pids.append(child)
            yield proc, child, spool_path, state_db
        finally:
            killer.cancel()


@as_root
def test_a_signal_to_roots_replay_stops_the_replay_running_as_the_owner(shared_tmp):
    """SIGTERM sent to root's process (the one an operator or a service manager knows)
    reaches the child replaying as the owner: it stops as a replay stops (143, the row
    still spooled), rather than root's process going on waiting or leaving it behind."""
    with roots_replay_waiting(shared_tmp) as (proc, _, spool_path, state_db):
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        rest = proc.stderr.read()
        assert proc.wait(BOUND) == 143, rest
    assert "interrupted by SIGTERM" in rest
    assert messages(state_db) == 0
    with walspool.Spool(spool_path) as spool:
        assert sum(1 for _ in spool.records()) == 1


@as_root
def test_roots_replay_ends_a_child_its_owner_stopped(shared_tmp):
    """State.db's owner stops (SIGSTOP) the child replaying as them while root waits
    for it: root notices, ends the child and fails saying so, rather than waiting (and
    holding Ctrl-C and kill) until someone sends SIGKILL. The row stays spooled."""
    with roots_replay_waiting(shared_tmp) as (proc, child, spool_path, state_db):
        stopped = as_user(OWNER, f"import os, signal; os.kill({child}, signal.SIGSTOP)")
        assert stopped.returncode == 0, stopped.stderr
        assert proc.stderr is not None
        rest = proc.stderr.read()
        assert proc.wait(BOUND) == 1, rest
    assert f"(pid {child}) was stopped (SIGSTOP) while root waited for it" in rest
    assert not Path(f"/proc/{child}").exists()
    assert messages(state_db) == 0
    with walspool.Spool(spool_path) as spool:
        assert sum(1 for _ in spool.records()) == 1


def open_files(pid: int) -> dict[int, str]:
    """What process ``pid`` has open above descriptor 2, each descriptor's target. The
    process runs meanwhile: a descriptor it closes between the listing and the look
    (a file it read) is left out; one inherited and kept open stays in both."""
    opened = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if int(fd) > 2:
            try:
                opened[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
    return opened


@as_root
def test_every_command_root_runs_on_another_users_spool_runs_as_that_user_from_a_clean_start(
    shared_tmp,
):
    """Root's ``watch`` of the owner's spool (any command on another user's spool, not
    only a replay into their state.db) runs in a child that has become the owner,
    with umask 077 and none of root's descriptors above 2, its memory (root's
    environment in it) unreadable to the owner. SIGTERM to root's process ends both
    (143)."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    spool_path = gateway_spool(home)
    secret = owned_dir(shared_tmp / "roots", 0, 0o700) / "secret"
    secret.write_text("root's own")
    with secret.open() as roots_file:
        proc = subprocess.Popen(
            # Not on a terminal, watch reads, waits --interval, reads again, prints.
            [sys.executable, "-m", "walspool", "watch", str(spool_path), "--interval", "600"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(roots_file.fileno(),),
            start_new_session=True,  # the killer below ends the child too
            env={**os.environ, "PYTHONPATH": str(ROOT), "ROOTS_TOKEN": "t0k3n", "LANG": "C"},
        )
    killer = threading.Timer(BOUND * 2, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        child, status = owners_child(proc)
        opened = open_files(child)
        # Its memory began as root's (root's environment is still in it): the owner,
        # who may signal the child, may not read it.
        peek = "import sys; print(open(f'/proc/{sys.argv[1]}/environ', 'rb').read()[:1])"
        peeked = as_user(OWNER, peek, str(child))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND) == 143, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        killer.cancel()
    assert status["Uid"].split() == [str(OWNER)] * 4
    assert status["Gid"].split()[0] == str(pwd.getpwuid(OWNER).pw_gid)
    assert status["Umask"] == "0077"
    assert str(secret) not in opened.values(), opened  # open in root's process
    assert peeked.returncode != 0 and "Permission denied" in peeked.stderr, peeked


@as_root
def test_roots_drop_on_another_users_spool_runs_as_them_and_the_audit_says_root(shared_tmp, capfd):
    """Root's ``drop`` of a quarantined row in the owner's spool runs as the owner (the
    files it makes are theirs), and the audit table says root asked for it."""
    home = owned_dir(shared_tmp / "hermes", OWNER)
    path = home / "spool.db"
    sink = MemorySink()
    sink.refuse = lambda sid, rec: RowRejected("refused")
    with walspool.Spool(path) as spool:  # made by root, then given to the owner
        spool.append("s", {"role": "user", "content": "x"})
        assert Replayer(spool, sink).replay().quarantined == 1
        (row_id,) = [r.id for r in spool.records()]
    for made in home.iterdir():
        os.chown(made, OWNER, OWNER)
    assert main(["drop", str(path), "--id", str(row_id), "--yes"]) == 0, capfd.readouterr()
    with apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY) as conn:
        (actor,) = [a for (a,) in conn.execute("SELECT actor FROM audit")]
    name = pwd.getpwuid(OWNER).pw_name
    assert actor.startswith(f"root as {name} (uid {OWNER}"), actor
    assert {p.lstat().st_uid for p in home.iterdir()} == {OWNER}


@as_root
def test_the_owners_child_starts_with_an_environment_of_its_own():
    """What the child of root's command runs with (and would pass on): the owner's
    HOME, USER and LOGNAME, a plain PATH, of root's only the locale, the terminal, TZ,
    SUDO_USER and HERMES_HOME; umask 077."""
    from walspool.cli import _owner

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.environ.update(ROOTS_TOKEN="t0k3n", LANG="C", HERMES_HOME="/srv/h", SUDO_USER="ops")
        os.dup2(write, 1)  # descriptors above 2 are closed
        _owner.fresh_start(OWNER)
        os.write(1, json.dumps([dict(os.environ), os.umask(0)]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        env, umask = json.load(pipe)
    os.waitpid(pid, 0)
    entry = pwd.getpwuid(OWNER)
    assert umask == 0o077
    assert env.pop("HOME") == entry.pw_dir and env.pop("PATH") == _owner.CHILD_PATH
    assert env.pop("USER") == env.pop("LOGNAME") == entry.pw_name
    assert env.pop(maintenance.RUN_BY_ROOT_ENV) == "1"
    assert set(env) <= set(_owner.KEPT_ENVIRONMENT), env
    assert env["LANG"] == "C" and env["HERMES_HOME"] == "/srv/h" and env["SUDO_USER"] == "ops"
    assert "ROOTS_TOKEN" not in env


def owners_child(proc: subprocess.Popen[str]) -> tuple[int, dict[str, str]]:
    """The child root's process runs its command in, once it has become ``OWNER`` (looked
    for until then, within ``BOUND``): its pid and ``/proc`` status."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline and proc.poll() is None:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for child in map(int, children):
            with contextlib.suppress(OSError):
                lines = Path(f"/proc/{child}/status").read_text().splitlines()
                status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
                if status["Uid"].split()[0] == str(OWNER):
                    return child, status
        select.select([], [], [], 0.01)  # a short pause between looks
    raise AssertionError(f"no child became uid {OWNER}: {proc.poll()}")


# -- every directory on the way --------------------------------------------------------


@as_root
def test_a_directory_on_the_way_that_a_third_user_controls_is_refused(shared_tmp, capsys):
    """The neighbour owns a directory above the owner's spool: they could swap the
    owner's directory for another, so root refuses the spool, naming that directory."""
    above = owned_dir(shared_tmp / "neighbours", NEIGHBOUR, 0o755)
    made = gateway_spool(owned_dir(shared_tmp / "hermes", OWNER))
    os.rename(made.parent, above / "hermes")  # the owner's spool, moved below it
    spool_path = above / "hermes" / "spool.db"
    with pytest.raises(walspool.UntrustedSpool, match=f"{above}, on the way to"):
        walspool.Spool(spool_path)
    assert main(["stats", str(spool_path)]) == 1
    assert f"{above}, on the way to" in capsys.readouterr().err


def test_a_directory_on_the_way_others_can_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    (shared / "hermes").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(walspool.UntrustedSpool, match=r"shared, on the way to .* not sticky"):
        walspool.Spool(shared / "hermes" / "spool.db")
    shared.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    with walspool.Spool(shared / "hermes" / "spool.db") as spool:
        spool.append("s", {"role": "user", "content": "x"})


@as_root
def test_roots_import_never_follows_the_owners_link_into_a_third_users_files(shared_tmp, capfd):
    """The spool's owner links ``pending_messages`` in her home to another user's
    JSON spool: root's ``import-json`` of her home refuses the link (it would import the
    other user's messages into her spool and delete them); the files stay. A link of
    root's own, or one the other user made to his own directory, is followed."""
    home = owned_dir(shared_tmp / "owner", OWNER)
    spool = gateway_spool(home)
    theirs = owned_dir(shared_tmp / "neighbour" / "pending_messages", NEIGHBOUR)
    os.chown(theirs.parent, NEIGHBOUR, NEIGHBOUR)
    os.chmod(theirs.parent, 0o711)
    message = {"session_key": "t", "reason": "transcript_cap_drop", "ts": 1, "seq": 0}
    message["data"] = {"session_id": "t", "message": {"role": "user", "content": "theirs"}}
    pending = theirs / "pending-1.json"
    pending.write_text(json.dumps(message))
    os.chown(pending, NEIGHBOUR, NEIGHBOUR)
    made = as_user(
        OWNER,
        "import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
        str(theirs),
        str(home / "pending_messages"),
    )
    assert made.returncode == 0, made.stderr
    assert os.lstat(home / "pending_messages").st_uid == OWNER
    assert main(["import-json", str(spool), str(home / "pending_messages")]) == 1
    err = capfd.readouterr().err
    assert f"{home / 'pending_messages'}, on the way to" in err
    assert f"symbolic link of uid {OWNER} to {theirs}, which belongs to uid {NEIGHBOUR}" in err
    assert pending.exists()
    assert [r.session_id for r in walspool.Spool(spool).records()] == ["s"]
    # The other user's own link to his own directory, or root's, is his or root's word.
    (home / "pending_messages").unlink()
    for uid in (NEIGHBOUR, 0):
        link = shared_tmp / f"link-{uid}"
        link.symlink_to(theirs)
        os.chown(link, uid, uid, follow_symlinks=False)
        open_directory(link, link).close()


@as_root
@pytest.mark.parametrize(
    ("mode", "why"),
    [
        (0o600, "cannot read it: Permission denied"),  # root's import runs as her
        (0o644, f"owned by uid {NEIGHBOUR}, not by the directory's owner (uid {OWNER})"),
    ],
)
def test_roots_import_leaves_a_hard_link_to_another_users_file_in_place(
    shared_tmp, capfd, mode, why
):
    """Where ``fs.protected_hardlinks=0``, the owner of ``pending_messages`` can hard-link
    another user's pending file into it (made here by root for her): root's import
    would put that user's message into her spool, which she reads. Root's import runs
    as her, so a file she may not read stays; one she may read is not hers, and stays
    too: only files of the directory's owner are imported. The link is named, and her
    own file goes in."""
    home = owned_dir(shared_tmp / "owner", OWNER)
    spool = gateway_spool(home)
    pending = owned_dir(home / "pending_messages", OWNER)
    theirs = owned_dir(shared_tmp / "neighbour", NEIGHBOUR)

    def payload(session: str, text: str) -> str:
        data = {"session_id": session, "message": {"role": "user", "content": text}}
        return json.dumps(
            {
                "session_key": session,
                "reason": "transcript_cap_drop",
                "ts": 1,
                "seq": 0,
                "data": data,
            }
        )

    secret = theirs / "pending-9.json"
    secret.write_text(payload("t", "theirs"))
    os.chown(secret, NEIGHBOUR, NEIGHBOUR)
    os.chmod(secret, mode)
    os.link(secret, pending / "pending-2.json")
    own = pending / "pending-1.json"
    own.write_text(payload("s", "hers"))
    os.chown(own, OWNER, OWNER)
    assert main(["import-json", str(spool), str(pending)]) == 3
    out = capfd.readouterr().out
    assert f"left in place: pending-2.json: {why}" in out
    with walspool.Spool(spool) as s:
        assert [r.message["content"] for r in s.records()] == ["x", "hers"]
    assert (pending / "pending-2.json").exists() and not own.exists()


def test_an_import_directory_others_can_write_is_refused(tmp_path):
    """Anyone could plant a forged message file there for an import to spool."""
    pending = tmp_path / "pending_messages"
    pending.mkdir()
    planted = pending / "pending-1.json"
    planted.write_text(json.dumps({"session_id": "s", "message": "forged"}))
    pending.chmod(0o777)
    with walspool.Spool(tmp_path / "spool.db") as spool:
        with pytest.raises(walspool.UntrustedSpool, match="writable by group or others"):
            walspool.import_json_spool(spool, pending)
        assert list(spool.records()) == []
    assert planted.exists()


# -- group-writable directories: trusted when the group is the owner's alone ----------------

UNSHARE = shutil.which("unshare")
#: A user-private group, as Debian gives daemon: uid 1, group daemon (gid 1), no member.
UPG_USER = 1


def upg_user_ready() -> bool:
    try:
        user, group = pwd.getpwuid(UPG_USER), grp.getgrgid(UPG_USER)
    except KeyError:
        return False
    return (user.pw_gid, group.gr_name, group.gr_mem) == (UPG_USER, user.pw_name, []) and sum(
        e.pw_gid == UPG_USER for e in pwd.getpwall()
    ) == 1


needs_upg = pytest.mark.skipif(not upg_user_ready(), reason="needs daemon's private group")


@as_root
@needs_upg
def test_a_directory_on_the_way_writable_by_its_owners_private_group_is_trusted(shared_tmp):
    """umask 002 made the owner's directories 0775; the group is the owner's alone, so
    nobody else can swap what the path names. Given to a group others share, refused."""
    above = owned_dir(shared_tmp / "home", UPG_USER, 0o775)
    home = owned_dir(above / "hermes", UPG_USER, 0o700)
    done = as_user(UPG_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stdout + done.stderr
    os.chown(above, UPG_USER, NOBODY)  # group nogroup: sync and _apt are in it too
    done = as_user(UPG_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    assert f"{above}, on the way to" in done.stdout
    assert "its group nogroup is not its owner's alone" in done.stdout


@as_root
def test_a_directory_writable_by_group_root_is_refused(tmp_path):
    """Group 0 is never taken for root's alone: containers run processes no user
    database lists with gid 0 (an arbitrary uid with gid 0, as OpenShift does)."""
    shared = tmp_path / "shared"
    (shared / "hermes").mkdir(parents=True, mode=0o700)
    os.chown(shared, 0, 0)
    shared.chmod(0o775)
    with pytest.raises(walspool.UntrustedSpool, match="its group root is not its owner's alone"):
        walspool.Spool(shared / "hermes" / "spool.db")


OPEN_AND_APPEND = """
import sys, walspool
try:
    with walspool.Spool(sys.argv[1]) as spool:
        spool.append("s", {"role": "user", "content": "x"})
except walspool.WalspoolError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
print("ok")
"""

#: Each an administrator's edit of /etc/group or /etc/passwd after which daemon's
#: group holds someone else (or may: a group not named after it, not its primary).
EDITS = {
    "a member added": ("group", "daemon:x:1:", "daemon:x:1:nobody"),
    "another user's primary group": (
        "passwd",
        "daemon:x:1:1:",
        "intruder:x:4242:1::/nonexistent:/usr/sbin/nologin\ndaemon:x:1:1:",
    ),
    "named otherwise": ("group", "daemon:x:1:", "staff2:x:1:"),
    "no longer daemon's primary group": ("passwd", "daemon:x:1:1:", "daemon:x:1:65534:"),
}


@as_root
@needs_upg
@pytest.mark.skipif(UNSHARE is None, reason="needs unshare for a private /etc")
@pytest.mark.parametrize("edit", [None, *EDITS])
def test_a_private_group_that_gains_another_member_is_refused_at_the_next_open(
    shared_tmp, tmp_path, edit
):
    """The group is read at each open: after an administrator's edit (made here in a
    private mount namespace, /etc/group or /etc/passwd bind-mounted over) root's
    ``walspool stats`` refuses the 0775 home it read before."""
    home = owned_dir(shared_tmp / "hermes", UPG_USER, 0o775)
    done = as_user(UPG_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 0, done.stdout + done.stderr
    mounts = []
    for name in ("group", "passwd"):
        text = Path(f"/etc/{name}").read_text()
        if edit is not None and EDITS[edit][0] == name:
            _, old, new = EDITS[edit]
            assert old in text
            text = text.replace(old, new, 1)
        (tmp_path / name).write_text(text)
        mounts.append(f"mount --bind {tmp_path / name} /etc/{name}")
    script = " && ".join([*mounts, 'exec "$0" -m walspool stats "$1"'])
    ran = subprocess.run(
        [UNSHARE, "-m", "sh", "-c", script, sys.executable, str(home / "spool.db")],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if "mount" in ran.stderr and ran.returncode != 1:
        pytest.skip(f"no private mount namespace here: {ran.stderr.strip()}")
    if edit is None:
        assert ran.returncode == 0, ran.stderr
    else:
        assert ran.returncode == 1, ran.stdout + ran.stderr
        assert "its group" in ran.stderr and "is not its owner's alone" in ran.stderr
