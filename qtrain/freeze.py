"""Export: trained QT weights -> packed weights + scales, and the packed inference path.

:func:`freeze` quantizes each quantized op's weight exactly as the training
forward did (the QT op's own quantization function and spec, so the same
codes and scales) and stores it packed as a :class:`FrozenLayer`: codes
``(N, K)`` - output features by the flattened contraction, in the op's own
contracting order - packed along K in the :mod:`qtrain.core.packing` layout
(uint32 words, K-contiguous, LSB first; binary bit 1 = +1), with
per-output-channel scales ``(N,)`` or group scales / zero points ``(N, G)``.
Every weight qtype freezes: binary, ternary, int2..int8, nf4 and mxfp4 packed
into words; fp8 (``float8_e4m3fn``, ``float8_e5m2``) and ``mxfp8`` weights as
their fp8 codes' bytes, uint8 ``(N, K)`` (one byte a code; uint8 so that any
serializer keeps them), with the QT op's scales (mxfp8: one e8m0 scale per 32
values of K). fp8 weights run on XLA (no GPU kernel takes them).

What it freezes, and how the frozen model runs:

* A model quantized with :func:`qtrain.quantize_model` (linen): ``freeze(variables,
  provider)`` with the :class:`~qtrain.QtProvider` the model ran with (or the
  quantized model). Every op the provider recorded as quantized is frozen
  from its record: which operand is the weight, which of its axes the op
  contracts (any ``dot_general`` / ``einsum`` layout: ``Dense``,
  ``DenseGeneral``, ``Einsum``, the projections of
  ``MultiHeadDotProductAttention``, a module's own ``jax.lax.dot_general``),
  or the convolution's kernel layout. The provider records an op each time
  the quantized model is traced: after ``qmodel.init`` or a training step,
  or in a new process after ``jax.eval_shape(qmodel.apply, variables, x)``.
  :func:`apply_frozen` then runs the *float* model under qtrain's
  interception: each frozen op computes its product from the packed weight
  with the call's own dimension numbers; every other op runs as in the
  quantized model (float). The modules still read their ``kernel``: it is
  a NaN placeholder of the parameter's shape, built inside the call, which
  the frozen op never reads. Run ``apply_frozen`` under ``jax.jit`` (frozen
  tree as an argument) and XLA removes the placeholders; an eager call
  allocates them for its duration. A placeholder read by anything other
  than its frozen op makes NaNs, never plausible numbers.
* An nnx model quantized in place by :func:`qtrain.quantize_model`:
  ``frozen = freeze(model)`` returns a new nnx model (the input is left as
  it is) in which each quantized op's :class:`~qtrain.flax.model.QtOp` is a
  :class:`FrozenOp` holding the packed weight as :class:`FrozenWeight`
  variables and each frozen parameter a static :class:`Placeholder`. Call it
  like the model (``frozen(x)``, ``nnx.jit``), split / merge it with
  ``nnx.split`` / ``nnx.merge``, save it with :func:`save_frozen`.
* Models built from :class:`~qtrain.qlayers.QDense` / :class:`~qtrain.qlayers.QConv`:
  ``freeze(variables, {path regex: LayerQuant})``. These layers' kernels are
  ``(K, N)`` / HWIO by definition; they are replaced as whole layers (bias,
  learned input scale ``scale_a`` and shift ``bias_a`` included). A list of
  :class:`~qtrain.QtRule` s freezes plain ``nn.Dense`` / ``nn.Conv`` layers
  the same way (their kernels are ``(K, N)`` / HWIO too); any other module
  at a frozen path raises at inference: freeze such models with the provider.

nnx specifics: a user module's own calls (``jnp.einsum``, ``jax.lax.dot_general``,
``conv_general_dilated``, ``@`` / ``jnp.matmul`` / ``jnp.dot`` ...) freeze like a layer's
op: each quantized call's :class:`FrozenOp` sits on the module under the call's op id
(``einsum0``), the parameter it took becomes a :class:`Placeholder` (passed as it is, it
reads as NaNs), and the module's calls are handed to their frozen ops in the order the
sample forward numbered them (a call that now takes another parameter raises). Layers
stacked by ``nnx.vmap`` (run by ``nnx.scan`` / ``nnx.vmap``) freeze layer by layer: the
frozen op's arrays carry the stack's leading axes (:attr:`FrozenOp.stack`), so the scan
slices them with the layer's other state, and each layer's codes and scales are those its
QT op computed (static input scales one per layer).

What cannot be frozen (freeze raises, naming the layer): linen layers
stacked by ``nn.scan`` / ``nn.vmap`` (the op sees one slice of the
parameter); an op whose weight is computed from a
parameter (a masked convolution's ``kernel * mask``, an einsum that sums
weight axes first); an op of a module with several parameters of the
weight's shape, none named ``kernel``; a quantized ``ragged_dot``; a stacked
nnx layer with a LoRA adapter (merge it first). A module's own op must pass the
parameter itself as its weight (as the QT forward's interception expects).

``implementation`` (the rules' names, :data:`IMPLEMENTATIONS`):

* ``"xla"``: the weight is rebuilt in its own layout and the product is the
  QT forward's (:func:`qtrain.ops.dispatch.quantized_dot_general` with the
  op's dimension numbers; convolutions
  :func:`~qtrain.ops.conv_general_qt.quantized_conv`): the same numbers as
  the quantized model's forward (op by op; under ``jax.jit`` XLA may sum a
  float x dequantized product of either graph in another order; a product
  of two quantized operands summed in float32, fp8 x fp8, matches a forward
  that ran with the same implementation name: ``"auto"`` hands XLA GEMM
  layouts, which sum in another order);
* ``"auto"``: on a GPU, the Triton kernels on the packed weights where they
  take the layer and the product has at most
  :data:`qtrain._frozen.AUTO_KERNEL_MAX_ROWS` (16) rows, where they were
  measured faster than XLA's bf16 GEMM (decoding); larger products (prefill,
  QLoRA training) as ``"xla"`` through dispatch's ``"auto"``; elsewhere
  the XLA path (the same choice the rules' default makes, so on the CPU the
  same numbers as the quantized model);
* ``"triton"`` / ``"interpret"``: the qtrain Triton kernels
  (:func:`qtrain.kernels.binary_matmul.binary_matmul`,
  :func:`qtrain.kernels.nbit_matmul.nbit_matmul`, int8) on a GPU / in the
  Pallas interpreter, on prepared weights; the input reshaped to
  ``(M, K)`` in the weight's K order; convolutions as im2col (patches of the
  *quantized* input, so zero padding contributes 0 as in training) + the
  packed matmul. A layer no kernel takes (batch axes in the weight, grouped
  convolutions, asymmetric or group-scaled inputs, fp8 inputs, fp8 weights)
  raises naming it (``"auto"`` runs such layers on XLA);
* ``"mosaic"``: the Mosaic GPU kernels (Hopper, jax >= 0.11) through
  dispatch, which says why a layer cannot run there.

:func:`layer_sizes` reports bytes per layer (binary layers ~25x smaller than
float32), :func:`save_frozen` / :func:`load_frozen` round-trip a frozen model
through orbax.

Example (a rule-quantized linen model):
  >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
  >>> from qtrain import freeze
  >>> model = nn.Sequential([nn.DenseGeneral((4, 8)), nn.DenseGeneral(16, axis=(-2, -1))])
  >>> provider = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4",
  ...                                             act_qtype="int8")])
  >>> qmodel = qtrain.quantize_model(model, provider)
  >>> x = jax.random.normal(jax.random.key(0), (2, 32))
  >>> variables = qmodel.init(jax.random.key(1), x)
  >>> frozen = freeze.freeze(variables, provider)
  >>> sorted(frozen["layers"]), frozen["layers"]["layers_1"].words.shape
  (['layers_0', 'layers_1'], (16, 4))
  >>> y = jax.jit(lambda fr, x: freeze.apply_frozen(model, fr, x))(frozen, x)
  >>> bool(jnp.all(y == jax.jit(qmodel.apply)(variables, x)))
  True
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import meta as flax_meta

from qtrain import _frozen
from qtrain import lora as lora_lib
from qtrain import provider as provider_lib
from qtrain._frozen import FrozenLayer
from qtrain.binary import LayerQuant
from qtrain.flax import hosts
from qtrain.flax import intercept as _intercept
from qtrain.flax import model as model_lib
from qtrain.flax.model import variable_get
from qtrain.ops import lora as lora_ops
from qtrain.ops import placement
from qtrain.qlayers import QConv, QDense
from qtrain.rules import QtRule

__all__ = ["FrozenLayer", "FrozenOp", "FrozenWeight", "Placeholder", "freeze", "freeze_layer",
           "apply_layer", "apply_frozen", "layer_sizes", "save_frozen", "load_frozen",
           "IMPLEMENTATIONS"]

IMPLEMENTATIONS = _frozen.IMPLEMENTATIONS
_ARRAY_FIELDS = _frozen.ARRAY_FIELDS
_FORMAT = "qtrain.freeze/2"
_STATE_NAMES = ("act_scale", "act_shift", "act_static_scale", "act_static_count")
_static = getattr(nnx, "static", lambda v: v)
_data = getattr(nnx, "data", lambda v: v)


def _where(path: str, op_id: str | None = None) -> str:
  p = path or "<root>"
  return p if op_id is None else f"{p} ({op_id})"


# ----------------------------------------------------------------------------
# Freezing whole layers: qlayers.QDense / QConv, or nn.Dense / nn.Conv from rules.


def freeze_layer(params: Mapping[str, jax.Array], lq: LayerQuant, *, where: str = "") -> FrozenLayer:
  """Freezes one QDense / QConv-style layer: ``kernel`` (``(K, N)`` or HWIO) and optional
  ``bias`` / ``scale_a`` / ``bias_a`` (or the provider's ``<op>_act_scale`` / ``_act_shift``)."""
  if lq.weight is None:
    raise ValueError(f"freeze: layer {_where(where)!r}: LayerQuant.weight is None (freeze needs "
                     "a quantized weight)")
  raw = flax_meta.unbox(params["kernel"])
  kernel = jnp.asarray(raw, jnp.float32)

  def get(*names):
    """The param under one of ``names`` (qlayers' name or the provider's ``<op>0_<name>``)."""
    found = [k for k in params for nm in names if k == nm or k.endswith("_" + nm)]
    if len(found) > 1:
      raise ValueError(f"freeze: layer {_where(where)!r}: several {names} params: {found}")
    return jnp.asarray(flax_meta.unbox(params[found[0]]), jnp.float32) if found else None

  scale_a = get("scale_a", "act_scale")
  fields = dict(scale_a=scale_a, bias_a=get("bias_a", "act_shift"), bias=get("bias"),
                weight_dtype="float32", param="kernel", param_dtype=jnp.dtype(raw.dtype).name)
  scale = "given" if scale_a is not None else None
  if kernel.ndim == 2:
    return _frozen.build_dot(kernel, contract=(0,), batch=(), w_cfg=lq.weight,
                             where=_where(where), act=_frozen.act_meta(lq.act, scale), **fields)
  if kernel.ndim >= 3:
    cc = lq.conv_config()
    nd = kernel.ndim
    return _frozen.build_conv(kernel, rhs_spec=(nd - 1, nd - 2) + tuple(range(nd - 2)),
                              w_cfg=cc.rhs, where=_where(where),
                              act=_frozen.act_meta(cc.lhs, scale), **fields)
  raise ValueError(f"freeze: layer {_where(where)!r}: kernel of shape {kernel.shape}; expected a "
                   "Dense (K, N) or conv HWIO kernel")


def _kernel_paths(params, prefix=()):
  """Yields (path tuple, dict) for every sub-dict holding a ``kernel``."""
  if isinstance(params, Mapping):
    if "kernel" in params and not isinstance(params["kernel"], Mapping):
      yield prefix, params
    for key, v in params.items():
      if isinstance(v, Mapping):
        yield from _kernel_paths(v, prefix + (str(key),))


def _is_qtrule(r) -> bool:
  return isinstance(r, QtRule)


def _match(rules, path: str, conv: bool):
  for r in rules:
    if _is_qtrule(r):
      if r.matches(path, "conv_general_dilated" if conv else "dot_general"):
        if r.weight_sparsity is not None or r.act_sparsity is not None:
          raise ValueError(f"freeze: layer {path!r}: its rule sets N:M sparsity, which a list of "
                           "rules does not freeze (whole layers); freeze the model with the "
                           "QtProvider it ran with")
        return LayerQuant.from_rule(r, conv=conv) if r.quantizes else None
      continue
    pat, lq = r
    if re.fullmatch(pat, path):
      return lq
  return None


def _remove(tree: Mapping, path: tuple[str, ...]):
  """``tree`` without the entry at ``path`` (empty parents dropped)."""
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


def _set_in(tree: Mapping, path: tuple[str, ...], value) -> dict:
  out = dict(tree)
  if len(path) == 1:
    out[path[0]] = value
  else:
    out[path[0]] = _set_in(tree.get(path[0], {}), path[1:], value)
  return out


def _freeze_layers(variables, rules) -> dict:
  layers = {}
  params = variables["params"]
  new_params = params
  for path, sub in list(_kernel_paths(params)):
    p = "/".join(path)
    lq = _match(rules, p, conv=jnp.ndim(flax_meta.unbox(sub["kernel"])) >= 3)
    if lq is None or lq.weight is None:
      continue
    layers[p] = freeze_layer(sub, lq, where=p)
    new_params = _remove(new_params, path)
  return {"layers": layers, "variables": {**variables, "params": new_params}}


# ----------------------------------------------------------------------------
# Freezing ops from the provider's records (linen and nnx).


def _weight_quant(rec, provider):
  """The OperandQuant the QT op quantized its weight with (what freezing quantizes it with)."""
  return provider._operand(provider.rules[rec.rule_index], weight=True, given_scale=False,
                           conv=rec.op_name == "conv_general_dilated")


def _from_record(rec, provider, module_params: Mapping, state: Mapping, where: str, *,
                 static: str = "count") -> FrozenLayer:
  """The FrozenLayer of one op the provider recorded as quantized.

  ``static``: how a static input scale is read: ``"count"``, as calibrated where its count is
  positive (else one scale per batch, as the QT op does); ``"given"``, as calibrated whatever
  the count says (a template built under tracing, where the count is not known).
  """
  if rec.contraction is None:
    raise ValueError(f"freeze: the record of {where!r} says nothing of its contraction (recorded "
                     "by an older qtrain?): run the quantized model once again")
  if rec.op_name == "ragged_dot":
    raise ValueError(f"freeze: {where!r} is a quantized ragged_dot (a mixture-of-experts "
                     "product), which freeze does not export yet: keep it float with a first "
                     f"rule QtRule(module_path={rec.path!r}, op_names=('ragged_dot',))")
  rule = provider.rules[rec.rule_index]
  conv = rec.op_name == "conv_general_dilated"
  if conv:
    _, (_, rhs_spec, _), _, shapes, dtypes = rec.contraction
  else:
    _, dn, shapes, dtypes = rec.contraction
  w_idx = {"lhs": 0, "rhs": 1}[rec.weight_operand]
  name = hosts.weight_param_name(module_params, shapes[w_idx], what="freeze", where=where)
  raw = flax_meta.unbox(module_params[name])
  scale_kind, scale_a, bias_a, zero_a = None, None, None, None

  def need(key, why):
    if state.get(key) is None:
      raise ValueError(f"freeze: layer {where!r}: its rule keeps {why}, but the variables hold "
                       f"no {key!r} for it (pass all collections, e.g. 'quant_stats')")
    return jnp.asarray(state[key])  # as stored: the QT op reads it as is

  if rule.act_qtype is not None:
    if rule.act_learnable_scale:
      scale_kind, scale_a = "given", need("act_scale", "a learned input scale")
    elif rule.act_static_scale:
      asymmetric = rule.act_calibration_method.is_asymmetric
      if asymmetric and "act_static_zero_point" not in state:
        raise NotImplementedError(
            f"freeze: layer {where!r}: its rule keeps an asymmetric static input scale "
            f"(act_calibration_method={rule.act_calibration_method.method!r}: a scale and a "
            "zero point), which freeze takes from qtrain.qwix's statistics (sum_of_min / "
            "sum_of_max) only; train with a symmetric static calibration (e.g. 'absmax') or "
            "with qtrain.qwix.QtProvider to freeze this layer")
      s = need("act_static_scale", "a static input scale")
      count = need("act_static_count", "a static input scale")
      # Under tracing (nnx.eval_shape of a PTQ model) the count is not known: a template keeps
      # the calibrated scale's place.
      if static == "given" or isinstance(count, jax.core.Tracer) or float(count) > 0:
        scale_kind, scale_a = "given", s
        if asymmetric:
          zero_a = need("act_static_zero_point", "a static input zero point")
      else:  # never calibrated: the QT op calibrates one scale per batch, as here
        scale_kind = "batch"
    if rule.act_learnable_shift:
      bias_a = need("act_shift", "a learned input shift")
  a_cfg = provider._operand(rule, weight=False, given_scale=scale_kind is not None, conv=conv)
  fields = dict(scale_a=scale_a, zero_a=zero_a, bias_a=bias_a, bias=None,
                act=_frozen.act_meta(a_cfg, scale_kind),
                weight_operand=w_idx, weight_dtype=dtypes[w_idx], param=name,
                param_dtype=jnp.dtype(raw.dtype).name, op_id=rec.op_id, op_name=rec.op_name,
                lora=_frozen.lora_meta(rule), w_sparsity=_frozen.sparsity_meta(rule.weight_sparsity),
                a_sparsity=_frozen.sparsity_meta(rule.act_sparsity))
  w_cfg = _weight_quant(rec, provider)
  kernel = jnp.asarray(raw).astype(dtypes[w_idx])  # the module's cast, as the op saw it
  # The weight pruned as the QT op prunes it (before quantizing, in the operand's own layout).
  kernel = _frozen.sparsity_of(fields["w_sparsity"], kernel, f"the weight of layer {where!r}")
  if conv:
    return _frozen.build_conv(kernel, rhs_spec=rhs_spec, w_cfg=w_cfg, where=where, **fields)
  # Where a tile meets a multi-axis contraction the op quantizes the merged contraction; the
  # activation's other axes do not matter to the merge, so a small stand-in takes its place.
  ac, ab = dn[0][1 - w_idx], dn[1][1 - w_idx]
  stand_in = jnp.zeros([s if a in ac or a in ab else 1 for a, s in enumerate(shapes[1 - w_idx])],
                       dtypes[1 - w_idx])
  _, merged, mdn = _frozen.merge_contraction(
      stand_in, kernel, dn, w_idx, (None if a_cfg is None else a_cfg.tile_size,
                                    None if w_cfg is None else w_cfg.tile_size))
  layer = _frozen.build_dot(merged, contract=mdn[0][w_idx], batch=mdn[1][w_idx], w_cfg=w_cfg,
                            where=where, **fields)
  if merged.shape == kernel.shape:
    return layer
  return dataclasses.replace(layer, kernel_shape=tuple(int(d) for d in kernel.shape),
                             layout=(_frozen.merged_order(dn, w_idx), tuple(dn[1][w_idx])))


def _subtree(tree: Mapping, path: str, where: str, what: str) -> Mapping:
  node = tree
  for part in (path.split("/") if path else []):
    if not isinstance(node, Mapping) or part not in node:
      raise ValueError(f"freeze: the provider recorded an op of module {where!r}, but the "
                       f"variables hold no {what} for it: pass the variables of the model the "
                       "provider ran with")
    node = node[part]
  return node


def _records(provider):
  recs = provider.records()
  if not recs:
    raise ValueError(
        "freeze: the provider has recorded no op, so freeze cannot tell how each op uses its "
        "weight: run the quantized model once first (qmodel.init, a step, or, costing no "
        "compute, jax.eval_shape(qmodel.apply, variables, x))")
  return recs


def _layer_key(path: str, op_id: str, counts) -> str:
  return path if counts[path] == 1 else f"{path}:{op_id}"


def _layer_path(key: str, layer: FrozenLayer) -> str:
  suffix = f":{layer.op_id}"
  return key[:-len(suffix)] if layer.op_id and key.endswith(suffix) else key


def _static_state(provider, stats, rec) -> tuple[dict, list[str]]:
  """A static input scale's state ``{"act_static_scale", "act_static_count"}`` of op ``rec``
  from its module's statistics ``stats`` (name -> value), and the names it was read from.

  A provider with its own layout of the statistics (``read_static_stats``: qtrain.qwix's, qwix's
  ``<op id>_lhs: {count, sum_of_absmax}``) reads them itself; qtrain's are
  ``<op id>_act_static_scale`` / ``<op id>_act_static_count``.
  """
  stats = stats if isinstance(stats, Mapping) else {}
  read = getattr(provider, "read_static_stats", None)
  if read is not None:
    return read(stats, rec.op_id, provider.rules[rec.rule_index])
  names = {n: f"{rec.op_id}_{n}" for n in ("act_static_scale", "act_static_count")}
  return ({n: stats.get(k) for n, k in names.items()},
          [k for k in names.values() if stats.get(k) is not None])


def _freeze_records(variables, provider, *, static: str = "count") -> dict:

  recs = [r for r in _records(provider) if r.status == provider_lib.QUANTIZED]
  recs.sort(key=lambda r: (r.path, r.op_id))
  counts = collections.Counter(r.path for r in recs)
  params = variables["params"]
  stats = variables.get("quant_stats", {})
  layers, drop_params, drop_stats = {}, set(), set()
  for r in recs:
    where = _where(r.path, r.op_id)
    split = tuple(r.path.split("/")) if r.path else ()
    mod = _subtree(params, r.path, where, "params")
    mod_stats = stats
    for part in split:
      mod_stats = mod_stats.get(part, {}) if isinstance(mod_stats, Mapping) else {}
    state = {n: flax_meta.unbox(mod.get(f"{r.op_id}_{n}")) for n in ("act_scale", "act_shift")}
    static_state, stat_names = _static_state(provider, mod_stats, r)
    state.update(static_state)
    layer = _from_record(r, provider, mod, state, where, static=static)
    layers[_layer_key(r.path, r.op_id, counts)] = layer
    drop_params.add(split + (layer.param,))
    drop_params.update(split + (f"{r.op_id}_{n}",) for n in ("act_scale", "act_shift")
                       if state[n] is not None)
    drop_stats.update(split + (n,) for n in stat_names)
  rest = dict(variables)
  # Ops left in float keep no adapter of their own: theirs folds into their kernel.
  frozen_ops = {(r.path, r.op_id) for r in recs}
  rest["params"] = lora_lib.merge_params(rest["params"], provider,
                                         keep=lambda path, op_id: (path, op_id) in frozen_ops)
  for path in sorted(drop_params):
    rest["params"] = _remove(rest["params"], path)
  if drop_stats:
    for path in sorted(drop_stats):
      rest["quant_stats"] = _remove(rest["quant_stats"], path)
    if not rest["quant_stats"]:
      del rest["quant_stats"]
  return {"layers": layers, "variables": rest}


# ----------------------------------------------------------------------------
# nnx.


def _check_unmasked(module, where: str) -> None:
  """A masked layer's op multiplies ``kernel * mask``, not the parameter freeze would pack."""
  if getattr(module, "mask", None) is not None:
    raise ValueError(f"freeze: layer {where!r} ({type(module).__name__}) has a mask: its op's "
                     "weight is kernel * mask, not a parameter, and cannot be frozen")


class FrozenWeight(nnx.Variable):
  """nnx state of a frozen layer (packed weights, scales, input scale / shift): not trained."""


@dataclasses.dataclass(frozen=True)
class Placeholder:
  """Stands in for a frozen float parameter of an nnx module (static).

  Reading it (``p[...]``, ``p.value``) gives NaNs of the parameter's shape and
  dtype, built where they are read: the frozen op ignores them (dead code
  under jit), anything else that reads them makes NaNs, never plausible
  numbers.
  """

  shape: tuple[int, ...]
  dtype: str

  def __getitem__(self, index):
    return jnp.full(self.shape, jnp.nan, self.dtype)[index]

  @property
  def value(self):
    return self[...]

  def get_value(self):
    return self[...]

  def __jax_array__(self):  # passed as it is to a module's own product (jnp.einsum(x, self.w))
    return self[...]


class FrozenOp(nnx.Module):
  """The op an nnx layer calls in place of its ``dot_general`` / ``einsum_op`` /
  ``conv_general_dilated`` attribute once frozen: the product from the packed weight.

  Attributes:
    path: the layer's module path.
    op_name: ``dot_general``, ``einsum`` or ``conv_general_dilated``.
    implementation: where products run (see the module docstring; set by
      :func:`apply_frozen`).
  """

  def __init__(self, layer: FrozenLayer, *, path: str, op_name: str, implementation: str = "auto",
               adapter=None, weight_quant=None, op_id: str | None = None,
               stack: tuple[int, ...] = ()):
    self.path = path
    self.op_name = op_name
    # A module's own (direct) call: its op id, the attribute this op sits under; None for a
    # layer's op attribute.
    self.op_id = op_id
    # A layer stacked by nnx.vmap (run by nnx.scan / nnx.vmap): the stack's shape, the leading
    # axes of each array of ``layer`` (sliced with the layer's parameters); () otherwise.
    self.stack = tuple(int(d) for d in stack)
    # How the weight was quantized (an OperandQuant, static): what re-freezes it from other
    # float weights (qtrain.qwix.quantize_params); None for layers loaded from older files.
    self.weight_quant = _static(weight_quant)
    self.implementation = _frozen.check_implementation(implementation)
    self.deterministic = False
    if adapter is not None:  # (LoraA, LoraB, dropout RngStream or None): carried over as they are
      self.lora_a, self.lora_b = adapter[0], adapter[1]
      if adapter[2] is not None:
        self.lora_dropout_rng = adapter[2]
    self.spec = _static(dataclasses.replace(layer, **{f: None for f in _ARRAY_FIELDS}))
    for f in _ARRAY_FIELDS:
      if getattr(layer, f) is not None:
        setattr(self, f, FrozenWeight(getattr(layer, f)))

  @property
  def layer(self) -> FrozenLayer:
    arrays = {f: getattr(self, f)[...] for f in _ARRAY_FIELDS if hasattr(self, f)}
    return dataclasses.replace(self.spec, **arrays)

  def refreeze(self, kernel) -> FrozenLayer:
    """This op's layer frozen anew from another float weight ``kernel`` (the parameter, as the
    module holds it): the same quantization, layout and metadata; the arrays' shapes and
    dtypes are this op's (which may be abstract, ``nnx.eval_shape``'s).

    Raises:
      ValueError: naming the layer, where float weights cannot give the layer: it records no
        weight quantization (loaded from a file), keeps a LoRA adapter or input-scale state
        (calibrated, learned), or the kernel's shape differs.
    """
    spec, where = self.spec, _where(self.path, f"{self.op_name}0")
    if self.weight_quant is None:
      raise ValueError(f"frozen layer {where!r} does not record how its weight was quantized "
                       "(loaded from a file?): freeze it from the quantized model instead")
    if spec.lora is not None:
      raise ValueError(f"frozen layer {where!r} keeps a LoRA adapter, which a float weight does "
                       "not give: freeze the trained model instead")
    if (spec.act_dict or {}).get("scale") == "given" or hasattr(self, "bias_a"):
      raise ValueError(f"frozen layer {where!r} keeps a calibrated or learned input scale, which "
                       "float params do not hold: freeze the trained QT model instead")
    kernel = jnp.asarray(kernel)
    if tuple(kernel.shape) != tuple(spec.kernel_shape):
      param = "/".join([p for p in self.path.split("/") if p] + [spec.param])
      raise ValueError(f"{param!r} has shape {tuple(kernel.shape)}, the frozen layer {where!r} "
                       f"{spec.kernel_shape}")
    layer = _frozen.rebuild(spec, kernel, self.weight_quant, where=where)
    for f in _ARRAY_FIELDS:
      want = variable_get(getattr(self, f)) if hasattr(self, f) else None
      got = getattr(layer, f)
      if (want is None) != (got is None) or (
          want is not None and (got.shape != want.shape or got.dtype != want.dtype)):
        raise ValueError(f"frozen layer {where!r}: {f} comes out "
                         f"{None if got is None else (got.dtype, got.shape)}, the layer's "
                         f"{None if want is None else (want.dtype, want.shape)} (a tile across "
                         "several contracting axes is not rebuilt here: freeze the model instead)")
    return layer

  @property
  def key(self) -> str:
    """The frozen layer's key: the module path, ``<path>:<op id>`` for a module's direct call."""
    return self.path if self.op_id is None else f"{self.path}:{self.op_id}"

  @property
  def weight_operand(self) -> int:
    """The weight's operand index in the op (1 for a layer's op)."""
    return self.spec.weight_operand

  def __call__(self, *args, **kwargs):
    # The product's own jax.lax / jnp calls must not reach a frame of the calling module.
    with _intercept.sentinel():
      return self._call(args, kwargs, 1)

  def direct(self, op_name: str, args, kwargs, weight_operand: int):
    """A module's own call of this op (``jnp.einsum`` / ``jax.lax.dot_general`` / ``@`` ...
    in its code; ``args`` / ``kwargs`` as the op takes them), its weight operand
    ``weight_operand``: the product from the frozen weight."""
    if op_name != self.op_name:
      raise _frozen._mismatch(_where(self.path, self.op_id),
                              f"it was frozen as a {self.op_name} call, now called as {op_name}")
    with _intercept.sentinel():
      return self._call(args, kwargs, weight_operand)

  def _call(self, args, kwargs, weight_operand: int):
    kwargs = dict(kwargs)
    out_sharding = kwargs.pop("out_sharding", None)
    if self.op_name == "einsum":  # (subscripts, *operands)
      head, operands, tail = args[:1], args[1:], ()
    else:  # (lhs, rhs, *rest)
      head, operands, tail = (), args[:2], args[2:]
    carried = (self.layer, self._adapter())

    def frozen(*ops_and_carried):
      *ops, (layer, adapter) = ops_and_carried
      return self._product(layer, adapter, weight_operand, *head, *ops, *tail, **kwargs)
    if placement.needs_placement(out_sharding):
      # The float op this one replaces, for where it would place its result.
      original = _intercept.original(self.op_name)
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return placement.as_float_sharded(
          lambda *ops: original(*head, *ops, *tail, **kwargs, **kw), frozen, *operands,
          out_sharding=out_sharding, carried=carried)
    return frozen(*operands, carried)

  def _product(self, layer, adapter, weight_operand, *args, **kwargs):
    where = _where(self.path, self.op_id)
    if self.op_name == "dot_general":
      return self._dot_general(layer, adapter, weight_operand, *args, **kwargs)
    if self.op_name == "einsum":
      subscripts, *operands = args
      return _frozen.einsum(layer, subscripts, operands, kwargs, weight_operand=weight_operand,
                            implementation=self.implementation, where=where, adapter=adapter)
    if weight_operand != 1:
      raise _frozen._mismatch(where, f"its kernel is operand {weight_operand}, frozen as 1")
    return _frozen.conv_general_dilated(layer, *args, **kwargs,
                                        implementation=self.implementation, where=where)

  def _dot_general(self, layer, adapter, weight_operand, lhs, rhs, dimension_numbers,
                   precision=None, preferred_element_type=None):
    del precision  # a product of quantized values has its own (the QT op's) precision
    return _frozen.dot_general(layer, lhs, rhs, dimension_numbers,
                               preferred_element_type=preferred_element_type,
                               weight_operand=weight_operand, implementation=self.implementation,
                               where=_where(self.path, self.op_id), adapter=adapter)

  def _adapter(self):
    if getattr(self, "lora_a", None) is None:
      return None
    rng = getattr(self, "lora_dropout_rng", None)
    key = None if (rng is None or self.deterministic) else rng()
    return self.lora_a[...], self.lora_b[...], key


def _nnx_hooks(model, cls):
  """(path, owner module, attribute, op) of every ``cls`` op in ``model``: a layer's op
  attribute (``dot_general``, ``einsum_op``, ``conv_general_dilated``) or a module's direct
  call's op, kept under its op id (``einsum0``)."""
  out = []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    for attr, op in vars(node).items():
      if isinstance(op, cls):
        out.append(("/".join(str(p) for p in path), node, attr, op))
  return out


def _frozen_site(frame, op_name: str, op_id: str, operands):
  """(the frozen op, its weight operand) of a direct call of a frozen nnx model's module: the
  op kept under the call's op id; (None, None) for a call left float (it has none)."""
  op = vars(frame.module).get(op_id)
  if op is None:
    return None, None
  where = f"the {op_name} call {op_id!r} of frozen nnx module {frame.path or '<root>'!r}"
  if not callable(getattr(op, "direct", None)):
    raise ValueError(f"{where}: the module's attribute {op_id!r} is a {type(op).__name__}, not "
                     "the call's frozen op")
  w = op.weight_operand
  _, param = hosts.nnx_weight_operand(frame.module, operands[w:w + 1])
  if param is not None:  # a parameter the module still holds: not the frozen weight
    raise ValueError(f"{where} takes parameter {param!r} as its weight, and was frozen from "
                     f"{op.spec.param!r} (calls are told apart by their order: run them in the "
                     "order of the sample forward)")
  return op, w


class _FrozenDirectCalls:
  """The provider of a frozen nnx model's direct calls (:func:`_frozen_site` finds each call's
  frozen op): a frozen call computes from its frozen weight, every other call runs float."""

  def note_skipped(self, *args, **kwargs) -> None:  # a form left float: float here too
    pass

  def dot_general(self, host, path, op_id, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, weight_operand, fallback, out_sharding=None,
                  **_):
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    if host is None:
      return fallback(lhs, rhs, dimension_numbers, precision=precision,
                      preferred_element_type=preferred_element_type, **kw)
    return host.direct("dot_general", (lhs, rhs, dimension_numbers),
                       dict(precision=precision, preferred_element_type=preferred_element_type,
                            **kw), weight_operand)

  def einsum(self, host, path, op_id, subscripts, operands, kwargs, *, weight_operand, fallback):
    if host is None:
      return fallback(subscripts, *operands, **kwargs)
    return host.direct("einsum", (subscripts, *operands), kwargs, weight_operand)

  def conv_general_dilated(self, host, path, op_id, lhs, rhs, *args, weight_operand, fallback,
                           out_sharding=None, **kwargs):
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    if host is None:
      return fallback(lhs, rhs, *args, **kwargs, **kw)
    return host.direct("conv_general_dilated", (lhs, rhs, *args), {**kwargs, **kw},
                       weight_operand)

  def ragged_dot(self, host, path, op_id, lhs, rhs, group_sizes, *, float_call, **_):
    if host is None:
      return float_call()
    raise ValueError(f"frozen nnx module {path or '<root>'!r}: its attribute {op_id!r} is "
                     "taken by a ragged_dot call, which is never frozen")


FROZEN_DIRECT_CALLS = _FrozenDirectCalls()


def _stack_of(node, op, rec) -> tuple[int, ...]:
  """The stack shape of a layer stacked by nnx.vmap (run by nnx.scan / nnx.vmap): the leading
  axes its weight parameter has beyond the weight operand its op saw; () for a plain layer."""
  if rec.contraction is None:
    return ()
  shapes = rec.contraction[-2]
  w_shape = tuple(shapes[{"lhs": 0, "rhs": 1}[rec.weight_operand]])
  if op.weight_param is not None:
    shape = tuple(jnp.shape(variable_get(vars(node)[op.weight_param])))
    return shape[:len(shape) - len(w_shape)] if shape[len(shape) - len(w_shape):] == w_shape \
        else ()
  return model_lib._observed_stack_shape(node, w_shape) or ()


def _index(tree, idx):
  return jax.tree.map(lambda a: a[idx], tree)


def stack_layers(layers: list, stack: tuple[int, ...], where: str) -> FrozenLayer:
  """The frozen layers of a stack's layers (in ``np.ndindex(stack)`` order) as one layer whose
  arrays have the stack's leading axes (what nnx.scan / nnx.vmap slice)."""
  first = jax.tree.structure(layers[0])
  for i, layer in enumerate(layers):
    if jax.tree.structure(layer) != first:
      raise ValueError(f"freeze: layer {where!r}: the layers of its stack {stack} freeze "
                       f"differently (layer {i}: {jax.tree.structure(layer)}, layer 0: {first}); "
                       "a stack's layers must all be calibrated (or all not)")
  return jax.tree.map(lambda *a: jnp.stack(a).reshape(stack + a[0].shape), *layers)


def unstack_layer(layer: FrozenLayer, stack: tuple[int, ...]) -> list:
  """The per-layer frozen layers of a stacked one (``np.ndindex(stack)`` order)."""
  return [_index(layer, idx) for idx in np.ndindex(*stack)] if stack else [layer]


def _freeze_nnx(model, provider=None):

  frozen = nnx.clone(model)
  hooks = _nnx_hooks(frozen, model_lib.QtOp)
  if not hooks:
    raise ValueError("freeze: this nnx model has no quantized op: quantize it with "
                     "qtrain.quantize_model(model, provider, ...) and run it once first")
  recs = {}
  for _, _, _, op in hooks:
    if provider is not None and op.provider is not provider:
      raise ValueError(f"freeze: the op of nnx module {_where(op.path)!r} was quantized by "
                       f"another provider than the one given ({provider!r})")
    recs.update({(r.path, r.op_id): r for r in _records(op.provider)})
  for _, node, attr, op in hooks:
    direct = op.weight_param is not None  # a module's own call, kept under its op id
    where = _where(op.path, op.op_id)
    rec = recs.get((op.path, op.op_id))
    if rec is None:
      raise ValueError(f"freeze: the op of nnx module {where!r} has not run yet: call the model "
                       "once (or pass sample inputs to quantize_model) before freezing")
    if rec.status != provider_lib.QUANTIZED:  # left in float by the QT model: float here too
      if getattr(op, lora_ops.A_NAME, None) is not None:  # its adapter folds into its weight
        lora_lib.fold_nnx_op(node, op, where)
      if direct:
        delattr(node, attr)
      else:
        setattr(node, attr, _static(op.original))
      continue
    _check_unmasked(node, where)
    params = {k: variable_get(v) for k, v in vars(node).items()
              if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam)}
    if direct:  # the parameter the call took (the module may have others of its shape)
      params = {op.weight_param: params[op.weight_param]}
    state = {n: variable_get(getattr(op, n)) for n in _STATE_NAMES if getattr(op, n, None) is not None}
    owner = getattr(op, "stat_owner", None)
    stats = None
    if owner is not None:  # statistics kept on the layer (qtrain.qwix's provider)
      stats = {k: variable_get(v) for k, v in vars(owner).items()
               if isinstance(v, model_lib.QuantStat)}
    elif direct:  # a direct call keeps its statistics on its op (qtrain.qwix's: <side>)
      stats = {f"{op.op_id}_{k}": variable_get(v) for k, v in vars(op).items()
               if isinstance(v, model_lib.QuantStat)}

    def with_stats(state, stats):  # the op's state plus what its statistics give
      if stats is None:
        return state, []
      static_state, names = _static_state(op.provider, stats, rec)
      return {**state, **{k: v for k, v in static_state.items() if v is not None}}, names
    stack = _stack_of(node, op, rec)
    if stack:  # one layer per index of the stack, arrays stacked as the parameters are
      layers = []
      for idx in np.ndindex(*stack):
        p_i = {k: v[idx] for k, v in params.items() if tuple(jnp.shape(v))[:len(stack)] == stack}
        s_i = {k: (None if v is None else _stacked_state(v, stack, idx, k, where))
               for k, v in state.items()}
        st_i = None if stats is None else {
            k: jax.tree.map(lambda a, k=k: _stacked_state(a, stack, idx, k, where), v)
            for k, v in stats.items()}
        s_i, names = with_stats(s_i, st_i)
        layers.append(_from_record(rec, op.provider, p_i, s_i, f"{where}[{idx}]"))
      layer = stack_layers(layers, stack, where)
      spec_layer = layers[0]
    else:
      state, names = with_stats(state, stats)
      layer = spec_layer = _from_record(rec, op.provider, params, state, where)
    if owner is not None:  # the layer keeps them no more: the frozen op has what they gave
      for k in names:
        delattr(node, k)
    adapter = None
    if layer.lora is not None:
      if stack:
        raise ValueError(f"freeze: layer {where!r} is one of a stack {stack} and keeps a LoRA "
                         "adapter: merge it (qtrain.lora.merge) before freezing a stack")
      adapter = (op.lora_a, op.lora_b, getattr(op, "lora_dropout_rng", None))
    fop = FrozenOp(layer, path=op.path, op_name=op.op_name, adapter=adapter,
                   weight_quant=_weight_quant(rec, op.provider),
                   op_id=op.op_id if direct else None, stack=stack)
    fop.deterministic = op.deterministic
    setattr(node, attr, _data(fop))
    setattr(node, spec_layer.param,
            _static(Placeholder(spec_layer.kernel_shape, spec_layer.param_dtype)))
  model_lib.reframe_direct_calls(frozen, FROZEN_DIRECT_CALLS, _frozen_site)
  return frozen


