"""Compile time of one training step: a small GPT-style decoder, float vs quantized training.

The model: ``--layers`` pre-LayerNorm blocks of flax's own ``nn.MultiHeadDotProductAttention``
(causal) and a ``Dense -> gelu -> Dense`` MLP, d_model ``--width``, an embedding and a
``Dense`` head; AdamW; one ``value_and_grad`` step under ``jax.jit``. Per config: the seconds
``lower`` (tracing included) and ``compile`` take and the compiled HLO module's line count, and
their ratios to the float model in the same run (issue 18's target: compile <= 1.5x float). The
float step is lowered once untimed first, so no config pays the process's one-time tracing costs.

  python benchmarks/compile_time.py                       # CPU: the record goes to a temp dir
  python benchmarks/compile_time.py --configs float,int8_sr_low --width 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qtrain  # noqa: E402
from benchmarks import _record  # noqa: E402

_INT8 = dict(module_path=".*", weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")
CONFIGS = {
    "float": None,
    "int8_nosr": [qtrain.QtRule(**_INT8)],
    "int8_sr_low": [qtrain.QtRule(**_INT8, bwd_stochastic_rounding="low_bit_uniform")],
    "int8_sr_hash": [qtrain.QtRule(**_INT8, bwd_stochastic_rounding="low_bit_hash")],
    "fp8": [qtrain.QtRule(module_path=".*", weight_qtype="float8_e4m3fn",
                          act_qtype="float8_e4m3fn", bwd_qtype="float8_e5m2")],
    "w1a8": [qtrain.QtRule(module_path=".*", weight_qtype="binary", act_qtype="int8")],
}


class Block(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class Decoder(nn.Module):
  width: int
  layers: int
  heads: int
  vocab: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width)(tokens)
    for _ in range(self.layers):
      x = Block(self.width, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def lower(rules, *, width: int, layers: int, heads: int, vocab: int, batch: int, seq: int):
  """Builds the model (``rules``: None for float) and lowers its step: (seconds, lowered)."""
  model = Decoder(width, layers, heads, vocab)
  if rules is not None:
    model = qtrain.quantize_model(model, qtrain.QtProvider(rules))
  tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, vocab)
  params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]
  tx = optax.adamw(1e-3)

  def step(p, s, tokens, key):
    def loss(p):
      logits = model.apply({"params": p}, tokens, rngs={qtrain.RNG_STREAM: key})
      return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  t0 = time.perf_counter()
  lowered = jax.jit(step).lower(params, tx.init(params), tokens, jax.random.key(2))
  return time.perf_counter() - t0, lowered


def measure(rules, **shape):
  """(lower seconds, compile seconds, compiled HLO lines) of the step."""
  lower_s, lowered = lower(rules, **shape)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return lower_s, time.perf_counter() - t0, compiled.as_text().count("\n")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {list(CONFIGS)}")
  ap.add_argument("--width", type=int, default=128)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=256)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=64)
  _record.add_arguments(ap, results=False)
  args = ap.parse_args()
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
  if "float" in names:  # the baseline first
    names = ["float"] + [n for n in names if n != "float"]
  shape = dict(width=args.width, layers=args.layers, heads=args.heads, vocab=args.vocab,
               batch=args.batch, seq=args.seq)
  rec = _record.Recorder("compile_time", shape, out_dir=args.out_dir, results=None)
  rows, base = [], None
  lower(None, **shape)  # warm-up: the process's first trace, untimed
  print("| config | lower s | vs float | compile s | vs float | HLO lines | vs float |\n"
        "|---|---|---|---|---|---|---|")
  for name in names:
    lower_s, compile_s, lines = measure(CONFIGS[name], **shape)
    if name == "float":
      base = (lower_s, compile_s, lines)
    row = dict(config=name, lower_s=lower_s, compile_s=compile_s, hlo_lines=lines,
               lower_vs_float=lower_s / base[0] if base else None,
               compile_vs_float=compile_s / base[1] if base else None,
               hlo_vs_float=lines / base[2] if base else None)
    rows.append(row)
    rec.write(rows)
    ratio = lambda v: f"{v:.2f}x" if v else ""
    print(f"| {name} | {lower_s:.2f} | {ratio(row['lower_vs_float'])} | {compile_s:.2f} "
          f"| {ratio(row['compile_vs_float'])} | {lines} | {ratio(row['hlo_vs_float'])} |",
          flush=True)
  rec.finish(rows)


if __name__ == "__main__":
  main()
