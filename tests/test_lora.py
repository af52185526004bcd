"""LoRA adapters (models/lora.py): the base model exactly at zero, merged weights against the
unmerged product per weight layout, gradients and optimizer state only for the adapters, the
reference without a copy, adapter-only checkpoints, export, and PEFT's forward (parity)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo
from experiments.configs import grpo_arithmetic
from jaxrl_agents import registry
from jaxrl_agents.models import gemma, lm, lora, transformer, weights, zoo
from jaxrl_agents.rollout import continuous, sampler, sampling
from jaxrl_agents.train import checkpointing
from jaxrl_agents.train import optim as optim_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def _tokens(b=2, t=9, vocab=320, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)
  return tokens, jnp.broadcast_to(jnp.arange(t), (b, t))


def _nonzero(adapters, seed=1, scale=0.05):
  """Adapters with B drawn too (a new adapter's B is zero, which hides mistakes)."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape) for k, x in
                                   zip(keys, leaves, strict=True)])


BASES = {
    "transformer": lambda: (zoo.TINY, zoo.TINY.init(jax.random.key(0))),
    "stacked": lambda: (zoo.TINY, transformer.stack_layers(zoo.TINY.init(jax.random.key(0)))),
    "gemma3": lambda: _gemma(gemma.TINY_GEMMA3),
    "gemma2": lambda: _gemma(gemma.TINY_GEMMA2),
}


def _gemma(c):
  cfg = gemma.definition(c)
  return cfg, cfg.init(jax.random.key(0))


@pytest.mark.parametrize("base", sorted(BASES))
def test_new_adapters_give_exactly_the_base_models_logits(base):
  cfg, params = BASES[base]()
  model = lora.LoraLM(cfg, SPEC)
  adapters = lora.init(jax.random.key(1), params, SPEC)
  tokens, positions = _tokens(vocab=cfg.vocab_size)
  ours = model.apply({"base": params, "lora": adapters}, tokens, positions)[0]
  theirs = cfg.apply(params, tokens, positions)[0]
  assert np.array_equal(np.asarray(ours), np.asarray(theirs))
  # and with adapters trained, the model moves
  moved = model.apply({"base": params, "lora": _nonzero(adapters)}, tokens, positions)[0]
  assert float(jnp.abs(moved - theirs).max()) > 1e-3


# Each layout's weight as the model uses it, and the unmerged product through its adapters:
# x W + s (x A^T) B^T written out per layout, apart from lora.delta's transposes.
LAYOUTS = {
    # name: (weight shape, axes, forward einsum of x with the weight)
    "dense [out, in]": ((6, 5), "oi", "ti,oi->to"),
    "stacked [L, out, in]": ((3, 6, 5), "boi", "ti,loi->lto"),
    "q_einsum [N, D, H]": ((2, 5, 3), "oio", "td,ndh->tnh"),
    "kv_einsum [2, K, D, H]": ((2, 2, 5, 3), "boio", "td,ckdh->ctkh"),
    "attn_vec [N, H, D]": ((2, 3, 5), "iio", "tnh,nhd->td"),
    "kernel [in, out]": ((5, 6), "io", "ti,io->to"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_merged_weights_equal_the_adapters_applied(layout):
  shape, axes, forward = LAYOUTS[layout]
  w = jax.random.normal(jax.random.key(0), shape)
  batch = tuple(n for n, a in zip(shape, axes, strict=True) if a == "b")
  out = int(np.prod([n for n, a in zip(shape, axes, strict=True) if a == "o"]))
  inn = int(np.prod([n for n, a in zip(shape, axes, strict=True) if a == "i"]))
  a = jax.random.normal(jax.random.key(1), (*batch, 4, inn))
  b = jax.random.normal(jax.random.key(2), (*batch, out, 4))
  in_shape = tuple(n for n, ax in zip(shape, axes, strict=True) if ax == "i")
  x = jax.random.normal(jax.random.key(3), (7, *in_shape))
  merged = w + lora.delta(a, b, shape, axes, 0.5)
  ours = jnp.einsum(forward, x, merged)
  # applied: x (flattened over its in-axes) through A then B, per batch entry
  low = jnp.einsum("ti,...ri->...tr", x.reshape(7, inn), a)
  up = jnp.einsum("...tr,...or->...to", low, b)
  out_shape = tuple(n for n, ax in zip(shape, axes, strict=True) if ax == "o")
  applied = jnp.einsum(forward, x, w) + 0.5 * up.reshape(*batch, 7, *out_shape)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(applied), rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_adapters_only():
  cfg, params = BASES["transformer"]()
  model = lora.LoraLM(cfg, SPEC)
  full = {"base": params, "lora": _nonzero(lora.init(jax.random.key(1), params, SPEC))}
  tokens, positions = _tokens()

  def loss(p):
    return jnp.mean(model.apply(p, tokens, positions)[0] ** 2)

  grads = jax.grad(loss)(full)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["base"]))
  assert all(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["lora"]))


