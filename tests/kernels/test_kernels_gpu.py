"""Every qtrain kernel compiled for real (Triton, Mosaic GPU) against its reference; GPU only.

Run on the GPU machine:
``XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python -m pytest -m gpu -n 8 tests/kernels``.
"""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from qtrain.kernels import binary_matmul as bmm
from qtrain.kernels import int8_matmul as imm
from qtrain.kernels import nbit_matmul as nbm
from qtrain.kernels import prepared
from qtrain.kernels._qmatmul import BlockConfig
from _testutil import rel_error as _rel, random_acts as _acts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

FLOAT_BUDGET = 1e-5  # bf16/f16 products are exact in f32; f32 uses an IEEE dot
CONFIGS = {
    "small": BlockConfig(block_m=16, block_n=64, split_k=2, num_warps=4, num_stages=4),
    "flat": BlockConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128),
    "nobyte": BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=3, byte_decode=False,
                          decode16=False),
    "default": None,
}




@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("act", ["bfloat16", "float16", "float32", "int8", "binary"])
def test_binary_gpu(cfg, act):
  rng = np.random.default_rng(0)
  m, k, n = 200, 1000, 300  # ragged M, K, N
  wv = jnp.asarray(np.where(rng.random((n, k)) > 0.5, 1, -1), jnp.int8)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  w = prepared.prepare_weight(wv, "binary", scale=ws, kn=act in ("bfloat16", "float16") and cfg != "nobyte")
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  if act == "binary":
    xv = jnp.asarray(np.where(rng.random((m, k)) > 0.5, 1, -1), jnp.int8)
    x = prepared.prepare_binary_activations(xv)
    ref = bmm.binary_matmul_reference(xv, wv, w_scale=ws, x_scale=xs)
  else:
    x = _acts(rng, m, k, act)
    ref = bmm.binary_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
  out = jax.jit(lambda x, w: bmm.binary_matmul(x, w, x_scale=xs, config=CONFIGS[cfg]))(x, w)
  if act in ("int8", "binary"):
    np.testing.assert_array_equal(out, ref)
  else:
    assert _rel(out, ref) < FLOAT_BUDGET
  if act == "binary" and cfg == "small":
    pc = bmm.binary_matmul(x, w, x_scale=xs, config=CONFIGS[cfg], method="popcount")
    np.testing.assert_array_equal(pc, ref)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("qtype,lo,hi,group,zero", [
    ("int2", -2, 2, 128, False), ("int4", -8, 8, 64, True), ("int4", -8, 8, None, False),
    ("ternary", -1, 2, 32, False), ("int8", -128, 128, 128, False), ("int8", -128, 128, None, False)])
