"""qtrain.ops.conv_general_qt: forward vs a float64 numpy convolution, gradients vs a
fake-quant straight-through reference, and 1x1 conv == dense dot_general_qt.

Error budgets (as in tests/ops/test_dot_general_qt.py):
  * |out - conv64(x_hat, w_hat)| <= ACC_RTOL * conv64(|x_hat|, |w_hat|): the
    integer convolution is exact in int32, fp8 accumulates in float32.
  * |out - conv64(x, w)| <= conv64(E_x, |w_hat|) + conv64(|x|, E_w) + the above,
    E = per-element quantization budget (int: scale / 2; fp8: 2^-(m+1) |x| or
    half a subnormal step).
  * Float backward: the same float32 math as the reference (ACC_RTOL of the
    absolute terms); int8 backward: relative Frobenius error <= 2^-6.
"""

import dataclasses
import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.ops import config as C
from qtrain.core import qarray
from qtrain.ops.conv_general_qt import conv_general_qt
from qtrain.ops.dot_general_qt import dot_general_qt

ACC_RTOL = 2.0 ** -17   # fp8: float32 accumulation over <= 72 window terms, + scaling
HIGHEST = jax.lax.Precision.HIGHEST
OQ = C.OperandQuant


def _rand(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------
# float64 numpy reference convolution (NHWC x HWIO), any layout via transposes.


def _to_nhwc(x, spec):  # spec: "NHWC" / "NCHW"
  return np.transpose(x, [spec.index(c) for c in "NHWC"])


def _to_hwio(w, spec):
  return np.transpose(w, [spec.index(c) for c in "HWIO"])


def _np_conv_windows(x, w, layout, strides, padding, rhs_dilation, groups):
  """float64 NHWC input (padded), HWIO kernel, and per (tap, group) the slices a
  convolution reads: (input window, input channels, output channels, i, j)."""
  lspec, rspec, ospec = layout
  x = _to_nhwc(np.asarray(x, np.float64), lspec)
  w = _to_hwio(np.asarray(w, np.float64), rspec)
  n, h, wd, c = x.shape
  kh, kw, cg, o = w.shape
  dh, dw = rhs_dilation
  ekh, ekw = (kh - 1) * dh + 1, (kw - 1) * dw + 1
  if isinstance(padding, str):
    pads = jax.lax.padtype_to_pads((h, wd), (ekh, ekw), strides, padding)
  else:
    pads = padding
  xp = np.pad(x, ((0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)))
  sh, sw = strides
  oh = (xp.shape[1] - ekh) // sh + 1
  ow = (xp.shape[2] - ekw) // sw + 1
  og = o // groups
  taps = [((slice(None), slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
            slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)),
           slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og), i, j)
          for i in range(kh) for j in range(kw) for g in range(groups)]
  return xp, w, pads, taps, (n, oh, ow, o)


def np_conv(x, w, layout, strides, padding, rhs_dilation, groups):
  xp, w, _, taps, out_shape = _np_conv_windows(x, w, layout, strides, padding, rhs_dilation, groups)
  out = np.zeros(out_shape)
  for win, ci, co, i, j in taps:
    out[..., co] += np.einsum("nhwc,co->nhwo", xp[win][..., ci], w[i, j, :, co])
  return np.transpose(out, ["NHWC".index(ch) for ch in layout[2]])


def np_conv_vjp(ct, x, w, layout, strides, padding, rhs_dilation, groups):
  """float64 (d input, d kernel) of sum(ct * np_conv(x, w, ...))."""
  lspec, rspec, ospec = layout
  xp, wk, pads, taps, _ = _np_conv_windows(x, w, layout, strides, padding, rhs_dilation, groups)
  ct = np.transpose(np.asarray(ct, np.float64), [ospec.index(ch) for ch in "NHWC"])
  dxp, dw = np.zeros_like(xp), np.zeros_like(wk)
  for win, ci, co, i, j in taps:
    dxp[win + (ci,)] += np.einsum("nhwo,co->nhwc", ct[..., co], wk[i, j, :, co])
    dw[i, j, :, co] += np.einsum("nhwc,nhwo->co", xp[win][..., ci], ct[..., co])
  (t, _), (l, _) = pads
  dx = dxp[:, t:t + xp.shape[1] - sum(pads[0]), l:l + xp.shape[2] - sum(pads[1]), :]
  return (np.transpose(dx, ["NHWC".index(ch) for ch in lspec]),
          np.transpose(dw, ["HWIO".index(ch) for ch in rspec]))


# ----------------------------------------------------------------------------
# Reference quantization: input per batch element, kernel per output feature.


def _specs(lq, rq, layout):
  lspec, rspec, _ = layout
  ls = None if lq is None else qarray.QuantizeSpec(
      qtype=lq.qtype, channelwise_axes=(lspec.index("N"),) if lq.channelwise else (),
      calibration=lq.calibration)
  rs = None if rq is None else qarray.QuantizeSpec(
      qtype=rq.qtype, channelwise_axes=(rspec.index("O"),) if rq.channelwise else (),
      calibration=rq.calibration)
  return ls, rs


@functools.partial(jax.jit, static_argnames=("spec",))
def _quant_jit(x, spec):
  q = qarray.quantize(x, spec)
  return qarray.dequantize(q), q


def _quant(x, spec):
  if spec is None:
    return np.asarray(x), None
  xh, q = _quant_jit(jnp.asarray(x), spec)
  return np.asarray(xh), q


