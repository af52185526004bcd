r"""Attention implementations on this backend: agreement with the reference, time and
memory of attention's gradient, and of scoring's gradient at long rows.

  .venv/bin/python benchmarks/attention_kernels.py               # all implementations
  .venv/bin/python benchmarks/attention_kernels.py --implementations xla,chunked \
      --lengths 512 --scoring-lengths 512                        # what a CPU runs

`models/attention.py` names the implementations; "cudnn", "triton" and "mosaic" are
tokamax's accelerator kernels, which a CPU cannot run (their rows then hold the error).
Three parts, each implementation alone, so a kernel that refuses a shape or runs out of
memory is recorded as its error and the rest go on:

1. agreement: `attend` against `attention.reference` (softmax over the materialized
   mask, float32), forward and the gradient of a random projection of the output, for
   a packed pass (two segments and padding, `Mask.segments`), a pass through a KV
   cache (`Mask.cached`) and a continuation after a shared prefix at odd lengths
   (`Mask.after_prefix`), in float32 and bfloat16 inputs: the max abs error.
2. attention: `jax.grad` of a projection of `attend` at `--rows` x T, bfloat16, for
   SmolLM2's heads (9 query / 3 key-value heads of 64) and a Qwen2.5-1.5B shape's (12 / 2
   of 128): ms a call (best of `--repeats` after a warm-up), compile s, XLA's compiled
   temporaries.
3. scoring: `jax.grad` of the summed `scoring.policy_logprobs(..., with_entropy=True)`
   on random SmolLM2-shaped weights (layers stacked and rematerialized, `remat="full"`;
   vocabulary logits 128 columns at a time; bfloat16 compute), one group of `--rows`
   rows sharing a 64-token prompt with replies of each `--scoring-lengths`: s a call,
   scored tokens a second, compiled temporaries.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import cpu_info
from jaxrl_agents import types
from jaxrl_agents.models import attention, transformer
from jaxrl_agents.rollout import scoring

GIB = 2 ** 30
# The embedded model's architecture (its config.json), written out so this script needs
# no weights package; parameters are drawn at random.
SMOLLM2 = transformer.TransformerConfig(
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
    ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=16384)
HEADS = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
PROMPT = 64


def problem(key, b, t, s, heads, dtype):
  h, kv, dh = heads
  kq, kk, kv_, kw = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, t, h, dh), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, kv, dh), jnp.float32).astype(dtype)
  v = jax.random.normal(kv_, (b, s, kv, dh), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (b, t, h * dh), jnp.float32)
  return q, k, v, w


def packed_mask(b, t):
  """Two segments and trailing padding in row 0, one segment and leading padding in the
  others (each segment one run, as `Mask.segments` requires)."""
  ids = np.zeros((b, t), np.int32)
  ids[0, :t // 3], ids[0, t // 3:t - 5] = 1, 2
  ids[1:, 7:] = 1
  return attention.Mask.segments(jnp.asarray(ids))


def cached_mask(b, t, s):
  """T new queries at slots [s - t, s) of a cache whose first 3 slots are padding."""
  valid = np.ones((b, s), bool)
  valid[:, :3] = False
  return attention.Mask.cached(jnp.asarray(valid), jnp.int32(s - t), t)


def prefix_mask(b, t, s):
  """T continuation tokens after an (s - t)-slot prefix whose first 2 slots are padding,
  the last 4 of each continuation padding too (`Mask.after_prefix`)."""
  prefix = np.ones((b, s - t), bool)
  prefix[:, :2] = False
  own = np.ones((b, t), bool)
  own[:, -4:] = False
  return attention.Mask.after_prefix(jnp.asarray(prefix), jnp.asarray(own))


def agreement(name: str, dtype) -> dict:
  # "after_prefix" is scoring's pass after a shared prompt, at odd lengths (scoring's
  # rows are one shorter than the tokens).
  return {case: agreement_case(name, dtype, case, t, s) for case, (t, s) in {
      "packed": (256, 256), "cached": (16, 320), "after_prefix": (255, 319)}.items()}


def agreement_case(name: str, dtype, case: str, t: int, s: int) -> dict:
  q, k, v, w = problem(jax.random.key(1), 2, t, s, HEADS["smollm2"], dtype)
  mask = {"packed": lambda: packed_mask(2, t), "cached": lambda: cached_mask(2, t, s),
          "after_prefix": lambda: prefix_mask(2, t, s)}[case]()
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # attend's [B, K, S, Dh]

  def loss(q, k, v, fn):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
  ours = lambda q, kt, vt: attention.attend(q, kt, vt, mask, implementation=name)
  ref = lambda q, k, v: attention.reference(q, k, v, mask)
  got, want = jax.jit(ours)(q, kt, vt), ref(q, k, v)
  g_ours = jax.jit(jax.grad(lambda *a: loss(*a, ours), argnums=(0, 1, 2)))(q, kt, vt)
  g_ref = jax.grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2))(q, k, v)
  g_ours = (g_ours[0], g_ours[1].transpose(0, 2, 1, 3), g_ours[2].transpose(0, 2, 1, 3))
  err = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
  return {"forward": err(got, want),
          "grad": max(err(a, b) for a, b in zip(g_ours, g_ref, strict=True)),
          "grad_scale": max(float(jnp.max(jnp.abs(b))) for b in g_ref)}


def agrees(r: dict) -> bool:
  """Within bfloat16's rounding of the reference: the outputs are O(1) and each input
  rounds by 2^-8 relatively, so 0.05 absolute, and 2% of the gradient's scale."""
  return "error" not in r and all(
      c["forward"] < 0.05 and c["grad"] < 0.02 * c["grad_scale"] + 0.05 for c in r.values())


