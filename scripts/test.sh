#!/usr/bin/env bash
# Sets everything up (with the test and parity extras) and runs lint and the
# whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
lanes=${TEST_LANES:-2}
if [ "$lanes" != 1 ] && [ "$lanes" != 2 ]; then
  echo "scripts/test.sh: TEST_LANES must be 1 or 2, got '$lanes'" >&2
  exit 2
fi
scripts/setup.sh test,parity
.venv/bin/ruff check .
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -X faulthandler -m pytest -q "$@"
fi
# The whole suite as six processes, each starting with fresh XLA state: a process
# holding the compiled programs of many tests has crashed inside XLA's CPU compiler
# (a segfault in backend_compile_and_load, each time in a test that passes alone: twice
# in test_turn_credit's PPO run; not diagnosed yet). A group whose process dies from a
# signal runs once more, saying so; a test that fails fails the suite. Every group runs
# even when an earlier one fails.
#
# The groups run in two lanes side by side (TEST_LANES=1: one after the other). Most of
# a test's time is XLA compiling, which uses one core, so one lane leaves the second core
# of a 2-core machine mostly idle. On a 2-core Zen 4 (2026-11-28) the whole suite took
# 2762 s in two lanes against about 3370 s in one. Each lane's output is kept in a file
# and printed when the lane ends; each group's exit line is printed as the group ends.
run_group() {
  local files=(tests/test_$1*.py) rc=0 start=$SECONDS
  # --durations: the slowest tests of each group in the CI log, to keep the suite's time in view.
  local pytest=(.venv/bin/python -X faulthandler -m pytest -q -p no:cacheprovider --durations=8)
  "${pytest[@]}" "${files[@]}" || rc=$?
  if [ "$rc" -ge 128 ]; then
    echo "scripts/test.sh: the test process of ${files[*]} died from signal $((rc - 128));" \
         "running that group once more"
    rc=0
    "${pytest[@]}" "${files[@]}" || rc=$?
  fi
  # To fd 3, the script's own stdout: in two lanes it shows at once, not with the lane's log.
  echo "scripts/test.sh: tests/test_$1*.py: exit status $rc, $((SECONDS - start)) s" >&3
  return "$rc"
}
lane() {
  local status=0 group
  for group in "$@"; do run_group "$group" || status=1; done
  return $status
}
exec 3>&1
# The embedded model is fetched and converted once, before the lanes could race to it.
.venv/bin/python -c "from jaxrl_agents.models import zoo; zoo.smollm2_dir()"
# Lanes balanced by the groups' times (seconds on a 2-core Zen 3, AVX2, in two lanes,
# 2026-11-29, the whole suite 41 minutes):
# [d-e] 1235, [s] 1192 | [f-m] 1090, [n-r] 712, [t-z] 518, [a-c] 125
lane_a=("[d-e]" "[s]")
lane_b=("[f-m]" "[n-r]" "[t-z]" "[a-c]")
if [ "$lanes" = 1 ]; then
  lane "${lane_a[@]}" "${lane_b[@]}"
  exit $?
fi
logs=$(mktemp -d)
# Each lane its own persistent compilation cache (tests/conftest.py): the cache's writes
# are not atomic, so two processes side by side must not share one directory.
JAX_COMPILATION_CACHE_DIR="$PWD/.cache/jax_tests/lane_a" lane "${lane_a[@]}" > "$logs/a" 2>&1 &
pid_a=$!
JAX_COMPILATION_CACHE_DIR="$PWD/.cache/jax_tests/lane_b" lane "${lane_b[@]}" > "$logs/b" 2>&1 &
pid_b=$!
status=0
wait "$pid_a" || status=1
echo "=== lane 1: ${lane_a[*]}"; cat "$logs/a"
wait "$pid_b" || status=1
echo "=== lane 2: ${lane_b[*]}"; cat "$logs/b"
rm -rf "$logs"
exit $status
