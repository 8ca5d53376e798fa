"""The backend registry and the "auto" policy (the seam between the ops and the kernels).

:func:`quantized_dot_general` takes the same operands as
:func:`qtrain.core.qdot.dot_general_quantized_xla` (each a ``QArray`` or a
float array; the rhs may also be a kernel-layout weight) and runs them on the
backend named by ``implementation`` (:data:`BACKENDS`, one module each under
:mod:`qtrain.ops.backends`):

  "xla": always the XLA reference, layouts left to XLA.
  "triton": the Pallas Triton kernels (GPU only).
  "mosaic": the Pallas Mosaic GPU kernels (Hopper, jax >= 0.11): small-M
    matmul, int8 GEMM for larger M.
  "interpret": the Triton kernels in the Pallas interpreter (CPU tests).
  "auto": an ordered policy, :data:`AUTO_ORDER`: the first GPU backend whose
    ``auto_plan`` takes the call (what it supports *and* measured faster
    than XLA for it, see each backend's docstring) runs on a CUDA lowering;
    everything else, and every other platform, runs on XLA with its int8/fp8
    GEMMs in GEMM layout. A PreparedWeight (kernel layout only) runs on the
    Triton kernel on CUDA and in the interpreter elsewhere.

A forced backend on a call it does not take raises ValueError with the
backend's reason (never a silent fallback, never silently wrong numbers).

Example:
  >>> import jax.numpy as jnp
  >>> from qtrain.core import qarray
  >>> from qtrain.ops import dispatch
  >>> w = qarray.quantize(jnp.ones((8, 4)), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  >>> dn = (((1,), (0,)), ((), ()))
  >>> dispatch.supports(jnp.ones((2, 8)), w, dn, implementation="triton") is None
  True
  >>> dispatch.supports(jnp.ones((2, 8)), jnp.ones((8, 4)), dn, implementation="triton")
  'the rhs is not quantized (kernels take quantized weights as rhs)'
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qtrain.core import _lax
from qtrain.core import qdot
from qtrain.kernels import _common
from qtrain.kernels import mosaic_matmul as _mosaic
from qtrain.kernels.prepared import PreparedWeight
from qtrain.ops import config as cfg_lib
from qtrain.ops.backends import _base
from qtrain.ops.backends.mosaic import MosaicBackend
from qtrain.ops.backends.triton import TritonBackend
from qtrain.ops.backends.xla import XlaBackend

IMPLEMENTATIONS = cfg_lib.IMPLEMENTATIONS

# The registry: every implementation name but "auto" is one backend.
BACKENDS: dict[str, _base.Backend] = {
    "xla": XlaBackend(),
    "triton": TritonBackend(),
    "mosaic": MosaicBackend(),
    "interpret": TritonBackend(interpret=True),
}
assert set(BACKENDS) | {"auto"} == set(IMPLEMENTATIONS), (sorted(BACKENDS), IMPLEMENTATIONS)

# "auto": the GPU backends it tries, in order, before XLA (in GEMM layout).
AUTO_ORDER: tuple[str, ...] = ("mosaic", "triton")
_AUTO_XLA = XlaBackend(gemm_layout=True)

__all__ = ["AUTO_ORDER", "BACKENDS", "IMPLEMENTATIONS", "quantized_dot_general", "supports"]


def supports(lhs, rhs, dimension_numbers, *, implementation: str,
             preferred_element_type=None) -> str | None:
  """None where backend ``implementation`` takes this call, else the reason it does not."""
  cfg_lib.check_implementation(implementation)
  if implementation == "auto":
    return None
  out = jnp.dtype(preferred_element_type if preferred_element_type is not None else jnp.float32)
  return _base.supports(BACKENDS[implementation],
                        _base.DotCall(lhs, rhs, dimension_numbers, out))


def _empty_product(lhs, rhs, dimension_numbers, out_dtype) -> jax.Array | None:
  """Zeros of ``lax.dot_general``'s output shape where an operand has no
  elements (M, N or K = 0; with K = 0 the (M, N) output is all zeros), else None."""
  if isinstance(rhs, (PreparedWeight, _mosaic.MosaicWeight)):
    if math.prod(lhs.shape) != 0:
      return None
    _base.check_last_axis_dims(lhs, dimension_numbers, type(rhs).__name__)
    return jnp.zeros(tuple(lhs.shape[:-1]) + (rhs.n,), out_dtype)
  if math.prod(lhs.shape) != 0 and math.prod(rhs.shape) != 0:
    return None
  dn = qdot.normalize_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim,
                                        lhs_shape=lhs.shape, rhs_shape=rhs.shape)
  return jnp.zeros(qdot.output_shape(lhs.shape, rhs.shape, dn), out_dtype)


def _as_compute_dtype(x, compute_dtype):
  """A float (not quantized, not prepared) operand cast to ``compute_dtype``."""
  if compute_dtype is None or _base.is_qarray(x) or isinstance(x, (PreparedWeight, _mosaic.MosaicWeight)):
    return x
  return x if x.dtype == compute_dtype else x.astype(compute_dtype)


def _forced(name: str, call: _base.DotCall) -> jax.Array:
  backend = BACKENDS[name]
  try:
    plan = backend.plan(call)
  except _base.Unsupported as e:
    if name == "mosaic":
      raise ValueError(f"implementation='mosaic': the Mosaic kernel does not handle this dot "
                       f"({e}); use implementation='triton', 'xla' or 'auto'") from None
    raise ValueError(f"implementation={name!r}: no qtrain kernel handles this dot ({e}); use "
                     f"implementation='xla' or 'auto'") from None
  if name == "triton" and not _common.on_gpu():
    raise ValueError(f"implementation='triton' needs a GPU backend; this one is "
                     f"{jax.default_backend()!r} (use 'interpret' on CPU)")
  return backend.run(plan)


def _auto(call: _base.DotCall) -> jax.Array:
  # Kernels are chosen per lowering platform (not the process's default
  # backend), so the same code also runs on a CPU device of a GPU process.
  if isinstance(call.rhs, PreparedWeight):  # kernel layout only: no XLA path
    triton, interpret = BACKENDS["triton"], BACKENDS["interpret"]
    try:
      plan = triton.auto_plan(call)
    except _base.Unsupported as e:
      raise ValueError(f"implementation='auto': no qtrain kernel handles this dot ({e}); "
                       f"pass a QArray rhs") from None
    return jax.lax.platform_dependent(cuda=lambda: triton.run(plan),
                                      default=lambda: interpret.run(plan))
  xla = lambda: _AUTO_XLA.run(_AUTO_XLA.plan(call))
  # (A MosaicWeight rhs has concrete sizes by construction: only arrays and QArrays have shapes.)
  if _lax.has_symbolic_dim(call.lhs.shape, getattr(call.rhs, "shape", ())):
    # A symbolic dimension (jax.export with a shape variable): the GPU backends plan grids and
    # pick measured configs on concrete sizes, so the product is XLA's, valid for every size.
    return xla()
  for name in AUTO_ORDER:
    backend = BACKENDS[name]
    plan = backend.auto_plan(call)
    if plan is not None:
      return jax.lax.platform_dependent(cuda=lambda: backend.run(plan), default=xla)
  return xla()


def quantized_dot_general(lhs, rhs, dimension_numbers, *, preferred_element_type,
                          implementation: str = "auto", compute_dtype=None) -> jax.Array:
  """``dot_general`` over QArray/float operands, by a Pallas kernel or by XLA.

  Args:
    lhs: a ``QArray`` or a float array (activations).
    rhs: a ``QArray`` or a float array (weights), a
      :class:`~qtrain.kernels.prepared.PreparedWeight`, or (with "mosaic" or
      "auto") a :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight`.
    dimension_numbers: as for :func:`jax.lax.dot_general`.
    preferred_element_type: the float output dtype (None: float32).
    implementation: one of :data:`IMPLEMENTATIONS`.
    compute_dtype: the float dtype of a product with a float operand (see
      :func:`qtrain.core.qdot.dot_general_quantized_xla`): float operands are
      cast to it before a kernel or XLA sees them. None: as they are.

  Returns:
    The product, shaped like ``jax.lax.dot_general``'s output. An operand with
    no elements gives zeros of that shape for every implementation, forced
    kernels included: there is nothing to compute, so no kernel is planned or
    run and no other path stands in for one.

  Raises:
    ValueError: for an unknown ``implementation``, or a forced kernel
      ("triton"/"mosaic"/"interpret") on a config no kernel handles (the
      message says why), or "triton"/"mosaic" off a GPU; not for an empty
      product (see Returns), except for a weight form the implementation
      never takes (a MosaicWeight off "mosaic"/"auto", a PreparedWeight on "xla").
  """
  cfg_lib.check_implementation(implementation)
  out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None else jnp.float32)
  # Weight forms an implementation cannot take are refused whatever the shapes.
  if isinstance(rhs, _mosaic.MosaicWeight) and implementation not in ("mosaic", "auto"):
    raise ValueError(f"a MosaicWeight rhs runs with implementation='mosaic' or 'auto'; got "
                     f"{implementation=}")
  prepared_rhs = isinstance(rhs, PreparedWeight)
  if prepared_rhs and implementation == "xla":
    raise ValueError("implementation='xla' cannot take a PreparedWeight rhs; pass a QArray")
  empty = _empty_product(lhs, rhs, dimension_numbers, out_dtype)
  if empty is not None:
    return empty
  if compute_dtype is not None:
    compute_dtype = jnp.dtype(compute_dtype)
    lhs, rhs = _as_compute_dtype(lhs, compute_dtype), _as_compute_dtype(rhs, compute_dtype)
  call = _base.DotCall(lhs, rhs, dimension_numbers, out_dtype, compute_dtype)
  if implementation == "auto":
    return _auto(call)
  return _forced(implementation, call)
