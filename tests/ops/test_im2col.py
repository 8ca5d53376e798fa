"""qtrain.ops.im2col: a convolution as patches x kernel matrix, against lax's convolution
and lax's own patches, both K orders, groups, dilations, layouts; the transposes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qarray as qa
from qtrain.ops import im2col

HIGHEST = jax.lax.Precision.HIGHEST

# (x shape, w shape, layout, strides, padding, lhs_dilation, rhs_dilation, groups)
GEOMS = [
    ((2, 7, 6, 4), (3, 3, 4, 8), ("NHWC", "HWIO", "NHWC"), (1, 1), "SAME", (1, 1), (1, 1), 1),
    ((2, 4, 9, 8), (6, 4, 3, 2), ("NCHW", "OIHW", "NCHW"), (2, 2), ((1, 0), (2, 1)), (1, 1), (1, 1), 1),
    ((2, 8, 8, 6), (2, 3, 3, 4), ("NHWC", "HWIO", "NCHW"), (1, 2), "VALID", (1, 1), (2, 1), 2),
    ((3, 5, 5, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NHWC"), (1, 1), ((2, 2), (1, -1)), (2, 1), (1, 1), 2),
    ((2, 9, 5), (3, 5, 4), ("NWC", "WIO", "NWC"), (2,), "SAME", (1,), (2,), 1),
]


def _params(g):
  xs, ws, layout, strides, padding, ld, rd, groups = g
  dn = jax.lax.conv_dimension_numbers(xs, ws, layout)
  return dict(window_strides=strides, padding=padding, lhs_dilation=ld, rhs_dilation=rd, dn=dn,
              feature_group_count=groups, batch_group_count=1, precision=None)


def _lax_conv(x, w, p):
  return jax.lax.conv_general_dilated(
      x, w, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"], p["dn"],
      p["feature_group_count"], precision=HIGHEST)


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("channel_major", [False, True])
@pytest.mark.parametrize("g", range(len(GEOMS)))
def test_patches_times_kernel_matrix_is_the_convolution(g, channel_major):
  xs, ws = GEOMS[g][:2]
  x, w, p = _rand(xs, 1), _rand(ws, 2), _params(GEOMS[g])
  geo = im2col.geometry(xs, ws, p, channel_major=channel_major)
  y = jax.lax.dot_general(im2col.patches(x, geo), im2col.kernel_matrix(w, geo),
                          geo.dot_dimension_numbers(), precision=HIGHEST)
  ref = _lax_conv(x, w, p)
  got = im2col.output_layout(y, geo)
  assert got.shape == ref.shape
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
  # The transposes: the kernel back from its matrix exactly, the patches' transpose = their vjp,
  # an output gradient into the product's layout and back.
  np.testing.assert_array_equal(im2col.kernel_from_matrix(im2col.kernel_matrix(w, geo), geo, ws), w)
  dp = _rand(im2col.patches(x, geo).shape, 3)
  _, vjp = jax.vjp(lambda v: im2col.patches(v, geo), x)
  np.testing.assert_allclose(im2col.patches_transpose(dp, geo, xs), vjp(dp)[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(im2col.output_layout(im2col.product_layout(ref, geo), geo), ref)


@pytest.mark.slow
@pytest.mark.parametrize("g", [0, 1, 4])
def test_channel_major_order_is_lax_patches(g):
  xs, ws, layout = GEOMS[g][:3]
  x, p = _rand(xs, 4), _params(GEOMS[g])
  geo = im2col.geometry(xs, ws, p, channel_major=True)
  ref = jax.lax.conv_general_dilated_patches(
      jnp.transpose(x, p["dn"].lhs_spec), geo.window, p["window_strides"], p["padding"],
      p["lhs_dilation"], p["rhs_dilation"], precision=HIGHEST)
  np.testing.assert_array_equal(im2col.patches(x, geo), jnp.moveaxis(ref, 1, -1))


@pytest.mark.slow
@pytest.mark.parametrize("g", [0, 2, 3])
@pytest.mark.parametrize("scale_axes", ["batch", "channel", "tensor"])
def test_quantized_operands_dequantize_to_the_float_patches(g, scale_axes):
  """patches_operand / kernel_operand lay the scales onto the patches and the matrix: what
  they dequantize to is the patches (matrix) of the dequantized operand; padding is 0
  for every qtype, binary's +-1 grid included (codes travel as int8)."""
  xs, ws, layout = GEOMS[g][:3]
  p = _params(GEOMS[g])
  dn = p["dn"]
  geo = im2col.geometry(xs, ws, p)
  lhs_axes = {"batch": (dn.lhs_spec[0],), "channel": (dn.lhs_spec[1],), "tensor": ()}[scale_axes]
  rhs_axes = {"batch": (dn.rhs_spec[0],), "channel": (dn.rhs_spec[1],), "tensor": ()}[scale_axes]
  for qtype in ("int8", "binary", "float8_e4m3fn"):
    xq = qa.quantize(_rand(xs, 5), qa.QuantizeSpec(qtype=qtype, channelwise_axes=lhs_axes))
    wq = qa.quantize(_rand(ws, 6), qa.QuantizeSpec(qtype=qtype, channelwise_axes=rhs_axes))
    a, b = im2col.patches_operand(xq, geo), im2col.kernel_operand(wq, geo)
    assert isinstance(a, qa.QArray) and isinstance(b, qa.QArray)
    np.testing.assert_array_equal(a.dequantize(), im2col.patches(xq.dequantize(), geo))
    np.testing.assert_array_equal(b.dequantize(), im2col.kernel_matrix(wq.dequantize(), geo))
  # A zero point is not the code padding reads: such an operand is dequantized first.
  xz = qa.quantize(_rand(xs, 7), qa.QuantizeSpec(qtype="int8", channelwise_axes=lhs_axes,
                                                 calibration="minmax"))
  assert xz.zero_point is not None
  np.testing.assert_array_equal(im2col.patches_operand(xz, geo),
                                im2col.patches(xz.dequantize(jnp.float32), geo))
