"""Weight storage orders that load straight into Hopper's wgmma A-operand registers.

The Mosaic GPU kernels (:mod:`qtrain.kernels.mosaic_matmul`) feed decoded weights
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
* int2 (chunks of 64 columns = 16 bytes of four 2-bit fields, loaded like
  int8) has only the int8-activation order below (there is no 16-bit decode).

With int8 activations (the kernels' "A8" path) the decoded weights go to
wgmma's 8-bit A layout instead (thread quad ``q`` holds columns ``4q + v`` of
each 16-column chunk): the decode puts each stored column into some 8-bit
slot. Each storage order is laid out for one kind of activations (``order``:
``"float"``, the order above, or ``"int8"``, where the A8 decode puts every
column in its own slot; for int8 weights that is the natural order, since
wgmma reads them from shared memory as stored). Either order serves both
paths: where the order does not match the activations,
:func:`activation_permutation` gives the permutation of the activations' K
columns that makes the dot product come out unchanged (one gather of the
small (M, K) activations per call).

Independently of the column order, :func:`tile_major` stores the weights tile
by tile (each (CTA rows, tile_k) tile one contiguous block, in the order the
kernel streams them), so that every TMA copy reads one block.

Example:
  >>> import numpy as np
  >>> from qtrain.kernels import mosaic_layout
  >>> w = np.arange(32, dtype=np.int8)[None, :]
  >>> stored = np.asarray(mosaic_layout.permute_columns(w, "int4"))
  >>> [int(v) for v in stored[0, :8]]  # thread quad 0's nibbles
  [0, 1, 8, 9, 16, 17, 24, 25]
  >>> sigma = mosaic_layout.activation_permutation("int4", order="int8", act="int8")
  >>> bool((sigma == np.arange(32)).all())  # laid out for int8 activations: no permutation
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import packing

CHUNK = {"int8": 16, "int4": 32, "int2": 64, "binary": 128}  # K columns per permutation chunk
PACKED = ("binary", "int2")  # qtypes stored as bytes of several bit fields (pack_bits)

# Byte order of the four thread quads inside a 16-byte chunk (UPCAST_2X).
_QUAD_ORDER = (0, 2, 1, 3)


ORDERS = ("float", "int8")  # the activations a storage order is laid out for


def orders(qtype: str) -> tuple[str, ...]:
  """The storage orders (= activation paths) ``qtype`` has, the default first: int2 only "int8"."""
  return ("int8",) if qtype == "int2" else ORDERS


def _check(qtype: str, order: str) -> None:
  if qtype not in CHUNK:
    raise ValueError(f"the Mosaic storage orders take qtype 'int8', 'int4', 'int2' or 'binary', "
                     f"got {qtype!r}")
  if order not in ORDERS:
    raise ValueError(f"order={order!r}; valid: {ORDERS} (the activations the weights are laid out for)")
  if order not in orders(qtype):
    raise ValueError(f"order={order!r}: {qtype} weights run with int8 activations only (valid: "
                     f"{orders(qtype)})")


def _float_order(qtype: str) -> np.ndarray:
  if qtype == "int4":
    return np.array([8 * (i // 2) + 2 * q + i % 2 for q in range(4) for i in range(8)])
  if qtype == "int8":
    return np.array([8 * (v // 2) + 2 * q + v % 2 for q in _QUAD_ORDER for v in range(4)])
  return np.array([8 * (p % 16) + 2 * q + p // 16 for q in _QUAD_ORDER for p in range(32)])


def decode_slots(qtype: str, act: str) -> np.ndarray:
  """``slot[kc]``: the stored position (within a chunk) the kernel's decode for
  ``act`` ("float" or "int8") activations puts at its wgmma K position ``kc``.

  * float: the 16-bit decode puts stored position ``s`` where the "float"
    order's column ``perm[s]`` belongs (that is what the order is for).
  * int8 with int8 weights: wgmma reads the tile from shared memory as stored.
  * int8 with int4 weights: quad ``q``'s 32-bit word holds stored nibbles
    ``8q + i``; the even nibbles (``i = 2v``) become the bytes of the
    16-column sub-chunk ``j = 0``, the odd ones of ``j = 1`` (column ``16 j + 4 q + v``).
  * int8 with binary weights: quad ``q``'s word holds stored bytes
    ``4 _QUAD_ORDER[q] + v``; shifting it left by ``t`` moves bit ``7 - t`` of
    each byte to the byte's sign position, the bytes of sub-chunk ``t``
    (column ``16 t + 4 q + v``).
  * int8 with int2 weights: the same bytes; shifting left by ``2 j`` moves
    field ``3 - j`` (bits ``6 - 2j``, ``7 - 2j``) to each byte's top two bits,
    the bytes of sub-chunk ``j``.
  """
  if act not in ORDERS:
    raise ValueError(f"act={act!r}; valid: 'float', 'int8'")
  _check(qtype, act)
  if act == "float":
    return np.argsort(_float_order(qtype))
  slot = np.arange(CHUNK[qtype])
  if qtype == "int8":
    return slot
  for q in range(4):
    for v in range(4):
      if qtype == "int4":
        for j in range(2):
          slot[16 * j + 4 * q + v] = 8 * q + 2 * v + j
      elif qtype == "int2":
        for j in range(4):
          slot[16 * j + 4 * q + v] = 4 * (4 * _QUAD_ORDER[q] + v) + 3 - j
      else:
        for t in range(8):
          slot[16 * t + 4 * q + v] = 8 * (4 * _QUAD_ORDER[q] + v) + 7 - t
  return slot


def column_permutation(qtype: str, order: str = "float") -> np.ndarray:
  """``perm[s]``: the logical column stored at position ``s`` of a chunk.

  For binary, position ``s = 32 q' + p`` is bit ``p`` of the chunk's word
  ``q'`` in :mod:`qtrain.core.packing`'s layout (bit ``p`` = column ``p`` of
  the word's 32), so packing the permuted values gives the words above.
  The "int8" order is the inverse of the A8 decode's slots.
  """
  _check(qtype, order)
  return _float_order(qtype) if order == "float" else np.argsort(decode_slots(qtype, "int8"))


def activation_permutation(qtype: str, order: str = "float", act: str = "int8") -> np.ndarray:
  """``sigma[kc]``: the logical column the kernel's ``act`` path multiplies at
  its K position ``kc`` of a chunk, for weights stored in ``order`` (the
  activations are permuted by it; the identity where ``order == act``)."""
  return column_permutation(qtype, order)[decode_slots(qtype, act)]


def permute_activations(x, qtype: str, order: str = "float", act: str = "int8"):
  """(M, K) activations -> K in the kernel's order for ``qtype`` weights stored
  in ``order`` (``x`` itself where that is the identity)."""
  sigma = activation_permutation(qtype, order, act)
  if np.array_equal(sigma, np.arange(len(sigma))):
    return x
  return jnp.take(jnp.asarray(x), jnp.asarray(_chunk_index(sigma, x.shape[-1], qtype)), axis=-1)


def _chunk_index(perm: np.ndarray, k: int, qtype: str) -> np.ndarray:
  c = len(perm)
  if k % c:
    raise ValueError(f"K={k} must be a multiple of {c} for {qtype} storage")
  return (np.arange(k // c)[:, None] * c + perm[None, :]).reshape(-1)


def permute_columns(values, qtype: str, order: str = "float"):
  """(N, K) values -> the same values with K in storage order (K a multiple of CHUNK)."""
  index = _chunk_index(column_permutation(qtype, order), values.shape[-1], qtype)
  return jnp.take(jnp.asarray(values), jnp.asarray(index), axis=-1)


def unpermute_columns(stored, qtype: str, order: str = "float"):
  """Inverse of :func:`permute_columns`: (N, K) stored -> logical column order."""
  inverse = np.argsort(_chunk_index(column_permutation(qtype, order), stored.shape[-1], qtype))
  return jnp.take(jnp.asarray(stored), jnp.asarray(inverse), axis=-1)


def tile_major(data, rows: int, cols: int):
  """(N, C) stored weights -> (N * C // cols, cols): the (rows, cols) tiles one
  after another, row band by row band and along C within a band (each tile
  contiguous; tile ``(i, j)`` is row block ``i * (C // cols) + j``)."""
  n, c = data.shape
  return data.reshape(n // rows, rows, c // cols, cols).transpose(0, 2, 1, 3).reshape(-1, cols)


def untile(data, n: int, rows: int, cols: int):
  """Inverse of :func:`tile_major` for ``n`` rows."""
  c = data.shape[0] * cols // n
  return data.reshape(n // rows, c // cols, rows, cols).transpose(0, 2, 1, 3).reshape(n, c)


def pack_bits(values, qtype: str, order: str) -> jnp.ndarray:
  """(N, K) binary (> 0 means +1) or int2 ([-2, 1]) values -> (N, K * bits // 8)
  int8 bytes in storage order: stored position ``s`` of a chunk is field
  ``s % (8 // bits)`` (from the low bits) of byte ``s // (8 // bits)``.
  K must be a multiple of :data:`CHUNK`."""
  values = jnp.asarray(values)
  words = packing.pack(permute_columns(values, qtype, order), qtype)  # little-endian words
  return jax.lax.bitcast_convert_type(words, jnp.int8).reshape(values.shape[0], -1)


def unpack_bits(stored, qtype: str, k: int, order: str) -> jnp.ndarray:
  """Inverse of :func:`pack_bits`: (N, K * bits // 8) int8 -> (N, K) int8 codes (binary +-1)."""
  stored = jnp.asarray(stored)
  words = jax.lax.bitcast_convert_type(stored.reshape(stored.shape[0], -1, 4), jnp.uint32)
  values = packing.unpack(words, qtype, size=k)
  return unpermute_columns(values, qtype, order)


def pack_binary(values, order: str = "float") -> jnp.ndarray:
  """(N, K) binary values (> 0 means +1) -> (N, K // 8) int8 bytes in storage order.

  K must be a multiple of 128.
  """
  return pack_bits(values, "binary", order)


def unpack_binary(stored, k: int, order: str = "float") -> jnp.ndarray:
  """Inverse of :func:`pack_binary`: (N, K // 8) int8 -> (N, K) int8 +-1."""
  return unpack_bits(stored, "binary", k, order)
