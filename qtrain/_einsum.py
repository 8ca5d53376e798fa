"""Two-operand einsum written as one ``dot_general`` (so it can be quantized).

We do not call ``jnp.einsum`` to quantize an einsum: ``jnp.einsum`` is
internally jitted, and quantizing while its inner jit traces would put a
quantized jaxpr in a cache that float callers share. Instead the einsum is
parsed here into a ``dot_general`` (batch / contracting dimension numbers)
plus a transpose of its output, and the caller runs that ``dot_general``
through :func:`qtrain.ops.dot_general_qt`.

Supported: two operands, explicit (``->``) or implicit output, ``...``
(ellipsis axes must have equal sizes on both operands when both have them),
labels summed out of one operand only. Not supported (``parse`` returns
None; the caller falls back to float with a warning): repeated labels in one
operand (diagonals), broadcasting a size-1 label against a larger one.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
  lhs_sum_axes: tuple[int, ...]      # axes summed out of lhs before the dot
  rhs_sum_axes: tuple[int, ...]
  dimension_numbers: tuple          # for the (summed) operands
  out_perm: tuple[int, ...]         # transpose of the dot_general output
  lhs_contract_axes: tuple[int, ...]  # in the summed lhs (for the activation shift)
  rhs_contract_axes: tuple[int, ...]


_POOL = [chr(0x3B1 + i) for i in range(24)]  # greek letters: never valid einsum labels in JAX


def _expand(term: str, ndim: int, n_ell: int, what: str) -> list[str] | None:
  if "..." in term:
    head, tail = term.split("...")
    k = ndim - len(head) - len(tail)
    if k < 0:
      return None
    return list(head) + _POOL[n_ell - k:n_ell] + list(tail)
  if len(term) != ndim:
    raise ValueError(f"einsum operand {what} has rank {ndim} but subscripts {term!r}")
  return list(term)


def parse(subscripts: str, lhs_shape, rhs_shape) -> EinsumPlan | None:
  """Plans ``einsum(subscripts, lhs, rhs)`` as a dot_general; None if unsupported."""
  if not isinstance(subscripts, str):
    return None
  s = subscripts.replace(" ", "")
  if "->" in s:
    ins, out = s.split("->")
  else:
    ins, out = s, None
  terms = ins.split(",")
  if len(terms) != 2 or any(t.count("...") > 1 for t in terms):
    return None
  ells = []
  for t, shp in zip(terms, (lhs_shape, rhs_shape)):
    ells.append(len(shp) - len(t.replace("...", "")) if "..." in t else 0)
  n_ell = max(ells)
  if n_ell > len(_POOL):
    return None
  lt = _expand(terms[0], len(lhs_shape), n_ell, "0")
  rt = _expand(terms[1], len(rhs_shape), n_ell, "1")
  if lt is None or rt is None or len(set(lt)) != len(lt) or len(set(rt)) != len(rt):
    return None
  sizes: dict[str, int] = {}
  for labels, shp in ((lt, lhs_shape), (rt, rhs_shape)):
    for lab, n in zip(labels, shp):
      if lab in sizes and sizes[lab] != n:
        return None  # broadcasting of size-1 labels: not supported here
      sizes[lab] = n
  if out is None:
    ell_labels = _POOL[:n_ell]
    once = sorted(c for c in set(lt + rt) if c not in ell_labels and (lt + rt).count(c) == 1)
    ot = [c for c in ell_labels if c in lt or c in rt] + once
  else:
    if out.count("...") > 1:
      return None
    if "..." in out:
      head, tail = out.split("...")
      ot = list(head) + _POOL[:n_ell] + list(tail)
    else:
      ot = list(out)
  if len(set(ot)) != len(ot) or any(c not in lt and c not in rt for c in ot):
    return None
  # Labels in one operand only and not in the output are summed out first.
  lhs_sum = tuple(i for i, c in enumerate(lt) if c not in rt and c not in ot)
  rhs_sum = tuple(i for i, c in enumerate(rt) if c not in lt and c not in ot)
  lt2 = [c for i, c in enumerate(lt) if i not in lhs_sum]
  rt2 = [c for i, c in enumerate(rt) if i not in rhs_sum]
  batch = [c for c in lt2 if c in rt2 and c in ot]
  contract = [c for c in lt2 if c in rt2 and c not in ot]
  lb = tuple(lt2.index(c) for c in batch)
  rb = tuple(rt2.index(c) for c in batch)
  lc = tuple(lt2.index(c) for c in contract)
  rc = tuple(rt2.index(c) for c in contract)
  lfree = [c for c in lt2 if c not in batch and c not in contract]
  rfree = [c for c in rt2 if c not in batch and c not in contract]
  res = batch + lfree + rfree
  if sorted(res) != sorted(ot):
    return None
  perm = tuple(res.index(c) for c in ot)
  return EinsumPlan(lhs_sum_axes=lhs_sum, rhs_sum_axes=rhs_sum,
                    dimension_numbers=((lc, rc), (lb, rb)), out_perm=perm,
                    lhs_contract_axes=lc, rhs_contract_axes=rc)


def run(plan: EinsumPlan, lhs, rhs, dot_general):
  """Runs ``plan`` with ``dot_general(lhs, rhs, dimension_numbers)``."""
  if plan.lhs_sum_axes:
    lhs = jnp.sum(lhs, axis=plan.lhs_sum_axes)
  if plan.rhs_sum_axes:
    rhs = jnp.sum(rhs, axis=plan.rhs_sum_axes)
  out = dot_general(lhs, rhs, plan.dimension_numbers)
  if plan.out_perm != tuple(range(len(plan.out_perm))):
    out = jnp.transpose(out, plan.out_perm)
  return out
