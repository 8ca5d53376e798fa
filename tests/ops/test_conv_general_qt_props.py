"""Property tests of qtrain.ops.conv_general_qt and its gradients against float64 (issue 16).

Cases: 1-D and 2-D convolutions in every layout of _strategies._SPECS (NWC,
NCW, WNC / NHWC, NCHW inputs and outputs; WIO, OIW, IOW / HWIO, OIHW
kernels), strides 1-2, VALID / SAME / explicit padding, lhs and rhs dilation,
feature or batch groups, an empty batch; each side None or any qtype x
calibration (channelwise on/off), float32/bfloat16/float16 on each side,
magnitudes from 1e-30 to 1e30 and the float32 edges, NaN/Inf planted.

Reference: the convolution in float64 (lax.conv_general_dilated under
jax.enable_x64) of the operands dequantized by the library's own quantize
with the spec the op documents (input: one scale per batch element when
channelwise and batch_group_count == 1, else per tensor; kernel: one per
output feature), a group holding NaN/Inf set to NaN.

Budget (as for tests/ops/test_dot_general_qt_props.py; P = conv64(|lhs|, |rhs|), n the number
of terms per output, at most rhs.size / out_features):
  * both quantized, both integer-like or both fp8, no zero point: the
    convolution of the codes is exact (int32; fp8 products exact in float32,
    float32 accumulation: gamma(n)), then acc * ls * rs: two float32 roundings;
  * one side float: the quantized side rounded into c = promote_types of the
    input dtypes (u_c), float32 accumulation gamma(n);
  * otherwise (int x fp8, minmax zero points): both dequantized in float32,
    gamma(n) after 2 u per product;
  * the result rounded once into the output dtype.
Gradients (float64 vjp of the same convolution): float backward: the
residuals rounded into promote_types(g, operand) (u_c each), float32
accumulation; int8 / fp8 backward (batch_group_count 1: dot_general_qt's
backward on the patches): g times the other side's scale (folded in; none for
a float side or a zero point) quantized per GradQuant with one scale per
output position (dlhs) or per output feature (drhs) adds vjp(E_g) against
the other side's codes, E_g its per-element rounding bound (half a step; a
step with stochastic rounding; fp8's relative bound); batch_group_count > 1:
g itself quantized per batch element (dlhs) / output feature (drhs).
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _props_ref as R
import _strategies as S
from qtrain.ops import config as C
from qtrain.core import qarray
from qtrain.ops.conv_general_qt import conv_general_qt

FAST = hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None,
                           suppress_health_check=list(hypothesis.HealthCheck))
DEEP = S.deep(FAST, 60)
EPILOGUE_ROUNDINGS = 2  # acc * ls * rs in float32
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ConvCase:
  layout: S.ConvLayout
  ldtype: str
  rdtype: str
  lv: S.Values
  rv: S.Values
  lq: C.OperandQuant | None
  rq: C.OperandQuant | None
  preferred: str | None
  gv: S.Values | None = None
  dlhs: C.GradQuant | None = None
  drhs: C.GradQuant | None = None


grad_quants = S.grad_quants()


@st.composite
def conv_cases(draw, *, big=False, nonfinite=True, grads=False, force_nonfinite=False, new=False):
  """ConvCase draws; ``new``: at least one side nf4 (the value-set qtype convolutions take,
  per channel; MX qtypes need blocks along a contraction and are refused), the other None or
  any qtype."""
  kw = dict(max_spatial=9, max_kernel=4, max_batch=4, max_features=4) if big else {}
  layout = draw(S.conv_layouts(**kw))
  dts = st.sampled_from(S.FLOAT_DTYPES)
  ldt, rdt = draw(dts), draw(dts)
  vals = S.values(nonfinite=nonfinite)
  lv = draw(S.values(nonfinite=True).filter(lambda v: v.nonfinite) if force_nonfinite else vals)
  rv = draw(vals)
  lq = draw(S.operand_quants(lv, ldt, tile_axis_size=None, tiles=False))
  rq = draw(S.operand_quants(rv, rdt, tile_axis_size=None, tiles=False))
  if new:
    nf4 = lambda v, dt: S.operand_quants(v, dt, tile_axis_size=None, tiles=False, allow_none=False,
                                         qtypes_=("nf4",))
    if draw(st.booleans()):
      lq = draw(nf4(lv, ldt))
    else:
      rq = draw(nf4(rv, rdt))
  pet = draw(st.sampled_from([None, None, "float32"]))
  case = ConvCase(layout=layout, ldtype=ldt, rdtype=rdt, lv=lv, rv=rv, lq=lq, rq=rq, preferred=pet)
  if grads:
    case = dataclasses.replace(case, gv=draw(S.values()), dlhs=draw(grad_quants),
                               drhs=draw(grad_quants))
  return case


def _specs(case: ConvCase):
  lspec_s, rspec_s, ospec_s = case.layout.dimension_numbers
  lhs_b = lspec_s.index("N")
  rhs_o = rspec_s.index("O")
  mk = lambda oq, axes: None if oq is None else qarray.QuantizeSpec(
      qtype=oq.qtype, calibration=oq.calibration, channelwise_axes=axes if oq.channelwise else ())
  lch = (lhs_b,) if case.layout.batch_group_count == 1 else ()
  return mk(case.lq, lch), mk(case.rq, (rhs_o,))


def _side(x, oq, q, spec, dtype):
  """(values the op multiplies: deq with NaN groups or x, s_full or None)."""
  x64 = R.f64(x)
  if oq is None:
    return x64, None
  cw, tiles = R.normalize_grid(x64.shape, spec.channelwise_axes, {})
  finite = R.expand(R.group_reduce(np.isfinite(x64), cw, tiles, np.all), x64.shape)
  s_full = R.expand(R.f64(q.scale), x64.shape)
  # The values of the codes (nf4's: its table's, in float32 as the op reads them).
  codes = R.f64(qarray.values_of(q)) - (0 if q.zero_point is None else R.expand(R.f64(q.zero_point), x64.shape))
  return np.where(finite, codes * s_full, np.nan), s_full


def _conv64(layout: S.ConvLayout):
  kw = layout.kwargs()

  @jax.jit
  def conv(a, b):
    return jax.lax.conv_general_dilated(a, b, precision=HIGHEST, **kw)

  def run(*pairs):
    with jax.enable_x64(True):
      return [np.asarray(conv(jnp.asarray(a, jnp.float64), jnp.asarray(b, jnp.float64)))
              for a, b in pairs]
  return run


def _out_dtype(case):
  return jnp.dtype(case.preferred) if case.preferred else jnp.result_type(
      jnp.dtype(case.ldtype), jnp.dtype(case.rdtype))


def _fin_abs(v):
  return np.where(np.isfinite(v), np.abs(v), 0.0)


def _path(case: ConvCase):
  """(rel_in, exact) of the forward product, None when both sides are float:
  rel_in the relative rounding of the inputs into the compute dtype, exact
  whether the codes are convolved exactly (integer-like or fp8 pairs)."""
  c = jnp.promote_types(jnp.dtype(case.ldtype), jnp.dtype(case.rdtype))
  if case.lq is None and case.rq is None:
    return None
  if (case.lq is None) != (case.rq is None):
    return R.unit_roundoff(c), False
  lt, rt = case.lq.qtype, case.rq.qtype
  zp = case.lq.calibration.is_asymmetric or case.rq.calibration.is_asymmetric
  if lt.is_float == rt.is_float and not zp and not (lt.is_lut or rt.is_lut):
    return 0.0, True
  # nf4 (its codes are not numbers: its patches / kernel matrix are dequantized into float32,
  # im2col) times a quantized side: both dequantized in float32, as int x fp8.
  return 2 * R.U32 + R.U32 ** 2, False


def _touches_nonfinite(case: ConvCase, x, w, out_shape) -> np.ndarray:
  """Outputs whose contraction structurally includes a non-finite group: every
  output of a batch element whose input holds NaN/Inf (quantized per batch
  element: that element; per tensor: all), every output of a feature whose
  kernel slice holds one (per tensor: all). Where the window meets those
  values only through padding or dilation holes, XLA's convolutions (float32
  vs float64) differ on whether 0 * NaN is formed, so NaN or the finite
  reference are both right there."""
  lspec_s, rspec_s, ospec_s = case.layout.dimension_numbers
  bad_l = ~np.isfinite(R.f64(x))
  bad_r = ~np.isfinite(R.f64(w))
  nb, no = out_shape[ospec_s.index("N")], out_shape[ospec_s.index("C")]
  b_axis = lspec_s.index("N")
  per_batch = (np.any(bad_l, axis=tuple(a for a in range(x.ndim) if a != b_axis))
               if case.lq is None or (case.lq.channelwise and case.layout.batch_group_count == 1)
               else np.full(x.shape[b_axis], bad_l.any()))
  o_axis = rspec_s.index("O")
  per_feat = (np.any(bad_r, axis=tuple(a for a in range(w.ndim) if a != o_axis))
              if case.rq is None or case.rq.channelwise else np.full(w.shape[o_axis], bad_r.any()))
  bg = case.layout.batch_group_count
  # With batch groups, output batch n reads input batches n + k * (N / bg).
  per_out_batch = per_batch.reshape(bg, -1).any(axis=0) if bg > 1 else per_batch
  shape = [1] * len(out_shape)
  sb, so = list(shape), list(shape)
  sb[ospec_s.index("N")], so[ospec_s.index("C")] = nb, no
  m = per_out_batch.reshape(sb) | per_feat.reshape(so)
  if bg > 1 or case.layout.feature_group_count > 1:
    # XLA lowers grouped convolutions with masks (0 * NaN): on the CPU, with
    # batch_group_count=2, a NaN in kernel feature 0 also turns feature 2 NaN
    # (lax.conv_general_dilated itself does this): any non-finite group may
    # reach every output.
    m = m | per_batch.any() | per_feat.any()
  return np.broadcast_to(m, out_shape)


def check_forward(case: ConvCase) -> None:
  lay = case.layout
  x = S.make(case.lv, lay.lhs_shape, case.ldtype)
  w = S.make(case.rv, lay.rhs_shape, case.rdtype)
  hypothesis.note(f"lhs = {x!r}\nrhs = {w!r}")
  lspec, rspec = _specs(case)
  cfg = C.ConvGeneralQtConfig(lhs=case.lq, rhs=case.rq)
  kw = lay.kwargs()
  pet = case.preferred

  @jax.jit
  def run(x, w):
    out = conv_general_qt(x, w, **kw, preferred_element_type=pet, config=cfg)
    return (out, None if lspec is None else qarray.quantize(x, lspec),
            None if rspec is None else qarray.quantize(w, rspec))

  path = _path(case)
  if path is None:
    # No quantization: the op is lax.conv_general_dilated, bit for bit (and
    # raises where lax raises, e.g. on two float dtypes).
    try:
      lax_out = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
          x, w, **kw, preferred_element_type=_out_dtype(case)))(jnp.asarray(x), jnp.asarray(w))
    except TypeError:
      with pytest.raises(TypeError):
        run(jnp.asarray(x), jnp.asarray(w))
      return
    out = run(jnp.asarray(x), jnp.asarray(w))[0]
    assert out.dtype == lax_out.dtype and out.shape == lax_out.shape
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(lax_out, np.float64))
    return
  out, ql, qr = run(jnp.asarray(x), jnp.asarray(w))
  out_dtype = _out_dtype(case)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(a, b, **kw),
                             x.astype(np.float32), w.astype(np.float32)).shape
  assert out.shape == out_shape and out.dtype == out_dtype, (out.shape, out.dtype, out_shape)
  rel_in, exact = path
  a, _ = _side(x, case.lq, ql, lspec, case.ldtype)
  b, _ = _side(w, case.rq, qr, rspec, case.rdtype)
  conv = _conv64(lay)
  ref, P, ones_l, ones_r = conv((a, b), (_fin_abs(a), _fin_abs(b)), (np.ones_like(a), _fin_abs(b)),
                                (_fin_abs(a), np.ones_like(b)))
  O = lay.rhs_shape[lay.dimension_numbers[1].index("O")]
  n = w.size // max(O, 1)
  c = jnp.promote_types(jnp.dtype(case.ldtype), jnp.dtype(case.rdtype))
  abs_in = 0.0
  if exact:
    fp8 = case.lq.qtype.is_float
    k = (n if fp8 else 0) + EPILOGUE_ROUNDINGS
    float_acc = fp8
  else:
    k, float_acc = n, True
    if c == jnp.float16 and (case.lq is None) != (case.rq is None):
      abs_in = R.flush(c) * (ones_l if case.lq is not None else ones_r)
  u_out = R.unit_roundoff(out_dtype)
  acc = (rel_in + R.gamma(k) * (1 + rel_in)) * P + (k + 1) * R.TINY32 + abs_in
  budget = (1 + u_out) * acc + u_out * np.abs(ref) + R.flush(out_dtype) + 2 * n * R.U64 * P
  may_overflow = (float_acc & (P * (1 + rel_in) * (1 + R.gamma(k)) >= R.overflow_threshold(jnp.float32))) | (
      np.abs(ref) + budget >= R.overflow_threshold(jnp.float32))
  R.check_output(out, ref, budget, out_dtype=out_dtype, may_overflow=may_overflow,
                 may_be_nan=_touches_nonfinite(case, x, w, ref.shape),
                 what="conv_general_qt vs float64 conv of the dequantized operands")


_NHWC = S.ConvLayout(lhs_shape=(2, 5, 5, 3), rhs_shape=(3, 3, 3, 4),
                     dimension_numbers=("NHWC", "HWIO", "NHWC"), window_strides=(1, 1),
                     padding="SAME", lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                     feature_group_count=1, batch_group_count=1)


@hypothesis.settings(FAST, max_examples=20)
@hypothesis.given(case=conv_cases())
# Issue 16 item 2: weight-only int8 on a bf16 convolution, and e5m2 x e4m3fn.
@pytest.mark.slow
@hypothesis.example(case=ConvCase(layout=_NHWC, ldtype="bfloat16", rdtype="bfloat16",
                                  lv=S.Values(), rv=S.Values(seed=1), lq=None,
                                  rq=C.OperandQuant(qtype="int8"), preferred=None))
@hypothesis.example(case=ConvCase(layout=_NHWC, ldtype="float32", rdtype="float32",
                                  lv=S.Values(), rv=S.Values(seed=1),
                                  lq=C.OperandQuant(qtype="float8_e5m2"),
                                  rq=C.OperandQuant(qtype="float8_e4m3fn"), preferred=None))
def test_conv_general_qt_forward(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=10)
@hypothesis.given(case=conv_cases(force_nonfinite=True))
def test_conv_general_qt_forward_nonfinite(case):
  check_forward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=conv_cases(big=True))
def test_conv_general_qt_forward_deep(case):
  check_forward(case)


# ----------------------------------------------------------------------------
# Backward


def _grad_err(g, gq, keep):
  """Per-element bound of g's quantization error (one scale per index of the axes ``keep``)."""
  if gq is None:
    return np.zeros_like(g)
  red = tuple(a for a in range(g.ndim) if a not in keep)
  t = np.max(np.abs(g), axis=red, keepdims=True, initial=0.0) / gq.qtype.qmax * (1 + 4 * R.U32)
  steps = 1.0 if gq.stochastic_rounding else 0.5
  if gq.qtype.is_float:
    _, sub, nmant = R.fp8_steps(gq.qtype)
    e = np.maximum(2.0 ** -nmant * steps * np.abs(g), sub * steps * t)
  else:
    e = steps * np.broadcast_to(t, g.shape)
  return e + 2 * R.U32 * np.abs(g) + R.TINY32