def _budget(x, q):
  x = np.asarray(x, np.float64)
  if q is None:
    return np.zeros_like(x)
  s = np.broadcast_to(np.asarray(q.scale, np.float64), x.shape)  # per-N / per-O / per-tensor
  if q.qtype.is_float:
    fi = jnp.finfo(q.qtype.compute_dtype)
    normal = np.abs(x / s) >= 2.0 ** fi.minexp
    return np.where(normal, 2.0 ** -(fi.nmant + 1) * np.abs(x),
                    2.0 ** (fi.minexp - fi.nmant - 1) * s) + 2.0 ** -21 * np.abs(x)
  return s / 2 + 2.0 ** -21 * np.abs(x)


NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")

# name -> (layout, x shape, w shape, strides, padding, rhs_dilation, groups, lq, rq)
CASES = {
    "nhwc_same_int8": (NHWC, (2, 7, 6, 4), (3, 3, 4, 8), (1, 1), "SAME", (1, 1), 1,
                       OQ(qtype="int8"), OQ(qtype="int8")),
    "nchw_stride2_explicit_int8": (NCHW, (2, 4, 9, 8), (6, 4, 3, 2), (2, 2), ((1, 0), (2, 1)), (1, 1), 1,
                                   OQ(qtype="int8"), OQ(qtype="int8")),
    "nhwc_dilated_valid_fp8": (NHWC, (2, 8, 8, 3), (2, 3, 3, 5), (1, 1), "VALID", (2, 1), 1,
                               OQ(qtype="float8_e4m3fn"), OQ(qtype="float8_e4m3fn")),
    "nhwc_groups2_binary": (NHWC, (2, 6, 6, 8), (3, 3, 4, 6), (1, 1), "SAME", (1, 1), 2,
                            OQ(qtype="binary", calibration="absmean"),
                            OQ(qtype="binary", calibration="absmean")),
    "nchw_groups2_int4w_a8": (NCHW, (3, 4, 7, 7), (4, 2, 3, 3), (1, 2), "SAME", (1, 2), 2,
                              OQ(qtype="int8"), OQ(qtype="int4")),
    "nhwc_ternary_w_a8_per_tensor": (NHWC, (2, 5, 5, 4), (3, 3, 4, 4), (2, 1), ((1, 1), (0, 2)), (1, 1), 1,
                                     OQ(qtype="int8", channelwise=False), OQ(qtype="ternary")),
    "nhwc_w8_a16": (NHWC, (2, 5, 5, 4), (3, 3, 4, 4), (1, 1), "SAME", (1, 1), 1, None, OQ(qtype="int8")),
}


def _cfg(lq, rq, dl=None, dr=None):
  return C.ConvGeneralQtConfig(lhs=lq, rhs=rq, dlhs_grad=dl, drhs_grad=dr, implementation="xla")


def _conv_args(case):
  layout, xs, ws, strides, padding, dil, groups, lq, rq = CASES[case]
  return layout, strides, padding, dil, groups


@functools.partial(jax.jit, static_argnames=("case", "cfg"))
def _op(x, w, case, cfg, key=None):
  layout, strides, padding, dil, groups = _conv_args(case)
  return conv_general_qt(x, w, strides, padding, None, dil, layout, groups, config=cfg, key=key)


@functools.partial(jax.jit, static_argnames=("case", "cfg"))
def _op_grads(x, w, ct, case, cfg):
  return jax.grad(lambda x, w: jnp.sum(_op(x, w, case, cfg) * ct), (0, 1))(x, w)


def _lax_conv(x, w, case):
  layout, strides, padding, dil, groups = _conv_args(case)
  return jax.lax.conv_general_dilated(x, w, strides, padding, None, dil, layout, groups,
                                      precision=HIGHEST)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_forward_vs_float64(case):
  layout, xs, ws, strides, padding, dil, groups, lq, rq = CASES[case]
  x, w = _rand(xs, 1), _rand(ws, 2, 0.3)
  out = np.asarray(_op(jnp.asarray(x), jnp.asarray(w), case, _cfg(lq, rq)), np.float64)
  lspec, rspec = _specs(lq, rq, layout)
  xh, xq = _quant(x, lspec)
  wh, wq = _quant(w, rspec)
  conv = lambda a, b: np_conv(a, b, layout, strides, padding, dil, groups)
  ref_hat = conv(xh, wh)
  abs_hat = conv(np.abs(xh), np.abs(wh))
  assert out.shape == ref_hat.shape
  assert np.all(np.abs(out - ref_hat) <= ACC_RTOL * abs_hat), np.max(np.abs(out - ref_hat) / abs_hat)
  kinds = {o.qtype.kind for o in (lq, rq) if o is not None}
  if kinds <= {"int", "float"}:
    bound = conv(_budget(x, xq), np.abs(wh)) + conv(np.abs(x), _budget(w, wq)) + ACC_RTOL * abs_hat
    err = np.abs(out - conv(x, w))
    assert np.all(err <= bound) and err.max() > 0, np.max(err / bound)
  # The reference conv itself agrees with lax on the dequantized operands.
  np.testing.assert_allclose(np.asarray(jax.jit(_lax_conv, static_argnums=2)(xh, wh, case)), ref_hat,
                             rtol=1e-4, atol=1e-4 * abs_hat.max())


def _fq_ste(x, spec):
  if spec is None:
    return x
  return x + jax.lax.stop_gradient(qarray.fake_quantize(x, spec) - x)


