"""QArray: quantized values + scale (+ zero point), and how to make one.

``quantize(x, how)`` = calibrate (compute a scale, and a zero point for the
asymmetric ``minmax`` method) then round ``x / scale`` into the qtype.
``dequantize(q)`` gives back ``(q.qvalue - zero_point) * scale``.

Scale shapes: ``scale`` has the same rank as the array. Along each axis its
size is the full size for a *channelwise* axis (one scale per index), the
number of tiles for a *tiled* axis (group-wise scales along the contracting
axis, ``size // tile_size``), and 1 for an axis reduced over.

NaN and Inf are propagated visibly, never turned into plausible numbers: any
non-finite input makes the scale of its group NaN, so every dequantized value
of that group (and every product computed from it) is NaN.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.core import qarray
  >>> x = jax.random.normal(jax.random.key(0), (4, 64))
  >>> how = qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,), tiled_axes={1: 32})
  >>> q = qarray.quantize(x, how)
  >>> q.qvalue.dtype, q.scale.shape
  (dtype('int8'), (4, 2))
  >>> bool(jnp.max(jnp.abs(qarray.dequantize(q) - x)) < 0.02)
  True
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import _lax
from qtrain.core import qtypes
from qtrain.core import rounding

CalibrationMethod = Literal["absmax", "absmean", "rms", "minmax", "fixed", "percentile"]
CALIBRATION_METHODS: tuple[str, ...] = ("absmax", "absmean", "rms", "minmax", "fixed", "percentile")


def _is_real(v) -> bool:
  """An int or float (Python or numpy), not a bool and not a string."""
  return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


_F32 = np.finfo(np.float32)
# Calibration numbers become float32 scales: outside float32's normal range
# they would flush to 0 or overflow to inf.
_POSITIVE = f"a finite real number in [{float(_F32.tiny):.4g}, {float(_F32.max):.4g}] (float32's normal range)"


def _positive_float(field: str, v) -> float:
  if not _is_real(v) or not float(_F32.tiny) <= v <= float(_F32.max):  # NaN fails it
    raise ValueError(f"{field}={v!r} is not valid; valid: {_POSITIVE}")
  return float(v)


def _is_axis(a) -> bool:
  return isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))


def _int_tuple(v) -> tuple[int, ...] | None:
  """``v`` as a tuple of ints, or None if it is not a sequence of int axes."""
  if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__iter__"):
    return None
  v = tuple(v)
  return tuple(int(a) for a in v) if all(_is_axis(a) for a in v) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
  """How a scale is computed from the values it covers.

  Attributes:
    method: ``absmax`` (bound = max|x|), ``absmean`` (bound = mean|x|; for
      ``binary`` this is the L2-optimal scale), ``rms`` (bound =
      sqrt(mean x^2)), ``minmax`` (asymmetric: the range [min(x, 0), max(x, 0)]
      maps onto [qmin, qmax] with an integer zero point), ``fixed`` (bound =
      ``bound``, no data dependence), ``percentile`` (bound = the
      ``percentile``-th percentile of |x|).
    multiplier: multiplies the bound (e.g. ``rms`` with 3.0).
    bound: the fixed bound, only for ``fixed``.
    percentile: in (0, 100], only for ``percentile``.

  The scale is ``bound * multiplier / qmax``; values beyond the bound clip.
  """

  method: CalibrationMethod = "absmax"
  multiplier: float = 1.0
  bound: float | None = None
  percentile: float | None = None

  def __post_init__(self):
    if not isinstance(self.method, str) or self.method not in CALIBRATION_METHODS:
      raise ValueError(
          f"Unknown calibration method={self.method!r}; valid: {list(CALIBRATION_METHODS)}")
    object.__setattr__(self, "multiplier", _positive_float("multiplier", self.multiplier))
    if self.method == "fixed":
      if self.bound is None:
        raise ValueError("method='fixed' needs bound=..., got bound=None; valid: " + _POSITIVE)
      object.__setattr__(self, "bound", _positive_float("bound", self.bound))
    elif self.bound is not None:
      raise ValueError(f"bound={self.bound!r} is only used with method='fixed', not {self.method!r}")
    if self.method == "percentile":
      p = self.percentile
      if not _is_real(p) or not 0 < p <= 100:  # NaN fails the comparison
        raise ValueError(f"method='percentile' needs percentile=..., got percentile={p!r}; "
                         "valid: a real number in (0, 100]")
      object.__setattr__(self, "percentile", float(p))
    elif self.percentile is not None:
      raise ValueError(
          f"percentile={self.percentile!r} is only used with method='percentile', not {self.method!r}")

  @property
  def is_static(self) -> bool:
    return self.method == "fixed"

  @property
  def is_asymmetric(self) -> bool:
    return self.method == "minmax"


def as_calibration(c: "Calibration | str") -> Calibration:
  """Accepts a :class:`Calibration` or a method name (``"absmax"``, ``"rms"``...)."""
  if isinstance(c, Calibration):
    return c
  if isinstance(c, str):
    return Calibration(method=c)
  raise ValueError(f"calibration={c!r} must be a Calibration or one of {list(CALIBRATION_METHODS)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeSpec:
  """How to quantize one array: qtype, scale granularity, calibration, rounding.

  Attributes:
    qtype: a qtype name or dtype (see :mod:`qtrain.core.qtypes`).
    channelwise_axes: axes with one scale per index.
    tiled_axes: ``{axis: tile_size}``: group-wise scales along ``axis``, one per
      ``tile_size`` consecutive values (the size must divide the axis).
    calibration: a :class:`Calibration` or a method name.
    stochastic_rounding: ``None`` (round to nearest even), ``"uniform"`` or
      ``"low_bit_uniform"`` (see :mod:`qtrain.core.rounding`); needs a key.
  """

  qtype: object
  channelwise_axes: tuple[int, ...] = ()
  tiled_axes: Mapping[int, int] = dataclasses.field(default_factory=dict)
  calibration: Calibration | str = "absmax"
  stochastic_rounding: str | None = None

  def __post_init__(self):
    qt = qtypes.get_qtype(self.qtype)
    object.__setattr__(self, "qtype", qt)
    object.__setattr__(self, "calibration", as_calibration(self.calibration))
    cw = _int_tuple(self.channelwise_axes)
    if cw is None:
      raise ValueError(f"channelwise_axes={self.channelwise_axes!r} is not valid; valid: a tuple "
                       "of int axes, e.g. (0,) or (0, -1)")
    dup = sorted({a for a in cw if cw.count(a) > 1})
    if dup:
      raise ValueError(f"channelwise_axes={cw} names axis {dup[0]} more than once")
    object.__setattr__(self, "channelwise_axes", cw)
    tiles = self.tiled_axes
    if not isinstance(tiles, Mapping):
      raise ValueError(f"tiled_axes={tiles!r} is not valid; valid: a dict {{axis: tile_size}}, "
                       "e.g. {-1: 128}")
    for ax, t in tiles.items():
      if not _is_axis(ax):
        raise ValueError(f"tiled_axes={dict(tiles)!r}: axis {ax!r} is not an int axis")
      if not _is_axis(t) or t <= 0:
        raise ValueError(f"tiled_axes={dict(tiles)!r}: tile size {t!r} for axis {ax} is not "
                         "valid; valid: a positive int")
    object.__setattr__(self, "tiled_axes", {int(a): int(t) for a, t in tiles.items()})
    both = set(self.channelwise_axes) & set(self.tiled_axes)
    if both:
      raise ValueError(f"axes {sorted(both)} are both channelwise_axes and tiled_axes")
    if self.stochastic_rounding not in (None,) + rounding.STOCHASTIC_METHODS:
      raise ValueError(
          f"stochastic_rounding={self.stochastic_rounding!r}; valid: "
          f"{[None, *rounding.STOCHASTIC_METHODS]}")
    cal = self.calibration
    if cal.is_asymmetric and qt.kind != "int":
      raise ValueError(
          f"calibration 'minmax' (asymmetric, zero point) needs an integer qtype, got {qt.name!r}")

  def __hash__(self):
    return hash((self.qtype, self.channelwise_axes, tuple(sorted(self.tiled_axes.items())),
                 self.calibration, self.stochastic_rounding))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized array.

  Attributes:
    qvalue: quantized values in the qtype's compute dtype (int8 for integer,
      binary and ternary qtypes, the fp8 dtype for float qtypes); the shape of
      the original array (sub-byte values are NOT packed here: see
      :mod:`qtrain.core.packing`).
    scale: float32, same rank as ``qvalue`` (see the module docstring).
    zero_point: ``None``, or float32 integral values shaped like ``scale``
      (asymmetric quantization: ``x ~ (qvalue - zero_point) * scale``).
    qtype: the :class:`~qtrain.core.qtypes.QType` (static pytree metadata).
  """

  qvalue: jax.Array
  scale: jax.Array
  zero_point: jax.Array | None
  qtype: qtypes.QType = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return self.qvalue.shape

  @property
  def ndim(self) -> int:
    return self.qvalue.ndim

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize(self, dtype)


