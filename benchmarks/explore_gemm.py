"""Mosaic int8 GEMM (qtrain.pallas.mosaic_gemm) against XLA, side by side, on the GPU.

For each (M, K, N): checks the kernel bit for bit against the XLA path
(cuBLAS int8 GEMM, then the int32 -> scaled float pass), then times, inside one
jit each (benchmarks/_timing.py):

* ``xla bf16``: ``a @ b.T`` on bf16 operands (the float step's GEMM);
* ``xla int8``: the int8 product as qtrain's XLA path runs it (s32 GEMM,
  convert, both scales, cast);
* ``mosaic``: the default config, and every ``--configs`` variant.

Usage (GPU)::

  PYTHONPATH=. python benchmarks/explore_gemm.py --shapes 8192x4096x16384,8192x16384x4096 \\
      --configs "tile_k=256,steps=3;wg_axis=m" --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import time_in_loop  # noqa: E402

from qtrain.pallas import mosaic_gemm as mg  # noqa: E402


def parse_config(text: str) -> mg.GemmConfig:
  """"tile_k=256,steps=3" -> GemmConfig(tile_k=256, steps=3) (ints where they parse)."""
  kw = {}
  for part in filter(None, text.split(",")):
    key, val = part.split("=")
    kw[key.strip()] = int(val) if val.strip().lstrip("-").isdigit() else val.strip()
  return mg.GemmConfig(**kw)


def operands(m, k, n, seed=0):
  ka, kb, ks, kt = jax.random.split(jax.random.key(seed), 4)
  a = jax.random.randint(ka, (m, k), -127, 128, jnp.int8)
  b = jax.random.randint(kb, (n, k), -127, 128, jnp.int8)
  sa = jax.random.uniform(ks, (m,), jnp.float32, 0.5, 1.5) * 1e-3
  sb = jax.random.uniform(kt, (n,), jnp.float32, 0.5, 1.5) * 1e-3
  return a, b, sa, sb


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="8192x4096x16384,8192x16384x4096,4096x8192x16384")
  ap.add_argument("--configs", default="", help="';'-separated GemmConfig variants")
  ap.add_argument("--out-dtype", default="bfloat16")
  ap.add_argument("--append", default="")
  args = ap.parse_args()
  out_dtype = jnp.dtype(args.out_dtype)
  variants = [("mosaic default", None)] + [(f"mosaic {c}", parse_config(c))
                                           for c in filter(None, args.configs.split(";"))]
  rows = []
  for shape in args.shapes.split(","):
    m, k, n = (int(v) for v in shape.split("x"))
    a, b, sa, sb = operands(m, k, n)
    ref_fn = jax.jit(lambda a, b, sa, sb: mg.mosaic_gemm_reference(a, b, a_scale=sa, b_scale=sb,
                                                                   out_dtype=out_dtype))
    ref = np.asarray(ref_fn(a, b, sa, sb).astype(jnp.float32))
    af, bf = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    t_bf16 = time_in_loop(lambda x, y: x @ y.T, af, bf)
    t_int8 = time_in_loop(lambda x, y, s, t: mg.mosaic_gemm_reference(x, y, a_scale=s, b_scale=t,
                                                                      out_dtype=out_dtype), a, b, sa, sb)
    flops = 2 * m * n * k
    base = [("xla bf16", t_bf16, "n/a"), ("xla int8 (s32 + convert + scales)", t_int8, "n/a")]
    for name, t, ok in base:
      rows.append((shape, name, t, t_bf16 / t, t_int8 / t, flops / t / 1e12, ok))
      print(f"{shape} {name:40s} {t * 1e6:9.1f} us  {t_bf16 / t:5.2f}x bf16  "
            f"{t_int8 / t:5.2f}x int8  {flops / t / 1e12:7.1f} TOP/s", flush=True)
    for name, cfg in variants:
      try:
        cfg = mg.checked_config(a, b, cfg, out_dtype)
        fn = lambda x, y, s, t, cfg=cfg: mg._gemm(x, y, s, t, out_dtype, cfg)
        out = np.asarray(jax.jit(fn)(a, b, sa, sb).astype(jnp.float32))
        ok = "exact" if np.array_equal(out, ref) else f"MISMATCH max {np.abs(out - ref).max():.3g}"
        t = time_in_loop(fn, a, b, sa, sb)
      except Exception as e:  # report, keep going
        print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        rows.append((shape, name, None, None, None, None, f"failed: {type(e).__name__}"))
        continue
      rows.append((shape, name, t, t_bf16 / t, t_int8 / t, flops / t / 1e12, ok))
      print(f"{shape} {name:40s} {t * 1e6:9.1f} us  {t_bf16 / t:5.2f}x bf16  "
            f"{t_int8 / t:5.2f}x int8  {flops / t / 1e12:7.1f} TOP/s  {ok}", flush=True)
  dev = jax.devices()[0].device_kind
  lines = [f"\n### Mosaic int8 GEMM, {datetime.date.today()}, {dev}, jax {jax.__version__}",
           f"`{' '.join(['python'] + sys.argv)}` (out {out_dtype}; default "
           f"{dataclasses.asdict(mg.GemmConfig())})\n",
           "| M x K x N | variant | µs | vs XLA bf16 | vs XLA int8 | TOP/s | check |",
           "|---|---|---|---|---|---|---|"]
  for shape, name, t, sp, si, tops, ok in rows:
    if t is None:
      lines.append(f"| {shape} | {name} | | | | | {ok} |")
    else:
      lines.append(f"| {shape} | {name} | {t * 1e6:.1f} | {sp:.2f}x | {si:.2f}x | {tops:.0f} | {ok} |")
  table = "\n".join(lines)
  print(table)
  if args.append:
    with open(args.append, "a") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
