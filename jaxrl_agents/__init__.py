"""jaxrl_agents: JAX-native reinforcement learning of LLM agents."""

__version__ = "0.1.0"
