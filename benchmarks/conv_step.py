"""Convolution training-step benchmark: a ResNet-18 step, bf16 vs qtrain QT, side by side.

ResNet-18 (NHWC, bf16 params and activations, batch norm in training mode, a
float 7x7 stem and a float head: the usual recipe for quantized CNNs), images
``--image`` x ``--image`` (default 224), batch ``--batch`` (default 64); one
step = value_and_grad of the cross-entropy + optax SGD with momentum. Steps run
inside ONE jit (a ``lax.fori_loop`` carrying the params and batch statistics)
and the time is divided by the step count; median of ``--repeats``. Every
config starts from the same float32 init cast to bf16.

Configs (the 3x3 and 1x1 convolutions of the residual stages quantized,
``module_path`` ``layer.*``):

* ``bf16``: XLA / cuDNN convolutions.
* ``qtrain_int8``: int8 weights and activations, int8 gradients
  (``low_bit_uniform`` stochastic rounding); the forward as cuDNN's int8 convolution of the
  codes, both gradient products as patches x kernel matrix on the int8 GEMM
  (:mod:`qtrain.ops.im2col`).
* ``qtrain_int8_fwd``: the same forward, float gradients (cuDNN's dgrad / wgrad in bf16).
* ``qtrain_binary``: binary weights and activations (absmean scales), float backward: the
  forward as cuDNN's int8 convolution of the +-1 codes, the backward as cuDNN's dgrad / wgrad;
  the stages' ReLUs replaced by the identity (the next convolution binarizes: see ResNet18).

  python3 benchmarks/conv_step.py --out-dir $OUT          # on the GPU machine
  python3 benchmarks/conv_step.py --image 32 --batch 2 --steps 1 --repeats 1   # CPU smoke run

Writes the run's JSON record (after every config) and, on a GPU, rebuilds the
``conv_step`` table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qtrain  # noqa: E402
from benchmarks import _record  # noqa: E402

CONFIGS = {
    "bf16": "no quantization (XLA / cuDNN convolutions)",
    "qtrain_int8": "w8a8 convs (cuDNN int8 forward), int8 gradients on the patches, low_bit_uniform SR",
    "qtrain_int8_fwd": "w8a8 convs forward, float backward",
    "qtrain_binary": "binary weights and activations (absmean), float backward",
}
DEFAULT_CONFIGS = ("bf16", "qtrain_int8", "qtrain_binary")
_BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


class BasicBlock(nn.Module):
  features: int
  strides: int = 1
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, (3, 3), self.strides, padding=1, use_bias=False, name="conv1",
                **_BF16)(x)
    y = self.act(nn.BatchNorm(use_running_average=False, name="bn1", **_BF16)(y))
    y = nn.Conv(self.features, (3, 3), padding=1, use_bias=False, name="conv2", **_BF16)(y)
    y = nn.BatchNorm(use_running_average=False, name="bn2", **_BF16)(y)
    if x.shape[-1] != self.features or self.strides != 1:
      x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False, name="down", **_BF16)(x)
      x = nn.BatchNorm(use_running_average=False, name="bn_down", **_BF16)(x)
    return self.act(x + y)


def _identity(x):
  return x


class ResNet18(nn.Module):
  """``act``: the residual stages' activation; binary runs use the identity, since
  the next convolution binarizes (the sign of a ReLU output is +1 everywhere: a
  constant input that batch norm then divides by a vanishing deviation)."""

  classes: int = 1000
  stages: Sequence[int] = (64, 128, 256, 512)
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(64, (7, 7), 2, padding=3, use_bias=False, name="stem", **_BF16)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, name="bn_stem", **_BF16)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    for i, f in enumerate(self.stages):
      for j in range(2):
        x = BasicBlock(f, 2 if (i > 0 and j == 0) else 1, self.act, name=f"layer{i + 1}_{j}")(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.classes, name="head", **_BF16)(x)


def rules(name: str):
  common = dict(module_path=r"layer.*", op_names=("conv_general_dilated",))
  if name == "qtrain_int8":
    return [qtrain.QtRule(**common, weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                          bwd_stochastic_rounding="low_bit_uniform")]
  if name == "qtrain_int8_fwd":
    return [qtrain.QtRule(**common, weight_qtype="int8", act_qtype="int8")]
  if name == "qtrain_binary":
    return [qtrain.QtRule(**common, weight_qtype="binary", act_qtype="binary",
                          weight_calibration_method="absmean", act_calibration_method="absmean")]
  raise ValueError(name)


def _act(name: str) -> Callable:
  return _identity if name == "qtrain_binary" else nn.relu


def build(name: str):
  model = ResNet18(act=_act(name))
  if name == "bf16":
    return model, None
  return qtrain.quantize_model(model, qtrain.QtProvider(rules(name))), qtrain.RNG_STREAM


def time_config(name, image, batch, steps, repeats):
  model, stream = build(name)
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (batch, image, image, 3), jnp.float32).astype(jnp.bfloat16)
  y = jax.random.randint(ky, (batch,), 0, 1000)
  # float32 init cast to bf16 (flax initialisers run in bf16 give few distinct values).
  init_model = ResNet18(act=_act(name))
  variables = jax.jit(lambda k, x: init_model.init({"params": k}, x))(kp, x.astype(jnp.float32))
  # bf16 params; batch statistics stay float32 (what BatchNorm's update writes).
  variables = {**variables, "params": jax.tree.map(lambda v: v.astype(jnp.bfloat16),
                                                   variables["params"])}
  if stream is not None:  # the quantized model's own variables (calibration state, if any)
    qvars = jax.jit(lambda k, x: model.init({"params": k, stream: k}, x))(kp, x)
    variables = {**qvars, "params": variables["params"], "batch_stats": variables["batch_stats"]}
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}
  tx = optax.sgd(1e-3, momentum=0.9)

  def loss_fn(p, rest, key, x, y):
    kw = {"rngs": {stream: key}} if stream else {}
    logits, upd = model.apply({"params": p, **rest}, x, mutable=["batch_stats"], **kw)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
    return loss, {**rest, **upd}

  @jax.jit
  def run(p, s, rest, key, x, y):
    def one_step(i, carry):
      p, s, rest, key, _ = carry
      key, sub = jax.random.split(key)
      (loss, rest), g = jax.value_and_grad(loss_fn, has_aux=True)(p, rest, sub, x, y)
      upd, s = tx.update(g, s, p)
      return optax.apply_updates(p, upd), s, rest, key, loss
    return jax.lax.fori_loop(0, steps, one_step, (p, s, rest, key, jnp.zeros((), jnp.float32)))

  opt_state = tx.init(params)
  t0 = time.perf_counter()
  compiled = run.lower(params, opt_state, rest, jax.random.key(1), x, y).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, opt_state, rest, jax.random.key(1), x, y))  # warm up
  times, out = [], None
  for r in range(repeats):
    t0 = time.perf_counter()
    out = compiled(params, opt_state, rest, jax.random.key(2 + r), x, y)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / steps * 1e3)
  return statistics.median(times), float(out[-1]), compile_s


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--image", type=int, default=224)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                  help="comma-separated; " + "; ".join(f"{k}: {v}" for k, v in CONFIGS.items()))
  _record.add_arguments(ap)
  args = ap.parse_args()
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
  rec = _record.Recorder("conv_step", dict(image=args.image, batch=args.batch, steps=args.steps,
                                           repeats=args.repeats, model="resnet18"),
                         out_dir=args.out_dir, results=args.results)
  rows, base = [], None
  for name in names:
    row = dict(config=name, model="resnet18", image=args.image, batch=args.batch)
    try:
      ms, loss, compile_s = time_config(name, args.image, args.batch, args.steps, args.repeats)
    except Exception as e:  # report, keep going: one config failing must not hide the others
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      rows.append(dict(row, ms=None, vs_bf16=None, loss=None,
                       error=f"{type(e).__name__}: {str(e)[:200]}"))
      rec.write(rows)
      continue
    if name == "bf16":
      base = ms
    sp = base / ms if base else None
    rows.append(dict(row, ms=ms, vs_bf16=sp, loss=loss, compile_s=compile_s))
    print(f"{name:16s} {ms:9.3f} ms/step  {sp if sp else float('nan'):5.2f}x  "
          f"loss {loss:.4f}  compile {compile_s:.1f} s", flush=True)
    rec.write(rows)
  rec.finish(rows)


if __name__ == "__main__":
  main()
