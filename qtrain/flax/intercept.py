"""How linen calls are caught: scoped, thread-local, safe under jit caches.

linen layers look ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``
and ``jax.numpy.einsum`` up at call time, so a quantized linen model's call
(see :class:`qtrain.flax.model.QtLinenModel`) does three things for its duration:

1. installs *dispatchers* in place of those three public names, and of
   ``jax.lax.ragged_dot`` / ``ragged_dot_general`` (which have no quantized
   form: they run in float, recorded, with a warning where a rule would
   quantize them) (reference counted: installed when the first quantized call
   in the process starts, the originals put back when the last one ends);
2. registers a ``flax.linen.intercept_methods`` interceptor (thread-local in
   Flax) that pushes a *frame* — the running module, the provider, and the
   JAX trace state at the moment the module's method was entered — on a
   thread-local stack for the duration of every module method;
3. on exit, pops everything.

A dispatcher acts only when all of these hold, and otherwise calls the
original function unchanged:

* this thread has a frame (another thread's float model is never touched);
* the call is made at the trace level the frame's method was entered at.
  A call made while JAX traces an inner ``jax.jit`` (``jnp.matmul`` /
  ``x @ w`` / ``jnp.dot`` internals, or a user's jitted helper), an inner
  ``jax.vmap``/``grad`` or similar inside the method, stays float: the jaxpr
  cached by that inner jit is float, so no later float caller of the same
  function and shape can get quantized results (qwix's bug #1). When a rule
  wanted such an op quantized, it stays float all the same (documented
  behaviour: quantize through a Flax layer or a direct call).
* qtrain's own code is not running (a sentinel frame is pushed while the
  provider and the core ops run, so their internal calls are never
  re-intercepted).

``x @ w``, ``jnp.dot``, ``jnp.matmul`` inside a linen module therefore stay
float (they use JAX's internal ``dot_general``, never the public name): use
``jax.lax.dot_general`` / ``jnp.einsum`` or a Flax layer to quantize.

nnx modules have no method interceptor: :mod:`qtrain.flax.model` gives each
user nnx module of a quantized model a subclass whose methods run inside
:func:`module_frame`, the same frames and dispatchers with a ``sites`` hook
that says where an op keeps its state (a ``QtOp`` on the module) and which
operand is the weight (one of the module's ``nnx.Param`` values, by
identity). An nnx frame also catches the matmul operator and ``jnp.matmul``
(:data:`_MATMUL_TARGETS`): an nnx module commonly writes ``x @ self.w``,
and catching them is as safe as the rest (same thread, same trace level).
Linen frames let matmuls pass through, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from qtrain import provider as provider_lib
from qtrain.flax import hosts

try:  # public since jax 0.4.36; used by flax.nnx too.
  from jax.extend.core import get_opaque_trace_state as _get_trace_state
except ImportError:  # pragma: no cover
  from jax._src.core import get_opaque_trace_state as _get_trace_state  # type: ignore


def trace_state():
  return _get_trace_state(convention="flax")


_tls = threading.local()


@dataclasses.dataclass
class Frame:
  module: Any
  provider: Any
  trace: Any
  rename: tuple = ((), ())   # (prefix, replacement) of module paths
  counters: dict = dataclasses.field(default_factory=dict)
  _path: str | None = None
  # nnx: ``sites(frame, op_name, op_id, operands) -> (host, weight operand index)``, where an
  # op of this module keeps its state; None: a linen frame (LinenHost, linen_weight_operand).
  sites: Callable | None = None

  @property
  def path(self) -> str:
    if self._path is None:
      raw = tuple(self.module.path)
      prefix, repl = self.rename
      if raw[:len(prefix)] == prefix:
        raw = tuple(repl) + raw[len(prefix):]
      self._path = "/".join(str(p) for p in raw)
    return self._path

  def next_id(self, op_name: str) -> str:
    n = self.counters.get(op_name, 0)
    self.counters[op_name] = n + 1
    return f"{op_name}{n}"


def _frames() -> list:
  f = getattr(_tls, "frames", None)
  if f is None:
    f = _tls.frames = []
  return f


def depth() -> int:
  """How many frames this thread has (0: no quantized linen call is running)."""
  return len(getattr(_tls, "frames", None) or ())


def current_frame() -> Frame | None:
  f = getattr(_tls, "frames", None)
  return f[-1] if f else None


@contextlib.contextmanager
def sentinel():
  """Marks qtrain's own code as running: dispatchers pass calls straight through."""
  frames = _frames()
  frames.append(None)
  try:
    yield
  finally:
    frames.pop()


