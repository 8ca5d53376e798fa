"""``dot_general_qt``: a quantized-training dot_general as a ``jax.custom_vjp``.

Forward: each operand is quantized per its :class:`~qtrain.core.config.
OperandQuant` (or left in float) and the product runs through
:func:`qtrain.pallas.dispatch.quantized_dot_general` (a Pallas kernel on GPU
where one is faster, the exact XLA path otherwise: int8 x int8 -> int32,
fp8 x fp8 -> f32, scales after).

Backward (``dlhs = g . rhs``, ``drhs = lhs . g``, dimension numbers derived
for any batch/contracting layout): the incoming gradient is quantized per
:class:`~qtrain.core.config.GradQuant` (stochastic rounding keyed by an
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
  >>> from qtrain.core import config, dot_general_qt
  >>> cfg = config.DotGeneralQtConfig(
  ...     lhs=config.OperandQuant(qtype="int8"), rhs=config.OperandQuant(qtype="int8"),
  ...     dlhs_grad=config.GradQuant(qtype="int8"), drhs_grad=config.GradQuant(qtype="int8"),
  ...     implementation="xla")
  >>> x = jax.random.normal(jax.random.key(0), (8, 32))
  >>> w = jax.random.normal(jax.random.key(1), (32, 4))
  >>> dn = (((1,), (0,)), ((), ()))
  >>> y = dot_general_qt.dot_general_qt(x, w, dn, cfg)
  >>> gx, gw = jax.grad(lambda x, w: dot_general_qt.dot_general_qt(x, w, dn, cfg).sum(), (0, 1))(x, w)
  >>> y.shape, gx.shape, gw.shape
  ((8, 4), (8, 32), (32, 4))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import config as cfg_lib
from qtrain.core import estimators
from qtrain.core import qarray as qa
from qtrain.core import qdot


# ----------------------------------------------------------------------------
# Operand quantization shared with conv_general_qt.


def operand_spec(oq: cfg_lib.OperandQuant, ndim: int, channel_axes: tuple[int, ...],
                 tile_axis: int | None) -> qa.QuantizeSpec:
  """The QuantizeSpec of a forward operand."""
  return qa.QuantizeSpec(
      qtype=oq.qtype,
      channelwise_axes=channel_axes if oq.channelwise else (),
      tiled_axes={tile_axis: oq.tile_size} if (oq.tile_size and tile_axis is not None) else {},
      calibration=oq.calibration,
  )


def as_scale(given: jax.Array, shape: tuple[int, ...], what: str) -> jax.Array:
  """Reshapes a passed-in scale to the operand's rank and validates it."""
  given = jnp.asarray(given, jnp.float32)
  if given.ndim > len(shape):
    raise ValueError(f"{what} of shape {given.shape} has more axes than the operand {shape}")
  s = given.reshape((1,) * (len(shape) - given.ndim) + given.shape)
  for ns, n in zip(s.shape, shape):
    if ns != 1 and n % ns:
      raise ValueError(f"{what} of shape {given.shape} does not fit an operand of shape {shape}")
  return s


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OperandResidual:
  """What the backward keeps of one operand."""
  value: Any            # QArray (quantized operand) or the float operand
  mask: Any             # bool array where the gradient passes, or None
  x: Any                # float operand, only for an LSQ-learned scale
  given_scale: Any      # the passed-in scale (its original shape), or None


def quantize_operand(x, oq, given_scale, channel_axes, tile_axis, what) -> OperandResidual:
  """Quantizes one forward operand (or keeps it float) and builds its residual."""
  if oq is None:
    if given_scale is not None:
      raise ValueError(f"{what}_scale was given but config.{what} is None (the operand is float)")
    return OperandResidual(value=x, mask=None, x=None, given_scale=None)
  spec = operand_spec(oq, x.ndim, channel_axes, tile_axis)
  if given_scale is None:
    q = qa.quantize(x, spec)
  else:
    q = qa.quantize_with_scale(x, oq.qtype, as_scale(given_scale, x.shape, f"{what}_scale"))
  full_scale = qa.expand_scale(q.scale, x.shape)
  zp = None if q.zero_point is None else qa.expand_scale(q.zero_point, x.shape)
  mask = estimators.pass_mask(oq.estimator, x, full_scale, qmax=q.qtype.qmax,
                              zero_point_full=zp, qmin=q.qtype.qmin)
  keep_x = given_scale is not None and oq.scale_grad == "lsq"
  return OperandResidual(value=q, mask=mask, x=x if keep_x else None, given_scale=given_scale)


