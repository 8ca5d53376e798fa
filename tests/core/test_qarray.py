"""qtrain.core.qarray: calibrate / quantize / dequantize against a float64 numpy reference.

Error budgets (all elementwise, against the float64 input):
  * integer qtypes (int8/int4/int2/ternary), symmetric, inside the calibration
    range: |x - deq| <= scale / 2 -- exactly the round-to-nearest bound -- plus
    FP32_SLACK * |x| for the two float32 roundings of x / scale and q * scale.
  * values beyond the calibration bound clip to +-qmax exactly.
  * binary (absmean): deq == sign(x) * mean|x| of its group (sign(0) = +1);
    the scale equals the float64 group mean to float32 rounding (SCALE_RTOL).
  * fp8: |x - deq| <= 2^-(nmant + 1) * |x| for normal values (|x / scale| >=
    2^minexp), and <= 2^(minexp - nmant - 1) * scale (half a subnormal step)
    below, plus FP32_SLACK * |x|.
"""

import dataclasses
import zlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _strategies as S
from qtrain.core import qarray, qtypes

FP32_SLACK = 2.0 ** -21       # a few float32 ulps, relative
SCALE_RTOL = 2e-6             # float32 reductions vs the float64 reference (<= 128 terms)

INT_QTYPES = ["int8", "int6", "int4", "int3", "int2", "ternary"]
FP8_QTYPES = ["float8_e4m3fn", "float8_e5m2"]
# Value-set and MX qtypes (blocks of 32, codes into a table): tests/core/test_lut_mx_qtypes.py.
ALL_QTYPES = list(S.QTYPES)

# (shape, channelwise_axes, tiled_axes)
LAYOUTS = [
    ((6, 64), (), {}),                 # per tensor
    ((6, 64), (0,), {}),               # per row
    ((6, 64), (1,), {}),               # per column
    ((6, 64), (0,), {1: 32}),
    ((6, 128), (0,), {1: 64}),
    ((4, 256), (0,), {1: 128}),
    ((6, 48), (0,), {1: 12}),          # any divisor
    ((3, 10, 24), (0, 2), {1: 5}),     # tile on a middle axis
    ((3, 10, 24), (-1,), {-2: 2}),     # negative axes
    ((64, 6), (1,), {0: 32}),          # tile along axis 0
]


