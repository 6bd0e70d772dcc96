"""Trust only what the spool's owner made (walspool.store.files), with real second users.

The tests run as root in CI; the users are real: a child process switched with
``setpriv`` to ``nobody`` (the gateway's user here) or ``daemon`` (a careless or
hostile neighbour). Files are planted as that neighbour would have left them.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import sqlite3
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest
from _helpers import MemorySink
from _lock_holder import replay_lock_held
from _users import NOBODY, as_root, shared_directory
from _users import python_as as as_user

import walspool
import walspool.replay.jsonspool
import walspool.store.codec
import walspool.store.paging
import walspool.store.spool
from walspool.cli import main
from walspool.replay.replayer import Replayer

GATEWAY_USER = NOBODY
NEIGHBOUR = 1  # daemon


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other users can reach (pytest's own tmp_path is root's, 0700)."""
    with shared_directory("walspool-trust-", 0o711) as top:
        yield top


def owned_dir(path: Path, uid: int, mode: int = 0o700) -> Path:
    path.mkdir(parents=True)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


OPEN_AND_APPEND = """
import sys, walspool
try:
    with walspool.Spool(sys.argv[1]) as spool:
        spool.append("s", {"role": "user", "content": "secret"})
except walspool.WalspoolError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
print("ok")
"""


# -- directories and files someone else made ----------------------------------------------


@as_root
def test_a_directory_others_can_write_is_refused(shared_tmp):
    home = owned_dir(shared_tmp / "hermes", GATEWAY_USER, 0o777)
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("UntrustedSpool") and "chmod go-w" in done.stdout
    assert not (home / "spool.db").exists()


@as_root
def test_a_directory_of_another_user_is_refused(shared_tmp):
    home = owned_dir(shared_tmp / "hermes", NEIGHBOUR, 0o755)
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("UntrustedSpool") and "belongs to uid 1" in done.stdout


def private_group_of(uid: int) -> bool:
    """Whether ``uid``'s primary group is its own alone (read here without walspool):
    named as the user, no member listed but the user, nobody else's primary group."""
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrgid(user.pw_gid)
    except KeyError:
        return False
    return (
        group.gr_name == user.pw_name
        and set(group.gr_mem) <= {user.pw_name}
        and all(e.pw_gid != user.pw_gid or e.pw_uid == uid for e in pwd.getpwall())
    )


needs_private_group = pytest.mark.skipif(
    not private_group_of(NEIGHBOUR), reason="needs daemon's user-private group (Debian's)"
)


