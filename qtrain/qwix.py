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

PTQ (:class:`PtqProvider`, :func:`quantize_params`) quantizes each quantized op's weight as
:mod:`qtrain.freeze` does (the QT op's own codes of the same weights) and keeps it in qwix's
params layout, a :class:`WithAux` of a :class:`QArray` ``(qvalue, scale[, zero_point])``; each
call rebuilds qtrain's frozen layer from it (no re-quantization) for the frozen product. Static
activation scales keep qwix's statistics (``quant_stats/<path>/<op id>_lhs/{count,
sum_of_absmax}``).

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
import functools
import threading
import warnings
from typing import Any, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax import nnx
from flax.linen import module as _linen_module

from qtrain import freeze as freeze_lib
from qtrain import provider as provider_lib
from qtrain import rules as rules_lib
from qtrain import sparsity as sparsity_lib
from qtrain import _frozen
from qtrain._qwix import layout
from qtrain.core import qarray, qtypes
from qtrain._frozen import FrozenLayer
from qtrain.flax import hosts
from qtrain.flax import intercept as _intercept
from qtrain.flax import model as model_lib

__all__ = ["QuantizationRule", "QtRule", "QtProvider", "PtqProvider", "PtqModel", "QuantStat",
           "quantize_model", "quantize_params", "process_prequantized_params",
           "restore_quantization_rules", "to_qtrain_rule", "RNG_STREAM", "WithAux", "QArray", "dequantize",
           "PtqOp", "SparsityRule"]

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
    tile_size: an int tile along the contraction, a float (a fraction of it, ``1 / tile
      count``), or per-axis tiles ``{axis: tile}`` (2-D scales; see ``qtrain.QtRule``).
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
    bwd_weight_grad_tile_size: the incoming gradient's tile in the weight gradient's product
      (``qtrain.QtRule.bwd_weight_grad_tile_size``).
    disable_channelwise_axes: one scale per tensor (per tile with ``tile_size``).
    bwd_stochastic_rounding: ``"uniform"`` or ``"low_bit_uniform"`` (qtrain's
      ``"low_bit_hash"`` too).
    channelwise_noise_axes: accepted, any value: qtrain draws one noise value per element,
      never broadcasts it over axes (qwix's default draws it along axis 0 only).
    additional_qt_config: qwix's per-product overrides; the tiles (``tile_size``,
      ``dlhs_tile_size``, ``drhs_tile_size``) and gradient qtypes / calibrations equal for both
      products map (read with the weight as the second operand: ``dlhs`` is the input's
      gradient), and ``sparsity_rule`` (a :class:`SparsityRule`: N:M sparsity of the weight);
      any other key raises naming it.
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
  if tuple(rule.act_batch_axes) != (0,):
    bad.append(f"act_batch_axes={tuple(rule.act_batch_axes)!r}: qtrain's static activation "
               "scale is one per tensor; only the default (0,) is accepted")
  qt = rule if isinstance(rule, QtRule) else None
  extra = _additional_qt_config(qt, bad) if qt is not None else {}
  if bad:
    raise ValueError(f"qwix rule (module_path={rule.module_path!r}): " + "; ".join(bad))
  op_names = tuple(rule.op_names) or None
  bwd_q = extra.get("bwd_qtype", qt.bwd_qtype if qt else None)
  w_tile = extra.get("bwd_weight_grad_tile_size", qt.bwd_weight_grad_tile_size if qt else None)
  a_tile = extra.get("bwd_act_grad_tile_size")
  if bwd_q is None:  # qwix reads a gradient's tile only where that gradient is quantized
    w_tile = a_tile = None
  if rule.weight_qtype is None:  # qwix quantizes nothing in an op without a weight qtype
    return rules_lib.QtRule(module_path=rule.module_path, op_names=op_names)
  return rules_lib.QtRule(
      module_path=rule.module_path,
      op_names=op_names,
      weight_qtype=rule.weight_qtype,
      act_qtype=rule.act_qtype,
      tile_size=extra.get("tile_size", rule.tile_size),
      act_static_scale=bool(rule.act_static_scale),
      weight_calibration_method=rule.weight_calibration_method,
      act_calibration_method=rule.act_calibration_method or "absmax",
      bwd_qtype=bwd_q,
      bwd_calibration_method=qt.bwd_calibration_method if qt else "absmax",
      bwd_weight_grad_tile_size=w_tile,
      bwd_act_grad_tile_size=a_tile,
      disable_channelwise_axes=qt.disable_channelwise_axes if qt else False,
      bwd_stochastic_rounding=qt.bwd_stochastic_rounding if qt else None,
      weight_sparsity=extra.get("weight_sparsity"),
  )


# qwix's DotGeneralQtConfig fields that additional_qt_config may override and qtrain maps: the
# per-product gradient qtypes (each must equal the other's, as qtrain.QtRule's bwd_qtype is
# both products'), the tiles (forward; each backward product's incoming gradient) and the
# gradient calibration where it is the rule's. Read with the weight as the second operand
# (x @ W: nnx.Linear, linen Dense / DenseGeneral, Einsum('...k,kn')): dlhs is the input's
# gradient, drhs the weight's.
_QT_CONFIG_KEYS = ("tile_size", "dlhs_grad_qtype", "drhs_grad_qtype", "dlhs_tile_size",
                   "drhs_tile_size", "dlhs_grad_calibration_method",
                   "drhs_grad_calibration_method", "sparsity_rule")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsityRule:
  """qwix's ``SparsityRule`` (its fields and defaults), for
  ``QtRule(additional_qt_config={"sparsity_rule": SparsityRule(...)})``: N:M sparsity of the
  weight (the op's second operand in qwix: every Flax layer's kernel), pruned before it is
  quantized, which :func:`to_qtrain_rule` maps onto ``qtrain.QtRule(weight_sparsity=
  qtrain.sparsity.Sparsity(n, m, order, block_size, offset))``.

  qwix's QtProvider applies the ``weight_sparsity_{n, m, order, block_size, offset}`` fields
  only, on every step; so does qtrain. The others raise where set (qwix's QT ignores them; its
  separate ``SparsityModule`` reads them): ``weight_sparsity_start_step`` /
  ``weight_sparsity_update_step`` (a schedule) and ``eval_mode``, and ``activation_sparsity_*``
  (qtrain's own ``QtRule(act_sparsity=...)`` prunes the activation). ``weight_sparsity_m=0``
  means no sparsity.
  """

  weight_sparsity_n: int = 0
  weight_sparsity_m: int = 0
  weight_sparsity_order: str = "R"
  weight_sparsity_block_size: int = 0
  weight_sparsity_offset: int = 0
  weight_sparsity_start_step: int = 0
  weight_sparsity_update_step: int = 1
  eval_mode: bool = False
  activation_sparsity_n: int = 0
  activation_sparsity_m: int = 0
  activation_sparsity_order: str = "R"
  activation_sparsity_block_size: int = 0
  activation_sparsity_offset: int = 0


def _weight_sparsity(rule, bad: list):
  """The qtrain Sparsity of a qwix SparsityRule (None for m = 0), appending to ``bad`` what
  qtrain does not map, naming the field."""
  if not isinstance(rule, SparsityRule):
    bad.append(f"additional_qt_config['sparsity_rule']={rule!r}: expected a "
               "qtrain.qwix.SparsityRule")
    return None
  for f, default, why in (
      ("weight_sparsity_start_step", 0, "a sparsity schedule"),
      ("weight_sparsity_update_step", 1, "a sparsity schedule"),
      ("eval_mode", False, "an evaluation switch"),
      ("activation_sparsity_n", 0, "activation sparsity"),
      ("activation_sparsity_m", 0, "activation sparsity")):
    if getattr(rule, f) != default:
      bad.append(f"sparsity_rule.{f}={getattr(rule, f)!r}: {why} is not applied by qwix's "
                 "QtProvider (only its SparsityModule reads it) and not mapped; leave it at "
                 f"{default!r}" + (" (qtrain.QtRule(act_sparsity=(n, m)) prunes activations)"
                                   if f.startswith("activation") else ""))
  if rule.weight_sparsity_m == 0:
    return None
  try:
    return sparsity_lib.Sparsity(n=rule.weight_sparsity_n, m=rule.weight_sparsity_m,
                                 order=rule.weight_sparsity_order,
                                 block_size=rule.weight_sparsity_block_size,
                                 offset=rule.weight_sparsity_offset)
  except ValueError as e:
    bad.append(f"sparsity_rule: {str(e).removeprefix('Invalid Sparsity: ')}")
    return None


