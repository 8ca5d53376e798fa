"""The QT ops jitted on the GPU give the numbers the same ops give on the CPU; GPU only.

XLA's GPU Triton GEMM fusion once returned 2x results for quantized dots whose
int8 operands were produced by fused quantize ops (jax 0.11.2, H200), and its Triton
int8 GEMM returns 2x for short contractions; XLA's GPU backend lowers no integer
convolution with an integer output. These tests pin the workarounds (qdot materializes
its low-precision operands and pads their contractions; conv_general_qt convolves
integer values as float32 off the CPU, which XLA runs as cuDNN's int8 convolution).

Run on the GPU machine: ``PYTHONPATH=. python -m pytest -m gpu tests/ops/test_ops_gpu.py``.
"""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain.core as qc

import qtrain.ops as qops
from _testutil import rel_error as _rel

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



def _both(fn, *args):
  gpu = jax.jit(fn)(*args)
  with jax.default_device(jax.devices("cpu")[0]):
    cpu = jax.jit(fn)(*[jax.device_put(a, jax.devices("cpu")[0]) for a in args])
  return gpu, cpu


CONFIGS = {
    "w8a8_int8_grads": dict(lhs=qops.OperandQuant(qtype="int8"), rhs=qops.OperandQuant(qtype="int8"),
                            dlhs_grad=qops.GradQuant(qtype="int8"), drhs_grad=qops.GradQuant(qtype="int8")),
    "w8a8_tile16": dict(lhs=qops.OperandQuant(qtype="int8", tile_size=16),
                        rhs=qops.OperandQuant(qtype="int8", tile_size=16),
                        dlhs_grad=qops.GradQuant(qtype="int8"), drhs_grad=qops.GradQuant(qtype="int8")),
    "w4_tile32_a16": dict(rhs=qops.OperandQuant(qtype="int4", tile_size=32)),
    "binary": dict(lhs=qops.OperandQuant(qtype="binary", calibration="absmean"),
                   rhs=qops.OperandQuant(qtype="binary", calibration="absmean")),
    "fp8": dict(lhs=qops.OperandQuant(qtype="float8_e4m3fn"), rhs=qops.OperandQuant(qtype="float8_e4m3fn"),
                dlhs_grad=qops.GradQuant(qtype="float8_e5m2"), drhs_grad=qops.GradQuant(qtype="float8_e5m2")),
}


@pytest.mark.parametrize("implementation", ["xla", "auto"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("shape", [(8, 32, 16), (256, 512, 128), (512, 256, 1024)])
def test_dot_general_qt_gpu_matches_cpu(name, shape, implementation):
  m, k, n = shape
  cfg = qops.DotGeneralQtConfig(implementation=implementation, **CONFIGS[name])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  fwd = lambda x, w: qops.dot_general_qt(x, w, dn, cfg)
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
  cfg = qops.ConvGeneralQtConfig(lhs=qops.OperandQuant(qtype=qtype, calibration=cal),
                               rhs=qops.OperandQuant(qtype=qtype, calibration=cal))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 9, 9, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 16, 8)), jnp.float32)
  fwd = lambda x, w: qops.conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        config=cfg)
  g_out, c_out = _both(fwd, x, w)
  # fp8: the GPU runs the convolution of fp8 values at fp8 GEMM accuracy (measured on an
  # H200: 3.9e-5 to 5.5e-5, also for identical fp8 inputs; see the test below).
  assert _rel(g_out, c_out) < (FP8_FWD_BUDGET if qtype.startswith("float8") else BUDGET)
  g_g, c_g = _both(jax.grad(lambda x, w: jnp.sum(fwd(x, w) ** 2), (0, 1)), x, w)
  # The backward convolutions run on the dequantized fp8 values: the same fp8-accuracy
  # convolution on the GPU (measured 4.9e-5 on an H200).
  for a, b in zip(g_g, c_g):
    assert _rel(a, b) < (FP8_FWD_BUDGET if qtype.startswith("float8") else BUDGET)


