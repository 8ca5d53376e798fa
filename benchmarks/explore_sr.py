"""Where the stochastic-rounding noise of a QT step goes: PRNG word sources, measured.

JAX's threefry (partitionable mode, the default) spends one full threefry2x32
hash per 32-bit word, and XLA splits its 20 rounds over several fusions that
materialize intermediate state. This script swaps the word source behind
:func:`qtrain.core.rounding._random_words` and measures, side by side in one
run:

1. the rounding pass alone: ``stochastic_round(y, int8, low_bit_uniform)`` of
   a (T, F) bf16 gradient, timed inside one jit (``_timing.time_in_loop``);
2. the whole int8 QT training step of ``benchmarks/train_step.py``
   (``qtrain_int8_lowbit``) with each source.

Sources: ``threefry`` (jax.random.bits, what qtrain ships), ``xla_threefry`` and
``xla_philox`` (XLA's RngBitGenerator, seeded by 4 threefry words of the key),
``hash`` (a murmur3-finalizer hash of (row, column, seed), fully fusible).

  PYTHONPATH=. python benchmarks/explore_sr.py --json /tmp/sr.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing  # noqa: E402
import train_step  # noqa: E402
from qtrain.core import qtypes, rounding  # noqa: E402

_SHIPPED = rounding._random_words


def _rbg(algorithm):
  def words(key, shape):
    seed = jax.random.bits(key, (4,), jnp.uint32)
    return lax.rng_bit_generator(seed, tuple(shape), dtype=jnp.uint32, algorithm=algorithm)[1]
  return words


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _hash_words(key, shape):
  shape = tuple(shape)
  s = jax.random.bits(key, (2,), jnp.uint32)
  if not shape:
    return _fmix32(s[0] ^ s[1])
  rows = lax.broadcasted_iota(jnp.uint32, shape, 0) if len(shape) > 1 else jnp.zeros(shape, jnp.uint32)
  for ax in range(1, len(shape) - 1):
    rows = rows * jnp.uint32(shape[ax]) + lax.broadcasted_iota(jnp.uint32, shape, ax)
  cols = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  h = _fmix32(rows * jnp.uint32(0x9E3779B1) ^ s[0])
  return _fmix32(h + cols * jnp.uint32(0x85EBCA77) + s[1])


SOURCES = {
    "threefry": _SHIPPED,
    "xla_threefry": _rbg(lax.RandomAlgorithm.RNG_THREE_FRY),
    "xla_philox": _rbg(lax.RandomAlgorithm.RNG_PHILOX),
    "hash": _hash_words,
}


def rounding_pass_us(rows: int, cols: int) -> float:
  y = jax.random.normal(jax.random.key(0), (rows, cols), jnp.bfloat16) * 30
  key = jax.random.key(1)
  qt = qtypes.get_qtype("int8")

  def f(y, key):
    return rounding.stochastic_round(y, qt, key, method="low_bit_uniform")
  return _timing.time_in_loop(f, y, key, unroll=4) * 1e6


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sources", default=",".join(SOURCES))
  ap.add_argument("--width", type=int, default=4096)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-step", action="store_true")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  rows = []
  for name in args.sources.split(","):
    rounding._random_words = SOURCES[name]
    try:
      us = rounding_pass_us(args.tokens, 4 * args.width)
      ms, loss = (None, None) if args.no_step else train_step.time_config(
          "qtrain_int8_lowbit", args.width, 4 * args.width, args.tokens, args.steps, args.repeats)
    finally:
      rounding._random_words = _SHIPPED
    rows.append(dict(source=name, rounding_us=us, step_ms=ms, loss=loss))
    print(f"{name:14s} rounding pass {us:9.1f} us   step {ms} ms   loss {loss}", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
