"""Preference optimization of the policy (experiments/dpo.py): log-probs, losses, runs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import dpo
from experiments.configs import dpo_arithmetic
from jaxrl_agents.data import preferences
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.objectives import losses
from jaxrl_agents.rollout import scoring
from jaxrl_agents.train import metrics as metrics_lib

PAIRS = [{"prompt": "2 + 3?", "chosen": "5", "rejected": "six or so"},
         {"prompt": "a much longer question here?", "chosen": "yes!", "rejected": "no"}]


# Jitted: eager, each op of the forward would compile on its own.
_reply_logprobs = jax.jit(scoring.reply_logprobs, static_argnames="cfg")


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def _reply_logp_by_hand(model, prompt, reply):
  """Sum of log-softmax over the reply's tokens (and its closing one), from an unpadded
  forward of the sequence alone."""
  ids, prompt_len = preferences.response_ids(model.tokenizer, prompt, reply, chat=True)
  # Jitted: eager, each op of the forward would compile on its own.
  logits, _ = jax.jit(transformer.apply, static_argnames="cfg")(
      model.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], model.cfg)
  logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
  return float(sum(logp[t - 1, ids[t]] for t in range(prompt_len, len(ids))))


def _settings(loss, **kwargs):
  return dpo.DPOSettings(loss=loss, loss_kwargs=tuple(sorted(kwargs.items())), max_len=128,
                         chat=True, system=None)


def _batch(model, pairs, ref_params):
  c, r = preferences.encode_pairs(model.tokenizer, pairs, max_len=128)
  batch = dpo.PairBatch(*(jnp.asarray(x) for x in (c.tokens, c.mask, c.response, r.tokens,
                                                   r.mask, r.response)),
                        jnp.zeros(len(pairs)), jnp.zeros(len(pairs)))
  ref = jax.jit(dpo.reference_logprobs, static_argnames="cfg")(ref_params, batch, cfg=model.cfg)
  return batch._replace(ref_chosen_logp=ref[0], ref_rejected_logp=ref[1])


def test_reference_logprobs_equal_an_unpadded_forward_per_reply(tiny):
  batch = _batch(tiny, PAIRS, tiny.params)
  for i, p in enumerate(PAIRS):
    assert float(batch.ref_chosen_logp[i]) == pytest.approx(
        _reply_logp_by_hand(tiny, p["prompt"], p["chosen"]), rel=1e-5)
    assert float(batch.ref_rejected_logp[i]) == pytest.approx(
        _reply_logp_by_hand(tiny, p["prompt"], p["rejected"]), rel=1e-5)


@pytest.mark.parametrize("loss, kwargs", [("dpo", dict(beta=0.5)), ("ipo", dict(tau=0.3)),
                                          ("rpo", dict(beta=0.2, eta=0.7)),
                                          ("cpl", dict(alpha=0.4, gamma=0.9))])
def test_each_loss_is_the_library_loss_of_independently_computed_log_probs(tiny, loss, kwargs):
  """A policy that moved away from the reference: the experiment's loss equals the library
  loss evaluated on log-probs computed sequence by sequence."""
  policy = jax.tree.map(lambda x: x * 1.05, tiny.params)
  batch = _batch(tiny, PAIRS, tiny.params)
  got, _ = jax.jit(dpo.preference_loss, static_argnames=("cfg", "s"))(
      policy, batch, cfg=tiny.cfg, s=_settings(loss, **kwargs))
  moved = zoo.Model(**{**tiny.__dict__, "params": policy})
  c = jnp.asarray([_reply_logp_by_hand(moved, p["prompt"], p["chosen"]) for p in PAIRS])
  r = jnp.asarray([_reply_logp_by_hand(moved, p["prompt"], p["rejected"]) for p in PAIRS])
  refs = (batch.ref_chosen_logp, batch.ref_rejected_logp)
  if loss == "dpo":
    expected = -jax.nn.log_sigmoid(0.5 * ((c - refs[0]) - (r - refs[1]))).mean()
  elif loss == "ipo":
    expected = (((c - refs[0]) - (r - refs[1]) - 1 / (2 * 0.3)) ** 2).mean()
  elif loss == "rpo":
    n_chosen = jnp.asarray([len(preferences.response_ids(tiny.tokenizer, p["prompt"],
                                                         p["chosen"])[0]) -
                            preferences.response_ids(tiny.tokenizer, p["prompt"],
                                                     p["chosen"])[1] for p in PAIRS])
    expected = (-jax.nn.log_sigmoid(0.2 * ((c - refs[0]) - (r - refs[1]))).mean()
                + 0.7 * (-c / n_chosen).mean())
  else:
    tok_c, tok_r = jax.jit(dpo._both_sides, static_argnums=2)(policy, batch, tiny.cfg)
    expected, _ = losses.cpl_loss(tok_c, tok_r, batch.chosen_response, batch.rejected_response,
                                  alpha=0.4, gamma=0.9)
    # And S with gamma = 1 is the sequence log-prob computed by hand.
    s1 = losses.preference.discounted_logp_sum(tok_c, batch.chosen_response, 1.0)
    np.testing.assert_allclose(np.asarray(s1), np.asarray(c), rtol=1e-5)
  assert float(got) == pytest.approx(float(expected), rel=1e-4)


def test_a_reply_token_with_no_real_token_before_it_counts_zero(tiny):
  """An empty raw prompt: the reply's first token has only padding before it, so it has no
  prediction and contributes 0 (not a log-prob read off a padding column)."""
  e = preferences.encode_texts(tiny.tokenizer, ["", ""], ["ab", "abcdef"], max_len=64,
                               chat=False)
  logp = np.asarray(_reply_logprobs(tiny.params, jnp.asarray(e.tokens),
                                           jnp.asarray(e.mask), jnp.asarray(e.response),
                                           cfg=tiny.cfg))
  for i in range(2):
    real = np.flatnonzero(e.mask[i])
    assert logp[i, real[0]] == 0.0 and np.all(logp[i, real[1:]] < 0)
    assert np.all(logp[i, :real[0]] == 0)


def test_reply_log_probs_over_the_reply_tail_equal_the_full_width_ones(tiny):
  """Logits for the last R columns only give the same log-probs as all W columns."""
  e = preferences.encode_texts(tiny.tokenizer, ["a long prompt " * 6, "q"], ["ab", "abcdefgh"],
                               max_len=128)
  tail = preferences.reply_tail(e.response, multiple=4)
  assert tail.shape[1] == 12 < e.tokens.shape[1]  # "abcdefgh" and the closing token: 9 -> 12
  args = (tiny.params, jnp.asarray(e.tokens), jnp.asarray(e.mask))
  full = np.asarray(_reply_logprobs(*args, jnp.asarray(e.response), cfg=tiny.cfg))
  short = np.asarray(_reply_logprobs(*args, jnp.asarray(tail), cfg=tiny.cfg))
  np.testing.assert_allclose(short, full[:, -12:], rtol=1e-6, atol=1e-6)
  assert np.all(full[:, :-12] == 0)
  with pytest.raises(ValueError, match="not right-aligned"):
    preferences.reply_tail(np.asarray([[True, False, False, False, False]]), multiple=2)


def _signal_pairs(n, seed):
  rng = np.random.default_rng(seed)
  words = ["red", "blue", "cat", "dog", "sun", "sea", "tree", "rock"]
  body = lambda: " ".join(rng.choice(words, size=rng.integers(1, 3)))
  return [{"prompt": body(), "chosen": body() + "!", "rejected": body() + "?"} for _ in range(n)]


def test_dpo_raises_the_held_out_log_ratio_margin_on_the_tiny_model(tmp_path):
  preferences.write_pairs(tmp_path / "train.jsonl", _signal_pairs(128, 0))
  preferences.write_pairs(tmp_path / "eval.jsonl", _signal_pairs(32, 1))
  config = dpo_arithmetic.get_config("tiny")
  config.pairs_jsonl = str(tmp_path / "train.jsonl")
  config.eval_pairs_jsonl = str(tmp_path / "eval.jsonl")
  config.eval_size, config.steps, config.pairs_per_step = 32, 12, 8
  config.eval_every = config.checkpoint_every = 12
  config.optimizer.learning_rate = 1e-3
  result = dpo.train(config, str(tmp_path / "run"), progress=False)
  evals = [r for r in metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
           if r["kind"] == "eval"]
  assert evals[0]["step"] == 0 and evals[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
  assert result["reward_margin"] > 0.5 and result["pair_accuracy"] >= 0.9


def test_tiny_generated_pairs_run_writes_every_artifact_and_resumes_exactly(tmp_path,
                                                                          crashed_copy):
  config = dpo_arithmetic.get_config("tiny")
  config.keep_checkpoints = 4  # the resume below starts from step 2's
  full = str(tmp_path / "full")
  result = dpo.train(config, full, progress=False)
  for name in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard",
               "pairs/train.jsonl", "pairs/candidates.jsonl"):
    assert os.path.exists(os.path.join(full, name)), name
  for key in ("pair_accuracy", "reward_margin", "calibration_error", "greedy_accuracy"):
    assert key in result, key
  records = lambda w, kind: [r for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))
                             if r["kind"] == kind]
  train = records(full, "train")
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in train)
  # A crash after the checkpoint of step 2 (the pairs already sampled), resumed.
  part = crashed_copy(full, tmp_path / "part", 2)
  dpo.train(config, part, progress=False)
  strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                      for r in rs]
  assert strip(records(part, "train")) == strip(train)
  assert strip(records(part, "eval")) == strip(records(full, "eval"))


def test_config_refusals(tmp_path):
  config = dpo_arithmetic.get_config("tiny")
  config.loss = "kto"
  with pytest.raises(ValueError, match="config.loss must be one of"):
    dpo.train(config, str(tmp_path / "a"), progress=False)
  config = dpo_arithmetic.get_config("tiny")
  config.loss_kwargs.dpo.betta = 0.2
  with pytest.raises(ValueError, match=r"loss_kwargs.dpo: unknown setting\(s\) \['betta'\]"):
    dpo.train(config, str(tmp_path / "k"), progress=False)
  config = dpo_arithmetic.get_config("tiny")
  config.pairs_per_step, config.minibatches = 3, 2
  with pytest.raises(ValueError, match="positive multiple of minibatches"):
    dpo.train(config, str(tmp_path / "b"), progress=False)
