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
  # A failed install (a registry hiccup, a full disk) is tried once more without pip's
  # cache, after saying what the disk has left.
  if ! .venv/bin/python -m pip install --quiet -e "$spec"; then
    echo "setup.sh: pip install failed; free disk: $(df -h . | tail -1); trying once more" >&2
    .venv/bin/python -m pip install --quiet --no-cache-dir -e "$spec"
  fi
  touch "$stamp"
fi