@functools.partial(jax.jit, static_argnames=("case",))
def _ref_grads(x, w, ct, case):
  layout, *_, lq, rq = CASES[case]
  lspec, rspec = _specs(lq, rq, layout)
  loss = lambda x, w: jnp.sum(_lax_conv(_fq_ste(x, lspec), _fq_ste(w, rspec), case) * ct)
  grads = jax.grad(loss, (0, 1))(x, w)
  # Absolute terms |ct| * |w_hat| and |x_hat| * |ct| (for the error budget).
  xh = jnp.abs(_fq_ste(x, lspec))
  wh = jnp.abs(_fq_ste(w, rspec))
  ax = jax.grad(lambda a: jnp.sum(_lax_conv(a, wh, case) * jnp.abs(ct)))(x)
  aw = jax.grad(lambda b: jnp.sum(_lax_conv(xh, b, case) * jnp.abs(ct)))(w)
  return grads, (ax, aw)


GRAD_CASES = ["nhwc_same_int8", "nchw_stride2_explicit_int8", "nhwc_groups2_binary",
              "nhwc_dilated_valid_fp8", "nchw_groups2_int4w_a8", "nhwc_w8_a16"]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES)
def test_float_backward_matches_fake_quant_ste_reference(case):
  layout, xs, ws, *_, lq, rq = CASES[case]
  x, w = jnp.asarray(_rand(xs, 3)), jnp.asarray(_rand(ws, 4, 0.3))
  ct = jnp.asarray(_rand(_op(x, w, case, _cfg(lq, rq)).shape, 5))
  gx, gw = _op_grads(x, w, ct, case, _cfg(lq, rq))
  (rx, rw), (ax, aw) = _ref_grads(x, w, ct, case)
  assert gx.shape == x.shape and gw.shape == w.shape
  for g, r, a in ((gx, rx, ax), (gw, rw, aw)):
    err = np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))
    assert np.all(err <= ACC_RTOL * np.asarray(a, np.float64) + 1e-30), np.max(err / np.asarray(a))


@pytest.mark.parametrize("case", ["nhwc_same_int8", "nchw_groups2_int4w_a8"])
@pytest.mark.thin(2)
def test_int8_backward_within_budget(case):
  layout, xs, ws, *_, lq, rq = CASES[case]
  x, w = jnp.asarray(_rand(xs, 6)), jnp.asarray(_rand(ws, 7, 0.3))
  ct = jnp.asarray(_rand(_op(x, w, case, _cfg(lq, rq)).shape, 8))
  cfg = _cfg(lq, rq, C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  gx, gw = _op_grads(x, w, ct, case, cfg)
  (rx, rw), _ = _ref_grads(x, w, ct, case)
  for g, r in ((gx, rx), (gw, rw)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert 0 < rel <= 2.0 ** -6, rel


@pytest.mark.slow
def test_stochastic_rounding_needs_key_and_is_keyed():
  case = "nhwc_same_int8"
  layout, xs, ws, *_, lq, rq = CASES[case]
  gq = C.GradQuant(qtype="int8", stochastic_rounding="uniform")
  cfg = _cfg(lq, rq, gq, gq)
  x, w = jnp.asarray(_rand(xs, 9)), jnp.asarray(_rand(ws, 10, 0.3))
  with pytest.raises(ValueError, match="key"):
    conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=layout, config=cfg)
  grad = jax.jit(jax.grad(lambda x, w, k: jnp.sum(_op(x, w, case, cfg, k) ** 2), (0, 1)))
  a, b, c = grad(x, w, jax.random.key(0)), grad(x, w, jax.random.key(0)), grad(x, w, jax.random.key(1))
  for u, v, t in zip(a, b, c):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert np.any(np.asarray(u) != np.asarray(t))


@pytest.mark.slow
def test_clipped_ste_masks_conv_gradient():
  case = "nhwc_same_int8"
  layout, xs, ws, *_ = CASES[case]
  lq = OQ(qtype="int8", calibration=qarray.Calibration(method="fixed", bound=1.0), estimator="clipped_ste")
  rq = OQ(qtype="int8", estimator="clipped_ste_unit")
  x, w = jnp.asarray(_rand(xs, 11, 1.5)), jnp.asarray(_rand(ws, 12, 0.9))
  ct = jnp.asarray(_rand(_op(x, w, case, _cfg(lq, rq)).shape, 13))
  gx, gw = _op_grads(x, w, ct, case, _cfg(lq, rq))
  gx_ste, gw_ste = _op_grads(x, w, ct, case, _cfg(dataclasses.replace(lq, estimator="ste"),
                                                   dataclasses.replace(rq, estimator="ste")))
  mx, mw = np.abs(np.asarray(x)) <= 1.0, np.abs(np.asarray(w)) <= 1.0  # fixed bound 1: |x/s| <= 127
  assert (~mx).any() and (~mw).any()
  np.testing.assert_array_equal(np.asarray(gx), np.where(mx, np.asarray(gx_ste), 0))
  np.testing.assert_array_equal(np.asarray(gw), np.where(mw, np.asarray(gw_ste), 0))


def test_residuals_are_quantized():
  case = "nhwc_same_int8"
  layout, xs, ws, *_, lq, rq = CASES[case]
  x, w = jnp.asarray(_rand(xs, 14)), jnp.asarray(_rand(ws, 15))
  _, vjp = jax.vjp(lambda x, w: _op(x, w, case, _cfg(lq, rq)), x, w)
  leaves = [(l.shape, l.dtype) for l in jax.tree_util.tree_leaves(vjp) if hasattr(l, "shape")]
  assert (xs, jnp.dtype(jnp.int8)) in leaves and (ws, jnp.dtype(jnp.int8)) in leaves, leaves
  assert not any(shape in (xs, ws) and jnp.issubdtype(d, jnp.floating) for shape, d in leaves), leaves


@pytest.mark.slow
@pytest.mark.parametrize("qtype,cal", [("int8", "absmax"), ("binary", "absmean")])
def test_1x1_conv_equals_dense_dot_general_qt(qtype, cal):
  n, h, wd, c, o = 3, 4, 5, 16, 8
  x = jnp.asarray(_rand((n, h, wd, c), 16))
  w = jnp.asarray(_rand((1, 1, c, o), 17, 0.3))
  # Per-tensor input scales (a conv's input scale is per batch element, a
  # dense lhs's per row: per tensor is the same for both), per-output kernel.
  lq = OQ(qtype=qtype, calibration=cal, channelwise=False)
  rq = OQ(qtype=qtype, calibration=cal)
  conv = jax.jit(lambda x, w: conv_general_qt(x, w, (1, 1), "VALID", dimension_numbers=NHWC,
                                              config=_cfg(lq, rq)))
  dn = (((1,), (0,)), ((), ()))
  dcfg = C.DotGeneralQtConfig(lhs=lq, rhs=rq, implementation="xla")
  dense = jax.jit(lambda x, w: dot_general_qt(x.reshape(-1, c), w.reshape(c, o), dn, dcfg).reshape(n, h, wd, o))
  np.testing.assert_allclose(np.asarray(conv(x, w)), np.asarray(dense(x, w)), rtol=1e-6, atol=1e-6)
  ct = jnp.asarray(_rand((n, h, wd, o), 18))
  gc = jax.jit(jax.grad(lambda x, w: jnp.sum(conv(x, w) * ct), (0, 1)))(x, w)
  gd = jax.jit(jax.grad(lambda x, w: jnp.sum(dense(x, w) * ct), (0, 1)))(x, w)
  for a, b in zip(gc, gd):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_bad_conv_configs_raise():
  with pytest.raises(ValueError, match="tile_size"):
    C.ConvGeneralQtConfig(rhs=OQ(qtype="int4", tile_size=32))
  x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
  with pytest.raises(ValueError, match="ConvGeneralQtConfig"):
    conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC,
                    config=C.DotGeneralQtConfig(lhs=OQ(qtype="int8")))
  with pytest.raises(ValueError, match="lhs_scale"):
    conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC,
                    config=_cfg(None, OQ(qtype="int8")), lhs_scale=jnp.ones(()))


