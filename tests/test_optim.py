"""qtrain.optim: latent-weight clipping, Bop, low-bit stored weights with stochastic rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qtrain import optim


def _params():
  return {"bin": {"kernel": jnp.array([0.95, -0.95, 0.2, -0.2])},
          "head": {"kernel": jnp.array([0.95, 2.0]), "bias": jnp.array([0.0])}}


def test_clip_latent_weights_masked():
  params = _params()
  grads = jax.tree.map(lambda p: -jnp.ones_like(p), params)
  tx = optax.chain(optax.sgd(0.1), optim.clip_latent_weights(1.0, mask=optim.path_mask(r"bin/.*")))
  upd, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, upd)
  np.testing.assert_allclose(new["bin"]["kernel"], [1.0, -0.85, 0.3, -0.1], atol=1e-6)
  np.testing.assert_allclose(new["head"]["kernel"], [1.05, 2.1], atol=1e-6)
  # Default mask: every float leaf.
  tx2 = optax.chain(optax.sgd(0.1), optim.clip_latent_weights(1.0))
  new2 = optax.apply_updates(params, tx2.update(grads, tx2.init(params), params)[0])
  assert float(jnp.max(jnp.abs(new2["head"]["kernel"]))) == 1.0
  proj = optim.project_latent_weights({"a": jnp.array([-3.0, 0.5])}, bound=1.0)
  np.testing.assert_allclose(proj["a"], [-1.0, 0.5])
  with pytest.raises(ValueError, match="needs params"):
    tx.update(grads, tx.init(params))


def test_bop_flip_rule_and_momentum():
  w = jnp.array([1.0, 1.0, -1.0, -1.0, 1.0])
  g = jnp.array([1.0, -1.0, -1.0, 1.0, 1e-6])
  tx = optim.bop(threshold=1e-3, gamma=0.5)
  state = tx.init({"w": w})
  upd, state = tx.update({"w": g}, state, {"w": w})
  np.testing.assert_allclose(state.momentum["w"], 0.5 * g)
  # Flip where |m| > tau and sign(m) == sign(w): indices 0 and 2.
  np.testing.assert_allclose(optax.apply_updates({"w": w}, upd)["w"], [-1.0, 1.0, 1.0, -1.0, 1.0])
  upd2, state2 = tx.update({"w": g}, state, {"w": w})
  np.testing.assert_allclose(state2.momentum["w"], 0.75 * g)


@pytest.mark.slow
def test_bop_learns_signs_and_binary_optimizer_routes():
  target = jnp.sign(jax.random.normal(jax.random.key(0), (256,)))
  w0 = jnp.sign(jax.random.normal(jax.random.key(1), (256,)))
  params = {"binary": {"kernel": w0}, "float": {"scale": jnp.array([0.0])}}

  def loss(p):
    return -jnp.sum(p["binary"]["kernel"] * target) + jnp.sum((p["float"]["scale"] - 3.0) ** 2)

  tx = optim.binary_optimizer(optim.path_mask(r"binary/.*"), other=optax.sgd(0.1),
                              threshold=1e-4, gamma=1e-2)
  state = tx.init(params)
  for _ in range(60):
    upd, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, upd)
  np.testing.assert_array_equal(params["binary"]["kernel"], target)
  assert set(np.unique(np.asarray(params["binary"]["kernel"]))) <= {-1.0, 1.0}
  np.testing.assert_allclose(params["float"]["scale"], [3.0], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "int4", "int2"])
def test_lowbit_round_trip_and_storage(qtype):
  w = jax.random.normal(jax.random.key(0), (64, 32))
  p = optim.to_lowbit({"k": w, "b": jnp.zeros(32)}, qtype=qtype, mask=optim.path_mask("k"))
  lb = p["k"]
  assert isinstance(lb, optim.LowBitWeight) and lb.scale.shape == (1, 32)
  err = jnp.abs(optim.from_lowbit(p)["k"] - w)
  assert bool(jnp.all(err <= lb.scale / 2 + 1e-6))
  bits = int(qtype[3:])
  assert optim.tree_nbytes(lb.words) == w.size * bits // 8
  # Jittable (a pytree with static metadata).
  f = jax.jit(lambda t: optim.from_lowbit(t)["k"].sum())
  np.testing.assert_allclose(f(p), optim.from_lowbit(p)["k"].sum(), rtol=1e-5)


@pytest.mark.slow
def test_small_updates_survive_only_with_stochastic_rounding():
  n, steps = 8192, 40
  w = jax.random.uniform(jax.random.key(0), (n, 1), minval=-1, maxval=1)
  p0 = optim.to_lowbit({"w": w}, qtype="int8", mask=None, axis=0)
  step = p0["w"].scale  # one quantization step
  upd = {"w": jnp.full((n, 1), 0.1) * step}   # a fifth of half a step, every step
  pn = ps = p0
  key = jax.random.key(1)
  for i in range(steps):
    pn = optim.lowbit_apply_updates(pn, upd, rounding_mode="nearest")
    ps = optim.lowbit_apply_updates(ps, upd, key=jax.random.fold_in(key, i))
  w0 = optim.from_lowbit(p0)["w"]
  moved_n = float(jnp.mean(optim.from_lowbit(pn)["w"] - w0) / step[0, 0])
  moved_s = float(jnp.mean(optim.from_lowbit(ps)["w"] - w0) / step[0, 0])
  assert moved_n == 0.0                      # round-to-nearest loses every update
  # Expected 4.0 steps (40 x 0.1); values near +1 clip at qmax, so slightly less.
  assert 3.7 < moved_s < 4.1, moved_s
  with pytest.raises(ValueError, match="needs key"):
    optim.lowbit_apply_updates(p0, upd)


@pytest.mark.slow
def test_lowbit_training_beats_nearest_and_saves_memory():
  """Linear regression on int8-stored weights with updates far below half a step."""
  k, n = 64, 16
  x = jax.random.normal(jax.random.key(0), (512, k))
  w_true = jax.random.normal(jax.random.key(1), (k, n)) * 0.5
  y = x @ w_true
  w_init = jax.random.normal(jax.random.key(2), (k, n)) * 0.5
  loss = lambda w: jnp.mean((x @ w - y) ** 2)
  tx = optax.sgd(0.02)  # largest update ~0.7 of a step at the start, then well under half

  @jax.jit
  def step(p, state, key, nearest):
    g = jax.grad(lambda t: loss(t["w"]))(optim.from_lowbit(p))
    u, state = tx.update(g, state)
    pn = optim.lowbit_apply_updates(p, u, rounding_mode="nearest")
    ps = optim.lowbit_apply_updates(p, u, key=key)
    return jax.tree.map(lambda a, b: jnp.where(nearest, a, b), pn, ps), state

  results = {}
  for mode in ("nearest", "stochastic", "float"):
    p = optim.to_lowbit({"w": w_init}, qtype="int8")
    if mode == "float":
      p = optim.from_lowbit(p)
    state = tx.init(optim.from_lowbit(p))
    key = jax.random.key(3)
    for i in range(200):
      if mode == "float":
        u, state = tx.update(jax.grad(lambda t: loss(t["w"]))(p), state)
        p = optax.apply_updates(p, u)
      else:
        p, state = step(p, state, jax.random.fold_in(key, i), mode == "nearest")
    results[mode] = float(loss(optim.from_lowbit(p)["w"]))
  start = float(loss(optim.to_lowbit({"w": w_init}, qtype="int8")["w"].dequantize()))
  assert results["nearest"] > 0.95 * start           # stuck: updates < half a step are lost
  assert results["stochastic"] < 0.5 * start         # keeps descending...
  assert results["stochastic"] < 1.05 * results["float"]  # ...like float32 SGD
  # Memory: int8 / int4 stored weights + SGD vs float32 params + SGD.
  for qtype, min_saving in (("int8", 3.5), ("int4", 6.5)):
    p = optim.to_lowbit({"w": jnp.zeros((1024, 256)) + 0.1}, qtype=qtype)
    rep = optim.memory_report(p, optax.sgd(0.1).init(optim.from_lowbit(p)))
    assert rep["saving"] >= min_saving, rep
  # With Adam the float32 moments dominate unless kept in low precision too.
  pf = {"w": jnp.zeros((1024, 256))}
  p4 = optim.to_lowbit({"w": jnp.zeros((1024, 256)) + 0.1}, qtype="int4")
  adam_bf16 = optax.adam(1e-3, mu_dtype=jnp.bfloat16)
  rep = optim.memory_report(p4, adam_bf16.init(optim.from_lowbit(p4)),
                            float_params=pf, float_opt_state=optax.adam(1e-3).init(pf))
  assert rep["saving"] > 1.8, rep  # bf16 first moment, float32 second moment
