#!/usr/bin/env bash
# Installs tunix (google-tunix 0.1.7, a baseline, not a project dependency) into
# its own virtualenv, benchmarks/.venv-tunix, with the project importable too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x benchmarks/.venv-tunix/bin/python ]; then
  python3 -m venv benchmarks/.venv-tunix
  benchmarks/.venv-tunix/bin/python -m pip install --quiet --upgrade pip
fi
if ! benchmarks/.venv-tunix/bin/python -c "import tunix" 2>/dev/null; then
  benchmarks/.venv-tunix/bin/python -m pip install --quiet "google-tunix==0.1.7" "jax==0.10.2" \
    "jaxlib==0.10.2"
  benchmarks/.venv-tunix/bin/python -m pip install --quiet --no-deps -e .
fi
