# Sourced by the scripts in this folder: make .venv (Python 3.11+) with walspool,
# its test tools and hermes-agent==0.19.0 installed, on a machine that has only python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="$root/.venv"
stamp="$venv/.walspool-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test,hermes]"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
