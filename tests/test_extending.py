"""docs/extending.md's guides, run as written: user modules that register a reward and a host
environment, named through `config.imports`; the registry's errors and its list command."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo
from experiments.configs import env_common, grpo_arithmetic
from jaxrl_agents import registry
from jaxrl_agents.objectives import policy_objective as objective_lib
from jaxrl_agents.tools import list as list_tool
from jaxrl_agents.train import metrics as metrics_lib

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                     "extending.md")


def _guide_files() -> dict[str, str]:
  """{relative path: source} of every Python block of the guide that names its file on
  its first line (`# my_project/rewards.py`)."""
  with open(GUIDE) as f:
    text = f.read()
  files = {}
  for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
    first = block.splitlines()[0]
    if first.startswith("# my_project/"):
      files[first[2:].strip()] = block
  return files


@pytest.fixture
def my_project(tmp_path, monkeypatch):
  """The guide's `my_project` package on sys.path; its registrations undone afterwards."""
  files = _guide_files()
  assert {"my_project/config.py", "my_project/rewards.py", "my_project/envs.py",
          "my_project/controls.py"} <= set(files)
  (tmp_path / "my_project").mkdir()
  (tmp_path / "my_project" / "__init__.py").write_text("")
  for path, source in files.items():
    (tmp_path / path).write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield tmp_path
  for module in [m for m in sys.modules if m == "my_project" or m.startswith("my_project.")]:
    del sys.modules[module]
  registry._REGISTRY.get("reward", {}).pop("ends_with_period", None)
  registry._REGISTRY.get("env", {}).pop("echo", None)
  registry._REGISTRY.get("token_control", {}).pop("positive_only", None)


def _load_config(path, variant):
  spec = importlib.util.spec_from_file_location("my_project_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def test_an_unregistered_name_is_refused_naming_the_closest_and_how_to_register():
  with pytest.raises(KeyError, match=r"did you mean 'math_strict'\?.*imports"):
    registry.get("reward", "math_strikt")
  config = grpo_arithmetic.get_config("tiny")
  config.rewards = {"ends_with_period": 1.0}
  with pytest.raises(KeyError, match="unknown reward 'ends_with_period'"):
    grpo.validate(config)


def test_imports_that_cannot_be_imported_fail_naming_the_module():
  config = grpo_arithmetic.get_config("tiny")
  config.imports = ("no_such_project.rewards",)
  with pytest.raises(ModuleNotFoundError, match=r"config.imports names 'no_such_project"):
    grpo.validate(config)
  with pytest.raises(TypeError, match="sequence of module names"):
    registry.import_modules("no_such_project")


def test_the_guides_reward_trains_through_config_imports(my_project):
  config = _load_config(my_project / "my_project" / "config.py", "tiny")
  assert config.imports == ("my_project.rewards",)
  config.steps, config.eval_every, config.checkpoint_every = 1, 0, 1
  grpo.validate(config)  # the user's reward name is known once its module is imported
  grpo.train(config, str(my_project / "run"), progress=False)
  (record,) = [r for r in metrics_lib.read_jsonl(str(my_project / "run" / "metrics.jsonl"))
               if r["kind"] == "train"]
  assert "reward/ends_with_period_mean" in record
  samples = metrics_lib.read_jsonl(str(my_project / "run" / "samples.jsonl"))
  for s in samples:  # the logged component is the guide's function of the logged reply
    assert s["reward/ends_with_period"] == float(s["completion"].rstrip().endswith("."))


def test_the_guides_token_control_is_chosen_through_config_imports(my_project):
  config = grpo_arithmetic.get_config("tiny")
  config.imports, config.token_control.name = ("my_project.controls",), "positive_only"
  grpo.validate(config)  # known once its module is imported
  hp = grpo.settings_from_config(config).objective
  logp = -jnp.arange(1.0, 7.0).reshape(2, 3) / 4
  mask = jnp.array([[True, True, False], [True, True, True]])
  advantages = jnp.array([1.0, -1.0])
  kept, metrics = objective_lib.controlled_mask(hp, logp, jnp.zeros((2, 3)), advantages, mask)
  np.testing.assert_array_equal(kept, [[True, True, False], [False, False, False]])
  assert float(metrics["kept_frac"]) == pytest.approx(2 / 5)
  loss, _ = objective_lib.policy_objective(hp, logp, jnp.zeros((2, 3)), logp, advantages, mask)
  assert np.isfinite(loss)


def test_the_guides_host_environment_runs_through_config_imports(my_project):
  config = env_common.set_env(
      grpo_arithmetic.base_config("tiny"), "tiny", env="echo", options={},
      tiny_options={"words": ["apple", "pear"]}, max_turns=2, tiny_max_turns=2,
      max_new_tokens=4, tiny_max_new_tokens=4)
  config.imports = ("my_project.envs",)
  config.steps, config.eval_every, config.checkpoint_every, config.sample_every = 1, 0, 1, 1
  grpo.train(config, str(my_project / "run"), progress=False)
  (record,) = [r for r in metrics_lib.read_jsonl(str(my_project / "run" / "metrics.jsonl"))
               if r["kind"] == "train"]
  assert 1 <= record["episode_turns"] <= 2
  # The environment's own counter reaches the log, and is the accuracy (the success rate).
  assert record["success"] == record["accuracy"] and 0.0 <= record["success"] <= 1.0
  samples = metrics_lib.read_jsonl(str(my_project / "run" / "samples.jsonl"))
  assert any("Say apple." in str(s) or "Say pear." in str(s) for s in samples)


def test_the_list_command_prints_every_kind_and_refuses_an_unknown_one(capsys):
  assert list_tool.main([]) == 0
  out = capsys.readouterr().out
  for kind in ("reward", "env", "policy_loss", "group_advantage", "model"):
    assert re.search(rf"^{kind} \(\d+\)$", out, flags=re.M), kind
  assert re.search(r"^  math_strict +1 if the reply states", out, flags=re.M)
  assert list_tool.main(["rewrd"]) == 2
  assert "did you mean 'reward'?" in capsys.readouterr().err


def test_the_list_command_imports_a_users_module(my_project, capsys):
  assert list_tool.main(["--import", "my_project.rewards", "reward"]) == 0
  assert re.search(r"^  ends_with_period +bonus if the reply ends with a period\.$",
                   capsys.readouterr().out, flags=re.M)
