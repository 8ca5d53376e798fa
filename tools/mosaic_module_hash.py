"""Hashes of the Mosaic GPU modules the kernel lowers to, one per config: a refactor check.

Lowers :func:`qtrain.kernels.mosaic_matmul._kernel` for CUDA without a GPU (jax
>= 0.11; on a CPU-only machine too) for each qtype x bf16/f16/int8 activations
(int2: int8 only) x 2 configs, captures each Mosaic module (source locations stripped) before
Mosaic serializes it, and prints a short sha256 per case. Run it before and
after a change that should not alter the kernel and diff the two outputs:
identical hashes mean identical kernels. Compare runs over the same cases: Mosaic numbers
its symbols per process, so a case's hash also depends on the cases lowered before it. (It stops at the Mosaic module: the
TMA descriptor checks that run when XLA compiles it on a GPU are not covered.)

  python tools/mosaic_module_hash.py > before.txt   # then after the change
  python tools/mosaic_module_hash.py | diff before.txt -
"""
import hashlib
import importlib
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qtrain.kernels import mosaic_matmul as mm  # noqa: E402


def main():
  if jax.__version_info__ < (0, 11):
    sys.exit(f"needs jax >= 0.11 (Pallas Mosaic GPU); this is jax {jax.__version__}")
  importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")  # the lowering
  from jax.experimental.mosaic.gpu import core as mosaic_core
  jax.config.update("jax_traceback_in_locations_limit", 0)
  captured = []
  serde = mosaic_core._run_serde_pass

  def capture(module, **kw):
    captured.append(module.operation.get_asm(enable_debug_info=False))
    return serde(module, **kw)

  mosaic_core._run_serde_pass = capture
  n, k, m = 1024, 2048, 16
  for qtype in mm.QTYPES:
    for act in (jnp.bfloat16, jnp.float16, jnp.int8) if qtype != "int2" else (jnp.int8,):
      for cfg in (mm.MosaicConfig(tile_k=256, steps=2, wg_rows=128),
                  mm.MosaicConfig(tile_k=512, steps=2, split_k=2)):
        cols = mm._w_cols(qtype, k)
        w = jax.ShapeDtypeStruct((n, cols), jnp.int4 if qtype == "int4" else jnp.int8)
        f = lambda w, x, qtype=qtype, cfg=cfg: mm._kernel(w, x, qtype=qtype, k_pad=k, cfg=cfg)
        jax.jit(f).trace(w, jax.ShapeDtypeStruct((m, k), act)).lower(lowering_platforms=("cuda",))
        text = captured.pop()
        print(qtype, jnp.dtype(act).name, f"tk{cfg.tile_k} sk{cfg.split_k}",
              hashlib.sha256(text.encode()).hexdigest()[:16], len(text))


if __name__ == "__main__":
  main()
