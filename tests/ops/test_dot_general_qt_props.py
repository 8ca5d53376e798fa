"""Property tests of qtrain.ops.dot_general_qt and its gradients against float64 (issue 16).

Cases: random dimension numbers (batch axes, 0-3 contracting axes listed in
any order, free axes on both sides, any axis order, size-1 and size-0 axes),
each side None or any qtype x calibration, channelwise on/off, a tile size
dividing the last contracting axis, float32/bfloat16/float16 on each side,
``preferred_element_type``, magnitudes from 1e-30 to 1e30 (and the float32
edges), NaN/Inf planted.

Reference: the float64 dot of the operands dequantized by the library's own
``quantize`` with the operand spec the op documents (OperandQuant: one scale
per index of every non-contracting axis when channelwise, tiles along the
last contracting axis), exactly ((q - zp) * s in float64), a group holding
NaN/Inf set to NaN (the quantize contract).

Forward budget, per output element, with P = sum |a_i b_i| over its
contraction (n terms) and u_x the unit roundoff of dtype x:
  * one side float (compute dtype c = promote_types of the two input dtypes):
    the quantized side is rounded into c (u_c per element; float16 also
    2^-25 absolute per element: it keeps subnormals), then the products are
    accumulated in float32: gamma(n) P (+ one TINY32 per flushed operation);
  * both integer-like (int8/int4/int2/ternary/binary), scales factorable: the
    integer accumulation is exact; the epilogue rounds (acc * ls) * rs twice
    per tile group and sums G groups in float32: gamma(G + 1) P;
  * fp8 x fp8: float32 accumulation of exact fp8 products, then the epilogue:
    gamma(n + G + 1) P;
  * anything else (int x fp8, scales varying per element along the
    contraction, unequal tiles): both sides dequantized in float32
    (2 u each product) then gamma(n) P;
  * a value-set side (nf4, mxfp4; scales factorable): its table values read
    into float32 multiply the other side's values there, exactly (e2m1 has 2
    significant bits, int8 / fp8 codes at most 8) except for nf4's float32
    table values (u per product), float32 accumulation, the epilogue per
    group and the sum of G groups: (u) + gamma(n + G + 1) P; mxfp8 is fp8
    (its 32-value blocks are G groups of the last contracting axis);
  * both float (no quantization): bit for bit lax.dot_general;
  * the result is rounded once into the output dtype: u_out |ref| (+ its
    flush), and must be Inf exactly where |ref| beyond the budget overflows it.
End to end (absmax, no clipping): |out - x . w| <= the above +
sum(E_x |w| + |x| E_w + E_x E_w) with E the per-element quantization bound
(nf4, mxfp8, mxfp4: half the largest gap between neighbouring values of the
format times the scale, _props_ref.value_set_error; its attainment is checked
by test_dot_general_qt_new_qtypes_e2e_budget_is_attained).

Backward: ``lhs_bar = g . deq(rhs)`` contracted back to lhs's layout (and
rhs_bar likewise), float64 reference from the dequantized operands and g.
Float backward: the quantized residual rounded into promote(g, operand)
dtypes, float32 accumulation, one rounding into the operand's dtype.
Quantized backward: g (times the residual's scale when it is folded in, see
dot_general_qt._fold_scale) is quantized per GradQuant with one scale per
index of g's axes that survive the product; each element is off by at most
half its step (round to nearest; a full step with stochastic rounding; fp8:
its relative rounding bound), so the error adds sum |dg| |y'| over the
contraction (y' the residual with its folded scale divided out).
clipped_ste: zero exactly where |x / scale| > qmax (MX qtypes: the midpoint above the top
element, qarray.pass_limit; none with absmax and a multiplier >= 1), the STE gradient
elsewhere; |x / scale| within float32 rounding of that limit may go either way (except under
absmax).
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
from hypothesis.control import currently_in_test_context
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _props_ref as R
import _strategies as S
from qtrain.ops import config as C
from qtrain.core import qarray
from qtrain.ops.dot_general_qt import dot_general_qt

FAST = hypothesis.settings(max_examples=30, deadline=None, derandomize=True, database=None,
                           suppress_health_check=list(hypothesis.HealthCheck))
DEEP = S.deep(FAST, 80)
EPILOGUE_ROUNDINGS = 2  # (acc * ls) * rs in float32


@dataclasses.dataclass(frozen=True)
class DotCase:
  layout: S.DotLayout
  ldtype: str
  rdtype: str
  lv: S.Values
  rv: S.Values
  lq: C.OperandQuant | None
  rq: C.OperandQuant | None
  preferred: str | None
  implementation: str
  # backward
  gv: S.Values | None = None
  dlhs: C.GradQuant | None = None
  drhs: C.GradQuant | None = None


grad_quants = S.grad_quants()


@st.composite
def dot_cases(draw, *, max_size=4, max_contract=64, max_rank=4, nonfinite=True, grads=False,
              force_empty=False, force_nonfinite=False, one_float=False, clipped_absmax=False,
              new=False):
  """DotCase draws; the force_/one_float/clipped_absmax flags narrow the space
  to one property (an empty axis, NaN/Inf, exactly one float side, clipped_ste
  under absmax on both sides). ``new``: at least one side of S.NEW_QTYPES (nf4,
  mxfp8, mxfp4), the other None or any qtype, on layouts whose last contracting
  axis is a multiple of 32 (an MX block; S.new_dot_layouts)."""
  if new:
    layout = draw(S.new_dot_layouts(max_size=max_size, max_rank=max_rank))
  else:
    layout = draw(S.dot_layouts(max_size=max_size, max_contract=max_contract, max_rank=max_rank))
  if force_empty:
    side = draw(st.sampled_from(["lhs", "rhs"]))
    shape = list(getattr(layout, f"{side}_shape"))
    hypothesis.assume(shape)
    # Zero an axis of one side, and its partner (batch/contracting) on the other.
    a = draw(st.integers(0, len(shape) - 1))
    (lc, rc), (lb, rb) = layout.dn
    mine, other = ((lc + lb, rc + rb) if side == "lhs" else (rc + rb, lc + lb))
    oshape = list(getattr(layout, f"{'rhs' if side == 'lhs' else 'lhs'}_shape"))
    shape[a] = 0
    if a in mine:
      oshape[other[mine.index(a)]] = 0
    l, r = (shape, oshape) if side == "lhs" else (oshape, shape)
    layout = dataclasses.replace(layout, lhs_shape=tuple(l), rhs_shape=tuple(r))
  dts = st.sampled_from(S.FLOAT_DTYPES)
  ldt, rdt = draw(dts), draw(dts)
  vals = S.values(nonfinite=nonfinite)
  if force_nonfinite:
    vals = S.values(nonfinite=True).filter(lambda v: v.nonfinite)
  lv, rv = draw(vals), draw(S.values(nonfinite=nonfinite))
  nl = layout.last_contract_size
  if not new:
    lq = draw(S.operand_quants(lv, ldt, tile_axis_size=nl))
    rq = draw(S.operand_quants(rv, rdt, tile_axis_size=nl))
  else:
    any_q = S.QTYPES + S.NEW_QTYPES
    lq = draw(S.operand_quants(lv, ldt, tile_axis_size=nl, qtypes_=any_q))
    rq = draw(S.operand_quants(rv, rdt, tile_axis_size=nl, qtypes_=any_q))
    if draw(st.booleans()):
      lq = draw(S.operand_quants(lv, ldt, tile_axis_size=nl, qtypes_=S.NEW_QTYPES, allow_none=False))
    else:
      rq = draw(S.operand_quants(rv, rdt, tile_axis_size=nl, qtypes_=S.NEW_QTYPES, allow_none=False))
  qtypes_ = S.NEW_QTYPES if new else S.QTYPES
  if one_float:
    quantized = draw(S.operand_quants(lv, ldt, tile_axis_size=nl, allow_none=False, qtypes_=qtypes_))
    lq, rq = (None, quantized) if draw(st.booleans()) else (quantized, None)
  if clipped_absmax:
    absmax = lambda oq: dataclasses.replace(oq, calibration=qarray.Calibration(method="absmax"),
                                            estimator="clipped_ste", channelwise=True)
    # (MX blocks: test_dot_general_qt_clipped_ste_absmax_mx_block_top.)
    cq = ("nf4",) if new else S.QTYPES
    lq = absmax(draw(S.operand_quants(lv, ldt, tile_axis_size=nl, allow_none=False, qtypes_=cq)))
    rq = absmax(draw(S.operand_quants(rv, rdt, tile_axis_size=nl, allow_none=False, qtypes_=cq)))
  pet = draw(st.sampled_from([None, None, "float32", "bfloat16", "float16"]))
  impl = draw(st.sampled_from(["auto", "xla"]))
  case = DotCase(layout=layout, ldtype=ldt, rdtype=rdt, lv=lv, rv=rv, lq=lq, rq=rq, preferred=pet,
                 implementation=impl)
  if grads:
    case = dataclasses.replace(case, gv=draw(S.values(modes=S.MODES)), dlhs=draw(grad_quants),
                               drhs=draw(grad_quants))
  return case


# ----------------------------------------------------------------------------
# One side of the reference


def free(nd, contract, batch):
  return tuple(a for a in range(nd) if a not in contract and a not in batch)


def operand_spec(oq, nd, contract, batch) -> qarray.QuantizeSpec:
  """The documented forward spec (OperandQuant): channelwise over every
  non-contracting axis, tiles along the last contracting axis."""
  return qarray.QuantizeSpec(
      qtype=oq.qtype, calibration=oq.calibration,
      channelwise_axes=tuple(sorted(batch + free(nd, contract, batch))) if oq.channelwise else (),
      tiled_axes={contract[-1]: oq.tile_size} if (oq.tile_size and contract) else {})


@dataclasses.dataclass
class Side:
  x: np.ndarray            # the input, float64
  val: np.ndarray          # what the op multiplies: deq (NaN groups) or x
  oq: C.OperandQuant | None
  dtype: jnp.dtype
  spec: qarray.QuantizeSpec | None = None
  s_full: np.ndarray | None = None    # scale expanded to x's shape
  zp_full: np.ndarray | None = None
  scale: np.ndarray | None = None     # scale in its own (grid) shape
  err: np.ndarray | None = None       # per-element |x_hat - x| bound (finite x)


def make_side(x, oq, q, spec, dtype) -> Side:
  x64 = R.f64(x)
  side = Side(x=x64, val=x64, oq=oq, dtype=jnp.dtype(dtype), spec=spec)
  if oq is None:
    side.err = np.zeros_like(x64)
    return side
  s = R.f64(q.scale)
  cw, tiles = R.normalize_grid(x64.shape, spec.channelwise_axes, spec.tiled_axes)
  finite = R.expand(R.group_reduce(np.isfinite(x64), cw, tiles, np.all), x64.shape)
  s_full = R.expand(s, x64.shape)
  zp_full = None if q.zero_point is None else R.expand(R.f64(q.zero_point), x64.shape)
  # The values of the codes (a value-set qtype's are its table's, in float32 as the op reads them).
  codes = R.f64(qarray.values_of(q)) - (0 if zp_full is None else zp_full)
  side.val = np.where(finite, codes * s_full, np.nan)
  side.s_full, side.zp_full, side.scale = s_full, zp_full, s
  xs = np.where(finite, x64, 0.0)
  if oq.qtype.is_lut or oq.qtype.is_mx:  # nf4, mxfp8, mxfp4: the format's value gaps
    side.err = np.where(finite, R.value_set_error(xs, np.where(finite, s_full, 1.0), oq.qtype), np.nan)
    return side
  center, bound = R.element_budget(xs, np.where(finite, s_full, 1.0),
                                   None if zp_full is None else np.where(finite, zp_full, 0.0),
                                   oq.qtype, stochastic=False)
  side.err = np.where(finite, np.abs(center - xs) + bound, np.nan)
  if oq.qtype.kind == "binary":
    side.err = np.where(finite, np.abs(side.val - xs), np.nan)
  return side


def _finite_abs(v):
  return np.where(np.isfinite(v), np.abs(v), 0.0)


# ----------------------------------------------------------------------------
# Forward


def forward_budget(case: DotCase, L: Side, Rs: Side, out_dtype, ref, P, Ones_l, Ones_r):
  """(budget, may_overflow) per output element (see the module docstring)."""
  (lc, rc), _ = case.layout.dn
  n = int(np.prod([case.layout.lhs_shape[a] for a in lc], dtype=np.int64))
  c = jnp.promote_types(L.dtype, Rs.dtype)
  u_out = R.unit_roundoff(out_dtype)
  abs_in = 0.0
  float_acc = True
  beyond_c = 0.0
  if (case.lq is None) != (case.rq is None):
    rel_in, k = R.unit_roundoff(c), n
    if c == jnp.float16:  # float16 keeps subnormals: half a subnormal step per element
      abs_in = R.flush(c) * (Ones_l if case.lq is not None else Ones_r)
    # A grid value past c's range is Inf in c (the documented policy).
    q_side = L if case.lq is not None else Rs
    big = (_finite_abs(q_side.val) >= R.overflow_threshold(c)) * 1.0
    beyond_c = R.dot64(big, np.ones_like(Rs.val), case.layout.dn) if case.lq is not None else (
        R.dot64(np.ones_like(L.val), big, case.layout.dn))
  else:
    lt, rt = case.lq.qtype, case.rq.qtype
    nl = case.layout.last_contract_size or 0
    groups = lambda oq: (nl // oq.tile_size) if (oq.tile_size and nl) else 1
    gl, gr = groups(case.lq), groups(case.rq)
    per_element = nl > 1 and 1 in (case.lq.tile_size, case.rq.tile_size)
    factors = not per_element and (gl == 1 or gr == 1 or gl == gr)
    lut = lt.is_lut or rt.is_lut
    exact = not lut and lt.is_float == rt.is_float and factors
    if lut and factors:
      # A value-set side's table values are read into float32 and multiply the other side's
      # values there (qdot): each product is exact (e2m1 values have 2 significant bits, int8
      # and fp8 codes at most 8), except nf4's float32 table values (one rounding, u); float32
      # accumulation of each group's terms (at most n), then the epilogue per group and the
      # sum of the G groups.
      G = max(gl, gr)
      rel_in = R.U32 if "nf4" in (lt.name, rt.name) else 0.0
      k = n + (G - 1) + EPILOGUE_ROUNDINGS
    elif exact:
      G = max(gl, gr)
      rel_in = 0.0
      k = (n if lt.is_float else 0) + (G - 1) + EPILOGUE_ROUNDINGS
      float_acc = lt.is_float or G > 1
    else:
      rel_in, k = 2 * R.U32 + R.U32 ** 2, n
  acc = (rel_in + R.gamma(k) * (1 + rel_in)) * P + (k + 1) * R.TINY32 + abs_in
  budget = (1 + u_out) * acc + u_out * np.abs(ref) + R.flush(out_dtype) + 2 * n * R.U64 * P
  may_overflow = (float_acc & (P * (1 + rel_in) * (1 + R.gamma(k)) >= R.overflow_threshold(jnp.float32))) | (
      np.abs(ref) + budget >= R.overflow_threshold(jnp.float32)) | (beyond_c > 0)
  return budget, may_overflow


def _merge_group(shape, group, batch):
  """numpy twin of the op's merge of ``group`` (axes, in order) into one axis at min(group):
  (function on arrays of ``shape``, merged shape, new index of each batch axis)."""
  nd, pos = len(shape), min(group)
  rest = [a for a in range(nd) if a not in group]
  order = [a for a in rest if a < pos] + list(group) + [a for a in rest if a > pos]
  mshape = (tuple(shape[a] for a in order[:pos]) + (int(np.prod([shape[a] for a in group])),)
            + tuple(shape[a] for a in order[pos + len(group):]))
  new = {a: (i if i < pos else (pos if i < pos + len(group) else i - len(group) + 1))
         for i, a in enumerate(order)}
  return (lambda v: np.transpose(v, order).reshape(mshape)), mshape, tuple(new[a] for a in batch)


def merged(case: DotCase):
  """The case as the op computes it, and the maps of lhs- / rhs-shaped arrays into it.

  A tile over a contraction of several axes groups the whole contraction,
  flattened in the order of the lhs's contracting axes (the documented
  contract of dot_general_qt); the reference quantizes and multiplies the
  merged operands, whose product has the original output layout.
  """
  lay = case.layout
  (lc, rc), (lb, rb) = lay.dn
  tiled = any(oq is not None and oq.tile_size for oq in (case.lq, case.rq))
  if not tiled or len(lc) < 2:
    return case, (lambda v: v), (lambda v: v)
  pairs = sorted(zip(lc, rc))
  fl, lshape, lb2 = _merge_group(lay.lhs_shape, [p[0] for p in pairs], lb)
  fr, rshape, rb2 = _merge_group(lay.rhs_shape, [p[1] for p in pairs], rb)
  dn = (((min(lc),), (min(rc),)), (lb2, rb2))
  return dataclasses.replace(case, layout=S.DotLayout(lshape, rshape, dn)), fl, fr


def _build(case: DotCase):
  """(x, w, cfg) for the op, and (merged case, x, w, lspec, rspec) for the reference."""
  lay = case.layout
  x = S.make(case.lv, lay.lhs_shape, case.ldtype)
  w = S.make(case.rv, lay.rhs_shape, case.rdtype)
  cfg = C.DotGeneralQtConfig(lhs=case.lq, rhs=case.rq, dlhs_grad=case.dlhs, drhs_grad=case.drhs,
                             implementation=case.implementation)
  if currently_in_test_context():  # (the deterministic tests call check_forward directly)
    hypothesis.note(f"lhs = {x!r}\nrhs = {w!r}")
  mcase, fl, fr = merged(case)
  (lc, rc), (lb, rb) = mcase.layout.dn
  xm, wm = fl(x), fr(w)
  lspec = None if case.lq is None else operand_spec(case.lq, xm.ndim, lc, lb)
  rspec = None if case.rq is None else operand_spec(case.rq, wm.ndim, rc, rb)
  return x, w, cfg, (mcase, xm, wm, lspec, rspec, fl, fr)


def _quantize_both(x, w, lspec, rspec):
  return (None if lspec is None else qarray.quantize(x, lspec),
          None if rspec is None else qarray.quantize(w, rspec))


def _out_dtype(case):
  return jnp.dtype(case.preferred) if case.preferred else jnp.result_type(
      jnp.dtype(case.ldtype), jnp.dtype(case.rdtype))


def check_forward(case: DotCase) -> float | None:
  """Checks the forward; returns the largest |out - x . w| / its end-to-end budget where
  that is checked (None elsewhere)."""
  x, w, cfg, (mcase, xm, wm, lspec, rspec, _, _) = _build(case)
  dn = case.layout.dn
  pet = case.preferred

  key = jax.random.key(0) if cfg.needs_key else None
  out_dtype = _out_dtype(case)

  @jax.jit
  def run(x, w, xm, wm):
    out = dot_general_qt(x, w, dn, cfg, preferred_element_type=pet, key=key)
    lax_out = jax.lax.dot_general(x, w, dn, preferred_element_type=out_dtype)
    return out, lax_out, _quantize_both(xm, wm, lspec, rspec)

  out, lax_out, (ql, qr) = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(xm), jnp.asarray(wm))
  case, dn, x, w = mcase, mcase.layout.dn, xm, wm  # the reference: the op's merged view
  assert out.shape == lax_out.shape and out.dtype == out_dtype, (out.shape, out.dtype)
  if case.lq is None and case.rq is None:
    # No quantization: the op is lax.dot_general with preferred_element_type =
    # the output dtype it documents (result_type of the inputs by default), bit
    # for bit.
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(lax_out, np.float64))
    return None
  L = make_side(x, case.lq, ql, lspec, case.ldtype)
  Rs = make_side(w, case.rq, qr, rspec, case.rdtype)
  ref = R.dot64(L.val, Rs.val, dn)
  P = R.dot64(_finite_abs(L.val), _finite_abs(Rs.val), dn)
  ones_l = R.dot64(np.ones_like(L.val), _finite_abs(Rs.val), dn)
  ones_r = R.dot64(_finite_abs(L.val), np.ones_like(Rs.val), dn)
  budget, may_overflow = forward_budget(case, L, Rs, out_dtype, ref, P, ones_l, ones_r)
  R.check_output(out, ref, budget, out_dtype=out_dtype, may_overflow=may_overflow,
                 what="dot_general_qt vs float64 dot of the dequantized operands")

  # End to end against the original operands: sides None or absmax without clipping.
  e2e = lambda oq: oq is None or (oq.calibration.method == "absmax" and oq.calibration.multiplier >= 1
                                  and oq.qtype.kind != "binary")
  if e2e(case.lq) and e2e(case.rq) and np.isfinite(L.x).all() and np.isfinite(Rs.x).all():
    ref0 = R.dot64(L.x, Rs.x, dn)
    extra = (R.dot64(L.err, np.abs(Rs.x), dn) + R.dot64(np.abs(L.x), Rs.err, dn)
             + R.dot64(L.err, Rs.err, dn))
    total = budget + extra * (1 + 4 * R.U32)
    R.check_output(out, ref0, total, out_dtype=out_dtype,
                   may_overflow=may_overflow | (np.abs(ref0) + budget + extra >= R.overflow_threshold(out_dtype)),
                   what="dot_general_qt vs float64 dot of the original operands")
    fin = np.isfinite(R.f64(out)) & (total > 0)
    return float(np.max(np.abs(R.f64(out) - ref0)[fin] / total[fin], initial=0.0))
  return None


OQ = C.OperandQuant
_MK = S.DotLayout(lhs_shape=(2, 4), rhs_shape=(4, 3), dn=(((1,), (0,)), ((), ())))


def _case(layout, lq, rq, ldt="float32", rdt="float32", lv=S.Values(), rv=S.Values(seed=1), **kw):
  return DotCase(layout=layout, ldtype=ldt, rdtype=rdt, lv=lv, rv=rv, lq=lq, rq=rq, preferred=None,
                 implementation="auto", **kw)


@FAST
@hypothesis.given(case=dot_cases())
# Issue 16 item 4: a quantized float32 operand times a float16 one, finite data
# (1e5 and 1e-9 magnitudes): computed in float16 it gives inf or 0.
@hypothesis.example(case=_case(_MK, OQ(qtype="int8"), None, rdt="float16",
                               lv=S.Values(mode="tensor", exponent=5)))
@hypothesis.example(case=_case(_MK, OQ(qtype="int8"), None, rdt="float16",
                               lv=S.Values(mode="tensor", exponent=-9)))
# Item 7: the epilogue (acc * ls) * rs with one huge and one tiny scale.
@hypothesis.example(case=_case(S.DotLayout(lhs_shape=(2, 64), rhs_shape=(64, 3), dn=_MK.dn),
                               OQ(qtype="int8"), OQ(qtype="int8"), lv=S.Values(mode="huge"),
                               rv=S.Values(mode="tensor", exponent=-30)))
# Item 6: an empty batch (M = 0) with implementation="auto".
@pytest.mark.slow
@hypothesis.example(case=_case(S.DotLayout(lhs_shape=(0, 8), rhs_shape=(8, 4), dn=_MK.dn),
                               OQ(qtype="int8"), OQ(qtype="int8")))
def test_dot_general_qt_forward(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=dot_cases(force_nonfinite=True))
def test_dot_general_qt_forward_nonfinite(case):
  """NaN/Inf in an operand: every output whose contraction touches its group is NaN."""
  check_forward(case)


@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=dot_cases(one_float=True))
# Issue 16 item 3: a bf16 float lhs (6, 9) contracting axis 0 with a quantized
# bf16 rhs (5, 6, 3) (UNIMPLEMENTED BF16 x BF16 = F32 on the CPU).
@pytest.mark.slow
@hypothesis.example(case=_case(S.DotLayout(lhs_shape=(6, 9), rhs_shape=(5, 6, 3),
                                           dn=(((0,), (1,)), ((), ()))),
                               None, OQ(qtype="int8"), ldt="bfloat16", rdt="bfloat16"))
def test_dot_general_qt_forward_one_float_side(case):
  """One side float (float32/bfloat16/float16), the other quantized, any layout:
  the quantized side is dequantized into promote_types of the two input dtypes."""
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=10)
@hypothesis.given(case=dot_cases(force_empty=True, grads=True, nonfinite=False))
def test_dot_general_qt_empty_axis(case):
  """A size-0 axis anywhere: lax.dot_general's output shape (zeros); gradients
  of each operand's shape and dtype."""
  check_forward(case)
  check_backward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=dot_cases(max_size=8, max_contract=256, max_rank=5))