def finish_operand_grad(x_bar, res: OperandResidual, oq, dtype):
  """Applies the estimator mask and computes a learned scale's gradient."""
  scale_bar = None
  if res.given_scale is not None:
    q: qa.QArray = res.value
    full = qa.expand_scale(q.scale, q.shape)
    if oq.scale_grad == "lsq":
      sb = estimators.lsq_scale_grad(x_bar, res.x, q.qvalue, q.scale, full,
                                     qmin=q.qtype.qmin, qmax=q.qtype.qmax)
    else:
      masked = x_bar if res.mask is None else jnp.where(res.mask, x_bar, 0)
      sb = estimators.bitorch_scale_grad(masked, q.qvalue, q.scale)
    scale_bar = sb.reshape(jnp.shape(res.given_scale)).astype(jnp.result_type(res.given_scale))
  if res.mask is not None:
    x_bar = jnp.where(res.mask, x_bar, 0)
  return x_bar.astype(dtype), scale_bar


def quantize_grad(g, gq: cfg_lib.GradQuant, channel_axes, key):
  spec = qa.QuantizeSpec(qtype=gq.qtype, channelwise_axes=channel_axes,
                         calibration=gq.calibration, stochastic_rounding=gq.stochastic_rounding)
  return qa.quantize(g, spec, key=key)


def key_data(key) -> jax.Array | None:
  if key is None:
    return None
  if jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    return jax.random.key_data(key)
  return jnp.asarray(key, jnp.uint32)


def split_key(kd, n: int):
  if kd is None:
    return [None] * n
  return list(jax.random.split(jax.random.wrap_key_data(kd), n))


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


def _fold_scale(g, y: qa.QArray, dims, swap_ans: bool, nxk: int):
  """Moves ``y``'s scale into ``g`` when it varies along the contraction.

  Returns (g', y') or None when the scale varies jointly along contracted and
  free axes of this product (then the caller multiplies in float).
  """
  (gc, yk), (gb, yb) = dims
  ys = y.scale
  y_free = [a for a in range(y.ndim) if a not in yk and a not in yb]
  varies = lambda axes: any(ys.shape[a] != 1 for a in axes)
  if not varies(yk):
    return g, y
  if varies(y_free):
    return None
  t = jnp.transpose(ys, tuple(yb) + tuple(yk) + tuple(y_free))
  t = t.reshape(t.shape[:len(yb) + len(yk)])
  nb = len(yb)
  if swap_ans:
    s_g = t.reshape(t.shape + (1,) * nxk)
  else:
    s_g = t.reshape(t.shape[:nb] + (1,) * nxk + t.shape[nb:])
  g2 = g.astype(jnp.float32) * s_g
  y2 = dataclasses.replace(y, scale=jnp.ones((1,) * y.ndim, jnp.float32))
  return g2, y2


def backward_product(g, y_res, dn_x_first, x_ndim: int, *, swap_ans: bool, gq, key,
                     implementation: str, x_shape):
  """``x_bar`` for one operand: quantize g (folding y's scale), dot, transpose."""
  from qtrain.pallas import dispatch  # the kernels' seam

  dims, perm, g_free = transpose_dims(dn_x_first, x_ndim, y_res.ndim, swap_ans=swap_ans)
  g_in = g
  if gq is not None:
    y_in = y_res
    if qdot.is_quantized(y_res):
      x_kept = len(qdot.free_axes(x_ndim, dn_x_first[0][0], dn_x_first[1][0]))
      folded = _fold_scale(g, y_res, dims, swap_ans, x_kept)
      if folded is not None:
        g_in, y_in = folded
    g_in = quantize_grad(g_in, gq, g_free, key)
  else:
    y_in = y_res
  r = dispatch.quantized_dot_general(g_in, y_in, dims, preferred_element_type=jnp.float32,
                                     implementation=implementation)
  return jnp.transpose(r, perm).reshape(x_shape)


# ----------------------------------------------------------------------------
# The op.


def _channel_axes(ndim, contract, batch):
  return tuple(sorted(set(batch) | set(qdot.free_axes(ndim, contract, batch))))


