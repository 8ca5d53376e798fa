"""Asymmetric static activation scales: a passed-in (scale, zero point) in the QT ops, and
QtRule(act_static_scale=True, act_calibration_method="minmax") through the provider."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain.core import qarray
from qtrain.ops import config as C
from qtrain.ops import conv_general_qt, dot_general_qt

DN = (((1,), (0,)), ((), ()))


def _ref_minmax(lo, hi, qmin=-128, qmax=127):
  """float64 reference of the int8 minmax grid: scale = (hi - lo) / 255, zero point =
  qmin - round(lo / scale)."""
  lo, hi = min(lo, 0.0), max(hi, 0.0)
  s = (hi - lo) / (qmax - qmin)
  return s, float(np.clip(qmin - np.round(lo / s), qmin, qmax))


def _fake(x, s, z, qmin=-128, qmax=127):
  q = np.clip(np.round(np.asarray(x, np.float64) / s) + z, qmin, qmax)
  return (q - z) * s


@pytest.mark.slow
def test_minmax_scale_matches_reference_and_calibrate():
  r = np.random.default_rng(0)
  for lo, hi in ((-0.7, 3.1), (0.5, 2.0), (-4.0, -1.0), (-1e-3, 5e4)):
    s, z = qarray.minmax_scale(jnp.float32(lo), jnp.float32(hi), "int8")
    rs, rz = _ref_minmax(lo, hi)
    assert abs(float(s) - rs) <= 2e-7 * rs and float(z) == rz, (lo, hi, float(s), rs, z, rz)
    # calibrate(minmax) of data with those ends gives the same scale and zero point.
    x = jnp.asarray(r.uniform(lo, hi, (64,)).astype(np.float32)).at[:2].set(jnp.float32([lo, hi]))
    cs, cz = qarray.calibrate(x, qarray.QuantizeSpec(qtype="int8", calibration="minmax"))
    assert float(cs.reshape(())) == float(s) and float(cz.reshape(())) == float(z)
  with pytest.raises(ValueError, match="float8_e4m3fn.*integer"):
    qarray.minmax_scale(jnp.float32(-1), jnp.float32(1), "float8_e4m3fn")


@pytest.mark.slow
def test_given_zero_point_dot_and_conv():
  r = np.random.default_rng(1)
  x = r.uniform(-0.5, 3.0, (8, 16)).astype(np.float32)
  w = r.standard_normal((16, 4)).astype(np.float32)
  s, z = _ref_minmax(-0.5, 3.0)
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), implementation="xla")
  y = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, cfg, lhs_scale=jnp.float32(s),
                     lhs_zero_point=jnp.float32(z))
  ref = _fake(x, np.float32(s), z) @ w.astype(np.float64)
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5)
  # Within half a step of the float product (nothing clips: the grid spans the data).
  np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - x.astype(np.float64) @ w),
                               np.broadcast_to((s / 2) * np.abs(w).sum(0) * (1 + 1e-5) + 1e-5,
                                               (8, 4)))
  # The zero point matters: without it the grid is symmetric and the values above it clip.
  y0 = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, cfg, lhs_scale=jnp.float32(s))
  assert not np.allclose(y0, y, atol=1e-3)
  # Convolution: the same numbers as im2col by hand.
  xc = jnp.asarray(r.uniform(-0.5, 3.0, (2, 6, 6, 3)).astype(np.float32))
  k = jnp.asarray(r.standard_normal((3, 3, 3, 4)).astype(np.float32))
  cdn = ("NHWC", "HWIO", "NHWC")
  yc = conv_general_qt(xc, k, (1, 1), "VALID", dimension_numbers=cdn,
                       config=C.ConvGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"),
                                                    implementation="xla"),
                       lhs_scale=jnp.float32(s), lhs_zero_point=jnp.float32(z))
  refc = jax.lax.conv_general_dilated(jnp.asarray(_fake(xc, np.float32(s), z), jnp.float32), k,
                                      (1, 1), "VALID", dimension_numbers=cdn,
                                      precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(yc, refc, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_given_zero_point_gradients():
  r = np.random.default_rng(2)
  x = jnp.asarray(r.uniform(-0.5, 3.0, (8, 16)).astype(np.float32))
  w = jnp.asarray(r.standard_normal((16, 4)).astype(np.float32))
  s, z = _ref_minmax(-0.5, 2.0)  # values above 2 clip
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8", estimator="clipped_ste"),
                             implementation="xla")
  f = lambda x, s, z: dot_general_qt(x, w, DN, cfg, lhs_scale=s, lhs_zero_point=z).sum()
  gx, gs, gz = jax.grad(f, (0, 1, 2))(x, jnp.float32(s), jnp.float32(z))
  assert float(gz) == 0.0
  # clipped STE: the gradient passes where x lies on the grid's range, is 0 where it clipped.
  lo_edge, hi_edge = (-128 - z) * s, (127 - z) * s
  inside = (np.asarray(x) >= lo_edge) & (np.asarray(x) <= hi_edge)
  assert (~inside).any() and inside.any()
  np.testing.assert_allclose(np.asarray(gx), np.where(inside, np.asarray(w).sum(1), 0.0),
                             rtol=1e-6)
  # LSQ's gradient of the scale on the shifted grid: sum g * (q - z - x / s), (q - z) clipped.
  q = np.clip(np.round(np.asarray(x, np.float64) / s) + z, -128, 127)
  v = np.where(inside, (q - z) - np.asarray(x) / s, q - z)
  g = np.broadcast_to(np.asarray(w).sum(1), x.shape)
  ref = (g * v).sum() / np.sqrt(x.size * 127)
  np.testing.assert_allclose(float(gs), ref, rtol=1e-4)
  with pytest.raises(ValueError, match="lhs_zero_point was given without lhs_scale"):
    dot_general_qt(x, w, DN, cfg, lhs_zero_point=jnp.float32(z))
  with pytest.raises(ValueError, match="zero point needs an integer qtype"):
    dot_general_qt(x, w, DN, C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="float8_e4m3fn")),
                   lhs_scale=jnp.float32(s), lhs_zero_point=jnp.float32(z))


class _Dense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(5, name="d")(x)


@pytest.mark.slow
@pytest.mark.parametrize("averaging", ["mean", "ema"])
def test_rule_static_minmax_calibrates_and_freezes(averaging):
  rule = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True,
                       act_calibration_method="minmax", act_static_scale_averaging=averaging,
                       act_static_scale_ema_decay=0.5)
  qm = qtrain.quantize_model(_Dense(), qtrain.QtProvider([rule]))
  r = np.random.default_rng(3)
  batches = [jnp.asarray(r.uniform(a, b, (10, 12)).astype(np.float32))
             for a, b in ((-1.0, 3.0), (-0.5, 2.0), (0.2, 4.0))]
  v = qm.init(jax.random.key(0), batches[0])
  stats = v["quant_stats"]
  lo = hi = None
  for i, xb in enumerate(batches):
    _, nv = qm.apply({**v, "quant_stats": stats}, xb, mutable="quant_stats")
    stats = nv["quant_stats"]
    blo, bhi = min(float(xb.min()), 0.0), max(float(xb.max()), 0.0)
    if i == 0:
      lo, hi = blo, bhi
    elif averaging == "mean":
      lo, hi = lo + (blo - lo) / (i + 1), hi + (bhi - hi) / (i + 1)
    else:
      lo, hi = 0.5 * lo + 0.5 * blo, 0.5 * hi + 0.5 * bhi
  st = stats["d"]
  np.testing.assert_allclose([float(st["dot_general0_act_static_min"]),
                              float(st["dot_general0_act_static_max"])], [lo, hi], rtol=1e-6)
  assert float(st["dot_general0_act_static_count"]) == 3
  # Frozen (not mutable): a new batch uses the stored ends, not its own.
  x = jnp.asarray(r.uniform(-3.0, 6.0, (4, 12)).astype(np.float32))
  y = qm.apply({**v, "quant_stats": stats}, x)
  s, z = _ref_minmax(lo, hi)
  k, b = (np.asarray(v["params"]["d"][n], np.float64) for n in ("kernel", "bias"))
  ks = np.abs(k).max(0) / 127
  kq = np.clip(np.round(k / ks), -127, 127) * ks
  ref = _fake(np.asarray(x), np.float32(s), z) @ kq + b
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-4, atol=1e-4)


def test_rule_static_minmax_validation():
  qtrain.QtRule(act_qtype="int4", act_static_scale=True, act_calibration_method="minmax,0.9")
  with pytest.raises(ValueError, match="act_calibration_method='minmax'.*integer"):
    qtrain.QtRule(act_qtype="float8_e4m3fn", act_static_scale=True,
                  act_calibration_method="minmax")
  with pytest.raises(ValueError, match="act_learnable_scale=True with act_calibration_method"):
    qtrain.QtRule(act_qtype="int8", act_learnable_scale=True, act_calibration_method="minmax")


@pytest.mark.slow
def test_freeze_of_a_static_minmax_scale_raises_naming_the_layer():
  # A frozen op takes no zero point: freezing must say so, not report missing state.
  from qtrain import freeze
  rule = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True,
                       act_calibration_method="minmax")
  provider = qtrain.QtProvider([rule])
  qm = qtrain.quantize_model(_Dense(), provider)
  x = jnp.asarray(np.random.default_rng(4).uniform(-1.0, 3.0, (10, 12)).astype(np.float32))
  v = qm.init(jax.random.key(0), x)
  _, stats = qm.apply(v, x, mutable="quant_stats")
  with pytest.raises(NotImplementedError, match=r"'d .*asymmetric static input scale.*'minmax'.*'absmax'"):
    freeze.freeze({**v, **stats}, provider)
