r"""Memory plans of full fine-tuning against LoRA, from shapes alone (no weights).

  .venv/bin/python benchmarks/lora_memory.py                       # the three shapes, 1k-4k
  .venv/bin/python benchmarks/lora_memory.py --models llama-3-8b --lengths 2048

For SmolLM2-135M, a Qwen2.5-1.5B- and a Llama-3-8B-shaped config (parameters from
`jax.eval_shape`), each of

  full       every weight trains: float32 weights, gradient and AdamW moments
  lora       rank `--rank` adapters on every linear weight (models/lora.py), base float32
  lora-bf16  the same, the frozen base stored in bfloat16 (config.lora.base_dtype) and the
             passes computed in bfloat16 (config.dtype). On a CPU its temporaries hold a
             float32 copy of every stacked weight: XLA:CPU computes bfloat16 in float32
             and casts the whole stack before the layers' loop (seen in the compiled
             HLO; the transformer does it with or without LoRA). An accelerator computes
             bfloat16 natively; that compile is not measured here.

compiles the GRPO experiment's jitted update (`experiments.grpo.grpo_update`: loss,
gradient, AdamW) for `--rows` rows (one group sharing a `--prompt`-column prompt) of
replies of each length, in the layout long rows need (layers stacked and rematerialized,
chunked attention, vocabulary logits `--logprob-chunk` columns at a time), and reports
XLA's compiled memory: arguments (parameters, optimizer state, the batch) and
temporaries (activations, gradients, the merged weights). One device's peak is about
arguments + temporaries (outputs alias the donated state).

Per device on meshes of 1, 8 and 64 devices: the parameters' and optimizer state's
shares under `sharding.RULES` (FSDP over every device; an adapter's A split along its
input like its weight, B along its output), beside the one-device temporaries of
`--rows` rows (each device holding `--rows` rows of its own), and a bfloat16 KV cache of
`--kv-rows` rollouts of prompt + reply tokens split over the devices
(`sharding.CACHE_RULES`).

Prints a Markdown table, then one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import long_context

from experiments import grpo
from experiments.configs import grpo_arithmetic
from jaxrl_agents.models import lora, transformer
from jaxrl_agents.parallel import sharding

GIB = 2 ** 30
MODES = ("full", "lora", "lora-bf16")


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _per_device(tree, sizes, rules=sharding.RULES) -> int:
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    spec = sharding.spec_for(sharding.path_name(path), leaf.shape, sizes, rules)
    total += math.prod(leaf.shape) * leaf.dtype.itemsize // sharding.shard_count(spec, sizes)
  return total


def train_state(cfg, mode: str, rank: int, config):
  """(model definition, train-state shapes, GRPO) of `mode` on `cfg`'s stacked shapes."""
  if mode == "lora-bf16":  # stored and computed in bfloat16 (the accelerators' setting)
    cfg = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
  params = jax.eval_shape(lambda: transformer.stack_layers(transformer.init(jax.random.key(0),
                                                                            cfg)))
  if mode != "full":
    spec = lora.LoraSpec(rank=rank, alpha=2.0 * rank)
    adapters = jax.eval_shape(lambda: lora.init(jax.random.key(1), params, spec))
    params, cfg = {"base": params, "lora": adapters}, lora.LoraLM(cfg, spec)
  algorithm = grpo.GRPO(config, cfg)
  state = jax.eval_shape(lambda p: algorithm.init_state(p, None), params)
  return cfg, state, algorithm


def measure(name: str, mode: str, length: int, args) -> dict:
  base_cfg = long_context.model_config(name, length, args.prompt).replace(attention="chunked")
  config = grpo_arithmetic.get_config()
  config.prompts_per_step, config.group_size, config.oversample = 1, args.rows, 1
  config.max_new_tokens, config.pack_replies = length, False
  config.logprob_chunk, config.layout, config.remat = args.logprob_chunk, "stacked", "full"
  cfg, state, algorithm = train_state(base_cfg, mode, args.rank, config)
  batch = long_context.batch(args.rows, args.prompt, length)
  update = lambda st, bt: grpo.grpo_update(st, bt, jax.random.key(0), 0.0,
                                           optimizer=algorithm.optimizer, cfg=cfg,
                                           s=algorithm.settings)
  t0 = time.perf_counter()
  analysis = jax.jit(update).lower(state, batch).compile().memory_analysis()
  seconds = time.perf_counter() - t0
  params = state.params
  trainable = lora.trainable(params)
  out = {"model": name, "mode": mode, "length": length,
         "params_bytes": _bytes(params), "trainable_bytes": _bytes(trainable),
         "opt_state_bytes": _bytes(state.opt_state),
         "argument_bytes": int(analysis.argument_size_in_bytes),
         "temp_bytes": int(analysis.temp_size_in_bytes), "compile_s": round(seconds, 1),
         "devices": {}}
  cache = jax.eval_shape(lambda: transformer.init_cache(base_cfg, args.kv_rows,
                                                        args.prompt + length, "bfloat16"))
  for n in (1, 8, 64):
    sizes = {"data": 1, "fsdp": n, "tensor": 1}
    share = {"params": _per_device(params, sizes),
             "opt_state": _per_device(state.opt_state, sizes),
             "temp": out["temp_bytes"],
             "kv_cache": _per_device(cache._asdict(), sizes, sharding.CACHE_RULES)}
    share["total"] = sum(share.values())
    out["devices"][n] = share
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-1.5b,llama-3-8b")
  p.add_argument("--lengths", default="1024,2048,4096")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--logprob-chunk", type=int, default=128)
  p.add_argument("--kv-rows", type=int, default=64,
                 help="rollouts decoding at once, for the KV cache column")
  args = p.parse_args()
  results = []
  print("| model | mode | reply tokens | params | optimizer state | update temporaries | "
        "one device (GiB) | per device of 8 | per device of 64 |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name in args.models.split(","):
    for length in (int(x) for x in args.lengths.split(",")):
      for mode in args.modes.split(","):
        r = measure(name, mode, length, args)
        results.append(r)
        d = r["devices"]
        print(f"| {name} | {mode} | {length} | {r['params_bytes'] / GIB:.2f} | "
              f"{r['opt_state_bytes'] / GIB:.3f} | {r['temp_bytes'] / GIB:.2f} | "
              f"{d[1]['total'] / GIB:.1f} | {d[8]['total'] / GIB:.1f} | "
              f"{d[64]['total'] / GIB:.1f} |", flush=True)
  print(json.dumps({"rank": args.rank, "rows": args.rows, "prompt": args.prompt,
                    "kv_rows": args.kv_rows, "logprob_chunk": args.logprob_chunk,
                    "layout": "stacked, remat full, chunked attention",
                    "backend": jax.default_backend(), "results": results}))


if __name__ == "__main__":
  main()
