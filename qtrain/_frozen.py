"""Frozen layers and their products: the numerics behind :mod:`qtrain.freeze`.

A :class:`FrozenLayer` is one quantized weight, stored packed, plus what its
op needs to quantize the other operand at inference. It is built by
quantizing the weight operand with the QT op's own function and spec
(:func:`qtrain.ops.qt_operand.quantize_operand`: the same calibration, the
same rounding, so the same codes and scales), and knows how the op
contracts it (``layout``):

* dot ops (``dot_general`` and the ``dot_general`` an ``einsum`` becomes):
  the weight's contracting and batch axes. The codes are stored
  ``(N, K)`` (``(B, N, K)`` with batch axes): N the free axes flattened in
  kernel order, K the contracting axes flattened in the op's contracting
  order; packed along K. Group-wise scales (``tile_size``, along the last
  contracting axis) become ``(N, K // tile_size)`` groups of flattened K.
  Where a tile meets a contraction of several axes, the op merges them
  first (:func:`~qtrain.ops.dot_general_qt.merge_tiled_contraction`), and
  so does freezing, and inference with the frozen layer: the layer keeps
  the op's own ``kernel_shape`` and ``layout``, its codes and groups those
  of the merged contraction.
* convolutions: the kernel's ``rhs_spec`` (O, I, spatial...); codes
  ``(O, I * prod(spatial))``, K channel-major, the patch order of
  :func:`jax.lax.conv_general_dilated_patches`.

Products (:func:`dot_product`, :func:`conv_product`) run by
``implementation`` (the rules' names, :data:`IMPLEMENTATIONS`):

* ``"xla"`` / ``"auto"`` off a GPU: the weight is rebuilt in the kernel's own
  layout and the product is *the QT forward's call*
  (:func:`qtrain.ops.dispatch.quantized_dot_general` with the op's own
  dimension numbers; convolutions :func:`~qtrain.ops.conv_general_qt.quantized_conv`):
  the same codes, scales, layouts and epilogue, so the same numbers (op by
  op: under ``jax.jit`` XLA fuses each graph its own way and may sum a float x
  dequantized product in another order).
* ``"triton"`` / ``"interpret"`` (and ``"auto"`` on a GPU where a kernel takes
  the layer): the activation is reshaped to ``(M, K)`` in the weight's K
  order and multiplied with the packed weight as a
  :class:`~qtrain.kernels.prepared.PreparedWeight` through dispatch;
  convolutions as im2col of the *quantized* input (zero padding contributes
  0) + the packed matmul. A forced kernel that cannot take a layer raises,
  naming the layer and the reason.
* ``"mosaic"``: the Mosaic GPU kernels through dispatch (it says why a layer
  cannot run there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qtrain import _einsum
from qtrain import sparsity as sparsity_lib
from qtrain.core import packing
from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.core import qtypes
from qtrain.kernels import prepared
from qtrain.ops import config as cfg_lib
from qtrain.ops import dispatch
from qtrain.ops import im2col
from qtrain.ops import lora as lora_ops
from qtrain.ops import qt_operand as qop
from qtrain.ops.conv_general_qt import quantized_conv
from qtrain.ops.dot_general_qt import merge_tiled_contraction

IMPLEMENTATIONS = cfg_lib.IMPLEMENTATIONS
ARRAY_FIELDS = ("words", "w_scale", "w_zero", "scale_a", "bias_a", "bias", "zero_a")
META_FIELDS = ("kind", "w_qtype", "k", "n", "kernel_shape", "group_size", "act", "layout",
               "weight_operand", "weight_dtype", "param", "param_dtype", "op_id", "op_name", "lora",
               "w_sparsity", "a_sparsity")
# What an activation's scale comes from at inference (FrozenLayer.act["scale"]):
#   None: calibrated per call as the op's OperandQuant says;
#   "given": FrozenLayer.scale_a (a learned scale, or a calibrated static one; with
#            FrozenLayer.zero_a, an asymmetric (minmax) static one's zero point);
#   "batch": one scale per tensor calibrated on each call and passed as a given
#            scale (a static scale that was never calibrated: what the QT op does).
ACT_SCALES = (None, "given", "batch")


@dataclasses.dataclass(frozen=True)
class FrozenLayer:
  """One frozen weight (a pytree; the metadata is static).

  Attributes:
    words: packed weight codes, uint32 ``(N, ceil(K / values_per_word))``
      (``(B, N, ...)`` for a weight with batch axes); int8 weights are packed
      too (4 a word). fp8 and mxfp8 weights: their fp8 codes' bytes, uint8
      ``(N, K)`` (:func:`store_codes`; uint8, not the fp8 dtype, so every
      serializer keeps them).
    w_scale: ``(N,)`` per-output-channel or ``(N, G)`` group-wise float32
      weight scale (a per-tensor scale is stored broadcast to ``(N,)``).
    w_zero: None, or like ``w_scale``: the zero point, ``w ~ (q - z) * s``.
    scale_a: None or a float32 scalar: the input's scale when
      ``act["scale"] == "given"`` (learned, or a calibrated static scale).
    bias_a: None or the learned input shift (shaped like the input's
      contracting axes; conv: per input channel), added before quantizing.
    bias: None, or (N,) float32: the layer's bias, for layers applied as a
      whole (:func:`qtrain.freeze.apply_layer`); ops leave the bias to their
      module.
    kind: ``"dot"`` or ``"conv"``.
    w_qtype: the weight qtype name.
    k, n: flattened contracting size and output features.
    kernel_shape: the weight operand's shape (the parameter's shape).
    group_size: K values per weight scale group, or None.
    act: None (float input) or a hashable tuple of (key, value) pairs:
      ``qtype``, ``calibration``, ``bound``, ``multiplier``, ``percentile``,
      ``channelwise``, ``tile_size``, ``scale`` (see :data:`ACT_SCALES`).
    layout: dot: ``(contracting axes, batch axes)`` of the weight in its op;
      conv: the kernel's ``rhs_spec`` (O axis, I axis, spatial axes).
    weight_operand: 0 or 1, the weight's operand index in its op.
    weight_dtype: the dtype of the weight operand the op quantized (a
      module may cast its parameter, e.g. to bfloat16).
    param, param_dtype: the parameter the weight was read from (inference
      puts a placeholder of that name, shape and dtype in its place).
    op_id, op_name: the op of the module (``dot_general0``, ...) this layer
      replaces; None for a layer applied as a whole (qlayers, or frozen from
      a LayerQuant mapping / list of rules).
    lora: None, or ``(("dropout", rate), ("scale", alpha / rank))``: the op
      keeps a LoRA adapter (its ``A`` / ``B`` stay parameters of the module,
      beside the frozen weight; :mod:`qtrain.lora`).
    zero_a: None, or a float32 scalar: the integer zero point of an asymmetric (``minmax``)
      static input scale ``scale_a``, ``x ~ (q - zero_a) * scale_a``.
    w_sparsity, a_sparsity: None, or the N:M sparsity (:class:`qtrain.sparsity.Sparsity` as
      the tuple ``(n, m, order, block_size, offset)``) the op's rule prunes its weight (the
      frozen codes are of the pruned weight; :func:`rebuild` prunes again) / its input with
      (inference prunes the input before quantizing it, as the QT op).
  """

  words: jax.Array
  w_scale: jax.Array
  w_zero: jax.Array | None
  scale_a: jax.Array | None
  bias_a: jax.Array | None
  bias: jax.Array | None
  kind: str
  w_qtype: str
  k: int
  n: int
  kernel_shape: tuple[int, ...]
  group_size: int | None
  act: Any
  layout: tuple = ()
  weight_operand: int = 1
  weight_dtype: str = "float32"
  param: str = "kernel"
  param_dtype: str = "float32"
  op_id: str | None = None
  op_name: str | None = None
  lora: Any = None
  zero_a: jax.Array | None = None
  w_sparsity: Any = None
  a_sparsity: Any = None

  @property
  def lora_dict(self) -> dict | None:
    return None if self.lora is None else dict(self.lora)

  @property
  def act_dict(self) -> dict | None:
    return None if self.act is None else dict(self.act)

  def weight_codes(self) -> jax.Array:
    """The weight codes, ``(N, K)`` (``(B, N, K)`` with batch axes): int8 values (uint8 codes
    for nf4 / mxfp4), or the fp8 values themselves for fp8 and mxfp8 weights."""
    return load_codes(self.words, self.w_qtype, self.k)

  def kernel_qarray(self) -> qa.QArray:
    """The weight as the QT op quantized it: a QArray in the weight operand's own layout."""
    return _kernel_qarray(self)

  def nk_qarray(self) -> qa.QArray:
    """The weight as an ``(N, K)`` QArray (scale ``(N, 1)`` or ``(N, G)``)."""
    if self.words.ndim != 2:
      raise ValueError(f"a weight with batch axes (words {self.words.shape}) has no (N, K) form")
    col = lambda a: None if a is None else (a if a.ndim == 2 else a[:, None])
    return qa.QArray(qvalue=self.weight_codes(), scale=col(self.w_scale), zero_point=col(self.w_zero),
                     qtype=qtypes.get_qtype(self.w_qtype))

  def meta(self) -> dict:
    """The static fields as JSON-able values (plus which arrays are present)."""
    out = {f: getattr(self, f) for f in META_FIELDS}
    out["kernel_shape"] = list(self.kernel_shape)
    out["act"] = self.act_dict
    out["lora"] = self.lora_dict
    out["layout"] = _to_lists(self.layout)
    out["present"] = [f for f in ARRAY_FIELDS if getattr(self, f) is not None]
    return out

  @classmethod
  def from_meta(cls, meta: dict, arrays: dict) -> "FrozenLayer":
    """Inverse of :meth:`meta` (``arrays``: the present array fields)."""
    kw = {f: meta[f] for f in META_FIELDS if f in meta}
    kw["kernel_shape"] = tuple(meta["kernel_shape"])
    kw["act"] = None if meta["act"] is None else tuple(sorted((k, _to_tuples(v)) for k, v in meta["act"].items()))
    kw["lora"] = None if meta.get("lora") is None else tuple(sorted(meta["lora"].items()))
    kw["layout"] = _to_tuples(meta.get("layout", ()))
    for f in ("w_sparsity", "a_sparsity"):
      kw[f] = None if meta.get(f) is None else _to_tuples(meta[f])
    return cls(**{f: (arrays[f] if f in meta["present"] else None) for f in ARRAY_FIELDS}, **kw)


