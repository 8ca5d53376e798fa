"""The inline-PTX decoders of qtrain.kernels._asm, checked on the CPU.

The PTX only runs on a GPU (there the kernel tests, ``pytest -m gpu``, run it
inside the kernels). Here a small emulator of the few PTX instructions the
decoders emit (prmt, shl, shr, and, lop3, mov, fma.rn.{bf16x2,f16x2}, written
from the PTX ISA's definitions) runs the generated programs on random words
and compares every output bit with the jnp decoders the interpreter uses.
"""

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qtrain.kernels import _asm
from qtrain.kernels import _common

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = 0
  for i in range(4):
    nib = (c >> (4 * i)) & 0xF
    byte = pool[nib & 7]
    if nib & 8:  # sign-replicate mode
      byte = 0xFF if byte & 0x80 else 0
    out |= byte << (8 * i)
  return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
  out = 0
  for bit in range(32):
    idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
    out |= ((lut >> idx) & 1) << bit
  return out


def _fma16x2(a: int, b: int, c: int, dtype) -> int:
  out = 0
  for h in range(2):
    x = [np.array([(v >> (16 * h)) & 0xFFFF], np.uint16).view(dtype)[0].astype(np.float64)
         for v in (a, b, c)]
    r = np.array([x[0] * x[1] + x[2]], np.float64).astype(dtype)  # one rounding (.rn)
    out |= int(r.view(np.uint16)[0]) << (16 * h)
  return out


def run_ptx(ptx: str, inputs: list[int], n_out: int) -> list[int]:
  """Runs one instance of a generated decoder program on 32-bit ``inputs``."""
  regs = {f"${n_out + i}": v & M32 for i, v in enumerate(inputs)}

  def val(tok: str) -> int:
    tok = tok.strip()
    if tok in regs:
      return regs[tok]
    return int(tok, 0) & M32

  for line in ptx.splitlines():
    line = line.strip().rstrip(";")
    if not line or line in "{}" or line.startswith(".reg"):
      continue
    op, rest = line.split(None, 1)
    args = [a.strip() for a in rest.split(",")]
    d, src = args[0], args[1:]
    if op == "prmt.b32":
      regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
    elif op == "shl.b32":
      regs[d] = (val(src[0]) << val(src[1])) & M32
    elif op == "shr.b32":
      regs[d] = val(src[0]) >> val(src[1])
    elif op == "and.b32":
      regs[d] = val(src[0]) & val(src[1])
    elif op == "mov.b32":
      regs[d] = val(src[0])
    elif op == "lop3.b32":
      regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
    elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
      dtype = ml_dtypes.bfloat16 if "bf16" in op else np.float16
      regs[d] = _fma16x2(val(src[0]), val(src[1]), val(src[2]), dtype)
    else:
      raise AssertionError(f"the emulator does not know {op!r}")
  return [regs[f"${i}"] for i in range(n_out)]


def _emulate(words: np.ndarray, s: int, *, binary, bits, a_format, dtype):
  """Applies the slot-``s`` decoder to an int32 array, instance by instance."""
  flat = words.reshape(-1).astype(np.int64) & M32
  b = 1 if binary else bits
  if a_format == "float":
    ptx, pack = _asm._float16_ptx(s, b, binary, dtype), 2
  else:
    ptx, pack = _asm._byte_top_ptx(s, b), 4
  width = 32 // pack
  out = np.zeros(flat.size, np.int64)
  for i in range(0, flat.size, pack):
    (r,) = run_ptx(ptx, [int(v) for v in flat[i:i + pack]], 1)
    for e in range(pack):
      out[i + e] = (r >> (width * e)) & ((1 << width) - 1)
  return out.astype(np.uint16 if pack == 2 else np.uint8).reshape(words.shape)


def _jnp_decode(words, s, *, binary, bits, a_format, dtype):
  w = jnp.asarray(words, jnp.int32)
  if a_format == "float":
    d = (_common.decode_binary_to_16bit(~w, s, dtype) if binary
         else _common.decode_int_to_16bit(w, s, bits, dtype))
    return np.asarray(d).view(np.uint16)
  per_byte = 8 // (1 if binary else bits)
  byte = _common.word_byte(w, s // per_byte)
  return np.asarray(_common.byte_slot_to_top(byte, s % per_byte, 1 if binary else bits)).view(np.uint8)


@pytest.mark.parametrize("binary,bits", [(True, 1), (False, 2), (False, 4)])
@pytest.mark.parametrize("a_format,dtype", [("float", jnp.bfloat16), ("float", jnp.float16),
                                            ("int8", jnp.int8)])
def test_decoders_match_jnp_bit_for_bit(binary, bits, a_format, dtype):
  rng = np.random.default_rng(bits * 31 + len(a_format))
  words = rng.integers(-2**31, 2**31, (3, 8), dtype=np.int64).astype(np.int32)
  for s in range(32 // (1 if binary else bits)):
    got = _emulate(words, s, binary=binary, bits=bits, a_format=a_format, dtype=dtype)
    want = _jnp_decode(words, s, binary=binary, bits=bits, a_format=a_format, dtype=dtype)
    np.testing.assert_array_equal(got, want, err_msg=f"slot {s}")


def test_slot_out_of_range():
  w = jnp.zeros((4, 4), jnp.int32)
  with pytest.raises(ValueError, match="slot 8 out of range for 4-bit codes"):
    _asm.decode_slot(w, 8, w_binary=False, w_bits=4, a_format="float", a_dtype=jnp.bfloat16)


def test_supports():
  assert _asm.supports(w_binary=True, w_bits=1, a_format="float", a_dtype=jnp.bfloat16, byte_shift=0)
  assert not _asm.supports(w_binary=True, w_bits=1, a_format="float", a_dtype=jnp.float32,
                           byte_shift=0)
  assert not _asm.supports(w_binary=False, w_bits=8, a_format="float", a_dtype=jnp.bfloat16,
                           byte_shift=0)
  assert _asm.supports(w_binary=False, w_bits=4, a_format="int8", a_dtype=jnp.int8, byte_shift=4)
  assert not _asm.supports(w_binary=True, w_bits=1, a_format="int8", a_dtype=jnp.int8, byte_shift=0)


def test_emulator_knows_each_instruction():
  # prmt from the PTX ISA example table: selector 0x5410 puts the low halves side by side.
  assert _prmt(0x33221100, 0x77665544, 0x5410) == 0x55441100
  assert _prmt(0x000000F0, 0, 0x0008) == 0xF0F0F0FF  # sign replicate of byte 0 into byte 0
  assert _lop3(0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA, 0x6A) == (0xF0F0F0F0 & 0xCCCCCCCC) ^ 0xAAAAAAAA
  assert re.fullmatch(r"0x[0-9A-F]{8}", _asm._dup(0x3F80))
