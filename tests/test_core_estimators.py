"""qtrain.core.estimators: pass masks and learned-scale gradients against their formulas."""

import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import estimators


def _rand(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def test_ste_is_identity():
  x = jnp.asarray(_rand((4, 8), 0))
  assert estimators.pass_mask("ste", x, jnp.ones((4, 1)), qmax=127.0) is None


@pytest.mark.parametrize("qmax", [127.0, 7.0, 1.0])
def test_clipped_ste_zero_outside_range(qmax):
  x = _rand((6, 32), 1, scale=3.0)
  s = np.abs(_rand((6, 1), 2)) * 0.5 / qmax + 0.01
  m = np.asarray(estimators.pass_mask("clipped_ste", jnp.asarray(x), jnp.asarray(s), qmax=qmax))
  expected = np.abs(x.astype(np.float64) / s) <= qmax
  assert expected.any() and (~expected).any()
  np.testing.assert_array_equal(m, expected)


def test_clipped_ste_binary_rule_and_asymmetric():
  x = jnp.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
  m = estimators.pass_mask("clipped_ste", x, jnp.full((1,), 1.0), qmax=1.0)
  assert np.asarray(m).tolist() == [False, True, True, True, True, True, False]
  # With a zero point the range is [qmin, qmax] after the shift.
  m = estimators.pass_mask("clipped_ste", x, jnp.full((1,), 0.1), qmax=15.0,
                           zero_point_full=jnp.full((1,), 5.0), qmin=0.0)
  # y = x / 0.1 + 5 in [0, 15] <=> x in [-0.5, 1.0]
  assert np.asarray(m).tolist() == [False, False, True, True, True, True, False]
  # A zero scale covers only zeros (binary all-zero group): they pass.
  m = estimators.pass_mask("clipped_ste", jnp.zeros(3), jnp.zeros(3), qmax=1.0)
  assert np.asarray(m).all()


def test_clipped_ste_unit():
  x = jnp.asarray(_rand((64,), 3, scale=1.5))
  m = estimators.pass_mask("clipped_ste_unit", x, jnp.full((1,), 123.0), qmax=1.0)
  np.testing.assert_array_equal(np.asarray(m), np.abs(np.asarray(x)) <= 1.0)


def test_unknown_estimator_raises():
  with pytest.raises(ValueError, match="nope"):
    estimators.pass_mask("nope", jnp.ones(2), jnp.ones(1), qmax=1.0)


def _lsq_direct(g, x, s_full, qmin, qmax, n):
  """LSQ (Esser et al. 2020) d x_hat / d s, float64, written from the paper."""
  y = x / s_full
  q = np.clip(np.round(y), qmin, qmax)
  d = np.where(y < qmin, qmin, np.where(y > qmax, qmax, q - y))
  return g * d / np.sqrt(n * qmax)


@pytest.mark.parametrize("scale_shape,qmin,qmax", [
    ((1, 1), -128, 127), ((8, 1), -128, 127), ((8, 4), -8, 7), ((1, 64), -2, 1)])
def test_lsq_scale_grad_matches_formula(scale_shape, qmin, qmax):
  shape = (8, 64)
  x = _rand(shape, 4, scale=2.0)
  g = _rand(shape, 5)
  s = (np.abs(_rand(scale_shape, 6)) * 3.0 / qmax + 0.05 / qmax).astype(np.float32)
  s_full = np.repeat(np.repeat(s, shape[0] // s.shape[0], 0), shape[1] // s.shape[1], 1)
  q = np.clip(np.round(x / s_full), qmin, qmax).astype(np.int8)
  out = estimators.lsq_scale_grad(jnp.asarray(g), jnp.asarray(x), jnp.asarray(q), jnp.asarray(s),
                                  jnp.asarray(s_full), qmin=qmin, qmax=qmax)
  n = x.size // s.size
  per = _lsq_direct(g.astype(np.float64), x.astype(np.float64), s_full.astype(np.float64), qmin, qmax, n)
  ref = per.reshape(s.shape[0], shape[0] // s.shape[0], s.shape[1], shape[1] // s.shape[1]).sum((1, 3))
  y = x / s_full
  assert ((y > qmax) | (y < qmin)).any()  # both branches exercised
  assert out.shape == s.shape
  # Budget: float32 sums of <= 512 terms.
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5 * np.abs(per).sum())


def test_bitorch_scale_grad_matches_formula():
  x = _rand((8, 64), 7)
  g = _rand((8, 64), 8)
  mask = np.abs(x) <= 1.2
  sign = np.where(x >= 0, 1, -1).astype(np.int8)
  g_clipped = np.where(mask, g, 0)
  for sshape in [(1, 1), (8, 1)]:
    out = estimators.bitorch_scale_grad(jnp.asarray(g_clipped), jnp.asarray(sign), jnp.zeros(sshape))
    ref = (g_clipped.astype(np.float64) * sign).reshape(sshape[0], -1).sum(1).reshape(sshape) / np.sqrt(x.size)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


def test_reduce_to_tiles_and_broadcast_axes():
  x = _rand((4, 6, 8), 9)
  np.testing.assert_allclose(np.asarray(estimators.reduce_to(jnp.asarray(x), (4, 1, 2))),
                             x.reshape(4, 6, 2, 4).sum((1, 3)).reshape(4, 1, 2), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(estimators.reduce_to(jnp.asarray(x), (8,))),
                             x.sum((0, 1)).reshape(1, 1, 8), rtol=1e-5)
