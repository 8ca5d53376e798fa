"""``quantize_model`` for flax.linen and flax.nnx, and the per-op summary.

linen
  ``qmodel = quantize_model(model, provider)`` returns a
  :class:`QtLinenModel`, a linen Module that shares ``model``'s scope (the
  parameter tree is the float model's, plus any learned activation
  scales/shifts) and calls it inside a scoped, thread-local interception
  (:mod:`qtrain.flax.intercept`). Use it like the float model: ``qmodel.init``,
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
  operand. A user's module that calls ``jnp.einsum``, ``jax.lax.dot_general``,
  ``jax.lax.conv_general_dilated`` or the matmul family (``@``, ``jnp.matmul``,
  ``jnp.dot``, ``jnp.tensordot``, ``jnp.inner``) itself gets a
  subclass whose methods run in an interception frame (linen's,
  :func:`qtrain.flax.intercept.module_frame`): the weight is the operand that
  is one of the module's ``nnx.Param`` s, and each quantized call keeps a
  :class:`QtOp` on the module under its op id (``einsum0``, ``dot_general1``),
  created by the sample forward (a call it did not run raises).
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

import dataclasses
import functools
import threading
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx
from qtrain import provider as provider_lib
from qtrain import rules as rules_lib
from qtrain.flax import hosts
from qtrain.flax import intercept as _intercept

# ---------------------------------------------------------------------------
# linen


class QtLinenModel(nn.Module):
  """A linen model whose ops are quantized per ``provider`` (see :func:`quantize_model`).

  Shares the wrapped model's scope, so variables keep the float model's
  paths. ``__call__`` forwards to ``model.__call__``; ``init`` / ``apply`` with
  ``method=`` (a method name of the model, or a function taking the model, e.g.
  ``Model.decode``) run it on the wrapped model, quantized the same way.
  """

  model: nn.Module
  provider: Any

  def setup(self):
    nn.share_scope(self, self.model)

  def __call__(self, *args, **kwargs):
    return self._run(lambda model: model(*args, **kwargs))

  def _run(self, fn):
    """``fn(model)`` on the wrapped model with its ops quantized."""
    own = tuple(self.path)
    top = _intercept.depth() == 0
    with _intercept.linen_scope(self.provider, rename=(own + ("model",), own)):
      out = fn(self.model)
    if top and not self.provider.rules_checked:
      # Every op of the model has been seen (recorded) by the end of its first call.
      self.provider.warn_unused_rules_once(
          [(r.path, r.op_name) for r in self.provider.records()])
    return out

  def _model_method(self, method):
    """``method`` (flax's ``init`` / ``apply`` argument) as a function of this wrapper that runs
    it on the wrapped model, quantized: a method name of the model, or a function taking the
    model (``Model.decode``, ``lambda m, x: m.encode(x)``)."""
    if method is None or method == "__call__":
      return method
    if isinstance(method, str):
      if not callable(getattr(type(self.model), method, None)):
        raise AttributeError(f"method={method!r}: {type(self.model).__name__} has no such method")
      name = method
      return lambda module, *args, **kwargs: module._run(
          lambda model: getattr(model, name)(*args, **kwargs))
    if not callable(method):
      raise TypeError(f"method={method!r} is neither a method name nor a callable")
    return lambda module, *args, **kwargs: module._run(lambda model: method(model, *args, **kwargs))

  def init(self, rngs, *args, method=None, **kwargs):
    return super().init(rngs, *args, method=self._model_method(method), **kwargs)

  def apply(self, variables, *args, method=None, **kwargs):
    return super().apply(variables, *args, method=self._model_method(method), **kwargs)


# ---------------------------------------------------------------------------
# nnx


class QuantStat(nnx.Variable):
  """nnx state of a static activation scale (not trained; updated while calibrating)."""


class ActScale(nnx.Param):
  """A learned activation scale (bitorch-engine's ``scale_a``); trained by optax."""


class ActShift(nnx.Param):
  """A learned per-input-feature activation shift (bitorch-engine's ``bias_a``)."""


class LoraA(nnx.LoRAParam):
  """A LoRA adapter's down projection ``A`` (K, r); ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``
  trains the adapters alone."""


class LoraB(nnx.LoRAParam):
  """A LoRA adapter's up projection ``B`` (r, N), initialised to zeros."""


_STATE_TYPES = {"act_scale": ActScale, "act_shift": ActShift, "lora_a": LoraA, "lora_b": LoraB}


def variable_get(v):
  """An nnx Variable's value (flax versions with and without ``get_value``)."""
  return v.get_value() if hasattr(v, "get_value") else v.value


def variable_set(v, x) -> None:
  """Sets an nnx Variable's value (flax versions with and without ``set_value``)."""
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
            f"qtrain: the op in nnx module {self.op.path!r} keeps state {name!r} (a static or "
            "learned activation scale, or a LoRA adapter) that was never created: pass sample "
            "inputs to qtrain.quantize_model(model, provider, *sample_args)")
      v = cls(init_fn())
      setattr(self.op, name, v)
    return variable_get(v)

  def param(self, name, init_fn):
    return self._get_or_create(name, init_fn, _STATE_TYPES[name])

  def stat(self, name, init_fn):
    owner = getattr(self.op, "stat_owner", None)
    if owner is None:
      return self._get_or_create(name, init_fn, QuantStat)
    # A provider keeping statistics on the layer (qtrain.qwix: qwix's ``<op id>_lhs`` path).
    full = f"{self.op.op_id}_{name}"
    v = vars(owner).get(full)
    if v is None:
      if not self.initializing:
        raise ValueError(
            f"qtrain: the op in nnx module {self.op.path!r} keeps statistics {full!r} (a static "
            "activation scale) that were never created: pass sample inputs to quantize_model")
      v = QuantStat(init_fn())
      setattr(owner, full, v)
    return variable_get(v)

  def set_stat(self, name, value):
    owner = getattr(self.op, "stat_owner", None)
    if owner is None:
      variable_set(getattr(self.op, name), value)
    else:
      variable_set(vars(owner)[f"{self.op.op_id}_{name}"], value)

  def rng_key(self, stream, what):
    rng = getattr(self.op, "rng", None)
    return None if rng is None else rng()

  def missing_rng_message(self, stream, what):
    return (f"qtrain: {what} needs keys from the RNG stream {stream!r}: pass "
            f"rngs=nnx.Rngs({stream}=seed) to qtrain.quantize_model")

  def init_key(self, what):
    rng = getattr(self.op, "lora_init_rng", None)
    if rng is None:
      raise ValueError(f"qtrain: {what} is initialised from the 'params' RNG stream: pass "
                       "rngs=nnx.Rngs(params=seed) to qtrain.quantize_model")
    return rng()

  def dropout_key(self):
    rng = getattr(self.op, "lora_dropout_rng", None)
    if rng is None or self.op.deterministic:
      return None
    return rng()


class QtOp(nnx.Module):
  """The quantized op an nnx layer calls in place of its ``dot_general`` / ``einsum_op`` /
  ``conv_general_dilated`` attribute. Holds the op's state (nnx Variables).

  Attributes:
    path: the layer's module path (what rules matched).
    op_name: ``dot_general``, ``einsum`` or ``conv_general_dilated``.
    calibrate: update static activation scales on each call (see
      :func:`set_calibrate`).
    deterministic: no LoRA dropout (``model.eval()`` sets it, ``model.train()``
      clears it, as for ``nnx.Dropout``).
  """

  def __init__(self, *, provider, path: str, op_name: str, original, rng=None,
               op_id: str | None = None, weight_param: str | None = None):
    self.provider = provider
    self.path = path
    self.op_name = op_name
    # ``<op name><n>``: the n-th such call of the module (a direct call; 0 for a layer's op).
    self.op_id = op_id or f"{op_name}0"
    # A direct call's weight: the name of the module's parameter the sample forward saw as its
    # weight operand (each later call must take the same one); None for a layer's op.
    self.weight_param = weight_param
    self.original = original
    self.calibrate = True
    self.deterministic = False
    self.initializing = False
    if rng is not None:
      self.rng = rng

  @property
  def disable_quant_stats_update(self) -> bool:
    """qwix's name for ``not calibrate``: ``model.set_attributes(disable_quant_stats_update=True)``
    freezes the static activation scales, as in qwix."""
    return not self.calibrate

  @disable_quant_stats_update.setter
  def disable_quant_stats_update(self, value: bool) -> None:
    self.calibrate = not bool(value)

  def __call__(self, *args, **kwargs):
    # The provider's own jax.lax / jnp calls must not reach a frame of the calling module.
    with _intercept.sentinel():
      return self._call(*args, **kwargs)

  def _call(self, *args, **kwargs):
    host = _NnxHost(self)
    op_id = self.op_id
    if self.initializing and _observed.shapes is not None:
      _observed.shapes[(self.path, op_id)] = jnp.shape(_weight_arg(self.op_name, args))
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


# Flax's own nnx layers that compute a matmul or a convolution. One whose op cannot be replaced
# (a custom dot_general, dot_general_cls, ConvTranspose) is worth a warning; Flax's other layers
# with parameters (norms, Embed, BatchNorm, ...) have no such op, and are passed silently.
_FLAX_OP_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum)


