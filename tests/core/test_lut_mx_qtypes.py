"""nf4, mxfp8, mxfp4 against float64 numpy references of each format.

References: round to the nearest value of the set (ties: the even code), the e8m0 scale rule
(the largest 2**k with absmax / 2**k >= h, h = 232 for e4m3 and 3.5 for e2m1, k in
[-126, 127]) per block of 32 values of one row, nf4's absmax scale per group. Error budgets
come from the formats: nf4 half the largest gap between neighbouring values times the scale;
MX half the gap between the two element-grid neighbours of |x| / scale (half an element ulp,
the top one past the largest element) times the scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qtrain.core import packing, qarray, qtypes, rounding

NEW = ("nf4", "mxfp8", "mxfp4")
F32_MAX = float(np.finfo(np.float32).max)
U32 = 2.0 ** -24


def _table(name: str) -> np.ndarray:
  qt = qtypes.get_qtype(name)
  return np.asarray(qt.values, np.float64)


def ref_round_codes(y: np.ndarray, name: str) -> np.ndarray:
  """The code of the nearest value of the set (float64 distances); ties: an even code, then
  the smallest code (e2m1's +0 before -0)."""
  t = _table(name)
  y = np.clip(y.astype(np.float64), t.min(), t.max())  # beyond the ends: the end
  d = np.abs(y[..., None] - t)
  best = d == d.min(axis=-1, keepdims=True)
  score = np.where(best, (np.arange(16) % 2) * 16 + np.arange(16), 10**6)
  return np.argmin(score, axis=-1)


def _edge(name: str) -> float:
  return {"mxfp8": 232.0, "mxfp4": 3.5}[name]


def ref_e8m0(bound: np.ndarray, name: str) -> np.ndarray:
  out = np.ones_like(bound, dtype=np.float64)
  for i, b in np.ndenumerate(bound):
    if b == 0:
      continue
    k = math.floor(math.log2(b / _edge(name)))
    # float64 log2 of an exact power-of-two ratio is exact; guard the floor anyway.
    while 2.0 ** (k + 1) * _edge(name) <= b:
      k += 1
    while 2.0 ** k * _edge(name) > b:
      k -= 1
    out[i] = 2.0 ** min(max(k, -126), 127)
  return out


def _element_grid(name: str) -> np.ndarray:
  """Non-negative element values, with the value the grid would have next above its top."""
  if name == "mxfp4":
    return np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 8], np.float64)
  v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  v = np.unique(np.abs(v[np.isfinite(v)]))
  return np.append(v, 480.0)


def ref_mx_elements(y: np.ndarray, name: str) -> np.ndarray:
  """y (float64, already divided by the scale) rounded to the element format, clipped."""
  if name == "mxfp4":
    return _table(name)[ref_round_codes(y, name)]
  c = np.clip(y, -448, 448).astype(np.float32)
  return c.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def half_gap_budget(y: np.ndarray, name: str) -> np.ndarray:
  """Half the gap between the element-grid neighbours of |y| (beyond the top: the top gap)."""
  g = _element_grid(name)
  a = np.minimum(np.abs(y), g[-1] * (1 - 1e-12))
  hi = np.searchsorted(g, a, side="right")
  lo = hi - 1
  return (g[hi] - g[lo]) / 2


def _rows(shape, seed, spread=3.0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, size=shape[:-1] + (1,))
  return x.astype(np.float32)


def _spec(name, axis=-1, ndim=2, tile=None):
  tile = tile or qtypes.get_qtype(name).block_size
  cw = tuple(a for a in range(ndim) if a != axis % ndim)
  return qarray.QuantizeSpec(qtype=name, channelwise_axes=cw, tiled_axes={axis: tile})


# ----------------------------------------------------------------------------- the formats


