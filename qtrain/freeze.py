"""Export: trained QT params -> packed weights + scales, and the packed inference path.

:func:`freeze` quantizes each quantized layer's kernel exactly as the
training forward did (same calibration, same rounding, so the same codes and
scales) and stores it as a :class:`FrozenLayer`:

* weights stored ``(N, K)`` - output channels by the contracting axis, the
  layout the kernels want - and packed along K in the
  :mod:`qtrain.core.packing` layout (uint32 words, K-contiguous, LSB first;
  binary bit 1 = +1). A conv kernel HWIO becomes ``(O, I*H*W)`` with K
  ordered channel-major (``i * H * W + h * W + w``), the patch order of
  :func:`jax.lax.conv_general_dilated_patches`;
* per-output-channel scales ``(N,)`` or group scales / zero points ``(N, G)``;
* the layer's input quantization: a learned ``scale_a`` and ``bias_a``
  (bitorch), or a calibration to run at inference (larq: fixed 1; XNOR:
  ``mean|x|`` per row), and the float ``bias``.

:func:`apply_layer` runs one frozen layer; :func:`apply_frozen` runs a whole
Flax model with its :class:`~qtrain.qlayers.QDense` / :class:`~qtrain.qlayers.QConv`
layers replaced by their frozen versions (``nn.intercept_methods``), the rest
(float layers, batch norm) from the remaining variables. ``implementation``:

* ``"xla"``: unpack the words, exact int8 x int8 -> int32 products (the same
  math as the training forward's XLA path; convs as an int conv);
* ``"pallas"`` / ``"interpret"``: the qtrain Pallas kernels
  (:func:`qtrain.pallas.binary_matmul.binary_matmul`,
  :func:`qtrain.pallas.nbit_matmul.nbit_matmul`) on GPU / in the Pallas
  interpreter; convs as im2col (patches of the *quantized* input, so zero
  padding contributes 0 exactly as in training) + packed matmul;
* ``"mosaic"``: the Mosaic GPU kernel
  (:func:`qtrain.pallas.mosaic_matmul.mosaic_matmul`; Hopper, jax >= 0.11) for
  layers with bf16/f16 inputs or symmetric integer-quantized ones (<= 8 bits,
  binary included: the int8-activation path), binary/int4/int8 per-channel
  weights and at most 128 rows; any other layer raises ValueError saying why;
* ``"auto"``: ``"pallas"`` on GPU, ``"xla"`` elsewhere.

:func:`layer_sizes` reports bytes per layer (binary layers ~25x smaller than
float32), :func:`save_frozen` / :func:`load_frozen` round-trip a frozen model
through orbax.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain import binary, freeze, qlayers
  >>> layer = qlayers.QDense(8, quant=binary.bitorch())
  >>> x = jax.random.normal(jax.random.key(0), (4, 64))
  >>> variables = layer.init(jax.random.key(1), x)
  >>> frozen = freeze.freeze(variables, {"": binary.bitorch()})
  >>> fl = frozen["layers"][""]
  >>> fl.words.shape, fl.words.dtype
  ((8, 2), dtype('uint32'))
  >>> y = freeze.apply_frozen(layer, frozen, x)
  >>> bool(jnp.allclose(y, layer.apply(variables, x), atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qtrain.binary import LayerQuant
from qtrain.core import packing
from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.core import qtypes

from qtrain.core import qt_operand as _qop
from qtrain.core.conv_general_qt import quantized_conv

__all__ = ["FrozenLayer", "freeze", "apply_layer", "apply_frozen", "layer_sizes", "save_frozen",
           "load_frozen", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic", "interpret")
_ARRAY_FIELDS = ("words", "w_scale", "w_zero", "scale_a", "bias_a", "bias")


@dataclasses.dataclass(frozen=True)
class FrozenLayer:
  """One frozen linear / conv layer (a pytree; metadata static).

  Attributes:
    words: packed weight (N, ceil(K / values_per_word)) uint32; int8 weights
      are packed too (4 a word).
    w_scale: (N,) per-channel or (N, G) group-wise float32 weight scale.
    w_zero: None, or like ``w_scale``: the zero point, ``w ~ (q - z) * s``.
    scale_a: None or a float32 scalar: the learned input scale.
    bias_a: None or (K_in,) float32: the learned input shift (conv: per input channel).
    bias: None or (N,) float32.
    kind: ``"dense"`` or ``"conv"``.
    w_qtype: the weight qtype name.
    k, n: contracting size and output features.
    kernel_shape: the trained kernel's shape ((K, N) or HWIO).
    group_size: K values per weight scale group, or None.
    act: None (float input) or a dict: ``qtype``, ``calibration`` (method),
      ``bound`` (for ``fixed``), ``multiplier``, ``channelwise`` - how the
      input is quantized at inference when no ``scale_a`` is learned.
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
  act: Any  # a hashable tuple of (key, value) pairs, or None

  @property
  def act_dict(self) -> dict | None:
    return None if self.act is None else dict(self.act)

  def weight_codes(self) -> jax.Array:
    """The (N, K) int8 weight codes."""
    return packing.unpack(self.words, self.w_qtype, size=self.k, axis=-1)

  def meta(self) -> dict:
    return {"kind": self.kind, "w_qtype": self.w_qtype, "k": self.k, "n": self.n,
            "kernel_shape": list(self.kernel_shape), "group_size": self.group_size,
            "act": self.act_dict, "present": [f for f in _ARRAY_FIELDS
                                              if getattr(self, f) is not None]}


