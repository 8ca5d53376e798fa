"""Weight storage orders that load straight into Hopper's wgmma A-operand registers.

The Mosaic GPU kernels (:mod:`qtrain.pallas.mosaic_matmul`) feed decoded weights
to ``wgmma`` as its register A operand, whose 16-bit layout gives the thread at
lane ``l`` of a warp (``q = l % 4``) the columns ``8j + 2q + {0, 1}`` of every
8-column chunk ``j``. A quantized tile loaded from shared memory with 32-bit
loads lands in a different layout (Mosaic's "upcast" layouts: each thread holds
4 consecutive bytes). Instead of shuffling registers between threads after the
load (what a generic relayout does), the weights are stored with their K
columns permuted so that the bytes a thread loads already hold exactly the
columns its wgmma fragment needs; decoding is then thread-local.

Per chunk of K columns, stored column ``s`` holds logical column
``perm[s]`` (rows keep their order):

* int8 (chunks of 16; Mosaic's ``WGMMA_LAYOUT_UPCAST_2X``): thread quad
  ``q`` loads stored bytes ``(q % 2) * 8 + (q // 2) * 4 + v`` (v = 0..3); byte
  ``v`` is logical column ``8 (v // 2) + 2q + v % 2``.
* int4 (chunks of 32; ``WGMMA_LAYOUT_UPCAST_4X``): thread quad ``q`` loads
  nibbles ``8q + i`` (i = 0..7); nibble ``i`` is column ``8 (i // 2) + 2q + i % 2``.
* binary (chunks of 128 columns = 16 bytes, loaded like int8): the 32-bit word
  of thread quad ``q`` holds column ``8j + 2q`` at bit ``j`` and column
  ``8j + 2q + 1`` at bit ``16 + j`` (j = 0..15), so one shift moves a pair of
  bits to the sign positions (15 and 31) of a packed pair of 16-bit floats.

With int8 activations (the kernels' "A8" path) the decoded weights go to
wgmma's 8-bit A layout instead (thread quad ``q`` holds columns ``4q + v`` of
each 16-column chunk). The weights keep the storage order above (one
prepared weight serves both paths); the decode puts each stored column into
some 8-bit slot, and :func:`activation_permutation` permutes the activations'
K columns the same way, so the dot product is unchanged.

Example:
  >>> import numpy as np
  >>> from qtrain.pallas import mosaic_layout
  >>> w = np.arange(32, dtype=np.int8)[None, :]
  >>> stored = np.asarray(mosaic_layout.permute_columns(w, "int4"))
  >>> [int(v) for v in stored[0, :8]]  # thread quad 0's nibbles
  [0, 1, 8, 9, 16, 17, 24, 25]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import packing

CHUNK = {"int8": 16, "int4": 32, "binary": 128}  # K columns per permutation chunk

# Byte order of the four thread quads inside a 16-byte chunk (UPCAST_2X).
_QUAD_ORDER = (0, 2, 1, 3)


def column_permutation(qtype: str) -> np.ndarray:
  """``perm[s]``: the logical column stored at position ``s`` of a chunk.

  For binary, position ``s = 32 q' + p`` is bit ``p`` of the chunk's word
  ``q'`` in :mod:`qtrain.core.packing`'s layout (bit ``p`` = column ``p`` of
  the word's 32), so packing the permuted values gives the words above.
  """
  if qtype == "int4":
    return np.array([8 * (i // 2) + 2 * q + i % 2 for q in range(4) for i in range(8)])
  if qtype == "int8":
    return np.array([8 * (v // 2) + 2 * q + v % 2 for q in _QUAD_ORDER for v in range(4)])
  if qtype == "binary":
    return np.array([8 * (p % 16) + 2 * q + p // 16 for q in _QUAD_ORDER for p in range(32)])
  raise ValueError(f"column_permutation takes qtype 'int8', 'int4' or 'binary', got {qtype!r}")


def activation_permutation(qtype: str) -> np.ndarray:
  """``sigma[kc]``: the logical column the int8-activation kernel multiplies at
  its K position ``kc`` of a chunk (the activations are permuted by it).

  * int8: wgmma reads the stored tile from shared memory as it is, so
    ``sigma`` is the storage order itself.
  * int4: quad ``q``'s 32-bit word holds stored nibbles ``8q + i``; the even
    nibbles (``i = 2v``) become the bytes of the 16-column sub-chunk ``j = 0``,
    the odd ones of ``j = 1`` (column ``16 j + 4 q + v``).
  * binary: quad ``q``'s word holds stored bytes ``4 _QUAD_ORDER[q] + v``;
    shifting it left by ``t`` moves bit ``7 - t`` of each byte to the byte's
    sign position, the bytes of sub-chunk ``t`` (column ``16 t + 4 q + v``).
  """
  perm = column_permutation(qtype)
  if qtype == "int8":
    return perm
  sigma = np.empty_like(perm)
  for q in range(4):
    for v in range(4):
      if qtype == "int4":
        for j in range(2):
          sigma[16 * j + 4 * q + v] = perm[8 * q + 2 * v + j]
      else:
        for t in range(8):
          sigma[16 * t + 4 * q + v] = perm[8 * (4 * _QUAD_ORDER[q] + v) + 7 - t]
  return sigma


def permute_activations(x, qtype: str):
  """(M, K) activations -> K in the int8-activation kernel's order for ``qtype`` weights."""
  return jnp.take(jnp.asarray(x), jnp.asarray(_chunk_index(qtype, x.shape[-1], activation_permutation)),
                  axis=-1)


def _chunk_index(qtype: str, k: int, order=None) -> np.ndarray:
  perm = (order or column_permutation)(qtype)
  c = len(perm)
  if k % c:
    raise ValueError(f"K={k} must be a multiple of {c} for {qtype} storage")
  return (np.arange(k // c)[:, None] * c + perm[None, :]).reshape(-1)


def permute_columns(values, qtype: str):
  """(N, K) values -> the same values with K in storage order (K a multiple of CHUNK)."""
  return jnp.take(jnp.asarray(values), jnp.asarray(_chunk_index(qtype, values.shape[-1])), axis=-1)


def unpermute_columns(stored, qtype: str):
  """Inverse of :func:`permute_columns`: (N, K) stored -> logical column order."""
  inverse = np.argsort(_chunk_index(qtype, stored.shape[-1]))
  return jnp.take(jnp.asarray(stored), jnp.asarray(inverse), axis=-1)


def pack_binary(values) -> jnp.ndarray:
  """(N, K) binary values (> 0 means +1) -> (N, K // 8) int8 bytes in storage order.

  K must be a multiple of 128.
  """
  values = jnp.asarray(values)
  words = packing.pack(permute_columns(values, "binary"), "binary")  # little-endian words
  return jax.lax.bitcast_convert_type(words, jnp.int8).reshape(values.shape[0], -1)


def unpack_binary(stored, k: int) -> jnp.ndarray:
  """Inverse of :func:`pack_binary`: (N, K // 8) int8 -> (N, K) int8 +-1."""
  stored = jnp.asarray(stored)
  words = jax.lax.bitcast_convert_type(stored.reshape(stored.shape[0], -1, 4), jnp.uint32)
  values = packing.unpack(words, "binary", size=k)
  return jnp.take(values, jnp.asarray(np.argsort(_chunk_index("binary", k))), axis=-1)