def _is_flax_layer(node) -> bool:
  return type(node).__module__.split(".")[0] == "flax"


def _declared_kernel_shape(node) -> tuple[int, ...] | None:
  """The kernel shape a Flax layer declares (its constructor's arguments), or None."""
  if isinstance(node, nnx.Linear):
    return (node.in_features, node.out_features)
  if isinstance(node, nnx.LinearGeneral):
    return (*node.batch_axis.values(), *node.in_features, *node.out_features)
  if isinstance(node, (nnx.Conv, nnx.Einsum)):
    return tuple(node.kernel_shape)
  return None


def _declared_stack_shape(node) -> tuple[int, ...] | None:
  """A Flax layer's stack shape: its kernel's leading axes beyond the declared kernel shape.

  ``()`` for a plain layer, ``(n,)`` for a layer created under ``nnx.vmap`` (n layers), None
  when the layer is not one of Flax's or its kernel does not end with the declared shape.
  """
  decl = _declared_kernel_shape(node)
  kernel = vars(node).get("kernel")
  if decl is None or not isinstance(kernel, nnx.Variable):
    return None
  shape = tuple(jnp.shape(variable_get(kernel)))
  n = len(shape) - len(decl)
  if n < 0 or shape[n:] != tuple(decl):
    return None
  return shape[:n]


