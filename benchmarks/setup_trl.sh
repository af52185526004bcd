#!/usr/bin/env bash
# Installs TRL (trl 1.16.0, the learning race's baseline, not a project
# dependency) with the CPU build of torch into its own virtualenv,
# benchmarks/.venv-trl. The project is installed without its dependencies so
# that both sides of the race share the graders (jaxrl_agents.rewards: numpy, and jax,
# which the learned rewards' module imports).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x benchmarks/.venv-trl/bin/python ]; then
  python3 -m venv benchmarks/.venv-trl
  benchmarks/.venv-trl/bin/python -m pip install --quiet --upgrade pip
fi
if ! benchmarks/.venv-trl/bin/python -c "import trl, jaxrl_agents.rewards" 2>/dev/null; then
  # torch==2.13.0 resolves to the CPU build on the project's machines.
  benchmarks/.venv-trl/bin/python -m pip install --quiet "torch==2.13.0" "trl==1.16.0" \
    "transformers>=5.20,<5.24" "accelerate>=1.10,<2" "datasets>=4.7,<5" "numpy<3" \
    "jax>=0.7,<0.11"
  benchmarks/.venv-trl/bin/python -m pip install --quiet --no-deps -e .
fi
