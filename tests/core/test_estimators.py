"""qtrain.core.estimators: pass masks and learned-scale gradients against their formulas."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests import _strategies as S
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


# ----------------------------------------------------------------------------
# clipped_ste against the calibration range: the element that sets an absmax
# scale is inside (0.3 / (0.3 / 127) is 127.00001 in float32, and the gradient
# of ~23% of rows' largest element used to be dropped).

import jax  # noqa: E402

import qtrain.ops as qops  # noqa: E402
from qtrain.core import qarray, qtypes  # noqa: E402
from qtrain.ops import config

_quantize = jax.jit(qarray.quantize, static_argnames=("spec",))
_mask = jax.jit(estimators.pass_mask, static_argnames=("estimator", "qmax", "qmin"))
# (shape, channelwise_axes, tiled_axes)
_LAYOUTS = [((1, 3), (0,), {}), ((64, 33), (0,), {}), ((64, 64), (0,), {1: 16}),
            ((6, 5, 8), (0, 2), {}), ((48, 40), (), {}), ((40, 48), (1,), {0: 8})]


def _spread(shape, seed):
  """Normal data times 10^k, k in [-30, 30] per row: many magnitudes, both signs."""
  rng = np.random.default_rng(seed)
  k = rng.integers(-30, 31, shape[:1] + (1,) * (len(shape) - 1))
  return (rng.standard_normal(shape) * 10.0 ** k).astype(np.float32)


def _mask_of(q, x, estimator="clipped_ste"):
  zp = None if q.zero_point is None else qarray.expand_scale(q.zero_point, x.shape)
  return np.asarray(_mask(estimator, jnp.asarray(x), qarray.expand_scale(q.scale, x.shape),
                          qmax=float(q.qtype.qmax), zero_point_full=zp, qmin=float(q.qtype.qmin)))


def test_clipped_ste_grad_of_the_absmax_element_passes():
  cfg = config.DotGeneralQtConfig(
      lhs=config.OperandQuant(qtype="int8", estimator="clipped_ste"), implementation="xla")
  x = jnp.array([[0.15, -0.075, 0.3]])
  g = jax.grad(lambda x: qops.dot_general_qt(
      x, jnp.ones((3, 2)), (((1,), (0,)), ((), ())), cfg).sum())(x)
  np.testing.assert_array_equal(np.asarray(g), [[2.0, 2.0, 2.0]])


@pytest.mark.parametrize("shape,cw,tiles", _LAYOUTS)
@pytest.mark.parametrize("qtype", list(S.QTYPES))
@pytest.mark.thin(4)
def test_clipped_ste_under_absmax_passes_every_element(qtype, shape, cw, tiles):
  x = _spread(shape, hash((qtype, shape)) % 2**32)
  q = _quantize(jnp.asarray(x), qarray.QuantizeSpec(
      qtype=qtype, channelwise_axes=cw, tiled_axes=tiles))
  assert _mask_of(q, x).all()


@pytest.mark.parametrize("shape,cw,tiles", _LAYOUTS)
@pytest.mark.parametrize("qtype", ["int8", "int4", "int2"])
@pytest.mark.thin(4)
def test_clipped_ste_under_minmax_passes_every_element(qtype, shape, cw, tiles):
  # The integer zero point shifts the grid by up to half a step against
  # [min, max]: the range's ends land in [qmin - 1/2, qmax + 1/2].
  x = _spread(shape, hash((qtype, shape, 1)) % 2**32)
  x[..., 0] += np.abs(x).max() * 0.3  # one-sided groups too
  q = _quantize(jnp.asarray(x), qarray.QuantizeSpec(
      qtype=qtype, channelwise_axes=cw, tiled_axes=tiles, calibration="minmax"))
  assert _mask_of(q, x).all()


def _bound_case(name, x, cw, tiles):
  """(Calibration, its float64 bound per element) of a calibration that clips."""
  from test_qarray import np_expand, np_group_reduce
  if name == "fixed":
    return qarray.Calibration(method="fixed", bound=0.75), np.full(x.shape, 0.75)
  if name == "fixed_x0.5":
    return qarray.Calibration(method="fixed", bound=2.0, multiplier=0.5), np.full(x.shape, 1.0)
  if name == "p90":
    p90 = np_group_reduce(np.abs(x), cw, tiles, lambda v, axis, keepdims: np.percentile(
        v, 90.0, axis=axis, keepdims=keepdims))
    return qarray.Calibration(method="percentile", percentile=90.0), np_expand(p90, x.shape)
  mean = np_group_reduce(np.abs(x), cw, tiles, np.mean)
  return qarray.Calibration(method="absmean"), np_expand(mean, x.shape)


@pytest.mark.parametrize("cal", ["fixed", "fixed_x0.5", "p90", "absmean"])
@pytest.mark.parametrize("qtype", ["int8", "int4", "ternary", "binary", "float8_e4m3fn"])
@pytest.mark.parametrize("shape,cw,tiles", [((16, 64), (0,), {1: 16}), ((40, 48), (1,), {})])
@pytest.mark.thin(4)
def test_clipped_ste_masks_what_is_beyond_a_clipping_bound(qtype, shape, cw, tiles, cal):
  x = _rand(shape, 21)
  # Elements exactly at the bound (a fixed bound of 0.75 or 1.0) are inside.
  x.flat[::7] = np.float32(0.75) * np.sign(x.flat[::7])
  x.flat[3::11] = 1.0
  cal, bound = _bound_case(cal, x, cw, tiles)
  q = _quantize(jnp.asarray(x), qarray.QuantizeSpec(
      qtype=qtype, channelwise_axes=cw, tiled_axes=tiles, calibration=cal))
  m = _mask_of(q, x)
  a = np.abs(x.astype(np.float64))
  inside, outside = a <= bound * (1 - 2.0 ** -18), a > bound * (1 + 2.0 ** -18)
  assert inside.any() and outside.any()
  assert m[inside].all() and not m[outside].any()
  if cal.method == "fixed":
    assert m[a == bound].all() and (a == bound).any()


@pytest.mark.parametrize("qtype", ["int8", "int4", "int2"])
def test_clipped_ste_minmax_with_a_narrowed_range_masks_beyond_it(qtype):
  shape, cw, tiles = (16, 64), (0,), {1: 32}
  x = _rand(shape, 22) + 0.3
  cal = qarray.Calibration(method="minmax", multiplier=0.5)
  q = _quantize(jnp.asarray(x), qarray.QuantizeSpec(
      qtype=qtype, channelwise_axes=cw, tiled_axes=tiles, calibration=cal))
  m = _mask_of(q, x)
  from test_qarray import np_expand, np_group_reduce
  lo = np_expand(np.minimum(np_group_reduce(x, cw, tiles, np.min), 0) * 0.5, shape)
  hi = np_expand(np.maximum(np_group_reduce(x, cw, tiles, np.max), 0) * 0.5, shape)
  s = np_expand(np.asarray(q.scale, np.float64), shape)
  # Inside the calibrated range: passes. Beyond it by more than a step (the
  # grid's ends are within half a step of the range's): masked.
  inside = (x >= lo) & (x <= hi)
  outside = (x < lo - s) | (x > hi + s)
  assert inside.any() and outside.any()
  assert m[inside].all() and not m[outside].any()


def test_clipped_ste_with_scales_beyond_2_to_126():
  # 1 / scale is subnormal there (flushed to 0): the test must not divide.
  x = jnp.array([[3e38, 5e37, -1e38, -1.5e38, 0.0]])
  q = qarray.quantize(x, qarray.QuantizeSpec(
      qtype="binary", calibration=qarray.Calibration(method="fixed", bound=1e38)))
  assert float(q.scale[0, 0]) == np.float32(1e38)
  np.testing.assert_array_equal(_mask_of(q, np.asarray(x)), [[False, True, True, False, True]])
