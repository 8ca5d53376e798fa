"""The Mosaic GPU kernel's CPU-checkable parts: weight storage order, configs, errors.

The storage order (:mod:`qtrain.kernels.mosaic_layout`) is checked against
Mosaic's own layout definitions: which thread / register / vector slot each
element of a tile lands in for the upcast load layouts and for the wgmma
A-operand layout (``TiledLayout.tiling.tile_indices``, pure Python). The
kernel's register relabelling (``wgmma_register``) and binary decode
(``binary_pair_bits``) are applied to the loaded slots and must reproduce the
logical weight in every wgmma slot. The kernel's numbers are checked on the
GPU (tests/kernels/test_kernels_gpu.py).
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import fragmented_array as fa

from qtrain.core import packing
from qtrain.core import qarray as qa
from qtrain.ops import dispatch
from qtrain.ops.backends import mosaic as mosaic_backend
from qtrain.ops.backends import DotCall, Unsupported
from qtrain.kernels import mosaic_layout as ml
from qtrain.kernels import mosaic_matmul as mm


def _plan_mosaic(x, w, dn):
  p = mosaic_backend.plan_matmul(DotCall(x, w, dn, jnp.dtype(jnp.float32)))
  return p.x, p.x_scale, p.w, p.out_shape


def _linear(idx, sizes):
  out = 0
  for i, s in zip(idx, sizes):
    out = out * s + i
  return out


def fragment_map(layout, shape):
  """{(thread, register index, vector slot): (row, col)} for a warpgroup-wide TiledLayout."""
  tiled = layout.tiling.tile_shape(shape)
  nd = len(tiled)
  warp = [d % nd for d in layout.warp_dims]
  lane = [d % nd for d in layout.lane_dims]
  vec = layout.vector_dim % nd
  out = {}
  for r in range(shape[0]):
    for c in range(shape[1]):
      t = layout.tiling.tile_indices((r, c))
      thread = (_linear([t[d] for d in warp], [tiled[d] for d in warp]) * 32
                + _linear([t[d] for d in lane], [tiled[d] for d in lane]))
      reg = tuple(0 if i in warp or i in lane or i == vec else t[i] for i in range(nd))
      out[(thread, reg, t[vec])] = (r, c)
  return out


def _wgmma_slots(cols):
  slots = fragment_map(fa.WGMMA_LAYOUT, (64, cols))
  return slots, len(fa.WGMMA_LAYOUT.tiling.tile_shape((64, cols)))


def test_unpermuted_int4_would_not_fill_wgmma_fragments():
  # The storage-order checks below have teeth: without the permutation the relabelled
  # registers hold the wrong columns.
  cols = 64
  w = np.random.default_rng(2).integers(-8, 8, (64, cols))
  want, nd = _wgmma_slots(cols)
  got = {}
  for (thread, reg, slot), (r, c) in fragment_map(fa.WGMMA_LAYOUT_UPCAST_4X, (64, cols)).items():
    j, pos = divmod(slot, 2)
    got[(thread, mm.wgmma_register(reg, j, 4, nd), pos)] = w[r, c]
  assert sum(got[key] != w[r, c] for key, (r, c) in want.items()) > len(want) // 2


def _loaded_words(load, shape, stored, slot_bits=8):
  """{(thread, register): the 32-bit word it loads} of ``stored`` (``shape``) in the
  upcast layout ``load``, and {(thread, register): the rows it holds}."""
  words, rows = {}, {}
  for (thread, reg, slot), (r, c) in fragment_map(load, shape).items():
    val = int(stored[r, c]) & ((1 << slot_bits) - 1)
    words[(thread, reg)] = words.get((thread, reg), 0) | val << (slot_bits * slot)
    rows.setdefault((thread, reg), set()).add(r)
  return words, rows


def _binary_a16_slots(words, one_bits, act, nd):
  """((thread, wgmma register, position), value) for every 16-bit slot the binary
  decode (``binary_pair_bits``) fills from the loaded words."""
  for (thread, reg), word in words.items():
    for j in range(16):
      pair = mm.binary_pair_bits(word, j, one_bits)
      halves = np.array([pair & 0xFFFF, pair >> 16], np.uint16).view(act).astype(np.float64)
      for pos in range(2):
        yield (thread, mm.wgmma_register(reg, j, 16, nd), pos), halves[pos]


@pytest.mark.parametrize("act,one_bits", [(ml_dtypes.bfloat16, 0x3F80), (np.float16, 0x3C00)])
def test_binary_storage_and_decode_fill_wgmma_fragments(act, one_bits):
  cols = 256
  w = np.where(np.random.default_rng(3).random((64, cols)) > 0.5, 1, -1)
  stored = np.asarray(ml.pack_binary(w)).view(np.uint8)
  assert stored.shape == (64, cols // 8)
  words, _ = _loaded_words(fa.WGMMA_LAYOUT_UPCAST_2X, (64, cols // 8), stored)
  want, nd = _wgmma_slots(cols)
  got = dict(_binary_a16_slots(words, one_bits, act, nd))
  assert got.keys() == want.keys()
  assert sum(got[key] != w[r, c] for key, (r, c) in want.items()) == 0


def _a16_kernel_matrix(qtype, stored, cols, one_bits=0x3F80, act=ml_dtypes.bfloat16):
  """The (64, cols) A matrix the 16-bit kernel path multiplies: the stored tile
  loaded in its upcast layout, relabelled (int4/int8) or decoded by
  ``binary_pair_bits`` (binary), placed by ``wgmma_register``."""
  want, nd = _wgmma_slots(cols)
  a = np.full((64, cols), 999.0)
  if qtype == "binary":
    words, _ = _loaded_words(fa.WGMMA_LAYOUT_UPCAST_2X, (64, cols // 8), stored)
    for key, value in _binary_a16_slots(words, one_bits, act, nd):
      a[want[key]] = value
    return a
  upcast = fa.WGMMA_LAYOUT_UPCAST_4X if qtype == "int4" else fa.WGMMA_LAYOUT_UPCAST_2X
  per = 4 if qtype == "int4" else 2
  for (thread, reg, slot), (r, c) in fragment_map(upcast, (64, cols)).items():
    j, pos = divmod(slot, 2)
    a[want[(thread, mm.wgmma_register(reg, j, per, nd), pos)]] = stored[r, c]
  return a


def _stored(qtype, w, order):
  if qtype in ("binary", "int2"):
    return np.asarray(ml.pack_bits(w, qtype, order)).view(np.uint8)
  return np.asarray(ml.permute_columns(w, qtype, order))


def _sigma(qtype, order, act, cols):
  c = ml.CHUNK[qtype]
  return np.concatenate([i * c + ml.activation_permutation(qtype, order, act) for i in range(cols // c)])


_ORDER_CASES = [(qt, lo, hi, order, act)
                for qt, lo, hi in [("binary", -1, 2), ("int2", -2, 2), ("int4", -8, 8), ("int8", -128, 128)]
                for order in ml.orders(qt) for act in ml.orders(qt)]


@pytest.mark.parametrize("qtype,lo,hi,order,act", _ORDER_CASES)
@pytest.mark.thin(3)
def test_every_storage_order_gives_the_dot_on_both_paths(qtype, lo, hi, order, act):
  # Each order puts column sigma(kc) in every wgmma slot kc of either path (sigma the
  # identity where the order is laid out for the path's activations), and the
  # activations permuted by sigma make the product exactly factor * w @ x.T.
  cols = 256
  rng = np.random.default_rng(13)
  w = rng.integers(lo, hi, (64, cols))
  if qtype == "binary":
    w = np.where(w > 0, 1, -1)
  stored = _stored(qtype, w, order)
  if act == "int8":
    a, factor = _a8_kernel_matrix(qtype, stored, cols), mm.A8_FACTOR[qtype]
  else:
    a, factor = _a16_kernel_matrix(qtype, stored, cols), 1
  sigma = _sigma(qtype, order, act, cols)
  assert np.array_equal(sigma, np.arange(cols)) == (order == act)
  np.testing.assert_array_equal(a, factor * w[:, sigma])
  x = rng.integers(-128, 128, (16, cols))
  xp = np.asarray(ml.permute_activations(jnp.asarray(x, jnp.int8), qtype, order, act)).astype(np.int64)
  np.testing.assert_array_equal(a @ xp.T, factor * (w @ x.T))


def test_matching_order_leaves_the_activations_alone():
  x = jnp.ones((4, 256), jnp.int8)
  assert ml.permute_activations(x, "int4", "int8", "int8") is x
  assert ml.permute_activations(x, "int4", "float", "float") is x
  with pytest.raises(ValueError, match="order='bf16'"):
    ml.column_permutation("int4", "bf16")
  with pytest.raises(ValueError, match="act='int4'"):
    ml.decode_slots("int4", "int4")
  with pytest.raises(ValueError, match="order='bf16'"):
    mm.prepare_mosaic_weight(jnp.ones((8, 512), jnp.int8), "int8", order="bf16")


def _a8_kernel_matrix(qtype, stored, cols):
  """The (64, cols) int8 A matrix the int8-activation kernel multiplies: the
  stored tile loaded in its upcast layout, decoded by the kernel's Python-int
  models and placed in wgmma's 8-bit layout (int8: read from shared memory as stored)."""
  if qtype == "int8":
    return stored.astype(np.int64)
  if qtype == "binary":
    load, per, decode = fa.WGMMA_LAYOUT_UPCAST_2X, 8, mm.binary_int8_bits
    shape, slot_bits = (64, cols // 8), 8
  elif qtype == "int2":
    load, per, decode = fa.WGMMA_LAYOUT_UPCAST_2X, 4, mm.int2_int8_bits
    shape, slot_bits = (64, cols // 4), 8
  else:
    load, per, decode = fa.WGMMA_LAYOUT_UPCAST_4X, 2, mm.int4_int8_bits
    shape, slot_bits = (64, cols), 4
  words, rows = _loaded_words(load, shape, stored, slot_bits)
  eight = fragment_map(fa.WGMMA_LAYOUT_8BIT, (64, cols))
  nd = len(fa.WGMMA_LAYOUT_8BIT.tiling.tile_shape((64, cols)))
  a = np.full((64, cols), 999, np.int64)
  for (thread, reg), word in words.items():
    for j in range(per):
      quad = np.array([decode(word, j)], np.uint32).view(np.int8)
      for v in range(4):
        r, kc = eight[(thread, mm.wgmma_register(reg, j, per, nd), v)]
        assert r in rows[(thread, reg)]  # decoding is thread-local: same rows
        a[r, kc] = quad[v]
  return a


def test_int8_activation_check_has_teeth():
  # Unpermuted activations (or a wrong decode) break the product.
  cols = 256
  rng = np.random.default_rng(12)
  w = np.where(rng.random((64, cols)) > 0.5, 1, -1)
  a = _a8_kernel_matrix("binary", np.asarray(ml.pack_binary(w)).view(np.uint8), cols)
  x = rng.integers(-128, 128, (16, cols))
  assert np.any(a @ x.T != 64 * (w @ x.T))
  assert mm.binary_int8_bits(0xFFFFFFFF, 0) == 0x40404040  # all bits set: +64 each
  assert mm.binary_int8_bits(0, 3) == 0xC0C0C0C0  # none set: -64 each
  assert mm.int4_int8_bits(0x87654321, 0) == 0x70503010 and mm.int4_int8_bits(0x87654321, 1) == 0x80604020
  # int2 fields 0..3 of byte 0x4E are -2, -1, 0, 1: j = 0 takes field 3, j = 3 field 0 (x 64)
  assert [mm.int2_int8_bits(0x4E4E4E4E, j) & 0xFF for j in range(4)] == [0x40, 0x00, 0xC0, 0x80]
  w2 = rng.integers(-2, 2, (64, cols))
  a2 = _a8_kernel_matrix("int2", np.asarray(ml.pack_bits(w2, "int2", "int8")).view(np.uint8), cols)
  natural = np.asarray(packing.pack(jnp.asarray(w2, jnp.int8), "int2")).view(np.uint8)  # unpermuted
  bad = _a8_kernel_matrix("int2", natural.reshape(64, -1), cols)
  assert np.array_equal(a2, 64 * w2) and np.mean(bad != 64 * w2) > 0.5


@pytest.mark.slow
def test_pack_binary_round_trip_and_permutations():
  rng = np.random.default_rng(4)
  w = np.where(rng.random((5, 384)) > 0.5, 1, -1).astype(np.int8)
  np.testing.assert_array_equal(ml.unpack_binary(ml.pack_binary(w), 384), w)
  for qtype in ("int8", "int4", "int2"):
    perm = ml.column_permutation(qtype, ml.orders(qtype)[0])
    np.testing.assert_array_equal(np.sort(perm), np.arange(ml.CHUNK[qtype]))
  w2 = rng.integers(-2, 2, (5, 384)).astype(np.int8)
  packed = ml.pack_bits(w2, "int2", "int8")
  assert packed.shape == (5, 96) and packed.dtype == jnp.int8
  np.testing.assert_array_equal(ml.unpack_bits(packed, "int2", 384, "int8"), w2)


def test_layout_errors_name_the_bad_value():
  with pytest.raises(ValueError, match="K=100 must be a multiple of 128"):
    ml.pack_binary(jnp.ones((2, 100)))
  with pytest.raises(ValueError, match="K=40 must be a multiple of 32 for int4"):
    ml.permute_columns(jnp.ones((2, 40)), "int4")
  with pytest.raises(ValueError, match="'ternary'"):
    ml.column_permutation("ternary")
  with pytest.raises(ValueError, match="order='float': int2 weights run with int8 activations only"):
    ml.column_permutation("int2", "float")
  with pytest.raises(ValueError, match="order='float': int2 weights run with int8 activations only"):
    ml.decode_slots("int2", "float")


@pytest.mark.parametrize("kw,match", [
    (dict(tile_k=64), "tile_k=64"),
    (dict(steps=1), "steps=1"),
    (dict(split_k=3), "split_k=3"),
    (dict(wg_rows=96), "wg_rows=96"),
])
def test_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    mm.MosaicConfig(**kw)


@pytest.mark.parametrize("qtype", mm.QTYPES)
@pytest.mark.parametrize("n,k", [(28672, 8192), (4096, 4096), (300, 1000)])
@pytest.mark.parametrize("m", [1, 16, 64, 128])
@pytest.mark.parametrize("act", [jnp.bfloat16, jnp.int8])
def test_default_config_fits_and_tiles(qtype, n, k, m, act):
  w = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, qtype), jax.ShapeDtypeStruct((n, k), jnp.int8))
  assert w.order == ("int8" if qtype == "int2" else "float")
  cfg = mm.default_config(w, m, num_sms=132, act_dtype=act)
  assert mm.smem_bytes(qtype, m, cfg, jnp.dtype(act).itemsize) <= mm.SMEM_BYTES
  assert cfg.wg_rows * cfg.tile_k * jnp.dtype(act).itemsize <= 65536  # decoded registers
  assert qtype != "binary" or cfg.tile_k >= 256
  # Large N (more 64-row tiles than SMs) takes 128 rows per warpgroup where it fits.
  assert cfg.wg_rows == 64 or n == 28672
  assert cfg.wg_rows == 128 or not (n == 28672 and m <= 16)
  assert w.k_pad % (cfg.tile_k * cfg.split_k) == 0
  tiles = w.n_pad // cfg.cta_rows
  assert tiles * cfg.split_k <= max(132, tiles)