jax.tree_util.register_dataclass(
    FrozenLayer, data_fields=list(_ARRAY_FIELDS),
    meta_fields=["kind", "w_qtype", "k", "n", "kernel_shape", "group_size", "act"])


def _act_meta(lq: LayerQuant):
  a = lq.act
  if a is None:
    return None
  if a.qtype.kind not in ("binary", "int", "ternary"):
    raise ValueError(f"freeze: input qtype {a.qtype.name!r} is not supported (binary/int only)")
  cal = a.calibration
  return tuple(sorted(dict(qtype=a.qtype.name, calibration=cal.method, bound=cal.bound,
                           multiplier=cal.multiplier, percentile=cal.percentile,
                           channelwise=bool(a.channelwise)).items()))


def freeze_layer(params: Mapping[str, jax.Array], lq: LayerQuant) -> FrozenLayer:
  """Freezes one layer's params (``kernel``, optional ``bias``/``scale_a``/``bias_a``)."""
  if lq.weight is None:
    raise ValueError("freeze needs a quantized weight (LayerQuant.weight is None)")
  if not lq.weight.qtype.packable:
    raise ValueError(f"weight qtype {lq.weight.qtype.name!r} cannot be packed")
  kernel = jnp.asarray(params["kernel"], jnp.float32)
  if kernel.ndim == 2:
    kind, k, n = "dense", kernel.shape[0], kernel.shape[1]
    wop = lq.weight
    spec = _qop.operand_spec(wop, 2, (1,), 0)
    q = qa.quantize(kernel, spec)
    codes = q.qvalue.T                                   # (N, K)
    per_n = lambda a: jnp.broadcast_to(a, (a.shape[0], n)).T
    scale = per_n(q.scale)                               # (N, G) or (N, 1)
    zero = None if q.zero_point is None else per_n(q.zero_point)
    group = wop.tile_size
  elif kernel.ndim >= 3:
    kind = "conv"
    wop = lq.conv_config().rhs
    nd = kernel.ndim
    spec = _qop.operand_spec(wop, nd, (nd - 1,), None)
    q = qa.quantize(kernel, spec)
    n = kernel.shape[-1]
    perm = (nd - 1, nd - 2) + tuple(range(nd - 2))        # HWIO -> OIHW
    codes = jnp.transpose(q.qvalue, perm).reshape(n, -1)
    k = codes.shape[1]
    per_n = lambda a: jnp.broadcast_to(a, (1,) * (nd - 1) + (n,)).reshape(n, 1)
    scale = per_n(q.scale)
    zero = None if q.zero_point is None else per_n(q.zero_point)
    group = None
  else:
    raise ValueError(f"kernel of shape {kernel.shape}: expected a Dense (K, N) or conv HWIO kernel")
  if scale.shape[1] == 1:
    scale = scale[:, 0]
    zero = None if zero is None else zero[:, 0]
    group = None
  def get(*names):
    """The param under one of ``names`` (qlayers' name or the provider's ``<op>0_<name>``)."""
    found = [k for k in params for nm in names if k == nm or k.endswith("_" + nm)]
    if len(found) > 1:
      raise ValueError(f"freeze: several {names} params in one layer: {found}")
    return jnp.asarray(params[found[0]], jnp.float32) if found else None

  return FrozenLayer(
      words=packing.pack(codes.astype(jnp.int8), wop.qtype, axis=-1), w_scale=scale,
      w_zero=zero, scale_a=get("scale_a", "act_scale"), bias_a=get("bias_a", "act_shift"),
      bias=get("bias"), kind=kind,
      w_qtype=wop.qtype.name, k=int(k), n=int(n), kernel_shape=tuple(int(d) for d in kernel.shape),
      group_size=group, act=_act_meta(lq))