@pytest.mark.parametrize("base", ["transformer", "stacked"])
def test_merging_in_each_layer_equals_merging_up_front(base):
  """The transformer merges each layer's adapters as the layer runs (`lora.Adapted`): the
  same logits and adapter gradients as merging every weight before the pass."""
  cfg, params = BASES[base]()
  model = lora.LoraLM(cfg, SPEC)
  full = {"base": params, "lora": _nonzero(lora.init(jax.random.key(1), params, SPEC))}
  tokens, positions = _tokens()

  def loss(adapters, per_layer):
    p = model.merged({"base": params, "lora": adapters}, per_layer)
    return jnp.mean(cfg.apply(p, tokens, positions)[0] ** 2)

  assert isinstance(model.merged(full, True)["layers"][0]["wq"] if base == "transformer"
                    else model.merged(full, True)["layers"]["wq"], lora.Adapted)
  for per_layer, eager in zip(jax.value_and_grad(loss)(full["lora"], True),
                              jax.value_and_grad(loss)(full["lora"], False), strict=True):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                 per_layer, eager)


def test_merging_in_each_layer_keeps_the_merged_stack_out_of_memory():
  """Stacked layers under one scan: merged up front, the whole merged stack and its
  gradient are temporaries of the update; merged per layer, one layer's at a time."""
  cfg = zoo.TINY.replace(d_model=256, ffn_dim=1024, n_heads=4, n_kv_heads=4, head_dim=64,
                         n_layers=8, remat="full")
  params = jax.eval_shape(lambda: transformer.stack_layers(cfg.init(jax.random.key(0))))
  spec = lora.LoraSpec(rank=4)
  adapters = jax.eval_shape(lambda: lora.init(jax.random.key(1), params, spec))
  model = lora.LoraLM(cfg, spec)
  tokens, positions = _tokens(b=2, t=16)

  def temporaries(per_layer):
    def loss(a, base):
      p = model.merged({"base": base, "lora": a}, per_layer)
      return jnp.mean(cfg.apply(p, tokens, positions)[0])
    compiled = jax.jit(jax.grad(loss)).lower(adapters, params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  layer_weights = sum(x.size * 4 for k, x in params["layers"].items() if k.startswith("w"))
  eager, per_layer = temporaries(False), temporaries(True)
  assert eager >= layer_weights  # the merged stack at least
  assert per_layer < eager - layer_weights // 2, (per_layer, eager, layer_weights)


def test_optimizer_keeps_moments_for_the_adapters_and_leaves_the_base():
  cfg, params = BASES["stacked"]()
  full = {"base": params, "lora": _nonzero(lora.init(jax.random.key(1), params, SPEC))}
  tx = optim_lib.make_optimizer(learning_rate=1e-2, total_updates=10).tx
  state = tx.init(full)
  n_state = sum(x.size for x in jax.tree.leaves(state) if x.ndim)
  n_adapters = sum(x.size for x in jax.tree.leaves(full["lora"]))
  assert n_state == 2 * n_adapters  # Adam's two moments, nothing of the base
  grads = jax.tree.map(jnp.ones_like, full)  # even a nonzero base gradient moves nothing
  updates, _ = tx.update(grads, state, full)
  new = optim_lib.optax.apply_updates(full, updates)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(new["base"]),
                                                    jax.tree.leaves(params), strict=True))
  assert not np.array_equal(new["lora"]["layers"]["wq"]["a"], full["lora"]["layers"]["wq"]["a"])