def timed(fn, args, repeats: int) -> dict:
  """Compile s, XLA's compiled temporaries, best of `repeats` calls after a warm-up."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    best = min(best, time.perf_counter() - t0)
  return {"s": best, "compile_s": round(compile_s, 2),
          "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}


def attention_grad(name: str, heads, rows: int, t: int, repeats: int) -> dict:
  q, k, v, w = problem(jax.random.key(2), rows, t, t, heads, jnp.bfloat16)
  mask = attention.Mask.segments(jnp.ones((rows, t), jnp.int32))
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def loss(q, kt, vt):
    out = attention.attend(q, kt, vt, mask, implementation=name)
    return jnp.sum(out.astype(jnp.float32) * w)
  r = timed(jax.grad(loss, argnums=(0, 1, 2)), (q, kt, vt), repeats)
  r["ms"] = round(r.pop("s") * 1e3, 3)
  return r


def scoring_grad(name: str, params, rows: int, length: int, repeats: int) -> dict:
  cfg = SMOLLM2.replace(attention=name, remat="full", dtype="bfloat16")
  rng = np.random.default_rng(0)
  ids = lambda n: rng.integers(3, cfg.vocab_size, (rows, n), dtype=np.int32)
  traj = types.single_turn(ids(PROMPT), np.ones((rows, PROMPT), bool), ids(length),
                           np.ones((rows, length), bool), np.zeros((rows, length), np.float32))
  traj = jax.tree.map(jnp.asarray, traj)

  def loss(p, traj):
    logp, entropy = scoring.policy_logprobs(p, cfg, traj, with_entropy=True,
                                            group_size=rows, chunk=128)
    return jnp.sum(logp) + jnp.sum(entropy)
  r = timed(jax.grad(loss), (params, traj), repeats)
  r["tok_s"] = round(rows * length / r["s"], 1)
  r["s"] = round(r["s"], 4)
  return r


def attempt(fn, *args) -> dict:
  """fn's result, or its error (a kernel that refuses a shape or runs out of memory is
  a result; the run goes on)."""
  try:
    return fn(*args)
  except Exception as e:  # noqa: BLE001 - recorded, see the docstring
    traceback.print_exc(limit=2, file=sys.stderr)
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--implementations", default="xla,chunked,cudnn,triton,mosaic")
  p.add_argument("--lengths", default="1024,4096,8192", help="part 2's row lengths")
  p.add_argument("--scoring-lengths", default="1024,4096,8192", help="part 3's reply lengths")
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", help="also write the JSON here, after each part (a run cut off "
                                "by a time limit keeps what it measured)")
  p.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                             "agreement,attention,scoring")
  args = p.parse_args()
  names = args.implementations.split(",")
  skip = set(filter(None, args.skip.split(",")))
  device = jax.devices()[0]
  out = {"backend": jax.default_backend(), "device": device.device_kind, "jax": jax.__version__,
         "host": cpu_info.describe(), "rows": args.rows, "chunk": list(attention.CHUNK),
         "agreement": {}, "attention": {}, "scoring": {}}
  print("device:", out["device"], "jax", out["jax"], flush=True)

  def save():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
  if "agreement" not in skip:
    for name in names:
      for dtype in ("float32", "bfloat16"):
        r = attempt(agreement, name, jnp.dtype(dtype))
        out["agreement"][f"{name}_{dtype}"] = r
        print(f"agreement {name:8s} {dtype:8s} {json.dumps(r)}", flush=True)
    save()
    # Parts 2 and 3 time only what computes the right values in bfloat16.
    names = [n for n in names if agrees(out["agreement"][f"{n}_bfloat16"])]
    out["timed"] = names
  if "attention" not in skip:
    for heads in HEADS:
      for t in (int(x) for x in args.lengths.split(",")):
        for name in names:
          r = attempt(attention_grad, name, HEADS[heads], args.rows, t, args.repeats)
          out["attention"][f"{heads}_{args.rows}x{t}_{name}"] = r
          print(f"attention {heads:12s} {args.rows}x{t:<5d} {name:8s} {json.dumps(r)}",
                flush=True)
        save()
  if "scoring" not in skip:
    params = transformer.stack_layers(transformer.init(jax.random.key(0), SMOLLM2))
    for length in (int(x) for x in args.scoring_lengths.split(",")):
      for name in names:
        r = attempt(scoring_grad, name, params, args.rows, length, args.repeats)
        out["scoring"][f"{args.rows}x{length}_{name}"] = r
        print(f"scoring   smollm2 {args.rows}x(64+{length}) {name:8s} {json.dumps(r)}",
              flush=True)
        save()
  print(json.dumps(out))


if __name__ == "__main__":
  main()
