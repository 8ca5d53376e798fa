"""Rounding into a qtype: round-to-nearest and stochastic rounding.

Stochastic rounding rounds ``y`` up with probability equal to its distance
from the value below, so ``E[round(y)] = y``: it is unbiased where
round-to-nearest is biased (small gradient values all collapse to 0).

Methods:
  * ``"uniform"``: one independent uniform draw per element (32 random bits).
  * ``"low_bit_uniform"``: one independent draw per element with only 8
    random bits: each 32-bit PRNG word feeds 4 elements, so it costs a
    quarter of the PRNG work of ``"uniform"`` (JAX's threefry computes one
    full hash per word whatever its width; in one H200 run, s3 of
    docs/performance-history.md, the int8 QT step ran 1.19x bf16 with it and
    1.14x with ``"uniform"``).
    The rounding probability is quantized to 1/256 steps: bias <= 1/512 of
    a step.
  * ``"low_bit_hash"``: ``"low_bit_uniform"``'s 8 bits per element, taken
    from a keyed integer hash of each word's index instead of JAX's PRNG
    (:func:`hash_words`). The hash is a handful of integer operations per
    word where threefry runs 20 rounds, so it compiles and runs far cheaper
    (the noise of every quantized gradient sits inside the quantization
    fusion); it is a statistical generator, not a cryptographic one: each
    key gives a fixed permutation of the word indices, scrambled. Same
    bias bound as ``"low_bit_uniform"``. The key's bits come from
    ``jax.random.key_data``, so any key implementation works; different
    keys give different noise. A backward whose roundings are all
    ``"low_bit_hash"`` derives one key per product without a threefry
    split either (:func:`split_key`).

Both work for integer qtypes (the step is 1), for fp8 qtypes (the step is
the fp8 spacing at ``y``, so the result is one of the two fp8 neighbours) and
for value-set (LUT) qtypes (``nf4``, ``mxfp4``): the result is one of the two
neighbouring values of the set, the upper one with probability
``(y - lo) / (hi - lo)``.

Round-to-nearest onto a value set goes to the nearest value; an exact tie
(``y`` on the midpoint of two neighbours) goes to the one with the even code:
for e2m1 codes that is IEEE round-half-to-even (0.25 -> 0, 0.75 -> 1, 5 -> 4),
for nf4 a fixed, documented choice. Beyond the set's ends ``y`` clips to them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.core import rounding, qtypes
  >>> y = jnp.full((100_000,), 0.25)
  >>> q = rounding.stochastic_round(y, qtypes.get_qtype("int8"), jax.random.key(0))
  >>> bool(abs(q.astype(jnp.float32).mean() - 0.25) < 0.01)
  True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qtrain.core import qtypes

STOCHASTIC_METHODS: tuple[str, ...] = ("uniform", "low_bit_uniform", "low_bit_hash")


def check_stochastic_method(value, field: str = "stochastic_rounding") -> str | None:
  """``value`` if it is None or one of :data:`STOCHASTIC_METHODS`; else a ValueError naming
  ``field`` and the valid values (every entry point validates through here)."""
  if value is not None and value not in STOCHASTIC_METHODS:
    raise ValueError(f"{field}={value!r}; valid: {[None, *STOCHASTIC_METHODS]}")
  return value


def _noise(key: jax.Array, shape, method: str) -> jax.Array:
  """Uniform noise in [0, 1), one independent value per element."""
  if method == "uniform":
    return jax.random.uniform(key, shape, jnp.float32)
  if method == "low_bit_uniform":
    return (_bytes(key, shape, _random_words).astype(jnp.float32) + 0.5) * (1.0 / 256.0)
  if method == "low_bit_hash":
    return (_bytes(key, shape, hash_words).astype(jnp.float32) + 0.5) * (1.0 / 256.0)
  raise ValueError(f"Unknown stochastic rounding method={method!r}; valid: {list(STOCHASTIC_METHODS)}")


def _random_words(key: jax.Array, shape) -> jax.Array:
  """Independent uniform uint32 words (JAX's PRNG for ``key``'s implementation)."""
  return jax.random.bits(key, shape, jnp.uint32)


# Two rounds of xor-shift-multiply: the constants and shifts of "lowbias32"
# from Chris Wellons' hash-prospector (a bijection of uint32 whose output bits
# each flip with probability ~1/2 for any flipped input bit).
_MIX = ((16, 0x7FEB352D), (15, 0x846CA68B))
_GOLDEN = 0x9E3779B9


def _mix32(x: jax.Array) -> jax.Array:
  for shift, mult in _MIX:
    x = (x ^ (x >> shift)) * jnp.uint32(mult)
  return x ^ (x >> 16)


def hash_words(key: jax.Array, shape) -> jax.Array:
  """Uniform uint32 words of ``shape`` from a keyed hash of each word's row-major index.

  The key's data (``jax.random.key_data``, any implementation) is folded
  into two 32-bit seeds; word ``i`` is ``mix(mix(i ^ s0) + s1)`` (``mix``: a
  bijective 32-bit finalizer), a key-dependent permutation of the indices,
  so no two words of one call repeat. Up to 2**32 words per call.

  Raises:
    ValueError: for a shape of more than 2**32 words (the index is 32-bit).
  """
  shape = tuple(int(n) for n in shape)
  size = math.prod(shape)
  if size > 2**32:
    raise ValueError(f"stochastic_rounding='low_bit_hash' draws at most 2**32 words (4 * 2**32 "
                     f"elements) per quantized array; got {size} words for shape {shape}: use "
                     f"'low_bit_uniform'")
  s0, s1 = hash_seeds(key)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return mix_words(index, s0, s1)


def hash_seeds(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 seeds :func:`hash_words` folds ``key``'s data into."""
  data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  s0, s1 = jnp.uint32(_GOLDEN), jnp.uint32(~_GOLDEN & 0xFFFFFFFF)
  for i in range(data.shape[0]):
    s0 = _mix32(s0 ^ data[i])
    s1 = _mix32(s1 + data[i])
  return s0, s1


