"""Run by tests/test_multidevice.py in a subprocess with N fake CPU devices (``XLA_FLAGS``
must be set before jax starts): trains a small quantized network (a 1-D conv, two Dense) 5 SGD
steps on one device, under ``jax.jit`` with ``NamedSharding`` (data-parallel, FSDP,
tensor-parallel) and data-parallel under ``jax.shard_map``, with quantized and with float
gradients (and round-to-nearest ones, the weight gradient's scales per shard or shared across the
data axis), tensor parallelism under ``jax.shard_map``, and QLoRA (a frozen packed base with
adapters) data parallel and FSDP, and prints one JSON object: the losses of each, and the collectives of each
compiled step (op, result type).

  python tests/_multidevice_run.py N QTYPE     # QTYPE: int8 or fp8
"""

import functools
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


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3,), name="conv")(x)
    h = nn.gelu(nn.Dense(64, name="up")(h.reshape(h.shape[0], -1)))
    return nn.Dense(16, name="down")(h)


class TpUp(nn.Module):  # column-parallel under shard_map: the kernel split along its features
  hidden: int

  @nn.compact
  def __call__(self, x):
    k = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.hidden))
    return nn.gelu(jax.lax.dot_general(x, k, (((1,), (0,)), ((), ()))))


class TpDown(nn.Module):  # row-parallel: the kernel split along its input; partial sums summed
  out: int
  axis: str | None

  @nn.compact
  def __call__(self, h):
    k = self.param("kernel", nn.initializers.lecun_normal(), (h.shape[-1], self.out))
    y = jax.lax.dot_general(h, k, (((1,), (0,)), ((), ())))
    return y if self.axis is None else jax.lax.psum(y, self.axis)


class TpNet(nn.Module):
  hidden: int
  axis: str | None = None

  @nn.compact
  def __call__(self, x):
    return TpDown(16, self.axis, name="down")(TpUp(self.hidden, name="up")(x))


def tensor_parallel(x, y, n_devices):
  """Megatron-style tensor parallelism written with jax.shard_map: column-split up, row-split
  down, round-to-nearest int8 gradients. Shared scales (the axis-name fields of the rules:
  the row-parallel layer's input and weight, the column-parallel layer's input gradient) give
  one device's losses; per-shard scales do not."""
  model_mesh = Mesh(np.array(jax.devices()), ("model",))
  tx = optax.sgd(0.05)

  def rules(shared: bool):
    m = ("model",) if shared else ()
    common = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")
    return [qtrain.QtRule(module_path="up", bwd_act_grad_axis_names=m, **common),
            qtrain.QtRule(module_path="down", act_axis_names=m, weight_axis_names=m, **common)]

  def train(shared: bool, sharded: bool):
    net = TpNet(64 // n_devices, "model") if sharded else TpNet(64)  # each shard's own sizes
    model = qtrain.quantize_model(net, qtrain.QtProvider(rules(shared)))
    params = TpNet(64).init(jax.random.key(2), x)["params"]
    loss = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
    specs = {"up": {"kernel": P(None, "model")}, "down": {"kernel": P("model", None)}}

    def grads(p, x, y):
      if not sharded:
        return jax.value_and_grad(loss)(p, x, y)
      return jax.shard_map(jax.value_and_grad(loss), mesh=model_mesh,
                           in_specs=(specs, P(), P()), out_specs=(P(), specs))(p, x, y)

    @jax.jit
    def step(p, s):
      value, g = grads(p, x, y)
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s, value

    p, s, losses = params, tx.init(params), []
    for _ in range(5):
      p, s, value = step(p, s)
      losses.append(float(value))
    return losses

  return {"single": train(True, False), "shared": train(True, True),
          "per_shard": train(False, True)}


def qlora(x, y, data, step_collectives):
  """QLoRA (int4 base weights frozen and packed, rank-4 adapters) trained 5 AdamW steps on one
  device and data parallel (the batch split, the frozen layers replicated) and with the packed
  words sharded too (FSDP of the frozen base): the losses, and the collectives of each step."""
  from qtrain import freeze, lora

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))

  rule = qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=8, lora_rank=4,
                       lora_alpha=8.0)
  provider = qtrain.QtProvider([rule])
  v = qtrain.quantize_model(Mlp(), provider).init(jax.random.key(5), x)
  frozen = freeze.freeze(v, provider)
  adapters, rest = lora.split(frozen["variables"]["params"])
  adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # B = 0 would train A not at all at first
  tx = optax.adamw(3e-3)

  def step(ad, state, layers, x, y):
    def loss(ad):
      fv = {**frozen["variables"], "params": lora.combine(ad, rest)}
      out = freeze.apply_frozen(Mlp(), {"layers": layers, "variables": fv}, x)
      return jnp.mean((out - y) ** 2)
    value, g = jax.value_and_grad(loss)(ad)
    u, state = tx.update(g, state, ad)
    return optax.apply_updates(ad, u), state, value

  def run(mesh=None, shard_words=False):
    ad, layers, xs, ys = adapters, frozen["layers"], x, y
    if mesh is not None:
      rep = NamedSharding(mesh, P())
      ad = jax.device_put(ad, rep)
      xs, ys = (jax.device_put(v, NamedSharding(mesh, P("data"))) for v in (x, y))
      words = lambda w: NamedSharding(mesh, P("data", None) if shard_words else P())
      layers = {k: jax.tree.map(lambda a: jax.device_put(a, words(a) if a.ndim == 2 else rep), l)
                for k, l in layers.items()}
    state = tx.init(ad)
    f = jax.jit(step)
    ops = step_collectives(f.lower(ad, state, layers, xs, ys).compile().as_text())
    losses = []
    for _ in range(5):
      ad, state, value = f(ad, state, layers, xs, ys)
      losses.append(float(value))
    return {"losses": losses, "collectives": ops}

  return {"single": run(), "dp": run(data), "fsdp": run(data, shard_words=True)}


