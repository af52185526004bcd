"""tunix's Sampler on SmolLM2 weights, run inside benchmarks/.venv-tunix.

Called by benchmarks/sampler.py (not a project dependency):

  benchmarks/.venv-tunix/bin/python benchmarks/tunix_sampler.py --hf-dir DIR \
      --prompts prompts.json --batch-sizes 1,8,32 --dtypes float32,bfloat16

Prints one JSON object on its last line. With `--serve` it times one call per
request instead, so benchmarks/sampler.py can interleave it with the other
systems: each stdin line "DTYPE BATCH" gets one stdout line
{"seconds": ..., "first": bool} (the first call of a shape includes its
compilation); "texts" answers with the greedy texts, unpatched and patched.

tunix 0.1.7's llama3 attention calls
`apply_rope` without the config's rope_theta (it always uses 1e6), while
SmolLM2 uses 1e5; `--patch-rope` rebinds the module's apply_rope with the
right theta (the one-line fix) so the text can be compared both ways.
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp


def model_config(hf_dir):
  """tunix's llama3 ModelConfig with the shapes of the Hugging Face config in `hf_dir`."""
  from tunix.models.llama3 import model as model_lib

  with open(f"{hf_dir}/config.json") as f:
    hf = json.load(f)
  return model_lib.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], weight_tying=hf["tie_word_embeddings"])


def build(hf_dir, dtype, patch_rope):
  from transformers import AutoTokenizer
  from tunix.generate import sampler as sampler_lib
  from tunix.models.llama3 import model as model_lib
  from tunix.models.llama3 import params as params_lib

  cfg = model_config(hf_dir)
  if patch_rope:
    if not hasattr(model_lib, "_original_apply_rope"):
      model_lib._original_apply_rope = model_lib.apply_rope
    model_lib.apply_rope = functools.partial(model_lib._original_apply_rope,
                                             rope_theta=cfg.rope_theta)
  elif hasattr(model_lib, "_original_apply_rope"):
    model_lib.apply_rope = model_lib._original_apply_rope
  model = params_lib.create_model_from_safe_tensors(hf_dir, cfg, dtype=dtype)
  tok = AutoTokenizer.from_pretrained(hf_dir)
  cache = sampler_lib.CacheConfig(cache_size=256, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  return sampler_lib.Sampler(transformer=model, tokenizer=tok, cache_config=cache)


def greedy_texts(hf_dir, prompts, new_tokens):
  texts = {}
  for patched in (False, True):
    sampler = build(hf_dir, jnp.float32, patch_rope=patched)
    out = sampler(prompts, max_generation_steps=new_tokens, max_prompt_length=64,
                  temperature=0.0)
    texts["patched" if patched else "unpatched"] = list(out.text)
  return texts


def serve(args, prompts):
  """Answers timing requests from stdin, one JSON line each, until EOF."""
  import sys
  samplers, seen = {}, set()
  for line in sys.stdin:
    request = line.split()
    if request == ["texts"]:
      print(json.dumps(greedy_texts(args.hf_dir, prompts[:args.text_prompts], args.new_tokens)),
            flush=True)
      continue
    dtype_name, bs = request[0], int(request[1])
    if dtype_name not in samplers:
      samplers.clear()  # one model in memory at a time
      dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
      samplers[dtype_name] = build(args.hf_dir, dtype, patch_rope=False)
    start = time.perf_counter()
    samplers[dtype_name](prompts[:bs], max_generation_steps=args.new_tokens,
                         max_prompt_length=64, eos_tokens=[-1], temperature=0.0)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "first": (dtype_name, bs) not in seen}), flush=True)
    seen.add((dtype_name, bs))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", required=True)
  p.add_argument("--prompts", required=True, help="JSON list of chat-rendered prompt strings")
  p.add_argument("--batch-sizes", default="1,8,32")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--text-prompts", type=int, default=8,
                 help="greedy texts returned (stopping at EOS) for the agreement check")
  p.add_argument("--serve", action="store_true", help="time one call per stdin request")
  args = p.parse_args()
  with open(args.prompts) as f:
    prompts = json.load(f)
  if args.serve:
    serve(args, prompts)
    return
  result = {"tok_s": {}, "compile_s": {}, "texts": {}}
  for dtype_name in args.dtypes.split(","):
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    sampler = build(args.hf_dir, dtype, patch_rope=False)
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
      batch = prompts[:bs]
      run = lambda batch=batch, sampler=sampler: sampler(
          batch, max_generation_steps=args.new_tokens, max_prompt_length=64,
          eos_tokens=[-1], temperature=0.0)  # eos -1: never stop, always 64 tokens
      start = time.perf_counter()
      run()
      first = time.perf_counter() - start
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        out = run()
        jax.block_until_ready(out.tokens) if hasattr(out, "tokens") else None
        times.append(time.perf_counter() - start)
      best = min(times)
      result["tok_s"][f"{dtype_name}_bs{bs}"] = bs * args.new_tokens / best
      result["compile_s"][f"{dtype_name}_bs{bs}"] = max(first - best, 0.0)
      print(f"tunix {dtype_name} bs={bs}: {bs * args.new_tokens / best:.1f} tok/s "
            f"(best {best:.2f}s, first call {first:.1f}s)", flush=True)
  result["texts"] = greedy_texts(args.hf_dir, prompts[:args.text_prompts], args.new_tokens)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
