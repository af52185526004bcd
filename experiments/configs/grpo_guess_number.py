r"""GRPO on guess-the-number, a multi-turn game played inside `lax.scan`.

The environment names a range; each turn the agent guesses and is told
"Higher." or "Lower." (jaxrl_agents/envs/guess_number.py). Reward 1 on the turn
the guess is right; the episode ends then or after `max_turns` turns. Every
step draws `prompts_per_step` secret numbers and plays `group_size` episodes of
each (rollout/multiturn.py); GRPO compares the episodes of one number.

  python -m experiments.grpo --config=experiments/configs/grpo_guess_number.py \
      --workdir=runs/grpo_guess_number

Variants: `:tiny` (the tiny random model, numbers 1-4, 3 turns of 2 tokens:
a smoke test).
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_arithmetic.get_config(variant)
  # A registered JAX-native environment (jaxrl_agents/envs) and its options; the
  # data, prompt and reward keys of single-turn runs are not used with one.
  c.env = "guess_number"
  c.env_kwargs = ml_collections.ConfigDict(dict(low=1, high=16))
  c.max_turns = 5  # bisection needs ceil(log2(high - low + 2)) turns
  c.task = ""
  c.max_new_tokens = 8  # per turn
  c.prompts_per_step = 4
  c.group_size = 8
  c.eval_size = 64
  c.eval_batch_size = 32
  c.temperature = 1.0
  if variant == "tiny":
    c.env_kwargs = ml_collections.ConfigDict(dict(low=1, high=4))
    c.max_turns = 3
    c.max_new_tokens = 2
    c.prompts_per_step = 2
    c.eval_size = 8
    c.eval_batch_size = 8
  return c
