"""The qtype registry: what each quantized number format is.

A *qtype* names a quantized number format. Users pass qtypes as strings
(``"int8"``, ``"int7"`` ... ``"int2"``, ``"binary"``, ``"ternary"``,
``"float8_e4m3fn"``, ``"float8_e5m2"``) or, where JAX has one, as a dtype
(``jnp.int8``, ``jnp.int4``, ``jnp.float8_e4m3fn``, ...). :func:`get_qtype`
turns either into a :class:`QType` record.

Example:
  >>> from qtrain.core import qtypes
  >>> qtypes.get_qtype("int4").qmax
  7
  >>> qtypes.get_qtype("binary").bits
  1
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

Kind = Literal["int", "binary", "ternary", "float"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QType:
  """A quantized number format.

  Attributes:
    name: canonical name (``"int8"``, ``"binary"``, ...).
    kind: ``"int"`` (symmetric two's-complement integers), ``"binary"``
      (values -1/+1), ``"ternary"`` (-1/0/+1) or ``"float"`` (fp8).
    bits: bits per value in storage (1 for binary, 2 for ternary and int2, 4
      for int3 and int4, 8 for int5..int8 and fp8).
    qmin: smallest representable quantized value (for ``float`` kinds the
      most negative finite value).
    qmax: largest representable quantized value (the calibration maps the
      scale so that ``absmax`` lands here).
    compute_dtype: the dtype the quantized values are held in for
      arithmetic: int8 for every integer-like kind (sub-byte values are
      computed exactly in int8 after unpacking), the fp8 dtype for floats.
    packable: whether :mod:`qtrain.core.packing` can pack it into words.
  """

  name: str
  kind: Kind
  bits: int
  qmin: float
  qmax: float
  compute_dtype: jnp.dtype
  packable: bool

  @property
  def is_float(self) -> bool:
    return self.kind == "float"

  @property
  def is_integer_like(self) -> bool:
    """True for int, binary and ternary: computed exactly in int8."""
    return self.kind != "float"

  @property
  def container(self) -> str:
    """The qtype whose packed layout and kernels hold this one's codes: int3 sits in int4's
    4-bit fields, int5..int7 in int8's bytes (every code fits, sign-extended the same way);
    every other qtype is its own container."""
    return f"int{self.bits}" if self.kind == "int" else self.name

  def __str__(self) -> str:
    return self.name


def _int(bits: int) -> QType:
  # Stored in the next packed field width: int3 in int4's 4-bit fields, int5..int7 in bytes.
  return QType(
      name=f"int{bits}",
      kind="int",
      bits=next(b for b in (2, 4, 8) if b >= bits),
      qmin=-(2 ** (bits - 1)),
      qmax=2 ** (bits - 1) - 1,
      compute_dtype=jnp.dtype(jnp.int8),
      packable=True,
  )


def _fp8(name: str) -> QType:
  dtype = jnp.dtype(getattr(jnp, name))
  finfo = jnp.finfo(dtype)
  return QType(
      name=name,
      kind="float",
      bits=8,
      qmin=float(finfo.min),
      qmax=float(finfo.max),
      compute_dtype=dtype,
      packable=False,
  )


_REGISTRY: dict[str, QType] = {
    "int8": _int(8),
    "int7": _int(7),
    "int6": _int(6),
    "int5": _int(5),
    "int4": _int(4),
    "int3": _int(3),
    "int2": _int(2),
    "binary": QType(
        name="binary", kind="binary", bits=1, qmin=-1, qmax=1,
        compute_dtype=jnp.dtype(jnp.int8), packable=True,
    ),
    "ternary": QType(
        name="ternary", kind="ternary", bits=2, qmin=-1, qmax=1,
        compute_dtype=jnp.dtype(jnp.int8), packable=True,
    ),
    "float8_e4m3fn": _fp8("float8_e4m3fn"),
    "float8_e5m2": _fp8("float8_e5m2"),
}

VALID_QTYPES: tuple[str, ...] = tuple(_REGISTRY)

QTypeLike = "str | jnp.dtype | type | QType"


def get_qtype(qtype: object) -> QType:
  """Returns the :class:`QType` for a name, a dtype or a QType.

  Args:
    qtype: a name from :data:`VALID_QTYPES`, a JAX/numpy dtype (or scalar
      type such as ``jnp.int8``) with a matching name, or a :class:`QType`.

  Raises:
    ValueError: if ``qtype`` names no known qtype; the message lists the
      valid ones.
  """
  if isinstance(qtype, QType):
    return qtype
  name: str | None
  if isinstance(qtype, str):
    name = qtype
  else:
    try:
      name = np.dtype(qtype).name
    except TypeError:
      name = None
  if name is None or name not in _REGISTRY:
    raise ValueError(
        f"Unknown qtype {qtype!r}; valid qtypes are {list(VALID_QTYPES)} "
        "(as strings, or as the matching jnp dtypes)."
    )
  return _REGISTRY[name]