def _stacked_state(v, stack, idx, name, where):
  """Layer ``idx``'s value of an op's state ``v`` kept for a stack (leading axes ``stack``)."""
  v = jnp.asarray(v)
  if tuple(v.shape[:len(stack)]) != tuple(stack):
    raise ValueError(f"freeze: layer {where!r} is one of a stack {stack}, and its state {name!r} "
                     f"has shape {tuple(v.shape)}, not one per layer")
  return v[idx]


# ----------------------------------------------------------------------------
# The public entry point.


def freeze(variables, layer_quants=None):
  """Freezes the quantized ops / layers of a trained model.

  Args:
    variables: linen: ``{"params": ..., <other collections>}`` (or a bare
      params dict). nnx: the model quantized in place by
      :func:`qtrain.quantize_model`, after it has run once.
    layer_quants: linen: the :class:`~qtrain.QtProvider` the model was
      trained with, or the quantized model (``qtrain.quantize_model``'s
      result): every op it recorded as quantized is frozen (see the module
      docstring). For models of :mod:`qtrain.qlayers` layers,
      ``{path regex: LayerQuant or None}`` (or a sequence of pairs), matched
      with ``re.fullmatch`` against the ``/``-joined module path of every
      params sub-dict that holds a ``kernel`` (first match wins; None or a
      float LayerQuant leaves the layer float; ``""`` is the root); a list
      of :class:`~qtrain.QtRule` s does the same for plain ``nn.Dense`` /
      ``nn.Conv`` layers. nnx: None, or the model's provider.

  Returns:
    linen: ``{"layers": {key: FrozenLayer}, "variables": the variables
    without the frozen weights (and the frozen ops' input scales / shifts)}``;
    a key is the module path, or ``"<path>:<op id>"`` for a module with
    several frozen ops. nnx: a new, frozen nnx model.

  Raises:
    ValueError: a layer that cannot be frozen (stacked, a computed weight), records
      missing or not matching the variables; the message names the layer.
  """
  if isinstance(variables, nnx.Module):
    return _freeze_nnx(variables, layer_quants)

  if isinstance(layer_quants, model_lib.QtLinenModel):
    layer_quants = layer_quants.provider
  if "params" not in variables:
    variables = {"params": variables}
  if isinstance(layer_quants, provider_lib.QtProvider):
    return _freeze_records(variables, layer_quants)
  if layer_quants is None:
    raise ValueError("freeze(variables, layer_quants): pass the QtProvider the model ran with "
                     "(or {path regex: LayerQuant} for qtrain.qlayers models)")
  rules = list(layer_quants.items()) if isinstance(layer_quants, Mapping) else list(layer_quants)
  return _freeze_layers(variables, rules)


