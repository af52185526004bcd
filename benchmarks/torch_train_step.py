"""transformers + torch's train step on SmolLM2, a worker process of benchmarks/train_step.py.

  .venv/bin/python benchmarks/torch_train_step.py --hf-dir DIR --tokens tokens.npy

Each stdin line "DTYPE" (float32 or bfloat16) runs one train step on the batch
in `--tokens` and answers one stdout line {"seconds": ...}. A step is forward +
backward + `torch.optim.AdamW` on LlamaForCausalLM with float32 parameters and
moments; bfloat16 runs the forward under `torch.autocast`. The model and
optimizer are built once (float32 parameters serve both dtypes). It runs in its
own process, which exits before the next system is timed (see
`train_step.bench_alone`).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", required=True)
  p.add_argument("--tokens", required=True)
  args = p.parse_args()
  torch.set_num_threads(len(os.sched_getaffinity(0)))  # the CPUs this process may use
  model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
  ids = torch.tensor(np.load(args.tokens), dtype=torch.long)
  for line in sys.stdin:
    dtype = line.strip()
    if dtype not in ("float32", "bfloat16"):
      raise ValueError(f"expected a dtype line, float32 or bfloat16, got {line!r}")
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
      out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "loss": out.loss.item()}), flush=True)


if __name__ == "__main__":
  main()
