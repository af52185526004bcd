r"""DPO (or IPO, RPO, CPL) on arithmetic pairs, on the embedded SmolLM2-135M.

  python -m experiments.dpo --config=experiments/configs/dpo_arithmetic.py \
      --workdir=runs/dpo_arithmetic

The pairs are made as for the reward model (`reward_model_arithmetic.py`): the
model's own replies to `arithmetic/mixed` questions, one the strict grader
accepts against one it rejects (generated into <workdir>/pairs; point
`pairs_dir` at a reward-model run's pairs to reuse them when the settings
match). Evaluation reports the implicit reward's held-out pair accuracy and the
policy's greedy accuracy on the 100 held-out questions.

Variants (`--config=...dpo_arithmetic.py:VARIANT`):
  tiny   the tiny random model, a few small steps, every artifact (seconds).
"""

import ml_collections

from experiments.configs import trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  trainer_common.add_pair_data(c)

  c.loss = "dpo"  # dpo, ipo, rpo, cpl
  # Each loss reads only its own entry (jaxrl_agents/objectives/losses/preference.py).
  c.loss_kwargs = ml_collections.ConfigDict(dict(
      dpo=dict(beta=0.1, label_smoothing=0.0),
      ipo=dict(tau=0.1),
      rpo=dict(beta=0.1, eta=1.0),
      cpl=dict(alpha=0.1, gamma=1.0)))
  c.max_len = 128  # tokens of prompt + reply; longer pairs lose the prompt's start

  c.pairs_per_step = 16
  trainer_common.add_schedule(c, steps=100, learning_rate=1e-6, eval_every=50)

  if variant == "tiny":
    return _tiny(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The tiny random model, a few small steps, every artifact."""
  trainer_common.tiny_pair_data(c)
  c.max_len = 96
  c.pairs_per_step = 4
  trainer_common.tiny_schedule(c)
  return c
