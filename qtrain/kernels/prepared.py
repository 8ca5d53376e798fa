"""Weights re-laid out once for the qtrain kernels (a pytree, jit/shard_map friendly).

A :class:`PreparedWeight` holds a quantized weight matrix stored (N, K) —
output channels by the contracting axis — in the layout the kernels read:
packed qtypes (binary, ternary, int2, int4) as int32 words in the plane layout
of :mod:`qtrain.kernels._common`, int8 as a dense int8 matrix. N is padded to a
multiple of ``n_align`` and K to a whole number of K tiles; scales are stored
transposed ((groups, N)) so a kernel reads one contiguous row per group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qtrain.core import packing
from qtrain.core import qtypes
from qtrain.kernels import _common

DENSE_BLOCK_K = 128  # K tile of dense int8 weights


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
  """A quantized (N, K) weight in kernel layout.

  Attributes:
    data: (Np, Kw) int32 plane-layout words, or (Np, Kp) int8 for 8-bit.
    w_scale: (1, Np) float32 per-channel scale, or None.
    g_scale: (G, Np) float32 group scales, or None.
    g_zero: (G, Np) float32 group zero points (w ~ (q - z) * s), or None.
    qtype: qtype name (static).
    n: true number of output channels (static).
    k: true contracting size (static).
    plane_k: K values per plane (static).
    planes: planes per K tile (static).
    group_size: K values per scale group, or None (static).
    kn: ``data`` is stored transposed, (Kw, Np) / (Kp, Np) (static).
  """

  data: jax.Array
  w_scale: jax.Array | None
  g_scale: jax.Array | None
  g_zero: jax.Array | None
  qtype: str
  n: int
  k: int
  plane_k: int
  planes: int
  group_size: int | None
  kn: bool = False

  @property
  def dense(self) -> bool:
    return self.data.dtype == jnp.int8

  @property
  def n_pad(self) -> int:
    return self.data.shape[1 if self.kn else 0]

  @property
  def k_words(self) -> int:
    """Length of the stored K axis (words, or int8 values when dense)."""
    return self.data.shape[0 if self.kn else 1]

  @property
  def bits(self) -> int:
    return qtypes.get_qtype(self.qtype).bits

  @property
  def block_k(self) -> int:
    return self.plane_k * self.planes


jax.tree_util.register_dataclass(
    PreparedWeight,
    data_fields=["data", "w_scale", "g_scale", "g_zero"],
    meta_fields=["qtype", "n", "k", "plane_k", "planes", "group_size", "kn"],
)


def _channel_scale(scale, n: int, n_pad: int) -> jax.Array:
  s = jnp.asarray(scale, jnp.float32).reshape(-1)
  if s.shape[0] not in (1, n):
    raise ValueError(f"per-channel scale has {s.shape[0]} entries; expected 1 or {n=}")
  s = jnp.broadcast_to(s, (n,))
  return jnp.pad(s, (0, n_pad - n))[None, :]


def _group_param(p, n: int, n_pad: int, groups: int, groups_pad: int) -> jax.Array:
  p = jnp.asarray(p, jnp.float32)
  if p.shape != (n, groups):
    raise ValueError(f"group-wise scale/zero point has shape {p.shape}; expected {(n, groups)}")
  return jnp.pad(p.T, ((0, groups_pad - groups), (0, n_pad - n)))


def prepare_weight(values: jax.Array, qtype, *, scale=None, zero_point=None,
                   group_size: int | None = None, k: int | None = None,
                   plane_words: int = 32, n_align: int = 128, kn: bool = False) -> PreparedWeight:
  """Builds the kernel layout of a quantized weight stored (N, K).

  Args:
    values: int8 quantized values (N, K); or, with ``k`` given, uint32 words
      (N, ceil(K / vpw)) packed by :func:`qtrain.core.packing.pack`.
    qtype: binary, ternary or int2..int8 (int3 is laid out as int4, int5..int7 as int8).
    scale: per-channel (N,) / (N, 1) / scalar, or group-wise (N, K // group_size).
    zero_point: None, or like a group-wise ``scale`` (needs ``group_size``).
    group_size: K values per scale group (a multiple of 16 that divides K).
    k: true K when ``values`` are packed words.
    plane_words: words per plane of packed weights (a power of two >= 16;
      32 suits int8 and bf16 tensor cores).
    n_align: N is padded to a multiple of this.
    kn: store the data transposed ((K, N)): the decoded planes feed the dot
      as its (K, N) operand without a transpose (a tuning choice for
      16-bit activations; 8-bit tensor cores want the default (N, K)).

  Returns:
    A :class:`PreparedWeight`.
  """
  qt = qtypes.get_qtype(qtype)
  if not qt.packable or not qt.is_integer_like:
    raise ValueError(f"qtype {qt.name!r} has no kernel layout; use binary, ternary or int2..int8")
  if k is not None:
    values = packing.unpack(values, qt, size=k, axis=-1)
  # int3 codes are laid out as int4, int5..int7 as int8: every code fits, and the kernels are
  # those of the container.
  qt = qtypes.get_qtype(qt.container)
  values = jnp.asarray(values)
  if values.ndim != 2:
    raise ValueError(f"weights must be 2-D (N, K); got shape {values.shape}")
  n, k = values.shape
  if group_size is not None:
    if k % group_size or group_size % 16:
      raise ValueError(f"{group_size=} must be a multiple of 16 that divides {k=}")
    if qt.kind == "binary":
      raise ValueError("binary weights take per-channel scales only (group_size=None)")
  elif zero_point is not None:
    raise ValueError("zero points need group-wise scales (group_size)")
  n_pad = _common.round_up(n, n_align)
  if qt.bits == 8:
    plane_k = group_size if group_size else DENSE_BLOCK_K
    planes = max(1, DENSE_BLOCK_K // plane_k)
  else:
    plane_k = min(plane_words, group_size) if group_size else plane_words
    if not _common.is_pow2(plane_k) or plane_k < 16:
      raise ValueError(f"plane_words={plane_k} must be a power of two >= 16")
    planes = 32 // qt.bits
    if group_size and (group_size % plane_k or (plane_k * planes) % group_size):
      raise ValueError(f"{group_size=} must be a multiple of {plane_k=} dividing block_k={plane_k * planes}")
  block_k = plane_k * planes
  k_pad = _common.round_up(k, block_k)
  values = jnp.pad(values.astype(jnp.int8), ((0, n_pad - n), (0, 0)))
  if qt.bits == 8:
    data = jnp.pad(values, ((0, 0), (0, k_pad - k)))
  else:
    data = _common.to_plane_layout(values, qt, plane_words=plane_k)
  w_scale = g_scale = g_zero = None
  if group_size is None:
    if scale is not None:
      w_scale = _channel_scale(scale, n, n_pad)
  else:
    groups, groups_pad = k // group_size, k_pad // group_size
    g_scale = _group_param(scale, n, n_pad, groups, groups_pad)
    if zero_point is not None:
      g_zero = _group_param(zero_point, n, n_pad, groups, groups_pad)
  if kn:
    data = data.T
  return PreparedWeight(data=data, w_scale=w_scale, g_scale=g_scale, g_zero=g_zero,
                        qtype=qt.name, n=n, k=k, plane_k=plane_k, planes=planes,
                        group_size=group_size, kn=kn)


def prepare_binary_activations(x: jax.Array, *, plane_words: int = 32) -> jax.Array:
  """Packs binary activations (M, K) (> 0 means +1) into plane-layout int32 words."""
  return _common.to_plane_layout(jnp.where(x > 0, 1, -1).astype(jnp.int8), "binary",
                                 plane_words=plane_words)
