"""qtrain.core.rounding: stochastic rounding is unbiased, independent per element, keyed.

Statistical budgets: every check uses a fixed PRNG key (deterministic), and a
bound of Z_MAX = 4 standard deviations of the sampling noise (sigma computed
from the Bernoulli variance of each rounding), so a correct implementation
passes with probability > 0.9999 for any key.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qtrain.core import qtypes, rounding

Z_MAX = 4.0
INT8 = qtypes.get_qtype("int8")
METHODS = list(rounding.STOCHASTIC_METHODS)
LOW_BIT_BIAS = 1.0 / 512  # documented bound of the low_bit_* methods, in steps
LOW_BIT = ("low_bit_uniform", "low_bit_hash")


@functools.partial(jax.jit, static_argnames=("qt", "method", "n"))
def _sr_samples(y, key, qt, method, n):
  """n independent stochastic roundings of y: shape (n, *y.shape), as float32."""
  yb = jnp.broadcast_to(y, (n,) + y.shape)
  return rounding.stochastic_round(yb, qt, key, method=method).astype(jnp.float32)


def _int_inputs(m, seed):
  rng = np.random.default_rng(seed)
  k = rng.integers(-50, 50, m)
  f = rng.uniform(0.02, 0.98, m)
  return (k + f).astype(np.float32)


@pytest.mark.parametrize("method", METHODS)
def test_int_sr_is_unbiased_and_error_shrinks_like_one_over_sqrt_n(method):
  y = _int_inputs(512, 0)
  f = y - np.floor(y)
  rms = {}
  for n, key in ((64, 1), (1024, 2)):
    s = np.asarray(_sr_samples(jnp.asarray(y), jax.random.key(key), INT8, method, n))
    # Always one of the two integer neighbours.
    assert np.all((s == np.floor(y)) | (s == np.floor(y) + 1))
    err = s.mean(0) - y
    sigma = np.sqrt(f * (1 - f) / n)
    # Aggregate bias: the mean error over all 512 values is within Z_MAX sigma.
    bias_sigma = np.sqrt(np.sum(sigma ** 2)) / len(y)
    extra = LOW_BIT_BIAS if method in LOW_BIT else 0.0
    assert abs(err.mean()) <= Z_MAX * bias_sigma + extra
    # Per value: the spread is the Bernoulli spread (rms z ~ 1; 512 values
    # give it a std of ~0.03, so [0.85, 1.15] is a 5-sigma band).
    z = err / sigma
    assert 0.85 <= np.sqrt(np.mean(z ** 2)) <= 1.15 + (0.1 if method in LOW_BIT else 0)
    rms[n] = np.sqrt(np.mean(err ** 2))
  # 16x the samples: 4x smaller error (each rms known to ~3%).
  assert 3.3 <= rms[64] / rms[1024] <= 4.8, rms


@pytest.mark.slow
def test_round_to_nearest_is_biased_where_sr_is_not():
  y = jnp.full((4096,), 0.3, jnp.float32)
  assert np.all(np.asarray(rounding.round_nearest(y, INT8)) == 0)  # bias -0.3
  for method in METHODS:
    s = np.asarray(rounding.stochastic_round(y, INT8, jax.random.key(3), method=method), np.float64)
    sigma = np.sqrt(0.3 * 0.7 / y.size)
    assert abs(s.mean() - 0.3) <= Z_MAX * sigma + (LOW_BIT_BIAS if method in LOW_BIT else 0)


@pytest.mark.parametrize("method", METHODS)
def test_sr_is_independent_per_element(method):
  y = jnp.full((8, 256), 0.5, jnp.float32)
  s = np.asarray(rounding.stochastic_round(y, INT8, jax.random.key(4), method=method))
  # Not per row: every row holds both 0 and 1, in about equal numbers.
  for row in s:
    assert set(row.tolist()) == {0, 1}
    assert abs(row.mean() - 0.5) <= Z_MAX * 0.5 / np.sqrt(256)
  # Rows are not copies of each other.
  assert len({tuple(r) for r in s}) == 8
  # Neighbouring elements are uncorrelated (|corr| within Z_MAX / sqrt(n)).
  a, b = s[:, :-1].ravel() - 0.5, s[:, 1:].ravel() - 0.5
  assert abs(np.mean(a * b) / 0.25) <= Z_MAX / np.sqrt(a.size)
  c, d = s[:-1].ravel() - 0.5, s[1:].ravel() - 0.5
  assert abs(np.mean(c * d) / 0.25) <= Z_MAX / np.sqrt(c.size)


@pytest.mark.parametrize("method", METHODS)
def test_same_key_same_result_different_key_different(method):
  y = jnp.asarray(_int_inputs(1024, 5))
  a = rounding.stochastic_round(y, INT8, jax.random.key(7), method=method)
  b = rounding.stochastic_round(y, INT8, jax.random.key(7), method=method)
  c = rounding.stochastic_round(y, INT8, jax.random.key(8), method=method)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.mean(np.asarray(a) != np.asarray(c)) > 0.2  # E = 2 f (1 - f) ~ 0.33


@pytest.mark.parametrize("method", LOW_BIT)
def test_low_bit_bias_is_within_documented_bound(method):
  # Rounding probabilities are quantized to 1/256 steps: bias <= 1/512 of a
  # step. Fractions near 0 and 1 (where the sampling sigma is tiny) and at
  # half-steps of the 1/256 grid (where the bias is largest).
  fracs = np.array([0.001, 0.003, 1 / 512 - 1e-4, 0.5 + 1 / 512 - 1e-4, 0.25 + 1 / 1024,
                    0.997, 1 - 1 / 512 + 1e-4], np.float32)
  n = 1 << 18
  y = jnp.asarray(3.0 + fracs)
  s = np.asarray(_sr_samples(y, jax.random.key(9), INT8, method, n), np.float64)
  p_up = (s == 4.0).mean(0)
  sigma = np.sqrt(np.maximum(p_up * (1 - p_up), 1.0 / n) / n)
  bias = p_up - fracs.astype(np.float64)
  assert np.all(np.abs(bias) <= LOW_BIT_BIAS + Z_MAX * sigma), (bias, sigma)
  # The probability really is quantized (not the 32-bit method): 0.001 < 1/512
  # never rounds up, 0.003 rounds up with probability 1/256.
  assert p_up[0] == 0.0
  assert abs(p_up[1] - 1 / 256) <= Z_MAX * np.sqrt((1 / 256) / n)
  # ... while "uniform" is unbiased at the same point.
  u = np.asarray(_sr_samples(y[:1], jax.random.key(9), INT8, "uniform", n))
  assert abs(u.mean() - float(y[0])) <= Z_MAX * np.sqrt(0.001 / n)


def _fp8_grid(dtype):
  v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  return np.unique(v[np.isfinite(v)])


def _fp8_inputs(dtype, m, seed):
  fi = ml_dtypes.finfo(dtype)
  rng = np.random.default_rng(seed)
  # Log-uniform over the subnormal and normal range, both signs, plus values
  # one float32 ulp below powers of two (binade edges).
  e = rng.uniform(fi.minexp - fi.nmant, np.log2(float(fi.max)) - 0.01, m)
  y = rng.choice([-1.0, 1.0], m) * 2.0 ** e
  edges = 2.0 ** rng.integers(fi.minexp - fi.nmant + 1, int(np.log2(float(fi.max))), 32)
  edges = np.nextafter(edges.astype(np.float32), np.float32(0)) * rng.choice([-1, 1], 32)
  y = np.concatenate([y.astype(np.float32), edges.astype(np.float32)])
  # Exactly representable values stay put.
  return np.concatenate([y, rng.choice(_fp8_grid(dtype), 16).astype(np.float32)])


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("method", METHODS)
def test_fp8_sr_gives_a_neighbour_and_is_unbiased(qtype, method):
  qt = qtypes.get_qtype(qtype)
  dtype = qt.compute_dtype.type
  grid = _fp8_grid(dtype)
  y = _fp8_inputs(dtype, 256, 11).astype(np.float64)
  hi = grid[np.searchsorted(grid, y, side="left")]
  lo = grid[np.searchsorted(grid, y, side="right") - 1]
  n = 512
  out = _sr_samples(jnp.asarray(y, jnp.float32), jax.random.key(12), qt, method, n)
  s = np.asarray(out, np.float64)
  assert np.all((s == lo) | (s == hi)), y[np.any((s != lo) & (s != hi), axis=0)]
  step = hi - lo
  p = np.where(step > 0, (y - lo) / np.where(step > 0, step, 1), 0.0)
  sigma = step * np.sqrt(p * (1 - p) / n)
  err = s.mean(0) - y
  extra = LOW_BIT_BIAS * step if method in LOW_BIT else 0.0
  # Per value, relative to its own step: aggregate bias within Z_MAX sigma.
  ok = step > 0
  zb = (err[ok] / step[ok]).mean()
  zsig = np.sqrt(np.sum((sigma[ok] / step[ok]) ** 2)) / ok.sum()
  assert abs(zb) <= Z_MAX * zsig + (LOW_BIT_BIAS if method in LOW_BIT else 0.0)
  assert np.all(np.abs(err) <= 5.5 * sigma + extra + 1e-30)
  assert np.all(s[:, ~ok] == y[~ok])  # representable values are exact


def test_fp8_sr_clips_to_the_finite_range():
  qt = qtypes.get_qtype("float8_e4m3fn")
  y = jnp.array([1e4, -1e4, 460.0, -460.0], jnp.float32)
  s = np.asarray(rounding.stochastic_round(y, qt, jax.random.key(0)), np.float32)
  np.testing.assert_array_equal(s, [448, -448, 448, -448])


def test_int_sr_clips_and_binary_sr_mean():
  s = rounding.stochastic_round(jnp.array([300.0, -300.0, 126.5]), INT8, jax.random.key(0))
  assert np.asarray(s)[:2].tolist() == [127, -128] and int(np.asarray(s)[2]) in (126, 127)
  binary = qtypes.get_qtype("binary")
  y = jnp.asarray(np.random.default_rng(1).uniform(-1.5, 1.5, 64).astype(np.float32))
  n = 2048
  out = np.asarray(_sr_samples(y, jax.random.key(13), binary, "uniform", n))
  assert set(np.unique(out).tolist()) <= {-1.0, 1.0}
  target = np.clip(np.asarray(y), -1, 1)
  sigma = np.sqrt(np.maximum(1 - target ** 2, 1e-12) / n)
  assert np.all(np.abs(out.mean(0) - target) <= 5.0 * sigma + 1e-12)


def test_round_nearest_is_half_to_even_and_binary_sign():
  y = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.7, 200.0, -200.0])
  np.testing.assert_array_equal(np.asarray(rounding.round_nearest(y, INT8)),
                                [0, 2, 2, 0, -2, 127, 127, -128])
  b = rounding.round_nearest(jnp.array([0.0, -0.0, 1e-30, -1e-30, 3.0]), qtypes.get_qtype("binary"))
  np.testing.assert_array_equal(np.asarray(b), [1, 1, 1, -1, 1])


def test_unknown_method_raises():
  with pytest.raises(ValueError, match="sometimes"):
    rounding.stochastic_round(jnp.ones(3), INT8, jax.random.key(0), method="sometimes")


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_rounding_noise_extremes_give_the_two_neighbours(qtype):
  # White-box check of the bit-pattern rounding: noise 0 keeps the smaller
  # magnitude neighbour, noise just below 1 the larger one, for every inexact
  # value, including one float32 ulp below each power of two (binade edges),
  # subnormals, and both signs. Representable values never move.
  qt = qtypes.get_qtype(qtype)
  dtype = qt.compute_dtype.type
  grid = _fp8_grid(dtype)
  fi = ml_dtypes.finfo(dtype)
  k = np.arange(fi.minexp - fi.nmant + 1, int(np.log2(float(fi.max))) + 1)
  below = np.nextafter((2.0 ** k).astype(np.float32), np.float32(0))
  y = np.concatenate([below, -below, _fp8_inputs(dtype, 256, 3)])
  assert y.dtype == np.float32
  yd = y.astype(np.float64)
  hi = grid[np.searchsorted(grid, yd, side="left")]
  lo = grid[np.searchsorted(grid, yd, side="right") - 1]
  small = np.where(np.abs(lo) <= np.abs(hi), lo, hi)
  large = np.where(np.abs(lo) <= np.abs(hi), hi, lo)
  for u, want in ((0.0, small), (np.float32(1) - np.float32(2.0**-24), large)):
    r = rounding.fp8_round_with_noise(jnp.asarray(y), qt.compute_dtype,
                                       jnp.full(y.shape, u, jnp.float32))
    np.testing.assert_array_equal(np.asarray(r, np.float64), want)
  assert (hi > lo)[:2 * len(k)].all()


def _threefry_sizes(fn, *args):
  """Element counts of the threefry2x32 calls in ``fn``'s lowered program."""
  import re
  text = jax.jit(fn).lower(*args).as_text()
  calls = [l for l in text.splitlines() if "call @threefry2x32" in l]
  return [int(np.prod([int(d) for d in re.findall(r"tensor<([\dx]+)xui32>", c)[0].split("x")]))
          for c in calls]


