"""The built package: its sdist, the wheel built from that sdist, and that wheel
installed on its own into a gateway's environment, working there (the README's
install step for a copy of walspool that is not on the package index)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

from _helpers import ROOT

#: Seconds for ``python -m build`` (it makes an isolated environment for setuptools).
BUILD_SECONDS = 600

#: Run in the gateway's interpreter with only the installed wheel on the path before
#: site-packages: where walspool comes from, its plugin entry point, and the demo's
#: outage on the real 0.19.0 store (a small one).
CHECK = """
import importlib.metadata, io, sys
target = sys.argv[1]
import walspool, walspool.plugin
from walspool.demo import run_demo
assert walspool.__file__.startswith(target), walspool.__file__
dist = importlib.metadata.distribution("walspool")
assert str(dist.locate_file("")).startswith(target), dist.locate_file("")
(plugin,) = [e for e in dist.entry_points if e.group == "hermes_agent.plugins"]
assert plugin.load() is walspool.plugin, plugin
out = io.StringIO()
assert run_demo(out, sessions=2, messages=250, threads=1) == 0, out.getvalue()
print("ok")
"""


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_SECONDS, **kw)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def sources(files: list[str], prefix: str) -> set[str]:
    """The package's Python files and markers among ``files``, relative to ``prefix``."""
    return {
        name[len(prefix) :]
        for name in files
        if name.startswith(prefix + "walspool/") and name.endswith((".py", "py.typed"))
    }


def test_the_sdist_builds_a_wheel_that_installs_alone_and_works_in_the_gateway(tmp_path):
    """``python -m build`` makes the sdist and the wheel from it; both pass ``twine check
    --strict`` and hold every module of the tree's package; the wheel installed with
    ``pip --no-deps`` (the gateway has apsw and msgspec) runs the plugin and the demo
    from its own files, with the console script beside them."""
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "walspool").rglob("*")}
    expected = {name for name in tree if name.endswith((".py", "py.typed"))}
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
    (sdist,) = dist.glob("walspool-*.tar.gz")
    (wheel,) = dist.glob("walspool-*-py3-none-any.whl")
    # The package index's own check of both: metadata, and the README as their page.
    checked = run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)])
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0] + "/"
        assert sources(archive.getnames(), top) == expected
    with zipfile.ZipFile(wheel) as archive:
        assert sources(archive.namelist(), "") == expected

    target = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"]
    run([*pip, "--target", str(target), str(wheel)])
    script = target / "bin" / "walspool"
    assert script.is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = run([sys.executable, "-c", CHECK, str(target)], env=env, cwd=tmp_path)
    assert done.stdout.strip().endswith("ok")
    version = run([sys.executable, str(script), "--version"], env=env, cwd=tmp_path)
    assert version.stdout.startswith("walspool "), version.stdout
