"""What every backend of :func:`qtrain.ops.dispatch.quantized_dot_general` shares.

* :class:`DotCall` — one product: operands, dimension numbers, output and
  compute dtypes.
* :class:`Unsupported` — a backend's refusal; its message is the reason.
* :class:`Backend` — the protocol: ``plan(call)`` canonicalises a call for the
  backend (or raises :class:`Unsupported`), ``run(plan)`` computes it,
  ``auto_plan(call)`` is the plan ``"auto"`` should run here (measured faster
  on this machine), else None; :func:`supports` wraps ``plan`` as
  ``None | reason``.
* The kernels' canonical form: lhs (M, K) x rhs (N, K), free axes flattened
  to M / N, contracting axes to K, with per-row / per-column (or group-wise)
  scales. Shared by the Triton and Mosaic backends.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from qtrain.core import qarray, qdot


@dataclasses.dataclass(frozen=True)
class DotCall:
  """One ``dot_general`` over QArray / float / prepared operands.

  ``compute_dtype`` has already been applied to float operands; the XLA
  backend also passes it on (see :func:`qtrain.core.qdot.dot_general_quantized_xla`).
  """

  lhs: Any
  rhs: Any
  dimension_numbers: Any
  out_dtype: jnp.dtype
  compute_dtype: jnp.dtype | None = None


class Unsupported(Exception):
  """A backend cannot take a call; ``str(e)`` says why."""


class Backend(Protocol):
  """A place a :class:`DotCall` can run (see the module docstring)."""

  name: str

  def plan(self, call: DotCall) -> Any:
    ...

  def run(self, plan: Any) -> jax.Array:
    ...

  def auto_plan(self, call: DotCall) -> Any | None:
    ...


def supports(backend: Backend, call: DotCall) -> str | None:
  """None where ``backend`` takes ``call``, else the reason it does not."""
  try:
    backend.plan(call)
  except Unsupported as e:
    return str(e)
  return None


def is_qarray(x) -> bool:
  return isinstance(x, qarray.QArray)


def decline_emulated(call: DotCall) -> None:
  """Raises :class:`Unsupported` for an operand of a qtype no GPU kernel computes: the
  value-set qtypes (nf4, mxfp4: codes into a table) and the MX qtypes (e8m0 block scales).
  The registry then runs them on XLA, dequantize-after-codes (:mod:`qtrain.core.qdot`)."""
  for what, x in (("lhs", call.lhs), ("rhs", call.rhs)):
    if is_qarray(x) and (x.qtype.is_lut or x.qtype.is_mx):
      raise Unsupported(f"{what} qtype {x.qtype.name} has no GPU kernel (emulated on XLA: "
                        "its values read from codes, the product in float, scales after)")


def canonical_operand(x, contract, free):
  """Transposes ``x`` to (free..., contract...) and flattens to 2-D."""
  perm = tuple(free) + tuple(contract)
  if perm != tuple(range(x.ndim)):
    x = jnp.transpose(x, perm)
  m = math.prod(x.shape[:len(free)])
  return x.reshape(m, -1)


def _check_free_scale(s, free, shape, what: str) -> None:
  """Along a free axis a kernel takes one scale, or one per index (not per tile)."""
  for a in free:
    if s.shape[a] not in (1, shape[a]):
      raise Unsupported(f"the {what} scale has {s.shape[a]} entries along a free axis of size "
                        f"{shape[a]} (tiled; kernels take one scale or one per index there)")


def row_scale(s, contract, free, shape, what: str = "activation"):
  """A scale that varies only along free axes, as (prod(free),); else Unsupported."""
  if any(s.shape[a] != 1 for a in contract):
    raise Unsupported(f"the {what} scale varies along a contracting axis")
  _check_free_scale(s, free, shape, what)
  full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free)
  s = jnp.transpose(s, tuple(free) + tuple(contract)).reshape(full)
  return jnp.broadcast_to(s, tuple(shape[a] for a in free)).reshape(-1)


def weight_scale(s, contract, free, shape):
  """rhs scale -> ("channel", (N,), None) or ("group", (N, G), group_size); else Unsupported."""
  n_shape = tuple(shape[a] for a in free)
  _check_free_scale(s, free, shape, "weight")
  tiled = [a for a in contract if s.shape[a] != 1]
  if not tiled:
    full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free)
    s = jnp.transpose(s, tuple(free) + tuple(contract)).reshape(full)
    return "channel", jnp.broadcast_to(s, n_shape).reshape(-1), None
  if len(contract) != 1:
    raise Unsupported("group-wise weight scales need a single contracting axis")
  (c,) = contract
  groups, k = s.shape[c], shape[c]
  if groups == k or k % groups:
    raise Unsupported(f"weight scale with {groups} entries along K={k} is not group-wise")
  full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free) + (groups,)
  s = jnp.transpose(s, tuple(free) + (c,)).reshape(full)
  s = jnp.broadcast_to(s, n_shape + (groups,)).reshape(-1, groups)
  return "group", s, k // groups


def axes(lhs, rhs, dimension_numbers):
  """(lc, rc, lfree, rfree) of a batch-free dot with contracting axes, else Unsupported."""
  (lc, rc), (lb, rb) = qdot.normalize_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
  if lb or rb:
    raise Unsupported("batch dimensions")
  if not lc:
    raise Unsupported("no contracting dimensions")
  return lc, rc, qdot.free_axes(lhs.ndim, lc, lb), qdot.free_axes(rhs.ndim, rc, rb)


def check_last_axis_dims(lhs, dimension_numbers, what: str) -> None:
  """A prepared rhs (N, K) must contract lhs's last axis with its axis 1, no batch axes."""
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lb) or tuple(rb) or tuple(rc) != (1,) or tuple(a % lhs.ndim for a in lc) != (lhs.ndim - 1,):
    raise ValueError(
        f"with a {what} rhs, dimension_numbers must contract lhs's last axis with "
        f"rhs axis 1 and have no batch axes; got {dimension_numbers}")
