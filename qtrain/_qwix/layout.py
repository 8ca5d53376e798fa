"""qwix's PTQ params layout on qtrain's frozen layers.

In qwix's PTQ params, each quantized weight is a :class:`WithAux` leaf holding a
:class:`QArray` ``(qvalue, scale[, zero_point])`` in the weight's own layout (``qvalue`` the
parameter's shape, ``scale`` / ``zero_point`` of the same rank, one value per tile of each
axis), and a rule's static input scale is a ``WithAux`` of its scale under
``<op id>_lhs_scale`` beside the module's params. qtrain's frozen layers (:mod:`qtrain._frozen`)
keep the same codes and scales packed ``(N, K)``; this module converts between the two. The
conversion is a re-arrangement (transposes, packing), never a re-quantization: a
:class:`WithAux`'s ``how`` holds the frozen layer's metadata, so the arrays alone rebuild it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import meta

from qtrain import _frozen
from qtrain._frozen import FrozenLayer
from qtrain.core import qtypes
from qtrain.ops import config as cfg_lib


def unbox(tree):
  """``tree`` with nnx Variables and linen boxes (``nn.Partitioned``) replaced by their values."""
  def one(v):
    if isinstance(v, nnx.Variable):
      return v.get_value()
    if isinstance(v, meta.AxisMetadata):
      return v.unbox()
    return v
  return jax.tree.map(one, tree, is_leaf=lambda v: isinstance(v, (nnx.Variable, meta.AxisMetadata)))


def _rebox(box, value):
  """``value`` in ``box``'s place: a linen box or nnx Variable keeps its metadata."""
  if isinstance(box, meta.AxisMetadata):
    return box.replace_boxed(value)
  if isinstance(box, nnx.Variable):
    return box.replace(value)
  return value


@flax.struct.dataclass
class QArray:
  """qwix's ``QArray``: ``x ~ (qvalue - zero_point) * scale``, ``scale`` and ``zero_point`` of
  ``qvalue``'s rank, each axis dividing ``qvalue``'s (one value per tile of it).

  Attributes:
    qvalue: the codes, in the weight's own shape (int8; int4 / int2 for those qtypes).
    scale: float scales.
    zero_point: None (symmetric) or the zero points, in ``qvalue``'s dtype.
    qtype: the qtype's name (static); defaults to ``qvalue``'s dtype name.
  """

  qvalue: Any
  scale: Any
  zero_point: Any = None
  qtype: Any = flax.struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    if self.qtype is None:
      dt = getattr(unbox(self.qvalue), "dtype", None)
      if dt is not None:
        object.__setattr__(self, "qtype", qtype_of(jnp.dtype(dt).name))

  shape = property(lambda self: unbox(self.qvalue).shape)
  ndim = property(lambda self: len(unbox(self.qvalue).shape))
  dtype = property(lambda self: unbox(self.scale).dtype)

  def astype(self, dtype) -> "QArray":
    """The dequantized dtype changed (the scale's), as qwix's."""
    return self.replace(scale=_rebox(self.scale, unbox(self.scale).astype(dtype)))


@flax.struct.dataclass
class WithAux:
  """qwix's ``WithAux``: an array or :class:`QArray` with static ``how`` (how it was quantized:
  for qtrain.qwix's PTQ params, the frozen layer's metadata)."""

  array: Any
  how: Any = flax.struct.field(pytree_node=False, default=None)

  value = property(lambda self: unbox(self.array))
  shape = property(lambda self: unbox(self.array).shape)
  ndim = property(lambda self: len(unbox(self.array).shape))
  dtype = property(lambda self: unbox(self.array).dtype)

  def __getitem__(self, key):
    return jax.tree.map(lambda x: x[key], self.value)

  def astype(self, dtype) -> "WithAux":
    inner = unbox(self.array)
    if isinstance(inner, QArray):
      return self.replace(array=self.array.astype(dtype) if isinstance(self.array, QArray)
                          else inner.astype(dtype))
    return self.replace(array=_rebox(self.array, inner.astype(dtype)))

  def reshape(self, *shape) -> "WithAux":
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
      shape = tuple(shape[0])
    if tuple(self.shape) != tuple(shape):
      raise ValueError(f"a quantized weight keeps its shape {tuple(self.shape)}; reshape to "
                       f"{tuple(shape)} asked")
    return self


