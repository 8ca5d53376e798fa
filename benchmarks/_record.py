"""What every maintained benchmark does at the end of a run: a JSON record and the current table.

A run writes one JSON file, ``benchmarks/records/<benchmark>-<date>-<device>-<seq>.json``::

  {"benchmark": "kernels", "seq": 12,
   "meta": {date, recorded, device, platform, versions, command, git_commit, git_dirty, ...},
   "rows": [{...every figure of one case...}, ...]}

``seq`` orders the runs of one benchmark (the next run gets the largest ``seq`` so far
plus one). ``benchmarks/RESULTS.md`` holds, between ``<!-- begin:<benchmark> -->`` and
``<!-- end:<benchmark> -->``, a table rebuilt from every GPU record of that benchmark:
one row per case (a kernel x shape x M, a training-step config x width, a language-model
config x d_model x sequence length) with the figures of its latest run, its ratios to the
baselines measured in that same run (XLA bf16 and XLA int8 for a kernel; bf16 and the qwix
config of the same qtypes for a training step; bf16 for a language-model step), and that
run's record, date, device and jax version; the commands are listed under each table. Each
row starts with an anchor (:func:`kernel_anchor`, :func:`step_anchor`, :func:`lm_anchor`)
that README.md and docs/ link to. A table with no GPU record yet reads "No GPU run yet.".
Text outside the markers is left as it is.

RESULTS.md holds GPU figures only: a run on another platform writes its record (by
default to a temporary directory) and leaves RESULTS.md alone, and records whose
platform is not "gpu" never enter a table. Nor do runs made under ``XLA_FLAGS`` (kept in
their record's ``meta["xla_flags"]``): the tables compare configs under XLA's defaults, and
docs cite a flagged run by its record.

On a machine whose ``benchmarks/`` does not come back (a lent GPU machine), run with
``--out-dir $OUT`` and add the records here afterwards, which also rebuilds the tables:

  python3 benchmarks/_record.py add /path/to/kernels-2026-11-24-nvidia-h200.json
  python3 benchmarks/_record.py render     # rebuild every table from benchmarks/records/
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RECORDS_DIR = os.path.join(HERE, "records")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
_VERSIONED = ("jax", "jaxlib", "flax", "optax", "qwix", "numpy")


# ---------------------------------------------------------------------------------------------
# Run metadata and record files


def device_slug(device: str) -> str:
  """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (for file names).

  >>> device_slug("NVIDIA H200")
  'nvidia-h200'
  """
  return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def _versions() -> dict:
  out = {"python": sys.version.split()[0]}
  for name in _VERSIONED:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _git(*args: str) -> str | None:
  try:
    res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  return res.stdout.strip() if res.returncode == 0 else None


def run_meta(**extra) -> dict:
  """The facts every record carries, plus the benchmark's own (``extra``).

  The git commit comes from ``git`` in the repository, else from the environment
  variable ``QTRAIN_GIT_COMMIT`` (a copied work tree without ``.git``), else None.
  """
  import jax  # only here: `_record.py render` needs no jax
  dev = jax.devices()[0]
  now = datetime.datetime.now(datetime.timezone.utc)
  commit = _git("rev-parse", "HEAD") or os.environ.get("QTRAIN_GIT_COMMIT") or None
  dirty = _git("status", "--porcelain", "--untracked-files=no")
  meta = dict(date=now.date().isoformat(), recorded=now.isoformat(timespec="seconds"),
              device=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
              versions=_versions(), command="python3 " + shlex.join(sys.argv),
              git_commit=commit, git_dirty=None if dirty is None else bool(dirty))
  if os.environ.get("XLA_FLAGS"):  # XLA's options change what a figure measures
    meta["xla_flags"] = os.environ["XLA_FLAGS"]
  meta.update(extra)
  return meta


def load_records(records_dir: str = RECORDS_DIR, benchmark: str | None = None) -> list[dict]:
  """Every record in ``records_dir`` (of ``benchmark`` if given), oldest first, each with
  its file name under ``"file"``."""
  out = []
  for path in glob.glob(os.path.join(records_dir, "*.json")):
    with open(path) as f:
      rec = json.load(f)
    if not isinstance(rec, dict) or "benchmark" not in rec or "seq" not in rec:
      raise ValueError(f"{path}: not a benchmark record (needs 'benchmark' and 'seq')")
    if benchmark is None or rec["benchmark"] == benchmark:
      rec["file"] = os.path.basename(path)
      out.append(rec)
  return sorted(out, key=lambda r: (r["seq"], r["file"]))


def _next_seq(benchmark: str, dirs: Iterable[str]) -> int:
  seqs = [r["seq"] for d in dirs if os.path.isdir(d) for r in load_records(d, benchmark)]
  return max(seqs, default=0) + 1


def record_name(benchmark: str, date: str, device: str, seq: int) -> str:
  """The record's file name.

  >>> record_name("kernels", "2026-11-22", "NVIDIA H200", 7)
  'kernels-2026-11-22-nvidia-h200-7.json'
  """
  return f"{benchmark}-{date}-{device_slug(device)}-{seq}.json"


def _same_dir(a: str, b: str) -> bool:
  return os.path.realpath(a) == os.path.realpath(b)


class Recorder:
  """One run's record: ``write(rows)`` as often as wanted (a run cut by a timeout keeps
  what it measured), then ``finish(rows)`` once, which also rebuilds the benchmark's
  table in RESULTS.md where that applies (a GPU run recorded into benchmarks/records/)."""

  def __init__(self, benchmark: str, meta: dict | None = None, *, out_dir: str | None = None,
               results: str | None = RESULTS_MD):
    self.benchmark = benchmark
    self.meta = run_meta(**(meta or {}))
    gpu = self.meta["platform"] == "gpu"
    if out_dir is None:  # non-GPU records stay out of the repository unless asked for
      out_dir = RECORDS_DIR if gpu else os.path.join(tempfile.gettempdir(), "qtrain-records")
    os.makedirs(out_dir, exist_ok=True)
    self.out_dir, self.results = out_dir, results
    self.seq = _next_seq(benchmark, {RECORDS_DIR, out_dir})
    self.path = os.path.join(out_dir, record_name(benchmark, self.meta["date"],
                                                  self.meta["device"], self.seq))

  def write(self, rows: list[dict]) -> str:
    with open(self.path, "w") as f:
      json.dump(dict(benchmark=self.benchmark, seq=self.seq, meta=self.meta, rows=rows), f,
                indent=1)
      f.write("\n")
    return self.path

  def finish(self, rows: list[dict]) -> str:
    self.write(rows)
    print(f"record: {self.path}", flush=True)
    if not self.results or self.benchmark not in TABLES:
      return self.path
    if self.meta["platform"] != "gpu":
      print(f"{self.results} not updated: this ran on {self.meta['platform']} "
            f"({self.meta['device']}); it holds GPU figures only.", flush=True)
    elif not _same_dir(self.out_dir, RECORDS_DIR):
      print(f"{self.results} not updated: the record is outside {RECORDS_DIR}. Add it with\n"
            f"  python3 benchmarks/_record.py add {self.path}", flush=True)
    else:
      render_results(self.results, RECORDS_DIR, [self.benchmark])
      print(f"{self.results}: table '{self.benchmark}' rebuilt", flush=True)
    return self.path


def record(benchmark: str, rows: list[dict], meta: dict | None = None, **kw) -> str:
  """Writes one run's record and rebuilds its table (see :class:`Recorder`); returns the path."""
  return Recorder(benchmark, meta, **kw).finish(rows)


