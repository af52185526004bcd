"""Op tests for jaxrl_agents.objectives.losses.token_controls: covariance clip (SPEAR), entropy
gate (EARL)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.objectives.losses.token_controls import covariance_clip_mask, entropy_gate_mask


def _np(x):
  return np.asarray(x)


# --- covariance clip ---------------------------------------------------------------------

_LOGP = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0]])
_ADV = jnp.array([[1.0, 1.0, -1.0], [2.0, -1.0, 0.0]])
_MASK = jnp.array([[True, True, True], [True, True, False]])
# valid: mean logp = -2.1, mean A = 0.4
# c = (1.1*0.6, 0.1*0.6, -0.9*-1.4, 1.6*1.6, -1.9*-1.4) = (0.66, 0.06, 1.26, 2.56, 2.66)


def test_covariance_clip_hand_values():
  new_mask, metrics = jax.jit(covariance_clip_mask)(_LOGP, _ADV, _MASK, 0.4)
  # floor(0.4 * 5) = 2 dropped: c = 2.66 and 2.56
  np.testing.assert_array_equal(_np(new_mask), [[True, True, True], [False, False, False]])
  assert int(metrics["num_dropped"]) == 2
  assert float(metrics["dropped_frac"]) == pytest.approx(0.4)
  assert float(metrics["cov_mean"]) == pytest.approx(7.2 / 5, rel=1e-5)
  assert float(metrics["cov_threshold"]) == pytest.approx(2.56, rel=1e-5)
  new_mask, _ = covariance_clip_mask(_LOGP, _ADV, _MASK, 0.6)
  # floor(3) dropped: adds c = 1.26
  np.testing.assert_array_equal(_np(new_mask), [[True, True, False], [False, False, False]])
  # per row: row 0 floor(0.5*3) = 1 -> 1.26; row 1 floor(0.5*2) = 1 -> 2.66
  new_mask, _ = covariance_clip_mask(_LOGP, _ADV, _MASK, 0.5, per_sequence=True)
  np.testing.assert_array_equal(_np(new_mask), [[True, True, False], [True, False, False]])


def test_covariance_clip_frac_zero_is_identity():
  rng = np.random.default_rng(0)
  logp = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  mask = jnp.asarray(rng.random((4, 9)) < 0.7)
  new_mask, metrics = covariance_clip_mask(logp, adv, mask, 0.0)
  np.testing.assert_array_equal(_np(new_mask), _np(mask))
  assert int(metrics["num_dropped"]) == 0
  assert float(metrics["cov_threshold"]) == -np.inf


@pytest.mark.parametrize("frac", [0.05, 0.2, 0.29, 0.5, 1.0])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_covariance_clip_drops_exactly_the_top_fraction(frac, per_sequence):
  rng = np.random.default_rng(1)
  logp = rng.normal(size=(5, 20)).astype(np.float32)
  adv = rng.normal(size=(5, 20)).astype(np.float32)
  mask = rng.random((5, 20)) < 0.8
  fn = jax.jit(functools.partial(covariance_clip_mask, per_sequence=per_sequence))
  new_mask, _ = fn(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), frac)
  new_mask = _np(new_mask)
  n = mask.sum()
  cov = (logp - logp[mask].mean()) * (adv - adv[mask].mean())
  assert not np.any(new_mask & ~mask)  # never re-enables a token
  dropped = mask & ~new_mask
  rows = [slice(None)] if not per_sequence else [slice(i, i + 1) for i in range(5)]
  for rs in rows:
    m, d, c = mask[rs], dropped[rs], cov[rs]
    k = int(np.floor(frac * m.sum() + 1e-4))
    assert d.sum() == k
    expected = np.zeros_like(m)
    valid_idx = np.flatnonzero(m)
    top = valid_idx[np.argsort(-c.reshape(-1)[valid_idx], kind="stable")[:k]]
    expected.reshape(-1)[top] = True
    np.testing.assert_array_equal(d, expected)
  if not per_sequence:
    assert dropped.sum() == int(np.floor(frac * n + 1e-4))


def test_covariance_clip_traces_once_and_vmaps():
  traces = []

  @jax.jit
  def fn(logp, adv, mask, frac):
    traces.append(None)
    return covariance_clip_mask(logp, adv, mask, frac)

  rng = np.random.default_rng(2)
  for frac in (0.1, 0.3):
    mask = jnp.asarray(rng.random((3, 8)) < 0.6)
    fn(
      jnp.asarray(rng.normal(size=(3, 8))),
      jnp.asarray(rng.normal(size=(3, 8))),
      mask,
      jnp.float32(frac),
    )
  assert len(traces) == 1
  logp = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 3, 8)) < 0.6)
  batched, _ = jax.vmap(covariance_clip_mask, in_axes=(0, 0, 0, None))(logp, adv, mask, 0.25)
  single, _ = covariance_clip_mask(logp[1], adv[1], mask[1], 0.25)
  np.testing.assert_array_equal(_np(batched[1]), _np(single))


def test_covariance_clip_shape_errors():
  with pytest.raises(ValueError, match="advantages"):
    covariance_clip_mask(_LOGP, _ADV[:, :2], _MASK, 0.1)
  with pytest.raises(ValueError, match="logp"):
    covariance_clip_mask(_LOGP[0], _ADV, _MASK, 0.1)


# --- entropy gate ------------------------------------------------------------------------

_ENT = jnp.array([[0.1, 0.9, 0.5], [0.7, 0.2, 5.0]])
_EMASK = jnp.array([[True, True, True], [True, True, False]])


def test_entropy_gate_hand_values():
  new_mask, metrics = jax.jit(entropy_gate_mask)(_ENT, _EMASK, 0.4)
  # ceil(0.4 * 5) = 2 kept: 0.9 and 0.7 (the masked 5.0 never counts)
  np.testing.assert_array_equal(_np(new_mask), [[False, True, False], [True, False, False]])
  assert int(metrics["num_kept"]) == 2
  assert float(metrics["kept_frac"]) == pytest.approx(0.4)
  assert float(metrics["entropy_threshold"]) == pytest.approx(0.7)
  assert float(metrics["kept_entropy_mean"]) == pytest.approx(0.8)
  new_mask, _ = entropy_gate_mask(_ENT, _EMASK, 0.5)  # ceil(2.5) = 3
  np.testing.assert_array_equal(_np(new_mask), [[False, True, True], [True, False, False]])
  # per row: ceil(1.5) = 2 of row 0, ceil(1.0) = 1 of row 1
  new_mask, _ = entropy_gate_mask(_ENT, _EMASK, 0.5, per_sequence=True)
  np.testing.assert_array_equal(_np(new_mask), [[False, True, True], [True, False, False]])
  new_mask, _ = entropy_gate_mask(_ENT, _EMASK, 0.34, per_sequence=True)
  # row 0: ceil(1.02) = 2; row 1: ceil(0.68) = 1
  np.testing.assert_array_equal(_np(new_mask), [[False, True, True], [True, False, False]])


def test_entropy_gate_top_frac_one_is_identity():
  rng = np.random.default_rng(3)
  ent = jnp.asarray(rng.random((4, 11)), jnp.float32)
  mask = jnp.asarray(rng.random((4, 11)) < 0.6)
  for per_sequence in (False, True):
    new_mask, metrics = entropy_gate_mask(ent, mask, 1.0, per_sequence=per_sequence)
    np.testing.assert_array_equal(_np(new_mask), _np(mask))
    assert int(metrics["num_kept"]) == int(mask.sum())


@pytest.mark.parametrize("top_frac", [0.0, 0.1, 0.2, 0.37, 0.8])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_entropy_gate_kept_entropies_dominate_dropped(top_frac, per_sequence):
  rng = np.random.default_rng(4)
  ent = rng.random((6, 15)).astype(np.float32)
  mask = rng.random((6, 15)) < 0.75
  fn = jax.jit(functools.partial(entropy_gate_mask, per_sequence=per_sequence))
  new_mask, _ = fn(jnp.asarray(ent), jnp.asarray(mask), jnp.float32(top_frac))
  new_mask = _np(new_mask)
  assert not np.any(new_mask & ~mask)
  rows = [slice(None)] if not per_sequence else [slice(i, i + 1) for i in range(6)]
  for rs in rows:
    m, kept = mask[rs], new_mask[rs]
    dropped = m & ~kept
    assert kept.sum() == int(np.ceil(top_frac * m.sum() - 1e-4))
    if kept.any() and dropped.any():
      assert ent[rs][kept].min() >= ent[rs][dropped].max()


def test_entropy_gate_vmap_and_shape_errors():
  rng = np.random.default_rng(5)
  ent = jnp.asarray(rng.random((2, 3, 7)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 3, 7)) < 0.7)
  batched, _ = jax.vmap(entropy_gate_mask, in_axes=(0, 0, None))(ent, mask, 0.3)
  single, _ = entropy_gate_mask(ent[0], mask[0], 0.3)
  np.testing.assert_array_equal(_np(batched[0]), _np(single))
  with pytest.raises(ValueError, match="mask"):
    entropy_gate_mask(_ENT, _EMASK[:, :2], 0.5)
  with pytest.raises(ValueError, match="entropy"):
    entropy_gate_mask(_ENT[0], _EMASK, 0.5)
