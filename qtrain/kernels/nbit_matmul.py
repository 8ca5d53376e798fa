"""N-bit weight matmul: 2/4/8-bit (and ternary) weights x {bf16/f16/f32, int8} activations.

``out = sum_g (x_g @ (q_g - z_g).T) * s_g`` with group-wise scales ``s`` (and
optional zero points ``z``) over groups of ``group_size`` K values, or
``(x @ q.T) * w_scale`` with per-channel scales; times a per-row activation
scale for int8 activations. Weights come from
:func:`qtrain.kernels.prepared.prepare_weight` (2/4-bit and ternary packed in the
plane layout, 8-bit dense int8).

Each decoded plane (plane_k K values) lies inside one scale group, so group
scales multiply the group's partial sum (``block_m x block_n`` multiplies per
group) rather than every weight. Float activations: planes decode to float
with the 2**23 mantissa trick (no int->float convert); int8 activations:
planes decode to int8 for int8 tensor cores and each group's int32 partial
sum is exact.
"""

from __future__ import annotations

import jax

from qtrain.core import _lax
import jax.numpy as jnp
from jax import lax

from qtrain.kernels import _qmatmul
from qtrain.kernels.prepared import PreparedWeight

BlockConfig = _qmatmul.BlockConfig

# Measured on one H200 (jax 0.11.2, benchmarks/kernels.py --explore, 2026-11-21;
# the int2/int4 rows at M <= 16 and K=8192, N=28672 with the inline-PTX
# decoders, benchmarks/explore_decode.py, 2026-11-22);
# key: (qtype, act format, K, N, M bucket). Missing keys use the heuristic.
_LARGE_M = BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128)
CONFIGS: dict[tuple, BlockConfig] = {
    **{(qt, fmt, k, n, mb): _LARGE_M for qt in ("int2", "int4") for fmt in ("float", "int8")
       for k, n in ((8192, 28672), (4096, 4096)) for mb in (512, 4096)},
    ("int2", "float", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, split_k=4, num_warps=4, num_stages=3),
    ("int4", "float", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, split_k=4, num_warps=4, num_stages=3),
    ("int2", "int8", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, split_k=2, num_warps=4, num_stages=3),
    ("int4", "int8", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, split_k=2, num_warps=4, num_stages=3),
    ("int8", "float", 8192, 28672, 16): BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    ("int2", "float", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
    ("int4", "float", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
    ("int8", "float", 4096, 4096, 16): BlockConfig(block_m=16, block_n=64, split_k=4, num_warps=4, num_stages=4),
    ("int8", "float", 8192, 28672, 4096): BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3),
    ("int8", "float", 4096, 4096, 4096): BlockConfig(block_m=128, block_n=256, num_warps=8, num_stages=3),
}

SUPPORTED_QTYPES = ("int2", "ternary", "int4", "int8")


def nbit_matmul(x: jax.Array, w: PreparedWeight, *, x_scale=None, out_dtype=jnp.float32,
                config: BlockConfig | None = None, interpret: bool = False) -> jax.Array:
  """N-bit weight matmul with fused group-wise or per-channel scales.

  Args:
    x: (M, K) activations, bf16/f16/f32 (WnA16) or int8 (WnA8).
    w: :class:`PreparedWeight` of qtype int2, ternary, int4 or int8.
    x_scale: None, scalar or (M,) per-row activation scale.
    out_dtype: output dtype.
    config: block config; default from :data:`CONFIGS` or a heuristic.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (M, N) array of ``out_dtype``.
  """
  if w.qtype not in SUPPORTED_QTYPES:
    raise ValueError(f"nbit_matmul needs qtype in {SUPPORTED_QTYPES}, got {w.qtype!r}")
  if x.dtype == jnp.int8:
    fmt = "int8"
  elif x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    fmt = "float"
  else:
    raise ValueError(f"activations of dtype {x.dtype} are not supported; use bf16/f16/f32 or int8")
  if x.ndim != 2 or x.shape[1] != w.k:
    raise ValueError(f"x has shape {x.shape}; expected (M, {w.k})")
  m = x.shape[0]
  group_planes = w.group_size // w.plane_k if w.group_size else None
  spec = _qmatmul.KernelSpec(
      w_format="dense" if w.dense else "packed", w_bits=w.bits, w_binary=False, a_format=fmt,
      plane_k=w.plane_k, planes=w.planes, group_planes=group_planes,
      has_zero=w.g_zero is not None, kn=w.kn)
  kp = w.k_words if w.dense else w.k_words // w.plane_k * w.block_k
  if config is None:
    config = _qmatmul.select_config(CONFIGS, (w.qtype, fmt, w.k, w.n), m, w.n_pad,
                                    kp // w.block_k)
  out = _qmatmul.qmatmul(x, w.data, spec=spec, k=w.k, w_scale=w.w_scale, g_scale=w.g_scale,
                         g_zero=w.g_zero, a_scale=_qmatmul.as_row_scale(x_scale, m),
                         rowsum=None, out_dtype=out_dtype, config=config,
                         interpret=interpret, name=f"qtrain_{w.qtype}_matmul")
  return out[:, :w.n]


def nbit_matmul_reference(x: jax.Array, w_values: jax.Array, *, w_scale=None,
                          group_size: int | None = None, g_scale=None, g_zero=None,
                          x_scale=None, out_dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference.

  Args:
    x: (M, K) float or int8 activations.
    w_values: (N, K) int8 quantized weights.
    w_scale: None, scalar or (N,) per-channel scale (without ``group_size``).
    group_size: K values per group, or None.
    g_scale: (N, K // group_size) group scales; g_zero: same shape or None.
    x_scale: None, scalar or (M,).
    out_dtype: output dtype.

  Returns:
    (M, N) ``out_dtype``. Integer partial sums are exact; float scaling in f32.
  """
  m, k = x.shape
  n = w_values.shape[0]
  is_int = x.dtype == jnp.int8
  acc_t = jnp.int32 if is_int else jnp.float32
  xc = x if is_int else x.astype(jnp.float32)
  wc = w_values.astype(jnp.int8) if is_int else w_values.astype(jnp.float32)
  prec = None if is_int else lax.Precision.HIGHEST
  a_scale = _qmatmul.as_row_scale(x_scale, m)
  if group_size is None:
    acc = _lax.dot_general(xc, wc, (((1,), (1,)), ((), ())), preferred_element_type=acc_t,
                          precision=prec)
    ws = None if w_scale is None else jnp.broadcast_to(
        jnp.asarray(w_scale, jnp.float32).reshape(-1), (n,))[None, :]
    return _qmatmul.epilogue_reference(acc, a_scale=a_scale, w_scale=ws, out_dtype=out_dtype)
  g = k // group_size
  xg = xc.reshape(m, g, group_size)
  wg = wc.reshape(n, g, group_size)
  part = jnp.einsum("mgk,ngk->gmn", xg, wg, preferred_element_type=acc_t,
                    precision=prec).astype(jnp.float32)
  if g_zero is not None:
    rs = jnp.sum(xg.astype(acc_t), axis=2).astype(jnp.float32)  # (m, g)
    part = part - rs.T[:, :, None] * jnp.asarray(g_zero, jnp.float32).T[:, None, :]
  acc = jnp.sum(part * jnp.asarray(g_scale, jnp.float32).T[:, None, :], axis=0)
  return _qmatmul.epilogue_reference(acc, a_scale=a_scale, out_dtype=out_dtype)