# ----------------------------------------------------------------------------
# Inference.


def apply_layer(layer: FrozenLayer, x: jax.Array, *, strides=None, padding="SAME",
                implementation: str = "auto") -> jax.Array:
  """Runs one whole frozen layer (:func:`freeze_layer`'s) on ``x`` (dense: ``(..., K)``;
  conv: NHWC, with the layer's ``strides`` and ``padding``), bias included.

  Args:
    layer: a :class:`FrozenLayer` of a ``(K, N)`` or HWIO kernel.
    x: the float input.
    strides, padding: conv window strides and padding (as the trained layer).
    implementation: see the module docstring.
  """
  return _apply_layer(layer, x, strides=strides, padding=padding,
                      implementation=_frozen.check_implementation(implementation), where="<layer>")


def _apply_layer(layer, x, *, strides, padding, implementation, where):
  out_dtype = jnp.result_type(x)
  if layer.kind == "dot":
    if layer.layout != ((0,), ()) or len(layer.kernel_shape) != 2 or layer.weight_operand != 1:
      raise ValueError(f"frozen layer {where!r} is not a (K, N) dense layer (layout "
                       f"{layer.layout}): run it in its model with apply_frozen")
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    y = _frozen.dot_general(layer, x, None, dn, preferred_element_type=out_dtype,
                            implementation=implementation, where=where)
  else:
    ks = layer.kernel_shape
    nsp = len(ks) - 2
    if isinstance(strides, int):
      strides = (strides,) * nsp
    strides = tuple(strides) if strides else (1,) * nsp
    spatial = "HWD"[:nsp]
    dn = ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")
    y = _frozen.conv_general_dilated(layer, x, None, strides, padding, dimension_numbers=dn,
                                     preferred_element_type=out_dtype,
                                     implementation=implementation, where=where)
  if layer.bias is not None:
    y = y + layer.bias.astype(y.dtype)
  return y


