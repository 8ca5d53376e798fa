"""Run by tests/test_explicit_sharding.py in a subprocess with 4 fake CPU devices (``XLA_FLAGS``
must be set before jax starts): quantized linen and nnx models under Explicit mesh axes
(``jax.set_mesh``), with ``out_sharding`` on their products and without. Prints one JSON object.
"""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import qtrain  # noqa: E402

MESH = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
DN = (((1,), (0,)), ((), ()))
RULE = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")
rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
IMG = jnp.asarray(rng.standard_normal((8, 6, 6, 3)), jnp.float32)


class Linen(nn.Module):
  """dot_general (out_sharding) -> einsum (out_sharding) -> @ (none): data parallel."""
  sharded_out: bool

  @nn.compact
  def __call__(self, x):
    out = P("data", None) if self.sharded_out else None
    w1 = self.param("w1", nn.initializers.normal(0.3), (16, 32))
    w2 = self.param("w2", nn.initializers.normal(0.3), (32, 8))
    w3 = self.param("w3", nn.initializers.normal(0.3), (8, 4))
    h = jnp.tanh(jax.lax.dot_general(x, w1, DN, out_sharding=out))
    h = jnp.tanh(jnp.einsum("bk,kn->bn", h, w2, out_sharding=out))
    return h @ w3


class Conv(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(4, (3, 3))(x)
    return jnp.mean(h, axis=(1, 2))


class Nnx(nnx.Module):
  def __init__(self, rngs, sharded_out: bool):
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.3)
    self.l2 = nnx.Linear(32, 4, rngs=rngs)
    self.out = P("data", None) if sharded_out else None

  def __call__(self, x):
    return self.l2(jnp.tanh(jnp.einsum("bk,kn->bn", x, self.w1[...], out_sharding=self.out)))


def train_linen(model, v, x, steps, place=None):
  def loss(p, x):
    return jnp.mean(model.apply({"params": p}, x) ** 2)

  step = jax.jit(lambda p, x: (loss(p, x), jax.tree.map(
      lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x))))
  p, out = v["params"], []
  for _ in range(steps):
    l, p = step(p, x)
    out.append(float(l))
  return out, p


def typeof_str(a) -> str:
  return str(jax.typeof(a))


res = {}
plain = qtrain.quantize_model(Linen(False), qtrain.QtProvider([RULE]))
v = plain.init(jax.random.key(1), X)
one, _ = train_linen(plain, v, X, 3)  # one device, no mesh
for name, sharded_out in (("out_sharding", True), ("inferred", False)):
  q = qtrain.quantize_model(Linen(sharded_out), qtrain.QtProvider([RULE]))
  with jax.set_mesh(MESH):
    xs = jax.device_put(X, NamedSharding(MESH, P("data", None)))
    vs = jax.device_put(v, NamedSharding(MESH, P()))
    many, p = train_linen(q, vs, xs, 3)
    y = jax.jit(q.apply)(vs, xs)
    res[name] = dict(one=one, many=many, y_type=typeof_str(y),
                     grad_types=sorted({typeof_str(a) for a in jax.tree.leaves(p)}))

q = qtrain.quantize_model(Conv(), qtrain.QtProvider([RULE]))
v = q.init(jax.random.key(1), IMG)
one, _ = train_linen(q, v, IMG, 2)
with jax.set_mesh(MESH):
  many, _ = train_linen(q, jax.device_put(v, NamedSharding(MESH, P())),
                        jax.device_put(IMG, NamedSharding(MESH, P("data"))), 2)
res["conv"] = dict(one=one, many=many)

one_model = Nnx(nnx.Rngs(0), False)
qtrain.quantize_model(one_model, qtrain.QtProvider([RULE]), X)
y_one = one_model(X)
with jax.set_mesh(MESH):
  xs = jax.device_put(X, NamedSharding(MESH, P("data", None)))
  m = Nnx(nnx.Rngs(0), True)
  qtrain.quantize_model(m, qtrain.QtProvider([RULE]), xs)  # the sample forward, sharded
  y_many = nnx.jit(lambda m, x: m(x))(m, xs)
res["nnx"] = dict(equal=bool(np.array_equal(np.asarray(y_one), np.asarray(y_many))),
                  y_type=typeof_str(y_many))

# Frozen (serving) models: the frozen ops place their results as the float ops do.
from qtrain import freeze  # noqa: E402

prov = qtrain.QtProvider([RULE])
q = qtrain.quantize_model(Linen(False), prov)
v = q.init(jax.random.key(1), X)
fr = freeze.freeze(v, prov)
y_one = freeze.apply_frozen(Linen(False), fr, X)
frozen = {}
for name, sharded_out in (("out_sharding", True), ("inferred", False)):
  with jax.set_mesh(MESH):
    y = jax.jit(lambda f, x: freeze.apply_frozen(Linen(sharded_out), f, x))(
        jax.device_put(fr, NamedSharding(MESH, P())),
        jax.device_put(X, NamedSharding(MESH, P("data", None))))
  frozen[name] = dict(close=float(np.max(np.abs(np.asarray(y) - np.asarray(y_one)))),
                      y_type=typeof_str(y))


class NnxLinears(nnx.Module):
  """nnx.Linear -> nnx.Linear, the first called with out_sharding."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x, out=None):
    return self.l2(jnp.tanh(self.l1(x, out_sharding=out)))


def frozen_nnx(x):
  m = NnxLinears(nnx.Rngs(0))
  prov = qtrain.QtProvider([RULE])
  qtrain.quantize_model(m, prov, x)
  return freeze.freeze(m, prov)


y_one = freeze.apply_frozen(frozen_nnx(X), X)
with jax.set_mesh(MESH):
  xs = jax.device_put(X, NamedSharding(MESH, P("data", None)))
  fm = frozen_nnx(xs)
  y = nnx.jit(lambda m, x: freeze.apply_frozen(m, x, P("data", None)))(fm, xs)
frozen["nnx"] = dict(close=float(np.max(np.abs(np.asarray(y) - np.asarray(y_one)))),
                     y_type=typeof_str(y))
res["frozen"] = frozen

# An ambiguous product (a contraction over a sharded axis with no out_sharding) raises the float
# op's error, named for the layer.
q = qtrain.quantize_model(Linen(False), qtrain.QtProvider([RULE]))
v = q.init(jax.random.key(1), X)
with jax.set_mesh(MESH):
  try:
    params = dict(v["params"], w1=jax.device_put(v["params"]["w1"],
                                                 NamedSharding(MESH, P("model", None))))
    jax.jit(q.apply)({"params": jax.device_put(params, NamedSharding(MESH, P()))
                      | {"w1": params["w1"]}},
                     jax.device_put(X, NamedSharding(MESH, P(None, "model"))))
    res["ambiguous"] = "no error"
  except Exception as e:  # noqa: BLE001
    res["ambiguous"] = f"{type(e).__name__}: {e}"
print(json.dumps(res))