def test_tile_major_puts_each_tile_in_one_block():
  data = np.arange(512 * 64).reshape(512, 64)
  t = np.asarray(ml.tile_major(jnp.asarray(data), 256, 16))
  assert t.shape == (512 * 64 // 16, 16)
  # tile (i, j) is row block i * 4 + j
  np.testing.assert_array_equal(t[(1 * 4 + 2) * 256:(1 * 4 + 3) * 256], data[256:512, 32:48])
  np.testing.assert_array_equal(np.asarray(ml.untile(jnp.asarray(t), 512, 256, 16)), data)


def test_tiled_weights_fix_the_config_tiles():
  w = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, "int4", tiles="auto"),
                     jax.ShapeDtypeStruct((28672, 8192), jnp.int8))
  assert w.tiles == mm.auto_tiles(28672) == (256, 256)
  assert w.data.shape == (28672 * 8192 // 256, 256)
  cfg = mm.default_config(w, 16, num_sms=132)
  assert (cfg.cta_rows, cfg.tile_k) == w.tiles
  small = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, "binary", tiles="auto"),  # row-major here
                         jax.ShapeDtypeStruct((4096, 4096), jnp.int8))
  assert small.tiles is None and mm.auto_tiles(4096) is None
  own = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, "binary", tiles=(128, 512)),
                       jax.ShapeDtypeStruct((4096, 4096), jnp.int8))
  assert mm.default_config(own, 1, num_sms=132) == mm.MosaicConfig(tile_k=512, steps=4, split_k=4)
  with pytest.raises(ValueError, match=r"the weights are stored in \(256, 256\) tiles"):
    mm.checked_config(jnp.ones((16, 8192), jnp.int8), w, mm.MosaicConfig(tile_k=512, steps=2))
  with pytest.raises(ValueError, match=r"tiles=\(256, 128\): valid"):
    mm.prepare_mosaic_weight(jnp.ones((8, 512), jnp.int8), "binary", tiles=(256, 128))
  with pytest.raises(ValueError, match=r"tiles=\(64, 256\): valid"):
    mm.prepare_mosaic_weight(jnp.ones((8, 512), jnp.int8), "int8", tiles=(64, 256))
  w8 = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, "int8", tiles="auto"),
                      jax.ShapeDtypeStruct((28672, 8192), jnp.int8))
  assert mm.default_config(w8, 48).steps == 2  # the documented bound: M <= 48 with bf16 ...
  with pytest.raises(ValueError, match=r"M=49: weights stored in \(256, 256\) tiles"):
    mm.default_config(w8, 49)
  assert mm.default_config(w8, 64, act_dtype=jnp.int8).steps == 2  # ... and 64 with int8 activations
  big = jax.eval_shape(lambda v: mm.prepare_mosaic_weight(v, "int8", tiles=(256, 512)),
                       jax.ShapeDtypeStruct((1024, 1024), jnp.int8))
  with pytest.raises(ValueError, match=r"M=128: weights stored in \(256, 512\) tiles"):
    mm.default_config(big, 128)