@pytest.mark.parametrize("act", ["bfloat16", "int8"])
def test_nbit_gpu(cfg, qtype, lo, hi, group, zero, act):
  rng = np.random.default_rng(1)
  m, k, n = 70, 1024, 200
  x = _acts(rng, m, k, act)
  wv = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32) if act == "int8" else None
  if group:
    gs = jnp.asarray(rng.random((n, k // group)) + 0.5, jnp.float32)
    gz = jnp.asarray(rng.integers(-2, 3, (n, k // group)), jnp.float32) if zero else None
    w = prepared.prepare_weight(wv, qtype, scale=gs, zero_point=gz, group_size=group,
                                kn=act == "bfloat16" and cfg == "flat")
    ref = nbm.nbit_matmul_reference(x, wv, group_size=group, g_scale=gs, g_zero=gz, x_scale=xs)
  else:
    ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
    w = prepared.prepare_weight(wv, qtype, scale=ws)
    ref = nbm.nbit_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
  out = jax.jit(lambda x, w: nbm.nbit_matmul(x, w, x_scale=xs, config=CONFIGS[cfg]))(x, w)
  if act == "int8" and not group:
    np.testing.assert_array_equal(out, ref)
  else:
    assert _rel(out, ref) < FLOAT_BUDGET


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("m", [1, 16, 300])
def test_int8_gpu(cfg, m):
  rng = np.random.default_rng(m)
  k, n = 1000, 384
  x, w = _acts(rng, m, k, "int8"), _acts(rng, n, k, "int8")
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  out = imm.int8_matmul(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16, config=CONFIGS[cfg])
  ref = imm.int8_matmul_reference(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(out, ref)


def test_dispatch_triton_matches_xla():
  from qtrain.core import qarray as qa
  from qtrain.ops import dispatch
  x = jax.random.normal(jax.random.key(0), (4, 64, 512), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (512, 256), jnp.float32)
  wq = qa.quantize(w, qa.QuantizeSpec(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 128}))
  xq = qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 1)))
  dn = (((2,), (0,)), ((), ()))
  a = dispatch.quantized_dot_general(xq, wq, dn, preferred_element_type=jnp.float32,
                                     implementation="triton")
  b = dispatch.quantized_dot_general(xq, wq, dn, preferred_element_type=jnp.float32,
                                     implementation="xla")
  assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("qtype,group", [("binary", None), ("ternary", None), ("ternary", 64),
                                         ("int2", None), ("int2", 64), ("int4", None), ("int4", 64)])
@pytest.mark.parametrize("act", ["bfloat16", "float16", "int8"])
@pytest.mark.parametrize("kn", [False, True])
def test_asm_decoders_same_bits_as_jnp_gpu(qtype, group, act, kn):
  """The inline-PTX decoders (qtrain.kernels._asm) against the jnp decoders in the same kernel."""
  rng = np.random.default_rng(len(qtype) * 100 + (group or 0) + kn + len(act))
  m, k, n = 13, (1024 if group else 1000), 200  # ragged M, N (and K without groups)
  x = _acts(rng, m, k, act)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32) if act == "int8" else None
  cfg = BlockConfig(block_m=16, block_n=64, split_k=2, num_warps=4, num_stages=3)
  if qtype == "binary":
    wv = jnp.asarray(np.where(rng.random((n, k)) > 0.5, 1, -1), jnp.int8)
    ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
    w = prepared.prepare_weight(wv, "binary", scale=ws, kn=kn)
    call = lambda c: jax.jit(lambda x, w: bmm.binary_matmul(x, w, x_scale=xs, config=c))(x, w)
    ref = bmm.binary_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
  else:
    lo, hi = {"ternary": (-1, 2), "int2": (-2, 2), "int4": (-8, 8)}[qtype]
    wv = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
    if group:
      gs = jnp.asarray(rng.random((n, k // group)) + 0.5, jnp.float32)
      w = prepared.prepare_weight(wv, qtype, scale=gs, group_size=group, kn=kn)
      ref = nbm.nbit_matmul_reference(x, wv, group_size=group, g_scale=gs, x_scale=xs)
    else:
      ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
      w = prepared.prepare_weight(wv, qtype, scale=ws, kn=kn)
      ref = nbm.nbit_matmul_reference(x, wv, w_scale=ws, x_scale=xs)
    call = lambda c: jax.jit(lambda x, w: nbm.nbit_matmul(x, w, x_scale=xs, config=c))(x, w)
  out_asm = call(cfg)
  out_jnp = call(dataclasses.replace(cfg, asm=False))
  np.testing.assert_array_equal(np.asarray(out_asm, np.float32), np.asarray(out_jnp, np.float32))
  if act == "int8" and not group:
    np.testing.assert_array_equal(out_asm, ref)
  else:
    assert _rel(out_asm, ref) < FLOAT_BUDGET


# ---- Mosaic GPU kernel (Hopper, jax >= 0.11).
from qtrain.kernels import mosaic_matmul as mm  # noqa: E402

_needs_mosaic = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                   reason="Pallas Mosaic GPU kernels need jax >= 0.11")
_MOSAIC_SHAPES = [
    (1, 300, 1000, None),  # ragged N and K, default config (split-K)
    (16, 4096, 4096, None),
    (37, 640, 2048, mm.MosaicConfig(tile_k=256, steps=3, split_k=2)),  # ragged M
    (64, 1024, 1536, mm.MosaicConfig(tile_k=256, steps=2, split_k=2)),
    (128, 256, 512, None),
    (16, 1000, 2048, mm.MosaicConfig(tile_k=256, steps=2, wg_rows=128)),  # 128 rows per warpgroup
]


@_needs_mosaic
@pytest.mark.parametrize("qtype,lo,hi", [("binary", -1, 2), ("int4", -8, 8), ("int8", -128, 128)])
@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k,cfg", _MOSAIC_SHAPES)
def test_mosaic_gpu(qtype, lo, hi, act, m, n, k, cfg):
  rng = np.random.default_rng(m + n + k)
  v = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  x = _acts(rng, m, k, act)
  w = mm.prepare_mosaic_weight(v, qtype, scale=ws)
  out = jax.jit(lambda x, w: mm.mosaic_matmul(x, w, x_scale=xs, config=cfg))(x, w)
  ref = mm.mosaic_matmul_reference(x, v, qtype, w_scale=ws, x_scale=xs)
  assert out.shape == (m, n)
  assert _rel(out, ref) < FLOAT_BUDGET


_A8_QTYPES = [("binary", -1, 2), ("int2", -2, 2), ("int4", -8, 8), ("int8", -128, 128)]
# (qtype, lo, hi, act): int2 weights run with int8 activations only
_QTYPE_ACTS = [(*q, act) for q in _A8_QTYPES for act in ("bfloat16", "int8")
               if q[0] != "int2" or act == "int8"]


@_needs_mosaic
@pytest.mark.parametrize("qtype,lo,hi", _A8_QTYPES)
@pytest.mark.parametrize("m,n,k,cfg", _MOSAIC_SHAPES)
def test_mosaic_gpu_int8_activations(qtype, lo, hi, m, n, k, cfg):
  # int8 wgmma, int32 accumulation: exact up to the f32 scaling of the result.
  rng = np.random.default_rng(m + n + k + 1)
  v = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  x = jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8)
  w = mm.prepare_mosaic_weight(v, qtype, scale=ws)
  out = jax.jit(lambda x, w: mm.mosaic_matmul(x, w, x_scale=xs, config=cfg))(x, w)
  ref = mm.mosaic_matmul_reference(x, v, qtype, w_scale=ws, x_scale=xs)
  assert out.shape == (m, n)
  assert _rel(out, ref) < 1e-6


@_needs_mosaic
@pytest.mark.parametrize("qtype,lo,hi", [("binary", -1, 2), ("int4", -8, 8), ("int8", -128, 128)])
@pytest.mark.parametrize("order", ["float", "int8"])
@pytest.mark.parametrize("act", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,n,k,cfg", [
    (3, 1000, 1536, None),  # default config: split-K, XLA epilogue
    (16, 1000, 2048, mm.MosaicConfig(tile_k=256, steps=2, wg_rows=128)),  # kernel epilogue
])
def test_mosaic_gpu_either_storage_order(qtype, lo, hi, order, act, m, n, k, cfg):
  # Weights laid out for either kind of activations run both kinds (the other kind's
  # K columns permuted per call).
  rng = np.random.default_rng(m + n + k + 3)
  v = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  x = (jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8) if act == "int8"
       else _acts(rng, m, k, act))
  w = mm.prepare_mosaic_weight(v, qtype, scale=ws, order=order)
  out = jax.jit(lambda x, w: mm.mosaic_matmul(x, w, x_scale=xs, config=cfg))(x, w)
  ref = mm.mosaic_matmul_reference(x, v, qtype, w_scale=ws, x_scale=xs)
  assert _rel(out, ref) < (1e-6 if act == "int8" else FLOAT_BUDGET)


@_needs_mosaic
@pytest.mark.parametrize("qtype,lo,hi,act", _QTYPE_ACTS)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m,n,k,cfg", [
    (5, 1000, 2048, mm.MosaicConfig(tile_k=256, steps=2, wg_rows=128)),  # ragged M and N
    (37, 640, 2048, mm.MosaicConfig(tile_k=256, steps=3)),
    (16, 512, 1024, mm.MosaicConfig(tile_k=512, steps=3)),
    (64, 768, 512, mm.MosaicConfig(tile_k=256, steps=2)),
])
def test_mosaic_kernel_epilogue_matches_the_xla_epilogue(qtype, lo, hi, act, out_dtype, m, n, k, cfg):
  # Without split-K the kernel scales, casts and transposes the result itself: the same
  # bits as the partial sums scaled by XLA (the A8 factor is a power of two).
  rng = np.random.default_rng(m * n + k)
  v = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  w = mm.prepare_mosaic_weight(v, qtype, scale=jnp.asarray(rng.random(n) + 0.5, jnp.float32))
  xs = jnp.asarray(rng.random(m) + 0.5, jnp.float32)
  x = (jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8) if act == "int8"
       else _acts(rng, m, k, act))
  run = lambda fuse: np.asarray(jax.jit(lambda x, w: mm._matmul(
      x, w, xs, jnp.dtype(out_dtype), cfg, fuse_epilogue=fuse))(x, w))
  fused = run(True)
  assert fused.shape == (m, n) and fused.dtype == jnp.dtype(out_dtype)
  np.testing.assert_array_equal(fused, run(False))
  # bf16 output: round to nearest, at most 2**-9 of the largest value (budget 2**-8)
  budget = {"float32": 1e-6 if act == "int8" else FLOAT_BUDGET, "bfloat16": 2.0**-8}[out_dtype]
  assert _rel(fused, mm.mosaic_matmul_reference(x, v, qtype, w_scale=w.w_scale, x_scale=xs)) < budget