def _normalize_axes(spec: QuantizeSpec, shape: tuple[int, ...]):
  nd = len(shape)
  for what in ("channelwise_axes", "tiled_axes"):
    seen: dict[int, int] = {}  # normalized axis -> the entry that named it
    for ax in getattr(spec, what):
      if not -nd <= ax < nd:
        raise ValueError(f"axis {ax} is out of range for an array of shape {shape}")
      if ax % nd in seen:  # e.g. tiled_axes={1: 4, -1: 8} on a 2-d array
        raise ValueError(f"{what}={getattr(spec, what)!r} names axis {ax % nd} of shape {shape} "
                         f"twice: as {seen[ax % nd]} and as {ax}")
      seen[ax % nd] = ax
  cw = tuple(sorted(a % nd for a in spec.channelwise_axes))
  tiles = {a % nd: t for a, t in spec.tiled_axes.items()}
  both = set(cw) & set(tiles)
  if both:  # e.g. channelwise_axes=(1,) with tiled_axes={-1: 32} on a 2-d array
    raise ValueError(f"axes {sorted(both)} of shape {shape} are both channelwise_axes and "
                     f"tiled_axes (channelwise_axes={spec.channelwise_axes}, "
                     f"tiled_axes={spec.tiled_axes})")
  for a, t in tiles.items():
    if shape[a] % t:
      divisors = [d for d in (32, 64, 128, 256) if shape[a] % d == 0]
      raise ValueError(
          f"tile_size={t} does not divide axis {a} of size {shape[a]} (shape {shape}); "
          f"use a divisor of {shape[a]}" + (f", e.g. {divisors}" if divisors else ""))
  return cw, tiles


