r"""PPO with a value head and token-level GAE on arithmetic, the embedded SmolLM2-135M-Instruct.

Same task, prompts and rewards as grpo_arithmetic.py; one completion per prompt
is enough for PPO (the critic is the baseline), so a step samples 16 prompts x 1.

  python -m experiments.ppo --config=experiments/configs/ppo_arithmetic.py \
      --workdir=runs/ppo_arithmetic

Variants: `:tiny` (the tiny random model, 3 steps of 4 prompts x 2 rollouts,
16 new tokens: a smoke test of every artifact in about a minute).
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None):
  c = grpo_arithmetic.base_config(variant)
  del c.advantage, c.advantage_kwargs  # GAE with the critic replaces group baselines
  c.critic = "shared"  # or "separate": a copy of the initial backbone with its own head
  c.gamma = 1.0
  c.gae_lambda = 0.95
  c.normalize_advantages = True
  c.vf_coef = 0.1
  c.value_clip = 0.2
  c.loss_kwargs.ppo.eps_high = 0.2  # symmetric clipping
  # The critic's own optimizer (the policy's is c.optimizer): a value head learns
  # faster than the policy may move.
  c.critic_optimizer = ml_collections.ConfigDict(dict(learning_rate=1e-4))
  c.kl_estimator = "k1"
  if variant == "tiny":
    c.prompts_per_step = 4
    c.group_size = 2
  else:
    c.prompts_per_step = 16
    c.group_size = 1
    c.epochs = 2
    c.minibatches = 2
  return c
