"""Training end to end: int8 QT vs float on a small task (linen and nnx); orbax resume."""

import pytest
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.training import train_state

import qtrain

N_CLASSES = 4


def _data(n=512, d=16, seed=0):
  """A teacher-labelled classification task (no download)."""
  kx, kt = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (n, d))
  t1 = jax.random.normal(kt, (d, 32))
  logits = jnp.tanh(x @ t1) @ jax.random.normal(jax.random.fold_in(kt, 1), (32, N_CLASSES))
  return x, jnp.argmax(logits, -1)


INT8_RULES = [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                            bwd_qtype="int8", bwd_stochastic_rounding="uniform")]


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(N_CLASSES)(x)


def _train_linen(model, steps=300, seed=0):
  x, y = _data()
  params = jax.jit(model.init)(jax.random.key(seed), x[:2])["params"]
  tx = optax.adam(3e-3)

  def loss_fn(p, k):
    logits = model.apply({"params": p}, x, rngs={"quant": k})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train(params):
    def body(carry, i):
      p, o = carry
      loss, g = jax.value_and_grad(loss_fn)(p, jax.random.fold_in(jax.random.key(1), i))
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss
    (p, _), losses = jax.lax.scan(body, (params, tx.init(params)), jnp.arange(steps))
    return p, losses

  return train(params)[1]


def _assert_tracks(lf, lq, steps):
  """Stated margin: the 10-step mean loss of int8 QT is within 10% of float's at each step."""
  assert lf[-1] < 0.01 * lf[0] and lq[-1] < 0.01 * lq[0]  # both learn (loss down 100x)
  for s in steps:
    f, q = lf[s - 10:s].mean(), lq[s - 10:s].mean()
    assert abs(q - f) <= 0.10 * f, (s, f, q)
  assert not np.array_equal(lf, lq)                  # ... and it really was quantized


@pytest.mark.slow
def test_linen_int8_training_tracks_float():
  # Measured (CPU): step 50: 0.2424 float vs 0.2422 int8; step 300: 0.00122 vs 0.00123.
  lf = np.asarray(_train_linen(MLP()))
  lq = np.asarray(_train_linen(qtrain.quantize_model(MLP(), qtrain.QtProvider(INT8_RULES))))
  _assert_tracks(lf, lq, (25, 50, 100, 200, 300))


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 64, rngs=rngs)
    self.l3 = nnx.Linear(64, N_CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def _train_nnx(quantize, steps=200):
  x, y = _data()
  m = NnxMLP(nnx.Rngs(0))
  if quantize:
    m = qtrain.quantize_model(m, qtrain.QtProvider(INT8_RULES), rngs=nnx.Rngs(quant=1))
  opt = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    def loss_fn(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, g = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, g)
    return loss

  return np.array([float(step(m, opt)) for _ in range(steps)])


@pytest.mark.slow
def test_nnx_int8_training_tracks_float():
  # Measured (CPU): step 50: 0.2933 float vs 0.2932 int8; step 200: 0.00425 vs 0.00426.
  lf, lq = _train_nnx(False), _train_nnx(True)
  _assert_tracks(lf, lq, (25, 50, 100, 200))


# ---------------------------------------------------------------------------
# Checkpoint and resume.

STATEFUL_RULES = [
    qtrain.QtRule(module_path="Dense_0", weight_qtype="int8", act_qtype="int8",
                  act_static_scale=True, bwd_qtype="int8", bwd_stochastic_rounding="uniform"),
    qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                  act_learnable_scale=True, bwd_qtype="int8"),
]


class TrainState(train_state.TrainState):
  quant_stats: dict


@pytest.mark.slow
def test_linen_orbax_resume_same_trajectory(tmp_path):
  x, y = _data(n=64)
  qm = qtrain.quantize_model(MLP(), qtrain.QtProvider(STATEFUL_RULES))
  v = jax.jit(qm.init)(jax.random.key(0), x)
  assert "quant_stats" in v and "dot_general0_act_scale" in v["params"]["Dense_1"]

  tx = optax.adam(1e-2)  # one instance: a new one would be a new static field (a retrace)

  def fresh():
    return TrainState.create(apply_fn=qm.apply, params=v["params"], tx=tx,
                             quant_stats=v["quant_stats"])

  @jax.jit
  def step(state):
    key = jax.random.fold_in(jax.random.key(3), state.step)

    def loss_fn(p):
      logits, upd = state.apply_fn({"params": p, "quant_stats": state.quant_stats}, x,
                                   rngs={"quant": key}, mutable=["quant_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

    (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=g).replace(quant_stats=upd["quant_stats"]), loss

  s, straight = fresh(), []
  for _ in range(8):
    s, l = step(s)
    straight.append(float(l))

  s, resumed = fresh(), []
  for _ in range(4):
    s, l = step(s)
    resumed.append(float(l))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", s)
  ckpt.wait_until_finished()
  del s
  s = ckpt.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh()))
  assert int(s.step) == 4 and float(s.quant_stats["Dense_0"]["dot_general0_act_static_count"]) == 4
  for _ in range(4):
    s, l = step(s)
    resumed.append(float(l))
  assert resumed == straight


@pytest.mark.slow
def test_nnx_orbax_resume_same_trajectory(tmp_path):
  x, y = _data(n=64)

  tx = optax.adam(1e-2)  # shared, like the provider: the graphdef stays the same (no retrace)
  rules = [qtrain.QtRule(module_path="l1", weight_qtype="int8", act_qtype="int8",
                         act_static_scale=True, bwd_qtype="int8",
                         bwd_stochastic_rounding="uniform"),
           qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                         act_learnable_scale=True, bwd_qtype="int8")]
  provider = qtrain.QtProvider(rules)

  def fresh():
    m = NnxMLP(nnx.Rngs(0))
    m = qtrain.quantize_model(m, provider, x, rngs=nnx.Rngs(quant=1))
    return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    loss, g = nnx.value_and_grad(
        lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(m)
    opt.update(m, g)
    return loss

  m, opt = fresh()
  straight = [float(step(m, opt)) for _ in range(8)]

  m, opt = fresh()
  resumed = [float(step(m, opt)) for _ in range(4)]
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "nnx", {"model": nnx.state(m), "opt": nnx.state(opt)})
  ckpt.wait_until_finished()
  m, opt = fresh()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        {"model": nnx.state(m), "opt": nnx.state(opt)})
  restored = ckpt.restore(tmp_path / "nnx", target)
  nnx.update(m, restored["model"])
  nnx.update(opt, restored["opt"])
  assert float(m.l1.dot_general.act_static_count[...]) == 4
  resumed += [float(step(m, opt)) for _ in range(4)]
  assert resumed == straight
