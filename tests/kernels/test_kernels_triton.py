"""Interpret-mode (CPU) tests of the qtrain Pallas kernels against their references.

Integer paths must be bit-exact; float paths (bf16/f16/f32 activations) may
differ from the f32 reference only by f32 summation order (budget below).
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from qtrain.core import packing
from qtrain.kernels import _common
from qtrain.kernels import binary_matmul as bmm
from qtrain.kernels import int8_matmul as imm
from qtrain.kernels import nbit_matmul as nbm
from qtrain.kernels import prepared
from qtrain.kernels._qmatmul import BlockConfig
from _testutil import rel_error as _rel, random_acts as _acts

FLOAT_BUDGET = 2e-6  # normwise relative error vs the f32 reference (products exact, f32 sums)

SMALL = BlockConfig(block_m=16, block_n=32)
SPLIT = BlockConfig(block_m=16, block_n=32, split_k=2)
FLAT = BlockConfig(block_m=16, block_n=32, block_k=64)
FLAT_SPLIT = BlockConfig(block_m=32, block_n=16, block_k=32, split_k=3)
NO16 = BlockConfig(block_m=16, block_n=32, decode16=False)
NOBYTE = BlockConfig(block_m=16, block_n=32, byte_decode=False, split_k=2)




def _sign(rng, shape):
  return jnp.asarray(np.where(rng.random(shape) > 0.5, 1, -1), jnp.int8)


@pytest.mark.slow
@pytest.mark.parametrize("qtype,lo,hi", [("binary", -1, 2), ("ternary", -1, 2), ("int2", -2, 2),
                                         ("int4", -8, 8), ("int8", -128, 128)])
def test_plane_layout_roundtrip(qtype, lo, hi):
  rng = np.random.default_rng(1)
  v = jnp.asarray(rng.integers(lo, hi, (5, 77)), jnp.int8)
  if qtype == "binary":
    v = jnp.where(v > 0, 1, -1).astype(jnp.int8)
  words = _common.to_plane_layout(v, qtype, plane_words=16)
  np.testing.assert_array_equal(_common.from_plane_layout(words, qtype, size=77, plane_words=16), v)
  from_packed = _common.packed_to_plane_layout(packing.pack(v, qtype), qtype, size=77, plane_words=16)
  np.testing.assert_array_equal(from_packed, words)


@pytest.mark.slow
@pytest.mark.parametrize("m,k,n,act,config,kn", [
    (6, 90, 20, "int8", NOBYTE, False),
    (17, 100, 33, "int8", SPLIT, True),
    (33, 200, 20, "int8", FLAT_SPLIT, False),
    (20, 130, 17, "bfloat16", FLAT, True),
    (2, 70, 20, "bfloat16", NO16, True),
    (9, 96, 24, "float16", SPLIT, False),
    (4, 70, 16, "float32", SMALL, False),
])
def test_binary_matmul(m, k, n, act, config, kn):
  rng = np.random.default_rng(m * k + n)
  x, wv = _acts(rng, m, k, act), _sign(rng, (n, k))
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32) if act == "int8" else None
  w = prepared.prepare_weight(wv, "binary", scale=ws, plane_words=16, kn=kn)
  out = bmm.binary_matmul(x, w, x_scale=xs, config=config, interpret=True)
  ref = bmm.binary_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  if act == "int8":
    np.testing.assert_array_equal(out, ref)
  else:
    assert _rel(out, ref) < FLOAT_BUDGET


@pytest.mark.slow
@pytest.mark.parametrize("method,config", [("mma", SMALL), ("mma", FLAT_SPLIT), ("mma", NOBYTE),
                                           ("popcount", SMALL)])
def test_binary_x_binary(method, config):
  rng = np.random.default_rng(7)
  m, k, n = 19, 150, 40
  xv, wv = _sign(rng, (m, k)), _sign(rng, (n, k))
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  w = prepared.prepare_weight(wv, "binary", scale=2.0, plane_words=16)
  xw = prepared.prepare_binary_activations(xv, plane_words=16)
  out = bmm.binary_matmul(xw, w, x_scale=xs, out_dtype=jnp.bfloat16, config=config,
                          method=method, interpret=True)
  ref = bmm.binary_matmul_reference(xv, wv, w_scale=2.0, x_scale=xs, out_dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("qtype,lo,hi,group,zero,act,config,kn", [
    ("int4", -8, 8, None, False, "int8", SMALL, False),
    ("int4", -8, 8, 64, True, "int8", NOBYTE, False),
    ("int2", -2, 2, None, False, "int8", NOBYTE, False),
    ("int4", -8, 8, 64, True, "bfloat16", SPLIT, True),
    ("int4", -8, 8, 32, False, "int8", FLAT, True),
    ("int4", -8, 8, 64, False, "float16", NO16, False),
    ("int2", -2, 2, 128, True, "int8", FLAT_SPLIT, False),
    ("int2", -2, 2, None, False, "bfloat16", FLAT, False),
    ("ternary", -1, 2, 64, False, "float32", SMALL, False),
    ("int8", -128, 128, None, False, "bfloat16", SPLIT, True),
    ("int8", -128, 128, 32, True, "int8", SMALL, False),
])
def test_nbit_matmul(qtype, lo, hi, group, zero, act, config, kn):
  rng = np.random.default_rng(abs(hash((qtype, group, act))) % 2**31)
  m, n = 13, 36
  k = 256 if group else 200
  x = _acts(rng, m, k, act)
  wv = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32) if act == "int8" else None
  if group:
    gs = jnp.asarray(rng.random((n, k // group)) + 0.5, jnp.float32)
    gz = jnp.asarray(rng.integers(-2, 3, (n, k // group)), jnp.float32) if zero else None
    w = prepared.prepare_weight(wv, qtype, scale=gs, zero_point=gz, group_size=group, plane_words=16,
                                kn=kn)
    ref = nbm.nbit_matmul_reference(x, wv, group_size=group, g_scale=gs, g_zero=gz, x_scale=xs)
  else:
    ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
    w = prepared.prepare_weight(wv, qtype, scale=ws, plane_words=16, kn=kn)
    ref = nbm.nbit_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
  out = nbm.nbit_matmul(x, w, x_scale=xs, config=config, interpret=True)
  assert out.shape == (m, n)
  if act == "int8" and not group:
    np.testing.assert_array_equal(out, ref)
  else:
    assert _rel(out, ref) < FLOAT_BUDGET


@pytest.mark.slow
def test_nbit_integer_partial_sums_exact():
  """Unit group scales: the group-wise int8 path gives exact integers."""
  rng = np.random.default_rng(3)
  x = _acts(rng, 7, 128, "int8")
  wv = jnp.asarray(rng.integers(-8, 8, (24, 128)), jnp.int8)
  w = prepared.prepare_weight(wv, "int4", scale=jnp.ones((24, 2)), group_size=64, plane_words=16)
  out = nbm.nbit_matmul(x, w, config=SMALL, interpret=True)
  exact = np.asarray(x, np.int64) @ np.asarray(wv, np.int64).T
  np.testing.assert_array_equal(np.asarray(out, np.int64), exact)


@pytest.mark.slow
@pytest.mark.parametrize("m,k,n,config", [(1, 100, 20, SMALL), (40, 300, 50, SPLIT)])
def test_int8_matmul(m, k, n, config):
  rng = np.random.default_rng(m + k)
  x, w = _acts(rng, m, k, "int8"), _acts(rng, n, k, "int8")
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  out = imm.int8_matmul(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16, config=config,
                        interpret=True)
  ref = imm.int8_matmul_reference(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(out, ref)


@pytest.mark.slow
def test_kernels_under_jit():
  rng = np.random.default_rng(11)
  x, wv = _acts(rng, 6, 64, "int8"), _sign(rng, (20, 64))
  w = prepared.prepare_weight(wv, "binary", plane_words=16)
  f = jax.jit(lambda x, w: bmm.binary_matmul(x, w, config=SMALL, interpret=True))
  np.testing.assert_array_equal(f(x, w), bmm.binary_matmul_reference(x, wv))


def test_validation_messages():
  rng = np.random.default_rng(0)
  wv = _sign(rng, (16, 64))
  w = prepared.prepare_weight(wv, "binary")
  with pytest.raises(ValueError, match="K=32"):
    bmm.binary_matmul(jnp.ones((2, 32), jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="popcount"):
    bmm.binary_matmul(jnp.ones((2, 64), jnp.bfloat16), w, method="popcount", interpret=True)
  with pytest.raises(ValueError, match="block_m=24"):
    BlockConfig(block_m=24)
  with pytest.raises(ValueError, match="group_size=48"):
    prepared.prepare_weight(jnp.ones((4, 96), jnp.int8), "int4", scale=jnp.ones((4, 2)), group_size=48)
  with pytest.raises(ValueError, match="nbit_matmul needs"):
    nbm.nbit_matmul(jnp.ones((2, 64), jnp.bfloat16), w, interpret=True)
  with pytest.raises(ValueError, match="block_n=256"):
    bmm.binary_matmul(jnp.ones((2, 64), jnp.int8), w,
                      config=BlockConfig(block_m=16, block_n=256), interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("config", [SMALL, SPLIT])
def test_int8_matmul_epilogue_survives_a_huge_times_tiny_scale(config):
  # (acc * x_scale) * w_scale overflows for x_scale ~1e35 and w_scale ~1e-32
  # although the product is ~1e7: the kernel's epilogue falls back to
  # acc * (x_scale * w_scale) there, with the bits of qdot.scale_product.
  from qtrain.core import qdot
  rng = np.random.default_rng(7)
  m, k, n = 20, 128, 40
  x, w = _acts(rng, m, k, "int8"), _acts(rng, n, k, "int8")
  xs = jnp.asarray(10.0 ** rng.uniform(33, 36, m), jnp.float32).at[:4].set(1.5)
  ws = jnp.asarray(10.0 ** rng.uniform(-37, -30, n), jnp.float32).at[:4].set(2.0)
  out = imm.int8_matmul(x, w, x_scale=xs, w_scale=ws, config=config, interpret=True)
  ref = imm.int8_matmul_reference(x, w, x_scale=xs, w_scale=ws)
  acc = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
  xla = qdot.scale_product(acc, xs[:, None], ws[None, :], grouped=False, out_dtype=jnp.float32)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_array_equal(out, xla)
  exact = (np.asarray(acc, np.float64) * np.asarray(xs, np.float64)[:, None]
           * np.asarray(ws, np.float64)[None, :])
  # Rows 4.. times columns 0..3 (x_scale ~1e35 times w_scale 2) are beyond float32.
  over = np.abs(exact) > np.finfo(np.float32).max
  assert over.any() and not over[:4].any() and not over[:, 4:].any()
  assert np.all(np.isinf(np.asarray(out)[over]))
  np.testing.assert_allclose(np.asarray(out)[~over], exact[~over], rtol=2.0 ** -22)
