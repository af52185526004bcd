r"""XLA's compiled memory of the GRPO update and of scoring's gradient at long rows.

  .venv/bin/python benchmarks/long_context.py                      # SmolLM2, 512..4k
  .venv/bin/python benchmarks/long_context.py --models qwen2.5-1.5b --lengths 2048
  .venv/bin/python benchmarks/long_context.py --chunks 128x256,256x512,512x1024 --lengths 2048

Shapes only: parameters come from `jax.eval_shape`, nothing is allocated, so 1.5B- and
8B-shaped configs are measured on a CPU. For `--rows` rows (one group sharing a
`--prompt`-column prompt) with replies of each length, it compiles

  scoring  `jax.grad` of the summed `scoring.policy_logprobs(..., with_entropy=True)`
  update   the GRPO experiment's jitted update (`experiments.grpo.grpo_update`: the loss,
           its gradient and AdamW) on the main job's config

and reports `compiled.memory_analysis()`'s temporaries and the compile time, per
attention implementation (`models/attention.py`: "xla", "chunked"), each in the layout
long rows need (layers stacked and rematerialized, `remat="full"`; vocabulary logits
`--logprob-chunk` columns at a time). The baseline of the code before attention had an
implementation choice is the "xla" row (the same einsums); the per-layer list layout
with whole logits is measured by benchmarks/long_scoring_memory.py (35.6 GiB at 4 x 2,048
on 2026-12-03). `--chunks` instead compares "chunked"'s (query, key) chunk sizes.

`--decode` also measures decode tokens/s of a static batch against continuous batching
on long-tailed reply lengths (benchmarks/continuous_batching.py: the embedded model,
batch 32, geometric lengths of mean `--decode-mean` capped at `--decode-cap`), as
`decode_tok_s` {static, continuous} and `continuous_over_static` (null without it).

Prints one JSON object as its last line (benchmarks/record.py), with
`scoring_temp_bytes` and `update_temp_bytes` as {implementation: {length: bytes}} of
the first model.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import grpo
from experiments.configs import grpo_arithmetic
from jaxrl_agents import types
from jaxrl_agents.models import attention, transformer, zoo
from jaxrl_agents.rollout import scoring

GIB = 2 ** 30

# Public architecture figures (config.json of each family); no weights are read.
MODELS = {
    "smollm2-135m-instruct": None,  # the embedded model's own config
    "qwen2.5-1.5b": transformer.TransformerConfig(
        vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
        ffn_dim=8960, rope_theta=1000000.0, tie_embeddings=True, qkv_bias=True,
        max_seq_len=32768),
    "llama-3-8b": transformer.TransformerConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=14336, rope_theta=500000.0, tie_embeddings=False, max_seq_len=8192),
}


def model_config(name: str, length: int, prompt: int) -> transformer.TransformerConfig:
  cfg = MODELS[name] or zoo.load(name).cfg
  return cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt + length), remat="full")


def batch(rows: int, prompt: int, length: int) -> grpo.GRPOBatch:
  ones = lambda *s: np.ones(s, np.int32)
  traj = types.single_turn(ones(rows, prompt), ones(rows, prompt).astype(bool),
                           ones(rows, length), ones(rows, length).astype(bool),
                           np.zeros((rows, length), np.float32))
  zeros = jnp.zeros(traj.tokens.shape, jnp.float32)
  return grpo.GRPOBatch(traj=traj, advantages=jnp.ones(rows), old_logp=zeros, ref_logp=zeros,
                        correct=jnp.zeros(rows))


def compiled_memory(fn, *args) -> tuple[dict, float]:
  """XLA's compiled memory analysis of jit(fn) on args: temporaries, arguments (the
  parameters, for the update the optimizer state too) and outputs; compile seconds."""
  t0 = time.perf_counter()
  analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
  return {"temp_bytes": int(analysis.temp_size_in_bytes),
          "argument_bytes": int(analysis.argument_size_in_bytes),
          "output_bytes": int(analysis.output_size_in_bytes)}, time.perf_counter() - t0


def measure(kind: str, cfg, rows: int, prompt: int, length: int, logprob_chunk: int) -> dict:
  params = jax.eval_shape(lambda: transformer.stack_layers(transformer.init(jax.random.key(0),
                                                                            cfg)))
  b = batch(rows, prompt, length)
  if kind == "scoring":
    def loss(p):
      logp, entropy = scoring.policy_logprobs(p, cfg, b.traj, with_entropy=True,
                                              group_size=rows, chunk=logprob_chunk)
      return jnp.sum(logp) + jnp.sum(entropy)
    memory, seconds = compiled_memory(jax.grad(loss), params)
  else:
    config = grpo_arithmetic.get_config()
    config.prompts_per_step, config.group_size, config.oversample = 1, rows, 1
    config.max_new_tokens, config.pack_replies = length, False
    config.logprob_chunk, config.layout, config.remat = logprob_chunk, "stacked", "full"
    algorithm = grpo.GRPO(config, cfg)
    state = jax.eval_shape(lambda p: algorithm.init_state(p, None), params)
    update = lambda st, bt: grpo.grpo_update(st, bt, jax.random.key(0), 0.0,
                                             optimizer=algorithm.optimizer, cfg=cfg,
                                             s=algorithm.settings)
    memory, seconds = compiled_memory(update, state, b)
  return {**memory, "compile_s": round(seconds, 1)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="smollm2-135m-instruct",
                 help=f"comma-separated, of {','.join(MODELS)}")
  p.add_argument("--lengths", default="512,1024,2048,4096")
  p.add_argument("--implementations", default="xla,chunked")
  p.add_argument("--kinds", default="scoring,update")
  p.add_argument("--chunks", default="",
                 help="compare 'chunked' (query x key) chunk sizes instead, e.g. 256x512")
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--logprob-chunk", type=int, default=128)
  p.add_argument("--decode", action="store_true",
                 help="also decode static vs continuous (minutes; "
                      "benchmarks/continuous_batching.py)")
  p.add_argument("--decode-mean", type=float, default=64)
  p.add_argument("--decode-cap", type=int, default=512)
  p.add_argument("--decode-sequences", type=int, default=128)
  args = p.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  if args.chunks:
    variants = [("chunked", tuple(int(n) for n in c.split("x"))) for c in args.chunks.split(",")]
  else:
    variants = [(name, attention.CHUNK) for name in args.implementations.split(",")]
  out = {"rows": args.rows, "prompt": args.prompt, "logprob_chunk": args.logprob_chunk,
         "layout": "stacked, remat full", "backend": jax.default_backend(), "results": [],
         "decode_tok_s": None, "continuous_over_static": None}
  for model in args.models.split(","):
    for length in lengths:
      cfg = model_config(model, length, args.prompt)
      for kind in args.kinds.split(","):
        for name, chunk in variants:
          attention.CHUNK = chunk  # read when tokamax's op is built (cached): rebuild it
          attention._tokamax_ops.cache_clear()
          r = measure(kind, cfg.replace(attention=name), args.rows, args.prompt, length,
                      args.logprob_chunk)
          r.update(model=model, kind=kind, attention=name, chunk=list(chunk), length=length)
          out["results"].append(r)
          print(f"{model:22s} {kind:8s} {name:8s} chunk {chunk[0]:4d}x{chunk[1]:<5d} "
                f"reply {length:5d}  temporaries {r['temp_bytes'] / GIB:8.3f} GiB  "
                f"(compile {r['compile_s']:.1f} s)", flush=True)
  first = args.models.split(",")[0]
  for kind in ("scoring", "update"):
    out[f"{kind}_temp_bytes"] = {
        name: {str(r["length"]): r["temp_bytes"] for r in out["results"]
               if r["kind"] == kind and r["model"] == first and r["attention"] == name}
        for name, _ in variants} if not args.chunks else None
  if args.decode:
    import continuous_batching  # benchmarks/ is the script's directory
    decode = continuous_batching.measure(zoo.load(zoo.DEFAULT_MODEL), args.decode_sequences, 32,
                                         args.decode_mean, args.decode_cap)
    out.update(decode=decode, decode_tok_s=decode["decode_tok_s"],
               continuous_over_static=decode["continuous_over_static"])
    print(f"decode: static {decode['decode_tok_s']['static']:.1f} tok/s, continuous "
          f"{decode['decode_tok_s']['continuous']:.1f} tok/s, x"
          f"{decode['continuous_over_static']:.2f}", flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
