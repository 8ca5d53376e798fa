"""Experiment: decode two packed weights per 32-bit instruction with inline PTX (GPU only).

benchmarks/RESULTS.md ("What limits the sub-byte kernels") measured the W1A16
and W4A16 small-M kernels bound by their in-kernel decode: each weight costs
3-5 integer instructions (shift, mask/or, truncate to 16 bits), because the
Triton lowering has no width-changing bitcast from one int32 to two bf16.
``jax.experimental.pallas.triton.elementwise_inline_asm`` with ``pack=2`` can
build a bf16x2 register from two words directly:

* binary plane ``s`` (taking ``~words``): shift each word's bit ``s`` to the
  sign bit of its half (bit 15 / bit 31), then two ``lop3`` merge the signs
  into the pattern of 1.0 in both halves: 4 instructions per 2 weights;
* int4 slot ``s``: shift and mask each word's nibble into its half, XOR the
  sign offset and OR the bf16 pattern of 128 in one ``lop3``, then one
  ``fma.rn.bf16x2`` subtracts 136 from both halves: about 6 per 2 weights.

This script swaps those decoders in for :func:`qtrain.pallas._common.
decode_binary_to_16bit` / ``decode_int_to_16bit`` while the kernels trace (plane
path: static slot ``s``; any other call keeps the shipped decoder), checks the
result bit for bit against the shipped kernel, and times both at M = 16.
Nothing here is used by qtrain until it is measured faster.

  PYTHONPATH=. python benchmarks/explore_asm.py
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _timing  # noqa: E402
from qtrain.pallas import _common  # noqa: E402
from qtrain.pallas import binary_matmul as bmm  # noqa: E402
from qtrain.pallas import nbit_matmul as nbm  # noqa: E402
from qtrain.pallas import prepared  # noqa: E402
from qtrain.pallas._qmatmul import BlockConfig  # noqa: E402

_SHIPPED_BINARY = _common.decode_binary_to_16bit
_SHIPPED_INT = _common.decode_int_to_16bit


def _shift(reg: str, src: str, left: int) -> str:
  """PTX moving ``src`` left by ``left`` bits (right if negative) into ``reg``."""
  if left >= 0:
    return f"shl.b32 {reg}, {src}, {left};"
  return f"shr.b32 {reg}, {src}, {-left};"


def _asm2(asm: str, words: jax.Array, dtype) -> jax.Array:
  (out,) = _common.plt.elementwise_inline_asm(
      asm, args=[words], constraints="=r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, dtype)])
  return out


def binary_asm(inv_words: jax.Array, s, dtype) -> jax.Array:
  """``decode_binary_to_16bit`` for a static slot, two weights per instruction group."""
  if not isinstance(s, int) or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return _SHIPPED_BINARY(inv_words, s, dtype)
  asm = "\n".join([
      "{", ".reg .b32 t0, t1, m0, m1, one;",
      _shift("t0", "$1", 15 - s),
      _shift("t1", "$2", 31 - s),
      "mov.b32 m0, 0x00008000;", "mov.b32 m1, 0x80000000;", "mov.b32 one, 0x3F803F80;",
      "lop3.b32 t0, t0, m0, one, 0xEA;",  # (t0 & m0) | one
      "lop3.b32 $0, t1, m1, t0, 0xEA;",  # (t1 & m1) | t0
      "}"])
  return _asm2(asm, inv_words, dtype)


def int4_asm(words: jax.Array, s, bits: int, dtype) -> jax.Array:
  """``decode_int_to_16bit`` for int4 codes at a static slot (bf16 only)."""
  if not isinstance(s, int) or bits != 4 or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return _SHIPPED_INT(words, s, bits, dtype)
  asm = "\n".join([
      "{", ".reg .b32 t0, t1, m0, m1, x, one, off;",
      _shift("t0", "$1", -4 * s),
      _shift("t1", "$2", 16 - 4 * s),
      "mov.b32 m0, 0x0000000F;", "mov.b32 m1, 0x000F0000;",
      "and.b32 t0, t0, m0;",
      "and.b32 t1, t1, m1;",
      "mov.b32 x, 0x00080008;",
      "or.b32 t0, t0, t1;",
      "xor.b32 t0, t0, x;",  # two's complement -> offset code (c + 8)
      "mov.b32 x, 0x43004300;", "or.b32 t0, t0, x;",  # bf16 128 + (c + 8), both halves
      "mov.b32 one, 0x3F803F80;", "mov.b32 off, 0xC308C308;",  # 1.0, -136.0
      "fma.rn.bf16x2 $0, t0, one, off;",
      "}"])
  return _asm2(asm, words, dtype)


@contextlib.contextmanager
def asm_decoders():
  _common.decode_binary_to_16bit = binary_asm
  _common.decode_int_to_16bit = int4_asm
  try:
    yield
  finally:
    _common.decode_binary_to_16bit = _SHIPPED_BINARY
    _common.decode_int_to_16bit = _SHIPPED_INT


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--k", type=int, default=8192)
  ap.add_argument("--n", type=int, default=28672)
  ap.add_argument("--m", type=int, default=16)
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  k, n, m = args.k, args.n, args.m
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.float32)
  sign = jnp.where(w > 0, 1, -1).astype(jnp.int8)
  wg = w.reshape(n, k // 128, 128)
  s4 = jnp.max(jnp.abs(wg), axis=2) / 7
  q4 = jnp.clip(jnp.round(wg / s4[..., None]), -8, 7).astype(jnp.int8).reshape(n, k)
  del w, wg
  cases = []
  for kn, cfg in ((False, BlockConfig(block_m=16, block_n=128, num_stages=3)),
                  (True, BlockConfig(block_m=16, block_n=256, num_warps=8, num_stages=3))):
    wb = prepared.prepare_weight(sign, "binary", kn=kn)
    cases.append((f"binary W1A16 {'kn' if kn else 'nk'} bn{cfg.block_n}", wb, cfg,
                  functools.partial(bmm.binary_matmul, out_dtype=jnp.bfloat16, config=cfg),
                  n * k / 8))
    w4 = prepared.prepare_weight(q4, "int4", scale=s4, group_size=128, kn=kn)
    cases.append((f"int4 W4A16 g128 {'kn' if kn else 'nk'} bn{cfg.block_n}", w4, cfg,
                  functools.partial(nbm.nbit_matmul, out_dtype=jnp.bfloat16, config=cfg),
                  n * k / 2 + 4 * n * k / 128))
  bf16_w = sign.astype(jnp.bfloat16).T
  t_bf16 = _timing.time_in_loop(lambda x, w: x @ w, x, bf16_w)
  print(f"{'xla bf16 x @ w':40s} {t_bf16 * 1e6:8.1f} us", flush=True)
  rows = [dict(case="xla bf16", us=t_bf16 * 1e6)]
  for name, wp, cfg, fn, wbytes in cases:
    shipped = jax.jit(fn)(x, wp)
    row = dict(case=name)
    try:
      with asm_decoders():
        f_asm = jax.jit(lambda x, w, fn=fn: fn(x, w))
        got = f_asm(x, wp)
        row["max_abs_diff_vs_shipped"] = float(np.max(np.abs(
            np.asarray(got, np.float32) - np.asarray(shipped, np.float32))))
        row["asm_us"] = _timing.time_in_loop(fn, x, wp) * 1e6
    except Exception as e:  # noqa: BLE001  (report, keep going)
      row["asm_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    row["shipped_us"] = _timing.time_in_loop(fn, x, wp) * 1e6
    row["weight_TBps_shipped"] = wbytes / row["shipped_us"] / 1e6
    rows.append(row)
    print(f"{name:40s} shipped {row['shipped_us']:8.1f} us  asm {row.get('asm_us', float('nan')):8.1f}"
          f" us  diff {row.get('max_abs_diff_vs_shipped')}  {row.get('asm_error', '')}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
