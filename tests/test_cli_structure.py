"""The command line's layout: a package, one module per command.

The package-wide scans of ``test_security`` read ``walspool/*.py``; the ones that
matter for the command line run here over ``walspool/cli/*.py`` too.
"""

from __future__ import annotations

from _helpers import ROOT
from test_security import _Scan

from walspool.cli import COMMANDS

CLI = ROOT / "walspool" / "cli"


def test_one_module_per_command():
    for name, fn, add_args in COMMANDS:
        module = name.replace("-", "_")
        assert fn.__module__ == f"walspool.cli.{module}", name
        assert add_args is None or add_args.__module__ == fn.__module__, name
        assert (CLI / f"{module}.py").is_file()


def test_no_sql_is_built_from_variables_in_the_command_line():
    problems = []
    for source in sorted(CLI.glob("*.py")):
        problems += _Scan(source.read_text(), f"walspool/cli/{source.name}").run()
    assert problems == [], "\n".join(problems)


def test_the_old_modules_are_gone():
    assert not (ROOT / "walspool" / "cli.py").exists()
    assert not (ROOT / "walspool" / "_cli_output.py").exists()


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