def test_dot_general_qt_forward_deep(case):
  check_forward(case)


# ----------------------------------------------------------------------------
# Backward


def backward_bound(case, g, x: Side, y: Side, gq, which: str):
  """(reference, budget, may_overflow, quant_group_info) of the cotangent of ``x``."""
  lay = case.layout
  dn = lay.dn
  (lc, rc), (lb, rb) = dn
  ls, rs, os_ = R.dot_subscripts(len(lay.lhs_shape), len(lay.rhs_shape), dn)
  if which == "lhs":
    xs, ys, y_contract, y_batch, x_contract, x_batch = ls, rs, rc, rb, lc, lb
    bar = lambda gg, yy: R.dot64_lhs_bar(gg, yy, len(lay.lhs_shape), dn)
  else:
    xs, ys, y_contract, y_batch, x_contract, x_batch = rs, ls, lc, lb, rc, rb
    bar = lambda gg, yy: R.dot64_rhs_bar(gg, yy, len(lay.rhs_shape), dn)
  g64 = R.f64(g)
  ref = bar(g64, y.val)
  yfree = free(y.x.ndim, y_contract, y_batch)
  n_bwd = int(np.prod([y.x.shape[a] for a in yfree], dtype=np.int64))
  gdt = jnp.dtype(g.dtype)
  c = jnp.promote_types(gdt, y.dtype)
  # g's axes surviving this product (its scale groups): batch and x's free axes.
  g_letters = os_
  y_free_letters = {ys[a] for a in yfree}
  g_red_axes = tuple(i for i, ch in enumerate(g_letters) if ch in y_free_letters)
  beyond_c, abs_in = 0.0, 0.0
  if gq is None:
    P = bar(np.abs(g64), _finite_abs(y.val))
    rel_in = R.unit_roundoff(c) if y.oq is not None else 0.0
    k = n_bwd
    quant = 0.0
    if y.oq is not None:  # a grid value past c's range is Inf in c (the documented policy)
      beyond_c = bar(np.ones_like(g64), (_finite_abs(y.val) >= R.overflow_threshold(c)) * 1.0)
      if c == jnp.float16:  # float16 keeps subnormals: half a subnormal step per element
        abs_in = R.flush(c) * bar(np.abs(g64), np.ones_like(y.val))
  else:
    yv = y.val
    gp = g64
    if y.oq is not None:
      varies = lambda axes: any(y.scale.shape[a] != 1 for a in axes)
      # (An empty contraction has no scale to fold: its product is zeros.)
      if varies(yfree) and not varies(y_contract) and all(y.x.shape[a] for a in y_contract):
        # g' = g * s_y (s_y in g's layout), y' = y / s_y.
        idx = tuple(0 if a in y_contract else slice(None) for a in range(y.x.ndim))
        red_letters = "".join(ch for a, ch in enumerate(ys) if a not in y_contract)
        s_red = y.s_full[idx]
        # The documented shift: per batch index the scale over 2**e, its largest value
        # brought into [0.5, 1) (none below 1), its smallest positive one kept >= 2**-126;
        # y' keeps 2**e.
        kept = [a for a in range(y.x.ndim) if a not in y_contract]
        free_pos = tuple(i for i, a in enumerate(kept) if a in yfree)
        fin = np.isfinite(s_red)
        top = np.max(np.where(fin, s_red, 0.0), axis=free_pos, keepdims=True, initial=0.0)
        low = np.min(np.where(fin & (s_red > 0), s_red, 1.0), axis=free_pos, keepdims=True,
                     initial=1.0)
        e = np.clip(np.minimum(np.frexp(top)[1], np.frexp(low)[1] + 125), 0, 127)
        s_red = s_red / 2.0 ** e
        other = "".join(ch for ch in g_letters if ch not in red_letters)
        other_shape = [g64.shape[g_letters.index(ch)] for ch in other]
        fold = np.einsum(f"{red_letters},{other}->{g_letters}", s_red, np.ones(other_shape))
        gp = g64 * fold
        yv = np.where(y.s_full == 0, 0.0, y.val / np.where(y.s_full == 0, 1.0, y.s_full))
        yv = yv * 2.0 ** np.expand_dims(e, tuple(sorted(y_contract)))
    gqt = gq.qtype
    t = R.group_reduce(np.abs(gp), tuple(i for i in range(gp.ndim) if i not in g_red_axes), {},
                       lambda v, axis, keepdims: np.max(v, axis=axis, keepdims=keepdims, initial=0.0))
    t = R.expand(t, gp.shape) / gqt.qmax * (1 + 4 * R.U32)
    steps = 1.0 if gq.stochastic_rounding else 0.5
    if gqt.is_float:
      _, sub, nmant = R.fp8_steps(gqt)
      e = np.maximum(2.0 ** -nmant * steps * np.abs(gp), sub * steps * t)
    else:
      e = steps * t
    e = e + 3 * R.U32 * np.abs(gp) + R.TINY32  # g * s_y and g' / t rounded in float32
    quant = bar(e, _finite_abs(yv))
    P = bar(np.abs(gp) + e, _finite_abs(yv))
    rel_in = 2 * R.unit_roundoff(c) + R.unit_roundoff(c) ** 2
    k = n_bwd + EPILOGUE_ROUNDINGS
  u_x = R.unit_roundoff(x.dtype)
  acc = quant + (rel_in + R.gamma(k) * (1 + rel_in)) * P + (k + 1) * R.TINY32 + abs_in
  budget = (1 + u_x) * acc + u_x * np.abs(ref) + R.flush(x.dtype) + 2 * n_bwd * R.U64 * P
  may_overflow = (P * (1 + rel_in) * (1 + R.gamma(k)) >= R.overflow_threshold(jnp.float32)) | (
      np.abs(ref) + budget >= R.overflow_threshold(x.dtype)) | (beyond_c > 0)
  return ref, budget, may_overflow


