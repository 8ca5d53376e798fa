"""qtrain.kernels.grad_pair (interpret mode): both backward codes of a gradient, bit for bit
what qarray.quantize gives for each folded gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray, qtypes, rounding
from qtrain.kernels import grad_pair as gp


def _case(m, n, seed, dtype=jnp.bfloat16, spread=0):
  """A gradient whose rows span 1e-30..1e30 (scales near both float32 ends) and folds that vary
  by orders of magnitude along their axes; ``spread``: each element also times 2**-k, k
  uniform in [0, spread) (values far below their row's largest)."""
  ks = jax.random.split(jax.random.key(seed), 5)
  rows = jnp.exp(jax.random.uniform(ks[0], (m, 1), minval=-69.0, maxval=69.0))
  g = jax.random.normal(ks[1], (m, n)) * rows
  if spread:
    g = g * jnp.exp2(-jax.random.randint(ks[4], (m, n), 0, spread).astype(jnp.float32))
  g = g.astype(dtype)
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


def _check_codes(m, n, n_last, methods, qtype, spread=0):
  qt = qtypes.get_qtype(qtype)
  g, fl, fr = _case(m, n, m + n + n_last, spread=spread)
  keys = (jax.random.key(11), jax.random.key(12))
  c_l, c_rt, s_l, s_r = jax.jit(_xla_codes, static_argnums=(3, 4, 5))(
      g, fl, fr, n_last, qt, methods, keys)
  seeds = jnp.stack([*rounding.hash_seeds(keys[0]), *rounding.hash_seeds(keys[1])])
  opts = dict(qmin=qt.qmin, qmax=qt.qmax, n_last=n_last,
              code_dtype=qt.compute_dtype.name,
              stochastic=tuple(x is not None for x in methods))
  args = (g, fl, fr, 1.0 / s_l, 1.0 / s_r, seeds)
  k_l, k_rt = jax.jit(lambda *a: gp.grad_pair(*a, interpret=True, **opts))(*args)
  r_l, r_rt = jax.jit(lambda *a: gp.grad_pair_reference(*a, **opts))(*args)
  assert k_l.dtype == c_l.dtype == qt.compute_dtype
  assert k_l.shape == (m, n) and k_rt.shape == (n, m)
  bits = lambda a: np.asarray(a).view(np.uint8)
  for got in ((k_l, k_rt), (r_l, r_rt)):
    np.testing.assert_array_equal(bits(got[0]), bits(c_l))
    np.testing.assert_array_equal(bits(got[1]), bits(c_rt))
  # The codes use the qtype's whole range (the scales are each row's / column's absmax).
  assert float(jnp.abs(k_l.astype(jnp.float32)).max()) == qt.qmax
  return k_l


@pytest.mark.slow
@pytest.mark.parametrize("m,n,n_last", [(64, 64, 64), (128, 192, 192), (64, 128, 32), (64, 192, 6)])
@pytest.mark.parametrize("methods", [("low_bit_hash", "low_bit_hash"), (None, None),
                                     ("low_bit_hash", None)])
def test_kernel_matches_quantize_bit_for_bit(m, n, n_last, methods):
  _check_codes(m, n, n_last, methods, "int8")


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["float8_e5m2", "float8_e4m3fn"])
@pytest.mark.parametrize("methods,m,n,n_last", [
    (("low_bit_hash", "low_bit_hash"), 64, 192, 6), ((None, "low_bit_hash"), 64, 64, 64)])
def test_fp8_codes_match_quantize_bit_for_bit(qtype, methods, m, n, n_last):
  """fp8 gradients: the kernel's rounding (to nearest by the conversion, stochastically to a
  grid neighbour) is qarray.quantize's, bit for bit, over rows spanning 1e-30..1e30 (values
  down in fp8's subnormal range, where the stochastic rounding changes its formula)."""
  codes = _check_codes(m, n, n_last, methods, qtype, spread=48)
  tiny = float(jnp.finfo(jnp.dtype(qtype)).smallest_normal)
  assert bool(((jnp.abs(codes.astype(jnp.float32)) < tiny) & (codes != 0)).any())


@pytest.mark.slow
def test_fp8_stochastic_rounding_is_unbiased_between_grid_neighbours():
  """e5m2 codes of 0.3 * 2**k land on the two grid values around it, with the mean at it."""
  m, n = 64, 128
  g = jnp.full((m, n), 0.3 * 4096, jnp.float32).at[:, 0].set(57344.0)
  fl, fr = jnp.ones((n,)), jnp.ones((m,))
  one = lambda v: jnp.full(v, 1.0, jnp.float32)
  c_l, _ = gp.grad_pair(g, fl, fr, one((m,)), one((n,)), jnp.arange(1, 5, dtype=jnp.uint32),
                        qmin=-57344.0, qmax=57344.0, n_last=n, stochastic=(True, True),
                        code_dtype="float8_e5m2", interpret=True)
  vals = np.asarray(c_l[:, 1:].astype(jnp.float32))
  assert sorted(np.unique(vals).tolist()) == [1024.0, 1280.0]  # e5m2 neighbours of 1228.8
  assert abs(vals.mean() - 1228.8) < 5.0, vals.mean()  # 8128 draws: sd 1.1


def test_code_dtype_names_the_valid_ones():
  with pytest.raises(ValueError, match="code_dtype='bfloat16'.*float8_e5m2"):
    gp.grad_pair(jnp.ones((64, 64)), jnp.ones((64,)), jnp.ones((64,)), jnp.ones((64,)),
                 jnp.ones((64,)), jnp.zeros((4,), jnp.uint32), qmin=-1.0, qmax=1.0, n_last=64,
                 stochastic=(False, False), code_dtype="bfloat16", interpret=True)


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