@as_root
@needs_private_group
def test_a_home_writable_by_its_owners_private_group_is_trusted(shared_tmp, capfd):
    """A home under umask 002 on a system of user-private groups (0775, the group the
    owner's alone): the owner spools there, root's commands read it."""
    owner = NEIGHBOUR  # daemon: uid 1, group daemon, which holds nobody else
    home = owned_dir(shared_tmp / "hermes", owner, 0o775)
    done = as_user(owner, OPEN_AND_APPEND, str(home / "spool.db"))
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stdout + done.stderr
    assert main(["stats", str(home / "spool.db"), "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["rows"] == 1
    assert (home / "spool.db").stat().st_uid == owner
    assert stat.S_IMODE(home.stat().st_mode) == 0o775  # left as the owner made it


@as_root
@pytest.mark.parametrize(
    "owner, group",
    [(NEIGHBOUR, GATEWAY_USER), (GATEWAY_USER, GATEWAY_USER)],
    ids=["other", "shared"],
)
def test_a_home_writable_by_a_group_that_holds_others_is_refused(shared_tmp, owner, group):
    """Group-writable by a group that is not the owner's alone: daemon's home in group
    nogroup, or nobody's home in its own primary group nogroup, which other users
    (sync, _apt) share and which is not named after it."""
    home = owned_dir(shared_tmp / "hermes", owner, 0o775)
    os.chown(home, owner, group)
    done = as_user(owner, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("UntrustedSpool") and "chmod go-w" in done.stdout
    assert f"its group {grp.getgrgid(group).gr_name} is not its owner's alone" in done.stdout
    assert not (home / "spool.db").exists()


def set_acl(path: Path, entries: list[tuple[int, int, int]]) -> None:
    """Give ``path`` the POSIX ACL of (tag, permissions, id) ``entries``, as ``setfacl``
    stores it (``system.posix_acl_access``); skips where the file system keeps none."""
    ordered = sorted(entries, key=lambda entry: (entry[0], entry[2]))  # as the kernel wants
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in ordered)
    try:
        os.setxattr(path, "system.posix_acl_access", raw)
    except OSError as exc:
        pytest.skip(f"no POSIX ACL on this file system: {exc}")


#: ACL tags and "no id" (the owner's, the group's, the mask's and others' entries).
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER, NO_ID = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 2**32 - 1


@as_root
@needs_private_group
@pytest.mark.parametrize("entry", ["user", "group"])
def test_a_home_others_may_write_through_its_acl_is_refused(shared_tmp, entry):
    """``setfacl -m u:nobody:rwx`` (or ``g:nogroup:rwx``) on daemon's 0700 home: the mode
    reads 0770 (the group bits are the ACL's mask) and the group is daemon's own, but
    nobody may write it. The owner's open is refused, naming the entry, and nothing is
    made there; the owner's own entries do not count."""
    owner = NEIGHBOUR  # daemon, whose group is its own: the mode alone looks private
    home = owned_dir(shared_tmp / "hermes", owner, 0o700)
    named = (USER, 7, GATEWAY_USER) if entry == "user" else (GROUP, 7, GATEWAY_USER)
    rest = [(GROUP_OBJ, 0, NO_ID), (MASK, 7, NO_ID), (OTHER, 0, NO_ID)]
    set_acl(home, [(USER_OBJ, 7, NO_ID), named, *rest])
    assert stat.S_IMODE(home.stat().st_mode) == 0o770
    done = as_user(owner, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    name = "nobody" if entry == "user" else grp.getgrgid(GATEWAY_USER).gr_name
    assert done.stdout.startswith("UntrustedSpool"), done.stdout
    assert f"through its ACL ({entry}:{name}:rwx)" in done.stdout and "setfacl -b" in done.stdout
    assert not (home / "spool.db").exists()
    # The owner's own entry, and read-only entries for others, are no reason.
    set_acl(home, [(USER_OBJ, 7, NO_ID), (USER, 7, owner), (USER, 5, GATEWAY_USER), *rest])
    done = as_user(owner, OPEN_AND_APPEND, str(home / "spool.db"))
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stdout + done.stderr


@pytest.mark.parametrize("planted", ["spool.db", "spool.db-wal", "spool.db-shm"])
@as_root
def test_a_spool_file_another_user_made_is_not_adopted(shared_tmp, planted):
    """Left by a neighbour while the directory was still open to them: refused, and
    nothing is written into it."""
    home = owned_dir(shared_tmp / "hermes", GATEWAY_USER)
    (home / planted).touch()
    os.chown(home / planted, NEIGHBOUR, NEIGHBOUR)
    os.chmod(home / planted, 0o666)
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(home / "spool.db"))
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("UntrustedSpool") and f"{planted} belongs to uid 1" in (
        done.stdout
    )
    assert (home / planted).stat().st_size == 0


@as_root
def test_root_on_the_gateway_users_spool_leaves_every_file_to_that_user(shared_tmp, tmp_path):
    """An operator's replay as root must not lock the gateway's user out of its spool."""
    home = owned_dir(shared_tmp / "hermes", GATEWAY_USER)
    spool_path = home / "spool.db"
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(spool_path))
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
    with walspool.Spool(spool_path) as spool:  # root, as `walspool replay` would run
        Replayer(spool, MemorySink()).replay()
        spool.append("s", {"role": "user", "content": "by root"})
    owners = {p.name: p.stat().st_uid for p in home.iterdir()}
    assert owners and set(owners.values()) == {GATEWAY_USER}, owners
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(spool_path))
    assert done.stdout.strip() == "ok", done.stdout + done.stderr