jax.tree_util.register_dataclass(FrozenLayer, data_fields=list(ARRAY_FIELDS),
                                 meta_fields=list(META_FIELDS))


def _to_lists(t):
  return [_to_lists(v) for v in t] if isinstance(t, (tuple, list)) else t


def _to_tuples(t):
  return tuple(_to_tuples(v) for v in t) if isinstance(t, (tuple, list)) else t


class Unsupported(Exception):
  """A layer or call the chosen product path cannot take (the message says why)."""


# ----------------------------------------------------------------------------
# Building: the weight quantized as its QT op does, stored packed.


def sparsity_meta(sp) -> tuple | None:
  """The hashable ``w_sparsity`` / ``a_sparsity`` metadata of a rule's Sparsity (or None)."""
  return None if sp is None else dataclasses.astuple(sp)


def sparsity_of(meta, x, what: str):
  """``x`` pruned as the sparsity metadata ``meta`` says (``x`` itself for None)."""
  if meta is None:
    return x
  return sparsity_lib.sparsify(x, sparsity_lib.Sparsity(*meta), what=what)


def lora_meta(rule) -> tuple | None:
  """The hashable ``lora`` metadata of an op under ``rule`` (None without an adapter)."""
  if not rule.has_lora:
    return None
  return (("dropout", float(rule.lora_dropout)), ("scale", float(rule.lora_scale)))


