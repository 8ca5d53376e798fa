"""Operand handling shared by the QT ops (dot_general_qt, conv_general_qt).

Quantizing a forward operand (calibrated or with a passed-in scale) into the
residual the backward keeps (:class:`OperandResidual`: the QArray, the
estimator's pass mask, the float operand only when an LSQ-learned scale needs
it); finishing an operand's gradient (mask, learned-scale gradient);
quantizing an incoming gradient; PRNG key plumbing through ``custom_vjp``;
tracing each op's forward and backward once per signature (:func:`traced_once`);
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
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def tiles_of(tile, shape, channel_axes: tuple[int, ...], tile_axis: int | None, what: str
             ) -> tuple[tuple[int, ...], dict[int, int]]:
  """(channelwise axes, ``{axis: tile}``) of an operand of ``shape`` whose scales are per index
  of ``channel_axes`` and tiled per ``tile`` (:func:`qtrain.ops.config.check_tile`): an int or a
  fraction along ``tile_axis``, or per-axis tiles (a tiled axis is no longer channelwise)."""
  if tile is None:
    return tuple(channel_axes), {}
  if cfg_lib.is_per_axis(tile):
    tiles = cfg_lib.resolve_axis_tiles(tile, shape, what)
    return tuple(a for a in channel_axes if a not in tiles), tiles
  if tile_axis is None:
    return tuple(channel_axes), {}
  return tuple(channel_axes), {tile_axis: cfg_lib.resolve_tile(tile, int(shape[tile_axis]), what)}


def operand_spec(oq: cfg_lib.OperandQuant, ndim: int, channel_axes: tuple[int, ...],
                 tile_axis: int | None, *, shape=None) -> qa.QuantizeSpec:
  """The QuantizeSpec of a forward operand (``shape``: the operand's, needed for a fractional
  or per-axis ``tile_size``)."""
  cw, tiles = (tuple(channel_axes), {})
  if oq.tile_size is not None:
    if shape is None:
      if isinstance(oq.tile_size, int) and tile_axis is not None:
        tiles = {tile_axis: oq.tile_size}
      elif not isinstance(oq.tile_size, int):
        raise ValueError(f"operand_spec: tile_size={oq.tile_size!r} needs the operand's shape=")
    else:
      cw, tiles = tiles_of(oq.tile_size, shape, cw, tile_axis, "tile_size")
  return qa.QuantizeSpec(
      qtype=oq.qtype,
      channelwise_axes=cw if oq.channelwise else (),
      tiled_axes=tiles,
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
  given_scale: Any      # the passed-in scale (its original shape), or None; with a zero
                        # point, the pair (scale, zero point)


def split_given(given_scale):
  """``(scale, zero point or None)`` of a passed-in scale (a pair where a zero point came with
  it: an asymmetric static scale)."""
  if isinstance(given_scale, tuple):
    return given_scale
  return given_scale, None


def as_zero_point(zp, shape, what: str, qt) -> jax.Array:
  """A passed-in zero point, reshaped like :func:`as_scale`: integral values in [qmin, qmax]
  (rounded and clipped there)."""
  if qt.kind != "int":
    raise ValueError(f"{what} was given for qtype {qt.name!r}: a zero point needs an integer "
                     "qtype (asymmetric quantization)")
  z = as_scale(zp, shape, what)
  return jnp.clip(jnp.round(z), qt.qmin, qt.qmax)


def quantize_operand(x, oq, given_scale, channel_axes, tile_axis, what) -> OperandResidual:
  """Quantizes one forward operand (or keeps it float) and builds its residual.
  ``given_scale``: None (calibrated), a scale, or ``(scale, zero point)``."""
  check_given_scale(oq, given_scale, what)
  if oq is None:
    return OperandResidual(value=x, mask=None, x=None, given_scale=None)
  spec = operand_spec(oq, x.ndim, channel_axes, tile_axis, shape=x.shape)
  if given_scale is None:
    q = qa.quantize(x, spec)
  else:
    scale, zp = split_given(given_scale)
    if zp is not None:
      zp = as_zero_point(zp, x.shape, f"{what}_zero_point", oq.qtype)
    q = qa.quantize_with_scale(x, oq.qtype, as_scale(scale, x.shape, f"{what}_scale"), zp)
  full_scale = qa.expand_scale(q.scale, x.shape)
  zp = None if q.zero_point is None else qa.expand_scale(q.zero_point, x.shape)
  mask = estimators.pass_mask(oq.estimator, x, full_scale, qmax=qa.pass_limit(q.qtype),
                              zero_point_full=zp, qmin=q.qtype.qmin)
  keep_x = given_scale is not None and oq.scale_grad == "lsq"
  return OperandResidual(value=q, mask=mask, x=x if keep_x else None, given_scale=given_scale)


def finish_operand_grad(x_bar, res: OperandResidual, oq, dtype):
  """Applies the estimator mask and computes a learned scale's gradient."""
  scale_bar = None
  if res.given_scale is not None:
    q: qa.QArray = res.value
    given, given_zp = split_given(res.given_scale)
    full = qa.expand_scale(q.scale, q.shape)
    if oq.scale_grad == "lsq":
      if q.zero_point is None:
        sb = estimators.lsq_scale_grad(x_bar, res.x, qa.values_of(q), q.scale, full,
                                       qmin=q.qtype.qmin, qmax=q.qtype.qmax)
      else:  # the grid is (codes - zp) * scale: LSQ's rule on the shifted codes and bounds
        z = qa.expand_scale(q.zero_point, q.shape)
        y = qa.divide_by_scale(res.x.astype(jnp.float32), q.scale)
        v = qa.values_of(q) - z
        inside = (y >= q.qtype.qmin - z) & (y <= q.qtype.qmax - z)
        d = jnp.where(inside, v - y, v)
        factor = 1.0 / jnp.sqrt(float(q.qvalue.size // max(q.scale.size, 1)) *
                                float(max(q.qtype.qmax, 1.0)))
        sb = estimators.reduce_to(x_bar.astype(jnp.float32) * d,
                                  q.scale.shape).reshape(q.scale.shape) * factor
    else:
      masked = x_bar if res.mask is None else jnp.where(res.mask, x_bar, 0)
      sb = estimators.bitorch_scale_grad(masked, q.qvalue, q.scale)
    scale_bar = sb.reshape(jnp.shape(given)).astype(jnp.result_type(given))
    if given_zp is not None:  # a zero point takes no gradient (integral)
      scale_bar = (scale_bar, jnp.zeros(jnp.shape(given_zp), jnp.result_type(given_zp)))
  if res.mask is not None:
    x_bar = jnp.where(res.mask, x_bar, 0)
  return x_bar.astype(dtype), scale_bar


def quantize_grad(g, gq: cfg_lib.GradQuant, channel_axes, key, contract_axes=()):
  """The incoming gradient quantized per ``gq``: one scale per index of ``channel_axes`` (its
  axes kept by the product), tiled per ``gq.tile_size`` (an int or a fraction along the last of
  ``contract_axes``, or per-axis tiles in ``g``'s axes)."""
  cw, tiles = tiles_of(gq.tile_size, jnp.shape(g), tuple(channel_axes),
                       contract_axes[-1] if contract_axes else None, "GradQuant.tile_size")
  spec = qa.QuantizeSpec(qtype=gq.qtype, channelwise_axes=cw, tiled_axes=tiles,
                         calibration=gq.calibration, stochastic_rounding=gq.stochastic_rounding,
                         axis_names=gq.axis_names)
  return qa.quantize(g, spec, key=key)


def quantize_mx_grad(g, gq: cfg_lib.GradQuant, contract_axes, key):
  """An MX gradient (``gq.qtype`` mxfp8 / mxfp4): one e8m0 scale per block of 32 values along
  the product's contraction, ``contract_axes`` of ``g`` flattened in ``g``'s axis order: each
  block is 32 consecutive values of that flattened contraction, at one index of the other axes;
  a contraction that is not a multiple of 32 ends in a shorter block (zeros pad it).

  Returns a QArray (tiled along the last contracting axis, channelwise along every other) where
  that axis is a multiple of 32, else the dequantized float32 values of the same blocks.
  """
  qt, block = gq.qtype, gq.qtype.block_size
  nd, shape = g.ndim, tuple(g.shape)
  ca = sorted(a % nd for a in contract_axes)
  spec = lambda cw, t: qa.QuantizeSpec(qtype=qt, channelwise_axes=cw, tiled_axes={t: block},
                                       calibration=gq.calibration,
                                       stochastic_rounding=gq.stochastic_rounding)
  if ca and shape[ca[-1]] % block == 0:
    return qa.quantize(g, spec(tuple(a for a in range(nd) if a != ca[-1]), ca[-1]), key=key)
  rest = [a for a in range(nd) if a not in ca]
  perm = rest + ca
  k = math.prod(shape[a] for a in ca)
  t = jnp.transpose(g, perm).reshape(tuple(shape[a] for a in rest) + (k,))
  t = jnp.pad(t, [(0, 0)] * len(rest) + [(0, -k % block)])
  v = qa.quantize(t, spec(tuple(range(len(rest))), len(rest)), key=key).dequantize(jnp.float32)
  v = v[..., :k].reshape(tuple(shape[a] for a in perm))
  return jnp.transpose(v, tuple(int(i) for i in np.argsort(perm)))


varying_axes = _lax.varying_axes


def operand_axes(*operands) -> tuple:
  """:func:`varying_axes` of each operand (of each part of a ``(scale, zero point)`` pair):
  what a QT op's backward must give back."""
  return tuple(tuple(varying_axes(v) for v in x) if isinstance(x, tuple) else varying_axes(x)
               for x in operands)


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
  if isinstance(ct, tuple):  # a (scale, zero point) pair's cotangents
    return tuple(match_varying(c, a) for c, a in zip(ct, axes, strict=True))
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


def traced_once(*, static_argnums: tuple[int, ...]):
  """A QT op's forward or backward, traced and lowered once per signature.

  Under a trace (``jax.jit``, ``jax.grad``, ``nnx.jit``...) the function runs as a
  ``jax.jit`` with ``static_argnums`` (the op's dimension numbers, config, dtypes and
  shapes; all hashable): a model's many same-shaped layers reuse one trace of the
  quantization, fold and dispatch (an int8 dot's forward and backward lower to ~460 HLO
  operations where a float dot's take ~17, with both platform branches of the kernel
  dispatch traced) and JAX lowers the shared jaxpr to one function. XLA inlines the
  calls, so the compiled program is the one written inline. Called eagerly (no argument
  a tracer) it runs op by op as written: an eager QT forward computes what an eager
  frozen or float layer computes, rather than one fused program's reassociated sums.
  What the trace reads besides its arguments must be fixed for the process (the backend
  registry, device count): a test that patches such a module attribute clears the cache
  first (``jax.clear_caches()``). ``.traced`` is the ``jax.jit`` function.
  """

  def wrap(fn):
    traced = jax.jit(fn, static_argnums=static_argnums)

    @functools.wraps(fn)
    def call(*args):
      # (The static arguments are hashable configs and shapes: never tracers.)
      if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
        return traced(*args)
      return fn(*args)

    call.traced = traced
    return call

  return wrap
