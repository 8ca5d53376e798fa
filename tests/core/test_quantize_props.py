"""Property tests of qtrain.core.quantize / dequantize against float64 (issue 16).

For every qtype x calibration x grid (channelwise, tiled, per tensor) x input
dtype, on random shapes (size-0 axes included) and magnitudes from 1e-30 to
1e30 (and the edges of float32), with NaN/Inf planted:

* every finite group's scale is finite, >= the smallest normal float32 and
  equals its calibration's definition (tests/_props_ref.calibration_scales);
  all-zero groups: scale 1 (binary 0); a group holding NaN/Inf dequantizes to
  NaN without touching the other groups;
* per element, |x_hat - clip(x)| <= half a step (integers, ternary), the fp8
  rounding bound, or exactly sign(x) * s (binary), plus the float32 roundings
  (tests/_props_ref.element_budget); stochastic rounding lands on one of the
  two neighbours of x / s, and is unbiased (a 6-sigma test on a fixed seed).
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import _props_ref as R
import _strategies as S
from qtrain.core import qarray, qtypes

FAST = hypothesis.settings(max_examples=60, deadline=None, derandomize=True, database=None,
                           suppress_health_check=list(hypothesis.HealthCheck))
DEEP = S.deep(FAST, 150)


@functools.partial(jax.jit, static_argnames=("spec",))
def _quantize(x, key, *, spec):
  q = qarray.quantize(x, spec, key=key)
  return q, qarray.dequantize(q)


@st.composite
def quantize_cases(draw, *, max_rank: int, max_size: int):
  dtype = draw(st.sampled_from(S.FLOAT_DTYPES))
  shape = draw(S.shapes(max_rank=max_rank, max_size=max_size))
  v = draw(S.values(nonfinite=True))
  qt = draw(st.sampled_from(S.QTYPES))
  cal = draw(S.calibrations(qt, v.nominal(dtype)))
  cw, tiles = draw(S.grids(shape))
  sr = draw(st.sampled_from([None, None, "uniform", "low_bit_uniform", "low_bit_hash"]))
  return dtype, shape, v, qarray.QuantizeSpec(qtype=qt, channelwise_axes=cw, tiled_axes=tiles,
                                              calibration=cal, stochastic_rounding=sr)


def _fp8_grid(qt: qtypes.QType) -> np.ndarray:
  """Every finite value of an fp8 qtype, sorted."""
  v = np.arange(256, dtype=np.uint8).view(qt.compute_dtype).astype(np.float64)
  return np.unique(v[np.isfinite(v)])


def _neighbours(y: np.ndarray, qt: qtypes.QType) -> tuple[np.ndarray, np.ndarray]:
  """The representable values just below and above y (y itself when on the grid)."""
  if qt.is_float:
    grid = _fp8_grid(qt)
    i = np.clip(np.searchsorted(grid, y, side="right") - 1, 0, len(grid) - 1)
    lo = grid[i]
    hi = np.where(lo == y, lo, grid[np.minimum(i + 1, len(grid) - 1)])
    return lo, hi
  return np.floor(y), np.ceil(y)


def check_quantize(dtype, shape, v, spec) -> None:
  qt: qtypes.QType = spec.qtype
  cal = spec.calibration
  sr = spec.stochastic_rounding
  x = S.make(v, shape, dtype)
  key = jax.random.key(v.seed) if sr else None
  q, deq = _quantize(jnp.asarray(x), key, spec=spec)
  cw, tiles = R.normalize_grid(shape, spec.channelwise_axes, spec.tiled_axes)
  scale_shape = tuple(n // tiles[a] if a in tiles else (n if a in cw else 1)
                      for a, n in enumerate(shape))
  hypothesis.note(f"x = {x!r}")
  hypothesis.note(f"scale = {np.asarray(q.scale)!r}; qvalue = {np.asarray(q.qvalue)!r}")
  assert q.qvalue.shape == shape and q.qvalue.dtype == qt.compute_dtype
  assert q.scale.dtype == jnp.float32 and q.scale.shape == scale_shape, q.scale.shape
  assert deq.shape == shape and deq.dtype == jnp.float32
  x64, s, d = R.f64(x), R.f64(q.scale), R.f64(deq)
  zp = None if q.zero_point is None else R.f64(q.zero_point)
  assert (zp is not None) == cal.is_asymmetric

  # --- scales of finite groups
  finite_g = R.group_reduce(np.isfinite(x64), cw, tiles, np.all)
  zero_g = R.group_reduce(x64 == 0, cw, tiles, np.all)
  xs = np.where(np.isfinite(x64), x64, 0.0)
  s_exp, tol, zero_bound = R.calibration_scales(xs, qt, cal, cw, tiles)
  if cal.method == "fixed":  # no data dependence, except binary's all-zero groups (item 14)
    s_exp = np.where(zero_g & (qt.kind == "binary"), 0.0, s_exp)
  for idx in zip(*np.nonzero(finite_g)):
    si, ei = s[idx], s_exp[idx]
    where = f"group {tuple(int(i) for i in idx)} of scale shape {scale_shape}"
    assert np.isfinite(si), f"{where}: finite data, scale {si}"
    if zero_g[idx] and (cal.method != "fixed" or qt.kind == "binary"):
      assert si == ei, f"{where}: all-zero group has scale {si}, expected {ei}"
      continue
    if zero_bound[idx] and qt.kind == "binary":
      # A zero bound on data that is not all zero (a low percentile of a
      # mostly-zero group): binary has no zero code, so scale 0 would zero
      # values that are not; the contract asks for a usable scale.
      assert si >= R.TINY32, f"{where}: binary scale {si} for a group that is not all zero"
      continue
    assert si >= R.TINY32 or (zero_bound[idx] and si == ei), f"{where}: scale {si} < TINY32"
    assert abs(si - ei) <= tol[idx] * ei, (
        f"{where}: scale {si!r}, calibration {cal} gives {ei!r} (rel. err "
        f"{abs(si - ei) / ei:.3g} > {tol[idx]:.3g})")

  # --- dequantized values
  finite_e = R.expand(finite_g, shape)
  assert np.all(np.isnan(d[~finite_e])), "a group holding NaN/Inf must dequantize to NaN"
  if not finite_e.any():
    return
  assert np.all(np.isfinite(d[finite_e])), "finite data must dequantize to finite values"
  se = R.expand(s, shape)[finite_e]
  xe, de = x64[finite_e], d[finite_e]
  qv = R.f64(q.qvalue)[finite_e]
  ze = None if zp is None else R.expand(zp, shape)[finite_e]
  if ze is not None:
    zg = zp[finite_g]
    assert np.all(zg == np.round(zg)) and np.all((zg >= qt.qmin) & (zg <= qt.qmax)), zg
    # The range [(qmin - zp) s, (qmax - zp) s] must cover [min(x, 0), max(x, 0)] * multiplier
    # up to half a step (zp is rounded), else values inside it would be clipped.
    m = cal.multiplier
    lo = np.minimum(R.group_reduce(xs, cw, tiles, lambda v, axis, keepdims: np.min(
        v, axis=axis, keepdims=keepdims, initial=0.0)), 0.0) * m
    hi = np.maximum(R.group_reduce(xs, cw, tiles, lambda v, axis, keepdims: np.max(
        v, axis=axis, keepdims=keepdims, initial=0.0)), 0.0) * m
    # Near the float32 limit the zero point moves one step inward (both ends stay finite):
    # the end there comes back within one step. A capped scale (the range exceeds what
    # 2**(bits-1) steps on each side can span in float32) covers what it can.
    f32max = float(np.finfo(np.float32).max)
    near = (np.abs(lo) + 2 * s >= f32max) | (np.abs(hi) + 2 * s >= f32max)
    slack = np.where(near, 1.0, 0.5) * s + 4 * R.U32 * (np.abs(lo) + np.abs(hi) + s * (np.abs(zp) + 1))
    capped = (hi - lo) / (qt.qmax - qt.qmin) > R.minmax_cap(qt) * (1 - 4 * R.U32)
    ok = (((qt.qmin - zp) * s <= lo + slack) & ((qt.qmax - zp) * s >= hi - slack)) | capped
    assert np.all(ok[finite_g]), "minmax range does not cover the data"
  if qt.kind == "binary":
    assert np.all(np.isin(qv, (-1.0, 1.0))), np.unique(qv)
    if sr:
      assert np.all(np.abs(de) == se), "binary values are -s or +s"
    else:
      bad = np.argwhere(de != np.where(xe >= 0, se, -se))
      assert not bad.size, f"binary: x_hat != sign(x) * s at {bad[:4].ravel().tolist()}"
    return
  if not qt.is_float:
    assert np.all(qv == np.round(qv)) and np.all((qv >= qt.qmin) & (qv <= qt.qmax)), np.unique(qv)
  if qt.kind == "ternary":
    assert np.all(np.isin(qv, (-1.0, 0.0, 1.0)))
  center, bound = R.element_budget(xe, se, ze, qt, stochastic=sr is not None)
  err = np.abs(de - center)
  bad = np.argwhere(err > bound).ravel()
  assert not bad.size, (
      f"{int(bad.size)} values outside the {qt.name} budget; e.g. x {xe[bad[0]]!r} -> x_hat "
      f"{de[bad[0]]!r} (scale {se[bad[0]]!r}, expected {center[bad[0]]!r} +- {bound[bad[0]]:.3g})")
  if sr:
    # One of the two neighbours of y = x / s (+ zp) after clipping, to float32 rounding of y.
    zz = 0.0 if ze is None else ze
    y = np.clip(xe / np.where(se == 0, 1, se) + zz, qt.qmin, qt.qmax)
    dy = 2 * R.U32 * (np.abs(y) + 1)
    lo, _ = _neighbours(y - dy, qt)
    _, hi = _neighbours(y + dy, qt)
    bad = np.argwhere((qv < lo) | (qv > hi)).ravel()
    assert not bad.size, (f"stochastic rounding of y = {y[bad[0]]!r} gave {qv[bad[0]]!r}, "
                          f"not in [{lo[bad[0]]!r}, {hi[bad[0]]!r}]")


def _spec(qtype, method="absmax", **kw):
  return qarray.QuantizeSpec(qtype=qtype, calibration=qarray.Calibration(method=method, **kw))


@hypothesis.settings(FAST, max_examples=50)
@hypothesis.given(case=quantize_cases(max_rank=3, max_size=6))
# Issue 16 item 7: rms squares in float32 (1e-20 underflows to a zero scale,
# 1e20 overflows to NaN), absmean / minmax overflow near the float32 maximum, a
# scale below the smallest normal float32 flushes its group to 0.
@hypothesis.example(case=("float32", (8,), S.Values(mode="tensor", exponent=-20), _spec("int8", "rms")))
@hypothesis.example(case=("float32", (8,), S.Values(mode="tensor", exponent=20), _spec("int8", "rms")))
@hypothesis.example(case=("float32", (64,), S.Values(mode="huge"), _spec("int8", "absmean")))
@hypothesis.example(case=("float32", (64,), S.Values(mode="huge"), _spec("int8", "minmax")))
@hypothesis.example(case=("float32", (4,), S.Values(mode="tiny"), _spec("int8")))
# Item 14: binary with a fixed bound on an all-zero group (sign(0) = +1).
@pytest.mark.slow
@hypothesis.example(case=("float32", (4,), S.Values(zeros=1.0), _spec("binary", "fixed", bound=1.0)))
def test_quantize_contract(case):
  check_quantize(*case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=quantize_cases(max_rank=4, max_size=16))
def test_quantize_contract_deep(case):
  check_quantize(*case)


# ----------------------------------------------------------------------------
# Stochastic rounding is unbiased.

N_SR = 1 << 16


@pytest.mark.parametrize("method", ["uniform", "low_bit_uniform", "low_bit_hash"])
@pytest.mark.parametrize("qtype", S.QTYPES)
@pytest.mark.thin(3)
def test_stochastic_rounding_unbiased(qtype, method):
  """mean((q - y) / step) over N values y spread over the range is 0 within
  6 sigma (sigma^2 = sum p (1 - p) / N^2, p the probability of rounding up)
  plus the documented bias: <= 1/512 of a step for low_bit_uniform (8-bit
  probabilities), and for uniform the float32 rounding of y + noise (<= 2 u
  (|y| + 1) in probability) and the 2^-23 noise resolution."""
  qt = qtypes.get_qtype(qtype)
  rng = np.random.default_rng(7)
  s = 2.0 ** -3  # a power of two: x / s is exact, so y is known exactly
  if qt.is_float:
    top = np.log2(qt.qmax)
    sub = R.fp8_steps(qt)[1]
    y = rng.choice([-1, 1], N_SR) * 2.0 ** rng.uniform(np.log2(sub), top, N_SR)
  else:
    y = rng.uniform(qt.qmin, qt.qmax, N_SR)
  y = y.astype(np.float32).astype(np.float64)
  x = (y * s).astype(np.float32)
  spec = qarray.QuantizeSpec(qtype=qt, calibration=qarray.Calibration(
      method="fixed", bound=float(s * qt.qmax)), stochastic_rounding=method)
  q, _ = _quantize(jnp.asarray(x), jax.random.key(11), spec=spec)
  assert float(q.scale.reshape(())) == s
  qv = R.f64(q.qvalue)
  if qt.kind == "binary":
    lo, hi = np.full_like(y, -1.0), np.full_like(y, 1.0)
    y = np.clip(y, -1, 1)
  else:
    lo, hi = _neighbours(y, qt)
  assert np.all((qv == lo) | (qv == hi)), "stochastic rounding left the two neighbours"
  step = np.where(hi > lo, hi - lo, 1.0)
  p = (y - lo) / step
  d = (qv - y) / step
  sigma = np.sqrt(np.sum(p * (1 - p))) / N_SR
  bias = 1 / 512 if method.startswith("low_bit") else float(np.mean(2 * R.U32 * (np.abs(y) + 1) / step)) + 2.0 ** -23
  assert abs(d.mean()) <= 6 * sigma + bias, (d.mean(), sigma, bias)


# ----------------------------------------------------------------------------
# The value-set and MX qtypes (S.NEW_QTYPES: nf4, mxfp8, mxfp4): the same properties, with
# budgets from each format. A value-set element rounds to the nearest value of its table (or,
# stochastically, to one of the two around it), so its error is at most half (one) the largest
# gap between neighbouring values, times the scale; mxfp8's elements are e4m3's grid up to 448.


def _element_values(qt: qtypes.QType) -> np.ndarray:
  """The values an element of ``qt`` takes (before the scale), sorted."""
  if qt.is_lut:
    return np.unique(np.asarray(qt.values, np.float64))
  g = _fp8_grid(qtypes.get_qtype("float8_e4m3fn"))
  return g[np.abs(g) <= qt.qmax]


def max_gap(qt: qtypes.QType) -> float:
  """The largest gap between neighbouring element values of ``qt``."""
  return float(np.max(np.diff(_element_values(qt))))


@st.composite
def new_qtype_cases(draw):
  name = draw(st.sampled_from(S.NEW_QTYPES))
  qt = qtypes.get_qtype(name)
  dtype = draw(st.sampled_from(S.FLOAT_DTYPES))
  v = draw(S.values(nonfinite=True))
  # Blocks along one axis: the format's (MX: 32, every other axis channelwise) or, for nf4,
  # any tile of it, channelwise or not.
  block = qt.block_size if qt.is_mx else draw(st.sampled_from([qt.block_size, 16, 8]))
  lead = draw(st.lists(st.integers(0 if draw(st.integers(0, 7)) == 0 else 1, 3),
                       min_size=0, max_size=2))
  axis = draw(st.integers(0, len(lead)))
  shape = list(lead)
  shape.insert(axis, block * draw(st.integers(1, 3)))
  others = tuple(a for a in range(len(shape)) if a != axis)
  cw = others if qt.is_mx else draw(st.sampled_from([others, ()]))
  sr = draw(st.sampled_from([None, None, "uniform", "low_bit_uniform", "low_bit_hash"]))
  spec = qarray.QuantizeSpec(qtype=qt, channelwise_axes=cw, tiled_axes={axis: block},
                             stochastic_rounding=sr)
  return dtype, tuple(shape), v, spec


def check_quantize_new(dtype, shape, v, spec) -> None:
  qt: qtypes.QType = spec.qtype
  sr = spec.stochastic_rounding
  x = S.make(v, shape, dtype)
  q, deq = _quantize(jnp.asarray(x), jax.random.key(v.seed) if sr else None, spec=spec)
  cw, tiles = R.normalize_grid(shape, spec.channelwise_axes, spec.tiled_axes)
  scale_shape = tuple(n // tiles[a] if a in tiles else (n if a in cw else 1)
                      for a, n in enumerate(shape))
  hypothesis.note(f"x = {x!r}; scale = {np.asarray(q.scale)!r}")
  assert q.qvalue.shape == shape and q.scale.shape == scale_shape
  x64, s, d = R.f64(x), R.f64(q.scale), R.f64(deq)
  finite_g = R.group_reduce(np.isfinite(x64), cw, tiles, np.all)
  zero_g = R.group_reduce(x64 == 0, cw, tiles, np.all)
  amax = R.group_reduce(np.where(np.isfinite(x64), np.abs(x64), 0.0), cw, tiles, np.max) \
      if x64.size else np.zeros(scale_shape)
  # Scales: nf4's is the group's absmax (1 for an all-zero group); MX's a power of two 2**k,
  # k in [-126, 127], with absmax / 2**k below the element grid's top midpoint (so nothing
  # rounds past half a step) unless k is clamped.
  fs, fz, fa = s[finite_g], zero_g[finite_g], amax[finite_g]
  assert np.all(np.isfinite(fs)) and np.all(fs > 0)
  if qt.is_mx:
    m, e = np.frexp(fs)
    assert np.all(m == 0.5) and np.all((e - 1 >= -126) & (e - 1 <= 127)), fs
    top = qt.qmax + max_gap(qt) / 2
    ratio = fa / fs
    assert np.all((ratio < top) | (fs == 2.0 ** 127)), ratio
  else:
    np.testing.assert_array_equal(fs[~fz], np.maximum(fa[~fz].astype(np.float32), R.TINY32))
    assert np.all(fs[fz] == 1.0)
  # Values: NaN exactly in groups holding NaN/Inf; elsewhere on the grid and within budget.
  finite_e = R.expand(finite_g, shape)
  assert np.all(np.isnan(d[~finite_e]))
  if not finite_e.any():
    return
  vals = _element_values(qt)
  y = R.f64(qarray.values_of(q))[finite_e]
  assert np.all(np.isin(y, vals)), "a code outside the format's values"
  se, xe, de = R.expand(s, shape)[finite_e], x64[finite_e], d[finite_e]
  assert np.all(np.isfinite(de))
  gap = max_gap(qt)
  budget = (gap if sr else gap / 2) * se
  slack = 2.0 ** -22 * (np.abs(xe) + np.abs(de)) + 2.0 ** -22 * se  # float32 roundings
  err = np.abs(de - xe)
  bad = err > budget + slack
  assert not bad.any(), (f"{int(bad.sum())} elements beyond (max gap {gap} / "
                         f"{1 if sr else 2}) * scale: x={xe[bad][:4]}, x_hat={de[bad][:4]}, "
                         f"scale={se[bad][:4]}")


@pytest.mark.slow
@FAST
@hypothesis.given(case=new_qtype_cases())
def test_quantize_new_qtypes(case):
  check_quantize_new(*case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=new_qtype_cases())
def test_quantize_new_qtypes_deep(case):
  check_quantize_new(*case)


def test_new_qtype_max_gaps():
  """The budgets' gaps, from the tables: nf4's widest step is between its bottom two values
  (-1 and -0.696), mxfp4's between 4 and 6, mxfp8's between 416 and 448."""
  nf4 = np.sort(np.asarray(qtypes.get_qtype("nf4").values, np.float64))
  assert max_gap(qtypes.get_qtype("nf4")) == nf4[1] - nf4[0]
  assert max_gap(qtypes.get_qtype("mxfp4")) == 2.0
  assert max_gap(qtypes.get_qtype("mxfp8")) == 32.0
