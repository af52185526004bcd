"""Command-line entry points, run as users run them."""

import os
import subprocess
import sys

import pytest


def _run(*args, timeout=300):
  env = {**os.environ, "XLA_FLAGS": ""}
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        timeout=timeout, env=env)


def test_generate_prints_only_the_completion():
  # The old command name, kept working beside jaxrl_agents.tools.generate.
  r = _run("jaxrl_agents.generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens",
           "5", "--no-chat")
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert len(lines) == 1  # one prompt, one completion, nothing else on stdout
  assert "loaded tiny" in r.stderr


def test_generate_rejects_unknown_model():
  r = _run("jaxrl_agents.tools.generate", "--model", "no-such-model", "--prompt", "hi")
  assert r.returncode != 0
  assert "unknown model 'no-such-model'" in r.stderr


@pytest.mark.smollm2
@pytest.mark.slow
def test_generate_smollm2_answers_arithmetic():
  r = _run("jaxrl_agents.tools.generate", "--prompt", "What is 2 + 3? Answer with the number only.",
           "--max-new-tokens", "16")
  assert r.returncode == 0, r.stderr
  assert "5" in r.stdout
