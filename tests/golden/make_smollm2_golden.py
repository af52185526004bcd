"""Regenerates smollm2_golden.json from transformers' own GGUF loading (needs torch).

  .venv/bin/python tests/golden/make_smollm2_golden.py

The fixture holds, for a few chat prompts: the token ids of transformers' GGUF
tokenizer, the top-10 logits at several positions and a 16-token greedy
continuation, all from transformers' reference implementation. The test suite
checks the project's model against it without torch.
"""

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxrl_agents.models import zoo

PROMPTS = ["What is 12 + 7?", "Name three primary colors.",
           "Write a haiku about the sea.\nKeep it short."]
TOP_K = 10
NEW_TOKENS = 16


def main():
  path = zoo.smollm2_gguf_path()
  folder, name = os.path.split(path)
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  cases = []
  for prompt in PROMPTS:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0]
      greedy = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
    positions = [0, len(ids) // 3, 2 * len(ids) // 3, len(ids) - 1]
    top = [torch.topk(logits[p], TOP_K) for p in positions]
    cases.append({
        "prompt": prompt, "text": text, "ids": ids, "positions": positions,
        "top_ids": [t.indices.tolist() for t in top],
        "top_logits": [[round(v, 5) for v in t.values.tolist()] for t in top],
        "greedy": greedy.tolist(),
    })
  out = os.path.join(os.path.dirname(__file__), "smollm2_golden.json")
  with open(out, "w") as f:
    json.dump({"source": "transformers GGUF loader, float32", "cases": cases}, f, indent=1)
  print("wrote", out)


if __name__ == "__main__":
  main()
