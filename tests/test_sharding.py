"""Sharding on the 8 fake CPU devices the test setup creates (tests/conftest.py): meshes from
config, the parameter rules, and the same numbers on every mesh as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_agents.models import zoo
from jaxrl_agents.parallel import sharding

MESHES = [{"data": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2}]

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def test_mesh_shape_fills_one_axis_and_names_bad_specs():
  assert sharding.mesh_shape(None, 8) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert sharding.mesh_shape({"data": 2, "fsdp": -1}, 8) == {"data": 2, "fsdp": 4, "tensor": 1}
  mesh = sharding.mesh_from_config({"fsdp": -1, "tensor": 2})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sharding.mesh_shape({"model": 2}, 8)
  with pytest.raises(ValueError, match="only one mesh axis may be -1"):
    sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.mesh_shape({"data": 4, "fsdp": 4}, 8)
  with pytest.raises(ValueError, match="do not split"):
    sharding.mesh_shape({"data": 3, "fsdp": -1}, 8)


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def test_rules_shard_weights_and_keep_what_does_not_divide_whole(tiny):
  mesh = sharding.mesh_from_config({"data": 2, "fsdp": 2, "tensor": 2})
  specs = jax.tree.map(lambda s: s.spec, sharding.shardings(tiny.params, mesh))
  layer = specs["layers"][0]
  assert layer["wq"] == P("tensor", "fsdp") and layer["w_down"] == P("fsdp", "tensor")
  assert layer["attn_norm"] == P() and specs["embed"] == P("tensor", "fsdp")
  # A dimension the axis does not divide stays whole; a size-1 axis is never named.
  mesh3 = sharding.mesh_from_config({"fsdp": 1, "tensor": 8})
  assert sharding.spec_for("layers/0/wk", (36, 63), mesh3) == P()
  assert sharding.spec_for("layers/0/wk", (32, 64), mesh3) == P("tensor")
  # ... or goes to another dimension it divides
  assert sharding.spec_for("layers/0/wk", (36, 64), mesh3) == P(None, "tensor")
  assert sharding.spec_for("embed", (49152, 576), {"data": 1, "fsdp": 256, "tensor": 1}) == \
      P("fsdp")
  # The stacked layout's leading layer axis stays whole.
  assert sharding.spec_for("layers/wq", (2, 64, 64), mesh) == P(None, "tensor", "fsdp")
  # Optimizer moments sit under paths ending the same way.
  assert sharding.spec_for("opt_state/0/mu/layers/1/wo", (64, 64), mesh) == P("fsdp", "tensor")


def test_per_device_parameter_and_optimizer_bytes_fall_as_fsdp_grows(tiny):
  import optax

  tx = optax.adamw(1e-3)
  sizes = []
  for fsdp in (1, 2, 4, 8):
    mesh = sharding.mesh_from_config({"fsdp": fsdp})
    params = sharding.shard(tiny.params, mesh)
    opt_state = sharding.init_sharded(tx.init, mesh, params)
    sizes.append((sharding.bytes_per_device(params), sharding.bytes_per_device(opt_state)))
  total = sum(x.nbytes for x in jax.tree.leaves(tiny.params))
  assert sizes[0][0] == total
  for (p0, o0), (p1, o1) in zip(sizes, sizes[1:], strict=False):
    assert p1 < p0 and o1 < o0
  # Norm vectors ([64]) are replicated; the rest is split 8 ways.
  norms = sum(x.nbytes for x in jax.tree.leaves(tiny.params) if x.ndim == 1)
  assert sizes[-1][0] == pytest.approx((total - norms) / 8 + norms)


def _grpo_case(tiny):
  """A tiny GRPO algorithm, its state and one prepared batch of 16 rows."""
  from experiments import common, grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents import data as data_lib
  from jaxrl_agents.rollout import single_turn

  config = grpo_arithmetic.get_config("tiny")
  config.prompts_per_step, config.group_size = 4, 4
  # Adam's first step moves a weight by lr * g / (|g| + eps): with the usual eps = 1e-8 a
  # weight whose gradient is ~0 moves by a float-noise-sized fraction of lr, which another
  # order of summation changes. A larger eps keeps the update a smooth function of g.
  config.optimizer.eps = 1e-4
  algo = grpo.GRPO(config, tiny.cfg)
  state = algo.init_state(tiny.params, jax.random.key(0))
  source = data_lib.load_task(config.task, "train")
  examples = [source[i] for i in range(4)]
  reward_fn, grader = common.make_rewards(config)
  r = single_turn.rollout(tiny.params, tiny, examples, jax.random.key(1), group_size=4,
                          sampling=single_turn.sampling_from_config(config, tiny.tokenizer),
                          template=config.prompt_template, chat=config.chat, system=None,
                          reward_fn=reward_fn, grader=grader)
  return algo, state, algo.prepare(state, r, jax.random.key(2))


@pytest.mark.parametrize("spec", MESHES, ids=lambda s: "x".join(map(str, s.values())))
def test_a_grpo_update_on_a_mesh_equals_one_device(tiny, spec):
  algo, state, batch = _grpo_case(tiny)
  assert batch.traj.tokens.shape[0] == 16 and float(jnp.abs(batch.advantages).sum()) > 0
  copy = lambda t: jax.tree.map(jnp.copy, t)
  ref_state, ref_metrics = algo.update(copy(state), batch, jax.random.key(3), 0.0)
  mesh = sharding.mesh_from_config(spec)
  sharded_state = sharding.shard(copy(state), mesh)
  sharded_batch = sharding.shard_batch(batch, mesh)
  assert sharded_batch.traj.tokens.sharding.spec == P(("data", "fsdp"))
  new_state, metrics = algo.update(sharded_state, sharded_batch, jax.random.key(3), 0.0)
  for k in ("loss", "grad_norm"):
    assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-4, abs=1e-6), k
  lr = float(algo.optimizer.schedule(0))
  assert 0 < lr <= 1e-3
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0.01 * lr)
  wq = new_state.params["layers"][0]["wq"]
  assert wq.sharding.spec == sharding.spec_for("layers/0/wq", wq.shape, mesh)


@pytest.mark.parametrize("spec", MESHES, ids=lambda s: "x".join(map(str, s.values())))
def test_sampling_with_sharded_weights_and_rows_equals_one_device(tiny, spec):
  from jaxrl_agents.models import tokenizer as tokenizer_lib
  from jaxrl_agents.rollout import sampler as sampler_lib

  tok = tiny.tokenizer
  ids = [tokenizer_lib.plain_ids(tok, f"question {i}" + "?" * i) for i in range(8)]
  tokens, mask = tokenizer_lib.pad_left(ids, tok.pad_token_id)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=12, temperature=1.0,
                                        stop_tokens=(tok.eos_token_id,), pad_id=tok.pad_token_id)
  run = functools.partial(sampler_lib.generate, cfg=tiny.cfg, rng=jax.random.key(5),
                          sampling=sampling, samples_per_prompt=2)
  ref = run(tiny.params, prompt_tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(mask))
  mesh = sharding.mesh_from_config(spec)
  out = run(sharding.shard(tiny.params, mesh),
            prompt_tokens=sharding.shard_batch(jnp.asarray(tokens), mesh),
            prompt_mask=sharding.shard_batch(jnp.asarray(mask), mesh))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))


def _records(workdir, kind):
  from jaxrl_agents.train import metrics as metrics_lib
  return [r for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl") if r["kind"] == kind]


def test_the_tiny_grpo_experiment_on_a_mesh_logs_what_one_device_logs_and_resumes_on_one(
    tmp_path, monkeypatch):
  """config.mesh is all it takes: the same rewards, losses and eval figures (float
  tolerance), a state placed by the rules, and a checkpoint written on 8 devices that
  resumes on one."""
  from experiments import grpo
  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  config.optimizer.eps = 1e-4  # see _grpo_case
  one = tmp_path / "one"
  grpo.train(config, str(one), progress=False)
  config.mesh.update(dict(data=2, fsdp=2, tensor=2))
  meshed = tmp_path / "mesh"
  placed = []
  shard = sharding.shard

  def spy(tree, mesh, *args, **kwargs):
    out = shard(tree, mesh, *args, **kwargs)
    if mesh is not None and hasattr(out, "params"):
      placed.append(out.params["layers"][0]["wq"].sharding.spec)
    return out

  monkeypatch.setattr(sharding, "shard", spy)
  grpo.train(config, str(meshed), progress=False)
  assert placed == [P("tensor", "fsdp")]  # the harness placed the train state
  keys = ("reward_mean", "accuracy", "loss", "grad_norm", "kl", "entropy")
  for a, b in zip(_records(one, "train"), _records(meshed, "train"), strict=True):
    for k in keys:
      if k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["step"], k)
  for a, b in zip(_records(one, "eval"), _records(meshed, "eval"), strict=True):
    assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
  # The mesh run's checkpoint resumes on one device (a mesh change is a resumable change).
  config.mesh.update(dict(data=1, fsdp=1, tensor=1))
  config.steps += 1
  grpo.train(config, str(meshed), progress=False)
  assert [r["step"] for r in _records(meshed, "train")][-1] == config.steps


def test_offline_trainers_on_a_mesh(tmp_path, monkeypatch):
  """The reward-model trainer on a mesh logs what it logs on one device, and every offline
  trainer splits its batches over the mesh."""
  from experiments import dpo, process_reward_model, sft
  from experiments import reward_model as rm_experiment
  from experiments.configs import (
      dpo_arithmetic,
      process_reward_model_arithmetic,
      reward_model_arithmetic,
      sft_arithmetic,
  )

  config = reward_model_arithmetic.get_config("tiny")
  config.pairs_per_step = 8
  config.eval_every = 0  # the train records are compared
  config.optimizer.eps = 1e-4
  rm_experiment.train(config, str(tmp_path / "one"), progress=False)
  config.mesh.update(dict(data=2, fsdp=4))
  config.pairs_dir = str(tmp_path / "one" / "pairs")
  split = []
  shard_batch = sharding.shard_batch

  def spy(tree, mesh, *args, **kwargs):
    out = shard_batch(tree, mesh, *args, **kwargs)
    if mesh is not None:
      split.extend(x.sharding.spec for x in jax.tree.leaves(out) if np.ndim(x) == 2)
    return out

  monkeypatch.setattr(sharding, "shard_batch", spy)
  rm_experiment.train(config, str(tmp_path / "mesh"), progress=False)
  for a, b in zip(_records(tmp_path / "one", "train"), _records(tmp_path / "mesh", "train"),
                  strict=True):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
  assert split and all(spec == P(("data", "fsdp")) for spec in split)
  for module, cfg_module in ((dpo, dpo_arithmetic), (sft, sft_arithmetic),
                             (process_reward_model, process_reward_model_arithmetic)):
    split.clear()
    c = cfg_module.get_config("tiny")
    c.steps, c.eval_every, c.checkpoint_every = 1, 0, 1
    c.mesh.update(dict(data=2, fsdp=2))
    module.train(c, str(tmp_path / module.__name__), progress=False)
    assert split and all(spec == P(("data", "fsdp")) for spec in split), module.__name__


def test_memory_plan_matches_the_parameter_count_and_the_cache_formula():
  """benchmarks/sharding_memory.py from shapes alone: Llama-3-8B on fsdp=8 holds an eighth
  of 4 bytes per parameter (less the replicated norms), and the KV cache is rows x context
  x layers x 2 x kv heads x head dim x 2 bytes over the row-splitting devices."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).parent.parent / "benchmarks" / "sharding_memory.py"
  spec = importlib.util.spec_from_file_location("sharding_memory", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  cfg = bench.MODELS["llama-3-8b"]
  got = bench.plan(cfg, {"data": 1, "fsdp": 8, "tensor": 1}, rows=64, context=1024)
  norms = (2 * cfg.n_layers + 1) * cfg.d_model
  expected = ((cfg.num_params - norms) / 8 + norms) * 4 / bench.GIB
  assert got["params_gib"] == pytest.approx(expected, rel=1e-6)
  assert got["adam_gib"] == pytest.approx(2 * expected, rel=1e-6)
  kv = 64 * 1024 * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2 / 8
  assert got["kv_cache_gib"] * bench.GIB == pytest.approx(kv + 64 * 1024 / 8, rel=1e-6)
  assert cfg.num_params == pytest.approx(8.03e9, rel=0.01)


def test_a_model_loads_straight_onto_the_mesh():
  mesh = sharding.mesh_from_config({"fsdp": 4, "tensor": 2})
  model = zoo.load("tiny", mesh=mesh)
  plain = zoo.load("tiny")
  wq = model.params["layers"][0]["wq"]
  assert wq.sharding.spec == P("tensor", "fsdp") and len(wq.addressable_shards) == 8
  assert wq.addressable_shards[0].data.shape == (32, 16)
  for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  bf16 = zoo.load("tiny", param_dtype="bfloat16", mesh=mesh)
  assert bf16.params["embed"].dtype == jnp.bfloat16
  assert model.cfg.activation_mesh is mesh and plain.cfg.activation_mesh is None


def test_activations_keep_their_rows_split_and_the_logits_of_one_device():
  """With weights over fsdp, the residual stream is constrained to rows over data x fsdp
  after the embedding and every layer (in the compiled program), in the forward pass and
  in a decode step; the logits are those of one device."""
  from jaxrl_agents.models import transformer

  mesh = sharding.mesh_from_config({"data": 2, "fsdp": 2, "tensor": 2})
  model, plain = zoo.load("tiny", mesh=mesh), zoo.load("tiny")
  tokens = jnp.asarray(np.arange(8 * 6).reshape(8, 6) % 200 + 3, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(6), (8, 6))
  forward = jax.jit(lambda p, t, pos, cfg: transformer.apply(p, t, pos, cfg)[0],
                    static_argnums=3)
  lowered = forward.lower(model.params, sharding.shard_batch(tokens, mesh),
                          sharding.shard_batch(positions, mesh), model.cfg).as_text()
  # One constraint after the embedding and one per layer, all rows over data x fsdp.
  constraints = [line for line in lowered.splitlines() if "sharding_constraint" in line]
  assert len(constraints) == 1 + model.cfg.n_layers
  assert all('[{"data", "fsdp"}, {}, {}]' in line for line in constraints)
  plain_lowered = forward.lower(plain.params, tokens, positions, plain.cfg).as_text()
  assert "sharding_constraint" not in plain_lowered
  np.testing.assert_allclose(
      np.asarray(forward(model.params, sharding.shard_batch(tokens, mesh),
                         sharding.shard_batch(positions, mesh), model.cfg)),
      np.asarray(forward(plain.params, tokens, positions, plain.cfg)), rtol=1e-5, atol=1e-5)
  cache = transformer.init_cache(model.cfg, 8, 8)
  step = jax.jit(transformer.decode_step, static_argnums=3)
  text = step.lower(model.params, tokens[:, 0], positions[:, 0], model.cfg, cache).as_text()
  assert '[{}, {"data", "fsdp"}]' in text  # feature-major [D, B]: rows are the columns


@pytest.mark.slow
def test_ppo_on_a_multi_turn_environment_on_a_mesh_logs_what_one_device_logs(tmp_path):
  """PPO (a value head, token-level GAE) over FrozenLake's lax.scan episodes: the mesh
  changes no reward, loss or value figure beyond float tolerance."""
  from experiments import ppo
  from experiments.configs import ppo_frozen_lake

  config = ppo_frozen_lake.get_config("tiny")
  config.steps = 2
  config.eval_every = 0  # the train records are compared; evaluation on a mesh: the GRPO test
  config.optimizer.eps = 1e-4  # see _grpo_case
  ppo.train(config, str(tmp_path / "one"), progress=False)
  config.mesh.update(dict(data=2, fsdp=2, tensor=2))
  ppo.train(config, str(tmp_path / "mesh"), progress=False)
  one, meshed = _records(tmp_path / "one", "train"), _records(tmp_path / "mesh", "train")
  assert len(one) == 2
  keys = ("reward_mean", "loss", "value_loss", "value_mean", "entropy", "episode_turns")
  for a, b in zip(one, meshed, strict=True):
    assert all(k in a for k in keys[:4]), sorted(a)
    for k in keys:
      if k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["step"], k)
