"""Operand handling shared by the QT ops (dot_general_qt, conv_general_qt).

Quantizing a forward operand (calibrated or with a passed-in scale) into the
residual the backward keeps (:class:`OperandResidual`: the QArray, the
estimator's pass mask, the float operand only when an LSQ-learned scale needs
it); finishing an operand's gradient (mask, learned-scale gradient);
quantizing an incoming gradient; PRNG key plumbing through ``custom_vjp``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qtrain.core import config as cfg_lib
from qtrain.core import estimators
from qtrain.core import qarray as qa


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


def split_key(kd, n: int):
  if kd is None:
    return [None] * n
  return list(jax.random.split(kd, n))
