"""The project's Flax Gemma against Google's `gemma` library (its outputs recorded in
tests/golden/gemma_tiny.npz by tests/golden/make_gemma_golden.py), and the tiny Gemma
through the sampler."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_agents.models import gemma, lm, zoo
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(REPO, "tests", "golden")


def _golden_module():
  spec = importlib.util.spec_from_file_location(
      "make_gemma_golden", os.path.join(GOLDEN_DIR, "make_gemma_golden.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MAKE = _golden_module()
GOLDEN = np.load(os.path.join(GOLDEN_DIR, "gemma_tiny.npz"))


CONFIGS = {"gemma3": gemma.TINY_GEMMA3, "gemma2": gemma.TINY_GEMMA2}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def golden_model(request):
  """(name, definition, params): a tiny configuration with the weights the library ran on."""
  cfg = gemma.definition(CONFIGS[request.param])
  shapes = jax.tree.map(lambda s: s.shape, jax.eval_shape(cfg.init, jax.random.key(0)))
  return request.param, cfg, jax.tree.map(jnp.asarray, MAKE.golden_params(shapes))


def test_tiny_configs_are_the_ones_the_library_ran():
  for name, ours in CONFIGS.items():
    theirs = MAKE.CONFIGS[name]
    for field in ("num_embed", "embed_dim", "hidden_dim", "num_heads", "head_dim",
                  "num_kv_heads", "sliding_window_size", "use_qk_norm",
                  "transpose_gating_einsum", "local_base_frequency", "global_base_frequency"):
      assert getattr(ours, field) == theirs[field], (name, field)
    kinds = {"LOCAL_SLIDING": gemma.LOCAL, "GLOBAL": gemma.GLOBAL}
    assert ours.attention_types == tuple(kinds[t] for t in theirs["attention_types"]), name
    for field in ("attn_logits_soft_cap", "final_logit_softcap"):
      assert getattr(ours, field) == theirs.get(field), (name, field)
    assert ours.global_scale_factor == theirs.get("global_scale_factor", 1.0), name
  # The library's BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS, with D / N != head_dim.
  g2 = gemma.TINY_GEMMA2
  assert g2.query_scale == (g2.embed_dim // g2.num_heads) ** -0.5 != g2.head_dim ** -0.5
  assert g2.num_heads == g2.num_kv_heads and not g2.transpose_gating_einsum


def test_parameter_tree_is_the_librarys(golden_model):
  """Same paths and shapes as `gemma.gm.nn.Transformer.init`'s params (recorded), so the
  library's checkpoints load and its modules run on these params."""
  name, cfg, params = golden_model
  ours = {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(params)}
  theirs = {str(path): tuple(int(d) for d in shape if d >= 0)
            for path, shape in zip(GOLDEN[f"{name}_param_paths"], GOLDEN[f"{name}_param_shapes"],
                                   strict=True)}
  assert ours == theirs


def test_logits_match_the_gemma_library(golden_model):
  name, cfg, params = golden_model
  tokens, valid, positions = MAKE.golden_inputs()
  # The window is shorter than the 12 tokens: the local layer's mask matters.
  assert tokens.shape[1] > CONFIGS[name].sliding_window_size
  logits, _ = jax.jit(lambda p, t, x, s: cfg.apply(p, t, x, segment_ids=s))(
      params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid, jnp.int32))
  want = GOLDEN[f"{name}_logits"]
  np.testing.assert_allclose(np.asarray(logits)[valid], want[valid], atol=1e-5, rtol=1e-5)
  assert np.abs(want[valid]).max() > 1e-2  # not a trivially small comparison


def test_greedy_decoding_matches_the_gemma_library(golden_model):
  """The project's sampler (prefill + cached decode steps) on the library's weights picks the
  library's greedy tokens, which its own cache produced."""
  name, cfg, params = golden_model
  tokens, _, _ = MAKE.golden_inputs()
  prompt = jnp.asarray(tokens[:1, :6])
  want = GOLDEN[f"{name}_greedy"]
  sampling = sampler_lib.SamplingConfig(max_new_tokens=len(want), temperature=0.0,
                                        stop_tokens=(), pad_id=0)
  out = sampler_lib.generate(params, cfg, prompt, jnp.ones_like(prompt, bool), jax.random.key(0),
                             sampling)
  np.testing.assert_array_equal(np.asarray(out.tokens[0]), want)
  assert len(set(want.tolist())) > 2  # a varied continuation, not one token repeated


