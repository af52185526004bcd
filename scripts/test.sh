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
# The whole suite as four processes, each starting with fresh XLA state: a process
# holding the compiled programs of many tests has crashed inside XLA's CPU compiler
# (a segfault in backend_compile_and_load, each time in a test that passes alone; the
# second time, with half the suite per process, in test_turn_credit's PPO run; not
# diagnosed yet). Every process runs even when an earlier one fails.
status=0
for group in "[a-e]" "[f-m]" "[n-r]" "[s-z]"; do
  .venv/bin/python -X faulthandler -m pytest -q tests/test_${group}*.py || status=1
done
exit $status