def _kernel_paths(params, prefix=()):
  """Yields (path tuple, dict) for every sub-dict holding a ``kernel``."""
  if isinstance(params, Mapping):
    if "kernel" in params and not isinstance(params["kernel"], Mapping):
      yield prefix, params
    for key, v in params.items():
      if isinstance(v, Mapping):
        yield from _kernel_paths(v, prefix + (str(key),))


def _is_qtrule(r) -> bool:
  return type(r).__name__ == "QtRule" and hasattr(r, "matches")


def _match(rules, path: str, conv: bool):
  for r in rules:
    if _is_qtrule(r):
      if r.matches(path, "conv_general_dilated" if conv else "dot_general"):
        return LayerQuant.from_rule(r, conv=conv) if r.quantizes else None
      continue
    pat, lq = r
    if re.fullmatch(pat, path):
      return lq
  return None


def _remove(tree: Mapping, path: tuple[str, ...]):
  """``tree`` without the sub-dict at ``path`` (empty parents dropped)."""
  if not path:
    return {}
  out = {}
  for key, v in tree.items():
    if key == path[0]:
      if len(path) > 1 and isinstance(v, Mapping):
        sub = _remove(v, path[1:])
        if sub:
          out[key] = sub
    else:
      out[key] = v
  return out


def freeze(variables, layer_quants) -> dict:
  """Freezes the quantized layers of a trained model.

  Args:
    variables: ``{"params": ..., <other collections>}`` (or a bare params dict).
    layer_quants: a list of :class:`qtrain.QtRule` (the rules the model was
      trained with through :func:`qtrain.quantize_model`; a layer gets the
      first rule matching its path and op), or
      ``{path regex: LayerQuant or None}`` (or a sequence of pairs),
      matched with ``re.fullmatch`` against the ``/``-joined module path of
      every params sub-dict that holds a ``kernel``; the first match wins;
      None or a float LayerQuant leaves the layer float. (``""`` is the root:
      a single layer frozen on its own.)

  Returns:
    ``{"layers": {path: FrozenLayer}, "variables": the variables without the
    frozen layers' params}``.
  """
  if "params" not in variables:
    variables = {"params": variables}
  if hasattr(layer_quants, "rules") and not isinstance(layer_quants, Mapping):
    layer_quants = layer_quants.rules  # a QtProvider
  rules = list(layer_quants.items()) if isinstance(layer_quants, Mapping) else list(layer_quants)
  layers = {}
  rest = dict(variables)
  params = variables["params"]
  new_params = params
  for path, sub in list(_kernel_paths(params)):
    p = "/".join(path)
    lq = _match(rules, p, conv=jnp.ndim(sub["kernel"]) >= 3)
    if lq is None or lq.weight is None:
      continue
    layers[p] = freeze_layer(sub, lq)
    new_params = _remove(new_params, path)
  rest["params"] = new_params
  return {"layers": layers, "variables": rest}


