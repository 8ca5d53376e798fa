"""A materialized transpose (Pallas): the layout XLA cannot take back.

Why it exists: XLA's GPU layout assignment turns a ``transpose`` into a free
layout change (a bitcast) wherever it can, and a quantized dot whose int8 /
fp8 operands end up with the contracting axis major runs on a slow GEMM
(cuBLAS's int8 fast path wants both operands K-minor, "TN"): measured in the
int8 training step, a cutlass sm80 fallback at 1/8 of the int8 speed, or a
Triton GEMM at half of it, or a standalone XLA int8 transpose at a few percent
of HBM bandwidth (docs/performance-history.md, "Training step profile and GEMM layout"). A Pallas
call's operands and results have a fixed row-major layout, so this copy pins
the operand in the layout the GEMM wants.

:func:`transpose` takes any permutation; it runs the kernel when the
permutation swaps two contiguous groups of axes after leading batch axes
(``(batch..., A..., B...) -> (batch..., B..., A...)``, which is what putting
a dot operand's contracting axes last needs) and the two groups' sizes are
multiples of the block; otherwise it is ``jnp.transpose``.

Example:
  >>> import jax.numpy as jnp
  >>> from qtrain.kernels import transpose as tp
  >>> x = jnp.arange(256 * 128, dtype=jnp.int32).reshape(256, 128).astype(jnp.int8)
  >>> y = tp.transpose(x, (1, 0), interpret=True)
  >>> bool((y == x.T).all())
  True
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qtrain.kernels import _common
from qtrain.kernels import sharded

BLOCK = 64  # tile edge (elements); sizes that are not multiples fall back to jnp.transpose


def _kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...].T


def split_perm(perm: tuple[int, ...]) -> tuple[int, int] | None:
  """``(nb, na)`` when ``perm`` = (0..nb-1, nb+na.., nb..nb+na-1) with both
  swapped groups non-empty, else None (the identity included)."""
  n = len(perm)
  nb = 0
  while nb < n and perm[nb] == nb:
    nb += 1
  if nb == n:
    return None
  first = perm[nb]  # the B group starts at axis `first`; A = [nb, first)
  expect = tuple(range(nb)) + tuple(range(first, n)) + tuple(range(nb, first))
  return (nb, first - nb) if perm == expect else None


def transpose_batched(x: jax.Array, *, interpret: bool = False, block: int = BLOCK) -> jax.Array:
  """(B, P, Q) -> (B, Q, P) by the Pallas kernel; P and Q multiples of ``block``."""
  b, p, q = x.shape
  if p % block or q % block:
    raise ValueError(f"transpose_batched needs P={p} and Q={q} to be multiples of block={block}")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        _kernel,
        out_shape=_common.out_struct((b, q, p), x.dtype, x),
        grid=(b, p // block, q // block),
        in_specs=[pl.BlockSpec((None, block, block), lambda k, i, j: (k, i, j))],
        out_specs=pl.BlockSpec((None, block, block), lambda k, i, j: (k, j, i)),
        compiler_params=_common.triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qtrain_transpose",
    )(x)


def transpose(x: jax.Array, perm, *, interpret: bool = False, block: int = BLOCK) -> jax.Array:
  """``jnp.transpose(x, perm)``, materialized by the Pallas kernel where it applies.

  Args:
    x: any array.
    perm: a permutation of ``range(x.ndim)``.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
    block: tile edge of the kernel.

  Returns:
    The transposed array (identical values to ``jnp.transpose``).
  """
  perm = tuple(int(a) for a in perm)
  if sorted(perm) != list(range(x.ndim)):
    raise ValueError(f"perm={perm} is not a permutation of the {x.ndim} axes of shape {x.shape}")
  if perm == tuple(range(x.ndim)):
    return x
  split = split_perm(perm)
  if split is None:
    return jnp.transpose(x, perm)
  nb, na = split
  bshape, ashape, cshape = x.shape[:nb], x.shape[nb:nb + na], x.shape[nb + na:]
  p, q = math.prod(ashape), math.prod(cshape)
  if p % block or q % block:
    return jnp.transpose(x, perm)
  y = transpose_batched(x.reshape(math.prod(bshape), p, q), interpret=interpret, block=block)
  return y.reshape(bshape + cshape + ashape)


@functools.lru_cache(maxsize=None)
def _kernel_transpose(perm: tuple[int, ...]):
  """One function per permutation: a static argument of the per-shard wrapper (a stable
  object, so every call of one permutation shares its lowering)."""
  return functools.partial(transpose, perm=perm)


def gemm_transpose(x: jax.Array, perm) -> jax.Array:
  """:func:`transpose` by the Pallas kernel when lowered for a CUDA GPU (one kernel call per
  shard under ``jax.jit`` with sharded operands: :mod:`qtrain.kernels.sharded`),
  ``jnp.transpose`` for any other platform (chosen per lowering platform, so a CPU computation
  in a process whose default backend is a GPU works too). Not differentiable on the GPU
  branch: meant for quantized values."""
  perm = tuple(int(a) for a in perm)
  return jax.lax.platform_dependent(
      x, cuda=lambda v: sharded.transpose(v, perm, _kernel_transpose(perm)),
      default=lambda v: jnp.transpose(v, perm))