@pytest.mark.slow
def test_unsupported_calls_are_told_apart_from_wrong_ones():
  # "auto" falls back to XLA on UnsupportedCall only; a mismatched x is the caller's error.
  w = mm.prepare_mosaic_weight(jnp.ones((8, 512), jnp.int8), "int8")
  for x in (jnp.ones((4, 512), jnp.float32), jnp.ones((129, 512), jnp.bfloat16)):
    with pytest.raises(mm.UnsupportedCall):
      mm.checked_config(x, w)
  with pytest.raises(mm.UnsupportedCall, match="shared memory"):
    mm.checked_config(jnp.ones((37, 512), jnp.bfloat16), w, mm.MosaicConfig(tile_k=256, steps=4))
  with pytest.raises(ValueError, match=r"expected \(M, 512\)") as e:
    mm.checked_config(jnp.ones((4, 256), jnp.bfloat16), w)
  assert not isinstance(e.value, mm.UnsupportedCall)
  # auto on f32 activations (which the kernel does not take) runs XLA: the exact product
  x = jax.random.normal(jax.random.key(9), (4, 512))
  got = dispatch.quantized_dot_general(x, w, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32, implementation="auto")
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.ones((512, 8)), rtol=1e-5)


@pytest.mark.slow
def test_prepare_pads_and_lays_out():
  rng = np.random.default_rng(5)
  v = jnp.asarray(rng.integers(-8, 8, (300, 1000)), jnp.int8)
  w = mm.prepare_mosaic_weight(v, "int4", scale=jnp.full((300, 1), 0.5))
  assert (w.n, w.k, w.n_pad, w.k_pad) == (300, 1000, 512, 1024)
  assert w.data.dtype == jnp.int4 and w.w_scale.shape == (300,)
  back = np.asarray(w.data.astype(jnp.int8))[:, np.argsort(np.tile(ml.column_permutation("int4"), 32)
                                                           + np.repeat(np.arange(32) * 32, 32))]
  np.testing.assert_array_equal(back[:300, :1000], v)
  assert not back[300:].any() and not back[:, 1000:].any()
  b = mm.prepare_mosaic_weight(jnp.where(v > 0, 1, -1), "binary")
  assert b.data.shape == (512, 128) and b.k_pad == 1024 and b.w_scale is None
  np.testing.assert_array_equal(ml.unpack_binary(b.data, 1024)[:300, :1000], np.where(v > 0, 1, -1))


