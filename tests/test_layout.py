"""The package's layout: the spool core, replay, the link and the command line as
packages, the public face and the gateways' adapters at the top, one module per command.

The package-wide scans of ``test_security`` read every module, the command line's too.
"""

from __future__ import annotations

import ast
import re

from _helpers import ROOT

from walspool.cli import COMMANDS
from walspool.link.link import Link

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
    assert packages == {"store", "replay", "link", "gateways", "cli"}


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


#: SQL that names one of the spool's tables or views.
SPOOL_SQL = re.compile(
    r"\b(FROM|INTO|UPDATE|JOIN|TABLE)\s+(records|spool_meta|sequences|audit|backlog|failures)\b",
    re.IGNORECASE,
)


def test_only_the_store_reads_or_writes_the_spools_tables():
    """The storage contract: every statement against the spool's tables is in
    ``walspool/store``; the other packages call its functions."""
    found = []
    for source in sorted((ROOT / "walspool").rglob("*.py")):
        if source.parent.name == "store":
            continue
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if SPOOL_SQL.search(node.value) and not _docstring(tree, node):
                    found.append(f"{source.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _docstring(tree: ast.AST, node: ast.Constant) -> bool:
    """Whether ``node`` is a module's, class's or function's docstring (prose may
    name a table)."""
    for owner in ast.walk(tree):
        if isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = owner.body
            if body and isinstance(body[0], ast.Expr) and body[0].value is node:
                return True
    return False


def test_no_module_outside_the_store_runs_its_own_statements_on_a_spool():
    """``Spool.query``, ``transact``, ``transact_later`` and ``read_page`` are the
    store's own: no escape hatch for another package."""
    hatches = {"query", "transact", "transact_later", "read_page"}
    found = []
    for source in sorted((ROOT / "walspool").rglob("*.py")):
        if source.parent.name == "store":
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in hatches:
                    found.append(f"{source.relative_to(ROOT)}:{node.lineno} {node.func.attr}")
    assert found == []


#: The gateway's objects, whose private names walspool reads as an adapter must (its
#: classes name some of theirs alike: ``_lock``, ``_conn``, ``_execute_write``).
GATEWAY_OBJECTS = re.compile(r"(^|\.)(store|store\._db|session_db)$")


def test_no_part_reads_another_parts_private_state():
    """Parts are composed through public methods and the link's shared ``Core``: no
    module reads an underscored name that a walspool class defines on an object other
    than ``self``/``cls`` (the gateway's own objects aside)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted((ROOT / "walspool").rglob("*.py"))}
    private = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    private.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        private.add(node.attr)
    private = {name for name in private if name.startswith("_") and not name.startswith("__")}
    found = []
    for source, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in private:
                continue
            base = ast.unparse(node.value)
            if base in ("self", "cls") or GATEWAY_OBJECTS.search(base):
                continue
            found.append(f"{source.relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
    assert found == []


def test_the_link_is_composed_not_mixed_in():
    """``Link`` holds its parts; it inherits none of them (no shared ``self``)."""
    assert Link.__bases__ == (object,)


def test_the_link_names_no_gateways_attribute():
    """The link is gateway-neutral: it reads a store only as ``Transcripts``; the
    adapters (``walspool.gateways``, ``walspool.hermes``) name the gateway's attributes.
    So no module of ``walspool/link`` reads an underscored name off another object."""
    found = []
    for source in sorted((ROOT / "walspool" / "link").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute) and re.fullmatch(r"_[^_].*|_", node.attr):
                base = ast.unparse(node.value)
                if base not in ("self", "cls"):
                    found.append(f"{source.relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
    assert found == []