@_needs_mosaic
@pytest.mark.parametrize("qtype,lo,hi,act", _QTYPE_ACTS)
@pytest.mark.parametrize("m,n,k,cfg", [
    (16, 1000, 2048, mm.MosaicConfig(tile_k=256, steps=2, wg_rows=128)),  # kernel epilogue
    (3, 700, 2048, mm.MosaicConfig(tile_k=512, steps=2, split_k=2)),  # split-K
])
def test_mosaic_gpu_tiled_weights_give_the_same_bits(qtype, lo, hi, act, m, n, k, cfg):
  # Weights stored tile by tile stream the same values in the same order as row-major ones.
  rng = np.random.default_rng(m + n + k + 4)
  v = jnp.asarray(rng.integers(lo, hi, (n, k)), jnp.int8)
  ws = jnp.asarray(rng.random(n) + 0.5, jnp.float32)
  x = (jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8) if act == "int8"
       else _acts(rng, m, k, act))
  order = "int8" if act == "int8" else "float"
  run = lambda tiles: np.asarray(jax.jit(lambda x, w: mm.mosaic_matmul(x, w, config=cfg))(
      x, mm.prepare_mosaic_weight(v, qtype, scale=ws, order=order, tiles=tiles)))
  tiled = run((cfg.cta_rows, cfg.tile_k))
  np.testing.assert_array_equal(tiled, run(None))
  ref = mm.mosaic_matmul_reference(x, v, qtype, w_scale=ws)
  assert _rel(tiled, ref) < (1e-6 if act == "int8" else FLOAT_BUDGET)


