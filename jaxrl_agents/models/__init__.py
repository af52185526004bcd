"""Pure-functional networks, checkpoint I/O, tokenizers and model presets."""

from jaxrl_agents.models.transformer import KVCache, TransformerConfig, apply, init, init_cache

__all__ = ["KVCache", "TransformerConfig", "apply", "init", "init_cache"]
