"""``QtProvider``: turns (module path, op, rule) into a quantized-training op.

The provider holds an ordered list of :class:`~qtrain.rules.QtRule`; for
each intercepted op it finds the first matching rule, builds the
:class:`~qtrain.ops.DotGeneralQtConfig` /
:class:`~qtrain.ops.ConvGeneralQtConfig` (forward qtypes of the weight and
activation operands, gradient qtypes, stochastic rounding), reads or updates
the op's Flax state (static activation scales, learned activation scale and
shift) through a small *host* object (one for linen modules, one for nnx
modules), draws stochastic-rounding keys from the RNG stream
:data:`RNG_STREAM` (``"quant"``), and calls :func:`qtrain.ops.dot_general_qt`
or :func:`qtrain.ops.conv_general_qt`.

It never decides which operand is the weight: the interception layer tells
it (from the layer's calling convention, or from the identity of the
module's own parameter), see :mod:`qtrain.flax.model`.

Every op it sees is recorded (path, op id, matched rule, qtypes, status) for
:func:`qtrain.summary`.

Example:
  >>> import qtrain
  >>> p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8")])
  >>> p.match("Dense_0", "dot_general")[0]
  0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp

from qtrain import _einsum
from qtrain import rules as rules_lib
from qtrain import sparsity as sparsity_lib
from qtrain.core import qarray
from qtrain.core import qdot
from qtrain.core import qtypes
from qtrain.ops import config as cfg_lib
from qtrain.ops import conv_general_qt as _conv_general_qt
from qtrain.ops import dot_general_qt as _dot_general_qt
from qtrain.ops import lora as lora_lib
from qtrain.ops import placement
from qtrain.ops import ragged_dot_qt as _ragged_dot_qt

DROPOUT_STREAM = "dropout"
"""The Flax RNG stream LoRA dropout keys are drawn from (flax's own dropout stream)."""

RNG_STREAM = "quant"
"""The Flax RNG stream stochastic-rounding keys are drawn from.

linen: ``model.apply(variables, x, rngs={"quant": key})`` (fold the step into
the key so every step differs: ``jax.random.fold_in(key, step)``). nnx: pass
``rngs=nnx.Rngs(quant=seed)`` to :func:`qtrain.quantize_model`; the stream's
counter advances on every call.
"""

# Op statuses in the records.
QUANTIZED = "quantized"
FLOAT_NO_RULE = "float: no rule matched"
FLOAT_RULE = "float: rule sets no qtype"
FLOAT_NO_WEIGHT = "float: no weight operand"
FLOAT_UNSUPPORTED = "float: unsupported form"
FLOAT_LORA = "float + LoRA"
FLOAT_NO_QUANTIZED_FORM = "float: qtrain has no quantized form of this op"


class Host(Protocol):
  """Where an op's Flax state lives (a linen module's scope, or an nnx QtOp)."""

  initializing: bool
  calibrating: bool

  def param(self, name: str, init_fn: Callable[[], jax.Array]) -> jax.Array: ...
  def stat(self, name: str, init_fn: Callable[[], jax.Array]) -> jax.Array: ...
  def set_stat(self, name: str, value: jax.Array) -> None: ...
  def rng_key(self, stream: str, what: str) -> jax.Array | None: ...
  def missing_rng_message(self, stream: str, what: str) -> str: ...
  def init_key(self, what: str) -> jax.Array: ...
  def dropout_key(self) -> jax.Array | None: ...


@dataclasses.dataclass(frozen=True)
class OpRecord:
  """One intercepted op, as listed by :func:`qtrain.summary`."""
  path: str
  op_id: str
  op_name: str
  rule_index: int | None
  status: str
  weight_operand: str | None   # "lhs", "rhs" or None
  weight_qtype: str | None
  act_qtype: str | None
  bwd_qtype: str | None
  shapes: tuple = ()
  # How a quantized op used its operands (what qtrain.freeze needs to lay out the weight):
  # ("dot_general", dimension_numbers, operand shapes, operand dtypes) for dot_general and
  # einsum (the dot the einsum became), ("conv_general_dilated", (lhs_spec, rhs_spec,
  # out_spec), feature_group_count, operand shapes, operand dtypes) for convolutions; None
  # for ops left in float.
  contraction: tuple | None = None


def _place(v: jax.Array, ndim: int, axes: Sequence[int]) -> jax.Array:
  """Reshapes ``v`` (shaped like the ``axes`` of an ndim array) to broadcast."""
  shape = [1] * ndim
  for a, n in zip(axes, v.shape):
    shape[a] = n
  return v.reshape(shape)


def _shapes_dtypes(operands) -> tuple:
  return (tuple(tuple(jnp.shape(o)) for o in operands),
          tuple(jnp.dtype(jnp.result_type(o)).name for o in operands))


def init_learned_scale(x: jax.Array, qtype, multiplier: float) -> jax.Array:
  """``multiplier * mean|x| / sqrt(qmax)`` (1.0 where ``x`` is all zeros)."""
  qt = qtypes.get_qtype(qtype)
  m = jnp.mean(jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)))
  s = multiplier * m / math.sqrt(max(float(qt.qmax), 1.0))
  return jnp.where(m > 0, s, 1.0).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_guard(x, message: str):
  """Identity whose gradient raises ``message`` (when it is traced)."""
  return x


