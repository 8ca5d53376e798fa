"""The Mosaic int8 GEMM (qtrain.kernels.mosaic_gemm) and its dispatch.

CPU: configs and their errors, the reference against float64, the dispatch
plan (canonicalisation and scales, checked bit for bit against the XLA path),
the QT backward's output dtype. GPU (``-m gpu``, a Hopper GPU and jax >= 0.11):
the kernel bit for bit against its reference over configs and output dtypes,
"auto" dispatch onto it, and a QT op's gradients on it against cuBLAS's.
"""

import importlib
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.ops import config as C
from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.ops.dot_general_qt import dot_general_qt
from qtrain.kernels import _common
from qtrain.ops import dispatch
from qtrain.kernels import mosaic_gemm as mg
from qtrain.kernels.mosaic_matmul import UnsupportedCall
from qtrain.ops.backends import mosaic as mosaic_backend
from qtrain.ops.backends import DotCall, Unsupported

dqt = importlib.import_module("qtrain.ops.dot_general_qt")
DN = (((1,), (0,)), ((), ()))  # (M, K) x (K, N): the rhs needs a transpose to (N, K)


def _codes(key, shape):
  return jax.random.randint(key, shape, -127, 128, jnp.int8)


def _scales(key, n):
  return jax.random.uniform(key, (n,), jnp.float32, 0.5, 1.5) * 1e-2


@pytest.mark.parametrize("kw, match", [
    (dict(tile_m=96), "tile_m=96; valid"),
    (dict(tile_n=32), "tile_n=32; valid"),
    (dict(tile_k=512), "tile_k=512; valid"),
    (dict(tile_m=128, tile_n=256), "16384"),
    (dict(steps=1), "steps=1; valid: 2..8"),
    (dict(wg_axis="k"), "wg_axis='k'; valid"),
    (dict(grid_minor="x"), "grid_minor='x'; valid"),
    (dict(snake=0), "snake=0"),
])
def test_config_errors_name_the_bad_value(kw, match):
  with pytest.raises(ValueError, match=match):
    mg.GemmConfig(**kw)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_default_config_fits_and_tiles_the_ctas(out_dtype):
  cfg = mg.default_config(8192, 4096, 16384, out_dtype)
  assert mg.smem_bytes(cfg, out_dtype) <= mg.SMEM_BYTES
  assert cfg.steps == (4 if out_dtype != jnp.float32 else 3)
  assert (cfg.cta_m, cfg.cta_n) == (128, 256)
  assert (mg.GemmConfig(wg_axis="m").cta_m, mg.GemmConfig(wg_axis="m").cta_n) == (256, 128)


def test_default_config_keeps_the_sms_busy():
  # (128, 256) CTA tiles, or (128, 128) where those would leave more than half the SMs idle
  assert mg.default_config(8192, 16384, 4096, num_sms=132) == mg.GemmConfig()
  assert mg.default_config(1024, 4096, 4096, num_sms=132) == mg.GemmConfig()  # 128 tiles
  small = mg.default_config(512, 4096, 4096, num_sms=132)  # 64 tiles of (128, 256)
  assert (small.cta_m, small.cta_n) == (128, 128) and small.steps == 4
  assert mg.default_config(512, 4096, 4096, num_sms=64) == mg.GemmConfig()


