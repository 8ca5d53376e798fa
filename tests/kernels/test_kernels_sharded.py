"""Per-shard kernel calls (:mod:`qtrain.kernels.sharded`) on 4 fake CPU devices.

Each partitioner (Shardy, JAX's default, and GSPMD) runs ``tests/kernels/_sharded_run.py`` in a
subprocess (the device count must be set before jax starts) with a pure-jnp stand-in for the
kernel. A Pallas call the partitioner knows nothing about runs on replicated operands (every
device gathers the global batch); the wrappers say what each shard computes. These check that each shard computes its own block: M and N sharded give one device's numbers with
no collective at all, a sharded K gives one all-reduce of the partial products (no all-gather
of the operands) within float32 rounding of the exact product, and vmap, shard_map and one
device run the kernel function as it is. The weight-times-activation products
(``tests/kernels/_sharded_weight_run.py``) run the Triton kernels for real in the Pallas
interpreter through the dispatch, and the Mosaic weight layout with a stand-in kernel: each
shard's kernel is lowered for its block (M, and N where the packed layout splits), with no
collective, one device's numbers, and the weight gathered where N cannot split.
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


@pytest.mark.slow  # the partitioner subprocesses (the module fixture): ~10 s each
@pytest.mark.parametrize("case", ["k", "m_k"])
def test_gemm_sharded_along_k_sums_partial_products(run, case):
  r = run[case]
  assert r["collectives"] == ["all-reduce"], r  # the partial products, never the operands
  # float32 partial sums of exact integer products, scaled: a few float32 ulps of the largest.
  assert r["rel_err"] < 4 * 2.0 ** -24, r


@pytest.mark.slow
def test_transpose_keeps_every_axis_sharding(run):
  r = run["transpose"]
  assert r["equal"] and r["collectives"] == [] and r["out_spec"] == ["model", "data"], r


@pytest.mark.slow
def test_vmap_shard_map_and_one_device_run_the_kernel_function(run):
  assert run["vmap_equal"] and run["vmap_transpose_equal"]
  assert run["shard_map_equal"] and run["single_device_equal"]


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------
# Weight x activation products (sharded.weight_matmul): the Triton kernels interpreted, through
# the dispatch, and the Mosaic weight layout with a stand-in kernel
# (tests/kernels/_sharded_weight_run.py, about 20 s a partitioner).


@pytest.fixture(scope="module", params=["shardy", "gspmd"])
def weight_run(request) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.join(HERE, "_sharded_weight_run.py"),
                         request.param], capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


FLOAT_ROUNDING = 1e-6  # a float path's shard runs another block config: f32 sums reordered
SPECS = {"m": ["data", None], "n": [None, "model"], "m_n": ["data", "model"]}
# The kernel lowered per shard: [x's shard shape, the shard's N] (32 x 256 by 256 channels on
# a 2 x 2 mesh; the Mosaic case 8 x 512 by 512). Without the wrapper nothing is lowered per
# shard: an interpreted kernel is plain XLA ops, which XLA partitions itself (a Pallas GPU
# kernel, a custom call, it would run on gathered operands).
TRITON_SHARDS = {"m": [[[16, 256], 256]], "n": [[[32, 256], 128]], "m_n": [[[16, 256], 128]]}
MOSAIC_SHARDS = {"m": [[[4, 512], 512]], "n": [[[8, 512], 256]], "m_n": [[[4, 512], 256]]}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["int8", "binary", "int4_groups_kn"])
@pytest.mark.parametrize("case", ["m", "n", "m_n"])
def test_triton_products_sharded_along_m_and_n_run_per_shard(weight_run, kernel, case):
  # Each device computes its block: no collective at all (the activations are not gathered),
  # the output keeps the operands' sharding, and the numbers are one device's: exactly for
  # the integer kernels (int32 sums), to f32 rounding for the float one.
  r = weight_run[f"{kernel}_{case}"]
  assert r["collectives"] == [] and r["out_spec"] == SPECS[case], r
  assert r["shard_calls"] == TRITON_SHARDS[case], r
  if kernel == "int4_groups_kn":
    assert r["rel_err"] < FLOAT_ROUNDING, r
  else:
    assert r["equal"], r


@pytest.mark.slow
def test_triton_products_on_one_device_and_in_shard_map_are_the_kernels_bits(weight_run):
  for kernel in ("int8", "binary", "int4_groups_kn", "int8_padded"):
    assert weight_run[f"{kernel}_one_device_equal"], kernel
  assert weight_run["shard_map_equal"] and weight_run["vmap_equal"]


@pytest.mark.slow
def test_a_qarray_weight_packed_in_the_step_runs_per_row_shard(weight_run):
  r = weight_run["qarray_m"]
  assert r["equal"] and r["collectives"] == [] and r["out_spec"] == ["data", None], r
  assert r["shard_calls"] == [[[16, 256], 128]], r


@pytest.mark.slow
def test_padded_n_and_sharded_k_are_gathered(weight_run):
  # N = 200 padded to 256 channels does not split: the weight is gathered (rows stay split).
  for case, m_spec in (("n", None), ("m_n", "data")):
    r = weight_run[f"int8_padded_{case}"]
    assert r["equal"] and r["collectives"] == ["all-gather"] and r["out_spec"] == [m_spec, None], r
    assert r["shard_calls"] == [[[16 if m_spec else 32, 256], 200]], r
  r = weight_run["int8_k"]  # a sharded contraction: gathered, then one device's product
  assert r["equal"] and r["collectives"] == ["all-gather"], r
  assert r["shard_calls"] == [[[32, 256], 256]], r


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["row_major", "tiled"])
def test_mosaic_weight_splits_along_n_in_whole_blocks(weight_run, layout):
  for case in ("m", "n", "m_n"):
    r = weight_run[f"mosaic_{layout}_{case}"]
    assert r["equal"] and r["collectives"] == [] and r["out_spec"] == SPECS[case], (case, r)
    assert r["shard_calls"] == MOSAIC_SHARDS[case], (case, r)
  # 4 shards of 512 channels would be 128 rows, not whole 256-row blocks: gathered.
  r = weight_run[f"mosaic_{layout}_n4"]
  assert r["equal"] and r["collectives"] == ["all-gather"], r
  assert r["shard_calls"] == [[[8, 512], 512]], r


@pytest.mark.slow
def test_weight_matmul_sites_of_one_shard_signature_trace_the_kernel_once(weight_run):
  r = weight_run["sites"]
  assert r["shard_traces"] == 1 and r["rel_err"] < FLOAT_ROUNDING, r


def test_the_per_shard_triton_product_exports_for_the_gpu():
  # What the partitioner lowers for one shard of N (128 of 256 channels): the Triton int8
  # kernel on the shard's weight (its own n), lowered for CUDA (no GPU needed).
  import functools

  import jax
  import jax.numpy as jnp
  from qtrain.kernels import prepared, sharded
  from qtrain.ops.backends import triton as tb

  w = prepared.prepare_weight(jnp.ones((128, 512), jnp.int8), "int8", scale=jnp.ones(128))
  flat, tree = jax.tree_util.tree_flatten((jnp.ones((16, 512), jnp.int8), jnp.ones(16), w))
  fn = functools.partial(sharded._weight_matmul_flat, kernel=tb._on_shard, tree=tree,
                         n_local=128, out_dtype=jnp.dtype(jnp.bfloat16),
                         static=(("interpret", False), ("kernel", "int8")))
  exp = sharded.export_kernel(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat],
                              platforms=["cuda"])
  assert "__gpu$xla.gpu.triton" in exp.mlir_module()
  assert exp.out_avals[0].shape == (16, 128)


def test_weight_layout_splits_only_unpadded_weights_in_whole_blocks():
  import jax.numpy as jnp
  from qtrain.kernels import mosaic_matmul as mm, prepared, sharded

  pw = prepared.prepare_weight(jnp.ones((256, 128), jnp.int8), "int4",
                               scale=jnp.ones((256, 2)), group_size=64, kn=True)
  lay = sharded.weight_layout(pw)  # data (Kw, Np): N on axis 1; g_scale (G, Np)
  assert lay == sharded.WeightLayout((1, 1), 256, True, sharded.PREPARED_N_BLOCK), lay
  assert not sharded.weight_layout(prepared.prepare_weight(jnp.ones((200, 128), jnp.int8),
                                                           "int8")).splits
  mw = mm.prepare_mosaic_weight(jnp.ones((512, 512), jnp.int8), "int4", scale=jnp.ones(512),
                                tiles=(256, 256))
  assert sharded.weight_layout(mw) == sharded.WeightLayout((0, 0), 512, True, mm.N_ALIGN)
  assert not sharded.weight_layout(mm.prepare_mosaic_weight(jnp.ones((300, 512), jnp.int8),
                                                            "int8")).splits


def test_weight_matmul_rejects_bad_input_by_name():
  import jax.numpy as jnp
  from qtrain.kernels import prepared, sharded

  w = prepared.prepare_weight(jnp.ones((128, 64), jnp.int8), "int8")
  f = lambda x, w, **kw: x
  with pytest.raises(ValueError, match=r"weight of type \w+: weight_matmul takes a PreparedWeight "
                                       r"or a MosaicWeight"):
    sharded.weight_matmul(f, jnp.ones((4, 64)), jnp.ones((128, 64)), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"x_scale has 3 entries; expected 1 or M=4"):
    sharded.weight_matmul(f, jnp.ones((4, 64)), w, x_scale=jnp.ones(3), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"x has shape \(2, 4, 64\)"):
    sharded.weight_matmul(f, jnp.ones((2, 4, 64)), w, out_dtype=jnp.float32)
