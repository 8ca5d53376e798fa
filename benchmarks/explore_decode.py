"""Small-M sub-byte kernels: inline-PTX decoders (qtrain.pallas._asm) vs the jnp ones.

For each kernel at M = 16 on (K, N) = (8192, 28672), times the wrapper's
default config and a grid of configs with the inline-PTX decoders (block_n,
warps, split-K), checks
each against the kernel's f32 reference and the best asm config bit for bit
against the jnp decoders, and prints a table (XLA bf16 measured in the same
run). GPU only.

  PYTHONPATH=. python benchmarks/explore_decode.py --json $OUT/decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _timing  # noqa: E402
from benchmarks import kernels as kb  # noqa: E402
from qtrain.pallas import nbit_matmul as nbm  # noqa: E402
from qtrain.pallas._qmatmul import BlockConfig  # noqa: E402

KERNELS = ("binary W1A16", "binary W1A8", "int2 W2A16 g128", "int4 W4A16 g128",
           "int4 W4A8 g128", "int2 W2A8 g128")


def kernel_fn(kernel, ops, config):
  """kb.kernel_fn plus the W{2,4}A8 group-scale kernels (int8 activations)."""
  if kernel in ("int4 W4A8 g128", "int2 W2A8 g128"):
    w = ops.packed_nk[kernel[:4]]
    return (lambda x, w, s: nbm.nbit_matmul(x, w, x_scale=s, out_dtype=jnp.bfloat16,
                                            config=config)), (ops.xq, w, ops.xs)
  return kb.kernel_fn(kernel, ops, config)


def reference(kernel, ops):
  if kernel in ("int4 W4A8 g128", "int2 W2A8 g128"):
    q, s, _ = ops.packed[kernel[:4]]
    return nbm.nbit_matmul_reference(ops.xq, q, group_size=kb.GROUP, g_scale=s, x_scale=ops.xs)
  return kb.reference(kernel, ops)


def candidates(kernel: str, extra: bool = False) -> list[BlockConfig]:
  """The block_n x split_k grid, or (``extra``) deeper pipelines and more warps
  around the best grid point (bn128, split 1-2)."""
  del kernel  # the same grid for every kernel
  out = []
  if extra:
    for sk in (1, 2):
      for warps, stages in ((4, 4), (4, 5), (8, 3), (8, 4), (2, 3)):
        out.append(BlockConfig(block_m=16, block_n=128, split_k=sk, num_warps=warps,
                               num_stages=stages))
    return out
  for bn, warps in ((64, 4), (128, 4), (256, 8)):
    for sk in (1, 2, 4):
      out.append(BlockConfig(block_m=16, block_n=bn, split_k=sk, num_warps=warps, num_stages=3))
  return out


def describe(cfg: BlockConfig | None, plane_words: int = 32) -> str:
  pw = f" pw{plane_words}" if plane_words != 32 else ""
  if cfg is None:
    return "default config" + pw
  return (f"bn{cfg.block_n} w{cfg.num_warps} sk{cfg.split_k} s{cfg.num_stages}{pw} "
          + ("asm" if cfg.asm else "jnp"))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--k", type=int, default=8192)
  ap.add_argument("--n", type=int, default=28672)
  ap.add_argument("--m", type=int, default=16)
  ap.add_argument("--kernels", default=",".join(KERNELS))
  ap.add_argument("--budget-s", type=float, default=400)
  ap.add_argument("--extra", action="store_true",
                  help="deeper pipelines / more warps at block_n 128 instead of the main grid")
  ap.add_argument("--plane-words", type=int, default=32,
                  help="words per plane of the packed weights (prepare_weight's plane_words)")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  t0 = time.time()
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
  ops = kb.Operands(args.m, args.k, args.n)
  pw = args.plane_words
  if pw != 32:  # re-lay out every packed weight with the requested plane width
    prep = kb.prepared.prepare_weight
    ops.w_bin = prep(ops.w_bin_values, "binary", scale=ops.w_bin.w_scale[0, :args.n], plane_words=pw)
    ops.w_bin_kn = prep(ops.w_bin_values, "binary", scale=ops.w_bin.w_scale[0, :args.n],
                        plane_words=pw, kn=True)
    ops.packed = {qt: (q, s, prep(q, qt, scale=s, group_size=kb.GROUP, kn=True, plane_words=pw))
                  for qt, (q, s, _) in ops.packed.items()}
  ops.packed_nk = {qt: kb.prepared.prepare_weight(q, qt, scale=s, group_size=kb.GROUP,
                                                  plane_words=pw)
                   for qt, (q, s, _) in ops.packed.items()}
  t_bf16 = _timing.time_in_loop(lambda x, w: x @ w, ops.x, ops.w_t)
  print(f"xla bf16: {t_bf16 * 1e6:.1f} us", flush=True)
  rows = [dict(kernel="xla bf16", config="", us=t_bf16 * 1e6)]

  def record(kernel, cfg, fn, fargs, ref):
    out = jax.jit(fn)(*fargs)
    err = float(kb.rel_err(out, ref))
    t = _timing.time_in_loop(fn, *fargs)
    row = dict(kernel=kernel, config=describe(cfg, pw), us=t * 1e6, rel_err=err,
               vs_bf16=t_bf16 / t)
    rows.append(row)
    print(f"  {kernel:16s} {row['config']:34s} {t * 1e6:8.1f} us  {t_bf16 / t:5.2f}x  err {err:.1e}",
          flush=True)
    return t, out

  for kernel in [k for k in args.kernels.split(",") if k]:
    ref = reference(kernel, ops)
    try:  # what the wrapper picks (CONFIGS table / heuristic)
      record(kernel, None, *kernel_fn(kernel, ops, None), ref)
    except Exception as e:  # noqa: BLE001
      print(f"FAIL {kernel} default config: {type(e).__name__}: {str(e)[:300]}", flush=True)
    best = None
    for cfg in candidates(kernel, args.extra):
      if time.time() - t0 > args.budget_s:
        print("budget exhausted", flush=True)
        break
      try:
        t, out = record(kernel, cfg, *kernel_fn(kernel, ops, cfg), ref)
      except Exception as e:  # noqa: BLE001
        print(f"FAIL {kernel} {describe(cfg, pw)}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      if best is None or t < best[0]:
        best = (t, cfg, out)
    if best is not None:
      # The same config with the jnp decoders: the decoded weights must be the same bits.
      t, cfg, out = best
      jcfg = dataclasses.replace(cfg, asm=False)
      tj, outj = record(kernel, jcfg, *kernel_fn(kernel, ops, jcfg), ref)
      same = bool(np.array_equal(np.asarray(out, np.float32), np.asarray(outj, np.float32)))
      rows.append(dict(kernel=kernel, config=f"BEST {describe(cfg, pw)}", us=t * 1e6,
                       vs_bf16=t_bf16 / t, asm_equals_jnp=same, jnp_same_config_us=tj * 1e6))
      print(f"BEST {kernel}: {describe(cfg, pw)} {t * 1e6:.1f} us ({t_bf16 / t:.2f}x bf16); "
            f"jnp decoders, same config: {tj * 1e6:.1f} us; asm == jnp bits: {same}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
  print("\n| kernel | config | µs | vs bf16 |\n|---|---|---|---|")
  for r in rows:
    if r["config"].startswith("BEST") or r["kernel"] == "xla bf16":
      print(f"| {r['kernel']} | {r['config']} | {r['us']:.1f} | {r.get('vs_bf16', 1.0):.2f}x |")


if __name__ == "__main__":
  main()
