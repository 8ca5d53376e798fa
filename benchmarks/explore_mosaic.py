"""Mosaic GPU small-M kernel: a grid of its configs, side by side with XLA bf16.

Times :func:`qtrain.pallas.mosaic_matmul.mosaic_matmul` over a grid of
:class:`~qtrain.pallas.mosaic_matmul.MosaicConfig` (rows per warpgroup, tile_k,
pipeline depth; split-K as the wrapper picks it) at M = 16 and 64 on
(K, N) = (8192, 28672) and M = 16 on (4096, 4096), each output checked against
the f64 reference (``rel_err``: max abs error / max abs reference, f32 output),
with XLA bf16 measured in the same run. ``--act int8`` times the int8-activation
path (int8 codes with a row scale) instead of bf16 activations. Rows print as
they finish and the JSON is rewritten after each.

  PYTHONPATH=. python benchmarks/explore_mosaic.py --budget-s 400 --json $OUT/mosaic_cfg.json
  PYTHONPATH=. python benchmarks/explore_mosaic.py --act int8 --budget-s 300 --json $OUT/mosaic_a8.json

``--tiles 128x512`` keeps only those (rows per warpgroup x tile_k) configs.
``--ablate`` instead times the default config of each kernel at M = 16,
(K, N) = (8192, 28672) three ways: as shipped, with its decode skipped (int8
activations: the loaded words go to wgmma as they are) and with empty pipeline
steps (the TMA stream alone); the differences say where the time goes. Binary
weights with int8 activations add a fourth: a one-AND decode per register
(the ALU cost of a bit-plane decode).

GPU only (Hopper, jax >= 0.11).
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _timing
from qtrain.pallas import mosaic_matmul as mm


def library_configs(qtype: str, m: int, act_bytes: int = 2) -> list:
  """Every (wg_rows, tile_k, steps) of the grid that the kernel accepts at this M."""
  out = []
  for wg_rows, tks in ((64, (512, 256)), (128, (256,) if act_bytes == 2 else (512, 256))):
    for tk in tks:
      for st in (2, 3, 4):
        if qtype == "binary" and tk < 256:
          continue
        cfg = mm.MosaicConfig(tile_k=tk, steps=st, wg_rows=wg_rows)
        if mm.smem_bytes(qtype, m, cfg, act_bytes) <= mm.SMEM_BYTES:
          out.append(cfg)
  return out


def run_configs(a: argparse.Namespace) -> None:
  print(jax.__version__, jax.devices()[0].device_kind, a.act, flush=True)
  a8 = a.act == "int8"
  rows, t0 = [], time.time()
  for k, n, ms in ((8192, 28672, (16, 64)), (4096, 4096, (16,))):
    for m in ms:
      kx, kw = jax.random.split(jax.random.key(m))
      x = jax.random.normal(kx, (m, k), jnp.bfloat16)
      wbf = jax.random.normal(kw, (n, k), jnp.bfloat16)
      t_bf = _timing.time_in_loop(lambda x, w: x @ w.T, x, wbf)
      rows.append(dict(m=m, k=k, n=n, kernel="xla bf16", us=t_bf * 1e6))
      xs = None
      if a8:  # int8 codes with a per-row scale
        xs = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1) / 127
        x = jnp.clip(jnp.round(x.astype(jnp.float32) / xs[:, None]), -127, 127).astype(jnp.int8)
      print(rows[-1], flush=True)
      for qtype, lo, hi in (("binary", -1, 2), ("int4", -8, 8), ("int8", -128, 128)):
        v = jax.random.randint(kw, (n, k), lo, hi, jnp.int32).astype(jnp.int8)
        w = mm.prepare_mosaic_weight(v, qtype, order="int8" if a8 else "float")
        ref = np.asarray(mm.mosaic_matmul_reference(x, v, qtype, x_scale=xs), np.float64)
        base = mm.default_config(w, m, act_dtype=x.dtype)
        for cfg in library_configs(qtype, m, x.dtype.itemsize):
          if a.tiles and f"{cfg.wg_rows}x{cfg.tile_k}" not in a.tiles.split(","):
            continue
          if time.time() - t0 > a.budget_s:
            break
          cfg = mm.with_split(w, cfg)
          f = jax.jit(lambda x, w, cfg=cfg: mm.mosaic_matmul(x, w, x_scale=xs, config=cfg))
          name = f"{qtype}{' A8' if a8 else ''} rows{cfg.wg_rows} tk{cfg.tile_k} s{cfg.steps} sk{cfg.split_k}"
          try:
            out = np.asarray(f(x, w), np.float64)
            err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
            t = _timing.time_in_loop(f, x, w)
            rows.append(dict(m=m, k=k, n=n, kernel=name, us=t * 1e6, rel_err=err, vs_bf16=t_bf / t,
                             default=cfg == base))
          except Exception as e:  # noqa: BLE001
            rows.append(dict(m=m, k=k, n=n, kernel=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
          print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in rows[-1].items()},
                flush=True)
          if a.json:
            json.dump(rows, open(a.json, "w"), indent=1)


def run_ablation(a: argparse.Namespace) -> None:
  print(jax.__version__, jax.devices()[0].device_kind, "ablation", flush=True)
  m, k, n = 16, 8192, 28672
  kx, kw = jax.random.split(jax.random.key(m))
  xf = jax.random.normal(kx, (m, k), jnp.bfloat16)
  rows = [dict(m=m, k=k, n=n, kernel="xla bf16",
               us=_timing.time_in_loop(lambda x, w: x @ w.T, xf,
                                       jax.random.normal(kw, (n, k), jnp.bfloat16)) * 1e6)]
  print(rows[-1], flush=True)
  for act in (jnp.bfloat16, jnp.int8):
    x = xf if act == jnp.bfloat16 else jnp.clip(jnp.round(xf * 40), -127, 127).astype(jnp.int8)
    for qtype, lo, hi in (("binary", -1, 2), ("int4", -8, 8), ("int8", -128, 128)):
      v = jax.random.randint(kw, (n, k), lo, hi, jnp.int32).astype(jnp.int8)
      w = mm.prepare_mosaic_weight(v, qtype, order="int8" if act == jnp.int8 else "float")
      cfg = mm.default_config(w, m, act_dtype=act)
      modes = [None, "stream"]
      if act == jnp.int8 and qtype != "int8":
        modes.insert(1, "no_decode")
      if act == jnp.int8 and qtype == "binary":
        modes.insert(1, "one_op")
      for mode in modes:
        # x first: time_in_loop perturbs its first argument every call
        f = jax.jit(lambda x, w, mode=mode, cfg=cfg, qtype=qtype: mm._kernel(
            w, x, qtype=qtype, k_pad=k, cfg=cfg, ablate=mode))
        t = _timing.time_in_loop(f, x, w.data)
        rows.append(dict(m=m, k=k, n=n, act=jnp.dtype(act).name, qtype=qtype, ablate=str(mode),
                         config=f"rows{cfg.wg_rows} tk{cfg.tile_k} s{cfg.steps} sk{cfg.split_k}",
                         us=t * 1e6))
        print(rows[-1], flush=True)
        if a.json:
          json.dump(rows, open(a.json, "w"), indent=1)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--budget-s", type=float, default=400)
  p.add_argument("--json", default=None)
  p.add_argument("--act", choices=("bf16", "int8"), default="bf16")
  p.add_argument("--tiles", default="", help="comma-separated ROWSxTILE_K configs to keep")
  p.add_argument("--ablate", action="store_true")
  a = p.parse_args()
  run_ablation(a) if a.ablate else run_configs(a)


if __name__ == "__main__":
  main()
