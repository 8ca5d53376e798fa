"""The XLA reference for dots over quantized operands.

``dot_general_quantized_xla(lhs, rhs, dimension_numbers, ...)`` takes each
operand as a :class:`~qtrain.core.qarray.QArray` or a float array and
computes with real low-precision arithmetic where it can:

* integer-like x integer-like (int8/int4/int2/ternary/binary, unpacked to
  int8): ``int8 x int8 -> int32``, scales applied after; exact.
* fp8 x fp8 (either kind, e4m3fn x e5m2 included): ``fp8 x fp8 -> float32``
  (each product exact in float32), scales applied after.
* integer-like x fp8: both codes in float32 (each product exact), float32
  accumulation at ``HIGHEST``, scales applied after.
* value-set (LUT) qtypes (nf4, mxfp4) x anything quantized: the codes are
  not numbers, so the LUT side's values are read from its table into float32
  (dequantize-after-codes), and the product runs as integer x fp8 does:
  float32 at ``HIGHEST``, scales after (exact for e2m1 values times int8 or
  fp8 codes; nf4's float32 values make rounded float32 products).
* MX qtypes (mxfp8, mxfp4): their 32-value blocks are group-wise scales along
  the contraction (below); mxfp8 x mxfp8 is fp8 x fp8.
* group-wise (tiled) scales along a contracting axis: the axis is split into
  (groups, tile), groups become a batch axis of the dot, each group's partial
  sum is scaled, then the groups are summed.
* zero points (asymmetric): ``(Ql - Zl)(Qr - Zr)`` is expanded into int8 dots
  of the codes and of the zero points (each exact in int32).
* one side quantized, the other float: the quantized side is dequantized into
  ``compute_dtype`` (default: the float side's dtype; the QT ops pass
  ``promote_types`` of the original operands' dtypes) and the float side cast
  to it (the Pallas W{1,2,4,8}A16 kernels do this fused). A bf16 x bf16
  product accumulates in float32 (:func:`float_dot_general`).

Scales tiled along a free axis (2-D tiles: blocks along the contraction and
along a free axis) are repeated to one per index of that axis first: they
factor out of the sum as per-channel scales do.

Where scales cannot be factored out of the contraction (a scale that varies
along a contracting axis per element, or two tiled contracting axes) both
sides are dequantized and the dot runs in float32: the same numbers as the
quantized math, without the speed.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.core import qarray, qdot
  >>> x = jax.random.normal(jax.random.key(0), (8, 64))
  >>> w = jax.random.normal(jax.random.key(1), (64, 16))
  >>> xq = qarray.quantize(x, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  >>> wq = qarray.quantize(w, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  >>> out = qdot.dot_general_quantized_xla(xq, wq, (((1,), (0,)), ((), ())),
  ...                                      preferred_element_type=jnp.float32)
  >>> out.shape
  (8, 16)
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp

from qtrain.core import _lax
from qtrain.core import qarray as qa

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def normalize_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int, *,
                                lhs_shape=None, rhs_shape=None) -> DimensionNumbers:
  """Tuples of non-negative ints, validated before any work is traced.

  Raises ValueError (naming the axes) for a malformed value, an axis out of
  range, an axis repeated within an operand's contracting or batch axes, an
  axis both contracting and batch, lhs/rhs axis counts that differ and, when
  the shapes are given, paired lhs/rhs axes of different sizes.
  """
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    axes = {k: tuple(operator.index(a) for a in v)
            for k, v in (("lc", lc), ("rc", rc), ("lb", lb), ("rb", rb))}
  except (TypeError, ValueError):
    raise ValueError(
        f"dimension_numbers={dimension_numbers!r} must be ((lhs_contract, rhs_contract), "
        "(lhs_batch, rhs_batch)) with int axes") from None
  bad = lambda msg: ValueError(f"dimension_numbers={dimension_numbers!r}: {msg}")
  ndims = {"lhs": lhs_ndim, "rhs": rhs_ndim}
  out = {}
  for k, v in axes.items():
    side, kind = ("lhs" if k[0] == "l" else "rhs"), ("contracting" if k[1] == "c" else "batch")
    nd = ndims[side]
    for a in v:
      if not -nd <= a < nd:
        raise bad(f"{side} {kind} axis {a} is out of range for {side} of rank {nd}")
    norm = tuple(a % nd for a in v)
    if len(set(norm)) != len(norm):
      raise bad(f"{side} {kind} axes {v} repeat an axis ({kind} dimensions must be distinct)")
    out[k] = norm
  for side in ("lhs", "rhs"):
    both = sorted(set(out[side[0] + "c"]) & set(out[side[0] + "b"]))
    if both:
      raise bad(f"{side} axes {both} are both contracting and batch axes")
  for kind, l, r in (("contracting", out["lc"], out["rc"]), ("batch", out["lb"], out["rb"])):
    if len(l) != len(r):
      raise bad(f"lhs has {len(l)} {kind} axes, rhs {len(r)} (they pair up one to one)")
    if lhs_shape is not None and rhs_shape is not None:
      for i, j in zip(l, r):
        if lhs_shape[i] != rhs_shape[j]:
          raise bad(f"{kind} axes lhs {i} (size {lhs_shape[i]}) and rhs {j} (size "
                    f"{rhs_shape[j]}) differ in size (shapes {tuple(lhs_shape)} and "
                    f"{tuple(rhs_shape)})")
  return ((out["lc"], out["rc"]), (out["lb"], out["rb"]))


def output_shape(lhs_shape, rhs_shape, dn: DimensionNumbers) -> tuple[int, ...]:
  """``dot_general``'s output shape: (batch..., lhs free..., rhs free...)."""
  (lc, rc), (lb, rb) = dn
  return (tuple(lhs_shape[a] for a in lb)
          + tuple(lhs_shape[a] for a in free_axes(len(lhs_shape), lc, lb))
          + tuple(rhs_shape[a] for a in free_axes(len(rhs_shape), rc, rb)))


