"""Mosaic W4A8 / W1A8 at M = 16 and 1 on (8192, 28672): pipeline depth and tile_k,
row-major against tile-major weights (``order="int8"``, 128-row warpgroups), each
checked against the f32 reference, with XLA bf16 in the same run. GPU only.

  PYTHONPATH=. python benchmarks/explore_tiles.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax, jax.numpy as jnp, numpy as np
from benchmarks import _timing
from qtrain.pallas import mosaic_matmul as mm
k, n = 8192, 28672
kx, kw = jax.random.split(jax.random.key(0))
for m in (16, 1):
  xf = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
  print(m, "xla bf16", round(_timing.time_in_loop(lambda x, w: x @ w.T, xf, jax.random.normal(kw, (n, k), jnp.bfloat16)) * 1e6, 1), flush=True)
  x8 = jnp.clip(jnp.round(xf * 40), -127, 127).astype(jnp.int8)
  xs = jax.random.uniform(jax.random.fold_in(kx, 7), (m,)) + 0.5
  for qtype, lo, hi, cfgs in (("int4", -8, 8, [(256, 3), (256, 4), (256, 5), (512, 2)]),
                               ("binary", -1, 2, [(256, 4), (256, 6), (512, 3), (512, 4), (512, 6)])):
    v = jax.random.randint(kw, (n, k), lo, hi, jnp.int32).astype(jnp.int8)
    ref = np.asarray(mm.mosaic_matmul_reference(x8, v, qtype, x_scale=xs), np.float64)
    for tk, st in cfgs:
      for tiles in (None, (256, tk)):
        w = mm.prepare_mosaic_weight(v, qtype, order="int8", tiles=tiles)
        cfg = mm.MosaicConfig(tile_k=tk, steps=st, wg_rows=128)
        try:
          f = jax.jit(lambda x, w, cfg=cfg: mm.mosaic_matmul(x, w, x_scale=xs, out_dtype=jnp.bfloat16, config=cfg))
          err = float(np.max(np.abs(np.asarray(f(x8, w), np.float64) - ref)) / np.max(np.abs(ref)))
          t = _timing.time_in_loop(f, x8, w)
          print(m, qtype, f"tk{tk} s{st}", "tiled" if tiles else "rows", round(t * 1e6, 1), f"err {err:.1e}", flush=True)
        except Exception as e:
          print(m, qtype, f"tk{tk} s{st}", "ERR", str(e)[:120], flush=True)
