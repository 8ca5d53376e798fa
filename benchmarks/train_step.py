"""Training-step benchmark: bf16 vs qtrain QT (int8, fp8, binary) vs qwix QT, side by side.

An MLP stack (4 blocks of Dense(D->F) + gelu + Dense(F->D) + residual, bf16 params
and activations) at T tokens; one step = value_and_grad + optax SGD update. Steps
run inside ONE jit (a ``lax.fori_loop`` carrying the params, so nothing can be
hoisted) and the time is divided by the step count; median of ``--repeats``.

Run on the GPU machine (qwix travels as a wheel in .whl/; benchmarks/gpu.sh installs it):

  python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --out-dir $OUT

Prints a markdown table, writes the run's JSON record (after every config, so a
run cut by a timeout keeps what it measured) and, on a GPU, rebuilds the
training-step table of benchmarks/RESULTS.md (benchmarks/_record.py).

On a CPU it runs too (slowly; the figures are not GPU figures and never enter
RESULTS.md): ``python3 benchmarks/train_step.py --widths 64 --tokens 256 --steps 2
--repeats 1 --configs bf16,qtrain_int8_lowbit``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qtrain  # noqa: E402
from benchmarks import _record  # noqa: E402
from qtrain.ops.backends import mosaic as mosaic_backend  # noqa: E402

# What each config quantizes (every Dense of the MLP, module_path ".*"):
CONFIGS = {
    "bf16": "no quantization",
    "qtrain_int8_lowbit": "w8a8, int8 gradients, low_bit_uniform SR ('auto': the Mosaic GEMM on Hopper)",
    "qtrain_int8_cublas": "qtrain_int8_lowbit with the Mosaic GEMM off (XLA's cuBLAS int8 GEMM)",
    "qtrain_int8_hash": "w8a8, int8 gradients, low_bit_hash SR (noise from a keyed hash, no PRNG)",
    "qtrain_int8": "w8a8, int8 gradients, uniform SR",
    "qtrain_int8_kernel": "qtrain_int8_lowbit forced onto the Pallas-Triton int8 kernel",
    "qtrain_int8_fwd": "w8a8 forward, float backward",
    "qtrain_int8_hash_fixed": "qtrain_int8_hash with each activation's scale per tensor from a "
                              "fixed bound (fixed,8): no reduction before its quantization",
    "qtrain_fp8_nosr": "e4m3 forward, e5m2 gradients, round to nearest",
    "qtrain_fp8_nosr_fixed": "qtrain_fp8_nosr with weights per tensor (absmax) and each "
                             "activation's scale per tensor from a fixed bound (fixed,8)",
    "qtrain_fp8_nosr_xla": "qtrain_fp8_nosr with implementation='xla' (layouts left to XLA)",
    "qtrain_fp8_lowbit": "e4m3 forward, e5m2 gradients, low_bit_uniform SR",
    "qtrain_fp8_hash": "e4m3 forward, e5m2 gradients, low_bit_hash SR",
    "qtrain_fp8": "e4m3 forward, e5m2 gradients, uniform SR",
    "qtrain_binary": "binary weights and activations (absmean scales), float backward",
    "qtrain_binary_g8": "qtrain_binary with int8 gradients (low_bit_hash SR): all three products int8",
    "qwix_int8": "qwix: w8a8, int8 gradients, uniform SR",
    "qwix_int8_fwd": "qwix: w8a8 forward, float backward",
    "qwix_fp8": "qwix: e4m3 forward, e5m2 gradients (qwix has no SR for fp8)",
}
DEFAULT_CONFIGS = ("bf16", "qtrain_int8_lowbit", "qtrain_int8_hash", "qtrain_int8_cublas", "qwix_int8",
                   "qtrain_binary", "qtrain_fp8_nosr", "qtrain_fp8_lowbit", "qtrain_fp8_hash",
                   "qwix_fp8")


class Block(nn.Module):
  width: int
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.hidden, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name="up")(x)
    h = nn.gelu(h)
    return x + nn.Dense(self.width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name="down")(h)


class MLP(nn.Module):
  width: int
  hidden: int
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    for i in range(self.depth):
      x = Block(self.width, self.hidden, name=f"mlp_{i}")(x)
    return x


# *_fixed: a constant activation scale, so its quantization is elementwise and XLA can fuse it
# into the activation's producer: the speed a delayed (previous-step) scale would have, less the
# amax pass that keeps such a scale current.
_FIXED_ACT = dict(act_granularity="per_tensor", act_calibration_method="fixed,8")


def qtrain_rules(name: str):
  common = dict(module_path=r".*")
  if name.endswith("_fixed"):  # its twin's rule with the constant activation scale
    fp8 = dict(weight_granularity="per_tensor") if "fp8" in name else {}
    return [dataclasses.replace(r, **_FIXED_ACT, **fp8) for r in qtrain_rules(name[:-len("_fixed")])]
  if name in ("qtrain_int8", "qtrain_int8_lowbit", "qtrain_int8_hash", "qtrain_int8_kernel",
              "qtrain_int8_cublas"):
    # _lowbit: 8-bit stochastic-rounding noise (a quarter of the PRNG work); _hash: the same
    # 8 bits from a keyed integer hash instead of the PRNG;
    # _kernel: also every quantized product forced onto the Pallas int8
    # kernel (bf16 written by its epilogue instead of XLA's int32 + convert).
    # _cublas: "auto" without the Mosaic GEMM (every product on XLA's cuBLAS int8 GEMM).
    sr = {"qtrain_int8": "uniform", "qtrain_int8_hash": "low_bit_hash"}.get(name, "low_bit_uniform")
    impl = "triton" if name == "qtrain_int8_kernel" else "auto"
    return [qtrain.QtRule(**common, weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                          bwd_stochastic_rounding=sr, implementation=impl)]
  if name == "qtrain_int8_fwd":
    return [qtrain.QtRule(**common, weight_qtype="int8", act_qtype="int8")]
  if name in ("qtrain_fp8", "qtrain_fp8_lowbit", "qtrain_fp8_hash", "qtrain_fp8_nosr",
              "qtrain_fp8_nosr_xla"):
    # _nosr: round-to-nearest e5m2 gradients (what qwix's fp8 rule does);
    # _xla: operand layouts left to XLA (no Pallas GEMM-layout transposes).
    sr = {"qtrain_fp8": "uniform", "qtrain_fp8_lowbit": "low_bit_uniform",
          "qtrain_fp8_hash": "low_bit_hash"}.get(name)
    impl = "xla" if name.endswith("_xla") else "auto"
    return [qtrain.QtRule(**common, weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn",
                          bwd_qtype="float8_e5m2", bwd_stochastic_rounding=sr,
                          implementation=impl)]
  if name in ("qtrain_binary", "qtrain_binary_g8"):
    # _g8: the backward products int8 too (the gradient quantized, the residuals' +-1 codes as
    # int8), where qtrain_binary multiplies the float gradient by the dequantized residuals.
    bwd = (dict(bwd_qtype="int8", bwd_stochastic_rounding="low_bit_hash")
           if name == "qtrain_binary_g8" else {})
    return [qtrain.QtRule(**common, weight_qtype="binary", act_qtype="binary",
                          weight_calibration_method="absmean", act_calibration_method="absmean",
                          **bwd)]
  raise ValueError(name)


def qwix_model(model, name):
  import qwix  # carried as a wheel
  if name == "qwix_int8":
    rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                       bwd_stochastic_rounding="uniform")
  elif name == "qwix_int8_fwd":
    rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
  elif name == "qwix_fp8":
    rule = qwix.QtRule(module_path=".*", weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn",
                       bwd_qtype="float8_e5m2")
  else:
    raise ValueError(name)
  return qwix.quantize_model(model, qwix.QtProvider([rule]))


def build(name, width, hidden):
  """Returns (model, name of the RNG stream its stochastic rounding draws from, or None)."""
  model = MLP(width, hidden)
  if name == "bf16":
    return model, None
  if name.startswith("qwix"):
    return qwix_model(model, name), "stochastic_rounding" if name == "qwix_int8" else None
  return qtrain.quantize_model(model, qtrain.QtProvider(qtrain_rules(name))), qtrain.RNG_STREAM


@dataclasses.dataclass(frozen=True)
class StepSetup:
  """One config's benchmark inputs: initial params and optimizer state, the data
  (passed to the jitted step as arguments, never closed over: XLA would
  constant-fold the first layer's input quantization), and one SGD step."""
  params: Any
  opt_state: Any
  x: jax.Array
  target: jax.Array
  step: Callable  # (params, opt_state, key, x, target) -> (params, opt_state)
  loss_fn: Callable  # (params, key, x, target) -> scalar


def setup(name, width, hidden, tokens) -> StepSetup:
  model, stream = build(name, width, hidden)
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (tokens, width), jnp.bfloat16)
  target = jax.random.normal(kt, (tokens, width), jnp.bfloat16)
  rngs = {"params": kp, stream: kp} if stream else {"params": kp}
  variables = model.init(rngs, x)
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}
  tx = optax.sgd(1e-4)

  def loss_fn(p, key, x, target):
    kw = {"rngs": {stream: key}} if stream else {}
    y = model.apply({"params": p, **rest}, x, **kw)
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))

  def step(p, s, key, x, target):
    _, g = jax.value_and_grad(loss_fn)(p, key, x, target)
    upd, s = tx.update(g, s, p)
    return optax.apply_updates(p, upd), s

  return StepSetup(params=params, opt_state=tx.init(params), x=x, target=target, step=step,
                   loss_fn=loss_fn)


