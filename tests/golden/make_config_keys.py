"""Records which keys each shipped experiment config has, for tests/test_faults.py.

  .venv/bin/python tests/golden/make_config_keys.py

config_keys.json maps each config (module, or module:variant) to its flattened
keys as they were when the record was made. Runs written since then hold those
keys in their config.json; a key added to a config later is missing from them,
and `harness.check_resumable` would refuse to resume such a run unless the key
has a backward default in `experiments.common.RESUME_RULES` (the value that
computes as the run did). The test fails on a new key without one.

Run this only to add configs that are not in the record yet: entries already
there are kept as they are (rewriting them would hide the keys added since).
"""

import importlib
import json
import os
import pkgutil
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tests", "golden", "config_keys.json")

# Maps whose keys are names the user chooses (reward functions, environment and loss
# arguments): a run without one of them computes differently, so no backward default
# applies.
FREE_FORM = ("rewards.", "env_reply_rewards.", "env_kwargs.", "loss_kwargs.",
             "advantage_kwargs.", "task_options.")

_VARIANT_TEST = re.compile(r"variant\s*(?:==|in)\s*\(?([^:\n]*)")
_LITERAL = re.compile(r"\"(\w+)\"")


def config_names() -> list[str]:
  """module or module:variant for every shipped config with a get_config; the variants
  are the string literals its source compares `variant` with."""
  from experiments import configs

  names = []
  for info in pkgutil.iter_modules(configs.__path__):
    module = importlib.import_module(f"experiments.configs.{info.name}")
    if not hasattr(module, "get_config"):
      continue
    with open(module.__file__) as f:
      source = f.read()
    variants = sorted({v for test in _VARIANT_TEST.findall(source)
                       for v in _LITERAL.findall(test)})
    names += [info.name] + [f"{info.name}:{v}" for v in variants]
  return names


def flat_keys(name: str) -> list[str]:
  """The flattened keys of config `name` (module or module:variant), free-form maps left out."""
  from jaxrl_agents.train import harness

  module, _, variant = name.partition(":")
  config = importlib.import_module(f"experiments.configs.{module}").get_config(variant or None)
  return sorted(k for k in harness._flat(harness.config_to_dict(config))
                if not k.startswith(FREE_FORM))


def main() -> None:
  sys.path.insert(0, REPO)  # run as a script from anywhere: the project's packages import
  record = {}
  if os.path.exists(OUT):
    with open(OUT) as f:
      record = json.load(f)
  added = [name for name in config_names() if name not in record]
  for name in added:
    record[name] = flat_keys(name)
  with open(OUT, "w") as f:
    f.write("{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(keys)}"  # a line per config
                             for name, keys in sorted(record.items())) + "\n}\n")
  print(f"{OUT}: added {added or 'nothing'}")


if __name__ == "__main__":
  main()
