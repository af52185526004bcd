"""Faults from what a run shares with others: the compilation cache others could plant
programs in, a model directory given as a workdir, two exports racing for one --out, and
an update that blows the weights up without a NaN (reliability round 3, items 2, 4, 5, 11).
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from test_harness import _config, _train

from experiments import common
from jaxrl_agents.models import zoo
from jaxrl_agents.tools import export
from jaxrl_agents.train import checkpointing, compilation_cache, optim, workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------
# The compilation cache: an entry is a program the run executes.


def test_a_cache_directory_others_can_write_is_refused_when_named(tmp_path):
  shared = tmp_path / "shared_cache"
  shared.mkdir()
  os.chmod(shared, 0o777)
  with pytest.raises(ValueError, match=r"refused, others may write to it \(mode 777\)"):
    common.enable_compilation_cache(str(shared), str(tmp_path / "run"))
  # below a directory others can write without the sticky bit: it could be swapped
  open_parent = tmp_path / "open"
  open_parent.mkdir()
  os.chmod(open_parent, 0o777)
  with pytest.raises(ValueError, match="may be written by others .* no sticky bit"):
    common.enable_compilation_cache(str(open_parent / "cache"), str(tmp_path / "run"))
  # /tmp-like (sticky) parents are fine, and a new cache is made private
  sticky = tmp_path / "sticky"
  sticky.mkdir()
  os.chmod(sticky, 0o1777)
  assert compilation_cache.private_cache_dir(str(sticky / "cache")) is None
  assert os.stat(sticky / "cache").st_mode & 0o077 == 0


def test_auto_cache_beside_a_shared_workdir_parent_moves_to_the_users_own(tmp_path, monkeypatch,
                                                                        caplog):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))
  runs = tmp_path / "runs"
  runs.mkdir()
  planted = runs / compilation_cache.CACHE_NAME  # made first by someone else: writable
  planted.mkdir()
  os.chmod(planted, 0o777)
  used = common.enable_compilation_cache("auto", str(runs / "run1"))
  assert used == str(tmp_path / "home_cache" / "jaxrl_agents" / "jax_compilation_cache")
  assert os.stat(used).st_mode & 0o077 == 0
  assert "not using" in caplog.text and "others may write to it" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user")
def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path):
  theirs = tmp_path / "theirs"
  theirs.mkdir(mode=0o755)
  os.chown(theirs, 65534, 65534)  # nobody
  assert "owned by user id 65534" in compilation_cache.why_not_private(str(theirs))
  with pytest.raises(ValueError, match="owned by user id 65534"):
    common.enable_compilation_cache(str(theirs), str(tmp_path / "run"))
  # through a symlink the user owns, the directory it names is what is checked
  link = tmp_path / "link"
  link.symlink_to(theirs)
  assert "owned by user id 65534" in compilation_cache.why_not_private(str(link))


_CACHED_PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from experiments import common
    common.enable_compilation_cache(sys.argv[1], "unused")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    print(float(jax.jit(lambda x: (jnp.sin(x) * 3).sum())(jnp.arange(100.0))))
""")


def test_damaged_cache_entries_are_compiled_again_not_a_crash(tmp_path):
  cache = tmp_path / "cache"
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)

  def run():
    return subprocess.run([sys.executable, "-c", _CACHED_PROGRAM, str(cache)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)

  first = run()
  assert first.returncode == 0, first.stderr[-2000:]
  entries = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
  assert entries, "the first run cached nothing"
  for i, path in enumerate(entries):  # not compressed; compressed but not a program
    with open(path, "wb") as f:
      f.write(zlib.compress(b"\x00garbage" * 64) if i % 2 else b"\x00garbage" * 64)
  second = run()
  assert second.returncode == 0, second.stderr[-2000:]
  assert "Error reading persistent compilation cache entry" in second.stderr  # it read them
  assert second.stdout == first.stdout
  expected = float((np.sin(np.arange(100.0, dtype=np.float32)) * 3).sum())
  assert float(second.stdout) == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------
# A workdir that holds a model, not a run.


def _digests(directory) -> dict:
  return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
          for name in sorted(os.listdir(directory))}


