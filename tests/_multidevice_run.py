"""Run by tests/test_multidevice.py in a subprocess with N fake CPU devices (``XLA_FLAGS``
must be set before jax starts): trains a quantized MLP 5 SGD steps on one device and under
``jax.jit`` with ``NamedSharding`` (data-parallel, FSDP, tensor-parallel), and prints one JSON
object: the losses of each, and the collectives of each compiled step (op, dtype, shape).

  python tests/_multidevice_run.py N QTYPE     # QTYPE: int8 or fp8
"""

import json
import os
import re
import sys

n_devices, qtype = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={n_devices}")
os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import qtrain  # noqa: E402

QTYPES = {"int8": ("int8", "int8", "int8"),
          "fp8": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))


def main():
  w, a, g = QTYPES[qtype]
  rules = [qtrain.QtRule(weight_qtype=w, act_qtype=a, bwd_qtype=g,
                         bwd_stochastic_rounding="low_bit_hash")]
  model = qtrain.quantize_model(MLP(), qtrain.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (32, 16))
  y = jax.random.normal(jax.random.key(1), (32, 16))
  params = model.init(jax.random.key(2), x)["params"]
  tx = optax.sgd(0.05)

  def step(p, s, x, y, key):
    def loss(p):
      return jnp.mean((model.apply({"params": p}, x, rngs={qtrain.RNG_STREAM: key}) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  def run(mesh=None, param_specs=None, data_spec=None):
    p, xs, ys = params, x, y
    if mesh is not None:
      p = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs,
                                              is_leaf=lambda v: isinstance(v, P)))
      xs, ys = (jax.device_put(v, NamedSharding(mesh, data_spec)) for v in (x, y))
    s = tx.init(p)
    f = jax.jit(step)
    text = f.lower(p, s, xs, ys, jax.random.key(3)).compile().as_text()
    ops = []
    for line in text.splitlines():
      m = re.search(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
      if m:
        ops.append([m.group(2), m.group(1)])
    losses = []
    for i in range(5):
      p, s, value = f(p, s, xs, ys, jax.random.fold_in(jax.random.key(3), i))
      losses.append(float(value))
    return {"losses": losses, "collectives": ops}

  devices = np.array(jax.devices())
  assert devices.size == n_devices, devices
  data = Mesh(devices, ("data",))
  grid = Mesh(devices.reshape(n_devices // 2, 2), ("data", "model"))
  replicated = jax.tree.map(lambda _: P(), params)
  fsdp = {"up": {"kernel": P("data", None), "bias": P()},
          "down": {"kernel": P("data", None), "bias": P()}}
  tp = {"up": {"kernel": P(None, "model"), "bias": P("model")},  # column-split
        "down": {"kernel": P("model", None), "bias": P()}}      # row-split
  out = {"single": run(),
         "dp": run(data, replicated, P("data")),
         "fsdp": run(data, fsdp, P("data")),
         "tp": run(grid, tp, P("data"))}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