def _additional_qt_config(qt: "QtRule", bad: list) -> dict:
  """The qtrain.QtRule fields ``qt.additional_qt_config`` sets (appending to ``bad`` what it
  cannot map, naming the key)."""
  cfg = qt.additional_qt_config
  if cfg is None:
    return {}
  if not isinstance(cfg, Mapping):
    bad.append(f"additional_qt_config={cfg!r} must be a mapping of DotGeneralQtConfig fields")
    return {}
  out: dict = {}
  for k in cfg:
    if k not in _QT_CONFIG_KEYS:
      bad.append(f"additional_qt_config[{k!r}]: not supported (qtrain maps "
                 f"{', '.join(_QT_CONFIG_KEYS)}; the residuals are always the forward's "
                 "quantized operands)")
  if "tile_size" in cfg:
    out["tile_size"] = cfg["tile_size"]
  qtypes_ = {k: cfg[k] for k in ("dlhs_grad_qtype", "drhs_grad_qtype") if k in cfg}
  if qtypes_:
    names = {k: (None if v is None else qtypes.get_qtype(v).name) for k, v in qtypes_.items()}
    rule_q = None if qt.bwd_qtype is None else qtypes.get_qtype(qt.bwd_qtype).name
    both = {names.get(k, rule_q) for k in ("dlhs_grad_qtype", "drhs_grad_qtype")}
    if len(both) > 1:
      bad.append(f"additional_qt_config {qtypes_!r}: the two backward products with different "
                 f"gradient qtypes ({sorted(map(str, both))}) are not supported; qtrain's "
                 "bwd_qtype quantizes both")
    else:
      out["bwd_qtype"] = both.pop()
  for k in ("dlhs_grad_calibration_method", "drhs_grad_calibration_method"):
    if k in cfg and cfg[k] != qt.bwd_calibration_method:
      bad.append(f"additional_qt_config[{k!r}]={cfg[k]!r}: a per-product gradient calibration "
                 f"is not supported; set bwd_calibration_method (it is "
                 f"{qt.bwd_calibration_method!r})")
  if cfg.get("sparsity_rule") is not None:
    out["weight_sparsity"] = _weight_sparsity(cfg["sparsity_rule"], bad)
  if "dlhs_tile_size" in cfg:
    out["bwd_act_grad_tile_size"] = cfg["dlhs_tile_size"]
  if "drhs_tile_size" in cfg:
    out["bwd_weight_grad_tile_size"] = cfg["drhs_tile_size"]
  return out


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
    self._side = threading.local()  # which operand the running op's activation is

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

  # ------------------------------------------------------------------ static activation scales
  # qwix's layout and meaning: the statistics of the input of op ``<op id>`` (``lhs`` where the
  # weight is the second operand) are ``quant_stats/<module path>/<op id>_lhs`` =
  # ``{"count": int32, "sum_of_absmax": float32 (1,) * ndim}``: the number of calibration batches
  # and the sum of each batch's calibrated bound (the absmax of each token's values, or ``rms``
  # times its factor, ..., averaged over the tokens). The scale is ``sum / count / qmax``; before
  # any calibration batch, each batch's own. nnx keeps them as a ``QuantStat`` on the layer.

  stats_on_owner = True  # nnx: statistics on the layer (``<op id>_lhs``), as qwix keeps them

  def dot_general(self, *args, **kwargs):
    """qwix's ``provider.dot_general(lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None, *, out_sharding=None)`` called in a linen module's method
    (the op of that module, its rhs the weight, as qwix has it); and the interception's call
    (``host, path, op_id, ...``, ``weight_operand=``), which quantizes an intercepted op."""
    if "weight_operand" not in kwargs:
      return self._qwix_call("dot_general", args, kwargs)
    return self._dot_general(*args, **kwargs)

  def _qwix_call(self, op_name: str, args, kwargs):
    """An op called as qwix's provider method (``provider.dot_general(lhs, rhs, dn)``) in a
    linen module's method: the op ``<op name><n>`` of that module (counted per module call, as
    qwix's op ids), quantized with its rhs as the weight."""
    stack = _linen_module._context.module_stack
    module = stack[-1] if stack else None
    if module is None or getattr(module, "scope", None) is None:
      raise ValueError(f"qtrain.qwix.QtProvider.{op_name}({', '.join(['...'] * len(args))}) "
                       "called outside a linen module's method: qwix's provider ops are called "
                       "inside one (nnx and other code: quantize the model with "
                       "quantize_model, which intercepts jax.lax.dot_general itself)")
    frame = _intercept.current_frame()
    if frame is not None and frame.module is module and frame.provider is self:
      path, op_id = frame.path, frame.next_id(op_name)
    else:
      counts = module.__dict__.setdefault("_qtrain_qwix_op_counts", {})
      n = counts.get(op_name, 0)
      counts[op_name] = n + 1
      path, op_id = "/".join(str(p) for p in module.path), f"{op_name}{n}"
    host = hosts.LinenHost(module, op_id)
    orig = _intercept.original(op_name)
    with _intercept.sentinel():
      if op_name == "dot_general":
        lhs, rhs, dn, *rest = args
        names = ("precision", "preferred_element_type")
        kw = {**dict(zip(names, rest)), **kwargs}
        return self._dot_general(host, path, op_id, lhs, rhs, dn, kw.get("precision"),
                                 kw.get("preferred_element_type"), weight_operand=1,
                                 fallback=orig, out_sharding=kw.get("out_sharding"))
      subscripts, *operands = args
      return super().einsum(host, path, op_id, subscripts, tuple(operands), kwargs,
                            weight_operand=1, fallback=orig)

  def einsum(self, *args, **kwargs):
    """qwix's ``provider.einsum(subscripts, *operands, **kwargs)`` in a linen module's method
    (its second operand the weight), and the interception's call."""
    if "weight_operand" not in kwargs:
      return self._qwix_call("einsum", args, kwargs)
    return super().einsum(*args, **kwargs)

  def _dot_general(self, host, path, op_id, lhs, rhs, dimension_numbers, *args,
                   weight_operand, **kwargs):
    side = getattr(self._side, "v", None)
    self._side.v = "rhs" if weight_operand == 0 else "lhs"
    try:
      return super().dot_general(host, path, op_id, lhs, rhs, dimension_numbers, *args,
                                 weight_operand=weight_operand, **kwargs)
    finally:
      self._side.v = side

  def _act_state(self, host, rule, act, contract_axes):
    if (not rule.act_static_scale or rule.act_learnable_scale or rule.act_learnable_shift
        or rule.act_static_scale_averaging != "mean"):
      return super()._act_state(host, rule, act, contract_axes)
    side = getattr(self._side, "v", None) or "lhs"
    return act, jax.lax.stop_gradient(self._qwix_static_scale(host, rule, act, contract_axes,
                                                              side))

  def _qwix_static_scale(self, host, rule, x, contract_axes, side):
    qt = qtypes.get_qtype(rule.act_qtype)
    x = jax.lax.stop_gradient(x)
    contract = {a % x.ndim for a in contract_axes}
    if rule.act_calibration_method.is_asymmetric:
      return self._qwix_static_minmax(host, rule, x, tuple(sorted(contract)), side)
    spec = qarray.QuantizeSpec(qtype=rule.act_qtype,
                               channelwise_axes=tuple(a for a in range(x.ndim) if a not in contract),
                               calibration=rule.act_calibration_method,
                               axis_names=rule.act_axis_names)
    # Each token's bound (its scale times qmax), averaged over the tokens: one per tensor.
    cur = jnp.mean(qarray.calibrate(x, spec)[0] * qt.qmax).reshape((1,) * x.ndim)
    stat = host.stat(side, lambda: {"count": jnp.zeros((), jnp.int32),
                                    "sum_of_absmax": jnp.zeros(cur.shape, jnp.float32)})
    count, total = stat["count"], stat["sum_of_absmax"]
    if tuple(total.shape) != tuple(cur.shape):
      raise ValueError(f"quant_stats: {side!r} statistics of shape {tuple(total.shape)}, this "
                       f"input's {tuple(cur.shape)} (qtrain.qwix keeps one per tensor)")
    if host.calibrating:
      count, total = count + 1, total + cur
      host.set_stat(side, {"count": count, "sum_of_absmax": total})
    bound = jnp.where(count > 0, total / jnp.maximum(count, 1).astype(jnp.float32), cur)
    return _scale_of_bound(bound.reshape(()), qt)

  def _qwix_static_minmax(self, host, rule, x, contract, side):
    """qwix's asymmetric static scale: ``{count, sum_of_min, sum_of_max}``, the sums of each
    batch's per-token ``min(x, 0)`` / ``max(x, 0)`` (times the calibration's multiplier)
    averaged over the tokens; the averaged ends give the scale and zero point as ``minmax``
    maps a range onto the integer qtype."""
    lo, hi = _token_ends(x, contract, rule.act_calibration_method.multiplier)
    shape = (1,) * x.ndim
    cur = {"sum_of_min": jnp.mean(lo).reshape(shape), "sum_of_max": jnp.mean(hi).reshape(shape)}
    stat = host.stat(side, lambda: {"count": jnp.zeros((), jnp.int32),
                                    **{k: jnp.zeros(shape, jnp.float32) for k in cur}})
    if set(stat) != {"count", *cur}:
      raise ValueError(f"quant_stats: {side!r} statistics {sorted(stat)}, an asymmetric "
                       f"(minmax) static scale keeps {sorted({'count', *cur})}")
    count = stat["count"]
    if host.calibrating:
      count = count + 1
      stat = {"count": count, **{k: stat[k] + cur[k] for k in cur}}
      host.set_stat(side, stat)
    n = jnp.maximum(count, 1).astype(jnp.float32)
    ends = [jnp.where(count > 0, stat[k] / n, cur[k]).reshape(()) for k in cur]
    return qarray.minmax_scale(*ends, rule.act_qtype)

  def read_static_stats(self, stats: Mapping, op_id: str, rule) -> tuple[dict, list[str]]:
    """qtrain's static-scale state (``act_static_scale``, ``act_static_count``) of op ``op_id``
    from its module's statistics in qwix's layout; and the names read (for freezing)."""
    for side in ("lhs", "rhs"):
      stat = stats.get(f"{op_id}_{side}")
      if isinstance(stat, Mapping) and "count" in stat:
        return (static_state_of(stat, rule.act_qtype,
                                asymmetric=rule.act_calibration_method.is_asymmetric),
                [f"{op_id}_{side}"])
    return {"act_static_scale": None, "act_static_count": None}, []


