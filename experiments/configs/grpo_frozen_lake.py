r"""GRPO on FrozenLake, a text-grid game played inside `lax.scan`.

Each turn the agent sees the map (X itself, G the goal, H holes, . ice) and
answers left, down, right or up (jaxrl_agents/envs/frozen_lake.py). Reward 1
on reaching the goal; a hole ends the episode. Every step draws
`prompts_per_step` random 4x4 maps (each with a path) and plays `group_size`
episodes of each; the held-out maps are fixed.

  python -m experiments.grpo --config=experiments/configs/grpo_frozen_lake.py \
      --workdir=runs/grpo_frozen_lake

A shortest path takes 6 moves; the 8 turns allow two mistakes. GiGPO compares
the moves made from the same square (turn_credit.name="gigpo", the default
here), and the potential (minus the distance to the goal) shapes each move.
Slippery ice: --config.env_kwargs.slippery=True.

One worked game on another map (a shortest path, in the environment's words)
comes before each episode as earlier chat turns (`demonstrations`). Without it
SmolLM2-135M echoes the map instead of naming a move (32 of 32 greedy held-out
episodes invalid on 3x3 maps); with it every greedy reply is a move (always
"right", success 0 on 32 held-out 4x4 maps) and 6-19% of sampled episodes
reach the goal: what there is to learn is the game, not the format.

Variants: `:tiny` (the tiny random model, 2x2 maps without holes, 3 turns of
5 tokens: a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def set_frozen_lake(c: ml_collections.ConfigDict, variant: str | None
                    ) -> ml_collections.ConfigDict:
  """The environment, the episode's shape and the shaping (GRPO's and PPO's configs)."""
  c = env_common.set_env(
      c, variant, env="frozen_lake",
      options=dict(size=4, hole_prob=0.2, slippery=False, demonstrations=1),
      tiny_options=dict(size=2, hole_prob=0.0, slippery=False, demonstrations=0), max_turns=8,
      tiny_max_turns=3, max_new_tokens=8, tiny_max_new_tokens=5)
  c.potential_shaping = True
  return c


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = set_frozen_lake(grpo_arithmetic.base_config(variant), variant)
  c.turn_credit.name, c.turn_credit.gamma = "gigpo", 0.95
  return c