def _observed_stack_shape(node, weight_shape) -> tuple[int, ...] | None:
  """A module's stack shape from the weight operand its op saw in the sample forward.

  The weight operand is one of the module's parameters, sliced by the nnx.scan / nnx.vmap that
  runs the stack: a parameter of exactly that shape means no stacking; otherwise the leading
  axes of the one parameter that ends with that shape. None when that is ambiguous.
  """
  shapes = [tuple(jnp.shape(variable_get(v))) for v in vars(node).values() if isinstance(v, nnx.Param)]
  weight_shape = tuple(weight_shape)
  if weight_shape in shapes:
    return ()
  lead = {s[:len(s) - len(weight_shape)] for s in shapes
          if len(s) > len(weight_shape) and s[len(s) - len(weight_shape):] == weight_shape}
  return lead.pop() if len(lead) == 1 else None


def _op_stream(stream, stack: tuple[int, ...], tag: str):
  """An op's own stochastic-rounding stream, stacked like its layer.

  One key is drawn from ``stream`` and split over ``stack``
  (``jax.random.split(key, stack)``); layer i's call j then uses
  ``fold_in(keys[i], j)`` (nnx.RngStream's counter, stacked too). nnx.scan /
  nnx.vmap slice the keys and counters with the layer's parameters.
  """
  return nnx.RngStream(jax.random.split(stream(), stack), tag=tag)


_OP_STATE = ("act_static_scale", "act_static_count", "act_scale", "act_shift", "lora_a", "lora_b")


def _weight_arg(op_name: str, args) -> Any:
  return args[2] if op_name == "einsum" else args[1]


class _Observed(threading.local):
  """quantize_model's sample forward, while it runs: the weight operand shapes the QtOps see
  (by (path, op id)), and the provider whose direct-call ops it may create."""
  shapes: dict | None = None
  provider: Any = None


_observed = _Observed()


# ---------------------------------------------------------------------------
# Direct calls: jnp.einsum / jax.lax.dot_general / conv_general_dilated / @ / jnp.dot ... in a
# user's module.


@dataclasses.dataclass(frozen=True)
class _Direct:
  """What the frames of a user nnx module need (a static attribute of the module)."""
  provider: Any
  path: str
  # Op ids a layer-style op attribute of the module takes (its ``dot_general0``): direct calls
  # of that op are numbered from 1.
  counters: tuple = ()
  # ``sites(frame, op_name, op_id, operands) -> (host, weight operand)`` (:class:`Frame`'s);
  # None: a QT model's, :func:`_direct_site`. A frozen model's direct calls have their own
  # (:mod:`qtrain.freeze`), which hands each call to its frozen op.
  sites: Callable | None = None


_DIRECT_ATTR = "_qtrain_direct"
_FLOAT_CLASS_ATTR = "_qtrain_float_class"


class _FloatHost:
  """The host of a direct call that stays float: the provider reads no state for it."""
  initializing = False
  calibrating = False

  def _never(self, *args, **kwargs):
    raise AssertionError("qtrain: a direct call left in float asked its host for state")

  param = stat = set_stat = rng_key = missing_rng_message = init_key = dropout_key = _never


_FLOAT_HOST = _FloatHost()