def test_cache_continuation_equals_one_prefill(golden_model):
  _, cfg, params = golden_model
  tokens, valid, positions = (jnp.asarray(a) for a in MAKE.golden_inputs())
  segments = valid.astype(jnp.int32)
  full, _ = cfg.apply(params, tokens, positions, segment_ids=segments)
  _, cache = cfg.apply(params, tokens[:, :5], positions[:, :5], segment_ids=segments[:, :5],
                       new_cache_len=12)
  ext, cache = cfg.apply(params, tokens[:, 5:9], positions[:, 5:9],
                         segment_ids=segments[:, 5:9], cache=cache)
  np.testing.assert_allclose(np.asarray(ext), np.asarray(full[:, 5:9]), atol=1e-5)
  for i in range(9, 12):  # then one token at a time
    step, cache = cfg.decode_step(params, tokens[:, i], positions[:, i], cache)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full[:, i]), atol=1e-5)


def test_tokenizer_writes_gemmas_chat_template_and_stops_at_end_of_turn():
  tok = tokenizer_lib.gemma_byte_tokenizer()
  text = tokenizer_lib.chat_prompt(tok, "What is 2+2?", system="Be brief.")
  assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
                  "<start_of_turn>model\n")
  vocab = tok.get_vocab()
  assert set(tokenizer_lib.stop_token_ids(tok)) == {vocab["<end_of_turn>"], vocab["<eos>"]}
  # Data that spells a control token stays text.
  ids, _ = tokenizer_lib.encode_chat(tok, "hi<end_of_turn>")
  assert ids.count(vocab["<end_of_turn>"]) == 1  # only the template's own


def test_tiny_gemma_preset_samples_through_the_sampler():
  model = zoo.load("tiny-gemma")
  lm.check_definition(model.cfg)
  out = sampler_lib.Sampler(model)(["What is 2+2?", "hello"], rng=jax.random.key(0),
                                   max_new_tokens=6, temperature=1.0)
  texts, sample = out
  assert len(texts) == 2 and sample.tokens.shape == (2, 6)


def _perturbed(model):
  """The tiny Gemma with every weight moved off its init (norm scales off zero too)."""
  noise = lambda i, x: x + 0.05 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)
  leaves, tree = jax.tree.flatten(model.params)
  model.params = jax.tree.unflatten(tree, [noise(i, x) for i, x in enumerate(leaves)])
  return model


def test_hugging_face_directory_round_trip(tmp_path):
  model = _perturbed(zoo.load("tiny-gemma"))
  zoo.save_hf_dir(model, str(tmp_path))
  with open(os.path.join(tmp_path, "config.json")) as f:
    hf = json.load(f)
  assert hf["model_type"] == "gemma3_text"
  assert hf["layer_types"] == ["sliding_attention", "full_attention"]
  back = zoo.load(str(tmp_path))
  assert back.cfg == model.cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back.params, model.params)
  assert back.tokenizer.get_vocab() == model.tokenizer.get_vocab()
  zoo.check_params(back.params, back.cfg)
  with pytest.raises(ValueError, match="shape"):
    zoo.check_params(jax.tree.map(lambda x: x[..., :1], back.params), back.cfg, "bad")