def _token_ends(x, contract: tuple, multiplier: float):
  """Each token's ``(min(x, 0), max(x, 0)) * multiplier`` over the ``contract`` axes (float32;
  a NaN in a token gives ``(-inf, inf)``, so the scale that follows is NaN)."""
  xf = x.astype(jnp.float32)
  nan = jnp.isnan(xf)
  lo = jnp.min(jnp.where(nan, -jnp.inf, xf), axis=contract, initial=0.0)
  hi = jnp.max(jnp.where(nan, jnp.inf, xf), axis=contract, initial=0.0)
  if multiplier != 1.0:
    lo, hi = lo * multiplier, hi * multiplier
  return lo, hi


def _scale_of_bound(bound, qt):
  """The scale of a calibrated bound (``bound / qmax``; an all-zero input's bound gives 1)."""
  return jnp.where(bound > 0, bound / qt.qmax, 1.0).astype(jnp.float32)


_SYMMETRIC_STATS = ("sum_of_absmax",)
_ASYMMETRIC_STATS = ("sum_of_min", "sum_of_max")


def static_state_of(stat: Mapping, act_qtype, *, asymmetric: bool = False) -> dict:
  """``{"act_static_scale", "act_static_count"}`` of one qwix statistics entry ``{"count",
  "sum_of_absmax"}``; with ``asymmetric`` (a ``minmax`` rule), of ``{"count", "sum_of_min",
  "sum_of_max"}``, plus ``"act_static_zero_point"`` (``count`` 0: scale 0, never calibrated).

  Raises:
    ValueError: statistics of the other calibration, or malformed ones, naming what is
      expected.
  """
  names = _ASYMMETRIC_STATS if asymmetric else _SYMMETRIC_STATS
  if "count" not in stat or any(k not in stat for k in names):
    kind = ("asymmetric (act_calibration_method='minmax')" if asymmetric else
            "symmetric (absmax, rms, ...)")
    raise ValueError(f"quant_stats: statistics {sorted(stat)}: the rule's {kind} static scale "
                     f"reads {sorted({'count', *names})}")
  sums = [jnp.asarray(stat[k], jnp.float32) for k in names]
  for k, total in zip(names, sums):
    if total.size != 1:
      raise ValueError(f"quant_stats: {k} of shape {tuple(total.shape)}: qtrain.qwix's static "
                       "input scale is one per tensor (a per-position scale, qwix's for inputs "
                       "of rank > 2, is not supported)")
  count = jnp.asarray(stat["count"])
  out = {"act_static_count": count.astype(jnp.float32)}
  means = [t.reshape(()) / jnp.maximum(count, 1) for t in sums]
  if asymmetric:
    scale, zero = qarray.minmax_scale(*means, act_qtype)
    out["act_static_zero_point"] = jnp.where(count > 0, zero, 0.0)
  else:
    scale = _scale_of_bound(means[0], qtypes.get_qtype(act_qtype))
  out["act_static_scale"] = jnp.where(count > 0, scale, 0.0)
  return out


# ----------------------------------------------------------------------------
# PTQ: weights quantized once for serving, on qtrain.freeze, in qwix's params layout.

WithAux = layout.WithAux
QArray = layout.QArray