def _direct_site(frame, op_name: str, op_id: str, operands) -> tuple[Any, int | None]:
  """Where a user nnx module's direct call keeps its state, and which operand is its weight.

  The state is the QtOp at the module's attribute named by the op id (``einsum0``: its first
  ``jnp.einsum`` call), created by quantize_model's sample forward for each call a rule
  quantizes. A call that needs one and has none (it did not run in the sample forward), or a
  call that takes another weight than it took there, raises: never float in silence.
  """
  module, path, provider = frame.module, frame.path, frame.provider
  w, param = hosts.nnx_weight_operand(module, operands)
  shape = None if w is None else tuple(jnp.shape(operands[w]))
  where = f"the {op_name} call {op_id!r} of nnx module {path!r} ({_what(module)})"
  op = vars(module).get(op_id)
  if op is not None and not isinstance(op, QtOp):
    raise ValueError(f"qtrain: {where} keeps its quantized op under the attribute {op_id!r}, "
                     f"which the module already uses (a {type(op).__name__}): rename it")
  if isinstance(op, QtOp):
    if param != op.weight_param:
      now = ("no operand is one of its parameters" if param is None
             else f"it takes parameter {param!r}")
      raise ValueError(
          f"qtrain: {where} took parameter {op.weight_param!r} as its weight in quantize_model's "
          f"sample forward, and now {now}: a module's direct calls are told apart by their "
          "order (op ids count each op's calls), so they must run in the sample forward's "
          "order with the same weights; keep other code paths in other modules or methods "
          "that the sample forward runs too")
    if op.initializing and _observed.shapes is not None:
      _observed.shapes[(path, op_id)] = shape
    return _NnxHost(op), w
  m = provider.match(path, op_name)
  if m is None or not m[1].active or w is None:
    return _FLOAT_HOST, w
  if m[1].has_lora:
    raise ValueError(
        f"qtrain: rules[{m[0]}] (lora_rank={m[1].lora_rank}) matches {where}: LoRA adapters on "
        "an nnx module's direct calls are not supported (lora.merge and freeze would not see "
        "them); compute the product with nnx.Linear / nnx.Einsum, keep the op as an attribute "
        "(self.dot_general = jax.lax.dot_general), or exclude it from the rule")
  if _observed.provider is not provider:
    raise ValueError(
        f"qtrain: rules[{m[0]}] matches {where}, which did not run in quantize_model's sample "
        "forward, so it has no quantized op (its state and keys are made there): pass sample "
        "inputs that run this code path, quantize_model(model, provider, *sample_args), or keep "
        f"the call in float with a first rule that sets no qtype, QtRule(module_path={path!r}, "
        f"op_names=({op_name!r},))")
  op = QtOp(provider=provider, path=path, op_name=op_name, original=_intercept.original(op_name),
            op_id=op_id, weight_param=param)
  op.initializing = True
  setattr(module, op_id, getattr(nnx, "data", lambda v: v)(op))
  _observed.shapes[(path, op_id)] = shape
  return _NnxHost(op), w


def _not_ours(klass: type) -> bool:
  """A class of Flax, JAX or Python itself (not the user's)."""
  return klass.__module__.split(".")[0] in ("flax", "jax", "builtins", "typing", "abc")


def _framed_method(fn: Callable) -> Callable:
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    d = vars(self).get(_DIRECT_ATTR)
    if d is None:
      return fn(self, *args, **kwargs)
    with _intercept.module_frame(self, d.provider, d.path, d.sites or _direct_site,
                                 dict(d.counters)):
      return fn(self, *args, **kwargs)
  return method


def _passing_method(fn: Callable) -> Callable:
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    if _intercept.depth() == 0:
      return fn(self, *args, **kwargs)
    with _intercept.sentinel():  # its ops are its own (hooked, or float): not the caller's
      return fn(self, *args, **kwargs)
  return method


_FRAMED_CLASSES: dict[tuple[type, bool], type] = {}
_framed_lock = threading.Lock()


def _framed_class(cls: type, user: bool) -> type:
  """``cls`` with its methods in frames: a user's module's methods (``__call__`` and every
  method its own classes define) run in a frame of the module, whose direct calls are
  quantized; a Flax module's ``__call__`` lets the ops it makes pass (its op attributes keep
  their hooks), so they are not taken for those of a user's module that calls it."""
  with _framed_lock:
    key = (cls, user)
    if key in _FRAMED_CLASSES:
      return _FRAMED_CLASSES[key]
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
          _FLOAT_CLASS_ATTR: cls}
    if user:
      names = {"__call__"} | {n for k in cls.__mro__ if not _not_ours(k)
                              for n, v in vars(k).items()
                              if isinstance(v, types.FunctionType) and not n.startswith("__")}
      for n in sorted(names):
        fn = getattr(cls, n, None)
        if isinstance(fn, types.FunctionType):
          ns[n] = _framed_method(fn)
    else:
      ns["__call__"] = _passing_method(cls.__call__)
    framed = type(cls)(cls.__name__, (cls,), ns)
    _FRAMED_CLASSES[key] = framed
    return framed


def _is_user_module(node) -> bool:
  """A module of the user's (or of a library other than Flax and qtrain)."""
  return (isinstance(node, nnx.Module) and
          type(node).__module__.split(".")[0] not in ("flax", "qtrain"))


def float_direct_calls(model) -> None:
  """Makes the direct calls of ``model``'s user modules float again, in place: their QtOps
  are dropped and every module gets its own class back (for a float copy, e.g. lora.merge)."""
  for _, node in list(nnx.iter_graph(model)):
    if not isinstance(node, nnx.Module):
      continue
    for name, op in list(vars(node).items()):
      if isinstance(op, QtOp) and op.weight_param is not None:
        delattr(node, name)
    if _DIRECT_ATTR in vars(node):
      delattr(node, _DIRECT_ATTR)
    float_class = vars(type(node)).get(_FLOAT_CLASS_ATTR)
    if float_class is not None:
      node.__class__ = float_class


