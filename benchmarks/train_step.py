"""Train-step throughput: this project vs transformers + torch and tunix's llama3 + optax.

  .venv/bin/python benchmarks/train_step.py                 # all three (sets up tunix's venv)
  .venv/bin/python benchmarks/train_step.py --skip-tunix --dtypes float32
  .venv/bin/python benchmarks/train_step.py --baselines-retain-freed-memory

One step is forward + backward + AdamW over a batch of 8 x 256 tokens of
SmolLM2-135M-Instruct (every token predicted from the ones before it, token-mean
cross entropy). The compute dtype is float32 or bfloat16: for the project and
torch, bfloat16 means bfloat16 matmul inputs with float32 parameters, AdamW
moments and accumulation (`dtype="bfloat16"`; torch under `autocast`); tunix's
llama3 has one dtype for everything, so its bfloat16 row keeps parameters and
moments in bfloat16 too. Side by side in the same run:

  ours   the project's SFT update (`experiments.sft.sft_loss` through
         `optim.update_state`, jitted, the state donated)
  torch  transformers' LlamaForCausalLM on the same weights, torch.optim.AdamW
         (benchmarks/torch_train_step.py, a worker process)
  tunix  tunix 0.1.7's llama3 model (nnx) given SmolLM2's shapes and weights,
         optax.adamw under nnx.jit, in benchmarks/.venv-tunix (a worker process)

Each figure is the best of `--repeats` timed steps after one warm-up step;
compile time is the warm-up's excess over the best step. The systems run one
after another, none while another's worker process or train state is alive
(`bench_alone` says why; the project's loaded weights stay in this process).
Model-FLOPs utilization (MFU) counts 6 flops per parameter per token plus
attention's 12 x layers x sequence x width per token (the PaLM convention),
against the f32 and bf16 (f32-accumulated) matmul throughput measured with
JAX in the same run.

The project's side keeps freed host memory for reuse, as the SFT experiment does
by default (`jaxrl_agents.train.host_memory`: one glibc arena, no mmap, no trimming);
the baselines run with glibc's defaults, as their users get them, unless
`--baselines-retain-freed-memory` starts their workers with the same settings
(they gain from them too: quote both comparisons).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from sampler import TunixProcess, WorkerProcess, machine_limits, timed

import cpu_info
from experiments import sft
from jaxrl_agents.models import zoo
from jaxrl_agents.train import host_memory
from jaxrl_agents.train import optim as optim_lib

BATCH, SEQ = 8, 256


def batch_tokens(vocab: int, seed: int = 0) -> np.ndarray:
  """int32[BATCH, SEQ] tokens (random ids: the cost does not depend on the text)."""
  return np.random.default_rng(seed).integers(3, vocab, (BATCH, SEQ), dtype=np.int32)


def model_flops_per_token(cfg) -> float:
  return 6 * cfg.num_params + 12 * cfg.n_layers * SEQ * cfg.n_heads * cfg.head_dim


def ours_runner(model, tokens: np.ndarray, dtype: str):
  """(run, close) of the project's update: `close` deletes the train state and hands
  the freed heap back to the system (`host_memory.release_freed_memory`)."""
  cfg = model.cfg.replace(dtype=dtype)
  optimizer = optim_lib.make_optimizer(learning_rate=1e-5, total_updates=1000, grad_clip=None)
  loss = functools.partial(sft.sft_loss, cfg=cfg, aggregation="token-mean")
  update = jax.jit(functools.partial(optim_lib.update_state, optimizer, loss, epochs=1,
                                     minibatches=1), donate_argnums=0)
  params = jax.tree.map(jnp.copy, model.params)
  box = [sft.SFTState(params=params, opt_state=optimizer.tx.init(params),
                      updates=jnp.zeros((), jnp.int32))]
  ones = jnp.ones(tokens.shape, bool)
  batch = sft.SFTBatch(jnp.asarray(tokens), ones, ones)
  rng = jax.random.key(0)

  def run():
    box[0], metrics = update(box[0], batch, rng, jnp.float32(0.0))
    jax.block_until_ready((box[0], metrics))

  def close():
    for leaf in jax.tree.leaves(box.pop()):
      leaf.delete()
    host_memory.release_freed_memory()
  return timed(run), close


class TorchTrainWorker(WorkerProcess):
  """transformers + torch's train step (benchmarks/torch_train_step.py), one step per
  request, in its own process with this interpreter."""

  def __init__(self, hf_dir: str, tokens_file: str):
    super().__init__(sys.executable, "torch_train_step.py", "--hf-dir", hf_dir,
                     "--tokens", tokens_file)


class TunixTrainWorker(TunixProcess):
  """tunix's train step, timing one step per request."""

  def __init__(self, hf_dir: str, tokens_file: str):
    super().__init__("tunix_train_step.py", "--hf-dir", hf_dir, "--tokens", tokens_file)