def _group_reduce(x: jax.Array, cw, tiles, fn) -> jax.Array:
  """Reduces ``x`` to the scale shape with ``fn(x, axis=..., keepdims=True)``."""
  shape = x.shape
  split_shape, red_axes, pos = [], [], 0
  for a, n in enumerate(shape):
    if a in tiles:
      split_shape += [n // tiles[a], tiles[a]]
      red_axes.append(pos + 1)
      pos += 2
    else:
      split_shape.append(n)
      if a not in cw:
        red_axes.append(pos)
      pos += 1
  r = fn(x.reshape(split_shape), axis=tuple(red_axes), keepdims=True)
  return r.reshape(scale_shape(shape, cw, tiles))


def scale_shape(shape, cw, tiles) -> tuple[int, ...]:
  return tuple(
      n // tiles[a] if a in tiles else (n if a in cw else 1) for a, n in enumerate(shape))


def expand_scale(s: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Repeats a (possibly tiled) scale so it broadcasts against ``shape``."""
  for a, (ns, n) in enumerate(zip(s.shape, shape)):
    if ns not in (1, n):
      s = jnp.repeat(s, n // ns, axis=a)
  return s


def _groups_of(scale_shape_: tuple[int, ...], shape: tuple[int, ...]):
  """Recovers (channelwise axes, tiles) from a scale shape."""
  cw = tuple(a for a, (ns, n) in enumerate(zip(scale_shape_, shape)) if ns == n and n != 1)
  tiles = {a: n // ns for a, (ns, n) in enumerate(zip(scale_shape_, shape)) if ns not in (1, n)}
  return cw, tiles


def nonfinite_to_nan(scale: jax.Array, x: jax.Array) -> jax.Array:
  """Sets the scale of every group of ``x`` holding a NaN/Inf to NaN."""
  cw, tiles = _groups_of(scale.shape, x.shape)
  finite = _group_reduce(jnp.isfinite(x), cw, tiles, jnp.all)
  return jnp.where(finite, scale, jnp.nan)


def calibrate(x: jax.Array, spec: QuantizeSpec) -> tuple[jax.Array, jax.Array | None]:
  """Returns ``(scale, zero_point)`` for ``x`` (zero_point None if symmetric)."""
  qt: qtypes.QType = spec.qtype  # type: ignore[assignment]
  cal: Calibration = spec.calibration  # type: ignore[assignment]
  cw, tiles = _normalize_axes(spec, x.shape)
  xf = x.astype(jnp.float32)
  if cal.method == "minmax":
    lo = jnp.minimum(_group_reduce(xf, cw, tiles, jnp.min), 0.0) * cal.multiplier
    hi = jnp.maximum(_group_reduce(xf, cw, tiles, jnp.max), 0.0) * cal.multiplier
    span = hi - lo
    scale = _finite_or_nan(jnp.where(span == 0, 1.0, span / (qt.qmax - qt.qmin)))
    zero_point = jnp.clip(qt.qmin - jnp.round(lo / scale), qt.qmin, qt.qmax)
    return scale, zero_point
  ax = jnp.abs(xf)
  if cal.method == "absmax":
    bound = _group_reduce(ax, cw, tiles, jnp.max)
  elif cal.method == "absmean":
    bound = _group_reduce(ax, cw, tiles, jnp.mean)
  elif cal.method == "rms":
    bound = jnp.sqrt(_group_reduce(xf * xf, cw, tiles, jnp.mean))
  elif cal.method == "percentile":
    p = cal.percentile
    bound = _group_reduce(ax, cw, tiles, lambda v, axis, keepdims: jnp.percentile(
        v, p, axis=axis, keepdims=keepdims))
  else:  # fixed
    bound = jnp.full(scale_shape(x.shape, cw, tiles), cal.bound, jnp.float32)
  bound = bound * cal.multiplier
  # bound == 0 (all zeros): scale 1 gives exact zeros back; binary has no 0
  # code, so its all-zero groups get scale 0 (+1 * 0 = 0). NaN/Inf bounds -> NaN.
  zero_scale = 0.0 if qt.kind == "binary" else 1.0
  return _finite_or_nan(jnp.where(bound == 0, zero_scale, bound / qt.qmax)), None


def _safe_scale(scale: jax.Array) -> jax.Array:
  """``scale`` with 0 replaced by 1, to divide by: a zero scale (binary's
  all-zero group) holds only zeros, and ``0 / 1 = 0`` where ``0 / 0`` is NaN."""
  return jnp.where(scale == 0, 1.0, scale)


def _finite_or_nan(scale: jax.Array) -> jax.Array:
  return jnp.where(jnp.isfinite(scale), scale, jnp.nan)


def quantize_with_scale(
    x: jax.Array,
    qtype,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    *,
    stochastic_rounding: str | None = None,
    key: jax.Array | None = None,
    check_finite: bool = True,
) -> QArray:
  """Quantizes ``x`` with a given (e.g. static or learned) scale.

  With ``check_finite`` (the default), non-finite values of ``x`` make their
  whole scale group NaN, so they show as NaN after dequantization instead of
  as clipped, plausible numbers. ``quantize`` turns it off for calibrations
  whose scale already propagates NaN/Inf (absmax, absmean, rms, minmax).
  """
  qt = qtypes.get_qtype(qtype)
  xf = x.astype(jnp.float32)
  scale = scale.astype(jnp.float32)
  if scale.ndim != x.ndim:
    raise ValueError(f"scale of shape {scale.shape} must have the rank of x {x.shape}")
  if check_finite:
    scale = nonfinite_to_nan(scale, x)
  y = xf / _safe_scale(expand_scale(scale, x.shape))
  if zero_point is not None:
    y = y + expand_scale(zero_point, x.shape)
  if stochastic_rounding is not None:
    if key is None:
      raise ValueError(f"stochastic_rounding={stochastic_rounding!r} needs a PRNG key, got key=None")
    qv = rounding.stochastic_round(y, qt, key, method=stochastic_rounding)
  else:
    qv = rounding.round_nearest(y, qt)
  return QArray(qvalue=qv, scale=scale, zero_point=zero_point, qtype=qt)


def quantize(x: jax.Array, spec: QuantizeSpec, *, key: jax.Array | None = None) -> QArray:
  """Calibrates and quantizes ``x`` per ``spec`` (see :class:`QuantizeSpec`)."""
  scale, zp = calibrate(x, spec)
  method = spec.calibration.method  # type: ignore[union-attr]
  return quantize_with_scale(
      x, spec.qtype, scale, zp, stochastic_rounding=spec.stochastic_rounding, key=key,
      check_finite=method in ("fixed", "percentile"))


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """``(qvalue - zero_point) * scale`` in ``dtype``.

  fp8 values pass through an optimization barrier first: XLA's GPU backend
  (jax 0.11.2, ``xla_allow_excess_precision``) otherwise folds the
  f32 -> fp8 -> f32 round trip of a value quantized in the same jit into
  nothing, dropping the fp8 rounding (measured on an H200: 4095 of 4096
  round-tripped values were not fp8 values).
  """
  v = q.qvalue
  if q.qtype.is_float:
    v = _lax.optimization_barrier(v)
  v = v.astype(jnp.float32)
  if q.zero_point is not None:
    v = v - expand_scale(q.zero_point, q.shape)
  return (v * expand_scale(q.scale, q.shape)).astype(dtype)


def fake_quantize(x: jax.Array, spec: QuantizeSpec, *, key=None) -> jax.Array:
  """``dequantize(quantize(x))`` in ``x.dtype`` (no gradient handling)."""
  return dequantize(quantize(x, spec, key=key), x.dtype)