def act_meta(oq: cfg_lib.OperandQuant | None, scale: str | None):
  """The hashable ``act`` metadata of an input quantized per ``oq``."""
  if oq is None:
    return None
  if scale not in ACT_SCALES:
    raise ValueError(f"scale={scale!r}; valid: {list(ACT_SCALES)}")
  cal = oq.calibration
  meta = dict(
      qtype=oq.qtype.name, calibration=cal.method, bound=cal.bound, multiplier=cal.multiplier,
      percentile=cal.percentile, channelwise=bool(oq.channelwise), tile_size=oq.tile_size,
      scale=scale)
  if oq.axis_names:  # only where set: metadata saved before the field stays as it was
    meta["axis_names"] = tuple(oq.axis_names)
  return tuple(sorted(meta.items()))


def _act_operand(act: dict) -> cfg_lib.OperandQuant:
  cal = qa.Calibration(method=act["calibration"], bound=act["bound"],
                       multiplier=act["multiplier"], percentile=act["percentile"])
  return cfg_lib.OperandQuant(qtype=act["qtype"], calibration=cal, channelwise=act["channelwise"],
                              tile_size=act.get("tile_size"),
                              axis_names=tuple(act.get("axis_names", ())))


def _freezable(qt: qtypes.QType) -> bool:
  return qt.packable or qt.is_float


def check_packable(w_cfg: cfg_lib.OperandQuant, where: str) -> None:
  """Raises, naming the layer, for a weight qtype freeze has no storage for (none today:
  packable qtypes are packed, fp8 ones stored a byte per code)."""
  qt = w_cfg.qtype
  if not _freezable(qt):
    ok = [n for n in qtypes.VALID_QTYPES if _freezable(qtypes.get_qtype(n))]
    raise ValueError(f"freeze: layer {where!r} has {qt.name} weights, which cannot be frozen "
                     f"(frozen weights: {ok})")


def store_codes(codes: jax.Array, qtype) -> jax.Array:
  """A weight's codes ``(..., K)`` as :attr:`FrozenLayer.words`: packed along K into uint32
  words (:mod:`qtrain.core.packing`), or for fp8 / mxfp8 their fp8 bit patterns, one uint8
  byte per code (no packing: a byte is the code's own width)."""
  qt = qtypes.get_qtype(qtype)
  if qt.is_float:
    return jax.lax.bitcast_convert_type(jnp.asarray(codes).astype(qt.compute_dtype), jnp.uint8)
  return packing.pack(codes, qt, axis=-1)


def load_codes(words: jax.Array, qtype, k: int) -> jax.Array:
  """Inverse of :func:`store_codes`: the ``k`` codes of each row (fp8 values for fp8 qtypes)."""
  qt = qtypes.get_qtype(qtype)
  if not qt.is_float:
    return packing.unpack(words, qt, size=k, axis=-1)
  if words.dtype != jnp.uint8 or words.shape[-1] != k:
    raise ValueError(f"{qt.name} weights are stored as uint8 (..., {k}) code bytes, got "
                     f"{words.dtype} {tuple(words.shape)}")
  return jax.lax.bitcast_convert_type(words, qt.compute_dtype)


def _channel_axes(ndim, contract, batch):
  return tuple(sorted(set(batch) | set(qdot.free_axes(ndim, contract, batch))))


