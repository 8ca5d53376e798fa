"""qtrain.kernels.transpose (interpret mode) and its use as the XLA path's layout pin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray, qdot
from qtrain.kernels import transpose as tp
from _testutil import all_eqns as _all_eqns


def _int8(shape, seed):
  return jax.random.randint(jax.random.key(seed), shape, -128, 128, jnp.int32).astype(jnp.int8)


@pytest.mark.slow
@pytest.mark.parametrize("shape,perm", [
    ((128, 64), (1, 0)),
    ((2, 64, 192), (0, 2, 1)),
    ((64, 2, 64), (1, 2, 0)),  # (A, B...) -> (B..., A): B groups two axes
    ((2, 3, 64, 128), (0, 1, 3, 2)),
    ((3, 64, 128), (1, 2, 0)),
])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.bfloat16])
def test_transpose_kernel_matches_jnp(shape, perm, dtype):
  x = _int8(shape, sum(shape)).astype(dtype)
  y = tp.transpose(x, perm, interpret=True)
  assert y.dtype == x.dtype and y.shape == tuple(shape[a] for a in perm)
  np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                np.transpose(np.asarray(x.astype(jnp.float32)), perm))


@pytest.mark.slow
def test_transpose_uses_the_kernel_exactly_where_it_applies():
  def has_pallas(x, perm):
    jaxpr = jax.make_jaxpr(functools.partial(tp.transpose, perm=perm, interpret=True))(x)
    return any(e.primitive.name == "pallas_call" for e in jaxpr.jaxpr.eqns)
  assert has_pallas(_int8((128, 64), 0), (1, 0))
  assert not has_pallas(_int8((128, 64), 0), (0, 1))  # identity: nothing to do
  assert not has_pallas(_int8((100, 64), 0), (1, 0))  # 100 is not a multiple of the block
  assert has_pallas(_int8((64, 64, 64), 0), (2, 0, 1))  # a group swap: kernel
  assert not has_pallas(_int8((64, 64, 64), 0), (1, 0, 2))  # not a group swap: jnp
  y = tp.transpose(_int8((100, 64), 1), (1, 0), interpret=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(_int8((100, 64), 1)).T)


def test_split_perm():
  assert tp.split_perm((1, 0)) == (0, 1)
  assert tp.split_perm((0, 2, 3, 1)) == (1, 1)
  assert tp.split_perm((2, 3, 0, 1)) == (0, 2)
  assert tp.split_perm((0, 1, 2)) is None
  assert tp.split_perm((1, 0, 2)) is None


@pytest.mark.slow
def test_transpose_rejects_a_bad_perm():
  with pytest.raises(ValueError, match=r"perm=\(0, 0\) is not a permutation"):
    tp.transpose(_int8((64, 64), 0), (0, 0))
  with pytest.raises(ValueError, match="multiples of block=64"):
    tp.transpose_batched(_int8((1, 64, 100), 0))


@pytest.mark.slow
@pytest.mark.parametrize("dn,ls,rs", [
    ((((0,), (0,)), ((), ())), (128, 64), (128, 192)),  # drhs-like: K major on both sides
    ((((1,), (0,)), ((), ())), (64, 128), (128, 192)),  # forward x @ w: w K-major
    ((((1,), (2,)), ((0,), (0,))), (2, 64, 64), (2, 128, 64)),
])
def test_xla_path_with_pinned_transposes_is_bit_identical(dn, ls, rs):
  x = jax.random.normal(jax.random.key(1), ls)
  w = jax.random.normal(jax.random.key(2), rs)
  (lc, rc), (lb, rb) = dn
  xq = qarray.quantize(x, qarray.QuantizeSpec(
      qtype="int8", channelwise_axes=tuple(a for a in range(x.ndim) if a not in lc)))
  wq = qarray.quantize(w, qarray.QuantizeSpec(
      qtype="int8", channelwise_axes=tuple(a for a in range(w.ndim) if a not in rc)))
  pinned = functools.partial(tp.transpose, interpret=True)
  f = lambda t: qdot.dot_general_quantized_xla(xq, wq, dn, preferred_element_type=jnp.float32,
                                               transpose=t)
  a, b = f(pinned), f(None)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ref = jax.lax.dot_general(np.asarray(qarray.dequantize(xq), np.float64),
                            np.asarray(qarray.dequantize(wq), np.float64), dn)
  np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-5, atol=1e-5)
  eqns = jax.make_jaxpr(lambda: f(pinned))().jaxpr.eqns
  assert not any(e.primitive.name == "transpose" and e.invars[0].aval.dtype == jnp.int8 for e in eqns)



def test_gemm_transpose_has_a_cuda_kernel_branch_and_runs_on_cpu():
  x = _int8((128, 192), 5)
  jaxpr = jax.make_jaxpr(lambda x: tp.gemm_transpose(x, (1, 0)))(x)
  names = {e.primitive.name for e in _all_eqns(jaxpr.jaxpr)}
  assert "pallas_call" in names and "transpose" in names, names  # CUDA branch, other platforms
  y = jax.jit(lambda x: tp.gemm_transpose(x, (1, 0)))(x)  # lowered for the CPU: jnp.transpose
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x).T)