def _grad_guard_fwd(x, message):
  return x, None


def _grad_guard_bwd(message, _, g):
  raise ValueError(message)


_grad_guard.defvjp(_grad_guard_fwd, _grad_guard_bwd)


class OpError(ValueError):
  """A ValueError raised while building or running a quantized op, naming its rule and layer."""


def _listing(items: Sequence[str], limit: int = 6) -> str:
  """``['a', 'b'] and 3 more``: a short list for a message."""
  shown = ", ".join(repr(x) for x in items[:limit])
  more = f" and {len(items) - limit} more" if len(items) > limit else ""
  return f"[{shown}]{more}"


class QtProvider:
  """Quantized-training provider: an ordered list of rules (first match wins).

  Args:
    rules: :class:`~qtrain.rules.QtRule` s, most specific first.
    rng_stream: the Flax RNG stream for stochastic rounding (default
      ``"quant"``).

  Use it with :func:`qtrain.quantize_model`. After the model has run (``init``
  or a step), :func:`qtrain.summary` lists what each op got and warns about
  rules that matched nothing.
  """

  def __init__(self, rules: Sequence[rules_lib.QtRule], *, rng_stream: str = RNG_STREAM):
    if isinstance(rules, rules_lib.QtRule):
      rules = [rules]
    rules = tuple(rules)
    for i, r in enumerate(rules):
      if not isinstance(r, rules_lib.QtRule):
        raise ValueError(f"rules[{i}] must be a qtrain.QtRule, got a {type(r).__module__}."
                         f"{type(r).__qualname__} (qwix's rules go to qtrain.qwix.QtProvider)")
    if not isinstance(rng_stream, str) or not rng_stream:
      raise ValueError(f"rng_stream={rng_stream!r} must be a non-empty string")
    self.rules = rules
    self.rng_stream = rng_stream
    self._records: dict[tuple[str, str], OpRecord] = {}
    self._warned: set = set()
    self._rules_checked = False
    self._lock = threading.Lock()

  def __repr__(self):
    return f"QtProvider({len(self.rules)} rules, rng_stream={self.rng_stream!r})"

  # Identity semantics: a provider is a static field of the quantized model.
  __hash__ = object.__hash__

  def __eq__(self, other):
    return self is other

  # ------------------------------------------------------------------ rules

  def match(self, path: str, op_name: str) -> tuple[int, rules_lib.QtRule] | None:
    """The first rule matching ``(path, op_name)``, with its index."""
    return rules_lib.first_match(self.rules, path, op_name)

  @property
  def needs_rng(self) -> bool:
    return any(r.needs_rng for r in self.rules)

  # ---------------------------------------------------------------- records

  def record(self, rec: OpRecord) -> None:
    with self._lock:
      self._records[(rec.path, rec.op_id)] = rec

  def records(self) -> list[OpRecord]:
    """Every op seen so far (one entry per module path and op id)."""
    with self._lock:
      return list(self._records.values())

  def unused_rules(self) -> list[tuple[int, rules_lib.QtRule]]:
    """Rules that matched no op seen so far."""
    used = {r.rule_index for r in self.records()}
    return [(i, r) for i, r in enumerate(self.rules) if i not in used]

  def unused_rule_messages(self, ops: Sequence[tuple[str, str]]) -> list[tuple[int, str]]:
    """``(rule index, message)`` for each rule that is the first match of none of ``ops``.

    ``ops`` are ``(module path, op name)`` pairs (every op of a model). The
    message names the likely mistake: paths the regex finds with
    ``re.search`` but does not ``re.fullmatch`` (module_path is fullmatched),
    ops the path matches but ``op_names`` excludes, ops an earlier rule takes.
    """
    ops = sorted(set(ops))
    used = set()
    for path, op_name in ops:
      m = self.match(path, op_name)
      if m is not None:
        used.add(m[0])
    out = []
    for i, r in enumerate(self.rules):
      if i in used:
        continue
      msg = f"qtrain: rules[{i}] (module_path={r.module_path!r}, {r.short()}) matched no op"
      taken = sorted({p for p, o in ops if r.matches(p, o)})
      near = sorted({p for p, _ in ops if r.near_miss(p)})
      other_op = sorted({f"{p} ({o})" for p, o in ops
                         if r.op_names is not None and o not in r.op_names and
                         r.matches(p, r.op_names[0])})
      if taken:
        msg += f"; earlier rules match first on {_listing(taken)}"
      if near:
        msg += (f"; module_path is re.fullmatch-ed against the whole path, and only "
                f"re.search finds it in {_listing(near)} (e.g. module_path="
                f"{'.*' + r.module_path + '.*'!r})")
      if other_op:
        msg += f"; op_names={r.op_names} excludes {_listing(other_op)}"
      if not ops:
        msg += " (the model has no op qtrain can intercept)"
      out.append((i, msg))
    return out

  @property
  def rules_checked(self) -> bool:
    """Whether :meth:`warn_unused_rules_once` has run (it checks once per provider)."""
    return self._rules_checked

  def warn_unused_rules_once(self, ops: Sequence[tuple[str, str]], *, stacklevel: int = 4) -> None:
    """Warns about the rules that match none of ``ops``, the first time it is called.

    Called when the model first runs (the end of a linen model's first call;
    nnx's ``quantize_model``), when every op of the model is known.
    """
    with self._lock:
      if self._rules_checked:
        return
      self._rules_checked = True
    for i, msg in self.unused_rule_messages(ops):
      self.warn_once(("unused-rule", i), msg, stacklevel=stacklevel)

  def warn_once(self, key, message: str, *, stacklevel: int = 3) -> None:
    with self._lock:
      if key in self._warned:
        return
      self._warned.add(key)
    warnings.warn(message, stacklevel=stacklevel)

  @contextlib.contextmanager
  def _naming(self, m, op_name: str, path: str):
    """Re-raises a ValueError from building or running a quantized op with its rule and layer."""
    try:
      yield
    except OpError:
      raise
    except ValueError as e:
      msg = str(e).removeprefix("qtrain: ")
      raise OpError(f"qtrain: rules[{m[0]}] (module_path={m[1].module_path!r}) on {op_name} in "
                    f"module {path!r}: {msg}") from e

  def _rec(self, path, op_id, op_name, m, status, w_idx, shapes, contraction=None):
    rule = m[1] if m else None
    quant = status == QUANTIZED
    self.record(OpRecord(
        path=path, op_id=op_id, op_name=op_name, rule_index=m[0] if m else None, status=status,
        weight_operand=None if (w_idx is None or w_idx < 0) else ("lhs", "rhs")[w_idx],
        weight_qtype=rule.weight_qtype if (quant and rule) else None,
        act_qtype=rule.act_qtype if (quant and rule) else None,
        bwd_qtype=rule.bwd_qtype if (quant and rule) else None,
        shapes=tuple(tuple(s) for s in shapes), contraction=contraction))

  def note_skipped(self, path: str, op_id: str, op_name: str, status: str, shapes=()) -> None:
    """Records an op left in float by the interception layer (and warns if a rule wanted it)."""
    m = self.match(path, op_name)
    self._rec(path, op_id, op_name, m, status, None, shapes)
    if m is not None and m[1].active:
      self.warn_once((path, op_id, status),
                     f"qtrain: {op_name} in module {path!r} matches rules[{m[0]}] but stays in "
                     f"float ({status})")

  def _no_weight(self, path, op_id, op_name, m, weight_operand, shapes):
    self._rec(path, op_id, op_name, m, FLOAT_NO_WEIGHT, None, shapes)
    if weight_operand is None or weight_operand >= 0:  # not a weightless layer by design
      self.warn_once((path, op_id, "no-weight"),
                     f"qtrain: {op_name} in module {path!r} matches rules[{m[0]}] but no operand "
                     "is one of the module's parameters (e.g. a cast or sliced weight, or two "
                     "activations), so it stays in float")

  # -------------------------------------------------------------- configs

  def _operand(self, rule, *, weight: bool, given_scale: bool, conv: bool):
    qt = rule.weight_qtype if weight else rule.act_qtype
    if qt is None:
      return None
    channelwise, tile_size = rule.granularity(weight=weight)
    return cfg_lib.OperandQuant(
        qtype=qt,
        calibration=rule.weight_calibration_method if weight else rule.act_calibration_method,
        channelwise=channelwise,
        tile_size=None if (conv or (given_scale and not weight)) else tile_size,
        estimator=rule.weight_estimator if weight else rule.act_estimator,
        scale_grad=(rule.act_scale_grad if (not weight and rule.act_learnable_scale) else "lsq"),
        axis_names=rule.weight_axis_names if weight else rule.act_axis_names)

  def _grad(self, rule, *, weight: bool = False):
    """The gradient's quantization in the product giving the weight's gradient
    (``weight=True``) or the activation's."""
    if rule.bwd_qtype is None:
      return None
    return cfg_lib.GradQuant(qtype=rule.bwd_qtype, calibration=rule.bwd_calibration_method,
                             stochastic_rounding=rule.bwd_stochastic_rounding,
                             axis_names=(rule.bwd_weight_grad_axis_names if weight else
                                         rule.bwd_act_grad_axis_names),
                             tile_size=(rule.bwd_weight_grad_tile_size if weight else
                                        rule.bwd_act_grad_tile_size))

  def _act_state(self, host: Host, rule, act, contract_axes):
    """Applies the learned shift; returns (act, act_scale or None)."""
    scale = None
    if rule.act_learnable_shift:
      shape = tuple(act.shape[a] for a in contract_axes)
      shift = host.param("act_shift", lambda: jnp.zeros(shape, jnp.float32))
      act = act + _place(jnp.asarray(shift), act.ndim, contract_axes).astype(act.dtype)
    if rule.act_learnable_scale:
      scale = host.param("act_scale",
                         lambda: init_learned_scale(act, rule.act_qtype, rule.act_scale_init))
    elif rule.act_static_scale:
      scale = jax.lax.stop_gradient(self._static_scale(host, rule, act))
    return act, scale

  def _static_scale(self, host: Host, rule, x):
    """The static activation scale (per tensor); ``(scale, zero point)`` for ``minmax``."""
    if rule.act_calibration_method.is_asymmetric:
      return self._static_minmax(host, rule, x)
    spec = qarray.QuantizeSpec(qtype=rule.act_qtype, channelwise_axes=(),
                               calibration=rule.act_calibration_method,
                               axis_names=rule.act_axis_names)
    cur = qarray.calibrate(jax.lax.stop_gradient(x), spec)[0].reshape(())
    scale = host.stat("act_static_scale", lambda: jnp.zeros((), jnp.float32))
    count = host.stat("act_static_count", lambda: jnp.zeros((), jnp.float32))
    if host.calibrating:
      if rule.act_static_scale_averaging == "ema":
        d = rule.act_static_scale_ema_decay
        new = jnp.where(count > 0, d * scale + (1 - d) * cur, cur)
      else:
        new = scale + (cur - scale) / (count + 1)
      host.set_stat("act_static_scale", new)
      host.set_stat("act_static_count", count + 1)
      return new
    # Frozen: the stored scale; before any calibration batch, this batch's scale.
    return jnp.where(count > 0, scale, cur)

  def _static_minmax(self, host: Host, rule, x):
    """An asymmetric static scale: the averaged ends ``min(x, 0)``, ``max(x, 0)`` of the
    calibration batches (kept next to the count), made a scale and zero point by ``minmax``."""
    lo, hi = qarray.minmax_bounds(jax.lax.stop_gradient(x), rule.act_axis_names)
    s_lo = host.stat("act_static_min", lambda: jnp.zeros((), jnp.float32))
    s_hi = host.stat("act_static_max", lambda: jnp.zeros((), jnp.float32))
    count = host.stat("act_static_count", lambda: jnp.zeros((), jnp.float32))
    if host.calibrating:
      if rule.act_static_scale_averaging == "ema":
        d = rule.act_static_scale_ema_decay
        avg = lambda old, cur: jnp.where(count > 0, d * old + (1 - d) * cur, cur)
      else:
        avg = lambda old, cur: old + (cur - old) / (count + 1)
      lo, hi = avg(s_lo, lo), avg(s_hi, hi)
      host.set_stat("act_static_min", lo)
      host.set_stat("act_static_max", hi)
      host.set_stat("act_static_count", count + 1)
    else:  # frozen: the stored ends; before any calibration batch, this batch's
      lo, hi = jnp.where(count > 0, s_lo, lo), jnp.where(count > 0, s_hi, hi)
    cal = rule.act_calibration_method
    return qarray.minmax_scale(lo, hi, rule.act_qtype, cal.multiplier)

  def _key(self, host: Host, rule, path):
    """(key, error message if the stream is missing) for stochastic rounding.

    Without the stream the forward still runs (evaluation needs no keys);
    a gradient through the op then raises the message (see :func:`_grad_guard`).
    """
    if not rule.needs_rng:
      return None, None
    what = f"{path} (bwd_stochastic_rounding={rule.bwd_stochastic_rounding!r})"
    key = host.rng_key(self.rng_stream, what)
    if key is not None:
      return key, None
    return jax.random.key(0), host.missing_rng_message(self.rng_stream, what)

  # ------------------------------------------------------------------- ops

  def dot_general(self, host: Host, path: str, op_id: str, lhs, rhs, dimension_numbers,
                  precision=None, preferred_element_type=None, *, weight_operand: int | None,
                  fallback: Callable, out_sharding=None, op_name: str = "dot_general",
                  record_shapes=None):
    """A dot_general called by module ``path`` (``weight_operand``: 0, 1 or None)."""
    m = self.match(path, op_name)
    shapes = record_shapes or (jnp.shape(lhs), jnp.shape(rhs))
    def float_call():
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return fallback(lhs, rhs, dimension_numbers, precision=precision,
                      preferred_element_type=preferred_element_type, **kw)
    if m is None or not m[1].active:
      self._rec(path, op_id, op_name, m, FLOAT_NO_RULE if m is None else FLOAT_RULE, weight_operand,
                shapes)
      return float_call()
    if weight_operand is None or weight_operand < 0:
      self._no_weight(path, op_id, op_name, m, weight_operand, shapes)
      return float_call()
    if placement.needs_placement(out_sharding):
      with self._naming(m, op_name, path):
        return placement.as_float_sharded(
            lambda l, r: fallback(l, r, dimension_numbers, precision=precision,
                                  preferred_element_type=preferred_element_type,
                                  **({} if out_sharding is None else
                                     {"out_sharding": out_sharding})),
            lambda l, r: self.dot_general(
                host, path, op_id, l, r, dimension_numbers, precision, preferred_element_type,
                weight_operand=weight_operand, fallback=fallback, op_name=op_name,
                record_shapes=record_shapes), lhs, rhs, out_sharding=out_sharding)
    with self._naming(m, op_name, path):
      rule = m[1]
      dn = qdot.normalize_dimension_numbers(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
      if not rule.quantizes:  # an adapter on the float op
        self._rec(path, op_id, op_name, m, FLOAT_LORA, weight_operand, shapes,
                  ("dot_general", dn, *_shapes_dtypes((lhs, rhs))))
        out = float_call()
        return out + self._lora(host, rule, path, (lhs, rhs)[1 - weight_operand],
                                jnp.shape((lhs, rhs)[weight_operand]), dn, weight_operand, out)
      ops = [lhs, rhs]
      a_idx = 1 - weight_operand
      x_orig = ops[a_idx]
      # N:M sparsity: each operand pruned before it is calibrated and quantized.
      ops[weight_operand] = sparsity_lib.sparsify(
          ops[weight_operand], rule.weight_sparsity, what=f"weight_sparsity of {op_name} in "
          f"module {path!r}")
      ops[a_idx] = sparsity_lib.sparsify(ops[a_idx], rule.act_sparsity,
                                         what=f"act_sparsity of {op_name} in module {path!r}")
      act, act_scale = ops[a_idx], None
      if rule.act_qtype is not None:
        act, act_scale = self._act_state(host, rule, act, dn[0][a_idx])
        ops[a_idx] = act
      w_cfg = self._operand(rule, weight=True, given_scale=False, conv=False)
      a_cfg = self._operand(rule, weight=False, given_scale=act_scale is not None, conv=False)
      g, gw = self._grad(rule), self._grad(rule, weight=True)
      cfg = cfg_lib.DotGeneralQtConfig(
          lhs=w_cfg if weight_operand == 0 else a_cfg, rhs=w_cfg if weight_operand == 1 else a_cfg,
          dlhs_grad=gw if weight_operand == 0 else g, drhs_grad=gw if weight_operand == 1 else g,
          implementation=rule.implementation)
      scales, zero_points = [None, None], [None, None]
      if isinstance(act_scale, tuple):  # an asymmetric static scale: (scale, zero point)
        act_scale, zero_points[a_idx] = act_scale
      scales[a_idx] = act_scale
      self._rec(path, op_id, op_name, m, QUANTIZED, weight_operand, shapes,
                ("dot_general", dn, *_shapes_dtypes(ops)))
      key, missing = self._key(host, rule, path)
      out = _dot_general_qt(ops[0], ops[1], dn, cfg, precision=precision,
                            preferred_element_type=preferred_element_type, key=key,
                            lhs_scale=scales[0], rhs_scale=scales[1],
                            lhs_zero_point=zero_points[0], rhs_zero_point=zero_points[1])
      if rule.has_lora:
        out = out + self._lora(host, rule, path, x_orig, jnp.shape(ops[weight_operand]), dn,
                               weight_operand, out)
      return out if missing is None else _grad_guard(out, missing)

  def _check_no_sparsity(self, m, op_name: str, path: str) -> None:
    rule = m[1]
    if rule.weight_sparsity is not None or rule.act_sparsity is not None:
      raise OpError(f"qtrain: rules[{m[0]}] (module_path={rule.module_path!r}) sets N:M sparsity "
                    f"and matches {op_name} in module {path!r}: sparsity goes on dot_general and "
                    "einsum ops; restrict the rule with op_names=('dot_general', 'einsum')")

  def _lora(self, host: Host, rule, path, x, w_shape, dn, weight_operand, out):
    """The rule's adapter on this op: ``scale * dropout(x) . A . B`` in ``out``'s layout."""
    lay = lora_lib.layout(w_shape, dn, weight_operand=weight_operand)
    what = f"the LoRA adapter of module {path!r}"
    if host.initializing:
      a0, b0 = lora_lib.init(host.init_key(what), lay, rule.lora_rank)
    else:
      a0 = b0 = None
    a = host.param(lora_lib.A_NAME, lambda: a0)
    b = host.param(lora_lib.B_NAME, lambda: b0)
    lora_lib.check_shapes(a, b, lay, what)
    key = host.dropout_key() if rule.lora_dropout > 0 else None
    return lora_lib.delta(x, a, b, lay, scale=rule.lora_scale, dropout=rule.lora_dropout, key=key,
                          dtype=out.dtype)

  def einsum(self, host: Host, path: str, op_id: str, subscripts, operands, kwargs, *,
             weight_operand: int | None, fallback: Callable):
    """A two-operand einsum, computed as one dot_general (never through jnp.einsum's jit)."""
    m = self.match(path, "einsum")
    shapes = tuple(jnp.shape(o) for o in operands)
    if m is None or not m[1].active:
      self._rec(path, op_id, "einsum", m, FLOAT_NO_RULE if m is None else FLOAT_RULE,
                weight_operand, shapes)
      return fallback(subscripts, *operands, **kwargs)
    if weight_operand is None or weight_operand < 0:
      self._no_weight(path, op_id, "einsum", m, weight_operand, shapes)
      return fallback(subscripts, *operands, **kwargs)
    if placement.needs_placement(kwargs.get("out_sharding")):
      rest = {k: v for k, v in kwargs.items() if k != "out_sharding"}
      with self._naming(m, "einsum", path):
        return placement.as_float_sharded(
            lambda *ops: fallback(subscripts, *ops, **kwargs),
            lambda *ops: self.einsum(host, path, op_id, subscripts, ops, rest,
                                     weight_operand=weight_operand, fallback=fallback),
            *operands, out_sharding=kwargs.get("out_sharding"))
    plan = _einsum.parse(subscripts, *shapes) if len(operands) == 2 else None
    extra = {k: v for k, v in kwargs.items()
             if k not in ("precision", "preferred_element_type", "optimize", "_dot_general",
                          "out_sharding") and v is not None}
    if plan is None or extra:
      self._rec(path, op_id, "einsum", m, FLOAT_UNSUPPORTED, weight_operand, shapes)
      self.warn_once((path, op_id, "einsum"),
                     f"qtrain: einsum {subscripts!r} in module {path!r} (rules[{m[0]}]) cannot be "
                     "quantized (needs two operands, no diagonals/broadcasting); it stays in float")
      return fallback(subscripts, *operands, **kwargs)
    with self._naming(m, "einsum", path):
      lhs, rhs = operands

      def dg(l, r, dn):
        return self.dot_general(host, path, op_id, l, r, dn, kwargs.get("precision"),
                                kwargs.get("preferred_element_type"),
                                weight_operand=weight_operand, fallback=jax.lax.dot_general,
                                op_name="einsum", record_shapes=shapes)
      return _einsum.run(plan, lhs, rhs, dg)

  def conv_general_dilated(self, host: Host, path: str, op_id: str, lhs, rhs, window_strides,
                           padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                           feature_group_count=1, batch_group_count=1, precision=None,
                           preferred_element_type=None, *, weight_operand: int | None,
                           fallback: Callable, out_sharding=None):
    """A convolution called by module ``path`` (the weight must be the kernel, ``rhs``)."""
    m = self.match(path, "conv_general_dilated")
    shapes = (jnp.shape(lhs), jnp.shape(rhs))
    if m is not None and m[1].has_lora:
      raise OpError(f"qtrain: rules[{m[0]}] (module_path={m[1].module_path!r}) sets lora_rank="
                    f"{m[1].lora_rank} and matches conv_general_dilated in module {path!r}: LoRA "
                    "adapters go on dot_general and einsum ops; restrict the rule with "
                    "op_names=('dot_general', 'einsum')")
    if m is not None:
      self._check_no_sparsity(m, "conv_general_dilated", path)

    def float_call():
      kw = {} if out_sharding is None else {"out_sharding": out_sharding}
      return fallback(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
                      rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                      feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                      precision=precision, preferred_element_type=preferred_element_type, **kw)
    if m is None or not m[1].quantizes:
      self._rec(path, op_id, "conv_general_dilated", m, FLOAT_NO_RULE if m is None else FLOAT_RULE,
                weight_operand, shapes)
      return float_call()
    if weight_operand != 1:
      self._no_weight(path, op_id, "conv_general_dilated", m, weight_operand, shapes)
      return float_call()
    if placement.needs_placement(out_sharding):
      with self._naming(m, "conv_general_dilated", path):
        return placement.as_float_sharded(
            lambda l, r: fallback(l, r, window_strides, padding, lhs_dilation=lhs_dilation,
                                  rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                                  feature_group_count=feature_group_count,
                                  batch_group_count=batch_group_count, precision=precision,
                                  preferred_element_type=preferred_element_type,
                                  **({} if out_sharding is None else
                                     {"out_sharding": out_sharding})),
            lambda l, r: self.conv_general_dilated(
                host, path, op_id, l, r, window_strides, padding, lhs_dilation, rhs_dilation,
                dimension_numbers, feature_group_count, batch_group_count, precision,
                preferred_element_type, weight_operand=weight_operand, fallback=fallback),
            lhs, rhs, out_sharding=out_sharding)
    with self._naming(m, "conv_general_dilated", path):
      rule = m[1]
      for name, weight in (("weight", True), ("act", False)):
        if rule.granularity(weight=weight)[1] is not None and \
            (rule.weight_qtype if weight else rule.act_qtype) is not None:
          field = "tile_size" if (rule.weight_granularity if weight else rule.act_granularity) \
              is None else f"{name}_granularity"
          raise ValueError(f"{field}={getattr(rule, field)} is set, and convolutions take no "
                           "tile_size (restrict the rule with op_names=('dot_general', 'einsum'))")
      for field in ("bwd_weight_grad_tile_size", "bwd_act_grad_tile_size"):
        if getattr(rule, field) is not None:
          raise ValueError(f"{field}={getattr(rule, field)} is set, and convolutions take no "
                           "tile_size (restrict the rule with op_names=('dot_general', 'einsum'))")
      cdn = jax.lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
      act, act_scale = lhs, None
      if rule.act_qtype is not None:
        act, act_scale = self._act_state(host, rule, lhs, (cdn.lhs_spec[1],))
      cfg = cfg_lib.ConvGeneralQtConfig(
          lhs=self._operand(rule, weight=False, given_scale=act_scale is not None, conv=True),
          rhs=self._operand(rule, weight=True, given_scale=False, conv=True),
          dlhs_grad=self._grad(rule), drhs_grad=self._grad(rule, weight=True),
          implementation=rule.implementation)
      self._rec(path, op_id, "conv_general_dilated", m, QUANTIZED, 1, shapes,
                ("conv_general_dilated", (cdn.lhs_spec, cdn.rhs_spec, cdn.out_spec),
                 int(feature_group_count), *_shapes_dtypes((act, rhs))))
      key, missing = self._key(host, rule, path)
      act_zp = None
      if isinstance(act_scale, tuple):  # an asymmetric static scale: (scale, zero point)
        act_scale, act_zp = act_scale
      out = _conv_general_qt(
          act, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
          feature_group_count, batch_group_count, precision, preferred_element_type, config=cfg,
          key=key, lhs_scale=act_scale, lhs_zero_point=act_zp)
      return out if missing is None else _grad_guard(out, missing)

  def ragged_dot(self, host: Host, path: str, op_id: str, lhs, rhs, group_sizes, *,
                 weight_operand: int | None, float_call: Callable, precision=None,
                 preferred_element_type=None, group_offset=None, out_sharding=None,
                 rhs_layout: tuple[int, int] | None = (0, 1)):
    """A grouped product (``jax.lax.ragged_dot``, or a ``ragged_dot_general`` of the same
    meaning) called by module ``path``: ``lhs`` (M, K) the tokens, ``rhs`` the experts'
    weights (the weight operand must be ``rhs``). ``rhs_layout``: rhs's (group axis,
    contracting axis), ``(0, 1)`` for ragged_dot; None: a form of ``ragged_dot_general``
    qtrain does not take (recorded, float, a warning where a rule matches). ``float_call()``
    runs the original call."""
    m = self.match(path, "ragged_dot")
    shapes = (jnp.shape(lhs), jnp.shape(rhs))
    if m is None or not m[1].active:
      self._rec(path, op_id, "ragged_dot", m, FLOAT_NO_RULE if m is None else FLOAT_RULE,
                weight_operand, shapes)
      return float_call()
    if m[1].has_lora:
      raise OpError(f"qtrain: rules[{m[0]}] (module_path={m[1].module_path!r}) sets lora_rank="
                    f"{m[1].lora_rank} and matches ragged_dot in module {path!r}: LoRA adapters "
                    "go on dot_general and einsum ops; restrict the rule with "
                    "op_names=('dot_general', 'einsum')")
    self._check_no_sparsity(m, "ragged_dot", path)
    if rhs_layout is None:
      self.note_skipped(path, op_id, "ragged_dot", FLOAT_UNSUPPORTED, shapes=shapes)
      return float_call()
    if weight_operand != 1:
      self._no_weight(path, op_id, "ragged_dot", m, weight_operand, shapes)
      return float_call()
    if placement.needs_placement(out_sharding):
      with self._naming(m, "ragged_dot", path):
        return placement.as_float_sharded(
            lambda *_: float_call(),  # the original call, its out_sharding included
            lambda l, r, gs: self.ragged_dot(
                host, path, op_id, l, r, gs, weight_operand=weight_operand,
                float_call=float_call, precision=precision,
                preferred_element_type=preferred_element_type, group_offset=group_offset,
                rhs_layout=rhs_layout), lhs, rhs, group_sizes, out_sharding=out_sharding)
    with self._naming(m, "ragged_dot", path):
      rule = m[1]
      w = rhs
      if tuple(rhs_layout) != (0, 1) and jnp.ndim(rhs) == 3:  # to (G, K, N)
        gax, cax = rhs_layout
        w = jnp.transpose(rhs, (gax, cax, 3 - gax - cax))
      act, act_scale = lhs, None
      if rule.act_qtype is not None and jnp.ndim(lhs) == 2:
        if rule.act_static_scale and rule.act_calibration_method.is_asymmetric:
          raise NotImplementedError(
              f"qtrain: rules[{m[0]}] (act_static_scale=True, act_calibration_method="
              f"{rule.act_calibration_method.method!r}) matches ragged_dot in module {path!r}: "
              "asymmetric (zero-point) static scales are not built for ragged_dot; use a "
              "symmetric calibration (e.g. 'absmax') for it, or keep it float with a rule")
        act, act_scale = self._act_state(host, rule, lhs, (1,))
      cfg = cfg_lib.DotGeneralQtConfig(
          lhs=self._operand(rule, weight=False, given_scale=act_scale is not None, conv=False),
          rhs=self._operand(rule, weight=True, given_scale=False, conv=False),
          dlhs_grad=self._grad(rule), drhs_grad=self._grad(rule, weight=True),
          implementation=rule.implementation)
      self._rec(path, op_id, "ragged_dot", m, QUANTIZED, 1, shapes,
                ("ragged_dot", tuple(rhs_layout), *_shapes_dtypes((act, rhs))))
      key, missing = self._key(host, rule, path)
      out = _ragged_dot_qt(
          act, w, group_sizes, cfg, precision=precision,
          preferred_element_type=preferred_element_type, group_offset=group_offset, key=key,
          lhs_scale=act_scale)
      return out if missing is None else _grad_guard(out, missing)

  # -------------------------------------------------------------- summary

  def summary(self) -> str:
    """A table of every op seen, its rule and qtypes; warns about unused rules."""
    recs = sorted(self.records(), key=lambda r: (r.path, r.op_id))
    for _, msg in self.unused_rule_messages([(r.path, r.op_name) for r in recs]):
      warnings.warn(msg, stacklevel=2)
    if not recs:
      warnings.warn("qtrain: no op recorded yet: run the quantized model once (init or a step) "
                    "before asking for its summary", stacklevel=2)
    head = ("module path", "op id", "rule", "weight", "w qtype", "a qtype", "g qtype", "status")
    rows = [head] + [
        (r.path or "<root>", r.op_id, "-" if r.rule_index is None else str(r.rule_index),
         r.weight_operand or "-", str(r.weight_qtype or "-"), str(r.act_qtype or "-"),
         str(r.bwd_qtype or "-"), r.status) for r in recs]
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
