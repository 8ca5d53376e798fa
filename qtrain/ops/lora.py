"""Low-rank adapters (LoRA) on a ``dot_general``'s weight: shapes, product and fold.

An adapter on a weight ``W`` of a ``dot_general`` is a pair ``A`` ``(K, r)``,
``B`` ``(r, N)``: ``K`` the product of the weight's contracting axes (in the
op's pairing order), ``N`` the product of its free axes (in the weight's own
order), ``r`` the rank. It adds ``scale * dropout(x) . A . B`` to the op's
output, laid out as ``dot_general`` lays out ``x . W``; folded into the weight
it is ``W + scale * (A . B)`` reshaped to ``W``'s layout (:func:`fold`), so a
merged model computes what the adapted one did. Weights with batch axes take
no adapter (:func:`layout` raises).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.ops import lora
  >>> dn = (((1,), (0,)), ((), ()))                  # x (M, K) . W (K, N)
  >>> lay = lora.layout((8, 3), dn, weight_operand=1)
  >>> lay.k, lay.n
  (8, 3)
  >>> x, w = jnp.ones((2, 8)), jnp.zeros((8, 3))
  >>> a, b = jnp.ones((8, 4)), jnp.ones((4, 3))
  >>> d = lora.delta(x, a, b, lay, scale=0.5)
  >>> bool(jnp.all(d == jax.lax.dot_general(x, lora.fold(w, a, b, lay, scale=0.5), dn)))
  True
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import qdot

A_NAME = "lora_a"
B_NAME = "lora_b"


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where an adapter meets its weight in one op (static).

  Attributes:
    weight_operand: 0 or 1, the weight's operand index.
    w_contract: the weight's contracting axes, in the op's pairing order.
    w_free: the weight's free axes, ascending.
    x_contract: the activation's contracting axes, paired with ``w_contract``.
    w_shape: the weight operand's shape.
  """

  weight_operand: int
  w_contract: tuple[int, ...]
  w_free: tuple[int, ...]
  x_contract: tuple[int, ...]
  w_shape: tuple[int, ...]

  @property
  def k(self) -> int:
    return math.prod(self.w_shape[a] for a in self.w_contract)

  @property
  def n(self) -> int:
    return math.prod(self.w_shape[a] for a in self.w_free)

  def shapes(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of ``A`` and ``B`` for ``rank``."""
    return (self.k, rank), (rank, self.n)


def layout(w_shape, dimension_numbers, *, weight_operand: int) -> Layout:
  """The adapter layout of a weight of shape ``w_shape`` in an op with these (normalized)
  dimension numbers; raises ValueError for a weight with batch axes or no contraction."""
  (contract, batch) = dimension_numbers
  w = int(weight_operand)
  if batch[w]:
    raise ValueError(f"a weight with batch axes {tuple(batch[w])} (shape {tuple(w_shape)}) takes "
                     "no LoRA adapter")
  if not contract[w]:
    raise ValueError(f"the op contracts no axis of the weight (shape {tuple(w_shape)}): it takes "
                     "no LoRA adapter")
  wc = tuple(int(a) for a in contract[w])
  return Layout(weight_operand=w, w_contract=wc, w_free=qdot.free_axes(len(w_shape), wc, ()),
                x_contract=tuple(int(a) for a in contract[1 - w]),
                w_shape=tuple(int(d) for d in w_shape))


def init(key: jax.Array, lay: Layout, rank: int) -> tuple[jax.Array, jax.Array]:
  """``A`` Gaussian with standard deviation ``1/sqrt(K)``, ``B`` zeros (float32): the adapted
  op starts as the base op, and the first gradient reaches ``B``."""
  (k, r), (_, n) = lay.shapes(rank)
  a = jax.random.normal(key, (k, r), jnp.float32) / math.sqrt(k)
  return a, jnp.zeros((r, n), jnp.float32)


def check_shapes(a, b, lay: Layout, where: str) -> None:
  if jnp.ndim(a) != 2 or jnp.ndim(b) != 2 or a.shape[1] != b.shape[0] or \
      a.shape[0] != lay.k or b.shape[1] != lay.n:
    raise ValueError(f"the LoRA adapter of {where} has A {tuple(jnp.shape(a))} and B "
                     f"{tuple(jnp.shape(b))}; its weight {lay.w_shape} needs A (K={lay.k}, r) and "
                     f"B (r, N={lay.n})")


def delta(x: jax.Array, a: jax.Array, b: jax.Array, lay: Layout, *, scale: float,
          dropout: float = 0.0, key: jax.Array | None = None, dtype=None) -> jax.Array:
  """``scale * dropout(x) . A . B`` in the op's output layout, computed in ``dtype``
  (default: ``x``'s float dtype). Dropout (rate ``dropout``, inverted scaling) runs only
  when ``key`` is given."""
  dtype = jnp.dtype(dtype or (x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32))
  x_free = qdot.free_axes(x.ndim, lay.x_contract, ())
  free_shape = tuple(x.shape[a] for a in x_free)
  rows = jnp.transpose(x, x_free + lay.x_contract).reshape(free_shape + (lay.k,)).astype(dtype)
  if dropout > 0.0 and key is not None:
    keep = jax.random.bernoulli(key, 1.0 - dropout, rows.shape)
    rows = jnp.where(keep, rows / jnp.asarray(1.0 - dropout, dtype), jnp.zeros((), dtype))
  h = rows @ a.astype(dtype)
  out = (h @ (b.astype(dtype) * jnp.asarray(scale, dtype))).reshape(
      free_shape + tuple(lay.w_shape[a] for a in lay.w_free))
  if lay.weight_operand == 0:  # dot_general puts the lhs's (the weight's) free axes first
    nx = len(free_shape)
    out = jnp.transpose(out, tuple(range(nx, out.ndim)) + tuple(range(nx)))
  return out


def fold(w: jax.Array, a: jax.Array, b: jax.Array, lay: Layout, *, scale: float) -> jax.Array:
  """``W + scale * A . B`` in ``W``'s layout and dtype (the sum is taken in float32)."""
  ab = (a.astype(jnp.float32) @ b.astype(jnp.float32)) * scale
  ab = ab.reshape(tuple(lay.w_shape[i] for i in lay.w_contract) +
                  tuple(lay.w_shape[i] for i in lay.w_free))
  inv = tuple(int(i) for i in np.argsort(lay.w_contract + lay.w_free))
  return (jnp.asarray(w, jnp.float32) + jnp.transpose(ab, inv)).astype(jnp.result_type(w))