class PtqProvider:
  """qwix's ``PtqProvider``: weights quantized once, inputs quantized per call, as the rules say.

  Built on :mod:`qtrain.freeze`: each quantized op's weight is quantized as the QT op quantizes
  it (the same codes and scales, so a PTQ model predicts what the QT model's forward predicts)
  and kept in qwix's layout, a :class:`WithAux` of a :class:`QArray` ``(qvalue, scale[,
  zero_point])`` in the weight's place; each call hands it to qtrain's frozen product (packed on
  the way: the Triton / Mosaic kernels on a GPU, ``implementation``, see
  :func:`qtrain.freeze.apply_frozen`).

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


def _act_side(layer: FrozenLayer) -> str:
  return "lhs" if layer.weight_operand == 1 else "rhs"


def _check_qwix_layer(layer: FrozenLayer, where: str) -> None:
  if layer.bias_a is not None or layer.lora is not None:
    raise ValueError(f"PtqProvider: layer {where!r} keeps a learned input shift or a LoRA "
                     "adapter, which qwix's PTQ params have no place for: freeze it with "
                     "qtrain.freeze instead")


def _record_of(provider: PtqProvider, path: str, op_id: str):
  for r in provider.qt.records():
    if r.path == path and r.op_id == op_id:
      return r
  raise ValueError(f"PtqProvider: no record of the op {op_id!r} of {path!r}")  # pragma: no cover


def _act_ndim(rec) -> int:
  shapes = rec.contraction[-2]
  w_idx = {"lhs": 0, "rhs": 1}[rec.weight_operand]
  return len(shapes[1 - w_idx])


def _weight_how(key: str, layer: FrozenLayer, weight_quant, stack=()) -> layout.WeightHow:
  spec = dataclasses.replace(layer, **{f: None for f in _frozen.ARRAY_FIELDS})
  return layout.WeightHow(key=key, spec=spec, weight_quant=weight_quant, stack=tuple(stack))


def _get_path(tree, path: tuple):
  node = tree
  for p in path:
    if not isinstance(node, Mapping) or p not in node:
      return None
    node = node[p]
  return node


def _qwix_params(frozen: Mapping, boxed: Mapping, provider: PtqProvider) -> dict:
  """freeze's ``{"layers", "variables"}`` as PTQ params in qwix's layout: each frozen weight a
  WithAux(QArray) at its parameter's path (boxed as the parameter was), each calibrated static
  input scale a WithAux at ``<op id>_lhs_scale`` beside it (and an asymmetric one's zero point
  at ``<op id>_lhs_zero_point``)."""
  params = dict(frozen["variables"].get("params", {}))
  for key, layer in frozen["layers"].items():
    path = freeze_lib._layer_path(key, layer)
    owner = tuple(p for p in path.split("/") if p)
    _check_qwix_layer(layer, key)
    rec = _record_of(provider, path, layer.op_id)
    weight_quant = freeze_lib._weight_quant(rec, provider.qt)
    q = layout.to_qarray(layer, weight_quant)
    box = _get_path(boxed, owner + (layer.param,))
    q = QArray(qvalue=layout._rebox(box, q.qvalue), scale=layout._rebox(box, q.scale),
               zero_point=None if q.zero_point is None else layout._rebox(box, q.zero_point),
               qtype=q.qtype)
    leaves = {layer.param: WithAux(q, _weight_how(key, layer, weight_quant))}
    if (layer.act_dict or {}).get("scale") == "given":
      stem, qt = f"{layer.op_id}_{_act_side(layer)}", layer.act_dict["qtype"]
      leaves[f"{stem}_scale"] = WithAux(
          layout.static_scale_array(layer.scale_a, _act_ndim(rec)),
          layout.ScaleHow(key=key, qtype=qt, zero_point=layer.zero_a is not None))
      if layer.zero_a is not None:
        leaves[f"{stem}_zero_point"] = layout.static_zero_point_array(layer.zero_a,
                                                                      _act_ndim(rec), qt)
    for name, leaf in leaves.items():
      params = freeze_lib._set_in(params, owner + (name,), leaf)
  return params


def _frozen_from_qwix(params: Mapping) -> tuple[dict, dict]:
  """PTQ params in qwix's layout -> (qtrain's frozen layers by key, the float params left)."""
  weights, scales, zeros = {}, {}, {}

  def walk(node, prefix):
    out = {}
    taken = set()
    for k, v in node.items():
      if isinstance(v, WithAux) and isinstance(v.how, layout.ScaleHow) and v.how.zero_point:
        zk = f"{str(k)[:-len('_scale')]}_zero_point"
        if zk not in node:
          raise ValueError(f"PTQ params: {'/'.join(prefix + (str(k),))!r} is an asymmetric "
                           f"static input scale, and the params hold no zero point {zk!r} "
                           "beside it")
        zeros[v.how.key] = layout.unbox(node[zk])
        taken.add(zk)
    for k, v in node.items():
      if k in taken:
        continue
      if isinstance(v, WithAux) and isinstance(v.how, layout.WeightHow):
        weights[v.how.key] = (v, "/".join(prefix + (str(k),)))
      elif isinstance(v, WithAux) and isinstance(v.how, layout.ScaleHow):
        scales[v.how.key] = v
      elif isinstance(v, Mapping):
        out[k] = walk(v, prefix + (str(k),))
      else:
        out[k] = v
    return out

  rest = walk(params, ())
  layers = {}
  for key, (w, where) in weights.items():
    arr = layout.unbox(w.array)
    if not isinstance(arr, QArray):
      raise ValueError(f"PTQ params: {where!r} is a WithAux of {type(arr).__name__}, not of a "
                       "QArray (qvalue, scale)")
    s = scales.pop(key, None)
    spec_scale = (w.how.spec.act_dict or {}).get("scale")
    if spec_scale == "given" and s is None:
      raise ValueError(f"PTQ params: layer {key!r} keeps a static input scale, and the params "
                       "hold none for it (<op id>_lhs_scale)")
    layers[key] = layout.to_frozen(w.how, arr, None if s is None else layout.unbox(s.array),
                                   zeros.get(key))
  if scales:
    raise ValueError(f"PTQ params: static input scales {sorted(scales)} of no quantized weight")
  return layers, rest


class PtqModel:
  """A linen model served from quantized weights (:func:`quantize_model` with a
  :class:`PtqProvider`): ``init`` and ``apply`` as a linen module's.

  ``init``'s ``params`` are qwix's PTQ params: each quantized op's weight is a
  :class:`WithAux` of a :class:`QArray` ``(qvalue, scale[, zero_point])`` (boxed as the
  parameter was: ``nn.with_partitioning``'s names on each array), a rule's static input scale a
  ``WithAux`` under ``<op id>_lhs_scale`` (calibrated on the ``init`` batch, as qwix's), every
  other parameter as it is. ``jax.eval_shape(ptq_model.init, key, x)`` gives the template that
  :func:`quantize_params` fills from trained float parameters. ``apply`` hands each weight to
  qtrain's frozen product (packing its codes); float params raise. Inside ``init`` and
  ``apply`` (only there), ``jnp.asarray`` passes a :class:`WithAux` / :class:`QArray` through
  (:func:`qtrain._qwix.layout.asarray`), as qwix's PTQ does.
  """

  def __init__(self, model, provider: PtqProvider):
    self.model = model
    self.provider = provider

  def __repr__(self):
    return f"PtqModel({type(self.model).__name__}, {self.provider!r})"

  def init(self, rngs, *args, method=None, **kwargs) -> dict:
    with _intercept.asarray_scope(layout.asarray):
      return self._init(rngs, *args, method=method, **kwargs)

  def _init(self, rngs, *args, method=None, **kwargs) -> dict:
    qt_model = model_lib.quantize_model(self.model, self.provider.qt)
    variables = dict(qt_model.init(rngs, *args, method=method, **kwargs))
    recs = [r for r in self.provider.qt.records() if r.status == provider_lib.QUANTIZED]
    if not recs:  # no op to quantize (the rules' warning given): all float
      return variables
    if any(self.provider.rules[r.rule_index].act_static_scale for r in recs):
      # qwix's PTQ init calibrates a static input scale on the init batch: so does this one.
      _, new = qt_model.apply(variables, *args, method=method, mutable=["quant_stats"], **kwargs)
      variables["quant_stats"] = new["quant_stats"]
    frozen = freeze_lib._freeze_records(variables, self.provider.qt, static="given")
    out = dict(frozen["variables"])
    out["params"] = _qwix_params(frozen, variables["params"], self.provider)
    return out

  def apply(self, variables: Mapping, *args, method=None, **kwargs):
    with _intercept.asarray_scope(layout.asarray):
      return self._apply(variables, *args, method=method, **kwargs)

  def _apply(self, variables: Mapping, *args, method=None, **kwargs):
    params = variables.get("params") if isinstance(variables, Mapping) else None
    if not isinstance(params, Mapping):
      raise ValueError(f"expected PTQ variables ({{'params': ...}}), got "
                       f"{type(variables).__name__}")
    layers, rest = _frozen_from_qwix(nn.unbox(params))
    if not layers and not self._all_float(variables, args, method, kwargs):
      raise ValueError("PtqModel.apply: the params hold no quantized weight (WithAux leaves): "
                       "float params are quantized by quantize_params(params, "
                       "jax.eval_shape(ptq_model.init, key, x)['params']) first")
    frozen = {"layers": layers, "variables": {**variables, "params": rest}}
    return freeze_lib.apply_frozen(self.model, frozen, *args,
                                   implementation=self.provider.implementation, method=method,
                                   **kwargs)

  def _all_float(self, variables, args, method, kwargs) -> bool:
    """Whether the rules quantize no op of the model (traced once, costing no compute, where
    the provider has not seen the model run)."""
    if not self.provider.qt.records():
      qt_model = model_lib.quantize_model(self.model, self.provider.qt)
      jax.eval_shape(lambda v, a, k: qt_model.apply(v, *a, method=method, **k),
                     variables, args, kwargs)
    return not any(r.status == provider_lib.QUANTIZED for r in self.provider.qt.records())


def quantize_params(params: Mapping, abstract_quantized_params, quant_stats: Mapping | None = None,
                    *, allow_extra_params: bool = False):
  """qwix's ``quantize_params``: trained float ``params`` -> PTQ params in qwix's layout.

  Each param whose place in the template is a :class:`WithAux` (a quantized weight) is quantized
  as the template's ``how`` says (the QT op's quantization: the same codes and scales as the
  trained QT model's forward); every other param is taken as it is. ``params`` may be a
  subtree of the template (one layer's, say), as in qwix.

  Args:
    params: the float (or QT-trained) model's params (linen: unboxed or boxed; nnx: a pure dict,
      ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``). linen also takes whole variables
      (``{"params": ...}``) with a template of whole variables.
    abstract_quantized_params: linen: the template,
      ``jax.eval_shape(ptq_model.init, key, x)["params"]`` (or whole variables). nnx: the PTQ
      model (``nnx.eval_shape`` of a function returning
      ``quantize_model(model, PtqProvider(rules), x)``); the result is then a pure dict of its
      state, for ``nnx.update(model, result)``.
    quant_stats: the QT model's statistics in qwix's layout (linen: its ``quant_stats``; nnx:
      ``nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat))``); each gives the static input
      scale ``<op id>_lhs_scale`` of its layer (a never-calibrated one, count 0, raises).
    allow_extra_params: params the template has no place for (a loss head the served method
      never calls, say) are dropped instead of raising.

  Returns:
    The PTQ params (the structure of ``params``, quantized weights as ``WithAux`` leaves; nnx: a
    pure dict), plus the static scales ``quant_stats`` gives.

  Raises:
    ValueError: a param the template has no place for (naming it) without
      ``allow_extra_params``, a shape other than the template's, statistics never calibrated or
      of no static-scale layer of the template.
  """
  if isinstance(abstract_quantized_params, nnx.Module):
    return _quantize_params_nnx(params, abstract_quantized_params, quant_stats,
                                allow_extra_params)
  params, template = nn.unbox(params), nn.unbox(abstract_quantized_params)
  if _is_variables_template(template):
    return _quantize_variables(params, template, quant_stats, allow_extra_params)
  if not isinstance(params, Mapping) or not isinstance(template, Mapping):
    raise ValueError("quantize_params: params and the template are nested dicts (linen), or the "
                     "template is the PTQ nnx model")
  out: dict = {}
  extra = []

  def walk(p, t, prefix):
    for k, v in p.items():
      where = prefix + (k,)
      tv = t.get(k) if isinstance(t, Mapping) else None
      if tv is None:
        extra.append("/".join(map(str, where)))
      elif isinstance(v, Mapping) and not isinstance(tv, WithAux):
        if not isinstance(tv, Mapping):
          raise ValueError(f"quantize_params: {'/'.join(map(str, where))!r} is a subtree in "
                           "params and a leaf in the template")
        walk(v, tv, where)
      elif isinstance(tv, WithAux) and isinstance(tv.how, layout.WeightHow):
        q = layout.requantize(tv.how, v, "/".join(map(str, where)))
        _set_nested(out, where, WithAux(q, tv.how))
      else:
        _check_shape(v, tv, where)
        _set_nested(out, where, v)

  walk(params, template, ())
  _raise_extra(extra, allow_extra_params)
  for path, stat in _stat_entries(quant_stats):
    name = path[-1] + "_scale"
    tv = _get_path(template, path[:-1] + (name,))
    if not (isinstance(tv, WithAux) and isinstance(tv.how, layout.ScaleHow)):
      raise ValueError(f"quantize_params: quant_stats {'/'.join(map(str, path))!r} has no "
                       f"static input scale {name!r} in the template")
    scale, zero = _stat_scale(stat, tv, path)
    _set_nested(out, path[:-1] + (name,), WithAux(scale, tv.how))
    if zero is not None:
      _set_nested(out, path[:-1] + (path[-1] + "_zero_point",), zero)
  return out


def _stat_scale(stat: Mapping, tv: WithAux, path) -> tuple[jax.Array, jax.Array | None]:
  """The PTQ static input scale (and an asymmetric one's zero point, else None) in qwix's
  layout, from one statistics entry."""
  if "count" in stat and int(np.asarray(stat["count"])) == 0:
    raise ValueError(f"quantize_params: quant_stats {'/'.join(map(str, path))!r} was never "
                     "calibrated (count 0): run the QT model in training mode on data first "
                     "(linen: apply(..., mutable=['quant_stats']))")
  try:
    state = static_state_of(stat, tv.how.qtype, asymmetric=tv.how.zero_point)
  except ValueError as e:
    raise ValueError(f"quantize_params: quant_stats {'/'.join(map(str, path))!r}: "
                     f"{str(e).removeprefix('quant_stats: ')}") from None
  zero = state.get("act_static_zero_point")
  return (layout.static_scale_array(state["act_static_scale"], tv.ndim),
          None if zero is None else layout.static_zero_point_array(zero, tv.ndim, tv.how.qtype))


def _stat_entries(quant_stats) -> list[tuple[tuple, Mapping]]:
  """(path, {"count", "sum_of_..."}) of each statistics entry of qwix-layout quant_stats."""
  out = []

  def walk(node, prefix):
    node = layout.unbox(node)
    if isinstance(node, Mapping) and "count" in node and not isinstance(node["count"], Mapping):
      out.append((prefix, node))
      return
    if isinstance(node, Mapping):
      for k, v in node.items():
        walk(v, prefix + (k,))
  if quant_stats:
    walk(quant_stats, ())
  return out


def _set_nested(tree: dict, path: tuple, value) -> None:
  node = tree
  for p in path[:-1]:
    node = node.setdefault(p, {})
  node[path[-1]] = value


def _check_shape(value, template, where) -> None:
  shape = getattr(template, "shape", None)
  if shape is not None and tuple(np.shape(value)) != tuple(shape):
    raise ValueError(f"quantize_params: {'/'.join(map(str, where))!r} has shape "
                     f"{tuple(np.shape(value))}, the template's {tuple(shape)}")


def _raise_extra(extra: list, allow: bool) -> None:
  if extra and not allow:
    raise ValueError(f"quantize_params: params the template has no place for: {extra[:6]}"
                     f"{' ...' if len(extra) > 6 else ''}; pass allow_extra_params=True to drop "
                     "them (params the PTQ model never uses)")


def _is_variables_template(template) -> bool:
  """Whether ``template`` is whole PTQ variables (``{"params": {...}, ...}``)."""
  return (isinstance(template, Mapping) and isinstance(template.get("params"), Mapping)
          and layout.tree_has_quantized(template["params"])
          and not layout.tree_has_quantized({k: v for k, v in template.items() if k != "params"}))


def _quantize_variables(variables, template: Mapping, quant_stats, allow_extra_params: bool) -> dict:
  """quantize_params over whole variables: ``params`` quantized, the template's other
  collections taken from ``variables`` as they are."""
  if not isinstance(variables, Mapping) or not isinstance(variables.get("params"), Mapping):
    raise ValueError("quantize_params: the template is whole variables ({'params': ...}), so "
                     "params must be too; got "
                     f"{sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__}")
  missing = [c for c in template if c != "params" and c not in variables]
  extra = [c for c in variables if c not in template and c != "quant_stats"]
  if missing:
    raise ValueError(f"quantize_params: the variables lack the template's collections {missing}")
  if extra and not allow_extra_params:
    raise ValueError(f"quantize_params: collections the template has no place for: {extra}; pass "
                     "allow_extra_params=True to drop them")
  out = {c: variables[c] for c in template if c != "params"}
  if quant_stats is None and "quant_stats" not in template:
    quant_stats = variables.get("quant_stats")
  out["params"] = quantize_params(variables["params"], template["params"], quant_stats,
                                  allow_extra_params=allow_extra_params)
  return out


# ---------------------------------------------------------------------------- nnx


def _promote_dtype_keep_quantized(args, *, dtype=None, inexact=True):
  """nnx layers' ``promote_dtype`` with a PTQ weight (a QArray) passed through as it is."""
  from flax.nnx.nn import dtypes as nnx_dtypes
  floats = [None if isinstance(a, (QArray, WithAux)) else a for a in args]
  out = nnx_dtypes.promote_dtype(floats, dtype=dtype, inexact=inexact)
  return type(args)(a if o is None else o for a, o in zip(args, out))


class PtqOp(nnx.Module):
  """The op of an nnx layer of a PTQ model: its weight (qwix's :class:`QArray`, which the layer
  reads from its ``WithAux`` and passes in) rebuilt as qtrain's frozen layer for the product.

  Attributes:
    how: the weight's :class:`qtrain._qwix.layout.WeightHow` (static).
    path, op_name: the layer's module path and op.
    implementation: where the products run (:func:`qtrain.freeze.apply_frozen`).
    scale_name: the layer's attribute holding the static input scale, or None (an
      asymmetric one's zero point is at ``<op id>_lhs_zero_point``).
  """

  def __init__(self, how: layout.WeightHow, *, path: str, op_name: str, implementation: str,
               owner=None, scale_name: str | None = None):
    self.how = freeze_lib._static(how)
    self.path = path
    self.op_name = op_name
    self.implementation = _frozen.check_implementation(implementation)
    self.scale_name = scale_name
    if scale_name is not None:
      self.owner = freeze_lib._data(owner)

  def _layer(self, weight) -> FrozenLayer:
    if isinstance(weight, WithAux):
      weight = weight.value
    if not isinstance(weight, QArray):
      raise ValueError(f"PTQ layer {self.path or '<root>'!r}: its weight is a "
                       f"{type(weight).__name__}, not qwix's QArray (qvalue, scale): load PTQ "
                       "params (quantize_params / process_prequantized_params) into it")
    scale = zero = None
    if self.scale_name is not None:
      given = getattr(self.owner, self.scale_name)
      scale = layout.unbox(given.array)
      if given.how.zero_point:  # an asymmetric static scale: its zero point beside it
        zero = layout.unbox(getattr(self.owner, _zero_point_name(self.scale_name)))
    return layout.to_frozen(self.how, weight, scale, zero)

  @property
  def spec(self) -> FrozenLayer:
    """The frozen layer's metadata (no arrays)."""
    return self.how.spec

  @property
  def weight_operand(self) -> int:
    """The weight's operand index in the op (1 for a layer's op)."""
    return self.how.spec.weight_operand

  def __call__(self, *args, **kwargs):
    # The product's own jax.lax / jnp calls must not reach a frame of the calling module.
    with _intercept.sentinel():
      return self._product(args, kwargs, 1)

  def direct(self, op_name: str, args, kwargs, weight_operand: int):
    """A module's own call of this op (``jnp.einsum(..., x, self.w)`` in its code), its weight
    (the :class:`WithAux` / :class:`QArray`) operand ``weight_operand``."""
    where = f"{self.path or '<root>'} ({self.how.spec.op_id})"
    if op_name != self.op_name:
      raise ValueError(f"PTQ call {where!r} was quantized as a {self.op_name} call, now called "
                       f"as {op_name}")
    with _intercept.sentinel():
      return self._product(args, kwargs, weight_operand)

  def _product(self, args, kwargs, w_idx: int):
    kwargs = dict(kwargs)
    if kwargs.pop("out_sharding", None) is not None:
      raise NotImplementedError(f"PTQ layer {self.path!r}: out_sharding is not supported")
    spec = self.how.spec
    stand_in = freeze_lib.Placeholder(spec.kernel_shape, spec.param_dtype)[...]
    where = self.path or "<root>"

    def split(ops):  # (frozen layer, operands with the weight's stand-in)
      ops = list(ops)
      layer, ops[w_idx] = self._layer(ops[w_idx]), stand_in
      return layer, tuple(ops)
    if self.op_name == "dot_general":
      (lhs, rhs), (dn, *rest) = args[:2], args[2:]
      kwargs.pop("precision", None)
      if rest:
        rest = rest[1:]  # precision: a product of quantized values has the QT op's own
      layer, (lhs, rhs) = split((lhs, rhs))
      return _frozen.dot_general(layer, lhs, rhs, dn, *rest, weight_operand=w_idx,
                                 implementation=self.implementation, where=where, **kwargs)
    if self.op_name == "einsum":
      subscripts, *operands = args
      layer, operands = split(operands)
      return _frozen.einsum(layer, subscripts, operands, kwargs, weight_operand=w_idx,
                            implementation=self.implementation, where=where)
    if w_idx != 1:
      raise ValueError(f"PTQ layer {where!r}: a convolution's kernel is its operand 1, not "
                       f"{w_idx}")
    lhs, rhs, *rest = args
    layer, (lhs, rhs) = split((lhs, rhs))
    return _frozen.conv_general_dilated(layer, lhs, rhs, *rest, **kwargs,
                                        implementation=self.implementation, where=where)


def _sharded_like(value, var, ref=None):
  """``value`` placed as the parameter ``var``'s names say on ``ref``'s (or ``var``'s) mesh."""
  if isinstance(value, jax.core.Tracer):
    return value
  names = getattr(var, "sharding_names", None) if isinstance(var, nnx.Variable) else None
  src = ref if ref is not None else (var.get_value() if isinstance(var, nnx.Variable) else None)
  sharding = getattr(src, "sharding", None)
  if names is None or not isinstance(sharding, jax.sharding.NamedSharding) or isinstance(
      sharding.mesh, jax.sharding.AbstractMesh):
    return value
  spec = []
  for ax, name in enumerate(tuple(names) + (None,) * (value.ndim - len(names))):
    size = 1 if name is None else int(np.prod([sharding.mesh.shape[n] for n in
                                              ((name,) if isinstance(name, str) else name)]))
    spec.append(name if value.shape[ax] % size == 0 else None)
  return jax.device_put(value, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec)))