def free_axes(ndim: int, contract, batch) -> tuple[int, ...]:
  return tuple(a for a in range(ndim) if a not in contract and a not in batch)


def is_quantized(x) -> bool:
  return isinstance(x, qa.QArray)


def float_dot_general(lhs, rhs, dn, *, precision=None, preferred_element_type=None) -> jax.Array:
  """``lax.dot_general`` of float arrays that XLA's CPU backend can always run.

  A bf16 x bf16 product with a float32 (or float64) output is rejected by
  XLA's CPU runtime for some layouts (jaxlib 0.10.2: ``UNIMPLEMENTED:
  Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32``, e.g.
  lhs (6, 9) contracting axis 0 with rhs (5, 6, 3) contracting axis 1, or a
  batch axis that is not leading). On a CPU lowering the operands are cast to
  the output dtype first: bf16 values, and products of two, are exact in
  float32, so the numbers are the same; other platforms keep the bf16 x bf16
  product (the GPU's fast path).
  """
  pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
  dot = lambda a, b: _lax.dot_general(a, b, dn, precision=precision, preferred_element_type=pet)
  if (lhs.dtype == rhs.dtype == jnp.bfloat16 and pet is not None
      and pet in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))):
    return jax.lax.platform_dependent(
        lhs, rhs, cpu=lambda a, b: dot(a.astype(pet), b.astype(pet)), default=dot)
  return dot(lhs, rhs)


def _as_dtype(x, dtype):
  return x.dequantize(dtype) if is_quantized(x) else x.astype(dtype)


