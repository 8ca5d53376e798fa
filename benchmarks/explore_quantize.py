"""Fused absmax + int8 quantization (qtrain.pallas.quantize) vs the XLA path, on the GPU.

Part 1, one gradient-sized array (8192, 16384) bf16: for a per-row and a
per-column scale, with and without a folded multiplier, round-to-nearest and
``low_bit_uniform`` stochastic rounding, a few tilings: time of the kernel and
of the XLA path (``qarray.quantize``), and a bit-for-bit comparison of their
int8 values and scales.

Part 2 (``--step``): the ``qtrain_int8_lowbit`` training step of
benchmarks/train_step.py with ``qtrain.pallas.quantize.AUTO_KERNEL`` off
(shipped) and on, twice each, side by side; the final loss must not change
(the kernel gives the same bits).

  PYTHONPATH=. python benchmarks/explore_quantize.py --step --json $OUT/quant.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from qtrain.pallas import quantize as pq  # noqa: E402


def part1(r: int, c: int, rows: list):
  x = jax.random.normal(jax.random.key(0), (r, c), jnp.bfloat16)
  key = jax.random.key(5)
  mults = {None: None, "row": jax.random.uniform(jax.random.key(1), (r, 1)) + 0.5,
           "col": jax.random.uniform(jax.random.key(2), (1, c)) + 0.5}
  for axis in (1, 0):
    for sr in (None, "low_bit_uniform"):
      for mname in (None, "row" if axis == 0 else "col"):
        m = mults[mname]
        kw = dict(axis=axis, mult=m, stochastic_rounding=sr, key=key if sr else None)
        ref_fn = jax.jit(lambda x: pq.quantize_int8_2d_reference(x, **kw))
        qr, sr_ = ref_fn(x)
        t_xla = _timing.time_in_loop(lambda x: pq.quantize_int8_2d_reference(x, **kw), x)
        cfgs = [None] + ([pq.QuantizeConfig(block_r=4, block_c=2048, num_warps=8),
                          pq.QuantizeConfig(block_r=16, block_c=512, num_warps=8),
                          pq.QuantizeConfig(block_r=8, block_c=1024, num_warps=4)] if axis == 1 else
                         [pq.QuantizeConfig(block_r=32, block_c=256, num_warps=8),
                          pq.QuantizeConfig(block_r=128, block_c=64, num_warps=8),
                          pq.QuantizeConfig(block_r=64, block_c=128, num_warps=4)])
        for cfg in cfgs:
          name = f"axis={axis} sr={sr} mult={mname} cfg={cfg}"
          try:
            q, s = jax.jit(lambda x: pq.quantize_int8_2d(x, config=cfg, **kw))(x)
            same = bool(np.array_equal(np.asarray(q), np.asarray(qr))
                        and np.array_equal(np.asarray(s), np.asarray(sr_)))
            t = _timing.time_in_loop(lambda x: pq.quantize_int8_2d(x, config=cfg, **kw), x)
          except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
          gbs = r * c * 3 / t / 1e9  # read bf16 once + write int8 once
          rows.append(dict(axis=axis, sr=sr, mult=mname, cfg=str(cfg), kernel_us=t * 1e6,
                           xla_us=t_xla * 1e6, speedup=t_xla / t, same_bits=same, gbs=gbs))
          print(f"{name}: kernel {t * 1e6:8.1f} us ({gbs:6.0f} GB/s)  xla {t_xla * 1e6:8.1f} us  "
                f"{t_xla / t:5.2f}x  same bits: {same}", flush=True)


def part2(rows: list):
  import train_step  # noqa: PLC0415
  for flag in (False, True, False, True):
    pq.AUTO_KERNEL = flag
    ms, loss = train_step.time_config("qtrain_int8_lowbit", 4096, 16384, 8192, 10, 3)
    rows.append(dict(step="qtrain_int8_lowbit", fused_quantize=flag, ms=ms, loss=loss))
    print(f"step qtrain_int8_lowbit, fused quantize {flag}: {ms:.3f} ms  loss {loss:.4f}",
          flush=True)
  pq.AUTO_KERNEL = False


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--step", action="store_true")
  ap.add_argument("--no-part1", action="store_true")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
  rows: list = []
  try:
    if not args.no_part1:
      part1(8192, 16384, rows)
    if args.step:
      part2(rows)
  finally:
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