def reframe_direct_calls(model, provider, sites: Callable) -> None:
  """Hands the direct calls of ``model``'s user modules to ``provider`` through ``sites``
  (:class:`_Direct`), in place: modules that are in frames already (a copy of a QT model) keep
  their op numbering; a float model's user modules are put in frames as :func:`quantize_model`
  puts them (Flax modules letting their own ops pass), their numbering from their op
  attributes. A frozen model's direct calls run so (:mod:`qtrain.freeze`)."""
  framed = False
  passing = []
  for path, node in list(nnx.iter_graph(model)):
    if not isinstance(node, nnx.Module) or isinstance(node, QtOp):
      continue
    d = vars(node).get(_DIRECT_ATTR)
    if d is not None:
      setattr(node, _DIRECT_ATTR, dataclasses.replace(d, provider=provider, sites=sites))
      framed = True
    elif _is_user_module(node) and not hasattr(type(node), _FLOAT_CLASS_ATTR):
      hook = _nnx_hook(node)
      node.__class__ = _framed_class(type(node), user=True)
      setattr(node, _DIRECT_ATTR, _Direct(provider, "/".join(str(p) for p in path),
                                          () if hook is None else ((hook[1], 1),), sites))
      framed = True
    elif callable(node) and _is_flax_layer(node) and not hasattr(type(node), _FLOAT_CLASS_ATTR):
      passing.append(node)
  if framed:
    for node in passing:
      node.__class__ = _framed_class(type(node), user=False)


def _what(node) -> str:
  return type(node).__name__


def _no_hook_reason(node) -> str:
  if isinstance(node, nnx.ConvTranspose):
    return "ConvTranspose calls jax.lax.conv_transpose, which qtrain does not replace"
  if getattr(node, "dot_general_cls", None) is not None:
    return "it was given dot_general_cls"
  for attr in ("dot_general", "einsum_op", "conv_general_dilated"):
    if attr in vars(node):
      return f"its {attr} is a custom function ({getattr(vars(node)[attr], '__name__', '?')})"
  return "it has no replaceable op attribute"


def _warn_no_hook(provider, user_modules, flax_layers):
  for pstr, node, i in flax_layers:
    provider.warn_once((pstr, "nnx-no-hook"),
                       f"qtrain: nnx module {pstr!r} ({_what(node)}) matches rules[{i}] but "
                       f"{_no_hook_reason(node)}: it stays in float", stacklevel=5)
  if user_modules:
    listing = ", ".join(f"{p!r} ({_what(n)}, rules[{i}])" for p, n, i in user_modules[:8])
    more = f" and {len(user_modules) - 8} more" if len(user_modules) > 8 else ""
    provider.warn_once(("nnx-no-hook", tuple(p for p, _, _ in user_modules)),
                       f"qtrain: nnx modules {listing}{more} have parameters and match rules: "
                       "their direct jnp.einsum / jax.lax.dot_general / conv_general_dilated / "
                       "ragged_dot / @ / jnp.matmul / jnp.dot calls are quantized by ops that quantize_model's sample forward "
                       "creates, and none was given: such a call raises when the model runs "
                       "(pass sample inputs, quantize_model(model, provider, *sample_args))",
                       stacklevel=5)


def _stream(rngs, name):
  if rngs is None:
    return None
  try:
    return rngs[name]
  except (KeyError, AttributeError):
    return None