@pytest.mark.slow
def test_prepare_and_matmul_errors():
  v = jnp.ones((8, 512), jnp.int8)
  with pytest.raises(ValueError, match="qtype='ternary'"):
    mm.prepare_mosaic_weight(v, "ternary")
  with pytest.raises(ValueError, match="order='float'; valid for int2 weights"):
    mm.prepare_mosaic_weight(v, "int2", order="float")
  with pytest.raises(mm.UnsupportedCall, match="int2 weights with bfloat16 activations"):
    mm.checked_config(jnp.ones((4, 512), jnp.bfloat16), mm.prepare_mosaic_weight(v, "int2"))
  with pytest.raises(ValueError, match="3 entries"):
    mm.prepare_mosaic_weight(v, "int8", scale=jnp.ones(3))
  with pytest.raises(ValueError, match="2-D"):
    mm.prepare_mosaic_weight(v[None], "int8")
  w = mm.prepare_mosaic_weight(v, "int8")
  with pytest.raises(ValueError, match="float32.*bfloat16, float16 or int8"):
    mm.mosaic_matmul(jnp.ones((4, 512), jnp.float32), w)
  with pytest.raises(ValueError, match="M=129"):
    mm.mosaic_matmul(jnp.ones((129, 512), jnp.bfloat16), w)
  with pytest.raises(ValueError, match=r"expected \(M, 512\)"):
    mm.mosaic_matmul(jnp.ones((4, 256), jnp.bfloat16), w)
  big = mm.MosaicConfig(tile_k=256, steps=4)
  assert mm.smem_bytes("int8", 37, big) > mm.SMEM_BYTES
  with pytest.raises(ValueError, match="shared memory"):
    mm.mosaic_matmul(jnp.ones((37, 512), jnp.bfloat16), w, config=big)
  with pytest.raises(ValueError, match="does not tile K=512"):
    mm.mosaic_matmul(jnp.ones((4, 512), jnp.bfloat16), w,
                     config=mm.MosaicConfig(tile_k=256, split_k=4))
  wb = mm.prepare_mosaic_weight(v, "binary")
  with pytest.raises(ValueError, match="binary weights need tile_k >= 256"):
    mm.mosaic_matmul(jnp.ones((4, 512), jnp.bfloat16), wb, config=mm.MosaicConfig(tile_k=128))
  deep = mm.prepare_mosaic_weight(jnp.ones((8, mm.A8_MAX_K + 1), jnp.int8), "int8")
  with pytest.raises(ValueError, match=f"K={mm.A8_MAX_K + 1} .*int32 accumulator"):
    mm.mosaic_matmul(jnp.ones((4, mm.A8_MAX_K + 1), jnp.int8), deep)
  wide = mm.MosaicConfig(wg_rows=128, tile_k=512, steps=2)  # int8 activations only
  with pytest.raises(ValueError, match="wg_rows=128 x tile_k=512 decodes more than 32768 bfloat16"):
    mm.mosaic_matmul(jnp.ones((4, 512), jnp.bfloat16), w, config=wide)
  # int8 activation tiles are half the bytes: a config too big for bf16 fits.
  assert mm.smem_bytes("int8", 37, big, 1) <= mm.SMEM_BYTES


