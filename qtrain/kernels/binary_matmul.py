"""Binary-weight matmul: 1-bit packed weights x {bf16/f16/f32, int8, binary} activations.

``out = (x @ sign(w).T) * x_scale[:, None] * w_scale[None, :]`` with ``w`` (N, K)
binary (+-1) packed 1 bit a value (:func:`qtrain.kernels.prepared.prepare_weight`).

* float activations (W1A16): each weight plane is decoded straight to +-1.0
  (bit moved into the float sign, no int->float convert) and fed to bf16/f16
  tensor cores (f32 activations use an IEEE f32 dot).
* int8 activations (W1A8): planes decode to {0, 1} int8 bits, int8 tensor
  cores accumulate ``x . bits`` in int32 and the epilogue forms
  ``2 * acc - rowsum(x)`` (exact).
* binary activations (W1A1): activations packed like the weights; either the
  same int8 tensor-core path (``method="mma"``) or XOR + popcount on the
  words (``method="popcount"``): ``K - 2 * popcount(x ^ w)``.

Integer paths are bit-exact against :func:`binary_matmul_reference`; float
paths differ only in f32 summation order.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax

from qtrain.core import _lax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from qtrain.kernels import _common
from qtrain.kernels import _qmatmul
from qtrain.kernels.prepared import PreparedWeight

BlockConfig = _qmatmul.BlockConfig

# Measured on one H200 (jax 0.11.2, benchmarks/kernels.py --explore, 2026-11-21;
# the "float" and "int8" rows at M <= 16 with the inline-PTX decoders,
# benchmarks/explore_decode.py, 2026-11-22);
# key: (activation format, K, N, M bucket). Missing keys use the heuristic.
_LARGE_M = BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3, block_k=64)
CONFIGS: dict[tuple, BlockConfig] = {
    **{(fmt, k, n, mb): _LARGE_M for fmt in ("float", "int8", "binary")
       for k, n in ((8192, 28672), (4096, 4096)) for mb in (512, 4096)},
    ("float", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    ("int8", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    ("binary", 8192, 28672, 16): BlockConfig(block_m=16, block_n=256, num_warps=8, num_stages=3),
    ("binary-pc", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    ("float", 4096, 4096, 16): BlockConfig(block_m=16, block_n=128, split_k=4, num_warps=4, num_stages=3),
    ("int8", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    ("binary", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
    ("binary-pc", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
}


def _act_format(x: jax.Array) -> str:
  if x.dtype == jnp.int32:
    return "binary"
  if x.dtype == jnp.int8:
    return "int8"
  if x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    return "float"
  raise ValueError(f"activations of dtype {x.dtype} are not supported; use bf16/f16/f32, int8, "
                   "or int32 binary plane words (prepare_binary_activations)")


def binary_popcount_kernel(a_ref, w_ref, ws_ref, as_ref, o_ref, *, k: int, chunk: int,
                           has_w_scale: bool, has_a_scale: bool):
  """XNOR/popcount kernel: a_ref (bm, Kw) and w_ref (bn, Kw) binary words."""
  bm, kw = a_ref.shape
  bn = w_ref.shape[0]

  def body(c, acc):
    a = a_ref[:, pl.ds(c * chunk, chunk)]
    w = w_ref[:, pl.ds(c * chunk, chunk)]
    x = lax.population_count(a[:, None, :] ^ w[None, :, :])
    return acc + jnp.sum(x, axis=2)

  acc = lax.fori_loop(0, kw // chunk, body, jnp.zeros((bm, bn), jnp.int32))
  out = (k - 2 * acc).astype(jnp.float32)  # padding codes agree (0 ^ 0), so K not Kp
  if has_a_scale:
    out = out * as_ref[...]
  if has_w_scale:
    out = out * ws_ref[...]
  o_ref[...] = out.astype(o_ref.dtype)


def _popcount_call(x, w: PreparedWeight, a_scale, out_dtype, config: BlockConfig, interpret):
  m, kw = x.shape
  n_pad = w.n_pad
  bm, bn = config.block_m, config.block_n
  chunk = 8 if kw % 8 == 0 else 1
  m_pad = _common.round_up(m, bm)
  if m_pad != m:
    x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
  ws = w.w_scale if w.w_scale is not None else jnp.ones((1, n_pad), jnp.float32)
  a_s = a_scale if a_scale is not None else jnp.ones((m, 1), jnp.float32)
  a_s = jnp.pad(a_s, ((0, m_pad - m), (0, 0)))
  kernel = functools.partial(binary_popcount_kernel, k=w.k, chunk=chunk,
                             has_w_scale=True, has_a_scale=True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    out = pl.pallas_call(
        kernel,
        out_shape=_common.out_struct((m_pad, n_pad), out_dtype, x, w.data, ws, a_s),
        grid=(m_pad // bm, n_pad // bn),
        in_specs=[pl.BlockSpec((bm, kw), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, kw), lambda i, j: (j, 0)),
                  pl.BlockSpec((1, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((bm, 1), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_common.triton_params(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
        interpret=interpret,
        name="qtrain_binary_popcount_matmul",
    )(x, w.data, ws, a_s)
  return out[:m]


def binary_matmul(x: jax.Array, w: PreparedWeight, *, x_scale=None, out_dtype=jnp.float32,
                  config: BlockConfig | None = None,
                  method: Literal["mma", "popcount"] = "mma",
                  interpret: bool = False) -> jax.Array:
  """Binary-weight matmul ``x @ sign(w).T`` with fused scales.

  Args:
    x: (M, K) bf16/f16/f32 or int8 activations, or (M, Kw) int32 binary
      activation words from :func:`qtrain.kernels.prepared.prepare_binary_activations`
      (same ``plane_words`` as ``w``).
    w: binary :class:`PreparedWeight` (per-channel or no scale).
    x_scale: None, scalar or (M,) per-row activation scale.
    out_dtype: output dtype (bf16 or f32 typically).
    config: block config; default from :data:`CONFIGS` or a heuristic.
    method: "mma" (decode to int8/bf16 tensor cores) or "popcount" (binary
      activations only).
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (M, N) array of ``out_dtype``.
  """
  if w.qtype != "binary":
    raise ValueError(f"binary_matmul needs binary weights, got qtype {w.qtype!r}")
  fmt = _act_format(x)
  m = x.shape[0]
  kw = w.k_words
  if fmt == "binary":
    if x.shape[1] != kw:
      raise ValueError(f"binary activation words {x.shape} do not match weight words {w.data.shape}")
  elif x.shape[1] != w.k:
    raise ValueError(f"x has K={x.shape[1]} but the weights have k={w.k}")
  if method not in ("mma", "popcount"):
    raise ValueError(f"{method=} must be 'mma' or 'popcount'")
  if method == "popcount" and (fmt != "binary" or w.kn):
    raise ValueError("method='popcount' needs binary activations (int32 words) and (N, K) "
                     "weights (kn=False)")
  a_scale = _qmatmul.as_row_scale(x_scale, m)
  num_tiles = kw // w.plane_k
  if config is None:
    config = _qmatmul.select_config(CONFIGS, (fmt + ("-pc" if method == "popcount" else ""), w.k, w.n),
                                    m, w.n_pad, num_tiles)
  if method == "popcount":
    return _popcount_call(x, w, a_scale, out_dtype, config, interpret)[:, :w.n]
  spec = _qmatmul.KernelSpec(w_format="packed", w_bits=1, w_binary=True, a_format=fmt,
                             plane_k=w.plane_k, planes=w.planes, kn=w.kn)
  rowsum = None
  if fmt == "int8":
    rowsum = jnp.sum(x.astype(jnp.int32), axis=1, keepdims=True)
  elif fmt == "binary":
    ones = jnp.sum(lax.population_count(x), axis=1, keepdims=True)
    rowsum = 2 * ones - w.k  # padding codes are 0 bits
  out = _qmatmul.qmatmul(x, w.data, spec=spec, k=w.k, w_scale=w.w_scale, g_scale=None,
                         g_zero=None, a_scale=a_scale, rowsum=rowsum, out_dtype=out_dtype,
                         config=config, interpret=interpret, name="qtrain_binary_matmul")
  return out[:, :w.n]


def binary_matmul_reference(x: jax.Array, w_values: jax.Array, *, w_scale=None, x_scale=None,
                            out_dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference.

  Args:
    x: (M, K) float or int8 activations (binary activations as int8 +-1).
    w_values: (N, K) int8 +-1 weights (anything > 0 counts as +1).
    w_scale: None, scalar or (N,).
    x_scale: None, scalar or (M,).
    out_dtype: output dtype.

  Returns:
    (M, N) ``out_dtype``: int8 inputs exactly (int32 accumulation), floats in f32.
  """
  w = jnp.where(w_values > 0, 1, -1).astype(jnp.int8)
  dims = (((1,), (1,)), ((), ()))
  if x.dtype == jnp.int8:
    acc = _lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)
  else:
    acc = _lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims,
                          precision=lax.Precision.HIGHEST)
  ws = None if w_scale is None else jnp.broadcast_to(
      jnp.asarray(w_scale, jnp.float32).reshape(-1), (w.shape[0],))[None, :]
  return _qmatmul.epilogue_reference(acc, a_scale=_qmatmul.as_row_scale(x_scale, x.shape[0]),
                                     w_scale=ws, out_dtype=out_dtype)