def clip_mask(x: Side):
  """(masked, either): where clipped_ste must zero the gradient, and where
  float32 rounding of x / scale next to the range end lets it go either way."""
  oq = x.oq
  if oq is None or oq.estimator != "clipped_ste":
    z = np.zeros(x.x.shape, bool)
    return z, z
  qt = oq.qtype
  s = np.where(x.s_full == 0, 1.0, x.s_full)
  y = x.x / s
  if x.zp_full is not None:  # the documented range: [qmin - 1/2, qmax + 1/2] after the shift
    y = y + x.zp_full
    dist = np.maximum(qt.qmin - 0.5 - y, y - qt.qmax - 0.5)
  else:  # qmax, or an MX qtype's midpoint above its top element (qarray.pass_limit)
    dist = np.abs(y) - qarray.pass_limit(qt)
  tol = 4 * R.U32 * (np.abs(y) + 1)
  if oq.calibration.method == "absmax" and oq.calibration.multiplier >= 1:
    # Every element is inside the range it defines, unless the scale was capped (the range
    # times the multiplier beyond float32): then the general test below applies.
    capped = np.abs(x.x) > x.s_full * qarray.pass_limit(qt) * (1 + 16 * R.U32)
    if not capped.any():
      z = np.zeros(x.x.shape, bool)
      return z, z
  return dist > tol, np.abs(dist) <= tol


