"""The weight-times-activation kernels per shard on 2 GPUs (qtrain.kernels.sharded.weight_matmul).

Runs decode-size products (M = 16) through ``implementation="triton"`` and ``"mosaic"`` under
``jax.jit`` on a 2-device mesh, rows (M) sharded and, for a weight split by columns, N
sharded, and compares each with the same product on one device. Prints per case: the largest
error relative to the largest output, whether the bits equal one device's, whether the
compiled program has an all-gather (it should not: each device runs the kernel on its own
rows / columns), and the output's sharding.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python tools/check_sharded_kernels_gpu.py [--gspmd]

``--interpret``: a dry run of this script on 2 fake CPU devices (the Triton kernels in the
Pallas interpreter, smaller K and N; no Mosaic).

Expected: no all-gather in any case; integer activations with per-channel scales bit-equal;
bf16 activations within float32 summation order (a shard may run another block config).
The Mosaic cases need jax >= 0.11 and a Hopper GPU (skipped otherwise, with the reason).
Exit status 1 if a case fails one of these.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

INTERPRET = "--interpret" in sys.argv
if INTERPRET:  # before jax starts
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=2")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from qtrain.core import qarray as qa, qtypes  # noqa: E402
from qtrain.kernels import _common, mosaic_matmul as mm, prepared, sharded  # noqa: E402
from qtrain.ops import dispatch  # noqa: E402

DN = (((1,), (1,)), ((), ()))
M, K, N = (16, 512, 512) if INTERPRET else (16, 4096, 4096)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gspmd", action="store_true", help="GSPMD instead of Shardy")
  ap.add_argument("--interpret", action="store_true",
                  help="dry run on 2 fake CPU devices (Triton kernels interpreted)")
  args = ap.parse_args()
  jax.config.update("jax_use_shardy_partitioner", not args.gspmd)
  gpus = jax.devices() if INTERPRET else [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    print(f"needs 2 GPUs; found {len(gpus)} ({jax.devices()})")
    return 2
  mesh = Mesh(np.array(gpus[:2]), ("x",))
  S = lambda *spec: NamedSharding(mesh, P(*spec))
  rng = np.random.default_rng(0)
  x_bf16 = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  x_int8 = qa.QArray(qvalue=jnp.asarray(rng.integers(-127, 128, (M, K)), jnp.int8),
                     scale=jnp.asarray(rng.uniform(0.01, 0.02, (M, 1)), jnp.float32),
                     zero_point=None, qtype=qtypes.get_qtype("int8"))

  def weight(qtype, lo, hi):
    return qa.QArray(qvalue=jnp.asarray(rng.integers(lo, hi, (N, K)), jnp.int8),
                     scale=jnp.asarray(rng.uniform(0.01, 0.02, (N, 1)), jnp.float32),
                     zero_point=None, qtype=qtypes.get_qtype(qtype))

  w_int4, w_int8 = weight("int4", -8, 8), weight("int8", -127, 128)
  pw_int4 = prepared.prepare_weight(w_int4.qvalue, "int4", scale=w_int4.scale, kn=True)

  def x_spec(x, m):
    if isinstance(x, qa.QArray):
      return qa.QArray(qvalue=S(m, None), scale=S(m, None), zero_point=None, qtype=x.qtype)
    return S(m, None)

  def w_spec(w, n):
    if isinstance(w, qa.QArray):
      return qa.QArray(qvalue=S(n, None), scale=S(n, None), zero_point=None, qtype=w.qtype)
    lay = sharded.weight_layout(w)
    leaves, tree = jax.tree_util.tree_flatten(w)
    return tree.unflatten([S(*[n if i == a else None for i in range(l.ndim)])
                           for l, a in zip(leaves, lay.n_axes)])

  triton = "interpret" if INTERPRET else "triton"
  cases = [  # name, implementation, x, w, exact
      ("triton bf16 x int4", triton, x_bf16, w_int4, False),
      ("triton int8 x int8", triton, x_int8, w_int8, True),
      ("triton bf16 x PreparedWeight int4", triton, x_bf16, pw_int4, False),
  ]
  mosaic_skip = None
  if INTERPRET:
    mosaic_skip = "--interpret (no CPU interpreter for Mosaic GPU)"
  elif jax.__version_info__ < (0, 11):
    mosaic_skip = f"jax {jax.__version__} < 0.11"
  elif not _common.on_hopper():
    mosaic_skip = "not a Hopper GPU"
  if mosaic_skip is None:
    mw_int4 = mm.prepare_mosaic_weight(w_int4.qvalue, "int4", scale=w_int4.scale)
    cases += [("mosaic bf16 x int4", "mosaic", x_bf16, w_int4, False),
              ("mosaic int8 x int8", "mosaic", x_int8, w_int8, True),
              ("mosaic bf16 x MosaicWeight int4", "mosaic", x_bf16, mw_int4, False)]
  else:
    print(f"mosaic cases skipped: {mosaic_skip}")

  failed = 0
  print(f"partitioner: {'gspmd' if args.gspmd else 'shardy'}; devices: {gpus[0].device_kind} x 2; "
        f"M={M} K={K} N={N}")
  print(f"{'case':36s} {'split':6s} {'rel err':>9s} {'bits':>5s} {'all-gather':>10s}  out sharding")
  for name, impl, x, w, exact in cases:
    f = lambda x, w, impl=impl: dispatch.quantized_dot_general(
        x, w, DN, preferred_element_type=jnp.float32, implementation=impl)
    one = np.asarray(jax.jit(f)(jax.device_put(x, gpus[0]), jax.device_put(w, gpus[0])),
                     np.float64)
    # N splits for a QArray weight (packed per call to N a multiple of 128 / 256) and for the
    # prepared forms (4096 channels, no padding).
    for split, m, n in (("M", "x", None), ("N", None, "x")):
      try:
        g = jax.jit(f, in_shardings=(x_spec(x, m), w_spec(w, n)))
        got = g(x, w)
        hlo = g.lower(x, w).compile().as_text()
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{name:36s} {split:6s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        failed += 1
        continue
      got_np = np.asarray(got, np.float64)
      rel = float(np.max(np.abs(got_np - one)) / np.max(np.abs(one)))
      bits = bool(np.array_equal(got_np, one))
      gather = bool(re.search(r"\ball-gather(?:-start)?\(", hlo))
      ok = not gather and (bits if exact else rel < 1e-5)
      failed += not ok
      print(f"{name:36s} {split:6s} {rel:9.2e} {str(bits):>5s} {str(gather):>10s}  "
            f"{got.sharding.spec}{'' if ok else '   <-- FAIL'}")
  print("all passed" if not failed else f"{failed} case(s) failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
