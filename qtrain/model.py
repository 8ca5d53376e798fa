"""``quantize_model`` for flax.linen and flax.nnx, and the per-op summary.

linen
  ``qmodel = quantize_model(model, provider)`` returns a
  :class:`QtLinenModel`, a linen Module that shares ``model``'s scope (the
  parameter tree is the float model's, plus any learned activation
  scales/shifts) and calls it inside a scoped, thread-local interception
  (:mod:`qtrain._intercept`). Use it like the float model: ``qmodel.init``,
  ``qmodel.apply``, ``TrainState.create(apply_fn=qmodel.apply, ...)``.
  Which operand is the weight: for ``Dense``, ``DenseGeneral``, ``Conv`` and
  ``Einsum`` the kernel by the layer's calling convention; for a user's own
  module, the operand that *is* one of the module's parameters. Static
  activation scales live in the ``"quant_stats"`` collection and are updated
  when it is mutable (``apply(..., mutable=["quant_stats"])``: calibrate),
  frozen otherwise.

nnx
  ``quantize_model(model, provider, *sample_args, rngs=...)`` modifies
  ``model`` **in place** (``nnx.clone`` it first to keep a float copy) and
  returns it. Flax's nnx layers take their op as a per-instance attribute
  (``Linear.dot_general``, ``LinearGeneral.dot_general``,
  ``Conv.conv_general_dilated``, ``Einsum.einsum_op``); for each layer a
  rule matches, that attribute is replaced by a :class:`QtOp` (an
  ``nnx.Module`` holding the op's state as nnx Variables:
  :class:`ActScale`, :class:`ActShift`, :class:`QuantStat`). No global
  state is involved. A user's nnx module is quantized the same way when it
  keeps ``self.dot_general = jax.lax.dot_general`` (or ``einsum_op`` /
  ``conv_general_dilated``) and calls it with the weight as the second
  operand; modules that call ``jax.lax`` directly are not intercepted under
  nnx (``quantize_model`` warns when a rule matches such a module).
  ``MultiHeadAttention``'s projections are quantized; its attention einsums
  (activation x activation) stay float. Rules with state (static or learned
  activation scales) need ``sample_args``: one eager forward creates the
  state (learned scales initialise from that batch).
  Calibrate vs frozen: :func:`set_calibrate`.

Example (linen):
  >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
  >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
  >>> qmodel = qtrain.quantize_model(model, qtrain.QtProvider(
  ...     [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]))
  >>> x = jnp.ones((2, 16))
  >>> variables = qmodel.init(jax.random.key(0), x)
  >>> qmodel.apply(variables, x).shape
  (2, 4)

Example (nnx):
  >>> from flax import nnx
  >>> m = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  >>> m = qtrain.quantize_model(m, qtrain.QtProvider(
  ...     [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]))
  >>> m(jnp.ones((2, 16))).shape
  (2, 4)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx
from flax.core import meta

from qtrain import _intercept
from qtrain import provider as provider_lib

# ---------------------------------------------------------------------------
# linen


class QtLinenModel(nn.Module):
  """A linen model whose ops are quantized per ``provider`` (see :func:`quantize_model`).

  Shares the wrapped model's scope, so variables keep the float model's
  paths. ``__call__`` forwards to ``model.__call__``.
  """

  model: nn.Module
  provider: Any

  def setup(self):
    nn.share_scope(self, self.model)

  def __call__(self, *args, **kwargs):
    own = tuple(self.path)
    with _intercept.linen_scope(self.provider, rename=(own + ("model",), own)):
      return self.model(*args, **kwargs)


# linen layers whose weight operand is known by their calling convention.
_LINEN_RHS_WEIGHT = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Einsum)
# linen layers whose own ops have no weight operand (activation x activation).
_LINEN_NO_WEIGHT = (nn.MultiHeadDotProductAttention,)
NO_WEIGHT_BY_DESIGN = -1


def linen_weight_operand(module, op_name: str, operands) -> int | None:
  """Index of the weight operand: by calling convention, else by parameter identity."""
  if isinstance(module, _LINEN_RHS_WEIGHT):
    return 1
  if isinstance(module, _LINEN_NO_WEIGHT):
    return NO_WEIGHT_BY_DESIGN
  try:
    params = module.variables.get("params", {})
  except Exception:  # pragma: no cover - unbound module
    return None
  leaves = jax.tree.leaves(meta.unbox(params))
  hits = [i for i, o in enumerate(operands) if any(o is leaf for leaf in leaves)]
  if len(hits) == 1:
    return hits[0]
  return None


class LinenHost:
  """An op's state in the calling linen module's scope (names prefixed by op id)."""

  def __init__(self, module, op_id: str):
    self.module = module
    self.op_id = op_id
    self.initializing = module.is_initializing()
    self.calibrating = (not self.initializing) and module.is_mutable_collection("quant_stats")

  def param(self, name, init_fn):
    return self.module.scope.param(f"{self.op_id}_{name}", lambda *_: init_fn())

  def stat(self, name, init_fn):
    return self.module.scope.variable("quant_stats", f"{self.op_id}_{name}", init_fn).value

  def set_stat(self, name, value):
    self.module.scope.put_variable("quant_stats", f"{self.op_id}_{name}", value)

  def rng_key(self, stream, what):
    if not self.module.scope.has_rng(stream):
      return None  # forward-only use is fine; a gradient raises missing_rng_message
    return self.module.make_rng(stream)

  def missing_rng_message(self, stream, what):
    return (f"qtrain: {what} needs keys from the Flax RNG stream {stream!r} for its gradient, "
            f"which this apply was not given: call apply(..., rngs={{{stream!r}: key}}) (fold "
            "the step into the key so each step differs)")


# ---------------------------------------------------------------------------
# nnx


class QuantStat(nnx.Variable):
  """nnx state of a static activation scale (not trained; updated while calibrating)."""


class ActScale(nnx.Param):
  """A learned activation scale (bitorch-engine's ``scale_a``); trained by optax."""


class ActShift(nnx.Param):
  """A learned per-input-feature activation shift (bitorch-engine's ``bias_a``)."""


_STATE_TYPES = {"act_scale": ActScale, "act_shift": ActShift}


def _vget(v):
  return v.get_value() if hasattr(v, "get_value") else v.value


def _vset(v, x):
  if hasattr(v, "set_value"):
    v.set_value(x)
  else:  # pragma: no cover
    v.value = x


class _NnxHost:

  def __init__(self, op: "QtOp"):
    self.op = op
    self.initializing = op.initializing
    self.calibrating = op.calibrate and not op.initializing

  def _get_or_create(self, name, init_fn, cls):
    v = getattr(self.op, name, None)
    if v is None:
      if not self.initializing:
        raise ValueError(
            f"qtrain: the op in nnx module {self.op.path!r} keeps state {name!r} (static or "
            "learned activation scale) that was never created: pass sample inputs to "
            "qtrain.quantize_model(model, provider, *sample_args)")
      v = cls(init_fn())
      setattr(self.op, name, v)
    return _vget(v)

  def param(self, name, init_fn):
    return self._get_or_create(name, init_fn, _STATE_TYPES[name])

  def stat(self, name, init_fn):
    return self._get_or_create(name, init_fn, QuantStat)

  def set_stat(self, name, value):
    _vset(getattr(self.op, name), value)

  def rng_key(self, stream, what):
    rng = getattr(self.op, "rng", None)
    return None if rng is None else rng()

  def missing_rng_message(self, stream, what):
    return (f"qtrain: {what} needs keys from the RNG stream {stream!r}: pass "
            f"rngs=nnx.Rngs({stream}=seed) to qtrain.quantize_model")


class QtOp(nnx.Module):
  """The quantized op an nnx layer calls in place of its ``dot_general`` / ``einsum_op`` /
  ``conv_general_dilated`` attribute. Holds the op's state (nnx Variables).

  Attributes:
    path: the layer's module path (what rules matched).
    op_name: ``dot_general``, ``einsum`` or ``conv_general_dilated``.
    calibrate: update static activation scales on each call (see
      :func:`set_calibrate`).
  """

  def __init__(self, *, provider, path: str, op_name: str, original, rng=None):
    self.provider = provider
    self.path = path
    self.op_name = op_name
    self.original = original
    self.calibrate = True
    self.initializing = False
    if rng is not None:
      self.rng = rng

  def __call__(self, *args, **kwargs):
    host = _NnxHost(self)
    op_id = f"{self.op_name}0"
    if self.op_name == "dot_general":
      return self.provider.dot_general(host, self.path, op_id, *args, weight_operand=1,
                                       fallback=self.original, **kwargs)
    if self.op_name == "einsum":
      subscripts, *operands = args
      return self.provider.einsum(host, self.path, op_id, subscripts, operands, kwargs,
                                  weight_operand=1, fallback=self.original)
    return self.provider.conv_general_dilated(host, self.path, op_id, *args, weight_operand=1,
                                              fallback=self.original, **kwargs)


def _nnx_hook(node) -> tuple[str, str] | None:
  """(attribute, op name) of an nnx module's injectable op, if it has one."""
  if isinstance(node, QtOp):
    return None
  for attr, op_name, orig in (("dot_general", "dot_general", jax.lax.dot_general),
                              ("einsum_op", "einsum", jnp.einsum),
                              ("conv_general_dilated", "conv_general_dilated",
                               jax.lax.conv_general_dilated)):
    if attr not in vars(node):
      continue
    v = vars(node)[attr]
    if isinstance(v, QtOp):
      raise ValueError(f"module {type(node).__name__} is already quantized ({attr} is a QtOp)")
    if attr == "dot_general" and getattr(node, "dot_general_cls", None) is not None:
      return None
    if v is None and isinstance(node, nnx.LinearGeneral):
      return attr, op_name
    if v is orig or v is _intercept.original(op_name):
      return attr, op_name
  return None


def _owns_params(node) -> bool:
  return any(isinstance(v, nnx.Param) for v in vars(node).values())


def _quantize_nnx(model, provider, sample_args, sample_kwargs, rngs):
  stream = None
  if rngs is not None:
    try:
      stream = rngs[provider.rng_stream]
    except (KeyError, AttributeError):
      stream = None
  plan = []
  for path, node in list(nnx.iter_graph(model)):
    if not isinstance(node, nnx.Module) or isinstance(node, QtOp):
      continue
    pstr = "/".join(str(p) for p in path)
    hook = _nnx_hook(node)
    if hook is None:
      if _owns_params(node):
        hit = [i for i, r in enumerate(provider.rules) if r.quantizes and
               any(r.matches(pstr, o) for o in ("dot_general", "einsum", "conv_general_dilated"))]
        if hit:
          provider.warn_once((pstr, "nnx-no-hook"),
                             f"qtrain: nnx module {pstr!r} ({type(node).__name__}) matches "
                             f"rules[{hit[0]}] but has no dot_general/einsum_op/"
                             "conv_general_dilated attribute to replace: its calls to jax.lax / "
                             "jnp are not quantized")
      continue
    attr, op_name = hook
    m = provider.match(pstr, op_name)
    if m is None or not m[1].quantizes:
      provider.note_skipped(pstr, f"{op_name}0", op_name,
                            provider_lib.FLOAT_NO_RULE if m is None else provider_lib.FLOAT_RULE)
      continue
    if m[1].needs_rng and stream is None:
      raise ValueError(
          f"qtrain: rules[{m[0]}] (bwd_stochastic_rounding={m[1].bwd_stochastic_rounding!r}) "
          f"matches {pstr!r} and needs keys from the RNG stream {provider.rng_stream!r}: pass "
          f"rngs=nnx.Rngs({provider.rng_stream}=seed) to qtrain.quantize_model")
    plan.append((node, attr, op_name, pstr, m))
  ops = []
  data = getattr(nnx, "data", lambda v: v)
  for node, attr, op_name, pstr, m in plan:
    original = vars(node)[attr]
    if original is None:
      original = _intercept.original(op_name)
    op = QtOp(provider=provider, path=pstr, op_name=op_name, original=original,
              rng=stream if m[1].needs_rng else None)
    setattr(node, attr, data(op))
    ops.append((op, m[1]))
  needs_state = [op.path for op, r in ops if r.has_state]
  if needs_state and not sample_args and not sample_kwargs:
    raise ValueError(f"qtrain: rules with static or learned activation scales match nnx modules "
                     f"{needs_state}: pass sample inputs, quantize_model(model, provider, "
                     "*sample_args), to create their state")
  if sample_args or sample_kwargs:
    for op, _ in ops:
      op.initializing = True
    try:
      model(*sample_args, **sample_kwargs)
    finally:
      for op, _ in ops:
        op.initializing = False
  return model


# ---------------------------------------------------------------------------
# Public entry points.


def quantize_model(model, provider: provider_lib.QtProvider, *sample_args, rngs=None,
                   **sample_kwargs):
  """Returns ``model`` with its matmuls and convolutions quantized per ``provider``.

  Args:
    model: a ``flax.linen.Module`` (unbound) or a ``flax.nnx.Module``.
    provider: a :class:`~qtrain.provider.QtProvider`.
    *sample_args, **sample_kwargs: nnx only: a sample batch for one eager
      forward that creates the ops' state (needed when a rule keeps static
      or learned activation scales; learned scales initialise from it).
    rngs: nnx only: an ``nnx.Rngs`` with a ``"quant"`` stream (needed when a
      rule uses ``bwd_stochastic_rounding``).

  Returns:
    linen: a new :class:`QtLinenModel` (``init``/``apply`` as usual; pass
    ``rngs={"quant": key}`` to ``apply`` for stochastic rounding).
    nnx: ``model`` itself, modified in place.

  What is intercepted:
    * linen: ``jax.lax.dot_general``, ``jnp.einsum`` (two operands) and
      ``jax.lax.conv_general_dilated`` called by ``Dense``, ``DenseGeneral``,
      ``Conv``, ``Einsum``, ``MultiHeadDotProductAttention``'s projections,
      and by a user's own module (the weight is the operand that is one of the
      module's parameters; otherwise the op stays float with a warning).
    * nnx: ``Linear``, ``LinearGeneral``, ``Conv``, ``Einsum``,
      ``MultiHeadAttention``'s projections, and user modules that keep and
      call a ``dot_general`` / ``einsum_op`` / ``conv_general_dilated``
      attribute (weight second).
    * Never: ``x @ w``, ``jnp.dot``, ``jnp.matmul`` (they stay float, exactly),
      calls made inside an inner ``jax.jit`` / ``vmap`` / ``grad`` of a
      module's method (float, so the inner jit's cache stays float), attention
      score/value einsums (activation x activation, float).

  Pitfalls:
    * linen static scales inside ``nn.scan`` need
      ``variable_axes={"quant_stats": 0}``; learned scales follow ``"params"``.
    * nnx: a new ``QtProvider`` is a new static attribute (a retrace under
      ``nnx.jit``); reuse one provider for models that share a jitted step.
    * nnx layers stacked with ``nnx.vmap``/``nnx.scan`` are supported for rules
      without state; static/learned scales and stochastic-rounding streams of
      stacked layers are not (their Variables are created unstacked).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
    >>> rules = [qtrain.QtRule(module_path=r".*", weight_qtype="int4", tile_size=16)]
    >>> qmodel = qtrain.quantize_model(nn.Dense(8), qtrain.QtProvider(rules))
    >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 32)))
    >>> qmodel.apply(v, jnp.ones((2, 32))).shape
    (2, 8)
  """
  if not isinstance(provider, provider_lib.QtProvider):
    raise ValueError(f"provider={provider!r} must be a qtrain.QtProvider")
  if isinstance(model, nn.Module):
    if sample_args or sample_kwargs or rngs is not None:
      raise ValueError("linen models take no sample inputs or rngs here: state is created by "
                       "qmodel.init(...), keys come from apply(..., rngs={'quant': key})")
    if isinstance(model, QtLinenModel):
      raise ValueError("model is already quantized")
    if model.scope is not None:
      raise ValueError("pass an unbound linen Module (not one bound to variables)")
    return QtLinenModel(model=model, provider=provider)
  if isinstance(model, nnx.Module):
    return _quantize_nnx(model, provider, sample_args, sample_kwargs, rngs)
  raise ValueError(f"model must be a flax.linen.Module or flax.nnx.Module, got {type(model)}")


def set_calibrate(model, calibrate: bool) -> None:
  """nnx: turns updating of static activation scales on (calibrate) or off (frozen).

  For linen, the switch is the ``"quant_stats"`` collection's mutability:
  ``qmodel.apply(v, x, mutable=["quant_stats"])`` calibrates, a plain
  ``apply`` uses the frozen scales.
  """
  if isinstance(model, nn.Module):
    raise ValueError("linen: calibrate with apply(..., mutable=['quant_stats']); without it the "
                     "static scales are frozen")
  n = 0
  for _, node in nnx.iter_graph(model):
    if isinstance(node, QtOp):
      node.calibrate = bool(calibrate)
      n += 1
  if n == 0:
    raise ValueError("model has no quantized op (was it passed to qtrain.quantize_model?)")


def _provider_of(obj) -> provider_lib.QtProvider:
  if isinstance(obj, provider_lib.QtProvider):
    return obj
  if isinstance(obj, QtLinenModel):
    return obj.provider
  if isinstance(obj, nnx.Module):
    for _, node in nnx.iter_graph(obj):
      if isinstance(node, QtOp):
        return node.provider
    raise ValueError("this nnx model has no quantized op; pass the QtProvider to summary()")
  raise ValueError(f"summary() takes a QtProvider or a quantized model, got {type(obj)}")


def summary(obj) -> str:
  """A table of every intercepted op: module path, op id, matched rule, qtypes, status.

  ``obj`` is a :class:`~qtrain.provider.QtProvider`, a quantized linen model
  or a quantized nnx model. Ops appear once the model has run (``init`` or a
  step). Rules that matched no op raise a ``UserWarning``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
    >>> p = qtrain.QtProvider([qtrain.QtRule(module_path="layers_0", weight_qtype="int8")])
    >>> qm = qtrain.quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), p)
    >>> _ = qm.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> print(qtrain.summary(qm).splitlines()[2].split()[:5])
    ['layers_0', 'dot_general0', '0', 'rhs', 'int8']
  """
  return _provider_of(obj).summary()