def check_backward(case: DotCase) -> None:
  x, w, cfg, (mcase, xm, wm, lspec, rspec, fl, fr) = _build(case)
  dn = case.layout.dn
  pet = case.preferred
  out_dtype = _out_dtype(case)
  expect_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), x, w).shape
  g = S.make(case.gv, expect_shape, out_dtype)
  if currently_in_test_context():
    hypothesis.note(f"g = {g!r}")
  key = jax.random.key(case.gv.seed) if cfg.needs_key else None

  @jax.jit
  def run(x, w, xm, wm, g, key):
    f = lambda a, b: dot_general_qt(a, b, dn, cfg, preferred_element_type=pet, key=key)
    _, vjp = jax.vjp(f, x, w)
    return vjp(g), _quantize_both(xm, wm, lspec, rspec)

  (lbar, rbar), (ql, qr) = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(xm), jnp.asarray(wm),
                               jnp.asarray(g), key)
  assert lbar.shape == x.shape and rbar.shape == w.shape, (lbar.shape, rbar.shape)
  # The reference: the op's merged view (gradients mapped into it as the operands are).
  case, dn, x, w, lbar, rbar = mcase, mcase.layout.dn, xm, wm, fl(np.asarray(lbar)), fr(np.asarray(rbar))
  L = make_side(x, case.lq, ql, lspec, case.ldtype)
  Rs = make_side(w, case.rq, qr, rspec, case.rdtype)
  for which, bar, X, Y, gq in (("lhs", lbar, L, Rs, case.dlhs), ("rhs", rbar, Rs, L, case.drhs)):
    assert bar.shape == X.x.shape and bar.dtype == X.dtype, (which, bar.shape, bar.dtype)
    ref, budget, may_overflow = backward_bound(case, g, X, Y, gq, which)
    masked, either = clip_mask(X)
    o = R.f64(bar)
    assert np.all(o[masked] == 0), f"{which}_bar: clipped_ste must zero elements outside the range"
    ref = np.where(masked, 0.0, ref)
    budget = np.where(masked, 0.0, budget)
    # In the rounding band either outcome is right: compare with 0 where the op gave 0.
    ref = np.where(either & (o == 0), 0.0, ref)
    budget = np.where(either & (o == 0), 0.0, budget)
    R.check_output(bar, ref, budget, out_dtype=X.dtype, may_overflow=may_overflow,
                   what=f"{which}_bar vs float64 (g . deq(other), {gq})")


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=25)
@hypothesis.given(case=dot_cases(grads=True, nonfinite=False))
def test_dot_general_qt_gradients(case):
  check_backward(case)