@contextlib.contextmanager
def gemm_threshold(name):
  """``*_cublas`` configs trace with the Mosaic GEMM off (its AUTO_GEMM_MIN_M raised)."""
  saved = mosaic_backend.AUTO_GEMM_MIN_M
  if name.endswith("_cublas"):
    mosaic_backend.AUTO_GEMM_MIN_M = 1 << 62
  try:
    yield
  finally:
    mosaic_backend.AUTO_GEMM_MIN_M = saved


def time_config(name, width, hidden, tokens, steps, repeats):
  with gemm_threshold(name):
    return _time_config(name, width, hidden, tokens, steps, repeats)


def _time_config(name, width, hidden, tokens, steps, repeats):
  su = setup(name, width, hidden, tokens)
  params, opt_state, x, target, loss_fn = su.params, su.opt_state, su.x, su.target, su.loss_fn

  @jax.jit
  def run(p, s, key, x, target):
    def one_step(i, carry):
      p, s, key = carry
      key, sub = jax.random.split(key)
      return (*su.step(p, s, sub, x, target), key)
    return jax.lax.fori_loop(0, steps, one_step, (p, s, key))

  key = jax.random.key(1)
  out = run(params, opt_state, key, x, target)  # compile + warm up
  jax.block_until_ready(out)
  times = []
  for r in range(repeats):
    t0 = time.perf_counter()
    out = run(params, opt_state, jax.random.key(2 + r), x, target)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / steps * 1e3)
  final_loss = float(jax.jit(loss_fn)(out[0], key, x, target))
  return statistics.median(times), final_loss


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--widths", default="1024,4096", help="model widths D (comma-separated; F = 4 D)")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens T per step")
  ap.add_argument("--steps", type=int, default=10, help="steps inside one jit")
  ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
  ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                  help="comma-separated; " + "; ".join(f"{k}: {v}" for k, v in CONFIGS.items()))
  _record.add_arguments(ap)
  args = ap.parse_args()
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
  widths = [int(v) for v in args.widths.split(",")]
  rec = _record.Recorder("train_step", dict(tokens=args.tokens, steps=args.steps,
                                            repeats=args.repeats, widths=widths),
                         out_dir=args.out_dir, results=args.results)
  rows = []
  for w in widths:
    base = None
    for name in names:
      row = dict(config=name, D=w, F=4 * w, T=args.tokens)
      try:
        ms, loss = time_config(name, w, 4 * w, args.tokens, args.steps, args.repeats)
      except Exception as e:  # report, keep going: one config failing must not hide the others
        print(f"{name} D={w}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append(dict(row, ms=None, vs_bf16=None, loss=None,
                         error=f"{type(e).__name__}: {str(e)[:200]}"))
        rec.write(rows)
        continue
      if name == "bf16":
        base = ms
      sp = base / ms if base else None
      rows.append(dict(row, ms=ms, vs_bf16=sp, loss=loss))
      print(f"{name:18s} D={w:5d} {ms:9.3f} ms/step  {sp if sp else float('nan'):5.2f}x  loss {loss:.4f}",
            flush=True)
      rec.write(rows)  # after every config: a timeout keeps what was measured
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}: T={args.tokens}, "
        f"{args.steps} steps in one jit, median of {args.repeats}\n")
  print("| config | D | F | ms/step | vs bf16 | final loss |\n|---|---|---|---|---|---|")
  for r in rows:
    if r["ms"] is None:
      print(f"| {r['config']} | {r['D']} | {r['F']} | failed: {r['error']} | | |")
    else:
      sp = f"{r['vs_bf16']:.2f}x" if r["vs_bf16"] else "n/a"
      print(f"| {r['config']} | {r['D']} | {r['F']} | {r['ms']:.3f} | {sp} | {r['loss']:.4f} |")
  rec.finish(rows)


if __name__ == "__main__":
  main()
