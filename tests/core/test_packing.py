"""qtrain.core.packing: THE bit layout, round trips, and bad inputs."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import packing, qtypes

PACKABLE = ["binary", "ternary", "int2", "int3", "int4", "int5", "int6", "int7", "int8"]

_SETTINGS = hypothesis.settings(max_examples=12, deadline=None, database=None,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


# One XLA compile per (shape, axis) instead of one per primitive.
_pack = jax.jit(packing.pack, static_argnames=("qtype", "axis"))
_unpack = jax.jit(packing.unpack, static_argnames=("qtype", "size", "axis"))


def _values_strategy(qtype):
  qt = qtypes.get_qtype(qtype)
  if qt.kind == "binary":
    return st.sampled_from([-1, 1])
  return st.integers(int(qt.qmin), int(qt.qmax))


def _np_pack_reference(values, bits, binary):
  """Independent float-free reference of the documented layout (python ints)."""
  v = np.asarray(values).astype(np.int64)
  vpw = 32 // bits
  n = v.shape[-1]
  nw = -(-n // vpw)
  out = np.zeros(v.shape[:-1] + (nw,), np.uint64)
  codes = (v > 0).astype(np.int64) if binary else (v & ((1 << bits) - 1))
  for k in range(n):
    out[..., k // vpw] |= (codes[..., k].astype(np.uint64) << np.uint64((k % vpw) * bits))
  return out.astype(np.uint32)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", PACKABLE)
@_SETTINGS
@hypothesis.given(data=st.data())
def test_round_trip_bit_exact_any_shape_any_axis(qtype, data):
  qt = qtypes.get_qtype(qtype)
  shape = data.draw(st.sampled_from([(5,), (3, 33), (2, 7, 5), (1, 64)]))
  axis = data.draw(st.integers(-len(shape), len(shape) - 1))
  values = data.draw(hnp.arrays(np.int8, shape, elements=_values_strategy(qtype)))
  words = _pack(jnp.asarray(values), qtype, axis=axis)
  n = shape[axis]
  vpw = packing.values_per_word(qt.bits)
  assert words.dtype == jnp.uint32
  expected_shape = list(shape)
  expected_shape[axis] = -(-n // vpw)
  assert words.shape == tuple(expected_shape)
  assert packing.packed_size(n, qt.bits) == expected_shape[axis]
  # The words follow the documented layout exactly.
  ref = _np_pack_reference(np.moveaxis(values, axis, -1), qt.bits, qt.kind == "binary")
  np.testing.assert_array_equal(np.asarray(jnp.moveaxis(words, axis, -1)), ref)
  back = _unpack(words, qtype, size=n, axis=axis)
  assert back.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(back), values)


def test_layout_int4_hand_built():
  # Value k at bits 4k..4k+3, LSB first; two's-complement low nibbles.
  v = [1, -2, 3, -4, 5, -6, 7, -8, -1]
  words = packing.pack(jnp.array([v], jnp.int8), "int4")
  w0 = (0x1 | 0xE << 4 | 0x3 << 8 | 0xC << 12 | 0x5 << 16 | 0xA << 20 | 0x7 << 24 | 0x8 << 28)
  assert w0 == 0x87A5C3E1
  np.testing.assert_array_equal(np.asarray(words), np.array([[w0, 0xF]], np.uint32))
  np.testing.assert_array_equal(np.asarray(packing.unpack(words, "int4", size=9)), [v])


@pytest.mark.slow
def test_layout_binary_ternary_int2_int8_hand_built():
  # binary: bit 1 for +1, 0 for -1; the ragged tail pads with 0 (decodes to -1).
  b = [1, -1, -1, 1, 1]
  np.testing.assert_array_equal(np.asarray(packing.pack(jnp.array(b, jnp.int8), "binary")),
                                [0b11001])
  np.testing.assert_array_equal(
      np.asarray(packing.unpack(jnp.array([0b11001], jnp.uint32), "binary", size=32))[:6],
      [1, -1, -1, 1, 1, -1])
  # binary: any value > 0 is +1, anything else (0 too) is -1.
  np.testing.assert_array_equal(np.asarray(packing.pack(jnp.array([3, 0, -5], jnp.int8), "binary")),
                                [0b001])
  # ternary: -1 is 0b11, 0 is 0b00, +1 is 0b01; 16 per word.
  t = [-1, 0, 1, 1, -1]
  np.testing.assert_array_equal(np.asarray(packing.pack(jnp.array(t, jnp.int8), "ternary")),
                                [0b11_01_01_00_11])
  # int2: -2 is 0b10.
  np.testing.assert_array_equal(np.asarray(packing.pack(jnp.array([-2, 1, -1, 0], jnp.int8), "int2")),
                                [0b00_11_01_10])
  # int8: 4 bytes, little end first.
  np.testing.assert_array_equal(
      np.asarray(packing.pack(jnp.array([1, -1, 127, -128, 5], jnp.int8), "int8")),
      [0x807FFF01, 0x05])
  # Packing along axis 0 of an (N, K) array packs columns.
  x = jnp.array([[1, -1], [1, 1], [-1, 1]], jnp.int8)
  np.testing.assert_array_equal(np.asarray(packing.pack(x, "binary", axis=0)), [[0b011, 0b110]])


def test_values_per_word_and_packed_size():
  assert [packing.values_per_word(b) for b in (1, 2, 4, 8)] == [32, 16, 8, 4]
  assert packing.packed_size(33, 1) == 2 and packing.packed_size(32, 1) == 1
  assert packing.packed_size(9, 4) == 2
  with pytest.raises(ValueError, match="bits=3"):
    packing.values_per_word(3)


def test_accepts_other_integer_dtypes_and_jnp_qtypes():
  v = np.array([[3, -4, 0, 7, -8]], np.int32)
  w = packing.pack(jnp.asarray(v), jnp.int4)
  np.testing.assert_array_equal(np.asarray(packing.unpack(w, jnp.int4, size=5)), v)


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "float8_e5m2", jnp.float8_e4m3fn])
def test_non_packable_qtype_raises(qtype):
  with pytest.raises(ValueError, match="cannot be bit-packed") as e:
    packing.pack(jnp.zeros((4,), jnp.int8), qtype)
  assert "binary" in str(e.value) and "int4" in str(e.value)
  with pytest.raises(ValueError, match="cannot be bit-packed"):
    packing.unpack(jnp.zeros((1,), jnp.uint32), qtype, size=4)


def test_unknown_qtype_raises():
  with pytest.raises(ValueError, match="int9"):
    packing.pack(jnp.ones((4,), jnp.int8), "int9")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_float_values_raise(dtype):
  with pytest.raises(ValueError, match="integer"):
    packing.pack(jnp.ones((8,), dtype), "int4")


def test_wrong_size_and_word_dtype_raise():
  words = packing.pack(jnp.ones((2, 20), jnp.int8), "int4")  # 3 words per row
  assert words.shape == (2, 3)
  for size in (16, 25, 0):
    with pytest.raises(ValueError, match=f"size={size}"):
      packing.unpack(words, "int4", size=size)
  for size in (17, 24):
    assert packing.unpack(words, "int4", size=size).shape == (2, size)
  with pytest.raises(ValueError, match="uint32"):
    packing.unpack(words.astype(jnp.int32), "int4", size=20)


def test_pack_under_jit():
  v = jax.random.randint(jax.random.key(0), (3, 70), -8, 8).astype(jnp.int8)
  f = jax.jit(lambda v: packing.unpack(packing.pack(v, "int4"), "int4", size=70))
  np.testing.assert_array_equal(np.asarray(f(v)), np.asarray(v))


@pytest.mark.parametrize("qtype,bad", [("int4", 9), ("int4", -9), ("int2", 2), ("ternary", 2)])
def test_pack_rejects_out_of_range_values(qtype, bad):
  values = np.array([[0, 1, bad, -1]], np.int8)
  with pytest.raises(ValueError, match=r"do not fit"):
    packing.pack(values, qtype)


@pytest.mark.parametrize("axis", [2, -3, 7, 1.0, True])
def test_out_of_range_or_non_int_axis_raises_naming_axis_ndim_and_range(axis):
  # An out-of-range axis used to wrap (axis % ndim) and pack a different axis.
  v = jnp.ones((2, 8), jnp.int8)
  msg = rf"axis={axis!r}.*ndim=2.*\[-2, 1\]"
  with pytest.raises(ValueError, match=msg):
    packing.pack(v, "int4", axis=axis)
  with pytest.raises(ValueError, match=msg):
    packing.unpack(packing.pack(v, "int4"), "int4", size=8, axis=axis)


def test_negative_axes_name_the_same_axis_as_positive_ones():
  v = np.random.default_rng(1).integers(-8, 8, (3, 5, 9)).astype(np.int8)
  w = _pack(v, qtype="int4", axis=-3)
  assert w.shape == (1, 5, 9)
  np.testing.assert_array_equal(w, _pack(v, qtype="int4", axis=0))
  np.testing.assert_array_equal(_unpack(w, qtype="int4", size=3, axis=-3), v)


def test_zero_d_input_raises_instead_of_dividing_by_zero():
  with pytest.raises(ValueError, match="at least one axis.*0-d"):
    packing.pack(jnp.ones((), jnp.int8), "int4")
  with pytest.raises(ValueError, match="at least one axis.*0-d"):
    packing.unpack(jnp.ones((), jnp.uint32), "int4", size=1)
