"""jaxrl_agents: JAX-native reinforcement learning of LLM agents."""

from jaxrl_agents import host_memory

__version__ = "0.1.0"

# Before XLA starts its threads: see host_memory for why and for the opt-out.
host_memory.retain_freed_memory()