def _conv_padding(mod):
  """A QConv / nn.Conv's padding as lax takes it (only the options both support)."""
  if isinstance(mod, nn.Conv):
    for f, ok in (("input_dilation", (None, 1)), ("kernel_dilation", (None, 1)),
                  ("feature_group_count", (1,))):
      v = getattr(mod, f, None)
      if v not in ok and not (isinstance(v, (tuple, list)) and all(d == 1 for d in v)):
        raise NotImplementedError(f"freeze: nn.Conv with {f}={v!r} is not supported as a whole "
                                  "frozen layer (freeze the model with its QtProvider)")
  pad = mod.padding
  if isinstance(pad, str):
    if pad not in ("SAME", "VALID"):
      raise NotImplementedError(f"freeze: conv padding {pad!r} is not supported")
    return pad
  if isinstance(pad, int):
    return tuple((pad, pad) for _ in mod.kernel_size)
  return tuple((p, p) if isinstance(p, int) else tuple(p) for p in pad)


def _linen_adapter(host, hit):
  """(A, B, dropout key) of a frozen op's adapter from its module's params, or None."""
  layer, where = hit
  if layer.lora is None:
    return None
  names = [f"{host.op_id}_{n}" for n in (lora_ops.A_NAME, lora_ops.B_NAME)]
  params = host.module.variables.get("params", {})
  if any(n not in params for n in names):
    raise ValueError(f"frozen layer {where!r} keeps a LoRA adapter, but the variables hold no "
                     f"{names[0]!r} / {names[1]!r} for it: pass freeze's variables (with the "
                     "adapters) to apply_frozen")
  a, b = (flax_meta.unbox(params[n]) for n in names)
  key = host.dropout_key() if layer.lora_dict["dropout"] > 0 else None
  return a, b, key