# ---------------------------------------------------------------------------
# Dispatchers and their scoped installation.

_install_lock = threading.Lock()
_install_count = 0
_originals: dict[str, Any] = {}
_TARGETS = (("jax.lax", jax.lax, "dot_general"), ("jax.lax", jax.lax, "conv_general_dilated"),
            ("jax.numpy", jnp, "einsum"), ("jax.lax", jax.lax, "ragged_dot"),
            ("jax.lax", jax.lax, "ragged_dot_general"))


def original(name: str):
  """The original public function (also while dispatchers are installed)."""
  if name in _originals:
    return _originals[name]
  mod = jnp if name in ("einsum", "matmul") else jax.lax
  return getattr(mod, name)


def _install():
  global _install_count
  with _install_lock:
    if _install_count == 0:
      for _, mod, name in _TARGETS:
        _originals[name] = getattr(mod, name)
        setattr(mod, name, _DISPATCHERS[name])
    _install_count += 1


def _uninstall():
  global _install_count
  with _install_lock:
    _install_count -= 1
    if _install_count == 0:
      for _, mod, name in _TARGETS:
        setattr(mod, name, _originals.pop(name))


def installed() -> bool:
  return _install_count > 0


def _active(op_name: str, *, nnx_only: bool = False) -> tuple[Frame | None, str | None]:
  """The frame to act in and the op id, or (None, None): pass the call through.

  A call at another trace level than the frame's method was entered at is
  passed through silently: it is made inside an inner jit / transform of the
  method (a user's jitted helper, ``jnp`` internals), or it is qtrain's own
  core op being traced lazily (custom_vjp forward/backward). Either way the
  cached inner jaxpr must stay float. ``nnx_only``: linen frames pass the call
  through too (the matmul operator, which linen leaves float).
  """
  f = current_frame()
  if f is None or f.trace != trace_state() or (nnx_only and f.sites is None):
    return None, None
  return f, f.next_id(op_name)


def _site(f: Frame, op_name: str, op_id: str, operands) -> tuple[Any, int | None]:
  """(host, weight operand index) of an op called in frame ``f``."""
  if f.sites is not None:
    return f.sites(f, op_name, op_id, operands)
  return (hosts.LinenHost(f.module, op_id),
          hosts.linen_weight_operand(f.module, op_name, operands))


def _dispatch_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, **kwargs):
  orig = original("dot_general")
  f, op_id = _active("dot_general")
  if f is None:
    return orig(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  with sentinel():
    host, w = _site(f, "dot_general", op_id, (lhs, rhs))
    return f.provider.dot_general(
        host, f.path, op_id, lhs, rhs, dimension_numbers,
        precision, preferred_element_type, weight_operand=w, fallback=orig,
        out_sharding=kwargs.get("out_sharding"))


def _dispatch_einsum(subscripts, /, *operands, **kwargs):
  orig = original("einsum")
  f, op_id = _active("einsum")
  if f is None:
    return orig(subscripts, *operands, **kwargs)
  with sentinel():
    host, w = _site(f, "einsum", op_id, operands)
    return f.provider.einsum(host, f.path, op_id, subscripts, operands, kwargs,
                             weight_operand=w, fallback=orig)


def _dispatch_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                   precision=None, preferred_element_type=None, **kwargs):
  orig = original("conv_general_dilated")
  f, op_id = _active("conv_general_dilated")
  if f is None:
    return orig(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                feature_group_count, batch_group_count, precision, preferred_element_type,
                **kwargs)
  with sentinel():
    host, w = _site(f, "conv_general_dilated", op_id, (lhs, rhs))
    return f.provider.conv_general_dilated(
        host, f.path, op_id, lhs, rhs, window_strides, padding,
        lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
        precision, preferred_element_type, weight_operand=w, fallback=orig,
        out_sharding=kwargs.pop("out_sharding", None))


