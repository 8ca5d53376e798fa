"""``conv_general_qt``: a quantized-training convolution as a ``jax.custom_vjp``.

Forward: the input (``lhs``) and kernel (``rhs``) are quantized per their
:class:`~qtrain.ops.config.OperandQuant` — the input with one scale per
batch element (``channelwise``) or per tensor, the kernel with one scale per
output feature — and the convolution runs on the quantized values as a
matrix product (:mod:`qtrain.ops.im2col`): patches of the input's codes
(padding reads the code 0, so it contributes exactly 0 for every qtype)
times the kernel's codes as a matrix, through
:func:`qtrain.ops.dispatch.quantized_dot_general` — int8 x int8 -> int32 or
fp8 x fp8 -> f32, exact, scales after; on a GPU the int8 GEMM or a Pallas
kernel where ``implementation`` picks one. With ``implementation="auto"`` a CUDA
lowering runs two integer-coded operands as XLA's convolution of the codes instead
(cuDNN's int8 convolution: the same exact sums, no patches in memory), and the
backward products whose gradient is not quantized as XLA's convolution transposes
(:func:`direct_forward`, :func:`direct_float_grads`). Strides, padding, dilations,
feature groups (a batch axis of the product) and any layout (NHWC, NCHW,
...) are supported.

Backward: the residuals are kept quantized (int8/fp8 + scales) and the two
gradients are :func:`~qtrain.ops.dot_general_qt.dot_general_qt`'s backward
products of that matrix product: ``d patches = g . kernel`` and ``d kernel =
patches . g`` with the incoming gradient quantized per ``dlhs_grad`` /
``drhs_grad`` after the residual's scale is folded into it (one gradient
scale per output position for the input's gradient, per output feature for
the kernel's; stochastic rounding included), so all three products run in
int8 (or fp8). The input's gradient is the patches' gradient summed back
over the windows (in float32). A convolution is therefore exactly the dense
QT layer applied to its patches.

``batch_group_count > 1`` (a form the transposes of grouped convolutions
take, rarely written by hand) keeps XLA's convolution: quantized values
convolved exactly, and a float32 backward of the dequantized residuals with
the incoming gradient fake-quantized per batch element (``dlhs_grad``) and
per output feature (``drhs_grad``); a forced kernel implementation raises there.

A quantized operand whose scale varies over spatial axes (a passed-in scale)
or that has a zero point is dequantized into float32 before its patches are
taken (a zero point is not the code 0 that padding reads).

Dtypes follow the policy of :mod:`qtrain.ops.qt_operand`, as
:func:`~qtrain.ops.dot_general_qt.dot_general_qt` does: the output is
``preferred_element_type`` or ``result_type(lhs, rhs)``; a float operand times
a quantized one multiplies in ``promote_types(lhs.dtype, rhs.dtype)`` (weight-only
int8 under a bf16 ``nn.Conv`` is a bf16 product accumulated in float32);
two quantized operands multiply exactly (int8 -> int32, fp8 -> float32, mixed
fp8 kinds included); gradients come back in each operand's dtype.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import qtrain.ops as qops
  >>> cfg = qops.ConvGeneralQtConfig(lhs=qops.OperandQuant(qtype="int8"),
  ...                              rhs=qops.OperandQuant(qtype="int8"))
  >>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  >>> w = jax.random.normal(jax.random.key(1), (3, 3, 3, 4))
  >>> y = qops.conv_general_qt(x, w, (1, 1), "SAME", config=cfg,
  ...     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> y.shape
  (2, 8, 8, 4)
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from qtrain.core import _lax
from qtrain.core import qdot
from qtrain.ops import config as cfg_lib
from qtrain.ops import dispatch
from qtrain.ops import im2col
from qtrain.ops import qt_operand as dqt
from qtrain.ops.dot_general_qt import _with_zero_point, backward_product


def _conv(lhs, rhs, p, preferred_element_type):
  return _lax.conv_general_dilated(
      lhs, rhs, p["window_strides"], p["padding"], lhs_dilation=p["lhs_dilation"],
      rhs_dilation=p["rhs_dilation"], dimension_numbers=p["dn"],
      feature_group_count=p["feature_group_count"], batch_group_count=p["batch_group_count"],
      precision=p["precision"], preferred_element_type=preferred_element_type)


def _low_precision_conv(a, b, p, *, is_float: bool, backend: str | None = None) -> jax.Array:
  """Convolution of quantized values, accumulated exactly, as float32.

  On the CPU: int8 x int8 -> int32 (fp8 x fp8 -> f32) in XLA; two fp8 kinds
  (e4m3fn x e5m2), which XLA's convolution does not mix, are convolved as
  float32 (every fp8 value, and every product of two, is exact in float32).
  XLA's GPU backend lowers no integer convolution with an integer output, so
  elsewhere the quantized values are convolved as float32 at HIGHEST precision.
  For integer codes XLA's GPU backend recognizes that form (a convolution of
  int8 values converted to float32) and runs cuDNN's int8 convolution, whose
  int32 accumulation is exact; where cuDNN has none for the geometry it stays a
  float32 convolution, where every product of int8 values is exact and so is
  the sum while it stays below 2**24 in magnitude (guaranteed for windows of up
  to 1040 int8 x int8 values, or 2**24 binary ones; beyond that, only the last
  float32 bit can differ). ``backend`` (default: ``jax.default_backend()``)
  picks the path.
  """
  p = dict(p, precision=None)
  on_cpu = (backend or jax.default_backend()) == "cpu"
  if on_cpu or is_float:
    # fp8 codes stay materialized in front of the float32 convolution (no convert fused into it).
    a, b = _lax.optimization_barrier((a, b))
  if on_cpu:
    if a.dtype != b.dtype:
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return _conv(a, b, p, jnp.float32 if is_float else jnp.int32).astype(jnp.float32)
  p["precision"] = jax.lax.Precision.HIGHEST
  return _conv(a.astype(jnp.float32), b.astype(jnp.float32), p, jnp.float32)


def operand_dtype(lq, rq, compute_dtype=None) -> jnp.dtype:
  """The dtype :func:`quantized_conv`'s float path brings both operands to:
  float32 for two QArrays; else ``compute_dtype`` (default: the float side's
  dtype, ``promote_types`` of two float sides)."""
  if qdot.is_quantized(lq) and qdot.is_quantized(rq):
    return jnp.dtype(jnp.float32)
  if compute_dtype is not None:
    return jnp.dtype(compute_dtype)
  floats = [x.dtype for x in (lq, rq) if not qdot.is_quantized(x)]
  return jnp.dtype(jnp.promote_types(*floats) if len(floats) == 2 else floats[0])


def _as_dtype(x, dtype):
  return x.dequantize(dtype) if qdot.is_quantized(x) else x.astype(dtype)


def _as_matmul(p) -> bool:
  """Whether the convolution runs as patches x kernel matrix (see the module docstring)."""
  return p["batch_group_count"] == 1


def _codes_factor(lq, rq, p) -> bool:
  """Whether two QArrays convolve exactly on their values with the scales applied after: the
  same kind of values (integer or float; no LUT qtype), no zero point, the input's scale
  varying (at most) along its batch axis and the kernel's along its output-feature axis (a
  passed-in scale may vary elsewhere, e.g. per input channel)."""
  lhs_spec, rhs_spec, _ = p["dn"]
  varies_only = lambda s, axis: all(n == 1 for a, n in enumerate(s.shape) if a != axis)
  return (qdot.is_quantized(lq) and qdot.is_quantized(rq)
          and lq.qtype.is_float == rq.qtype.is_float and not lq.qtype.is_lut
          and not rq.qtype.is_lut and lq.zero_point is None and rq.zero_point is None
          and varies_only(lq.scale, lhs_spec[0]) and varies_only(rq.scale, rhs_spec[0]))


def direct_forward(lq, rq, p) -> bool:
  """Whether ``implementation="auto"`` runs this forward as XLA's own convolution of the codes
  on a CUDA lowering (cuDNN's int8 implicit GEMM; exact, the numbers of the matrix product):
  two integer-coded QArrays whose scales factor out (:func:`_codes_factor`), one feature group,
  concrete shapes. fp8 codes, groups and everything else take the matrix product."""
  return (_as_matmul(p) and p["feature_group_count"] == 1 and _codes_factor(lq, rq, p)
          and not lq.qtype.is_float and not _lax.has_symbolic_dim(lq.shape, rq.shape))


def quantized_conv(lq, rq, p, out_dtype, compute_dtype=None, implementation: str = "xla"):
  """Convolution over QArray/float operands (``p``: the conv's static parameters).

  As a matrix product of the input's patches and the kernel
  (:mod:`qtrain.ops.im2col`) on :func:`~qtrain.ops.dispatch.quantized_dot_general`
  with ``implementation``: exact low-precision arithmetic where both operands
  are quantized and their scales factor out (input per batch element or per
  tensor, kernel per output feature or per tensor); otherwise as dispatch
  multiplies (two QArrays whose scales do not factor: float32; a float side:
  ``compute_dtype``, the quantized side dequantized into it), accumulated in
  float32. With ``implementation="auto"`` a CUDA lowering runs two integer-coded
  operands (:func:`direct_forward`) as XLA's convolution of the codes instead: cuDNN's
  int8 convolution, the same exact sums without the patches in memory.
  ``batch_group_count > 1``: XLA's convolution (see the module docstring).
  :mod:`qtrain.freeze` calls it so frozen inference reproduces training's arithmetic.
  """
  both = qdot.is_quantized(lq) and qdot.is_quantized(rq)
  if _as_matmul(p):
    def as_matmul():
      geo = im2col.geometry(lq.shape, rq.shape, p)
      a, b = im2col.patches_operand(lq, geo), im2col.kernel_operand(rq, geo)
      y = dispatch.quantized_dot_general(
          a, b, geo.dot_dimension_numbers(), preferred_element_type=out_dtype,
          implementation=implementation, compute_dtype=jnp.float32 if both else compute_dtype)
      return im2col.output_layout(y, geo)
    if implementation == "auto" and direct_forward(lq, rq, p):
      return jax.lax.platform_dependent(
          cuda=lambda: _xla_conv(lq, rq, p, out_dtype, backend="gpu"), default=as_matmul)
    return as_matmul()
  if implementation not in ("xla", "auto"):
    raise ValueError(f"implementation={implementation!r}: a convolution with batch_group_count="
                     f"{p['batch_group_count']} runs as XLA's convolution, not as a matrix product "
                     f"a kernel could take; use implementation='xla' or 'auto'")
  return _xla_conv(lq, rq, p, out_dtype, compute_dtype)


def _xla_conv(lq, rq, p, out_dtype, compute_dtype=None, backend: str | None = None):
  """XLA's convolution of QArray/float operands (``batch_group_count > 1``, and
  :func:`direct_forward`'s convolutions on a GPU). ``backend``: as for
  :func:`_low_precision_conv`."""
  lhs_spec, rhs_spec, out_spec = p["dn"]
  # Scales that do not factor out (or a LUT qtype, whose codes are not numbers): the
  # dequantized operands are convolved in float32 below.
  if _codes_factor(lq, rq, p):
    acc = _low_precision_conv(lq.qvalue, rq.qvalue, p, is_float=lq.qtype.is_float,
                              backend=backend)
    nd = acc.ndim
    def to_out(s, axis_in, axis_out):
      v = s.reshape(-1)  # varies along axis_in only (or is one value)
      shape = [1] * nd
      shape[axis_out] = v.shape[0]
      return v.reshape(shape)
    # lhs scale varies (at most) along the batch axis, rhs along the output-feature axis.
    ls = to_out(lq.scale, lhs_spec[0], out_spec[0])
    rs = to_out(rq.scale, rhs_spec[0], out_spec[1])
    # The dot's epilogue: (acc * ls) * rs, or acc * (ls * rs) where that overflows.
    return qdot.scale_product(acc, ls, rs, grouped=False, out_dtype=out_dtype)
  dtype = operand_dtype(lq, rq, compute_dtype)
  lf, rf = _as_dtype(lq, dtype), _as_dtype(rq, dtype)
  if p["precision"] is None and dtype == jnp.float32:
    p = dict(p, precision=jax.lax.Precision.HIGHEST)  # float32 math, not TF32 on GPUs
  return _conv(lf, rf, p, jnp.float32).astype(out_dtype)


@dqt.traced_once(static_argnums=(4, 5, 6))
def _forward(lhs, rhs, lhs_scale, rhs_scale, p, config, out_dtype):
  lhs_spec, rhs_spec, _ = p["dn"]
  # Per-batch-element input scales only when batch elements map to themselves.
  lhs_channels = (lhs_spec[0],) if p["batch_group_count"] == 1 else ()
  lres = dqt.quantize_operand(lhs, config.lhs, lhs_scale, lhs_channels, None, "lhs")
  rres = dqt.quantize_operand(rhs, config.rhs, rhs_scale, (rhs_spec[0],), None, "rhs")
  if config.lhs is None and config.rhs is None:
    # Nothing quantized: jax.lax.conv_general_dilated itself (which, unlike dot_general, takes
    # no mixed float dtypes), as dot_general_qt's unquantized forward is lax.dot_general.
    return _conv(lhs, rhs, p, out_dtype), (lres, rres)
  ctype = dqt.compute_dtype(lhs.dtype, rhs.dtype)
  return (quantized_conv(lres.value, rres.value, p, out_dtype, ctype, config.implementation),
          (lres, rres))


def _fake_grad(g, gq, key, channel_axes):
  if gq is None:
    return g.astype(jnp.float32)
  if gq.qtype.is_mx:  # blocks of 32 along the other axes, flattened (the product's contraction)
    v = dqt.quantize_mx_grad(g, gq, [a for a in range(g.ndim) if a not in channel_axes], key)
    return v.dequantize(jnp.float32) if qdot.is_quantized(v) else v
  return dqt.quantize_grad(g, gq, channel_axes, key).dequantize(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _conv_qt(lhs, rhs, lhs_scale, rhs_scale, kd, p, config, out_dtype, meta):
  return _forward(lhs, rhs, lhs_scale, rhs_scale, p, config, out_dtype)[0]


def _fwd(lhs, rhs, lhs_scale, rhs_scale, kd, p, config, out_dtype, meta):
  out, res = _forward(lhs, rhs, lhs_scale, rhs_scale, p, config, out_dtype)
  return out, (*res, kd)


@dqt.traced_once(static_argnums=(0, 1, 2, 3))
def _bwd(p, config, out_dtype, meta, res, g):
  lres, rres, kd = res
  ldtype, rdtype, varying = meta
  k_l, k_r = dqt.split_key(kd, (config.dlhs_grad, config.drhs_grad))
  if _as_matmul(p):
    dtypes = (ldtype, rdtype)
    patches = lambda: _matmul_grads(p, config, lres, rres, g, k_l, k_r, dtypes)
    direct_l, direct_r = direct_float_grads(p, config, lres, rres, g)
    if direct_l or direct_r:
      def cuda():
        pl, pr = _matmul_grads(p, config, lres, rres, g, k_l, k_r, dtypes,
                               need=(not direct_l, not direct_r))
        tl, tr = _transposed_conv_grads(p, lres, rres, g, dtypes, need=(direct_l, direct_r))
        return (tl if direct_l else pl), (tr if direct_r else pr)
      lhs_bar, rhs_bar = jax.lax.platform_dependent(cuda=cuda, default=patches)
    else:
      lhs_bar, rhs_bar = patches()
  else:
    lhs_bar, rhs_bar = _xla_conv_grads(p, config, lres, rres, g, k_l, k_r, (ldtype, rdtype))
  lhs_bar, ls_bar = dqt.finish_operand_grad(lhs_bar, lres, config.lhs, ldtype)
  rhs_bar, rs_bar = dqt.finish_operand_grad(rhs_bar, rres, config.rhs, rdtype)
  return (*dqt.typed_like_operands((lhs_bar, rhs_bar, ls_bar, rs_bar), varying), None)


def direct_float_grads(p, config, lres, rres, g) -> tuple[bool, bool]:
  """Which backward products ``implementation="auto"`` runs as XLA's transposes of the
  convolution (cuDNN's dgrad / wgrad) on a CUDA lowering, rather than on the patches: those
  whose gradient is not quantized (``dlhs_grad`` / ``drhs_grad`` None), when each residual is
  float or keeps its codes on the patches (:func:`qtrain.ops.im2col.keeps_codes`: the other
  factor is then the residual dequantized into the product's dtype, as on the patches); no
  learned scale (its gradient needs the float32 product); one feature group; concrete shapes."""
  a, b = lres.value, rres.value
  lhs_spec, rhs_spec, _ = p["dn"]
  plain = lambda v, spatial: not qdot.is_quantized(v) or im2col.keeps_codes(v, spatial)
  ok = (config.implementation == "auto" and p["feature_group_count"] == 1
        and lres.given_scale is None and rres.given_scale is None
        and plain(a, lhs_spec[2:]) and plain(b, rhs_spec[2:])
        and not _lax.has_symbolic_dim(a.shape, b.shape, g.shape))
  return ok and config.dlhs_grad is None, ok and config.drhs_grad is None


def _transposed_conv_grads(p, lres, rres, g, dtypes, need=(True, True)):
  """The float backward products as XLA's transposes of the convolution: the incoming
  gradient times the other residual, both in the product's dtype (``promote_types`` of the
  gradient's and that operand's original dtype, as on the patches; float32 products at
  HIGHEST precision), accumulated in float32 and rounded once. Returns the input's gradient
  in float32 and the kernel's in its own dtype (what :func:`_matmul_grads` returns)."""
  ldtype, rdtype = dtypes
  a_val, b_val = lres.value, rres.value
  def product_conv(other_dtype):
    ct = dqt.compute_dtype(g.dtype, other_dtype)
    q = dict(p, precision=jax.lax.Precision.HIGHEST if ct == jnp.float32 and p["precision"] is None
             else p["precision"])
    return ct, lambda a, b: _conv(a, b, q, None)
  # Inside shard_map both factors are typed as varying over the mesh axes the incoming gradient
  # varies over, so the transposes give per-shard cotangents as the patches' products do (the
  # caller sums a replicated operand's over shards); JAX's vjp of an invariant primal would sum
  # them itself. The products are linear: the transposed factor's value is never read.
  axes = dqt.varying_axes(g)
  vary = lambda x: dqt.match_varying(x, axes | dqt.varying_axes(x))
  lhs_bar = rhs_bar = None
  if need[0]:
    ct, conv = product_conv(rdtype)
    w = vary(_as_dtype(b_val, ct))
    _, vjp = jax.vjp(lambda x: conv(x, w), vary(jnp.zeros(a_val.shape, ct)))
    lhs_bar = vjp(g.astype(ct))[0].astype(jnp.float32)
  if need[1]:
    ct, conv = product_conv(ldtype)
    x = vary(_as_dtype(a_val, ct))
    _, vjp = jax.vjp(lambda w: conv(x, w), vary(jnp.zeros(b_val.shape, ct)))
    rhs_bar = vjp(g.astype(ct))[0].astype(rdtype)
  return lhs_bar, rhs_bar


def _matmul_grads(p, config, lres, rres, g, k_l, k_r, dtypes, need=(True, True)):
  """dot_general_qt's backward products of patches x kernel matrix; the
  patches' gradient summed back over the windows in float32. ``need``: which of the two
  (None for the other)."""
  ldtype, rdtype = dtypes
  a_val, b_val = lres.value, rres.value
  geo = im2col.geometry(a_val.shape, b_val.shape, p)
  a, b = im2col.patches_operand(a_val, geo), im2col.kernel_operand(b_val, geo)
  gm = im2col.product_layout(g, geo)
  dn = geo.dot_dimension_numbers()
  (lc, rc), (lb, rb) = dn
  # A residual dequantized for its patches (a zero point, a spatial scale) was
  # float32 in the forward's product: so is the other factor here.
  ydt = lambda q, v, dtype: jnp.float32 if qdot.is_quantized(q) and not qdot.is_quantized(v) else dtype
  lhs_bar = rhs_bar = None
  if need[0]:
    dp = backward_product(gm, b, dn, a.ndim, swap_ans=False, gq=config.dlhs_grad, key=k_l,
                          implementation=config.implementation, x_shape=a.shape,
                          out_dtype=jnp.float32, y_dtype=ydt(b_val, b, rdtype))
    lhs_bar = im2col.patches_transpose(dp, geo, a_val.shape)
  if need[1]:
    # As dot_general_qt: the kernel's gradient in its own dtype unless a learned
    # scale needs float32 (the same numbers: one rounding at the end either way).
    w_dtype = rdtype if rres.given_scale is None else jnp.float32
    dw = backward_product(gm, a, ((rc, lc), (rb, lb)), b.ndim, swap_ans=True,
                          gq=config.drhs_grad, key=k_r, implementation=config.implementation,
                          x_shape=b.shape, out_dtype=w_dtype, y_dtype=ydt(a_val, a, ldtype))
    rhs_bar = im2col.kernel_from_matrix(dw, geo, b_val.shape)
  return lhs_bar, rhs_bar


def _xla_conv_grads(p, config, lres, rres, g, k_l, k_r, dtypes):
  """The float32 backward of XLA's convolution (``batch_group_count > 1``)."""
  ldtype, rdtype = dtypes
  _, _, out_spec = p["dn"]
  # The values the forward multiplied (_xla_conv's float path rounds a
  # dequantized operand into the compute dtype; its exact path is float32-exact),
  # then float32 math.
  fwd_dtype = operand_dtype(lres.value, rres.value, dqt.compute_dtype(ldtype, rdtype))
  lf = _as_dtype(lres.value, fwd_dtype).astype(jnp.float32)
  rf = _as_dtype(rres.value, fwd_dtype).astype(jnp.float32)
  # dlhs: per-batch-element gradient scales; drhs: per-output-feature.
  g_l = _fake_grad(g, config.dlhs_grad, k_l, (out_spec[0],))
  g_r = _fake_grad(g, config.drhs_grad, k_r, (out_spec[1],))
  exact = dict(p, precision=jax.lax.Precision.HIGHEST)  # float32 math, not TF32 on GPUs
  _, vjp_l = jax.vjp(lambda a: _conv(a, rf, exact, jnp.float32), lf)
  _, vjp_r = jax.vjp(lambda b: _conv(lf, b, exact, jnp.float32), rf)
  (lhs_bar,), (rhs_bar,) = vjp_l(g_l), vjp_r(g_r)
  return lhs_bar, rhs_bar


_conv_qt.defvjp(_fwd, _bwd)


def _hashable_padding(padding):
  if isinstance(padding, str):
    return padding
  return tuple(tuple(int(v) for v in pair) for pair in padding)


def conv_general_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
    *,
    config: cfg_lib.ConvGeneralQtConfig,
    key: jax.Array | None = None,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    lhs_zero_point: jax.Array | None = None,
    rhs_zero_point: jax.Array | None = None,
) -> jax.Array:
  """Quantized-training ``jax.lax.conv_general_dilated`` (same positional args).

  Args:
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
      dimension_numbers, feature_group_count, batch_group_count, precision,
      preferred_element_type: as for :func:`jax.lax.conv_general_dilated`.
    config: a :class:`~qtrain.ops.config.ConvGeneralQtConfig`.
    key: PRNG key for stochastic rounding of gradients.
    lhs_scale, rhs_scale: optional static or learned scales.
    lhs_zero_point, rhs_zero_point: the zero point of a passed-in scale (an asymmetric static
      scale; integer qtypes), as :func:`~qtrain.ops.dot_general_qt.dot_general_qt` takes it.

  The arguments are checked as :func:`jax.lax.conv_general_dilated` checks
  them (shapes, layouts, feature counts), before anything is quantized. An
  operand with no elements (an empty batch, zero features) gives zeros of the
  output shape, as the lax op does, and zero (or empty) gradients.

  Raises:
    ValueError: for a bad config (naming the field), non-float operands or
      ``preferred_element_type``, a forced kernel implementation that cannot
      take the convolution's product (the message says why; at trace time),
      lax's own errors for bad conv arguments.
  """
  if not isinstance(config, cfg_lib.ConvGeneralQtConfig):
    raise ValueError(f"config must be a ConvGeneralQtConfig, got {type(config).__name__}")
  out_dtype = dqt.check_operands(lhs, rhs, preferred_element_type)
  if config.needs_key and key is None:
    raise ValueError("config asks for stochastic_rounding in dlhs_grad/drhs_grad: pass key=")
  nsp = jnp.ndim(lhs) - 2
  dn = jax.lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
  # lax checks window_strides' length but not the dilations' (a verifier
  # error at lowering): one entry per spatial dimension, each >= 1.
  for name, v in (("window_strides", window_strides), ("lhs_dilation", lhs_dilation),
                  ("rhs_dilation", rhs_dilation)):
    if v is not None and (len(v) != nsp or any(int(d) < 1 for d in v)):
      raise ValueError(f"{name}={tuple(v)!r} must hold {nsp} positive ints (one per spatial "
                       f"dimension of lhs {tuple(jnp.shape(lhs))})")
  p = dict(
      window_strides=tuple(window_strides), padding=_hashable_padding(padding),
      lhs_dilation=tuple(lhs_dilation) if lhs_dilation else (1,) * nsp,
      rhs_dilation=tuple(rhs_dilation) if rhs_dilation else (1,) * nsp,
      dn=dn, feature_group_count=int(feature_group_count), batch_group_count=int(batch_group_count),
      precision=precision)
  # lax's checks (and the output shape) on abstract float32 operands.
  out_shape = jax.eval_shape(
      lambda a, b: _conv(a, b, p, None),
      jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.float32),
      jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.float32)).shape
  dqt.check_given_scale(config.lhs, lhs_scale, "lhs")
  dqt.check_given_scale(config.rhs, rhs_scale, "rhs")
  lhs_scale = _with_zero_point(lhs_scale, lhs_zero_point, "lhs")
  rhs_scale = _with_zero_point(rhs_scale, rhs_zero_point, "rhs")
  if jnp.size(lhs) == 0 or jnp.size(rhs) == 0:
    return jnp.zeros(out_shape, out_dtype)
  return _conv_qt(lhs, rhs, lhs_scale, rhs_scale, dqt.as_key(key), _Static(p), config, out_dtype,
                  (jnp.result_type(lhs), jnp.result_type(rhs),
                   dqt.operand_axes(lhs, rhs, lhs_scale, rhs_scale)))


class _Static(dict):
  """A hashable dict of the conv's static parameters (for nondiff_argnums)."""

  def __hash__(self):
    return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))

  def __eq__(self, other):
    return isinstance(other, _Static) and hash(self) == hash(other)
