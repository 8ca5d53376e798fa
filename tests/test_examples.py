"""Smoke tests of ``examples/``: each example's main path end to end on a tiny budget.

Fashion-MNIST is replaced by a tiny synthetic IDX dataset written into ``tmp_path``; nothing
here reads ``../shared`` or Debian's dataset folder (the fallbacks are pointed at empty
temporary folders where the search order is tested).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(name: str):
  """Imports ``examples/<name>.py`` (once) as module ``qtrain_example_<name>``."""
  mod_name = f"qtrain_example_{name}"
  if mod_name not in sys.modules:
    spec = importlib.util.spec_from_file_location(mod_name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
  return sys.modules[mod_name]


def _write_idx(path: str, arr: np.ndarray) -> None:
  """Writes a uint8 array as a gzip-compressed IDX file."""
  header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + arr.astype(np.uint8).tobytes())


def _write_fashion(d, n_train: int = 64, n_test: int = 32, skip: tuple[str, ...] = ()) -> str:
  """A tiny random Fashion-MNIST look-alike (28x28 uint8 images, labels 0-9) in folder ``d``."""
  rng = np.random.default_rng(0)
  os.makedirs(d, exist_ok=True)
  for prefix, n in (("train", n_train), ("t10k", n_test)):
    files = {f"{prefix}-images-idx3-ubyte": rng.integers(0, 256, (n, 28, 28)),
             f"{prefix}-labels-idx1-ubyte": np.arange(n) % 10}
    for stem, arr in files.items():
      if stem not in skip:
        _write_idx(os.path.join(d, stem + ".gz"), arr)
  return str(d)


def _finite_numbers(obj) -> list[float]:
  """Every int / float in a JSON tree (bools left out)."""
  if isinstance(obj, bool):
    return []
  if isinstance(obj, (int, float)):
    return [float(obj)]
  if isinstance(obj, dict):
    return [x for v in obj.values() for x in _finite_numbers(v)]
  if isinstance(obj, (list, tuple)):
    return [x for v in obj for x in _finite_numbers(v)]
  return []


def _assert_png(path: str) -> None:
  assert os.path.getsize(path) > 1000, path
  with open(path, "rb") as f:
    assert f.read(8) == PNG_MAGIC, path


@pytest.fixture
def no_fallbacks(tmp_path, monkeypatch):
  """The Fashion-MNIST search with no ``$QTRAIN_DATA_DIR`` and empty fallback folders."""
  data = _load("fashion_mnist")._data
  monkeypatch.delenv(data.ENV_VAR, raising=False)
  monkeypatch.setattr(data, "SHARED_DIR", str(tmp_path / "shared" / "data" / "fashion-mnist"))
  monkeypatch.setattr(data, "DEBIAN_DIR", str(tmp_path / "usr-share-datasets" / "fashion-mnist"))
  return data


# ---------------------------------------------------------------------------
# quickstart


def _run_quickstart(tmp_path, runs: list[str]):
  qs = _load("quickstart")
  out = tmp_path / "qs"
  results = qs.main(["--steps", "3", "--runs", ",".join(runs), "--out-dir", str(out)])
  assert [r["name"] for r in results] == runs
  with open(out / "results.json") as f:
    summary = json.load(f)
  assert [r["name"] for r in summary["runs"]] == runs
  for r in summary["runs"]:
    assert len(r["losses"]) == 3 and len(r["evals"]) == 3
    assert 0.0 <= r["test_accuracy"] <= 1.0
  nums = _finite_numbers(summary["runs"])
  assert nums and all(math.isfinite(x) for x in nums)
  _assert_png(out / "loss.png")


@pytest.mark.slow
def test_quickstart_smoke(tmp_path):
  _run_quickstart(tmp_path, ["float"])


@pytest.mark.slow
def test_quickstart_all_runs(tmp_path):
  _run_quickstart(tmp_path, ["float", "int8", "binary"])


def test_default_out_dirs_are_under_tempdir():
  for name, folder in (("quickstart", "qtrain_quickstart"),
                       ("fashion_mnist", "qtrain_fashion_mnist"),
                       ("train_lm", "qtrain_train_lm")):
    args = _load(name).make_parser().parse_args([])
    assert args.out_dir == os.path.join(tempfile.gettempdir(), folder), name


def test_flags_are_one_style():
  """Every example's options are spelt one way: lower case words joined by hyphens
  (--out-dir; --out_dir was one example's spelling)."""
  import re
  for name in ("quickstart", "fashion_mnist", "train_lm"):
    for action in _load(name).make_parser()._actions:
      for opt in action.option_strings:
        assert re.fullmatch(r"-h|--[a-z0-9]+(-[a-z0-9]+)*", opt), (name, opt)


# ---------------------------------------------------------------------------
# fashion_mnist: data search


def test_fashion_search_order(tmp_path, no_fallbacks, monkeypatch, capsys):
  data = no_fallbacks
  flag = _write_fashion(tmp_path / "flag")
  env = _write_fashion(tmp_path / "env")
  monkeypatch.setenv(data.ENV_VAR, env)
  assert data.resolve_data_dir(flag) == flag
  assert data.resolve_data_dir(None) == env
  # a named folder without the files is reported, then the search goes on
  partial = _write_fashion(tmp_path / "partial", skip=("t10k-labels-idx1-ubyte",))
  assert data.resolve_data_dir(partial) == env
  assert "t10k-labels-idx1-ubyte" in capsys.readouterr().out
  monkeypatch.delenv(data.ENV_VAR)
  shared = _write_fashion(data.SHARED_DIR)
  assert data.resolve_data_dir(None) == shared
  assert data.resolve_data_dir(str(tmp_path / "nowhere")) == shared


def test_fashion_missing_data_is_a_clear_error(tmp_path, no_fallbacks):
  fm = _load("fashion_mnist")
  data = no_fallbacks
  missing = str(tmp_path / "no-such-folder")
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as e:
    fm.main(["--data-dir", missing, "--out-dir", str(out)])
  msg = e.value.code
  assert isinstance(msg, str)  # sys.exit(<message>): printed to stderr, exit status 1
  for where in (missing, "$" + data.ENV_VAR, data.SHARED_DIR, data.DEBIAN_DIR,
                "github.com/zalandoresearch/fashion-mnist", "train-images-idx3-ubyte"):
    assert where in msg, (where, msg)
  assert not out.exists()  # nothing written before the data is found


# ---------------------------------------------------------------------------
# fashion_mnist: training end to end


def _check_fashion_outputs(out, runs, epochs=1):
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert sorted(summary["runs"]) == sorted(runs)
  for run, r in summary["runs"].items():
    for key in ("test_acc", "train_loss", "train_acc", "epoch_seconds"):
      assert len(r[key]) == epochs, (run, key)
    assert "freeze_error" not in r, (run, r.get("freeze_error"))
    assert r["train_loss"][0] > 0
  nums = _finite_numbers(summary["runs"])
  assert nums and all(math.isfinite(x) for x in nums)
  _assert_png(out / "accuracy.png")
  for run in runs:
    assert os.path.getsize(out / f"{run}_params.msgpack") > 0
  return summary


def _run_fashion(tmp_path, runs: list[str], *extra: str):
  fm = _load("fashion_mnist")
  d = _write_fashion(tmp_path / "fm")
  out = tmp_path / "out"
  results = fm.main(["--data-dir", d, "--epochs", "1", "--limit-train", "64", "--batch-size",
                     "32", "--width", "4", "--runs", ",".join(runs), "--out-dir", str(out),
                     "--no-tqdm", *extra])
  summary = _check_fashion_outputs(out, runs)
  assert set(results) == set(runs)
  for r in summary["runs"].values():
    assert r["train_examples"] == 64
  return summary


@pytest.mark.slow  # ~6 s on 2 cores, mostly XLA compiling the CNN's training step
def test_fashion_mnist_smoke(tmp_path, no_fallbacks):
  _run_fashion(tmp_path, ["float"])


@pytest.mark.slow
def test_fashion_mnist_train_loss_is_the_mean_over_the_epochs_steps(tmp_path, no_fallbacks,
                                                                     monkeypatch):
  """The reported train loss is the mean of every step's loss of the epoch (it was one
  step's in 50: a short run reported the untrained loss)."""
  import jax
  import optax
  steps = []
  ce = optax.softmax_cross_entropy_with_integer_labels

  def recorded(logits, labels):
    per_example = ce(logits, labels)
    jax.debug.callback(lambda v: steps.append(float(v)), per_example.mean(), ordered=True)
    return per_example

  monkeypatch.setattr(optax, "softmax_cross_entropy_with_integer_labels", recorded)
  fm = _load("fashion_mnist")
  d = _write_fashion(tmp_path / "fm", n_train=96)
  out = tmp_path / "out"
  fm.main(["--data-dir", d, "--epochs", "1", "--batch-size", "32", "--width", "4", "--runs",
           "float", "--out-dir", str(out), "--no-tqdm"])
  with open(out / "summary.json") as f:
    reported = json.load(f)["runs"]["float"]["train_loss"]
  assert len(steps) == 3, steps  # 96 images in batches of 32
  # float32 throughout (the losses are positive): each recorded step loss may be summed over
  # its 32 examples in another order than the step's own (up to 31 roundings), the epoch sum
  # adds 2 and the division 1: 34 roundings of 2**-24 relative.
  rtol = 34 * 2.0 ** -24
  np.testing.assert_allclose(reported[0], np.mean(steps), rtol=rtol)
  assert abs(steps[0] - np.mean(steps)) > 10 * rtol * np.mean(steps), steps  # tells them apart


@pytest.mark.slow
def test_fashion_mnist_binary_frozen(tmp_path, no_fallbacks):
  """A quantized run and its freeze report, through the rules API (width 4: the dense layer
  has 72 inputs, so the grouped w4 / w2 presets need a larger --width)."""
  summary = _run_fashion(tmp_path, ["binary"], "--api", "rules")
  assert 0.0 <= summary["runs"]["binary"]["frozen_test_acc"] <= 1.0


@pytest.mark.slow
def test_fashion_mnist_cli_finds_data_through_env(tmp_path):
  """The script as a user runs it: no --data-dir, the data through $QTRAIN_DATA_DIR."""
  d = _write_fashion(tmp_path / "fm")
  out = tmp_path / "out"
  env = dict(os.environ, QTRAIN_DATA_DIR=d)
  p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "fashion_mnist.py"), "--epochs", "1",
                      "--limit-train", "64", "--batch-size", "32", "--width", "4", "--runs",
                      "float", "--out-dir", str(out)],
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert f"Fashion-MNIST from {d}" in p.stdout
  _check_fashion_outputs(out, ["float"])
  assert sorted(os.listdir(tmp_path)) == ["fm", "out"]  # nothing written into the cwd


