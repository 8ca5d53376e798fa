"""Operand handling shared by the QT ops (dot_general_qt, conv_general_qt).

Quantizing a forward operand (calibrated or with a passed-in scale) into the
residual the backward keeps (:class:`OperandResidual`: the QArray, the
estimator's pass mask, the float operand only when an LSQ-learned scale needs
it); finishing an operand's gradient (mask, learned-scale gradient);
quantizing an incoming gradient; PRNG key plumbing through ``custom_vjp``;
and the dtype policy both ops follow (:func:`check_operands`,
:func:`compute_dtype`):

* Inputs are float arrays; the output dtype is ``preferred_element_type``
  (a float dtype) or ``result_type(lhs, rhs)`` of the original operands.
* A product of a float operand and a quantized one runs in
  ``promote_types`` of the two *original* float dtypes: the quantized side is
  dequantized into that dtype, the float side cast up to it if narrower. bf16
  activations times a weight quantized from bf16 stay a bf16 x bf16 product
  (float32 accumulation; the W8A16 kernels' path), while a weight quantized
  from float32 times float16 activations computes in float32 (dequantizing
  it into float16 would overflow or flush values the float32 weight holds).
  In a backward product the float side is the incoming gradient (in the
  output dtype) and the quantized side the other operand's residual. A grid
  value beyond that dtype's range (``absmean`` and ``minmax`` grids can reach
  past the data: int4 ``absmean`` of float16 values near 6e4) is Inf there,
  as the same float16 product of that value would be; quantize such data
  from float32 or with ``absmax``.
* Nothing quantized: the op is ``jax.lax.dot_general`` /
  ``jax.lax.conv_general_dilated`` itself (the latter takes no mixed dtypes).
* Two quantized operands: integer-like x integer-like as int8 x int8 ->
  int32, fp8 x fp8 (either kind, mixed e4m3fn x e5m2 included) -> float32,
  both exact before the scales; integer x fp8 and scales that do not factor
  out of the contraction: both dequantized into float32.
* Gradients come back in each operand's own dtype (and a learned scale's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qtrain.core import _lax
from qtrain.core import estimators
from qtrain.core import qarray as qa
from qtrain.core import rounding
from qtrain.ops import config as cfg_lib


def check_operands(lhs, rhs, preferred_element_type) -> jnp.dtype:
  """Validates a QT op's operands; returns its output dtype (see the module docstring).

  Raises:
    ValueError: for a non-float operand or a non-float ``preferred_element_type``.
  """
  for name, v in (("lhs", lhs), ("rhs", rhs)):
    dtype = jnp.result_type(v)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{name} must be a float array, got dtype {dtype} (a QT op quantizes "
                       f"float operands: cast integer data to a float dtype first)")
  out = jnp.dtype(preferred_element_type if preferred_element_type is not None
                  else jnp.result_type(lhs, rhs))
  if not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"preferred_element_type={out} must be a float dtype for a QT op "
                     f"(e.g. float32, bfloat16, float16)")
  return out


def compute_dtype(a_dtype, b_dtype) -> jnp.dtype:
  """The dtype of a product with a float side: ``promote_types`` of the two
  original float dtypes (the quantized side's is that of the array it was
  quantized from). Products of two quantized sides ignore it (see the module
  docstring)."""
  return jnp.promote_types(a_dtype, b_dtype)


def check_given_scale(oq, given_scale, what: str) -> None:
  if oq is None and given_scale is not None:
    raise ValueError(f"{what}_scale was given but config.{what} is None (the operand is float)")


def operand_spec(oq: cfg_lib.OperandQuant, ndim: int, channel_axes: tuple[int, ...],
                 tile_axis: int | None) -> qa.QuantizeSpec:
  """The QuantizeSpec of a forward operand."""
  return qa.QuantizeSpec(
      qtype=oq.qtype,
      channelwise_axes=channel_axes if oq.channelwise else (),
      tiled_axes={tile_axis: oq.tile_size} if (oq.tile_size and tile_axis is not None) else {},
      calibration=oq.calibration,
      axis_names=oq.axis_names,
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
  check_given_scale(oq, given_scale, what)
  if oq is None:
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
      sb = estimators.lsq_scale_grad(x_bar, res.x, qa.values_of(q), q.scale, full,
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
                         calibration=gq.calibration, stochastic_rounding=gq.stochastic_rounding,
                         axis_names=gq.axis_names)
  return qa.quantize(g, spec, key=key)


varying_axes = _lax.varying_axes


def operand_axes(*operands) -> tuple[frozenset, ...]:
  """:func:`varying_axes` of each operand: what a QT op's backward must give back."""
  return tuple(varying_axes(x) for x in operands)


def typed_like_operands(cotangents, axes: tuple[frozenset, ...]) -> tuple:
  """:func:`match_varying` of each cotangent against its operand's :func:`operand_axes`."""
  return tuple(match_varying(ct, a) for ct, a in zip(cotangents, axes, strict=True))


def match_varying(ct, axes: frozenset):
  """A cotangent typed like its primal inside ``jax.shard_map``.

  A replicated operand (a weight) used with a per-shard one (a batch) gets a
  per-shard cotangent from the backward products. JAX's own autodiff sums
  such a cotangent over the mesh axes the primal does not vary over (the
  transpose of the implicit broadcast to every shard), and a ``custom_vjp``
  must do the same: the gradient of a replicated weight is the sum over
  shards, as for a float layer. An operand varying where its cotangent does
  not gets the cotangent cast to varying. Outside shard_map: unchanged.
  """
  if ct is None:
    return None
  have = varying_axes(ct)
  extra = tuple(sorted(have - axes))
  if extra:
    ct = jax.lax.psum(ct, extra)
  missing = tuple(sorted(axes - have))
  if missing:
    ct = jax.lax.pcast(ct, missing, to="varying")
  return ct


def as_key(key) -> jax.Array | None:
  """The PRNG key the ops carry through ``custom_vjp``: a typed key array.

  Typed keys keep their implementation (threefry, rbg, ...); a legacy raw
  ``uint32[2]`` key is wrapped as the default implementation.
  """
  if key is None:
    return None
  if jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))


def split_key(kd, grads) -> list:
  """One key per backward product, for the :class:`~qtrain.ops.config.GradQuant` (or None) of
  each (:func:`qtrain.core.rounding.split_key`)."""
  return rounding.split_key(kd, len(grads), [None if gq is None else gq.stochastic_rounding
                                             for gq in grads])