@pytest.mark.slow
@pytest.mark.parametrize("qtypes", [("int8", "int8"), ("int8", "binary"), (None, "int4")])
def test_forced_kernel_runs_the_conv_as_a_matrix_product(qtypes):
  """implementation is honoured for convolutions: a forced kernel (the Triton
  interpreter here) runs the patches x kernel product, with the numbers of XLA's."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 9, 16)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 16, 128)), jnp.float32)
  lq, rq = (None if q is None else OQ(qtype=q) for q in qtypes)
  ct = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, 9, 128)), jnp.float32)
  gq = C.GradQuant(qtype="int8")

  def run(impl):
    cfg = C.ConvGeneralQtConfig(lhs=lq, rhs=rq, dlhs_grad=gq, drhs_grad=gq, implementation=impl)
    f = lambda x, w: conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC, config=cfg)
    if lq is None:  # a forced kernel runs every product: d kernel = g . x has no quantized rhs
      return (f(x, w),)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(ct))

  for got, want in zip(jax.jit(lambda: run("interpret"))(), jax.jit(lambda: run("xla"))()):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2.0 ** -20,
                               atol=2.0 ** -20 * float(np.max(np.abs(np.asarray(want)))))
  with pytest.raises(ValueError, match="triton.*GPU"):
    run("triton")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "mosaic", "interpret"])
def test_forced_kernel_on_a_batch_grouped_conv_raises(impl):
  """batch_group_count > 1 stays XLA's convolution: a forced kernel says so."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5, 5, 2)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 2, 4)), jnp.float32)
  cfg = C.ConvGeneralQtConfig(lhs=OQ(qtype="int8"), rhs=OQ(qtype="int8"), implementation=impl)
  f = lambda c: conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC, batch_group_count=2,
                                config=c)
  with pytest.raises(ValueError, match=rf"implementation='{impl}': a convolution with "
                                       r"batch_group_count=2 runs as XLA's convolution"):
    f(cfg)
  outs = [f(dataclasses.replace(cfg, implementation=i)) for i in ("xla", "auto")]
  np.testing.assert_array_equal(outs[0], outs[1])
  assert np.all(np.isfinite(np.asarray(outs[0])))


@pytest.mark.slow
def test_preferred_element_type_and_grad_dtypes():
  case = "nhwc_same_int8"
  layout, xs, ws, *_, lq, rq = CASES[case]
  x = jnp.asarray(_rand(xs, 19)).astype(jnp.bfloat16)
  w = jnp.asarray(_rand(ws, 20))
  f = lambda x, w, t=None: conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=layout,
                                           preferred_element_type=t, config=_cfg(lq, rq))
  assert f(x, w.astype(jnp.bfloat16)).dtype == jnp.bfloat16
  assert f(x, w, jnp.float32).dtype == jnp.float32
  gx, gw = jax.grad(lambda x, w: jnp.sum(f(x, w, jnp.float32)), (0, 1))(x, w)
  assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32