def collectives(text: str) -> list:
  """(op, result type) of every collective in a compiled module's text."""
  ops = []
  for line in text.splitlines():
    m = re.search(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
    if m:
      ops.append([m.group(2), m.group(1)])
  return ops


def main():
  w, a, g = QTYPES[qtype]
  x = jax.random.normal(jax.random.key(0), (32, 6, 4))
  y = jax.random.normal(jax.random.key(1), (32, 16))
  tx = optax.sgd(0.05)
  devices = np.array(jax.devices())
  assert devices.size == n_devices, devices
  data = Mesh(devices, ("data",))
  grid = Mesh(devices.reshape(n_devices // 2, 2), ("data", "model"))

  def build(grads_quantized: bool, *, sr: str | None = "low_bit_hash", names=()):
    rules = [qtrain.QtRule(weight_qtype=w, act_qtype=a, bwd_qtype=g if grads_quantized else None,
                           bwd_stochastic_rounding=sr if grads_quantized else None,
                           bwd_weight_grad_axis_names=names if grads_quantized else ())]
    model = qtrain.quantize_model(Net(), qtrain.QtProvider(rules))
    params = model.init(jax.random.key(2), x)["params"]

    def loss(p, x, y, key, count):  # the squared error summed over x's rows, over count values
      out = model.apply({"params": p}, x, rngs={qtrain.RNG_STREAM: key})
      return jnp.sum((out - y) ** 2) / count

    return params, loss

  def step_fn(loss):
    def step(p, s, x, y, key):
      value, grads = jax.value_and_grad(loss)(p, x, y, key, y.size)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s, value
    return step

  def shard_map_step_fn(loss):
    def step(p, s, x, y, key):
      @functools.partial(jax.shard_map, mesh=data, in_specs=(P(), P("data"), P("data"), P()),
                         out_specs=(P(), P()))
      def grads(p, x, y, key):
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        # Each shard's share of the global mean; the gradient of the replicated parameters
        # comes back summed over the shards (JAX's rule, which the QT ops follow).
        value, grads = jax.value_and_grad(loss)(p, x, y, key, y.size * n_devices)
        return jax.lax.psum(value, "data"), grads
      value, grads = grads(p, x, y, key)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s, value
    return step

  def run(params, step, mesh=None, param_specs=None, data_spec=None):
    p, xs, ys = params, x, y
    if mesh is not None:
      p = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs,
                                              is_leaf=lambda v: isinstance(v, P)))
      xs, ys = (jax.device_put(v, NamedSharding(mesh, data_spec)) for v in (x, y))
    s = tx.init(p)
    f = jax.jit(step)
    ops = collectives(f.lower(p, s, xs, ys, jax.random.key(3)).compile().as_text())
    losses = []
    for i in range(5):
      p, s, value = f(p, s, xs, ys, jax.random.fold_in(jax.random.key(3), i))
      losses.append(float(value))
    return {"losses": losses, "collectives": ops}

  out = {}
  for grads_quantized, suffix in ((True, ""), (False, "_float_grads")):
    params, loss = build(grads_quantized)
    replicated = jax.tree.map(lambda _: P(), params)
    fsdp = {"conv": {"kernel": P(), "bias": P()},
            "up": {"kernel": P("data", None), "bias": P()},
            "down": {"kernel": P("data", None), "bias": P()}}
    tp = {"conv": {"kernel": P(), "bias": P()},
          "up": {"kernel": P(None, "model"), "bias": P("model")},  # column-split
          "down": {"kernel": P("model", None), "bias": P()}}      # row-split
    out["single" + suffix] = run(params, step_fn(loss))
    out["shard_map" + suffix] = run(params, shard_map_step_fn(loss))
    if grads_quantized:
      out["dp"] = run(params, step_fn(loss), data, replicated, P("data"))
      out["fsdp"] = run(params, step_fn(loss), data, fsdp, P("data"))
      out["tp"] = run(params, step_fn(loss), grid, tp, P("data"))
  # Round-to-nearest quantized gradients, the weight gradient's scales per shard or shared
  # across the data axis (bwd_weight_grad_axis_names; outside shard_map it has nothing to do).
  for names, suffix in (((), "_nosr"), (("data",), "_nosr_global")):
    params, loss = build(True, sr=None, names=names)
    if not names:
      out["single_nosr"] = run(params, step_fn(loss))
    out["shard_map" + suffix] = run(params, shard_map_step_fn(loss))
  params, loss = build(True, sr=None, names=("data",))
  out["single_nosr_global"] = run(params, step_fn(loss))
  out["tensor_parallel_shard_map"] = tensor_parallel(x.reshape(32, -1), y, n_devices)
  out["qlora"] = qlora(x.reshape(32, -1), y, data, collectives)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
