"""quantized_dot_general: kernel (interpret mode) vs the XLA reference path."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from qtrain.core import qarray as qa
from qtrain.ops import dispatch
from qtrain.ops.backends import triton as triton_backend
from qtrain.ops.backends import DotCall
from qtrain.kernels import prepared
from _testutil import all_eqns as _all_eqns
from _testutil import rel_error as _rel

INT_EXACT = 1e-6  # group-wise scales: f32 sums of exact integer partial sums
FLOAT_BUDGET = 1e-2  # XLA dequantizes weights to bf16 before its dot; the kernel does not



def _quant(x, qtype, channel_axes, tiled=None, calibration="absmax"):
  if qtype == "binary":
    calibration = "absmean"
  return qa.quantize(x, qa.QuantizeSpec(qtype=qtype, channelwise_axes=channel_axes,
                                        tiled_axes=tiled or {}, calibration=calibration))


def _both(lhs, rhs, dn, out=jnp.float32):
  a = dispatch.quantized_dot_general(lhs, rhs, dn, preferred_element_type=out,
                                     implementation="interpret")
  b = dispatch.quantized_dot_general(lhs, rhs, dn, preferred_element_type=out,
                                     implementation="xla")
  assert a.shape == b.shape and a.dtype == b.dtype
  return a, b


X = jax.random.normal(jax.random.key(0), (2, 5, 128), jnp.float32)
W = jax.random.normal(jax.random.key(1), (128, 40), jnp.float32)
DENSE_DN = (((2,), (0,)), ((), ()))


@pytest.mark.slow
@pytest.mark.parametrize("wq,tiles,lq", [
    ("binary", None, "binary"),
    ("int8", None, "int8"),
    ("int4", {0: 32}, "int8"),
    ("ternary", {0: 64}, "int4"),
])
def test_integer_paths_match_xla(wq, tiles, lq):
  w = _quant(W, wq, (1,), tiles)
  x = _quant(X, lq, (0, 1))
  a, b = _both(x, w, DENSE_DN)
  if tiles:
    assert _rel(a, b) < INT_EXACT
  else:
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("wq,tiles", [("binary", None), ("int2", {0: 64}), ("int8", None)])
def test_float_activation_paths_match_xla(wq, tiles):
  w = _quant(W, wq, (1,), tiles)
  a, b = _both(X.astype(jnp.bfloat16), w, DENSE_DN, out=jnp.bfloat16)
  assert _rel(a, b) < FLOAT_BUDGET


@pytest.mark.slow
def test_zero_points_and_transposed_weights():
  # weights stored (N, K) (contracting dim 1), asymmetric group-wise.
  w = _quant(W.T, "int4", (0,), {1: 32}, calibration="minmax")
  assert w.zero_point is not None
  x = _quant(X[0], "int8", (0,))
  a, b = _both(x, w, (((1,), (1,)), ((), ())))
  assert _rel(a, b) < INT_EXACT


@pytest.mark.slow
def test_multiple_contracting_dims():
  x = jax.random.normal(jax.random.key(2), (6, 4, 32), jnp.float32)
  w = jax.random.normal(jax.random.key(3), (4, 32, 24), jnp.float32)
  a, b = _both(_quant(x, "int8", (0,)), _quant(w, "int8", (2,)), (((1, 2), (0, 1)), ((), ())))
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_auto_on_cpu_is_xla():
  w, x = _quant(W, "int4", (1,), {0: 32}), _quant(X, "int8", (0, 1))
  a = dispatch.quantized_dot_general(x, w, DENSE_DN, preferred_element_type=jnp.float32)
  b = dispatch.quantized_dot_general(x, w, DENSE_DN, preferred_element_type=jnp.float32,
                                     implementation="xla")
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_jit_and_prepared_weight():
  w = _quant(W.T, "binary", (0,))  # (N, K)
  pw = prepared.prepare_weight(w.qvalue, "binary", scale=w.scale[:, 0])
  x = _quant(X, "int8", (0, 1))
  f = jax.jit(lambda x, pw: dispatch.quantized_dot_general(
      x, pw, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32,
      implementation="interpret"))
  ref = dispatch.quantized_dot_general(x, w, (((2,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32, implementation="xla")
  np.testing.assert_array_equal(f(x, pw), ref)


@pytest.mark.slow
def test_unsupported_configs_raise():
  w8 = _quant(W, "int8", (1,))
  with pytest.raises(ValueError, match=r"implementation=.*; valid: \[.auto., .xla., .triton., .mosaic., .interpret.\]"):
    dispatch.quantized_dot_general(X, w8, DENSE_DN, preferred_element_type=jnp.float32,
                                   implementation="cuda")
  with pytest.raises(ValueError, match="batch dimensions"):
    xb = jax.random.normal(jax.random.key(4), (3, 5, 128))
    wb = _quant(jax.random.normal(jax.random.key(5), (3, 128, 8)), "int8", (0, 2))
    dispatch.quantized_dot_general(xb, wb, (((2,), (1,)), ((0,), (0,))),
                                   preferred_element_type=jnp.float32, implementation="interpret")
  with pytest.raises(ValueError, match="fp8|float8"):
    wf = _quant(W, "float8_e4m3fn", (1,))
    dispatch.quantized_dot_general(X, wf, DENSE_DN, preferred_element_type=jnp.float32,
                                   implementation="interpret")
  with pytest.raises(ValueError, match="asymmetric"):
    xa = _quant(X, "int8", (0, 1), calibration="minmax")
    dispatch.quantized_dot_general(xa, w8, DENSE_DN, preferred_element_type=jnp.float32,
                                   implementation="interpret")
  with pytest.raises(ValueError, match="GPU"):
    if jax.default_backend() != "gpu":
      dispatch.quantized_dot_general(X, w8, DENSE_DN, preferred_element_type=jnp.float32,
                                     implementation="triton")
    else:
      raise ValueError("GPU present")
  # Unsupported under "auto" falls back to XLA silently (same numbers).
  wf = _quant(W, "float8_e4m3fn", (1,))
  dispatch.quantized_dot_general(X, wf, DENSE_DN, preferred_element_type=jnp.float32)


_SHARD_MAP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from qtrain.core import qarray as qa
    from qtrain.ops import dispatch
    assert len(jax.devices()) == 4, jax.devices()
    x = jax.random.normal(jax.random.key(0), (8, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)
    xq = qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
    wq = qa.quantize(w, qa.QuantizeSpec(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 32}))
    dn = (((1,), (0,)), ((), ()))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    def local(xq, wq):
      return dispatch.quantized_dot_general(xq, wq, dn, preferred_element_type=jnp.float32,
                                            implementation="interpret")
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
      from jax.experimental.shard_map import shard_map
    spec_x = qa.QArray(qvalue=P("data", None), scale=P("data", None), zero_point=None, qtype=xq.qtype)
    spec_w = qa.QArray(qvalue=P(None, "model"), scale=P(None, "model"), zero_point=None, qtype=wq.qtype)
    # check_vma=False: pallas_call's out_shape carries no varying-mesh-axes
    # annotation (its keyword differs between jax 0.10 and 0.11).
    f = jax.jit(shard_map(local, mesh=mesh, in_specs=(spec_x, spec_w), out_specs=P("data", "model"),
                          check_vma=False))
    out = f(xq, wq)
    ref = dispatch.quantized_dot_general(xq, wq, dn, preferred_element_type=jnp.float32,
                                         implementation="xla")
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < 1e-6, err
    print("SHARD_MAP_OK", out.sharding.spec, err)
""")