# Passed-in scales may vary along any axis (as_scale accepts any shape that
# divides the operand); N == C == 4 here so a per-input-channel scale would
# also broadcast (silently) against a per-batch output layout.
SCALE_CASES = {
    "lhs_per_C": (dict(lhs_scale=np.linspace(0.01, 0.03, 4).reshape(1, 1, 1, 4)), None),
    "lhs_per_N": (dict(lhs_scale=np.linspace(0.01, 0.03, 4).reshape(4, 1, 1, 1)), None),
    "lhs_per_H": (dict(lhs_scale=np.linspace(0.01, 0.03, 5).reshape(1, 5, 1, 1)), None),
    "lhs_scalar": (dict(lhs_scale=np.float32(0.02)), None),
    "rhs_per_I": (None, dict(rhs_scale=np.linspace(0.002, 0.006, 4).reshape(1, 1, 4, 1))),
    "rhs_per_O": (None, dict(rhs_scale=np.linspace(0.002, 0.006, 4).reshape(1, 1, 1, 4))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCALE_CASES))
def test_passed_in_scales_of_any_shape(name):
  lkw, rkw = SCALE_CASES[name]
  x, w = _rand((4, 5, 5, 4), 21), _rand((3, 3, 4, 4), 22, 0.3)
  cfg = _cfg(OQ(qtype="int8"), OQ(qtype="int8"))
  kw = {k: jnp.asarray(v, jnp.float32) for d in (lkw, rkw) if d for k, v in d.items()}
  out = np.asarray(conv_general_qt(jnp.asarray(x), jnp.asarray(w), (1, 1), "SAME",
                                   dimension_numbers=NHWC, config=cfg, **kw), np.float64)
  lspec, rspec = _specs(OQ(qtype="int8"), OQ(qtype="int8"), NHWC)

  def q_given(v, s):
    s = np.asarray(s, np.float32)
    s = s.reshape((1,) * (4 - s.ndim) + s.shape)
    return np.asarray(qarray.quantize_with_scale(jnp.asarray(v), "int8", jnp.asarray(s)).dequantize())

  xh = q_given(x, kw["lhs_scale"]) if lkw else _quant(x, lspec)[0]
  wh = q_given(w, kw["rhs_scale"]) if rkw else _quant(w, rspec)[0]
  conv = lambda a, b: np_conv(a, b, NHWC, (1, 1), "SAME", (1, 1), 1)
  ref, absref = conv(xh, wh), conv(np.abs(xh), np.abs(wh))
  assert np.all(np.abs(out - ref) <= ACC_RTOL * absref), np.max(np.abs(out - ref) / absref)


@pytest.mark.slow
def test_learned_input_scale_gets_lsq_gradient():
  case = "nhwc_same_int8"
  layout, xs, ws, *_ = CASES[case]
  lq, rq = OQ(qtype="int8", scale_grad="lsq"), OQ(qtype="int8")
  x, w = jnp.asarray(_rand(xs, 23)), jnp.asarray(_rand(ws, 24, 0.3))
  s = jnp.float32(1.5 / 127)  # |x| > 1.5 clips
  ct = jnp.asarray(_rand((2, 7, 6, 8), 25))
  f = lambda x, s: jnp.sum(conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=layout,
                                           config=_cfg(lq, rq), lhs_scale=s) * ct)
  gx, gs = jax.grad(f, (0, 1))(x, s)
  _, rspec = _specs(lq, rq, layout)
  wh = jnp.asarray(_quant(w, rspec)[0])
  # d loss / d x_hat (float64 via the numpy conv's transpose = jax vjp in f32 HIGHEST).
  g_x = np.asarray(jax.grad(lambda a: jnp.sum(_lax_conv(a, wh, case) * ct))(x), np.float64)
  y = np.asarray(x, np.float64) / float(s)
  assert (np.abs(y) > 127).any()
  d = np.where(y > 127, 127.0, np.where(y < -128, -128.0, np.clip(np.round(y), -128, 127) - y))
  per = g_x * d / np.sqrt(x.size * 127.0)
  np.testing.assert_allclose(float(gs), per.sum(), rtol=1e-4, atol=1e-5 * np.abs(per).sum())
  np.testing.assert_allclose(np.asarray(gx), g_x, rtol=1e-4, atol=1e-5 * np.abs(g_x).max())


@pytest.mark.parametrize("qtype,lo,hi", [("int8", -127, 127), ("binary", -1, 1)])
def test_non_cpu_conv_path_is_exact_for_integer_values(qtype, lo, hi):
  """The float32-HIGHEST path used where XLA cannot lower integer convs (GPU)
  gives exactly the int32 result for windows within its documented bound."""
  mod = importlib.import_module("qtrain.ops.conv_general_qt")  # the module, for its private helper
  rng = np.random.default_rng(7)
  vals = (lambda s: rng.choice([-1, 1], size=s)) if qtype == "binary" else (
      lambda s: rng.integers(lo, hi + 1, size=s))
  a = jnp.asarray(vals((2, 9, 9, 64)), jnp.int8)   # window 3*3*64 = 576 <= 1040
  b = jnp.asarray(vals((3, 3, 64, 8)), jnp.int8)
  p = dict(window_strides=(1, 1), padding="SAME", lhs_dilation=(1, 1), rhs_dilation=(1, 1),
           dn=jax.lax.conv_dimension_numbers(a.shape, b.shape, ("NHWC", "HWIO", "NHWC")),
           feature_group_count=1, batch_group_count=1, precision=None)
  on_cpu = mod._low_precision_conv(a, b, p, is_float=False, backend="cpu")
  elsewhere = mod._low_precision_conv(a, b, p, is_float=False, backend="gpu")
  np.testing.assert_array_equal(np.asarray(on_cpu), np.asarray(elsewhere))
  assert float(jnp.max(jnp.abs(on_cpu))) > 0