def _hlo_defs(text):
  """name -> its defining line, for every instruction of a compiled HLO module."""
  defs = {}
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("ROOT "):
      line = line[5:]
    if line.startswith("%") and " = " in line:
      defs[line.split(" = ", 1)[0].lstrip("%")] = line
  return defs


def _shape_of(defn: str) -> tuple[str, list[int], list[int]]:
  """(type, dims, layout) of an HLO value definition like 's8[256,512]{1,0} ...'."""
  m = re.match(r"\(?(\w+)\[([\d,]*)\]\{([\d,]*)", defn)
  ints = lambda t: [int(v) for v in t.split(",") if v]
  return m.group(1), ints(m.group(2)), ints(m.group(3))


@pytest.mark.parametrize("qtype,gq", [("int8", "int8"), ("float8_e4m3fn", "float8_e5m2")])
def test_qt_dense_products_read_k_minor_operands(qtype, gq, monkeypatch):
  # The forward and both backward products of a w8a8 layer with quantized gradients must
  # reach the GEMM (cuBLAS, or a Triton GEMM that XLA's autotuner picked) with both operands
  # K-minor: physically row-major with the contracting axis last. XLA otherwise turns the
  # operand transposes into layouts that send the product to a slow GEMM (a cutlass sm80
  # fallback at 1/8 of the int8 speed, measured in the training step). This checks XLA's
  # path: the Mosaic int8 GEMM, which "auto" picks for large M on Hopper, is switched off.
  from qtrain.ops.backends import mosaic as mosaic_backend
  monkeypatch.setattr(mosaic_backend, "AUTO_GEMM_MIN_M", 1 << 62)
  jax.clear_caches()  # the ops trace once per signature: retrace under the patch
  cfg = qops.DotGeneralQtConfig(lhs=qops.OperandQuant(qtype=qtype), rhs=qops.OperandQuant(qtype=qtype),
                              dlhs_grad=qops.GradQuant(qtype=gq, stochastic_rounding="uniform"),
                              drhs_grad=qops.GradQuant(qtype=gq, stochastic_rounding="uniform"))
  dn = (((1,), (0,)), ((), ()))
  x = jnp.ones((512, 256), jnp.bfloat16)
  w = jnp.ones((256, 1024), jnp.bfloat16)
  step = jax.jit(jax.grad(lambda x, w, k: jnp.sum(qops.dot_general_qt(x, w, dn, cfg, key=k)
                                                   .astype(jnp.float32) ** 2), (0, 1)))
  text = step.lower(x, w, jax.random.key(0)).compile().as_text()
  defs = _hlo_defs(text)
  low = ("s8", "f8e4m3fn", "f8e5m2")

  def operands(line, op):
    args = line.split(op + "(", 1)[1].split(")", 1)[0]
    names = [a.strip().lstrip("%") for a in args.split(",")][:2]
    return [_shape_of(defs[n].split(" = ", 1)[1]) for n in names if n in defs]

  gemms = []
  for line in defs.values():
    if "__cublas$lt$matmul" in line and "custom-call(" in line:
      ops = operands(line, "custom-call")
      lc = re.search(r'"lhs_contracting_dimensions":\["(\d+)"\]', line)
      rc = re.search(r'"rhs_contracting_dimensions":\["(\d+)"\]', line)
    elif " dot(" in line:
      ops = operands(line, "dot")
      lc = re.search(r"lhs_contracting_dims=\{(\d+)\}", line)
      rc = re.search(r"rhs_contracting_dims=\{(\d+)\}", line)
    else:
      continue
    if len(ops) == 2 and all(t in low for t, _, _ in ops):
      gemms.append((line, ops, int(lc.group(1)), int(rc.group(1))))
  assert len(gemms) == 3, "\n".join(g[0] for g in gemms) or text[-3000:]
  for line, ops, lc, rc in gemms:
    for (_, dims, layout), c in zip(ops, (lc, rc)):
      assert layout == list(range(len(dims) - 1, -1, -1)), (line, ops)  # row-major
      assert c == len(dims) - 1, (line, ops)  # contracting axis minor


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_quantization_gpu_matches_cpu_bit_exactly(dtype):
  # The same float32 -> low-precision conversion on both backends (round to nearest even).
  # The jitted function returns the low-precision values themselves.
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4096,)) * 3, jnp.float32)
  spec = qc.QuantizeSpec(qtype=dtype)
  g, c = _both(lambda x: qc.quantize(x, spec).qvalue, x)
  g, c = np.asarray(g).astype(np.float32), np.asarray(c).astype(np.float32)
  diff = np.nonzero(g != c)[0]
  assert diff.size == 0, (diff.size, list(zip(np.asarray(x)[diff][:5], g[diff][:5], c[diff][:5])))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
