"""Weak scaling of quantized training: lm_step.py's decoder on 1, 2, 4, ... devices of one host.

Each device keeps the same per-device batch (``--batch-per-device`` sequences of ``--seq``
tokens), so the global batch grows with the device count: perfect weak scaling keeps the step
time and multiplies tokens/s by the device count. Per config and device count: ms/step
(``--steps`` AdamW steps inside one jit, median of ``--repeats``), tokens/s, *scaling* (tokens/s
over the device count times the same config's tokens/s on one device) and *vs bf16* (bf16's
step time over this config's, at the same device count). The model, configs, optimizer and
text are lm_step.py's (its docstring says what each config quantizes).

Parallelism (``--mode``), through ``jax.jit`` with ``NamedSharding`` over a 1-D ``data`` mesh;
each batch is constrained to be split along ``data``:

  dp    data parallel: parameters and optimizer state replicated; gradients all-reduced
  fsdp  parameters and optimizer state sharded along their first axis the device count
        divides (replicated where none does); XLA gathers each weight where it is used (the
        quantized configs' weights as their codes: tests/test_multidevice.py)

On a multi-GPU machine (every device of the host, powers of two from 1):

  python3 benchmarks/scaling.py --out-dir $OUT
  python3 benchmarks/scaling.py --mode fsdp --configs bf16,qtrain_int8_hash --out-dir $OUT

On a CPU (fake devices, tiny sizes; never into RESULTS.md):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 benchmarks/scaling.py \\
      --width 64 --layers 1 --seq 64 --batch-per-device 2 --steps 2 --repeats 1

Prints a markdown table, writes the run's JSON record after every case and, on a GPU with the
record in benchmarks/records/, rebuilds the ``scaling`` table of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _record  # noqa: E402
from benchmarks import lm_step  # noqa: E402

MODES = ("dp", "fsdp")
DEFAULT_CONFIGS = ("bf16", "qtrain_int8_hash", "qtrain_fp8")


def device_counts(spec: str, available: int) -> list[int]:
  """``"auto"``: 1, 2, 4, ... up to ``available``; else the comma-separated counts.

  >>> device_counts("auto", 8), device_counts("auto", 6), device_counts("1,3", 4)
  ([1, 2, 4, 8], [1, 2, 4], [1, 3])
  """
  if spec == "auto":
    out, n = [], 1
    while n <= available:
      out.append(n)
      n *= 2
    return out
  counts = [int(v) for v in spec.split(",") if v]
  bad = [n for n in counts if not 1 <= n <= available]
  if bad or not counts:
    raise ValueError(f"--devices {spec!r}: each count must be in [1, {available}] (the devices "
                     f"this host has); got {bad or counts}")
  return counts


def param_spec(shape: tuple[int, ...], n: int, mode: str) -> P:
  """The partition of one parameter: replicated (dp, or no axis divisible by ``n``), or split
  along its first axis ``n`` divides (fsdp).

  >>> [tuple(param_spec(s, 4, m)) for s, m in (((64, 256), "fsdp"), ((3, 8), "fsdp"), ((8,), "dp"))]
  [('data', None), (None, 'data'), ()]
  """
  if mode == "dp" or n == 1:
    return P()
  for axis, size in enumerate(shape):
    if size % n == 0 and size >= n:
      return P(*([None] * axis + ["data"] + [None] * (len(shape) - axis - 1)))
  return P()


def measure(name: str, shape: lm_step.Shape, n: int, mode: str, plan: lm_step.Plan,
            text: np.ndarray, params0) -> dict:
  mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
  place = lambda tree: jax.tree.map(
      lambda p: jax.device_put(p, NamedSharding(mesh, param_spec(p.shape, n, mode))), tree)
  params = place(params0)
  train = jax.device_put(jnp.asarray(text), NamedSharding(mesh, P()))
  prog = lm_step.build_program(name, shape, plan.optim, params, train,
                               data_sharding=NamedSharding(mesh, P("data")))
  fresh = lambda: (lm_step._fresh(params), jax.block_until_ready(plan.optim.init(params)))
  out = lm_step.run_loop(prog, *fresh(), train, jax.random.key(1), plan.steps)  # warm-up
  times = []
  for r in range(plan.repeats):
    p, s = fresh()
    t0 = time.perf_counter()
    out = lm_step.run_loop(prog, p, s, train, jax.random.key(2 + r), plan.steps)
    times.append((time.perf_counter() - t0) / plan.steps)
  ms = statistics.median(times) * 1e3
  return dict(ms=ms, tokens_per_s=shape.tokens / (ms / 1e3), compile_s=prog.lower_s +
              prog.xla_compile_s, timing_loss=float(out[2]))


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", default="auto",
                  help="device counts, comma-separated, or 'auto' (1, 2, 4, ... up to all)")
  ap.add_argument("--mode", default="dp", choices=MODES, help="dp or fsdp (see the docstring)")
  ap.add_argument("--width", type=int, default=1024, help="d_model")
  ap.add_argument("--layers", type=int, default=0, help="decoder blocks (0: lm_step's auto)")
  ap.add_argument("--head-dim", type=int, default=128, help="attention head size")
  ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
  ap.add_argument("--batch-per-device", type=int, default=4, help="sequences per device per step")
  ap.add_argument("--attention", default="auto", choices=lm_step.ATTENTIONS)
  ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                  help="comma-separated lm_step.py configs (bf16 is the baseline)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps inside one jit")
  ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
  ap.add_argument("--text", default=None, help="as lm_step.py's --text")
  ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
  _record.add_arguments(ap)
  args = ap.parse_args(argv)
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in lm_step.CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(lm_step.CONFIGS)}")
  if "bf16" in names:
    names = ["bf16"] + [c for c in names if c != "bf16"]
  try:
    counts = device_counts(args.devices, jax.device_count())
  except ValueError as e:
    ap.error(str(e))
  if min(args.steps, args.repeats, args.batch_per_device, args.seq) < 1:
    ap.error("--steps, --repeats, --batch-per-device and --seq must be >= 1")
  layers = args.layers or lm_step.auto_layers(args.width)
  heads = lm_step.heads_for(args.width, args.head_dim)
  attention = lm_step.resolve_attention(args.attention, heads, min(args.width, args.head_dim),
                                        args.seq)
  text = lm_step.load_text(args.text, args.seq + 1, accuracy=False)
  plan = lm_step.Plan(steps=args.steps, repeats=args.repeats,
                      optim=lm_step.Optim(lr=args.lr, schedule_steps=200), loss_steps=200,
                      loss_seeds=0, eval_windows=0)
  rec = _record.Recorder("scaling", dict(
      mode=args.mode, device_counts=counts, d_model=args.width, layers=layers,
      head_dim=args.head_dim, seq=args.seq, batch_per_device=args.batch_per_device,
      attention=attention, steps=args.steps, repeats=args.repeats,
      optimizer=plan.optim.describe(), text=text.source), out_dir=args.out_dir,
      results=args.results)
  print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"{args.mode}, d_model {args.width}, {layers} layers, seq {args.seq} x "
        f"{args.batch_per_device} per device", flush=True)
  rows: list[dict] = []
  one: dict[str, float] = {}
  for n in counts:
    shape = lm_step.Shape(width=args.width, layers=layers, heads=heads, seq=args.seq,
                          batch=args.batch_per_device * n, attention=attention)
    params0 = lm_step.init_params(shape, 0)
    base = None
    for name in names:
      row = dict(config=name, devices=n, mode=args.mode, d_model=args.width, layers=layers,
                 seq=args.seq, batch=shape.batch, batch_per_device=args.batch_per_device,
                 tokens_per_step=shape.tokens)
      try:
        with warnings.catch_warnings():
          warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
          fig = measure(name, shape, n, args.mode, plan, text.train, params0)
      except Exception as e:  # report, keep going
        print(f"{name} x{n}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        # A partitioner callback's error carries the Python traceback inside the message: its
        # end names the cause.
        print(f"  ... {str(e)[-2000:]}", file=sys.stderr, flush=True)
        rows.append(dict(row, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}"))
        rec.write(rows)
        continue
      if n == counts[0] == 1:
        one[name] = fig["tokens_per_s"]
      if name == "bf16":
        base = fig
      row.update(fig, scaling=(fig["tokens_per_s"] / (n * one[name]) if name in one else None),
                 vs_bf16=(base["ms"] / fig["ms"] if base else None))
      rows.append(row)
      print(f"{name:17s} x{n:<2d} {fig['ms']:9.2f} ms/step {fig['tokens_per_s']:12,.0f} tok/s  "
            f"scaling {lm_step._fmt(row['scaling'], '.2f')}  vs bf16 "
            f"{lm_step._fmt(row['vs_bf16'], '.2f')}x  compile {fig['compile_s']:.1f} s", flush=True)
      rec.write(rows)
  print("\n| config | devices | ms/step | tokens/s | scaling | vs bf16 |\n|---|---|---|---|---|---|")
  for r in rows:
    if r["ms"] is None:
      print(f"| {r['config']} | {r['devices']} | {r['error']} | | | |")
      continue
    print(f"| {r['config']} | {r['devices']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | "
          f"{lm_step._fmt(r['scaling'], '.2f')} | {lm_step._fmt(r['vs_bf16'], '.2f')}x |")
  rec.finish(rows)
  return rows


if __name__ == "__main__":
  main()