def test_reference_matches_float64():
  rng = np.random.default_rng(6)
  x = rng.standard_normal((7, 300)).astype(np.float32)
  v = rng.integers(-8, 8, (33, 300))
  s, xs = rng.random(33) + 0.5, rng.random(7) + 0.5
  ref = (x.astype(np.float64) @ v.T.astype(np.float64)) * s[None, :] * xs[:, None]
  out = mm.mosaic_matmul_reference(jnp.asarray(x), jnp.asarray(v, jnp.int8), "int4", w_scale=s,
                                   x_scale=xs)
  assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.mark.slow
def test_dispatch_mosaic_off_gpu_and_unsupported():
  x = jax.random.normal(jax.random.key(0), (4, 256), jnp.bfloat16)
  wq = qa.quantize(jax.random.normal(jax.random.key(1), (256, 64)),
                   qa.QuantizeSpec(qtype="int4", channelwise_axes=(1,)))
  dn = (((1,), (0,)), ((), ()))
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="runs on a GPU"):
      dispatch.quantized_dot_general(x, wq, dn, preferred_element_type=jnp.float32,
                                     implementation="mosaic")
  assert "mosaic" in dispatch.IMPLEMENTATIONS
  with pytest.raises(Unsupported, match="group-wise"):
    _plan_mosaic(x, qa.quantize(jax.random.normal(jax.random.key(1), (256, 64)),
                                         qa.QuantizeSpec(qtype="int4", channelwise_axes=(1,),
                                                         tiled_axes={0: 128})), dn)
  with pytest.raises(Unsupported, match="float32"):
    _plan_mosaic(x.astype(jnp.float32), wq, dn)
  mw = mm.prepare_mosaic_weight(jnp.ones((64, 256), jnp.int8), "int8")
  with pytest.raises(ValueError, match="MosaicWeight rhs runs with implementation='mosaic' or 'auto'"):
    dispatch.quantized_dot_general(x, mw, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32, implementation="triton")