for _cls in (QArray, WithAux):
  nnx.register_data_type(_cls)
  # A frozen (PTQ) model's direct calls take it as a weight operand (``x @ self.w``).
  _cls.__qtrain_quantized_weight__ = True


@dataclasses.dataclass(frozen=True)
class WeightHow:
  """``how`` of a PTQ weight: the frozen layer's metadata (``spec``, arrays None), its key in
  qtrain's frozen layers, and the weight's quantization (for :func:`requantize`)."""

  key: str
  spec: FrozenLayer
  weight_quant: cfg_lib.OperandQuant | None
  # A layer stacked by nnx.vmap (run by nnx.scan / nnx.vmap): the stack's shape, the leading
  # axes of the QArray's arrays (``spec`` is one layer's); () otherwise.
  stack: tuple[int, ...] = ()

  @property
  def qtype(self) -> str:
    return self.spec.w_qtype


@dataclasses.dataclass(frozen=True)
class ScaleHow:
  """``how`` of a PTQ static input scale: its frozen layer's key, the input's qtype, and
  whether the scale has a zero point (an asymmetric, ``minmax``, static scale: a plain param
  ``<op id>_lhs_zero_point`` beside ``<op id>_lhs_scale``, as qwix keeps it)."""

  key: str
  qtype: str
  zero_point: bool = False

  @property
  def qmax(self) -> float:
    return float(qtypes.get_qtype(self.qtype).qmax)


def storage_dtype(qtype: str):
  """The dtype of a weight's codes in qwix's layout: int4 / int2 where the qtype is, the fp8
  dtype for fp8 and mxfp8 (e4m3fn elements), else int8."""
  qt = qtypes.get_qtype(qtype)
  if qt.is_float:
    return qt.compute_dtype
  return {"int4": jnp.int4, "int2": jnp.int2}.get(qtype, jnp.int8)


def qtype_of(name: str):
  """A QArray's ``qtype``: the dtype where the qtype is one (``jnp.dtype("int8")``, which
  compares equal to ``jnp.int8`` and to ``"int8"``, as qwix's), else its name (``"nf4"``)."""
  try:
    return jnp.dtype(name)
  except TypeError:
    return name


