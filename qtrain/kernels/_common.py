"""Shared pieces of the qtrain Pallas kernels: backend handles, tile layout, decoders.

The kernel tile layout (derived from :mod:`qtrain.core.packing`)
-----------------------------------------------------------------
:mod:`qtrain.core.packing` stores value ``k`` of a row in word ``k // vpw`` at
bit offset ``(k % vpw) * bits`` (``vpw = 32 // bits``). Unpacking that order
inside a kernel needs a (rows, words, vpw) -> (rows, K) reshape that Triton
lowers to register shuffles. The kernels instead read a *plane* layout that the
wrappers derive once from the packed (or unpacked) weights:

* K is padded to a multiple of ``block_k = vpw * plane_words`` (code 0, and
  the other operand is padded with zeros, so padding adds nothing).
* Tile ``t`` covers values ``[t * block_k, (t + 1) * block_k)`` and is stored in
  words ``[t * plane_words, (t + 1) * plane_words)`` of the row.
* Word ``j`` of a tile holds, in its slot ``s`` (bits ``[s*bits, (s+1)*bits)``),
  value ``k = t * block_k + s * plane_words + j``.

So one shift-and-mask of a (rows, plane_words) word tile yields a (rows,
plane_words) *plane* of values that are contiguous in K: it multiplies a
contiguous slice of the activations with a tensor-core dot, with no reshape.
The codes are the ones of :mod:`qtrain.core.packing` (two's complement low bits
for integers, bit 1 = +1 / bit 0 = -1 for binary); only the order changes.
Words are held as int32 (Triton's dot rejects unsigned types, and arithmetic
shifts sign-extend).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax

from qtrain.core import _lax
from qtrain.core import packing
from qtrain.core import qtypes

with warnings.catch_warnings():
  # jax >= 0.11 deprecates the Triton backend with a DeprecationWarning.
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as plt  # noqa: F401

_MAGIC = 0x4B000000  # float32 bits of 2**23: OR-ing a small int into the mantissa gives 2**23 + int.
_SIGN = -(2**31)  # int32 with only the sign bit set.


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """A kernel output's ``jax.ShapeDtypeStruct`` typed as varying over every manual mesh axis
  (``jax.shard_map``) that any of ``operands`` varies over: what XLA's own ops infer for their
  results. A Pallas call inside a ``shard_map`` with ``check_vma=True`` (the default) refuses an
  output without that type; outside ``shard_map`` every operand varies over nothing."""
  like = next((m for x in operands
               if (m := getattr(jax.typeof(x), "manual_axis_type", None)) is not None), None)
  if like is None:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)
  varying = frozenset().union(*(_lax.varying_axes(x) for x in operands))
  mat = type(like)(varying=varying, unreduced=frozenset(), reduced=frozenset())
  return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)


def varying_like(out: jax.Array, *operands) -> jax.Array:
  """``out`` cast (``jax.lax.pcast``, a type change only) to vary over every manual mesh axis
  that any of ``operands`` varies over and ``out`` does not. Mosaic GPU's ``plgpu.kernel``
  drops the ``manual_axis_type`` of its ``out_type`` (jax 0.11), so a kernel output inside a
  ``jax.shard_map`` came out typed as replicated, and ``lax.platform_dependent`` refused the
  kernel branch beside XLA's (typed varying)."""
  want = frozenset().union(*(_lax.varying_axes(x) for x in operands))
  missing = tuple(sorted(want - _lax.varying_axes(out)))
  return lax.pcast(out, missing, to="varying") if missing else out


def cdiv(a: int, b: int) -> int:
  """Ceiling division of non-negative ints."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  """Smallest multiple of ``b`` that is >= ``a``."""
  return cdiv(a, b) * b


def is_pow2(x: int) -> bool:
  """Whether ``x`` is a positive power of two."""
  return x > 0 and (x & (x - 1)) == 0


def triton_params(*, num_warps: int, num_stages: int):
  """Explicit Triton compiler params (on jax 0.10.2, omitting them picks Mosaic GPU)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def on_gpu() -> bool:
  """Whether JAX's default backend is a GPU."""
  return jax.default_backend() == "gpu"


def num_sms() -> int:
  """Streaming multiprocessors of the first GPU (132, an H100/H200 SXM, without one:
  configs chosen off a GPU, e.g. in CPU tests, assume that machine)."""
  try:
    return int(jax.local_devices(backend="gpu")[0].core_count)
  except (RuntimeError, AttributeError, IndexError):
    return 132


def on_hopper() -> bool:
  """Whether this process has a Hopper (compute capability 9.x) GPU."""
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:
    return False
  return bool(devices) and str(getattr(devices[0], "compute_capability", "")).startswith("9")


