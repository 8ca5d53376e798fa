"""qwix's quantized-training and PTQ API on qtrain: a qwix QT or PTQ script runs with one
changed import.

::

  import qwix                      # before
  from qtrain import qwix          # after

The rules keep qwix's fields and defaults (:class:`QuantizationRule`, :class:`QtRule`: an empty
``op_names`` means every op, ``act_calibration_method=None`` means ``absmax``, calibration
strings with arguments such as ``"absmax,0.9"`` or ``"fixed,-4,4"``), the provider draws
stochastic-rounding keys from qwix's RNG stream (``"stochastic_rounding"``) and has
:meth:`QtProvider.get_unused_rules`. Each rule becomes a :class:`qtrain.QtRule` once, in
:func:`to_qtrain_rule`; what qtrain cannot honour raises there, naming the field. Where qtrain
deliberately differs (it raises where qwix leaves an op float, its activation static scale is
one per tensor, ...) ``docs/migration-from-qwix.md`` lists it.

PTQ (:class:`PtqProvider`, :func:`quantize_params`) freezes each quantized op's weight with
:mod:`qtrain.freeze`: the QT op's own codes of the same weights, stored packed, run on the
packed GPU kernels.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from qtrain import qwix
  >>> rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8,
  ...                      bwd_qtype=jnp.int8, bwd_stochastic_rounding="uniform",
  ...                      weight_calibration_method="absmax,0.95")]
  >>> provider = qwix.QtProvider(rules)
  >>> model = qwix.quantize_model(nn.Dense(4), provider)
  >>> x = jnp.ones((2, 8))
  >>> params = model.init(jax.random.key(0), x)
  >>> g = jax.grad(lambda p: model.apply(p, x, rngs={"stochastic_rounding": jax.random.key(1)}
  ...                                    ).sum())(params)
  >>> provider.get_unused_rules()
  []
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax import nnx

from qtrain import freeze as freeze_lib
from qtrain import provider as provider_lib
from qtrain import rules as rules_lib
from qtrain import _frozen
from qtrain._frozen import FrozenLayer
from qtrain.flax import model as model_lib

__all__ = ["QuantizationRule", "QtRule", "QtProvider", "PtqProvider", "PtqModel", "QuantStat",
           "quantize_model", "quantize_params", "process_prequantized_params",
           "restore_quantization_rules", "to_qtrain_rule", "RNG_STREAM", "FROZEN_KEY"]

# qwix's nnx variable type of calibration state: ``nnx.state(model, qwix.QuantStat)`` selects a
# QT model's static-scale state (qtrain's layout, not qwix's ``sum_of_absmax`` / ``count``).
QuantStat = model_lib.QuantStat

RNG_STREAM = "stochastic_rounding"  # qwix's stream for stochastic-rounding keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
  """qwix's ``QuantizationRule``: its fields and defaults.

  Attributes:
    module_path: regex, ``re.fullmatch``-ed against the module path.
    op_names: the ops the rule applies to; empty (the default): every op.
    weight_qtype: the weight's qtype; None leaves the op float (as in qwix, whatever
      ``act_qtype`` says).
    act_qtype: the activation's qtype.
    tile_size: an int tile along the contraction (qwix's float form, a fraction of the axis,
      raises: give the tile in elements).
    act_static_scale: keep a calibrated activation scale in ``quant_stats`` (None: no).
    weight_calibration_method, act_calibration_method: ``"<method>[,<args>]"``
      (see :func:`qtrain.core.qarray.as_calibration`); ``act_calibration_method=None``
      means ``"absmax"``.
    act_batch_axes: only the default ``(0,)``: qtrain's static activation scale is one per
      tensor.
  """

  module_path: str = ".*"
  op_names: Collection[str] = ()
  weight_qtype: Any = None
  act_qtype: Any = None
  tile_size: int | float | None = None
  act_static_scale: bool | None = None
  weight_calibration_method: str = "absmax"
  act_calibration_method: str | None = None
  act_batch_axes: Collection[int] = (0,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QtRule(QuantizationRule):
  """qwix's ``QtRule``: a :class:`QuantizationRule` with the backward's settings.

  Attributes:
    bwd_qtype: the gradient's qtype in both backward products.
    bwd_calibration_method: the gradient's calibration.
    bwd_weight_grad_tile_size: not supported (raises when set).
    disable_channelwise_axes: one scale per tensor (per tile with ``tile_size``).
    bwd_stochastic_rounding: ``"uniform"`` or ``"low_bit_uniform"`` (qtrain's
      ``"low_bit_hash"`` too).
    channelwise_noise_axes: accepted, any value: qtrain draws one noise value per element,
      never broadcasts it over axes (qwix's default draws it along axis 0 only).
    additional_qt_config: not supported (raises when set): qtrain's op configs differ from
      qwix's.
  """

  bwd_qtype: Any = None
  bwd_calibration_method: str = "absmax"
  bwd_weight_grad_tile_size: int | float | None = None
  disable_channelwise_axes: bool = False
  bwd_stochastic_rounding: str | None = None
  channelwise_noise_axes: Sequence[int] = (0,)
  additional_qt_config: Mapping[str, Any] | None = None


def to_qtrain_rule(rule: QuantizationRule | rules_lib.QtRule) -> rules_lib.QtRule:
  """The :class:`qtrain.QtRule` doing what ``rule`` asks of qwix (a qtrain rule passes through).

  Raises:
    ValueError: for a field qtrain cannot honour, naming it and what would work.
  """
  if isinstance(rule, rules_lib.QtRule):
    return rule
  if not isinstance(rule, QuantizationRule):
    raise ValueError(f"expected a qwix QuantizationRule / QtRule (qtrain.qwix) or a "
                     f"qtrain.QtRule, got a {type(rule).__name__}")
  bad = []
  if isinstance(rule.tile_size, float):
    bad.append(f"tile_size={rule.tile_size!r}: a tile as a fraction of the axis is not supported; "
               "give the tile size in elements (an int)")
  if tuple(rule.act_batch_axes) != (0,):
    bad.append(f"act_batch_axes={tuple(rule.act_batch_axes)!r}: qtrain's static activation "
               "scale is one per tensor; only the default (0,) is accepted")
  qt = rule if isinstance(rule, QtRule) else None
  if qt is not None and qt.bwd_weight_grad_tile_size is not None:
    bad.append(f"bwd_weight_grad_tile_size={qt.bwd_weight_grad_tile_size!r}: not supported "
               "(the weight gradient's products are per channel); leave it None")
  if qt is not None and qt.additional_qt_config is not None:
    bad.append("additional_qt_config: qwix's op-config overrides have no qtrain counterpart; "
               "leave it None and set the rule's fields (qtrain.QtRule has more of them)")
  if bad:
    raise ValueError(f"qwix rule (module_path={rule.module_path!r}): " + "; ".join(bad))
  op_names = tuple(rule.op_names) or None
  if rule.weight_qtype is None:  # qwix quantizes nothing in an op without a weight qtype
    return rules_lib.QtRule(module_path=rule.module_path, op_names=op_names)
  return rules_lib.QtRule(
      module_path=rule.module_path,
      op_names=op_names,
      weight_qtype=rule.weight_qtype,
      act_qtype=rule.act_qtype,
      tile_size=rule.tile_size,
      act_static_scale=bool(rule.act_static_scale),
      weight_calibration_method=rule.weight_calibration_method,
      act_calibration_method=rule.act_calibration_method or "absmax",
      bwd_qtype=qt.bwd_qtype if qt else None,
      bwd_calibration_method=qt.bwd_calibration_method if qt else "absmax",
      disable_channelwise_axes=qt.disable_channelwise_axes if qt else False,
      bwd_stochastic_rounding=qt.bwd_stochastic_rounding if qt else None,
  )


class QtProvider(provider_lib.QtProvider):
  """qwix's ``QtProvider``: qwix rules, qwix's RNG stream, :meth:`get_unused_rules`.

  Args:
    rules: qwix rules (:class:`QuantizationRule` / :class:`QtRule`; a ``qtrain.QtRule``
      is taken as it is), first match wins.
    rng_stream: the RNG stream of stochastic-rounding keys (qwix's ``"stochastic_rounding"``).
  """

  def __init__(self, rules: Sequence[QuantizationRule], *, rng_stream: str = RNG_STREAM):
    if isinstance(rules, (QuantizationRule, rules_lib.QtRule)):
      rules = [rules]
    self.qwix_rules = tuple(rules)
    converted = []
    for i, r in enumerate(self.qwix_rules):
      try:
        converted.append(to_qtrain_rule(r))
      except ValueError as e:
        raise ValueError(f"rules[{i}]: {e}") from None
    super().__init__(converted, rng_stream=rng_stream)

  def __repr__(self):
    return f"qtrain.qwix.QtProvider({len(self.rules)} rules, rng_stream={self.rng_stream!r})"

  def get_unused_rules(self) -> list[QuantizationRule]:
    """The rules (as given) that matched no op of the model.

    Raises:
      ValueError: before the quantized model has run (linen: ``init`` or ``apply``; nnx:
        ``quantize_model`` with a sample batch), when its ops are not known yet.
    """
    if not self.rules_checked:
      raise ValueError("the quantized model has not run yet: call init/apply (linen) or "
                       "quantize_model with a sample batch (nnx) before get_unused_rules")
    return [self.qwix_rules[i] for i, _ in self.unused_rules()]


# ----------------------------------------------------------------------------
# PTQ: weights quantized once for serving, on qtrain.freeze.

FROZEN_KEY = "qtrain_frozen"  # where a PTQ params tree keeps its frozen layers


class PtqProvider:
  """qwix's ``PtqProvider``: weights quantized once, inputs quantized per call, as the rules say.

  Built on :mod:`qtrain.freeze`: each quantized op's weight is stored packed with its scales
  (the codes the QT op computes from the same weight, so a PTQ model predicts what the QT
  model's forward predicts) and runs through qtrain's packed kernels on a GPU
  (``implementation``, see :func:`qtrain.freeze.apply_frozen`).

  Args:
    rules: qwix rules, as for :class:`QtProvider` (the backward's fields are not used).
    implementation: the frozen products' implementation (``"auto"``, ``"xla"``, ``"triton"``,
      ``"interpret"``, ``"mosaic"``).
  """

  def __init__(self, rules: Sequence[QuantizationRule], *, implementation: str = "auto"):
    self.qt = QtProvider(rules)
    self.implementation = _frozen.check_implementation(implementation)

  @property
  def rules(self) -> tuple[rules_lib.QtRule, ...]:
    return tuple(self.qt.rules)

  def __repr__(self):
    return (f"qtrain.qwix.PtqProvider({len(self.rules)} rules, "
            f"implementation={self.implementation!r})")


@jax.tree_util.register_pytree_with_keys_class
class _FrozenLayers:
  """A PTQ params tree's frozen layers; the provider that froze them rides along as static
  data, so that :func:`quantize_params` can rebuild them from an abstract tree alone."""

  def __init__(self, layers: Mapping[str, FrozenLayer], provider: PtqProvider):
    self.layers = dict(layers)
    self.provider = provider

  def tree_flatten_with_keys(self):
    keys = sorted(self.layers)
    return [(jax.tree_util.DictKey(k), self.layers[k]) for k in keys], (tuple(keys), self.provider)

  @classmethod
  def tree_unflatten(cls, aux, children):
    keys, provider = aux
    return cls(dict(zip(keys, children)), provider)

  def __repr__(self):
    return f"FrozenLayers({sorted(self.layers)})"


class PtqModel:
  """A linen model served from quantized weights (:func:`quantize_model` with a
  :class:`PtqProvider`): ``init`` and ``apply`` as a linen module's.

  ``init`` returns the variables with every quantized op's weight frozen: ``params`` holds the
  float parameters left (biases, norms, float layers) and, under :data:`FROZEN_KEY`, the frozen
  layers; ``jax.eval_shape(ptq_model.init, key, x)`` gives the template that
  :func:`quantize_params` fills from trained float parameters. A rule's static activation
  scale is a calibrated one here (pass the QT model's ``quant_stats`` to
  :func:`quantize_params`).
  """

  def __init__(self, model, provider: PtqProvider):
    self.model = model
    self.provider = provider

  def __repr__(self):
    return f"PtqModel({type(self.model).__name__}, {self.provider!r})"

  def init(self, rngs, *args, method=None, **kwargs) -> dict:
    qt_model = model_lib.quantize_model(self.model, self.provider.qt)
    variables = qt_model.init(rngs, *args, method=method, **kwargs)
    if not self.provider.qt.records():  # no op to quantize (rules' warning given): all float
      return _ptq_variables({"layers": {}, "variables": dict(variables)}, self.provider)
    return _ptq_variables(freeze_lib._freeze_records(dict(variables), self.provider.qt,
                                                     static="given"), self.provider)

  def apply(self, variables: Mapping, *args, method=None, **kwargs):
    return freeze_lib.apply_frozen(self.model, _frozen_of(variables), *args,
                                   implementation=self.provider.implementation, method=method,
                                   **kwargs)


def _ptq_variables(frozen: Mapping, provider: PtqProvider) -> dict:
  """freeze's ``{"layers", "variables"}`` as PTQ variables: the layers inside ``params``."""
  out = dict(frozen["variables"])
  out["params"] = {**out.get("params", {}), FROZEN_KEY: _FrozenLayers(frozen["layers"], provider)}
  return out


def _frozen_of(variables: Mapping) -> dict:
  params = variables.get("params") if isinstance(variables, Mapping) else None
  if not isinstance(params, Mapping) or not isinstance(params.get(FROZEN_KEY), _FrozenLayers):
    raise ValueError(f"expected PTQ variables ({{'params': ...}} with the frozen layers under "
                     f"{FROZEN_KEY!r}: PtqModel.init's or quantize_params' output), got "
                     f"{type(variables).__name__} with keys "
                     f"{sorted(variables) if isinstance(variables, Mapping) else None}")
  rest = {k: v for k, v in params.items() if k != FROZEN_KEY}
  return {"layers": params[FROZEN_KEY].layers, "variables": {**variables, "params": rest}}


def quantize_params(params: Mapping, abstract_quantized_params, quant_stats: Mapping | None = None,
                    *, allow_extra_params: bool = False):
  """qwix's ``quantize_params``: trained float ``params`` -> PTQ params.

  Args:
    params: the float (or QT-trained) model's ``params`` (nnx: a pure dict,
      ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``). linen also takes the whole
      variables (``{"params": ...}``) with a template of whole variables.
    abstract_quantized_params: linen: the template,
      ``jax.eval_shape(ptq_model.init, key, x)["params"]`` (or ``ptq_model.init``'s own
      ``params``, or the whole variables of either). nnx: the PTQ model, ``nnx.eval_shape`` of a
      function returning
      ``quantize_model(model, PtqProvider(rules), x)``; the result is its state, for
      ``nnx.update(model, state)``. (A layer with a static or learned input scale, or a LoRA
      adapter, is frozen from the trained model with ``quantize_model`` instead: float
      params do not hold that state.)
    quant_stats: the QT model's ``quant_stats``; needed where a rule keeps a static
      activation scale (it must have been calibrated: a QT forward in training mode).
    allow_extra_params: as in qwix: params the template has no place for (a loss head the
      served method never calls, say) are dropped instead of raising.

  Returns:
    PTQ params, the template's structure, for ``ptq_model.apply({"params": ...}, x)`` (whole
    variables where whole variables were given).

  Raises:
    ValueError: the template is not a PTQ template, a static scale that was never calibrated,
      a tree that does not match the template (naming the first difference), params the template
      has no place for (naming them) without ``allow_extra_params``.
  """
  if isinstance(abstract_quantized_params, nnx.Module):
    if quant_stats is not None:
      raise ValueError("quantize_params(params, nnx model, quant_stats): static scales of an "
                       "nnx model are carried over by quantize_model(qt_model, PtqProvider(rules),"
                       " x) from the trained QT model; pass no quant_stats here")
    return _quantize_params_nnx(params, abstract_quantized_params, allow_extra_params)
  # nn.with_partitioning's boxes: a template from eval_shape(ptq_model.init) holds them; the
  # PTQ params are plain arrays, as in qwix (the boxes' names are the model's to add again).
  params, abstract_quantized_params = nn.unbox(params), nn.unbox(abstract_quantized_params)
  if _is_variables_template(abstract_quantized_params):
    return _quantize_variables(params, abstract_quantized_params, quant_stats, allow_extra_params)
  node = (abstract_quantized_params.get(FROZEN_KEY)
          if isinstance(abstract_quantized_params, Mapping) else None)
  if not isinstance(node, _FrozenLayers):
    raise ValueError(f"quantize_params: the template holds no frozen layers under {FROZEN_KEY!r}: "
                     "pass jax.eval_shape(ptq_model.init, key, x)['params'] of a model from "
                     "qtrain.qwix.quantize_model(model, PtqProvider(rules))")
  provider = node.provider
  variables = {"params": dict(params)}
  if quant_stats is not None:
    variables["quant_stats"] = quant_stats
  frozen = freeze_lib._freeze_records(variables, provider.qt, static="count")
  for key, layer in frozen["layers"].items():
    want = node.layers.get(key)
    if want is not None and want.act_dict and want.act_dict.get("scale") == "given" and (
        layer.act_dict.get("scale") == "batch"):
      raise ValueError(f"quantize_params: layer {key!r} keeps a static input scale, but "
                       "quant_stats says it was never calibrated (count 0): run the QT model in "
                       "training mode on data first, and pass its quant_stats")
  out = _ptq_variables(frozen, provider)["params"]
  extra = _extra_paths(out, abstract_quantized_params)
  if extra and not allow_extra_params:
    raise ValueError(f"quantize_params: params the template has no place for: {extra[:6]}"
                     f"{' ...' if len(extra) > 6 else ''}; pass allow_extra_params=True to drop "
                     "them (params the PTQ model never uses)")
  out = _prune(out, abstract_quantized_params)
  got_tree, want_tree = jax.tree.structure(out), jax.tree.structure(abstract_quantized_params)
  if got_tree != want_tree:
    got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(out)}
    want = {jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(abstract_quantized_params)}
    raise ValueError("quantize_params: params do not match the template: "
                     f"missing {sorted(want - got)[:4]}, unexpected {sorted(got - want)[:4]}")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out),
                          jax.tree.leaves(abstract_quantized_params)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(f"quantize_params: {jax.tree_util.keystr(path)} is {a.dtype}{a.shape}, "
                       f"the template's {b.dtype}{b.shape}")
  return out


def _is_variables_template(template) -> bool:
  """Whether ``template`` is whole PTQ variables (``{"params": {..., FROZEN_KEY: ...}, ...}``)."""
  return (isinstance(template, Mapping) and FROZEN_KEY not in template
          and isinstance(template.get("params"), Mapping) and FROZEN_KEY in template["params"])


def _quantize_variables(variables, template: Mapping, quant_stats, allow_extra_params: bool) -> dict:
  """quantize_params over whole variables: ``params`` quantized, the template's other
  collections taken from ``variables`` as they are."""
  if not isinstance(variables, Mapping) or not isinstance(variables.get("params"), Mapping):
    raise ValueError("quantize_params: the template is whole variables ({'params': ...}), so "
                     "params must be too; got "
                     f"{sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__}")
  missing = [c for c in template if c != "params" and c not in variables]
  extra = [c for c in variables if c not in template]
  if missing:
    raise ValueError(f"quantize_params: the variables lack the template's collections {missing}")
  if extra and not allow_extra_params:
    raise ValueError(f"quantize_params: collections the template has no place for: {extra}; pass "
                     "allow_extra_params=True to drop them")
  out = {c: variables[c] for c in template if c != "params"}
  out["params"] = quantize_params(variables["params"], template["params"], quant_stats,
                                  allow_extra_params=allow_extra_params)
  return out


def _extra_paths(tree: Mapping, template: Mapping, prefix: str = "") -> list[str]:
  """The '/'-joined paths of ``tree``'s entries that ``template`` has no key for."""
  out = []
  for k, v in tree.items():
    if k == FROZEN_KEY:
      continue
    if k not in template:
      out.append(f"{prefix}{k}")
    elif isinstance(v, Mapping) and isinstance(template[k], Mapping):
      out += _extra_paths(v, template[k], f"{prefix}{k}/")
  return out


def _prune(tree: Mapping, template: Mapping) -> dict:
  """``tree`` without the entries ``template`` has no key for."""
  return {k: (_prune(v, template[k]) if k != FROZEN_KEY and isinstance(v, Mapping)
              and isinstance(template[k], Mapping) else v)
          for k, v in tree.items() if k in template}


def _lookup(tree, path: tuple, what: str):
  node = tree
  for part in path:
    if isinstance(node, Mapping):
      key = part if part in node else (int(part) if str(part).isdigit() and int(part) in node
                                       else None)
      if key is not None:
        node = node[key]
        continue
    raise ValueError(f"quantize_params: params hold no {'/'.join(map(str, path))!r} ({what}); "
                     "pass the float model's nnx.to_pure_dict(nnx.state(model, nnx.Param))")
  return node


def _leaf_paths(tree, prefix: tuple = ()) -> list[tuple[str, ...]]:
  if not isinstance(tree, Mapping):
    return [prefix]
  return [p for k, v in tree.items() for p in _leaf_paths(v, prefix + (str(k),))]


def _quantize_params_nnx(params: Mapping, model, allow_extra_params: bool = False) -> nnx.State:
  """The state of the PTQ nnx ``model`` (abstract: ``nnx.eval_shape``) filled from float
  ``params`` (a pure dict): each frozen op's weight quantized and packed as freezing does, every
  other value taken as it is. For ``nnx.update(model, state)``."""
  state = nnx.state(model)
  pure = nnx.to_pure_dict(state)
  frozen_paths = {}
  used = set()
  for path, _, attr, op in freeze_lib._nnx_hooks(model, freeze_lib.FrozenOp):
    owner = tuple(p for p in path.split("/") if p) if path else ()
    name = op.spec.param
    used.add(owner + (name,))
    kernel = _lookup(params, owner + (name,), f"the weight of {'/'.join(owner) or 'the root'!r}")
    try:
      layer = op.refreeze(kernel)
    except ValueError as e:
      raise ValueError(f"quantize_params: {e}; for such layers use quantize_model(trained_model, "
                       "PtqProvider(rules), x)") from None
    for f in _frozen.ARRAY_FIELDS:
      if getattr(layer, f) is not None:
        frozen_paths[owner + (attr, f)] = getattr(layer, f)

  def fill(node, prefix):
    if isinstance(node, Mapping):
      return {k: fill(v, prefix + (str(k),)) for k, v in node.items()}
    if prefix in frozen_paths:
      return frozen_paths[prefix]
    used.add(prefix)
    value = jnp.asarray(_lookup(params, prefix, "a parameter of the PTQ model"))
    if value.shape != node.shape:
      raise ValueError(f"quantize_params: {'/'.join(prefix)!r} has shape {value.shape}, the "
                       f"template's {node.shape}")
    return value.astype(node.dtype)

  filled = fill(pure, ())
  extra = ["/".join(p) for p in _leaf_paths(params) if p not in used]
  if extra and not allow_extra_params:
    raise ValueError(f"quantize_params: params the PTQ model has no place for: {extra[:6]}"
                     f"{' ...' if len(extra) > 6 else ''}; pass allow_extra_params=True to drop "
                     "them (params the PTQ model never uses)")
  nnx.replace_by_pure_dict(state, filled)
  return state


def _ptq_nnx(model, provider: PtqProvider, model_inputs, kwargs):
  # A QT model (qtrain's) has QtOps: its layers' (op attributes) and its modules' direct calls'
  # (kept under their op ids). It is frozen as it is, if its rules are these; freeze names the
  # direct calls it cannot take yet.
  qt_ops = [node for _, node in nnx.iter_graph(model) if isinstance(node, model_lib.QtOp)]
  if qt_ops:
    for op in qt_ops:
      if tuple(op.provider.rules) != provider.rules:
        raise ValueError(f"quantize_model(qt_model, PtqProvider): the op of {op.path!r} was "
                         "quantized with other rules than the PtqProvider's; pass the rules the "
                         "model was trained with")
    if model_inputs or kwargs:
      # Records ops that have not run yet, on a copy that does not calibrate: the model passed
      # in keeps its state, and what is frozen is that state.
      probe = nnx.clone(model)
      model_lib.set_calibrate(probe, False)
      probe(*model_inputs, **kwargs)
    frozen = freeze_lib.freeze(model)
  else:
    if not model_inputs and not kwargs:
      raise ValueError("quantize_model(nnx model, PtqProvider(rules)): pass a sample batch "
                       "(quantize_model(model, provider, x)): the ops must run once to be frozen")
    qt_model = model_lib.quantize_model(nnx.clone(model), provider.qt, *model_inputs, **kwargs)
    if not any(r.status == provider_lib.QUANTIZED for r in provider.qt.records()):
      return nnx.clone(model)  # no op quantized (the rules' warning says so): nothing to freeze
    frozen = freeze_lib.freeze(qt_model)
  for _, _, _, op in freeze_lib._nnx_hooks(frozen, freeze_lib.FrozenOp):
    op.implementation = provider.implementation
  return frozen


def quantize_model(model, provider: provider_lib.QtProvider | PtqProvider, *model_inputs: Any,
                   **kwargs: Any):
  """qwix's ``quantize_model``.

  With a :class:`QtProvider`: linen as :func:`qtrain.quantize_model`; an nnx model is copied
  first (``nnx.clone``), so the model passed in stays float, as in qwix. nnx:
  ``model_inputs`` are the sample batch of the one eager forward, and stochastic-rounding keys
  come from ``rngs=nnx.Rngs(stochastic_rounding=seed)`` (qwix's ``qwix_rngs`` attribute is not
  read).

  With a :class:`PtqProvider`: linen: a :class:`PtqModel`; nnx: a new model whose quantized
  ops run on frozen weights (:func:`qtrain.freeze.freeze`), from a float model (quantized and
  run once on ``model_inputs``; a static scale is then not calibrated, and the frozen op takes
  one per batch, as the QT op does before calibration) or from a model quantized by
  :func:`quantize_model` with a :class:`QtProvider` of the same rules (its trained state,
  calibrated static scales included, carried over). The model passed in is left as it is.

  qwix's ``methods``: linen: qtrain quantizes the ops of every method of the model, so any
  methods the model has are accepted (a name it lacks raises); nnx: ``("__call__",)`` only, as
  qwix's nnx takes one method. ``call_method`` (other than ``"__call__"``) and
  ``skip_nnx_init`` raise.
  """
  call_method = kwargs.pop("call_method", "__call__")
  if call_method != "__call__":
    raise ValueError(f"call_method={call_method!r}: qtrain intercepts the ops of every method "
                     "of the model; leave call_method at '__call__'")
  methods = kwargs.pop("methods", ("__call__",))
  methods = (methods,) if isinstance(methods, str) else tuple(methods)
  if isinstance(model, nnx.Module) and methods != ("__call__",):
    raise ValueError(f"methods={methods!r}: an nnx model is quantized through its __call__ "
                     "(its sample forward); leave methods at ('__call__',)")
  missing = [m for m in methods if not callable(getattr(model, m, None))]
  if not methods or missing:
    raise ValueError(f"methods={methods!r}: {type(model).__name__} has no method "
                     f"{missing[0] if missing else '(none given)'!r}")
  if "skip_nnx_init" in kwargs:
    raise ValueError("skip_nnx_init: qtrain's nnx quantize_model runs the sample batch only when "
                     "one is given; pass no model inputs instead")
  if isinstance(provider, PtqProvider):
    if isinstance(model, nnx.Module):
      return _ptq_nnx(model, provider, model_inputs, kwargs)
    if model_inputs or kwargs:
      raise ValueError("quantize_model(linen model, PtqProvider): a linen model takes no sample "
                       "inputs here; pass them to ptq_model.init")
    return PtqModel(model, provider)
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
  return model_lib.quantize_model(model, provider, *model_inputs, **kwargs)


# ----------------------------------------------------------------------------
# Pre-quantized checkpoints (qwix's offline quantization): a checkpoint holds, per quantized
# weight, ``{"qvalue", "scale"[, "zero_point"]}`` (optionally under an ``"array"`` key), at the
# nnx state path of the weight; every other leaf is a float array.

_PREQUANTIZED_KEYS = ("qvalue", "scale", "zero_point")


def _flatten_checkpoint(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
  """path -> leaf, a pre-quantized weight's dict being one leaf."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping) and "qvalue" not in v:
      out.update(_flatten_checkpoint(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def restore_quantization_rules(checkpoint_params: Mapping, rule_type: type = QuantizationRule, *,
                               tile_size: int | None, act_qtype: Any = "weight", **kwargs: Any
                               ) -> list[QuantizationRule]:
  """qwix's ``restore_quantization_rules``: one rule per module of a pre-quantized checkpoint.

  Each ``{"qvalue", "scale"[, "zero_point"]}`` leaf gives a rule for the module holding it: its
  path ``/``-joined, integer keys (layers of a list) as ``[^/]+``; ``weight_qtype`` the codes'
  dtype; ``weight_calibration_method`` ``"minmax"`` with a zero point, else ``"absmax"``.

  Args:
    checkpoint_params: the checkpoint's tree (nnx state paths, no ``.value``).
    rule_type: :class:`QuantizationRule` or :class:`QtRule`.
    tile_size: every rule's ``tile_size``.
    act_qtype: every rule's ``act_qtype``; by default each rule's weight qtype.
    **kwargs: further fields of every rule (``bwd_qtype=...`` for a :class:`QtRule`).

  Returns:
    The rules, one per module path. Two weights under one path with different rules (layers of a
    list quantized differently) warn; the later one is kept.
  """
  if not (isinstance(rule_type, type) and issubclass(rule_type, QuantizationRule)):
    raise ValueError(f"rule_type={rule_type!r}: valid: qtrain.qwix.QuantizationRule or "
                     "qtrain.qwix.QtRule")
  rules: dict[str, QuantizationRule] = {}
  for path, leaf in _flatten_checkpoint(checkpoint_params).items():
    if not isinstance(leaf, Mapping):
      continue
    owner = path[:-2] if path[-1] == "array" else path[:-1]  # drop (weight name[, "array"])
    module_path = "/".join("[^/]+" if isinstance(p, int) else str(p) for p in owner)
    qtype = np.asarray(leaf["qvalue"]).dtype
    rule = rule_type(module_path=module_path, weight_qtype=qtype,
                     act_qtype=qtype if isinstance(act_qtype, str) and act_qtype == "weight"
                     else act_qtype,
                     weight_calibration_method="minmax" if leaf.get("zero_point") is not None
                     else "absmax",
                     tile_size=tile_size, **kwargs)
    if module_path in rules and rules[module_path] != rule:
      warnings.warn(f"restore_quantization_rules: module path {module_path!r} has weights of "
                    f"different rules ({rules[module_path]} and {rule}); the later one is kept",
                    stacklevel=2)
    rules[module_path] = rule
  return list(rules.values())


def _concrete_sharding(sharding, path: str):
  """A template's sharding made concrete: an abstract mesh's is resolved on ``jax.set_mesh``'s."""
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.AbstractMesh):
    mesh = jax.sharding.get_mesh()
    if getattr(mesh, "empty", True) or mesh.abstract_mesh != sharding.mesh:
      raise ValueError(f"process_prequantized_params: {path!r} is sharded on an abstract mesh "
                       f"({sharding.mesh}): call it inside `with jax.set_mesh(mesh)` of that mesh")
    return jax.sharding.NamedSharding(mesh, sharding.spec)
  return sharding


def _broadcast_groups(a: jax.Array, shape: tuple[int, ...], what: str, path: str) -> jax.Array:
  """A per-group array (one value per tile of each axis) repeated to ``shape``."""
  if a.ndim != len(shape) or any(n % g for g, n in zip(a.shape, shape)):
    raise ValueError(f"process_prequantized_params: {path!r}: {what} of shape {a.shape} does not "
                     f"tile qvalue's shape {shape} (each axis must divide qvalue's)")
  for ax, (g, n) in enumerate(zip(a.shape, shape)):
    if g not in (1, n):
      a = jnp.repeat(a, n // g, axis=ax)
  return a


def _dequantize_leaf(leaf: Mapping, path: str) -> jax.Array:
  missing = [k for k in ("qvalue", "scale") if k not in leaf]
  unsupported = sorted(set(leaf) - set(_PREQUANTIZED_KEYS))
  if missing or unsupported:
    raise ValueError(f"process_prequantized_params: {path!r}: a pre-quantized weight holds "
                     f"{list(_PREQUANTIZED_KEYS)} (zero_point optional); "
                     + (f"missing {missing}" if missing else f"unsupported keys {unsupported}"))
  q = jnp.asarray(leaf["qvalue"])
  x = q.astype(jnp.float32)
  if leaf.get("zero_point") is not None:
    x = x - _broadcast_groups(jnp.asarray(leaf["zero_point"], jnp.float32), q.shape,
                              "zero_point", path)
  return x * _broadcast_groups(jnp.asarray(leaf["scale"], jnp.float32), q.shape, "scale", path)


def process_prequantized_params(checkpoint_params: Mapping, template_params, *,
                                allow_extra_params: bool = False) -> dict:
  """qwix's ``process_prequantized_params`` for float and QT nnx models: a pre-quantized
  checkpoint dequantized into the model's float parameters, for ``nnx.update``.

  A ``{"qvalue", "scale"[, "zero_point"]}`` leaf (under its weight's path, optionally under
  ``"array"``) becomes ``(qvalue - zero_point) * scale`` (``scale`` and ``zero_point`` one value
  per tile of each axis, repeated over the tile); a float leaf is taken as it is. Each result
  has the template parameter's dtype and sharding (an abstract mesh's on the mesh of
  ``jax.set_mesh``). Fine-tuning a QT model from a checkpoint quantized elsewhere starts here.

  Args:
    checkpoint_params: the checkpoint's tree (nnx state paths, no ``.value``).
    template_params: the nnx model (a float or :class:`QtProvider`-quantized one), possibly
      abstract (``nnx.eval_shape``).
    allow_extra_params: drop checkpoint leaves the model has no parameter for (else they raise).

  Returns:
    A pure dict of the model's paths that the checkpoint holds.

  Raises:
    TypeError: the template is not an nnx model.
    ValueError: a leaf the model has no parameter for, a malformed pre-quantized leaf, a shape
      other than the parameter's, a float leaf for a frozen (PTQ) weight, or a PTQ template: a
      qtrain PTQ model keeps qtrain's packed layout, not qwix's ``qvalue`` / ``scale``.
  """
  if not isinstance(template_params, nnx.Module):
    raise TypeError("process_prequantized_params takes NNX models (an nnx.Module, possibly from "
                    f"nnx.eval_shape); got {type(template_params).__name__}")
  if freeze_lib._nnx_hooks(template_params, freeze_lib.FrozenOp):
    raise ValueError("process_prequantized_params: the template is a PTQ model (frozen ops): "
                     "qtrain's PTQ state is its packed layout, not qwix's qvalue / scale; load "
                     "the checkpoint into the float (or QT) model, then freeze it with "
                     "qwix.quantize_model(model, qwix.PtqProvider(rules), x)")
  params = dict(nnx.to_flat_state(nnx.state(template_params, nnx.Param)))
  out: dict = {}
  for path, leaf in _flatten_checkpoint(checkpoint_params).items():
    if path and path[-1] == "array" and isinstance(leaf, Mapping):
      path = path[:-1]
    name = "/".join(map(str, path))
    var = params.get(path)
    if var is None:
      if allow_extra_params:
        continue
      raise ValueError(f"process_prequantized_params: the model has no parameter {name!r} "
                       "(extra in the checkpoint); pass allow_extra_params=True to drop it")
    want = var.get_value()
    value = _dequantize_leaf(leaf, name) if isinstance(leaf, Mapping) else jnp.asarray(leaf)
    if tuple(value.shape) != tuple(want.shape):
      raise ValueError(f"process_prequantized_params: {name!r} has shape {tuple(value.shape)}, "
                       f"the model's parameter {tuple(want.shape)}")
    value = value.astype(want.dtype)
    sharding = _concrete_sharding(getattr(want, "sharding", None), name)
    if sharding is not None:
      value = jax.device_put(value, sharding)
    node = out
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = value
  return out
