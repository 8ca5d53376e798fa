"""The qtype registry: what each quantized number format is.

A *qtype* names a quantized number format. Users pass qtypes as strings
(``"int8"``, ``"int7"`` ... ``"int2"``, ``"binary"``, ``"ternary"``,
``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"nf4"``, ``"mxfp8"``, ``"mxfp4"``) or,
where JAX has one, as a dtype (``jnp.int8``, ``jnp.int4``, ``jnp.float8_e4m3fn``,
...). :func:`get_qtype` turns either into a :class:`QType` record.

Value-set ("LUT") qtypes hold 4-bit *codes* (0..15) that index a table of 16
values (:attr:`QType.values`): ``nf4`` is QLoRA's NormalFloat-4 (16 values in
[-1, 1], code 7 is 0), ``mxfp4``'s elements are OCP fp4 e2m1 (the code is the
e2m1 bit pattern: sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6). The OCP MX qtypes (``mxfp8``: e4m3 elements, ``mxfp4``: e2m1
elements) share one power-of-two (e8m0) scale per block of 32 values along the
contraction (:attr:`QType.scale_format`, :attr:`QType.block_size`).

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

Kind = Literal["int", "binary", "ternary", "float", "lut"]
ScaleFormat = Literal["float32", "e8m0"]

# QLoRA's NormalFloat-4 (Dettmers et al. 2023, appendix E): the quantiles of N(0, 1) scaled to
# [-1, 1], with an exact 0 (7 negative values, 0, 8 positive ones); code i is the i-th value.
NF4_VALUES: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _e2m1(code: int) -> float:
  """The value of an OCP fp4 e2m1 bit pattern (bias 1, a subnormal 0.5 step, no Inf/NaN)."""
  sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
  mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
  return -mag if sign else mag


E2M1_VALUES: tuple[float, ...] = tuple(_e2m1(c) for c in range(16))
# The OCP MX block: 32 consecutive values along the contraction share one e8m0 scale.
MX_BLOCK = 32
# Each value-set qtype's default block (QLoRA quantizes nf4 weights in blocks of 64).
NF4_BLOCK = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class QType:
  """A quantized number format.

  Attributes:
    name: canonical name (``"int8"``, ``"binary"``, ...).
    kind: ``"int"`` (symmetric two's-complement integers), ``"binary"``
      (values -1/+1), ``"ternary"`` (-1/0/+1), ``"float"`` (fp8 elements:
      ``float8_*`` and ``mxfp8``) or ``"lut"`` (4-bit codes into a table of
      16 values: ``nf4``, ``mxfp4``).
    bits: bits per value in storage (1 for binary, 2 for ternary and int2, 4
      for int3, int4 and the LUT qtypes, 8 for int5..int8 and fp8).
    qmin: smallest representable quantized value (for ``float`` kinds the
      most negative finite value).
    qmax: largest representable quantized value (the calibration maps the
      scale so that ``absmax`` lands here).
    compute_dtype: the dtype the quantized values are held in for
      arithmetic: int8 for every integer-like kind (sub-byte values are
      computed exactly in int8 after unpacking), the fp8 dtype for floats,
      uint8 *codes* for LUT kinds (a product reads their values from
      :attr:`values` first: codes are not numbers).
    packable: whether :mod:`qtrain.core.packing` can pack it into words.
    values: LUT kinds: the value of each code 0..15; None otherwise.
    scale_format: ``"float32"`` (any positive float32 scale) or ``"e8m0"``
      (OCP MX: a power of two 2**k, see :func:`qtrain.core.qarray.calibrate`).
    block_size: the default number of values per scale along the
      contraction (``tile_size``): 64 for nf4, 32 for the MX qtypes (for
      which it is the only valid one); None: per channel by default.
  """

  name: str
  kind: Kind
  bits: int
  qmin: float
  qmax: float
  compute_dtype: jnp.dtype
  packable: bool
  values: tuple[float, ...] | None = None
  scale_format: ScaleFormat = "float32"
  block_size: int | None = None

  @property
  def is_float(self) -> bool:
    return self.kind == "float"

  @property
  def is_integer_like(self) -> bool:
    """True for int, binary and ternary: computed exactly in int8."""
    return self.kind in ("int", "binary", "ternary")

  @property
  def is_lut(self) -> bool:
    """True for the value-set qtypes (nf4, mxfp4): ``qvalue`` holds codes, not values."""
    return self.kind == "lut"

  @property
  def is_mx(self) -> bool:
    """True for the OCP MX qtypes: a power-of-two scale per block of :data:`MX_BLOCK`."""
    return self.scale_format == "e8m0"

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


def _lut(name: str, values: tuple[float, ...], *, scale_format: ScaleFormat, block: int) -> QType:
  return QType(
      name=name, kind="lut", bits=4, qmin=min(values), qmax=max(values),
      compute_dtype=jnp.dtype(jnp.uint8), packable=True, values=values,
      scale_format=scale_format, block_size=block,
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
    "nf4": _lut("nf4", NF4_VALUES, scale_format="float32", block=NF4_BLOCK),
    "mxfp8": dataclasses.replace(_fp8("float8_e4m3fn"), name="mxfp8", scale_format="e8m0",
                                 block_size=MX_BLOCK),
    "mxfp4": _lut("mxfp4", E2M1_VALUES, scale_format="e8m0", block=MX_BLOCK),
}

VALID_QTYPES: tuple[str, ...] = tuple(_REGISTRY)

QTypeLike = "str | jnp.dtype | type | QType"

GRADIENT_QTYPES: tuple[str, ...] = tuple(
    n for n, q in _REGISTRY.items() if q.kind in ("int", "float") or q.is_mx)
"""The qtypes an incoming gradient may take: int2..int8, fp8 and the MX formats (mxfp8,
mxfp4: blocks of 32 along each backward product's contraction). Binary and ternary have no
small values; nf4's 16 values are quantiles of a normal weight distribution, a weight format
here."""


def check_gradient_qtype(qt: QType, field: str) -> None:
  """Raises a ValueError naming ``field`` and :data:`GRADIENT_QTYPES` unless ``qt`` is one."""
  if qt.name not in GRADIENT_QTYPES:
    why = {"nf4": " (nf4 is a weight format: its 16 values are quantiles of a normal weight "
                  "distribution, not of gradients)"}.get(qt.name, "")
    raise ValueError(f"{field}={qt.name!r}: gradients need int2..int8 or fp8 (or MX: mxfp8, "
                     f"mxfp4), one of {list(GRADIENT_QTYPES)}{why}")


def check_tile_size(qt: QType, tile_size: object, field: str = "tile_size") -> None:
  """An MX qtype's scale block is the format's (:data:`MX_BLOCK`): any other ``tile_size``
  raises, naming the valid one. Other qtypes take any positive tile (checked elsewhere)."""
  if qt.is_mx and tile_size is not None and tile_size != qt.block_size:
    raise ValueError(f"{field}={tile_size!r} with qtype {qt.name!r}: an MX format shares one "
                     f"e8m0 scale per block of {qt.block_size} values; valid: None (the default, "
                     f"{qt.block_size}) or {qt.block_size}")


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
