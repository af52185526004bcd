#!/usr/bin/env bash
# Sets everything up (with the test and parity extras) and runs lint and the
# whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,parity
.venv/bin/ruff check .
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -X faulthandler -m pytest -q "$@"
fi
# The whole suite as two processes, each starting with fresh XLA state: one process
# holding the compiled programs of every test crashed once inside XLA's CPU compiler
# (a segfault in backend_compile, in a test that passes alone; not diagnosed yet).
.venv/bin/python -X faulthandler -m pytest -q tests/test_[a-m]*.py
.venv/bin/python -X faulthandler -m pytest -q tests/test_[n-z]*.py
