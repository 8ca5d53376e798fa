"""How linen calls are caught: scoped, thread-local, safe under jit caches.

linen layers look ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``
and ``jax.numpy.einsum`` up at call time, so a quantized linen model's call
(see :class:`qtrain.flax.model.QtLinenModel`) does three things for its duration:

1. installs *dispatchers* in place of those three public names, of the
   matmul family (below), and of ``jax.lax.ragged_dot`` /
   ``ragged_dot_general`` (which have no quantized form: they run in float,
   recorded, with a warning where a rule would quantize them) (reference
   counted: installed when the first quantized call in the process starts,
   the originals put back when the last one ends);
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

The matmul family (``x @ w``, ``jnp.matmul``, ``jnp.dot``, ``jnp.tensordot``,
``jnp.inner``) is one dot_general each, which JAX computes with its internal
``dot_general``, never the public name. While dispatchers are installed, those
public functions and the ``@`` operator of arrays and tracers
(:func:`_matmul_targets`) are dispatchers too: a call made in the frame of a
user's module (linen or nnx) becomes that module's ``dot_general`` op, its
weight found as for ``jax.lax.dot_general`` (by parameter identity). In the
frame of a Flax (or qtrain) module they pass through: Flax's layers make their
own ``lax.dot_general`` / ``jnp.einsum`` calls, which are the ones quantized
(``nn.Embed.attend``'s ``jnp.dot`` stays float, as its ``embedding.T`` is no
parameter anyway).

nnx modules have no method interceptor: :mod:`qtrain.flax.model` gives each
user nnx module of a quantized model a subclass whose methods run inside
:func:`module_frame`, the same frames and dispatchers with a ``sites`` hook
that says where an op keeps its state (a ``QtOp`` on the module) and which
operand is the weight (one of the module's ``nnx.Param`` values, by
identity).

:func:`asarray_scope` swaps ``jnp.asarray`` the same scoped, thread-local way for a converter
that changes only what JAX rejects (qwix's PTQ models pass their quantized weights through it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qtrain import provider as provider_lib
from qtrain.core import qdot
from qtrain.flax import hosts
from qtrain.ops.ragged_dot_qt import ragged_dimension_numbers

try:  # public since jax 0.4.36; used by flax.nnx too.
  from jax.extend.core import get_opaque_trace_state as _get_trace_state
except ImportError:  # pragma: no cover
  from jax._src.core import get_opaque_trace_state as _get_trace_state  # type: ignore


try:  # the class of concrete arrays, importable without starting a backend
  from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover
  _ArrayImpl = None


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
# The public functions replaced by dispatchers: (module, name, key). The key names the
# function in _originals and _DISPATCHERS (jax.lax.dot is "lax.dot": jnp.dot is "dot").
_TARGETS = ((jax.lax, "dot_general", "dot_general"),
            (jax.lax, "conv_general_dilated", "conv_general_dilated"), (jnp, "einsum", "einsum"),
            (jax.lax, "ragged_dot", "ragged_dot"),
            (jax.lax, "ragged_dot_general", "ragged_dot_general"), (jnp, "matmul", "matmul"),
            (jnp, "dot", "dot"), (jnp, "tensordot", "tensordot"), (jnp, "inner", "inner"),
            (jnp, "vdot", "vdot"), (jax.lax, "dot", "lax.dot"))
_TARGET_OF = {key: (mod, name) for mod, name, key in _TARGETS}


def original(name: str):
  """The original public function (also while dispatchers are installed); ``name`` is a
  key of :data:`_TARGETS` (``"lax.dot"`` for ``jax.lax.dot``)."""
  if name in _originals:
    return _originals[name]
  mod, attr = _TARGET_OF.get(name, (jax.lax, name))
  return getattr(mod, attr)


def _install():
  global _install_count
  with _install_lock:
    if _install_count == 0:
      for mod, name, key in _TARGETS:
        _originals[key] = getattr(mod, name)
        setattr(mod, name, _DISPATCHERS[key])
      _install_operators()
    _install_count += 1


def _uninstall():
  global _install_count
  with _install_lock:
    _install_count -= 1
    if _install_count == 0:
      for mod, name, key in _TARGETS:
        setattr(mod, name, _originals.pop(key))
      _uninstall_operators()


def installed() -> bool:
  return _install_count > 0


def _active(op_name: str, *, user_frames_only: bool = False) -> tuple[Frame | None, str | None]:
  """The frame to act in and the op id, or (None, None): pass the call through.

  A call at another trace level than the frame's method was entered at is
  passed through silently: it is made inside an inner jit / transform of the
  method (a user's jitted helper, ``jnp`` internals), or it is qtrain's own
  core op being traced lazily (custom_vjp forward/backward). Either way the
  cached inner jaxpr must stay float. ``user_frames_only`` (the matmul family):
  the frame of a Flax or qtrain linen module passes the call through too, since
  such a layer's quantized ops are its own ``lax.dot_general`` / ``jnp.einsum``.
  """
  f = current_frame()
  if f is None or f.trace != trace_state():
    return None, None
  if user_frames_only and f.sites is None and _library_module(f.module):
    return None, None
  return f, f.next_id(op_name)


# Top-level packages whose classes are no user's: a linen module made only of these is a
# library layer (Flax's, the classes its lifted transforms derive from them, qtrain's).
_LIBRARY_PACKAGES = frozenset({"flax", "qtrain", "jax", "builtins", "abc", "typing"})


def _library_module(module) -> bool:
  """A linen module none of whose classes is the user's (``nn.remat(UserBlock)`` is the
  user's: its class derives from UserBlock)."""
  return all(k.__module__.split(".")[0] in _LIBRARY_PACKAGES for k in type(module).__mro__)


def _site(f: Frame, op_name: str, op_id: str, operands, *,
          by_identity: bool = False) -> tuple[Any, int | None]:
  """(host, weight operand index) of an op called in frame ``f``; ``by_identity``: the weight
  is the operand that is one of the module's parameters, whatever the module's class (a matmul
  a user's subclass of ``nn.Dense`` makes is not the layer's own op)."""
  if f.sites is not None:
    return f.sites(f, op_name, op_id, operands)
  return (hosts.LinenHost(f.module, op_id),
          hosts.linen_weight_operand(f.module, op_name, operands, by_convention=not by_identity))


def _dispatch_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, **kwargs):
  orig = original("dot_general")
  f, op_id = _active("dot_general")
  if f is None:
    return orig(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
  with sentinel():
    host, w = _site(f, "dot_general", op_id, (lhs, rhs))
    # The weight is found by identity (an nnx Variable itself may be passed); the op gets arrays.
    lhs, rhs = _as_array(lhs), _as_array(rhs)
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
    operands = tuple(_as_array(o) for o in operands)
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
    lhs, rhs = _as_array(lhs), _as_array(rhs)
    return f.provider.conv_general_dilated(
        host, f.path, op_id, lhs, rhs, window_strides, padding,
        lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
        precision, preferred_element_type, weight_operand=w, fallback=orig,
        out_sharding=kwargs.pop("out_sharding", None))


def _bind(fn, args, kwargs) -> dict | None:
  """``fn``'s arguments by name, defaults filled in; None where the call does not bind (left
  to ``fn`` itself, which raises JAX's own error)."""
  try:
    bound = inspect.signature(fn).bind(*args, **kwargs)
  except (TypeError, ValueError):
    return None
  bound.apply_defaults()
  out = dict(bound.arguments)
  out.update(out.pop("kwargs", None) or {})
  return out


# The arguments of ragged_dot(_general) a quantized product takes (the others must be unset).
_RAGGED_ARGS = frozenset({"lhs", "rhs", "group_sizes", "ragged_dot_dimension_numbers",
                          "precision", "preferred_element_type", "group_offset", "out_sharding"})


def _ragged(name: str):
  """A dispatcher for ``jax.lax.<name>`` (``ragged_dot`` / ``ragged_dot_general``: the grouped
  products of mixture-of-experts layers): in a module's frame, a ``ragged_dot`` op of the module
  (its weight the operand that is one of the module's parameters, which must be rhs);
  ``ragged_dot_general`` where it means what ragged_dot does (rows of lhs ragged, one group
  axis of rhs), other forms float (recorded, a warning where a rule matches)."""

  def dispatch(*args, **kwargs):
    orig = original(name)
    f, op_id = _active("ragged_dot")
    if f is None:
      return orig(*args, **kwargs)
    with sentinel():
      a = _bind(orig, args, kwargs)
      if a is None:
        return orig(*args, **kwargs)
      lhs, rhs = _as_array(a["lhs"]), _as_array(a["rhs"])
      shapes = (jnp.shape(lhs), jnp.shape(rhs))
      layout = (0, 1)
      if name == "ragged_dot_general":
        layout = ragged_dimension_numbers(a["ragged_dot_dimension_numbers"],
                                                        len(shapes[0]), len(shapes[1]))
      if any(v is not None for k, v in a.items() if k not in _RAGGED_ARGS) or not all(
          isinstance(o, jax.Array) for o in (lhs, rhs)):
        layout = None
      host, w = _site(f, "ragged_dot", op_id, (lhs, rhs), by_identity=True)
      return f.provider.ragged_dot(
          host, f.path, op_id, lhs, rhs, a["group_sizes"], weight_operand=w,
          float_call=lambda: orig(*args, **kwargs), precision=a.get("precision"),
          preferred_element_type=a.get("preferred_element_type"),
          group_offset=a.get("group_offset"), out_sharding=a.get("out_sharding"),
          rhs_layout=layout)

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch_{name}"
  return dispatch


# ---------------------------------------------------------------------------
# The matmul family: ``@``, jnp.matmul, jnp.dot, jnp.tensordot, jnp.inner (each one dot_general).


def _quantized_weight(x) -> bool:
  """A PTQ model's quantized weight (qwix's ``WithAux`` / ``QArray``, which mark their class):
  a frozen model's product takes it as its weight operand."""
  return bool(getattr(type(x), "__qtrain_quantized_weight__", False))


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


def dot_dimension_numbers(lhs_shape, rhs_shape) -> tuple | None:
  """``jnp.dot(lhs, rhs)`` as one dot_general: lhs's last axis against rhs's second-to-last
  (its only one when 1-D); dot_general's output (lhs's free axes, then rhs's) is jnp.dot's.
  None for a 0-d operand (a scalar product, not a matmul)."""
  nl, nr = len(lhs_shape), len(rhs_shape)
  if nl == 0 or nr == 0:
    return None
  return (((nl - 1,), (max(nr - 2, 0),)), ((), ()))


def inner_dimension_numbers(lhs_shape, rhs_shape) -> tuple | None:
  """``jnp.inner(lhs, rhs)``: the last axes of both contracted; None for a 0-d operand."""
  nl, nr = len(lhs_shape), len(rhs_shape)
  if nl == 0 or nr == 0:
    return None
  return (((nl - 1,), (nr - 1,)), ((), ()))


def tensordot_dimension_numbers(lhs_shape, rhs_shape, axes) -> tuple | None:
  """``jnp.tensordot(lhs, rhs, axes)`` as one dot_general (its output, lhs's free axes then
  rhs's, is tensordot's); None where nothing is contracted (an outer product). Raises
  ValueError / TypeError for axes jnp.tensordot rejects."""
  nl, nr = len(lhs_shape), len(rhs_shape)
  if isinstance(axes, int):
    if not 0 <= axes <= min(nl, nr):
      raise ValueError(f"axes={axes}")
    ca, cb = tuple(range(nl - axes, nl)), tuple(range(axes))
  else:
    ax_a, ax_b = axes
    ax_a = (ax_a,) if isinstance(ax_a, int) else tuple(ax_a)
    ax_b = (ax_b,) if isinstance(ax_b, int) else tuple(ax_b)
    if len(ax_a) != len(ax_b) or not all(-nl <= i < nl for i in ax_a) or not all(
        -nr <= i < nr for i in ax_b):
      raise ValueError(f"axes={axes}")
    ca, cb = tuple(i % nl for i in ax_a), tuple(i % nr for i in ax_b)
    if len(set(ca)) != len(ca) or len(set(cb)) != len(cb):
      raise ValueError(f"axes={axes}")
  if any(lhs_shape[i] != rhs_shape[j] for i, j in zip(ca, cb)):
    raise ValueError(f"axes={axes}")
  if not ca:
    return None
  return ((ca, cb), ((), ()))


# The keyword arguments of the jnp functions that a quantized product takes over.
_PRODUCT_KWARGS = frozenset({"precision", "preferred_element_type", "out_sharding"})


def _dispatch_product(a, b, dimension_numbers: Callable, kwargs: dict, float_call: Callable):
  """``a (x) b`` of the matmul family: in a user module's frame, a dot_general op of the
  module (``dimension_numbers(lhs shape, rhs shape)``, its weight the operand that is one of
  the module's parameters); ``float_call()`` (the original function) wherever it stays float.

  An invalid call (axes or shapes the function rejects, operands it does not take) is left to
  ``float_call``, which raises JAX's own error.
  """
  f, op_id = _active("dot_general", user_frames_only=True)
  if f is None:
    return float_call()
  with sentinel():
    lhs, rhs = _as_array(a), _as_array(b)
    if not all(isinstance(o, (jax.Array, np.ndarray, np.generic, int, float, complex))
               or _quantized_weight(o) for o in (lhs, rhs)):
      return float_call()
    shapes = (jnp.shape(lhs), jnp.shape(rhs))
    try:
      dn = dimension_numbers(*shapes)
    except (TypeError, ValueError):
      return float_call()
    if dn is None or not _PRODUCT_KWARGS.issuperset(kwargs):
      f.provider.note_skipped(f.path, op_id, "dot_general", provider_lib.FLOAT_UNSUPPORTED,
                              shapes=shapes)
      return float_call()
    host, w = _site(f, "dot_general", op_id, (lhs, rhs), by_identity=True)
    # A numpy or Python operand (never the weight: parameters are JAX arrays) as an array.
    lhs, rhs = (o if isinstance(o, jax.Array) or _quantized_weight(o) else jnp.asarray(o)
                for o in (lhs, rhs))
    return f.provider.dot_general(
        host, f.path, op_id, lhs, rhs, dn, kwargs.get("precision"),
        kwargs.get("preferred_element_type"), weight_operand=w,
        fallback=lambda *args, **kw: float_call(), out_sharding=kwargs.get("out_sharding"))


def _product_dispatcher(name: str, dimension_numbers: Callable):
  """The dispatcher of ``jnp.<name>(a, b, **kwargs)``."""

  def dispatch(a, b, **kwargs):
    orig = original(name)
    return _dispatch_product(a, b, dimension_numbers, kwargs, lambda: orig(a, b, **kwargs))

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch_{name}"
  return dispatch


def _dispatch_tensordot(a, b, axes=2, **kwargs):
  orig = original("tensordot")
  return _dispatch_product(
      a, b, lambda ls, rs: tensordot_dimension_numbers(ls, rs, axes), kwargs,
      lambda: orig(a, b, axes, **kwargs))


def vdot_dimension_numbers(lhs_shape, rhs_shape) -> tuple | None:
  """``jnp.vdot(lhs, rhs)`` of two vectors: ``jnp.dot``'s (the one axis contracted). None for
  other ranks: vdot flattens both operands, so a weight's layout (its output channels) is
  lost; those stay float."""
  if len(lhs_shape) != 1 or len(rhs_shape) != 1:
    return None
  return (((0,), (0,)), ((), ()))


def lax_dot_dimension_numbers(lhs_shape, rhs_shape) -> tuple:
  """``jax.lax.dot(lhs, rhs)`` without dimension numbers: a vector or matrix times a vector or
  matrix, lhs's last axis against rhs's first. Raises ValueError for the forms lax.dot rejects
  (the call is then left to it, which raises its own error)."""
  nl, nr = len(lhs_shape), len(rhs_shape)
  if not (1 <= nl <= 2 and 1 <= nr <= 2):
    raise ValueError("lax.dot needs dimension_numbers")
  return (((nl - 1,), (0,)), ((), ()))


def _dispatch_vdot(a, b, **kwargs):
  orig = original("vdot")
  float_call = lambda: orig(a, b, **kwargs)
  if any(jnp.iscomplexobj(_as_array(o)) for o in (a, b)):  # vdot conjugates: no real product
    dims = lambda ls, rs: None
  else:
    dims = vdot_dimension_numbers
  return _dispatch_product(a, b, dims, kwargs, float_call)


def _dispatch_lax_dot(lhs, rhs, *args, **kwargs):
  orig = original("lax.dot")
  float_call = lambda: orig(lhs, rhs, *args, **kwargs)
  a = _bind(orig, (lhs, rhs) + args, kwargs)
  if a is None:
    return float_call()
  given = a.pop("dimension_numbers", None)
  extra = {k: v for k, v in a.items() if k not in ("lhs", "rhs") and v is not None}

  def dims(ls, rs):
    if given is None:
      return lax_dot_dimension_numbers(ls, rs)
    return qdot.normalize_dimension_numbers(given, len(ls), len(rs), lhs_shape=ls, rhs_shape=rs)

  return _dispatch_product(lhs, rhs, dims, extra, float_call)


def _method_dot(name: str):
  """A dispatcher for the array method ``x.dot(w, **kwargs)`` (``name``: where it is bound)."""

  def dispatch(self, other, **kwargs):
    orig = _operator_originals[name]
    return _dispatch_product(self, other, dot_dimension_numbers, kwargs,
                             lambda: orig(self, other, **kwargs))

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch_{name.replace('.', '_')}"
  return dispatch


def _operator(name: str, swap: bool):
  """A dispatcher for the array method ``name`` (``__matmul__``, or ``__rmatmul__`` when
  ``swap``: the array is the right operand)."""

  def dispatch(self, other):
    orig = _operator_originals[name]
    if swap:
      return _dispatch_product(other, self, matmul_dimension_numbers, {},
                               lambda: orig(self, other))
    return _dispatch_product(self, other, matmul_dimension_numbers, {}, lambda: orig(self, other))

  dispatch.__name__ = dispatch.__qualname__ = f"_dispatch_{name.replace('.', '_')}"
  return dispatch


# Where JAX binds ``@``: concrete arrays (ArrayImpl's methods) and tracers (which forward
# ``__matmul__`` to their aval's ``_matmul``, a staticmethod of ShapedArray).
# (owner's name, attribute, swap the operands, a staticmethod)
_OPERATORS = (("ArrayImpl", "__matmul__", False, False), ("ArrayImpl", "__rmatmul__", True, False),
              ("ShapedArray", "_matmul", False, True), ("ShapedArray", "_rmatmul", True, True))
_OPERATOR_DISPATCHERS = {f"{o}.{attr}": _operator(f"{o}.{attr}", swap)
                         for o, attr, swap, _ in _OPERATORS}
# ``x.dot(w)``: ArrayImpl's method, and for tracers their aval's ``dot``, an ``aval_method``
# (a one-field named tuple ``(fun,)`` that Tracer.__getattr__ binds to the tracer).
_DOT_METHODS = ("ArrayImpl", "ShapedArray")
_OPERATOR_DISPATCHERS.update({f"{o}.dot": _method_dot(f"{o}.dot") for o in _DOT_METHODS})
_operator_originals: dict[str, Any] = {}
_operator_saved: dict[tuple[Any, str], Any] = {}


def _array_impl() -> type:
  """The class of JAX's concrete arrays. Never ``type(jnp.zeros(()))`` at import: creating an
  array starts JAX's backend, after which a user's ``XLA_FLAGS`` or ``jax_platforms`` set after
  ``import qtrain`` would be ignored."""
  if _ArrayImpl is not None:
    return _ArrayImpl
  return type(jnp.zeros(()))  # pragma: no cover - a JAX without jax._src.array.ArrayImpl


def _operator_owner(name: str) -> type:
  return _array_impl() if name == "ArrayImpl" else jax.core.ShapedArray


def _install_operators() -> None:
  for o, attr, _, static in _OPERATORS:
    owner = _operator_owner(o)
    _operator_saved[(owner, attr)] = vars(owner)[attr]
    # The function itself (a staticmethod unwrapped), for the dispatcher to call.
    _operator_originals[f"{o}.{attr}"] = getattr(owner, attr)
    fn = _OPERATOR_DISPATCHERS[f"{o}.{attr}"]
    setattr(owner, attr, staticmethod(fn) if static else fn)
  for o in _DOT_METHODS:
    owner = _operator_owner(o)
    raw = vars(owner).get("dot")
    if raw is None:  # pragma: no cover - a JAX that binds x.dot elsewhere: it stays float
      continue
    if o == "ShapedArray":
      if not (hasattr(raw, "_replace") and callable(getattr(raw, "fun", None))):
        continue  # pragma: no cover - not an aval_method: tracers' x.dot stays float
      _operator_originals[f"{o}.dot"] = raw.fun
      new = raw._replace(fun=_OPERATOR_DISPATCHERS[f"{o}.dot"])
    else:
      _operator_originals[f"{o}.dot"] = raw
      new = _OPERATOR_DISPATCHERS[f"{o}.dot"]
    _operator_saved[(owner, "dot")] = raw
    setattr(owner, "dot", new)


def _uninstall_operators() -> None:
  for (owner, attr), raw in list(_operator_saved.items()):
    setattr(owner, attr, raw)
  _operator_saved.clear()


_DISPATCHERS = {"dot_general": _dispatch_dot_general, "einsum": _dispatch_einsum,
                "conv_general_dilated": _dispatch_conv, "ragged_dot": _ragged("ragged_dot"),
                "ragged_dot_general": _ragged("ragged_dot_general"),
                "matmul": _product_dispatcher("matmul", matmul_dimension_numbers),
                "dot": _product_dispatcher("dot", dot_dimension_numbers),
                "tensordot": _dispatch_tensordot,
                "inner": _product_dispatcher("inner", inner_dimension_numbers),
                "vdot": _dispatch_vdot, "lax.dot": _dispatch_lax_dot}

for _name, _fn in _DISPATCHERS.items():
  _fn.__qtrain_dispatcher__ = _name  # type: ignore[attr-defined]
  _fn.__wrapped__ = original(_name)  # type: ignore[attr-defined]


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
  frames = _frames()
  top = frames[-1] if frames else None
  shared = top.counters if (top is not None and top.module is module) else dict(counters or {})
  frames.append(Frame(module=module, provider=provider, trace=trace_state(), counters=shared,
                      _path=path, sites=sites))
  try:
    yield
  finally:
    frames.pop()
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


# ---------------------------------------------------------------------------
# ``jnp.asarray`` inside a call that asks for it (qwix's PTQ models: a quantized weight passes
# through ``jnp.asarray(w, dtype)``, as Flax's ``promote_dtype`` calls it, to the quantized op).

_asarray_lock = threading.Lock()
_asarray_count = 0
_asarray_original: list = []   # jnp.asarray while the dispatcher is installed


def _dispatch_asarray(a, *args, **kwargs):
  """``jnp.asarray``: this thread's innermost :func:`asarray_scope` converter, else JAX's."""
  orig = _asarray_original[0] if _asarray_original else jnp.asarray
  convert = (getattr(_tls, "asarray", None) or [None])[-1]
  if convert is None:
    return orig(a, *args, **kwargs)
  dtype = args[0] if args else kwargs.get("dtype")
  rest, kw = args[1:], {k: v for k, v in kwargs.items() if k != "dtype"}
  return convert(a, dtype, lambda x, dt: orig(x, dt, *rest, **kw))


@contextlib.contextmanager
def asarray_scope(convert: Callable):
  """While this context runs, ``jnp.asarray(a, dtype, ...)`` made in this thread returns
  ``convert(a, dtype, fallback)``; ``fallback(x, dtype)`` is JAX's ``jnp.asarray`` with the
  call's other arguments. ``convert`` must give JAX's result for every value JAX converts
  (it may change only what JAX rejects), so a jit cache never holds a trace that differs
  from a float caller's. Other threads' calls, and every call once the last scope has
  exited, are JAX's own (the public name is restored)."""
  global _asarray_count
  with _asarray_lock:
    if _asarray_count == 0:
      _asarray_original[:] = [jnp.asarray]
      jnp.asarray = _dispatch_asarray
    _asarray_count += 1
  stack = getattr(_tls, "asarray", None)
  if stack is None:
    stack = _tls.asarray = []
  stack.append(convert)
  try:
    yield
  finally:
    stack.pop()
    with _asarray_lock:
      _asarray_count -= 1
      if _asarray_count == 0:
        jnp.asarray = _asarray_original.pop()
