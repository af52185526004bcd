r"""PPO with a critic on FrozenLake, credit by bi-level GAE (turns, then tokens inside a turn).

The environment and the episode's shape are grpo_frozen_lake.py's (4x4 random
maps, 8 turns, potential shaping); the critic, its optimizer and GAE are
ppo_arithmetic.py's. `gae_level` picks the multi-turn credit: "token" (GAE
over the policy tokens, the environment's skipped), "turn" (GAE over turns) or
"bilevel" (RAGEN's and VAGEN's: turn-level GAE with turn_gamma / turn_lam,
then token-level GAE inside each turn from the turn's return).

  python -m experiments.ppo --config=experiments/configs/ppo_frozen_lake.py \
      --workdir=runs/ppo_frozen_lake

Variants: `:tiny` (the tiny random model, 2x2 maps: a smoke test).
"""

import ml_collections

from experiments.configs import grpo_frozen_lake, ppo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_frozen_lake.set_frozen_lake(ppo_arithmetic.get_config(variant), variant)
  c.epochs = 1  # set_env's minibatches split the 32 episodes; one pass, as GRPO's
  c.gae_level = "bilevel"
  c.turn_gamma, c.turn_lam = 0.95, 0.95
  return c