class _FrozenOps:
  """What the linen interception calls in place of a QtProvider while a frozen model runs:
  frozen ops compute from their packed weights, every other op runs its float original."""

  def __init__(self, layers: dict, implementation: str):
    self.layers = layers  # {(path, op_id): (FrozenLayer, where)}
    self.implementation = implementation

  def dot_general(self, host, path, op_id, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, weight_operand, fallback, out_sharding=None,
                  op_name="dot_general", record_shapes=None):
    hit = self.layers.get((path, op_id))

    def float_call(l, r):
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return fallback(l, r, dimension_numbers, precision=precision,
                      preferred_element_type=preferred_element_type, **kw)
    if hit is None:
      return float_call(lhs, rhs)

    def frozen(l, r, carried):
      return _frozen.dot_general(carried[0], l, r, dimension_numbers,
                                 preferred_element_type=preferred_element_type,
                                 weight_operand=weight_operand, implementation=self.implementation,
                                 where=hit[1], adapter=carried[1])
    carried = (hit[0], _linen_adapter(host, hit))
    if placement.needs_placement(out_sharding):
      return placement.as_float_sharded(float_call, frozen, lhs, rhs, out_sharding=out_sharding,
                                        carried=carried)
    return frozen(lhs, rhs, carried)

  def einsum(self, host, path, op_id, subscripts, operands, kwargs, *, weight_operand, fallback):
    hit = self.layers.get((path, op_id))
    if hit is None:
      return fallback(subscripts, *operands, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k != "out_sharding"}

    def frozen(*ops_and_carried):
      *ops, (layer, adapter) = ops_and_carried
      return _frozen.einsum(layer, subscripts, tuple(ops), rest, weight_operand=weight_operand,
                            implementation=self.implementation, where=hit[1], adapter=adapter)
    carried = (hit[0], _linen_adapter(host, hit))
    if placement.needs_placement(kwargs.get("out_sharding")):
      return placement.as_float_sharded(lambda *ops: fallback(subscripts, *ops, **kwargs), frozen,
                                        *operands, out_sharding=kwargs.get("out_sharding"),
                                        carried=carried)
    return frozen(*operands, carried)

  def conv_general_dilated(self, host, path, op_id, lhs, rhs, window_strides, padding,
                           lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                           feature_group_count=1, batch_group_count=1, precision=None,
                           preferred_element_type=None, *, weight_operand, fallback,
                           out_sharding=None):
    hit = self.layers.get((path, op_id))

    def float_call(l, r):
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return fallback(l, r, window_strides, padding, lhs_dilation=lhs_dilation,
                      rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                      feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                      precision=precision, preferred_element_type=preferred_element_type, **kw)
    if hit is None:
      return float_call(lhs, rhs)
    if weight_operand is not None and weight_operand != 1:
      raise _frozen._mismatch(hit[1], f"its kernel is operand {weight_operand}, frozen as 1")
    _check_unmasked(host.module, hit[1])

    def frozen(l, r, layer):
      return _frozen.conv_general_dilated(
          layer, l, r, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
          feature_group_count, batch_group_count, precision, preferred_element_type,
          implementation=self.implementation, where=hit[1])
    if placement.needs_placement(out_sharding):
      return placement.as_float_sharded(float_call, frozen, lhs, rhs, out_sharding=out_sharding,
                                        carried=hit[0])
    return frozen(lhs, rhs, hit[0])