# ----------------------------------------------------------------------------
# Dtype policy (qtrain.ops.qt_operand): float dtype pairs x quantized sides,
# forward and gradients vs float64.
#
# Reference: float64 convolutions of the dequantized operands (q * s, exact
# in float64) and of the float operands. Budget per output element, as in
# tests/ops/test_dot_general_qt.py: with a float side the convolution runs in
# c = promote_types(lhs.dtype, rhs.dtype), a quantized side dequantized into c
# rounds each value by <= u_c |v| + eta_c (a float side cast up to c, int8 ->
# int32 and fp8 x fp8 products round nothing; integer x fp8 dequantizes both
# sides into float32); float32 accumulation of the K window terms, product
# roundings and the epilogue's two scalings add (K + 3) 2^-24 (|x|*|w|); the
# cast to the output dtype o adds u_o (|ref| + E) + eta_o. Gradients: a product
# in promote_types(cotangent dtype, the other operand's dtype) (dot_general_qt's
# backward on the patches), the other side's quantized residual rounded into it,
# float32 accumulation, the cotangent exact (multiples of 1/4 in [-1, 1]),
# K' = an upper bound on the terms per gradient element, the operand's dtype as o.

_DT = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _rounding(dtype):
  """(u, eta): rounding into ``dtype`` errs by <= u |v| + eta."""
  fi = jnp.finfo(dtype)
  return 2.0 ** -(fi.nmant + 1), 2.0 ** (fi.minexp - fi.nmant - 1)


def _deq64(q):
  """A QArray's dequantized values, exactly, in float64."""
  v = np.asarray(q.qvalue.astype(jnp.float32), np.float64)
  return v * np.asarray(qarray.expand_scale(q.scale, q.shape), np.float64)


def _bound(a_abs, n_terms, ref, out_dtype, rounded=()):
  e = (n_terms + 3) * 2.0 ** -24 * a_abs
  for dtype, uw, ew in rounded:
    u, eta = _rounding(dtype)
    e = e + u * uw + eta * ew
  uo, eo = _rounding(out_dtype)
  return e + uo * (np.abs(ref) + e) + eo


@functools.partial(jax.jit, static_argnames=("geom", "cfg"))
def _conv_fwd_vjp(x, w, ct, geom, cfg):
  """(out, d input, d kernel, input QArray, kernel QArray) in one program."""
  layout, strides, padding, dil, groups = geom
  f = lambda x, w: conv_general_qt(x, w, strides, padding, None, dil, layout, groups, config=cfg)
  out, vjp = jax.vjp(f, x, w)
  lspec, rspec = _specs(cfg.lhs, cfg.rhs, layout)
  q = lambda v, spec: spec and qarray.quantize(v, spec)
  return (out, *vjp(ct.astype(out.dtype)), q(x, lspec), q(w, rspec))