def test_a_model_directory_given_as_workdir_is_refused_before_anything_is_written(tmp_path):
  from experiments import grpo
  from experiments.configs import grpo_arithmetic

  model_dir = str(tmp_path / "model")
  zoo.save_hf_dir(zoo.load("tiny"), model_dir)
  before = _digests(model_dir)
  config = grpo_arithmetic.get_config("tiny")
  config.model = model_dir
  with pytest.raises(ValueError, match=r"holds config.json \(a model's, not a run's\), "
                                       r".*model.safetensors.*not a run"):
    grpo.train(config, model_dir, progress=False)
  assert _digests(model_dir) == before
  assert zoo.load(model_dir).cfg is not None  # still a loadable model
  # the command line refuses it before the compilation cache or the lock are made
  out = subprocess.run(
      [sys.executable, "-m", "experiments.grpo",
       "--config=experiments/configs/grpo_arithmetic.py:tiny", f"--workdir={model_dir}",
       f"--config.model={model_dir}"], capture_output=True, text=True, cwd=REPO, timeout=300,
      env={**os.environ, "PYTHONPATH": REPO})
  assert out.returncode != 0 and "a model directory or an export, not a run" in out.stderr
  assert _digests(model_dir) == before


@pytest.mark.parametrize("contents", [
    {"tokenizer.json": "{}"}, {"adapter_model.safetensors": ""}, {"weights.gguf": ""},
    {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]})},
    {"config.json": "not json"}])
def test_a_directory_with_model_files_is_refused_by_the_harness(tmp_path, contents):
  run_dir = tmp_path / "dir"
  run_dir.mkdir()
  for name, text in contents.items():
    (run_dir / name).write_text(text)
  with pytest.raises(ValueError, match="not a run"):
    _train(_config(), str(run_dir))
  assert sorted(os.listdir(run_dir)) == sorted(contents)  # nothing written


def test_a_run_directory_and_a_file_as_workdir(tmp_path):
  run_dir = str(tmp_path / "run")
  _train(_config(), run_dir)
  workdir.check_not_foreign(run_dir)  # a run's own files, its config.json included
  _train(_config(steps=8), run_dir)  # and it resumes
  a_file = tmp_path / "notes.txt"
  a_file.write_text("mine")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    _train(_config(), str(a_file))
  assert a_file.read_text() == "mine"


# ----------------------------------------------------------------------------
# Exports racing for one --out.


def test_an_export_while_another_holds_the_out_fails_and_keeps_the_first(tmp_path):
  out = str(tmp_path / "out")
  with export._exclusive(out):
    with pytest.raises(SystemExit, match="another export to it is running"):
      export.main(["--model", "tiny", "--out", out, "--overwrite"])
  assert not os.path.exists(out)
  assert export.main(["--model", "tiny", "--out", out]) == 0  # released


def test_two_exports_started_together_leave_one_export_and_one_clear_failure(tmp_path):
  out = str(tmp_path / "out")
  cmd = [sys.executable, "-m", "jaxrl_agents.tools.export", "--model", "tiny", "--out", out]
  env = {**os.environ, "PYTHONPATH": REPO}
  procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
           for _ in range(2)]
  results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
  codes = sorted(code for code, _ in results)
  assert codes[0] == 0 and codes[1] != 0, results
  failed = next(err for code, err in results if code != 0)
  assert "another export to it is running" in failed or "exists and is not empty" in failed
  assert "model.safetensors" in os.listdir(out)
  assert zoo.load(out).cfg is not None


# ----------------------------------------------------------------------------
# Weights that blow up without a NaN.