@pytest.mark.parametrize("targets, bound", [("attention", 0.02), ("all", 0.04)])
def test_optimizer_state_of_rank_16_on_smollm2_is_a_few_percent_of_full(targets, bound):
  """Measured from the arrays' shapes (jax.eval_shape: no weights): Adam's moments. By hand:
  rank 16 adds 16 (in + out) a weight; SmolLM2's layer (d 576, kv 192, ffn 1536) holds
  61,440 of them on the attention projections, 162,816 on every linear, x 30 layers, of
  134.5M: 1.37% and 3.63%."""
  cfg = transformer.TransformerConfig(  # SmolLM2-135M's shapes (its config.json)
      vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
      ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True, max_seq_len=8192)
  params = jax.eval_shape(cfg.init, jax.random.key(0))
  spec = lora.LoraSpec(rank=16, alpha=32.0, targets=(targets,))
  adapters = jax.eval_shape(lambda: lora.init(jax.random.key(1), params, spec))
  tx = optim_lib.make_optimizer(learning_rate=1e-4, total_updates=10).tx
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  full = nbytes(jax.eval_shape(tx.init, params))
  with_lora = nbytes(jax.eval_shape(tx.init, {"base": params, "lora": adapters}))
  assert with_lora / full <= bound, with_lora / full


def test_reference_is_the_base_with_the_adapters_off_and_no_copy():
  cfg, params = BASES["transformer"]()
  model = lora.LoraLM(cfg, SPEC)
  full = {"base": params, "lora": _nonzero(lora.init(jax.random.key(1), params, SPEC))}
  assert lora.reference_copy(full) is None  # a train state keeps no second copy
  ref = lora.reference(None, full)
  assert ref["base"] is full["base"]
  tokens, positions = _tokens()
  traj_logits = model.apply(ref, tokens, positions)[0]
  base_logits = cfg.apply(params, tokens, positions)[0]
  assert np.array_equal(np.asarray(traj_logits), np.asarray(base_logits))
  plain = {"w": jnp.ones(3)}
  assert lora.reference(lora.reference_copy(plain), plain)["w"] is not plain["w"]


def test_decoding_merges_once_and_samples_as_the_merged_model():
  """The sampler (static and continuous batching) with LoRA params equals the base
  definition on merged params, greedy."""
  cfg, params = BASES["transformer"]()
  model = lora.LoraLM(cfg, SPEC)
  full = {"base": params, "lora": _nonzero(lora.init(jax.random.key(1), params, SPEC), 3, 0.3)}
  merged = lora.merge(params, full["lora"], SPEC)
  assert lm.loop_params(model, full)["lora"] is None
  prompts = jax.random.randint(jax.random.key(5), (3, 6), 3, 320)
  mask = jnp.ones((3, 6), bool)
  sc = sampling.SamplingConfig(max_new_tokens=5, temperature=0.0, stop_tokens=())
  keys = jax.random.split(jax.random.key(0), 3)
  ours = sampler.generate(full, model, prompts, mask, keys[0], sc)
  theirs = sampler.generate(merged, cfg, prompts, mask, keys[0], sc)
  assert np.array_equal(np.asarray(ours.tokens), np.asarray(theirs.tokens))
  cont = continuous.generate(full, model, prompts, mask, keys, sc, slots=2)
  assert np.array_equal(np.asarray(cont.tokens), np.asarray(theirs.tokens))
  base_tokens = sampler.generate(params, cfg, prompts, mask, keys[0], sc).tokens
  assert not np.array_equal(np.asarray(base_tokens), np.asarray(ours.tokens))


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "positive integer"),
    (dict(rank=4, dropout=0.1), "dropout"),
    (dict(rank=4, targets="all"), "tuple"),
    (dict(rank=4, targets=("atention",)), "did you mean .attention."),
    (dict(rank=4, targets=("wq(",)), "neither a group"),
    (dict(rank=4, targets=("wq@xy",)), "one letter per"),
])
def test_bad_settings_name_the_problem(kwargs, message):
  with pytest.raises(ValueError, match=message):
    lora.LoraSpec(**kwargs)