@pytest.mark.parametrize("method", ["uniform", "low_bit_uniform", "low_bit_hash"])
def test_stochastic_rounding_gpu_matches_cpu_bit_exactly(dtype, method):
  # Same key, same bits: threefry words, the byte split of low_bit_uniform and
  # the fp8 bit-pattern rounding are integer ops, identical on both backends.
  from qtrain.core import qtypes, rounding
  qt = qtypes.get_qtype(dtype)
  y = jnp.asarray(np.random.default_rng(4).standard_normal((64, 1027)) * 40, jnp.float32)
  key = jax.random.key(5)
  g, c = _both(lambda y, k: rounding.stochastic_round(y, qt, k, method=method), y, key)
  np.testing.assert_array_equal(np.asarray(g).astype(np.float32), np.asarray(c).astype(np.float32))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_fake_quantization_keeps_its_rounding_under_jit(dtype):
  # quantize + dequantize in one jit: the f32 -> fp8 -> f32 round trip must not be folded
  # away (XLA's excess-precision simplification); every value is an fp8 value times the scale.
  x = jnp.asarray(np.random.default_rng(3).standard_normal((4096,)) * 3, jnp.float32)
  spec = qc.QuantizeSpec(qtype=dtype)
  g, c = _both(lambda x: qc.fake_quantize(x, spec), x)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
  assert np.unique(np.asarray(g)).size <= 256


def test_low_precision_conv_of_the_same_fp8_values_matches_cpu():
  cq = importlib.import_module("qtrain.ops.conv_general_qt")  # the module, not the op
  rng = np.random.default_rng(4)
  a = jnp.asarray(rng.standard_normal((2, 9, 9, 16)) * 50, jnp.float8_e4m3fn)
  b = jnp.asarray(rng.standard_normal((3, 3, 16, 8)) * 50, jnp.float8_e4m3fn)
  p = dict(window_strides=(1, 1), padding="SAME", lhs_dilation=None, rhs_dilation=None,
           dn=jax.lax.conv_dimension_numbers(a.shape, b.shape, ("NHWC", "HWIO", "NHWC")),
           feature_group_count=1, batch_group_count=1, precision=None)
  g, c = _both(lambda a, b: cq._low_precision_conv(a, b, p, is_float=True), a, b)
  # The same fp8 values on both sides: the CPU's sum is exact float32 (it equals the
  # float32 HIGHEST path there bit for bit); the GPU's (a float32 HIGHEST convolution of
  # the fp8 values, which XLA may run as an fp8 convolution) was measured at 5.5e-5 on an
  # H200, the accuracy of Hopper's fp8 accumulation (FP8_FWD_BUDGET, as for the fp8 dot).
  assert _rel(g, c) < FP8_FWD_BUDGET


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("wq, act", [("int3", "int8"), ("int3", None), ("int5", "int8"),
                                     ("int7", None)])
