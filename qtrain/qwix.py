"""qwix's quantized-training API on qtrain: a qwix QT script runs with one changed import.

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
from typing import Any, Collection, Mapping, Sequence

from flax import nnx

from qtrain import provider as provider_lib
from qtrain import rules as rules_lib
from qtrain.flax import model as model_lib

__all__ = ["QuantizationRule", "QtRule", "QtProvider", "quantize_model", "to_qtrain_rule",
           "RNG_STREAM"]

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


def quantize_model(model, provider: provider_lib.QtProvider, *model_inputs: Any, **kwargs: Any):
  """qwix's ``quantize_model``: linen as :func:`qtrain.quantize_model`; an nnx model is copied
  first (``nnx.clone``), so the model passed in stays float, as in qwix.

  nnx: ``model_inputs`` are the sample batch of the one eager forward, and stochastic-rounding
  keys come from ``rngs=nnx.Rngs(stochastic_rounding=seed)`` (qwix's ``qwix_rngs`` attribute
  is not read). qwix's ``call_method`` (other than ``"__call__"``) and ``skip_nnx_init`` raise.
  """
  call_method = kwargs.pop("call_method", "__call__")
  if call_method != "__call__":
    raise ValueError(f"call_method={call_method!r}: qtrain intercepts the ops of every method "
                     "of the model; leave call_method at '__call__'")
  if "skip_nnx_init" in kwargs:
    raise ValueError("skip_nnx_init: qtrain's nnx quantize_model runs the sample batch only when "
                     "one is given; pass no model inputs instead")
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
  return model_lib.quantize_model(model, provider, *model_inputs, **kwargs)