def test_checked_config_errors():
  a, b = jnp.ones((256, 256), jnp.int8), jnp.ones((512, 256), jnp.int8)
  assert mg.checked_config(a, b) == mg.default_config(256, 512, 256)
  with pytest.raises(ValueError, match=r"\(M, K\) and \(N, K\)"):
    mg.checked_config(a, jnp.ones((512, 128), jnp.int8))
  with pytest.raises(ValueError, match=r"one dtype of \['int8', 'float8_e4m3fn', "
                                       r"'float8_e5m2'\].*got int8 and float32"):
    mg.checked_config(a, b.astype(jnp.float32))
  with pytest.raises(ValueError, match="got float8_e5m2 and float8_e4m3fn"):
    mg.checked_config(a.astype(jnp.float8_e5m2), b.astype(jnp.float8_e4m3fn))
  # fp8 accumulates in float32: no K bound
  k = (mg.MAX_K // 128 + 1) * 128
  huge = jax.ShapeDtypeStruct((128, k), jnp.float8_e4m3fn)
  assert mg.checked_config(huge, jax.ShapeDtypeStruct((256, k), jnp.float8_e4m3fn),
                           mg.GemmConfig(tile_n=64, wg_axis="n")).tile_n == 64
  with pytest.raises(ValueError, match="out_dtype=int32"):
    mg.checked_config(a, b, out_dtype=jnp.int32)
  with pytest.raises(UnsupportedCall, match=r"\(M, N, K\) = \(200, 512, 256\).*\(128, 256\)"):
    mg.checked_config(jnp.ones((200, 256), jnp.int8), b, mg.GemmConfig())
  with pytest.raises(UnsupportedCall, match="shared memory"):
    mg.checked_config(a, b, mg.GemmConfig(tile_k=256, steps=4))
  big = jax.ShapeDtypeStruct((128, mg.MAX_K + 128), jnp.int8)
  with pytest.raises(UnsupportedCall, match="int32 accumulator"):
    mg.checked_config(big, jax.ShapeDtypeStruct((256, mg.MAX_K + 128), jnp.int8))
  with pytest.raises(ValueError, match="a_scale has 3 entries; expected 1 or 256"):
    mg.mosaic_gemm_reference(a, b, a_scale=jnp.ones(3))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off a GPU (on a GPU the kernel runs)")
def test_mosaic_gemm_off_gpu_says_so():
  a, b = jnp.ones((128, 128), jnp.int8), jnp.ones((256, 128), jnp.int8)
  with pytest.raises(ValueError, match="runs on a GPU; this backend is 'cpu'"):
    mg.mosaic_gemm(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype, budget", [(jnp.float32, 2.0**-22), (jnp.bfloat16, 2.0**-8)])
def test_reference_matches_float64(out_dtype, budget):
  ks = jax.random.split(jax.random.key(1), 4)
  a, b = _codes(ks[0], (24, 300)), _codes(ks[1], (40, 300))
  sa, sb = _scales(ks[2], 24), _scales(ks[3], 40)
  want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * np.asarray(sa, np.float64)[:, None] \
      * np.asarray(sb, np.float64)[None, :]
  out = np.asarray(mg.mosaic_gemm_reference(a, b, a_scale=sa, b_scale=sb, out_dtype=out_dtype),
                   np.float64)
  # exact int32 sums; two float32 products (2 ulp) and the final cast's half ulp per element
  assert np.all(np.abs(out - want) <= budget * np.abs(want) + 1e-30)


def _plan_gemm(x, w, dn, out_dtype, **kw):
  return mosaic_backend.plan_gemm(DotCall(x, w, dn, jnp.dtype(out_dtype)), **kw)


def _int8_qarrays(m, k, n, seed=0, lhs_qtype="int8", rhs_qtype="int8"):
  ks = jax.random.split(jax.random.key(seed), 2)
  x = qa.quantize(jax.random.normal(ks[0], (m, k)), qa.QuantizeSpec(qtype=lhs_qtype,
                                                                      channelwise_axes=(0,)))
  w = qa.quantize(jax.random.normal(ks[1], (k, n)), qa.QuantizeSpec(qtype=rhs_qtype,
                                                                      channelwise_axes=(1,)))
  return x, w


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lhs_qtype", ["int8", "int4", "binary"])
def test_plan_gemm_gives_the_xla_paths_numbers(out_dtype, lhs_qtype):
  # The plan's operands and scales, through the kernel's reference, are the
  # XLA path's product bit for bit (same exact int32 sums, same epilogue order).
  x, w = _int8_qarrays(256, 384, 512, lhs_qtype=lhs_qtype)
  plan = _plan_gemm(x, w, DN, out_dtype)
  assert plan.a.shape == (256, 384) and plan.b.shape == (512, 384) and plan.out_shape == (256, 512)
  np.testing.assert_array_equal(plan.b, w.qvalue.T)
  got = mg.mosaic_gemm_reference(plan.a, plan.b, a_scale=plan.a_scale, b_scale=plan.b_scale,
                                 out_dtype=out_dtype)
  want = qdot.dot_general_quantized_xla(x, w, DN, preferred_element_type=out_dtype)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.slow
def test_plan_gemm_takes_fp8_of_one_dtype(qtype):
  # fp8 x fp8 of one dtype (the fp8 forward): the plan keeps the codes' dtype, and through the
  # reference (float32 accumulation, the same epilogue order) gives the XLA path's product
  # within float32 summation order; the float64 product of the codes bounds both.
  x, w = _int8_qarrays(256, 384, 512, lhs_qtype=qtype, rhs_qtype=qtype)
  plan = _plan_gemm(x, w, DN, jnp.float32)
  assert plan.a.dtype == plan.b.dtype == jnp.dtype(qtype) and plan.out_shape == (256, 512)
  np.testing.assert_array_equal(np.asarray(plan.b, np.float32), np.asarray(w.qvalue.T, np.float32))
  got = np.asarray(mg.mosaic_gemm_reference(plan.a, plan.b, a_scale=plan.a_scale,
                                            b_scale=plan.b_scale, out_dtype=jnp.float32))
  want = np.asarray(qdot.dot_general_quantized_xla(x, w, DN, preferred_element_type=jnp.float32))
  exact = (np.asarray(x.qvalue, np.float64) @ np.asarray(w.qvalue, np.float64)) \
      * np.asarray(x.scale, np.float64) * np.asarray(w.scale, np.float64)
  # |error| of a float32 sum of K products <= K * eps * sum |terms| (+ the epilogue's 2 ulp)
  bound = 384 * 2.0**-24 * ((np.abs(np.asarray(x.qvalue, np.float64))
                            @ np.abs(np.asarray(w.qvalue, np.float64)))
                           * np.asarray(x.scale, np.float64) * np.asarray(w.scale, np.float64)) \
      + 2.0**-22 * np.abs(exact)
  for out in (got, want):
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.slow
def test_plan_gemm_refuses_what_it_cannot_take():
  x, w = _int8_qarrays(256, 384, 512)
  with pytest.raises(Unsupported, match="lhs is not a QArray"):
    _plan_gemm(x.dequantize(jnp.float32), w, DN, jnp.float32)
  fp8 = qa.quantize(jnp.ones((256, 384)), qa.QuantizeSpec(qtype="float8_e4m3fn",
                                                          channelwise_axes=(0,)))
  with pytest.raises(Unsupported, match="float8_e4m3fn x int8 .wgmma reads one element type"):
    _plan_gemm(fp8, w, DN, jnp.float32)
  e5m2 = qa.quantize(jnp.ones((384, 512)), qa.QuantizeSpec(qtype="float8_e5m2",
                                                           channelwise_axes=(1,)))
  with pytest.raises(Unsupported, match="float8_e4m3fn x float8_e5m2"):
    _plan_gemm(fp8, e5m2, DN, jnp.float32)
  mx = qa.quantize(jnp.ones((256, 384)), qa.QuantizeSpec(qtype="mxfp8", channelwise_axes=(0,),
                                                         tiled_axes={1: 32}))
  with pytest.raises(Unsupported, match="lhs qtype mxfp8 has no GPU kernel"):
    _plan_gemm(mx, w, DN, jnp.float32)
  grouped = qa.quantize(jax.random.normal(jax.random.key(2), (384, 512)),
                        qa.QuantizeSpec(qtype="int8", channelwise_axes=(1,), tiled_axes={0: 128}))
  with pytest.raises(Unsupported, match="rhs scale varies along a contracting axis"):
    _plan_gemm(x, grouped, DN, jnp.float32)
  with pytest.raises(Unsupported, match="output dtype int32"):
    _plan_gemm(x, w, DN, jnp.int32)
  with pytest.raises(Unsupported, match=r"M=256 \(below 257 rows\)"):
    _plan_gemm(x, w, DN, jnp.float32, min_m=257)


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks dispatch off a GPU (GPU dispatch: the tests below)")
def test_dispatch_off_hopper():
  x, w = _int8_qarrays(256, 384, 512)
  assert not _common.on_hopper()
  assert dispatch.BACKENDS["mosaic"].auto_plan(DotCall(x, w, DN, jnp.dtype(jnp.float32))) is None  # "auto" stays on XLA
  with pytest.raises(ValueError, match="Mosaic GEMM runs on a GPU"):
    dispatch.quantized_dot_general(x, w, DN, preferred_element_type=jnp.float32,
                                   implementation="mosaic")


def test_varying_like_types_a_kernel_output_as_its_operands():
  """The Mosaic kernels' outputs (``plgpu.kernel`` drops their type inside ``jax.shard_map``)
  are cast to vary over their operands' mesh axes: without the cast a replicated-typed output
  beside XLA's varying one fails ``lax.platform_dependent``, as "auto" pairs them."""
  from jax.sharding import Mesh, PartitionSpec as P
  from qtrain.core import _lax
  a = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (16, 4), jnp.float32)
  seen = {}

  def f(a, b):
    replicated = jnp.zeros((8, 4), jnp.float32) + b.sum()  # typed like an untyped kernel output
    typed = _common.varying_like(replicated, a, b)
    seen.update(before=_lax.varying_axes(replicated), after=_lax.varying_axes(typed),
                alone=_lax.varying_axes(_common.varying_like(replicated, b)))
    with pytest.raises(TypeError, match="branches must have equal output types"):
      jax.lax.platform_dependent(cuda=lambda: replicated, default=lambda: a @ b)
    return jax.lax.platform_dependent(cuda=lambda: typed, default=lambda: a @ b)

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))(a, b)
  assert seen == dict(before=frozenset(), after=frozenset({"data"}), alone=frozenset())
  np.testing.assert_allclose(np.asarray(out), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)