@hypothesis.settings(FAST, max_examples=12)
@hypothesis.given(case=dot_cases(grads=True, nonfinite=False, clipped_absmax=True))
# Issue 16 item 1: 0.3 / (0.3 / 127) is 127.00001 in float32; the gradient of
# 0.3 must pass (grad [[2, 2, 2]], not [[2, 2, 0]]).
@pytest.mark.slow
@hypothesis.example(case=_case(S.DotLayout(lhs_shape=(1, 3), rhs_shape=(3, 1), dn=_MK.dn),
                               OQ(qtype="int8", estimator="clipped_ste"), None,
                               lv=S.Values(explicit=(0.15, -0.075, 0.3)),
                               rv=S.Values(explicit=(2.0, 2.0, 2.0)),
                               gv=S.Values(explicit=(1.0,))))
def test_dot_general_qt_clipped_ste_absmax_masks_nothing(case):
  """clipped_ste under absmax: every element is inside the range it defines, so
  the gradient is the STE gradient everywhere (the element at the bound too)."""
  check_backward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=dot_cases(max_size=8, max_contract=256, max_rank=5, grads=True, nonfinite=False))
def test_dot_general_qt_gradients_deep(case):
  check_backward(case)


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "bool"])
@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_dot_general_qt_rejects_non_float_inputs(side, dtype):
  """A QT op takes float operands: an integer input is a ValueError naming the
  operand and its dtype."""
  x, w = jnp.ones((2, 4), jnp.float32), jnp.ones((4, 3), jnp.float32)
  x, w = (x.astype(dtype), w) if side == "lhs" else (x, w.astype(dtype))
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"))
  with pytest.raises(ValueError, match=f"{side}.*{dtype}"):
    dot_general_qt(x, w, (((1,), (0,)), ((), ())), cfg)


