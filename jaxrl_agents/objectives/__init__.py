"""Objectives: losses, advantage estimators, turn-level credit and the policy objective
GRPO and PPO share (docs/objectives.md)."""
