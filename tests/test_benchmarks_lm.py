"""Smoke tests of ``benchmarks/lm_step.py`` and its table in ``benchmarks/_record.py``.

The benchmark's main path runs at tiny sizes on the CPU (width 64, one layer, seq 64) on a
generated text written into ``tmp_path`` (nothing here reads ``../shared``); the table is
rendered from synthetic GPU records in temporary folders.
"""

from __future__ import annotations

import doctest
import json
import math
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a folder of scripts, importable from the repo root
  sys.path.insert(0, ROOT)

from benchmarks import _record  # noqa: E402


def _finite_positive(v) -> bool:
  return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@pytest.mark.slow
def test_lm_step_main_runs_tiny(tmp_path):
  from benchmarks import lm_step
  text = tmp_path / "text.txt"
  text.write_bytes(lm_step.generated_text(20_000))
  out = tmp_path / "records"
  rows = lm_step.main(["--widths", "64", "--layers", "1", "--seq", "64", "--batch", "2",
                       "--steps", "2", "--repeats", "1", "--configs", "bf16,qtrain_int8",
                       "--text", str(text), "--loss-seeds", "1", "--loss-steps", "2",
                       "--eval-batches", "1", "--out-dir", str(out), "--results", ""])
  files = sorted(os.listdir(out))
  assert len(files) == 1 and files[0].startswith("lm_step-"), files
  with open(out / files[0]) as f:
    rec = json.load(f)
  assert rec["benchmark"] == "lm_step" and rec["rows"] == json.loads(json.dumps(rows))
  assert rec["meta"]["text"].endswith("text.txt") and rec["meta"]["loss_seeds"] == 1
  assert [r["config"] for r in rec["rows"]] == ["bf16", "qtrain_int8"]
  for r in rec["rows"]:
    assert r.get("error") is None, r
    assert (r["d_model"], r["layers"], r["seq"], r["batch"], r["attention"]) == (64, 1, 64, 2, "flax")
    for field in ("ms", "tokens_per_s", "compile_s", "vs_bf16", "compile_vs_bf16"):
      assert _finite_positive(r[field]), (field, r)
    assert r["mem_bytes"] is None or _finite_positive(r["mem_bytes"])
    assert math.isfinite(r["timing_loss"]) and math.isfinite(r["loss"]) and r["loss"] > 0
    assert r["loss_steps"] == 2 and len(r["losses"]) == 1
  assert rec["rows"][0]["vs_bf16"] == 1.0


def test_lm_step_docstrings():
  from benchmarks import lm_step
  for mod in (lm_step, _record):
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0, mod.__name__


def _lm_row(config: str, ms: float, mem: int, compile_s: float, **extra) -> dict:
  row = dict(config=config, d_model=2048, layers=4, heads=16, seq=2048, batch=8,
             tokens_per_step=16384, attention="cudnn", ms=ms,
             tokens_per_s=16384 / (ms / 1e3) if ms else None, compile_s=compile_s, mem_bytes=mem,
             loss=None)
  return dict(row, **extra)


def _gpu_record(seq: int, rows: list[dict], command: str) -> dict:
  meta = dict(date="2026-11-26", recorded="2026-11-26T00:00:00+00:00", device="NVIDIA H100",
              platform="gpu", device_count=1, versions={"jax": "0.11.2", "flax": "0.12.10"},
              command=command, git_commit="0123456789abcdef", git_dirty=False)
  return dict(benchmark="lm_step", seq=seq, meta=meta, rows=rows)