def apply_frozen(model, frozen, *args, implementation: str = "auto", method=None, **kwargs):
  """Runs a frozen model: ``model.apply`` with every frozen op / layer on its packed weights.

  Args:
    model: linen: the (unbound) Flax module that was trained; for a model
      quantized by :func:`qtrain.quantize_model`, the float model (the
      quantized wrapper is accepted and unwrapped). nnx: the frozen model
      (:func:`freeze`'s result); ``frozen`` is then its first argument.
    frozen: linen: the output of :func:`freeze` (or :func:`load_frozen`).
    *args, **kwargs: the model's call arguments.
    implementation: see the module docstring.
    method: passed to ``model.apply`` (nnx: the name of the method to call).

  Run it under ``jax.jit`` with ``frozen`` as an argument (not a closed-over
  constant): the placeholders of frozen parameters are then never
  materialized.
  """
  impl = _frozen.check_implementation(implementation)
  if isinstance(model, nnx.Module):
    ops = _nnx_hooks(model, FrozenOp)
    if not ops:
      raise ValueError("apply_frozen: this nnx model has no FrozenOp: freeze it with "
                       "qtrain.freeze.freeze(model) first")
    for _, _, _, op in ops:
      op.implementation = impl
    fn = model if method is None else getattr(model, method)
    return fn(frozen, *args, **kwargs)

  if isinstance(model, model_lib.QtLinenModel):
    model = model.model
  whole, ops, variables = {}, {}, frozen["variables"]
  for key, layer in frozen["layers"].items():
    if layer.op_id is None:
      whole[key] = layer
      continue
    path = _layer_path(key, layer)
    ops[(path, layer.op_id)] = (layer, _where(path, layer.op_id))
    split = tuple(path.split("/")) if path else ()
    variables = {**variables, "params": _set_in(
        variables.get("params", {}), split + (layer.param,),
        jnp.full(layer.kernel_shape, jnp.nan, layer.param_dtype))}

  def interceptor(next_fun, a, kw, context):
    mod = context.module
    if context.method_name == "__call__":
      path = "/".join(str(p) for p in mod.path)
      if path in whole:
        if not isinstance(mod, (QDense, QConv, nn.Dense, nn.Conv)):
          raise ValueError(
              f"frozen layer {_where(path)!r} is a {type(mod).__name__}: a LayerQuant mapping or "
              "a list of rules freezes whole qlayers.QDense/QConv or nn.Dense/nn.Conv layers "
              "only; freeze this model with the QtProvider it ran with")
        x = a[0] if a else kw["inputs"]
        if isinstance(mod, (QConv, nn.Conv)):
          return _apply_layer(whole[path], x, strides=mod.strides, padding=_conv_padding(mod),
                              implementation=impl, where=path)
        return _apply_layer(whole[path], x, strides=None, padding=None, implementation=impl,
                            where=path)
    return next_fun(*a, **kw)

  with contextlib.ExitStack() as stack:
    if ops:
      stack.enter_context(_intercept.linen_scope(_FrozenOps(ops, impl)))
    if whole:
      stack.enter_context(nn.intercept_methods(interceptor))
    return model.apply(variables, *args, method=method, **kwargs)