# ---------------------------------------------------------------------------
# train_lm


def _write_text(path, n: int = 6000) -> str:
  """A small, learnable text: a few sentences repeated with random choices between them."""
  rng = np.random.default_rng(0)
  parts = ["the cat sat on the mat. ", "a dog ran in the park! ", "qtrain trains small nets; "]
  text = "".join(parts[i] for i in rng.integers(0, len(parts), n // 20))
  path.write_text(text)
  return str(path)


def _tiny_lm_args(text: str, runs: str, out) -> list[str]:
  """train_lm's arguments for a 12-step run of a one-block model, evaluated at steps 6 and 12."""
  return ["--text", text, "--runs", runs, "--steps", "12", "--d-model", "32", "--layers", "1",
          "--heads", "2", "--seq", "16", "--batch", "8", "--eval-every", "6", "--eval-batches",
          "2", "--out-dir", str(out), "--no-tqdm"]


@pytest.mark.slow
def test_train_lm_smoke(tmp_path):
  lm = _load("train_lm")
  text = _write_text(tmp_path / "tiny.txt")
  out = tmp_path / "lm"
  summary = lm.main(_tiny_lm_args(text, "float,bitnet", out))
  with open(out / "summary.json") as f:
    on_disk = json.load(f)
  assert on_disk["runs"].keys() == summary["runs"].keys() == {"float", "bitnet"}
  for name, r in on_disk["runs"].items():
    assert len(r["train_loss"]) == 12
    assert [s for s, _ in r["held_out"]] == [6, 12]
    # Learning happened: the loss starts near ln(256) = 5.55 and falls on this repetitive text.
    assert r["train_loss"][0] > 4.5 and r["train_loss"][-1] < r["train_loss"][0] - 1.0, name
  nums = _finite_numbers(on_disk["runs"])
  assert nums and all(math.isfinite(x) for x in nums)
  _assert_png(out / "loss.png")


@pytest.mark.slow
def test_train_lm_qlora_fine_tunes_the_float_model(tmp_path):
  lm = _load("train_lm")
  text = _write_text(tmp_path / "tiny.txt")
  out = tmp_path / "lm"
  summary = lm.main(_tiny_lm_args(text, "qlora", out))
  runs = summary["runs"]
  assert list(runs) == ["float", "qlora"]  # the float model is trained first, then fine-tuned
  q = runs["qlora"]
  assert [s for s, _ in q["held_out"]] == [0, 6, 12]
  # Rank-8 adapters on q, k, v, out (32 -> 32 each), mlp_up (32 -> 128), mlp_down (128 -> 32).
  assert q["trained_params"] == 4 * (32 * 8 + 8 * 32) + (32 * 8 + 8 * 128) + (128 * 8 + 8 * 32)
  assert q["frozen_layers"] == 6 and q["frozen_bytes"] < q["float32_bytes"] / 4
  assert q["train_loss"][-1] < q["train_loss"][0]
  assert all(math.isfinite(x) for x in _finite_numbers(runs))
  _assert_png(out / "loss.png")


def test_train_lm_bitnet_rules_are_the_preset_on_the_blocks():
  lm = _load("train_lm")
  (rule,) = lm.rules("bitnet")
  assert rule.module_path == r"block_\d+/.*" and rule.op_names == ("dot_general",)
  assert rule.short() == "w=ternary a=int8 g=None w_gran=per_tensor a_gran=per_token"
  assert lm.rules("float") is None
  assert {r.weight_qtype for run in ("int8", "fp8", "int4") for r in lm.rules(run)} == {
      "int8", "float8_e4m3fn", "int4"}
  (q,) = lm.rules("qlora")
  assert (q.weight_qtype, q.tile_size, q.lora_rank, q.lora_scale) == ("int4", 32, 8, 2.0)


@pytest.mark.parametrize("argv, match", [
    (["--runs", "float,int3"], r"--runs 'float,int3': unknown \['int3'\]; valid: float, int8"),
    (["--text", "/nonexistent/x.txt"], r"--text /nonexistent/x.txt: no such file"),
    (["--steps", "0"], r"--steps 0 must be positive"),
    (["--d-model", "30", "--heads", "4"], r"--d-model 30 must be a multiple of --heads 4"),
])
def test_train_lm_bad_arguments_are_named(argv, match):
  with pytest.raises(SystemExit, match=match):
    _load("train_lm").main(argv)


def test_train_lm_text_too_short_is_refused(tmp_path):
  path = tmp_path / "short.txt"
  path.write_text("abc" * 20)
  with pytest.raises(SystemExit, match=r"60 bytes; its 90% / 10% splits need at least 130 bytes"):
    _load("train_lm").main(["--text", str(path), "--seq", "128"])
