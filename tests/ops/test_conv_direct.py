"""conv_general_qt's direct route: with ``implementation="auto"`` a CUDA lowering runs the
forward of two integer-coded operands as XLA's convolution of the codes (cuDNN's int8
convolution) and the float-gradient backward products as XLA's convolution transposes,
instead of the patches x kernel matrix product.

On the CPU, "auto" keeps the matrix product, so these tests call the route's pieces
directly and hold them to the matrix product's numbers: the forward bit for bit (both sum
integer products exactly, then apply the same scale epilogue), in both forms (the int32
convolution, and the float32 HIGHEST convolution of the codes a GPU lowers); the float
backward within float32 summation order (float32 products) or one rounding into bfloat16
(bf16 products, which both round once from a float32 sum). ``tests/ops/test_ops_gpu.py``
runs the whole op both ways on a GPU.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.ops import config as C

cg = importlib.import_module("qtrain.ops.conv_general_qt")  # the module, for its pieces
OQ = C.OperandQuant

# (input shape, kernel shape, strides, padding, dimension numbers, lhs dilation, rhs dilation)
GEOMETRIES = {
    "3x3_same": ((2, 9, 9, 16), (3, 3, 16, 8), (1, 1), "SAME", ("NHWC", "HWIO", "NHWC"), None, None),
    "3x3_s2_pad": ((2, 10, 9, 6), (3, 3, 6, 5), (2, 2), ((1, 2), (0, 1)), ("NHWC", "HWIO", "NHWC"),
                   None, None),
    "1x1_s2": ((3, 8, 8, 12), (1, 1, 12, 4), (2, 2), "VALID", ("NHWC", "HWIO", "NHWC"), None, None),
    "nchw_dilated": ((2, 5, 11, 10), (4, 5, 3, 2), (1, 1), "SAME", ("NCHW", "OIHW", "NCHW"),
                     None, (2, 1)),
    "lhs_dilated": ((2, 6, 6, 4), (3, 3, 4, 3), (1, 1), ((1, 1), (2, 0)), ("NHWC", "HWIO", "NHWC"),
                    (2, 1), None),
    "1d": ((3, 17, 5), (4, 5, 6), (2,), "SAME", ("NWC", "WIO", "NWC"), None, None),
    "3d": ((2, 4, 5, 6, 3), (2, 3, 2, 3, 4), (1, 1, 1), "SAME", ("NDHWC", "DHWIO", "NDHWC"),
           None, None),
    "c1_input": ((4, 12, 12, 1), (3, 3, 1, 7), (1, 1), "SAME", ("NHWC", "HWIO", "NHWC"), None, None),
}


def _cases(names, fast):
  """pytest params of ``names``; those not in ``fast`` carry the slow marker."""
  return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


def _params(case, groups=1):
  xs, ws, strides, padding, dn, ld, rd = GEOMETRIES[case]
  nsp = len(xs) - 2
  return cg._Static(dict(
      window_strides=strides, padding=padding, lhs_dilation=ld or (1,) * nsp,
      rhs_dilation=rd or (1,) * nsp, dn=jax.lax.conv_dimension_numbers(xs, ws, dn),
      feature_group_count=groups, batch_group_count=1, precision=None))


def _operands(case, dtype, seed):
  xs, ws = GEOMETRIES[case][:2]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(xs) * 3.0, dtype)
  w = jnp.asarray(rng.standard_normal(ws) * 0.2, dtype)
  return x, w


def _residuals(x, w, p, cfg, out_dtype):
  return cg._forward(x, w, None, None, p, cfg, out_dtype)[1]


QTYPES = {
    "int8": (OQ(qtype="int8"), OQ(qtype="int8")),
    "int8_per_tensor": (OQ(qtype="int8", channelwise=False), OQ(qtype="int8")),
    "binary": (OQ(qtype="binary", calibration="absmean"), OQ(qtype="binary", calibration="absmean")),
    "int4_x_int8": (OQ(qtype="int4"), OQ(qtype="int8")),
}


@pytest.mark.parametrize("qt", _cases(sorted(QTYPES), ("int8",)))  # binary: 8-11 s a case
@pytest.mark.parametrize("case", _cases(sorted(GEOMETRIES), ("3x3_s2_pad", "nchw_dilated", "1d")))
@pytest.mark.thin(3)
def test_direct_forward_is_the_matrix_product_bit_for_bit(case, qt):
  p = _params(case)
  lq, rq = QTYPES[qt]
  cfg = C.ConvGeneralQtConfig(lhs=lq, rhs=rq)
  x, w = _operands(case, jnp.float32, seed=len(case))
  lres, rres = _residuals(x, w, p, cfg, jnp.float32)
  a, b = lres.value, rres.value
  assert cg.direct_forward(a, b, p)
  want = np.asarray(cg.quantized_conv(a, b, p, jnp.float32, implementation="xla"))
  assert np.count_nonzero(want) > want.size // 2
  for backend in ("cpu", "gpu"):  # int32 convolution; float32 HIGHEST convolution of codes
    got = jax.jit(lambda a, b: cg._xla_conv(a, b, p, jnp.float32, backend=backend))(a, b)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=backend)


@pytest.mark.slow  # 13 s on two CPU cores
def test_direct_forward_takes_only_integer_codes_whose_scales_factor():
  p = _params("3x3_same")
  x, w = _operands("3x3_same", jnp.float32, seed=1)
  res = lambda lq, rq, q=p: [r.value for r in _residuals(x, w, q, C.ConvGeneralQtConfig(
      lhs=lq, rhs=rq), jnp.float32)]
  assert cg.direct_forward(*res(OQ(qtype="int8"), OQ(qtype="int8")), p)
  # fp8 codes (the fp8 GEMM on the patches), a float side, a zero point: the matrix product.
  assert not cg.direct_forward(*res(OQ(qtype="float8_e4m3fn"), OQ(qtype="float8_e4m3fn")), p)
  a, b = res(None, OQ(qtype="int8"))
  assert not cg.direct_forward(a, b, p)
  assert not cg.direct_forward(*res(OQ(qtype="int8", calibration="minmax"), OQ(qtype="int8")), p)
  # A grouped convolution takes the matrix product (the group a batch axis of the GEMM).
  pg = _params("3x3_same", groups=2)
  wg = w[:, :, :8]
  lg, rg = [r.value for r in _residuals(x, wg, pg, C.ConvGeneralQtConfig(
      lhs=OQ(qtype="int8"), rhs=OQ(qtype="int8")), jnp.float32)]
  assert not cg.direct_forward(lg, rg, pg)


@pytest.mark.slow
def test_direct_float_grads_are_the_unquantized_gradient_products_under_auto():
  p = _params("3x3_same")
  x, w = _operands("3x3_same", jnp.float32, seed=2)
  g = jnp.ones((2, 9, 9, 8), jnp.float32)
  q8, gq = OQ(qtype="int8"), C.GradQuant(qtype="int8")
  def which(implementation="auto", **kw):
    cfg = C.ConvGeneralQtConfig(lhs=q8, rhs=q8, implementation=implementation, **kw)
    lres, rres = _residuals(x, w, p, cfg, jnp.float32)
    return cg.direct_float_grads(p, cfg, lres, rres, g)
  assert which() == (True, True)
  assert which(dlhs_grad=gq) == (False, True)
  assert which(drhs_grad=gq) == (True, False)
  assert which(dlhs_grad=gq, drhs_grad=gq) == (False, False)
  assert which(implementation="xla") == (False, False)


FLOAT_CONFIGS = {
    "w8a8": (OQ(qtype="int8"), OQ(qtype="int8")),
    "binary": (OQ(qtype="binary", calibration="absmean"), OQ(qtype="binary", calibration="absmean")),
    "weight_only_int8": (None, OQ(qtype="int8")),
    "act_only_int8": (OQ(qtype="int8"), None),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", _cases(sorted(FLOAT_CONFIGS), ("w8a8", "weight_only_int8")))
@pytest.mark.parametrize("case", _cases(["3x3_same", "3x3_s2_pad", "nchw_dilated", "lhs_dilated",
                                         "1d", "3d"], ("3x3_s2_pad", "lhs_dilated")))
@pytest.mark.thin(8)
def test_transposed_float_grads_match_the_patches(case, name, dtype):
  p = _params(case)
  lq, rq = FLOAT_CONFIGS[name]
  cfg = C.ConvGeneralQtConfig(lhs=lq, rhs=rq)
  dt = jnp.dtype(dtype)
  x, w = _operands(case, dt, seed=3)
  out_shape = jax.eval_shape(lambda a, b: cg._conv(a, b, p, None), x, w).shape
  g = jnp.asarray(np.random.default_rng(4).standard_normal(out_shape), dt)
  lres, rres = _residuals(x, w, p, cfg, dt)
  assert cg.direct_float_grads(p, cfg, lres, rres, g) == (True, True)
  key = jax.random.key(0)
  want = cg._matmul_grads(p, cfg, lres, rres, g, key, key, (dt, dt))
  got = jax.jit(lambda g: cg._transposed_conv_grads(p, lres, rres, g, (dt, dt)))(g)
  for name_, a, b in zip(("lhs", "rhs"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name_
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.count_nonzero(b) > b.size // 2
    # float32 sums of the same products in another order; a bf16 product's result rounds
    # once into bfloat16 from such a sum (the patches round at the end, after the cast).
    u = 2.0 ** -8 if dt == jnp.bfloat16 else 0.0
    np.testing.assert_array_less(np.abs(a - b), u * np.abs(b) + 2.0 ** -19 * np.abs(b).max()
                                 + 1e-30, err_msg=name_)


def test_auto_conv_gradients_inside_shard_map_type_both_routes_alike():
  """Inside shard_map the direct route's transposes (traced on every platform, beside the
  patches) must give per-shard cotangents typed as the patches' are: a batch-sharded input, a
  replicated kernel, float gradients. One device: the values are the unsharded op's."""
  from jax.sharding import Mesh, PartitionSpec as P
  p = _params("3x3_same")
  xs, ws, strides, padding, dn = GEOMETRIES["3x3_same"][:5]
  x, w = _operands("3x3_same", jnp.float32, seed=5)
  cfg = C.ConvGeneralQtConfig(lhs=OQ(qtype="int8"), rhs=OQ(qtype="int8"))
  conv = lambda x, w: cg.conv_general_qt(x, w, strides, padding, dimension_numbers=dn, config=cfg)
  loss = lambda x, w: jnp.sum(conv(x, w) ** 2)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  def sharded(x, w):
    gx, gw = jax.grad(loss, (0, 1))(x, w)
    return gx, jax.lax.psum(gw, "data")
  f = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P("data"), P()),
                            out_specs=(P("data"), P())))
  for a, b in zip(f(x, w), jax.jit(jax.grad(loss, (0, 1)))(x, w)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