def worker_runner(worker, dtype: str):
  """(run, close) of a baseline's train-step worker: one step of `dtype` per request."""
  return (lambda: worker.request(dtype)["seconds"]), worker.close


def bench_alone(start, dtype: str, repeats: int) -> tuple[float, float]:
  """(first step s, best of `repeats` later steps) of one system, measured while no
  other system's worker or train state is alive: `start(dtype)` -> (run, close),
  closed before the next.

  Not interleaved: a baseline's process alive beside the project's steps slowed
  them by 10-35% on a 2-core AMD EPYC (12.8 s alone; 14-17.5 s after a torch
  step, in this process or in its own; 12.7-13.2 s once torch's process had
  exited), while torch's steps kept their time. Under glibc's default malloc
  each step touched about 1.4M fresh pages (`pgfault` in /proc/vmstat), and
  that cost depends on what else holds memory (the project's side now keeps
  those pages; a baseline's still fault unless given the same settings). One
  system after another leaves drift over the minutes of a run uncancelled
  instead.
  """
  run, close = start(dtype)
  try:
    first = run()
    return first, min(run() for _ in range(repeats))
  finally:
    close()


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--skip-tunix", action="store_true")
  p.add_argument("--skip-torch", action="store_true")
  p.add_argument("--baselines-retain-freed-memory", action="store_true",
                 help="start torch's and tunix's workers with the glibc malloc settings "
                      "this project sets for itself (jaxrl_agents.train.host_memory)")
  args = p.parse_args()
  dtypes = args.dtypes.split(",")
  retained = host_memory.retain_freed_memory()  # as SFT does; before XLA's threads start
  if args.baselines_retain_freed_memory:
    # Read by the workers' glibc when they start.
    os.environ.update(host_memory.RETAIN_FREED_MEMORY_ENV)

  model = zoo.load(zoo.DEFAULT_MODEL)
  hf_dir = zoo.smollm2_dir()
  tokens = batch_tokens(model.cfg.vocab_size)
  # The baselines' workers read the batch from here (outside the repository).
  tokens_file = os.path.join(tempfile.mkdtemp(prefix="train_step_"), "tokens.npy")
  np.save(tokens_file, tokens)
  limits = machine_limits()
  cpu = cpu_info.describe()
  print("machine:", json.dumps({**cpu, **{k: round(v, 1) for k, v in limits.items()}}),
        flush=True)
  flops_per_token = model_flops_per_token(model.cfg)
  peak = {"float32": limits["matmul_f32_gflop_s"] * 1e9,
          "bfloat16": limits["matmul_bf16_f32acc_gflop_s"] * 1e9}
  result = {"tok_s": {}, "compile_s": {}, "mfu": {}, "machine": {**cpu, **limits},
            "batch": BATCH, "seq": SEQ, "model_flops_per_token": flops_per_token,
            "ours_retains_freed_memory": retained,
            "baselines_retain_freed_memory": args.baselines_retain_freed_memory}
  systems = {"ours": lambda dtype: ours_runner(model, tokens, dtype)}
  if not args.skip_torch:
    systems["torch"] = lambda dtype: worker_runner(TorchTrainWorker(hf_dir, tokens_file), dtype)
  if not args.skip_tunix:
    systems["tunix"] = lambda dtype: worker_runner(TunixTrainWorker(hf_dir, tokens_file), dtype)
  try:
    for dtype in dtypes:
      for system, start in systems.items():
        first, best = bench_alone(start, dtype, args.repeats)
        tok_s = BATCH * SEQ / best
        result["tok_s"].setdefault(system, {})[dtype] = tok_s
        result["compile_s"].setdefault(system, {})[dtype] = max(first - best, 0.0)
        result["mfu"].setdefault(system, {})[dtype] = tok_s * flops_per_token / peak[dtype]
        print(f"{system:6s} {dtype:8s}: {tok_s:6.1f} tok/s, step {best:.2f} s (first "
              f"{first:.1f} s), MFU {result['mfu'][system][dtype]:.3f}", flush=True)
  finally:
    os.remove(tokens_file)
  result["compile_s"].pop("torch", None)  # eager torch: nothing to compile
  ours = result["tok_s"]["ours"]
  for other in ("tunix", "torch"):
    if other in result["tok_s"]:
      result[f"ratio_vs_{other}"] = {d: ours[d] / result["tok_s"][other][d] for d in dtypes}
      result[f"ratio_vs_{other}_best_dtype"] = max(ours.values()) / max(
          result["tok_s"][other].values())
  print(json.dumps(result))


if __name__ == "__main__":
  main()
