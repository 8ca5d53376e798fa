"""Per-shard kernel calls (:mod:`qtrain.kernels.sharded`) on 4 fake CPU devices.

Each partitioner (Shardy, JAX's default, and GSPMD) runs ``tests/kernels/_sharded_run.py`` in a
subprocess (the device count must be set before jax starts) with a pure-jnp stand-in for the
kernel. A Pallas call the partitioner knows nothing about runs on replicated operands (every
device gathers the global batch); the wrappers say what each shard computes. These check that each shard computes its own block: M and N sharded give one device's numbers with
no collective at all, a sharded K gives one all-reduce of the partial products (no all-gather
of the operands) within float32 rounding of the exact product, and vmap, shard_map and one
device run the kernel function as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module", params=["shardy", "gspmd"])
def run(request) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.join(HERE, "_sharded_run.py"), request.param],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case,spec", [("m", ["data", None]), ("m_n", ["data", "model"])])
def test_gemm_sharded_along_m_and_n_computes_each_block_locally(run, case, spec):
  r = run[case]
  assert r["collectives"] == [], r
  assert r["equal_one_device"], r
  assert r["out_spec"] + [None] * (2 - len(r["out_spec"])) == spec


@pytest.mark.parametrize("case", ["k", "m_k"])
def test_gemm_sharded_along_k_sums_partial_products(run, case):
  r = run[case]
  assert r["collectives"] == ["all-reduce"], r  # the partial products, never the operands
  # float32 partial sums of exact integer products, scaled: a few float32 ulps of the largest.
  assert r["rel_err"] < 4 * 2.0 ** -24, r


def test_transpose_keeps_every_axis_sharding(run):
  r = run["transpose"]
  assert r["equal"] and r["collectives"] == [] and r["out_spec"] == ["model", "data"], r


def test_vmap_shard_map_and_one_device_run_the_kernel_function(run):
  assert run["vmap_equal"] and run["vmap_transpose_equal"]
  assert run["shard_map_equal"] and run["single_device_equal"]


def test_call_sites_of_one_shard_signature_lower_the_kernel_once(run):
  # A Pallas kernel lowered at every site made an 8-block decoder compile 4x slower on 2 GPUs.
  r = run["sites"]
  assert r["equal"] and r["shard_traces"] == 1, r


def test_the_triton_transpose_kernel_exports_for_the_gpu():
  # The per-shard transpose is a Pallas Triton kernel, whose custom call jax.export refuses by
  # default: without accepting it the export failed at every per-shard transpose on the GPU.
  # Lowered for CUDA here (no GPU needed to lower a Triton kernel).
  import jax
  import jax.numpy as jnp
  from qtrain.kernels import sharded, transpose as tp

  exp = sharded.export_kernel(tp._kernel_transpose((1, 0)),
                              [jax.ShapeDtypeStruct((256, 512), jnp.int8)], platforms=["cuda"])
  assert "__gpu$xla.gpu.triton" in exp.mlir_module()
  assert exp.out_avals[0].shape == (512, 256)


def test_a_kernel_that_does_not_export_is_lowered_at_the_site_with_a_warning():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from qtrain.kernels import sharded

  def host_kernel(x):  # host callbacks do not export
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  x = jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32)
  with pytest.warns(RuntimeWarning, match=r"host_kernel.*could not be exported.*every call site"):
    out = jax.jit(lambda v: sharded._lowered_once(host_kernel, v))(x)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