def build_dot(kernel, *, contract, batch, w_cfg, where: str, **fields) -> FrozenLayer:
  """A dot op's weight (``kernel``, already in the op's dtype) -> FrozenLayer.

  ``contract`` / ``batch``: the weight's contracting and batch axes in its op
  (in the op's pairing order); the rest of ``fields`` are FrozenLayer fields.
  """
  check_packable(w_cfg, where)
  contract, batch = tuple(int(a) for a in contract), tuple(int(a) for a in batch)
  if not contract:
    raise ValueError(f"freeze: layer {where!r}: its op contracts no axis of the weight")
  w = jnp.asarray(kernel)
  # The QT forward's own quantization of its weight operand (dot_general_qt._forward).
  q = qop.quantize_operand(w, w_cfg, None, _channel_axes(w.ndim, contract, batch), contract[-1],
                           "rhs").value
  free = qdot.free_axes(w.ndim, contract, batch)
  perm = batch + free + contract
  shp = w.shape
  bshape, fshape, cshape = ([shp[a] for a in axes] for axes in (batch, free, contract))
  lead = (math.prod(bshape),) if batch else ()
  n, k = math.prod(fshape), math.prod(cshape)
  codes = jnp.transpose(q.qvalue, perm).reshape(lead + (n, k))

  def flat(s):
    # Channel scales vary along batch/free axes, group scales along the last
    # contracting axis only: flattened K's groups are contiguous, repeated
    # over the other contracting axes.
    t = jnp.transpose(s, perm)
    g = t.shape[-1]
    if any(d != 1 for d in t.shape[len(perm) - len(contract):-1]):
      raise ValueError(f"freeze: layer {where!r}: a weight scale of shape {s.shape} varies along "
                       "a contracting axis other than the last")
    reps = tuple(cshape[:-1]) if g > 1 else (1,) * (len(cshape) - 1)
    t = jnp.broadcast_to(t, tuple(bshape) + tuple(fshape) + reps + (g,))
    return t.reshape(lead + (n, math.prod(reps) * g))

  # Per-axis tiles along a batch / free axis (2-D tiles) are one scale per channel here, as
  # the op's product reads them (qdot._per_index_free_scales): the same numbers.
  per_channel = lambda s: functools.reduce(
      lambda s, a: jnp.repeat(s, shp[a] // s.shape[a], axis=a) if s.shape[a] not in (1, shp[a])
      else s, batch + free, s)
  scale = flat(per_channel(q.scale))
  zero = None if q.zero_point is None else flat(per_channel(q.zero_point))
  groups = scale.shape[-1]
  group = k // groups if groups > 1 else None
  if groups == 1:
    scale = scale[..., 0]
    zero = None if zero is None else zero[..., 0]
  return FrozenLayer(
      words=store_codes(codes, w_cfg.qtype), w_scale=scale, w_zero=zero, kind="dot",
      w_qtype=w_cfg.qtype.name, k=int(k), n=int(n), kernel_shape=tuple(int(d) for d in shp),
      group_size=group, layout=(contract, batch), **fields)


def build_conv(kernel, *, rhs_spec, w_cfg, where: str, **fields) -> FrozenLayer:
  """A convolution's kernel (in the op's dtype; ``rhs_spec`` its O, I, spatial axes) -> FrozenLayer."""
  check_packable(w_cfg, where)
  rhs_spec = tuple(int(a) for a in rhs_spec)
  w = jnp.asarray(kernel)
  # conv_general_qt._forward's quantization of the kernel: one scale per output feature.
  q = qop.quantize_operand(w, w_cfg, None, (rhs_spec[0],), None, "rhs").value
  o = w.shape[rhs_spec[0]]
  codes = jnp.transpose(q.qvalue, rhs_spec).reshape(o, -1)
  per_o = lambda s: jnp.broadcast_to(jnp.transpose(s, rhs_spec).reshape(-1), (o,))
  return FrozenLayer(
      words=store_codes(codes, w_cfg.qtype), w_scale=per_o(q.scale),
      w_zero=None if q.zero_point is None else per_o(q.zero_point), kind="conv",
      w_qtype=w_cfg.qtype.name, k=int(codes.shape[1]), n=int(o),
      kernel_shape=tuple(int(d) for d in w.shape), group_size=None, layout=rhs_spec, **fields)


def rebuild(spec: FrozenLayer, kernel, w_cfg, *, where: str) -> FrozenLayer:
  """The layer ``spec`` describes, quantized again from the float ``kernel`` (of
  ``spec.kernel_shape``) with ``w_cfg``: no input scale, input shift or bias."""
  kernel = sparsity_of(spec.w_sparsity, jnp.asarray(kernel).astype(spec.weight_dtype),
                       f"the weight of layer {where!r}")
  fields = {f: getattr(spec, f) for f in META_FIELDS
            if f not in ("kind", "w_qtype", "k", "n", "kernel_shape", "group_size", "layout")}
  fields.update(scale_a=None, bias_a=None, bias=None)
  if spec.kind == "conv":
    return build_conv(kernel, rhs_spec=spec.layout, w_cfg=w_cfg, where=where, **fields)
  return build_dot(kernel, contract=spec.layout[0], batch=spec.layout[1], w_cfg=w_cfg,
                   where=where, **fields)


def _dot_axes(layer: FrozenLayer):
  contract, batch = layer.layout
  free = qdot.free_axes(len(layer.kernel_shape), contract, batch)
  return tuple(contract), tuple(batch), free


def _kernel_qarray(layer: FrozenLayer) -> qa.QArray:
  qt = qtypes.get_qtype(layer.w_qtype)
  ks = layer.kernel_shape
  codes = layer.weight_codes()
  if layer.kind == "conv":
    spec = layer.layout
    inv = tuple(int(i) for i in np.argsort(spec))
    qv = jnp.transpose(codes.reshape(tuple(ks[a] for a in spec)), inv)

    def per_o(a):
      shape = [1] * len(ks)
      shape[spec[0]] = layer.n
      return a.reshape(shape)
    return qa.QArray(qvalue=qv, scale=per_o(layer.w_scale),
                     zero_point=None if layer.w_zero is None else per_o(layer.w_zero), qtype=qt)
  contract, batch, free = _dot_axes(layer)
  perm = batch + free + contract
  inv = tuple(int(i) for i in np.argsort(perm))
  bshape, fshape, cshape = (tuple(ks[a] for a in axes) for axes in (batch, free, contract))
  qv = jnp.transpose(codes.reshape(bshape + fshape + cshape), inv)

  def scale(a):
    if layer.group_size is None:
      s = a.reshape(bshape + fshape + (1,) * len(cshape))
    elif len(cshape) == 1:
      s = a.reshape(bshape + fshape + (cshape[0] // layer.group_size,))
    else:  # groups of the flattened contraction (merged by the op): one scale per element
      s = jnp.repeat(a, layer.group_size, axis=-1).reshape(bshape + fshape + cshape)
    return jnp.transpose(s, inv)
  return qa.QArray(qvalue=qv, scale=scale(layer.w_scale),
                   zero_point=None if layer.w_zero is None else scale(layer.w_zero), qtype=qt)


# ----------------------------------------------------------------------------
# The input: shifted and quantized as the QT op does.


def _place(v, ndim: int, axes) -> jax.Array:
  shape = [1] * ndim
  for a, n in zip(axes, jnp.shape(v)):
    shape[a] = n
  return jnp.reshape(v, shape)


def shift_act(layer: FrozenLayer, x, contract):
  """``x`` plus the layer's learned input shift (laid along the contracting axes), if any."""
  if layer.bias_a is None:
    return x
  return x + _place(layer.bias_a, x.ndim, contract).astype(x.dtype)


def merge_contraction(act, w, dn, w_idx: int, tiles) -> tuple:
  """The op's merge of a tiled contraction of several axes, on (activation, weight).

  ``tiles``: the (activation, weight) tile sizes. Returns ``(act, w, dn)`` as
  :func:`~qtrain.ops.dot_general_qt.merge_tiled_contraction` hands them to
  the product (unchanged where it merges nothing).
  """
  ops, ts = [None, None], [None, None]
  ops[w_idx], ops[1 - w_idx] = w, act
  ts[w_idx], ts[1 - w_idx] = tiles[1], tiles[0]
  lhs, rhs, dn, _, _ = merge_tiled_contraction(ops[0], ops[1], dn, tuple(ts))
  return (rhs, lhs, dn) if w_idx == 0 else (lhs, rhs, dn)


def is_merged(dn, tiles) -> bool:
  """Whether the op merges its contraction (a tile on either side, several contracting axes)."""
  return any(tiles) and len(dn[0][0]) > 1


def merged_order(dn, w_idx: int) -> tuple[int, ...]:
  """The weight's contracting axes in the order the merged contraction flattens them (the
  order of the paired lhs axes): a merged layer's ``layout`` lists them so."""
  return tuple(int(p[w_idx]) for p in sorted(zip(*dn[0])))


def act_tile(layer: FrozenLayer) -> int | None:
  act = layer.act_dict
  return None if act is None else act.get("tile_size")


def quantize_act(layer: FrozenLayer, x, *, contract, channel_axes, tile_axis, shifted=False):
  """``x`` (+ the learned shift unless ``shifted``) quantized per the layer's ``act`` (or float ``x``)."""
  if not shifted:
    x = shift_act(layer, x, contract)
  act = layer.act_dict
  if act is None:
    return x
  oq = _act_operand(act)
  given, zero = None, None
  if act.get("scale") == "given":
    given, zero = layer.scale_a, layer.zero_a
  elif act.get("scale") == "batch":
    spec = qa.QuantizeSpec(qtype=oq.qtype, channelwise_axes=(), calibration=oq.calibration,
                           axis_names=oq.axis_names)
    given, zero = qa.calibrate(jax.lax.stop_gradient(x), spec)
    given = given.reshape(())
    zero = None if zero is None else zero.reshape(())
  if given is None:
    return qa.quantize(x, qop.operand_spec(oq, x.ndim, channel_axes, tile_axis, shape=x.shape))
  if zero is not None:
    zero = qop.as_zero_point(zero, x.shape, "the input zero point", oq.qtype)
  return qa.quantize_with_scale(x, oq.qtype, qop.as_scale(given, x.shape, "the input scale"),
                                zero)


def _out_dtype(preferred, *dtypes):
  if preferred is not None:
    return jnp.dtype(preferred)
  dt = jnp.result_type(*dtypes)
  return dt if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(jnp.float32)


# ----------------------------------------------------------------------------
# Products.


check_implementation = cfg_lib.check_implementation


# "auto" runs a frozen product on the packed-weight kernels up to this many rows, XLA above:
# the W4A16 / W8A16 kernels beat XLA's bf16 GEMM at M <= 16 and lose from M = 64 on
# (benchmarks/RESULTS.md#k-8192x28672-m16-int4-w4a16, #k-8192x28672-m64-int4-w4a16,
# #k-4096x4096-m64-int4-w4a16), as dispatch's AUTO_KERNEL has it for int8.
AUTO_KERNEL_MAX_ROWS = 16


def _wants_kernel(impl: str, rows: int) -> bool:
  if impl in ("triton", "interpret"):
    return True
  return impl == "auto" and jax.default_backend() == "gpu" and rows <= AUTO_KERNEL_MAX_ROWS


def _forced(impl: str, where: str, e: Exception) -> ValueError:
  return ValueError(f"implementation={impl!r}: layer {where!r} cannot run there ({e}); use "
                    f"implementation='xla' or 'auto'")


def _rows(x, contract, free):
  """An activation (QArray or float) as (M, K) rows, K in the order of ``contract``."""
  perm = tuple(free) + tuple(contract)
  shape = x.shape
  m = math.prod(shape[a] for a in free)
  k = math.prod(shape[a] for a in contract)
  if m == 0 or k == 0:
    raise Unsupported("empty operand")
  if not isinstance(x, qa.QArray):
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
      raise Unsupported(f"float activations of dtype {x.dtype}")
    return jnp.transpose(x, perm).reshape(m, k)
  if not x.qtype.is_integer_like:
    raise Unsupported(f"{x.qtype.name} activations (kernels take integer-like ones)")
  if x.zero_point is not None:
    raise Unsupported("asymmetric (zero-point) activations")
  if any(x.scale.shape[a] != 1 for a in contract):
    raise Unsupported("the activation scale varies along the contraction (tile_size)")
  s = jnp.transpose(x.scale, perm).reshape(tuple(x.scale.shape[a] for a in free))
  s = jnp.broadcast_to(s, tuple(shape[a] for a in free)).reshape(m, 1)
  return qa.QArray(qvalue=jnp.transpose(x.qvalue, perm).reshape(m, k), scale=s, zero_point=None,
                   qtype=x.qtype)


def _prepared(layer: FrozenLayer):
  """(PreparedWeight, per-channel zero fix or None) of an (N, K) frozen weight."""

  if layer.words.ndim != 2:
    raise Unsupported("weights with batch axes")
  if qtypes.get_qtype(layer.w_qtype).is_float:
    raise Unsupported(f"{layer.w_qtype} weights have no packed-weight GPU kernel (XLA computes "
                      "them, fp8 codes times float or fp8 inputs, scales after)")
  try:
    if layer.group_size is not None:
      return prepared.prepare_weight(layer.words, layer.w_qtype, scale=layer.w_scale,
                                     zero_point=layer.w_zero, group_size=layer.group_size,
                                     k=layer.k), None
    pw = prepared.prepare_weight(layer.words, layer.w_qtype, scale=layer.w_scale, k=layer.k)
  except ValueError as e:
    raise Unsupported(str(e)) from None
  # Per-channel zero points: x . ((q - z) s)^T = x . (q s)^T - rowsum(x) (z s).
  return pw, None if layer.w_zero is None else layer.w_zero * layer.w_scale


def _kernel_matmul(layer: FrozenLayer, x2d, impl: str, out_dtype):
  """(M, K) rows x the packed (N, K) weight through dispatch's prepared-weight path."""

  pw, zero_fix = _prepared(layer)
  out = dispatch.quantized_dot_general(x2d, pw, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32, implementation=impl)
  if zero_fix is not None:
    quant = isinstance(x2d, qa.QArray)
    rs = jnp.sum((x2d.qvalue if quant else x2d).astype(jnp.float32), axis=1, keepdims=True)
    if quant:
      rs = rs * x2d.scale
    out = out - rs * zero_fix[None, :]
  return out.astype(out_dtype)


def _mosaic_matmul(layer: FrozenLayer, x2d, out_dtype):

  return dispatch.quantized_dot_general(x2d, layer.nk_qarray(), (((1,), (1,)), ((), ())),
                                        preferred_element_type=out_dtype, implementation="mosaic")


def dot_product(layer: FrozenLayer, a_val, dn, out_dtype, implementation: str, where: str):
  """The op's product: the (quantized) activation ``a_val`` times the frozen weight.

  ``dn``: the op's normalized dimension numbers, the weight at
  ``layer.weight_operand``. The output has ``dot_general``'s layout.
  """

  impl = implementation
  w_idx = layer.weight_operand
  a_idx = 1 - w_idx
  rows = math.prod(a_val.shape[a] for a in qdot.free_axes(a_val.ndim, dn[0][a_idx], dn[1][a_idx]))
  if impl == "mosaic" or _wants_kernel(impl, rows):
    try:
      if dn[1][a_idx]:
        raise Unsupported("batch dimensions")
      contract = dn[0][a_idx]
      a_free = qdot.free_axes(a_val.ndim, contract, ())
      x2d = _rows(a_val, contract, a_free)
      if impl == "mosaic":
        out = _mosaic_matmul(layer, x2d, out_dtype)
      else:
        out = _kernel_matmul(layer, x2d, impl, out_dtype)
    except Unsupported as e:
      if impl != "auto":
        raise _forced(impl, where, e) from None
    else:
      _, _, w_free = _dot_axes(layer)
      a_shape = tuple(a_val.shape[a] for a in a_free)
      out = out.reshape(a_shape + tuple(layer.kernel_shape[a] for a in w_free))
      if w_idx == 0:  # dot_general puts the lhs's (the weight's) free axes first
        na = len(a_shape)
        out = jnp.transpose(out, tuple(range(na, out.ndim)) + tuple(range(na)))
      return out
  ops = [None, None]
  ops[w_idx], ops[a_idx] = layer.kernel_qarray(), a_val
  # A float activation times the weight computes as the QT op does: in the promoted dtype of
  # the two original dtypes.
  cdt = None if isinstance(a_val, qa.QArray) else qop.compute_dtype(a_val.dtype, layer.weight_dtype)
  return dispatch.quantized_dot_general(ops[0], ops[1], dn, preferred_element_type=out_dtype,
                                        implementation="xla" if impl == "xla" else "auto",
                                        compute_dtype=cdt)


def _im2col(layer: FrozenLayer, a_val, p):
  """Patches of the (quantized) input as (M, K) rows in the frozen K order, and (N, out spatial...)."""
  if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
    raise Unsupported("grouped convolutions")
  quant = isinstance(a_val, qa.QArray)
  if quant:
    if not a_val.qtype.is_integer_like:
      raise Unsupported(f"{a_val.qtype.name} activations (kernels take integer-like ones)")
    if a_val.zero_point is not None:
      raise Unsupported("asymmetric (zero-point) activations")
    vals = a_val.qvalue
  else:
    if a_val.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
      raise Unsupported(f"float activations of dtype {a_val.dtype}")
    vals = a_val
  # (N, out spatial..., C * prod(window)), channel-major; padding reads 0.
  patches = im2col.patches(vals, im2col.geometry(vals.shape, layer.kernel_shape, p,
                                                 channel_major=True))
  lead = patches.shape[:-1]
  m = math.prod(lead)
  if m == 0:
    raise Unsupported("empty operand")
  if not quant:
    return patches.reshape(m, -1).astype(a_val.dtype), lead
  s = jnp.broadcast_to(a_val.scale.reshape(-1, *([1] * (len(lead) - 1))), lead).reshape(m, 1)
  # As int8 codes, not binary: padded positions hold 0, which binary (+-1) would pack as -1.
  return qa.QArray(qvalue=patches.reshape(m, -1).astype(jnp.int8), scale=s, zero_point=None,
                   qtype=qtypes.get_qtype("int8")), lead


def conv_product(layer: FrozenLayer, a_val, p, out_dtype, implementation: str, where: str,
                 compute_dtype=None):
  """The convolution of the (quantized) input with the frozen kernel (``p``: the op's
  parameters, as :func:`~qtrain.ops.conv_general_qt.quantized_conv` takes them;
  ``compute_dtype``: the QT op's, from the input's and the weight's float dtypes)."""
  impl = implementation
  # The input's positions: the im2col product's rows before strides and dilation.
  rows = math.prod(a_val.shape[a] for a in p["dn"].lhs_spec if a != p["dn"].lhs_spec[1])
  if impl == "mosaic" or _wants_kernel(impl, rows):
    try:
      x2d, lead = _im2col(layer, a_val, p)
      if impl == "mosaic":
        out = _mosaic_matmul(layer, x2d, out_dtype)
      else:
        out = _kernel_matmul(layer, x2d, impl, out_dtype)
    except Unsupported as e:
      if impl != "auto":
        raise _forced(impl, where, e) from None
    else:
      out = jnp.moveaxis(out.reshape(lead + (layer.n,)), -1, 1)  # (N, O, out spatial...)
      return jnp.transpose(out, tuple(int(i) for i in np.argsort(p["dn"][2])))
  # The QT forward's call: its implementation ("auto" puts the operands of a float-accumulated
  # (fp8) product in GEMM layout, which sums in another order than "xla") and compute dtype.
  return quantized_conv(a_val, layer.kernel_qarray(), p, out_dtype, compute_dtype,
                        "xla" if impl == "xla" else "auto")


# ----------------------------------------------------------------------------
# Gradients: a frozen product is differentiable with respect to its input.


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_input_grad(fn, ref, layer: FrozenLayer, x):
  """``fn(layer, x)``, a frozen product, with the gradient of ``ref(x, w)``, its float
  counterpart on the dequantized weight ``w``."""
  return fn(layer, x)


def _with_input_grad_fwd(fn, ref, layer, x):
  return fn(layer, x), (layer, x)


def _with_input_grad_bwd(fn, ref, res, g):
  # The gradient of the float product with the dequantized weight: the input's quantization
  # (if the layer has one) passes it straight through, the frozen weight gets none.
  # The barrier ties the weight's dequantization to the incoming gradient: XLA can neither
  # share it with the forward's (which would keep every layer's dequantized weight alive
  # from the forward to the backward) nor hoist it ahead of the backward.
  layer, x = res
  g, bar = jax.lax.optimization_barrier((g, layer))
  w = bar.kernel_qarray().dequantize(x.dtype)
  _, vjp = jax.vjp(lambda a: ref(a, w), x)
  (dx,) = vjp(g.astype(x.dtype))
  return jax.tree.map(_zero_cotangent, layer), dx.astype(x.dtype)


_with_input_grad.defvjp(_with_input_grad_fwd, _with_input_grad_bwd)


# ----------------------------------------------------------------------------
# Ops: what an intercepted call runs when its weight is frozen.


def _mismatch(where: str, what: str) -> ValueError:
  return ValueError(f"frozen layer {where!r}: {what}; the model does not call this op as it did "
                    "when the layer was frozen (freeze with the QtProvider the model ran with)")


def _check_weight(layer: FrozenLayer, w, where: str) -> None:
  if w is None:
    return
  if tuple(jnp.shape(w)) != layer.kernel_shape:
    raise _mismatch(where, f"the weight operand has shape {tuple(jnp.shape(w))}, the frozen "
                           f"weight {layer.kernel_shape}")
  dt = jnp.dtype(jnp.result_type(w)).name
  if dt != layer.weight_dtype:
    raise _mismatch(where, f"the weight operand has dtype {dt}; it was frozen from "
                           f"{layer.weight_dtype} values")


def _check_float(x, where):
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"frozen layer {where!r}: the input must be a float array, got dtype "
                     f"{jnp.result_type(x)}")


def dot_general(layer: FrozenLayer, lhs, rhs, dimension_numbers, *, preferred_element_type=None,
                weight_operand: int | None = None, implementation: str, where: str,
                adapter=None):
  """A ``dot_general`` whose weight operand is frozen (the weight array, if passed, is
  only checked: a placeholder of the parameter's shape and dtype).

  Differentiable with respect to the input: the gradient of the float product
  with the dequantized weight. ``adapter``: None, or ``(A, B, dropout key or
  None)`` of the layer's LoRA adapter, added to the product."""
  if layer.kind != "dot":
    raise _mismatch(where, f"it was frozen as a {layer.kind} but is called as a dot")
  w_idx = layer.weight_operand
  if weight_operand is not None and weight_operand != w_idx:
    raise _mismatch(where, f"its weight is operand {weight_operand}, frozen as operand {w_idx}")
  ops = (lhs, rhs)
  act, w = ops[1 - w_idx], ops[w_idx]
  w_ndim = len(layer.kernel_shape)
  dn = qdot.normalize_dimension_numbers(dimension_numbers, jnp.ndim(lhs) if w_idx else w_ndim,
                                        w_ndim if w_idx else jnp.ndim(rhs))
  _check_weight(layer, w, where)
  (c, b) = (dn[0][w_idx], dn[1][w_idx])
  if is_merged(dn, (act_tile(layer), layer.group_size)):
    c = merged_order(dn, w_idx)
  if (tuple(c), tuple(b)) != tuple(layer.layout):
    raise _mismatch(where, f"its op contracts weight axes {c} (batch {b}); frozen for "
                           f"{layer.layout[0]} (batch {layer.layout[1]})")
  _check_float(act, where)
  out_dtype = _out_dtype(preferred_element_type, jnp.result_type(act),
                         layer.weight_dtype if w is None else jnp.result_type(w))
  out = _with_input_grad(
      functools.partial(_dot_forward, dn=dn, out_dtype=out_dtype, implementation=implementation,
                        where=where),
      functools.partial(_ref_dot, dn=dn, w_idx=w_idx), layer, act)
  if adapter is None:
    return out
  return out + _adapter_delta(layer, adapter, act, dn, where, out.dtype)


def _ref_dot(x, w, *, dn, w_idx):
  ops = (w, x) if w_idx == 0 else (x, w)
  return jax.lax.dot_general(*ops, dn)


def _adapter_delta(layer: FrozenLayer, adapter, act, dn, where, dtype):
  if layer.lora is None:
    raise ValueError(f"frozen layer {where!r} was given a LoRA adapter but was frozen without one")
  a, b, key = adapter
  lay = lora_ops.layout(layer.kernel_shape, dn, weight_operand=layer.weight_operand)
  lora_ops.check_shapes(a, b, lay, f"frozen layer {where!r}")
  meta = layer.lora_dict
  return lora_ops.delta(act, a, b, lay, scale=meta["scale"], dropout=meta["dropout"], key=key,
                        dtype=dtype)


def _dot_forward(layer: FrozenLayer, act, *, dn, out_dtype, implementation, where):
  # Dequantize (on the XLA path) when the input is there, not ahead of the whole forward.
  act, layer = jax.lax.optimization_barrier((act, layer))
  w_idx = layer.weight_operand
  act = sparsity_of(layer.a_sparsity, act, f"the input of layer {where!r}")
  act = shift_act(layer, act, dn[0][1 - w_idx])
  act, merged_w, dn = merge_contraction(
      act, jnp.zeros(layer.kernel_shape, layer.weight_dtype), dn, w_idx,
      (act_tile(layer), layer.group_size))
  if merged_w.shape != layer.kernel_shape:  # the op's view: one merged contracting axis
    layer = dataclasses.replace(layer, kernel_shape=tuple(merged_w.shape),
                                layout=(tuple(dn[0][w_idx]), tuple(dn[1][w_idx])))
  ac, ab = dn[0][1 - w_idx], dn[1][1 - w_idx]
  a_val = quantize_act(layer, act, contract=ac, channel_axes=_channel_axes(act.ndim, ac, ab),
                       tile_axis=ac[-1] if ac else None, shifted=True)
  return dot_product(layer, a_val, dn, out_dtype, implementation, where)


def conv_params(lhs_ndim, lhs_shape, rhs_shape, window_strides, padding, lhs_dilation,
                rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
                precision) -> dict:
  """The convolution's parameters as conv_general_qt builds them."""
  nsp = lhs_ndim - 2
  if isinstance(padding, str):
    pad = padding
  else:
    pad = tuple(tuple(int(v) for v in pair) for pair in padding)
  return dict(
      window_strides=tuple(window_strides), padding=pad,
      lhs_dilation=tuple(lhs_dilation) if lhs_dilation else (1,) * nsp,
      rhs_dilation=tuple(rhs_dilation) if rhs_dilation else (1,) * nsp,
      dn=jax.lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers),
      feature_group_count=int(feature_group_count), batch_group_count=int(batch_group_count),
      precision=precision)


def conv_general_dilated(layer: FrozenLayer, lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                         batch_group_count=1, precision=None, preferred_element_type=None, *,
                         implementation: str, where: str):
  """A convolution whose kernel (``rhs``, a placeholder or None) is frozen."""
  if layer.kind != "conv":
    raise _mismatch(where, f"it was frozen as a {layer.kind} but is called as a convolution")
  _check_weight(layer, rhs, where)
  _check_float(lhs, where)
  p = conv_params(jnp.ndim(lhs), jnp.shape(lhs), layer.kernel_shape, window_strides, padding,
                  lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
                  batch_group_count, precision)
  if tuple(p["dn"].rhs_spec) != tuple(layer.layout):
    raise _mismatch(where, f"its kernel layout (rhs_spec) is {tuple(p['dn'].rhs_spec)}, frozen "
                           f"for {layer.layout}")
  out_dtype = _out_dtype(preferred_element_type, jnp.result_type(lhs),
                         layer.weight_dtype if rhs is None else jnp.result_type(rhs))
  return _with_input_grad(
      functools.partial(_conv_forward, p=p, out_dtype=out_dtype, implementation=implementation,
                        where=where),
      functools.partial(_ref_conv, p=p), layer, lhs)


def _ref_conv(x, w, *, p):
  return jax.lax.conv_general_dilated(
      x, w, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"], p["dn"],
      p["feature_group_count"], p["batch_group_count"])


def _conv_forward(layer: FrozenLayer, lhs, *, p, out_dtype, implementation, where):
  lhs, layer = jax.lax.optimization_barrier((lhs, layer))
  lhs_spec = p["dn"].lhs_spec
  a_val = quantize_act(layer, lhs, contract=(lhs_spec[1],),
                       channel_axes=(lhs_spec[0],) if p["batch_group_count"] == 1 else (),
                       tile_axis=None)
  return conv_product(layer, a_val, p, out_dtype, implementation, where,
                      qop.compute_dtype(lhs.dtype, layer.weight_dtype))


def einsum(layer: FrozenLayer, subscripts, operands, kwargs, *, weight_operand, implementation,
           where, adapter=None):
  """A two-operand einsum whose weight is frozen (planned as the QT provider plans it)."""

  shapes = tuple(jnp.shape(o) for o in operands)
  plan = _einsum.parse(subscripts, *shapes) if len(operands) == 2 else None
  if plan is None:
    raise _mismatch(where, f"einsum {subscripts!r} with {len(operands)} operands is not one dot")
  if (plan.rhs_sum_axes, plan.lhs_sum_axes)[layer.weight_operand]:
    raise _mismatch(where, f"einsum {subscripts!r} sums axes of the weight before the dot")
  _check_weight(layer, operands[layer.weight_operand], where)

  def dg(lhs, rhs, dn):
    return dot_general(layer, lhs, rhs, dn, preferred_element_type=kwargs.get(
        "preferred_element_type"), weight_operand=weight_operand, implementation=implementation,
                       where=where, adapter=adapter)
  return _einsum.run(plan, *operands, dg)