@pytest.mark.slow
def test_dispatch_inside_shard_map_on_4_fake_devices():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  r = subprocess.run([sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0 and "SHARD_MAP_OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_auto_table_decisions():
  """'auto' picks the int8 kernel only for (N, K)-stored int8 weights at M <= 16."""
  w_nk = _quant(jax.random.normal(jax.random.key(6), (128, 256)), "int8", (0,))  # (N, K)
  x_small = _quant(jax.random.normal(jax.random.key(7), (8, 256)), "int8", (0,))
  x_big = _quant(jax.random.normal(jax.random.key(8), (100, 256)), "int8", (0,))
  nk = (((1,), (1,)), ((), ()))
  T = dispatch.BACKENDS["triton"]
  plan = lambda x, w, dn: T.plan(DotCall(x, w, dn, jnp.dtype(jnp.float32)))
  assert plan(x_small, w_nk, nk).weights_form == "qarray-nk"
  assert triton_backend.auto_prefers(plan(x_small, w_nk, nk))
  assert not triton_backend.auto_prefers(plan(x_big, w_nk, nk))
  # auto_plan is the same decision, as the policy sees it.
  assert T.auto_plan(DotCall(x_small, w_nk, nk, jnp.dtype(jnp.float32))) is not None
  assert T.auto_plan(DotCall(x_big, w_nk, nk, jnp.dtype(jnp.float32))) is None
  w_kn = _quant(jax.random.normal(jax.random.key(9), (256, 128)), "int8", (1,))  # (K, N)
  p = plan(x_small, w_kn, (((1,), (0,)), ((), ())))
  assert p.weights_form == "qarray" and not triton_backend.auto_prefers(p)
  w4 = _quant(jax.random.normal(jax.random.key(9), (128, 256)), "int4", (0,), {1: 64})
  assert not triton_backend.auto_prefers(plan(x_small, w4, nk))


def _qarray(codes, scale_shape, qtype="int8"):
  from qtrain.core import qtypes
  return qa.QArray(qvalue=jnp.asarray(codes, jnp.int8), scale=jnp.full(scale_shape, 0.5, jnp.float32),
                   zero_point=None, qtype=qtypes.get_qtype(qtype))


# (dimension_numbers, lhs shape, rhs shape): M = 0, K = 0, N = 0, batch = 0.
_EMPTY = {
    "M=0": ((((1,), (0,)), ((), ())), (0, 128), (128, 40)),
    "K=0": ((((1,), (0,)), ((), ())), (8, 0), (0, 40)),
    "N=0": ((((1,), (0,)), ((), ())), (8, 128), (128, 0)),
    "batch=0": ((((2,), (1,)), ((0,), (0,))), (0, 8, 128), (0, 128, 40)),
}


@pytest.mark.parametrize("impl", dispatch.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(_EMPTY))
@pytest.mark.parametrize("lhs_kind", ["float", "int8"])
def test_empty_operands_give_zeros_for_every_implementation(impl, case, lhs_kind):
  """An empty product is zeros of lax.dot_general's output shape under every
  implementation, forced kernels included (nothing to compute, so no kernel is
  planned: none is traced), in the requested dtype."""
  dn, ls, rs = _EMPTY[case]
  rhs = _qarray(np.ones(rs), rs[:-2] + (1, rs[-1]))
  lhs = (jnp.ones(ls, jnp.bfloat16) if lhs_kind == "float"
         else _qarray(np.ones(ls), ls[:-1] + (1,)))
  f = lambda l, r: dispatch.quantized_dot_general(l, r, dn, preferred_element_type=jnp.bfloat16,
                                                  implementation=impl)
  want = jax.lax.dot_general(jnp.ones(ls), jnp.ones(rs), dn)
  out = jax.jit(f)(lhs, rhs)
  assert (out.shape, out.dtype) == (want.shape, jnp.bfloat16)
  assert not np.any(np.asarray(out, np.float32))
  prims = {e.primitive.name for e in _all_eqns(jax.make_jaxpr(f)(lhs, rhs).jaxpr)}
  assert "pallas_call" not in prims and "dot_general" not in prims, prims


@pytest.mark.slow
def test_empty_lhs_with_a_prepared_weight_gives_zeros():
  w = _quant(W.T, "int8", (0,))  # (N, K)
  pw = prepared.prepare_weight(w.qvalue, "int8", scale=w.scale[:, 0])
  for impl in ("auto", "interpret"):
    out = dispatch.quantized_dot_general(jnp.ones((0, 3, 128), jnp.float32), pw, (((2,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32, implementation=impl)
    assert out.shape == (0, 3, 40) and out.dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_compute_dtype_casts_the_float_operand(impl):
  """compute_dtype brings a float operand to it before a kernel or XLA sees it:
  float16 activations x weights quantized from float32 values ~1e-9
  (compute_dtype=float32) give exactly what float32 activations give, none of
  it flushed to 0 (float16 has no 1e-9); bf16 with compute_dtype=bf16 is the
  bf16 call itself (the W8A16 path unchanged)."""
  x = jax.random.normal(jax.random.key(11), (8, 128), jnp.float32).astype(jnp.float16)
  w = _quant(jax.random.normal(jax.random.key(12), (128, 40)) * 1e-9, "int8", (1,))
  dn = (((1,), (0,)), ((), ()))
  call = lambda l, **kw: dispatch.quantized_dot_general(l, w, dn, preferred_element_type=jnp.float32,
                                                        implementation=impl, **kw)
  np.testing.assert_array_equal(call(x, compute_dtype=jnp.float32), call(x.astype(jnp.float32)))
  assert np.all(np.asarray(call(x, compute_dtype=jnp.float32)) != 0)
  xb = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(call(xb, compute_dtype=jnp.bfloat16), call(xb))


def test_registry_names_every_implementation_once():
  assert set(dispatch.BACKENDS) == set(dispatch.IMPLEMENTATIONS) - {"auto"}
  assert all(b.name == n for n, b in dispatch.BACKENDS.items())
  assert set(dispatch.AUTO_ORDER) <= set(dispatch.BACKENDS) - {"xla"}
  with pytest.raises(ValueError, match=r"implementation='cuda'; valid: \["):
    dispatch.supports(X, W, DENSE_DN, implementation="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "interpret", "mosaic"])
def test_forced_backend_raises_the_reason_supports_gives(impl):
  wf = _quant(W, "float8_e4m3fn", (1,))  # no kernel takes fp8 weights
  why = dispatch.supports(X, wf, DENSE_DN, implementation=impl)
  assert why is not None and "float8_e4m3fn" in why, why
  with pytest.raises(ValueError, match=re.escape(why)):
    dispatch.quantized_dot_general(X, wf, DENSE_DN, preferred_element_type=jnp.float32,
                                   implementation=impl)
  assert dispatch.supports(X, wf, DENSE_DN, implementation="xla") is None
  w8 = _quant(W, "int8", (1,))
  assert dispatch.supports(_quant(X, "int8", (0, 1)), w8, DENSE_DN, implementation="interpret") is None


@pytest.mark.slow
def test_auto_policy_guards_a_chosen_kernel_by_platform():
  """Where a backend's auto_plan takes the call, "auto" emits the kernel for a
  CUDA lowering and XLA for every other platform (one platform_index switch);
  elsewhere it is XLA alone. On this CPU both give the XLA numbers."""
  nk = (((1,), (1,)), ((), ()))
  w_nk = _quant(jax.random.normal(jax.random.key(6), (128, 256)), "int8", (0,))
  x_small = _quant(jax.random.normal(jax.random.key(7), (8, 256)), "int8", (0,))
  x_big = _quant(jax.random.normal(jax.random.key(8), (100, 256)), "int8", (0,))
  for x, kernel in ((x_small, True), (x_big, False)):
    f = lambda x, w: dispatch.quantized_dot_general(x, w, nk, preferred_element_type=jnp.float32)
    prims = {e.primitive.name for e in _all_eqns(jax.make_jaxpr(f)(x, w_nk).jaxpr)}
    assert ("platform_index" in prims) == kernel, prims
    ref = dispatch.quantized_dot_general(x, w_nk, nk, preferred_element_type=jnp.float32,
                                         implementation="xla")
    np.testing.assert_array_equal(jax.jit(f)(x, w_nk), ref)


def test_scale_tiled_along_a_free_axis_is_refused_not_crashed():
  """A backward product sees the residual's tiles (over the forward's
  contraction) along a free axis: 2 scales for 4 columns. Kernels take one
  scale or one per column there, so every kernel backend refuses with that
  reason and "auto" runs XLA (it used to crash planning a reshape)."""
  codes = _qarray(np.arange(-8, 8).reshape(4, 4) % 7, (1, 1))  # rhs (K=4, N=4)
  # 2 tiles of 2 columns each along N.
  w_cols = qa.QArray(qvalue=codes.qvalue, scale=jnp.asarray([[0.5, 0.25]], jnp.float32),
                     zero_point=None, qtype=codes.qtype)
  g = jax.random.normal(jax.random.key(3), (3, 4))
  dn = (((1,), (0,)), ((), ()))
  for impl in ("triton", "interpret", "mosaic"):
    why = dispatch.supports(g, w_cols, dn, implementation=impl)
    assert why is not None and "2 entries along a free axis of size 4" in why, (impl, why)
  out = dispatch.quantized_dot_general(g, w_cols, dn, preferred_element_type=jnp.float32)
  deq = np.asarray(w_cols.qvalue, np.float64) * np.repeat(np.asarray(w_cols.scale, np.float64), 2, axis=1)
  np.testing.assert_allclose(out, np.asarray(g, np.float64) @ deq, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_auto_at_training_size_traces_xla_alone(qtype):
  """Where no backend is preferred (M = 256, beyond every AUTO_KERNEL bucket that
  prefers a kernel), "auto" traces exactly XLA's program: no kernel plan whose
  ops every lowering would drop (they cost trace and compile time per op)."""
  from qtrain.ops.backends.xla import XlaBackend
  x = _quant(jax.random.normal(jax.random.key(1), (256, 128)), "int8", (0,))
  w = _quant(jax.random.normal(jax.random.key(2), (128, 512)), qtype, (1,))
  dn = (((1,), (0,)), ((), ()))
  auto = lambda x, w: dispatch.quantized_dot_general(x, w, dn, preferred_element_type=jnp.float32)
  xla = XlaBackend(gemm_layout=True)
  ref = lambda x, w: xla.run(xla.plan(DotCall(x, w, dn, jnp.dtype(jnp.float32))))
  assert str(jax.make_jaxpr(auto)(x, w)) == str(jax.make_jaxpr(ref)(x, w))


@pytest.mark.slow
@pytest.mark.parametrize("wq, lq, tiles", [("int3", "int8", None), ("int5", "int8", {0: 32}),
                                           ("int7", None, None), ("int6", "int6", None)])
def test_int3_to_int7_weights_run_their_container_kernels(wq, lq, tiles):
  """A forced kernel backend takes int3 weights as int4 and int5..int7 as int8 (it would raise
  Unsupported otherwise); integer products match the XLA path to float32 rounding."""
  w = _quant(W, wq, (1,), tiles)
  x = _quant(X, lq, (0, 1)) if lq else X.astype(jnp.bfloat16)
  a, b = _both(x, w, DENSE_DN)
  assert _rel(a, b) < (INT_EXACT if lq else FLOAT_BUDGET)
  assert _rel(b, jnp.einsum("blk,kn->bln", X, W)) < 0.5  # and it is the product asked for