# ----------------------------------------------------------------------------
# Inference.


def _resolve_impl(implementation: str) -> str:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; valid: {list(IMPLEMENTATIONS)}")
  if implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return implementation


def _quantize_input(layer: FrozenLayer, x: jax.Array, batch_axes: tuple[int, ...]):
  """The input as a QArray (training's rule), or float x when the input is float."""
  if layer.bias_a is not None:
    x = x + layer.bias_a.astype(x.dtype)
  act = layer.act_dict
  if act is None:
    return x
  qt = qtypes.get_qtype(act["qtype"])
  if layer.scale_a is not None:
    s = jnp.reshape(layer.scale_a, (1,) * x.ndim)
    return qa.quantize_with_scale(x, qt, s)
  cal = qa.Calibration(method=act["calibration"], bound=act["bound"],
                       multiplier=act["multiplier"], percentile=act["percentile"])
  spec = qa.QuantizeSpec(qtype=qt, channelwise_axes=batch_axes if act["channelwise"] else (),
                         calibration=cal)
  return qa.quantize(x, spec)


def _weight_qarray(layer: FrozenLayer) -> qa.QArray:
  """(N, K) weight QArray (scale (N, 1) or (N, G))."""
  s = layer.w_scale if layer.w_scale.ndim == 2 else layer.w_scale[:, None]
  z = None
  if layer.w_zero is not None:
    z = layer.w_zero if layer.w_zero.ndim == 2 else layer.w_zero[:, None]
  return qa.QArray(qvalue=layer.weight_codes(), scale=s, zero_point=z,
                   qtype=qtypes.get_qtype(layer.w_qtype))


def _matmul_xla(xq, layer: FrozenLayer, out_dtype):
  """(M, K) input (QArray or float) x frozen weight -> (M, N)."""
  return qdot.dot_general_quantized_xla(xq, _weight_qarray(layer), (((1,), (1,)), ((), ())),
                                        preferred_element_type=out_dtype)


def _matmul_pallas(xq, layer: FrozenLayer, out_dtype, interpret: bool):
  """(M, K) input x frozen weight through the qtrain Pallas kernels."""
  from qtrain.pallas import binary_matmul as bm
  from qtrain.pallas import nbit_matmul as nm
  from qtrain.pallas import prepared

  is_q = qdot.is_quantized(xq)
  if is_q and xq.zero_point is not None:
    return _matmul_xla(xq, layer, out_dtype)  # asymmetric inputs: no kernel path
  if is_q:
    x_in = xq.qvalue.astype(jnp.int8)
    x_scale = jnp.broadcast_to(xq.scale, (xq.shape[0], 1))[:, 0]
  else:
    x_in, x_scale = xq, None
  zero_fix = None
  if layer.w_qtype == "binary":
    pw = prepared.prepare_weight(layer.words, "binary", scale=layer.w_scale, k=layer.k)
    out = bm.binary_matmul(x_in, pw, x_scale=x_scale, out_dtype=jnp.float32, interpret=interpret)
  else:
    grouped = layer.w_scale.ndim == 2
    try:
      if grouped:
        pw = prepared.prepare_weight(layer.words, layer.w_qtype, scale=layer.w_scale,
                                     zero_point=layer.w_zero, group_size=layer.group_size,
                                     k=layer.k)
      else:
        pw = prepared.prepare_weight(layer.words, layer.w_qtype, scale=layer.w_scale, k=layer.k)
        if layer.w_zero is not None:
          # (q - z) * s per channel: x @ (q s)^T - rowsum(x) (z s).
          zero_fix = (layer.w_zero * layer.w_scale)[None, :]
    except ValueError:
      return _matmul_xla(xq, layer, out_dtype)  # a layout the kernels do not take
    out = nm.nbit_matmul(x_in, pw, x_scale=x_scale, out_dtype=jnp.float32, interpret=interpret)
    if zero_fix is not None:
      xs = x_in.astype(jnp.float32)
      rs = jnp.sum(xs, axis=1, keepdims=True)
      if x_scale is not None:
        rs = rs * x_scale[:, None]
      out = out - rs * zero_fix
  return out.astype(out_dtype)