def test_int3_to_int7_weights_run_on_their_container_kernels(backend, wq, act):
  """int3 weights run on the int4 kernels, int5..int7 on the int8 ones (the codes fit their
  container's fields): forced GPU backends take them and give the XLA path's numbers."""
  from qtrain.core import qarray as qa
  from qtrain.ops import dispatch
  x = jax.random.normal(jax.random.key(0), (16, 256), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (256, 384), jnp.float32)
  wq_ = qa.quantize(w, qa.QuantizeSpec(qtype=wq, channelwise_axes=(1,)))
  xq = (qa.quantize(x, qa.QuantizeSpec(qtype=act, channelwise_axes=(0,))) if act
        else x.astype(jnp.bfloat16))
  dn = (((1,), (0,)), ((), ()))
  run = lambda impl: jax.jit(lambda a, b: dispatch.quantized_dot_general(
      a, b, dn, preferred_element_type=jnp.float32, implementation=impl))(xq, wq_)
  got, want = run(backend), run("xla")
  # Integer products are exact (float32 rounding of the scaled sums only); bf16 activations
  # times dequantized weights accumulate in float32 in a different order.
  assert _rel(got, want) < (BUDGET if act else 1e-2), (backend, wq, act)


@pytest.mark.parametrize("shape,n_last", [((1024, 4096), 4096), ((512, 768), 6)])
@pytest.mark.parametrize("methods", [("low_bit_hash", "low_bit_hash"), (None, None)])
@pytest.mark.parametrize("qtype", ["int8", "float8_e5m2", "float8_e4m3fn"])
def test_gradient_pair_kernel_matches_xla_quantization_on_the_gpu(shape, n_last, methods, qtype):
  """The Triton kernel's codes are XLA's quantization of each folded gradient, bit for bit
  (rows spanning 1e-30..1e30; the GPU's float multiply, reciprocal and fp8 conversion, not the
  interpreter's)."""
  from qtrain.core import rounding
  from qtrain.kernels import grad_pair as gp
  m, n = shape
  qt = qc.get_qtype(qtype)
  ks = jax.random.split(jax.random.key(m + n), 4)
  rows = jnp.exp(jax.random.uniform(ks[0], (m, 1), minval=-69.0, maxval=69.0))
  g = (jax.random.normal(ks[1], (m, n)) * rows).astype(jnp.bfloat16)
  fl = jnp.exp(jax.random.normal(ks[2], (n,)) * 3)
  fr = jnp.exp(jax.random.normal(ks[3], (m,)) * 3)
  keys = (jax.random.key(1), jax.random.key(2))
  lead = n // n_last
  spec = lambda cw, method: qc.QuantizeSpec(qtype=qtype, channelwise_axes=cw,
                                            stochastic_rounding=method)

  @jax.jit
  def xla(g, fl, fr):
    g2 = (g.astype(jnp.float32) * fl[None, :]).reshape(m, lead, n_last)
    g3 = (g.astype(jnp.float32) * fr[:, None]).reshape(m, lead, n_last)
    ql = qc.quantize(g2, spec((0,), methods[0]), key=keys[0])
    qr = qc.quantize(g3, spec((1, 2), methods[1]), key=keys[1])
    return (ql.qvalue.reshape(m, n), qr.qvalue.reshape(m, n).T, ql.scale.reshape(m),
            qr.scale.reshape(n))

  c_l, c_rt, s_l, s_r = xla(g, fl, fr)
  seeds = jnp.stack([*rounding.hash_seeds(keys[0]), *rounding.hash_seeds(keys[1])])
  k_l, k_rt = jax.jit(lambda *a: gp.grad_pair(
      *a, qmin=qt.qmin, qmax=qt.qmax, n_last=n_last, code_dtype=qt.compute_dtype.name,
      stochastic=tuple(x is not None for x in methods)))(g, fl, fr, 1.0 / s_l, 1.0 / s_r, seeds)
  assert k_l.dtype == c_l.dtype and k_rt.dtype == c_rt.dtype
  bits = lambda a: np.asarray(a).view(np.uint8)  # fp8 NaN codes compare by their bits
  np.testing.assert_array_equal(bits(k_l), bits(c_l))
  np.testing.assert_array_equal(bits(k_rt), bits(c_rt))
  # Every row's largest value reaches the qtype's largest code.
  assert float(jnp.abs(k_l.astype(jnp.float32)).max()) == qt.qmax