def _along(s_full, axis):
  """A scale that varies (at most) along ``axis``, as a vector along it."""
  t = np.moveaxis(s_full, axis, 0)
  return t.reshape(t.shape[0], -1)[:, 0] if t.size else np.ones(t.shape[0])


def _folded(g_abs, y, s_full, axis, g_axis):
  """(|g| times y's scale laid on g's ``g_axis``, |y| / its scale): the gradient the op
  quantizes after folding y's scale (varying along y's ``axis``) in, and the codes its
  rounding error multiplies."""
  s = _along(s_full, axis)
  rest = g_abs.shape[:g_axis] + g_abs.shape[g_axis + 1:]
  g2 = g_abs * np.moveaxis(np.broadcast_to(s, rest + (s.size,)), -1, g_axis)
  return g2, np.where(s_full == 0, 0.0, np.abs(y) / np.where(s_full == 0, 1.0, s_full))


def check_backward(case: ConvCase) -> None:
  lay = case.layout
  x = S.make(case.lv, lay.lhs_shape, case.ldtype)
  w = S.make(case.rv, lay.rhs_shape, case.rdtype)
  lspec, rspec = _specs(case)
  cfg = C.ConvGeneralQtConfig(lhs=case.lq, rhs=case.rq, dlhs_grad=case.dlhs, drhs_grad=case.drhs)
  kw = lay.kwargs()
  pet = case.preferred
  out_dtype = _out_dtype(case)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(a, b, **kw),
                             x.astype(np.float32), w.astype(np.float32)).shape
  g = S.make(case.gv, out_shape, out_dtype)
  hypothesis.note(f"lhs = {x!r}\nrhs = {w!r}\ng = {g!r}")
  key = jax.random.key(case.gv.seed) if cfg.needs_key else None

  @jax.jit
  def run(x, w, g, key):
    f = lambda a, b: conv_general_qt(a, b, **kw, preferred_element_type=pet, config=cfg, key=key)
    _, vjp = jax.vjp(f, x, w)
    return vjp(g), (None if lspec is None else qarray.quantize(x, lspec),
                    None if rspec is None else qarray.quantize(w, rspec))

  if _path(case) is None and jnp.dtype(case.ldtype) != jnp.dtype(case.rdtype):
    # No quantization: the op is lax.conv_general_dilated, which takes no mixed dtypes.
    with pytest.raises(TypeError):
      run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), key)
    return
  (lbar, rbar), (ql, qr) = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), key)
  a, sa = _side(x, case.lq, ql, lspec, case.ldtype)
  b, sb = _side(w, case.rq, qr, rspec, case.rdtype)
  g64 = R.f64(g)
  ospec = lay.dimension_numbers[2]
  n_ax, c_ax = ospec.index("N"), ospec.index("C")
  every = tuple(range(g64.ndim))
  # The gradient's quantization (see the module docstring): a convolution run as a matrix
  # product quantizes g times the other side's scale (folded in: the kernel's per output
  # feature, the input's per batch element), one gradient scale per output position (dlhs)
  # or per output feature (drhs); its error then multiplies the other side's codes (y / s).
  # batch_group_count > 1: g itself, per batch element (dlhs) / output feature (drhs).
  matmul = kw["batch_group_count"] == 1
  b_l, b_r = np.abs(b), np.abs(a)  # what g's error multiplies in each product
  gp_l = gp_r = np.abs(g64)
  if matmul:
    # (A dequantized nf4 side is a float32 array to the backward products: no scale to fold.)
    if case.rq is not None and qr.zero_point is None and not case.rq.qtype.is_lut:
      gp_l, b_l = _folded(gp_l, b, sb, lay.dimension_numbers[1].index("O"), c_ax)
    if case.lq is not None and ql.zero_point is None and not case.lq.qtype.is_lut:
      gp_r, b_r = _folded(gp_r, a, sa, lay.dimension_numbers[0].index("N"), n_ax)
  el = _grad_err(gp_l, case.dlhs, tuple(i for i in every if i != c_ax) if matmul else (n_ax,))
  er = _grad_err(gp_r, case.drhs, (c_ax,))
  if case.dlhs is None or not matmul:
    gp_l, b_l = np.abs(g64), np.abs(b)
  if case.drhs is None or not matmul:
    gp_r, b_r = np.abs(g64), np.abs(a)

  @jax.jit
  def vjps(a, b, gl, gr):
    conv = lambda p, q: jax.lax.conv_general_dilated(p, q, precision=HIGHEST, **kw)
    _, vl = jax.vjp(lambda p: conv(p, b), a)
    _, vr = jax.vjp(lambda q: conv(a, q), b)
    return vl(gl)[0], vr(gr)[0]

  with jax.enable_x64(True):
    f = lambda *t: [np.asarray(v) for v in vjps(*[jnp.asarray(v, jnp.float64) for v in t])]
    ref_l, ref_r = f(a, b, g64, g64)
    P_l, _ = f(np.abs(a), b_l, gp_l + el, gp_r + er)
    _, P_r = f(b_r, np.abs(b), gp_l + el, gp_r + er)
    q_l, _ = f(np.abs(a), b_l, el, er)
    _, q_r = f(b_r, np.abs(b), el, er)
  gdt = jnp.dtype(out_dtype)
  for which, bar, ref, P, quant, X, xdt, oq, s_full, Y, ydt, gq, n in (
      ("lhs", lbar, ref_l, P_l, q_l, x, case.ldtype, case.lq, sa, case.rq, case.rdtype, case.dlhs, w.size),
      ("rhs", rbar, ref_r, P_r, q_r, w, case.rdtype, case.rq, sb, case.lq, case.ldtype, case.drhs, g.size)):
    xdt = jnp.dtype(xdt)
    assert bar.shape == X.shape and bar.dtype == xdt, (which, bar.shape, bar.dtype)
    c = jnp.promote_types(gdt, jnp.dtype(ydt))
    rel_in = (R.unit_roundoff(c) if Y is not None else 0.0) + (R.unit_roundoff(c) if gq is not None else 0.0)
    k = n
    u_x = R.unit_roundoff(xdt)
    acc = (quant if gq is not None else 0.0) + (rel_in + R.gamma(k) * (1 + rel_in)) * P + (k + 1) * R.TINY32
    budget = (1 + u_x) * acc + u_x * np.abs(ref) + R.flush(xdt) + 2 * n * R.U64 * P
    may_overflow = (P * (1 + rel_in) * (1 + R.gamma(k)) >= R.overflow_threshold(jnp.float32)) | (
        np.abs(ref) + budget >= R.overflow_threshold(xdt))
    o = R.f64(bar)
    if oq is not None and oq.estimator == "clipped_ste":
      x64 = R.f64(X)
      s = np.where(s_full == 0, 1.0, s_full)
      y = x64 / s
      q = ql if which == "lhs" else qr
      if q.zero_point is not None:  # the documented range: [qmin - 1/2, qmax + 1/2] after the shift
        y = y + R.expand(R.f64(q.zero_point), x64.shape)
        dist = np.maximum(oq.qtype.qmin - 0.5 - y, y - oq.qtype.qmax - 0.5)
      else:
        dist = np.abs(y) - oq.qtype.qmax
      tol = 4 * R.U32 * (np.abs(y) + 1)
      if oq.calibration.method == "absmax" and oq.calibration.multiplier >= 1:
        masked = either = np.zeros(x64.shape, bool)
      else:
        masked, either = dist > tol, np.abs(dist) <= tol
      assert np.all(o[masked] == 0), f"{which}_bar: clipped_ste must zero elements outside the range"
      ref = np.where(masked | (either & (o == 0)), 0.0, ref)
      budget = np.where(masked | (either & (o == 0)), 0.0, budget)
    R.check_output(bar, ref, budget, out_dtype=xdt, may_overflow=may_overflow,
                   what=f"conv {which}_bar vs float64 vjp ({gq})")


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=conv_cases(grads=True, nonfinite=False))
def test_conv_general_qt_gradients(case):
  check_backward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=conv_cases(big=True, grads=True, nonfinite=False))
