r"""Per-device memory of training on a device mesh, planned from shapes alone (no weights).

  .venv/bin/python benchmarks/sharding_memory.py [--rows 512 --context 2048]

For the embedded SmolLM2-135M and Llama-3-8B- and Qwen2.5-32B-shaped configs,
the parameters' shapes come from `jax.eval_shape(transformer.init)` and the
rollout KV cache's from `jax.eval_shape(transformer.init_cache)`; each array's
per-device share is its size over the number of pieces `sharding.RULES` (and
`CACHE_RULES`) cut it into on a mesh of that shape. Nothing is allocated, so
meshes of any size are planned on this CPU.

Counted per device: float32 parameters, their float32 gradient, AdamW's two
float32 moments, and a bfloat16 KV cache for `rows` rollouts of `context`
tokens (rows over data x fsdp, key/value heads over tensor). Activations are
not counted: "fits" leaves a quarter of the device free for them.

Prints a Markdown table per model, the smallest mesh that fits a 16 GiB (TPU
v5e) and an 80 GiB (H100) device, and last one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import math

import jax

from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.parallel import sharding

GIB = 2 ** 30

# Public architecture figures (config.json of each family); no weights are read.
MODELS = {
    "smollm2-135m-instruct": None,  # the embedded model's own config
    "llama-3-8b": transformer.TransformerConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=14336, rope_theta=500000.0, tie_embeddings=False, max_seq_len=8192),
    "qwen2.5-32b": transformer.TransformerConfig(
        vocab_size=152064, d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128,
        ffn_dim=27648, rope_theta=1000000.0, tie_embeddings=False, qkv_bias=True,
        max_seq_len=32768),
}
DEVICE_BUDGETS_GIB = {"TPU v5e (16 GiB)": 16, "H100 (80 GiB)": 80}
HEADROOM = 0.75  # the share of a device the counted arrays may take


def model_config(name: str) -> transformer.TransformerConfig:
  return MODELS[name] or zoo.load(name).cfg


def _per_device(tree, sizes, rules) -> int:
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    spec = sharding.spec_for(sharding.path_name(path), leaf.shape, sizes, rules)
    total += math.prod(leaf.shape) * leaf.dtype.itemsize // sharding.shard_count(spec, sizes)
  return total


def plan(cfg: transformer.TransformerConfig, sizes: dict[str, int], rows: int, context: int
         ) -> dict[str, float]:
  """Per-device GiB of parameters, gradient, optimizer moments and KV cache on `sizes`."""
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0), cfg))
  cache = jax.eval_shape(lambda: transformer.init_cache(cfg, rows, context, dtype="bfloat16"))
  p = _per_device(params, sizes, sharding.RULES)
  kv = _per_device(cache._asdict(), sizes, sharding.CACHE_RULES)
  out = {"params_gib": p / GIB, "grads_gib": p / GIB, "adam_gib": 2 * p / GIB,
         "kv_cache_gib": kv / GIB}
  out["total_gib"] = sum(out.values())
  return out


def meshes(devices: int) -> list[dict[str, int]]:
  """FSDP alone, and FSDP with 8-way tensor parallelism when the devices allow it."""
  out = [{"data": 1, "fsdp": devices, "tensor": 1}]
  if devices >= 8:
    out.append({"data": 1, "fsdp": devices // 8, "tensor": 8})
  return out


def smallest_fit(cfg, budget_gib: float, rows: int, context: int) -> dict | None:
  """The fewest devices (powers of two up to 4096), and then the least tensor parallelism,
  whose counted arrays fit `budget_gib` x HEADROOM."""
  for n in (2 ** k for k in range(13)):
    for t in (1, 2, 4, 8):
      if t > n:
        break
      sizes = {"data": 1, "fsdp": n // t, "tensor": t}
      figures = plan(cfg, sizes, rows, context)
      if figures["total_gib"] <= budget_gib * HEADROOM:
        return {"devices": n, "mesh": sizes, **figures}
  return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=512, help="rollouts in flight (KV cache rows)")
  parser.add_argument("--context", type=int, default=2048, help="tokens per rollout")
  args = parser.parse_args()
  report = {"rows": args.rows, "context": args.context, "models": {}}
  for name in MODELS:
    cfg = model_config(name)
    entry = {"parameters": cfg.num_params, "meshes": [], "fits": {}}
    print(f"\n### {name} ({cfg.num_params / 1e9:.2f} B parameters; KV cache: {args.rows} rows "
          f"x {args.context} tokens, bfloat16)\n")
    print("| devices | mesh (data, fsdp, tensor) | params | grads | AdamW moments | KV cache "
          "| total (GiB per device) |")
    print("|---|---|---|---|---|---|---|")
    for devices in (8, 64, 256):
      for sizes in meshes(devices):
        f = plan(cfg, sizes, args.rows, args.context)
        entry["meshes"].append({"devices": devices, "mesh": sizes, **f})
        print(f"| {devices} | ({sizes['data']}, {sizes['fsdp']}, {sizes['tensor']}) | "
              f"{f['params_gib']:.2f} | {f['grads_gib']:.2f} | {f['adam_gib']:.2f} | "
              f"{f['kv_cache_gib']:.2f} | {f['total_gib']:.2f} |")
    for device, budget in DEVICE_BUDGETS_GIB.items():
      fit = smallest_fit(cfg, budget, args.rows, args.context)
      entry["fits"][device] = fit
      if fit is None:
        print(f"\n{device}: no mesh of up to 4096 devices fits")
      else:
        m = fit["mesh"]
        print(f"\n{device}: {fit['devices']} devices, mesh ({m['data']}, {m['fsdp']}, "
              f"{m['tensor']}), {fit['total_gib']:.2f} GiB per device counted")
    report["models"][name] = entry
  print(json.dumps(report))


if __name__ == "__main__":
  main()
