"""Evaluating policies: pass@k, maj@k and mean@k estimators, intervals, and the harness
that decodes a task's prompts and grades the replies (strict and lenient)."""

from jaxrl_agents.evaluation import estimators, harness

__all__ = ["estimators", "harness"]