@as_root
def test_a_lock_file_root_left_behind_is_given_back_to_the_owner(shared_tmp):
    home = owned_dir(shared_tmp / "hermes", GATEWAY_USER)
    lock = home / "spool.db.replay-lock"
    lock.touch()  # an earlier walspool run as root made it root's
    with walspool.Spool(home / "spool.db") as spool:
        Replayer(spool, MemorySink()).replay()
    assert lock.stat().st_uid == GATEWAY_USER


def test_symlinks_among_the_spools_files_are_never_followed(tmp_path):
    """A link at ``-wal`` to a file of the owner's: refused, the target untouched
    (before, root could be made to chmod it to 0600)."""
    target = tmp_path / "precious"
    target.write_text("mine")
    os.chmod(target, 0o644)
    os.symlink(target, tmp_path / "spool.db-wal")
    with pytest.raises(walspool.SymlinkRefused, match="spool.db-wal is a symbolic link"):
        walspool.Spool(tmp_path / "spool.db")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.read_text() == "mine"


# -- FIFOs and stuck locks never hang ------------------------------------------------------


@contextlib.contextmanager
def must_return_within(seconds: int) -> Iterator[None]:
    """Fail the test, rather than hang it, if the block blocks (SIGALRM)."""

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for over {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_at_the_spool_path_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "spool.db"
    os.mkfifo(fifo)
    with must_return_within(10), pytest.raises(walspool.NotASpool, match="not a regular file"):
        walspool.Spool(fifo)
    for command in ("stats", "ls", "export", "check"):
        with must_return_within(10):
            assert main([command, str(fifo)]) == 1
        assert "not a regular file" in capsys.readouterr().err


def test_a_fifo_as_the_replay_lock_is_refused_without_blocking(tmp_path):
    path = tmp_path / "spool.db"
    os.mkfifo(f"{path}.replay-lock")
    with walspool.Spool(path) as spool:
        spool.append("s", 1)
        with must_return_within(10), pytest.raises(walspool.NotASpool, match="not a regular"):
            Replayer(spool, MemorySink()).replay()


def test_a_replay_lock_held_by_a_stuck_process_is_waited_for_within_a_bound(tmp_path):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s", 1)
        with replay_lock_held(path) as holder:
            with pytest.raises(walspool.ReplayBusy, match="stayed held for 0.2 s"):
                Replayer(spool, MemorySink()).replay(wait=0.2)
            with pytest.raises(walspool.ReplayBusy, match="another replay") as busy:
                Replayer(spool, MemorySink()).replay(wait=False)
            # walspool's replays write their pid into the lock file: the error names it
            assert busy.value.pid == holder.proc.pid
            assert f"process {holder.proc.pid} holds it" in str(busy.value)
            holder.release()
        assert Replayer(spool, MemorySink()).replay(wait=0.2).moved == 1
        # a replay writes its own pid while it holds the lock, and clears it after
        lock = Path(f"{path}.replay-lock")
        seen = []
        sink = MemorySink()
        write = sink.write
        sink.write = lambda *a, **k: (seen.append(lock.read_text()), write(*a, **k))[1]
        spool.append("s", 2)
        assert Replayer(spool, sink).replay().moved == 1
        assert seen == [f"{os.getpid()}\n"] and lock.read_text() == ""


def test_the_replay_lock_is_free_after_a_replay(tmp_path):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        Replayer(spool, MemorySink()).replay()
    fd = os.open(f"{path}.replay-lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if it were still held
    finally:
        os.close(fd)


# -- every error is a walspool error --------------------------------------------------------


def test_a_path_through_a_file_is_a_walspool_error(tmp_path):
    (tmp_path / "not-a-dir").write_text("x")
    with pytest.raises(walspool.SpoolIOError, match="cannot prepare spool"):
        walspool.Spool(tmp_path / "not-a-dir" / "spool.db")


# -- a crafted spool runs none of its own SQL -----------------------------------------------

RECURSIVE_BACKLOG = """
DROP VIEW backlog;
CREATE VIEW backlog AS
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)
SELECT NULL AS session_id, NULL AS session_key, i AS rows, 0 AS bytes, '' AS oldest,
       '' AS newest, 0 AS max_attempts, NULL AS last_error, 0 AS quarantined,
       0 AS superseded
FROM n;
"""


def craft(path: Path, sql: str) -> None:
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "real"})
    conn = apsw.Connection(str(path))
    conn.execute(sql)
    conn.close()


