"""The notebooks run top to bottom, headless, on workdirs from tiny runs, and write plots."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from experiments import grpo
from experiments.configs import grpo_arithmetic

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


def _execute(name, monkeypatch, **env):
  for key, value in env.items():
    monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
  with open(os.path.join(NOTEBOOKS, name)) as f:
    notebook = nbformat.read(f, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": NOTEBOOKS}}).execute()
  return notebook


def _assert_pngs(directory, names):
  for name in names:
    path = os.path.join(directory, name)
    assert os.path.exists(path), f"{name} was not written"
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000, f"{name} looks empty"


@pytest.fixture(scope="module")
def two_tiny_runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  paths = []
  for name, learning_rate in (("lr1e-3", 1e-3), ("lr3e-3", 3e-3)):
    config = grpo_arithmetic.get_config("tiny")
    config.steps, config.eval_every = 4, 2
    config.optimizer.learning_rate = learning_rate
    grpo.train(config, str(root / name), progress=False)
    paths.append(str(root / name))
  return paths


def test_training_dynamics_notebook(two_tiny_runs, tmp_path, monkeypatch):
  out = tmp_path / "plots"
  notebook = _execute("training_dynamics.ipynb", monkeypatch,
                      JAXRL_RUNS=os.pathsep.join(two_tiny_runs), JAXRL_PLOTS_OUT=str(out))
  _assert_pngs(out, ["curves.png", "compare_tokens.png", "hacking_signals.png"])
  text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
  assert "lr1e-3:" in text and "lr3e-3:" in text  # the warnings section reported on both runs


def test_objectives_tour_notebook(tmp_path, monkeypatch):
  out = tmp_path / "plots"
  _execute("objectives_tour.ipynb", monkeypatch, JAXRL_PLOTS_OUT=str(out))
  _assert_pngs(out, ["ppo_clipping.png", "cispo.png", "gspo.png", "aggregation.png"])
