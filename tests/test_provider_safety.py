"""Safe by construction: no effect outside the quantized model's calls.

* float code traced before or after a quantized model, in the same process,
  gives bit-identical results (``x @ w``, ``jnp.einsum``, a shared jitted
  helper calling ``jax.lax.dot_general``, a float Flax model);
* the public ``jax.lax`` / ``jnp`` functions are restored after every call,
  including one that raises;
* two threads applying a float and a quantized model at the same time both
  get their own, correct results.
"""

import functools
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain.flax import intercept as _intercept

DN = (((1,), (0,)), ((), ()))
RULES = [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")]
X = jax.random.normal(jax.random.key(0), (16, 32))
W = jax.random.normal(jax.random.key(1), (32, 32))

ORIGINALS = (jax.lax.dot_general, jnp.einsum, jax.lax.conv_general_dilated, jnp.matmul, jnp.dot,
             jnp.tensordot, jnp.inner)


@jax.jit
def shared_helper(x, w):
  """A user's jitted helper used both inside a quantized module and by float code."""
  return jax.lax.dot_general(x, w, DN)


@functools.partial(jax.jit, static_argnums=(2,), static_argnames=("precision",
                                                                 "preferred_element_type"))
def jit_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """A jitted dot_general a layer is configured with (``nn.Dense(dot_general=...)``)."""
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)


