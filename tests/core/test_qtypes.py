"""qtrain.core.qtypes: every qtype by name and by dtype; unknown names fail loudly."""

import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.core import qtypes

# name -> (kind, bits, qmin, qmax, compute dtype, packable)
EXPECTED = {
    "int8": ("int", 8, -128, 127, jnp.int8, True),
    "int7": ("int", 8, -64, 63, jnp.int8, True),
    "int6": ("int", 8, -32, 31, jnp.int8, True),
    "int5": ("int", 8, -16, 15, jnp.int8, True),
    "int4": ("int", 4, -8, 7, jnp.int8, True),
    "int3": ("int", 4, -4, 3, jnp.int8, True),
    "int2": ("int", 2, -2, 1, jnp.int8, True),
    "binary": ("binary", 1, -1, 1, jnp.int8, True),
    "ternary": ("ternary", 2, -1, 1, jnp.int8, True),
    "float8_e4m3fn": ("float", 8, -448.0, 448.0, jnp.float8_e4m3fn, False),
    "float8_e5m2": ("float", 8, -57344.0, 57344.0, jnp.float8_e5m2, False),
    "nf4": ("lut", 4, -1.0, 1.0, jnp.uint8, True),
    "mxfp8": ("float", 8, -448.0, 448.0, jnp.float8_e4m3fn, False),
    "mxfp4": ("lut", 4, -6.0, 6.0, jnp.uint8, True),
}

# qtypes JAX has a dtype for.
DTYPES = {
    "int8": [jnp.int8, np.int8, jnp.dtype("int8")],
    "int4": [jnp.int4, jnp.dtype(jnp.int4)],
    "int2": [jnp.int2, jnp.dtype(jnp.int2)],
    "float8_e4m3fn": [jnp.float8_e4m3fn, jnp.dtype(jnp.float8_e4m3fn)],
    "float8_e5m2": [jnp.float8_e5m2, jnp.dtype(jnp.float8_e5m2)],
}


def test_valid_qtypes_is_exactly_the_documented_set():
  assert set(qtypes.VALID_QTYPES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_name_gives_the_documented_record(name):
  kind, bits, qmin, qmax, dtype, packable = EXPECTED[name]
  qt = qtypes.get_qtype(name)
  assert (qt.name, qt.kind, qt.bits, qt.qmin, qt.qmax) == (name, kind, bits, qmin, qmax)
  assert qt.compute_dtype == jnp.dtype(dtype)
  assert qt.packable is packable
  assert qt.is_float is (kind == "float")
  assert qt.is_integer_like is (kind in ("int", "binary", "ternary"))
  assert str(qt) == name
  # A QType passes through unchanged.
  assert qtypes.get_qtype(qt) is qt


@pytest.mark.parametrize("name,dtype", [(n, d) for n, ds in DTYPES.items() for d in ds])
def test_dtype_is_accepted(name, dtype):
  assert qtypes.get_qtype(dtype) is qtypes.get_qtype(name)


@pytest.mark.parametrize("bad", ["int1", "int9", "int16", "INT8", "fp8", "uint8", "", jnp.float32, jnp.uint8,
                                 jnp.bfloat16, jnp.float8_e4m3fnuz, 8, None, object()])
def test_unknown_qtype_raises_value_error_listing_valid_ones(bad):
  with pytest.raises(ValueError) as e:
    qtypes.get_qtype(bad)
  msg = str(e.value)
  for name in qtypes.VALID_QTYPES:
    assert repr(name) in msg, (name, msg)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_container_holds_every_code_in_the_same_field_width(name):
  """int3 lives in int4's layout and kernels, int5..int7 in int8's: the container has the
  qtype's storage width and a code range that covers it."""
  qt = qtypes.get_qtype(name)
  box = qtypes.get_qtype(qt.container)
  assert box.bits == qt.bits and box.kind == qt.kind
  assert box.qmin <= qt.qmin and qt.qmax <= box.qmax
  assert (box is qt) is (name in ("int8", "int4", "int2", "binary", "ternary", "float8_e4m3fn",
                                  "float8_e5m2", "nf4", "mxfp8", "mxfp4"))
