"""qtrain.core.qarray over the whole float32 range: finite data give finite scales and values.

Data: signed powers of ten from 1e-37 to 3e38 (and float32's max), mixed within
scale groups and across them. Every qtype x calibration, channelwise and tiled.

Reference (float64, ``s`` = the QArray's scale, ``y = x / s``):
  * scale: ``clip(bound * multiplier / qmax, TINY, max_scale(qmax))`` with the
    float64 bound (rtol 1e-5: float32 reductions of <= 64 terms).
  * integer-like qtypes: the value is ``clip(round(y), qmin, qmax) * s`` in
    float32, exactly (ties aside, where float32's y may round the other way);
    inside the range (|y| <= qmax) that is within ``s / 2 + FP32_SLACK * |x|``.
  * binary: ``sign(x) * s`` exactly (sign(0) = +1).
  * fp8: inside the range, |x - deq| <= 2^-(nmant + 1) |x| for a normal y,
    half the smallest subnormal step times s below; beyond it, +-qmax * s.
  * minmax: ``(clip(round(y + zp), qmin, qmax) - zp) * s`` exactly (ties
    aside), within ``s / 2`` of every value of the range, or within one step
    where the grid's end would otherwise pass the float32 limit (the zero point
    is an integer, so one end may overshoot the range by half a step).
"""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests import _strategies as S
from qtrain.core import qarray, qtypes

F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)
FP32_SLACK = 2.0 ** -21
TIE = 1e-4  # |frac(y) - 1/2| below this: float32's y may round either way

# Value-set and MX qtypes (blocks of 32, codes into a table): tests/core/test_lut_mx_qtypes.py.
ALL_QTYPES = list(S.QTYPES)
LAYOUTS = [((0,), {}), ((0,), {1: 16})]
CALS = {
    "absmax": qarray.Calibration(method="absmax"),
    "absmean": qarray.Calibration(method="absmean"),
    "rms": qarray.Calibration(method="rms"),
    "rms_x3": qarray.Calibration(method="rms", multiplier=3.0),  # bound * 3 may pass float32's max
    "percentile": qarray.Calibration(method="percentile", percentile=90.0),
    "fixed": qarray.Calibration(method="fixed", bound=1e30),
    "minmax": qarray.Calibration(method="minmax"),
}
CASES = [(q, c) for q in ALL_QTYPES for c in CALS
         if c != "minmax" or qtypes.get_qtype(q).kind == "int"]

_quantize = jax.jit(qarray.quantize, static_argnames=("spec",))


def _signed(rng, mag):
  return rng.choice([-1.0, 1.0], mag.shape) * mag


def extreme_data(seed: int) -> np.ndarray:
  """(8, 64) float32 rows of very different magnitudes (no zeros)."""
  rng = np.random.default_rng(seed)
  n = 64
  def decades(lo, hi, k=n):
    e = rng.integers(lo, hi + 1, k)
    return rng.uniform(1.0, 3.0, k) * 10.0 ** e.astype(np.float64)
  rows = [
      _signed(rng, decades(-37, 38)),                        # everything mixed
      _signed(rng, decades(37, 38)),                         # the top ...
      _signed(rng, decades(-37, -37)),                       # ... the bottom (bound / qmax < TINY)
      _signed(rng, decades(-21, -19)),                       # squares underflow
      _signed(rng, decades(19, 21)),                         # squares overflow
      decades(-37, 38),                                      # positive only (minmax lo = 0)
      -decades(30, 38),                                      # negative only
      rng.standard_normal(n),
  ]
  x = np.stack(rows)
  x[1, :4] = [3e38, -3e38, F32_MAX, -F32_MAX]
  x[0, 5], x[0, 37] = 3e38, -1e-37
  return np.clip(x, -F32_MAX, F32_MAX).astype(np.float32)