def _rand(shape, seed, scale=1.0):
  """Random normal data with a spread of magnitudes across groups."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * scale * np.exp(rng.uniform(-2, 2, shape[:1] + (1,) * (len(shape) - 1)))).astype(np.float32)


# Jitted once per (shape, spec): one XLA compile instead of one per primitive.
_quantize = jax.jit(qarray.quantize, static_argnames=("spec",))
_dequantize = jax.jit(qarray.dequantize, static_argnames=("dtype",))


def _norm_layout(shape, cw, tiles):
  nd = len(shape)
  return tuple(sorted(a % nd for a in cw)), {a % nd: t for a, t in tiles.items()}


def np_group_reduce(x, cw, tiles, fn):
  """float64 reference: reduce each scale group of x with fn(v, axis=..., keepdims=True)."""
  x = np.asarray(x, np.float64)
  cw, tiles = _norm_layout(x.shape, cw, tiles)
  split, red = [], []
  for a, n in enumerate(x.shape):
    if a in tiles:
      split += [n // tiles[a], tiles[a]]
      red.append(len(split) - 1)
    else:
      split.append(n)
      if a not in cw:
        red.append(len(split) - 1)
  r = fn(x.reshape(split), axis=tuple(red), keepdims=True)
  out_shape = tuple(n // tiles[a] if a in tiles else (n if a in cw else 1)
                    for a, n in enumerate(x.shape))
  return r.reshape(out_shape)


def np_expand(s, shape):
  for a, (ns, n) in enumerate(zip(s.shape, shape)):
    if ns not in (1, n):
      s = np.repeat(s, n // ns, axis=a)
  return np.broadcast_to(s, shape)


def _spec(qtype, cw, tiles, calibration="absmax", **kw):
  return qarray.QuantizeSpec(qtype=qtype, channelwise_axes=cw, tiled_axes=tiles,
                             calibration=calibration, **kw)


# ----------------------------------------------------------------------------
# Per-qtype error budgets.


@pytest.mark.slow
@pytest.mark.parametrize("qtype", INT_QTYPES)
@pytest.mark.parametrize("shape,cw,tiles", LAYOUTS)
def test_int_absmax_within_half_step(qtype, shape, cw, tiles):
  qt = qtypes.get_qtype(qtype)
  x = _rand(shape, zlib.crc32(repr((qtype, shape, cw)).encode()))
  q = qarray.quantize(jnp.asarray(x), _spec(qtype, cw, tiles))
  ref_scale = np_group_reduce(np.abs(x), cw, tiles, np.max) / qt.qmax
  assert q.qvalue.dtype == jnp.int8 and q.zero_point is None
  assert q.scale.dtype == jnp.float32 and q.scale.shape == ref_scale.shape
  np.testing.assert_allclose(np.asarray(q.scale), ref_scale, rtol=SCALE_RTOL)
  qv = np.asarray(q.qvalue).astype(np.float64)
  assert np.all(np.abs(qv) <= qt.qmax)
  # Round to nearest: qvalue is the float64 rounding of x / scale (ties aside).
  s = np_expand(np.asarray(q.scale, np.float64), shape)
  y = x / s
  near_tie = np.abs(np.abs(y - np.floor(y)) - 0.5) < 1e-4
  np.testing.assert_array_equal(qv[~near_tie], np.round(y)[~near_tie])
  deq = np.asarray(qarray.dequantize(q), np.float64)
  err = np.abs(deq - x)
  assert np.all(err <= s / 2 + FP32_SLACK * np.abs(x)), np.max(err / s)
  # The max of each group hits +-qmax exactly.
  amax = np_expand(np_group_reduce(np.abs(qv), cw, tiles, np.max), shape)
  assert np.all(amax == qt.qmax)


@pytest.mark.parametrize("shape,cw,tiles", LAYOUTS)
@pytest.mark.thin(5)
def test_binary_absmean_is_sign_times_group_mean(shape, cw, tiles):
  x = _rand(shape, 7)
  x.flat[::17] = 0.0  # sign(0) = +1
  q = qarray.quantize(jnp.asarray(x), _spec("binary", cw, tiles, "absmean"))
  ref_scale = np_group_reduce(np.abs(x), cw, tiles, np.mean)  # qmax = 1
  np.testing.assert_allclose(np.asarray(q.scale), ref_scale, rtol=SCALE_RTOL)
  np.testing.assert_array_equal(np.asarray(q.qvalue), np.where(x >= 0, 1, -1))
  deq = np.asarray(qarray.dequantize(q))
  # Exactly sign(x) * (the float32 scale): no other rounding.
  np.testing.assert_array_equal(deq, np.where(x >= 0, 1.0, -1.0) * np_expand(np.asarray(q.scale), shape))
  np.testing.assert_allclose(deq, np.where(x >= 0, 1, -1) * np_expand(ref_scale, shape), rtol=SCALE_RTOL)


def _fp8_budget(qt, x, s):
  fi = jnp.finfo(qt.compute_dtype)
  y = np.abs(x / s)
  normal = y >= 2.0 ** fi.minexp
  bound = np.where(normal, 2.0 ** -(fi.nmant + 1) * np.abs(x), 2.0 ** (fi.minexp - fi.nmant - 1) * s)
  return bound + FP32_SLACK * np.abs(x), normal


@pytest.mark.parametrize("qtype", FP8_QTYPES)
@pytest.mark.parametrize("shape,cw,tiles", LAYOUTS[:6])
def test_fp8_relative_error(qtype, shape, cw, tiles):
  qt = qtypes.get_qtype(qtype)
  fi = jnp.finfo(qt.compute_dtype)
  rng = np.random.default_rng(3)
  # Log-uniform magnitudes reaching 4 octaves below the smallest normal of the
  # fp8 grid (after scaling), so normals and subnormals both occur.
  lowest = fi.minexp - np.log2(qt.qmax) - 4
  x = (rng.choice([-1, 1], shape) * 2.0 ** rng.uniform(lowest, 0, shape)).astype(np.float32)
  q = qarray.quantize(jnp.asarray(x), _spec(qtype, cw, tiles))
  assert q.qvalue.dtype == qt.compute_dtype
  ref_scale = np_group_reduce(np.abs(x), cw, tiles, np.max) / qt.qmax
  np.testing.assert_allclose(np.asarray(q.scale), ref_scale, rtol=SCALE_RTOL)
  s = np_expand(np.asarray(q.scale, np.float64), shape)
  deq = np.asarray(qarray.dequantize(q), np.float64)
  bound, normal = _fp8_budget(qt, x, s)
  assert normal.mean() > 0.5 and (~normal).any()
  assert np.all(np.abs(deq - x) <= bound)


# ----------------------------------------------------------------------------
# Calibration methods.


@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("method,multiplier,ref_bound", [
    ("absmean", 1.0, lambda a, cw, t: np_group_reduce(np.abs(a), cw, t, np.mean)),
    ("absmean", 2.5, lambda a, cw, t: np_group_reduce(np.abs(a), cw, t, np.mean)),
    ("rms", 3.0, lambda a, cw, t: np.sqrt(np_group_reduce(a * a, cw, t, np.mean))),
    ("rms", 1.0, lambda a, cw, t: np.sqrt(np_group_reduce(a * a, cw, t, np.mean))),
])
def test_symmetric_calibration_scale_and_clipping(qtype, method, multiplier, ref_bound):
  qt = qtypes.get_qtype(qtype)
  shape, cw, tiles = (6, 64), (0,), {1: 32}
  x = _rand(shape, 11)
  cal = qarray.Calibration(method=method, multiplier=multiplier)
  q = qarray.quantize(jnp.asarray(x), _spec(qtype, cw, tiles, cal))
  ref_scale = ref_bound(x, cw, tiles) * multiplier / qt.qmax
  np.testing.assert_allclose(np.asarray(q.scale), ref_scale, rtol=SCALE_RTOL)
  _check_symmetric_clip(q, x, qt, require_clipping=multiplier < 3)


def _check_symmetric_clip(q, x, qt, require_clipping=True):
  s = np_expand(np.asarray(q.scale, np.float64), x.shape)
  y = x / s
  qv = np.asarray(q.qvalue).astype(np.float64)
  deq = np.asarray(qarray.dequantize(q), np.float64)
  inside = np.abs(y) <= qt.qmax
  assert inside.any()
  if require_clipping:
    assert (~inside).any(), "the data must exercise clipping"
  assert np.all(np.abs(deq - x)[inside] <= (s / 2 + FP32_SLACK * np.abs(x))[inside])
  # Outside the bound: clipped to the end of the range on the value's side.
  assert np.all(qv[~inside & (y > 0)] == qt.qmax)
  assert np.all(qv[~inside & (y < 0)] <= -qt.qmax)


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_fixed_calibration_ignores_data(qtype):
  qt = qtypes.get_qtype(qtype)
  x = _rand((5, 32), 12)
  cal = qarray.Calibration(method="fixed", bound=0.75)
  spec = _spec(qtype, (0,), {}, cal)
  q = qarray.quantize(jnp.asarray(x), spec)
  np.testing.assert_allclose(np.asarray(q.scale), np.full((5, 1), 0.75 / qt.qmax), rtol=1e-7)
  q2 = qarray.quantize(jnp.asarray(3 * x), spec)
  np.testing.assert_array_equal(np.asarray(q2.scale), np.asarray(q.scale))
  _check_symmetric_clip(q, x, qt)


@pytest.mark.parametrize("pct", [50.0, 90.0, 99.0, 100.0])
def test_percentile_calibration(pct):
  qt = qtypes.get_qtype("int8")
  shape, cw, tiles = (4, 128), (0,), {1: 64}
  x = _rand(shape, 13)
  cal = qarray.Calibration(method="percentile", percentile=pct)
  q = qarray.quantize(jnp.asarray(x), _spec("int8", cw, tiles, cal))
  ref = np_group_reduce(np.abs(x), cw, tiles, lambda v, axis, keepdims: np.percentile(
      v, pct, axis=axis, keepdims=keepdims)) / qt.qmax
  np.testing.assert_allclose(np.asarray(q.scale), ref, rtol=1e-5)
  if pct < 100:
    _check_symmetric_clip(q, x, qt)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "int4", "int2"])
@pytest.mark.parametrize("data", ["mixed", "positive", "negative"])
def test_minmax_asymmetric_zero_point(qtype, data):
  qt = qtypes.get_qtype(qtype)
  shape, cw, tiles = (6, 64), (0,), {1: 32}
  x = _rand(shape, 14) + {"mixed": 0.7, "positive": 0.0, "negative": 0.0}[data]
  if data == "positive":
    x = np.abs(x) + 0.1
  elif data == "negative":
    x = -np.abs(x) - 0.1
  x[:, ::9] = 0.0  # zeros must come back exactly
  q = qarray.quantize(jnp.asarray(x), _spec(qtype, cw, tiles, "minmax"))
  assert q.zero_point is not None and q.zero_point.shape == q.scale.shape
  lo = np.minimum(np_group_reduce(x, cw, tiles, np.min), 0.0)
  hi = np.maximum(np_group_reduce(x, cw, tiles, np.max), 0.0)
  np.testing.assert_allclose(np.asarray(q.scale), (hi - lo) / (qt.qmax - qt.qmin), rtol=SCALE_RTOL)
  zp = np.asarray(q.zero_point, np.float64)
  assert np.all(zp == np.round(zp)) and np.all((zp >= qt.qmin) & (zp <= qt.qmax))
  qv = np.asarray(q.qvalue).astype(np.float64)
  # Each group's minimum maps to qmin (if < 0) and maximum to qmax (if > 0).
  qmin_g = np_group_reduce(qv, cw, tiles, np.min)
  qmax_g = np_group_reduce(qv, cw, tiles, np.max)
  assert np.all(np.where(lo < 0, qmin_g == qt.qmin, qmin_g == zp))
  assert np.all(np.where(hi > 0, qmax_g == qt.qmax, qmax_g == zp))
  deq = np.asarray(qarray.dequantize(q), np.float64)
  assert np.all(deq[x == 0] == 0.0)  # 0 is exactly representable
  s = np_expand(np.asarray(q.scale, np.float64), shape)
  # Half a step, plus the float32 rounding of x / scale + zero_point (|.| < 256,
  # ulp 2^-16 in units of the step).
  assert np.all(np.abs(deq - x) <= s / 2 + 2.0 ** -15 * s + FP32_SLACK * np.abs(x))


def test_minmax_rejects_non_integer_qtypes():
  for qt in ("binary", "ternary", "float8_e4m3fn"):
    with pytest.raises(ValueError, match="minmax"):
      _spec(qt, (), {}, "minmax")


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="nope"), "nope"),
    (dict(method="fixed"), "bound"),
    (dict(method="fixed", bound=-1.0), "bound"),
    (dict(method="absmax", bound=1.0), "bound"),
    (dict(method="percentile"), "percentile"),
    (dict(method="percentile", percentile=0.0), "percentile"),
    (dict(method="percentile", percentile=101.0), "percentile"),
    (dict(method="absmax", percentile=50.0), "percentile"),
    (dict(method="rms", multiplier=0.0), "multiplier"),
    (dict(method="rms", multiplier=float("inf")), "multiplier"),
])
def test_bad_calibration_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    qarray.Calibration(**kwargs)


# ----------------------------------------------------------------------------
# Spec validation.


@pytest.mark.parametrize("tile", [48, 100, 7])
def test_non_divisor_tile_raises_naming_the_tile(tile):
  spec = _spec("int8", (0,), {1: tile})
  with pytest.raises(ValueError, match=f"tile_size={tile}"):
    qarray.quantize(jnp.asarray(_rand((4, 64), 1)), spec)


def test_bad_specs_raise():
  with pytest.raises(ValueError, match="both"):
    _spec("int8", (1,), {1: 32})
  with pytest.raises(ValueError, match="tile size"):
    _spec("int8", (), {1: 0})
  with pytest.raises(ValueError, match="stochastic_rounding"):
    _spec("int8", (), {}, stochastic_rounding="sometimes")
  with pytest.raises(ValueError, match="int9"):
    _spec("int9", (), {})
  # The same axis named once negative, once positive.
  with pytest.raises(ValueError, match="both"):
    qarray.quantize(jnp.ones((2, 8)), _spec("int8", (1,), {-1: 4}))
  with pytest.raises(ValueError, match="out of range"):
    qarray.quantize(jnp.ones((2, 4)), _spec("int8", (2,), {}))
  with pytest.raises(ValueError, match="key"):
    qarray.quantize(jnp.ones((2, 4)), _spec("int8", (), {}, stochastic_rounding="uniform"))


# ----------------------------------------------------------------------------
# All zeros, NaN and Inf.

CAL_FOR = {
    "absmax": ALL_QTYPES,
    "absmean": ALL_QTYPES,
    "rms": ALL_QTYPES,
    "percentile": ALL_QTYPES,
    "fixed": ALL_QTYPES,
    "minmax": ["int8", "int4", "int2"],
}
CAL_CASES = [(q, c) for c, qs in CAL_FOR.items() for q in qs]
# binary has no zero code, but an all-zero group gets the scale 0 under every
# calibration, a fixed bound included (issue 16 item 14: it used to come back as
# +bound), so every case gives exact zeros.
ZERO_CASES = CAL_CASES


def _cal(method):
  return {"fixed": qarray.Calibration(method="fixed", bound=2.0),
          "percentile": qarray.Calibration(method="percentile", percentile=90.0)}.get(method, method)


@pytest.mark.parametrize("qtype,method", ZERO_CASES)
@pytest.mark.thin(3)
def test_all_zero_input_gives_finite_scales_and_exact_zeros(qtype, method):
  x = jnp.zeros((4, 64), jnp.float32)
  q = qarray.quantize(x, _spec(qtype, (0,), {1: 32}, _cal(method)))
  assert np.all(np.isfinite(np.asarray(q.scale)))
  if q.zero_point is not None:
    assert np.all(np.isfinite(np.asarray(q.zero_point)))
  np.testing.assert_array_equal(np.asarray(qarray.dequantize(q)), np.zeros((4, 64)))


@pytest.mark.slow
@pytest.mark.parametrize("qtype,method", CAL_CASES)
def test_nan_and_inf_are_visible_in_their_group_only(qtype, method):
  x = _rand((5, 64), 21)
  x[1, 5] = np.nan
  x[2, 40] = np.inf
  x[3, 0] = -np.inf
  q = qarray.quantize(jnp.asarray(x), _spec(qtype, (0,), {1: 32}, _cal(method)))
  deq = np.asarray(qarray.dequantize(q))
  bad = np.zeros(x.shape, bool)
  bad[1, :32] = bad[2, 32:] = bad[3, :32] = True
  assert np.all(np.isnan(deq[bad]))
  assert np.all(np.isfinite(deq[~bad]))
  # Per tensor: every value is NaN.
  qt_ = qarray.quantize(jnp.asarray(x), _spec(qtype, (), {}, _cal(method)))
  assert np.all(np.isnan(np.asarray(qarray.dequantize(qt_))))


def test_quantize_with_scale_nonfinite_input_is_nan():
  x = _rand((3, 8), 2)
  x[0, 3] = np.inf
  q = qarray.quantize_with_scale(jnp.asarray(x), "int8", jnp.full((3, 1), 0.1))
  deq = np.asarray(q.dequantize())
  assert np.all(np.isnan(deq[0])) and np.all(np.isfinite(deq[1:]))


def test_fake_quantize_matches_quantize_then_dequantize():
  x = jnp.asarray(_rand((4, 32), 5)).astype(jnp.bfloat16)
  spec = _spec("int4", (0,), {1: 16})
  out = qarray.fake_quantize(x, spec)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(qarray.dequantize(qarray.quantize(x, spec), jnp.bfloat16), np.float32))


# ----------------------------------------------------------------------------
# Property tests.

_mag = st.floats(2.0 ** -100, 2.0 ** 20, width=32, allow_subnormal=False)
_value = st.one_of(st.just(0.0), _mag, _mag.map(lambda v: -v))


@st.composite
def _array_and_layout(draw):
  shape = draw(st.sampled_from([(1, 7), (3, 32), (4, 1)]))
  x = draw(hnp.arrays(np.float32, shape, elements=_value))
  layout = draw(st.sampled_from(["tensor", "rows", "cols", "tiles"]))
  cw, tiles = {"tensor": ((), {}), "rows": ((0,), {}), "cols": ((1,), {}),
               "tiles": ((0,), {1: shape[1] // 2} if shape[1] % 2 == 0 else {})}[layout]
  return x, cw, tiles


_SETTINGS = hypothesis.settings(max_examples=20, deadline=None, database=None,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


@pytest.mark.slow
@pytest.mark.parametrize("qtype", INT_QTYPES + FP8_QTYPES)
@_SETTINGS
@hypothesis.given(data=_array_and_layout())
def test_property_within_half_step_and_idempotent(qtype, data):
  x, cw, tiles = data
  qt = qtypes.get_qtype(qtype)
  spec = _spec(qtype, cw, tiles)
  q = _quantize(jnp.asarray(x), spec)
  deq = np.asarray(_dequantize(q), np.float64)
  s = np_expand(np.asarray(q.scale, np.float64), x.shape)
  if qt.is_float:
    bound, _ = _fp8_budget(qt, x.astype(np.float64), s)
  else:
    bound = s / 2 + FP32_SLACK * np.abs(x)
  assert np.all(np.abs(deq - x) <= bound)
  # Idempotent: quantizing the dequantized array gives the same qvalues.
  q2 = _quantize(jnp.asarray(deq, jnp.float32), spec)
  np.testing.assert_array_equal(np.asarray(q2.qvalue, np.float32), np.asarray(q.qvalue, np.float32))


@_SETTINGS
@hypothesis.given(data=_array_and_layout())
def test_property_binary_absmean_idempotent(data):
  x, cw, tiles = data
  spec = _spec("binary", cw, tiles, "absmean")
  q = _quantize(jnp.asarray(x), spec)
  deq = _dequantize(q)
  q2 = _quantize(deq, spec)
  np.testing.assert_array_equal(np.asarray(q2.qvalue), np.asarray(q.qvalue))
  # Same scale up to the float32 summation of <= 80 equal terms.
  np.testing.assert_allclose(np.asarray(q2.scale), np.asarray(q.scale), rtol=1e-5)


# ----------------------------------------------------------------------------
# Field validation: every bad field raises ValueError naming the field, the
# value and what would be valid (strings, bools and NaN used to reach numpy
# ufuncs and fail with a TypeError naming nothing).


@pytest.mark.parametrize("kwargs,field,valid", [
    (dict(multiplier="2"), "multiplier='2'", "finite real number"),
    (dict(multiplier=True), "multiplier=True", "finite real number"),
    (dict(multiplier=float("nan")), "multiplier=nan", "finite real number"),
    (dict(multiplier=-1), "multiplier=-1", "finite real number"),
    (dict(multiplier=1e-300), "multiplier=1e-300", "float32's normal range"),
    (dict(multiplier=1e39), "multiplier=1e\\+39", "float32's normal range"),
    (dict(method="fixed", bound="1"), "bound='1'", "finite real number"),
    (dict(method="fixed", bound=np.bool_(True)), "bound=(np.)?(True|bool_\\(True\\))", "finite real"),
    (dict(method="fixed", bound=float("nan")), "bound=nan", "finite real number"),
    (dict(method="fixed", bound=0), "bound=0", "finite real number"),
    (dict(method="percentile", percentile="50"), "percentile='50'", r"\(0, 100\]"),
    (dict(method="percentile", percentile=True), "percentile=True", r"\(0, 100\]"),
    (dict(method="percentile", percentile=float("nan")), "percentile=nan", r"\(0, 100\]"),
    (dict(method="percentile", percentile=100.5), "percentile=100.5", r"\(0, 100\]"),
    (dict(method=3), "method=3", "absmax"),
])
def test_bad_calibration_field_names_field_value_and_valid_range(kwargs, field, valid):
  with pytest.raises(ValueError, match=f"{field}.*{valid}"):
    qarray.Calibration(**kwargs)


def test_calibration_takes_ints_and_numpy_reals_as_floats():
  c = qarray.Calibration(method="percentile", percentile=np.int64(50), multiplier=2)
  assert (c.percentile, c.multiplier) == (50.0, 2.0)
  assert type(c.percentile) is float and type(c.multiplier) is float
  assert qarray.Calibration(method="fixed", bound=np.float32(0.5)).bound == 0.5
  assert qarray.Calibration(multiplier=2) == qarray.Calibration(multiplier=2.0)


@pytest.mark.parametrize("bad", [3, None, ["absmax"]])
def test_as_calibration_rejects_non_calibrations(bad):
  with pytest.raises(ValueError, match=r"calibration=.*must be a Calibration or one of"):
    qarray.as_calibration(bad)
  with pytest.raises(ValueError, match="calibration="):
    _spec("int8", (), {}, bad)


@pytest.mark.parametrize("kwargs,match", [
    (dict(channelwise_axes=0), r"channelwise_axes=0 is not valid; valid: a tuple of int axes"),
    (dict(channelwise_axes=(0.0,)), r"channelwise_axes=\(0.0,\) is not valid"),
    (dict(channelwise_axes=(True,)), r"channelwise_axes=\(True,\) is not valid"),
    (dict(channelwise_axes="0"), r"channelwise_axes='0' is not valid"),
    (dict(channelwise_axes=(1, 0, 1)), r"channelwise_axes=\(1, 0, 1\) names axis 1 more than once"),
    (dict(tiled_axes=[(1, 4)]), r"tiled_axes=\[\(1, 4\)\] is not valid; valid: a dict"),
    (dict(tiled_axes={1.0: 4}), r"axis 1.0 is not an int axis"),
    (dict(tiled_axes={1: True}), r"tile size True for axis 1 is not valid; valid: a positive int"),
    (dict(tiled_axes={1: 4.0}), r"tile size 4.0 for axis 1"),
    (dict(stochastic_rounding="sometimes"), r"stochastic_rounding='sometimes'; valid"),
])
def test_bad_quantize_spec_fields_raise_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    qarray.QuantizeSpec(qtype="int8", **kwargs)


@pytest.mark.parametrize("cw,tiles,match", [
    ((), {1: 4, -1: 8}, r"tiled_axes=\{1: 4, -1: 8\} names axis 1 of shape \(4, 32\) twice: as 1 and as -1"),
    ((0, -2), {}, r"channelwise_axes=\(0, -2\) names axis 0 of shape \(4, 32\) twice: as 0 and as -2"),
    ((1,), {-1: 8}, r"axes \[1\] of shape \(4, 32\) are both channelwise_axes and tiled_axes"),
])
def test_two_entries_naming_one_axis_raise_naming_both(cw, tiles, match):
  # tiled_axes={1: 4, -1: 8} used to keep one of the two tile sizes silently.
  spec = _spec("int8", cw, tiles)
  with pytest.raises(ValueError, match=match):
    qarray.quantize(jnp.ones((4, 32)), spec)


# ----------------------------------------------------------------------------
# Zeros: what the docs promise (qtrain.core.qarray's module docstring), exactly.


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_binary_fixed_maps_zero_to_plus_bound_in_nonzero_groups_every_other_case_keeps_zeros(qtype):
  x = _rand((4, 64), 31)
  x[1] = 0.0  # an all-zero group
  x[2, ::3] = 0.0  # zeros among non-zeros
  fixed = qarray.Calibration(method="fixed", bound=2.0)
  deq = np.asarray(qarray.dequantize(qarray.quantize(jnp.asarray(x), _spec(qtype, (0,), {}, fixed))))
  if qtype == "binary":
    # No zero code (sign(0) = +1 is what lets binary pack into one bit): a
    # data-independent bound maps a 0 among non-zeros to +bound; an all-zero
    # group gets scale 0 and stays zero.
    np.testing.assert_array_equal(deq[2][x[2] == 0], 2.0)
    np.testing.assert_array_equal(deq[1], 0.0)
  else:
    np.testing.assert_array_equal(deq[x == 0], 0.0)
  # Every data-dependent calibration gives an all-zero group back as zeros,
  # binary included (scale 0).
  for method in [m for m in qarray.CALIBRATION_METHODS if m != "fixed"]:
    if method == "minmax" and qtypes.get_qtype(qtype).kind != "int":
      continue
    q = qarray.quantize(jnp.asarray(x), _spec(qtype, (0,), {}, _cal(method)))
    np.testing.assert_array_equal(np.asarray(qarray.dequantize(q))[1], 0.0)
    if qtype == "binary":
      assert float(q.scale[1, 0]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("qtype,method", CAL_CASES)
def test_empty_groups_quantize_like_all_zero_groups(qtype, method):
  # A contraction of size 0 (e.g. K = 0): groups of no values. Reductions take
  # 0 as their identity, so the groups count as all zero.
  for shape, cw in (((4, 0), (0,)), ((0, 8), (0,)), ((0, 8), ())):
    q = qarray.quantize(jnp.zeros(shape), _spec(qtype, cw, {}, _cal(method)))
    assert q.qvalue.shape == shape and np.all(np.isfinite(np.asarray(q.scale)))
    assert qarray.dequantize(q).shape == shape


@pytest.mark.parametrize("text, want", [
    ("absmax,0.9", qarray.Calibration(method="absmax", multiplier=0.9)),
    ("minmax, 0.5", qarray.Calibration(method="minmax", multiplier=0.5)),
    ("absmean,2", qarray.Calibration(method="absmean", multiplier=2.0)),
    ("rms,3", qarray.Calibration(method="rms", multiplier=3.0)),
    ("percentile,99.9", qarray.Calibration(method="percentile", percentile=99.9)),
    ("fixed,4", qarray.Calibration(method="fixed", bound=4.0)),
    ("fixed,-4,4", qarray.Calibration(method="fixed", bound=4.0)),
    ("fixed,-4e-3,4e-3", qarray.Calibration(method="fixed", bound=4e-3)),
])
def test_as_calibration_reads_method_with_arguments(text, want):
  assert qarray.as_calibration(text) == want
  # The same scales as the Calibration it stands for (int4, random data, per channel).
  x = jnp.asarray(np.random.default_rng(5).normal(size=(6, 9)) * 3, jnp.float32)
  a = qarray.quantize(x, _spec("int4", (0,), {}, text))
  b = qarray.quantize(x, _spec("int4", (0,), {}, want))
  np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
  np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))


@pytest.mark.parametrize("text, match", [
    ("fixed,-2,4", r"fixed,-2,4.*symmetric.*got \[-2, 4\]"),
    ("fixed,0", r"symmetric.*b > 0"),
    ("absmax,x", r"absmax,x.*must be numbers.*'rms,3'"),
    ("absmax,1,2", r"wrong number of arguments for 'absmax'"),
    ("percentile", r"percentile=None"),
    ("bogus,1", r"Unknown calibration method='bogus'; valid: \['absmax'"),
    ("absmax,-1", r"multiplier=-1.0 is not valid"),
    ("rms,nan", r"multiplier=nan is not valid"),
])
def test_as_calibration_strings_with_bad_arguments_raise_naming_them(text, match):
  with pytest.raises(ValueError, match=match):
    qarray.as_calibration(text)


# ----------------------------------------------------------------------------
# Scales shared across shards (axis_names).


@pytest.mark.slow
@pytest.mark.parametrize("method", ["absmax", "minmax", "fixed"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_axis_names_give_every_shard_the_whole_arrays_scale(method, nonfinite):
  """Four shards of the reduced axis (``jax.vmap`` with an axis name binds it as a shard_map
  does): with ``axis_names`` each shard's scale (and zero point) is the whole array's, bit for
  bit, NaN where any shard holds a NaN; without, each shard has its own. Shard 2 is all zero
  (its own scale would be the all-zero group's 1)."""
  rng = np.random.default_rng(4)
  x = (rng.standard_normal((4, 6, 5)) * 10.0 ** rng.uniform(-3, 3, (4, 1, 5))).astype(np.float32)
  x[2] = 0.0
  if nonfinite:
    x[1, 3, 2] = np.nan
  cal = qarray.Calibration(method="fixed", bound=3.0) if method == "fixed" else method
  qt = "int4" if method == "minmax" else "int8"
  whole = qarray.QuantizeSpec(qtype=qt, channelwise_axes=(1,), calibration=cal)  # reduce 0 and 1
  shared = qarray.QuantizeSpec(qtype=qt, channelwise_axes=(1,), calibration=cal,
                               axis_names=("data",))
  flat = jnp.asarray(x.reshape(24, 5))  # rows: shards x rows
  s_whole, z_whole = qarray.calibrate(flat, whole)
  got = jax.vmap(lambda v: qarray.calibrate(v, shared), axis_name="data")(jnp.asarray(x))
  own = jax.vmap(lambda v: qarray.calibrate(v, whole), axis_name="data")(jnp.asarray(x))
  for i in range(4):
    np.testing.assert_array_equal(np.asarray(got[0][i]), np.asarray(s_whole))
    if z_whole is not None:
      np.testing.assert_array_equal(np.asarray(got[1][i]), np.asarray(z_whole))
  if method != "fixed":
    assert not np.array_equal(np.asarray(own[0][0]), np.asarray(own[0][3]))
    assert np.all(np.asarray(own[0][2]) == 1.0)  # the all-zero shard's own scale
  assert np.isnan(np.asarray(got[0])).any() == (nonfinite and method != "fixed")


def test_axis_names_are_checked():
  with pytest.raises(ValueError, match=r"axis_names=\[1\] is not valid.*\('data',\)"):
    qarray.QuantizeSpec(qtype="int8", axis_names=[1])
  with pytest.raises(ValueError, match=r"axis_names=\('data',\) with calibration 'percentile'.*"
                                       r"absmax"):
    qarray.QuantizeSpec(qtype="int8", calibration="percentile,99", axis_names="data")
  assert qarray.QuantizeSpec(qtype="int8", axis_names="data").axis_names == ("data",)
  # Outside shard_map the array is whole: nothing to reduce across, the same scale.
  x = jax.random.normal(jax.random.key(0), (8, 4))
  spec = qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,))
  np.testing.assert_array_equal(
      np.asarray(qarray.calibrate(x, dataclasses.replace(spec, axis_names=("data",)))[0]),
      np.asarray(qarray.calibrate(x, spec)[0]))
  # Inside a shard_map, a name that is none of its mesh axes is a mistake, not a no-op.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  bad = dataclasses.replace(spec, axis_names=("dta",))
  f = jax.shard_map(lambda v: qarray.calibrate(v, bad)[0], mesh=mesh,
                    in_specs=jax.sharding.PartitionSpec("data"),
                    out_specs=jax.sharding.PartitionSpec())
  with pytest.raises(ValueError, match=r"'dta' is not a mesh axis of the enclosing shard_map"):
    f(x)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_dequantize_reads_its_codes_through_the_optimization_barrier(dtype):
  # XLA's GPU backend folds an f32 -> fp8 -> f32 round trip inside one jit unless the fp8
  # codes pass an optimization barrier (tests/ops/test_ops_gpu.py measures it on the GPU). On
  # the CPU nothing folds, so check the program: the barrier's fp8 output must be what the
  # dequantization reads (a barrier whose output goes unused protects nothing).
  spec = qarray.QuantizeSpec(qtype=dtype)
  jaxpr = jax.make_jaxpr(lambda x: qarray.fake_quantize(x, spec))(
      jnp.asarray(np.random.default_rng(0).standard_normal((64,)), jnp.float32)).jaxpr
  eqns = list(jaxpr.eqns)
  barriers = [(i, e) for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"
              and any(v.aval.dtype == jnp.dtype(dtype) for v in e.invars)]
  assert barriers, "no optimization barrier on the fp8 codes"
  for i, e in barriers:
    used = {id(v) for later in eqns[i + 1:] for v in later.invars} | {id(v) for v in jaxpr.outvars}
    assert any(id(v) in used for v in e.outvars), f"the barrier's output is unused: {e}"
