#!/usr/bin/env bash
# A virtualenv with Google's `gemma` library, to regenerate tests/golden/gemma_tiny.npz:
#
#   scripts/setup_gemma_reference.sh && .venv-gemma/bin/python tests/golden/make_gemma_golden.py
#
# Not part of the project's environment: gemma 3.3.0 needs kauldron, which imports
# tensorflow, and a plain `pip install gemma` spends many minutes backtracking over
# kauldron's dependencies. What installs in about a minute: gemma's runtime
# dependencies first, then gemma and kauldron without theirs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gemma}
PYTHON=${PYTHON:-python3.11}
JAX_VERSION=$(.venv/bin/python -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "jax==$JAX_VERSION" flax absl-py "etils[edc,enp,epath,epy,etree]" \
  einops jaxtyping numpy orbax-checkpoint sentencepiece treescope grain chex ml_collections \
  immutabledict typeguard lark optax tqdm typing_extensions clu tensorflow-cpu
"$VENV/bin/pip" install -q --no-deps gemma==3.3.0 kauldron==1.4.2
echo "gemma reference environment ready: $VENV"