def _w8a8_qt_case(m, k, n, *, seed, w_std, sr, implementation):
  """bf16 x (m, k), w (k, n) (standard deviation ``w_std``) and cotangent (m, n), and a
  w8a8 QT config with int8 gradients (``sr`` stochastic rounding) on ``implementation``."""
  ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
  w = jax.random.normal(ks[1], (k, n), jnp.bfloat16) * w_std
  ct = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
  gq = C.GradQuant(qtype="int8", stochastic_rounding=sr)
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"),
                             dlhs_grad=gq, drhs_grad=gq, implementation=implementation)
  return x, w, ct, cfg


@pytest.mark.slow
@pytest.mark.parametrize("given_scale", [False, True])
def test_backward_products_in_the_operand_dtype_give_the_same_gradients(monkeypatch, given_scale):
  # The QT backward writes each product in its operand's dtype (bf16 here)
  # where only a mask and a cast follow; forcing float32 products must give
  # the same gradients, bit for bit.
  x, w, ct, cfg = _w8a8_qt_case(64, 128, 96, seed=3, w_std=0.1, sr="uniform",
                                implementation="xla")
  scales = (jnp.full((64, 1), 0.02), None) if given_scale else (None, None)

  def grads():
    f = lambda x, w: jnp.sum(dot_general_qt(x, w, DN, cfg, key=jax.random.key(7),
                                            lhs_scale=scales[0]).astype(jnp.float32) * ct)
    return jax.grad(f, (0, 1))(x, w)

  seen = []
  real = dqt.backward_product

  def spy(*args, out_dtype=jnp.float32, **kw):
    seen.append(jnp.dtype(out_dtype))
    return real(*args, out_dtype=out_dtype, **kw)

  monkeypatch.setattr(dqt, "backward_product", spy)
  jax.clear_caches()  # the ops trace once per signature: a cached trace would skip the spy
  shipped = grads()
  assert seen == ([jnp.dtype(jnp.float32)] if given_scale else [jnp.dtype(jnp.bfloat16)]) + [
      jnp.dtype(jnp.bfloat16)]
  monkeypatch.setattr(dqt, "backward_product",
                      lambda *a, out_dtype=None, **kw: real(*a, out_dtype=jnp.float32, **kw))
  jax.clear_caches()
  forced = grads()
  for s, f in zip(shipped, forced):
    assert s.dtype == f.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(f, np.float32))