def _matmul_mosaic(xq, layer: FrozenLayer, out_dtype):
  """(M, K) input (bf16/f16, or an integer QArray) x frozen weight through the Mosaic
  GPU kernel (dispatch says why a layer cannot run there)."""
  from qtrain.pallas import dispatch
  return dispatch.quantized_dot_general(xq, _weight_qarray(layer), (((1,), (1,)), ((), ())),
                                        preferred_element_type=out_dtype,
                                        implementation="mosaic")


def _matmul(xq, layer, out_dtype, impl):
  if impl == "xla":
    return _matmul_xla(xq, layer, out_dtype)
  if impl == "mosaic":
    return _matmul_mosaic(xq, layer, out_dtype)
  return _matmul_pallas(xq, layer, out_dtype, interpret=(impl == "interpret"))


def _flatten_rows(xq, k: int):
  """(..., K) QArray/float -> (M, K) with a per-row scale."""
  if not qdot.is_quantized(xq):
    return xq.reshape(-1, k)
  lead = xq.shape[:-1]
  full = lambda a: None if a is None else jnp.broadcast_to(
      qa.expand_scale(a, xq.shape)[..., :1], lead + (1,)).reshape(-1, 1)
  return qa.QArray(qvalue=xq.qvalue.reshape(-1, k), scale=full(xq.scale),
                   zero_point=full(xq.zero_point), qtype=xq.qtype)


def apply_layer(layer: FrozenLayer, x: jax.Array, *, strides=None, padding="SAME",
                implementation: str = "auto") -> jax.Array:
  """Runs one frozen layer on ``x`` (dense: (..., K); conv: NHWC).

  Args:
    layer: a :class:`FrozenLayer`.
    x: the float input.
    strides, padding: conv window strides and padding (as the trained QConv).
    implementation: ``"auto"``, ``"xla"``, ``"pallas"``, ``"mosaic"`` or
      ``"interpret"`` (see the module docstring).
  """
  impl = _resolve_impl(implementation)
  out_dtype = jnp.result_type(x) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else jnp.float32
  if layer.kind == "dense":
    lead = x.shape[:-1]
    xq = _quantize_input(layer, x, tuple(range(x.ndim - 1)))
    y = _matmul(_flatten_rows(xq, layer.k), layer, out_dtype, impl).reshape(lead + (layer.n,))
  else:
    y = _apply_conv(layer, x, strides, padding, impl, out_dtype)
  if layer.bias is not None:
    y = y + layer.bias.astype(y.dtype)
  return y


