"""Quantized training on several devices under ``jax.jit`` + ``NamedSharding`` (fake CPU devices).

Each case runs ``tests/_multidevice_run.py`` in a subprocess (the device count must be set
before jax starts) and compares data-parallel, FSDP and tensor-parallel (column-split then
row-split Dense) training with one device: the same losses, and the collectives a user would
expect in the compiled step.

What these pin down: scales are computed over the whole (global) array, as on one device, so
sharding changes no number; XLA inserts the reductions the scales need. Under FSDP the
weights travel as their int8 / fp8 codes (plus small float scale vectors), not as float
weights: XLA quantizes each shard with the global scale and gathers the codes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHT_SHAPES = {"16,64", "64,16", "32,16", "16,32", "64,32", "32,64"}  # full or half weights
# The codes' dtype in the all-gather. XLA's CPU backend has no fp8 arithmetic and widens fp8
# values to f16 (exactly) before they are used, the collective included: 2 bytes per weight,
# not float32's 4.
CODE_DTYPES = {"int8": {"s8"}, "fp8": {"f8e4m3fn", "f16"}}


def _run(n_devices: int, qtype: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.join(HERE, "_multidevice_run.py"),
                         str(n_devices), qtype], capture_output=True, text=True, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _shape(type_str: str) -> tuple[str, str]:
  """('s8', '64,16') from 's8[64,16]{1,0}'."""
  dtype, rest = type_str.split("[", 1)
  return dtype, rest.split("]", 1)[0]


def _check(out: dict, qtype: str) -> None:
  single = np.array(out["single"]["losses"])
  assert single[-1] < single[0]  # it trains
  assert not out["single"]["collectives"]
  for mode in ("dp", "fsdp", "tp"):
    # The same numbers as one device: only the float reduction order may differ.
    np.testing.assert_allclose(out[mode]["losses"], single, rtol=2e-6, err_msg=mode)
  ops = {mode: out[mode]["collectives"] for mode in ("dp", "fsdp", "tp")}
  # Data parallel: gradients are all-reduced, nothing is gathered.
  assert any(op == "all-reduce" for op, _ in ops["dp"]), ops["dp"]
  assert not any(op == "all-gather" for op, _ in ops["dp"]), ops["dp"]
  # FSDP: every weight-sized all-gather moves codes, none moves float weights.
  gathers = [_shape(t) for op, t in ops["fsdp"] if op == "all-gather" and "[" in t]
  weight_gathers = [(d, s) for d, s in gathers if s in WEIGHT_SHAPES]
  assert weight_gathers, ops["fsdp"]
  assert {d for d, _ in weight_gathers} <= CODE_DTYPES[qtype], weight_gathers
  # Tensor parallel: the row-split product's partial sums are all-reduced.
  assert any(op == "all-reduce" for op, _ in ops["tp"]), ops["tp"]


@pytest.mark.parametrize("qtype", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_sharded_training_matches_one_device_on_4_devices(qtype):
  _check(_run(4, qtype), qtype)


@pytest.mark.slow
def test_sharded_training_matches_one_device_on_8_devices():
  _check(_run(8, "int8"), "int8")