def _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype):
  from qtrain.pallas import dispatch

  (lc, rc), (lb, rb) = dn
  lres = quantize_operand(lhs, config.lhs, lhs_scale, _channel_axes(lhs.ndim, lc, lb),
                          lc[-1] if lc else None, "lhs")
  rres = quantize_operand(rhs, config.rhs, rhs_scale, _channel_axes(rhs.ndim, rc, rb),
                          rc[-1] if rc else None, "rhs")
  if config.lhs is None and config.rhs is None:
    out = jax.lax.dot_general(lhs, rhs, dn, precision=precision, preferred_element_type=out_dtype)
  else:
    out = dispatch.quantized_dot_general(lres.value, rres.value, dn, preferred_element_type=out_dtype,
                                         implementation=config.implementation)
  return out, (lres, rres)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _dot_general_qt(lhs, rhs, lhs_scale, rhs_scale, kd, dn, config, precision, out_dtype, shapes):
  return _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype)[0]


def _fwd(lhs, rhs, lhs_scale, rhs_scale, kd, dn, config, precision, out_dtype, shapes):
  out, (lres, rres) = _forward(lhs, rhs, lhs_scale, rhs_scale, dn, config, precision, out_dtype)
  return out, (lres, rres, kd)


def _bwd(dn, config, precision, out_dtype, shapes, res, g):
  lres, rres, kd = res
  (lshape, rshape, ldtype, rdtype) = shapes
  (lc, rc), (lb, rb) = dn
  k_l, k_r = split_key(kd, 2)
  lhs_bar = backward_product(g, rres.value, dn, len(lshape), swap_ans=False, gq=config.dlhs_grad,
                             key=k_l, implementation=config.implementation, x_shape=lshape)
  rhs_bar = backward_product(g, lres.value, ((rc, lc), (rb, lb)), len(rshape), swap_ans=True,
                             gq=config.drhs_grad, key=k_r, implementation=config.implementation,
                             x_shape=rshape)
  lhs_bar, ls_bar = finish_operand_grad(lhs_bar, lres, config.lhs, ldtype)
  rhs_bar, rs_bar = finish_operand_grad(rhs_bar, rres, config.rhs, rdtype)
  return lhs_bar, rhs_bar, ls_bar, rs_bar, None


_dot_general_qt.defvjp(_fwd, _bwd)


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
) -> jax.Array:
  """Quantized-training ``jax.lax.dot_general``.

  Args:
    lhs, rhs: float operands.
    dimension_numbers: as for :func:`jax.lax.dot_general` (batch axes too).
    config: a :class:`~qtrain.core.config.DotGeneralQtConfig`.
    precision: used by float products (an unquantized op).
    preferred_element_type: the output dtype (default: the operands' result
      type); the backward returns gradients in each operand's dtype.
    key: PRNG key for stochastic rounding of gradients (required when the
      config asks for stochastic rounding).
    lhs_scale, rhs_scale: optional scales to use instead of calibrating
      (static or learned; they receive gradients per ``scale_grad``).

  Returns:
    ``dot_general(lhs, rhs)`` computed with quantized operands.

  Raises:
    ValueError: on a config that cannot be honoured (the message names the field).
  """
  if not isinstance(config, cfg_lib.DotGeneralQtConfig):
    raise ValueError(f"config must be a DotGeneralQtConfig, got {type(config).__name__}")
  for name, v in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(jnp.result_type(v), jnp.floating):
      raise ValueError(f"{name} must be a float array, got dtype {jnp.result_type(v)}")
  dn = qdot.normalize_dimension_numbers(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  if config.needs_key and key is None:
    raise ValueError("config asks for stochastic_rounding in dlhs_grad/drhs_grad: pass key=")
  for name, oq, x, c in (("lhs", config.lhs, lhs, dn[0][0]), ("rhs", config.rhs, rhs, dn[0][1])):
    if oq is not None and oq.tile_size:
      if not c:
        raise ValueError(f"config.{name}.tile_size={oq.tile_size} but the op contracts no axis")
      n = jnp.shape(x)[c[-1]]
      if n % oq.tile_size:
        raise ValueError(f"config.{name}.tile_size={oq.tile_size} does not divide the contracting "
                         f"axis of size {n} (shape {jnp.shape(x)})")
  out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                        else jnp.result_type(lhs, rhs))
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"preferred_element_type={out_dtype} must be a float dtype for a QT op")
  shapes = (tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs)), jnp.result_type(lhs), jnp.result_type(rhs))
  return _dot_general_qt(lhs, rhs, lhs_scale, rhs_scale, key_data(key), dn, config, precision,
                         out_dtype, shapes)