def _wrap_like(var, value):
  """``value`` as a Variable of ``var``'s type and metadata (a plain Param where ``var`` is not
  a Variable)."""
  if isinstance(var, nnx.Variable):
    return var.replace(_sharded_like(value, var))
  return nnx.Param(value)


def _to_qwix_nnx(frozen, source, provider: PtqProvider):
  """A frozen nnx model (FrozenOps) in qwix's layout: each frozen weight a WithAux(QArray of
  Params, with the parameter's metadata) in the parameter's place, the layer's op a
  :class:`PtqOp`, a calibrated static input scale a WithAux at ``<op id>_lhs_scale``."""
  nodes = {"/".join(str(p) for p in path): node for path, node in nnx.iter_graph(source)
           if isinstance(node, nnx.Module)}
  for path, node, attr, fop in freeze_lib._nnx_hooks(frozen, freeze_lib.FrozenOp):
    stack = fop.stack
    layers = freeze_lib.unstack_layer(fop.layer, stack)  # a stack's: one per layer
    layer = layers[0]
    key = path if fop.op_id is None else f"{path}:{fop.op_id}"
    _check_qwix_layer(layer, key or "<root>")
    orig = vars(nodes[path]).get(layer.param)
    q = layout.stack_qarrays([layout.to_qarray(l, fop.weight_quant) for l in layers], stack)
    wrapped = QArray(qvalue=_wrap_like(orig, q.qvalue), scale=_wrap_like(orig, q.scale),
                     zero_point=None if q.zero_point is None else _wrap_like(orig, q.zero_point),
                     qtype=q.qtype)
    how = _weight_how(key, layer, fop.weight_quant, stack)
    scale_name = None
    if (layer.act_dict or {}).get("scale") == "given":
      scale_name = f"{layer.op_id}_{_act_side(layer)}_scale"
      qt, ndim = layer.act_dict["qtype"], _nnx_act_ndim(source, fop)
      lead = (1,) * ndim
      scale = jnp.stack([layout.static_scale_array(l.scale_a, ndim) for l in layers])
      setattr(node, scale_name, freeze_lib._data(WithAux(
          nnx.Param(scale.reshape(stack + lead)),
          layout.ScaleHow(key=key, qtype=qt, zero_point=layer.zero_a is not None))))
      if layer.zero_a is not None:
        zero = jnp.stack([layout.static_zero_point_array(l.zero_a, ndim, qt) for l in layers])
        setattr(node, _zero_point_name(scale_name), nnx.Param(zero.reshape(stack + lead)))
    setattr(node, layer.param, freeze_lib._data(WithAux(wrapped, how)))
    op = PtqOp(how, path=fop.path, op_name=fop.op_name, implementation=provider.implementation,
               owner=node, scale_name=scale_name)
    setattr(node, attr, freeze_lib._data(op))
    if "promote_dtype" in vars(node):
      node.promote_dtype = _promote_dtype_keep_quantized
  return frozen