@pytest.mark.slow
def test_plan_mosaic_canonicalises_a_qarray():
  x = jax.random.normal(jax.random.key(0), (2, 3, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (256, 40))
  wq = qa.quantize(w, qa.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  xc, xs, mw, out_shape = _plan_mosaic(x, wq, (((2,), (0,)), ((), ())))
  assert xc.shape == (6, 256) and out_shape == (2, 3, 40) and xs is None
  assert (mw.n, mw.k, mw.qtype) == (40, 256, "int8")
  ref = mm.mosaic_matmul_reference(xc, wq.qvalue.T, "int8", w_scale=wq.scale.reshape(-1))
  want = jax.lax.dot_general(x.astype(jnp.float32), wq.qvalue.astype(jnp.float32) * wq.scale,
                             (((2,), (0,)), ((), ())), precision="highest")
  assert np.max(np.abs(np.asarray(ref).reshape(out_shape) - want)) <= 1e-5 * math.sqrt(256) * float(
      np.max(np.abs(want)))


@pytest.mark.slow
def test_plan_mosaic_takes_int8_activation_qarrays():
  # Symmetric integer activations (binary included) reach the kernel as int8
  # codes with a per-row scale; other quantized activations are refused.
  x = jax.random.normal(jax.random.key(0), (2, 3, 256))
  wq = qa.quantize(jax.random.normal(jax.random.key(1), (256, 40)),
                   qa.QuantizeSpec(qtype="int4", channelwise_axes=(1,)))
  dn = (((2,), (0,)), ((), ()))
  for qtype in ("int8", "int4", "binary"):
    xq = qa.quantize(x, qa.QuantizeSpec(qtype=qtype, channelwise_axes=(0, 1)))
    xc, xs, mw, out_shape = _plan_mosaic(xq, wq, dn)
    assert xc.dtype == jnp.int8 and xc.shape == (6, 256) and xs.shape == (6,)
    np.testing.assert_array_equal(xc, xq.qvalue.reshape(6, 256))
    np.testing.assert_array_equal(xs, xq.scale.reshape(6))
    assert out_shape == (2, 3, 40) and mw.qtype == "int4"
  mw = mm.prepare_mosaic_weight(jnp.ones((40, 256), jnp.int8), "int8")
  xq = qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 1)))
  xc, xs, _, out_shape = _plan_mosaic(xq, mw, (((2,), (1,)), ((), ())))
  assert xc.dtype == jnp.int8 and xs.shape == (6,) and out_shape == (2, 3, 40)
  with pytest.raises(Unsupported, match="float8_e4m3fn activations"):
    _plan_mosaic(qa.quantize(x, qa.QuantizeSpec(qtype="float8_e4m3fn")), wq, dn)
  with pytest.raises(Unsupported, match="asymmetric"):
    _plan_mosaic(qa.quantize(x, qa.QuantizeSpec(qtype="int8", calibration="minmax")), wq, dn)


