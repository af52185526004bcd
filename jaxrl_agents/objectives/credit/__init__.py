"""Credit assignment and reward shaping for multi-turn rollouts.

Turn-level signals (per-turn rewards, potentials, answer probabilities, implicit
process rewards) become per-turn or per-token advantages. Shapes:

  turn_rewards: f32[B, K]   K turns per rollout (padded), turn_mask: bool[B, K]
  turn_id:      int[B, T]   the turn each token belongs to (-1 or >= K: none)
  mask:         bool[B, T]  policy tokens (environment/tool tokens excluded)

Rows are ordered prompt-major: B = P * G, the G rollouts of prompt p are rows
p*G .. p*G + G - 1. Everything here is pure and jittable; string arguments
(`scope`) and sizes (`group_size`, `num_turns`, `num_roles`) are static.

```
turn_adv = normalize_turn_rewards(turn_rewards, turn_mask, scope="group", group_size=G)
token_adv = broadcast_turn_values(turn_adv, turn_id, mask, turn_mask)   # f32[B, T]
```

One topic per module (as rlax does): `turns`, `gae`, `shaping`, `information_gain`,
`step_rewards`, `token_weights`, `roles`; every public function is also here.
"""

from jaxrl_agents.objectives.credit.gae import (
    bilevel_gae,
    policy_token_gae,
    rewards_at_turn_ends,
    turn_level_gae,
    turn_values,
)
from jaxrl_agents.objectives.credit.information_gain import (
    igpo_turn_rewards,
    information_gain_rewards,
)
from jaxrl_agents.objectives.credit.roles import (
    RoleBaseline,
    RoleBaselineState,
    role_baseline,
    role_conditioned_advantages,
)
from jaxrl_agents.objectives.credit.shaping import (
    par_sigmoid_shaping,
    potential_based_shaping,
)
from jaxrl_agents.objectives.credit.step_rewards import (
    combine_outcome_and_step_advantages,
    implicit_step_rewards,
)
from jaxrl_agents.objectives.credit.token_weights import (
    pivotal_mask,
    positive_amplification,
)
from jaxrl_agents.objectives.credit.turns import (
    broadcast_turn_values,
    normalize_turn_rewards,
    step_group_advantages,
    turn_returns,
    turn_rewards_to_token_advantages,
)

__all__ = [
    "RoleBaseline",
    "RoleBaselineState",
    "bilevel_gae",
    "broadcast_turn_values",
    "combine_outcome_and_step_advantages",
    "igpo_turn_rewards",
    "implicit_step_rewards",
    "information_gain_rewards",
    "normalize_turn_rewards",
    "par_sigmoid_shaping",
    "pivotal_mask",
    "policy_token_gae",
    "positive_amplification",
    "potential_based_shaping",
    "rewards_at_turn_ends",
    "role_baseline",
    "role_conditioned_advantages",
    "step_group_advantages",
    "turn_level_gae",
    "turn_returns",
    "turn_rewards_to_token_advantages",
    "turn_values",
]