@pytest.mark.parametrize("m", [256, 1024])
def test_gradient_pair_training_gradients_match_the_xla_path(m):
  """A w8a8g8 ``low_bit_hash`` dot under "auto" (the pair kernel, and the Mosaic GEMM from
  M = 512) gives the gradients of implementation="xla" (per-product quantization, XLA's
  int8 GEMMs) bit for bit."""
  gq = qops.GradQuant(qtype="int8", stochastic_rounding="low_bit_hash")
  cfg = lambda impl: qops.DotGeneralQtConfig(
      lhs=qops.OperandQuant(qtype="int8"), rhs=qops.OperandQuant(qtype="int8"),
      dlhs_grad=gq, drhs_grad=gq, implementation=impl)
  dn = (((1,), (0,)), ((), ()))
  x = jax.random.normal(jax.random.key(0), (m, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (512, 1024)) *
       jnp.exp(jax.random.normal(jax.random.key(2), (1024,)))).astype(jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(3), (m, 1024))

  def grads(impl):
    f = lambda x, w: (qops.dot_general_qt(x, w, dn, cfg(impl), key=jax.random.key(4))
                      .astype(jnp.float32) * cot).sum()
    return jax.jit(jax.grad(f, (0, 1)))(x, w)
  (gx, gw), (rx, rw) = grads("auto"), grads("xla")
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(rx, np.float32))
  np.testing.assert_array_equal(np.asarray(gw, np.float32), np.asarray(rw, np.float32))


@pytest.mark.parametrize("method", ["low_bit_hash", None])
def test_fp8_gradient_pair_training_gradients_match_the_xla_path(method):
  """e4m3 operands with e5m2 gradients under "auto" (the pair kernel's codes) against
  implementation="xla" (each product quantizes its own gradient): the same codes and scales
  (bit for bit: the kernel test above), so only the fp8 GEMMs' accumulation differs
  (:data:`FP8_FWD_BUDGET`); a code set in the wrong layout or a wrong scale is O(1)."""
  gq = qops.GradQuant(qtype="float8_e5m2", stochastic_rounding=method)
  cfg = lambda impl: qops.DotGeneralQtConfig(
      lhs=qops.OperandQuant(qtype="float8_e4m3fn"), rhs=qops.OperandQuant(qtype="float8_e4m3fn"),
      dlhs_grad=gq, drhs_grad=gq, implementation=impl)
  dn = (((1,), (0,)), ((), ()))
  # 128 rows: the weight gradient contracts 128 terms, the regime FP8_FWD_BUDGET was measured
  # in (Hopper's fp8 accumulation error grows with the contraction).
  x = jax.random.normal(jax.random.key(0), (128, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (512, 1024)) *
       jnp.exp(jax.random.normal(jax.random.key(2), (1024,)))).astype(jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(3), (128, 1024))

  def grads(impl):
    f = lambda x, w: (qops.dot_general_qt(x, w, dn, cfg(impl), key=jax.random.key(4))
                      .astype(jnp.float32) * cot).sum()
    g = jax.grad(f, (0, 1))
    hlo = jax.jit(g).lower(x, w).as_text()
    return jax.jit(g)(x, w), "qtrain_grad_pair" in hlo
  ((gx, gw), pair), ((rx, rw), ref_pair) = grads("auto"), grads("xla")
  assert pair and not ref_pair
  assert _rel(gx, rx) < FP8_FWD_BUDGET and _rel(gw, rw) < FP8_FWD_BUDGET, (_rel(gx, rx),
                                                                            _rel(gw, rw))
  assert float(jnp.abs(gw.astype(jnp.float32)).max()) > 0