def check_conv_against_float64(x, w, geom, lq, rq, *, seed=0, ct_scale=1.0):
  layout, strides, padding, dil, groups = geom
  ld, rd = x.dtype, w.dtype
  o = jnp.result_type(ld, rd)
  c = jnp.promote_types(ld, rd)
  conv = lambda a, b: np_conv(a, b, layout, strides, padding, dil, groups)
  out_shape = conv(np.zeros(x.shape), np.zeros(w.shape)).shape
  ct = np.random.default_rng(seed).integers(-4, 5, out_shape) * 0.25 * ct_scale
  cfg = _cfg(lq, rq)
  out, gx, gw, xq, wq = _conv_fwd_vjp(x, w, jnp.asarray(ct, o), geom, cfg)
  assert (out.dtype, gx.dtype, gw.dtype) == (o, ld, rd)
  assert out.shape == out_shape and gx.shape == x.shape and gw.shape == w.shape
  xh = _deq64(xq) if lq else np.asarray(x, np.float64)
  wh = _deq64(wq) if rq else np.asarray(w, np.float64)
  ax, aw = np.abs(xh), np.abs(wh)
  kh, kw, cin, cout = _to_hwio(np.zeros(w.shape), layout[1]).shape
  # Forward.
  ref, a_abs = conv(xh, wh), conv(ax, aw)
  if lq and rq:
    r = [] if lq.qtype.is_float == rq.qtype.is_float else [(jnp.float32, 2 * a_abs, 0 * a_abs)]
  elif lq:
    r = [(c, a_abs, conv(np.ones_like(ax), aw))]
  else:
    r = [(c, a_abs, conv(ax, np.ones_like(aw)))]
  err, bound = np.abs(np.asarray(out, np.float64) - ref), _bound(a_abs, kh * kw * cin, ref, o, r)
  assert np.all(np.isfinite(np.asarray(out, np.float64)))
  assert np.all(err <= bound), np.max(err / bound)
  # Gradients: residuals rounded as the forward rounded them.
  vjp = lambda a, b, t=ct: np_conv_vjp(t, a, b, layout, strides, padding, dil, groups)
  rx, rw = vjp(xh, wh)
  gax, gaw = vjp(ax, aw, np.abs(ct))
  # A float backward product multiplies the cotangent (dtype o) with the other operand's
  # quantized residual dequantized into promote_types(o, its dtype), as dot_general_qt's.
  rx_ = [(jnp.promote_types(o, rd), gax, vjp(ax, np.ones_like(aw), np.abs(ct))[0])] if rq else []
  rw_ = [(jnp.promote_types(o, ld), gaw, vjp(np.ones_like(ax), aw, np.abs(ct))[1])] if lq else []
  n_out = int(np.prod(out_shape)) // cout
  for g, rf, a, n, rr, dt in ((gx, rx, gax, kh * kw * cout // groups, rx_, ld),
                              (gw, rw, gaw, n_out, rw_, rd)):
    err, bound = np.abs(np.asarray(g, np.float64) - rf), _bound(a, n, rf, dt, rr)
    assert np.all(err <= bound), np.max(err / bound)
  return out


def _geom(case):
  layout, xs, ws, strides, padding, dil, groups, *_ = CASES[case]
  return (layout, strides, padding, dil, groups), xs, ws


_QS = ("int8", "int4", "binary", "float8_e4m3fn", "float8_e5m2")
CONV_POLICY_CASES = (
    # weight-only int8 under every float dtype pair (a bf16 nn.Conv included).
    [(p, None, "int8") for p in ((a, b) for a in _DT for b in _DT)] +
    [(p, "int8", None) for p in (("bf16", "bf16"), ("f16", "f16"), ("f32", "f16"), ("bf16", "f32"))] +
    [(p, None, q) for q in _QS[1:] for p in (("bf16", "bf16"), ("f16", "f32"))] +
    [(p, lq, rq) for lq, rq in (("int8", "int8"), ("float8_e4m3fn", "float8_e4m3fn"),
                                ("float8_e5m2", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
                                ("int8", "float8_e4m3fn"))
     for p in (("bf16", "bf16"), ("f16", "f32"))])


@pytest.mark.parametrize("dtypes,lq,rq", CONV_POLICY_CASES)
@pytest.mark.thin(4)
def test_conv_dtype_policy_vs_float64(dtypes, lq, rq):
  geom, xs, ws = _geom("nhwc_same_int8")
  seed = zlib.crc32(f"{dtypes}/{lq}/{rq}".encode()) % 1000
  x = jnp.asarray(_rand(xs, seed), _DT[dtypes[0]])
  w = jnp.asarray(_rand(ws, seed + 1, 0.3), _DT[dtypes[1]])
  check_conv_against_float64(x, w, geom, lq and OQ(qtype=lq), rq and OQ(qtype=rq), seed=seed)


@pytest.mark.parametrize("case", ["nchw_stride2_explicit_int8", "nhwc_dilated_valid_fp8",
                                  "nchw_groups2_int4w_a8"])
def test_conv_bf16_weight_only_int8_any_geometry(case):
  """A linen nn.Conv(dtype=bf16, param_dtype=bf16) with weight-only int8: strides,
  explicit padding, dilation, feature groups, NCHW."""
  geom, xs, ws = _geom(case)
  x = jnp.asarray(_rand(xs, 51), jnp.bfloat16)
  w = jnp.asarray(_rand(ws, 52, 0.3), jnp.bfloat16)
  check_conv_against_float64(x, w, geom, None, OQ(qtype="int8"))


@pytest.mark.parametrize("side", ["lhs", "rhs"])
@pytest.mark.parametrize("magnitude", [1e5, 1e-9])
def test_conv_float32_quantized_times_float16_extreme_but_finite(side, magnitude):
  """A float32 operand of magnitude 1e5 or 1e-9, quantized, convolved with a
  float16 one (up to 6e4 against 1e5): finite, nonzero, within the float32 budget."""
  geom, xs, ws = _geom("nhwc_same_int8")
  rng = np.random.default_rng(8)
  big = lambda shape, m: (rng.uniform(0.5, 1.0, shape) * rng.choice([-1, 1], shape) * m)
  other = 6e4 if magnitude > 1 else 1.0
  if side == "lhs":
    x, w = jnp.asarray(big(xs, magnitude), jnp.float32), jnp.asarray(big(ws, other), jnp.float16)
  else:
    x, w = jnp.asarray(big(xs, other), jnp.float16), jnp.asarray(big(ws, magnitude), jnp.float32)
  oq = OQ(qtype="int8")
  # Gradients into the float16 operand stay finite: cotangents scaled down for 1e5.
  out = check_conv_against_float64(x, w, geom, oq if side == "lhs" else None,
                                   oq if side == "rhs" else None,
                                   ct_scale=2.0 ** -10 if magnitude > 1 else 1.0)
  assert np.count_nonzero(np.asarray(out)) > 0.9 * out.size


def test_conv_rejects_non_float_operands_and_output_as_dot_general_qt_does():
  x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
  cfg = _cfg(None, OQ(qtype="int8"))
  conv = lambda x, w, **kw: conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC,
                                            config=cfg, **kw)
  dense = lambda x, w, **kw: dot_general_qt(x, w, (((1,), (0,)), ((), ())),
                                            C.DotGeneralQtConfig(rhs=OQ(qtype="int8")), **kw)
  for op, a, b in ((conv, x, w), (dense, x[0, 0], w[0, 0])):
    msgs = []
    for args, kw in (((a.astype(jnp.int32), b), {}), ((a, b.astype(jnp.int8)), {}),
                     ((a, b), dict(preferred_element_type=jnp.int32))):
      with pytest.raises(ValueError) as e:
        op(*args, **kw)
      msgs.append(str(e.value))
    assert "lhs must be a float array, got dtype int32" in msgs[0]
    assert "rhs must be a float array, got dtype int8" in msgs[1]
    assert "preferred_element_type=int32 must be a float dtype" in msgs[2]


@pytest.mark.parametrize("xs,ws", [((0, 5, 5, 4), (3, 3, 4, 6)), ((2, 5, 5, 0), (3, 3, 0, 6)),
                                   ((2, 5, 5, 4), (3, 3, 4, 0))])
@pytest.mark.parametrize("qs", [("int8", "int8"), (None, "int8"), ("float8_e4m3fn", None)])
def test_conv_empty_operands_give_lax_results(xs, ws, qs):
  """An empty batch (and zero input / output features): zeros shaped like the lax
  op's output, zero / empty gradients of each operand's shape and dtype."""
  gq = C.GradQuant(qtype="int8", stochastic_rounding="uniform")
  cfg = C.ConvGeneralQtConfig(lhs=qs[0] and OQ(qtype=qs[0]), rhs=qs[1] and OQ(qtype=qs[1]),
                              dlhs_grad=gq, drhs_grad=gq)
  x, w = jnp.ones(xs, jnp.bfloat16), jnp.ones(ws, jnp.float32)
  # (lax's convolution takes one dtype: the float32 one gives the shape and values.)
  want = jax.lax.conv_general_dilated(x.astype(jnp.float32), w, (1, 1), "SAME", dimension_numbers=NHWC)

  @jax.jit
  def run(x, w, key):
    f = lambda x, w: conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=NHWC, config=cfg, key=key)
    out, vjp = jax.vjp(f, x, w)
    return (out, *vjp(jnp.ones(out.shape, out.dtype)))

  out, gx, gw = run(x, w, jax.random.key(0))
  assert (out.shape, out.dtype) == (want.shape, want.dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  assert (gx.shape, gx.dtype, gw.shape, gw.dtype) == (xs, x.dtype, ws, w.dtype)
  assert not np.any(np.asarray(gx, np.float32)) and not np.any(np.asarray(gw, np.float32))


def test_conv_bad_geometry_raises_naming_the_field():
  x, w = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
  cfg = _cfg(OQ(qtype="int8"), OQ(qtype="int8"))
  conv = lambda **kw: conv_general_qt(x, **{"rhs": w, "window_strides": (1, 1), "padding": "SAME",
                                            "dimension_numbers": NHWC, "config": cfg, **kw})
  with pytest.raises(ValueError, match=r"rhs_dilation=\(1,\) must hold 2 positive ints"):
    conv(rhs_dilation=(1,))
  with pytest.raises(ValueError, match=r"lhs_dilation=\(1, 0\) must hold 2 positive ints"):
    conv(lhs_dilation=(1, 0))
  # lax's own checks run before anything is quantized.
  with pytest.raises(ValueError, match="feature dimension"):
    conv(rhs=jnp.ones((3, 3, 2, 4)))
  with pytest.raises(TypeError, match="dimension_numbers"):
    conv(dimension_numbers=("NHWC", "HWIX", "NHWC"))


@pytest.mark.slow
@pytest.mark.parametrize("qtypes,strides,padding,dil", [
    (("int8", "int8"), (1, 1), "SAME", (1, 1)),
    (("int8", "binary"), (2, 1), ((1, 2), (0, 1)), (1, 2)),
    (("float8_e4m3fn", "float8_e4m3fn"), (1, 2), "VALID", (1, 1))])
def test_conv_is_dense_qt_on_its_patches(qtypes, strides, padding, dil):
  """The documented semantics: with a per-tensor input scale (the same scale a dense
  layer would compute over the patches: every input element lies in some window),
  a quantized convolution, forward and both gradients (quantized, stochastic
  rounding), is dot_general_qt applied to lax's own patches of the input."""
  x = jnp.asarray(_rand((2, 7, 8, 6), 21))
  w = jnp.asarray(_rand((3, 2, 6, 5), 22, 0.3))
  lq = OQ(qtype=qtypes[0], channelwise=False)
  rq = OQ(qtype=qtypes[1], calibration="absmean" if qtypes[1] == "binary" else "absmax")
  gq = C.GradQuant(qtype="int8", stochastic_rounding="uniform")
  key = jax.random.key(3)
  conv = lambda x, w: conv_general_qt(x, w, strides, padding, None, dil, NHWC,
                                      config=C.ConvGeneralQtConfig(lhs=lq, rhs=rq, dlhs_grad=gq,
                                                                   drhs_grad=gq,
                                                                   implementation="xla"), key=key)

  def dense(x, w):
    # lax's patches: (N, H', W', C * kh * kw), channel-major: the kernel as (C, kh, kw, O).
    p = jax.lax.conv_general_dilated_patches(x, w.shape[:2], strides, padding, rhs_dilation=dil,
                                             dimension_numbers=NHWC, precision=HIGHEST)
    wm = jnp.transpose(w, (2, 0, 1, 3)).reshape(-1, w.shape[-1])
    cfg = C.DotGeneralQtConfig(lhs=lq, rhs=rq, dlhs_grad=gq, drhs_grad=gq, implementation="xla")
    return dot_general_qt(p, wm, (((3,), (0,)), ((), ())), cfg, key=key)

  ct = jnp.asarray(_rand(jax.eval_shape(conv, x, w).shape, 23))
  (yc, gc), (yd, gd) = (jax.jit(lambda x, w, f=f: (f(x, w), jax.grad(
      lambda x, w: jnp.sum(f(x, w) * ct), (0, 1))(x, w)))(x, w) for f in (conv, dense))
  if rq.calibration.method == "absmax":
    np.testing.assert_array_equal(np.asarray(yc), np.asarray(yd))
  else:  # absmean sums |w| over the (kh, kw, C) kernel in another order than over its matrix
    np.testing.assert_allclose(np.asarray(yc), np.asarray(yd), rtol=2.0 ** -21)
  for a, b in zip(gc, gd):
    b = np.asarray(b)
    assert np.any(b != 0)
    # The input's gradient sums the same window terms in another order (float32).
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2.0 ** -20 * np.max(np.abs(b)))