def test_targets_that_match_nothing_or_read_oddly_are_refused():
  params = zoo.TINY.init(jax.random.key(0))
  with pytest.raises(ValueError, match="match no weight.*layers"):
    lora.targeted(params, lora.LoraSpec(rank=2, targets=("nothing_here",)))
  with pytest.raises(ValueError, match="no known axes.*attn_norm"):
    lora.targeted(params, lora.LoraSpec(rank=2, targets=("attn_norm",)))
  # a pattern with its axes: the norms cannot be read as a matrix
  with pytest.raises(ValueError, match="do not fit"):
    lora.targeted(params, lora.LoraSpec(rank=2, targets=("attn_norm@oi",)))
  assert set(lora.targeted(params, lora.LoraSpec(rank=2, targets=("attention",)))) == {
      f"layers/{i}/{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}


def _first_char_parity(completions, examples):
  return np.array([float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]), {}


def _lora_config(steps=3, **lora_kwargs):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = steps, 0, 1
  config.optimizer.learning_rate = 1e-2
  config.rewards = {"test_first_char_parity": 1.0}  # rewards that vary, so adapters move
  config.lora.update(dict(rank=4, alpha=8.0, **lora_kwargs))
  return config


def test_a_lora_run_saves_adapters_resumes_bitwise_and_exports(tmp_path, crashed_copy):
  workdir = str(tmp_path / "run")
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    grpo.train(_lora_config(), workdir, progress=False)
    assert {"metrics.jsonl", "samples.jsonl", "config.json", "tensorboard"} <= set(
        os.listdir(workdir))
    assert checkpointing.Checkpointer(workdir).steps()[-1] == 3
    # adapters only: no base weight in the checkpoint, the base's digest beside them
    state = checkpointing.plain_state(workdir, 3)
    assert state["params"]["base"] is None and state["params"]["lora"]
    restored_meta = checkpointing.Checkpointer(workdir).latest_meta()[1]
    assert len(restored_meta["base_digests"]) == 1
    resumed = crashed_copy(workdir, tmp_path / "resumed", step=1)
    grpo.train(_lora_config(), resumed, progress=False)
  read = lambda d: [{k: v for k, v in json.loads(line).items() if not k.endswith(("_s", "_per_s"))}
                    for line in open(os.path.join(d, "metrics.jsonl"))]
  assert read(workdir) == read(resumed)
  a = checkpointing.plain_state(workdir, 3)["params"]["lora"]
  b = checkpointing.plain_state(resumed, 3)["params"]["lora"]
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                    strict=True))

  out, adapters_dir = str(tmp_path / "hf"), str(tmp_path / "peft")
  code = subprocess.run([sys.executable, "-m", "jaxrl_agents.tools.export", "--workdir",
                         workdir, "--out", out, "--adapters", adapters_dir], cwd=REPO,
                        capture_output=True, text=True)
  assert code.returncode == 0, code.stderr[-3000:]
  exported = zoo.load(out).params
  base = zoo.load("tiny").params
  expected = lora.merge(base, checkpointing._as_lists(a), lora.LoraSpec(rank=4, alpha=8.0))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6),
               exported, expected)
  assert max(float(jnp.abs(x - y).max()) for x, y in
             zip(jax.tree.leaves(exported), jax.tree.leaves(base), strict=True)) > 0
  assert sorted(os.listdir(adapters_dir)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_lora_checkpoint_refuses_another_base_model(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    grpo.train(_lora_config(steps=1), workdir, progress=False)
    # the same name, other weights (a directory changed on disk): refused, checkpoints kept
    real_load = zoo.load

    def other_weights(name, *args, **kwargs):
      model = real_load(name, *args, **kwargs)
      model.params = jax.tree.map(lambda x: x * 1.01, model.params)
      return model

    monkeypatch.setattr(zoo, "load", other_weights)
    with pytest.raises(checkpointing.BaseModelMismatch, match="differ"):
      grpo.train(_lora_config(steps=2), workdir, progress=False)
    assert checkpointing.Checkpointer(workdir).steps() == [1]
    with pytest.raises(checkpointing.BaseModelMismatch, match="tiny"):
      checkpointing.latest_policy_params(workdir)
    monkeypatch.undo()
    # another model by name: the resume check names it
    config = _lora_config(steps=2)
    config.model = "tiny-qwen2"
    with pytest.raises(ValueError, match="model"):
      grpo.train(config, workdir, progress=False)


def test_grpo_with_a_kl_term_reads_the_base_as_its_reference(tmp_path):
  """The state keeps no reference copy; the KL to the base is exactly 0 at the first update
  (the adapters start at zero) and positive once they moved."""
  config = _lora_config(steps=2)
  config.kl_coef = 0.1
  model = lora.wrap(zoo.load("tiny"), lora.spec_from_config(config.lora), jax.random.key(0))
  assert grpo.GRPO(config, model.cfg).init_state(model.params, None).ref_params is None
  workdir = str(tmp_path / "run")
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    grpo.train(config, workdir, progress=False)
  kl = [json.loads(line)["kl"] for line in open(os.path.join(workdir, "metrics.jsonl"))
        if json.loads(line)["kind"] == "train"]
  assert kl[0] == 0.0 and kl[1] > 0.0, kl


@pytest.mark.parametrize("experiment, config_file, model", [
    ("ppo", "ppo_arithmetic", "tiny"), ("sft", "sft_arithmetic", "tiny"),
    ("dpo", "dpo_arithmetic", "tiny"), ("grpo", "grpo_arithmetic", "tiny-gemma"),
    ("grpo", "grpo_frozen_lake", "tiny"), ("grpo", "grpo_tic_tac_toe_self_play", "tiny"),
    ("rejection_sampling", "rejection_sampling_arithmetic", "tiny")])
def test_the_other_trainers_train_adapters_unchanged(tmp_path, experiment, config_file, model):
  """PPO (its policy and the critic built from it), SFT, DPO, GRPO on a Gemma (Flax), the
  multi-turn and self-play loops and rejection sampling with LoRA params: their
  checkpoints hold adapters only, and the adapters moved."""
  import importlib
  module = importlib.import_module(f"experiments.{experiment}")
  config = importlib.import_module(f"experiments.configs.{config_file}").get_config("tiny")
  config.steps, config.model = config.get("steps_per_round", 1), model  # one round
  config.lora.update(dict(rank=4, alpha=8.0))
  if "env" in config:
    # the tiny random model's episodes all score 0 (no advantage): an entropy bonus
    # gives the adapters a gradient of their own
    config.entropy_coef = 0.01
  workdir = str(tmp_path / experiment)
  module.train(config, workdir, progress=False)
  step = checkpointing.Checkpointer(workdir).steps()[-1]
  params = checkpointing.plain_state(workdir, step)["params"]
  nodes = [params] if lora.is_lora_params(params) else [
      v for v in params.values() if lora.is_lora_params(v)]
  assert nodes and all(n["base"] is None for n in nodes)
  b_of = lambda tree: jax.tree.leaves(jax.tree.map(
      lambda ab: ab["b"], tree, is_leaf=lambda x: isinstance(x, dict) and set(x) == {"a", "b"}))
  assert any(np.any(np.asarray(b)) for n in nodes for b in b_of(n["lora"]))


def test_a_reward_model_trains_adapters_and_serves_as_a_reward_merged(tmp_path):
  from experiments import reward_model as rm_experiment
  from experiments.configs import reward_model_arithmetic
  from jaxrl_agents.rewards import learned

  config = reward_model_arithmetic.get_config("tiny")
  config.lora.update(dict(rank=4, alpha=8.0))
  with pytest.raises(ValueError, match="frozen_layers=1 .*set frozen_layers=0"):
    rm_experiment.train(config, str(tmp_path / "refused"), progress=False)
  config.reward_model.frozen_layers = 0
  workdir = str(tmp_path / "rm")
  rm_experiment.train(config, workdir, progress=False)
  step = checkpointing.Checkpointer(workdir).steps()[-1]
  saved = checkpointing.plain_state(workdir, step)["params"]["backbone"]
  assert saved["base"] is None
  reward = learned.LearnedReward(workdir)
  by_hand = lora.merge(zoo.load("tiny").params, checkpointing._as_lists(saved["lora"]),
                       lora.LoraSpec(rank=4, alpha=8.0))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6),
               reward.params["backbone"], by_hand)
  example = {"question": "What is 5 + 7?", "answer": "12", "prompt": "What is 5 + 7?"}
  scores = reward(["12", "seven"], [example, example])
  assert np.all(np.isfinite(np.asarray(scores[0] if isinstance(scores, tuple) else scores)))