def _quantize_nnx(model, provider, sample_args, sample_kwargs, rngs):
  stream = None
  if rngs is not None:
    try:
      stream = rngs[provider.rng_stream]
    except (KeyError, AttributeError):
      stream = None
  plan, all_ops, user_modules, flax_layers = [], [], [], []
  framed, passing = [], []   # user modules (in frames), Flax modules (their ops pass)
  for path, node in list(nnx.iter_graph(model)):
    if not isinstance(node, nnx.Module) or isinstance(node, QtOp):
      continue
    pstr = "/".join(str(p) for p in path)
    if _DIRECT_ATTR in vars(node) or hasattr(type(node), _FLOAT_CLASS_ATTR):
      raise ValueError(f"module {type(node).__name__} at {pstr!r} is already quantized (its "
                       "direct calls are intercepted)")
    hook = _nnx_hook(node)
    if _is_user_module(node):
      framed.append((node, pstr, () if hook is None else ((hook[1], 1),)))
    elif callable(node) and _is_flax_layer(node):
      passing.append(node)
    if hook is None:
      if _owns_params(node) and (isinstance(node, _FLAX_OP_LAYERS) or not _is_flax_layer(node)):
        hit = [i for i, r in enumerate(provider.rules) if r.active and
               any(r.matches(pstr, o) for o in rules_lib.OP_NAMES)]
        if hit:
          (flax_layers if _is_flax_layer(node) else user_modules).append((pstr, node, hit[0]))
      continue
    attr, op_name = hook
    all_ops.append((pstr, op_name))
    m = provider.match(pstr, op_name)
    if m is None or not m[1].active:
      provider.note_skipped(pstr, f"{op_name}0", op_name,
                            provider_lib.FLOAT_NO_RULE if m is None else provider_lib.FLOAT_RULE)
      continue
    for name, field, why in (("params", "lora_rank", "initialises its LoRA adapters"),
                             (provider_lib.DROPOUT_STREAM, "lora_dropout",
                              "draws LoRA dropout keys")):
      if getattr(m[1], field) and _stream(rngs, name) is None:
        raise ValueError(
            f"qtrain: rules[{m[0]}] ({field}={getattr(m[1], field)!r}) matches {pstr!r} and {why} "
            f"from the RNG stream {name!r}: pass rngs=nnx.Rngs({name}=seed) to "
            "qtrain.quantize_model")
    if m[1].needs_rng and stream is None:
      raise ValueError(
          f"qtrain: rules[{m[0]}] (bwd_stochastic_rounding={m[1].bwd_stochastic_rounding!r}) "
          f"matches {pstr!r} and needs keys from the RNG stream {provider.rng_stream!r}: pass "
          f"rngs=nnx.Rngs({provider.rng_stream}=seed) to qtrain.quantize_model")
    plan.append((node, attr, op_name, pstr, m))
  has_sample = bool(sample_args or sample_kwargs)
  _warn_no_hook(provider, [] if has_sample else user_modules, flax_layers)
  # User modules' direct calls are known once the sample forward has run them.
  late_rule_check = has_sample and bool(framed)
  if not late_rule_check:
    provider.warn_unused_rules_once(all_ops, stacklevel=5)  # at the caller of quantize_model
  # A Flax layer's stacking is known from its declared kernel shape; a user module's is learnt
  # from the weight operand its op sees in the sample forward.
  stacks = {}
  for node, _, _, pstr, m in plan:
    stacks[pstr] = _declared_stack_shape(node)
    if stacks[pstr] is None and (m[1].needs_rng or m[1].has_state) and not has_sample:
      if m[1].has_state:
        continue  # the "pass sample inputs" error below names it
      raise ValueError(
          f"qtrain: rules[{m[0]}] (bwd_stochastic_rounding={m[1].bwd_stochastic_rounding!r}) "
          f"matches nnx module {pstr!r} ({_what(node)}): its op gets its own keys, stacked like "
          "the module's weight when the module is one of a stack (nnx.vmap / nnx.scan), which "
          "qtrain learns for a module that is not one of Flax's layers from one forward: pass "
          "sample inputs, quantize_model(model, provider, *sample_args, rngs=...)")
  ops = []
  data = getattr(nnx, "data", lambda v: v)
  for node, attr, op_name, pstr, m in plan:
    original = vars(node)[attr]
    if original is None:
      original = _intercept.original(op_name)
    op = QtOp(provider=provider, path=pstr, op_name=op_name, original=original)
    if m[1].needs_rng and stacks[pstr] is not None:
      op.rng = _op_stream(stream, stacks[pstr], provider.rng_stream)
    if m[1].has_lora:
      # A user module's stacking is learnt in the sample forward, which creates the adapters:
      # its layers then start from one A (B is zero, so the model starts as the base model).
      for field, name, on in (("lora_init_rng", "params", True),
                              ("lora_dropout_rng", provider_lib.DROPOUT_STREAM,
                               m[1].lora_dropout > 0)):
        if on:
          setattr(op, field, _op_stream(_stream(rngs, name), stacks[pstr] or (), name))
    setattr(node, attr, data(op))
    if getattr(provider, "stats_on_owner", False):
      # The provider keeps a static scale's statistics on the layer itself (qwix's layout,
      # qtrain.qwix): the op refers to its layer (a reference nnx's graph keeps as one node).
      op.stat_owner = data(node)
    ops.append((node, op, m))
  for node, pstr, counters in framed:
    node.__class__ = _framed_class(type(node), user=True)
    setattr(node, _DIRECT_ATTR, _Direct(provider, pstr, counters))
  if framed:  # only a user module's frame can take a Flax module's ops for its own
    for node in passing:
      node.__class__ = _framed_class(type(node), user=False)
  needs_state = [op.path for _, op, m in ops if m[1].has_state]
  if needs_state and not has_sample:
    raise ValueError(f"qtrain: rules with static or learned activation scales match nnx modules "
                     f"{needs_state}: pass sample inputs, quantize_model(model, provider, "
                     "*sample_args), to create their state")
  if not has_sample:
    return model
  stacked = [(op.path, stacks[op.path]) for _, op, _ in ops if stacks[op.path]]
  for _, op, _ in ops:
    op.initializing = True
  _observed.shapes, _observed.provider = {}, provider
  try:
    model(*sample_args, **sample_kwargs)
  except Exception as e:
    if not stacked:
      raise
    cause = str(e).splitlines()[0][:300] if str(e) else ""
    raise ValueError(
        f"qtrain: quantize_model's sample forward failed ({type(e).__name__}: {cause}); the nnx "
        f"modules {provider_lib._listing([f'{p} {s}' for p, s in stacked])} are stacked "
        "(leading axes shown), and the sample forward must run them as the model does, through "
        "nnx.scan / nnx.vmap (pass the model that scans the stack, or quantize each layer "
        "inside the vmapped constructor)") from e
  finally:
    observed, _observed.shapes, _observed.provider = _observed.shapes, None, None
    for _, op in _graph_ops(model):  # those of direct calls were created by the forward
      op.initializing = False
  for node, op, m in ops:
    if stacks[op.path] is None:
      if (op.path, op.op_id) not in observed:
        if not m[1].needs_rng:
          continue
        raise ValueError(
            f"qtrain: rules[{m[0]}] matches nnx module {op.path!r} ({_what(node)}), whose op the "
            "sample forward did not call: qtrain cannot tell whether it is one of a stack "
            "(nnx.vmap / nnx.scan) to give it keys stacked like its weight; call it in the "
            "sample forward, or keep it in float with a rule that sets no qtype")
      stacks[op.path] = _observed_stack_shape(node, observed[(op.path, op.op_id)])
      if stacks[op.path] is None:
        raise ValueError(
            f"qtrain: rules[{m[0]}] matches nnx module {op.path!r} ({_what(node)}), whose op got "
            f"a weight operand of shape {tuple(observed[(op.path, op.op_id)])}, which is none of the "
            "module's parameters (nor their trailing axes): qtrain cannot tell whether the "
            "module is one of a stack (nnx.vmap / nnx.scan) to stack its op's keys and state "
            "with it; pass the parameter itself as the op's second operand")
      if m[1].needs_rng:
        op.rng = _op_stream(stream, stacks[op.path], provider.rng_stream)
    _check_state_stacked(node, op, m, stacks[op.path])
  _finish_direct_ops(model, provider, stream, observed)
  if late_rule_check:
    provider.warn_unused_rules_once(all_ops + [(r.path, r.op_name) for r in provider.records()],
                                    stacklevel=5)
  return model


