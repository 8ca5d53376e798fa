"""The incoming gradient quantized for both backward products from two reads (Pallas Triton).

A quantized dot's backward quantizes its incoming gradient ``g`` (M, N) twice: for the input
gradient ``g @ w.T`` with the weight's per-column scale folded in and one scale per row, and
for the weight gradient ``x.T @ g`` with the activation's per-row scale folded in and one scale
per column, where the GEMM wants the codes transposed, (N, M), contraction minor. On XLA that
is two reductions and two quantization passes that each read ``g``, and a transpose of the
second pass's codes. Here two kernels read ``g`` once each:

* :func:`grad_pair_bounds`: the absmax bound of every row of ``g * fold_l`` and every column
  of ``g * fold_r`` (as ``|.|`` bits, whose max is exact in any order);
* :func:`grad_pair`: given the two scales, both code sets, the second written transposed.

Per element, with ``fold_l`` (N,) / ``fold_r`` (M,) the folded residual scales and
``inv_l`` (M,) / ``inv_r`` (N,) the reciprocals of the two gradient scales::

  y_l = (g * fold_l[n]) * inv_l[m]   ->  codes_l[m, n]
  y_r = (g * fold_r[m]) * inv_r[n]   ->  codes_rt[n, m]

each rounded to the gradient's qtype, an integer or an fp8 one (``code_dtype``): to nearest
(integers half to even; fp8 by the conversion, also half to even), or stochastically with the
bytes of :func:`qtrain.core.rounding.hash_words` of the element's word in the row-major order of
``g``'s own shape (``n_last``: the size of its last axis; fp8 values go to a neighbour on their
grid, :func:`qtrain.core.rounding.fp8_round_with_noise`), then clipped to ``[qmin, qmax]``. These are
:func:`qtrain.core.qarray.quantize`'s operations in its order, the division by the scale as a
multiplication by its reciprocal, which is what XLA computes for ``x / broadcast(scale)`` (the
tests compare the codes with XLA's quantization bit for bit, on the CPU in the interpreter and
on a GPU); :func:`grad_pair_reference` and :func:`grad_pair_bounds_reference` are the kernels
in ``jnp``.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from qtrain.kernels import grad_pair
  >>> g = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
  >>> fl, fr = jnp.ones((128,)), jnp.ones((64,))
  >>> il = 127.0 / jnp.abs(g.astype(jnp.float32)).max(axis=1)
  >>> ir = 127.0 / jnp.abs(g.astype(jnp.float32)).max(axis=0)
  >>> seeds = jnp.array([1, 2, 3, 4], jnp.uint32)
  >>> cl, crt = grad_pair.grad_pair(g, fl, fr, il, ir, seeds, qmin=-128, qmax=127, n_last=128,
  ...                               stochastic=(True, True), interpret=True)
  >>> rl, rrt = grad_pair.grad_pair_reference(g, fl, fr, il, ir, seeds, qmin=-128, qmax=127,
  ...                                         n_last=128, stochastic=(True, True))
  >>> cl.shape, crt.shape, bool((cl == rl).all() & (crt == rrt).all())
  ((64, 128), (128, 64), True)
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from qtrain.core import rounding
from qtrain.kernels import _common

BLOCK = 64  # tile edge; M and N must be multiples of it
NUM_WARPS = 4
# Flat element indices are int32 in the kernel.
MAX_ELEMENTS = 2**31 - 1


def supported(m: int, n: int, block: int = BLOCK) -> str | None:
  """None where :func:`grad_pair` takes an (m, n) gradient, else why not."""
  if m <= 0 or n <= 0 or m % block or n % block:
    return f"(M, N) = {(m, n)} are not positive multiples of the block {block}"
  if m * n > MAX_ELEMENTS:
    return f"M * N = {m * n} elements exceed {MAX_ELEMENTS} (int32 flat indices)"
  return None


def _noise(row0, col0, shape, n: int, n_last: int, s0, s1):
  """Uniform noise in (0, 1) of the (rows, cols) = ``shape`` tile at ``(row0, col0)`` of an
  (M, ``n``) gradient whose original last axis has ``n_last`` elements: each element's byte of
  its :func:`qtrain.core.rounding.hash_words` word (4 consecutive elements of that axis share
  a word: the layout of ``stochastic_round``'s ``low_bit_hash`` bytes).

  Where ``n_last`` is a multiple of 4 the words tile the row-major order: one hash per word,
  its 4 bytes spread over the word's elements (a quarter of the integer work of hashing per
  element, which bounds the kernel's speed). Else each element hashes its own word."""
  rows, cols = shape
  iota = lambda shp, axis: lax.broadcasted_iota(jnp.int32, shp, axis)
  if n_last % 4 == 0 and cols % 4 == 0:
    wshape = (rows, cols // 4)
    word = (row0 + iota(wshape, 0)) * (n // 4) + (col0 // 4 + iota(wshape, 1))
    bits = rounding.mix_words(word.astype(jnp.uint32), s0, s1)
    shift = (iota(wshape + (4,), 2) * 8).astype(jnp.uint32)
    b = ((bits[:, :, None] >> shift) & jnp.uint32(0xFF)).reshape(rows, cols)
  else:
    flat = (row0 + iota(shape, 0)) * n + (col0 + iota(shape, 1))
    row, col = flat // n_last, flat % n_last
    word, byte = row * (-(-n_last // 4)) + (col >> 2), col & 3
    bits = rounding.mix_words(word.astype(jnp.uint32), s0, s1)
    b = (bits >> (byte.astype(jnp.uint32) * jnp.uint32(8))) & jnp.uint32(0xFF)
  return (b.astype(jnp.float32) + 0.5) * (1.0 / 256.0)


def _round_half_even(y):
  """``jnp.round`` (half to even) from floor and compares: Pallas Triton lowers no ``round``.
  Exact: ``f`` and ``y - f`` are exact in float32, and a float32 of magnitude >= 2**23 is an
  integer (``d`` = 0)."""
  f = jnp.floor(y)
  d = y - f
  odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0
  return jnp.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


CODE_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
"""The code dtypes the kernel writes: int8 (every integer qtype of <= 8 bits) and the fp8 ones."""


def _round(y, u, qmin: float, qmax: float, code_dtype: str):
  """:func:`qtrain.core.rounding.round_nearest` / ``stochastic_round``'s operations for an
  integer or fp8 qtype (``u``: the noise, None to round to nearest)."""
  if code_dtype == "int8":
    r = _round_half_even(y) if u is None else jnp.floor(y + u)
    return jnp.clip(r, qmin, qmax).astype(jnp.int8)
  dtype = jnp.dtype(code_dtype)
  r = y if u is None else rounding.fp8_round_with_noise(y, dtype, u)
  return jnp.clip(r, qmin, qmax).astype(dtype)


def _codes(g, fold_l, fold_r, inv_l, inv_r, row0, col0, seeds, *, n, qmin, qmax, n_last,
           stochastic, code_dtype):
  """Both codes of the tile ``g`` at ``(row0, col0)`` of the (M, ``n``) gradient."""
  g = g.astype(jnp.float32)
  y_l = (g * fold_l[None, :]) * inv_l[:, None]
  y_r = (g * fold_r[:, None]) * inv_r[None, :]
  noise = lambda s0, s1: _noise(row0, col0, g.shape, n, n_last, s0, s1)
  u_l = noise(seeds[0], seeds[1]) if stochastic[0] else None
  u_r = noise(seeds[2], seeds[3]) if stochastic[1] else None
  return _round(y_l, u_l, qmin, qmax, code_dtype), _round(y_r, u_r, qmin, qmax, code_dtype)


def _abs_bits(y):
  """The int32 bits of ``|y|`` (float32): they order as the magnitudes, Inf above every finite
  value and NaN above Inf (:func:`qtrain.core.qarray.calibrate`'s absmax bound)."""
  return lax.bitcast_convert_type(y, jnp.int32) & jnp.int32(0x7FFFFFFF)


def _tile_bounds(g, fold_l, fold_r):
  """(row maxima of the input-gradient values, column maxima of the weight-gradient ones) of
  one tile, as ``|.|`` bits."""
  g = g.astype(jnp.float32)
  return (jnp.max(_abs_bits(g * fold_l[None, :]), axis=1),
          jnp.max(_abs_bits(g * fold_r[:, None]), axis=0))


def grad_pair_bounds_reference(g, fold_l, fold_r):
  """:func:`grad_pair_bounds` in ``jnp`` (XLA)."""
  return _tile_bounds(g, fold_l, fold_r)


# A jit boundary per signature: a decoder's step calls each shape once per layer, and each call
# would otherwise trace the kernel again (lowering time).
@functools.partial(jax.jit, static_argnames=("interpret", "block", "num_warps"))
def grad_pair_bounds(g, fold_l, fold_r, *, interpret: bool = False, block: int = BLOCK,
                     num_warps: int = NUM_WARPS):
  """The absmax bounds of both folded gradients from one read of ``g``.

  Returns ``(rows (M,), cols (N,))`` int32: the bits of ``max_n |g[m, n] * fold_l[n]|`` and of
  ``max_m |g[m, n] * fold_r[m]|`` (see :func:`_abs_bits`; a max of bits is exact in any order,
  so these are the bounds XLA's reductions find). Each tile writes its partial maxima; XLA
  reduces the (N / block, M) and (M / block, N) partials.
  """
  m, n = g.shape
  why = supported(m, n, block)
  if why is not None:
    raise ValueError(f"grad_pair_bounds: {why}")

  def kernel(g_ref, fl_ref, fr_ref, r_ref, c_ref):
    r_ref[...], c_ref[...] = _tile_bounds(g_ref[...], fl_ref[...], fr_ref[...])

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    rows, cols = pl.pallas_call(
        kernel,
        out_shape=(_common.out_struct((n // block, m), jnp.int32, g, fold_l, fold_r),
                   _common.out_struct((m // block, n), jnp.int32, g, fold_l, fold_r)),
        grid=(m // block, n // block),
        in_specs=[pl.BlockSpec((block, block), lambda i, j: (i, j)),
                  pl.BlockSpec((block,), lambda i, j: (j,)),
                  pl.BlockSpec((block,), lambda i, j: (i,))],
        out_specs=(pl.BlockSpec((None, block), lambda i, j: (j, i)),
                   pl.BlockSpec((None, block), lambda i, j: (i, j))),
        compiler_params=_common.triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qtrain_grad_pair_bounds",
    )(g, fold_l.astype(jnp.float32), fold_r.astype(jnp.float32))
  return rows.max(axis=0), cols.max(axis=0)


def grad_pair_reference(g, fold_l, fold_r, inv_l, inv_r, seeds, *, qmin: float, qmax: float,
                        n_last: int, stochastic: tuple[bool, bool], code_dtype: str = "int8"):
  """:func:`grad_pair` in ``jnp`` (XLA): ``(codes_l (M, N), codes_rt (N, M))`` of
  ``code_dtype``."""
  c_l, c_r = _codes(g, fold_l, fold_r, inv_l, inv_r, 0, 0, seeds, n=g.shape[1], qmin=qmin,
                    qmax=qmax, n_last=n_last, stochastic=stochastic, code_dtype=code_dtype)
  return c_l, c_r.T


@functools.partial(jax.jit, static_argnames=("qmin", "qmax", "n_last", "stochastic", "code_dtype",
                                             "interpret", "block", "num_warps"))
def grad_pair(g, fold_l, fold_r, inv_l, inv_r, seeds, *, qmin: float, qmax: float, n_last: int,
              stochastic: tuple[bool, bool], code_dtype: str = "int8", interpret: bool = False,
              block: int = BLOCK, num_warps: int = NUM_WARPS):
  """Both backward codes of ``g`` from one read (see the module docstring).

  Args:
    g: (M, N) float gradient, M and N multiples of ``block``.
    fold_l: (N,) float32, multiplies column ``n`` for the input-gradient codes.
    fold_r: (M,) float32, multiplies row ``m`` for the weight-gradient codes.
    inv_l: (M,) float32 reciprocal of each row's scale (input-gradient codes).
    inv_r: (N,) float32 reciprocal of each column's scale (weight-gradient codes).
    seeds: (4,) uint32: the hash seeds ``(s0, s1)`` of each stochastic rounding
      (:func:`qtrain.core.rounding.hash_seeds`), input-gradient codes first.
    qmin, qmax: the qtype's range.
    n_last: the size of the last axis of the gradient ``g`` was reshaped from (the hash's
      row length).
    stochastic: per code set, stochastic rounding (``low_bit_hash``) or to nearest.
    code_dtype: one of :data:`CODE_DTYPES`: ``"int8"`` for an integer qtype, else the fp8
      qtype's dtype.
    interpret: run in the Pallas interpreter (CPU tests).
    block: the square tile edge.
    num_warps: Triton warps per tile.

  Returns:
    ``(codes_l (M, N), codes_rt (N, M))`` of ``code_dtype``.
  """
  m, n = g.shape
  why = supported(m, n, block)
  if why is not None:
    raise ValueError(f"grad_pair: {why}")
  if code_dtype not in CODE_DTYPES:
    raise ValueError(f"grad_pair: code_dtype={code_dtype!r}; valid: {', '.join(CODE_DTYPES)}")
  if n_last <= 0 or (m * n) % n_last:
    raise ValueError(f"grad_pair: n_last={n_last} does not divide the {m * n} elements")
  opts = dict(qmin=float(qmin), qmax=float(qmax), n_last=int(n_last),
              stochastic=tuple(bool(s) for s in stochastic), code_dtype=code_dtype)

  def kernel(seeds_ref, g_ref, fl_ref, fr_ref, il_ref, ir_ref, ol_ref, or_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    seeds_v = [seeds_ref[k] for k in range(4)]
    c_l, c_r = _codes(g_ref[...], fl_ref[...], fr_ref[...], il_ref[...], ir_ref[...],
                      i * block, j * block, seeds_v, n=n, **opts)
    ol_ref[...] = c_l
    or_ref[...] = c_r.T

  vec = lambda axis: pl.BlockSpec((block,), (lambda i, j: (i,)) if axis == 0 else (lambda i, j: (j,)))
  operands = (jnp.asarray(seeds, jnp.uint32), g, fold_l.astype(jnp.float32),
              fold_r.astype(jnp.float32), inv_l.astype(jnp.float32), inv_r.astype(jnp.float32))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        kernel,
        out_shape=(_common.out_struct((m, n), code_dtype, *operands),
                   _common.out_struct((n, m), code_dtype, *operands)),
        grid=(m // block, n // block),
        in_specs=[pl.BlockSpec((4,), lambda i, j: (0,)),
                  pl.BlockSpec((block, block), lambda i, j: (i, j)),
                  vec(1), vec(0), vec(0), vec(1)],
        out_specs=(pl.BlockSpec((block, block), lambda i, j: (i, j)),
                   pl.BlockSpec((block, block), lambda i, j: (j, i))),
        compiler_params=_common.triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qtrain_grad_pair",
    )(*operands)
