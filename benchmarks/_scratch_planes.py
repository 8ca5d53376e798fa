import jax, jax.numpy as jnp, numpy as np
from benchmarks import _timing
from qtrain.pallas import mosaic_matmul as mm
k, n = 8192, 28672
kx, kw = jax.random.split(jax.random.key(0))
v = jax.random.randint(kw, (n, k), -1, 2, jnp.int32).astype(jnp.int8)
ws = jax.random.uniform(kx, (n,)) + 0.5
for m in (16, 1):
  xf = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
  print(m, "xla bf16", round(_timing.time_in_loop(lambda x, w: x @ w.T, xf, jax.random.normal(kw, (n, k), jnp.bfloat16)) * 1e6, 1), flush=True)
  x8 = jnp.clip(jnp.round(xf * 40), -127, 127).astype(jnp.int8)
  xs = jax.random.uniform(jax.random.fold_in(kx, 7), (m,)) + 0.5
  ref = np.asarray(mm.mosaic_matmul_reference(x8, v, "binary", w_scale=ws, x_scale=xs), np.float64)
  for order in ("int8", "float"):
    w = mm.prepare_mosaic_weight(v, "binary", scale=ws, order=order)
    base = mm.default_config(w, m, act_dtype=jnp.int8)
    f = jax.jit(lambda x, w: mm.mosaic_matmul(x, w, x_scale=xs, out_dtype=jnp.float32))
    out = np.asarray(f(x8, w), np.float64)
    print(m, order, "shipped", base, round(_timing.time_in_loop(f, x8, w) * 1e6, 1), "err", float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))), flush=True)
    for rows in (64, 128):
      for steps in (2, 3, 4):
        cfg = mm.MosaicConfig(tile_k=512, steps=steps, wg_rows=rows)
        try:
          g = jax.jit(lambda x, w, cfg=cfg: mm._matmul(x, w, xs, jnp.float32, cfg, planes=True))
          out = np.asarray(g(x8, w), np.float64)
          err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
          t = _timing.time_in_loop(g, x8, w)
          print(m, order, "planes", f"rows{rows} s{steps}", round(t * 1e6, 1), "err", err, flush=True)
        except Exception as e:
          print(m, order, "planes", f"rows{rows} s{steps}", "ERR", str(e)[:150], flush=True)
    if m == 1:
      break