def test_adapters_split_over_a_mesh_like_the_weights_they_adapt():
  from jax.sharding import PartitionSpec as P

  from jaxrl_agents.parallel import sharding
  sizes = {"data": 1, "fsdp": 4, "tensor": 2}
  cases = {("lora/layers/3/wq/a", (16, 576)): P(None, "fsdp"),
           ("lora/layers/3/wq/b", (576, 16)): P("tensor"),
           ("lora/layers/wo/a", (30, 16, 576)): P(None, None, "tensor"),  # stacked
           ("lora/layers/w_down/b", (30, 576, 16)): P(None, "fsdp"),
           ("opt_state/0/mu/lora/layers/3/w_up/a", (16, 576)): P(None, "fsdp")}
  for (name, shape), spec in cases.items():
    assert sharding.spec_for(name, shape, sizes) == spec, name


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_a_lora_run_on_a_mesh_logs_what_one_device_logs(tmp_path):
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    config = _lora_config(steps=2)
    config.optimizer.eps = 1e-4  # Adam's first steps amplify float noise (test_sharding)
    grpo.train(config, str(tmp_path / "one"), progress=False)
    config.mesh.update(dict(data=2, fsdp=2, tensor=2))
    grpo.train(config, str(tmp_path / "mesh"), progress=False)
  records = lambda d: [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))
                       if json.loads(line)["kind"] == "train"]
  for a, b in zip(records(tmp_path / "one"), records(tmp_path / "mesh"), strict=True):
    for k in ("reward_mean", "loss", "grad_norm", "entropy"):
      assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["step"], k)


@pytest.mark.parity
def test_a_lora_model_matches_peft_applying_the_same_adapters(tmp_path):
  """Our merged forward against PEFT's unmerged one (x W^T + s x A^T B^T in torch), on the
  adapters as `export --adapters` writes them."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  model = zoo.load("tiny-qwen2")
  spec = lora.LoraSpec(rank=4, alpha=8.0)
  adapters = _nonzero(lora.init(jax.random.key(1), model.params, spec), 2, 0.1)
  weights.save_hf_dir(model.params, model.cfg, str(tmp_path / "base"))
  weights.save_peft_adapters(adapters, model.cfg, str(tmp_path / "adapters"), rank=4,
                             alpha=8.0, base_model="tiny-qwen2")
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                         dtype=torch.float32)
  hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapters"))
  tokens, positions = _tokens(b=2, t=11, vocab=model.cfg.vocab_size)
  with torch.no_grad():
    theirs = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
  ours = lora.LoraLM(model.cfg, spec).apply({"base": model.params, "lora": adapters}, tokens,
                                            positions)[0]
  base = model.cfg.apply(model.params, tokens, positions)[0]
  assert float(jnp.abs(ours - base).max()) > 1e-2  # the adapters matter here
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)
