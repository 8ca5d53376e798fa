"""Quantized training on several devices (fake CPU devices).

Each case runs ``tests/_multidevice_run.py`` in a subprocess (the device count must be set
before jax starts) and compares with one device:

* ``jax.jit`` + ``NamedSharding``: data-parallel, FSDP and tensor-parallel (column-split then
  row-split Dense). Scales are computed over the whole (global) array, as on one device, so
  sharding changes no number; XLA inserts the reductions the scales need. Under FSDP the
  weights travel as their int8 / fp8 codes (plus small float scale vectors), not as float
  weights: XLA quantizes each shard with the global scale and gathers the codes.
* ``jax.shard_map`` data-parallel: every scale is computed on the shard's own data. With a
  float backward that changes no number (per-token activation scales and the replicated
  weights' scales are the same either way). Quantized gradients get per-shard scales (and
  per-shard noise), so the losses agree within the gradients' quantization error; with
  ``bwd_weight_grad_axis_names=("data",)`` the weight gradient's scales are the whole batch's,
  and round-to-nearest training gives one device's losses.
* ``jax.shard_map`` tensor-parallel (column-split, then row-split): the rules' axis-name
  fields share the scales whose reductions the split crosses; one device's losses.
* QLoRA (a frozen, packed int4 base with adapters) data parallel and with the packed words
  sharded: one device's losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# The FSDP-sharded Dense kernels, gathered whole, in either layout (the run's Net: up (48, 64),
# down (64, 16)). Activations may be gathered too (XLA's choice); they are data, not weights.
DENSE_KERNELS = {"48,64", "64,48", "64,16", "16,64"}
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
  weight_gathers = [(d, s) for d, s in gathers if s in DENSE_KERNELS]
  assert weight_gathers, ops["fsdp"]
  assert {d for d, _ in weight_gathers} <= CODE_DTYPES[qtype], weight_gathers
  # Tensor parallel: the row-split product's partial sums are all-reduced.
  assert any(op == "all-reduce" for op, _ in ops["tp"]), ops["tp"]
  # shard_map with a float backward: the same numbers as one device.
  np.testing.assert_allclose(out["shard_map_float_grads"]["losses"],
                             out["single_float_grads"]["losses"], rtol=2e-6)
  # ... with quantized gradients: per-shard gradient scales and noise. Each gradient element
  # is off by at most one quantization step of its group, a relative 1 / qmax of the group's
  # largest (1/127 for int8, 2**-2 for e5m2's 2 mantissa bits); five small SGD steps move the
  # loss by a small fraction of that.
  step = {"int8": 1 / 127, "fp8": 2.0 ** -2}[qtype]
  sm, one = np.array(out["shard_map"]["losses"]), single
  assert sm[0] == pytest.approx(one[0], rel=2e-6)  # the first loss is before any update
  np.testing.assert_allclose(sm, one, rtol=step)
  assert not np.array_equal(sm, one)  # per-shard scales really are per shard
  # Round to nearest, the weight gradient's scales shared across the data axis
  # (bwd_weight_grad_axis_names=("data",)): every gradient is quantized as on one device, so
  # the losses agree up to the float reduction order; per shard they do not. Outside
  # shard_map the names change nothing.
  one = np.array(out["single_nosr"]["losses"])
  np.testing.assert_array_equal(out["single_nosr_global"]["losses"], one)
  np.testing.assert_allclose(out["shard_map_nosr_global"]["losses"], one, rtol=2e-6)
  local = np.array(out["shard_map_nosr"]["losses"])
  assert np.max(np.abs(local - one) / np.abs(one)) > 1e-5, (local, one)
  # Tensor parallelism written with shard_map (column-split, then row-split), int8 forward
  # and round-to-nearest int8 gradients: with the rules' axis-name fields (the row-parallel
  # layer's input and weight, the column-parallel layer's input gradient) one device's losses;
  # per shard, not.
  # QLoRA (int4 packed base, rank-4 adapters, AdamW on the adapters) data parallel, and with
  # the packed words sharded too: one device's losses; data parallel all-reduces the adapters'
  # gradients and gathers nothing.
  q = out["qlora"]
  assert not q["single"]["collectives"]
  for mode in ("dp", "fsdp"):
    np.testing.assert_allclose(q[mode]["losses"], q["single"]["losses"], rtol=2e-6, err_msg=mode)
  assert q["single"]["losses"][-1] < q["single"]["losses"][0]
  assert [op for op, _ in q["dp"]["collectives"]] == ["all-reduce"], q["dp"]["collectives"]
  tp = out["tensor_parallel_shard_map"]
  np.testing.assert_allclose(tp["shared"], tp["single"], rtol=2e-6)
  per_shard, single = np.array(tp["per_shard"]), np.array(tp["single"])
  assert np.max(np.abs(per_shard - single) / single) > 1e-5, (per_shard, single)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_sharded_training_matches_one_device_on_4_devices(qtype):
  _check(_run(4, qtype), qtype)


@pytest.mark.slow
def test_sharded_training_matches_one_device_on_8_devices():
  _check(_run(8, "int8"), "int8")
