"""The sampler's pieces jitted once, for tests that step it by hand (the Python-loop
references of the multi-turn and self-play tests, the cache-passing tests): eager, a
prefill's forward would compile each of its ops on its own, every call."""

import jax

from jaxrl_agents.rollout import sampler as sampler_lib

prefill = jax.jit(sampler_lib.prefill, static_argnames=("cfg", "cache_len", "samples_per_prompt"))
extend = jax.jit(sampler_lib.extend, static_argnames=("cfg",))
decode = jax.jit(sampler_lib.decode, static_argnames=("cfg", "sampling", "keep_cache"))
