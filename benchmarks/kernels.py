"""Benchmark of qtrain's Pallas kernels against XLA bf16 and XLA int8.

Usage (on the GPU machine, from the repository root):
  python3 benchmarks/kernels.py [--ms 1,16] [--shapes 8192x28672] [--kernels "mosaic W1A8,..."]
      [--check] [--explore] [--budget-s 420] [--out-dir DIR] [--results PATH]

Rows: M in {1, 16, 64, 512, 4096}; (K, N) in {(4096, 4096), (8192, 28672)}.
Columns: time (µs, median of loop-amortized repeats, benchmarks/_timing.py),
speedup over the best XLA bf16 (default flags, and
--xla_gpu_enable_triton_gemm=false measured in a subprocess since the flag must
precede jax's initialisation), weight-stream TB/s and its fraction of the
measured copy bandwidth, TFLOP/s and its fraction of the measured bf16 peak.
The run's JSON record goes to --out-dir and, on a GPU, its rows into the kernel
table of benchmarks/RESULTS.md (benchmarks/_record.py).
--explore tries several block configs per kernel and shape (at --explore-ms) and
uses the best (printing them to paste into the kernels' CONFIGS tables).
"int2 W2A8 g128" / "int4 W4A8 g128" are the Triton group-scale kernels with int8
activations on (N, K)-stored words.
"mosaic gemm ..." is the large-M int8 GEMM (qtrain.kernels.mosaic_gemm; M a multiple of 128).
"mosaic ..." kernels run on weights laid out for their activations (order="int8"
for the A8 ones); "mosaic ... tiled" on the same weights stored tile by tile
(prepare_mosaic_weight(tiles="auto"): row-major where "auto" keeps it so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _record, _timing  # noqa: E402
from qtrain.kernels import binary_matmul as bmm  # noqa: E402
from qtrain.kernels import int8_matmul as imm  # noqa: E402
from qtrain.kernels import mosaic_gemm as mg  # noqa: E402
from qtrain.kernels import mosaic_matmul as mm  # noqa: E402
from qtrain.kernels import nbit_matmul as nbm  # noqa: E402
from qtrain.kernels import prepared  # noqa: E402
from qtrain.kernels._qmatmul import BlockConfig  # noqa: E402

MS = (1, 16, 64, 512, 4096)
SHAPES = ((4096, 4096), (8192, 28672))
GROUP = 128
# Mosaic GPU kernels (per-channel scales, M <= 128) and their weight qtype.
_MOSAIC_QTYPE = {"mosaic W1A16": "binary", "mosaic W4A16": "int4", "mosaic W8A16": "int8",
                 "mosaic W1A8": "binary", "mosaic W2A8": "int2", "mosaic W4A8": "int4",
                 "mosaic W8A8": "int8"}
# "... tiled": the same kernel on weights stored tile by tile (prepare_mosaic_weight(tiles="auto"))
_MOSAIC_QTYPE.update({f"{k} tiled": v for k, v in list(_MOSAIC_QTYPE.items())})
# The Mosaic int8 GEMM (large M; operands as int8 codes, binary weights as +-1) and its weights.
_GEMM_QTYPE = {"mosaic gemm W8A8": "int8", "mosaic gemm W1A8": "binary"}
# Triton group-scale kernels with int8 activations (weights as (N, K) words)
_GROUP_A8 = ("int2 W2A8 g128", "int4 W4A8 g128")
KERNELS = ("binary W1A16", "binary W1A8", "binary W1A1", "int2 W2A16 g128", "int4 W4A16 g128",
           "int4 W4A16", "int8 W8A16", "int8 x int8") + _GROUP_A8 + tuple(_MOSAIC_QTYPE) + tuple(
               _GEMM_QTYPE)


def weight_bytes(kernel: str, n: int, k: int) -> float:
  """Bytes of weights (plus scales) a kernel must stream."""
  if kernel.startswith("xla bf16"):
    return 2 * n * k
  if kernel in _MOSAIC_QTYPE:
    return n * k * {"binary": 1, "int2": 2, "int4": 4, "int8": 8}[_MOSAIC_QTYPE[kernel]] / 8 + 4 * n
  if kernel in _GEMM_QTYPE:
    return n * k + 4 * n  # int8 codes
  if kernel == "int4 W4A16":
    return n * k / 2 + 4 * n
  if kernel.startswith("binary"):
    return n * k / 8 + 4 * n
  if kernel.startswith("int2"):
    return n * k / 4 + 4 * n * k / GROUP
  if kernel.startswith("int4"):
    return n * k / 2 + 4 * n * k / GROUP
  return n * k + 4 * n  # int8


def candidates(kernel: str, m: int, n: int, k: int) -> list[BlockConfig | None]:
  """Block configs tried by --explore (and when a default config fails)."""
  if kernel in _MOSAIC_QTYPE or kernel in _GEMM_QTYPE:
    return [None]  # their config grids: docs/findings.md (explore_mosaic.py, explore_gemm.py)
  if m <= 64:
    bm = 16 if m <= 16 else 64
    if n >= 16384:
      out = [BlockConfig(block_m=bm, block_n=128, num_warps=4, num_stages=3),
             BlockConfig(block_m=bm, block_n=256, num_warps=8, num_stages=3)]
      if kernel == "binary W1A8":
        out.append(BlockConfig(block_m=bm, block_n=128, num_warps=4, num_stages=3,
                               byte_decode=False))
      return out
    return [BlockConfig(block_m=bm, block_n=64, split_k=4, num_warps=4, num_stages=4),
            BlockConfig(block_m=bm, block_n=128, split_k=4, num_warps=4, num_stages=3)]
  return [BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128),
          BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64),
          BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=128)]


class Operands:
  """Random operands of one (M, K, N) problem, quantized for every kernel."""

  def __init__(self, m: int, k: int, n: int, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    self.m, self.k, self.n = m, k, n
    self.x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    w = jax.random.normal(k2, (n, k), jnp.float32)
    self.w_t = w.T.astype(jnp.bfloat16)  # (K, N) for XLA bf16
    self.xq = jnp.clip(jnp.round(self.x.astype(jnp.float32) * 40), -127, 127).astype(jnp.int8)
    self.xs = jnp.full((m,), 1 / 40, jnp.float32)
    self.xw = prepared.prepare_binary_activations(self.x)
    absw = jnp.mean(jnp.abs(w), axis=1)
    self.w_bin_values = jnp.where(w > 0, 1, -1).astype(jnp.int8)
    self.w_bin = prepared.prepare_weight(self.w_bin_values, "binary", scale=absw)
    self.w_bin_kn = prepared.prepare_weight(self.w_bin_values, "binary", scale=absw, kn=True)
    self.w8_values = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
    self.w8_scale = jnp.full((n,), 1 / 40, jnp.float32)
    self.w8 = prepared.prepare_weight(self.w8_values, "int8", scale=self.w8_scale)
    wg = w.reshape(n, k // GROUP, GROUP)
    self.packed = {}
    for qt, qmax in (("int2", 1), ("int4", 7)):
      s = jnp.max(jnp.abs(wg), axis=2) / qmax
      q = jnp.clip(jnp.round(wg / s[..., None]), -qmax - 1, qmax).astype(jnp.int8).reshape(n, k)
      self.packed[qt] = (q, s, prepared.prepare_weight(q, qt, scale=s, group_size=GROUP, kn=True))
    s2 = jnp.max(jnp.abs(w), axis=1) / 1.5  # per-channel int2 for the Mosaic W2A8 kernel
    self.w2_values = jnp.clip(jnp.round(w / s2[:, None]), -2, 1).astype(jnp.int8)
    s4 = jnp.max(jnp.abs(w), axis=1) / 7
    self.w4_values = jnp.clip(jnp.round(w / s4[:, None]), -8, 7).astype(jnp.int8)
    self.w4_scale = s4
    self.w4 = prepared.prepare_weight(self.w4_values, "int4", scale=s4, kn=True)
    # Mosaic weights are prepared on first use (_mosaic_weight): each qtype x order x layout
    self.mosaic_codes = {"binary": (self.w_bin_values, absw), "int2": (self.w2_values, s2),
                         "int4": (self.w4_values, s4),
                         "int8": (self.w8_values, self.w8_scale)}
    self.mosaic = {}
    self.packed_nk = {}  # the group-scale A8 kernels' (N, K) words, prepared on first use
    jax.block_until_ready((self.w_bin, self.w8, self.packed, self.xw, self.w4))


def _packed_nk(ops: Operands, qtype: str):
  """``qtype``'s group-scale weight as (N, K) words (the W{2,4}A8 kernels' layout)."""
  if qtype not in ops.packed_nk:
    q, s, _ = ops.packed[qtype]
    ops.packed_nk[qtype] = jax.block_until_ready(
        prepared.prepare_weight(q, qtype, scale=s, group_size=GROUP))
  return ops.packed_nk[qtype]


def _mosaic_a8(kernel: str) -> bool:
  return kernel.removesuffix(" tiled").endswith("A8")


def _mosaic_weight(ops: Operands, kernel: str):
  """The Mosaic kernel's weight for ``kernel``, in the storage order of its activations
  (row-major, or tile by tile for "... tiled"), prepared once per Operands."""
  key = (_MOSAIC_QTYPE[kernel], "int8" if _mosaic_a8(kernel) else "float",
         "auto" if kernel.endswith(" tiled") else None)
  if key not in ops.mosaic:
    vals, scale = ops.mosaic_codes[key[0]]
    ops.mosaic[key] = jax.block_until_ready(mm.prepare_mosaic_weight(
        vals, key[0], scale=scale, order=key[1], tiles=key[2]))
  return ops.mosaic[key]


def kernel_fn(kernel: str, ops: Operands, config, method: str = "mma"):
  """(fn, args) computing one kernel on ``ops`` with ``config``."""
  out = jnp.bfloat16
  if kernel == "xla bf16":
    return (lambda x, w: x @ w), (ops.x, ops.w_t)
  if kernel == "xla int8":
    def f(xq, wq, xs, ws):
      acc = lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
      return (acc.astype(jnp.float32) * xs[:, None] * ws[None, :]).astype(out)
    return f, (ops.xq, ops.w8_values, ops.xs, ops.w8_scale)
  # Weight layouts measured best (docs/findings.md, explore.py): (K, N) words for
  # 16-bit activations and for the large-M flat path, (N, K) for int8 at small M.
  if kernel == "binary W1A16":
    return (lambda x, w: bmm.binary_matmul(x, w, out_dtype=out, config=config)), (ops.x, ops.w_bin_kn)
  if kernel == "binary W1A8":
    wb = ops.w_bin_kn if ops.m > 64 else ops.w_bin
    return (lambda x, w, s: bmm.binary_matmul(x, w, x_scale=s, out_dtype=out, config=config)), (
        ops.xq, wb, ops.xs)
  if kernel == "binary W1A1":
    return (lambda x, w: bmm.binary_matmul(x, w, out_dtype=out, config=config, method=method)), (
        ops.xw, ops.w_bin)
  if kernel in _GROUP_A8:
    return (lambda x, w, s: nbm.nbit_matmul(x, w, x_scale=s, out_dtype=out, config=config)), (
        ops.xq, _packed_nk(ops, kernel[:4]), ops.xs)
  if kernel == "int4 W4A16":  # per-channel scales
    return (lambda x, w: nbm.nbit_matmul(x, w, out_dtype=out, config=config)), (ops.x, ops.w4)
  if kernel.startswith("int2") or kernel.startswith("int4"):
    w = ops.packed[kernel[:4]][2]
    return (lambda x, w: nbm.nbit_matmul(x, w, out_dtype=out, config=config)), (ops.x, w)
  if kernel == "int8 W8A16":
    return (lambda x, w: nbm.nbit_matmul(x, w, out_dtype=out, config=config)), (ops.x, ops.w8)
  if kernel in _MOSAIC_QTYPE and _mosaic_a8(kernel):
    return (lambda x, w, s: mm.mosaic_matmul(x, w, x_scale=s, out_dtype=out, config=config)), (
        ops.xq, _mosaic_weight(ops, kernel), ops.xs)
  if kernel in _MOSAIC_QTYPE:
    return (lambda x, w: mm.mosaic_matmul(x, w, out_dtype=out, config=config)), (
        ops.x, _mosaic_weight(ops, kernel))
  if kernel == "int8 x int8":
    return (lambda x, w, s: imm.int8_matmul(x, w, x_scale=s, out_dtype=out, config=config)), (
        ops.xq, ops.w8, ops.xs)
  if kernel in _GEMM_QTYPE:
    vals, scale = ops.mosaic_codes[_GEMM_QTYPE[kernel]]
    return (lambda x, w, s, ws: mg.mosaic_gemm(x, w, a_scale=s, b_scale=ws, out_dtype=out,
                                               config=config)), (ops.xq, vals, ops.xs, scale)
  raise ValueError(kernel)


def reference(kernel: str, ops: Operands) -> jax.Array:
  """f32 reference output of ``kernel`` on ``ops``."""
  if kernel == "binary W1A16":
    return bmm.binary_matmul_reference(ops.x, ops.w_bin_values, w_scale=ops.w_bin.w_scale[0, :ops.n])
  if kernel == "binary W1A8":
    return bmm.binary_matmul_reference(ops.xq, ops.w_bin_values, x_scale=ops.xs,
                                       w_scale=ops.w_bin.w_scale[0, :ops.n])
  if kernel == "binary W1A1":
    xb = jnp.where(ops.x > 0, 1, -1).astype(jnp.int8)
    return bmm.binary_matmul_reference(xb, ops.w_bin_values, w_scale=ops.w_bin.w_scale[0, :ops.n])
  if kernel in _MOSAIC_QTYPE:
    qt = _MOSAIC_QTYPE[kernel]
    w = _mosaic_weight(ops, kernel)
    vals = ops.mosaic_codes[qt][0]
    if _mosaic_a8(kernel):
      return mm.mosaic_matmul_reference(ops.xq, vals, qt, w_scale=w.w_scale, x_scale=ops.xs)
    return mm.mosaic_matmul_reference(ops.x, vals, qt, w_scale=w.w_scale)
  if kernel == "int4 W4A16":
    return nbm.nbit_matmul_reference(ops.x, ops.w4_values, w_scale=ops.w4_scale)
  if kernel in _GROUP_A8:
    q, s, _ = ops.packed[kernel[:4]]
    return nbm.nbit_matmul_reference(ops.xq, q, group_size=GROUP, g_scale=s, x_scale=ops.xs)
  if kernel[:4] in ("int2", "int4"):
    q, s, _ = ops.packed[kernel[:4]]
    return nbm.nbit_matmul_reference(ops.x, q, group_size=GROUP, g_scale=s)
  if kernel == "int8 W8A16":
    return nbm.nbit_matmul_reference(ops.x, ops.w8_values, w_scale=ops.w8_scale)
  if kernel in _GEMM_QTYPE:
    vals, scale = ops.mosaic_codes[_GEMM_QTYPE[kernel]]
    return imm.int8_matmul_reference(ops.xq, vals, x_scale=ops.xs, w_scale=scale)
  return imm.int8_matmul_reference(ops.xq, ops.w8_values, x_scale=ops.xs, w_scale=ops.w8_scale)


def rel_err(out, ref) -> float:
  out = jnp.asarray(out, jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def figures(rows, bw: float, peak: float) -> list[dict]:
  """Record rows (every figure of each case) from (m, k, n, kernel, seconds, note) rows."""
  bf16_of = {(r[0], r[1], r[2]): r[4] for r in rows if r[3] == "xla bf16"}
  out = []
  for m, k, n, kernel, t, note in rows:
    tbs = weight_bytes(kernel, n, k) / t / 1e12
    tf = 2 * m * k * n / t / 1e12
    base = bf16_of.get((m, k, n))
    out.append(dict(m=m, k=k, n=n, kernel=kernel, us=t * 1e6,
                    vs_xla_bf16=base / t if base else None, weight_tbs=tbs,
                    of_copy_bw=tbs * 1e12 / bw, tflops=tf, of_bf16_peak=tf * 1e12 / peak,
                    note=note.strip()))
  return out


def render_table(rows: list[dict]) -> str:
  """Markdown table of :func:`figures` rows (the run's log; RESULTS.md has its own)."""
  lines = ["| M | K | N | kernel | µs | vs bf16 | weight TB/s | of copy bw | TFLOP/s | of bf16 peak | config / note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['vs_xla_bf16']:.2f}x" if r["vs_xla_bf16"] else "-"
    lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['kernel']} | {r['us']:.1f} | {ratio} | "
                 f"{r['weight_tbs']:.2f} | {r['of_copy_bw']:.0%} | {r['tflops']:.1f} | "
                 f"{r['of_bf16_peak']:.0%} | {r['note']} |")
  return "\n".join(lines)


