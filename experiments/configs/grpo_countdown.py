r"""GRPO on countdown (reach a target with the given numbers, each used once) with SmolLM2.

Countdown is hard for a 135M model: expect the format reward to rise first and
exact solutions to stay rare within a CPU budget; it is here as a second task
with a verifier that parses the expression safely (no eval).

  python -m experiments.grpo --config=experiments/configs/grpo_countdown.py \
      --workdir=runs/grpo_countdown

Variants: `:tiny` (the tiny random model; a smoke test).
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None):
  c = grpo_arithmetic.base_config(variant)
  c.task = "countdown"
  c.prompt_template = ("{question} Show only the equation, for example <answer>(1 + 2) * 3"
                       "</answer>.")
  c.rewards = ml_collections.ConfigDict({"countdown": 1.0, "countdown_format": 0.1})
  c.grader = "countdown"
  if variant != "tiny":
    c.max_new_tokens = 64
  else:
    grpo_arithmetic.tiny_reward(c)
  return c