def test_lm_table_renders_gpu_records(tmp_path):
  records = tmp_path / "records"
  records.mkdir()
  timing = _gpu_record(1, [_lm_row("bf16", 100.0, 40 << 30, 20.0),
                           _lm_row("qtrain_int8", 76.9, 30 << 30, 50.0),
                           dict(_lm_row("qwix_int8", 0, 0, 0), ms=None, error="skipped: no qwix")],
                       "python3 benchmarks/lm_step.py --widths 2048")
  loss = _gpu_record(2, [_lm_row("bf16", 101.0, 40 << 30, 21.0, loss=1.5, loss_std=0.01,
                                 loss_steps=200),
                         _lm_row("qtrain_fp8", 80.0, 32 << 30, 45.0, loss=1.52, loss_steps=200)],
                     "python3 benchmarks/lm_step.py --widths 2048 --loss-seeds 3")
  # A CPU record never enters the table.
  cpu = dict(_gpu_record(3, [_lm_row("qtrain_int8", 1.0, 1, 1.0)], "cpu run"))
  cpu["meta"] = dict(cpu["meta"], platform="cpu")
  # Nor does a later run under XLA_FLAGS (the tables compare configs under XLA's defaults).
  flagged = dict(_gpu_record(4, [_lm_row("qtrain_int8", 2.0, 1, 1.0)], "flagged run"))
  flagged["meta"] = dict(flagged["meta"], xla_flags="--xla_gpu_enable_triton_gemm=false")
  for name, rec in (("a.json", timing), ("b.json", loss), ("c.json", cpu), ("d.json", flagged)):
    (records / name).write_text(json.dumps(rec))
  results = tmp_path / "RESULTS.md"
  results.write_text("# Results\n\nintro\n")
  _record.render_results(str(results), str(records), ["lm_step"])
  text = results.read_text()
  assert text.startswith("# Results\n\nintro\n")
  assert "<!-- begin:lm_step " in text and "<!-- end:lm_step -->" in text
  row = next(l for l in text.splitlines() if 'id="lm-d2048-s2048-qtrain-int8"' in l)
  cells = [c.strip() for c in row.split("|")[1:-1]]
  # config, ms/step, tokens/s, vs bf16, peak GiB, vs bf16, compile s, vs bf16, loss, run, ...
  assert cells[1:9] == ["76.90", f"{16384 / 0.0769:,.0f}", "1.30x", "30.00", "0.75x", "50.0", "2.50x", ""]
  assert cells[9] == "[lm1](records/a.json)" and cells[10:] == ["2026-11-26", "NVIDIA H100", "0.11.2"]
  # bf16's timing from its latest run (lm2), the loss from the same run; fp8's loss without seeds.
  bf16 = next(l for l in text.splitlines() if 'id="lm-d2048-s2048-bf16"' in l)
  assert "| 101.00 |" in bf16 and "| 1.5000 ± 0.0100 @200 |" in bf16
  fp8 = next(l for l in text.splitlines() if 'id="lm-d2048-s2048-qtrain-fp8"' in l)
  assert "| 1.5200 @200 |" in fp8 and "1.26x" in fp8
  assert 'id="lm-d2048-s2048-qwix-int8"' not in text  # a skipped config has no row
  assert "### d_model = 2048, seq 2048: layers 4, heads 16, batch 8 (16,384 tokens per step), " \
         "attention cudnn" in text
  assert "**lm1**" in text and "**lm2**" in text and "cpu run" not in text
  assert "flagged run" not in text


