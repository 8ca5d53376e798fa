"""The QT ops jitted on the GPU give the numbers the same ops give on the CPU; GPU only.

XLA's GPU Triton GEMM fusion once returned 2x results for quantized dots whose
int8 operands were produced by fused quantize ops (jax 0.11.2, H200); XLA's GPU
backend cannot lower integer convolutions. These tests pin both workarounds
(qdot materializes its low-precision operands; conv_general_qt convolves
integer values in float32 at HIGHEST precision off the CPU).

Run on the GPU machine: ``PYTHONPATH=. python -m pytest -m gpu tests/test_core_gpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain.core as qc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

# The same quantized math on two backends: only float32 summation order differs,
# so forward and float-backward results agree to float32 rounding.
BUDGET = 1e-5
# Hopper's fp8 tensor cores accumulate with reduced precision (measured on an H200,
# jax 0.11.2, 256x512x128: forward 7.5e-5 from the CPU's exact float32 accumulation).
FP8_FWD_BUDGET = 5e-4
# Behind a quantized incoming gradient, a one-ulp forward difference can move an
# element of the gradient across a rounding boundary: one int8 step (1/127 of its
# row's absmax) or one e5m2 step (a quarter of its value). Measured on an H200:
# int8 gradients 1.6e-4 (w8a8, tile 16), e5m2 gradients 1.9e-3 (fp8).
INT8_GRAD_BUDGET = 2e-3
FP8_GRAD_BUDGET = 1e-2


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _both(fn, *args):
  gpu = jax.jit(fn)(*args)
  with jax.default_device(jax.devices("cpu")[0]):
    cpu = jax.jit(fn)(*[jax.device_put(a, jax.devices("cpu")[0]) for a in args])
  return gpu, cpu


CONFIGS = {
    "w8a8_int8_grads": dict(lhs=qc.OperandQuant(qtype="int8"), rhs=qc.OperandQuant(qtype="int8"),
                            dlhs_grad=qc.GradQuant(qtype="int8"), drhs_grad=qc.GradQuant(qtype="int8")),
    "w8a8_tile16": dict(lhs=qc.OperandQuant(qtype="int8", tile_size=16),
                        rhs=qc.OperandQuant(qtype="int8", tile_size=16),
                        dlhs_grad=qc.GradQuant(qtype="int8"), drhs_grad=qc.GradQuant(qtype="int8")),
    "w4_tile32_a16": dict(rhs=qc.OperandQuant(qtype="int4", tile_size=32)),
    "binary": dict(lhs=qc.OperandQuant(qtype="binary", calibration="absmean"),
                   rhs=qc.OperandQuant(qtype="binary", calibration="absmean")),
    "fp8": dict(lhs=qc.OperandQuant(qtype="float8_e4m3fn"), rhs=qc.OperandQuant(qtype="float8_e4m3fn"),
                dlhs_grad=qc.GradQuant(qtype="float8_e5m2"), drhs_grad=qc.GradQuant(qtype="float8_e5m2")),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("shape", [(8, 32, 16), (256, 512, 128)])
def test_dot_general_qt_gpu_matches_cpu(name, shape):
  m, k, n = shape
  cfg = qc.DotGeneralQtConfig(implementation="xla", **CONFIGS[name])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  fwd = lambda x, w: qc.dot_general_qt(x, w, dn, cfg)
  grads = jax.grad(lambda x, w: jnp.sum(fwd(x, w) ** 2), (0, 1))
  fwd_budget = FP8_FWD_BUDGET if name == "fp8" else BUDGET
  grad_budget = {"fp8": FP8_GRAD_BUDGET, "w8a8_int8_grads": INT8_GRAD_BUDGET,
                 "w8a8_tile16": INT8_GRAD_BUDGET}.get(name, BUDGET)
  (g_out, c_out) = _both(fwd, x, w)
  assert _rel(g_out, c_out) < fwd_budget
  g_g, c_g = _both(grads, x, w)
  for a, b in zip(g_g, c_g):
    assert _rel(a, b) < grad_budget


@pytest.mark.parametrize("qtype", ["int8", "binary", "float8_e4m3fn"])
def test_conv_general_qt_gpu_matches_cpu(qtype):
  cal = "absmean" if qtype == "binary" else "absmax"
  cfg = qc.ConvGeneralQtConfig(lhs=qc.OperandQuant(qtype=qtype, calibration=cal),
                               rhs=qc.OperandQuant(qtype=qtype, calibration=cal))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 9, 9, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 16, 8)), jnp.float32)
  fwd = lambda x, w: qc.conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        config=cfg)
  g_out, c_out = _both(fwd, x, w)
  assert _rel(g_out, c_out) < BUDGET
  g_g, c_g = _both(jax.grad(lambda x, w: jnp.sum(fwd(x, w) ** 2), (0, 1)), x, w)
  for a, b in zip(g_g, c_g):
    assert _rel(a, b) < BUDGET