# ----------------------------------------------------------------------------
# The value-set and MX qtypes (S.NEW_QTYPES: nf4, mxfp8, mxfp4) as weight / activation
# qtypes: the same properties, on layouts whose last contracting axis is 32 k long (k = 0
# included: an empty contraction), the other side None or any qtype. Budgets: see the module
# docstring (the value-set product) and _props_ref.value_set_error (the formats' gaps).


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=20)
@hypothesis.given(case=dot_cases(new=True))
def test_dot_general_qt_forward_new_qtypes(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=10)
@hypothesis.given(case=dot_cases(new=True, one_float=True))
def test_dot_general_qt_forward_new_qtypes_one_float_side(case):
  """A float side (float32/bfloat16/float16) times an nf4 / mxfp8 / mxfp4 one: the
  dequantized values in promote_types of the two input dtypes."""
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=8)
@hypothesis.given(case=dot_cases(new=True, force_empty=True, grads=True, nonfinite=False))
def test_dot_general_qt_new_qtypes_empty_axis(case):
  check_forward(case)
  check_backward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=15)
@hypothesis.given(case=dot_cases(new=True, force_nonfinite=True))
def test_dot_general_qt_forward_new_qtypes_nonfinite(case):
  check_forward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=dot_cases(new=True, max_size=6, max_rank=5))