def scale_groups(spec: FrozenLayer, weight_quant: cfg_lib.OperandQuant | None
                 ) -> tuple[int, ...] | None:
  """The number of scales along each axis of a dot weight quantized with per-axis tiles
  (``tile_size={axis: tile}``, qwix's 2-D scales), as qwix keeps them: a tiled axis one per
  tile, a contracting axis not named one, a batch axis one per index, a free axis not named one
  per index (one in all without ``channelwise``). None for other weights (whose scales
  :meth:`FrozenLayer.kernel_qarray` already gives in that layout)."""
  if (weight_quant is None or spec.kind != "dot"
      or not cfg_lib.is_per_axis(weight_quant.tile_size)):
    return None
  ks = tuple(spec.kernel_shape)
  tiles = cfg_lib.resolve_axis_tiles(weight_quant.tile_size, ks, "tile_size")
  contract, batch, _ = _frozen._dot_axes(spec)
  out = []
  for a, n in enumerate(ks):
    if a in tiles:
      out.append(n // tiles[a])
    elif a in contract:
      out.append(1)
    elif a in batch or weight_quant.channelwise:
      out.append(n)
    else:
      out.append(1)
  return tuple(out)


def _compact(a, groups: tuple[int, ...]):
  """A scale (or zero point) that is constant over each tile, one value per tile: ``groups``
  values along each axis (the first element of each tile)."""
  full = a
  for ax, g in enumerate(groups):
    n = full.shape[ax]
    if n == g:
      continue
    if n == 1:  # one value broadcast along the axis: repeat it to the tiles
      full = jnp.repeat(full, g, axis=ax)
      continue
    full = jax.lax.slice_in_dim(full, 0, n, stride=n // g, axis=ax)
  return full


def to_qarray(layer: FrozenLayer, weight_quant: cfg_lib.OperandQuant | None = None) -> QArray:
  """A frozen layer's weight as qwix's QArray in the weight's own layout (its codes and scales:
  one scale per tile of each axis, ``weight_quant`` saying the per-axis tiles of 2-D scales)."""
  q = layer.kernel_qarray()
  dt = storage_dtype(layer.w_qtype)
  scale, zp = q.scale.astype(jnp.float32), q.zero_point
  groups = scale_groups(layer, weight_quant)
  if groups is not None:
    scale = _compact(scale, groups)
    zp = None if zp is None else _compact(zp, groups)
  zp = None if zp is None else zp.astype(dt)
  return QArray(qvalue=q.qvalue.astype(dt), scale=scale, zero_point=zp,
                qtype=qtype_of(layer.w_qtype))


def _expand(a, shape):
  """A per-tile array repeated to ``shape`` (each axis of ``a`` 1, equal, or dividing)."""
  for ax, (g, n) in enumerate(zip(a.shape, shape)):
    if g not in (1, n):
      a = jnp.repeat(a, n // g, axis=ax)
  return jnp.broadcast_to(a, shape)


def to_frozen(how: WeightHow, qarray: QArray, scale_a=None, zero_a=None) -> FrozenLayer:
  """The frozen layer of a PTQ weight: its codes packed ``(N, K)``, scales per channel / group."""
  spec = how.spec
  qv = jnp.asarray(unbox(qarray.qvalue))
  scale = jnp.asarray(unbox(qarray.scale), jnp.float32)
  zp = qarray.zero_point
  zp = None if zp is None else jnp.asarray(unbox(zp)).astype(jnp.float32)
  ks = tuple(spec.kernel_shape)
  if tuple(qv.shape) != ks:
    raise ValueError(f"layer {how.key!r}: qvalue has shape {tuple(qv.shape)}, the weight's {ks}")
  for what, a in (("scale", scale), ("zero_point", zp)):
    if a is not None and (a.ndim != len(ks) or any(n % g for g, n in zip(a.shape, ks))):
      raise ValueError(f"layer {how.key!r}: {what} of shape {tuple(a.shape)} does not tile "
                       f"qvalue's {ks}")
  codes = qv.astype(storage_dtype(spec.w_qtype) if qtypes.get_qtype(spec.w_qtype).is_float
                   else jnp.int8)
  if spec.kind == "conv":
    perm = tuple(spec.layout)
    lead, n, k = (), spec.n, spec.k
  else:
    contract, batch, free = _frozen._dot_axes(spec)
    perm = batch + free + contract
    nb = math.prod(ks[a] for a in batch)
    lead, n = ((nb,) if batch else ()), math.prod(ks[a] for a in free)
    k = math.prod(ks[a] for a in contract)
  flat = lambda a: jnp.transpose(a, perm).reshape(lead + (n, k))
  codes = flat(codes)

  def per_group(a):
    full = flat(_expand(a, ks))
    if spec.group_size is None:
      return full[..., 0]
    return full[..., ::spec.group_size]
  return dataclasses.replace(
      spec, words=_frozen.store_codes(codes, spec.w_qtype), w_scale=per_group(scale),
      w_zero=None if zp is None else per_group(zp),
      scale_a=None if scale_a is None else jnp.asarray(scale_a, jnp.float32).reshape(()),
      zero_a=None if zero_a is None else jnp.asarray(zero_a).astype(jnp.float32).reshape(()))


def stack_qarrays(qarrays: list, stack: tuple[int, ...]) -> QArray:
  """The QArrays of a stack's layers (``np.ndindex(stack)`` order) as one, each array with the
  stack's leading axes (one QArray as it is for no stack)."""
  if not stack:
    return qarrays[0]
  first = qarrays[0]
  st = lambda name: (None if getattr(first, name) is None else jnp.stack(
      [getattr(q, name) for q in qarrays]).reshape(stack + getattr(first, name).shape))
  return QArray(qvalue=st("qvalue"), scale=st("scale"), zero_point=st("zero_point"),
                qtype=first.qtype)


def requantize(how: WeightHow, kernel, where: str) -> QArray:
  """``kernel`` (a float weight) quantized as the PTQ weight ``how`` says, in qwix's layout (a
  stack's weight layer by layer, its arrays stacked)."""
  spec = how.spec
  if how.weight_quant is None:
    raise ValueError(f"quantize_params: {where!r}: the template does not say how its weight was "
                     "quantized")
  kernel = jnp.asarray(kernel)
  want = tuple(how.stack) + tuple(spec.kernel_shape)
  if tuple(kernel.shape) != want:
    raise ValueError(f"quantize_params: {where!r} has shape {tuple(kernel.shape)}, the "
                     f"template's {want}")
  if how.stack:
    one = dataclasses.replace(how, stack=())
    return stack_qarrays([requantize(one, kernel[idx], f"{where}[{idx}]")
                          for idx in np.ndindex(*how.stack)], tuple(how.stack))
  if spec.kind != "conv" and len(spec.layout[0]) > 1 and spec.group_size is not None:
    raise ValueError(f"quantize_params: {where!r}: a tile across several contracting axes is "
                     "not rebuilt from float weights here: quantize the model with "
                     "quantize_model(model, PtqProvider(rules), x) instead")
  return to_qarray(_frozen.rebuild(spec, kernel, how.weight_quant, where=where), how.weight_quant)


def static_scale_array(scale, ndim: int):
  """A per-tensor input scale in qwix's layout: shape ``(1,) * ndim`` (the input's rank)."""
  return jnp.asarray(scale, jnp.float32).reshape((1,) * ndim)


def asarray(a, dtype, fallback):
  """``jnp.asarray(a, dtype)`` inside a PTQ model's call (qwix's): a quantized weight passes
  through to the quantized op instead of raising.

  * a :class:`QArray` is returned as it is, or with its dequantized dtype (the scale's) changed
    to ``dtype`` (:meth:`QArray.astype`);
  * a :class:`WithAux` keeps its ``how``, its array converted (unboxed) the same way;
  * an nnx Variable or linen box is read first (``nnx.Param(WithAux(...))`` is the WithAux);
  * an ``nnx.State`` of a quantized weight, ``{"array": {"qvalue", "scale"[, "zero_point"]}}``,
    becomes that :class:`QArray`;
  * anything else is ``fallback(a, dtype)``: JAX's ``jnp.asarray``, unchanged.

  Raises:
    ValueError: an ``nnx.State`` that is no quantized weight's, naming its keys.
  """
  if isinstance(a, (nnx.Variable, meta.AxisMetadata)):
    a = unbox(a)
  if isinstance(a, nnx.State):
    inner = unbox(a["array"]) if "array" in a else None
    if not (isinstance(inner, nnx.State) and "qvalue" in inner and "scale" in inner):
      found = sorted(map(str, (inner if isinstance(inner, nnx.State) else a).keys()))
      raise ValueError(f"jnp.asarray of an nnx.State with keys {found} inside a PTQ model: only "
                       "a quantized weight's state, {'array': {'qvalue', 'scale'[, "
                       "'zero_point']}}, converts (to a QArray); pass an array or a Variable")
    a = QArray(qvalue=inner["qvalue"], scale=inner["scale"],
               zero_point=inner["zero_point"] if "zero_point" in inner else None)
  if isinstance(a, WithAux):
    return a.replace(array=asarray(a.array, dtype, fallback))
  if isinstance(a, QArray):
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(a.dtype):
      return a.astype(dtype)
    return a
  return fallback(a, dtype)


def static_zero_point_array(zero_point, ndim: int, qtype: str):
  """A per-tensor input zero point in qwix's layout: shape ``(1,) * ndim``, in the input
  qtype's storage dtype (int8; int4 / int2)."""
  return jnp.asarray(zero_point).reshape((1,) * ndim).astype(storage_dtype(qtype))


def is_quantized_leaf(x) -> bool:
  return isinstance(x, WithAux)


def tree_has_quantized(tree) -> bool:
  return any(isinstance(x, WithAux) for x in jax.tree.leaves(tree, is_leaf=is_quantized_leaf))


def np_dtype_name(x) -> str:
  return np.dtype(getattr(x, "dtype", np.float32)).name