# ----------------------------------------------------------------------------
# Sizes and checkpoints.


def _nbytes(x) -> int:
  return 0 if x is None else int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize


def _tree_nbytes(tree) -> int:
  return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def _frozen_layers(frozen) -> dict:
  """key -> (frozen layer, how many layers it stands for): a stacked nnx layer's arrays carry
  the stack's leading axes; nnx keys are :attr:`FrozenOp.key`."""
  if isinstance(frozen, nnx.Module):
    return {op.key: (op.layer, int(np.prod(op.stack)))
            for _, _, _, op in _nnx_hooks(frozen, FrozenOp)}
  return {k: (l, 1) for k, l in frozen["layers"].items()}


def layer_sizes(frozen, variables=None) -> dict:
  """Bytes per frozen layer, against float32 (and model totals when ``variables`` is given).

  Args:
    frozen: :func:`freeze`'s result (linen dict or frozen nnx model).
    variables: linen only: the trained variables.

  Returns:
    ``{key: {"qtype", "act", "float32_bytes", "frozen_bytes", "weight_bytes", "ratio"}}``
    and, with the trained ``variables``, ``"__model__"``: float32 bytes of all
    variables vs the frozen model's bytes (frozen layers + remaining variables).
  """
  out = {}
  for key, (l, n_layers) in _frozen_layers(frozen).items():
    nw = int(np.prod(l.kernel_shape)) * n_layers
    extra = [l.bias, l.scale_a, l.bias_a]
    fp32 = 4 * nw + sum(4 * int(np.prod(np.shape(e))) for e in extra if e is not None)
    fb = sum(_nbytes(getattr(l, f)) for f in _ARRAY_FIELDS)
    out[key] = {"qtype": l.w_qtype, "act": (l.act_dict or {}).get("qtype"),
                "float32_bytes": fp32, "frozen_bytes": fb, "weight_bytes": _nbytes(l.words),
                "ratio": fp32 / max(fb, 1)}
  if variables is not None:
    if isinstance(frozen, nnx.Module):
      raise ValueError("layer_sizes(frozen, variables): variables= is for linen; a frozen nnx "
                       "model holds its own state")
    if "params" not in variables:
      variables = {"params": variables}
    f32 = sum(4 * int(np.prod(np.shape(x))) for x in jax.tree.leaves(variables))
    fz = _tree_nbytes(frozen["variables"]) + sum(v["frozen_bytes"] for v in out.values())
    out["__model__"] = {"float32_bytes": f32, "frozen_bytes": fz, "ratio": f32 / max(fz, 1)}
  return out