def _apply_conv(layer: FrozenLayer, x, strides, padding, impl, out_dtype):
  ks = layer.kernel_shape
  nsp = len(ks) - 2
  if isinstance(strides, int):
    strides = (strides,) * nsp
  strides = tuple(strides) if strides else (1,) * nsp
  spatial = "HWD"[:nsp]
  dn = ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")
  xq = _quantize_input(layer, x, (0,))
  cin = ks[-2]
  if impl == "xla":
    # The training forward's math: an exact int conv over codes, scales after.
    codes = layer.weight_codes()                                       # (O, I*prod(S))
    w_oi = codes.reshape((layer.n, cin) + tuple(ks[:nsp]))
    perm = tuple(range(2, 2 + nsp)) + (1, 0)                           # OI(S) -> (S)IO
    wq = qa.QArray(qvalue=jnp.transpose(w_oi, perm),
                   scale=layer.w_scale.reshape((1,) * (nsp + 1) + (layer.n,)),
                   zero_point=None if layer.w_zero is None else
                   layer.w_zero.reshape((1,) * (nsp + 1) + (layer.n,)),
                   qtype=qtypes.get_qtype(layer.w_qtype))
    p = dict(window_strides=strides, padding=padding, lhs_dilation=(1,) * nsp,
             rhs_dilation=(1,) * nsp, dn=jax.lax.conv_dimension_numbers(x.shape, wq.shape, dn),
             feature_group_count=1, batch_group_count=1, precision=None)
    return quantized_conv(xq, wq, p, out_dtype)  # the same math as training
  # Pallas: im2col over the quantized codes (zero padding adds 0), then the packed matmul.
  if qdot.is_quantized(xq):
    vals = xq.qvalue.astype(jnp.float32)
  else:
    vals = xq.astype(jnp.float32)
  patches = jax.lax.conv_general_dilated_patches(vals, ks[:nsp], strides, padding,
                                                 dimension_numbers=(dn[0], dn[1], dn[2]),
                                                 precision=jax.lax.Precision.HIGHEST)
  lead = patches.shape[:-1]
  m = int(np.prod(lead))
  if qdot.is_quantized(xq):
    if xq.zero_point is not None:
      raise ValueError("frozen conv with asymmetric inputs is not supported on the kernel path")
    row_scale = jnp.broadcast_to(xq.scale.reshape(xq.scale.shape[0], *([1] * nsp)),
                                 (xq.shape[0],) + lead[1:]).reshape(m, 1)
    pq = qa.QArray(qvalue=patches.reshape(m, -1).astype(jnp.int8), scale=row_scale,
                   zero_point=None, qtype=xq.qtype)
  else:
    pq = patches.reshape(m, -1).astype(x.dtype)
  return _matmul(pq, layer, out_dtype, impl).reshape(lead + (layer.n,))


def _conv_padding(mod):
  """A QConv / nn.Conv's padding as lax takes it (only the options both support)."""
  if isinstance(mod, nn.Conv):
    for f, ok in (("input_dilation", (None, 1)), ("kernel_dilation", (None, 1)),
                  ("feature_group_count", (1,))):
      v = getattr(mod, f, None)
      if v not in ok and not (isinstance(v, (tuple, list)) and all(d == 1 for d in v)):
        raise NotImplementedError(f"freeze: nn.Conv with {f}={v!r} is not supported")
  pad = mod.padding
  if isinstance(pad, str):
    if pad not in ("SAME", "VALID"):
      raise NotImplementedError(f"freeze: conv padding {pad!r} is not supported")
    return pad
  if isinstance(pad, int):
    return tuple((pad, pad) for _ in mod.kernel_size)
  return tuple((p, p) if isinstance(p, int) else tuple(p) for p in pad)


def apply_frozen(model: nn.Module, frozen: dict, *args, implementation: str = "auto",
                 method=None, **kwargs):
  """``model.apply`` with every frozen layer replaced by its packed version.

  Frozen layers are :class:`~qtrain.qlayers.QDense` / :class:`~qtrain.qlayers.QConv`
  or plain ``nn.Dense`` / ``nn.Conv`` (a model trained through
  :func:`qtrain.quantize_model`: pass the *float* model, the rules are not needed
  any more), matched by module path.

  Args:
    model: the (unbound) Flax module that was trained (for a rule-quantized
      model, the float model given to ``quantize_model``).
    frozen: the output of :func:`freeze` (or :func:`load_frozen`).
    *args, **kwargs: the model's call arguments.
    implementation: see the module docstring.
    method: passed to ``model.apply``.
  """
  from qtrain.qlayers import QConv, QDense

  layers = frozen["layers"]

  def interceptor(next_fun, a, kw, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, (QDense, QConv, nn.Dense, nn.Conv)):
      path = "/".join(str(p) for p in mod.path)
      if path in layers:
        x = a[0] if a else kw["inputs"]
        if isinstance(mod, (QConv, nn.Conv)):
          return apply_layer(layers[path], x, strides=mod.strides,
                             padding=_conv_padding(mod), implementation=implementation)
        return apply_layer(layers[path], x, implementation=implementation)
    return next_fun(*a, **kw)

  with nn.intercept_methods(interceptor):
    return model.apply(frozen["variables"], *args, method=method, **kwargs)


