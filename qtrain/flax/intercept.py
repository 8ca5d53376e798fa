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

``x @ w``, ``jnp.dot``, ``jnp.matmul`` inside a module therefore stay float
(they use JAX's internal ``dot_general``, never the public name): use
``jax.lax.dot_general`` / ``jnp.einsum`` or a Flax layer to quantize.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any

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
  mod = jnp if name == "einsum" else jax.lax
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


def _active(op_name: str) -> tuple[Frame | None, str | None]:
  """The frame to act in and the op id, or (None, None): pass the call through.

  A call at another trace level than the frame's method was entered at is
  passed through silently: it is made inside an inner jit / transform of the
  method (a user's jitted helper, ``jnp`` internals), or it is qtrain's own
  core op being traced lazily (custom_vjp forward/backward). Either way the
  cached inner jaxpr must stay float.
  """
  f = current_frame()
  if f is None or f.trace != trace_state():
    return None, None
  return f, f.next_id(op_name)


def _dispatch_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, **kwargs):
  orig = original("dot_general")
  f, op_id = _active("dot_general")
  if f is None:
    return orig(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  w = hosts.linen_weight_operand(f.module, "dot_general", (lhs, rhs))
  with sentinel():
    return f.provider.dot_general(
        hosts.LinenHost(f.module, op_id), f.path, op_id, lhs, rhs, dimension_numbers,
        precision, preferred_element_type, weight_operand=w, fallback=orig,
        out_sharding=kwargs.get("out_sharding"))


def _dispatch_einsum(subscripts, /, *operands, **kwargs):
  orig = original("einsum")
  f, op_id = _active("einsum")
  if f is None:
    return orig(subscripts, *operands, **kwargs)
  w = hosts.linen_weight_operand(f.module, "einsum", operands)
  with sentinel():
    return f.provider.einsum(hosts.LinenHost(f.module, op_id), f.path, op_id, subscripts,
                             operands, kwargs, weight_operand=w, fallback=orig)


def _dispatch_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                   precision=None, preferred_element_type=None, **kwargs):
  orig = original("conv_general_dilated")
  f, op_id = _active("conv_general_dilated")
  if f is None:
    return orig(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                feature_group_count, batch_group_count, precision, preferred_element_type,
                **kwargs)
  w = hosts.linen_weight_operand(f.module, "conv_general_dilated", (lhs, rhs))
  with sentinel():
    return f.provider.conv_general_dilated(
        hosts.LinenHost(f.module, op_id), f.path, op_id, lhs, rhs, window_strides, padding,
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