# ---------------------------------------------------------------------------
# Layout conversion (XLA side, run once per static weight).
# ---------------------------------------------------------------------------


def to_plane_layout(values: jax.Array, qtype, *, plane_words: int) -> jax.Array:
  """Packs quantized int8 ``values`` (rows, K) into the kernel plane layout.

  Args:
    values: integer array (rows, K) of quantized values of ``qtype``.
    qtype: a packable qtype (binary, ternary, int2, int4, int8).
    plane_words: words per plane (a power of two).

  Returns:
    int32 array (rows, ceil(K / block_k) * plane_words) with
    ``block_k = (32 // bits) * plane_words``.
  """
  qt = qtypes.get_qtype(qtype)
  vpw = packing.values_per_word(qt.bits)
  rows, k = values.shape
  block_k = vpw * plane_words
  kp = round_up(max(k, 1), block_k)
  codes = packing.encode(values, qt)  # uint32 codes, binary: 1 = +1
  if kp != k:
    codes = jnp.pad(codes, ((0, 0), (0, kp - k)))
  codes = codes.reshape(rows, kp // block_k, vpw, plane_words)
  shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qt.bits)[None, None, :, None]
  words = jnp.sum(codes << shifts, axis=2, dtype=jnp.uint32)  # disjoint bits: sum == or
  return lax.bitcast_convert_type(words.reshape(rows, -1), jnp.int32)


def packed_to_plane_layout(words: jax.Array, qtype, *, size: int, plane_words: int) -> jax.Array:
  """Re-lays out words packed by :func:`qtrain.core.packing.pack` (along the last axis)."""
  values = packing.unpack(words, qtype, size=size, axis=-1)
  return to_plane_layout(values, qtype, plane_words=plane_words)


def from_plane_layout(words: jax.Array, qtype, *, size: int, plane_words: int) -> jax.Array:
  """Inverse of :func:`to_plane_layout`: int8 values (rows, size)."""
  qt = qtypes.get_qtype(qtype)
  vpw = packing.values_per_word(qt.bits)
  rows = words.shape[0]
  w = lax.bitcast_convert_type(words, jnp.uint32).reshape(rows, -1, 1, plane_words)
  shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qt.bits)[None, None, :, None]
  mask = jnp.uint32((1 << qt.bits) - 1) if qt.bits < 32 else jnp.uint32(0xFFFFFFFF)
  codes = ((w >> shifts) & mask).reshape(rows, -1)[:, :size]
  return packing.decode(codes, qt)


# ---------------------------------------------------------------------------
# In-kernel decoders: pure jnp on int32 word tiles, so they run both under
# Triton and in interpret mode. `s` (the slot) is a Python int.
# ---------------------------------------------------------------------------


def _shift(s, bits: int = 1):
  """``s * bits`` as an int32 shift amount (``s`` a Python int or an int32 array)."""
  return jnp.int32(s * bits) if isinstance(s, int) else (s * bits).astype(jnp.int32)


def _codes(words: jax.Array, s, bits: int) -> jax.Array:
  """Unsigned codes of slot ``s`` as int32 in [0, 2**bits).

  ``s`` is a Python int, or an int32 array broadcast against ``words`` (the
  flat large-M path decodes several slots at once).
  """
  shifted = words if isinstance(s, int) and s == 0 else lax.shift_right_logical(words, _shift(s, bits))
  return shifted & jnp.int32((1 << bits) - 1)


def decode_int_to_int8(words: jax.Array, s, bits: int) -> jax.Array:
  """Slot ``s`` of two's-complement ``bits``-wide codes, sign-extended, as int8."""
  if isinstance(s, int):
    up = 32 - bits * (s + 1)
    x = (words << jnp.int32(up)) if up else words
  else:
    x = words << (32 - bits * (s + 1)).astype(jnp.int32)
  return (x >> jnp.int32(32 - bits)).astype(jnp.int8)  # arithmetic shift sign-extends


def decode_int_to_float(words: jax.Array, s, bits: int, dtype) -> jax.Array:
  """Slot ``s`` of two's-complement codes as ``dtype`` without an int->float convert.

  ``code ^ 2**(bits-1)`` is the value plus 2**(bits-1); OR-ing it into the
  mantissa of 2**23 and subtracting 2**23 + 2**(bits-1) in float32 gives the
  value exactly (shift, logic, one float add; no I2F instruction).
  """
  half = 1 << (bits - 1)
  t = (_codes(words, s, bits) ^ jnp.int32(half)) | jnp.int32(_MAGIC)
  f = lax.bitcast_convert_type(t, jnp.float32) - jnp.float32(float(2**23 + half))
  return f.astype(dtype)