def xla_bf16_times(ms, shapes, no_triton: bool) -> dict:
  """Times XLA bf16 for every (M, K, N); with no_triton, in a subprocess with the flag set."""
  if not no_triton:
    res = {}
    for k, n in shapes:
      for m in ms:
        ops_x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w_t = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        res[f"{m},{k},{n}"] = _timing.time_in_loop(lambda x, w: x @ w, ops_x, w_t)
    return res
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--xla-bf16-only",
                        "--ms", ",".join(map(str, ms)),
                        "--shapes", ",".join(f"{k}x{n}" for k, n in shapes)],
                       env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ms", default=",".join(map(str, MS)), help="M values (comma-separated)")
  p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES),
                 help="KxN weight shapes (comma-separated)")
  p.add_argument("--kernels", default=",".join(KERNELS),
                 help=f"kernels (comma-separated; XLA bf16 and int8 always run): {', '.join(KERNELS)}")
  p.add_argument("--check", action="store_true",
                 help="also the relative error of each kernel (M <= 64) against its f32 reference")
  p.add_argument("--explore", action="store_true",
                 help="time several block configs per Triton kernel and keep the best")
  p.add_argument("--explore-ms", default="16", help="M values --explore applies to")
  p.add_argument("--budget-s", type=float, default=420,
                 help="stop starting new kernels after this many seconds")
  _record.add_arguments(p)
  p.add_argument("--xla-bf16-only", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  ms = [int(v) for v in args.ms.split(",")]
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  kernels = [k for k in args.kernels.split(",") if k and k != "none"]
  unknown = [k for k in kernels if k not in KERNELS]
  if unknown:
    p.error(f"--kernels: unknown {unknown}; valid: {', '.join(KERNELS)}")
  if args.xla_bf16_only:
    print(json.dumps(xla_bf16_times(ms, shapes, False)))
    return
  t_start = time.time()
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; jax {jax.__version__}", flush=True)
  bw = _timing.copy_bandwidth()
  peak = _timing.bf16_peak()
  print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); bf16 peak {peak / 1e12:.0f} TFLOP/s",
        flush=True)
  rec = _record.Recorder("kernels", dict(copy_bw=bw, bf16_peak=peak), out_dir=args.out_dir,
                         results=args.results)
  bf16_default = xla_bf16_times(ms, shapes, False)
  try:
    bf16_notriton = xla_bf16_times(ms, shapes, True)
  except Exception as e:  # noqa: BLE001
    print("no-triton-gemm subprocess failed:", e, flush=True)
    bf16_notriton = {}
  rows, best_cfgs = [], {}
  for k, n in shapes:
    for m in ms:
      key = f"{m},{k},{n}"
      t_bf16 = min(v for v in (bf16_default.get(key), bf16_notriton.get(key)) if v)
      rows.append((m, k, n, "xla bf16", t_bf16, "best of default / no-triton-gemm"))
      if time.time() - t_start > args.budget_s:
        continue
      ops = Operands(m, k, n)
      for kernel in ["xla int8"] + kernels:
        if kernel in _MOSAIC_QTYPE and m > mm.MAX_M:
          continue
        if kernel in _GEMM_QTYPE and m % 128:  # the GEMM's CTA rows; small M is the kernels' above
          continue
        if time.time() - t_start > args.budget_s:
          print("budget exhausted; stopping", flush=True)
          break
        cands = [None]
        if kernel != "xla int8":
          explore_here = args.explore and str(m) in args.explore_ms.split(",")
          cands = candidates(kernel, m, n, k) if explore_here else [None]
        methods = ["mma", "popcount"] if (kernel == "binary W1A1" and m <= 64) else ["mma"]
        best = None
        for method in methods:
          tried = list(cands)
          for cfg in tried:
            try:
              fn, fargs = kernel_fn(kernel, ops, cfg, method)
              t = _timing.time_in_loop(fn, *fargs)
            except Exception as e:  # noqa: BLE001
              print(f"FAIL {kernel} M={m} K={k} N={n} {cfg} {method}: {type(e).__name__}: "
                    f"{str(e)[:300]}", flush=True)
              if cfg is None and kernel != "xla int8":
                tried.extend(candidates(kernel, m, n, k))  # the default failed: try others
              continue
            print(f"  {kernel:18s} M={m:5d} K={k} N={n} {method:8s} {cfg} {t * 1e6:9.1f} us",
                  flush=True)
            if best is None or t < best[0]:
              best = (t, cfg, method)
        if best is None:
          continue
        t, cfg, method = best
        note = "" if cfg is None else (f"bm{cfg.block_m} bn{cfg.block_n} sk{cfg.split_k} "
                                       f"w{cfg.num_warps} s{cfg.num_stages}")
        if kernel == "binary W1A1":
          note = (method + " " + note).strip()
        if args.check and kernel != "xla int8" and m <= 64:
          fn, fargs = kernel_fn(kernel, ops, cfg, method)
          err = rel_err(jax.jit(fn)(*fargs), reference(kernel, ops))
          note += f" err={err:.1e}"
        if cfg is not None:
          best_cfgs[(kernel, k, n, m)] = cfg
        elif kernel in _MOSAIC_QTYPE:
          c = mm.default_config(_mosaic_weight(ops, kernel), m,
                                act_dtype=jnp.int8 if _mosaic_a8(kernel) else jnp.bfloat16)
          note = f"default config rows{c.wg_rows} tk{c.tile_k} s{c.steps} sk{c.split_k} " + note
        elif kernel != "xla int8":
          note = "default config " + note
        rows.append((m, k, n, kernel, t, note))
        rec.write(figures(rows, bw, peak))  # a run cut by a timeout keeps what it measured
  table = figures(rows, bw, peak)
  print(render_table(table))
  if best_cfgs:
    print("\nBEST CONFIGS:")
    for key, cfg in best_cfgs.items():
      print(f"  {key}: BlockConfig(block_m={cfg.block_m}, block_n={cfg.block_n}, "
            f"split_k={cfg.split_k}, num_warps={cfg.num_warps}, num_stages={cfg.num_stages}),")
  rec.finish(table)


if __name__ == "__main__":
  main()