# ----------------------------------------------------------------------------
# On the GPU.

_needs_hopper = pytest.mark.skipif(not _common.on_hopper() or jax.__version_info__ < (0, 11),
                                   reason="needs a Hopper GPU and jax >= 0.11 (Pallas Mosaic GPU)")

GPU_CONFIGS = {
    "default": None,
    "wg_m": mg.GemmConfig(wg_axis="m", grid_minor="m", snake=2, steps=3),
    "wide": mg.GemmConfig(tile_m=64, tile_n=256, wg_axis="m", steps=3),
    "narrow": mg.GemmConfig(tile_m=64, tile_n=64, tile_k=64, steps=2),
    "deep_k": mg.GemmConfig(tile_m=64, tile_k=256, steps=2),
}


@pytest.mark.gpu
@_needs_hopper
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("cfg", list(GPU_CONFIGS))
def test_mosaic_gemm_gpu_is_exact(cfg, out_dtype):
  ks = jax.random.split(jax.random.key(zlib.crc32(cfg.encode())), 4)
  m, k, n = 512, 768, 1024  # several tiles along each axis, more tiles than one walk band
  a, b = _codes(ks[0], (m, k)), _codes(ks[1], (n, k))
  sa, sb = _scales(ks[2], m), _scales(ks[3], n)
  config = GPU_CONFIGS[cfg]
  assert mg.smem_bytes(config or mg.default_config(m, n, k, out_dtype), out_dtype) <= mg.SMEM_BYTES
  out = jax.jit(lambda a, b: mg.mosaic_gemm(a, b, a_scale=sa, b_scale=sb, out_dtype=out_dtype,
                                            config=config))(a, b)
  ref = mg.mosaic_gemm_reference(a, b, a_scale=sa, b_scale=sb, out_dtype=out_dtype)
  assert out.dtype == out_dtype and out.shape == (m, n)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def _fp8_codes(key, shape, dtype):
  # codes across the format's range (|x| up to its max; a few subnormal ones among them)
  finfo = jnp.finfo(dtype)
  x = jax.random.normal(key, shape, jnp.float32) * float(finfo.max) / 4
  return jnp.clip(x, -float(finfo.max), float(finfo.max)).astype(dtype)


