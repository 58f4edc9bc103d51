#!/usr/bin/env bash
# Prints the absolute path of a Python >= 3.12 interpreter, or exits 1 saying
# what was tried.
#
# Order: $PYTHON if set; then python3.14, python3.13, python3.12, python3 on
# PATH; then pyenv (`pyenv versions --bare`, newest first, run through
# PYENV_VERSION so pyenv shims work); then $PYENV_ROOT/versions/*/bin/python3.1x.
# Each candidate is run, not just looked up: a pyenv shim that names a version
# which is not selected exists on PATH but fails.
set -euo pipefail

MIN_MINOR=12
tried=()

# Runs "$@" -c ...; prints sys.executable if it is CPython 3.x >= 3.$MIN_MINOR.
probe() {
  "$@" -c "import sys; sys.exit(0 if sys.version_info[:2] >= (3, $MIN_MINOR) else 1); " \
    </dev/null >/dev/null 2>&1 || return 1
  "$@" -c 'import sys; print(sys.executable)' </dev/null 2>/dev/null
}

try() {
  tried+=("$*")
  probe "$@"
}

if [[ -n "${PYTHON:-}" ]]; then
  try "$PYTHON" && exit 0
  echo "find_python: PYTHON=$PYTHON is not a working Python >= 3.$MIN_MINOR." >&2
  exit 1
fi

for name in python3.14 python3.13 python3.12 python3; do
  command -v "$name" >/dev/null 2>&1 || continue
  try "$name" && exit 0
done

pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
pyenv_bin=$(command -v pyenv 2>/dev/null || true)
[[ -z "$pyenv_bin" && -x "$pyenv_root/bin/pyenv" ]] && pyenv_bin="$pyenv_root/bin/pyenv"
if [[ -n "$pyenv_bin" ]]; then
  # Plain CPython releases only (no dev, free-threaded, or virtualenv names).
  versions=$("$pyenv_bin" versions --bare 2>/dev/null \
    | grep -E '^3\.[0-9]+\.[0-9]+$' | sort -t. -k1,1nr -k2,2nr -k3,3nr || true)
  for v in $versions; do
    minor=${v#3.}; minor=${minor%%.*}
    (( minor >= MIN_MINOR )) || continue
    # Prefer the version's own binary; fall back to the shim.
    if [[ -x "$pyenv_root/versions/$v/bin/python3.$minor" ]]; then
      try "$pyenv_root/versions/$v/bin/python3.$minor" && exit 0
    fi
    PYENV_VERSION=$v try "python3.$minor" && exit 0
  done
fi

for bin in $(ls -d "$pyenv_root"/versions/*/bin/python3.1[0-9] 2>/dev/null | sort -rV); do
  try "$bin" && exit 0
done

{
  echo "find_python: no Python >= 3.$MIN_MINOR found."
  if ((${#tried[@]})); then
    echo "  tried (too old or not runnable): ${tried[*]}"
  fi
  echo "  Install Python 3.12 or newer (e.g. 'pyenv install 3.12'), or point PYTHON=/path/to/python3.12 at one."
} >&2
exit 1
