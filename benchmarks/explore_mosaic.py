"""Mosaic GPU small-M kernels: config grid of the library kernel, and the prototype's ablations.

``--mode configs`` times :func:`qtrain.pallas.mosaic_matmul.mosaic_matmul` over a
grid of :class:`~qtrain.pallas.mosaic_matmul.MosaicConfig` (rows per warpgroup,
tile_k, pipeline depth) at M = 16 / 64, each checked against the f64 reference,
with XLA bf16 and the Triton kernels measured in the same run.

``--mode ablation`` runs the prototype (benchmarks/_mosaic_proto.py: the same
kernel with switches the library does not carry) to show where the time goes:
pre-permuted weights relabelled into the wgmma layout against Mosaic's generic
relayout (warp shuffles), and a stream-only pipeline (TMA loads, no decode, no
MMA) as the floor of the tiling.

  PYTHONPATH=. python benchmarks/explore_mosaic.py --mode configs --json $OUT/mosaic_cfg.json

GPU only (Hopper, jax >= 0.11).
"""
import argparse, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _timing
from qtrain.pallas import mosaic_matmul as mm


def configs(kind, n):
  big = n > 8192
  out = []
  for wgs in (2, 4):
    sp = 1 if big else (4 if wgs == 2 else 8)
    for xmk in (False, True):
      if kind == "binary":
        tks = ((512, 4), (256, 6)) if wgs == 2 else ((256, 4), (256, 6))
      elif kind == "int4":
        tks = ((512, 3), (256, 4)) if wgs == 2 else ((256, 3),)
      else:
        tks = ((256, 3),) if wgs == 2 else ((128, 4),)
      for tk, st in tks:
        out.append(dict(tile_k=tk, steps=st, split=sp, wgs=wgs, x_mk=xmk))
  out.append(dict(out[0], stream_only=True))
  out.append(dict(out[-2], stream_only=True))
  return out


def library_configs(qtype, m):
  out = []
  for wg_rows, tks in ((64, (512, 256)), (128, (256,))):
    for tk in tks:
      for st in (2, 3, 4):
        if qtype == "binary" and tk < 256:
          continue
        cfg = mm.MosaicConfig(tile_k=tk, steps=st, wg_rows=wg_rows)
        if mm.smem_bytes(qtype, m, cfg) <= mm.SMEM_BYTES:
          out.append(cfg)
  return out


def run_configs(a):
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  rows, t0 = [], time.time()
  for k, n, ms in ((8192, 28672, (16, 64)), (4096, 4096, (16,))):
    for m in ms:
      kx, kw = jax.random.split(jax.random.key(m))
      x = jax.random.normal(kx, (m, k), jnp.bfloat16)
      wbf = jax.random.normal(kw, (n, k), jnp.bfloat16)
      t_bf = _timing.time_in_loop(lambda x, w: x @ w.T, x, wbf)
      rows.append(dict(m=m, k=k, n=n, kernel="xla bf16", us=t_bf * 1e6))
      print(rows[-1], flush=True)
      for qtype, lo, hi in (("binary", -1, 2), ("int4", -8, 8), ("int8", -128, 128)):
        v = jax.random.randint(kw, (n, k), lo, hi, jnp.int32).astype(jnp.int8)
        w = mm.prepare_mosaic_weight(v, qtype)
        ref = np.asarray(mm.mosaic_matmul_reference(x, v, qtype), np.float64)
        base = mm.default_config(w, m)
        for cfg in library_configs(qtype, m):
          if time.time() - t0 > a.budget_s:
            break
          cfg = mm.with_split(w, cfg)
          f = jax.jit(lambda x, w, cfg=cfg: mm.mosaic_matmul(x, w, config=cfg))
          name = f"{qtype} rows{cfg.wg_rows} tk{cfg.tile_k} s{cfg.steps} sk{cfg.split_k}"
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


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=("configs", "ablation"), default="configs")
  p.add_argument("--budget-s", type=float, default=400)
  p.add_argument("--json", default=None)
  a = p.parse_args()
  if a.mode == "configs":
    return run_configs(a)
  from benchmarks import _mosaic_proto as mp
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  rows = []
  for k, n in ((8192, 28672), (4096, 4096)):
    m = 16
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    xt = x.T
    xf = np.asarray(xt.astype(jnp.float32), np.float64)
    wbf = jax.random.normal(kw, (n, k), jnp.bfloat16)
    t_bf = _timing.time_in_loop(lambda x, w: x @ w.T, x, wbf)
    rows.append(dict(k=k, n=n, kernel="xla bf16", us=t_bf * 1e6))
    print(rows[-1], flush=True)
    bits01 = jax.random.bernoulli(kw, 0.5, (n, k))
    ops = {"binary": (jnp.asarray(mp.pack_binary(np.asarray(bits01))),
                      np.where(np.asarray(bits01), 1.0, -1.0) @ xf)}
    for kind, dt, lo, hi in (("int8", jnp.int8, -128, 128), ("int4", jnp.int4, -8, 8)):
      wq = jax.random.randint(kw, (n, k), lo, hi, jnp.int32)
      ops[kind] = (jnp.asarray(mp.permute_weights(np.asarray(wq), 4 if kind == "int4" else 8)).astype(dt),
                   np.asarray(wq, np.float64) @ xf)
    for kind, (w, ref) in ops.items():
      for cfg in configs(kind, n):
        name = f"{kind} " + " ".join(f"{kk}={vv}" for kk, vv in cfg.items())
        xin = x if cfg["x_mk"] else xt
        try:
          f = jax.jit(lambda xin, w, cfg=cfg: mp.wmm_lane(w, xin, binary=kind == "binary", **cfg).sum(0))
          out = np.asarray(f(xin, w), np.float64)
          err = None if cfg.get("stream_only") else float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
          t = _timing.time_in_loop(f, xin, w)
          rows.append(dict(k=k, n=n, kernel=name, us=t * 1e6, rel_err=err, vs_bf16=t_bf / t))
        except Exception as e:
          rows.append(dict(k=k, n=n, kernel=name, error=f"{type(e).__name__}: {str(e)[:800]}"))
        print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in rows[-1].items()},
              flush=True)
        if a.json:
          json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
  main()