@pytest.mark.parametrize("lr", [1e30, 2.0])
def test_a_learning_rate_that_would_blow_the_weights_up_is_refused(tmp_path, lr):
  from experiments import grpo
  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  config.optimizer.learning_rate = lr
  with pytest.raises(ValueError, match="learning_rate must be a finite number > 0 and at most 1"):
    grpo.train(config, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")
  with pytest.raises(ValueError, match=r"groups.critic.learning_rate must be .* at most 1"):
    optim.make_optimizer(learning_rate=1e-5, total_updates=1,
                         groups={"critic": {"learning_rate": 1e30}}, label_fn=lambda p: p)


def test_diverging_weights_are_never_checkpointed_and_the_run_stops_naming_them(tmp_path):
  from jaxrl_agents.train import harness

  run_dir = str(tmp_path / "run")
  # least squares with a step far past stability: the weights grow ~x30 a step, finite
  with pytest.raises(harness.TrainingStopped, match=r"step \d+: weight \['w'\] holds .* the "
                                                     "run diverged; not checkpointed"):
    _train(_config(learning_rate=30.0, steps=12, checkpoint_every=1), run_dir)
  saved = checkpointing.Checkpointer(run_dir).steps()
  for step in saved:
    state = checkpointing.plain_state(run_dir, step)
    assert checkpointing.absurd_weight(state) is None, step
  assert saved  # the sane steps before the blow-up were kept


def test_export_refuses_weights_that_are_not_finite_or_absurd():
  bad = {"layer": {"w": np.array([1.0, 1e30], np.float32)}}
  with pytest.raises(SystemExit, match=r"weight \['layer'\]\['w'\] holds 1e\+30"):
    export._check_weights(bad, "run")
  with pytest.raises(SystemExit, match=r"\['w'\] holds nan"):
    export._check_weights({"w": np.array([np.nan, 1.0], np.float32)}, "run")
  export._check_weights({"w": np.array([300.0, -2.0], np.float32)}, "run")  # large, not absurd


# ----------------------------------------------------------------------------
# Schedule values that cannot mean anything are named before a workdir is made.


@pytest.mark.parametrize("key,value,message", [
    ("eval_batch_size", 0, "eval_batch_size must be an integer >= 1"),
    ("eval_batch_size", -2, "eval_batch_size must be an integer >= 1"),
    ("eval_every", -1, "eval_every must be an integer >= 0"),
    ("sample_every", -3, "sample_every must be an integer >= 0"),
    ("samples_per_log", -1, "samples_per_log must be an integer >= 0"),
    ("kl_coef", -0.1, "kl_coef must be a finite number >= 0"),
    ("kl_coef", float("nan"), "kl_coef must be a finite number >= 0"),
    ("time_budget_s", float("nan"), "time_budget_s must be >= 0 and finite"),
])
def test_meaningless_schedule_values_are_named_before_the_workdir_is_made(tmp_path, key, value,
                                                                           message):
  from experiments import grpo
  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  config[key] = value
  with pytest.raises(ValueError, match=message):
    grpo.train(config, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")


# ----------------------------------------------------------------------------
# Hostile data and arguments.


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "answer": ' + "9" * 5000 + "}", "Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
])
def test_a_jsonl_row_json_cannot_read_is_named_with_its_file_and_line(tmp_path, line, message):
  from jaxrl_agents.data import jsonl

  path = tmp_path / "rows.jsonl"
  path.write_text('{"prompt": "1+1?", "answer": "2"}\n' + line + "\n")
  with pytest.raises(ValueError, match=rf"rows.jsonl:2: JSON that cannot be read .*{message}"):
    list(jsonl.read_objects(path))


def test_rows_nested_to_the_parsers_limit_fail_with_their_line_not_a_recursion_error(tmp_path):
  from jaxrl_agents.data import jsonl

  path = tmp_path / "rows.jsonl"
  deep = "[" * 980 + '"\\ud800"' + "]" * 980  # about as deep as json.loads goes
  path.write_text('{"prompt": "x", "answer": "1", "meta": ' + deep + "}\n")
  # the text check walks it without recursion; the parser may already refuse it here
  with pytest.raises(ValueError, match="rows.jsonl:1: (field 'meta(\\[0\\])+' holds .* lone "
                                       "surrogate|JSON that cannot be read)"):
    list(jsonl.read_objects(path))