def _float_dot(lhs, rhs, dn, out_dtype, compute_dtype=None, precision=None):
  """The product in float, for what no exact low-precision product serves.

  Two QArrays (integer x fp8, scales that do not factor out): both
  dequantized into float32. Otherwise both sides are brought to
  ``compute_dtype`` (a QArray dequantized into it, a float array cast to it);
  None: the float side's dtype (``promote_types`` of two float sides). The
  QT ops pass ``promote_types`` of the original operands' dtypes (see
  :mod:`qtrain.ops.qt_operand`): a QArray does not record the dtype it was
  quantized from. Accumulation in float32, then a cast to ``out_dtype``.
  """
  if is_quantized(lhs) and is_quantized(rhs):
    dtype = jnp.dtype(jnp.float32)
  elif compute_dtype is not None:
    dtype = jnp.dtype(compute_dtype)
  else:
    floats = [x.dtype for x in (lhs, rhs) if not is_quantized(x)]
    dtype = jnp.dtype(jnp.promote_types(*floats) if len(floats) == 2 else floats[0])
  lhs, rhs = _as_dtype(lhs, dtype), _as_dtype(rhs, dtype)
  if precision is None and dtype == jnp.float32:
    # Dequantized values are the quantized math's exact inputs: float32
    # products run at HIGHEST, not TF32 (the GPU default); bf16 is unaffected.
    precision = jax.lax.Precision.HIGHEST
  out = float_dot_general(lhs, rhs, dn, precision=precision, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _scale_plan(lhs: qa.QArray, rhs: qa.QArray, dn: DimensionNumbers):
  """Returns the tiled contracting pair (i, j, groups), None, or "float"."""
  (lc, rc), (lb, rb) = dn
  ls, rs = lhs.scale.shape, rhs.scale.shape
  tiled = []
  for i, j in zip(lc, rc):
    n = lhs.shape[i]
    si, sj = ls[i], rs[j]
    if (si == n and n > 1) or (sj == rhs.shape[j] and rhs.shape[j] > 1):
      return "float"  # per-element scale along a contracting axis
    if si == 1 and sj == 1:
      continue
    if si != 1 and sj != 1 and si != sj:
      return "float"
    tiled.append((i, j, max(si, sj)))
  if len(tiled) > 1:
    return "float"
  for a, n in enumerate(lhs.shape):
    if a not in lc and ls[a] not in (1, n):
      return "float"
  for a, n in enumerate(rhs.shape):
    if a not in rc and rs[a] not in (1, n):
      return "float"
  return tiled[0] if tiled else None


def _per_index_free_scales(q: qa.QArray, contract) -> qa.QArray:
  """``q`` with scales (and zero points) tiled along a non-contracting axis repeated to one per
  index of it (2-D tiles: blocks along a free axis too). The same numbers: a scale that does
  not vary along the contraction factors out of the sum whatever its layout, so the product
  keeps its low-precision path."""
  s, z = q.scale, q.zero_point
  for a, n in enumerate(q.shape):
    if a not in contract and s.shape[a] not in (1, n):
      s = jnp.repeat(s, n // s.shape[a], axis=a)
      z = None if z is None else jnp.repeat(z, n // z.shape[a], axis=a)
  if s is q.scale:
    return q
  return qa.QArray(qvalue=q.qvalue, scale=s, zero_point=z, qtype=q.qtype)


def _split_axis(x: jax.Array, axis: int, groups: int) -> jax.Array:
  """(.., n, ..) -> (groups, .., n // groups, ..): the group axis moved first."""
  shape = x.shape
  x = x.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _out_scale(s, batch, contract, free_self, n_free_other, *, self_is_lhs, grouped):
  """Arranges an operand's scale in the dot's output layout.

  The output of ``dot_general`` is ``(batch..., lhs free..., rhs free...)``,
  with a leading group axis when ``grouped`` (axis 0 of ``s`` then).
  Contracting axes of ``s`` have size 1 here and are dropped.
  """
  lead = (0,) if grouped else ()
  t = jnp.transpose(s, lead + tuple(batch) + tuple(free_self) + tuple(contract))
  nb = len(lead) + len(batch)
  t = t.reshape(t.shape[:nb + len(free_self)])
  if self_is_lhs:
    return t.reshape(t.shape + (1,) * n_free_other)
  return t.reshape(t.shape[:nb] + (1,) * n_free_other + t.shape[nb:])


def _int_terms(lhs: qa.QArray, rhs: qa.QArray):
  """(sign, lhs_int8, rhs_int8) terms of (Ql - Zl)(Qr - Zr)."""
  def codes(q):
    out = [(1, qa.values_of(q) if q.qtype.is_lut else q.qvalue)]
    if q.zero_point is not None:
      out.append((-1, qa.expand_scale(q.zero_point, q.shape).astype(q.qvalue.dtype) *
                  jnp.ones(q.shape, q.qvalue.dtype)))
    return out
  return [(sl * sr, a, b) for sl, a in codes(lhs) for sr, b in codes(rhs)]


def gemm_layout(ndim: int, contract, batch) -> tuple[int, ...]:
  """The axis order (batch..., free..., contracting...) of one dot operand.

  cuBLAS runs int8 (and fp8) GEMMs at full speed only with both operands
  K-minor ("TN"); with the contracting axes last in both operands, the dot's
  output layout is unchanged and XLA needs no layout copy of its own.
  """
  return tuple(batch) + free_axes(ndim, contract, batch) + tuple(contract)


def _gemm_dims(lhs_ndim: int, rhs_ndim: int, nb: int, nc: int) -> DimensionNumbers:
  """Dimension numbers of two operands already in :func:`gemm_layout`."""
  return ((tuple(range(lhs_ndim - nc, lhs_ndim)), tuple(range(rhs_ndim - nc, rhs_ndim))),
          (tuple(range(nb)), tuple(range(nb))))


# Low-precision products reach XLA with their contraction padded to a multiple of K_MULTIPLE and
# the last free axis of each operand to a multiple of FREE_MULTIPLE (see pad_for_gemm).
K_MULTIPLE = 64
FREE_MULTIPLE = 16


def pad_contraction(a: jax.Array, b: jax.Array, lc, rc) -> tuple[jax.Array, jax.Array]:
  """Zero-pads the last contracting axis of both operands so the contraction's length is a
  multiple of :data:`K_MULTIPLE` (exact: the added products are 0)."""
  lc, rc = tuple(lc), tuple(rc)
  if not lc:
    return a, b
  k = math.prod(a.shape[i] for i in lc)
  if k == 0 or k % K_MULTIPLE == 0:
    return a, b
  last = a.shape[lc[-1]]
  step = K_MULTIPLE // math.gcd(k // last, K_MULTIPLE)
  pad = -last % step
  widths = lambda x, axis: [(0, pad) if i == axis else (0, 0) for i in range(x.ndim)]
  return jnp.pad(a, widths(a, lc[-1])), jnp.pad(b, widths(b, rc[-1]))


def pad_for_gemm(a: jax.Array, b: jax.Array, dimension_numbers):
  """``(a, b, unpad)``: the operands of a low-precision ``dot_general`` zero-padded for XLA's
  GPU GEMMs, and the function that cuts the product back to its true shape (exact: padded
  rows and columns are sliced off, padded contraction terms are 0).

  XLA's GPU Triton int8 GEMM returns twice the true int8 x int8 -> int32 product for shapes
  it does not tile evenly (jax 0.11.2, H200, plain int8 inputs): contractions that are short
  and not a multiple of 4 (K = 2, 3, 5, 6, 7, 9..15 and 33..39 of those measured), a
  contraction XLA split into pieces that are not (432 split 8 ways into 54), and free axes of
  9 or 10. The contraction is padded to a multiple of :data:`K_MULTIPLE` (every split XLA
  picks is then a multiple of 4) and each operand's last free axis to a multiple of
  :data:`FREE_MULTIPLE`; on shapes already aligned (model widths) nothing changes.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  a, b = pad_contraction(a, b, lc, rc)
  lfree, rfree = free_axes(a.ndim, lc, lb), free_axes(b.ndim, rc, rb)

  def pad_last_free(x, free):
    if not free or x.shape[free[-1]] % FREE_MULTIPLE == 0:
      return x, None
    n = x.shape[free[-1]]
    widths = [(0, -n % FREE_MULTIPLE) if i == free[-1] else (0, 0) for i in range(x.ndim)]
    return jnp.pad(x, widths), n

  a, ln = pad_last_free(a, lfree)
  b, rn = pad_last_free(b, rfree)

  def unpad(out: jax.Array) -> jax.Array:
    # The product's axes: (batch..., lhs free..., rhs free...).
    if ln is not None:
      out = jax.lax.slice_in_dim(out, 0, ln, axis=len(lb) + len(lfree) - 1)
    if rn is not None:
      out = jax.lax.slice_in_dim(out, 0, rn, axis=out.ndim - 1)
    return out

  return a, b, unpad


def dot_general_quantized_xla(
    lhs, rhs, dimension_numbers, *, preferred_element_type, precision=None, transpose=None,
    compute_dtype=None,
) -> jax.Array:
  """Dot over QArray/float operands with real low-precision arithmetic.

  Args:
    lhs, rhs: :class:`~qtrain.core.qarray.QArray` or float arrays.
    dimension_numbers: as for :func:`jax.lax.dot_general`.
    preferred_element_type: the (float) output dtype.
    precision: passed to float dots.
    transpose: ``f(x, perm)`` that puts the low-precision operands of a
      quantized product into :func:`gemm_layout` before the dot, or None to
      hand XLA the operands as they are. :mod:`qtrain.ops.dispatch`
      passes a materialized Pallas transpose on a GPU (XLA's layout
      assignment cannot turn it back into a layout change) and
      ``jnp.transpose`` elsewhere.
    compute_dtype: the float dtype of a product with a float side (the
      quantized side dequantized into it, the float side cast to it); None:
      the float side's dtype. Two QArrays ignore it (int32 / float32
      accumulation, or float32 where the scales do not factor out).

  Returns:
    The product in ``preferred_element_type``.
  """
  out_dtype = jnp.dtype(preferred_element_type)
  dn = normalize_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim,
                                   lhs_shape=lhs.shape, rhs_shape=rhs.shape)
  if math.prod(lhs.shape) == 0 or math.prod(rhs.shape) == 0:  # an empty sum (K = 0) is 0
    return jnp.zeros(output_shape(lhs.shape, rhs.shape, dn), out_dtype)
  if not (is_quantized(lhs) and is_quantized(rhs)):
    return _float_dot(lhs, rhs, dn, out_dtype, compute_dtype, precision)
  (lc0, rc0), _ = dn
  lhs, rhs = _per_index_free_scales(lhs, lc0), _per_index_free_scales(rhs, rc0)
  plan = _scale_plan(lhs, rhs, dn)
  if plan == "float":
    return _float_dot(lhs, rhs, dn, out_dtype, compute_dtype, precision)
  (lc, rc), (lb, rb) = dn
  lfree, rfree = free_axes(lhs.ndim, lc, lb), free_axes(rhs.ndim, rc, rb)
  # An integer x fp8 pair has no low-precision GEMM: its codes multiply in float32, where each
  # product is exact (<= 8 + 4 significant bits), and the scales apply after, as for a pair of
  # one kind (dequantizing first could overflow where the scaled product does not).
  lut = lhs.qtype.is_lut or rhs.qtype.is_lut
  mixed = lut or lhs.qtype.is_float != rhs.qtype.is_float
  acc_dtype = jnp.float32 if lut or lhs.qtype.is_float or rhs.qtype.is_float else jnp.int32
  ls, rs = lhs.scale, rhs.scale
  terms = _int_terms(lhs, rhs)
  grouped = plan is not None
  if grouped:
    i, j, g = plan
    # The group axis goes first; every old axis a moves to a + 1 (the split
    # axis itself becomes the tile axis at i + 1, still contracted).
    terms = [(sg, _split_axis(a, i, g), _split_axis(b, j, g)) for sg, a, b in terms]
    ls = _group_scale(ls, i, g)
    rs = _group_scale(rs, j, g)
    up = lambda axes: tuple(a + 1 for a in axes)
    dn2 = ((up(lc), up(rc)), ((0,) + up(lb), (0,) + up(rb)))
    ls_o = _out_scale(ls, up(lb), up(lc), up(lfree), len(rfree), self_is_lhs=True, grouped=True)
    rs_o = _out_scale(rs, up(rb), up(rc), up(rfree), len(lfree), self_is_lhs=False, grouped=True)
  else:
    dn2 = dn
    ls_o = _out_scale(ls, lb, lc, lfree, len(rfree), self_is_lhs=True, grouped=False)
    rs_o = _out_scale(rs, rb, rc, rfree, len(lfree), self_is_lhs=False, grouped=False)
  if transpose is not None:
    # Both operands in GEMM layout (contracting axes minor); the output's axes
    # are (batch, lhs free, rhs free) in their original order either way.
    (lc2, rc2), (lb2, rb2) = dn2
    lperm = gemm_layout(terms[0][1].ndim, lc2, lb2)
    rperm = gemm_layout(terms[0][2].ndim, rc2, rb2)
    def to_gemm(x, perm):
      return x if perm == tuple(range(x.ndim)) else transpose(x, perm)
    terms = [(sg, to_gemm(a, lperm), to_gemm(b, rperm)) for sg, a, b in terms]
    dn2 = _gemm_dims(len(lperm), len(rperm), len(lb2), len(lc2))
  unpad = lambda t: t
  if not mixed:
    padded = [(sg, *pad_for_gemm(a, b, dn2)) for sg, a, b in terms]
    terms, unpad = [(sg, a, b) for sg, a, b, _ in padded], padded[0][3]
  # Materialize the int8/fp8 operands: XLA's GPU Triton GEMM fusion pulls the
  # quantize ops into the GEMM's prologue and was measured (jax 0.11.2, H200)
  # returning 2x results under jit.
  terms = [(sg, *_lax.optimization_barrier((a, b))) for sg, a, b in terms]
  acc = None
  for sg, a, b in terms:
    if mixed:
      t = _lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dn2,
                           precision=jax.lax.Precision.HIGHEST, preferred_element_type=acc_dtype)
    else:
      t = unpad(_lax.dot_general(a, b, dn2, preferred_element_type=acc_dtype))
    acc = t if acc is None else (acc + t if sg > 0 else acc - t)
  return scale_product(acc, ls_o, rs_o, grouped=grouped, out_dtype=out_dtype)


def scale_product(acc: jax.Array, ls_o: jax.Array, rs_o: jax.Array, *, grouped: bool,
                  out_dtype) -> jax.Array:
  """The epilogue of a quantized product: ``(acc * ls_o) * rs_o`` in float32
  (summed over the leading group axis when ``grouped``), cast to ``out_dtype``.
  ``ls_o`` / ``rs_o`` are the operands' scales in the output layout.

  Where ``(acc * ls_o) * rs_o`` is not finite, or 0 for a nonzero ``acc``,
  ``acc * (ls_o * rs_o)`` is used instead: ``acc * ls_o`` overflows (or
  flushes to 0) when one scale is huge (tiny) and the other small (large)
  although the product is moderate. Finite results are bit-identical to
  ``(acc * ls_o) * rs_o`` (the Pallas kernels' epilogues compute the same, without the
  flush fallback); NaN scales and products beyond float32 stay NaN / inf.
  """
  accf = acc.astype(jnp.float32)
  out = accf * ls_o * rs_o
  # (acc * ls) can also flush to 0 where the product is normal (a folded 2**-e scale on a tiny
  # gradient's 2**-126 scale, fp8 subnormal codes): the other order then, as for an overflow.
  out = jnp.where(jnp.isfinite(out) & ((out != 0) | (accf == 0)), out, accf * (ls_o * rs_o))
  if grouped:
    out = jnp.sum(out, axis=0)
  return out.astype(out_dtype)


def _group_scale(s: jax.Array, axis: int, groups: int) -> jax.Array:
  """Scale with 1 or ``groups`` entries along ``axis`` -> a leading group axis
  (size ``groups`` or 1) and size 1 at ``axis + 1`` (the tile axis)."""
  s = jnp.expand_dims(s, axis + 1)  # (.., g_or_1, 1, ..)
  return jnp.moveaxis(s, axis, 0)