def test_low_bit_uniform_spends_one_prng_word_per_four_elements():
  y = jnp.asarray(np.random.default_rng(11).normal(size=(8, 1024)) * 30, jnp.float32)
  key = jax.random.key(0)
  low = _threefry_sizes(lambda y, k: rounding.stochastic_round(y, INT8, k, method="low_bit_uniform"),
                        y, key)
  full = _threefry_sizes(lambda y, k: rounding.stochastic_round(y, INT8, k, method="uniform"), y, key)
  # One threefry call each, over a quarter of the counters (in JAX's default
  # partitionable mode: one counter per word, so 2048 against 8192).
  assert len(low) == len(full) == 1, (low, full)
  assert 4 * low[0] == full[0], (low, full)
  if jax.config.jax_threefry_partitionable:
    assert full == [8 * 1024], full


@pytest.mark.parametrize("method", LOW_BIT)
@pytest.mark.parametrize("shape", [(), (5,), (3, 7), (2, 4, 9)])
def test_low_bit_every_lane_of_a_word_is_unbiased(shape, method):
  # Elements 4j..4j+3 share one PRNG word (one byte each); each byte lane must
  # round with the right probability, ragged last axes included.
  n = 1 << 14
  y = jnp.full(shape, 2.0 + 0.3, jnp.float32)
  s = np.asarray(_sr_samples(y, jax.random.key(12), INT8, method, n), np.float64)
  assert s.shape == (n,) + shape
  assert np.all((s == 2.0) | (s == 3.0))
  p = (s == 3.0).mean(0)
  sigma = np.sqrt(0.3 * 0.7 / n)
  assert np.all(np.abs(p - 0.3) <= Z_MAX * sigma + LOW_BIT_BIAS), p
  if shape and shape[-1] >= 4:
    # The 4 lanes of a word are uncorrelated with each other.
    v = s.reshape(n, -1, shape[-1])[..., :4].reshape(-1, 4) - 2.3
    c = np.corrcoef(v.T)[np.triu_indices(4, 1)]
    assert np.all(np.abs(c) <= Z_MAX / np.sqrt(v.shape[0])), c