def _zero_point_name(scale_name: str) -> str:
  """``<op id>_lhs_zero_point`` of the static input scale ``<op id>_lhs_scale``."""
  return scale_name[:-len("_scale")] + "_zero_point"


def _nnx_act_ndim(source, fop) -> int:
  """The rank of a frozen op's input, from the record of the QT op it was frozen from."""
  for _, node in nnx.iter_graph(source):
    if isinstance(node, model_lib.QtOp) and node.path == fop.path:
      for r in node.provider.records():
        if r.path == fop.path and r.op_id == fop.spec.op_id and r.contraction is not None:
          return _act_ndim(r)
  return 2


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
    source = model
  else:
    if not model_inputs and not kwargs:
      raise ValueError("quantize_model(nnx model, PtqProvider(rules)): pass a sample batch "
                       "(quantize_model(model, provider, x)): the ops must run once to be frozen")
    source = model_lib.quantize_model(nnx.clone(model), provider.qt, *model_inputs, **kwargs)
    if not any(r.status == provider_lib.QUANTIZED for r in provider.qt.records()):
      # No op quantized (the rules' warning says so): nothing to freeze.
      return _serving(nnx.clone(model))
  return _serving(_to_qwix_nnx(freeze_lib.freeze(source), source, provider))


# nnx PTQ models: the root's class, once per class, a subclass whose __call__ runs in
# qwix's PTQ scope (jnp.asarray passes quantized weights through: layout.asarray), as qwix's
# PTQ intercepts the call of the model it returns.
_PTQ_CLASS_ATTR = "_qtrain_ptq_of"
_PTQ_CLASSES: dict[type, type] = {}
_ptq_class_lock = threading.Lock()