# conv_general_qt under "auto": the forward of two integer-coded operands as XLA's
# convolution of the codes (cuDNN's int8 convolution), the float-gradient backward products
# as XLA's convolution transposes. (input, kernel, strides, padding, layout)
_CONV_CASES = {
    "3x3": ((8, 16, 16, 64), (3, 3, 64, 64), (1, 1), "SAME", ("NHWC", "HWIO", "NHWC")),
    "3x3_s2": ((8, 16, 16, 64), (3, 3, 64, 128), (2, 2), ((1, 1), (1, 1)), ("NHWC", "HWIO", "NHWC")),
    "1x1_s2": ((8, 16, 16, 64), (1, 1, 64, 128), (2, 2), "VALID", ("NHWC", "HWIO", "NHWC")),
    "7x7_s2_c3": ((4, 32, 32, 3), (7, 7, 3, 64), (2, 2), ((3, 3), (3, 3)), ("NHWC", "HWIO", "NHWC")),
    "c1_o10": ((16, 14, 14, 1), (3, 3, 1, 10), (1, 1), "SAME", ("NHWC", "HWIO", "NHWC")),
    "nchw": ((4, 32, 12, 12), (48, 32, 3, 3), (1, 1), "SAME", ("NCHW", "OIHW", "NCHW")),
    "1d": ((4, 64, 32), (5, 32, 48), (1,), "SAME", ("NWC", "WIO", "NWC")),
    "3d": ((2, 6, 6, 6, 16), (3, 3, 3, 16, 32), (1, 1, 1), "SAME", ("NDHWC", "DHWIO", "NDHWC")),
}


def _conv_case(case, qtype, grads, implementation):
  xs, ws, strides, padding, dn = _CONV_CASES[case]
  cal = "absmean" if qtype == "binary" else "absmax"
  gq = qops.GradQuant(qtype="int8", stochastic_rounding="low_bit_hash") if grads == "int8" else None
  cfg = qops.ConvGeneralQtConfig(lhs=qops.OperandQuant(qtype=qtype, calibration=cal),
                               rhs=qops.OperandQuant(qtype=qtype, calibration=cal),
                               dlhs_grad=gq, drhs_grad=gq, implementation=implementation)
  fwd = lambda x, w: qops.conv_general_qt(x, w, strides, padding, dimension_numbers=dn,
                                          config=cfg, key=jax.random.key(5))
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
  w = jnp.asarray(rng.standard_normal(ws) * 0.1, jnp.float32)
  return fwd, x, w


@pytest.mark.parametrize("grads", ["float", "int8"])
@pytest.mark.parametrize("qtype", ["int8", "binary"])
@pytest.mark.parametrize("case", sorted(_CONV_CASES))
def test_conv_auto_direct_route_gives_the_matrix_products_numbers(case, qtype, grads):
  auto, x, w = _conv_case(case, qtype, grads, "auto")
  xla, _, _ = _conv_case(case, qtype, grads, "xla")
  # Exact integer sums both ways, the same scale epilogue: the same bits.
  np.testing.assert_array_equal(np.asarray(jax.jit(auto)(x, w)), np.asarray(jax.jit(xla)(x, w)))
  loss = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1)))
  for a, b in zip(loss(auto)(x, w), loss(xla)(x, w)):
    # float gradients: float32 products summed in another order; int8 gradients: both
    # ways the matrix products (the int8 GEMM kernels against XLA's exact int8 dots).
    assert _rel(a, b) < (BUDGET if grads == "float" else INT8_GRAD_BUDGET)


def test_conv_auto_forward_runs_cudnns_int8_convolution():
  auto, x, w = _conv_case("3x3", "int8", "float", "auto")
  text = jax.jit(auto).lower(x, w).compile().as_text()
  defs = _hlo_defs(text)
  convs = [l for l in defs.values() if "__cudnn$conv" in l and "custom-call(" in l]
  assert convs, text[-3000:]
  def operand_types(line):
    args = line.split("custom-call(", 1)[1].split(")", 1)[0]
    return [_shape_of(defs[a.strip().lstrip("%")].split(" = ", 1)[1])[0]
            for a in args.split(",") if a.strip().lstrip("%") in defs]
  assert any(operand_types(l)[:2] == ["s8", "s8"] for l in convs), convs


