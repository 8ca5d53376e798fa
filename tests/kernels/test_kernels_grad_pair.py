"""qtrain.kernels.grad_pair (interpret mode): both backward codes of a gradient, bit for bit
what qarray.quantize gives for each folded gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray, qtypes, rounding
from qtrain.kernels import grad_pair as gp


def _case(m, n, seed, dtype=jnp.bfloat16):
  """A gradient whose rows span 1e-30..1e30 (scales near both float32 ends) and folds that vary
  by orders of magnitude along their axes."""
  ks = jax.random.split(jax.random.key(seed), 4)
  rows = jnp.exp(jax.random.uniform(ks[0], (m, 1), minval=-69.0, maxval=69.0))
  g = (jax.random.normal(ks[1], (m, n)) * rows).astype(dtype)
  fold_l = jnp.exp(jax.random.normal(ks[2], (n,)) * 3)
  fold_r = jnp.exp(jax.random.normal(ks[3], (m,)) * 3)
  return g, fold_l, fold_r


def _xla_codes(g, fold_l, fold_r, n_last, qtype, methods, keys):
  """What the op's backward quantizes without the kernel: qarray.quantize of each folded
  gradient in the gradient's own shape (last axis n_last), per row / per column."""
  m, n = g.shape
  g2 = g.astype(jnp.float32) * fold_l[None, :]
  g3 = g.astype(jnp.float32) * fold_r[:, None]
  # The row/column structure is the 2-D view's; the hash words follow the original last axis.
  lead = n // n_last
  spec = lambda cw, method: qarray.QuantizeSpec(qtype=qtype, channelwise_axes=cw,
                                                stochastic_rounding=method)
  ql = qarray.quantize(g2.reshape(m, lead, n_last), spec((0,), methods[0]), key=keys[0])
  qr = qarray.quantize(g3.reshape(m, lead, n_last), spec((1, 2), methods[1]), key=keys[1])
  return (ql.qvalue.reshape(m, n), qr.qvalue.reshape(m, n).T,
          ql.scale.reshape(m), qr.scale.reshape(n))


@pytest.mark.slow
@pytest.mark.parametrize("m,n,n_last", [(64, 64, 64), (128, 192, 192), (64, 128, 32), (64, 192, 6)])
@pytest.mark.parametrize("methods", [("low_bit_hash", "low_bit_hash"), (None, None),
                                     ("low_bit_hash", None)])
def test_kernel_matches_quantize_bit_for_bit(m, n, n_last, methods):
  g, fl, fr = _case(m, n, m + n + n_last)
  keys = (jax.random.key(11), jax.random.key(12))
  c_l, c_rt, s_l, s_r = jax.jit(_xla_codes, static_argnums=(3, 4, 5))(
      g, fl, fr, n_last, qtypes.get_qtype("int8"), methods, keys)
  seeds = jnp.stack([*rounding.hash_seeds(keys[0]), *rounding.hash_seeds(keys[1])])
  opts = dict(qmin=-128, qmax=127, n_last=n_last, stochastic=tuple(x is not None for x in methods))
  args = (g, fl, fr, 1.0 / s_l, 1.0 / s_r, seeds)
  k_l, k_rt = jax.jit(lambda *a: gp.grad_pair(*a, interpret=True, **opts))(*args)
  r_l, r_rt = jax.jit(lambda *a: gp.grad_pair_reference(*a, **opts))(*args)
  assert k_l.dtype == jnp.int8 and k_l.shape == (m, n) and k_rt.shape == (n, m)
  for got in ((k_l, k_rt), (r_l, r_rt)):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(c_l))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(c_rt))
  # The codes use the whole int8 range (the scales are each row's / column's absmax).
  assert int(jnp.abs(k_l.astype(jnp.int32)).max()) == 127


@pytest.mark.slow
def test_int4_range_and_stochastic_mean():
  """A narrower integer qtype clips to its own range; the hash noise is unbiased."""
  m, n = 64, 128
  g = jnp.full((m, n), 0.3, jnp.float32).at[:, 0].set(7.0)
  fl, fr = jnp.ones((n,)), jnp.ones((m,))
  inv = lambda v: jnp.full(v, 1.0, jnp.float32)
  seeds = jnp.arange(1, 5, dtype=jnp.uint32)
  c_l, c_rt = gp.grad_pair(g, fl, fr, inv((m,)), inv((n,)), seeds, qmin=-8, qmax=7, n_last=n,
                           stochastic=(True, True), interpret=True)
  assert int(c_l.max()) == 7 and int(c_l.min()) >= 0
  mean = float(c_l[:, 1:].astype(jnp.float32).mean())
  assert abs(mean - 0.3) < 0.02, mean  # 8128 draws of Bernoulli(0.3): sd 0.005
  # Two seeds give different noise for the two code sets.
  assert bool((c_l[:, 1:] != c_rt.T[:, 1:]).any())


@pytest.mark.parametrize("m,n,why", [(64, 100, "multiples of the block"),
                                     (0, 64, "multiples of the block"),
                                     (2**16, 2**16, "int32 flat indices")])
def test_supported_names_what_it_cannot_take(m, n, why):
  assert why in gp.supported(m, n)
  if m * n < 2**20:
    with pytest.raises(ValueError, match=why):
      gp.grad_pair(jnp.ones((m, n)), jnp.ones((n,)), jnp.ones((m,)), jnp.ones((m,)),
                   jnp.ones((n,)), jnp.zeros((4,), jnp.uint32), qmin=-128, qmax=127, n_last=n,
                   stochastic=(False, False), interpret=True)


def test_n_last_must_divide_the_elements():
  with pytest.raises(ValueError, match="n_last=5"):
    gp.grad_pair(jnp.ones((64, 64)), jnp.ones((64,)), jnp.ones((64,)), jnp.ones((64,)),
                 jnp.ones((64,)), jnp.zeros((4,), jnp.uint32), qmin=-128, qmax=127, n_last=5,
                 stochastic=(False, False), interpret=True)


@pytest.mark.slow
def test_bounds_give_calibrates_absmax_scales_with_nonfinite_groups():
  """The bounds kernel's maxima turn into the scales qarray.calibrate finds, NaN where a row /
  column holds a NaN or an Inf (and only there)."""
  m, n = 128, 192
  g, fl, fr = _case(m, n, 3, jnp.float32)
  g = g.at[5, 7].set(jnp.nan).at[70, 130].set(-jnp.inf)
  b_l, b_r = jax.jit(lambda *a: gp.grad_pair_bounds(*a, interpret=True))(g, fl, fr)
  r_l, r_r = gp.grad_pair_bounds_reference(g, fl, fr)
  np.testing.assert_array_equal(np.asarray(b_l), np.asarray(r_l))
  np.testing.assert_array_equal(np.asarray(b_r), np.asarray(r_r))
  spec = lambda cw: qarray.QuantizeSpec(qtype="int8", channelwise_axes=cw)
  for bits, cw, folded in ((b_l, (0,), g * fl[None, :]), (b_r, (1,), g * fr[:, None])):
    got = qarray.absmax_scale(qarray.bound_of_bits(bits), spec(cw))
    want = qarray.calibrate(folded, spec(cw))[0].reshape(-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  s_l = qarray.absmax_scale(qarray.bound_of_bits(b_l), spec((0,)))
  s_r = qarray.absmax_scale(qarray.bound_of_bits(b_r), spec((1,)))
  assert np.flatnonzero(np.isnan(np.asarray(s_l))).tolist() == [5, 70]
  assert np.flatnonzero(np.isnan(np.asarray(s_r))).tolist() == [7, 130]
