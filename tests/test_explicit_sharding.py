"""Quantized products under Explicit mesh axes (``jax.set_mesh``), with and without
``out_sharding`` (4 fake CPU devices, ``tests/_explicit_sharding_run.py`` in a subprocess).

Under Explicit axes a product's output sharding is part of its type: the float op takes it from
``out_sharding`` or infers it. The quantized op gives the float op's sharding (its products run
with the axes Auto inside), so a data-parallel step matches one device's losses, and a product
the float op finds ambiguous raises the float op's error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# One subprocess (~50 s on 2 cores) serves every test here.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run() -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.join(HERE, "_explicit_sharding_run.py")],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["out_sharding", "inferred"])
def test_linen_data_parallel_step_matches_one_device(run, case):
  r = run[case]
  # The sharded weight gradient sums float32 partial products: float32 rounding apart.
  np.testing.assert_allclose(r["many"], r["one"], rtol=1e-6)
  assert r["one"][-1] < r["one"][0]
  assert r["y_type"] == "float32[8@data,4]", r        # the float op's output sharding
  assert all("@" not in t for t in r["grad_types"]), r  # replicated parameters, replicated updates


def test_convolution_data_parallel_matches_one_device(run):
  np.testing.assert_allclose(run["conv"]["many"], run["conv"]["one"], rtol=1e-6)


def test_nnx_einsum_with_out_sharding(run):
  assert run["nnx"]["equal"] and run["nnx"]["y_type"] == "float32[8@data,4]", run["nnx"]


def test_an_ambiguous_product_raises_the_float_ops_error(run):
  assert run["ambiguous"].startswith("ShardingTypeError") and "out_sharding" in run["ambiguous"]


@pytest.mark.parametrize("case", ["out_sharding", "inferred", "nnx"])
def test_frozen_ops_place_their_results_as_the_float_ops_do(run, case):
  """A frozen (serving) model under Explicit axes: linen products with out_sharding and without,
  nnx.Linear called with out_sharding; the predictions of one device, the float op's sharding."""
  r = run["frozen"][case]
  assert r["close"] == 0.0 and r["y_type"] == "float32[8@data,4]", r