def _ragged(name: str):
  """A dispatcher for ``jax.lax.<name>`` (the grouped products of mixture-of-experts layers):
  qtrain has no quantized form of it, so the call runs in float, and the op is recorded (the
  summary lists it) with a warning where a quantizing rule matches it: never float silently."""

  def dispatch(lhs, rhs, group_sizes, *args, **kwargs):
    orig = original(name)
    f, op_id = _active(name)
    if f is not None:
      with sentinel():
        f.provider.note_skipped(f.path, op_id, name, provider_lib.FLOAT_NO_QUANTIZED_FORM,
                                shapes=(lhs.shape, rhs.shape))
    return orig(lhs, rhs, group_sizes, *args, **kwargs)

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch_{name}"
  return dispatch


_DISPATCHERS = {"dot_general": _dispatch_dot_general, "einsum": _dispatch_einsum,
                "conv_general_dilated": _dispatch_conv, "ragged_dot": _ragged("ragged_dot"),
                "ragged_dot_general": _ragged("ragged_dot_general")}

for _name, _fn in _DISPATCHERS.items():
  _fn.__qtrain_dispatcher__ = _name  # type: ignore[attr-defined]
  _fn.__wrapped__ = original(_name)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# The matmul operator and jnp.matmul (nnx frames only).


def _as_array(x):
  """An operand as the array it stands for (an nnx Variable's value: the same object)."""
  m = getattr(x, "__jax_array__", None)
  return x if m is None else m()


def matmul_dimension_numbers(lhs_shape, rhs_shape) -> tuple | None:
  """``lhs @ rhs`` as one dot_general's dimension numbers, where its output is matmul's.

  A 1-D or 2-D ``rhs`` with any ``lhs`` of rank >= 1 (the 2-D one broadcast over the other's
  leading axes), or both of the same rank >= 3 with the same leading (batch) shape. None for
  the other forms (broadcast batch axes, a 2-D ``lhs`` times a stack), which stay float.
  """
  nl, nr = len(lhs_shape), len(rhs_shape)
  if nl == 0 or nr == 0:
    return None
  if nr <= 2:
    return (((nl - 1,), (0,)), ((), ()))
  if nl == nr and tuple(lhs_shape[:-2]) == tuple(rhs_shape[:-2]):
    batch = tuple(range(nl - 2))
    return (((nl - 1,), (nr - 2,)), (batch, batch))
  return None


def _dispatch_matmul_call(a, b, float_call: Callable, precision=None,
                          preferred_element_type=None):
  """``a @ b`` (``jnp.matmul(a, b)``) in an nnx frame: a dot_general op of the module when one
  operand is its parameter; ``float_call()`` (the original) wherever it stays float."""
  f, op_id = _active("dot_general", nnx_only=True)
  if f is None:
    return float_call()
  with sentinel():
    lhs, rhs = _as_array(a), _as_array(b)
    dn = matmul_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs))
    if dn is None:
      f.provider.note_skipped(f.path, op_id, "dot_general", provider_lib.FLOAT_UNSUPPORTED,
                              shapes=(jnp.shape(lhs), jnp.shape(rhs)))
      return float_call()
    host, w = _site(f, "dot_general", op_id, (lhs, rhs))
    return f.provider.dot_general(
        host, f.path, op_id, lhs, rhs, dn, precision, preferred_element_type, weight_operand=w,
        fallback=lambda *args, **kwargs: float_call())


def _dispatch_jnp_matmul(a, b, *, precision=None, preferred_element_type=None, **kwargs):
  orig = original("matmul")
  return _dispatch_matmul_call(
      a, b, lambda: orig(a, b, precision=precision, preferred_element_type=preferred_element_type,
                         **kwargs),
      precision=precision, preferred_element_type=preferred_element_type)


