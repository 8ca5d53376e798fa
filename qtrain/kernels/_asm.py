"""Inline-PTX weight decoders for the Triton kernels (GPU only).

The pure-jnp decoders of :mod:`qtrain.kernels._common` cost one or more 32-bit
instructions *per decoded value* (Triton has no width-changing bitcast), and
the small-M sub-byte kernels are bound by that decode (docs/performance-history.md,
"Pallas kernels vs XLA"). These decoders emit PTX through
``pallas.triton.elementwise_inline_asm`` and work on two (16-bit outputs) or
four (int8 outputs) values per instruction, one slot (one plane of the plane
layout) per call: Pallas lowers a single result per call. The byte shuffles
that gather the words' bits are the same for the slots of one half-word or
byte, and ``ptxas``, which optimizes the whole PTX, inline assembly
included, is free to share them:

* ``float16`` (binary / int2 / int4 weights, bf16 or f16 activations; two
  words per instance): ``prmt`` puts the low (or high) halves of the two
  words side by side, then per slot one shift and one ``lop3`` place both
  values' bits in a bf16x2 / f16x2 register (binary: the sign under the
  pattern of 1.0; integers: the offset code under the magic number ``2**m``,
  then one ``fma.rn`` subtracts ``2**m + 2**(bits-1)`` from both halves).
* ``byte_top`` (binary / int2 / int4 weights, int8 activations; four words
  per instance): three ``prmt`` gather byte ``b`` of the four words, then per
  slot a shift and an ``and`` move each byte's field to its top bits — the
  same int8 values (code * 2**(8 - bits)) as
  :func:`qtrain.kernels._common.byte_slot_to_top`.

Every output element depends only on its own input word (the instance merely
shares instructions between its two or four elements), so the result does
not depend on how Triton groups elements into instances. The outputs are the
same bits as the jnp decoders' (checked on the GPU by the kernel tests:
``pytest -m gpu``); the interpreter cannot run PTX, so interpret mode keeps
the jnp decoders.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.kernels import _common

_F16 = {  # dtype -> (bits of 1.0, fma suffix, magic exponent pattern 2**m, mantissa bits)
    jnp.dtype(jnp.bfloat16): (0x3F80, "bf16x2", 0x4300, 7),
    jnp.dtype(jnp.float16): (0x3C00, "f16x2", 0x6400, 10),
}


def _dup(v16: int) -> str:
  """A 16-bit pattern in both halves of a 32-bit PTX immediate."""
  return f"0x{(v16 << 16) | v16:08X}"


def _neg16(value: float, dtype) -> int:
  """Bits of ``-value`` in the 16-bit float ``dtype`` (numpy: no tracing; exact here)."""
  return int(np.asarray(-value, dtype=jnp.dtype(dtype)).view(np.uint16))


def supports(*, w_binary: bool, w_bits: int, a_format: str, a_dtype, byte_shift: int) -> bool:
  """Whether a packed weight's decode has an inline-PTX form here."""
  if not (w_binary or w_bits in (2, 4)):
    return False
  if a_format == "float":
    return jnp.dtype(a_dtype) in _F16
  return byte_shift > 0  # int8 / binary activations, byte decoding


def _float16_ptx(s: int, bits: int, binary: bool, dtype) -> str:
  one, fma, magic, mant = _F16[jnp.dtype(dtype)]
  per_half = 16 // bits
  sl = s % per_half  # field of each 16-bit half
  lines = ["{", ".reg .b32 u, t, one, off;",
           f"prmt.b32 u, $1, $2, {'0x5410' if s < per_half else '0x7632'};"]
  src = "u"
  if binary:
    if sl != 15:
      lines.append(f"shl.b32 t, u, {15 - sl};")
      src = "t"
    # (~bit at 15/31) | 1.0: code 1 is +1, code 0 is -1.
    lines.append(f"lop3.b32 $0, {src}, 0x80008000, {_dup(one)}, 0xAE;")
  else:
    half = 1 << (bits - 1)
    mask = (1 << bits) - 1
    if sl:
      lines.append(f"shr.b32 t, u, {bits * sl};")
      src = "t"
    lines += [
        # (field ^ half) | 2**m in both halves, i.e. 2**m + value + half ...
        f"lop3.b32 t, {src}, {_dup(mask)}, {_dup(magic | half)}, 0x6A;",
        f"mov.b32 one, {_dup(one)};",
        f"mov.b32 off, {_dup(_neg16(float(2 ** mant + half), dtype))};",
        f"fma.rn.{fma} $0, t, one, off;"]  # ... minus (2**m + half)
  lines.append("}")
  return "\n".join(lines)


def _byte_top_ptx(s: int, bits: int) -> str:
  per_byte = 8 // bits
  b = s // per_byte
  sel = f"0x{((4 + b) << 4) | b:04X}"
  top = {1: 0x80808080, 2: 0xC0C0C0C0, 4: 0xF0F0F0F0}[bits]
  up = 8 - bits * (s % per_byte + 1)
  lines = ["{", ".reg .b32 p, r, q;",
           f"prmt.b32 p, $1, $2, {sel};",
           f"prmt.b32 r, $3, $4, {sel};",
           "prmt.b32 q, p, r, 0x5410;"]  # byte b of the four words
  if up:
    lines.append(f"shl.b32 q, q, {up};")
  lines += [f"and.b32 $0, q, 0x{top:08X};", "}"]
  return "\n".join(lines)


def decode_slot(words: jax.Array, s: int, *, w_binary: bool, w_bits: int, a_format: str,
                a_dtype) -> jax.Array:
  """Slot ``s`` of a word tile, decoded by one inline-PTX call.

  Args:
    words: int32 word tile in the plane layout (raw codes, not inverted).
    s: the slot (a Python int).
    w_binary, w_bits: the weights' code.
    a_format: "float" (16-bit outputs in ``a_dtype``) or "int8"/"binary"
      (int8 outputs, fields moved to the top bits).
    a_dtype: the activations' dtype.

  Returns:
    An array shaped like ``words``: what
    :func:`qtrain.kernels._common.decode_binary_to_16bit` (of ``~words``),
    ``decode_int_to_16bit`` or ``byte_slot_to_top`` give for slot ``s``.
  """
  bits = 1 if w_binary else w_bits
  if not 0 <= s < 32 // bits:
    raise ValueError(f"slot {s} out of range for {bits}-bit codes (0..{32 // bits - 1})")
  if a_format == "float":
    asm, pack, dtype = _float16_ptx(s, bits, w_binary, a_dtype), 2, jnp.dtype(a_dtype)
  else:
    asm, pack, dtype = _byte_top_ptx(s, bits), 4, jnp.dtype(jnp.int8)
  (out,) = _common.plt.elementwise_inline_asm(
      asm, args=[words], constraints=",".join(["=r"] + ["r"] * pack), pack=pack,
      result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, dtype)])
  return out