def _ptq_class(cls: type) -> type:
  with _ptq_class_lock:
    if cls not in _PTQ_CLASSES:
      call = cls.__call__

      @functools.wraps(call)
      def __call__(self, *args, **kwargs):
        with _intercept.asarray_scope(layout.asarray):
          return call(self, *args, **kwargs)

      ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__, "__call__": __call__, _PTQ_CLASS_ATTR: cls}
      _PTQ_CLASSES[cls] = type(cls)(cls.__name__, (cls,), ns)
    return _PTQ_CLASSES[cls]


def _serving(model):
  """The nnx PTQ model ``model`` with its ``__call__`` in qwix's PTQ scope (in place)."""
  if _PTQ_CLASS_ATTR not in vars(type(model)):
    model.__class__ = _ptq_class(type(model))
  return model


def _ptq_ops(model):
  """(owner path tuple, owner, op) of every PtqOp of an nnx PTQ model."""
  return [(tuple(p for p in path.split("/") if p), node, op)
          for path, node, _, op in freeze_lib._nnx_hooks(model, PtqOp)]


def _quantize_params_nnx(params: Mapping, model, quant_stats, allow_extra_params: bool) -> dict:
  """The state of the PTQ nnx ``model`` (possibly abstract) filled from float ``params`` (a pure
  dict): each PTQ weight quantized as its ``how`` says, static input scales from qwix-layout
  ``quant_stats``, every other value taken as it is. A pure dict, for ``nnx.update``."""
  flat = {tuple(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model))}
  out: dict = {}
  weights = {}
  for owner, node, op in _ptq_ops(model):
    spec = op.how.spec
    weights[owner + (spec.param,)] = (node, op)
  extra = []
  for path, value in _flat_params(params):
    where = "/".join(map(str, path))
    key = tuple(path)
    if tuple(map(str, key)) in weights:
      node, op = weights[tuple(map(str, key))]
      q = layout.requantize(op.how, value, where)
      box = getattr(node, op.how.spec.param).array
      for f in ("qvalue", "scale", "zero_point"):
        a = getattr(q, f)
        if a is None:
          continue
        var = getattr(box, f)
        if var is None:
          raise ValueError(f"quantize_params: {where!r}: the template's weight has no {f}")
        _set_nested(out, key + ("array", f), _sharded_like(a, var, value))
      continue
    var = flat.get(tuple(map(str, key)))
    if var is None:
      extra.append(where)
      continue
    _check_shape(value, var.get_value(), path)
    _set_nested(out, key, jnp.asarray(value).astype(var.get_value().dtype))
  _raise_extra(extra, allow_extra_params)
  stats = {tuple(p): s for p, s in _stat_entries(quant_stats)}
  for owner, node, op in _ptq_ops(model):
    if op.scale_name is None:
      continue
    stat_path = owner + (op.scale_name[:-len("_scale")],)
    stat = stats.pop(stat_path, None)
    if stat is None and op.spec.op_id is not None:  # a direct call's: on its op, <op id>/<side>
      stat = stats.pop(owner + tuple(op.scale_name[:-len("_scale")].rsplit("_", 1)), None)
    if stat is None:
      raise ValueError(f"quantize_params: layer {'/'.join(owner) or '<root>'!r} keeps a static "
                       f"input scale: pass the QT model's quant_stats "
                       f"(nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat))), which hold "
                       f"{'/'.join(stat_path)!r}")
    tv = getattr(node, op.scale_name)
    scale, zero = _stat_scale(stat, tv, stat_path)
    _set_nested(out, owner + (op.scale_name, "array"), scale)
    if zero is not None:
      _set_nested(out, owner + (_zero_point_name(op.scale_name),), zero)
  if stats:
    raise ValueError(f"quantize_params: quant_stats {sorted('/'.join(map(str, p)) for p in stats)}"
                     " belong to no static-scale layer of the PTQ model")
  return out