# ----------------------------------------------------------------------------
# Sizes and checkpoints.


def _nbytes(x) -> int:
  return 0 if x is None else int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize


def _tree_nbytes(tree) -> int:
  return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def layer_sizes(frozen: dict, variables=None) -> dict:
  """Bytes per frozen layer, against float32 (and model totals when ``variables`` is given).

  Returns:
    ``{path: {"qtype", "float32_bytes", "frozen_bytes", "weight_bytes", "ratio"}}``
    and, with the trained ``variables``, ``"__model__"``: float32 bytes of all
    variables vs the frozen model's bytes (frozen layers + remaining variables).
  """
  out = {}
  for path, l in frozen["layers"].items():
    nw = int(np.prod(l.kernel_shape))
    extra = [l.bias, l.scale_a, l.bias_a]
    fp32 = 4 * nw + sum(4 * int(np.prod(np.shape(e))) for e in extra if e is not None)
    fb = sum(_nbytes(getattr(l, f)) for f in _ARRAY_FIELDS)
    out[path] = {"qtype": l.w_qtype, "act": (l.act_dict or {}).get("qtype"),
                 "float32_bytes": fp32, "frozen_bytes": fb, "weight_bytes": _nbytes(l.words),
                 "ratio": fp32 / max(fb, 1)}
  if variables is not None:
    if "params" not in variables:
      variables = {"params": variables}
    f32 = sum(4 * int(np.prod(np.shape(x))) for x in jax.tree.leaves(variables))
    fz = _tree_nbytes(frozen["variables"]) + sum(v["frozen_bytes"] for v in out.values())
    out["__model__"] = {"float32_bytes": f32, "frozen_bytes": fz, "ratio": f32 / max(fz, 1)}
  return out


def _esc(path: str) -> str:
  return "layer:" + path.replace("/", "|")


def _unesc(key: str) -> str:
  return key[len("layer:"):].replace("|", "/")


def save_frozen(directory: str, frozen: dict, *, force: bool = False) -> None:
  """Saves a frozen model with orbax: arrays (StandardSave) + layer metadata (JSON)."""
  import orbax.checkpoint as ocp
  arrays = {"layers": {_esc(p): {f: getattr(l, f) for f in _ARRAY_FIELDS if getattr(l, f) is not None}
                       for p, l in frozen["layers"].items()},
            "variables": frozen["variables"]}
  meta = {"layers": {p: l.meta() for p, l in frozen["layers"].items()}, "format": "qtrain.freeze/1"}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
    ck.save(directory, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                               meta=ocp.args.JsonSave(meta)), force=force)


def load_frozen(directory: str) -> dict:
  """Loads what :func:`save_frozen` wrote (arrays as jax arrays on the default device)."""
  import orbax.checkpoint as ocp
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
    r = ck.restore(directory, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(),
                                                      meta=ocp.args.JsonRestore()))
  arrays, meta = r["arrays"], r["meta"]
  layers = {}
  for p, m in meta["layers"].items():
    a = arrays["layers"][_esc(p)]
    get = lambda f: jnp.asarray(a[f]) if f in m["present"] else None
    act = None if m["act"] is None else tuple(sorted(m["act"].items()))
    layers[p] = FrozenLayer(
        words=get("words"), w_scale=get("w_scale"), w_zero=get("w_zero"), scale_a=get("scale_a"),
        bias_a=get("bias_a"), bias=get("bias"), kind=m["kind"], w_qtype=m["w_qtype"], k=m["k"],
        n=m["n"], kernel_shape=tuple(m["kernel_shape"]), group_size=m["group_size"], act=act)
  variables = jax.tree.map(jnp.asarray, arrays.get("variables", {}))
  return {"layers": layers, "variables": variables}