@pytest.mark.parity
def test_exported_gemma_matches_transformers_gemma3(tmp_path):
  """transformers' Gemma3ForCausalLM on the exported directory: the same logits over 20
  tokens, more than the sliding window (8), so both layer kinds are compared."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = _perturbed(zoo.load("tiny-gemma"))
  zoo.save_hf_dir(model, str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                         attn_implementation="eager")
  assert type(hf).__name__ == "Gemma3ForCausalLM"
  tokens = np.random.default_rng(0).integers(5, 300, (2, 20))
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  ours, _ = model.cfg.apply(model.params, jnp.asarray(tokens, jnp.int32),
                            jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20)))
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-5, rtol=1e-5)
  assert np.abs(theirs).max() > 0.5


def test_tiny_grpo_on_gemma_writes_artifacts_resumes_bitwise_and_exports(tmp_path, crashed_copy):
  """The GRPO smoke run with the Flax Gemma as the policy: every workdir artifact, a run that
  crashed after step 2's checkpoint and resumed logs what the whole run logs and ends on the
  same params, and the trained policy exports to a Hugging Face directory that loads back
  equal."""
  from experiments import grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.train import checkpointing
  from jaxrl_agents.train import metrics as metrics_lib

  config = grpo_arithmetic.get_config("tiny")
  config.model, config.steps, config.checkpoint_every = "tiny-gemma", 4, 1
  config.optimizer.learning_rate = 1e-2  # the params visibly move
  whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
  grpo.train(config, whole, progress=False)
  for name in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard"):
    assert os.path.exists(os.path.join(whole, name)), name
  untimed = lambda w: [{k: v for k, v in r.items() if not k.endswith(("_s", "_per_s"))}
                       for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))]
  train = [r for r in untimed(whole) if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert all(np.isfinite(r["reward_mean"]) and np.isfinite(r["grad_norm"]) for r in train)
  assert any(r["grad_norm"] > 0 for r in train)

  part = crashed_copy(whole, part, 2)
  grpo.train(config, part, progress=False)
  assert untimed(part) == untimed(whole)
  a, _, _ = checkpointing.latest_policy_params(whole)
  b, _, _ = checkpointing.latest_policy_params(part)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)

  out = str(tmp_path / "hf")
  code = subprocess.run([sys.executable, "-m", "jaxrl_agents.tools.export", "--workdir", whole,
                         "--out", out], cwd=REPO, capture_output=True, text=True)
  assert code.returncode == 0, code.stderr[-3000:]
  exported = zoo.load(out)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y)),
               exported.params, a)
  initial = zoo.load("tiny-gemma").params
  moved = jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), a, initial))
  assert max(moved) > 0


def test_gemma_shards_by_the_rules_and_a_sharded_update_equals_one_device():
  """On a (2, 2, 2) mesh of fake devices the Gemma's weights split over fsdp and tensor,
  and the loss, its gradient and the sampled tokens equal one device's."""
  from jaxrl_agents.parallel import sharding

  model = _perturbed(zoo.load("tiny-gemma"))
  cfg = model.cfg
  mesh = sharding.mesh_from_config({"data": 2, "fsdp": 2, "tensor": 2})
  placed = sharding.shard(model.params, mesh)
  specs = {sharding.path_name(path): x.sharding.spec
           for path, x in jax.tree_util.tree_leaves_with_path(placed)}
  assert specs["layer_0/attn/q_einsum/w"] == P("tensor", "fsdp")
  assert specs["layer_1/mlp/gating_einsum"] == P(None, "tensor", "fsdp")
  assert specs["embedder/input_embedding"] == P("tensor", "fsdp")
  tokens, valid, positions = (jnp.asarray(a) for a in MAKE.golden_inputs())
  tokens, valid, positions = (jnp.tile(a, (4, 1)) for a in (tokens, valid, positions))

  def loss(p, t, v, x):
    logits, _ = cfg.apply(p, t, x, segment_ids=v.astype(jnp.int32))
    return jnp.mean(jnp.where(v, jax.nn.logsumexp(logits, -1) - logits[..., 3], 0.0))

  step = jax.jit(jax.value_and_grad(loss))
  want, want_grad = step(model.params, tokens, valid, positions)
  rows = lambda a: sharding.shard_batch(a, mesh)
  got, grad = step(placed, rows(tokens), rows(valid), rows(positions))
  assert float(got) == pytest.approx(float(want), rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
               grad, want_grad)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=6, temperature=1.0, pad_id=0)
  run = lambda p, t, v: sampler_lib.generate(p, cfg, t, v, jax.random.key(0), sampling)
  np.testing.assert_array_equal(np.asarray(run(placed, rows(tokens), rows(valid)).tokens),
                                np.asarray(run(model.params, tokens, valid).tokens))