@pytest.mark.parametrize("qtype,lo,hi,order", [(qt, lo, hi, order) for qt, lo, hi, order, act in _ORDER_CASES
                                               if order == act])
@pytest.mark.parametrize("tiles", [None, (256, 256), (128, 512)])
@pytest.mark.thin(2)
def test_mosaic_weight_values_undo_the_storage_order(qtype, lo, hi, order, tiles):
  v = np.random.default_rng(13).integers(lo, hi, (300, 1000)).astype(np.int8)
  if qtype == "binary":
    v = np.where(v > 0, 1, -1).astype(np.int8)
  w = mm.prepare_mosaic_weight(jnp.asarray(v), qtype, scale=jnp.linspace(0.5, 1.5, 300), order=order,
                               tiles=tiles)
  assert w.order == order and w.tiles == tiles and (w.n_pad, w.k_pad) == (512, 1024)
  back = mm.mosaic_weight_values(w)
  assert back.shape == (300, 1000) and back.dtype == jnp.int8
  np.testing.assert_array_equal(back, v)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", mm.QTYPES)
@pytest.mark.parametrize("act", ["bfloat16", "int8"])
def test_auto_runs_a_mosaic_weight_anywhere(qtype, act):
  # "auto" with a MosaicWeight: the kernel on a CUDA lowering (GPU tests),
  # XLA on the stored codes elsewhere: the same numbers as the QArray it came from.
  k, n = 512, 200
  wq = qa.quantize(jax.random.normal(jax.random.key(3), (n, k)),
                   qa.QuantizeSpec(qtype=qtype, channelwise_axes=(0,)))
  mw = mm.prepare_mosaic_weight(wq.qvalue, qtype, scale=wq.scale)
  x = jax.random.normal(jax.random.key(4), (2, 5, k))
  lhs = (x.astype(jnp.bfloat16) if act == "bfloat16"
         else qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 1))))
  dn = (((2,), (1,)), ((), ()))
  got = jax.jit(lambda l, w: dispatch.quantized_dot_general(
      l, w, dn, preferred_element_type=jnp.float32, implementation="auto"))(lhs, mw)
  want = dispatch.quantized_dot_general(lhs, wq, dn, preferred_element_type=jnp.float32,
                                        implementation="xla")
  assert got.shape == want.shape == (2, 5, n)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5 * float(np.max(np.abs(want))))
  with pytest.raises(ValueError, match="must contract lhs's last axis"):
    dispatch.quantized_dot_general(lhs, mw, (((2,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32, implementation="auto")


def test_layout_docstring_examples_run():
  import doctest
  res = doctest.testmod(ml)
  assert res.attempted >= 4 and res.failed == 0