class UsesEverything(nn.Module):
  """A module calling matmuls in every way a user might."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", lambda k: W)
    return dict(
        direct=jax.lax.dot_general(x, w, DN),          # intercepted (w is the parameter)
        einsum=jnp.einsum("bi,ij->bj", x, w),          # intercepted (own einsum, not jnp's jit)
        matmul=x @ w,                                  # intercepted (w is the parameter)
        dot=jnp.dot(x, w),                             # intercepted (w is the parameter)
        helper=shared_helper(x, w),                    # inner jit: float by design
        dense=nn.Dense(32, use_bias=False, kernel_init=lambda *_: W)(x),  # intercepted
        # A known layer whose op is an inner jit: the weight is known by convention, so only
        # the trace-level check keeps the jit's cache float.
        dense_jit_op=nn.Dense(32, use_bias=False, kernel_init=lambda *_: W,
                              dot_general=jit_dot_general)(x),
    )


def _float_results():
  return dict(
      matmul=jax.jit(lambda x, w: x @ w)(X, W),
      matmul_eager=X @ W,
      dot=jax.jit(lambda x, w: jnp.dot(x, w))(X, W),
      dot_eager=jnp.dot(X, W),
      einsum=jax.jit(lambda x, w: jnp.einsum("bi,ij->bj", x, w))(X, W),
      einsum_eager=jnp.einsum("bi,ij->bj", X, W),
      dot_general=jax.lax.dot_general(X, W, DN),
      helper=shared_helper(X, W),
      jit_op=jit_dot_general(X, W, DN),
      linen=nn.Dense(32, use_bias=False).apply({"params": {"kernel": W}}, X),
      linen_jit=jax.jit(nn.Dense(32, use_bias=False).apply)({"params": {"kernel": W}}, X),
  )


def _assert_all_equal(a, b):
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("jit_quantized", [False, True])
def test_float_results_bit_identical_before_and_after(jit_quantized):
  before = _float_results()
  qm = qtrain.quantize_model(UsesEverything(), qtrain.QtProvider(RULES))
  v = jax.jit(qm.init)(jax.random.key(0), X)
  apply = jax.jit(qm.apply) if jit_quantized else qm.apply
  out = apply(v, X)
  after = _float_results()
  _assert_all_equal(before, after)
  # Inside the quantized model: quantized where intercepted, exactly float elsewhere.
  exact = X @ W
  for k in ("helper", "dense_jit_op"):
    np.testing.assert_array_equal(out[k], exact, err_msg=k)
  for k in ("direct", "einsum", "matmul", "dot", "dense"):
    assert not np.array_equal(out[k], exact), k
    np.testing.assert_allclose(out[k], exact, rtol=0.05, atol=0.2)
  for fn in ORIGINALS:
    assert getattr(fn, "__qtrain_dispatcher__", None) is None


def test_inner_jit_traced_first_inside_quantized_model_stays_float():
  # The helper's FIRST trace happens inside the quantized model: its cache must hold float.
  @jax.jit
  def fresh_helper(x, w):
    return jax.lax.dot_general(x, w, DN)

  fresh_op = jax.jit(lambda l, r, dn, precision=None: jax.lax.dot_general(l, r, dn),
                     static_argnums=(2,), static_argnames=("precision",))

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", lambda k: W)
      d = nn.Dense(32, use_bias=False, kernel_init=lambda *_: W, dot_general=fresh_op)(x)
      return fresh_helper(x, w), d, jnp.einsum("bi,ij->bj", x, w)

  qm = qtrain.quantize_model(M(), qtrain.QtProvider(RULES))
  v = jax.jit(qm.init)(jax.random.key(0), X)
  inner, dense_inner, quantized_einsum = jax.jit(qm.apply)(v, X)
  exact = jax.lax.dot_general(X, W, DN)
  np.testing.assert_array_equal(inner, exact)
  np.testing.assert_array_equal(dense_inner, exact)
  np.testing.assert_array_equal(fresh_helper(X, W), exact)
  np.testing.assert_array_equal(fresh_op(X, W, DN), exact)
  assert not np.array_equal(quantized_einsum, X @ W)
  # jnp.einsum of the same spec and shapes, outside: float.
  np.testing.assert_array_equal(jnp.einsum("bi,ij->bj", X, W),
                                jax.jit(lambda x, w: jnp.einsum("bi,ij->bj", x, w))(X, W))


@pytest.mark.slow
def test_float_nnx_model_unaffected_by_quantized_nnx_model():
  f = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
  before = f(X)
  q = qtrain.quantize_model(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), qtrain.QtProvider(RULES))
  yq = q(X)
  after = f(X)
  np.testing.assert_array_equal(before, after)
  assert not np.array_equal(yq, before)
  for fn in ORIGINALS:  # nnx never touches the global functions
    assert getattr(fn, "__qtrain_dispatcher__", None) is None


def test_patches_restored_after_exception():
  class Boom(nn.Module):
    @nn.compact
    def __call__(self, x):
      nn.Dense(4)(x)
      assert jax.lax.dot_general is not ORIGINALS[0]  # installed during the call
      raise RuntimeError("boom")

  matmul_methods = (vars(type(X))["__matmul__"], vars(type(X))["__rmatmul__"])
  qm = qtrain.quantize_model(Boom(), qtrain.QtProvider(RULES))
  with pytest.raises(RuntimeError, match="boom"):
    jax.jit(qm.init)(jax.random.key(0), X)
  assert (jax.lax.dot_general, jnp.einsum, jax.lax.conv_general_dilated, jnp.matmul, jnp.dot,
          jnp.tensordot, jnp.inner) == ORIGINALS
  assert (vars(type(X))["__matmul__"], vars(type(X))["__rmatmul__"]) == matmul_methods
  assert not _intercept.installed()


@pytest.mark.slow
def test_threads_float_and_quantized_concurrently():
  dense = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(8)])
  qm = qtrain.quantize_model(dense, qtrain.QtProvider(RULES))
  v = jax.jit(qm.init)(jax.random.key(0), X)
  xs = [X * (1 + i / 10) for i in range(4)]
  ref_f = [dense.apply(v, x) for x in xs]
  ref_q = [qm.apply(v, x) for x in xs]
  assert not np.array_equal(ref_f[0], ref_q[0])
  errors, barrier = [], threading.Barrier(2)

  def run(model, refs, n_rounds=2):
    try:
      barrier.wait()
      for _ in range(n_rounds):
        for x, r in zip(xs, refs):
          np.testing.assert_array_equal(model.apply(v, x), r)   # eager: traces every call
          # a fresh jit each time: traced concurrently with the other thread
          np.testing.assert_allclose(jax.jit(lambda v, x: model.apply(v, x))(v, x), r,
                                     rtol=1e-6, atol=1e-6)
    except Exception as e:  # pragma: no cover - reported below
      errors.append(e)

  ts = [threading.Thread(target=run, args=(dense, ref_f)),
        threading.Thread(target=run, args=(qm, ref_q))]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  assert not errors, errors
  assert not _intercept.installed()


@pytest.mark.slow
@pytest.mark.parametrize("op", ["dot_general", "einsum", "matmul", "dot"])
def test_out_sharding_on_a_quantized_op_is_taken_as_the_float_op_takes_it(op):
  """A quantized op called with out_sharding runs quantized (never quietly float) and places
  its result as the float op would; on one device, the numbers of the call without it.
  Explicit-axes meshes: tests/test_explicit_sharding.py."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  out = NamedSharding(jax.make_mesh((1,), ("d",)), P())

  class M(nn.Module):
    out_sharding: object = None

    @nn.compact
    def __call__(self, x):
      w = self.param("kernel", nn.initializers.normal(1.0), (8, 4))
      kw = {} if self.out_sharding is None else {"out_sharding": self.out_sharding}
      if op == "einsum":
        return jnp.einsum("bk,kn->bn", x, w, **kw)
      if op in ("matmul", "dot"):
        return getattr(jnp, op)(x, w, **kw)
      return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), **kw)

  x = jax.random.normal(jax.random.key(0), (2, 8))
  quant = qtrain.QtRule(weight_qtype="int8", act_qtype="int8")
  p = qtrain.QtProvider([quant])
  model = qtrain.quantize_model(M(out), p)
  v = model.init(jax.random.key(1), x)
  assert [r.status for r in p.records()] == ["quantized"]
  y = model.apply(v, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(
      qtrain.quantize_model(M(), qtrain.QtProvider([quant])).apply(v, x)))
  assert not np.array_equal(np.asarray(y), np.asarray(M().apply(v, x)))  # quantized, not float
  assert y.sharding.is_equivalent_to(out, y.ndim)
  # Frozen, the op takes out_sharding too: the QT forward's numbers, the float op's placement.
  from qtrain import freeze
  fy = freeze.apply_frozen(M(out), freeze.freeze(v, p), x)
  np.testing.assert_array_equal(np.asarray(fy), np.asarray(y))
  assert fy.sharding.is_equivalent_to(out, fy.ndim)