def test_dot_general_qt_forward_new_qtypes_deep(case):
  check_forward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=25)
@hypothesis.given(case=dot_cases(new=True, grads=True, nonfinite=False))
def test_dot_general_qt_new_qtypes_gradients(case):
  """Gradients through nf4 / mxfp8 / mxfp4 residuals (their values, read from the table),
  the incoming gradient float or int8 / fp8 (the gradient qtypes)."""
  check_backward(case)


@pytest.mark.slow
@DEEP
@hypothesis.given(case=dot_cases(new=True, max_size=6, max_rank=5, grads=True, nonfinite=False))
def test_dot_general_qt_new_qtypes_gradients_deep(case):
  check_backward(case)


@pytest.mark.slow
@hypothesis.settings(FAST, max_examples=8)
@hypothesis.given(case=dot_cases(new=True, grads=True, nonfinite=False, clipped_absmax=True))
def test_dot_general_qt_clipped_ste_absmax_nf4_masks_nothing(case):
  """nf4 under absmax: every element is inside [-1, 1] x its scale: nothing masked."""
  check_backward(case)


# clipped_ste passes gradients up to the MX midpoint above the top element (464 / 7): an MX
# block's absmax e8m0 scale lets its largest value land in (qmax, midpoint), where it rounds to
# qmax with at most half a gap of error, like any element.
@pytest.mark.slow
@pytest.mark.parametrize("name, top", [("mxfp8", 460.0), ("mxfp4", 6.8)])
def test_dot_general_qt_clipped_ste_absmax_mx_block_top(name, top):
  cfg = C.DotGeneralQtConfig(lhs=OQ(qtype=name, estimator="clipped_ste"))
  x = jnp.asarray(np.r_[top, np.ones(31)].reshape(1, 32), jnp.float32)
  g = jax.grad(lambda x: dot_general_qt(x, jnp.ones((32, 1)), _MK.dn, cfg).sum())(x)
  np.testing.assert_array_equal(np.asarray(g), np.ones((1, 32)))