def np_groups(x, cw, tiles):
  """x (float64) as (..., groups) -> a view whose last axes are each group's values."""
  assert cw == (0,)
  if not tiles:
    return x[:, None, :]
  t = tiles[1]
  return x.reshape(x.shape[0], x.shape[1] // t, t)


def expand(s, shape, cw, tiles):
  s = s.reshape(shape[0], -1)
  return np.repeat(s, shape[1] // s.shape[1], axis=1)


def ref_bound(name, g):
  a = np.abs(g)
  method = CALS[name].method
  if method == "absmax":
    return a.max(-1)
  if method == "absmean":
    return a.mean(-1)
  if method == "rms":
    return np.sqrt((g * g).mean(-1))
  if method == "percentile":
    return np.percentile(a, CALS[name].percentile, axis=-1)
  return np.full(g.shape[:-1], CALS[name].bound)


@pytest.mark.parametrize("cw,tiles", LAYOUTS)
@pytest.mark.parametrize("qtype,cal", CASES)
@pytest.mark.thin(4)
def test_finite_data_of_any_magnitude_give_finite_scales_and_values_within_budget(
    qtype, cal, cw, tiles):
  qt = qtypes.get_qtype(qtype)
  x = extreme_data(zlib.crc32(repr((qtype, cal, tiles)).encode()))
  q = _quantize(jnp.asarray(x), qarray.QuantizeSpec(
      qtype=qtype, channelwise_axes=cw, tiled_axes=tiles, calibration=CALS[cal]))
  scale = np.asarray(q.scale, np.float64)
  deq32 = np.asarray(qarray.dequantize(q))
  deq = deq32.astype(np.float64)
  assert np.all(np.isfinite(scale)) and np.all(scale >= TINY), scale
  assert np.all(np.isfinite(deq32))
  x64 = x.astype(np.float64)
  g = np_groups(x64, cw, tiles)
  s = expand(scale, x.shape, cw, tiles)
  s32 = expand(np.asarray(q.scale), x.shape, cw, tiles)

  if qt.kind != "int" or cal != "minmax":
    mult = CALS[cal].multiplier
    # Capped so the largest code times the scale is finite: qmax when nothing
    # clips (absmax), else also qmin (-128 for int8).
    codes = qt.qmax if cal == "absmax" else max(qt.qmax, -qt.qmin)
    want = np.clip(ref_bound(cal, g) * mult / qt.qmax, TINY, qarray.max_scale(codes))
    np.testing.assert_allclose(scale.reshape(want.shape), want, rtol=1e-5)

  y = x64 / s
  if cal == "minmax":
    _check_minmax(q, x64, g, s, s32, deq, y, cw, tiles)
  elif qt.kind == "binary":
    np.testing.assert_array_equal(deq32, np.where(x >= 0, 1.0, -1.0).astype(np.float32) * s32)
  elif qt.is_float:
    fi = ml_dtypes.finfo(qt.compute_dtype)
    inside = np.abs(y) <= qt.qmax
    normal = np.abs(y) >= 2.0 ** fi.minexp
    bound = np.where(normal, 2.0 ** -(fi.nmant + 1) * np.abs(x64),
                     2.0 ** (fi.minexp - fi.nmant - 1) * s) + FP32_SLACK * np.abs(x64)
    assert np.all((np.abs(deq - x64) <= bound)[inside])
    clip = np.sign(x64) * (np.float32(qt.qmax) * s32).astype(np.float64)
    np.testing.assert_array_equal(deq[~inside], clip[~inside])
  else:
    _check_int(qt, x64, s, s32, deq, y)
  if cal == "absmax":
    # Nothing clips: the element that set the scale is inside.
    assert np.all(np.abs(y) <= qt.qmax * (1 + 2.0 ** -20))


def _check_int(qt, x64, s, s32, deq, y):
  code = np.clip(np.round(y), qt.qmin, qt.qmax)
  tie = np.abs(np.abs(y - np.floor(y)) - 0.5) < TIE
  want = (code.astype(np.float32) * s32).astype(np.float64)
  np.testing.assert_array_equal(deq[~tie], want[~tie])
  inside = np.abs(y) <= qt.qmax
  assert np.all((np.abs(deq - x64) <= s / 2 + FP32_SLACK * np.abs(x64))[inside])


def _check_minmax(q, x64, g, s, s32, deq, y, cw, tiles):
  qt = q.qtype
  zp = expand(np.asarray(q.zero_point, np.float64), x64.shape, cw, tiles)
  assert np.all(zp == np.round(zp)) and np.all((zp >= qt.qmin) & (zp <= qt.qmax))
  n = qt.qmax - qt.qmin
  lo, hi = np.minimum(g.min(-1), 0.0), np.maximum(g.max(-1), 0.0)
  want = np.clip((hi / n - lo / n), TINY, qarray.max_scale(-qt.qmin))
  sg = s[:, ::s.shape[1] // want.shape[1]].reshape(want.shape)
  capped = sg >= qarray.max_scale(-qt.qmin) * (1 - 2.0 ** -17)  # n steps through 0 must fit
  np.testing.assert_allclose(sg[~capped], want[~capped], rtol=1e-5)
  assert np.all(want[capped] >= sg[capped])
  yz = y + zp
  code = np.clip(np.round(yz), qt.qmin, qt.qmax)
  tie = np.abs(np.abs(yz - np.floor(yz)) - 0.5) < TIE
  exact = ((code - zp).astype(np.float32) * s32).astype(np.float64)
  np.testing.assert_array_equal(deq[~tie], exact[~tie])
  # The grid (qmin - zp .. qmax - zp) * s: finite ends, every value between
  # them within half a step, and each end within half a step beyond its end
  # of the range, or, where that would pass float32's max, within one step
  # of it (the scale cap and the end guard keep 2**-17 of headroom).
  e_lo = ((qt.qmin - zp).astype(np.float32) * s32).astype(np.float64)
  e_hi = ((qt.qmax - zp).astype(np.float32) * s32).astype(np.float64)
  assert np.all(np.isfinite(e_lo) & np.isfinite(e_hi))
  err = np.abs(deq - x64)
  slack = FP32_SLACK * np.abs(x64) + 2.0 ** -15 * s  # y + zp rounded in float32 (|.| < 2^8)
  on_grid = (x64 >= e_lo - s / 2) & (x64 <= e_hi + s / 2)
  assert np.all((err <= s / 2 + slack)[on_grid])
  reach = F32_MAX * (1 - 2.0 ** -17) - s
  hi_e, lo_e = expand(hi, x64.shape, cw, tiles), expand(lo, x64.shape, cw, tiles)
  assert np.all(e_hi >= np.minimum(hi_e - s / 2, reach) - 2.0 ** -20 * np.abs(e_hi))
  assert np.all(e_lo <= np.maximum(lo_e + s / 2, -reach) + 2.0 ** -20 * np.abs(e_lo))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "int4", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("method", ["uniform", "low_bit_uniform", "low_bit_hash"])
def test_stochastic_rounding_at_the_extremes_gives_a_neighbour(qtype, method):
  # With the floored / capped scales: y reaches the top of the fp8 range (the
  # absmax element lands on qmax, its neighbour above is clipped away) and the
  # fp8 subnormal region (tiny elements of a group with a huge one).
  qt = qtypes.get_qtype(qtype)
  x = extreme_data(5)
  spec = qarray.QuantizeSpec(qtype=qtype, channelwise_axes=(0,), tiled_axes={1: 16},
                             stochastic_rounding=method)
  q = qarray.quantize(jnp.asarray(x), spec, key=jax.random.key(3))
  deq = np.asarray(qarray.dequantize(q), np.float64)
  assert np.all(np.isfinite(deq))
  s = expand(np.asarray(q.scale, np.float64), x.shape, (0,), {1: 16})
  y = x.astype(np.float64) / s
  v = np.asarray(q.qvalue.astype(jnp.float32), np.float64)
  # The kernel's y is float32's x / s: a few float32 ulps from the float64 y.
  y_lo = np.minimum(y * (1 - FP32_SLACK), y * (1 + FP32_SLACK))
  y_hi = np.maximum(y * (1 - FP32_SLACK), y * (1 + FP32_SLACK))
  if qt.is_float:
    grid = np.unique(np.arange(256, dtype=np.uint8).view(qt.compute_dtype).astype(np.float64))
    grid = grid[np.isfinite(grid)]
    below = grid[np.clip(np.searchsorted(grid, y_lo, side="right") - 1, 0, len(grid) - 1)]
    above = grid[np.clip(np.searchsorted(grid, y_hi, side="left"), 0, len(grid) - 1)]
  else:
    below = np.clip(np.floor(y_lo), qt.qmin, qt.qmax)
    above = np.clip(np.ceil(y_hi), qt.qmin, qt.qmax)
  # A neighbour of y on the qtype's grid: never further, never non-finite.
  assert np.all((v >= below) & (v <= above))
  assert np.all(np.abs(v - y)[np.abs(y) <= qt.qmax] <= (above - below)[np.abs(y) <= qt.qmax])
  assert np.abs(v).max() <= qt.qmax and (np.abs(v) == qt.qmax).any()


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_passed_in_scales_zero_subnormal_huge_nonfinite(qtype):
  # Rows: around 1e-20, around 1e-37, every magnitude (with tiny values whose
  # y underflows), 1e37..3e38.
  x = jnp.asarray(extreme_data(6)[[3, 2, 0, 1]])
  s = jnp.array([[0.0], [1e-40], [3e38], [1e-30]], jnp.float32)
  qt = qtypes.get_qtype(qtype)
  q = qarray.quantize_with_scale(x, qtype, s)
  deq = np.asarray(q.dequantize())
  # 0 and subnormal (XLA reads it as 0): the group is zero, exactly.
  np.testing.assert_array_equal(np.asarray(q.scale)[:2], 0.0)
  np.testing.assert_array_equal(deq[:2], 0.0)
  assert np.all(np.isfinite(deq))
  # 3e38 (its reciprocal is subnormal), lowered to max_scale of the largest
  # code: x / s is right, e.g. binary's signs, also where x / s underflows.
  s2 = float(q.scale[2, 0])
  assert s2 == np.float32(min(3e38, qarray.max_scale(max(qt.qmax, -qt.qmin))))
  y = np.asarray(x, np.float64)[2] / s2
  if qt.kind == "binary":
    np.testing.assert_array_equal(np.asarray(q.qvalue)[2], np.where(y >= 0, 1, -1))
  elif not qt.is_float:
    code = np.clip(np.round(y), qt.qmin, qt.qmax)
    tie = np.abs(np.abs(y - np.floor(y)) - 0.5) < TIE
    np.testing.assert_array_equal(np.asarray(q.qvalue)[2][~tie], code[~tie])
  # 1e-30 against values of 1e37..3e38: |x| / s passes float32's max (inf)
  # and saturates to the end of the range like any value beyond the bound.
  big = np.abs(np.asarray(x)[3]) > 1e-30 * qt.qmax
  assert big.all() and (np.abs(np.asarray(x, np.float64)[3]) / 1e-30 > F32_MAX).any()
  want = np.sign(np.asarray(x)[3]) * np.float32(qt.qmax) * np.float32(1e-30)
  if qt.kind == "int":
    want = np.where(np.asarray(x)[3] < 0, np.float32(qt.qmin) * np.float32(1e-30), want)
  np.testing.assert_array_equal(deq[3][big], want[big])
  for bad in (np.nan, np.inf):
    q = qarray.quantize_with_scale(x, qtype, s.at[1, 0].set(bad))
    deq = np.asarray(q.dequantize())
    assert np.all(np.isnan(deq[1])) and np.all(np.isfinite(deq[[0, 2, 3]]))


def test_max_scale_is_the_largest_scale_with_finite_codes():
  # (3.4028235e38 / 127) * 127 is inf in float32: the scale must be capped.
  with np.errstate(over="ignore"):
    assert np.isinf(np.float32(F32_MAX / 127) * np.float32(127))
  for codes in (1, 2, 3, 7, 8, 15, 127, 128, 255, 448.0, 57344.0):
    m = np.float32(qarray.max_scale(codes))
    assert np.isfinite(m * np.float32(codes))
    with np.errstate(over="ignore"):
      assert np.isinf(np.nextafter(m, np.float32(np.inf)) * np.float32(codes))


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_absmax_of_float32_max_comes_back_finite_and_exact(qtype):
  x = jnp.full((1, 8), F32_MAX).at[0, 1].set(-F32_MAX)
  deq = np.asarray(qarray.fake_quantize(x, qarray.QuantizeSpec(qtype=qtype)))
  assert np.all(np.isfinite(deq))
  np.testing.assert_allclose(deq, np.asarray(x), rtol=2.0 ** -20)


@pytest.mark.parametrize("method", [m for m in qarray.CALIBRATION_METHODS if m != "fixed"])
@pytest.mark.parametrize("size", [7, 4200, 65536])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("reduced_axis", [1, 0], ids=["rows", "columns"])
@pytest.mark.thin(4)
def test_nonfinite_value_in_a_large_group_makes_its_group_nan(method, size, bad, reduced_axis):
  """A max reduction does not carry NaN reliably (XLA's CPU reduce-max dropped it from 4200
  values): the group's NaN scale must come from the data, at any group size, whether the group
  runs along the minor axis (activations) or the leading one (a weight's per-channel scale)."""
  qt = "int8"
  x = np.random.default_rng(size).standard_normal((2, size)).astype(np.float32)
  x[0, size // 3] = bad
  channel = 1 - reduced_axis
  if reduced_axis == 0:
    x = np.ascontiguousarray(x.T)
  cal = (qarray.Calibration(method=method, percentile=99.0) if method == "percentile"
         else qarray.Calibration(method=method))
  spec = qarray.QuantizeSpec(qtype=qt, channelwise_axes=(channel,), calibration=cal)
  q = jax.jit(lambda v: qarray.quantize(v, spec))(jnp.asarray(x))
  scale = np.moveaxis(np.asarray(q.scale), channel, 0).reshape(2)
  deq = np.moveaxis(np.asarray(qarray.dequantize(q)), channel, 0)
  assert np.isnan(scale[0]) and np.isnan(deq[0]).all()
  assert np.isfinite(scale[1]) and np.isfinite(deq[1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "int7", "int5", "int4", "int3", "int2"])
def test_minmax_span_near_the_smallest_normal_is_not_floored(qtype):
  """minmax's span / (qmax - qmin) near float32's smallest normal: each end divided on its own
  is subnormal (flushed to zero by XLA), so the scale must come from the whole span. Both ends at
  0.9 * TINY * n give a scale of 1.8 * TINY, not TINY."""
  qt = qtypes.get_qtype(qtype)
  n = qt.qmax - qt.qmin
  tiny = float(np.finfo(np.float32).tiny)
  end = np.float32(0.9 * tiny * n)
  x = jnp.asarray(np.array([-end, end, 0.25 * end], np.float32))
  q = qarray.quantize(x, qarray.QuantizeSpec(qtype=qtype, calibration="minmax"))
  want = (float(end) - float(-end)) / n
  assert abs(float(q.scale.reshape(())) - want) <= 4 * 2.0 ** -24 * want, (q.scale, want)