def add_arguments(parser: argparse.ArgumentParser, results: bool = True) -> None:
  """The record flags every maintained benchmark takes (``--results`` where it has a table)."""
  parser.add_argument("--out-dir", default=None,
                      help="where the run's JSON record goes (default: benchmarks/records/ on a "
                           "GPU, a temporary directory elsewhere)")
  if results:
    parser.add_argument("--results", default=RESULTS_MD,
                        help="the RESULTS.md whose table a GPU run rebuilds ('' to leave it alone)")


# ---------------------------------------------------------------------------------------------
# The current tables


def _pct(v) -> str:
  return "" if v is None else f"{v:.0%}"


def _x(v) -> str:
  return "" if v is None else f"{v:.2f}x"


def _run_id(prefix: str, rec: dict) -> str:
  return f"{prefix}{rec['seq']}"


def _run_cells(prefix: str, rec: dict) -> str:
  """A row's last four cells: run (linked to its record), date, device, jax version."""
  m = rec["meta"]
  jax_version = (m.get("versions") or {}).get("jax") or ""
  return (f"[{_run_id(prefix, rec)}](records/{rec['file']}) | {m['date']} | {m['device']} | "
          f"{jax_version}")


def slug(text: str) -> str:
  """A row anchor's text: lower case, runs of other characters as one ``-``.

  >>> slug("int8 x int8"), slug("qtrain_int8_lowbit")
  ('int8-x-int8', 'qtrain-int8-lowbit')
  """
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def kernel_anchor(k: int, n: int, m: int, kernel: str) -> str:
  """The anchor of a kernel row (``RESULTS.md#<anchor>``).

  >>> kernel_anchor(8192, 28672, 16, "int8 x int8")
  'k-8192x28672-m16-int8-x-int8'
  """
  return f"k-{k}x{n}-m{m}-{slug(kernel)}"