def _esc(path: str) -> str:
  return "layer:" + path.replace("/", "|")


def save_frozen(directory: str, frozen, *, force: bool = False) -> None:
  """Saves a frozen model with orbax: arrays (StandardSave) + layer metadata (JSON).

  ``frozen``: :func:`freeze`'s linen dict, or a frozen nnx model (its state,
  and where each frozen op and placeholder sits).
  """
  import orbax.checkpoint as ocp

  if isinstance(frozen, nnx.Module):
    ops = _nnx_hooks(frozen, FrozenOp)
    state = nnx.to_pure_dict(nnx.state(frozen))
    meta = {"format": _FORMAT, "nnx": [
        {"owner": owner, "attr": attr, "path": op.path, "op_name": op.op_name,
         "op_id": op.op_id, "stack": list(op.stack), "layer": op.layer.meta()}
        for owner, _, attr, op in ops]}
    arrays = {"state": state}
  else:
    arrays = {"layers": {_esc(p): {f: getattr(l, f) for f in _ARRAY_FIELDS
                                   if getattr(l, f) is not None}
                         for p, l in frozen["layers"].items()},
              "variables": frozen["variables"]}
    meta = {"layers": {p: l.meta() for p, l in frozen["layers"].items()}, "format": _FORMAT}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
    ck.save(directory, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                               meta=ocp.args.JsonSave(meta)), force=force)


def _legacy_meta(m: dict) -> dict:
  """Format 1 (dense (K, N) / conv HWIO layers only) -> the current metadata."""
  m = dict(m)
  nd = len(m["kernel_shape"])
  if m["kind"] == "dense":
    m["kind"], m["layout"] = "dot", [[0], []]
  else:
    m["layout"] = [nd - 1, nd - 2] + list(range(nd - 2))
  if m["act"] is not None:
    m["act"] = {**m["act"], "tile_size": None,
                "scale": "given" if "scale_a" in m["present"] else None}
  return m


def load_frozen(directory: str, model=None):
  """Loads what :func:`save_frozen` wrote.

  Args:
    directory: the checkpoint directory.
    model: nnx only: the float model of the same architecture (e.g. built
      under ``nnx.eval_shape``, so its float weights are never allocated):
      the frozen ops and placeholders are put in a copy of it and its state
      is restored. linen: None.

  Returns:
    linen: the ``{"layers", "variables"}`` dict (arrays as jax arrays on the
    default device); nnx: the frozen nnx model.
  """
  import orbax.checkpoint as ocp

  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
    r = ck.restore(directory, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(),
                                                      meta=ocp.args.JsonRestore()))
  arrays, meta = r["arrays"], r["meta"]
  if "nnx" in meta:
    if model is None or not isinstance(model, nnx.Module):
      raise ValueError("load_frozen: this checkpoint holds a frozen nnx model: pass model=, the "
                       "float nnx model of the same architecture (e.g. built in nnx.eval_shape)")
    return _load_nnx(model, meta["nnx"], arrays["state"])
  if model is not None:
    raise ValueError("load_frozen: model= is for frozen nnx models; this checkpoint is linen")
  legacy = meta.get("format") == "qtrain.freeze/1"
  layers = {}
  for p, m in meta["layers"].items():
    if legacy:
      m = _legacy_meta(m)
    a = {f: jnp.asarray(v) for f, v in arrays["layers"][_esc(p)].items()}
    layers[p] = FrozenLayer.from_meta(m, a)
  variables = jax.tree.map(jnp.asarray, arrays.get("variables", {}))
  return {"layers": layers, "variables": variables}


def _load_nnx(model, ops_meta, state):
  frozen = nnx.clone(model)
  if any(m.get("op_id") is not None for m in ops_meta):  # direct calls: their modules in frames
    model_lib.reframe_direct_calls(frozen, FROZEN_DIRECT_CALLS, _frozen_site)
  nodes = {"/".join(str(p) for p in path): node for path, node in nnx.iter_graph(frozen)
           if isinstance(node, nnx.Module)}
  for m in ops_meta:
    node = nodes.get(m["owner"])
    if node is None:
      raise ValueError(f"load_frozen: the model has no module {m['owner']!r} (the checkpoint "
                       "was saved from another architecture)")
    lm = m["layer"]
    sub = state
    for part in (m["owner"].split("/") if m["owner"] else []):
      sub = sub[part]
    saved = sub[m["attr"]]
    arrays = {f: jnp.asarray(v) for f, v in saved.items() if f in _ARRAY_FIELDS}
    layer = FrozenLayer.from_meta(lm, arrays)
    adapter = None
    if layer.lora is not None:  # stand-ins of the saved shapes; the state restore fills them
      adapter = (model_lib.LoraA(jnp.zeros(np.shape(saved[lora_ops.A_NAME]), jnp.float32)),
                 model_lib.LoraB(jnp.zeros(np.shape(saved[lora_ops.B_NAME]), jnp.float32)),
                 nnx.RngStream(jax.random.key(0), tag=provider_lib.DROPOUT_STREAM)
                 if "lora_dropout_rng" in saved else None)
    setattr(node, m["attr"], _data(FrozenOp(layer, path=m["path"], op_name=m["op_name"],
                                            adapter=adapter, op_id=m.get("op_id"),
                                            stack=tuple(m.get("stack", ())))))
    setattr(node, layer.param, _static(Placeholder(layer.kernel_shape, layer.param_dtype)))
  graphdef, abstract = nnx.split(frozen)
  nnx.replace_by_pure_dict(abstract, jax.tree.map(jnp.asarray, state))
  return nnx.merge(graphdef, abstract)