@pytest.mark.parametrize("name", S.NEW_QTYPES)
def test_dot_general_qt_new_qtypes_e2e_budget_is_attained(name):
  """The format budget is not loose: with an identity lhs each output is one weight element,
  so |out - x . w| is that element's quantization error, which on random data reaches more
  than half of half the largest gap x scale (nf4, mxfp8, mxfp4 alike)."""
  k = 64
  lay = S.DotLayout(lhs_shape=(k, k), rhs_shape=(k, 8), dn=_MK.dn)
  case = _case(lay, None, OQ(qtype=name), lv=S.Values(explicit=tuple(np.eye(k).ravel())),
               rv=S.Values(seed=3))
  ratio = check_forward(case)
  assert ratio is not None and 0.5 < ratio <= 1.0, ratio


@pytest.mark.parametrize("name", S.NEW_QTYPES)
def test_new_qtypes_as_gradient_qtypes(name):
  """The MX qtypes are gradient qtypes too (tests/ops/test_mx_gradients.py); nf4 is a forward
  format only: as a gradient qtype it raises, naming the valid ones."""
  if name in ("mxfp8", "mxfp4"):
    assert C.GradQuant(qtype=name).qtype.name == name
    return
  with pytest.raises(ValueError, match=f"GradQuant.qtype='{name}': gradients need int2..int8 or fp8"):
    C.GradQuant(qtype=name)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_dot_general_qt_mx_needs_blocks_of_32(name):
  """An MX qtype's block is 32 values of one row along the contraction: another tile size,
  per-axis tiles, channelwise=False, a contraction 32 does not divide and no contraction raise."""
  for bad in (16, 64, 0.5):
    with pytest.raises(ValueError, match=f"tile_size={bad!r} with qtype '{name}'.*or 32"):
      OQ(qtype=name, tile_size=bad)
  with pytest.raises(ValueError, match=f"with qtype '{name}': an MX block"):
    OQ(qtype=name, tile_size={0: 32})
  with pytest.raises(ValueError, match=f"channelwise=False with qtype '{name}'"):
    OQ(qtype=name, channelwise=False)
  assert OQ(qtype=name, tile_size=32) == OQ(qtype=name)
  for side in ("lhs", "rhs"):
    cfg = C.DotGeneralQtConfig(**{side: OQ(qtype=name)})
    with pytest.raises(ValueError, match=f"config.{side}.tile_size=32 does not divide the "
                                         "contracting axis of size 48"):
      dot_general_qt(jnp.ones((2, 48)), jnp.ones((48, 3)), _MK.dn, cfg)
    with pytest.raises(ValueError, match=f"config.{side}.tile_size=32 but the op contracts no axis"):
      dot_general_qt(jnp.ones((2,)), jnp.ones((3,)), (((), ()), ((), ())), cfg)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "mxfp8"])
def test_dot_general_qt_backward_epilogue_flush(name):
  """Found by test_dot_general_qt_new_qtypes_gradients_deep: a tiny incoming gradient (1e-37)
  against a weight of mixed magnitudes (1e-30 .. 1e30)."""
  lay = S.DotLayout(lhs_shape=(1, 32), rhs_shape=(1, 32, 1, 2), dn=(((0, 1), (0, 1)), ((), ())))
  check_backward(_case(lay, None, OQ(qtype=name), rv=S.Values(mode="mixed", seed=0),
                       lv=S.Values(seed=0), gv=S.Values(mode="tiny", seed=0),
                       dlhs=C.GradQuant(qtype="int8")))
