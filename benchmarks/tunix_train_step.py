"""tunix's llama3 model trained with optax on SmolLM2 weights, run inside benchmarks/.venv-tunix.

Called by benchmarks/train_step.py (tunix is a baseline, not a project dependency):

  benchmarks/.venv-tunix/bin/python benchmarks/tunix_train_step.py --hf-dir DIR \
      --tokens tokens.npy

Each stdin line "DTYPE" (float32 or bfloat16) runs one train step on the batch
in `--tokens` and answers one stdout line {"seconds": ...} (the first step of a
dtype includes its compilation). A step is forward + backward + AdamW
(`nnx.Optimizer` over `optax.adamw`) under `nnx.jit`, token-mean next-token
cross entropy with a causal mask. tunix's llama3 has one dtype for parameters
and activations: its bfloat16 model keeps parameters and AdamW moments in
bfloat16 (the project's bfloat16 row keeps them in float32).
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix_sampler import model_config


def build(hf_dir: str, dtype):
  from tunix.models.llama3 import params as params_lib

  model = params_lib.create_model_from_safe_tensors(hf_dir, model_config(hf_dir), dtype=dtype)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-5, weight_decay=0.0), wrt=nnx.Param)
  return model, optimizer


@nnx.jit
def train_step(model, optimizer, tokens):
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))

  def loss_fn(model):
    logits, _ = model(tokens, positions, None, causal)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", required=True)
  p.add_argument("--tokens", required=True)
  args = p.parse_args()
  tokens = jnp.asarray(np.load(args.tokens))
  built = {}
  for line in sys.stdin:
    dtype = line.strip()
    if not dtype:
      continue
    if dtype not in built:
      built.clear()  # one model in memory at a time
      built[dtype] = build(args.hf_dir, getattr(jnp, dtype))
    model, optimizer = built[dtype]
    start = time.perf_counter()
    loss = train_step(model, optimizer, tokens)
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "loss": float(loss)}), flush=True)


if __name__ == "__main__":
  main()
