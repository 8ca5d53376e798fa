"""Rounding into a qtype: round-to-nearest and stochastic rounding.

Stochastic rounding rounds ``y`` up with probability equal to its distance
from the value below, so ``E[round(y)] = y``: it is unbiased where
round-to-nearest is biased (small gradient values all collapse to 0).

Methods:
  * ``"uniform"``: one independent uniform draw per element (32 random bits).
  * ``"low_bit_uniform"``: one independent draw per element with only 8
    random bits: each 32-bit PRNG word feeds 4 elements, so it costs a
    quarter of the PRNG work of ``"uniform"`` (JAX's threefry computes one
    full hash per word whatever its width; on an H200 this is what limits a
    QT step's rounding passes, benchmarks/RESULTS.md). The rounding
    probability is quantized to 1/256 steps: bias <= 1/512 of a step.

Both work for integer qtypes (the step is 1) and for fp8 qtypes (the step is
the fp8 spacing at ``y``, so the result is one of the two fp8 neighbours).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.core import rounding, qtypes
  >>> y = jnp.full((100_000,), 0.25)
  >>> q = rounding.stochastic_round(y, qtypes.get_qtype("int8"), jax.random.key(0))
  >>> bool(abs(q.astype(jnp.float32).mean() - 0.25) < 0.01)
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qtrain.core import qtypes

STOCHASTIC_METHODS: tuple[str, ...] = ("uniform", "low_bit_uniform")


def _noise(key: jax.Array, shape, method: str) -> jax.Array:
  """Uniform noise in [0, 1), one independent value per element."""
  if method == "uniform":
    return jax.random.uniform(key, shape, jnp.float32)
  if method == "low_bit_uniform":
    return (_bytes(key, shape).astype(jnp.float32) + 0.5) * (1.0 / 256.0)
  raise ValueError(f"Unknown stochastic rounding method={method!r}; valid: {list(STOCHASTIC_METHODS)}")


def _random_words(key: jax.Array, shape) -> jax.Array:
  """Independent uniform uint32 words (JAX's PRNG for ``key``'s implementation)."""
  return jax.random.bits(key, shape, jnp.uint32)


def _bytes(key: jax.Array, shape) -> jax.Array:
  """Independent uniform bytes (as uint32 in [0, 256)): the 4 bytes of each
  32-bit word of ``jax.random.bits`` go to 4 consecutive elements of the last
  axis (``jax.random.bits(..., jnp.uint8)`` would spend one word per byte)."""
  shape = tuple(shape)
  if not shape:
    return _random_words(key, ()) & 0xFF
  n = shape[-1]
  words = _random_words(key, shape[:-1] + (-(-n // 4),))
  shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
  b = (words[..., None] >> shifts) & 0xFF
  return b.reshape(shape[:-1] + (-1,))[..., :n]


def _clip(y: jax.Array, qt: qtypes.QType) -> jax.Array:
  return jnp.clip(y, qt.qmin, qt.qmax)


def round_nearest(y: jax.Array, qt: qtypes.QType) -> jax.Array:
  """Rounds ``y`` (already divided by the scale) to ``qt``'s values.

  Binary maps ``y >= 0`` to +1 and ``y < 0`` to -1 (sign with sign(0) = +1,
  so every value is +-1). Integers round half to even and clip.
  """
  if qt.kind == "binary":
    return jnp.where(y >= 0, 1, -1).astype(jnp.int8)
  if qt.is_float:
    return _clip(y, qt).astype(qt.compute_dtype)
  return _clip(jnp.round(y), qt).astype(qt.compute_dtype)


def _fp8_spacing(y: jax.Array, dtype) -> jax.Array:
  """Spacing of the fp8 grid at ``|y|`` (the subnormal spacing near zero)."""
  fi = jnp.finfo(dtype)
  # frexp gives the exact binade (|y| = m * 2^e, m in [0.5, 1)); a float32
  # log2 rounds up to the next integer just below a power of two.
  _, e = jnp.frexp(y)
  e = jnp.where(y == 0, fi.minexp, jnp.maximum(e - 1, fi.minexp))
  return jnp.ldexp(jnp.ones_like(y, jnp.float32), e - fi.nmant)


def stochastic_round(y: jax.Array, qt: qtypes.QType, key: jax.Array, *, method: str = "uniform") -> jax.Array:
  """Rounds ``y`` to ``qt`` stochastically (unbiased inside the range).

  Binary: +1 with probability (1 + y) / 2 (clipped to [0, 1]), so the mean is
  ``clip(y, -1, 1)``.
  """
  u = _noise(key, y.shape, method)
  y = y.astype(jnp.float32)
  if qt.kind == "binary":
    return jnp.where(u < (1.0 + jnp.clip(y, -1, 1)) * 0.5, 1, -1).astype(jnp.int8)
  if qt.is_float:
    step = _fp8_spacing(y, qt.compute_dtype)
    r = jnp.floor(y / step + u) * step
    return _clip(r, qt).astype(qt.compute_dtype)
  return _clip(jnp.floor(y + u), qt).astype(qt.compute_dtype)