def step_anchor(d: int, t: int, config: str) -> str:
  """The anchor of a training-step row (``RESULTS.md#<anchor>``).

  >>> step_anchor(4096, 8192, "qtrain_int8_lowbit")
  's-d4096-t8192-qtrain-int8-lowbit'
  """
  return f"s-d{d}-t{t}-{slug(config)}"


def lm_anchor(d: int, seq: int, config: str, embedding: str = "take") -> str:
  """The anchor of a language-model row (``RESULTS.md#<anchor>``); rows of the one-hot
  embedding's sections name it.

  >>> lm_anchor(2048, 2048, "qtrain_int8")
  'lm-d2048-s2048-qtrain-int8'
  >>> lm_anchor(2048, 2048, "qtrain_int8", "onehot")
  'lm-d2048-s2048-onehot-qtrain-int8'
  """
  emb = "" if embedding == "take" else f"{embedding}-"
  return f"lm-d{d}-s{seq}-{emb}{slug(config)}"


def _lm_embedding(row: dict) -> str:
  """A language-model row's token-embedding lookup (rows before the option: ``take``)."""
  return row.get("embedding", "take")


def _anchor(name: str) -> str:
  return f'<a id="{name}"></a>'


def _ratio_in_run(rec: dict, match: Callable[[dict], bool], value: float, field: str) -> str:
  """``baseline / value`` where ``rec`` has a row ``match`` picks (the same run's baseline)."""
  base = next((r.get(field) for r in rec["rows"]
               if match(r) and r.get("error") is None and r.get(field)), None)
  return "" if base is None or not value else _x(base / value)


def _runs_list(prefix: str, recs: list[dict]) -> list[str]:
  lines = ["", "Runs (each command as it was run):", ""]
  for rec in recs:
    m = rec["meta"]
    v = m.get("versions") or {}
    vers = ", ".join(f"{k} {v[k]}" for k in ("jax", "flax", "qwix") if v.get(k))
    if m.get("git_commit"):
      commit = "commit " + m["git_commit"][:10] + (" (uncommitted changes)" if m.get("git_dirty") else "")
    elif m.get("recorded_in"):
      commit = f"commit not recorded (figures committed in {m['recorded_in'][:10]})"
    else:
      commit = "commit not recorded"
    extra = []
    if m.get("copy_bw"):
      extra.append(f"copy bw {m['copy_bw'] / 1e12:.2f} TB/s")
    if m.get("bf16_peak"):
      extra.append(f"XLA bf16 peak {m['bf16_peak'] / 1e12:.0f} TFLOP/s")
    note = f" {m['note']}" if m.get("note") else ""
    lines.append(f"- **{_run_id(prefix, rec)}** · {m['date']} · {m['device']} · {vers} · "
                 f"{commit}{' · ' + ', '.join(extra) if extra else ''} · "
                 f"`{m.get('command') or 'command not recorded'}`{note}")
  return lines


def _latest(recs: list[dict], key: Callable[[dict], tuple]) -> dict:
  """case key -> (row, record) of the latest record measuring it (rows without a figure skipped)."""
  out = {}
  for rec in recs:  # oldest first: later runs overwrite
    for row in rec["rows"]:
      if row.get("error") is None and row.get("us", row.get("ms")) is not None:
        out[key(row)] = (row, rec)
  return out


_KERNEL_GROUP = (("xla bf16", 0), ("xla int8", 1), ("mosaic gemm", 4), ("mosaic", 3))


def _kernel_order(name: str) -> tuple:
  for prefix, group in _KERNEL_GROUP:
    if name.startswith(prefix):
      return (group, name)
  return (2, name)  # the Triton kernels