@pytest.mark.parametrize("k", [2, 3, 9, 14, 35, 432])
def test_int8_products_of_any_contraction_length_match_the_cpu(k):
  # XLA's GPU Triton GEMM returned twice the int8 product for contractions (or split-K
  # pieces) that are not multiples of 4; qdot.pad_for_gemm pads them with zeros.
  cfg = qops.DotGeneralQtConfig(lhs=qops.OperandQuant(qtype="int8"),
                              rhs=qops.OperandQuant(qtype="int8"), implementation="xla")
  rng = np.random.default_rng(k)
  x = jnp.asarray(rng.standard_normal((512, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, 32)), jnp.float32)
  g, c = _both(lambda x, w: qops.dot_general_qt(x, w, (((1,), (0,)), ((), ())), cfg), x, w)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_training_kernels_run_inside_shard_map():
  """Inside a user's ``jax.shard_map`` (``check_vma=True``) the kernels of a quantized step run
  and give the unsharded step's numbers on a one-device mesh: an int8 ``low_bit_hash`` dot with
  M = 1024 (the Mosaic GEMM, the Pallas transposes, the gradient pair kernels), an int8
  convolution (cuDNN's int8 convolution, its float transposes) and a forward-only M = 64
  product on the small-M Mosaic kernel. Their outputs were once typed as replicated
  (``pallas_call`` refused them; ``plgpu.kernel`` drops the type it is given)."""
  from jax.sharding import Mesh, PartitionSpec as P
  gq = qops.GradQuant(qtype="int8", stochastic_rounding="low_bit_hash")
  dot_cfg = qops.DotGeneralQtConfig(lhs=qops.OperandQuant(qtype="int8"),
                                    rhs=qops.OperandQuant(qtype="int8"), dlhs_grad=gq, drhs_grad=gq)
  conv_cfg = qops.ConvGeneralQtConfig(lhs=qops.OperandQuant(qtype="int8"),
                                      rhs=qops.OperandQuant(qtype="int8"))
  x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (512, 1024)) * 0.05).astype(jnp.bfloat16)
  img = jax.random.normal(jax.random.key(2), (8, 16, 16, 64), jnp.float32).astype(jnp.bfloat16)
  k = (jax.random.normal(jax.random.key(3), (3, 3, 64, 64)) * 0.05).astype(jnp.bfloat16)

  def loss(x, w, img, k):
    y = qops.dot_general_qt(x, w, (((1,), (0,)), ((), ())), dot_cfg, key=jax.random.key(4))
    z = qops.conv_general_qt(img, k, (1, 1), "SAME", config=conv_cfg,
                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return (y.astype(jnp.float32) ** 2).sum() + (z.astype(jnp.float32) ** 2).sum()

  small_cfg = qops.DotGeneralQtConfig(rhs=qops.OperandQuant(qtype="int8"),
                                      implementation="mosaic")

  def small(x, w):
    return qops.dot_general_qt(x[:64], w, (((1,), (0,)), ((), ())), small_cfg)

  def step(x, w, img, k):
    gx, gw, gimg, gk = jax.grad(loss, (0, 1, 2, 3))(x, w, img, k)
    # The replicated weights' gradients come back summed over the shards (check_vma).
    return gx, gw, gimg, gk, small(x, w)

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data"), P()),
                            out_specs=(P("data"), P(), P("data"), P(), P("data"))))
  hlo = f.lower(x, w, img, k).compile().as_text()
  assert "qtrain_grad_pair" in hlo
  want = jax.jit(lambda *a: jax.grad(loss, (0, 1, 2, 3))(*a) + (small(a[0], a[1]),))(x, w, img, k)
  for got, want in zip(f(x, w, img, k), want, strict=True):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
