"""Import upstream hermes-agent's JSON-file spool (``pending_messages/pending-*.json``).

Newer hermes-agent releases keep what they could not write to ``state.db`` as one
JSON file per message in ``<HERMES_HOME>/pending_messages``. ``import_json_spool``
moves such a directory into a walspool ``Spool``, in upstream's drop order, and
removes each file once its row is committed.

How each kind of file becomes a spool row:

* cap drop (``reason == "transcript_cap_drop"``): ``session_id = data.session_id``,
  ``message = data.message`` exactly as queued, ``session_key`` None (upstream's
  ``session_key`` is only a copy of the session id), reason ``CAP_DROP``. Needs a
  ``data.session_id`` string and a ``data.message`` object.
* shutdown slot and FIFO overflow (any other reason, e.g. "shutdown",
  "adapter_shutdown"): ``session_id = data.session_id`` when the file has one, else
  None (resolved from the key at replay); ``session_key`` = the file's
  ``session_key``; ``message`` = the ``data`` object, so text and platform metadata
  are kept; the reason string as the file spells it. When ``data`` has no
  ``timestamp`` and the file's ``ts`` is a usable number, ``timestamp = ts`` is added
  to the message: upstream's recovery writes the row with ``timestamp=ts``, and a
  sink reads a message's own ``timestamp`` (it would otherwise use the import time).
  Needs a ``data`` object with text or media, and a session key or id, the
  structure upstream's own recovery needs.
* agent history (``reason == AGENT_HISTORY``): ``message`` = the whole file (session
  id, count, messages, issue), ``session_id`` = its ``session_id``, else its
  ``session_key``, else ``"unknown"`` as the gateway link spools a history without an
  id. Needs a ``messages`` list. Replay leaves these rows alone unless asked.

Order: files are appended in upstream's order ``(ts, seq, file name)``, ``ts`` and
``seq`` as numbers; a value that is not a finite number within float range (text,
a bool, NaN, ``10**400``) sorts as 0.0, a missing ``seq`` as -1. Within a session the
spool's ``seq`` follows that order, after any rows the session already has.

Removal: files are appended in batches of up to ``batch_files`` consecutive files of
one reason, one transaction each; a batch's files are unlinked only after
``append_many`` returned, that is after the commit, and the directory is fsynced
after each batch's unlinks.

Not guaranteed:

* Exactly once across a crash. A process killed after a batch commits and before all
  its files are unlinked leaves those files behind, and the next import appends them
  again: at most one batch (``batch_files`` messages) is duplicated per crash, never
  lost. The spool's public API gives no way to commit a marker atomically with the
  rows, and telling a re-imported file from a genuinely repeated message by content
  could lose a message, which is worse than a duplicate. ``batch_files=1`` narrows
  the window to one file, at the cost of one commit per file.
* Exclusion from upstream itself. The directory is locked (``flock``) against a
  second ``import_json_spool``, but a running upstream gateway does not take that
  lock and may replay the same files into ``state.db``: stop it first.

With ``source_key`` (the gateway's drop-in uses it), the import is exactly once
instead: each row's message carries its file's name under that key, and a journal
file (``.walspool-import``) in the directory marks an import in progress. A run that
finds the journal (the last one was killed) first collects the file names its rows
carry (one scan of the spool) and removes those files without appending them again.
That assumes the rows are still in the spool, which holds when nothing replays them
between the interrupted import and the next (the drop-in imports first at startup).

Files left in place, each logged at WARNING with its name and why: unreadable ones
(not a regular file, a symbolic link, permission denied), ones that are not JSON or
not a JSON object, ones too costly to decode (nested deeper than ``codec.MAX_DEPTH``,
or more than ``codec.MAX_VALUES`` values: checked on the text before it is parsed),
ones missing the fields above, and ones the spool refuses (a name it cannot store, a
payload over ``max_payload_bytes``). Upstream's quarantined files (``*.json.bad``) are
left alone and listed in the report.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import math
import os
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from .. import text
from ..errors import InvalidArgument, PayloadTooLarge, WalspoolError
from ..store import codec, streams
from ..store.directories import open_directory
from ..store.records import AGENT_HISTORY, CAP_DROP
from ..store.spool import Spool

log = text.logger("walspool.jsonspool")

#: Names upstream gives its spool files.
FILE_PATTERN = "pending-*.json"
#: Names of files upstream has quarantined; never touched here.
QUARANTINE_PATTERN = "*.json.bad"
#: Files committed per transaction by default; also the most a crash can duplicate.
DEFAULT_BATCH_FILES = 256
#: A batch also ends once its files reach this many bytes, so memory is bounded by
#: bytes, not by the number of files.
BATCH_BYTES = 16 * 1024 * 1024
#: Marks an import in progress (``source_key`` imports); removed when it ends.
JOURNAL_NAME = ".walspool-import"
#: Sort value of a payload with no ``seq`` (a slot head), as upstream sorts it.
MISSING_SEQ = -1
#: Session id of an agent history that names no session, as the gateway link uses.
UNKNOWN_SESSION = "unknown"
#: Keys of a slot's ``data`` that carry media, which count as content without text.
MEDIA_KEYS = ("media", "media_urls")

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

OnProgress = Callable[[int, int], None]


class ImportReport(msgspec.Struct, frozen=True):
    """What ``import_json_spool`` did.

    ``skipped`` lists the files left in place as ``"name: why"``; ``quarantined``
    lists upstream's ``*.json.bad`` files, which are never imported.
    """

    imported: int
    skipped: list[str]
    by_reason: dict[str, int]
    quarantined: list[str] = msgspec.field(default_factory=list)


class _Refused(Exception):
    """A file that stays where it is; the message says why."""


class _Item(NamedTuple):
    """One file's row: what ``append_many`` takes, plus the file it came from."""

    name: str
    reason: str
    session_id: str | None
    message: Any
    session_key: str | None
    #: (device, inode, size, mtime) of the file as read: it is deleted only if it is
    #: still that file.
    identity: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: What the file costs in memory, about (its bytes and what decoding made of
    #: them), for batching by bytes.
    size: int = 0


def import_json_spool(
    spool: Spool,
    directory: str | os.PathLike[str],
    *,
    progress: OnProgress | None = None,
    batch_files: int = DEFAULT_BATCH_FILES,
    source_key: str | None = None,
) -> ImportReport:
    """Move upstream's ``pending-*.json`` files from ``directory`` into ``spool``.

    ``progress(done, total)`` is called with 0 first, then as files are imported or
    skipped. ``source_key``: keep each file's name in its message under this key and
    import exactly once across crashes (see the module docstring). Raises
    ``WalspoolError`` when the directory is missing, unreadable or being imported
    by another process; a spool error (``SpoolFull``, ``DiskFull``)
    propagates, and the files not yet committed stay for the next run.
    """
    if batch_files < 1:
        raise InvalidArgument(f"batch_files must be at least 1, not {batch_files}")
    path = Path(directory)
    dir_fd = _open_directory(path)
    try:
        _lock_directory(dir_fd, path)
        return _Import(spool, path, dir_fd, progress, batch_files, source_key).run()
    finally:
        os.close(dir_fd)


class _Import:
    """One pass over one directory: read, order, append in batches, unlink."""

    def __init__(
        self,
        spool: Spool,
        path: Path,
        dir_fd: int,
        progress: OnProgress | None,
        batch_files: int,
        source_key: str | None = None,
    ) -> None:
        self.source_key = source_key
        #: Files an interrupted import committed but did not remove (``source_key``).
        self.already: set[str] = set()
        self.journal = False
        self.spool = spool
        # Upstream writes JSON with non-ASCII as \uXXXX escapes (six bytes for what
        # UTF-8 spells in three) around the message: twice the payload limit, plus room.
        self.max_file_bytes = 2 * spool.max_payload_bytes + 64 * 1024
        self.path = path
        self.dir_fd = dir_fd
        #: The directory's owner: only files of theirs are imported.
        self.owner = os.fstat(dir_fd).st_uid
        self.progress = progress
        self.batch_files = batch_files
        self.skipped: list[str] = []
        self.by_reason: Counter[str] = Counter()
        self.done = 0
        self.total = 0

    def run(self) -> ImportReport:
        names, quarantined = self._list()
        self.total = len(names)
        self._report_progress()
        if self.source_key is not None and names:
            self._begin_journal()
        batch: list[_Item] = []
        for name in self._in_drop_order(names):
            item = self._item(name)
            if item is None:
                continue
            if name in self.already:
                if batch:
                    self._commit(batch)
                    batch = []
                self._finish_committed(item)
                continue
            if batch and (
                item.reason != batch[0].reason
                or len(batch) >= self.batch_files
                or sum(i.size for i in batch) + item.size > BATCH_BYTES
            ):
                self._commit(batch)
                batch = []
            batch.append(item)
        if batch:
            self._commit(batch)
        if self.journal:
            self._end_journal()
        if quarantined:
            log.warning(
                "Left %d quarantined file(s) (%s) in %s alone; inspect them by hand",
                len(quarantined),
                QUARANTINE_PATTERN,
                self.path,
            )
        imported = sum(self.by_reason.values())
        log.info(
            "Imported %d file(s) from %s into %s; %d left in place",
            imported,
            self.path,
            self.spool.path,
            len(self.skipped),
        )
        return ImportReport(imported, self.skipped, dict(self.by_reason), quarantined)

    # -- reading -------------------------------------------------------------------

    def _list(self) -> tuple[list[str], list[str]]:
        try:
            entries = os.listdir(self.dir_fd)
        except OSError as exc:
            raise WalspoolError(f"cannot list {self.path}: {exc.strerror}", path=self.path) from exc
        names = sorted(n for n in entries if fnmatch.fnmatchcase(n, FILE_PATTERN))
        quarantined = sorted(n for n in entries if fnmatch.fnmatchcase(n, QUARANTINE_PATTERN))
        return names, quarantined

    def _in_drop_order(self, names: list[str]) -> list[str]:
        """Names sorted by upstream's key; unreadable files are skipped here.

        Only the keys are kept, so memory stays small however many files there are;
        each file is read again when its turn comes.
        """
        keyed = []
        for name in names:
            try:
                payload, _, _ = _read_payload(self.dir_fd, name, self.max_file_bytes, self.owner)
                keyed.append((sort_key(payload, name), name))
            except _Refused as exc:
                self._skip(name, str(exc))
        keyed.sort()
        return [name for _, name in keyed]

    def _item(self, name: str) -> _Item | None:
        try:
            payload, st, cost = _read_payload(self.dir_fd, name, self.max_file_bytes, self.owner)
            item = _item_from(payload, name)
        except _Refused as exc:
            self._skip(name, str(exc))
            return None
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        item = item._replace(identity=identity, size=cost)
        if self.source_key is not None and isinstance(item.message, dict):
            item = item._replace(message={**item.message, self.source_key: name})
        return item

    # -- exactly once (source_key) ---------------------------------------------------

    def _begin_journal(self) -> None:
        """Find what an interrupted import committed, then mark this one in progress."""
        try:
            os.stat(JOURNAL_NAME, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            self.already = self._committed_names()
            log.warning(
                "%s: an earlier import was interrupted; %d of its file(s) are already in %s "
                "and are removed without importing them again",
                self.path,
                len(self.already),
                self.spool.path,
            )
        fd = os.open(
            JOURNAL_NAME,
            os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self.dir_fd,
        )
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(self.dir_fd)
        self.journal = True

    def _committed_names(self) -> set[str]:
        """The file names the spool's rows carry under ``source_key``."""
        return streams.names_under(self.spool, self.source_key)

    def _finish_committed(self, item: _Item) -> None:
        """A file an interrupted import committed: remove it, count it as imported."""
        self._remove([item])
        self.by_reason[item.reason] += 1
        self.done += 1
        self._report_progress()

    def _end_journal(self) -> None:
        try:
            os.unlink(JOURNAL_NAME, dir_fd=self.dir_fd)
            os.fsync(self.dir_fd)
        except OSError as exc:
            log.debug("cannot remove %s in %s: %s", JOURNAL_NAME, self.path, exc)

    # -- writing -------------------------------------------------------------------

    def _commit(self, batch: list[_Item]) -> None:
        """Append one batch in one transaction, then remove its files.

        A batch the spool refuses as given (a name it cannot store, a payload too
        large) is retried file by file, so only the refused files stay behind.
        """
        reason = batch[0].reason
        try:
            self.spool.append_many(
                [(i.session_id, i.message, i.session_key) for i in batch], reason=reason
            )
        except (InvalidArgument, PayloadTooLarge) as exc:
            if len(batch) == 1:
                self._skip(batch[0].name, f"the spool refused it: {exc}")
                return
            for item in batch:
                self._commit([item])
            return
        self._remove(batch)
        self.by_reason[reason] += len(batch)
        self.done += len(batch)
        self._report_progress()

    def _remove(self, items: list[_Item]) -> None:
        """Unlink files whose rows are committed, if each is still the file that was
        read; fsync the directory once."""
        for item in items:
            name = item.name
            try:
                st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != item.identity:
                    log.error(
                        "Imported %s into %s, but the file changed after it was read; left "
                        "it in place: check it by hand (the next import spools it again)",
                        self.path / name,
                        self.spool.path,
                    )
                    self.skipped.append(f"{name}: imported, but it changed after it was read")
                    continue
                os.unlink(name, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error(
                    "Imported %s into %s but could not delete it (%s); delete it by hand, "
                    "or the next import spools it again",
                    self.path / name,
                    self.spool.path,
                    exc.strerror,
                )
                self.skipped.append(f"{name}: imported, but could not be deleted: {exc.strerror}")
        try:
            os.fsync(self.dir_fd)
        except OSError as exc:
            log.debug("fsync of %s failed: %s", self.path, exc)

    # -- reporting -----------------------------------------------------------------

    def _skip(self, name: str, why: str) -> None:
        log.warning("Left %s in place: %s", self.path / name, why)
        self.skipped.append(f"{name}: {why}")
        self.done += 1
        self._report_progress()

    def _report_progress(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)


def check_directory(directory: str | os.PathLike[str]) -> None:
    """Raise the ``WalspoolError`` ``import_json_spool`` would for a directory it cannot
    use (missing, not a directory, refused by the checks), before a spool is opened."""
    os.close(_open_directory(Path(directory)))


def _open_directory(path: Path) -> int:
    """A descriptor of the import directory, opened through checked directories
    (``walspool.store.directories``): nobody but its owner and root can plant files in it
    or swap it, so every file read below it (by ``dir_fd``) is theirs."""
    try:
        with open_directory(path, path) as checked:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=checked.fd)
    except FileNotFoundError:
        raise WalspoolError(
            f"{path} does not exist; upstream keeps its JSON spool in "
            "<HERMES_HOME>/pending_messages",
            path=path,
        ) from None
    except NotADirectoryError:
        raise WalspoolError(f"{path} is not a directory", path=path) from None
    except OSError as exc:
        raise WalspoolError(f"cannot open {path}: {exc.strerror}", path=path) from exc


def _lock_directory(dir_fd: int, path: Path) -> None:
    """Hold an exclusive ``flock`` on the directory, so two imports never race.

    The lock goes with the descriptor: it is released on close or process death.
    """
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise WalspoolError(
            f"another walspool import of {path} is running; wait for it to finish",
            path=path,
        ) from None


def _read_payload(
    dir_fd: int, name: str, max_bytes: int, owner: int
) -> tuple[dict[str, Any], os.stat_result, int]:
    """Read and parse one spool file; raise ``_Refused`` saying why it is unusable.

    Parsed with the stdlib ``json`` module, which reads what upstream's
    ``json.dump`` writes (including ``NaN``). Only regular files of ``owner`` (the
    directory's) are read, never through a symbolic link, and a FIFO cannot block the
    import. A file over
    ``max_bytes`` is refused from its size before anything is read, and one nested
    deeper than ``codec.MAX_DEPTH`` or holding more than ``codec.MAX_VALUES`` values
    from its text before it is parsed. Returns the payload, the file's ``fstat`` and
    what it costs in memory, about (its bytes and ``codec.decoded_bytes``).
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _Refused("it disappeared during the import") from None
    except OSError as exc:
        why = "it is a symbolic link" if _is_symlink(dir_fd, name) else exc.strerror
        raise _Refused(f"cannot read it: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("not a regular file")
        if st.st_uid != owner:
            # A hard link to another user's file (where fs.protected_hardlinks=0 lets
            # the directory's owner make one): importing it would hand its message over.
            raise _Refused(
                f"owned by uid {st.st_uid}, not by the directory's owner (uid {owner}): "
                "only the gateway's own files are imported"
            )
        if st.st_size > max_bytes:
            raise _Refused(
                f"{st.st_size} bytes, more than a message within the spool's "
                f"max_payload_bytes can take as JSON ({max_bytes})"
            )
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise _Refused(f"it grew past {max_bytes} bytes while it was read")
    except OSError as exc:
        raise _Refused(f"cannot read it: {exc.strerror}") from None
    except MemoryError:
        raise _Refused(f"{st.st_size} bytes do not fit in this process's memory") from None
    finally:
        os.close(fd)
    try:
        codec.check_budget(raw)
    except codec.OverBudget as exc:
        raise _Refused(f"too costly to decode: {exc}") from None
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _Refused(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise _Refused(f"not a JSON object but {type(payload).__name__}")
    return payload, st, len(raw) + codec.decoded_bytes(raw)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def sort_key(payload: dict[str, Any], name: str) -> tuple[float, float, str]:
    """Upstream's drop-order key ``(ts, seq, file name)``."""
    return sort_number(payload.get("ts")), sort_number(payload.get("seq", MISSING_SEQ)), name


def sort_number(value: Any) -> float:
    """``value`` as a finite float; anything else (text, bool, NaN, ``10**400``) as 0.0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) else 0.0


def _item_from(payload: dict[str, Any], name: str) -> _Item:
    """Map one payload to its spool row (see the module docstring)."""
    reason = payload.get("reason")
    if not isinstance(reason, str) or not reason:
        raise _Refused("no reason string")
    if reason == CAP_DROP:
        return _cap_drop(payload, name)
    if reason == AGENT_HISTORY:
        return _agent_history(payload, name)
    return _slot(payload, name, reason)


def _cap_drop(payload: dict[str, Any], name: str) -> _Item:
    data = payload.get("data")
    if not isinstance(data, dict):
        raise _Refused(f"a {CAP_DROP} file needs a data object")
    session_id = _name(data.get("session_id"))
    if session_id is None:
        raise _Refused(f"a {CAP_DROP} file needs data.session_id")
    message = data.get("message")
    if not isinstance(message, dict):
        raise _Refused(f"a {CAP_DROP} file needs data.message to be an object")
    return _Item(name, CAP_DROP, session_id, message, None)


def _slot(payload: dict[str, Any], name: str, reason: str) -> _Item:
    data = payload.get("data")
    if not isinstance(data, dict):
        raise _Refused(f"a {reason} file needs a data object")
    if not (_name(data.get("text")) or any(data.get(key) for key in MEDIA_KEYS)):
        raise _Refused(f"a {reason} file needs data.text or media")
    session_id = _name(data.get("session_id"))
    session_key = _name(payload.get("session_key"))
    if session_id is None and session_key is None:
        raise _Refused(f"a {reason} file needs a session_key or data.session_id")
    ts = payload.get("ts")
    if "timestamp" not in data and sort_number(ts) > 0:
        data = {**data, "timestamp": ts}
    return _Item(name, reason, session_id, data, session_key)


def _agent_history(payload: dict[str, Any], name: str) -> _Item:
    if not isinstance(payload.get("messages"), list):
        raise _Refused(f"a {AGENT_HISTORY} file needs a messages list")
    session_key = _name(payload.get("session_key"))
    session_id = _name(payload.get("session_id")) or session_key or UNKNOWN_SESSION
    return _Item(name, AGENT_HISTORY, session_id, payload, session_key)


def _name(value: Any) -> str | None:
    """A non-empty string field, or None."""
    return value if isinstance(value, str) and value else None
