"""N:M structured sparsity: at most N nonzero values in each group of M, kept by magnitude.

A :class:`Sparsity` on a rule (``QtRule(weight_sparsity=(2, 4))``, ``act_sparsity=...``)
prunes that operand of each ``dot_general`` / ``einsum`` op the rule matches before it is
quantized: in every group of ``m`` values the ``n`` largest in magnitude are kept, the others
set to 0 (ties keep the earlier value). The mask is recomputed on every call from the values
(no state), and the gradient flows to the kept values only (the pruned ones get 0), as for
``jnp.where(mask, x, 0)`` with the mask held constant. ``qtrain.freeze`` freezes the pruned,
quantized weight; a frozen op prunes its input as the QT op does.

Groups are qwix's (``qwix.SparsityRule``'s ``weight_sparsity_*`` fields map onto this class):

* ``order="R"``: groups of ``m`` consecutive values along the operand's last axis, where its
  size is a multiple of ``m`` (``m * offset`` with an offset); otherwise the whole operand is
  flattened (row-major) and cut into groups of ``m`` (its size must then be a multiple of
  ``m``). ``order="C"``: the same along the second-to-last axis (the operand with its last two
  axes swapped). For a weight ``(K, N)`` of ``x @ W``, ``"R"`` groups output channels and
  ``"C"`` the contraction.
* ``offset > 1``: a group's ``m`` values lie ``offset`` apart (in each run of ``m * offset``
  values, group ``j`` holds the values ``j, j + offset, ...``; qwix's "widely separated"
  layout, e.g. 128 for TPU lanes). ``offset`` 0 and 1 mean adjacent values.
* ``block_size > 1``: blocks of ``block_size`` consecutive values along the grouped axis are
  scored by their summed magnitude and kept or pruned whole: N:M over blocks.

Example:
  >>> import jax.numpy as jnp
  >>> from qtrain.sparsity import Sparsity, sparsify
  >>> sparsify(jnp.array([[1., -4., 2., 3.], [0., 1., 1., -1.]]), Sparsity(n=2, m=4))
  Array([[ 0., -4.,  0.,  3.],
         [ 0.,  1.,  1.,  0.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["Sparsity", "as_sparsity", "mask", "sparsify", "ORDERS"]

ORDERS = ("R", "C")


@dataclasses.dataclass(frozen=True)
class Sparsity:
  """N:M structured sparsity of one operand (see the module docstring).

  Attributes:
    n: values kept in each group (1 <= n <= m).
    m: the group size.
    order: ``"R"`` (groups along the last axis) or ``"C"`` (along the second-to-last).
    block_size: 0 or 1: single values; > 1: blocks of that many values kept or pruned whole.
    offset: 0 or 1: a group is ``m`` adjacent values; > 1: ``m`` values ``offset`` apart.
  """

  n: int
  m: int
  order: str = "R"
  block_size: int = 0
  offset: int = 0

  def __post_init__(self):
    bad = []
    for f in ("n", "m", "block_size", "offset"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int):
        bad.append(f"{f}={v!r} must be an int")
    if not bad:
      if not 1 <= self.m:
        bad.append(f"m={self.m} must be >= 1")
      elif not 1 <= self.n <= self.m:
        bad.append(f"n={self.n} must be in [1, m={self.m}] (keep n of every m values)")
      if self.block_size < 0:
        bad.append(f"block_size={self.block_size} must be >= 0 (0 or 1: single values)")
      if self.offset < 0:
        bad.append(f"offset={self.offset} must be >= 0 (0 or 1: adjacent values)")
    if self.order not in ORDERS:
      bad.append(f"order={self.order!r}; valid: {list(ORDERS)}")
    if bad:
      raise ValueError("Invalid Sparsity: " + "; ".join(bad))

  def short(self) -> str:
    extra = "".join(f",{k}={getattr(self, k)}" for k, d in (("order", "R"), ("block_size", 0),
                                                             ("offset", 0))
                    if getattr(self, k) != d)
    return f"{self.n}:{self.m}{extra}"


def as_sparsity(value, field: str) -> Sparsity | None:
  """``value`` as a :class:`Sparsity`: None, a Sparsity, or ``(n, m)``; raises, naming
  ``field``, otherwise."""
  if value is None or isinstance(value, Sparsity):
    return value
  if isinstance(value, (tuple, list)) and len(value) == 2:
    try:
      return Sparsity(n=value[0], m=value[1])
    except ValueError as e:
      raise ValueError(f"{field}={tuple(value)!r}: {e}") from None
  raise ValueError(f"{field}={value!r}; valid: None, (n, m) (N:M sparsity, e.g. (2, 4)) or a "
                   "qtrain.sparsity.Sparsity")


def _groups_last(scores, n: int, m: int, offset: int, what: str):
  """The N:M mask of ``scores`` (>= 0), grouped along its last axis (or flattened)."""
  shape = scores.shape
  size = scores.size
  last = shape[-1] if shape else 1
  if size % m:
    raise ValueError(f"{what}: {size} values (shape {shape}) do not split into groups of m={m}")
  step = max(offset, 1)
  if offset > 0 and size % (offset * m):
    raise ValueError(f"{what}: with offset={offset} the operand's {size} values (shape {shape}) "
                     f"must split into runs of m * offset = {m * offset}")
  along_last = last % (m * step) == 0
  lead = shape[:-1] if along_last else ()
  run = last if along_last else size
  s = scores.reshape(lead + (run // (m * step), m, step))
  s = jnp.swapaxes(s, -1, -2)  # (..., runs, step, m): group j of a run holds j, j + step, ...
  _, idx = jax.lax.top_k(s, n)
  keep = jnp.any(jax.nn.one_hot(idx, m, dtype=jnp.bool_), axis=-2)
  return jnp.swapaxes(keep, -1, -2).reshape(shape)


def mask(x, sparsity: Sparsity, *, what: str = "sparsity") -> jax.Array:
  """The bool mask of the values :func:`sparsify` keeps (True: kept). ``what`` names the
  operand in errors."""
  x = jnp.asarray(x)
  if sparsity.order == "C" and x.ndim < 2:
    raise ValueError(f"{what}: order='C' groups along the second-to-last axis; the operand has "
                     f"shape {x.shape}")
  a = jnp.abs(jax.lax.stop_gradient(x)).astype(jnp.float32)
  if sparsity.order == "C":
    a = jnp.swapaxes(a, -1, -2)
  bs = sparsity.block_size
  if bs > 1:
    if a.ndim == 0 or a.shape[-1] % bs:
      raise ValueError(f"{what}: block_size={bs} does not divide the grouped axis of the operand "
                       f"(shape {x.shape}, order={sparsity.order!r})")
    a = a.reshape(a.shape[:-1] + (a.shape[-1] // bs, bs)).sum(-1)
  keep = _groups_last(a, sparsity.n, sparsity.m, sparsity.offset, what)
  if bs > 1:
    keep = jnp.repeat(keep, bs, axis=-1)
  if sparsity.order == "C":
    keep = jnp.swapaxes(keep, -1, -2)
  return keep


def sparsify(x, sparsity: Sparsity | None, *, what: str = "sparsity") -> jax.Array:
  """``x`` with the values outside its N:M mask set to 0 (``x`` itself for None). The gradient
  reaches the kept values only."""
  if sparsity is None:
    return x
  x = jnp.asarray(x)
  return jnp.where(mask(x, sparsity, what=what), x, jnp.zeros((), x.dtype))
