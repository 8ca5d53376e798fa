"""int8 x int8 matmul with per-row x per-column scales fused in the epilogue.

``out = (x @ w.T as int32) * x_scale[:, None] * w_scale[None, :]`` with ``x`` (M, K)
and ``w`` (N, K) int8 — both K-contiguous, which Hopper's 8-bit wgmma needs.
The int32 accumulation is exact; the epilogue casts to f32 and scales.
"""

from __future__ import annotations

import jax

from qtrain.core import _lax
import jax.numpy as jnp

from qtrain.kernels import _qmatmul
from qtrain.kernels.prepared import PreparedWeight, prepare_weight

BlockConfig = _qmatmul.BlockConfig

# Measured on one H200 (jax 0.11.2, benchmarks/kernels.py --explore, 2026-11-21);
# key: (K, N, M bucket). Missing keys use the heuristic.
CONFIGS: dict[tuple, BlockConfig] = {
    (8192, 28672, 16): BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    (4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
    (8192, 28672, 4096): BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    (4096, 4096, 4096): BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
}


def int8_matmul(x: jax.Array, w: jax.Array | PreparedWeight, *, x_scale=None, w_scale=None,
                out_dtype=jnp.float32, config: BlockConfig | None = None,
                interpret: bool = False) -> jax.Array:
  """int8 x int8 -> scaled float matmul.

  Args:
    x: (M, K) int8.
    w: (N, K) int8 weights, or an int8 :class:`PreparedWeight` (then its own
      per-channel scale is used and ``w_scale`` must be None).
    x_scale: None, scalar or (M,) per-row scale.
    w_scale: None, scalar or (N,) per-column scale.
    out_dtype: output dtype.
    config: block config; default from :data:`CONFIGS` or a heuristic.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (M, N) array of ``out_dtype``.
  """
  if x.dtype != jnp.int8:
    raise ValueError(f"int8_matmul needs int8 activations, got {x.dtype}")
  if isinstance(w, PreparedWeight):
    if w.qtype != "int8" or w.group_size is not None:
      raise ValueError(f"int8_matmul needs a per-channel int8 PreparedWeight, got {w.qtype!r} "
                       f"group_size={w.group_size}")
    if w_scale is not None:
      raise ValueError("w_scale must be None when w is a PreparedWeight (it carries its scale)")
  else:
    if w.dtype != jnp.int8 or w.ndim != 2:
      raise ValueError(f"w must be (N, K) int8, got {w.dtype} {w.shape}")
    w = prepare_weight(w, "int8", scale=w_scale)
  if x.ndim != 2 or x.shape[1] != w.k:
    raise ValueError(f"x has shape {x.shape}; expected (M, {w.k})")
  m = x.shape[0]
  spec = _qmatmul.KernelSpec(w_format="dense", w_bits=8, w_binary=False, a_format="int8",
                             plane_k=w.plane_k, planes=w.planes, kn=w.kn)
  if config is None:
    config = _qmatmul.select_config(CONFIGS, (w.k, w.n), m, w.n_pad, w.k_words // w.block_k)
  out = _qmatmul.qmatmul(x, w.data, spec=spec, k=w.k, w_scale=w.w_scale, g_scale=None,
                         g_zero=None, a_scale=_qmatmul.as_row_scale(x_scale, m), rowsum=None,
                         out_dtype=out_dtype, config=config, interpret=interpret,
                         name="qtrain_int8_matmul")
  return out[:, :w.n]


def int8_matmul_reference(x: jax.Array, w: jax.Array, *, x_scale=None, w_scale=None,
                          out_dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference: exact int32 dot, then the same f32 epilogue."""
  acc = _lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
  ws = None if w_scale is None else jnp.broadcast_to(
      jnp.asarray(w_scale, jnp.float32).reshape(-1), (w.shape[0],))[None, :]
  return _qmatmul.epilogue_reference(acc, a_scale=_qmatmul.as_row_scale(x_scale, x.shape[0]),
                                     w_scale=ws, out_dtype=out_dtype)