@pytest.mark.parametrize("experiment,config_name", [
    ("ppo", "ppo_frozen_lake"),  # a value head on the Gemma, a jitted multi-turn environment
    ("grpo", "grpo_calculator"),  # the host loop (a tool outside jit)
    ("grpo", "grpo_tic_tac_toe_self_play"),
    ("reward_model", "reward_model_arithmetic"),  # frozen_layers=1 on the Gemma's layer_0
    ("dpo", "dpo_arithmetic"),
])
def test_the_experiments_run_on_the_flax_gemma(tmp_path, experiment, config_name):
  import importlib

  module = importlib.import_module(f"experiments.{experiment}")
  config = importlib.import_module(f"experiments.configs.{config_name}").get_config("tiny")
  # Two train steps; no evaluation (the Gemma's evaluation runs in the GRPO resume test above).
  config.model, config.steps, config.eval_every = "tiny-gemma", 2, 0
  module.train(config, str(tmp_path), progress=False)
  from jaxrl_agents.train import metrics as metrics_lib

  train = [r for r in metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
           if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2]
  assert all(np.isfinite(v) for r in train for v in r.values() if isinstance(v, float))


def test_frozen_layers_stop_the_gemmas_gradient():
  from jaxrl_agents.models import reward_model

  model = _perturbed(zoo.load("tiny-gemma"))
  params = reward_model.init(model.params, jax.random.key(0), model.cfg, head_scale=0.1)
  tokens, valid, _ = (jnp.asarray(a) for a in MAKE.golden_inputs())

  def total(p):
    return jnp.sum(reward_model.hidden_states(p, tokens, valid, cfg=model.cfg, frozen_layers=1))

  grads = jax.jit(jax.grad(total))(params)["backbone"]
  size = lambda tree: sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(tree))
  assert size(grads["embedder"]) == 0 and size(grads["layer_0"]) == 0
  assert size(grads["layer_1"]) > 0 and size(grads["final_norm"]) > 0


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_a_gemma_library_checkpoint_loads_by_variant_and_path(tmp_path, layout):
  """`zoo.load("tiny-gemma3:<dir>")` reads what the library writes: `gm.ckpts.save_params`
  (a StandardCheckpointer save of the init params) or the flat legacy layout of the published
  checkpoints ("transformer/<scope>" keys, MLP weights under "w"); the tokenizer beside it."""
  import orbax.checkpoint as ocp

  model = _perturbed(zoo.load("tiny-gemma"))
  tree = jax.tree.map(np.asarray, model.params)
  if layout == "flat":
    flat = {}
    for name, scope in tree.items():
      if not name.startswith("layer_"):
        flat[f"transformer/{name}"] = scope
        continue
      for part, value in scope.items():
        if part == "mlp":  # "transformer/layer_0/mlp/linear": {"w": ...}
          flat.update({f"transformer/{name}/mlp/{k}": {"w": v} for k, v in value.items()})
        elif part == "attn":  # "transformer/layer_0/attn/q_einsum": {"w": ...}
          flat.update({f"transformer/{name}/attn/{k}": v for k, v in value.items()})
        else:  # "transformer/layer_0/pre_attention_norm": {"scale": ...}
          flat[f"transformer/{name}/{part}"] = value
    tree = flat
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(str(tmp_path / "ckpt"), tree)
  checkpointer.wait_until_finished()
  tokenizer_lib.gemma_byte_tokenizer().save_pretrained(str(tmp_path))
  loaded = zoo.load(f"tiny-gemma3:{tmp_path / 'ckpt'}")
  assert loaded.cfg == model.cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded.params, model.params)
  assert loaded.tokenizer.eos_token == "<end_of_turn>"
  with pytest.raises(ValueError, match="gemma variant"):
    zoo.load(f"no-such-variant:{tmp_path / 'ckpt'}")
  with pytest.raises(FileNotFoundError, match="no Gemma checkpoint"):
    zoo.load(f"tiny-gemma3:{tmp_path / 'missing'}")
