#!/usr/bin/env bash
# Creates .venv inside the repository and installs the package with the given
# extras (default: none). Re-running is cheap: it reinstalls only when setup.py
# or the extras change.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=".venv/.installed-$(cat setup.py | sha1sum | cut -c1-12)-${EXTRAS//,/-}"
if [ ! -f "$stamp" ]; then
  spec="."
  [ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
  # torch==2.13.0 (parity extra) resolves to the CPU build on these machines.
  .venv/bin/python -m pip install --quiet -e "$spec"
  touch "$stamp"
fi
