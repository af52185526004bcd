"""Writes tests/golden/gemma_tiny.npz with Google's `gemma` library, for tests/test_gemma.py.

The tiny configurations of `jaxrl_agents.models.gemma` (TINY_GEMMA3, TINY_GEMMA2:
CONFIGS below, in the library's terms) built as `gemma.gm.nn.Transformer`, with
weights drawn by `golden_params` (numpy, seeded: the test draws the same ones),
run by the library on fixed inputs; for each:
- the path and shape of every parameter (shapes padded with -1);
- the logits of one full forward pass over two left-padded rows;
- 10 greedy tokens after a prompt, decoded one at a time through the
  library's own KV cache.

The library needs tensorflow (through kauldron) and does not install into the
project's environment; run this in its own (`scripts/setup_gemma_reference.sh`):

  .venv-gemma/bin/python tests/golden/make_gemma_golden.py
"""

import os
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemma_tiny.npz")

# The library's configurations of jaxrl_agents.models.gemma.TINY_GEMMA3 and TINY_GEMMA2 (the
# test builds those and compares their outputs with these).
SHAPES = dict(num_embed=320, embed_dim=64, num_heads=4, head_dim=16, num_kv_heads=2)
CONFIGS = {
    "gemma3": dict(SHAPES, hidden_dim=128, sliding_window_size=8, use_qk_norm=True,
                   attention_types=("LOCAL_SLIDING", "GLOBAL"), transpose_gating_einsum=True,
                   local_base_frequency=10_000, global_base_frequency=1_000_000),
    # Gemma 2's soft caps and no qk-norm; K == N (the fused qkv weight); the untransposed
    # gating weight; queries scaled by (D / N)^-1/2; rope scaling on the global layer.
    "gemma2": dict(SHAPES, num_heads=2, hidden_dim=96, sliding_window_size=6,
                   use_qk_norm=False, attention_types=("GLOBAL", "LOCAL_SLIDING"),
                   transpose_gating_einsum=False, attn_logits_soft_cap=50.0,
                   final_logit_softcap=30.0,
                   query_pre_attn_norm="BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS",
                   local_base_frequency=10_000, global_base_frequency=10_000,
                   global_scale_factor=8.0),
}
SEQ, STEPS = 12, 10


def golden_params(shapes: dict) -> dict:
  """Weights for a nested dict of shapes: normal(0, 0.02) in sorted path order, seed 0
  (norm scales too, so (1 + scale) is exercised; larger weights make a random tied-embedding
  model repeat its last token, which would test little)."""
  rng = np.random.default_rng(0)

  def fill(tree):
    return {k: fill(v) if isinstance(v, dict) else
            (0.02 * rng.standard_normal(v)).astype(np.float32) for k, v in sorted(tree.items())}
  return fill(shapes)


def golden_inputs():
  """Two rows of SEQ tokens, the second left-padded by 3."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(5, SHAPES["num_embed"], (2, SEQ)).astype(np.int32)
  valid = np.ones((2, SEQ), bool)
  valid[1, :3] = False
  tokens[~valid] = 0
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return tokens, valid, positions


def run_library(name: str) -> dict:
  import jax
  import jax.numpy as jnp
  from gemma import gm

  attn = gm.nn.AttentionType
  kwargs = dict(final_logit_softcap=None, use_post_attn_norm=True, use_post_ffw_norm=True)
  kwargs.update(CONFIGS[name])
  kwargs["attention_types"] = tuple(getattr(attn, t) for t in kwargs["attention_types"])
  if "query_pre_attn_norm" in kwargs:
    kwargs["query_pre_attn_norm"] = getattr(gm.nn.config.QueryPreAttentionNormalisation,
                                            kwargs["query_pre_attn_norm"])
  model = gm.nn.Transformer(config=gm.nn.config.TransformerConfig(**kwargs), dtype=jnp.float32)
  tokens, valid, positions = golden_inputs()
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.asarray(tokens))["params"])
  params = golden_params(jax.tree.map(lambda s: s.shape, shapes))
  params = jax.tree.map(jnp.asarray, params)

  causal = np.tril(np.ones((SEQ, SEQ), bool))[None] & valid[:, None, :]
  mask = causal | np.eye(SEQ, dtype=bool)[None]
  out = model.apply({"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions),
                    attention_mask=jnp.asarray(mask))
  logits = np.asarray(out.logits, np.float32)

  # Greedy decoding of row 0's first 6 tokens as the prompt, through the library's cache.
  prompt = tokens[:1, :6]
  cache_len = 6 + STEPS
  cache = model.init_cache(batch_size=1, dtype=jnp.float32, cache_length=cache_len)
  prompt_mask = np.zeros((1, 6, cache_len), bool)
  prompt_mask[0, :, :6] = np.tril(np.ones((6, 6), bool))
  out = model.apply({"params": params}, jnp.asarray(prompt),
                    positions=jnp.arange(6, dtype=jnp.int32)[None], cache=cache,
                    attention_mask=jnp.asarray(prompt_mask))
  cache, next_logits = out.cache, out.logits[:, -1]
  greedy = []
  for step in range(STEPS):
    token = int(jnp.argmax(next_logits[0]))
    greedy.append(token)
    slot = 6 + step
    step_mask = np.zeros((1, 1, cache_len), bool)
    step_mask[0, 0, :slot + 1] = True
    out = model.apply({"params": params}, jnp.asarray([[token]], jnp.int32),
                      positions=jnp.asarray([[slot]], jnp.int32), cache=cache,
                      attention_mask=jnp.asarray(step_mask))
    cache, next_logits = out.cache, out.logits[:, -1]
  flat = jax.tree_util.tree_leaves_with_path(shapes)
  paths = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]
  dims = max(len(s.shape) for _, s in flat)
  param_shapes = np.asarray([list(s.shape) + [-1] * (dims - len(s.shape)) for _, s in flat])
  print(f"{name}: logits {logits.shape}, greedy {greedy}")
  return {f"{name}_logits": logits, f"{name}_greedy": np.asarray(greedy, np.int32),
          f"{name}_param_paths": np.asarray(paths), f"{name}_param_shapes": param_shapes}


def main():
  import gemma

  arrays = {}
  for name in CONFIGS:
    arrays.update(run_library(name))
  np.savez(OUT, gemma_version=np.asarray(gemma.__version__), **arrays)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  sys.exit(main())
