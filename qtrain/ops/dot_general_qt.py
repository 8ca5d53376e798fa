"""``dot_general_qt``: a quantized-training dot_general as a ``jax.custom_vjp``.

Forward: each operand is quantized per its :class:`~qtrain.ops.config.
OperandQuant` (or left in float) and the product runs through
:func:`qtrain.ops.dispatch.quantized_dot_general` (a Pallas kernel on GPU
where one is faster, the exact XLA path otherwise: int8 x int8 -> int32,
fp8 x fp8 -> f32, scales after).

Backward (``dlhs = g . rhs``, ``drhs = lhs . g``, dimension numbers derived
for any batch/contracting layout): the incoming gradient is quantized per
:class:`~qtrain.ops.config.GradQuant` (stochastic rounding keyed by an
explicit PRNG key), and multiplied with the *quantized residual* of the other
operand, saved in the forward in int8/fp8 (no float copy of quantized
operands is kept). A residual scale that varies along the backward
contraction (a weight's per-output-channel scale in ``dlhs``, an
activation's per-row scale in ``drhs``) is folded into the gradient before it
is quantized, so both backward products run as int8 x int8 -> int32 too.
The operand's estimator then masks the gradient (clipped STE), and a learned
scale passed in gets its LSQ or bitorch gradient.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import qtrain.ops as qops
  >>> cfg = qops.DotGeneralQtConfig(
  ...     lhs=qops.OperandQuant(qtype="int8"), rhs=qops.OperandQuant(qtype="int8"),
  ...     dlhs_grad=qops.GradQuant(qtype="int8"), drhs_grad=qops.GradQuant(qtype="int8"),
  ...     implementation="xla")
  >>> x = jax.random.normal(jax.random.key(0), (8, 32))
  >>> w = jax.random.normal(jax.random.key(1), (32, 4))
  >>> dn = (((1,), (0,)), ((), ()))
  >>> y = qops.dot_general_qt(x, w, dn, cfg)
  >>> gx, gw = jax.grad(lambda x, w: qops.dot_general_qt(x, w, dn, cfg).sum(), (0, 1))(x, w)
  >>> y.shape, gx.shape, gw.shape
  ((8, 4), (8, 32), (32, 4))
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import _lax
from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.core import rounding
from qtrain.kernels import grad_pair as _grad_pair_kernel
from qtrain.ops import config as cfg_lib
from qtrain.ops import dispatch
from qtrain.ops.qt_operand import (as_key, as_scale, check_given_scale, check_operands,
                                   compute_dtype, finish_operand_grad, operand_axes,
                                   quantize_grad, quantize_mx_grad, quantize_operand, split_key,
                                   traced_once, typed_like_operands)


# ----------------------------------------------------------------------------
# Backward dimension numbers.


def transpose_dims(dn, x_ndim: int, y_ndim: int, *, swap_ans: bool):
  """For ``x_bar = T(dot_general(g, y, dims))``: returns (dims, perm, g_free).

  ``x`` is the operand whose gradient is wanted, ``y`` the other one, ``dn``
  the forward dimension numbers written with ``x`` first; ``swap_ans`` says
  that in the forward output ``y``'s free axes come before ``x``'s (``x`` was
  the rhs). ``g_free`` are ``g``'s axes not contracted in this product.
  """
  (xc, yc), (xb, yb) = dn
  x_kept = qdot.free_axes(x_ndim, xc, xb)
  y_kept = qdot.free_axes(y_ndim, yc, yb)
  nb = len(xb)
  ans_batch = tuple(range(nb))
  if swap_ans:
    ans_y = tuple(range(nb, nb + len(y_kept)))
    ans_x = tuple(range(nb + len(y_kept), nb + len(y_kept) + len(x_kept)))
  else:
    ans_x = tuple(range(nb, nb + len(x_kept)))
    ans_y = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
  dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(yb)))
  xc_by_y = [xc[i] for i in np.argsort(yc)]
  perm = tuple(int(i) for i in np.argsort(list(xb) + list(x_kept) + xc_by_y))
  return dims, perm, ans_batch + ans_x


def _fold_scale(g, y: qa.QArray, dims, swap_ans: bool, nxk: int, axis_names=()):
  """Moves ``y``'s scale into ``g`` when it varies along the contraction.

  Returns (g', y') or None when the scale varies jointly along contracted and
  free axes of this product (then the caller multiplies in float).
  :func:`_fold_factor` tells the factor ``g'`` is ``g`` (as float32) times.

  ``g * scale`` can overflow float32 where the product does not (a gradient
  of 1e25 times a scale of 1e20, against codes of 0): one Inf would make its
  whole gradient group NaN. So per batch index the scale is divided by
  ``2**e``, the power of two that brings its largest value into [0.5, 1)
  (none where it is below 1): then ``|g * scale| <= |g|``, finite for every
  finite ``g``. The shift stops where the smallest positive value would leave
  float32's normal range (a flushed scale would drop its channel's gradient
  however large ``g`` is) and at 2**127; ``y'`` keeps ``2**e`` as its scale
  and the product's epilogue multiplies it back. Powers of two are exact, so
  the numbers are those of ``g * scale`` wherever that is finite; no pass
  over ``g`` is added (the shift is computed on the scale alone). Only scales
  that span more than 2**126 within one batch index, or reach 2**127, can
  leave a product that overflows. ``axis_names``: the ``jax.shard_map`` mesh
  axes the contraction is split over; the shift is then the whole array's.
  """
  folded = _fold_factor(y, dims, swap_ans, nxk, axis_names)
  if folded is None or folded is _NO_FOLD:
    return None if folded is None else (g, y)
  s_g, y2 = folded
  return g.astype(jnp.float32) * s_g, y2


_NO_FOLD = object()  # the scale does not vary along the contraction: nothing to fold


def _fold_factor(y: qa.QArray, dims, swap_ans: bool, nxk: int, axis_names=()):
  """:func:`_fold_scale`'s factor: ``(s_g, y')`` with ``g' = g.astype(float32) * s_g``
  (``s_g`` broadcasts against ``g``), :data:`_NO_FOLD` when ``y``'s scale does not vary along
  the contraction, None when it varies jointly along contracted and free axes."""
  (gc, yk), (gb, yb) = dims
  ys = y.scale
  y_free = [a for a in range(y.ndim) if a not in yk and a not in yb]
  varies = lambda axes: any(ys.shape[a] != 1 for a in axes)
  if not varies(yk):
    return _NO_FOLD
  if varies(y_free):
    return None
  t = jnp.transpose(ys, tuple(yb) + tuple(yk) + tuple(y_free)).astype(jnp.float32)
  t = t.reshape(t.shape[:len(yb) + len(yk)])
  nb = len(yb)
  e = _fold_exponent(t, tuple(range(nb, t.ndim)), axis_names)
  # Two exact steps of at most 2**-64 each: every positive t >= low ends normal,
  # and no factor is subnormal (a GPU flushes those to zero).
  half = e >> 1
  t = t * _pow2(-half) * _pow2(half - e)
  if swap_ans:
    s_g = t.reshape(t.shape + (1,) * nxk)
  else:
    s_g = t.reshape(t.shape[:nb] + (1,) * nxk + t.shape[nb:])
  # 2**e along y's batch axes, in y's axis order (yb may list them in another).
  order = sorted(range(nb), key=lambda i: yb[i])
  e = jnp.transpose(e.reshape(e.shape[:nb]), order)
  shape = [1] * y.ndim
  for a, n in zip(sorted(yb), e.shape):
    shape[a] = n
  y2 = dataclasses.replace(y, scale=_pow2(e).reshape(shape))
  return s_g, y2


def _fold_exponent(t: jax.Array, group: tuple[int, ...], axis_names=()) -> jax.Array:
  """The fold's shift ``e`` per group (int32 in [0, 127], keepdims): one above the exponent of
  the group's largest finite value (which then divides into [0.5, 1)), lowered so that its
  smallest positive normal value divided by ``2**e`` stays >= 2**-126 (at most 126 above that
  value's own exponent). Subnormal values count as zero, as XLA's CPU and GPU compares see them
  (decided on the bits, so on every platform).

  On the bits: a non-negative float32's int32 bits order as its value, and its biased exponent
  is ``bits >> 23``. Both ends come from integer reductions of the bits (max of the finite
  values', min of the positive normal ones'), where float reductions and a frexp cost ~40 more
  operations per backward product (compile time).
  """
  bits = jax.lax.bitcast_convert_type(t, jnp.int32)
  finite = jnp.isfinite(t)
  hi = jax.lax.select(finite, bits, jnp.zeros_like(bits))
  lo = jax.lax.select(finite & (bits >= _TINY_BITS), bits, jnp.full_like(bits, _ONE_BITS))
  # One single-operand reduction of both ends (min(lo) = -max(-lo); lo > 0): XLA's SPMD
  # partitioner all-reduces it over a sharded axis, where it all-gathers the operands of a
  # variadic reduce; one reduction instead of two compiles two fusions fewer (XLA's CPU splits
  # each reduction in two).
  ends = jax.lax.reduce_max(jnp.stack([hi, -lo]), tuple(a + 1 for a in group))
  top, low = ends[0], -ends[1]
  axis_names = _lax.bound_axis_names(t, axis_names, "axis_names") if axis_names else ()
  if axis_names:  # the group is split over shard_map shards: the whole group's ends
    top, low = jax.lax.pmax(top, axis_names), jax.lax.pmin(low, axis_names)
  # Biased exponents: top's - 127 + 1 and low's - 127 + 126; t >= 0 only reaches here (scales).
  e = jax.lax.min(jax.lax.shift_right_arithmetic(top, 23) - 126,
                  jax.lax.shift_right_arithmetic(low, 23) - 1)
  e = jax.lax.clamp(np.int32(0), e, np.int32(127))
  return e.reshape(e.shape + (1,) * len(group))


_ONE_BITS = 0x3F800000  # the bits of float32 1.0
_TINY_BITS = 0x00800000  # the bits of float32's smallest normal value


# ldexp for the fold's powers of two, by their bits: jnp's version handles subnormal, zero and
# non-finite inputs the fold never passes, and adds ~20 operations to every quantized backward
# product (compile time).


def _pow2(e: jax.Array) -> jax.Array:
  """2**e as float32 for int32 ``e`` in [-126, 127] (exact)."""
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def backward_product(g, y_res, dn_x_first, x_ndim: int, *, swap_ans: bool, gq, key,
                     implementation: str, x_shape, out_dtype=jnp.float32, y_dtype=None):
  """``x_bar`` for one operand: quantize g (folding y's scale), dot, transpose.
  ``out_dtype``: the product's dtype (float32, or the operand's own dtype where
  nothing but a cast follows: the same numbers, half the bytes for bf16).
  ``y_dtype``: the dtype ``y`` had before it was quantized (default: float32):
  a product with a float side runs in ``promote_types(g.dtype, y_dtype)``."""

  dims, perm, g_free = transpose_dims(dn_x_first, x_ndim, y_res.ndim, swap_ans=swap_ans)
  g_in, y_in = g, y_res
  if gq is not None:
    if qdot.is_quantized(y_res):
      x_kept = len(qdot.free_axes(x_ndim, dn_x_first[0][0], dn_x_first[1][0]))
      folded = _fold_scale(g, y_res, dims, swap_ans, x_kept, gq.axis_names)
      if folded is not None:
        g_in, y_in = folded
    if gq.qtype.is_mx:  # blocks of 32 along this product's contraction
      g_in = quantize_mx_grad(g_in, gq, dims[0][0], key)
    else:
      g_in = quantize_grad(g_in, gq, g_free, key, dims[0][0])
  return _backward_dot(g_in, y_in, dims, perm, g_dtype=g.dtype, y_dtype=y_dtype,
                       float_values=gq is not None and not qdot.is_quantized(g_in),
                       implementation=implementation, x_shape=x_shape, out_dtype=out_dtype)


def _backward_dot(g_in, y_in, dims, perm, *, g_dtype, y_dtype, float_values: bool,
                  implementation: str, x_shape, out_dtype):
  """The product of :func:`backward_product` once ``g`` is quantized (``float_values``: ``g_in``
  holds MX values dequantized, exact in float32)."""
  ctype = compute_dtype(g_dtype, y_dtype if y_dtype is not None else jnp.float32)
  if float_values:
    ctype = jnp.float32
  r = dispatch.quantized_dot_general(g_in, y_in, dims, preferred_element_type=out_dtype,
                                     implementation=implementation, compute_dtype=ctype)
  return jnp.transpose(r, perm).reshape(x_shape)


# ----------------------------------------------------------------------------
# Both gradient quantizations of a 2-D-like product from two reads of g (GPU kernels).


def _pair_grad_ok(gq) -> bool:
  """Whether :mod:`qtrain.kernels.grad_pair` computes this gradient quantization: an integer
  qtype of <= 8 bits or an fp8 one (not MX), plain absmax, one scale per row / column, no mesh
  axes, rounding to nearest or ``low_bit_hash`` (the noise it can compute in place)."""
  cal = gq.calibration
  qt = gq.qtype
  return (((qt.kind == "int" and qt.bits <= 8) or (qt.is_float and not qt.is_mx))
          and cal.method == "absmax"
          and cal.multiplier == 1.0 and gq.tile_size is None and not gq.axis_names
          and gq.stochastic_rounding in (None, "low_bit_hash"))


def _pair_xla(g2, g3, ql_spec, qr_spec, k_l, k_r, m: int, n: int):
  """:func:`_grad_pair`'s codes and scales on XLA: ``qarray.quantize`` of each folded gradient
  (the per-product path, whose numbers the kernels reproduce), the second one transposed."""
  ql = qa.quantize(g2, ql_spec, key=k_l)
  qr = qa.quantize(g3, qr_spec, key=k_r)
  return (ql.qvalue.reshape(m, n), jnp.transpose(qr.qvalue.reshape(m, n)),
          ql.scale.reshape(m), qr.scale.reshape(n))


def _pair_kernels(g2d, s_l, s_r, ql_spec, qr_spec, seeds, *, interpret: bool, **opts):
  """:func:`_pair_xla` by the two kernels of :mod:`qtrain.kernels.grad_pair`: the bounds of
  both folded gradients from one read, then both codes from another."""
  b_l, b_r = _grad_pair_kernel.grad_pair_bounds(g2d, s_l, s_r, interpret=interpret)
  sc_l = qa.absmax_scale(qa.bound_of_bits(b_l), ql_spec)
  sc_r = qa.absmax_scale(qa.bound_of_bits(b_r), qr_spec)
  inv = lambda sc: 1.0 / jnp.where(sc == 0, 1.0, sc)  # qarray.divide_by_scale's, as XLA runs it
  c_l, c_rt = _grad_pair_kernel.grad_pair(g2d, s_l, s_r, inv(sc_l), inv(sc_r), seeds,
                                          interpret=interpret, **opts)
  return c_l, c_rt, sc_l, sc_r


def _grad_pair(g, lres, rres, dn, config, k_l, k_r):
  """Both backward products' quantized gradients by :mod:`qtrain.kernels.grad_pair`, or None
  where its kernels do not apply (then each product quantizes its own, :func:`backward_product`).

  Applies to a product without batch axes whose operands are both quantized with scales that
  fold into ``g`` (per row / per column or per tensor), both gradients per
  :func:`_pair_grad_ok` and of one qtype, a gradient of (M, N) = (lhs free, rhs free) sizes
  the kernels tile,
  on one device (the kernel has no per-shard rule), with a kernel implementation ("auto" on a
  CUDA lowering, "triton", "mosaic", or "interpret" in the Pallas interpreter).

  Returns, per backward product, ``(lhs, rhs, dimension numbers, output permutation)`` for
  :func:`_backward_dot`: the input gradient's ``(g, folded rhs residual)``, ``g`` in its own
  shape; the weight gradient's ``(folded lhs residual, g)``, ``g`` transposed to
  (rhs free..., lhs free...), the layout its GEMM reads. The weight gradient is ``x.T @ g``
  rather than ``g.T @ x`` (the same two operands in the same layouts): its GEMM then writes
  it in the weight's own (K, N) layout, where ``g.T @ x`` wrote (N, K) and XLA carried the
  transpose into the training loop's weights and optimizer state.
  """
  impl = config.implementation
  (lc, rc), (lb, rb) = dn
  gq_l, gq_r = config.dlhs_grad, config.drhs_grad
  if (impl == "xla" or lb or gq_l is None or gq_r is None or not _pair_grad_ok(gq_l)
      or not _pair_grad_ok(gq_r) or gq_l.qtype != gq_r.qtype
      or not qdot.is_quantized(lres.value) or not qdot.is_quantized(rres.value)
      or jax.device_count() != 1):
    return None
  lq, rq = lres.value, rres.value
  nl = lq.ndim - len(lc)
  shape = tuple(g.shape)
  if _lax.has_symbolic_dim(shape):
    return None
  m, n = math.prod(shape[:nl]), math.prod(shape[nl:])
  if not shape or nl == 0 or nl == len(shape) or _grad_pair_kernel.supported(m, n) is not None:
    return None
  dims_l, perm_l, free_l = transpose_dims(dn, lq.ndim, rq.ndim, swap_ans=False)
  dims_r, perm_r, free_r = transpose_dims(((rc, lc), (rb, lb)), rq.ndim, lq.ndim, swap_ans=True)
  fold_l = _fold_factor(rq, dims_l, False, nl, ())
  fold_r = _fold_factor(lq, dims_r, True, len(shape) - nl, ())
  if fold_l is None or fold_r is None:
    return None
  (s_l, y_l) = (jnp.ones((n,), jnp.float32), rq) if fold_l is _NO_FOLD else fold_l
  (s_r, y_r) = (jnp.ones((m,), jnp.float32), lq) if fold_r is _NO_FOLD else fold_r
  s_l, s_r = jnp.reshape(s_l, (n,)), jnp.reshape(s_r, (m,))
  qt = gq_l.qtype
  spec = lambda gq, cw: qa.QuantizeSpec(qtype=qt, channelwise_axes=cw, calibration=gq.calibration,
                                        stochastic_rounding=gq.stochastic_rounding)
  ql_spec, qr_spec = spec(gq_l, free_l), spec(gq_r, free_r)
  seeds = [jnp.zeros((), jnp.uint32)] * 4
  for i, (gq, key) in enumerate(((gq_l, k_l), (gq_r, k_r))):
    if gq.stochastic_rounding is not None:
      seeds[2 * i], seeds[2 * i + 1] = rounding.hash_seeds(key)
  opts = dict(qmin=qt.qmin, qmax=qt.qmax, n_last=shape[-1],
              code_dtype=qt.compute_dtype.name,  # int8 for every integer qtype
              stochastic=(gq_l.stochastic_rounding is not None,
                          gq_r.stochastic_rounding is not None))
  args = (g.reshape(m, n), s_l, s_r, ql_spec, qr_spec, jnp.stack(seeds))
  kernels = lambda interpret: (lambda: _pair_kernels(*args, interpret=interpret, **opts))
  if impl == "interpret":
    c_l, c_rt, sc_l, sc_r = kernels(True)()
  else:
    g2 = g.astype(jnp.float32) * s_l.reshape(shape[nl:])
    g3 = g.astype(jnp.float32) * s_r.reshape(shape[:nl] + (1,) * (len(shape) - nl))
    xla = lambda: _pair_xla(g2, g3, ql_spec, qr_spec, k_l, k_r, m, n)
    c_l, c_rt, sc_l, sc_r = jax.lax.platform_dependent(cuda=kernels(False), default=xla)
  sc_l = sc_l.reshape(shape[:nl] + (1,) * (len(shape) - nl))
  sc_r = sc_r.reshape(shape[nl:] + (1,) * nl)  # g_rt's layout: rhs free axes first
  g_l = qa.QArray(qvalue=c_l.reshape(shape), scale=sc_l, zero_point=None, qtype=qt)
  g_rt = qa.QArray(qvalue=c_rt.reshape(shape[nl:] + shape[:nl]), scale=sc_r, zero_point=None,
                   qtype=qt)
  # g_rt holds g's rhs-free axes first: the weight gradient contracts the lhs residual's free
  # axes with g_rt's trailing (lhs-free) axes, in order. Its output holds the residual's
  # contracting axes, then g's rhs-free ones: transpose_dims' layout for g (rhs-free axes,
  # then those contracting axes) with the two groups swapped, so the permutation is perm_r
  # read through that swap.
  n_free, n_contract = len(shape) - nl, len(lc)
  dims_xg = ((dims_r[0][1], tuple(range(n_free, len(shape)))), ((), ()))
  swap = tuple(range(n_contract, n_contract + n_free)) + tuple(range(n_contract))
  perm_xg = tuple(swap[p] for p in perm_r)
  return (g_l, y_l, dims_l, perm_l), (y_r, g_rt, dims_xg, perm_xg)


# ----------------------------------------------------------------------------
# The op.


def _channel_axes(ndim, contract, batch):
  return tuple(sorted(set(batch) | set(qdot.free_axes(ndim, contract, batch))))


@traced_once(static_argnums=(4, 5, 6, 7))
def _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype):

  (lc, rc), (lb, rb) = dn
  lres = quantize_operand(lhs, config.lhs, lhs_scale, _channel_axes(lhs.ndim, lc, lb),
                          lc[-1] if lc else None, "lhs")
  rres = quantize_operand(rhs, config.rhs, rhs_scale, _channel_axes(rhs.ndim, rc, rb),
                          rc[-1] if rc else None, "rhs")
  if config.lhs is None and config.rhs is None:
    out = qdot.float_dot_general(lhs, rhs, dn, precision=precision, preferred_element_type=out_dtype)
  else:
    out = dispatch.quantized_dot_general(lres.value, rres.value, dn, preferred_element_type=out_dtype,
                                         implementation=config.implementation,
                                         compute_dtype=compute_dtype(lhs.dtype, rhs.dtype))
  return out, (lres, rres)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _dot_general_qt(lhs, rhs, lhs_scale, rhs_scale, kd, dn, config, precision, out_dtype, shapes):
  return _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype)[0]


def _fwd(lhs, rhs, lhs_scale, rhs_scale, kd, dn, config, precision, out_dtype, shapes):
  out, (lres, rres) = _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype)
  return out, (lres, rres, kd)


@traced_once(static_argnums=(0, 1, 2, 3, 4))
def _bwd(dn, config, precision, out_dtype, shapes, res, g):
  lres, rres, kd = res
  (lshape, rshape, ldtype, rdtype, varying) = shapes
  (lc, rc), (lb, rb) = dn
  k_l, k_r = split_key(kd, (config.dlhs_grad, config.drhs_grad))
  # Without a learned scale, finish_operand_grad only masks and casts x_bar, and
  # every product path rounds its float32 result once at the end: the product
  # may be written in the operand's float dtype directly (the same numbers).
  bar_dtype = lambda res, dtype: (dtype if res.given_scale is None
                                  and jnp.issubdtype(dtype, jnp.floating) else jnp.float32)
  pair = _grad_pair(g, lres, rres, dn, config, k_l, k_r)
  if pair is None:
    lhs_bar = backward_product(g, rres.value, dn, len(lshape), swap_ans=False,
                               gq=config.dlhs_grad, key=k_l, implementation=config.implementation,
                               x_shape=lshape, out_dtype=bar_dtype(lres, ldtype), y_dtype=rdtype)
    rhs_bar = backward_product(g, lres.value, ((rc, lc), (rb, lb)), len(rshape), swap_ans=True,
                               gq=config.drhs_grad, key=k_r, implementation=config.implementation,
                               x_shape=rshape, out_dtype=bar_dtype(rres, rdtype), y_dtype=ldtype)
  else:
    (g_l, y_l, dims_l, perm_l), (x_r, g_rt, dims_xg, perm_xg) = pair
    lhs_bar = _backward_dot(g_l, y_l, dims_l, perm_l, g_dtype=g.dtype, y_dtype=rdtype,
                            float_values=False, implementation=config.implementation,
                            x_shape=lshape, out_dtype=bar_dtype(lres, ldtype))
    # (x_r, g_rt): the residual first (see _grad_pair); the product's dtypes are symmetric.
    rhs_bar = _backward_dot(x_r, g_rt, dims_xg, perm_xg, g_dtype=g.dtype, y_dtype=ldtype,
                            float_values=False, implementation=config.implementation,
                            x_shape=rshape, out_dtype=bar_dtype(rres, rdtype))
  lhs_bar, ls_bar = finish_operand_grad(lhs_bar, lres, config.lhs, ldtype)
  rhs_bar, rs_bar = finish_operand_grad(rhs_bar, rres, config.rhs, rdtype)
  return (*typed_like_operands((lhs_bar, rhs_bar, ls_bar, rs_bar), varying), None)


_dot_general_qt.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------
# Tiles over a contraction of several axes.


def _merge_axes(x, scale, group, batch, what):
  """Brings ``group`` (axes of ``x``, in this order) together at ``min(group)`` and merges them.

  The other axes keep their order, so the product's output layout is unchanged. Returns
  (x', scale', merged axis, batch axes renumbered). A passed-in scale goes the same way (its
  contracting axes are broadcast first when they vary, so the merged scale stays exact).
  """
  nd = x.ndim
  pos = min(group)
  rest = [a for a in range(nd) if a not in group]
  order = [a for a in rest if a < pos] + list(group) + [a for a in rest if a > pos]
  new_index = {a: i if i < pos else (pos if i < pos + len(group) else i - len(group) + 1)
               for i, a in enumerate(order)}

  def merge(v):
    if order != list(range(nd)):
      v = jnp.transpose(v, order)
    return v.reshape(v.shape[:pos] + (int(np.prod(v.shape[pos:pos + len(group)])),)
                     + v.shape[pos + len(group):])

  if scale is not None:
    s = as_scale(scale, x.shape, f"{what}_scale")
    for a in group:  # a scale entry covers x.shape[a] // s.shape[a] consecutive elements
      if s.shape[a] != 1:
        s = jnp.repeat(s, x.shape[a] // s.shape[a], axis=a)
    scale = merge(s)
  return merge(x), scale, pos, tuple(new_index[a] for a in batch)


def merge_tiled_contraction(lhs, rhs, dn, tile_sizes, lhs_scale=None, rhs_scale=None):
  """Makes ``tile_size`` apply to the whole contraction of a multi-axis contraction.

  ``tile_size`` groups the contraction, the product of the contracting axes in
  the order the contracting axes lie in ``lhs`` (MultiHeadDotProductAttention's
  out projection contracts (heads, head_dim) = (4, 32): a 64 tile spans two
  heads).
  When an operand has a tile and the op contracts more than one axis, the
  contracting axes of both operands are brought together (a transpose only
  where they are not already adjacent and in the same order) and reshaped to
  one axis; JAX differentiates the reshape. The output layout does not change.

  ``tile_sizes``: ``(lhs tile_size, rhs tile_size)``, None where untiled (the
  config's; :mod:`qtrain.freeze` passes the frozen weight's, so frozen layers
  group their weights exactly as the op does). A fraction is of the whole
  contraction; per-axis tiles (``{axis: tile}``) name the operand's own axes
  and merge nothing.

  Returns ``(lhs, rhs, dn, lhs_scale, rhs_scale)``, unchanged when there is
  nothing to merge. Raises ValueError when a tile does not divide the contraction.
  """
  (lc, rc), (lb, rb) = dn
  tiled = [(n, t) for n, t in zip(("lhs", "rhs"), tile_sizes)
           if t and not cfg_lib.is_per_axis(t)]
  if not tiled or len(lc) < 2:
    return lhs, rhs, dn, lhs_scale, rhs_scale
  per_axis = [n for n, t in zip(("lhs", "rhs"), tile_sizes) if cfg_lib.is_per_axis(t)]
  if per_axis:
    raise ValueError(
        f"config.{per_axis[0]}.tile_size={dict(tile_sizes[per_axis[0] == 'rhs'])!r} (per-axis "
        f"tiles) with config.{tiled[0][0]}.tile_size={tiled[0][1]!r} on a contraction of "
        f"{len(lc)} axes: the latter merges the contraction into one axis, which renumbers the "
        "former's axes; give both operands per-axis tiles, or neither")
  sizes = tuple(int(jnp.shape(lhs)[a]) for a in lc)
  k = int(np.prod(sizes))
  for name, tile in tiled:
    t = int(round(k * tile)) if isinstance(tile, float) else tile
    if t <= 0 or k % t:
      raise ValueError(
          f"config.{name}.tile_size={tile} does not divide the contraction of size {k} "
          f"(contracting axes {tuple(lc) if name == 'lhs' else tuple(rc)} of {name} shape "
          f"{tuple(jnp.shape(lhs if name == 'lhs' else rhs))}: {' x '.join(map(str, sizes))})")
  # The contraction is flattened in the order its axes lie in lhs (the pairs sorted by the lhs
  # axis), so adjacent lhs axes need no transpose; rhs is transposed only where its paired axes
  # are not adjacent and in that order.
  pairs = sorted(zip(lc, rc))
  lhs, lhs_scale, l_axis, lb = _merge_axes(jnp.asarray(lhs), lhs_scale, [p[0] for p in pairs],
                                           lb, "lhs")
  rhs, rhs_scale, r_axis, rb = _merge_axes(jnp.asarray(rhs), rhs_scale, [p[1] for p in pairs],
                                           rb, "rhs")
  return lhs, rhs, (((l_axis,), (r_axis,)), (lb, rb)), lhs_scale, rhs_scale


def _with_zero_point(scale, zero_point, what: str):
  """The scale argument the custom_vjp carries: the scale, or ``(scale, zero point)``."""
  if zero_point is None:
    return scale
  if scale is None:
    raise ValueError(f"{what}_zero_point was given without {what}_scale (a zero point belongs "
                     "to a passed-in scale)")
  return (scale, zero_point)


def dot_general_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    config: cfg_lib.DotGeneralQtConfig,
    *,
    precision=None,
    preferred_element_type=None,
    key: jax.Array | None = None,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    lhs_zero_point: jax.Array | None = None,
    rhs_zero_point: jax.Array | None = None,
) -> jax.Array:
  """Quantized-training ``jax.lax.dot_general``.

  Dtypes (:mod:`qtrain.ops.qt_operand` states the policy once for both QT
  ops): the output is ``preferred_element_type`` or ``result_type(lhs, rhs)``;
  a float operand times a quantized one runs in ``promote_types(lhs.dtype,
  rhs.dtype)`` (bf16 x a bf16-quantized weight stays a bf16 product with
  float32 accumulation; a float32-quantized operand times float16 computes
  in float32); two quantized operands run int8 x int8 -> int32 or fp8 x fp8
  -> float32 (mixed fp8 kinds too), integer x fp8 in float32. The backward
  products follow the same rule with the incoming gradient as the float
  side; gradients come back in each operand's dtype.

  An operand with no elements (M, N or K = 0) gives zeros of the output
  shape, as :func:`jax.lax.dot_general` does, and zero (or empty) gradients:
  nothing is quantized and no kernel runs, whatever ``implementation`` says.

  Args:
    lhs, rhs: float operands.
    dimension_numbers: as for :func:`jax.lax.dot_general` (batch axes too);
      validated up front (distinct axes, matching counts and sizes).
    config: a :class:`~qtrain.ops.config.DotGeneralQtConfig`.
    precision: used by float products (an unquantized op).
    preferred_element_type: the output dtype (default: the operands' result
      type); the backward returns gradients in each operand's dtype.
    key: PRNG key for stochastic rounding of gradients (required when the
      config asks for stochastic rounding).
    lhs_scale, rhs_scale: optional scales to use instead of calibrating
      (static or learned; they receive gradients per ``scale_grad``).
    lhs_zero_point, rhs_zero_point: the zero point of a passed-in scale (an
      asymmetric static scale, e.g. from ``minmax``; integer qtypes): the
      operand is quantized as ``round(x / scale) + zero_point``, clipped to the
      qtype. Shaped like the scale; rounded to integers; no gradient.

  Returns:
    ``dot_general(lhs, rhs)`` computed with quantized operands.

  Raises:
    ValueError: on a config that cannot be honoured (the message names the
      field), non-float operands or ``preferred_element_type``, or invalid
      dimension numbers.
  """
  if not isinstance(config, cfg_lib.DotGeneralQtConfig):
    raise ValueError(f"config must be a DotGeneralQtConfig, got {type(config).__name__}")
  out_dtype = check_operands(lhs, rhs, preferred_element_type)
  dn = qdot.normalize_dimension_numbers(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs),
                                        lhs_shape=jnp.shape(lhs), rhs_shape=jnp.shape(rhs))
  if config.needs_key and key is None:
    raise ValueError("config asks for stochastic_rounding in dlhs_grad/drhs_grad: pass key=")
  tiles = tuple(None if oq is None else oq.tile_size for oq in (config.lhs, config.rhs))
  if lhs_zero_point is not None or rhs_zero_point is not None:  # merged as the scales are
    _, _, _, lhs_zero_point, rhs_zero_point = merge_tiled_contraction(
        lhs, rhs, dn, tiles, lhs_zero_point, rhs_zero_point)
  lhs, rhs, dn, lhs_scale, rhs_scale = merge_tiled_contraction(
      lhs, rhs, dn, tiles, lhs_scale, rhs_scale)
  for name, oq, x, c in (("lhs", config.lhs, lhs, dn[0][0]), ("rhs", config.rhs, rhs, dn[0][1])):
    if oq is not None and cfg_lib.is_per_axis(oq.tile_size):
      cfg_lib.resolve_axis_tiles(oq.tile_size, jnp.shape(x), f"config.{name}.tile_size")
    elif oq is not None and oq.tile_size:
      if not c:
        raise ValueError(f"config.{name}.tile_size={oq.tile_size} but the op contracts no axis")
      n = jnp.shape(x)[c[-1]]
      t = int(round(n * oq.tile_size)) if isinstance(oq.tile_size, float) else oq.tile_size
      if t <= 0 or n % t:
        raise ValueError(f"config.{name}.tile_size={oq.tile_size} does not divide the contracting "
                         f"axis of size {n} (shape {jnp.shape(x)})")
  out_shape = qdot.output_shape(jnp.shape(lhs), jnp.shape(rhs), dn)
  for name, gq in (("dlhs_grad", config.dlhs_grad), ("drhs_grad", config.drhs_grad)):
    if gq is not None and cfg_lib.is_per_axis(gq.tile_size):
      cfg_lib.resolve_axis_tiles(gq.tile_size, out_shape, f"config.{name}.tile_size")
    elif gq is not None and gq.tile_size is not None and not gq.qtype.is_mx:
      # The product's last contracting axis of g: rhs's last free axis (dlhs), lhs's (drhs).
      nb = len(dn[1][0])
      nl = len(qdot.free_axes(jnp.ndim(lhs), dn[0][0], dn[1][0]))
      axes = (tuple(range(nb + nl, len(out_shape))) if name == "dlhs_grad" else
              tuple(range(nb, nb + nl)))
      if not axes:
        raise ValueError(f"config.{name}.tile_size={gq.tile_size} but that backward product "
                         f"contracts no axis of the gradient (output shape {out_shape})")
      cfg_lib.resolve_tile(gq.tile_size, out_shape[axes[-1]], f"config.{name}.tile_size")
  check_given_scale(config.lhs, lhs_scale, "lhs")
  check_given_scale(config.rhs, rhs_scale, "rhs")
  lhs_scale = _with_zero_point(lhs_scale, lhs_zero_point, "lhs")
  rhs_scale = _with_zero_point(rhs_scale, rhs_zero_point, "rhs")
  if jnp.size(lhs) == 0 or jnp.size(rhs) == 0:
    return jnp.zeros(qdot.output_shape(jnp.shape(lhs), jnp.shape(rhs), dn), out_dtype)
  shapes = (tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs)), jnp.result_type(lhs), jnp.result_type(rhs),
            operand_axes(lhs, rhs, lhs_scale, rhs_scale))
  return _dot_general_qt(lhs, rhs, lhs_scale, rhs_scale, as_key(key), dn, config, precision,
                         out_dtype, shapes)
