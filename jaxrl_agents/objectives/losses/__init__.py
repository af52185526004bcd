"""Stateless objectives: policy-gradient surrogates, KL, entropy, value and preference losses.

Importing the package registers every loss under its kind ("policy_loss", "kl",
"aggregation", "preference_loss"); see docs/objectives.md for the table.
"""

from jaxrl_agents.objectives.losses import (
    aggregation,
    entropy,
    kl,
    kl_control,
    policy_gradient,
    preference,
    token_controls,
    value,
)
from jaxrl_agents.objectives.losses.aggregation import aggregate, masked_max, masked_mean
from jaxrl_agents.objectives.losses.entropy import entropy_bonus, entropy_from_logits
from jaxrl_agents.objectives.losses.kl import (
    forward_kl_from_logits,
    kl_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_reward_penalty,
    reverse_kl_from_logits,
)
from jaxrl_agents.objectives.losses.kl_control import (
    KLController,
    KLControllerState,
    accuracy_conditioned_beta,
    accuracy_conditioned_kl_controller,
    adaptive_kl_controller,
    fixed_kl_controller,
)
from jaxrl_agents.objectives.losses.policy_gradient import (
    cispo_loss,
    gspo_loss,
    ppo_loss,
    reinforce_loss,
)
from jaxrl_agents.objectives.losses.preference import (
    bradley_terry_loss,
    cpl_loss,
    dpo_loss,
    ipo_loss,
    raft_select,
    rpo_loss,
    sft_nll,
    spo_win_rate_rewards,
)
from jaxrl_agents.objectives.losses.token_controls import covariance_clip_mask, entropy_gate_mask
from jaxrl_agents.objectives.losses.value import clipped_value_loss

__all__ = [
    "KLController",
    "KLControllerState",
    "accuracy_conditioned_beta",
    "accuracy_conditioned_kl_controller",
    "adaptive_kl_controller",
    "aggregate",
    "aggregation",
    "bradley_terry_loss",
    "cispo_loss",
    "clipped_value_loss",
    "covariance_clip_mask",
    "cpl_loss",
    "dpo_loss",
    "entropy",
    "entropy_bonus",
    "entropy_from_logits",
    "entropy_gate_mask",
    "fixed_kl_controller",
    "forward_kl_from_logits",
    "gspo_loss",
    "ipo_loss",
    "kl",
    "kl_control",
    "kl_from_logits",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_reward_penalty",
    "masked_max",
    "masked_mean",
    "policy_gradient",
    "ppo_loss",
    "preference",
    "raft_select",
    "reinforce_loss",
    "reverse_kl_from_logits",
    "rpo_loss",
    "sft_nll",
    "spo_win_rate_rewards",
    "token_controls",
    "value",
]