def decode_binary_to_bits_int8(words: jax.Array, s) -> jax.Array:
  """Slot ``s`` of binary codes as int8 bits {0, 1} (1 means +1)."""
  return _codes(words, s, 1).astype(jnp.int8)


def decode_binary_to_pm1_int8(words: jax.Array, s) -> jax.Array:
  """Slot ``s`` of binary codes as int8 {-1, +1}."""
  return (_codes(words, s, 1) * 2 - 1).astype(jnp.int8)


def decode_binary_to_float(inv_words: jax.Array, s, dtype) -> jax.Array:
  """Slot ``s`` of binary codes as +-1.0 in ``dtype``; takes ``~words``.

  Moves the inverted bit into float32's sign bit and ORs in the bits of 1.0:
  one shift and one logic op per value, no int->float convert.
  """
  if isinstance(s, int):
    sign = (inv_words << jnp.int32(31 - s)) if s != 31 else inv_words
  else:
    sign = inv_words << (31 - s).astype(jnp.int32)
  f = lax.bitcast_convert_type((sign & jnp.int32(_SIGN)) | jnp.int32(0x3F800000), jnp.float32)
  return f.astype(dtype)


_ONE16 = {jnp.dtype(jnp.bfloat16): 0x3F80, jnp.dtype(jnp.float16): 0x3C00}
_MAGIC16 = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0, 7), jnp.dtype(jnp.float16): (0x6400, 1024.0, 10)}


def has_16bit_decode(dtype, bits: int) -> bool:
  """Whether :func:`decode_int_to_16bit` / :func:`decode_binary_to_16bit` serve ``dtype``."""
  dtype = jnp.dtype(dtype)
  return dtype in _MAGIC16 and bits <= _MAGIC16[dtype][2]


def _as16(x32: jax.Array, dtype) -> jax.Array:
  """Low 16 bits of int32 ``x32`` reinterpreted as ``dtype`` (bf16 / f16)."""
  return lax.bitcast_convert_type(x32.astype(jnp.int16), dtype)


def decode_binary_to_16bit(inv_words: jax.Array, s, dtype) -> jax.Array:
  """Slot ``s`` of binary codes as +-1 in bf16/f16, built as 16-bit patterns; takes ``~words``.

  The inverted bit becomes bit 15 (the sign) and is OR-ed with the pattern
  of 1.0: shift + logic op, truncate, bitcast; no float conversion at all.
  """
  one = jnp.int32(_ONE16[jnp.dtype(dtype)])
  if isinstance(s, int):
    sign = (inv_words << jnp.int32(15 - s)) if s <= 15 else lax.shift_right_logical(
        inv_words, jnp.int32(s - 15))
  else:
    sign = lax.shift_right_logical(inv_words, s.astype(jnp.int32)) << jnp.int32(15)
  return _as16((sign & jnp.int32(0x8000)) | one, dtype)


def decode_int_to_16bit(words: jax.Array, s, bits: int, dtype) -> jax.Array:
  """Slot ``s`` of two's-complement codes as bf16/f16 via the 16-bit magic number.

  ``(code ^ 2**(bits-1)) | pattern(2**m)`` is ``2**m + value + 2**(bits-1)``
  exactly (m = mantissa bits); one 16-bit float subtraction gives the value.
  """
  pattern, base, _ = _MAGIC16[jnp.dtype(dtype)]
  half = 1 << (bits - 1)
  t = (_codes(words, s, bits) ^ jnp.int32(half)) | jnp.int32(pattern)
  return _as16(t, dtype) - jnp.asarray(base + half, dtype)


def word_byte(words: jax.Array, b: int) -> jax.Array:
  """Byte ``b`` (bits [8b, 8b + 8)) of int32 words as int8."""
  x = lax.shift_right_logical(words, jnp.int32(8 * b)) if b else words
  return x.astype(jnp.int8)


def byte_slot_to_top(byte: jax.Array, i: int, bits: int) -> jax.Array:
  """Field ``i`` (bits [i*bits, (i+1)*bits)) of an int8 byte moved to the top bits.

  The result, read as int8, is the field's two's-complement value times
  ``2**(8 - bits)`` (for binary codes, -128 for bit 1 and 0 for bit 0): one or
  two int8 ops per value instead of shift + sign-extend + truncate on int32.
  """
  up = 8 - bits * (i + 1)
  x = (byte << jnp.int8(up)) if up else byte
  if i == 0:
    return x  # the shift emptied the low bits
  return x & jnp.int8(-(1 << (8 - bits)))  # the top `bits` bits