@pytest.mark.parametrize("qtype", ["int8", "int2", "binary", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("method", METHODS)
def test_sr_saturates_at_float32_extremes(qtype, method):
  # x / scale reaches +-inf for a small fixed or learned scale and a huge x
  # (qarray documents that such values saturate); float32's max sits one
  # carry below inf in the fp8 bit-pattern rounding.
  qt = qtypes.get_qtype(qtype)
  f32max = float(np.finfo(np.float32).max)
  y = jnp.array([np.inf, -np.inf, f32max, -f32max, float(qt.qmax) * (1 + 2.0 ** -22),
                 -float(qt.qmax) * (1 + 2.0 ** -22)], jnp.float32)
  s = np.asarray(rounding.stochastic_round(y, qt, jax.random.key(4), method=method), np.float64)
  n = np.asarray(rounding.round_nearest(y, qt), np.float64)
  for out in (s, n):
    assert np.all(out[[0, 2, 4]] == qt.qmax), out
    assert np.all(out[[1, 3]] == qt.qmin), out
    assert out[5] in (-qt.qmax, qt.qmin), out  # just below -qmax: -qmax or (SR) qmin


# ----------------------------------------------------------------------------
# low_bit_hash: the keyed hash behind the noise.


def _chi2_bound(dof: int) -> float:
  # Wilson-Hilferty: the chi-square quantile at ~Z_MAX sigma for dof degrees of freedom.
  return dof * (1 - 2 / (9 * dof) + Z_MAX * np.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.slow
def test_hash_words_bytes_are_uniform_and_uncorrelated():
  w = np.asarray(rounding.hash_words(jax.random.key(21), (64, 4096)), np.uint32).reshape(-1)
  assert np.unique(w).size == w.size  # a permutation of the indices: no repeats
  for lane in range(4):  # each byte lane, and the 16-bit halves, are uniform
    b = (w >> (8 * lane)) & 0xFF
    counts = np.bincount(b, minlength=256)
    expected = w.size / 256
    assert np.sum((counts - expected) ** 2 / expected) <= _chi2_bound(255), lane
  # Neighbouring words (consecutive indices) and the bits of one word are uncorrelated.
  bits = ((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float64)
  n = bits.shape[0]
  assert np.all(np.abs(bits.mean(0) - 0.5) <= Z_MAX * 0.5 / np.sqrt(n))
  lag = np.mean((bits[1:] - 0.5) * (bits[:-1] - 0.5), axis=0) / 0.25
  assert np.all(np.abs(lag) <= Z_MAX / np.sqrt(n - 1)), lag
  within = np.corrcoef(bits[:, ::5].T)[np.triu_indices(7, 1)]
  assert np.all(np.abs(within) <= Z_MAX / np.sqrt(n)), within


@pytest.mark.slow
def test_hash_words_depend_on_every_key_word_and_on_shape_position():
  shape = (16, 257)
  base = np.asarray(rounding.hash_words(jax.random.key(3), shape))
  data = jax.random.key_data(jax.random.key(3))
  for i in range(data.shape[0]):  # flipping one bit of any key word changes ~half the bits
    flipped = jax.random.wrap_key_data(data.at[i].set(data[i] ^ 1))
    other = np.asarray(rounding.hash_words(flipped, shape))
    frac = np.mean(np.unpackbits((base ^ other).view(np.uint8)))
    assert abs(frac - 0.5) <= Z_MAX * 0.5 / np.sqrt(base.size * 32), (i, frac)
  # A word's value depends on its row-major index alone: the same index in another shape
  # gives the same word, so one call's words never repeat another part of itself.
  flat = np.asarray(rounding.hash_words(jax.random.key(3), (16 * 257,)))
  np.testing.assert_array_equal(flat.reshape(shape), base)
  # Jitted and vmapped over keys: the same words as one call per key.
  keys = jax.random.split(jax.random.key(4), 3)
  vm = jax.jit(jax.vmap(lambda k: rounding.hash_words(k, (5, 6))))(keys)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(vm[i]), np.asarray(rounding.hash_words(keys[i], (5, 6))))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_low_bit_hash_takes_any_key_implementation(impl):
  y = jnp.full((1 << 16,), 0.3, jnp.float32)
  k1, k2 = jax.random.key(1, impl=impl), jax.random.key(2, impl=impl)
  a = np.asarray(rounding.stochastic_round(y, INT8, k1, method="low_bit_hash"), np.float64)
  b = np.asarray(rounding.stochastic_round(y, INT8, k2, method="low_bit_hash"), np.float64)
  sigma = np.sqrt(0.3 * 0.7 / y.size)
  assert abs(a.mean() - 0.3) <= Z_MAX * sigma + LOW_BIT_BIAS
  assert np.mean(a != b) > 0.35  # E = 2 p (1 - p) = 0.42 for independent draws


def test_low_bit_hash_runs_no_prng_call():
  y = jnp.asarray(np.random.default_rng(11).normal(size=(8, 1024)) * 30, jnp.float32)
  fn = lambda y, k: rounding.stochastic_round(y, INT8, k, method="low_bit_hash")
  assert _threefry_sizes(fn, y, jax.random.key(0)) == []
  jaxpr = str(jax.make_jaxpr(fn)(y, jax.random.key(0)))
  assert "random_bits" not in jaxpr and "threefry" not in jaxpr


def test_hash_words_refuses_more_than_2_to_the_32_words():
  with pytest.raises(ValueError, match=r"at most 2\*\*32 words.*4294967298 words.*low_bit_uniform"):
    jax.eval_shape(lambda k: rounding.hash_words(k, (2, 2**31 + 1)), jax.random.key(0))
  # The largest allowed shape traces.
  assert jax.eval_shape(lambda k: rounding.hash_words(k, (2**32,)), jax.random.key(0)).shape == (2**32,)


# split_key: one key per backward product.


@pytest.mark.parametrize("methods", [("uniform", None), ("low_bit_uniform", "low_bit_hash"),
                                     ("uniform", "low_bit_uniform")])
def test_split_key_is_jax_split_for_threefry_methods(methods):
  key = jax.random.key(5)
  got = rounding.split_key(key, 2, methods)
  want = jax.random.split(key, 2)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_split_key_for_hash_methods_runs_no_prng_call_and_gives_unrelated_noise(impl):
  key = jax.random.key(9, impl=impl)
  methods = ("low_bit_hash", None, "low_bit_hash")
  fn = lambda k: [jax.random.key_data(s) for s in rounding.split_key(k, 3, methods)]
  assert _threefry_sizes(fn, key) == []
  keys = rounding.split_key(key, 3, methods)
  data = [np.asarray(jax.random.key_data(k)) for k in keys]
  assert all(k.dtype == key.dtype for k in keys)  # same implementation, typed keys
  assert len({d.tobytes() for d in data} | {np.asarray(jax.random.key_data(key)).tobytes()}) == 4
  # The noise of two derived keys (and of the parent) is uncorrelated: words agree on ~half
  # their bits, bytes as often as chance allows.
  words = [np.asarray(rounding.hash_words(k, (64, 1024))) for k in (key, *keys)]
  for i in range(4):
    for j in range(i + 1, 4):
      frac = np.mean(np.unpackbits((words[i] ^ words[j]).view(np.uint8)))
      assert abs(frac - 0.5) <= Z_MAX * 0.5 / np.sqrt(words[i].size * 32), (i, j, frac)
  assert rounding.split_key(None, 2, methods[:2]) == [None, None]
  # Deterministic, and under jit the same keys.
  again = jax.jit(fn)(key)
  for a, b in zip(again, data):
    np.testing.assert_array_equal(np.asarray(a), b)