def test_generate_refuses_more_new_tokens_than_the_context_holds():
  from jaxrl_agents.tools import generate

  with pytest.raises(SystemExit, match="--max-new-tokens 100000: .* context of 512 tokens"):
    generate.main(["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "100000"])
  with pytest.raises(SystemExit, match="--max-new-tokens 0: must be at least 1"):
    generate.main(["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "0"])


# ----------------------------------------------------------------------------
# A run trained over several devices, read by a process with one.


@pytest.mark.slow
def test_a_run_trained_on_two_devices_exports_from_a_one_device_process(tmp_path):
  from experiments import grpo
  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  config.mesh.data, config.steps, config.eval_every, config.checkpoint_every = 2, 1, 0, 1
  run_dir = str(tmp_path / "run")
  grpo.train(config, run_dir, progress=False)
  code = textwrap.dedent(f"""
      import jax
      from jaxrl_agents.tools import export
      from jaxrl_agents.train import checkpointing
      assert jax.device_count() == 1
      params, _, step = checkpointing.latest_policy_params({run_dir!r})
      assert step == 1
      export.main(["--workdir", {run_dir!r}, "--out", {str(tmp_path / "hf")!r}])
      print("exported")
  """)
  env = {**os.environ, "PYTHONPATH": REPO,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
  assert out.returncode == 0 and "exported" in out.stdout, out.stderr[-3000:]
  assert "unreadable" not in out.stderr
  trained = zoo.load(str(tmp_path / "hf"))
  from jaxrl_agents.train import checkpointing
  params, _, _ = checkpointing.latest_policy_params(run_dir)
  np.testing.assert_array_equal(np.asarray(trained.params["embed"]),
                                np.asarray(params["embed"]))


# ----------------------------------------------------------------------------
# A resume against a model that changed outside the workdir.


@pytest.mark.slow
def test_dpo_refuses_to_resume_against_a_changed_reference(tmp_path):
  import jax

  from experiments import dpo
  from experiments.configs import dpo_arithmetic

  model_dir = str(tmp_path / "model")
  model = zoo.load("tiny")
  zoo.save_hf_dir(model, model_dir)
  config = dpo_arithmetic.get_config("tiny")
  config.model, config.steps, config.checkpoint_every, config.eval_every = model_dir, 1, 1, 0
  run_dir = str(tmp_path / "run")
  dpo.train(config, run_dir, progress=False)
  config.steps = 2
  dpo.train(config, run_dir, progress=False)  # the same reference: it resumes
  model.params = jax.tree.map(lambda x: x * 1.01, model.params)  # re-exported, changed
  export._write_clean(model_dir, lambda d: zoo.save_hf_dir(model, d))
  config.steps = 3
  with pytest.raises(ValueError, match=r"with a different reference \(.*model\) than the one "
                                       "loaded now"):
    dpo.train(config, run_dir, progress=False)


# ----------------------------------------------------------------------------
# A Hugging Face directory with what the transformer does not compute.


def _tiny_hf(tmp_path, edit_config=None, edit_tensors=None) -> str:
  from safetensors.numpy import load_file, save_file

  path = str(tmp_path / "hf")
  zoo.save_hf_dir(zoo.load("tiny"), path)
  if edit_config:
    with open(os.path.join(path, "config.json")) as f:
      config = json.load(f)
    edit_config(config)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config, f)
  if edit_tensors:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit_tensors(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
  return path


def _add(name, shape):
  return lambda t: t.__setitem__(name, np.full(shape, 5.0, np.float32))


@pytest.mark.parametrize("edit_config, edit_tensors, message", [
    (None, _add("model.layers.0.self_attn.o_proj.bias", (64,)),
     r"1 weights in the files are not part of the model .*o_proj.bias"),
    (None, _add("model.layers.1.mlp.down_proj.bias", (64,)), "mlp.down_proj.bias"),
    (None, _add("model.layers.2.input_layernorm.weight", (64,)), r"model.layers.2\."),
    (lambda c: c.update(hidden_act="gelu"), None, "hidden_act 'gelu' is not supported"),
    (lambda c: c.update(mlp_bias=True), None, "mlp_bias"),
    (lambda c: c.update(attention_bias=True), None, "o_proj's included"),
    (lambda c: c.pop("hidden_size"), None, "hidden_size missing"),
    (None, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"] + 1),
     "lm_head.weight differs from the embedding"),
])
def test_a_hugging_face_directory_with_what_the_model_does_not_compute_is_refused(
    tmp_path, edit_config, edit_tensors, message):
  path = _tiny_hf(tmp_path, edit_config, edit_tensors)
  with pytest.raises(ValueError, match=message):
    zoo.load(path)


def test_a_tied_models_saved_lm_head_equal_to_the_embedding_loads(tmp_path):
  path = _tiny_hf(tmp_path, edit_tensors=lambda t: t.__setitem__(
      "lm_head.weight", t["model.embed_tokens.weight"].copy()))
  assert zoo.load(path).cfg.vocab_size == 320


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
  def shrink(tensors):
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:200]

  path = _tiny_hf(tmp_path, lambda c: c.update(vocab_size=200), shrink)
  with pytest.raises(ValueError, match="the tokenizer has 259 tokens, the model's vocabulary 200"):
    zoo.load(path)


@pytest.mark.parametrize("name, message", [
    ("config.json", "config.json: not a readable JSON config"),
    ("tokenizer.json", r"tokenizer.json \(or tokenizer_config.json\): cannot be loaded")])
def test_a_garbage_config_or_tokenizer_file_is_named(tmp_path, name, message):
  path = _tiny_hf(tmp_path)
  with open(os.path.join(path, name), "w") as f:
    f.write("{garbage")
  with pytest.raises(ValueError, match=message):
    zoo.load(path)


def test_a_chat_template_that_runs_for_hours_is_refused_when_the_model_loads(tmp_path,
                                                                           monkeypatch):
  """...and the model's own template passes (a render as transformers does it, in a child
  process that is killed at the limit)."""
  from jaxrl_agents.models import tokenizer as tokenizer_lib

  path = _tiny_hf(tmp_path)
  monkeypatch.setattr(tokenizer_lib, "TEMPLATE_TIME_LIMIT_S", 1.0)
  assert tokenizer_lib.load_tokenizer(path).chat_template  # its own template: in time
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    # 10^10 iterations of Jinja's sandboxed ranges (100,000 at most each).
    f.write("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
            "{% endfor %}{{ messages[0]['content'] }}")
  with pytest.raises(ValueError, match=r"hf: the chat template did not render .* within 1 s"):
    zoo.load(path)


# ----------------------------------------------------------------------------
# Preference texts far longer than a sequence: only their ends are tokenized.


def test_a_huge_preference_text_tokenizes_only_the_end_it_keeps(monkeypatch):
  from jaxrl_agents.data import preferences
  from jaxrl_agents.models import tokenizer as tokenizer_lib

  tok = tokenizer_lib.load_tokenizer(zoo.smollm2_dir())
  rng = np.random.default_rng(0)
  words = ["the", "cat", "sat", "on", "a", "mat", "7", "+", "(x)", "naïve", "\n", "thirty"]
  prose = " ".join(rng.choice(words, 25_000).tolist())  # ~100,000 characters
  texts = [("What now?", prose), (prose, "Fine."), (prose, prose)]
  prompts, responses = zip(*texts, strict=True)
  cut = preferences.encode_texts(tok, prompts, responses, max_len=256)
  seen = []
  plain_ids = tokenizer_lib.plain_ids
  monkeypatch.setattr(tokenizer_lib, "plain_ids", lambda t, text: seen.append(len(text))
                      or plain_ids(t, text))
  preferences.encode_texts(tok, prompts, responses, max_len=256)
  assert max(seen) <= 257 * preferences.longest_token_chars(tok) < len(prose) // 4
  # The same tokens as encoding the whole texts (a text's start cannot reach its last 256).
  monkeypatch.setattr(preferences, "longest_token_chars", lambda t: 10**9)
  whole = preferences.encode_texts(tok, prompts, responses, max_len=256)
  for a, b in zip(cut, whole, strict=True):
    np.testing.assert_array_equal(a, b)
  assert cut.truncated.all()


# ----------------------------------------------------------------------------
# A full disk: one clear stop, and the next run resumes.


def test_a_full_disk_stops_the_run_saying_so_and_the_next_run_resumes(tmp_path, monkeypatch):
  import errno

  from jaxrl_agents.train import harness, metrics

  write_samples = metrics.MetricWriter.write_samples

  def full(self, step, *args, **kwargs):
    if step >= 4:
      raise OSError(errno.ENOSPC, "No space left on device", "samples.jsonl")
    return write_samples(self, step, *args, **kwargs)

  monkeypatch.setattr(metrics.MetricWriter, "write_samples", full)
  with pytest.raises(harness.TrainingStopped, match=r"no space left on its device .*step 4.*"
                     r"run the same command again"):
    _train(_config(), str(tmp_path))
  monkeypatch.setattr(metrics.MetricWriter, "write_samples", write_samples)  # space freed
  result, calls = _train(_config(), str(tmp_path))
  assert len(calls) == 3  # resumed from the checkpoint of step 3
  assert np.isfinite(result["error"])
