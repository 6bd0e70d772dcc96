"""docs/gateway.md's drop-in snippet, run as printed on the newer gateway (0.22): in a
fresh process, before the gateway starts, it makes every import of
``gateway.shutdown_flush`` in the gateway's own code get ``walspool.shutdown_flush``."""

from __future__ import annotations

from pathlib import Path

from _gateways_common import run_drop_in_snippet


def test_the_drop_in_snippet_makes_walspools_module_the_gateways(tmp_path: Path) -> None:
    """Run first in the gateway's process, the snippet gives walspool's module to
    ``import gateway.shutdown_flush`` and to every ``from gateway.shutdown_flush import``
    of the gateway's code (run_startup's recovery, run_shutdown's flushes, the
    transcript's spooling and drain), and the gateway's own cap evictions, during an
    outage, land in ``<HERMES_HOME>/spool.db``, not in upstream's JSON files."""
    found, spooled, home = run_drop_in_snippet(tmp_path, Path(__file__).parent, "_fork")
    assert found["module"] == "walspool.shutdown_flush"
    imports = found["imports"]
    assert {
        "run_startup.py: recover_gateway_pending",
        "run_shutdown.py: flush_pending_to_file",
        "run_shutdown.py: flush_overflow_to_file",
        "session_transcript.py: spool_dropped_transcript_message",
    } <= set(imports)
    assert set(imports.values()) == {"walspool.shutdown_flush"}, imports
    assert len(spooled) >= 30 and spooled == [f"m{i}" for i in range(len(spooled))]
    assert not (home / "pending_messages").exists()
