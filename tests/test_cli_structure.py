"""The package's layout: the spool core, replay, the link and the command line as
packages, the public face and the gateways' adapters at the top, one module per command.

The package-wide scans of ``test_security`` read every module, the command line's too.
"""

from __future__ import annotations

from _helpers import ROOT

from walspool.cli import COMMANDS

CLI = ROOT / "walspool" / "cli"


def test_one_module_per_command():
    for name, fn, add_args in COMMANDS:
        module = name.replace("-", "_")
        assert fn.__module__ == f"walspool.cli.{module}", name
        assert add_args is None or add_args.__module__ == fn.__module__, name
        assert (CLI / f"{module}.py").is_file()


def test_the_top_level_holds_the_public_face_and_the_adapters_only():
    """Everything else lives in the package its concern names."""
    top = {p.stem for p in (ROOT / "walspool").glob("*.py")}
    assert top == {
        "__init__",
        "__main__",
        "errors",
        "text",  # the public face, shared by every package
        "hermes",
        "shutdown_flush",  # the released gateways' adapters (public names)
        "plugin",
        "demo",
    }
    packages = {p.parent.name for p in (ROOT / "walspool").glob("*/__init__.py")}
    assert packages == {"store", "replay", "link", "cli"}


def test_every_package_is_in_the_wheel():
    """pyproject lists its packages by name: a new subpackage left out would be missing
    from a built wheel (the ``walspool`` command fails there, not in an editable install)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "walspool").rglob("__init__.py")
    }
    assert found == listed