def _graph_ops(model) -> list[tuple[Any, QtOp]]:
  """(owner module, op) of every QtOp in ``model``."""
  return [(node, op) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
          for op in vars(node).values() if isinstance(op, QtOp)]


def _finish_direct_ops(model, provider, stream, observed) -> None:
  """Gives the direct-call ops the sample forward created their keys, stacked like their
  module (learnt from the weight operand each saw), and checks their state's stacking."""
  for node, op in _graph_ops(model):
    if op.weight_param is None:
      continue
    m = provider.match(op.path, op.op_name)
    where = f"the {op.op_name} call {op.op_id!r} of nnx module {op.path!r} ({_what(node)})"
    stack = _observed_stack_shape(node, observed[(op.path, op.op_id)])
    if stack is None:
      raise ValueError(
          f"qtrain: rules[{m[0]}] matches {where}, whose weight (parameter {op.weight_param!r}) "
          f"had shape {observed[(op.path, op.op_id)]} in the sample forward, which is neither "
          "the parameter's shape nor its trailing axes: qtrain cannot tell how the module is "
          "stacked (nnx.vmap / nnx.scan) to stack the op's keys and state with it")
    if m[1].needs_rng:
      if stream is None:
        raise ValueError(
            f"qtrain: rules[{m[0]}] (bwd_stochastic_rounding={m[1].bwd_stochastic_rounding!r}) "
            f"matches {where} and needs keys from the RNG stream {provider.rng_stream!r}: pass "
            f"rngs=nnx.Rngs({provider.rng_stream}=seed) to qtrain.quantize_model")
      op.rng = _op_stream(stream, stack, provider.rng_stream)
    _check_state_stacked(node, op, m, stack)


