"""The matrix products of a train step and of a decode step, alone: XLA:CPU against torch.

  .venv/bin/python benchmarks/matmul_shapes.py
  .venv/bin/python benchmarks/matmul_shapes.py --repeats 5 --rounds 5

What the two speed benchmarks (train_step.py, sampler.py) compare whole, split
into the float32 products SmolLM2-135M-Instruct's step is made of, so that a gap
between the systems can be put on the kernels or on everything else:

  train    8 x 256 = 2048 rows: each projection's forward (x w^T), input gradient
           (g w) and weight gradient (the product `transformer.project`'s derivative
           runs: the narrower operand transposed; torch's autograd: g^T x), for the
           30 layers' q, k, v, o, gate, up, down and the tied LM head
  decode   batch 32, one token per row: the project's decode step multiplies the
           weight by feature-major activations (w [out, in] x h [in, 32],
           `transformer.decode_step`), transformers' batch-major ones (h [32, in] x
           w^T); each call runs the product over `--copies` distinct weights, so the
           weights stream from memory as they do in a step of 30 layers

Each figure is the best of --repeats calls, the systems interleaved for --rounds
rounds (these shared machines drift). A step's products sum each product's time
times how often a step runs it. torch runs with as many threads as the machine has
cores. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from sampler import best_of  # first call (compiles or warms up), then the best

import cpu_info
from jaxrl_agents.models import transformer, zoo

TRAIN_ROWS, DECODE_ROWS = 8 * 256, 32


def projections(cfg) -> list[tuple[str, int, int, int]]:
  """(name, in, out, uses per step) of every product-bearing weight."""
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layers = [("q", cfg.d_model, q), ("k", cfg.d_model, kv), ("v", cfg.d_model, kv),
            ("o", q, cfg.d_model), ("gate", cfg.d_model, cfg.ffn_dim),
            ("up", cfg.d_model, cfg.ffn_dim), ("down", cfg.ffn_dim, cfg.d_model)]
  return ([(n, i, o, cfg.n_layers) for n, i, o in layers]
          + [("head", cfg.d_model, cfg.vocab_size, 1)])


def train_products(n_in: int, n_out: int, rng) -> dict:
  """{kind: (jax call, torch call, flops)}: the forward and both gradients at 2048 rows."""
  import torch
  x = rng.standard_normal((TRAIN_ROWS, n_in), np.float32)
  w = rng.standard_normal((n_out, n_in), np.float32) * 0.02
  g = rng.standard_normal((TRAIN_ROWS, n_out), np.float32)
  xj, wj, gj = map(jnp.asarray, (x, w, g))
  xt, wt, gt = map(torch.from_numpy, (x, w, g))
  f32 = jnp.float32

  def gradient(argnum):  # `project`'s own derivative, one operand's (jit drops the other)
    return jax.jit(lambda x, w, g: jax.vjp(
        lambda x, w: transformer.project(x, w, f32, f32), x, w)[1](g)[argnum])

  forward = jax.jit(lambda x, w: transformer.project(x, w, f32, f32))
  grad_x, grad_w = gradient(0), gradient(1)
  flops = 2 * TRAIN_ROWS * n_in * n_out
  return {
      "forward": (lambda: forward(xj, wj).block_until_ready(),
                  lambda: torch.nn.functional.linear(xt, wt), flops),
      "grad_input": (lambda: grad_x(xj, wj, gj).block_until_ready(), lambda: gt @ wt, flops),
      "grad_weight": (lambda: grad_w(xj, wj, gj).block_until_ready(), lambda: gt.t() @ xt,
                      flops),
  }


def decode_products(n_in: int, n_out: int, copies: int, rng) -> tuple:
  """(jax call, torch call, flops per product): one decode-size product over `copies`
  distinct weights per call."""
  import torch
  ws = [rng.standard_normal((n_out, n_in), np.float32) * 0.02 for _ in range(copies)]
  h = rng.standard_normal((n_in, DECODE_ROWS), np.float32)
  wj, hj = [jnp.asarray(w) for w in ws], jnp.asarray(h)
  wt, ht = [torch.from_numpy(w) for w in ws], torch.from_numpy(np.ascontiguousarray(h.T))
  # Feature-major, as transformer.decode_step multiplies: w [out, in] x h [in, B].
  chain = jax.jit(lambda ws, h: [jnp.einsum("oi,ib->ob", w, h) for w in ws])

  def torch_chain():
    with torch.no_grad():
      return [torch.nn.functional.linear(ht, w) for w in wt]

  return (lambda: jax.block_until_ready(chain(wj, hj)), torch_chain,
          2 * DECODE_ROWS * n_in * n_out)


def check_same_product(name: str, kind: str, jax_call, torch_call) -> None:
  """Both calls must compute the same product (decode: the same transposed), up to f32
  rounding over the contraction; otherwise the timings compare different work."""
  ours = [np.asarray(a) for a in jax.tree.leaves(jax_call())]
  theirs = torch_call()
  theirs = [t.numpy() for t in (theirs if isinstance(theirs, list) else [theirs])]
  for a, b in zip(ours, theirs, strict=True):
    b = b.T if a.shape != b.shape else b
    scale = float(np.abs(b).max()) or 1.0
    if a.shape != b.shape or float(np.abs(a - b).max()) > 1e-4 * scale:
      raise AssertionError(f"{name} {kind}: XLA:CPU and torch disagree; not timed")


def interleaved(pairs: dict, repeats: int, rounds: int) -> dict:
  """{key: (jax seconds, torch seconds)}, each the best over the rounds."""
  best = {k: [float("inf"), float("inf")] for k in pairs}
  for _ in range(rounds):
    for key, (jax_call, torch_call) in pairs.items():
      best[key][0] = min(best[key][0], best_of(jax_call, repeats)[1])
      best[key][1] = min(best[key][1], best_of(torch_call, repeats)[1])
  return best


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--decode-weights-mb", type=float, default=128.0,
                 help="distinct weights each decode call streams (more than the caches)")
  args = p.parse_args()
  if args.repeats < 1 or args.rounds < 1:
    p.error("--repeats and --rounds must be >= 1")
  import torch
  torch.set_num_threads(os.cpu_count() or 1)
  cfg = zoo.load(zoo.DEFAULT_MODEL).cfg
  rng = np.random.default_rng(0)
  cpu = cpu_info.describe()
  print("machine:", json.dumps(cpu), flush=True)
  rows, totals = [], {"train": [0.0, 0.0], "decode": [0.0, 0.0]}
  for name, n_in, n_out, uses in projections(cfg):
    products = train_products(n_in, n_out, rng)
    weight_mb = n_in * n_out * 4 / 2 ** 20
    copies = max(1, min(64, round(args.decode_weights_mb / weight_mb)))
    jax_dec, torch_dec, dec_flops = decode_products(n_in, n_out, copies, rng)
    pairs = {k: v[:2] for k, v in products.items()}
    pairs["decode"] = (jax_dec, torch_dec)
    flops = {k: v[2] for k, v in products.items()} | {"decode": dec_flops * copies}
    for kind, (jax_call, torch_call) in pairs.items():
      check_same_product(name, kind, jax_call, torch_call)
    for kind, (t_jax, t_torch) in interleaved(pairs, args.repeats, args.rounds).items():
      per_product = copies if kind == "decode" else 1
      row = {"weight": name, "in": n_in, "out": n_out, "kind": kind,
             "jax_ms": 1e3 * t_jax / per_product, "torch_ms": 1e3 * t_torch / per_product,
             "jax_gflop_s": flops[kind] / t_jax / 1e9,
             "torch_gflop_s": flops[kind] / t_torch / 1e9}
      rows.append(row)
      step = "decode" if kind == "decode" else "train"
      totals[step][0] += uses * t_jax / per_product
      totals[step][1] += uses * t_torch / per_product
      print(f"{name:5s} [{n_out:5d} x {n_in:4d}] {kind:11s}: jax {row['jax_gflop_s']:5.0f}  "
            f"torch {row['torch_gflop_s']:5.0f} GFLOP/s  ({row['jax_ms']:7.2f} / "
            f"{row['torch_ms']:7.2f} ms)", flush=True)
  result = {"machine": cpu, "train_rows": TRAIN_ROWS, "decode_rows": DECODE_ROWS,
            "products": rows,
            "train_step_products_s": {"jax": totals["train"][0], "torch": totals["train"][1]},
            "decode_step_products_ms": {"jax": 1e3 * totals["decode"][0],
                                        "torch": 1e3 * totals["decode"][1]},
            # Above 1: XLA:CPU's products are the faster (torch's time over its own).
            "speed_vs_torch": {"train_step_products": totals["train"][1] / totals["train"][0],
                               "decode_step_products":
                                   totals["decode"][1] / totals["decode"][0]}}
  print(f"a train step's products: jax {totals['train'][0]:.2f} s, torch "
        f"{totals['train'][1]:.2f} s; a batch-32 decode step's: jax "
        f"{1e3 * totals['decode'][0]:.1f} ms, torch {1e3 * totals['decode'][1]:.1f} ms")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
