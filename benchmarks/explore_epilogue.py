"""How an int8 GEMM's output reaches its consumer on the GPU: XLA variants, measured.

In the int8 QT step (benchmarks/RESULTS.md, "Training step profile") XLA runs
cuBLAS's int8 GEMM with an int32 output and converts it to float32 in a
separate pass (``wrapped_convert``) before the consumer fusion. This script
times, side by side in one run, a forward layer's GEMM + epilogue + consumer
(bias, gelu, the next quantization's row absmax) for:

* ``s32``: ``dot(int8, int8) -> int32``, then ``* scales`` in float32 (what
  qtrain ships);
* ``f32``: ``dot(int8, int8, preferred_element_type=float32)``;
* ``bf16``: the bf16 GEMM on the float operands (the baseline);
* ``pallas``: qtrain's int8 kernel (scales fused into its epilogue, bf16 out).

and checks each int8 variant against the ``s32`` result (exact int32 sums).

``--step`` also times the whole ``qtrain_int8_lowbit`` training step with the
int8 products asked for float32 output. ``--pallas-epilogue-step`` times it
with :func:`qtrain.core.qdot.scale_product` (the scaled int32 -> float pass
after each cuBLAS int8 GEMM, which XLA runs as a separate convert plus a
consumer reading float32) replaced by a one-pass Pallas kernel writing the
output dtype directly (bf16 in the forward): all 2-D products, or only those
with a 16-bit output; the loss must not change.

  PYTHONPATH=. python benchmarks/explore_epilogue.py --json /tmp/epi.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing  # noqa: E402
import train_step  # noqa: E402
from qtrain.core import _lax as qlax  # noqa: E402
from qtrain.core import qdot  # noqa: E402
from qtrain.pallas import _common  # noqa: E402
from qtrain.pallas import int8_matmul, prepared  # noqa: E402

DN = (((1,), (1,)), ((), ()))  # (M, K) x (N, K)


def _consumer(y, bias):
  h = jax.nn.gelu(y.astype(jnp.float32) + bias)
  return h.astype(jnp.bfloat16), jnp.max(jnp.abs(h), axis=1)


def variants(m, k, n):
  ka, kb, kc = jax.random.split(jax.random.key(0), 3)
  a = jax.random.randint(ka, (m, k), -127, 128, jnp.int8)
  b = jax.random.randint(kb, (n, k), -127, 128, jnp.int8)
  sa = jax.random.uniform(kc, (m, 1), jnp.float32, 1e-4, 2e-4)
  sb = jnp.full((1, n), 1e-3, jnp.float32)
  bias = jnp.zeros((n,), jnp.float32)
  w = prepared.prepare_weight(b, "int8", scale=sb[0])

  def s32(a, b):
    acc = jax.lax.dot_general(a, b, DN, preferred_element_type=jnp.int32)
    return _consumer((acc.astype(jnp.float32) * sa * sb).astype(jnp.bfloat16), bias)

  def f32(a, b):
    acc = jax.lax.dot_general(a, b, DN, preferred_element_type=jnp.float32)
    return _consumer((acc * sa * sb).astype(jnp.bfloat16), bias)

  def pallas(a, b):
    out = int8_matmul.int8_matmul(a, w, x_scale=sa[:, 0], out_dtype=jnp.bfloat16,
                                  interpret=jax.default_backend() != "gpu")
    return _consumer(out, bias)

  fa, fb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)

  def bf16(fa, fb):
    return _consumer(jax.lax.dot_general(fa, fb, DN, preferred_element_type=jnp.bfloat16), bias)

  return {"s32": (s32, (a, b)), "f32": (f32, (a, b)), "pallas": (pallas, (a, b)),
          "bf16": (bf16, (fa, fb))}


def _epilogue_kernel(acc_ref, ls_ref, rs_ref, o_ref):
  out = acc_ref[...].astype(jnp.float32) * ls_ref[...] * rs_ref[...]
  o_ref[...] = out.astype(o_ref.dtype)


def pallas_scale_product(acc, ls_o, rs_o, *, out_dtype, interpret=False, bm=64, bn=256):
  """``scale_product`` of a 2-D int32 product as one Pallas pass (same op order)."""
  from jax.experimental import pallas as pl
  m, n = acc.shape
  ls = jnp.broadcast_to(ls_o.astype(jnp.float32), (m, 1))
  rs = jnp.broadcast_to(rs_o.astype(jnp.float32), (1, n))
  return pl.pallas_call(
      _epilogue_kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(m // bm, n // bn),
      in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((1, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      compiler_params=_common.triton_params(num_warps=4, num_stages=2),
      interpret=interpret, name="qtrain_scale_epilogue")(acc, ls, rs)


def patched_scale_product(*, only_16bit: bool, interpret: bool = False):
  shipped = qdot.scale_product

  def f(acc, ls_o, rs_o, *, grouped, out_dtype):
    ok = (not grouped and acc.ndim == 2 and acc.dtype == jnp.int32
          and acc.shape[0] % 64 == 0 and acc.shape[1] % 256 == 0
          and ls_o.ndim == 2 and ls_o.shape[1] == 1 and rs_o.ndim == 2 and rs_o.shape[0] == 1
          and (jnp.dtype(out_dtype).itemsize == 2 or not only_16bit))
    if not ok:
      return shipped(acc, ls_o, rs_o, grouped=grouped, out_dtype=out_dtype)
    return pallas_scale_product(acc, ls_o, rs_o, out_dtype=out_dtype, interpret=interpret)
  return f


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="8192x4096x16384,8192x16384x4096")
  ap.add_argument("--json", default="")
  ap.add_argument("--step", action="store_true",
                  help="also time the qtrain_int8_lowbit training step with int8 dots asked for "
                       "float32 (patched) vs int32 output (shipped)")
  ap.add_argument("--pallas-epilogue-step", action="store_true")
  args = ap.parse_args()
  rows = []
  if args.pallas_epilogue_step:
    shipped = qdot.scale_product
    for name, fn in (("shipped", shipped), ("pallas, all 2-D", patched_scale_product(only_16bit=False)),
                     ("pallas, 16-bit outputs", patched_scale_product(only_16bit=True)),
                     ("shipped", shipped)):
      qdot.scale_product = fn
      try:
        ms, loss = train_step.time_config("qtrain_int8_lowbit", 4096, 16384, 8192, 10, 3)
      finally:
        qdot.scale_product = shipped
      rows.append(dict(step=f"epilogue {name}", ms=ms, loss=loss))
      print(f"step, epilogue {name}: {ms:.3f} ms  loss {loss:.4f}", flush=True)
      if args.json:
        with open(args.json, "w") as f:
          json.dump(rows, f, indent=1)
    return
  if args.step:
    shipped = qlax.dot_general

    def f32_out(lhs, rhs, dn, *, preferred_element_type=None, **kw):
      if lhs.dtype == jnp.int8 and rhs.dtype == jnp.int8 and preferred_element_type == jnp.int32:
        preferred_element_type = jnp.float32
      return shipped(lhs, rhs, dn, preferred_element_type=preferred_element_type, **kw)

    for name, fn in (("s32", shipped), ("f32", f32_out), ("s32", shipped)):
      qlax.dot_general = fn
      try:
        ms, loss = train_step.time_config("qtrain_int8_lowbit", 4096, 16384, 8192, 10, 3)
      finally:
        qlax.dot_general = shipped
      rows.append(dict(step=name, ms=ms, loss=loss))
      print(f"step with int8 dots -> {name}: {ms:.3f} ms  loss {loss:.4f}", flush=True)
  for shape in args.shapes.split(","):
    m, k, n = (int(v) for v in shape.split("x"))
    vs = variants(m, k, n)
    ref = np.asarray(jax.jit(vs["s32"][0])(*vs["s32"][1])[0], np.float32)
    for name, (fn, xs) in vs.items():
      out = np.asarray(jax.jit(fn)(*xs)[0], np.float32)
      err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) if name != "bf16" else None
      hlo = jax.jit(fn).lower(*xs).compile().as_text()
      calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
      us = _timing.time_in_loop(fn, *xs, unroll=2) * 1e6
      rows.append(dict(shape=shape, variant=name, us=us, max_rel_err_vs_s32=err, custom_calls=calls))
      print(f"{shape:18s} {name:7s} {us:9.1f} us  err {err}  {calls}", flush=True)
      if args.json:
        with open(args.json, "w") as f:
          json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