def _check_state_stacked(node, op, m, stack):
  """Raises when a stacked layer's op state was created without the stack's leading axes."""
  if not stack:
    return
  for name in _OP_STATE:
    v = getattr(op, name, None)
    if v is None:
      continue
    shape = tuple(jnp.shape(variable_get(v)))
    per_layer_scalar = name in ("act_static_scale", "act_static_count", "act_scale")
    if shape[:len(stack)] != stack or (per_layer_scalar and shape != stack):
      raise ValueError(
          f"qtrain: rules[{m[0]}] keeps state {name!r} for nnx module {op.path!r} "
          f"({_what(node)}), one of a stack of shape {stack}, but the sample forward created "
          f"it with shape {shape}: run the stack in the sample forward as the model does, "
          "through nnx.scan / nnx.vmap")


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
      rule uses ``bwd_stochastic_rounding``). Each quantized op draws one key
      from it here and keeps its own stream (see Pitfalls: stacked layers).

  Returns:
    linen: a new :class:`QtLinenModel` (``init``/``apply`` as usual; pass
    ``rngs={"quant": key}`` to ``apply`` for stochastic rounding).
    nnx: ``model`` itself, modified in place.

  What is intercepted:
    * linen: ``jax.lax.dot_general``, ``jnp.einsum`` (two operands) and
      ``jax.lax.conv_general_dilated`` called by ``Dense``, ``DenseGeneral``,
      ``Conv``, ``Einsum``, ``MultiHeadDotProductAttention``'s projections,
      and by a user's own module, which also has its matmul family (``x @ w``,
      ``jnp.matmul``, ``jnp.dot``, ``jnp.tensordot``, ``jnp.inner``,
      ``jax.lax.dot``, ``x.dot(w)``, ``jnp.vdot`` of two vectors: each a
      ``dot_general`` op) and ``jax.lax.ragged_dot`` (a ``ragged_dot`` op:
      mixture-of-experts layers; ``ragged_dot_general`` of the same form)
      quantized (the weight is the operand that is one of the module's
      parameters; otherwise the op stays float with a warning).
    * nnx: ``Linear``, ``LinearGeneral``, ``Conv``, ``Einsum``,
      ``MultiHeadAttention``'s projections, user modules that keep and
      call a ``dot_general`` / ``einsum_op`` / ``conv_general_dilated``
      attribute (weight second), and user modules' own calls of ``jnp.einsum``,
      ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``,
      ``jax.lax.ragged_dot`` and the matmul family, as in linen (the weight is
      the operand that is one of the module's ``nnx.Param`` s; each such call's
      op is made by the sample forward, and a quantized call that the sample
      forward did not run raises).
    * Left float with a warning where a rule would quantize them (and listed
      by :func:`summary`): ``jnp.vdot`` of other ranks (it flattens the
      weight), ``ragged_dot_general`` of other forms (a ragged contraction or
      ragged batch axes).
    * Never: the matmul family inside Flax's own layers (their own
      ``lax.dot_general`` / ``jnp.einsum`` are what is quantized), calls made inside an inner ``jax.jit`` / ``vmap`` / ``grad`` of a
      module's method (float, so the inner jit's cache stays float), attention
      score/value einsums (activation x activation, float).

  Pitfalls:
    * linen static scales inside ``nn.scan`` need
      ``variable_axes={"quant_stats": 0}``; learned scales follow ``"params"``.
    * A rule that matches no op warns once, when the model first runs (linen:
      at the end of its first call, e.g. ``init``; nnx: in ``quantize_model``),
      naming paths it finds with ``re.search`` but not ``re.fullmatch``.
    * nnx: a new ``QtProvider`` is a new static attribute (a retrace under
      ``nnx.jit``); reuse one provider for models that share a jitted step.
    * nnx layers stacked with ``nnx.vmap`` and run by ``nnx.scan`` / ``nnx.vmap``
      (or quantized inside the vmapped constructor): each quantized op gets its
      own stochastic-rounding stream, stacked like its layer: one key drawn from
      ``rngs``' ``"quant"`` stream per op (graph order), split over the stack
      (``jax.random.split(key, stack_shape)``), and a counter: layer i's call j
      uses ``fold_in(keys[i], j)``. The stack shape of Flax's layers is their
      kernel's leading axes beyond the declared kernel shape; a user module's
      is learnt from the weight operand its op sees in the sample forward
      (``quantize_model`` asks for sample inputs when a stochastic-rounding
      rule matches one). Static and learned activation scales of stacked
      layers are created by the sample forward, which must run the stack as
      the model does (through the ``nnx.scan``): one value per layer.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
    >>> rules = [qtrain.QtRule(module_path=r".*", weight_qtype="int4", tile_size=16)]
    >>> qmodel = qtrain.quantize_model(nn.Dense(8), qtrain.QtProvider(rules))
    >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 32)))
    >>> qmodel.apply(v, jnp.ones((2, 32))).shape
    (2, 8)
  """
  if not isinstance(provider, provider_lib.QtProvider):
    raise ValueError(_not_a_provider(provider))
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


def _not_a_provider(obj) -> str:
  """The error for a ``provider`` that is not a QtProvider: type names and counts, no reprs."""
  msg = "provider must be a qtrain.QtProvider; got "
  if isinstance(obj, (list, tuple)):
    names = sorted({type(x).__name__ for x in obj})
    what = names[0] if len(names) == 1 else f"items ({', '.join(names)})"
    msg += f"a {type(obj).__name__} of {len(obj)} {what}"
    if obj and all(isinstance(x, rules_lib.QtRule) for x in obj):
      msg += ": pass qtrain.QtProvider(rules)"
    return msg
  msg += f"a {type(obj).__name__}"
  if isinstance(obj, rules_lib.QtRule):
    msg += ": pass qtrain.QtProvider([rule])"
  return msg


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