def test_value_tables():
  nf4 = _table("nf4")
  assert len(nf4) == 16 and np.all(np.diff(nf4) > 0) and nf4[0] == -1 and nf4[-1] == 1
  assert nf4[7] == 0.0 and (nf4 < 0).sum() == 7
  # mxfp4's codes are the OCP e2m1 bit patterns: ml_dtypes' float4_e2m1fn reads them the same.
  e2m1 = np.array([float(ml_dtypes.float4_e2m1fn(v)) for v in _table("mxfp4")])
  np.testing.assert_array_equal(e2m1, _table("mxfp4"))
  for c in range(16):  # bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa
    e, m = (c >> 1) & 3, c & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    assert _table("mxfp4")[c] == (-mag if c >> 3 else mag)
  assert sorted(set(np.abs(_table("mxfp4")))) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
  for name, (lo, hi, block) in {"nf4": (-1, 1, 64), "mxfp8": (-448, 448, 32),
                                "mxfp4": (-6, 6, 32)}.items():
    qt = qtypes.get_qtype(name)
    assert (qt.qmin, qt.qmax, qt.block_size, qt.bits) == (lo, hi, block, 8 if name == "mxfp8" else 4)
    assert qt.is_mx is (name != "nf4") and qt.is_lut is (name != "mxfp8")
    assert not qt.is_integer_like and (qt.name in qtypes.GRADIENT_QTYPES) is qt.is_mx


@pytest.mark.parametrize("name", ["nf4", "mxfp4"])
def test_round_nearest_matches_reference_ties_to_even_code(name):
  t = np.unique(_table(name))
  mids = (t[:-1] + t[1:]) / 2
  rng = np.random.default_rng(1)
  y = np.concatenate([
      t, mids, np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
      np.nextafter(mids.astype(np.float32), np.float32(-np.inf)),
      rng.uniform(-8, 8, 4000), [-0.0, 0.0, 7.0, -7.0, 100.0, -1e30, 1e-30]]).astype(np.float32)
  got = np.asarray(rounding.round_nearest(jnp.asarray(y), qtypes.get_qtype(name)))
  want = ref_round_codes(y.astype(np.float64), name)
  bad = np.flatnonzero(got != want)
  assert not bad.size, (y[bad[:5]], got[bad[:5]], want[bad[:5]])
  assert got.dtype == np.uint8
  if name == "mxfp4":  # IEEE round-half-to-even of e2m1
    vals = _table(name)[np.asarray(rounding.round_nearest(
        jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], jnp.float32), qtypes.get_qtype(name)))]
    np.testing.assert_array_equal(vals, [0, 1, 1, 2, 2, 4, 4, -4])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nf4", "mxfp4"])
@pytest.mark.parametrize("method", rounding.STOCHASTIC_METHODS)
def test_stochastic_rounding_is_unbiased_between_neighbours(name, method):
  qt = qtypes.get_qtype(name)
  t = np.unique(_table(name))
  rng = np.random.default_rng(2)
  ys = np.concatenate([rng.uniform(t[0], t[-1], 6), [t[3] + 0.3 * (t[4] - t[3])]]).astype(np.float32)
  n = 20000
  for i, y in enumerate(ys):
    codes = rounding.stochastic_round(jnp.full((n,), y), qt, jax.random.key(i), method=method)
    v = _table(name)[np.asarray(codes)]
    j = np.searchsorted(t, y, side="right") - 1
    lo, hi = t[j], t[min(j + 1, len(t) - 1)]
    assert set(np.unique(v)) <= {lo, hi}, (y, np.unique(v))
    # mean within 5 standard errors (+ the 8-bit methods' documented 1/512 step bias)
    sd = (hi - lo) / 2 / math.sqrt(n)
    bias = (hi - lo) / 512 if method != "uniform" else 0.0
    assert abs(v.mean() - y) <= 5 * sd + bias, (y, v.mean())
  # beyond the ends: the end
  v = _table(name)[np.asarray(rounding.stochastic_round(jnp.array([50.0, -50.0]), qt, jax.random.key(9)))]
  np.testing.assert_array_equal(v, [t[-1], t[0]])