@_needs_mosaic
@pytest.mark.parametrize("qtype", mm.QTYPES)
def test_auto_runs_a_mosaic_weight_on_the_kernel(qtype):
  # On the GPU "auto" runs a MosaicWeight through the Mosaic kernel: bit for bit
  # the forced kernel's output (XLA's bf16 path rounds the dequantized weights
  # to bf16, so its numbers differ in the last bits). int2: int8 activations.
  from qtrain.core import qarray as qa
  from qtrain.ops import dispatch
  rng = np.random.default_rng(21)
  lo, hi = {"binary": (-1, 2), "int2": (-2, 2)}.get(qtype, (-8, 8))
  v = jnp.asarray(rng.integers(lo, hi, (384, 1024)), jnp.int8)
  w = mm.prepare_mosaic_weight(v if qtype != "binary" else jnp.where(v > 0, 1, -1), qtype,
                               scale=jnp.asarray(rng.random(384) + 0.5, jnp.float32))
  x = jnp.asarray(rng.standard_normal((3, 8, 1024)), jnp.bfloat16)
  if qtype == "int2":
    x = qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 1)))
  dn = (((2,), (1,)), ((), ()))
  run = lambda impl: jax.jit(lambda x, w: dispatch.quantized_dot_general(
      x, w, dn, preferred_element_type=jnp.float32, implementation=impl))(x, w)
  np.testing.assert_array_equal(np.asarray(run("auto")), np.asarray(run("mosaic")))


def _mosaic_and_xla(lhs, qtype, key):
  """(wq, mosaic out, xla out) of lhs (2, 8, 512) x a random (512, 384) per-channel
  ``qtype`` weight, through dispatch's "mosaic" and "xla" implementations."""
  from qtrain.core import qarray as qa
  from qtrain.ops import dispatch
  w = jax.random.normal(jax.random.key(key), (512, 384), jnp.float32)
  wq = qa.quantize(w, qa.QuantizeSpec(qtype=qtype, channelwise_axes=(1,)))
  run = lambda impl: dispatch.quantized_dot_general(
      lhs, wq, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32, implementation=impl)
  return wq, run("mosaic"), run("xla")


@_needs_mosaic
@pytest.mark.parametrize("qtype", mm.QTYPES)
def test_dispatch_mosaic_int8_activations_matches_xla(qtype):
  from qtrain.core import qarray as qa
  x = jax.random.normal(jax.random.key(2), (2, 8, 512), jnp.float32)
  xq = qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 1)))
  _, a, b = _mosaic_and_xla(xq, qtype, key=3)
  assert a.shape == b.shape == (2, 8, 384)
  assert _rel(a, b) < 1e-6  # both integer products, scaled in f32


@_needs_mosaic
def test_dispatch_mosaic_refuses_int2_weights_with_float_activations():
  x = jax.random.normal(jax.random.key(0), (2, 8, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="int2 weights with bfloat16 activations"):
    _mosaic_and_xla(x, "int2", key=1)


@_needs_mosaic
@pytest.mark.parametrize("qtype", [q for q in mm.QTYPES if q != "int2"])
def test_dispatch_mosaic_matches_xla(qtype):
  x = jax.random.normal(jax.random.key(0), (2, 8, 512), jnp.bfloat16)
  wq, a, b = _mosaic_and_xla(x, qtype, key=1)
  exact = np.einsum("abk,kn->abn", np.asarray(x, np.float64),
                    np.asarray(wq.qvalue, np.float64) * np.asarray(wq.scale, np.float64))
  assert a.shape == b.shape == (2, 8, 384)
  assert _rel(a, exact) < FLOAT_BUDGET  # scales applied in f32 after the f32 accumulation
  # The XLA path dequantizes the weights to the activations' bf16 (each weight
  # rounded by at most 2**-9 relative), so the two agree to that rounding.
  assert _rel(b, exact) < 2**-8
  assert _rel(a, b) < 2**-8