def _operator(name: str, swap: bool):
  """A dispatcher for the array method ``name`` (``__matmul__``, or ``__rmatmul__`` when
  ``swap``: the array is the right operand)."""

  def dispatch(self, other):
    orig = _operator_originals[name]
    if swap:
      return _dispatch_matmul_call(other, self, lambda: orig(self, other))
    return _dispatch_matmul_call(self, other, lambda: orig(self, other))

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch{name}"
  return dispatch


# Where JAX binds ``@``: concrete arrays (ArrayImpl's methods) and tracers (which forward
# ``__matmul__`` to their aval's ``_matmul``, a staticmethod of ShapedArray); plus the public
# ``jnp.matmul``. (owner, attribute, dispatcher, wrap as staticmethod)
_ARRAY_IMPL = type(jnp.zeros(()))
_MATMUL_TARGETS = (
    (_ARRAY_IMPL, "__matmul__", _operator("ArrayImpl.__matmul__", False), False),
    (_ARRAY_IMPL, "__rmatmul__", _operator("ArrayImpl.__rmatmul__", True), False),
    (jax.core.ShapedArray, "_matmul", _operator("ShapedArray._matmul", False), True),
    (jax.core.ShapedArray, "_rmatmul", _operator("ShapedArray._rmatmul", True), True),
    (jnp, "matmul", _dispatch_jnp_matmul, False),
)
_operator_originals: dict[str, Any] = {}
_matmul_saved: dict[tuple[Any, str], Any] = {}
_matmul_count = 0


def _install_matmul():
  global _matmul_count
  with _install_lock:
    if _matmul_count == 0:
      for owner, attr, fn, static in _MATMUL_TARGETS:
        raw = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
        _matmul_saved[(owner, attr)] = raw
        key = "matmul" if owner is jnp else f"{owner.__name__}.{attr}"
        # The function itself (a staticmethod unwrapped), for the dispatcher to call.
        _operator_originals[key] = getattr(owner, attr)
        if owner is jnp:
          _originals["matmul"] = raw
        setattr(owner, attr, staticmethod(fn) if static else fn)
    _matmul_count += 1


def _uninstall_matmul():
  global _matmul_count
  with _install_lock:
    _matmul_count -= 1
    if _matmul_count == 0:
      for owner, attr, _, _ in _MATMUL_TARGETS:
        setattr(owner, attr, _matmul_saved.pop((owner, attr)))
      _originals.pop("matmul", None)


# ---------------------------------------------------------------------------
# nnx frames.


@contextlib.contextmanager
def module_frame(module, provider, path: str, sites: Callable, counters: dict | None = None):
  """Quantizes the ops an nnx module calls directly while this context runs (this thread only).

  ``sites`` finds each op's state and weight (see :class:`Frame`). A frame for the module
  already on top of the stack (one of its methods calling another) shares that frame's
  counters, so op ids go on in call order; ``counters`` seeds a new frame's (op ids an
  attribute op of the module already takes).
  """
  _install()
  _install_matmul()
  frames = _frames()
  top = frames[-1] if frames else None
  shared = top.counters if (top is not None and top.module is module) else dict(counters or {})
  frames.append(Frame(module=module, provider=provider, trace=trace_state(), counters=shared,
                      _path=path, sites=sites))
  try:
    yield
  finally:
    frames.pop()
    _uninstall_matmul()
    _uninstall()


# ---------------------------------------------------------------------------
# The linen scope.


def _interceptor(provider, rename, next_fun, args, kwargs, context):
  frames = _frames()
  frames.append(Frame(module=context.module, provider=provider, trace=trace_state(),
                      rename=rename))
  try:
    return next_fun(*args, **kwargs)
  finally:
    frames.pop()


@contextlib.contextmanager
def linen_scope(provider, rename=((), ())):
  """Quantizes the ops of linen modules called inside this context (this thread only).

  ``rename=(prefix, replacement)`` rewrites the start of module paths (the
  wrapper shares its scope with the wrapped model, so the wrapped model's
  paths are reported as the float model's).
  """
  import flax.linen as nn

  _install()
  try:
    with nn.intercept_methods(functools.partial(_interceptor, provider, rename)):
      yield
  finally:
    _uninstall()
