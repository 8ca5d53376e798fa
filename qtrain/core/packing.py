"""Bit packing of 1/2/4/8-bit quantized values into 32-bit words.

THE LAYOUT (the contract every Pallas kernel in :mod:`qtrain.kernels` reads):

* Words are ``uint32``. A word holds ``values_per_word(bits) = 32 // bits``
  values of one row, taken along the packed axis (the contracting axis K).
* Value ``k`` of a row lives in word ``k // values_per_word`` at bit offset
  ``(k % values_per_word) * bits``: least-significant bits first, the row
  contiguous in K ("K-contiguous"). For a weight stored ``(N, K)`` the packed
  array is ``(N, ceil(K / values_per_word))``.
* Codes: integer qtypes (``int2``, ``int4``, ``int8``, ``ternary``) store
  the low ``bits`` bits of the two's-complement value and are sign-extended on
  unpacking (``int4`` -3 is ``0b1101``; ``ternary`` -1 is ``0b11``).
  ``binary`` stores bit 1 for +1 and bit 0 for -1. Value-set qtypes
  (``nf4``, ``mxfp4``) store their code (0..15, unsigned: the index into
  the qtype's value table; for ``mxfp4`` the e2m1 bit pattern) and unpack to
  uint8 codes.
* A ragged K is padded to whole words with code 0. That decodes to 0 for the
  integer qtypes and ``mxfp4``, to **-1** for ``binary`` and to the value
  **-1.0** for ``nf4`` (its code 0): :func:`unpack` takes the true size and
  crops, and a kernel that runs over padded K must pad the other operand with
  zeros so the padding contributes nothing.

Example:
  >>> import jax.numpy as jnp
  >>> from qtrain.core import packing
  >>> v = jnp.array([[1, -1, 1, 1, -1]], jnp.int8)
  >>> w = packing.pack(v, "binary")
  >>> w.shape, w.dtype
  ((1, 1), dtype('uint32'))
  >>> packing.unpack(w, "binary", size=5).tolist()
  [[1, -1, 1, 1, -1]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import qtypes

WORD_BITS = 32
WORD_DTYPE = jnp.uint32
PACKABLE_BITS = (1, 2, 4, 8)


def values_per_word(bits: int) -> int:
  """How many ``bits``-wide values one uint32 word holds."""
  if bits not in PACKABLE_BITS:
    raise ValueError(f"bits={bits} cannot be packed; valid: {PACKABLE_BITS}")
  return WORD_BITS // bits


def packed_size(size: int, bits: int) -> int:
  """Number of words a row of ``size`` values takes."""
  vpw = values_per_word(bits)
  return -(-size // vpw)


def _check_axis(axis, ndim: int, what: str) -> int:
  """``axis`` normalized to ``[0, ndim)``; a clear error for 0-d arrays and bad axes."""
  if ndim == 0:
    raise ValueError(f"{what} needs an array with at least one axis to pack along, got a 0-d "
                     "array (reshape a scalar to shape (1,))")
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)) \
      or not -ndim <= axis < ndim:
    raise ValueError(f"axis={axis!r} is out of range for an array with ndim={ndim}; "
                     f"valid: an int in [{-ndim}, {ndim - 1}]")
  return int(axis) % ndim


def _packable_qtype(qtype) -> qtypes.QType:
  qt = qtypes.get_qtype(qtype)
  if not qt.packable:
    packable = [n for n in qtypes.VALID_QTYPES if qtypes.get_qtype(n).packable]
    raise ValueError(f"qtype {qt.name!r} cannot be bit-packed; packable qtypes are {packable}")
  return qt


def encode(values: jax.Array, qtype) -> jax.Array:
  """Maps quantized values (int8) to their unsigned ``bits``-wide codes."""
  qt = _packable_qtype(qtype)
  if qt.kind == "binary":
    return (values > 0).astype(jnp.uint32)
  if qt.is_lut:
    return values.astype(jnp.uint32) & jnp.uint32(0xF)
  mask = (1 << qt.bits) - 1
  return values.astype(jnp.int32).astype(jnp.uint32) & jnp.uint32(mask)


def decode(codes: jax.Array, qtype) -> jax.Array:
  """Inverse of :func:`encode`: unsigned codes to int8 values."""
  qt = _packable_qtype(qtype)
  if qt.is_lut:
    return codes.astype(jnp.uint8)
  codes = codes.astype(jnp.int32)
  if qt.kind == "binary":
    return (2 * codes - 1).astype(jnp.int8)
  shift = 32 - qt.bits
  return ((codes << shift) >> shift).astype(jnp.int8)  # sign-extend


def pack(values: jax.Array, qtype, *, axis: int = -1) -> jax.Array:
  """Packs quantized int8 ``values`` along ``axis`` into uint32 words.

  Args:
    values: integer array of quantized values in the qtype's range (for
      binary, any value > 0 means +1 and anything else -1; for a value-set
      qtype its codes, 0..15). Concrete arrays are range-checked; under
      ``jit`` the range is the caller's contract.
    qtype: a packable qtype: ``binary``, ``ternary``, ``int2``..``int8``,
      ``nf4``, ``mxfp4``.
    axis: the axis to pack along (the contracting axis).

  Returns:
    uint32 array whose ``axis`` has length ``ceil(n / values_per_word)``.
  """
  qt = _packable_qtype(qtype)
  values = jnp.asarray(values)
  if not jnp.issubdtype(values.dtype, jnp.integer):
    raise ValueError(f"pack expects integer quantized values, got dtype {values.dtype}")
  axis = _check_axis(axis, values.ndim, "pack")
  if not isinstance(values, jax.core.Tracer) and qt.kind != "binary" and values.size:
    lo, hi = int(jnp.min(values)), int(jnp.max(values))
    qmin, qmax = (0, 15) if qt.is_lut else (int(qt.qmin), int(qt.qmax))
    if lo < qmin or hi > qmax:
      what = "codes" if qt.is_lut else "values"
      raise ValueError(f"{what} in [{lo}, {hi}] do not fit {qt.name} "
                       f"([{qmin}, {qmax}]): they would wrap when packed")
  vpw = values_per_word(qt.bits)
  n = values.shape[axis]
  pad = packed_size(n, qt.bits) * vpw - n
  codes = jnp.moveaxis(encode(values, qt), axis, -1)
  if pad:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
  codes = codes.reshape(codes.shape[:-1] + (-1, vpw))
  shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qt.bits).astype(jnp.uint32)
  # Codes occupy disjoint bit ranges, so the sum is a bitwise OR.
  words = jnp.sum(codes << shifts, axis=-1, dtype=jnp.uint32)
  return jnp.moveaxis(words, -1, axis)


def unpack(words: jax.Array, qtype, *, size: int, axis: int = -1) -> jax.Array:
  """Unpacks uint32 ``words`` along ``axis`` to ``size`` int8 values (uint8 codes for a
  value-set qtype).

  Raises:
    ValueError: if ``size`` does not fit the number of words.
  """
  qt = _packable_qtype(qtype)
  if words.dtype != WORD_DTYPE:
    raise ValueError(f"unpack expects {jnp.dtype(WORD_DTYPE)} words, got {words.dtype}")
  axis = _check_axis(axis, words.ndim, "unpack")
  vpw = values_per_word(qt.bits)
  nwords = words.shape[axis]
  if not (nwords - 1) * vpw < size <= nwords * vpw:
    raise ValueError(
        f"size={size} does not match {nwords} words of {vpw} {qt.name} values "
        f"(valid sizes: {(nwords - 1) * vpw + 1}..{nwords * vpw})"
    )
  w = jnp.moveaxis(words, axis, -1)
  shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qt.bits).astype(jnp.uint32)
  mask = jnp.uint32((1 << qt.bits) - 1) if qt.bits < 32 else jnp.uint32(0xFFFFFFFF)
  codes = (w[..., None] >> shifts) & mask
  codes = codes.reshape(w.shape[:-1] + (nwords * vpw,))[..., :size]
  return jnp.moveaxis(decode(codes, qt), -1, axis)
