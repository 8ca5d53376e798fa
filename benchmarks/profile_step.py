"""Where a training step spends its GPU time: per-kernel totals from a JAX profile.

Builds the same MLP step as :mod:`benchmarks.train_step` for each config, runs
it once (compile), then records ``--steps`` steps with ``jax.profiler.trace``
and sums the GPU kernel time per kernel name (XLA fusion / GEMM / Pallas
kernel). Prints the top kernels per config and writes them all to the run's JSON
record (benchmarks/_record.py; no RESULTS.md table: group the kernels by kind by hand).

  python3 benchmarks/profile_step.py --widths 4096 --tokens 8192 \
      --configs bf16,qtrain_int8_lowbit --out-dir $OUT [--hlo-dir $OUT/hlo]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step  # noqa: E402
from benchmarks import _record  # noqa: E402


def _kernel_totals(trace_dir: str) -> dict:
  """Sums durations (µs) of device-side events in the perfetto trace, per (line, name).

  A GPU device in the trace has several lines (threads): the CUDA streams with
  the kernels, and XLA's op/module lines that repeat the same time under HLO
  names; they are kept apart (``line -> {name: µs}``).
  """
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
  with gzip.open(files[0], "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  meta = {(e.get("pid"), e.get("tid"), e["name"]): e.get("args", {}).get("name", "")
          for e in events if e.get("ph") == "M"}
  pid_names = {p: n for (p, _, k), n in meta.items() if k == "process_name"}
  gpu_pids = {p for p, n in pid_names.items() if "GPU" in n or "gpu" in n}
  lines = collections.defaultdict(lambda: collections.defaultdict(float))
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
      line = f"{pid_names[e['pid']]}/{meta.get((e['pid'], e.get('tid'), 'thread_name'), e.get('tid'))}"
      lines[line][e["name"]] += float(e["dur"])
  if not lines:
    raise RuntimeError(f"no GPU events in the trace; processes: {sorted(pid_names.values())}")
  return {k: dict(v) for k, v in lines.items()}


def profile_config(name: str, width: int, tokens: int, steps: int, hlo_dir: str = "") -> dict:
  su = train_step.setup(name, width, 4 * width, tokens)
  params, s, x, target = su.params, su.opt_state, su.x, su.target
  step = jax.jit(su.step)
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    text = step.lower(params, s, jax.random.key(1), x, target).compile().as_text()
    with gzip.open(os.path.join(hlo_dir, f"{name}-D{width}.hlo.txt.gz"), "wt") as f:
      f.write(text)
  out = step(params, s, jax.random.key(1), x, target)
  jax.block_until_ready(out)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for i in range(steps):
        out = step(out[0], out[1], jax.random.key(2 + i), x, target)
      jax.block_until_ready(out)
    lines = _kernel_totals(d)
  out_lines = {}
  for line, totals in lines.items():
    per_step = {k: v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out_lines[line] = dict(us_per_step=sum(per_step.values()), kernels=per_step)
  return dict(config=name, width=width, tokens=tokens, lines=out_lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--widths", default="4096", help="model widths D (comma-separated; F = 4 D)")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens T per step")
  ap.add_argument("--steps", type=int, default=3, help="profiled steps")
  ap.add_argument("--configs", default="bf16,qtrain_int8_lowbit",
                  help=f"comma-separated, as benchmarks/train_step.py: {', '.join(train_step.CONFIGS)}")
  ap.add_argument("--top", type=int, default=40, help="kernels printed per config")
  ap.add_argument("--hlo-dir", default="", help="write each config's optimized HLO (gzipped) here")
  _record.add_arguments(ap, results=False)
  args = ap.parse_args()
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in train_step.CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(train_step.CONFIGS)}")
  widths = [int(v) for v in args.widths.split(",")]
  rec = _record.Recorder("profile_step", dict(tokens=args.tokens, steps=args.steps,
                                              widths=widths), out_dir=args.out_dir)
  results = []
  for width in widths:
    for name in names:
      try:
        r = profile_config(name, width, args.tokens, args.steps, args.hlo_dir)
      except Exception as e:  # keep going: one config failing must not hide the others
        print(f"{name} D={width}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        results.append(dict(config=name, width=width, tokens=args.tokens,
                            error=f"{type(e).__name__}: {str(e)[:200]}"))
        continue
      results.append(r)
      for line, v in r["lines"].items():
        print(f"\n== {name} D={width} [{line}]: {v['us_per_step'] / 1e3:.3f} ms per step",
              flush=True)
        for k, us in list(v["kernels"].items())[: args.top]:
          print(f"  {us / 1e3:8.3f} ms  {k[:110]}")
      rec.write(results)
  rec.finish(results)


if __name__ == "__main__":
  main()