# ----------------------------------------------------------------------------- quantize


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("name", NEW)
def test_quantize_matches_float64_reference(name, axis, dtype):
  qt = qtypes.get_qtype(name)
  shape = (6, 128) if axis == -1 else (128, 6)
  x32 = _rows((6, 128), hash((name, axis)) % 2**16)
  x32 = x32 if axis == -1 else np.ascontiguousarray(x32.T)
  x = jnp.asarray(x32, dtype)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  q = qarray.quantize(x, _spec(name, axis))
  deq = np.asarray(q.dequantize(), np.float64)
  block = qt.block_size
  cw = (0,) if axis == -1 else (1,)
  tiles = {1: block} if axis == -1 else {0: block}
  from tests import _props_ref as R
  amax = R.group_reduce(np.abs(xf), cw, tiles, lambda v, axis, keepdims: np.max(v, axis=axis, keepdims=keepdims))
  s = np.asarray(q.scale, np.float64)
  assert s.shape == amax.shape and q.qvalue.shape == shape
  if qt.is_mx:
    np.testing.assert_array_equal(s, ref_e8m0(amax, name))
    sf = R.expand(s, shape)
    y = xf / sf  # exact: powers of two
    want = ref_mx_elements(y, name) * sf
    np.testing.assert_array_equal(deq, want)
    assert np.all(np.abs(deq - xf) <= half_gap_budget(y, name) * sf)
  else:
    np.testing.assert_allclose(s, amax, rtol=2 * U32)
    sf = R.expand(s, shape)
    t = np.unique(_table(name))
    budget = np.diff(t).max() / 2 * sf + 4 * U32 * (np.abs(xf) + sf)
    assert np.all(np.abs(deq - xf) <= budget)
    # and it is the nearest value of the set, up to float32's rounding of x / s
    codes = np.asarray(q.qvalue)
    dist = np.abs(xf[..., None] - _table(name) * sf[..., None])
    chosen = np.take_along_axis(dist, codes[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(chosen <= dist.min(-1) + 4 * U32 * (np.abs(xf) + sf))


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_nonfinite_blocks_are_nan_and_others_untouched(name):
  x = _rows((4, 128), 5)
  x[1, 3], x[2, 70], x[3, 100] = np.nan, np.inf, -np.inf
  q = qarray.quantize(jnp.asarray(x), _spec(name))
  deq = np.asarray(q.dequantize())
  block = qtypes.get_qtype(name).block_size
  for r, c in ((1, 3), (2, 70), (3, 100)):
    g = c // block
    assert np.isnan(deq[r, g * block:(g + 1) * block]).all()
  ok = np.isfinite(deq)
  assert ok[0].all() and ok.sum() == 4 * 128 - 3 * block
  clean = qarray.quantize(jnp.asarray(np.nan_to_num(x, nan=0, posinf=0, neginf=0)), _spec(name))
  np.testing.assert_array_equal(deq[0], np.asarray(clean.dequantize())[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_empty_and_all_zero(name):
  block = qtypes.get_qtype(name).block_size
  q = qarray.quantize(jnp.zeros((0, 2 * block)), _spec(name))
  assert q.qvalue.shape == (0, 2 * block) and q.scale.shape == (0, 2)
  z = qarray.quantize(jnp.zeros((3, block)), _spec(name))
  np.testing.assert_array_equal(np.asarray(z.scale), 1.0)
  np.testing.assert_array_equal(np.asarray(z.dequantize()), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_e8m0_range_extremes(name):
  """Blocks near the float32 limit and far below its smallest normal: finite scales on the
  e8m0 grid (k clamped to [-126, 127]), finite values within the budget."""
  rng = np.random.default_rng(7)
  x = rng.uniform(0.5, 1.0, (4, 32)) * np.array([[F32_MAX], [1e30], [1e-30], [2e-38]])
  x *= rng.choice([-1, 1], x.shape)
  x = x.astype(np.float32)
  x[0, 0] = F32_MAX  # rounds up to the next element: clipped so that value * scale is finite
  q = qarray.quantize(jnp.asarray(x), _spec(name))
  s = np.asarray(q.scale, np.float64)[:, 0]
  amax = np.abs(x.astype(np.float64)).max(1)
  np.testing.assert_array_equal(s, ref_e8m0(amax, name))
  k = np.log2(s)
  assert np.all(k == np.round(k)) and k.min() >= -126 and k.max() <= 127
  deq = np.asarray(q.dequantize(), np.float64)
  assert np.isfinite(deq).all()
  xf = x.astype(np.float64)
  y = xf / s[:, None]
  # the budget: half an element step, except values whose upper neighbour times the scale
  # would be past float32's limit (they take the grid value below, within one step).
  budget = half_gap_budget(y, name) * s[:, None]
  m = 1 if name == "mxfp4" else 3
  beyond = np.abs(y) > (2 - 2.0 ** -m) * 2.0 ** 127 / s[:, None]
  budget[beyond] *= 2
  # below float32's normal range XLA flushes: the last row may lose its subnormal values.
  budget[3] += float(np.finfo(np.float32).tiny)
  assert np.all(np.abs(deq - xf) <= budget)


# ----------------------------------------------------------------------------- validation


def test_mx_needs_blocks_of_32_of_one_row():
  with pytest.raises(ValueError, match=r"needs tiled_axes=\{axis: 32\}"):
    qarray.QuantizeSpec(qtype="mxfp8", channelwise_axes=(0,))
  with pytest.raises(ValueError, match=r"tiled_axes tile size=64 .*valid: None \(the default, 32\) or 32"):
    qarray.QuantizeSpec(qtype="mxfp4", tiled_axes={1: 64})
  with pytest.raises(ValueError, match="one axis is tiled and every other axis"):
    qarray.quantize(jnp.ones((4, 64)), qarray.QuantizeSpec(qtype="mxfp8", tiled_axes={1: 32}))
  with pytest.raises(ValueError, match="quantize_with_scale: qtype 'mxfp4'"):
    qarray.quantize_with_scale(jnp.ones((2, 32)), "mxfp4", jnp.ones((2, 1)))
  with pytest.raises(ValueError, match="minmax"):
    qarray.QuantizeSpec(qtype="nf4", calibration="minmax")


def test_unknown_qtype_lists_the_new_ones():
  with pytest.raises(ValueError) as e:
    qtypes.get_qtype("nf5")
  for n in NEW:
    assert repr(n) in str(e.value)


def test_gradient_qtypes_take_mx_and_refuse_nf4():
  for n in ("mxfp8", "mxfp4"):
    qtypes.check_gradient_qtype(qtypes.get_qtype(n), "bwd_qtype")
  with pytest.raises(ValueError, match=r"bwd_qtype='nf4': gradients need int2..int8 or fp8 "
                                       r"\(or MX: mxfp8, mxfp4\).*nf4 is a weight format"):
    qtypes.check_gradient_qtype(qtypes.get_qtype("nf4"), "bwd_qtype")


@pytest.mark.parametrize("name", ["nf4", "mxfp4"])
def test_codes_pack_in_4_bits_and_back(name):
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 16, (5, 37)).astype(np.uint8)
  words = packing.pack(jnp.asarray(codes), name)
  assert words.shape == (5, 5) and words.dtype == jnp.uint32
  back = packing.unpack(words, name, size=37)
  assert back.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(back), codes)
  # the layout: code k of a row at bit 4 * (k % 8) of word k // 8
  w = np.asarray(words)
  np.testing.assert_array_equal((w[:, 0] >> 4) & 0xF, codes[:, 1])
  with pytest.raises(ValueError, match=r"codes in \[.*\] do not fit"):
    packing.pack(jnp.full((1, 8), 16, jnp.int32), name)


@pytest.mark.slow
def test_values_of_reads_the_table():
  q = qarray.quantize(jnp.asarray(_rows((2, 64), 4)), _spec("nf4"))
  np.testing.assert_array_equal(np.asarray(qarray.values_of(q)),
                                np.asarray(qtypes.NF4_VALUES, np.float32)[np.asarray(q.qvalue)])