def _rel_err(out, a, b, sa, sb) -> float:
  """Relative Frobenius error of ``out`` against the float64 product of the codes, scaled."""
  s = np.asarray(sa, np.float64)[:, None] * np.asarray(sb, np.float64)[None, :]
  exact = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * s
  return float(np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact))


def _fp8_acc_budget(k: int) -> float:
  """Relative Frobenius error of a K-long fp8 wgmma sum of random-sign terms.

  Hopper's fp8 tensor cores keep about 14 bits of each partial sum (DeepSeek-V3's
  measurement; docs/findings.md "The Mosaic GEMM on fp8"), not float32's 24: K roundings
  of about 2**-14 each, independent, grow like sqrt(K). A wrong tile, scale or order
  errs by O(1)."""
  return math.sqrt(k) * 2.0**-14


@pytest.mark.gpu
@_needs_hopper
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("cfg", ["default", "narrow", "deep_k"])
def test_mosaic_gemm_gpu_fp8_within_the_fp8_accumulator_budget(cfg, dtype):
  ks = jax.random.split(jax.random.key(zlib.crc32(cfg.encode())), 4)
  m, k, n = 512, 768, 1024
  a, b = _fp8_codes(ks[0], (m, k), dtype), _fp8_codes(ks[1], (n, k), dtype)
  sa, sb = _scales(ks[2], m), _scales(ks[3], n)
  gemm = lambda out_dtype: jax.jit(lambda a, b: mg.mosaic_gemm(
      a, b, a_scale=sa, b_scale=sb, out_dtype=out_dtype, config=GPU_CONFIGS[cfg]))(a, b)
  assert _rel_err(gemm(jnp.float32), a, b, sa, sb) <= _fp8_acc_budget(k)
  assert _rel_err(gemm(jnp.bfloat16), a, b, sa, sb) <= _fp8_acc_budget(k) + 2.0**-8


