#!/usr/bin/env bash
# Creates the virtual environment (default .venv) with a Python >= 3.12 found
# by tools/find_python.sh, and installs this package editable with its test
# extra. Idempotent: reinstalls only when pyproject.toml is newer than the
# last install, and recreates a venv whose interpreter no longer runs or is
# older than 3.12.
#
# Usage: tools/setup.sh [VENV_DIR]      (env: PYTHON=/path/to/python to choose)
set -euo pipefail

cd "$(dirname "$0")/.."
venv=${1:-.venv}
stamp="$venv/.jax_overlap-installed"

venv_ok() {
  "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' \
    </dev/null >/dev/null 2>&1
}

if [[ -e "$venv" ]] && ! venv_ok; then
  echo "setup: $venv has no working Python >= 3.12; recreating it."
  rm -rf "$venv"
fi

if [[ ! -e "$venv" ]]; then
  python=$(tools/find_python.sh)
  echo "setup: creating $venv with $python ($("$python" --version 2>&1))"
  "$python" -m venv "$venv"
fi

if [[ -f "$stamp" && "$stamp" -nt pyproject.toml ]]; then
  exit 0
fi

pip_flags=(--disable-pip-version-check)
[[ -n "${CI:-}" ]] && pip_flags+=(--progress-bar off)
echo "setup: pip install -e '.[test]' into $venv"
"$venv/bin/python" -m pip install "${pip_flags[@]}" -e '.[test]' </dev/null
"$venv/bin/python" -c 'import sys, jax, jaxlib, jax_overlap
print(f"setup: Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")' </dev/null
touch "$stamp"