def _flat_params(params, prefix=()):
  """(path, leaf) of a pure dict of params (Variables unboxed)."""
  out = []
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  for k, v in params.items():
    if isinstance(v, Mapping):
      out += _flat_params(v, prefix + (k,))
    else:
      out.append((prefix + (k,), layout.unbox(v)))
  return out


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


def dequantize(array: QArray) -> jax.Array:
  """qwix's ``qarray.dequantize``: ``(qvalue - zero_point) * scale`` (each repeated over its
  tiles), in the scale's dtype."""
  q = jnp.asarray(layout.unbox(array.qvalue))
  scale = jnp.asarray(layout.unbox(array.scale))
  x = q.astype(scale.dtype)
  if array.zero_point is not None:
    x = x - _broadcast_groups(jnp.asarray(layout.unbox(array.zero_point)).astype(scale.dtype),
                              q.shape, "zero_point", "QArray")
  return x * _broadcast_groups(scale, q.shape, "scale", "QArray")


def _template_leaves(model) -> dict[tuple, Any]:
  """path -> Variable of an nnx model's state (a PTQ weight's arrays under
  ``<param>/array/{qvalue, scale[, zero_point]}``)."""
  return {tuple(k): v for k, v in nnx.to_flat_state(nnx.state(model))}


def _array_attribute_leaves(leaves: Mapping[tuple, Any]) -> dict[tuple, Any]:
  """``<path>/array`` -> the array-like (shape and dtype) ``array`` attribute of the value of
  each template Variable at ``<path>`` that has one (a value that carries its array, as
  qwix's boxed abstract values do): a checkpoint entry there is placed into it."""
  out = {}
  for path, var in leaves.items():
    inner = getattr(var.get_value() if isinstance(var, nnx.Variable) else var, "array", None)
    if hasattr(inner, "shape") and hasattr(inner, "dtype") and path + ("array",) not in leaves:
      out[path + ("array",)] = inner
  return out


def _place(value, var, path: str, *, allow_broadcast: bool = False) -> jax.Array:
  """A checkpoint array as the template Variable ``var``'s: its dtype, shape (a scale or zero
  point may be given per tile of a finer one: repeated) and sharding."""
  want = var.get_value() if isinstance(var, nnx.Variable) else var
  value = jnp.asarray(value)
  if tuple(value.shape) != tuple(want.shape):
    if not allow_broadcast:
      raise ValueError(f"process_prequantized_params: {path!r} has shape {tuple(value.shape)}, "
                       f"the model's {tuple(want.shape)}")
    if value.ndim != len(want.shape) or any(w % g for g, w in zip(value.shape, want.shape)):
      raise ValueError(f"process_prequantized_params: {path!r} has shape {tuple(value.shape)}, "
                       f"which does not tile the model's {tuple(want.shape)}")
    value = _broadcast_groups(value, tuple(want.shape), "value", path)
  value = value.astype(want.dtype)
  sharding = _concrete_sharding(getattr(want, "sharding", None), path)
  if sharding is not None and not isinstance(value, jax.core.Tracer):
    value = jax.device_put(value, sharding)
  return value


def _check_prequantized(leaf: Mapping, path: str) -> None:
  unsupported = sorted(set(leaf) - set(_PREQUANTIZED_KEYS))
  if unsupported:
    raise ValueError(f"process_prequantized_params: {path!r} has unsupported quantized leaves "
                     f"{unsupported}; a pre-quantized weight holds {list(_PREQUANTIZED_KEYS)} "
                     "(zero_point optional)")
  missing = [k for k in ("qvalue", "scale") if k not in leaf]
  if missing:
    raise ValueError(f"process_prequantized_params: {path!r} is missing {missing} (a "
                     f"pre-quantized weight holds qvalue, scale and optionally zero_point; found "
                     f"{sorted(leaf)})")


def process_prequantized_params(checkpoint_params: Mapping, template_params, *,
                                allow_extra_params: bool = False) -> dict:
  """qwix's ``process_prequantized_params``: a checkpoint (a nested dict of arrays at nnx state
  paths, a pre-quantized weight a ``{"qvalue", "scale"[, "zero_point"]}`` dict, optionally
  under ``"array"``) into the nnx model's parameters, as a pure dict for ``nnx.update``.

  Per checkpoint entry, by what the template holds at its path:

  * a quantized weight (a PTQ model's ``WithAux(QArray)``, or a ``{"array": {"qvalue",
    "scale"}}`` of Variables a user put in the model): the arrays, in the template's dtypes,
    shapes (a scale or zero point per tile of a finer template one is repeated) and shardings,
    at ``<param>/array/<name>``;
  * a float parameter: a pre-quantized weight is dequantized into it (``(qvalue - zero_point) *
    scale``), a float one cast; in the parameter's dtype and sharding (an abstract mesh's on the
    mesh of ``jax.set_mesh``). A parameter whose value carries its array as an ``array``
    attribute (an abstract value boxing it) takes an entry at ``<param>/array`` into that array.

  Args:
    checkpoint_params: the checkpoint's tree (nnx state paths, no ``.value``).
    template_params: the nnx model (float, QT or PTQ), possibly abstract (``nnx.eval_shape``).
    allow_extra_params: drop checkpoint entries the model has no place for (else they raise).

  Raises:
    TypeError: the template is not an nnx model.
    ValueError: an entry the model has no place for (naming it), a float entry for a quantized
      weight, a malformed pre-quantized entry (missing ``scale``, unsupported keys), a zero point
      where the template's weight has none (or none where it has one), a shape other than the
      template's.
  """
  if not isinstance(template_params, nnx.Module):
    raise TypeError("process_prequantized_params takes NNX models (an nnx.Module, possibly from "
                    f"nnx.eval_shape); got {type(template_params).__name__}")
  leaves = _template_leaves(template_params)
  prefixes = {p[:i] for p in leaves for i in range(1, len(p))}
  leaves.update(_array_attribute_leaves(leaves))
  out: dict = {}
  for path, leaf in _flatten_checkpoint(checkpoint_params).items():
    name = "/".join(map(str, path))
    base = path[:-1] if path and path[-1] == "array" else path
    quantized = (base + ("array", "qvalue")) in leaves
    if isinstance(leaf, Mapping):
      _check_prequantized(leaf, name)
      if quantized:
        for f in _PREQUANTIZED_KEYS:
          var = leaves.get(base + ("array", f))
          if f in leaf and leaf[f] is not None and var is None:
            raise ValueError(f"process_prequantized_params: {name!r} has an unexpected {f!r}: "
                             "the model's weight is quantized without one (symmetric)")
          if var is not None and (f not in leaf or leaf[f] is None):
            raise ValueError(f"process_prequantized_params: {name!r} is missing {f!r}, which "
                             "the model's weight has")
          if var is not None:
            _set_nested(out, base + ("array", f),
                        _place(leaf[f], var, f"{name}/{f}", allow_broadcast=f != "qvalue"))
        continue
      target = path if path in leaves else base
      var = leaves.get(target)
      if var is None:
        if not allow_extra_params:
          raise ValueError(f"process_prequantized_params: the model has no parameter {name!r} "
                           "(extra in the checkpoint); pass allow_extra_params=True to drop it")
        continue
      _set_nested(out, target, _place(_dequantize_leaf(leaf, name), var, name))
      continue
    if quantized or path in prefixes:
      raise ValueError(f"Unhandled or invalid parameter combination for {name!r}: the checkpoint "
                       f"holds a float array ({type(leaf).__name__}) where the model keeps a "
                       "quantized weight; pass {'qvalue', 'scale'[, 'zero_point']} for it")
    var = leaves.get(path)
    if var is None:
      if not allow_extra_params:
        raise ValueError(f"process_prequantized_params: the model has no parameter {name!r} "
                         "(extra in the checkpoint); pass allow_extra_params=True to drop it")
      continue
    _set_nested(out, path, _place(leaf, var, name))
  return out