def _short_note(note: str | None) -> str:
  """The config part of a kernel row's note (the error is in the record).

  >>> _short_note("default config rows128 tk256 s4 sk1  err=1.7e-03")
  'rows128 tk256 s4 sk1'
  """
  note = re.sub(r"err=\S+|default config|best of default / no-triton-gemm", "", note or "")
  return " ".join(note.split())


def render_kernels(recs: list[dict]) -> str:
  """The kernel table: one row per (K, N) x M x kernel, from its latest run."""
  latest = _latest(recs, lambda r: (r["k"], r["n"], r["m"], r["kernel"]))
  shapes = sorted({(k, n) for k, n, _, _ in latest}, key=lambda s: (-s[0] * s[1], s))
  lines = ["## Kernels", "",
           "Each row is the latest run of that case; every ratio is against a baseline of the "
           "same shape and M measured in that same run. *vs XLA bf16*: XLA's bf16 `x @ w` (best "
           "of its default flags and `--xla_gpu_enable_triton_gemm=false`) over the kernel's "
           "time; *vs XLA int8*: XLA's int8 GEMM with int32 output and its scaling pass (the "
           "strongest XLA baseline; it quantizes the activations too) over the kernel's time; "
           "*of copy bw*: the weight stream (packed weights + scales) per second over the copy "
           "bandwidth measured in that run; *config*: the default config the kernel picked, "
           "where it says more than the kernel's name. The run's command is in the list under "
           "the tables.", ""]
  used = {}
  for k, n in shapes:
    lines += [f"### (K, N) = ({k}, {n})", "",
              "| M | kernel | µs | vs XLA bf16 | vs XLA int8 | of copy bw | config | run | date | "
              "device | jax |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    cases = sorted((key for key in latest if key[:2] == (k, n)),
                   key=lambda c: (c[2], _kernel_order(c[3])))
    for case in cases:
      row, rec = latest[case]
      used[rec["seq"]] = rec
      same = lambda r: (r["k"], r["n"], r["m"], r["kernel"]) == (k, n, row["m"], "xla int8")
      lines.append(f"| {_anchor(kernel_anchor(k, n, row['m'], row['kernel']))}{row['m']} | "
                   f"{row['kernel']} | {row['us']:.1f} | {_x(row.get('vs_xla_bf16'))} | "
                   f"{_ratio_in_run(rec, same, row['us'], 'us')} | "
                   f"{_pct(row.get('of_copy_bw'))} | {_short_note(row.get('note'))} | "
                   f"{_run_cells('k', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("k", [used[s] for s in sorted(used)]))


_STEP_ORDER = ("bf16", "qtrain_int8_lowbit", "qtrain_int8_hash", "qtrain_int8_cublas", "qtrain_int8",
               "qtrain_int8_kernel", "qtrain_int8_fwd", "qwix_int8", "qwix_int8_fwd",
               "qtrain_fp8_nosr", "qtrain_fp8_nosr_xla", "qtrain_fp8_lowbit", "qtrain_fp8_hash", "qtrain_fp8",
               "qwix_fp8", "qtrain_binary")


def _qwix_twin(config: str) -> str | None:
  """The qwix config a qtrain config is compared with (same qtypes), or None.

  >>> _qwix_twin("qtrain_int8_lowbit"), _qwix_twin("qtrain_fp8_nosr"), _qwix_twin("qwix_fp8")
  ('qwix_int8', 'qwix_fp8', None)
  """
  for qt in ("int8", "fp8"):
    if config.startswith(f"qtrain_{qt}"):
      return f"qwix_{qt}_fwd" if config.endswith("_fwd") else f"qwix_{qt}"
  return None


def render_train_step(recs: list[dict]) -> str:
  """The training-step table: one row per (tokens, width, config), from its latest run."""
  latest = _latest(recs, lambda r: (r["T"], r["D"], r["config"]))
  lines = ["## Training step", "",
           "Each row is the latest run of that case; every ratio is against a step of the same "
           "width measured in that same run. *vs bf16*: the bf16 step's time over this step's; "
           "*vs qwix*: the qwix step with the same qtypes (`qwix_int8` or `qwix_fp8`) over this "
           "step's. The run's command is in the list under the tables.", ""]
  used = {}
  for t, d in sorted({(t, d) for t, d, _ in latest}, key=lambda s: (-s[1], s[0])):
    f = next(row["F"] for (tt, dd, _), (row, _) in latest.items() if (tt, dd) == (t, d))
    lines += [f"### D = {d}, F = {f}, T = {t} tokens", "",
              "| config | ms/step | vs bf16 | vs qwix | final loss | run | date | device | jax |",
              "|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(_STEP_ORDER)}
    cases = sorted((c for c in latest if c[:2] == (t, d)),
                   key=lambda c: (order.get(c[2], len(order)), c[2]))
    for case in cases:
      row, rec = latest[case]
      used[rec["seq"]] = rec
      twin = _qwix_twin(row["config"])
      vs_qwix = "" if twin is None else _ratio_in_run(
          rec, lambda r: (r["T"], r["D"], r["config"]) == (t, d, twin), row["ms"], "ms")
      loss = "" if row.get("loss") is None else f"{row['loss']:.4f}".rstrip("0").rstrip(".")
      lines.append(f"| {_anchor(step_anchor(d, t, row['config']))}{row['config']} | "
                   f"{row['ms']:.3f} | {_x(row.get('vs_bf16'))} | {vs_qwix} | {loss} | "
                   f"{_run_cells('s', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("s", [used[s] for s in sorted(used)]))


_LM_ORDER = ("bf16", "qtrain_int8", "qtrain_int8_hash", "qwix_int8", "qtrain_fp8", "qwix_fp8", "qtrain_int4w",
             "qtrain_int4w_hash", "qtrain_w1a8", "qtrain_w1a8_hash")


def _gib(v) -> str:
  return "" if v is None else f"{v / 2**30:.2f}"


def _lm_loss(row: dict, rec: dict, timing_rec: dict) -> str:
  """A loss cell: held-out loss after N steps (``@N``), ``± std`` over seeds where there were
  several, and the run it comes from where that is not the row's timing run."""
  cell = f"{row['loss']:.4f}"
  if row.get("loss_std") is not None:
    cell += f" ± {row['loss_std']:.4f}"
  cell += f" @{row['loss_steps']}" if row.get("loss_steps") else ""
  if rec is not timing_rec:
    cell += f" ([{_run_id('lm', rec)}](records/{rec['file']}))"
  return cell


def _lm_shape(rows: list[dict]) -> str:
  """A section's model and batch, from its rows (several values where runs differed)."""
  def vals(field):
    return " / ".join(str(v) for v in sorted({r.get(field) for r in rows}, key=str))
  tokens = " / ".join(f"{v:,}" for v in sorted({r["tokens_per_step"] for r in rows}))
  return (f"layers {vals('layers')}, heads {vals('heads')}, batch {vals('batch')} "
          f"({tokens} tokens per step), attention {vals('attention')}")


def _sections(latest: dict, config_order: tuple[str, ...]) -> list[tuple[tuple, list[tuple]]]:
  """Cases ``(width, other, config)`` grouped by ``(width, other)``, widest first, configs in
  ``config_order`` (unknown ones last, by name)."""
  order = {name: i for i, name in enumerate(config_order)}
  return [(head, sorted((c for c in latest if c[:2] == head),
                        key=lambda c: (order.get(c[2], len(order)), c[2])))
          for head in sorted({c[:2] for c in latest}, key=lambda s: (-s[0], s[1]))]


def render_lm_step(recs: list[dict]) -> str:
  """The language-model table: one row per (d_model, seq, config), from its latest run; the
  loss from the latest run that measured one (the accuracy mode)."""
  case = lambda r: (r["d_model"], (r["seq"], _lm_embedding(r)), r["config"])
  latest = _latest(recs, case)
  losses = {}
  for rec in recs:  # oldest first: later runs overwrite
    for row in rec["rows"]:
      if row.get("error") is None and row.get("loss") is not None:
        losses[case(row)] = (row, rec)
  lines = ["## Language-model training step", "",
           "Each row is the latest run of that case; every ratio is against the bf16 step of the "
           "same width measured in that same run. *vs bf16*: this step's tokens/s over bf16's "
           "(peak memory and compile time: this config's over bf16's); *peak GiB*: the compiled "
           "training loop's arguments + outputs - donated aliases + temporaries "
           "(`memory_analysis()`); *compile s*: `lower` + `compile`; *loss*: the held-out loss "
           "after `@N` training steps, ± its standard deviation over seeds, from the latest "
           "accuracy-mode run (linked where that is not the row's run). The run's command is in "
           "the list under the table.", ""]
  used = {}
  for (d, (seq, emb)), cases in _sections(latest, _LM_ORDER):
    lines += [f"### d_model = {d}, seq {seq}: {_lm_shape([latest[c][0] for c in cases])}, "
              f"embedding {emb}", "",
              "| config | ms/step | tokens/s | vs bf16 | peak GiB | vs bf16 | compile s | vs bf16 | "
              "loss | run | date | device | jax |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
      row, rec = latest[c]
      used[rec["seq"]] = rec
      base = next((r for r in rec["rows"] if case(r) == (d, (seq, emb), "bf16")
                   and r.get("error") is None
                   and r.get("ms")), None)
      ratio = lambda field, inverse=False: "" if base is None or not base.get(field) or \
          row.get(field) is None else _x(base[field] / row[field] if inverse else
                                         row[field] / base[field])
      loss = ""
      if c in losses:
        lrow, lrec = losses[c]
        used[lrec["seq"]] = lrec
        loss = _lm_loss(lrow, lrec, rec)
      lines.append(f"| {_anchor(lm_anchor(d, seq, row['config'], emb))}{row['config']} | "
                   f"{row['ms']:.2f} | {row['tokens_per_s']:,.0f} | {ratio('ms', True)} | "
                   f"{_gib(row.get('mem_bytes'))} | {ratio('mem_bytes')} | {row['compile_s']:.1f} | "
                   f"{ratio('compile_s')} | {loss} | {_run_cells('lm', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("lm", [used[s] for s in sorted(used)]))


def conv_anchor(model: str, image: int, batch: int, config: str) -> str:
  """The anchor of a convolution training-step row.

  >>> conv_anchor("resnet18", 224, 64, "qtrain_int8")
  'c-resnet18-224-b64-qtrain-int8'
  """
  return f"c-{model}-{image}-b{batch}-{slug(config)}"


def render_conv_step(recs: list[dict]) -> str:
  """The convolution training-step table: one row per (model, image, batch, config)."""
  latest = _latest(recs, lambda r: (r["model"], r["image"], r["batch"], r["config"]))
  lines = ["## Convolution training step", "",
           "`benchmarks/conv_step.py`: a ResNet-18 step (bf16, batch norm in training mode, "
           "float stem and head, the residual stages' convolutions quantized). Each row is the "
           "latest run of that case; *vs bf16*: the bf16 step's time in that same run over this "
           "step's.", ""]
  used = {}
  for model, image, batch in sorted({c[:3] for c in latest}):
    lines += [f"### {model}, {image}x{image}, batch {batch}", "",
              "| config | ms/step | vs bf16 | compile s | loss | run | date | device | jax |",
              "|---|---|---|---|---|---|---|---|---|"]
    for case in sorted((c for c in latest if c[:3] == (model, image, batch)),
                       key=lambda c: (c[3] != "bf16", c[3])):
      row, rec = latest[case]
      used[rec["seq"]] = rec
      comp = "" if row.get("compile_s") is None else f"{row['compile_s']:.1f}"
      loss = "" if row.get("loss") is None else f"{row['loss']:.4f}"
      lines.append(f"| {_anchor(conv_anchor(model, image, batch, row['config']))}{row['config']} | "
                   f"{row['ms']:.2f} | {_x(row.get('vs_bf16'))} | {comp} | {loss} | "
                   f"{_run_cells('c', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("c", [used[s] for s in sorted(used)]))


def lora_anchor(d: int, rank: int, config: str) -> str:
  """The anchor of a LoRA fine-tuning row.

  >>> lora_anchor(2048, 16, "qlora_int4")
  'lora-d2048-r16-qlora-int4'
  """
  return f"lora-d{d}-r{rank}-{slug(config)}"


_LORA_ORDER = ("lora_bf16", "qlora_int8", "qlora_int4", "qlora_int4_triton", "full_bf16")


def render_lora_step(recs: list[dict]) -> str:
  """The LoRA / QLoRA fine-tuning table: one row per (d_model, rank, config)."""
  case = lambda r: (r["d_model"], r["rank"], r["config"])
  latest = _latest(recs, case)
  lines = ["## LoRA / QLoRA fine-tuning step", "",
           "`benchmarks/lora_step.py`: lm_step.py's decoder (bf16), adapters on every block "
           "`dot_general`, AdamW on the adapters alone (full_bf16: every parameter). Each row is "
           "the latest run of that case; ratios are against lora_bf16 in that same run. *base "
           "MiB*: the stored weights of the decoder blocks (packed codes and scales for QLoRA); "
           "*trainable MiB*: adapters + AdamW moments; *peak GiB*: the compiled loop's "
           "`memory_analysis()` (arguments + outputs - donated + temporaries); *loss*: the "
           "training loss after the timed steps.", ""]
  used = {}
  for (d, rank), cases in _sections(latest, _LORA_ORDER):
    r0 = latest[cases[0]][0]
    lines += [f"### d_model = {d}, rank {rank}: layers {r0['layers']}, seq {r0['seq']} x batch "
              f"{r0['batch']}, attention {r0['attention']}", "",
              "| config | ms/step | vs lora_bf16 | peak GiB | vs lora_bf16 | base MiB | "
              "trainable MiB | compile s | loss | run | date | device | jax |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
      row, rec = latest[c]
      used[rec["seq"]] = rec
      lines.append(f"| {_anchor(lora_anchor(d, rank, row['config']))}{row['config']} | "
                   f"{row['ms']:.2f} | {_x(row.get('vs_lora_bf16'))} | "
                   f"{_gib(row.get('mem_bytes'))} | {_x(row.get('mem_vs_lora_bf16'))} | "
                   f"{row['base_bytes'] / 2**20:.1f} | {row['trainable_bytes'] / 2**20:.1f} | "
                   f"{row['compile_s']:.1f} | {row['loss']:.4f} | {_run_cells('q', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("q", [used[s] for s in sorted(used)]))


def scaling_anchor(mode: str, d: int, config: str, devices: int) -> str:
  """The anchor of a weak-scaling row.

  >>> scaling_anchor("dp", 1024, "qtrain_int8_hash", 8)
  'w-dp-d1024-qtrain-int8-hash-x8'
  """
  return f"w-{mode}-d{d}-{slug(config)}-x{devices}"


def render_scaling(recs: list[dict]) -> str:
  """The weak-scaling table: one row per (mode, d_model, per-device batch, config, devices)."""
  case = lambda r: (r["mode"], r["d_model"], r["batch_per_device"], r["config"], r["devices"])
  latest = _latest(recs, case)
  lines = ["## Weak scaling", "",
           "`benchmarks/scaling.py`: lm_step.py's decoder trained on 1, 2, 4, ... devices of one "
           "host with the same batch per device (`jax.jit` + `NamedSharding`; dp: replicated "
           "parameters, fsdp: sharded ones). Each row is the latest run of that case; *scaling*: "
           "tokens/s over the device count times the same config's tokens/s on one device in "
           "that run; *vs bf16*: bf16's step time over this one's at the same device count.", ""]
  used = {}
  for mode, d, bpd in sorted({c[:3] for c in latest}):
    cases = sorted((c for c in latest if c[:3] == (mode, d, bpd)),
                   key=lambda c: (c[3] != "bf16", c[3], c[4]))
    r0 = latest[cases[0]][0]
    lines += [f"### {mode}, d_model = {d}: layers {r0['layers']}, seq {r0['seq']} x {bpd} per "
              "device", "",
              "| config | devices | ms/step | tokens/s | scaling | vs bf16 | run | date | device "
              "| jax |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
      row, rec = latest[c]
      used[rec["seq"]] = rec
      lines.append(f"| {_anchor(scaling_anchor(mode, d, row['config'], row['devices']))}"
                   f"{row['config']} | {row['devices']} | {row['ms']:.2f} | "
                   f"{row['tokens_per_s']:,.0f} | {_pct(row.get('scaling'))} | "
                   f"{_x(row.get('vs_bf16'))} | {_run_cells('w', rec)} |")
    lines.append("")
  return "\n".join(lines + _runs_list("w", [used[s] for s in sorted(used)]))


TABLES: dict[str, Callable[[list[dict]], str]] = {"kernels": render_kernels,
                                                   "train_step": render_train_step,
                                                   "lm_step": render_lm_step,
                                                   "conv_step": render_conv_step,
                                                   "lora_step": render_lora_step,
                                                   "scaling": render_scaling}
# What a table reads before its benchmark's first GPU run.
_EMPTY = {"kernels": "## Kernels", "train_step": "## Training step",
          "lm_step": "## Language-model training step",
          "conv_step": "## Convolution training step",
          "lora_step": "## LoRA / QLoRA fine-tuning step", "scaling": "## Weak scaling"}


def _markers(benchmark: str) -> tuple[str, str]:
  return (f"<!-- begin:{benchmark} (generated by benchmarks/_record.py; edit the records, "
          f"not this) -->", f"<!-- end:{benchmark} -->")


def replace_section(text: str, benchmark: str, body: str) -> str:
  """``text`` with the part between ``benchmark``'s markers replaced by ``body`` (markers
  appended at the end if absent); everything else unchanged.

  >>> t = "intro\\n<!-- begin:x (generated by benchmarks/_record.py; edit the records, not this) -->\\nold\\n<!-- end:x -->\\ntail\\n"
  >>> print(replace_section(t, "x", "new"))
  intro
  <!-- begin:x (generated by benchmarks/_record.py; edit the records, not this) -->
  new
  <!-- end:x -->
  tail
  <BLANKLINE>
  """
  begin, end = _markers(benchmark)
  block = f"{begin}\n{body.strip()}\n{end}"
  pattern = re.compile(re.escape(f"<!-- begin:{benchmark} ") + r".*?" + re.escape(end), re.S)
  if pattern.search(text):
    return pattern.sub(lambda _: block, text, count=1)
  return text.rstrip("\n") + "\n\n" + block + "\n"


def render_results(results: str = RESULTS_MD, records_dir: str = RECORDS_DIR,
                   benchmarks: Iterable[str] = tuple(TABLES)) -> None:
  """Rebuilds the named tables of ``results`` from the GPU records in ``records_dir``."""
  text = open(results).read() if os.path.exists(results) else "# Benchmark results\n"
  for name in benchmarks:
    recs = [r for r in load_records(records_dir, name)
            if r["meta"].get("platform") == "gpu" and not r["meta"].get("xla_flags")]
    body = TABLES[name](recs) if recs else f"{_EMPTY[name]}\n\nNo GPU run yet."
    text = replace_section(text, name, body)
  with open(results, "w") as f:
    f.write(text)


def add_records(paths: Iterable[str], records_dir: str = RECORDS_DIR,
                results: str | None = RESULTS_MD) -> list[str]:
  """Copies records into ``records_dir`` and rebuilds their tables; returns their paths there.

  A record already there (same meta and rows) is not copied twice; one whose ``seq`` another
  record there holds gets the next free ``seq`` (and the file name that goes with it).
  """
  added, names = [], set()
  for path in paths:
    with open(path) as f:
      rec = json.load(f)
    if not all(k in rec for k in ("benchmark", "seq", "meta", "rows")):
      raise ValueError(f"{path}: not a benchmark record (needs 'benchmark', 'seq', 'meta', 'rows')")
    rec.pop("file", None)
    there = load_records(records_dir, rec["benchmark"]) if os.path.isdir(records_dir) else []
    same = [r for r in there if (r["meta"], r["rows"]) == (rec["meta"], rec["rows"])]
    if same:
      dest = os.path.join(records_dir, same[0]["file"])
    else:
      if rec["seq"] in {r["seq"] for r in there}:
        rec["seq"] = max(r["seq"] for r in there) + 1
      os.makedirs(records_dir, exist_ok=True)
      dest = os.path.join(records_dir, record_name(rec["benchmark"], rec["meta"]["date"],
                                                   rec["meta"]["device"], rec["seq"]))
      with open(dest, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    added.append(dest)
    names.add(rec["benchmark"])
  if results:
    render_results(results, records_dir, sorted(n for n in names if n in TABLES))
  return added


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--records-dir", default=RECORDS_DIR)
  p.add_argument("--results", default=RESULTS_MD)
  sub = p.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("add", help="copy records into --records-dir and rebuild their tables")
  a.add_argument("paths", nargs="+")
  sub.add_parser("render", help="rebuild every table from --records-dir")
  args = p.parse_args(argv)
  if args.cmd == "add":
    for dest in add_records(args.paths, args.records_dir, args.results):
      print(dest)
  else:
    render_results(args.results, args.records_dir)
  print(f"rebuilt {args.results}")


if __name__ == "__main__":
  main()
