"""qtrain.core.qdot.scale_product: the epilogue of every quantized product.

``(acc * ls) * rs`` overflows when one scale is huge and the other small
although the product is moderate (int8 data near 1e37 times data near 1e-30).
Where ``(acc * ls) * rs`` is finite the result must be those bits exactly (the
GPU kernels are tested bit-exact against it); elsewhere it must be the float64
product up to two float32 roundings, inf only where that is beyond float32,
NaN only from NaN scales.
"""

import math
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray, qdot

F32_MAX = float(np.finfo(np.float32).max)
TWO_ROUNDINGS = 2.0 ** -22


def _scales(rng, n, lo, hi):
  return (10.0 ** rng.uniform(lo, hi, n)).astype(np.float32)


def _case(seed, m=24, n=20, k=300):
  """int32 accumulators and per-row / per-column scales: half the rows huge,
  half the columns tiny, so (acc * ls) overflows where the product does not."""
  rng = np.random.default_rng(seed)
  acc = rng.integers(-127 * 127 * k, 127 * 127 * k, (m, n)).astype(np.int32)
  acc[rng.random((m, n)) < 0.1] = 0
  acc[0, :3] = [1, -1, 0]
  ls = np.concatenate([_scales(rng, m // 2, 33, 36.4), _scales(rng, m - m // 2, -37.9, 3)])
  rs = np.concatenate([_scales(rng, n // 2, -37.9, -28), _scales(rng, n - n // 2, -3, 3)])
  return acc, ls[:, None], rs[None, :]


@jax.jit
def _naive(acc, ls, rs):
  """``(acc * ls) * rs`` as XLA computes it (subnormal results flushed to 0)."""
  return (acc.astype(jnp.float32) * ls) * rs


def _exact(acc, ls, rs):
  return acc.astype(np.float64) * ls.astype(np.float64) * rs.astype(np.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_identical_where_finite_and_right_where_it_overflowed(seed):
  acc, ls, rs = _case(seed)
  out = np.asarray(qdot.scale_product(jnp.asarray(acc), jnp.asarray(ls), jnp.asarray(rs),
                                      grouped=False, out_dtype=jnp.float32))
  naive, exact = np.asarray(_naive(acc, ls, rs)), _exact(acc, ls, rs)
  fin = np.isfinite(naive)
  assert (~fin).sum() > 20 and fin.sum() > 20
  np.testing.assert_array_equal(out[fin].view(np.uint32), naive[fin].view(np.uint32))
  over = np.abs(exact) > F32_MAX
  rescued = ~fin & ~over
  assert rescued.sum() > 20
  np.testing.assert_allclose(out[rescued], exact[rescued], rtol=TWO_ROUNDINGS)
  assert np.all(np.isinf(out[over]))


def test_zero_accumulator_nan_scale_and_true_overflow():
  acc = jnp.array([[0, 0, 5, 7]], jnp.int32)
  ls = jnp.array([[3e38]], jnp.float32)
  rs = jnp.array([[3e38, 1e-38, 1e-37, 3e38]], jnp.float32)
  out = np.asarray(qdot.scale_product(acc, ls, rs, grouped=False, out_dtype=jnp.float32))
  # 0 stays 0; 5 * 3e38 * 1e-37 = 150 (acc * ls alone overflows); 7 * 9e76 is inf.
  np.testing.assert_array_equal(out[0, :2], 0.0)
  np.testing.assert_allclose(out[0, 2], 150.0, rtol=TWO_ROUNDINGS)
  assert np.isposinf(out[0, 3])
  out = np.asarray(qdot.scale_product(acc, ls.at[0, 0].set(jnp.nan), rs, grouped=False,
                                      out_dtype=jnp.float32))
  assert np.all(np.isnan(out))


def test_grouped_sums_the_rescued_groups():
  acc, ls, rs = _case(3, m=8, n=6)
  g = 3
  accs = np.stack([acc, -acc // 3, acc // 7])
  lss = np.stack([ls, ls * 0.5, ls * 0.25]).astype(np.float32)
  rss = np.stack([rs] * g)
  out = np.asarray(qdot.scale_product(jnp.asarray(accs), jnp.asarray(lss), jnp.asarray(rss),
                                      grouped=True, out_dtype=jnp.float32))
  exact = _exact(accs, lss, rss).sum(0)
  terms = np.asarray(_naive(accs, lss, rss))
  fin = np.isfinite(terms).all(0)
  assert fin.any() and (~fin).any()
  # Where every group's term is finite: those terms, summed in float32 (in
  # some order: 2 roundings of at most 2^-24 of the running sums; sums below
  # float32's smallest normal are flushed to 0).
  with np.errstate(invalid="ignore"):  # inf - inf where a term overflowed (not checked)
    sum_err = np.abs(out - terms.astype(np.float64).sum(0))
  tiny = float(np.finfo(np.float32).tiny)
  assert np.all((sum_err <= 2.0 ** -23 * np.abs(terms.astype(np.float64)).sum(0) + tiny)[fin])
  ok = np.abs(exact) <= F32_MAX / 2
  # Three terms of two roundings each, summed in float32.
  tol = 4 * TWO_ROUNDINGS * np.abs(_exact(accs, lss, rss)).sum(0) + 4 * tiny
  assert np.all(np.abs(out - exact)[ok] <= tol[ok])


@pytest.mark.slow
def test_quantized_dot_of_huge_times_tiny_is_finite_and_right():
  # int8 x int8 with scales ~1e35 and ~1e-32: acc * ls passes float32's max,
  # the product (~1e7) does not.
  rng = np.random.default_rng(4)
  x = (rng.standard_normal((6, 64)) * 1e37).astype(np.float32)
  w = (rng.standard_normal((64, 5)) * 1e-30).astype(np.float32)
  xq = qarray.quantize(jnp.asarray(x), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  wq = qarray.quantize(jnp.asarray(w), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  out = np.asarray(qdot.dot_general_quantized_xla(
      xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32))
  ref = np.asarray(xq.dequantize(), np.float64) @ np.asarray(wq.dequantize(), np.float64)
  assert np.all(np.isfinite(out))
  # The int32 accumulation is exact; two float32 roundings remain.
  np.testing.assert_allclose(out, ref, rtol=4 * TWO_ROUNDINGS, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_under_jit_same_bits(out_dtype):
  acc, ls, rs = _case(5)
  f = jax.jit(lambda a, l, r: qdot.scale_product(a, l, r, grouped=False, out_dtype=out_dtype))
  eager = qdot.scale_product(jnp.asarray(acc), jnp.asarray(ls), jnp.asarray(rs), grouped=False,
                             out_dtype=out_dtype)
  np.testing.assert_array_equal(np.asarray(f(acc, ls, rs), np.float32),
                                np.asarray(eager, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("int_side", ["lhs", "rhs"])
def test_integer_times_fp8_applies_scales_after_the_codes_product(int_side):
  """int8 x fp8 has no low-precision GEMM; its codes multiply in float32 and the scales
  apply after (as for a pair of one kind). Dequantizing first would overflow here: the int8
  side's scale is 2**122 (the backward's gradient fold leaves such powers of two), so
  127 * 2**122 is beyond float32 while every product with the 1e-30 fp8 side is ~1e8."""
  import dataclasses
  rng = np.random.default_rng(11)
  a = rng.standard_normal((5, 48)).astype(np.float32)
  b = (rng.standard_normal((48, 7)) * 1e-30).astype(np.float32)
  iq = qarray.quantize(jnp.asarray(a), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  iq = dataclasses.replace(iq, scale=jnp.full(iq.scale.shape, 2.0 ** 122, jnp.float32))
  fq = qarray.quantize(jnp.asarray(b), qarray.QuantizeSpec(qtype="float8_e4m3fn",
                                                           channelwise_axes=(1,)))
  assert not np.all(np.isfinite(np.asarray(iq.dequantize())))  # the case is what it says
  codes = lambda q: np.asarray(q.qvalue, np.float64)
  ref = (codes(iq) * np.asarray(iq.scale, np.float64)) @ (codes(fq) * np.asarray(fq.scale, np.float64))
  if int_side == "lhs":
    out = qdot.dot_general_quantized_xla(iq, fq, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)
  else:
    out = qdot.dot_general_quantized_xla(fq, iq, (((0,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32).T
  out = np.asarray(out, np.float64)
  assert np.all(np.isfinite(out)) and np.abs(ref).max() > 1e6
  # Exact products, 48 float32 additions, two scale roundings.
  k = 48
  tol = (k * 2.0 ** -24 + 2 * TWO_ROUNDINGS) * (np.abs(codes(iq) * np.asarray(iq.scale, np.float64))
                                                @ np.abs(codes(fq) * np.asarray(fq.scale, np.float64)))
  assert np.all(np.abs(out - ref) <= tol), np.max(np.abs(out - ref) / tol)


@pytest.mark.parametrize("lshape,rshape,dn", [
    ((5, 9), (9, 3), (((1,), (0,)), ((), ()))),
    ((2, 6, 6, 6, 4), (2, 6, 6, 6, 7), (((0, 1, 2, 3), (0, 1, 2, 3)), ((), ()))),
    ((3, 7, 5), (3, 4, 7), (((1,), (2,)), ((0,), (0,)))),
    ((4, 64), (64, 3), (((1,), (0,)), ((), ()))),
])
def test_pad_contraction_keeps_the_product_and_makes_k_a_multiple(lshape, rshape, dn):
  (lc, rc), _ = dn
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.integers(-127, 128, lshape), jnp.int8)
  b = jnp.asarray(rng.integers(-127, 128, rshape), jnp.int8)
  pa, pb = qdot.pad_contraction(a, b, lc, rc)
  k = math.prod(pa.shape[i] for i in lc)
  assert k % qdot.K_MULTIPLE == 0 and k == math.prod(pb.shape[i] for i in rc)
  assert k - math.prod(lshape[i] for i in lc) < qdot.K_MULTIPLE * max(
      1, math.prod(lshape[i] for i in lc) // lshape[lc[-1]])
  want = jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.int32)
  got = jax.lax.dot_general(pa, pb, dn, preferred_element_type=jnp.int32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("lshape,rshape,dn", [
    ((3136, 9), (9, 10), (((1,), (0,)), ((), ()))),
    ((10, 3136), (3136, 9), (((1,), (0,)), ((), ()))),
    ((2, 7, 5, 3), (2, 9, 5), (((2,), (2,)), ((0,), (0,)))),
    ((32, 64), (64, 48), (((1,), (0,)), ((), ()))),
])
def test_pad_for_gemm_aligns_the_shapes_and_unpads_to_the_same_product(lshape, rshape, dn):
  (lc, rc), (lb, rb) = dn
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.integers(-127, 128, lshape), jnp.int8)
  b = jnp.asarray(rng.integers(-127, 128, rshape), jnp.int8)
  pa, pb, unpad = qdot.pad_for_gemm(a, b, dn)
  assert math.prod(pa.shape[i] for i in lc) % qdot.K_MULTIPLE == 0
  for x, c, bt in ((pa, lc, lb), (pb, rc, rb)):
    free = qdot.free_axes(x.ndim, c, bt)
    assert x.shape[free[-1]] % qdot.FREE_MULTIPLE == 0
  want = jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.int32)
  got = unpad(jax.lax.dot_general(pa, pb, dn, preferred_element_type=jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
