"""Kernel-variant exploration and ablations on the GPU (feeds the CONFIGS tables).

Usage (GPU machine): PYTHONPATH=. python benchmarks/explore.py [--budget-s 240]

Times, on (K, N) = (8192, 28672):
* M = 16: the small-M plane path of each sub-byte kernel under layout /
  decoder / tile variants ((N, K) vs (K, N) weights, 16-bit vs f32 decoders,
  block_n, plane_words);
* M = 4096: the flat large-M path under a few tile shapes;
* ablations of the binary small-M path: streaming the packed words only,
  streaming + decoding every plane without the dot, and the full kernel; the
  differences locate the bottleneck (memory, decode ALU, or dot + operand
  layout shuffles).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _timing  # noqa: E402
from qtrain.pallas import _common  # noqa: E402
from qtrain.pallas import binary_matmul as bmm  # noqa: E402
from qtrain.pallas import nbit_matmul as nbm  # noqa: E402
from qtrain.pallas import prepared  # noqa: E402
from qtrain.pallas._qmatmul import BlockConfig  # noqa: E402

K, N = 8192, 28672


def _ablation_kernel(w_ref, o_ref, *, planes: int, pk: int, mode: str):
  bn = w_ref.shape[0]

  def body(t, acc):
    w = w_ref[:, pl.ds(t * pk, pk)]
    if mode == "load":
      return acc + w.astype(jnp.float32)
    inv = ~w
    for s in range(planes):
      acc = acc + _common.decode_binary_to_16bit(inv, s, jnp.bfloat16).astype(jnp.float32)
    return acc

  acc = lax.fori_loop(0, w_ref.shape[1] // pk, body, jnp.zeros((bn, pk), jnp.float32))
  o_ref[...] = acc


def ablation(words: jax.Array, mode: str, bn: int = 128, pk: int = 32) -> jax.Array:
  n, kw = words.shape
  return pl.pallas_call(
      functools.partial(_ablation_kernel, planes=32, pk=pk, mode=mode),
      out_shape=jax.ShapeDtypeStruct((n, pk), jnp.float32),
      grid=(n // bn,),
      in_specs=[pl.BlockSpec((bn, kw), lambda j: (j, 0))],
      out_specs=pl.BlockSpec((bn, pk), lambda j: (j, 0)),
      compiler_params=_common.triton_params(num_warps=4, num_stages=3),
      name=f"ablation_{mode}",
  )(words)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--budget-s", type=float, default=240)
  args = p.parse_args()
  t0 = time.time()
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
  k1, k2 = jax.random.split(jax.random.key(0))
  w = jax.random.normal(k2, (N, K), jnp.float32)
  sign = jnp.where(w > 0, 1, -1).astype(jnp.int8)
  wg = w.reshape(N, K // 128, 128)
  q = {}
  for qt, qmax in (("int2", 1), ("int4", 7)):
    s = jnp.max(jnp.abs(wg), axis=2) / qmax
    q[qt] = (jnp.clip(jnp.round(wg / s[..., None]), -qmax - 1, qmax).astype(jnp.int8).reshape(N, K), s)
  del w, wg
  results = []

  def timeit(name, fn, *a, wbytes=None):
    if time.time() - t0 > args.budget_s:
      return
    try:
      t = _timing.time_in_loop(fn, *a)
    except Exception as e:  # noqa: BLE001
      print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      return
    extra = f"  {wbytes / t / 1e12:.2f} TB/s" if wbytes else ""
    print(f"{name:70s} {t * 1e6:9.1f} us{extra}", flush=True)
    results.append((name, t))

  # Ablations (binary words, plane_words 32).
  wb = prepared.prepare_weight(sign, "binary")
  timeit("ablation: stream words only", lambda x: ablation(x, "load"), wb.data, wbytes=N * K / 8)
  timeit("ablation: stream + decode 32 planes (no dot)", lambda x: ablation(x, "decode"), wb.data,
         wbytes=N * K / 8)
  for m in (16, 4096):
    x = jax.random.normal(k1, (m, K), jnp.bfloat16)
    xq = jnp.clip(jnp.round(x.astype(jnp.float32) * 40), -127, 127).astype(jnp.int8)
    if m == 16:
      variants = [
          ("nk d16 bn128", dict(kn=False), BlockConfig(block_m=16, block_n=128, num_stages=3)),
          ("nk f32dec bn128", dict(kn=False),
           BlockConfig(block_m=16, block_n=128, num_stages=3, decode16=False)),
          ("kn d16 bn128", dict(kn=True), BlockConfig(block_m=16, block_n=128, num_stages=3)),
          ("kn d16 bn256 w8", dict(kn=True),
           BlockConfig(block_m=16, block_n=256, num_warps=8, num_stages=3)),
          ("nk d16 pw64 bn128", dict(kn=False, plane_words=64),
           BlockConfig(block_m=16, block_n=128, num_stages=3)),
          ("kn d16 pw16 bn128", dict(kn=True, plane_words=16),
           BlockConfig(block_m=16, block_n=128, num_stages=4)),
      ]
    else:
      variants = [
          ("nk flat bm128 bn128 bk128", dict(kn=False),
           BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128)),
          ("nk flat bm128 bn256 bk64", dict(kn=False),
           BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64)),
          ("kn flat bm128 bn128 bk128", dict(kn=True),
           BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128)),
          ("kn flat bm128 bn256 bk64", dict(kn=True),
           BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64)),
      ]
    for vname, prep, cfg in variants:
      wbin = prepared.prepare_weight(sign, "binary", **prep)
      timeit(f"M={m} binary W1A16 {vname}",
             lambda x, w, cfg=cfg: bmm.binary_matmul(x, w, out_dtype=jnp.bfloat16, config=cfg),
             x, wbin, wbytes=N * K / 8)
      if not prep.get("kn") or m == 4096:
        timeit(f"M={m} binary W1A8 {vname}",
               lambda x, w, cfg=cfg: bmm.binary_matmul(x, w, out_dtype=jnp.bfloat16, config=cfg),
               xq, wbin, wbytes=N * K / 8)
      if m == 4096 and not prep.get("kn"):
        xw = prepared.prepare_binary_activations(x)
        timeit(f"M={m} binary W1A1 {vname}",
               lambda x, w, cfg=cfg: bmm.binary_matmul(x, w, out_dtype=jnp.bfloat16, config=cfg),
               xw, wbin, wbytes=N * K / 8)
      del wbin
      for qt in ("int4", "int2"):
        qv, s = q[qt]
        wq = prepared.prepare_weight(qv, qt, scale=s, group_size=128, **prep)
        bits = 4 if qt == "int4" else 2
        timeit(f"M={m} {qt} W{bits}A16 g128 {vname}",
               lambda x, w, cfg=cfg: nbm.nbit_matmul(x, w, out_dtype=jnp.bfloat16, config=cfg),
               x, wq, wbytes=N * K * bits / 8 + 4 * N * K / 128)
        del wq
  print("done in", round(time.time() - t0), "s")


if __name__ == "__main__":
  main()
