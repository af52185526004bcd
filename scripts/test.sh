#!/usr/bin/env bash
# Sets everything up (with the test and parity extras) and runs lint and the
# whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,parity
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