def test_a_crafted_view_is_refused_by_the_read_commands(tmp_path, capsys):
    """An endless recursive ``backlog``: ``ls`` used to hang and ``check`` said ok."""
    path = tmp_path / "spool.db"
    craft(path, RECURSIVE_BACKLOG)
    with must_return_within(20):
        assert main(["ls", str(path)]) == 1
    assert "the view `backlog` is not walspool's definition" in capsys.readouterr().err
    with must_return_within(20):
        assert main(["check", str(path), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert "the view `backlog` is not walspool's definition" in result["problems"]


def test_a_planted_trigger_never_runs(tmp_path, caplog):
    """A trigger that would rewrite every appended row: the spool is not used (moved
    aside, kept), and a fresh one takes the appends as they are."""
    path = tmp_path / "spool.db"
    craft(
        path,
        "CREATE TRIGGER forge AFTER INSERT ON records BEGIN "
        """UPDATE records SET payload = '{"content": "forged"}' WHERE id = new.id; END""",
    )
    with walspool.Spool(path) as spool:
        spool.append("s", {"role": "user", "content": "mine"})
        assert [r.message["content"] for r in spool.records()] == ["mine"]
    assert "the trigger `forge` is not walspool's" in caplog.text
    assert [p for p in tmp_path.iterdir() if ".damaged-" in p.name]


# -- terminal and log injection ---------------------------------------------------------

FORGED = "\x1b[2K\rFORGED OUTPUT\x9b31m\u202e"


def test_text_from_users_reaches_the_terminal_escaped(tmp_path, capsys):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("victim", {"role": "user", "content": FORGED})
        spool.append("s1\ns2 999 rows", {"role": "user", "content": "x"}, reason=f"r{FORGED}")
    outputs = []
    for argv in (["ls"], ["stats"], ["show", "victim"], ["show", "victim", "--full"],
                 ["show", "s1\ns2 999 rows"], ["check"]):  # fmt: skip
        assert main([argv[0], str(path), *argv[1:]]) == 0, argv
        outputs.append(capsys.readouterr().out)
    for out in outputs:
        assert not any(c in out for c in "\x1b\r\x9b\u202e"), repr(out)
    ls = outputs[0].splitlines()
    assert len(ls) == 3  # the header and one line per session: no forged row
    assert "s1\\ns2 999 rows" in outputs[0]
    assert "\\x1b[2K FORGED OUTPUT\\x9b31m\\u202e" in outputs[2]  # a preview: one line
    # --full: JSON, with what JSON leaves raw escaped as JSON escapes as well
    assert "\\u001b[2K\\rFORGED OUTPUT\\u009b31m\\u202e" in outputs[3]
    # --json stays the lossless form
    assert main(["show", str(path), "victim", "--json", "--full"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["message"]["content"] == FORGED


def test_text_from_users_cannot_forge_a_log_line(tmp_path, caplog):
    path = tmp_path / "spool.db"
    with walspool.Spool(path) as spool:
        spool.append("s\nWARNING forged line", {"role": None, "content": "refused"})
        session_db = MemorySink()
        session_db.refuse = lambda sid, rec: sqlite3.IntegrityError(
            "NOT NULL constraint failed: messages.role"
        )
        with caplog.at_level(logging.INFO, logger="walspool"):
            assert Replayer(spool, session_db).replay().quarantined == 1
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("walspool")]
    assert lines and all("\n" not in line for line in lines)
    assert any("s\\nWARNING forged line" in line for line in lines)


# -- memory bounded by bytes, not rows ------------------------------------------------------


def test_pages_and_replay_batches_are_bounded_by_bytes(tmp_path, monkeypatch, capsys):
    """With pages that hold what two rows cost but not three, rows come two to a page
    and to a replay batch, and every path still sees every row once, in order."""
    path = tmp_path / "spool.db"
    text = [f"{i}:" + "x" * 560 for i in range(9)]
    with walspool.Spool(path) as spool:
        spool.append_many([("s", {"role": "user", "content": t}) for t in text])
        # What one row costs a page: its stored bytes and what decoding makes of it.
        (row,) = list(spool.records(session_id="s"))[:1]
        payload = walspool.store.codec.encode(row.message)
        cost = len(b"s") + len(row.reason.encode()) + len(payload)
        cost += walspool.store.codec.decoded_bytes(payload)
        monkeypatch.setattr(walspool.store.paging, "PAGE_BYTES", 2 * cost - 1)
        assert [r.message["content"] for r in spool.records()] == text
        assert [r.message["content"] for r in spool.records(session_id="s")] == text
        assert main(["show", str(path), "s", "--json", "--full"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [r["message"]["content"] for r in shown] == text
        assert main(["export", str(path)]) == 0
        exported = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["message"]["content"] for r in exported] == text
        batches: list[int] = []
        execute = spool.transact

        def counting(fn: Any) -> Any:
            result = execute(fn)
            if getattr(getattr(fn, "func", None), "__name__", "") == "_take":
                batches.append(len(result[0]))
            return result

        spool.transact = counting  # type: ignore[method-assign]
        sink = MemorySink()
        assert Replayer(spool, sink).replay().moved == 9
    assert sink.contents("s") == text
    assert batches == [2, 2, 2, 2, 1, 0]  # the last: streams spooled by key only (none)


# -- import-json: files read within bounds, deleted only if unchanged ------------------------


def pending(directory: Path, n: int, text: str = "x") -> Path:
    payload = {
        "session_key": "s",
        "reason": walspool.CAP_DROP,
        "ts": 1_767_225_600 + n,
        "seq": n,
        "data": {"session_id": "s", "message": {"role": "user", "content": f"{n}{text}"}},
    }
    path = directory / f"pending-{n:032x}.json"
    path.write_text(json.dumps(payload))
    return path


def test_an_oversized_file_is_refused_from_its_size_and_left_in_place(tmp_path):
    """A 2 GiB sparse file: never read into memory, reported, left; the rest imports."""
    directory = tmp_path / "pending_messages"
    directory.mkdir()
    pending(directory, 1)
    huge = directory / f"pending-{2:032x}.json"
    with open(huge, "wb") as f:
        f.truncate(2 * 1024**3)
    with walspool.Spool(tmp_path / "spool" / "spool.db", max_payload_bytes=4096) as spool:
        report = walspool.import_json_spool(spool, directory)
        assert report.imported == 1
        (why,) = report.skipped
        assert why.startswith(huge.name) and "2147483648 bytes" in why
    assert huge.exists() and huge.stat().st_size == 2 * 1024**3


def test_a_file_changed_after_it_was_read_is_not_deleted(tmp_path, monkeypatch):
    directory = tmp_path / "pending_messages"
    directory.mkdir()
    files = [pending(directory, n) for n in range(3)]
    with walspool.Spool(tmp_path / "spool" / "spool.db") as spool:
        append_many = spool.append_many

        def then_touch(items: Any, **kw: Any) -> Any:
            receipts = append_many(items, **kw)
            with open(files[1], "a") as f:  # someone rewrites it meanwhile
                f.write(" ")
            return receipts

        monkeypatch.setattr(spool, "append_many", then_touch)
        report = walspool.import_json_spool(spool, directory)
    assert report.imported == 3
    assert [s.split(":")[0] for s in report.skipped] == [files[1].name]
    assert [f.exists() for f in files] == [False, True, False]


def test_import_batches_are_bounded_by_bytes(tmp_path, monkeypatch):
    """A batch holds files until what they cost (their bytes and what decoding makes of
    them) would pass ``BATCH_BYTES``: set to fit two of these files, not three."""
    directory = tmp_path / "pending_messages"
    directory.mkdir()
    paths = [pending(directory, n, "y" * 700) for n in range(6)]
    raw = paths[0].read_bytes()
    cost = len(raw) + walspool.store.codec.decoded_bytes(raw)
    assert all(len(p.read_bytes()) == len(raw) for p in paths)
    monkeypatch.setattr(walspool.replay.jsonspool, "BATCH_BYTES", 3 * cost - 1)
    with walspool.Spool(tmp_path / "spool" / "spool.db") as spool:
        batches: list[int] = []
        append_many = spool.append_many

        def counting(items: Any, **kw: Any) -> Any:
            batches.append(len(items))
            return append_many(items, **kw)

        monkeypatch.setattr(spool, "append_many", counting)
        assert walspool.import_json_spool(spool, directory).imported == 6
        assert [r.message["content"][0] for r in spool.records()] == list("012345")
    assert batches == [2, 2, 2]


def test_a_symlinked_home_is_followed(tmp_path, capsys):
    """``HERMES_HOME`` a symlink to the real directory (common): the spool opens,
    appends, replays and reads through it; only the spool's own name may not be one."""
    real = owned_dir(tmp_path / "real", os.geteuid())
    home = tmp_path / "home"
    home.symlink_to(real)
    with walspool.Spool(home / "spool.db") as spool:
        spool.append("s", {"role": "user", "content": "through the link"})
        assert Replayer(spool, MemorySink()).replay().moved == 1
        spool.append("s", {"role": "user", "content": "again"})
    assert main(["stats", str(home / "spool.db"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1
    files = {p.name for p in real.iterdir()}
    assert {"spool.db", "spool.db.open-lock", "spool.db.replay-lock"} <= files
    assert files <= {"spool.db", "spool.db-wal", "spool.db-shm", "spool.db.open-lock",
                     "spool.db.replay-lock"}  # fmt: skip


@pytest.mark.parametrize("step", ["open_directory", "make_and_check", "open_private"])
def test_a_spool_directory_removed_during_the_open_is_a_walspool_error(tmp_path, monkeypatch, step):
    """The directory goes away between two steps of ``Spool()`` (another process
    cleaning up): a ``WalspoolError`` that names the spool, never a raw OSError."""
    import walspool.store.files as files

    spool_dir = tmp_path / "sub"
    real = getattr(files, step)

    def then_remove(*args: Any, **kw: Any) -> Any:
        result = real(*args, **kw)
        shutil.rmtree(spool_dir, ignore_errors=True)
        return result

    monkeypatch.setattr(files, step, then_remove)
    with pytest.raises(walspool.WalspoolError, match=str(spool_dir / "spool.db")):
        walspool.Spool(spool_dir / "spool.db")


#: The owner's crafted statistics table: ``sqlite_stat1`` redefined (``writable_schema``)
#: with a generated ``stat`` column computing ``argv[2]`` characters; SQLite reads the
#: table while it loads the schema, before any statement of walspool's.
CRAFT_STAT1 = """
import sys, apsw
conn = apsw.Connection(sys.argv[1])
conn.execute("ANALYZE")
conn.execute("PRAGMA writable_schema = ON")
conn.execute(
    "UPDATE sqlite_schema SET sql = 'CREATE TABLE sqlite_stat1(tbl,idx,st,"
    f" stat GENERATED ALWAYS AS (printf(''%.*c'', {int(sys.argv[2])}, ''x'')) VIRTUAL)'"
    " WHERE name = 'sqlite_stat1'"
)
conn.close()
conn = apsw.Connection(sys.argv[1])  # the crafted schema loaded: rows of it, if asked
conn.execute(
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
    "INSERT INTO sqlite_stat1 (tbl, idx, st) SELECT 'records', 'no_such_index_' || i, '1' "
    "FROM n",
    (int(sys.argv[3]) - 1,),
)
conn.close()
"""


def crafted_spool(home: Path, chars: int, rows: int = 1) -> Path:
    """The owner's spool holding one row, its ``sqlite_stat1`` crafted (``CRAFT_STAT1``)
    to compute ``chars`` characters for each of its ``rows`` rows."""
    path = home / "spool.db"
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(path))
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stdout + done.stderr
    done = as_user(GATEWAY_USER, CRAFT_STAT1, str(path), str(chars), str(rows))
    assert done.returncode == 0, done.stderr
    return path


@as_root
def test_a_statistics_table_made_to_compute_a_huge_value_never_runs_in_roots_commands(
    shared_tmp, capfd, caplog
):
    """The owner's sqlite_stat1 computes a 200 MB value whenever SQLite loads the
    schema (root's `walspool check` peaked near 1 GB before): root's commands stop at
    walspool's bound on values before any check and say what to do; the owner's own
    open moves the file aside, as a damaged spool, saying why."""
    path = crafted_spool(owned_dir(shared_tmp / "hermes", GATEWAY_USER), 200_000_000)
    assert main(["check", str(path), "--json"]) == 1
    (problem,) = json.loads(capfd.readouterr().out)["problems"]
    assert "loading its schema made a value too long for walspool's bounds" in problem
    assert "DROP TABLE sqlite_stat1" in problem
    assert main(["stats", str(path)]) == 1
    assert "loading its schema made a value too long" in capfd.readouterr().err
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(path))
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stdout + done.stderr
    assert "loading its schema made a value too long" in done.stderr  # the moved-aside line
    moved = path.parent.glob("spool.db.damaged-*")
    assert [p for p in moved if not p.name.endswith(("-wal", "-shm"))]


@as_root
def test_a_statistics_table_of_many_costly_values_stops_at_walspools_cpu_bound(shared_tmp, capfd):
    """The owner's sqlite_stat1 holds 100,000 rows, each computing a megabyte (within
    the bound on values, and few steps each: about 35 s of CPU in all for every
    command, every watch reading and every start before this bound): root's commands
    stop once the schema's load used UNVERIFIED_CPU_SECONDS and say what to do."""
    path = crafted_spool(owned_dir(shared_tmp / "hermes", GATEWAY_USER), 1_000_000, 100_000)
    for argv in (["stats", str(path)], ["check", str(path)]):
        assert main(argv) == 1, argv
        said = capfd.readouterr()
        assert "loading its schema took too long for walspool's bounds" in said.out + said.err
        assert "DROP TABLE sqlite_stat1" in said.out + said.err


@as_root
def test_a_statistics_table_sqlite_would_not_make_is_named_by_check(shared_tmp, capfd):
    """A crafted sqlite_stat1 whose value stays small loads within the bounds: check
    names it, and no command reads the spool; a plain ANALYZE's is no problem."""
    path = crafted_spool(owned_dir(shared_tmp / "hermes", GATEWAY_USER), 10)
    assert main(["check", str(path), "--json"]) == 1
    assert json.loads(capfd.readouterr().out)["problems"] == [
        "the table `sqlite_stat1` is not SQLite's definition"
    ]
    plain = owned_dir(shared_tmp / "plain", GATEWAY_USER) / "spool.db"
    done = as_user(GATEWAY_USER, OPEN_AND_APPEND, str(plain))
    assert done.returncode == 0, done.stderr
    analyze = "import apsw, sys; apsw.Connection(sys.argv[1]).execute('ANALYZE')"
    assert as_user(GATEWAY_USER, analyze, str(plain)).returncode == 0
    assert main(["check", str(plain), "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["problems"] == []