def test_lm_table_keys_sections_by_embedding(tmp_path):
  """A one-hot-embedding run gets its own section and anchors; each row's ratio is against the
  bf16 of its own embedding (records before the option count as ``take``)."""
  records = tmp_path / "records"
  records.mkdir()
  take = _gpu_record(1, [_lm_row("bf16", 100.0, 40 << 30, 20.0),
                         _lm_row("qtrain_int8", 80.0, 40 << 30, 40.0)], "take run")
  onehot = _gpu_record(2, [_lm_row("bf16", 90.0, 40 << 30, 20.0, embedding="onehot"),
                           _lm_row("qtrain_int8", 60.0, 40 << 30, 30.0, embedding="onehot")],
                       "onehot run")
  for name, rec in (("a.json", take), ("b.json", onehot)):
    (records / name).write_text(json.dumps(rec))
  results = tmp_path / "RESULTS.md"
  results.write_text("# Results\n")
  _record.render_results(str(results), str(records), ["lm_step"])
  lines = results.read_text().splitlines()
  heads = [l for l in lines if l.startswith("### d_model = 2048")]
  assert [h.rsplit(", ", 1)[-1] for h in heads] == ["embedding onehot", "embedding take"]
  row = lambda anchor: next(l for l in lines if f'id="{anchor}"' in l)
  assert "| 1.50x |" in row("lm-d2048-s2048-onehot-qtrain-int8")  # 90 / 60
  assert "| 1.25x |" in row("lm-d2048-s2048-qtrain-int8")  # 100 / 80
  assert "| 90.00 |" in row("lm-d2048-s2048-onehot-bf16") and "| 100.00 |" in row("lm-d2048-s2048-bf16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onehot_embedding_is_nn_embeds_lookup(dtype):
  """The one-hot product looks up exactly ``nn.Embed``'s rows (extreme magnitudes, every byte
  value, an empty batch); its table gradient is the float64 sum of each row's output
  gradients, to float32 accumulation and the dtype's rounding."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import lm_step
  dt = jnp.dtype(dtype)
  rng = np.random.default_rng(0)
  table = rng.standard_normal((lm_step.VOCAB, 16)) * 10.0 ** rng.integers(-30, 30, (lm_step.VOCAB, 1))
  params = {"params": {"embedding": jnp.asarray(table, dt)}}
  tokens = jnp.asarray(np.concatenate([np.arange(256), rng.integers(0, 256, 700)]).reshape(4, -1))
  ref_mod, mod = (nn.Embed(lm_step.VOCAB, 16, dtype=dt), lm_step.OneHotEmbed(lm_step.VOCAB, 16, dtype=dt))
  got, want = mod.apply(params, tokens), ref_mod.apply(params, tokens)
  assert got.dtype == want.dtype == dt
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
  assert mod.apply(params, jnp.zeros((2, 0), jnp.int32)).shape == (2, 0, 16)
  with pytest.raises(ValueError, match="token ids must be integers, got dtype float32"):
    mod.apply(params, tokens.astype(jnp.float32))

  cot = jnp.asarray(rng.standard_normal((*tokens.shape, 16)), dt)
  grad = jax.grad(lambda p: jnp.vdot(mod.apply(p, tokens).astype(jnp.float32),
                                     cot.astype(jnp.float32)))(params)["params"]["embedding"]
  c64 = np.asarray(cot, np.float64).reshape(-1, 16)
  ref = np.zeros((lm_step.VOCAB, 16))
  np.add.at(ref, np.asarray(tokens).reshape(-1), c64)
  mag = np.zeros((lm_step.VOCAB, 16))
  np.add.at(mag, np.asarray(tokens).reshape(-1), np.abs(c64))
  n = np.bincount(np.asarray(tokens).reshape(-1), minlength=lm_step.VOCAB)[:, None]
  budget = n * np.finfo(np.float32).eps * mag + float(jnp.finfo(dt).eps) * np.abs(ref)
  err = np.abs(np.asarray(grad, np.float64) - ref)
  assert (err <= budget).all(), float((err / np.maximum(budget, 1e-300)).max())


def test_lm_table_without_gpu_records_says_so(tmp_path):
  results = tmp_path / "RESULTS.md"
  results.write_text("# Results\n")
  (tmp_path / "records").mkdir()
  _record.render_results(str(results), str(tmp_path / "records"), ["lm_step"])
  assert "## Language-model training step\n\nNo GPU run yet.\n<!-- end:lm_step -->" in \
      results.read_text()


def test_render_keeps_results_md_as_committed(tmp_path):
  """Rendering every table from benchmarks/records/ reproduces RESULTS.md byte for byte."""
  results = tmp_path / "RESULTS.md"
  shutil.copy(_record.RESULTS_MD, results)
  _record.render_results(str(results), _record.RECORDS_DIR)
  with open(_record.RESULTS_MD) as f:
    assert results.read_text() == f.read()


# ----------------------------------------------------------------------------
# benchmarks/scaling.py


@pytest.mark.slow
def test_scaling_main_runs_on_two_fake_devices(tmp_path):
  """scaling.py at tiny sizes on 2 fake CPU devices (a subprocess: the device count is set
  before jax starts), both modes: one row per config and device count, the figures finite,
  scaling 1 on one device, vs_bf16 1 for bf16."""
  import subprocess
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
  for mode in ("dp", "fsdp"):
    out = tmp_path / mode
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--width", "64",
         "--layers", "1", "--seq", "32", "--batch-per-device", "2", "--steps", "2", "--repeats",
         "1", "--text", "generated", "--configs", "bf16,qtrain_int8_hash", "--mode", mode,
         "--out-dir", str(out), "--results", ""],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (name,) = os.listdir(out)
    rec = json.loads((out / name).read_text())
    assert rec["benchmark"] == "scaling" and rec["meta"]["mode"] == mode
    rows = rec["rows"]
    assert [(r["config"], r["devices"]) for r in rows] == [
        ("bf16", 1), ("qtrain_int8_hash", 1), ("bf16", 2), ("qtrain_int8_hash", 2)]
    for r in rows:
      assert r.get("error") is None, r
      assert r["batch"] == 2 * r["devices"] and r["tokens_per_step"] == 32 * r["batch"]
      for field in ("ms", "tokens_per_s", "compile_s", "scaling", "vs_bf16"):
        assert _finite_positive(r[field]), (field, r)
      assert math.isfinite(r["timing_loss"])
    assert rows[0]["scaling"] == rows[1]["scaling"] == 1.0 and rows[2]["vs_bf16"] == 1.0


def test_scaling_table_renders_gpu_records(tmp_path):
  records = tmp_path / "records"
  records.mkdir()
  row = lambda config, n, ms, scaling, vs: dict(
      config=config, devices=n, mode="dp", d_model=1024, layers=8, seq=2048, batch=4 * n,
      batch_per_device=4, tokens_per_step=8192 * n, ms=ms, tokens_per_s=8192 * n / (ms / 1e3),
      compile_s=10.0, scaling=scaling, vs_bf16=vs)
  rec = _gpu_record(1, [row("bf16", 1, 50.0, 1.0, 1.0), row("qtrain_int8_hash", 1, 40.0, 1.0, 1.25),
                        row("bf16", 8, 55.0, 0.909, 1.0),
                        row("qtrain_int8_hash", 8, 45.0, 0.889, 1.222)],
                    "python3 benchmarks/scaling.py")
  rec["benchmark"] = "scaling"
  (records / "a.json").write_text(json.dumps(rec))
  results = tmp_path / "RESULTS.md"
  results.write_text("# Results\n")
  _record.render_results(str(results), str(records), ["scaling"])
  text = results.read_text()
  assert "### dp, d_model = 1024: layers 8, seq 2048 x 4 per device" in text
  line = next(l for l in text.splitlines() if 'id="w-dp-d1024-qtrain-int8-hash-x8"' in l)
  cells = [c.strip() for c in line.split("|")[1:-1]]
  assert cells[1:6] == ["8", "45.00", f"{8192 * 8 / 0.045:,.0f}", "89%", "1.22x"], cells
  assert cells[6] == "[w1](records/a.json)"


def test_scaling_docstrings():
  from benchmarks import scaling
  res = doctest.testmod(scaling, optionflags=doctest.ELLIPSIS)
  assert res.failed == 0 and res.attempted > 0