@pytest.mark.gpu
@_needs_hopper
def test_fp8_products_run_on_the_gemm_only_when_forced():
  # "auto" leaves fp8 x fp8 on XLA (the same numbers as "xla"); "mosaic" runs it, within the
  # fp8 accumulator's budget (XLA's GEMM keeps more bits: docs/findings.md)
  k = 384
  x, w = _int8_qarrays(mosaic_backend.AUTO_GEMM_MIN_M, k, 512, lhs_qtype="float8_e4m3fn",
                       rhs_qtype="float8_e4m3fn")
  run = lambda impl: jax.jit(lambda x, w: dispatch.quantized_dot_general(
      x, w, DN, preferred_element_type=jnp.float32, implementation=impl))
  assert "mosaic_gpu" not in run("auto").lower(x, w).as_text()
  assert "mosaic_gpu" in run("mosaic").lower(x, w).as_text()
  np.testing.assert_array_equal(np.asarray(run("auto")(x, w)), np.asarray(run("xla")(x, w)))
  args = (x.qvalue, w.qvalue.T, x.scale[:, 0], w.scale[0])
  assert _rel_err(run("mosaic")(x, w), *args) <= _fp8_acc_budget(k)


@pytest.mark.gpu
@_needs_hopper
def test_auto_runs_large_int8_products_on_the_gemm():
  x, w = _int8_qarrays(mosaic_backend.AUTO_GEMM_MIN_M, 384, 512)
  run = lambda impl: jax.jit(lambda x, w: dispatch.quantized_dot_general(
      x, w, DN, preferred_element_type=jnp.bfloat16, implementation=impl))
  assert "mosaic_gpu" in run("auto").lower(x, w).as_text()
  assert "mosaic_gpu" not in run("xla").lower(x, w).as_text()
  np.testing.assert_array_equal(np.asarray(run("auto")(x, w), np.float32),
                                np.asarray(run("xla")(x, w), np.float32))
  np.testing.assert_array_equal(np.asarray(run("mosaic")(x, w), np.float32),
                                np.asarray(run("xla")(x, w), np.float32))


@pytest.mark.gpu
@_needs_hopper
def test_qt_gradients_on_the_gemm_equal_cublas(monkeypatch):
  # An int8 QT op with int8 gradients: forward and both backward products on
  # the Mosaic GEMM ("auto") give the same output and gradients as on XLA's
  # cuBLAS int8 GEMM (the GEMM switched off), bit for bit.
  x, w, ct, cfg = _w8a8_qt_case(1024, 512, 768, seed=4, w_std=0.05, sr="low_bit_uniform",
                                implementation="auto")

  def run():
    f = lambda x, w: dot_general_qt(x, w, DN, cfg, key=jax.random.key(9))
    fn = jax.jit(lambda x, w: (f(x, w), jax.vjp(f, x, w)[1](ct)))
    return fn.lower(x, w).as_text(), fn(x, w)

  text, on_gemm = run()
  assert text.count("mosaic_gpu") >= 3  # the forward and both backward products
  monkeypatch.setattr(mosaic_backend, "AUTO_GEMM_MIN_M", 1 << 62)
  jax.clear_caches()  # the ops trace once per signature: retrace under the patch
  text, on_cublas = run()
  assert "mosaic_gpu" not in text
  for g, c in zip(jax.tree.leaves(on_gemm), jax.tree.leaves(on_cublas)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c, np.float32))
