"""qtrain.core.qarray.calibrate on bf16 / f16 input: the group bound comes from the 16-bit bits.

A 16-bit float widens to float32 exactly and monotonically, so the max of a group's 16-bit
magnitude bits, widened, is the max of the widened values: every scale must equal, bit for bit,
the one calibrated from the same data cast to float32 first (the float32 path reduces the
float32 bits). Checked for every calibration that takes the bound, per row, per column, per
tensor and tiled, with NaN / Inf, signed zeros, subnormal and extreme values of each dtype.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray

# (channelwise axes, tiles) of a (rows, cols) array.
LAYOUTS = [((0,), {}), ((1,), {}), ((), {}), ((0,), {1: 4})]
METHODS = ["absmax", "rms", "percentile"]


def _data(dtype, seed: int, shape=(12, 16)) -> np.ndarray:
  """Random magnitudes over the dtype's whole range, with its specials planted."""
  rng = np.random.default_rng(seed)
  info = jnp.finfo(dtype)
  lo, hi = np.log10(float(info.smallest_subnormal)), np.log10(float(info.max))
  x = np.sign(rng.standard_normal(shape)) * 10.0 ** rng.uniform(lo, hi, shape)
  x = np.asarray(jnp.asarray(x.astype(np.float32)).astype(dtype)).astype(np.float32)
  specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, float(info.smallest_subnormal),
              -float(info.max), float(info.tiny)]
  for i, v in enumerate(specials):
    x[(3 * i + seed) % shape[0], (5 * i + 2 * seed) % shape[1]] = v
  return x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cw,tiles", LAYOUTS)
@pytest.mark.thin(3)
def test_16bit_input_scales_equal_the_float32_path_bit_for_bit(dtype, method, cw, tiles):
  cal = qarray.Calibration(method=method, **({"percentile": 99.0} if method == "percentile" else {}))
  spec = qarray.QuantizeSpec(qtype="int8", channelwise_axes=cw, tiled_axes=tiles, calibration=cal)
  for seed in range(4):
    x32 = _data(dtype, seed)
    x16 = jnp.asarray(x32).astype(dtype)
    assert np.array_equal(np.asarray(x16).astype(np.float32), x32, equal_nan=True)  # exact cast
    got, _ = qarray.calibrate(x16, spec)
    want, _ = qarray.calibrate(jnp.asarray(x32), spec)
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.int32)[~np.isnan(want)],
                                  want.view(np.int32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any()  # the specials hit some groups, not all (per tensor: the one)
    assert want.size == 1 or not np.isnan(want).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_16bit_bound_of_a_group_is_its_largest_magnitude(dtype):
  """Against an independent float64 reference: the absmax scale is max|x| / 127 per column."""
  x = np.asarray(jnp.asarray(
      np.random.default_rng(7).standard_normal((64, 8)).astype(np.float32) * 300).astype(dtype))
  spec = qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,))
  s, _ = qarray.calibrate(jnp.asarray(x), spec)
  ref = np.abs(x.astype(np.float64)).max(axis=0, keepdims=True) / 127
  np.testing.assert_allclose(np.asarray(s, np.float64), ref, rtol=2 ** -23)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_16bit_empty_and_all_zero_groups(dtype):
  spec = qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,))
  s, _ = qarray.calibrate(jnp.zeros((0, 3), dtype), spec)
  assert s.shape == (1, 3) and np.all(np.asarray(s) == 1.0)
  s, _ = qarray.calibrate(jnp.asarray([[-0.0, 0.0, 2.0]], dtype), spec)
  np.testing.assert_array_equal(np.asarray(s), np.float32([[1.0, 1.0, 2.0 / 127]]))
