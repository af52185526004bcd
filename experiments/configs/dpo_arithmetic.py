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

from experiments.configs import preference_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  preference_common.add_pair_data(c)

  c.loss = "dpo"  # dpo, ipo, rpo, cpl
  # Each loss reads only its own entry (jaxrl_agents/losses/preference.py).
  c.loss_kwargs = ml_collections.ConfigDict(dict(
      dpo=dict(beta=0.1, label_smoothing=0.0),
      ipo=dict(tau=0.1),
      rpo=dict(beta=0.1, eta=1.0),
      cpl=dict(alpha=0.1, gamma=1.0)))
  c.max_len = 128  # tokens of prompt + reply; longer pairs lose the prompt's start

  c.steps = 100
  c.pairs_per_step = 16
  c.minibatches = 1
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, warmup_updates=10, decay="cosine", end_fraction=0.1, clock="updates",
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
  c.max_consecutive_nonfinite = 5
  c.time_budget_s = 0.0
  c.eval_every_s = 0.0

  c.eval_every = 50
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  c.sample_every = 25
  c.samples_per_log = 8
  c.tensorboard = True
  c.start_over = False

  if variant == "tiny":
    return _tiny(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The tiny random model, a few small steps, every artifact."""
  preference_common.tiny_pair_data(c)
  c.max_len = 96
  c.steps = 4
  c.pairs_per_step = 4
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_updates = 0
  c.optimizer.decay = "constant"  # the resume test stops at step 2 of a 4-step run
  c.eval_every = 2
  c.checkpoint_every = 1
  c.sample_every = 1
  return c
