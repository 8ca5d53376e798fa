"""Prints how far the jitted QT ops on the GPU are from the same ops on the CPU, per part.

  PYTHONPATH=. python benchmarks/gpu_check_qt.py

One line per (config, shape): relative L2 error of the forward, dlhs and drhs. Used to set
the error budgets of tests/test_core_gpu.py from measurement.
"""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

import qtrain.core as qc

_spec = importlib.util.spec_from_file_location(  # the configs the GPU tests use
    "test_core_gpu", os.path.join(os.path.dirname(__file__), "..", "tests", "test_core_gpu.py"))
_t = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_t)
CONFIGS, _both, _rel = _t.CONFIGS, _t._both, _t._rel

for name in sorted(CONFIGS):
  for m, k, n in [(8, 32, 16), (256, 512, 128)]:
    cfg = qc.DotGeneralQtConfig(implementation="xla", **CONFIGS[name])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    fwd = lambda x, w: qc.dot_general_qt(x, w, dn, cfg)
    go, co = _both(fwd, x, w)
    gg, cg = _both(jax.grad(lambda x, w: jnp.sum(fwd(x, w) ** 2), (0, 1)), x, w)
    print(f"{name:18s} {m}x{k}x{n}: fwd {_rel(go, co):.2e} dlhs {_rel(gg[0], cg[0]):.2e} "
          f"drhs {_rel(gg[1], cg[1]):.2e}", flush=True)