def mix_words(index: jax.Array, s0, s1) -> jax.Array:
  """:func:`hash_words`' word for each uint32 word ``index`` under seeds ``(s0, s1)`` (a kernel
  computing the noise of its own elements calls this)."""
  return _mix32(_mix32(index ^ s0) + s1)


def split_key(key: jax.Array | None, n: int, methods) -> list:
  """``n`` keys for ``n`` roundings, the i-th with ``methods[i]`` (None: no stochastic rounding).

  Where every method is ``"low_bit_hash"`` or None the keys are ``key`` with its data XORed with
  ``i * golden``: :func:`hash_words` only reads the key's data and scrambles it through its
  mixer, so distinct data give unrelated noise, where :func:`jax.random.split` adds a threefry
  program (~200 compiled HLO operations) to every quantized backward. The threefry methods get
  :func:`jax.random.split`.
  """
  if key is None:
    return [None] * n
  if any(m not in (None, "low_bit_hash") for m in methods):
    return list(jax.random.split(key, n))
  data = jax.random.key_data(key)
  impl = jax.random.key_impl(key)
  return [jax.random.wrap_key_data(data ^ jnp.uint32((i * _GOLDEN) & 0xFFFFFFFF), impl=impl)
          for i in range(1, n + 1)]


def _bytes(key: jax.Array, shape, words_fn) -> jax.Array:
  """Independent uniform bytes (as uint32 in [0, 256)): the 4 bytes of each
  32-bit word of ``words_fn(key, shape)`` go to 4 consecutive elements of the
  last axis (``jax.random.bits(..., jnp.uint8)`` would spend one word per byte)."""
  shape = tuple(shape)
  if not shape:
    return words_fn(key, ()) & 0xFF
  n = shape[-1]
  words = words_fn(key, shape[:-1] + (-(-n // 4),))
  shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
  b = (words[..., None] >> shifts) & 0xFF
  return b.reshape(shape[:-1] + (4 * words.shape[-1],))[..., :n]  # no -1: shapes may be empty


def _clip(y: jax.Array, qt: qtypes.QType) -> jax.Array:
  return jnp.clip(y, qt.qmin, qt.qmax)


@functools.lru_cache(maxsize=None)
def _lut_table(qt: qtypes.QType):
  """(sorted distinct values as float32, the code of each, the float32 thresholds between
  neighbours, whether an exact tie at each goes up) for a LUT qtype.

  The midpoint ``m`` of two neighbours is computed in float64. Where ``m`` is a float32 value
  the comparison is ``y > m`` (or ``y >= m`` where the upper neighbour's code is even); where
  it is not, no float32 ``y`` equals it, and ``y > m`` is ``y > t`` for ``t`` the float32 below
  ``m``: the float32 comparisons pick the nearest value exactly.
  """
  if not qt.is_lut:
    raise ValueError(f"qtype {qt.name!r} has no value table")
  table = np.asarray(qt.values, np.float64)
  vals = np.unique(table)  # sorted; e2m1's -0 and +0 are one value
  codes = np.array([int(np.flatnonzero(table == v)[0]) for v in vals])  # +0 before -0
  thr, tie_up = [], []
  for j in range(len(vals) - 1):
    m = (vals[j] + vals[j + 1]) / 2
    t = np.float32(m)
    if float(t) > m:
      t = np.nextafter(t, np.float32(-np.inf))
    exact = float(t) == m
    thr.append(t)
    tie_up.append(bool(exact and codes[j + 1] % 2 == 0))
  return vals.astype(np.float32), codes, np.array(thr, np.float32), tuple(tie_up)


def lut_values(qt: qtypes.QType, codes: jax.Array, dtype=jnp.float32) -> jax.Array:
  """The values of a LUT qtype's ``codes`` (0..15) in ``dtype`` (a 16-entry table lookup)."""
  table = jnp.asarray(np.asarray(qt.values, np.float32)).astype(dtype)
  return jnp.take(table, codes.astype(jnp.int32), axis=0, mode="clip")


def _lut_round_nearest(y: jax.Array, qt: qtypes.QType) -> jax.Array:
  vals, codes, thr, tie_up = _lut_table(qt)
  y = y.astype(jnp.float32)
  idx = jnp.zeros(y.shape, jnp.int32)
  for t, up in zip(thr, tie_up):
    idx = idx + ((y >= t) if up else (y > t)).astype(jnp.int32)
  return _sorted_to_codes(idx, codes)


def _sorted_to_codes(idx: jax.Array, codes: np.ndarray) -> jax.Array:
  if np.array_equal(codes, np.arange(len(codes))):
    return idx.astype(jnp.uint8)
  return jnp.take(jnp.asarray(codes, jnp.uint8), idx, axis=0, mode="clip")


def _lut_stochastic_round(y: jax.Array, qt: qtypes.QType, u: jax.Array) -> jax.Array:
  """The neighbour above ``y`` with probability ``(y - lo) / (hi - lo)``, else the one below
  (so ``E = y`` inside the set's range); beyond the ends, the end."""
  vals, codes, _, _ = _lut_table(qt)
  y = y.astype(jnp.float32)
  lo = jnp.zeros(y.shape, jnp.int32)
  for v in vals[1:]:
    lo = lo + (y >= v).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, len(vals) - 1)
  table = jnp.asarray(vals)
  v_lo, v_hi = jnp.take(table, lo, axis=0), jnp.take(table, hi, axis=0)
  gap = v_hi - v_lo
  p = jnp.clip((y - v_lo) / jnp.where(gap > 0, gap, 1.0), 0.0, 1.0)
  return _sorted_to_codes(jnp.where(u < p, hi, lo), codes)


def round_nearest(y: jax.Array, qt: qtypes.QType) -> jax.Array:
  """Rounds ``y`` (already divided by the scale) to ``qt``'s values.

  Binary maps ``y >= 0`` to +1 and ``y < 0`` to -1 (sign with sign(0) = +1,
  so every value is +-1). Integers round half to even and clip. LUT qtypes
  give the code of the nearest value of the set (ties: the even code; see
  the module docstring).
  """
  if qt.is_lut:
    return _lut_round_nearest(y, qt)
  if qt.kind == "binary":
    return jnp.where(y >= 0, 1, -1).astype(jnp.int8)
  if qt.is_float:
    return _clip(y, qt).astype(qt.compute_dtype)
  return _clip(jnp.round(y), qt).astype(qt.compute_dtype)


def fp8_round_with_noise(y: jax.Array, dtype, u: jax.Array) -> jax.Array:
  """Rounds float32 ``y`` to a neighbour on the fp8 grid of ``dtype`` (not clipped).

  The magnitude goes up to the next grid value with probability equal to its
  distance from the one below, given ``u`` uniform in [0, 1). In the fp8
  normal range this is done on the float32 bit pattern: the fp8 grid of a
  binade is every ``2**drop``-th pattern (``drop = 23 - nmant``), so adding
  ``floor(u * 2**drop)`` and clearing the low ``drop`` bits rounds up exactly
  when the dropped bits plus the noise carry (a carry into the exponent gives
  the next power of two, the right neighbour at a binade edge). Below the
  smallest fp8 normal the grid is uniform with the subnormal spacing.
  """
  fi = jnp.finfo(dtype)
  drop = 23 - fi.nmant
  a = jnp.abs(y)
  n = (u * float(2**drop)).astype(jnp.uint32)
  bits = (lax.bitcast_convert_type(a, jnp.uint32) + n) & jnp.uint32(~(2**drop - 1) & 0xFFFFFFFF)
  normal = lax.bitcast_convert_type(bits, jnp.float32)
  sub_step = float(2.0 ** (fi.minexp - fi.nmant))
  sub = jnp.floor(a * (1.0 / sub_step) + u) * sub_step
  r = jnp.where(a < float(fi.smallest_normal), sub, normal)
  # A product with -1, not a negation: Pallas Triton lowers -r as 0 - r, which makes a
  # negative value's zero +0 where XLA's negation gives -0 (one set of code bits everywhere).
  return r * jnp.where(y < 0, -1.0, 1.0)


def stochastic_round(y: jax.Array, qt: qtypes.QType, key: jax.Array, *, method: str = "uniform") -> jax.Array:
  """Rounds ``y`` to ``qt`` stochastically (unbiased inside the range).

  Binary: +1 with probability (1 + y) / 2 (clipped to [0, 1]), so the mean is
  ``clip(y, -1, 1)``.
  """
  u = _noise(key, y.shape, method)
  y = y.astype(jnp.float32)
  if qt.is_lut:
    return _lut_stochastic_round(y, qt, u)
  if qt.kind == "binary":
    return jnp.where(u < (1.0 + jnp.clip(y, -1, 1)) * 0.5, 1, -1).astype(jnp.int8)
  if qt.is_float:
    return _clip(fp8_round_with_noise(y, qt.compute_dtype, u), qt).astype(qt.compute_dtype)
  return _clip(jnp.floor(y + u), qt).astype(qt.compute_dtype)