# clipped_ste under per-tensor minmax: the largest value lands at qmax + 0.03 after the
# zero-point shift, inside the documented range [qmin - 1/2, qmax + 1/2]; its gradient passes.
@hypothesis.example(case=ConvCase(
    layout=S.ConvLayout(lhs_shape=(1, 1, 1), rhs_shape=(1, 1, 4),
                        dimension_numbers=("NWC", "WIO", "NWC"), window_strides=(1,),
                        padding="VALID", lhs_dilation=(1,), rhs_dilation=(1,),
                        feature_group_count=1, batch_group_count=1),
    ldtype="float32", rdtype="float32", lv=S.Values(), rv=S.Values(), lq=None,
    rq=C.OperandQuant(qtype="int8", calibration="minmax", channelwise=False,
                      estimator="clipped_ste"),
    preferred=None, gv=S.Values(), dlhs=None, drhs=None))
def test_conv_general_qt_gradients_deep(case):
  check_backward(case)


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "bool"])
@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_conv_general_qt_rejects_non_float_inputs(side, dtype):
  """Like dot_general_qt: a QT op takes float operands; an integer input is a
  ValueError naming the operand and its dtype, not a truncated integer result."""
  x = jnp.ones((1, 4, 2), jnp.float32)
  w = jnp.ones((2, 2, 3), jnp.float32)
  x, w = (x.astype(dtype), w) if side == "lhs" else (x, w.astype(dtype))
  cfg = C.ConvGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"))
  with pytest.raises(ValueError, match=f"{side}.*{dtype}"):
    conv_general_qt(x, w, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"), config=cfg)


# ----------------------------------------------------------------------------
# nf4 (S.NEW_QTYPES' value-set qtype convolutions take: per batch element / per output
# feature, no tile). Its side is dequantized into float32 for the patches (padding must be the
# value 0, which is not nf4's code 0), so a quantized pair takes the float32 path of _path.


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=conv_cases(new=True))
def test_conv_general_qt_forward_nf4(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=10)
@hypothesis.given(case=conv_cases(new=True, force_nonfinite=True))
def test_conv_general_qt_forward_nf4_nonfinite(case):
  check_forward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=conv_cases(new=True, big=True))
def test_conv_general_qt_forward_nf4_deep(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=conv_cases(new=True, grads=True, nonfinite=False))
def test_conv_general_qt_nf4_gradients(case):
  check_backward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=conv_cases(new=True, big=True, grads=True, nonfinite=False))
def test_conv_general_qt_nf4_gradients_deep(case):
  check_backward(case)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_conv_general_qt_refuses_mx(side, name):
  """MX qtypes need 32-value blocks along a contracting axis, which convolutions do not take:
  the config raises naming the operand; nf4 per channel is accepted, nf4 with a tile raises."""
  with pytest.raises(ValueError, match=f"{side}.qtype='{name}': an MX qtype needs blocks of 32"):
    C.ConvGeneralQtConfig(**{side: C.OperandQuant(qtype=name)})
  C.ConvGeneralQtConfig(**{side: C.OperandQuant(qtype="nf4")})
  with pytest.raises(ValueError, match=f"{side}.tile_size=64: convolutions take no tile_size"):
    C.ConvGeneralQtConfig(**{side: C.OperandQuant(qtype="nf4", tile_size=64)})
