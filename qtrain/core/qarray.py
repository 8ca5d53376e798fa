"""QArray: quantized values + scale (+ zero point), and how to make one.

``quantize(x, how)`` = calibrate (compute a scale, and a zero point for the
asymmetric ``minmax`` method) then round ``x / scale`` into the qtype.
``dequantize(q)`` gives back ``(q.qvalue - zero_point) * scale``.

Scale shapes: ``scale`` has the same rank as the array. Along each axis its
size is the full size for a *channelwise* axis (one scale per index), the
number of tiles for a *tiled* axis (group-wise scales along the contracting
axis, ``size // tile_size``), and 1 for an axis reduced over.

Zeros: every calibration gives an all-zero group back as exact zeros (scale
1 from the data-dependent ones, 0 for ``binary`` whatever the calibration).
``binary`` has no zero code (sign(0) = +1, which is what lets it pack into one
bit), so a 0 among non-zero values of its group comes back as +scale (with a
``fixed`` bound: +bound).

Finite inputs of any float32 magnitude give finite scales and finite
dequantized values: scales are floored at the smallest normal float32
(:data:`TINY`; XLA flushes subnormals to zero, which would zero a whole
group) and capped where ``qmax * scale`` would overflow (:func:`max_scale`).
NaN and Inf are propagated visibly, never turned into plausible numbers: any
non-finite input makes the scale of its group NaN, so every dequantized value
of that group (and every product computed from it) is NaN.

Value-set qtypes (``nf4``, ``mxfp4``): ``qvalue`` holds codes (uint8, 0..15)
and :func:`dequantize` reads their values from the qtype's table first
(``values[code] * scale``); ``nf4``'s scale is the group's bound (its values
span [-1, 1]). MX qtypes (``mxfp8``, ``mxfp4``) need blocks of 32 along one
axis (``tiled_axes={axis: 32}``, every other axis channelwise: the OCP block is
32 values of one row) and take the e8m0 scale of :func:`e8m0_scale`.

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
import functools
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


_CALIBRATION_STRINGS = ("a method name, or '<method>,<args>' (qwix's format): 'absmax,0.9', "
                        "'minmax,0.9', 'absmean,2', 'rms,3' (the multiplier), 'percentile,99.9', "
                        "'fixed,4' or 'fixed,-4,4' (the bound)")


def as_calibration(c: "Calibration | str") -> Calibration:
  """Accepts a :class:`Calibration`, a method name (``"absmax"``, ``"rms"``...) or
  ``"<method>,<args>"`` as qwix writes it: ``"absmax,0.9"`` / ``"minmax,0.9"`` /
  ``"absmean,2"`` / ``"rms,3"`` (the multiplier), ``"percentile,99.9"``, ``"fixed,4"`` or
  ``"fixed,-4,4"`` (the bound: a fixed range is symmetric here, so ``"fixed,-2,4"`` raises).

  Example:
    >>> from qtrain.core import qarray
    >>> qarray.as_calibration("rms,3")
    Calibration(method='rms', multiplier=3.0, bound=None, percentile=None)
    >>> qarray.as_calibration("fixed,-4,4").bound
    4.0
  """
  if isinstance(c, Calibration):
    return c
  if not isinstance(c, str):
    raise ValueError(f"calibration={c!r} must be a Calibration or one of "
                     f"{list(CALIBRATION_METHODS)}, or {_CALIBRATION_STRINGS}")
  method, *args = (part.strip() for part in c.split(","))
  if not args:
    return Calibration(method=method)
  try:
    nums = [float(a) for a in args]
  except ValueError:
    raise ValueError(f"calibration={c!r}: the arguments after the method must be numbers; "
                     f"valid: {_CALIBRATION_STRINGS}") from None
  if method == "fixed" and len(nums) in (1, 2):
    lo, hi = (-abs(nums[0]), abs(nums[0])) if len(nums) == 1 else nums
    if lo != -hi or hi <= 0:
      raise ValueError(f"calibration={c!r}: a fixed range is symmetric in qtrain ('fixed,-b,b' or "
                       f"'fixed,b' with b > 0); got [{lo:g}, {hi:g}]")
    return Calibration(method="fixed", bound=hi)
  if method == "percentile" and len(nums) == 1:
    return Calibration(method="percentile", percentile=nums[0])
  if method in ("absmax", "minmax", "absmean", "rms") and len(nums) == 1:
    return Calibration(method=method, multiplier=nums[0])
  if method not in CALIBRATION_METHODS:
    return Calibration(method=method)  # raises, naming the valid methods
  raise ValueError(f"calibration={c!r}: wrong number of arguments for {method!r}; "
                   f"valid: {_CALIBRATION_STRINGS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeSpec:
  """How to quantize one array: qtype, scale granularity, calibration, rounding.

  Attributes:
    qtype: a qtype name or dtype (see :mod:`qtrain.core.qtypes`).
    channelwise_axes: axes with one scale per index.
    tiled_axes: ``{axis: tile_size}``: group-wise scales along ``axis``, one per
      ``tile_size`` consecutive values (the size must divide the axis).
    calibration: a :class:`Calibration` or a method name.
    stochastic_rounding: ``None`` (round to nearest even) or one of
      :data:`~qtrain.core.rounding.STOCHASTIC_METHODS` (see :mod:`qtrain.core.rounding`);
      needs a key.
    axis_names: inside ``jax.shard_map``, the mesh axes that split the axes a scale is
      reduced over: each group's bound is reduced across them too, so every shard gets the
      scale of the whole (global) array. For ``absmax``, ``minmax`` and ``fixed``
      calibrations (a percentile, mean or rms of shards is not theirs combined). Naming an
      axis that splits a channel axis instead would mix different channels' scales.
  """

  qtype: object
  channelwise_axes: tuple[int, ...] = ()
  tiled_axes: Mapping[int, int] = dataclasses.field(default_factory=dict)
  calibration: Calibration | str = "absmax"
  stochastic_rounding: str | None = None
  axis_names: tuple[str, ...] = ()

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
    rounding.check_stochastic_method(self.stochastic_rounding)
    cal = self.calibration
    if cal.is_asymmetric and qt.kind != "int":
      raise ValueError(
          f"calibration 'minmax' (asymmetric, zero point) needs an integer qtype, got {qt.name!r}")
    if qt.is_mx:
      if not self.tiled_axes:
        raise ValueError(f"qtype {qt.name!r} needs tiled_axes={{axis: {qt.block_size}}} (one e8m0 "
                         f"scale per block of {qt.block_size} values along that axis), got none")
      for t in self.tiled_axes.values():
        qtypes.check_tile_size(qt, t, "tiled_axes tile size")
    object.__setattr__(self, "axis_names", shared_axis_names(self.axis_names, cal, "axis_names"))

  def __hash__(self):
    return hash((self.qtype, self.channelwise_axes, tuple(sorted(self.tiled_axes.items())),
                 self.calibration, self.stochastic_rounding, self.axis_names))


GLOBAL_METHODS = ("absmax", "minmax", "fixed")
"""The calibrations whose bound over the whole array follows from the shards' bounds."""


def check_axis_names(names, what: str) -> tuple[str, ...]:
  """``names`` as a tuple of mesh axis names (a single name is one axis); raises naming
  ``what`` otherwise."""
  if isinstance(names, str):
    names = (names,)
  try:
    out = tuple(names)
  except TypeError:
    out = None
  if out is None or not all(isinstance(n, str) and n for n in out) or len(set(out)) != len(out):
    raise ValueError(f"{what}={names!r} is not valid; valid: a tuple of distinct mesh axis "
                     "names, e.g. ('data',)")
  return out


def shared_axis_names(names, calibration: "Calibration", what: str,
                      calibration_name: str = "calibration") -> tuple[str, ...]:
  """:func:`check_axis_names`, and a calibration whose bound over the whole array follows from
  the shards' (one of :data:`GLOBAL_METHODS`) where any name is given; the error names the
  calibration as ``calibration_name``."""
  out = check_axis_names(names, what)
  if out and calibration.method not in GLOBAL_METHODS:
    raise ValueError(f"{what}={out!r} with {calibration_name} {calibration.method!r}: a scale "
                     f"shared across shards needs one of {GLOBAL_METHODS}")
  return out


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
  qt: qtypes.QType = spec.qtype  # type: ignore[assignment]
  if qt.is_mx:
    shared = [a for a in range(nd) if a not in cw and a not in tiles and shape[a] > 1]
    if len(tiles) != 1 or shared:
      raise ValueError(
          f"qtype {qt.name!r} on shape {shape}: an MX block is {qt.block_size} values of one row, "
          f"so one axis is tiled and every other axis of size > 1 is channelwise; got "
          f"channelwise_axes={spec.channelwise_axes}, tiled_axes={spec.tiled_axes}")
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


def _grouped(x: jax.Array, cw, tiles) -> tuple[jax.Array, tuple[int, ...]]:
  """``x`` reshaped so each scale group spans the returned axes (tiled axes
  split in (tiles, tile)); a reduction over them with ``keepdims=True``
  broadcasts back against the reshaped ``x``."""
  split_shape, red_axes = [], []
  for a, n in enumerate(x.shape):
    if a in tiles:
      split_shape += [n // tiles[a], tiles[a]]
      red_axes.append(len(split_shape) - 1)
    else:
      split_shape.append(n)
      if a not in cw:
        red_axes.append(len(split_shape) - 1)
  return x.reshape(split_shape), tuple(red_axes)


def _group_reduce(x: jax.Array, cw, tiles, fn) -> jax.Array:
  """Reduces ``x`` to the scale shape with ``fn(x, axis=..., keepdims=True)``."""
  xs, red = _grouped(x, cw, tiles)
  return fn(xs, axis=red, keepdims=True).reshape(scale_shape(x.shape, cw, tiles))


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


# Scales are floored at the smallest normal float32: XLA flushes subnormals to
# zero (CPU and GPU), and a flushed scale would turn a whole group into zeros
# (or NaN). A group whose bound / qmax is below it is quantized on that
# coarser grid; its values still come back to within half a step.
TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
_INF_BITS = 0x7F800000  # float32 +Inf; every NaN's magnitude bits are above it


@functools.lru_cache(maxsize=None)
def max_scale(codes: float) -> float:
  """The largest float32 scale ``s`` with ``codes * s`` finite in float32.

  Dequantization computes ``code * scale`` with ``|code| <= codes``; a scale
  of ``bound / qmax`` rounded up could make ``qmax * scale`` overflow when the
  bound is near the float32 limit (``(3.4028235e38 / 127) * 127`` is inf).
  """
  s = np.float32(_F32_MAX / codes)
  with np.errstate(over="ignore"):
    while not np.isfinite(s * np.float32(codes)):
      s = np.nextafter(s, np.float32(0))
  return float(s)


def _symmetric_codes(qt: qtypes.QType, cal: Calibration) -> float:
  """The largest code magnitude a symmetric calibration can produce: ``qmax``
  for plain ``absmax`` (nothing clips), else also ``-qmin`` (a value below the
  bound clips to ``qmin``, -128 for int8)."""
  if cal.method == "absmax" and cal.multiplier == 1.0:
    return float(qt.qmax)
  return float(max(qt.qmax, -qt.qmin))


def _bound_scale(bound: jax.Array, multiplier: float, qmax: float, codes: float) -> jax.Array:
  """``bound * multiplier / qmax`` in [TINY, max_scale(codes)].

  This order is right over the whole float32 range: ``bound * multiplier``
  overflows only when the range exceeds float32 (the clamp then gives the
  widest finite grid), and underflows only when the scale would be below
  TINY anyway.
  """
  b = bound if multiplier == 1.0 else bound * multiplier
  return jnp.clip(b / qmax, TINY, max_scale(codes))


# XLA rewrites ``x / broadcast(s)`` as ``x * broadcast(1 / s)`` (CPU and GPU),
# and 1 / s is subnormal, so flushed to 0, for |s| > 2**126: every quotient of
# such a group would come out 0. Only scales above this need care.
_RECIP_SAFE = 2.0 ** 126


def _e8m0_edge(qt: qtypes.QType) -> float:
  """Half the largest magnitude a block may reach at its scale: the midpoint between the
  largest element and the value the element grid would have next (e4m3: (448 + 480) / 2 = 464,
  e2m1: (6 + 8) / 2 = 7), halved (232, 3.5)."""
  if qt.is_lut:
    mags = sorted({abs(v) for v in qt.values})  # type: ignore[union-attr]
    below = mags[-2]
  else:
    fi = jnp.finfo(qt.compute_dtype)
    below = float(fi.max) - 2.0 ** (int(np.floor(np.log2(float(fi.max)))) - fi.nmant)
  top = float(qt.qmax)
  return (top + (top - below) / 2) / 2


E8M0_MIN_EXP = -126
"""The smallest e8m0 exponent used: e8m0 reaches 2**-127, but that is a float32 subnormal,
which XLA flushes to zero (CPU and GPU); scales are float32 here."""
E8M0_MAX_EXP = 127


def e8m0_scale(bound: jax.Array, qt: qtypes.QType, *, stochastic: bool = False) -> jax.Array:
  """The MX scale of a block with ``bound`` (its absmax): the largest power of two ``2**k``
  with ``bound / 2**k >= h`` (``h`` = 232 for e4m3, 3.5 for e2m1; k in [-126, 127]).

  ``stochastic`` (the block is rounded stochastically): ``h`` is half the top element (224,
  3), so ``bound / 2**k`` lies in [h, 2h) below the top and every value has a grid neighbour
  on each side: no value clips, and the rounding stays unbiased (with the edge above, a
  block's largest value in (448, 464) or (6, 7) would clip to the top, biased by up to 3%
  or 14%).

  So ``bound / 2**k`` lies in [h, 2h): the block's largest value lands between the element
  grid's top value and the midpoint above it (464 for e4m3, 7 for e2m1), where it rounds to
  the top value with at most half an element step of error, the same as any rounding inside
  the grid: no element of the block loses more than half an ulp (of its own binade) at the
  block's scale. The OCP spec's example rule (``2**(floor(log2(bound)) - emax)``) lets
  ``bound / 2**k`` reach 2**(emax+1) (512, 8) and clips values above the top (448, 6) by up
  to a whole step; qwix's rule (its "outlier aware" constants: 12/7 for mxfp4, 60/31 for
  mxfp8) is this one for mxfp4, and for mxfp8 puts the edge at 462.9 instead of 464 (the same
  scale except for blocks whose ``bound / 2**k`` falls in [462.9, 464)). Computed exactly from
  the float32 exponent and mantissa of ``bound`` (no log2 rounding at the edges).
  """
  h = float(qt.qmax) / 2 if stochastic else _e8m0_edge(qt)
  hm, he = np.frexp(h)  # h = hm * 2**he, hm in [0.5, 1)
  m, e = jnp.frexp(jnp.minimum(bound, _F32_MAX))
  k = e - int(he) - jnp.where(m >= float(hm), 0, 1)
  k = jnp.clip(k, E8M0_MIN_EXP, E8M0_MAX_EXP)
  return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def pass_limit(qt: qtypes.QType) -> float:
  """The largest ``|x / scale|`` a calibrated value may have and still round to the grid's top
  with at most half a step of error: ``qmax``, or for an MX qtype the midpoint above its top
  element (464 for e4m3, 7 for e2m1), which its e8m0 scale lets a block's largest value reach.
  A clipping estimator passes gradients up to here."""
  return 2.0 * _e8m0_edge(qt) if qt.is_mx else float(qt.qmax)


def _scale_from_bound(bound: jax.Array, multiplier: float, qt: qtypes.QType, codes: float,
                      stochastic: bool = False):
  """The float32 scale (:func:`_bound_scale`) or, for MX qtypes, the e8m0 one (``stochastic``:
  see :func:`e8m0_scale`)."""
  if qt.is_mx:
    return e8m0_scale(bound if multiplier == 1.0 else bound * multiplier, qt,
                      stochastic=stochastic)
  return _bound_scale(bound, multiplier, qt.qmax, codes)


def divide_by_scale(x: jax.Array, scale: jax.Array, *, scale_max: float | None = None) -> jax.Array:
  """``x / scale`` in float32 for a scale of ``x``'s rank (broadcast or tiled,
  see :func:`expand_scale`); a zero scale divides by 1 (0 / 0 would be NaN).

  Where ``|scale| > 2**125`` the reciprocal is taken of ``scale * 2**-8`` and
  the power of two reapplied (exact), so the quotient is right for every
  scale up to the float32 limit. ``scale_max``: a static bound on the scales
  (calibrated ones have one); below 2**126 the plain division is already right.
  """
  s = jnp.where(scale == 0, 1.0, scale)
  if scale_max is not None and scale_max <= _RECIP_SAFE:
    return x / expand_scale(s, x.shape)
  f = jnp.where(jnp.abs(s) > _RECIP_SAFE / 2, 2.0 ** -8, 1.0)
  r = 1.0 / (s * f)
  return (x * expand_scale(r, x.shape)) * expand_scale(f, x.shape)


def calibrate(x: jax.Array, spec: QuantizeSpec) -> tuple[jax.Array, jax.Array | None]:
  """Returns ``(scale, zero_point)`` for ``x`` (zero_point None if symmetric).

  For finite ``x`` every scale is finite and in [TINY, max_scale]: an
  all-zero group gets 1 (its values come back as exact zeros), or 0 for
  ``binary`` (no zero code: +1 * 0 = 0; ``fixed`` too); "all zero" is decided
  from the data, not from the bound. A group holding a NaN/Inf
  gets a NaN scale.
  """
  qt: qtypes.QType = spec.qtype  # type: ignore[assignment]
  cal: Calibration = spec.calibration  # type: ignore[assignment]
  cw, tiles = _normalize_axes(spec, x.shape)
  xs, red = _grouped(x.astype(jnp.float32), cw, tiles)
  out_shape = scale_shape(x.shape, cw, tiles)
  group = lambda fn, v: fn(v, axis=red, keepdims=True)
  # min(x, 0) / max(x, 0) / max|x| with 0 as the identity: an empty group is all zero.
  gmin = lambda v: jnp.min(v, axis=red, keepdims=True, initial=0.0)
  gmax = lambda v: jnp.max(v, axis=red, keepdims=True, initial=0.0)
  # Which groups hold NaN/Inf: a float max reduction cannot be trusted to carry a NaN (XLA's
  # CPU reduce-max drops it in large reductions: 4200 values holding NaNs gave 1.0). The bound's
  # own reduction tells instead: max |x| is taken over the int32 bits of |x|, which order as the
  # values do for finite ones, with Inf above them and every NaN above Inf, so the group's bound
  # is Inf exactly where its data are not finite. No second reduction (a sum of x * 0, or
  # isfinite + reduce_and: XLA wrote a weight's f32 products to HBM before reducing them over its
  # leading axis) and no select before the max (XLA did not fuse one into that reduction either).
  names = _lax.bound_axis_names(x, spec.axis_names, "axis_names") if spec.axis_names else ()
  if names:  # shared across shard_map shards: the whole array's bounds
    gmin = lambda v, _f=gmin: jax.lax.pmin(_f(v), names)
    gmax = lambda v, _f=gmax: jax.lax.pmax(_f(v), names)

  def top():  # max |x| per group; Inf where the group holds a NaN or an Inf
    if jnp.dtype(x.dtype).itemsize == 2:  # bf16 / f16: the max of their own bits, widened after
      # (exact: widening is monotone). XLA's GPU reduction emitter does not fuse the f32 bits'
      # mask into a reduction over a leading axis (a weight's per-column bound): it wrote them
      # to HBM, 3x the reduction's time; the 16-bit bits fuse.
      b16 = jax.lax.bitcast_convert_type(_grouped(x, cw, tiles)[0], jnp.int16) & np.int16(0x7FFF)
      b16 = jnp.max(b16, axis=red, keepdims=True, initial=np.int16(0))
      b = jax.lax.bitcast_convert_type(
          jax.lax.bitcast_convert_type(b16, x.dtype).astype(jnp.float32), jnp.int32)
    else:
      bits = jax.lax.bitcast_convert_type(xs, jnp.int32) & np.int32(0x7FFFFFFF)
      b = jnp.max(bits, axis=red, keepdims=True, initial=np.int32(0))
    if names:
      b = jax.lax.pmax(b, names)
    return bound_of_bits(b)

  if cal.method == "minmax":
    nan = jnp.isnan(xs)
    lo = gmin(jnp.where(nan, -jnp.inf, xs))
    hi = gmax(jnp.where(nan, jnp.inf, xs))
    return _calibrate_minmax(lo, hi, qt, cal.multiplier, out_shape)
  ax = jnp.abs(xs)
  codes = _symmetric_codes(qt, cal)
  sr = spec.stochastic_rounding is not None  # MX: a scale below which nothing clips
  if cal.method == "fixed":
    s = jnp.full(out_shape,
                 _scale_from_bound(jnp.float32(cal.bound), cal.multiplier, qt, codes, sr),
                 jnp.float32)
    if qt.kind == "binary":  # no zero code: an all-zero group gets scale 0, so it stays zero
      s = jnp.where(gmax(ax) == 0, 0.0, s.reshape(gmax(ax).shape)).reshape(out_shape)
    return s, None
  if cal.method == "absmax":
    return absmax_scale(top(), spec).reshape(out_shape), None
  elif cal.method == "absmean":
    bound, zero, finite = _abs_mean(ax, red)
  elif cal.method == "rms":
    m = top()
    zero = m == 0
    # Pre-scaled by the group's absmax: x * x would underflow (|x| < ~1e-19)
    # or overflow (|x| > ~1.8e19); (x / m)^2 <= 1 does neither where it matters.
    r = jnp.sqrt(group(jnp.mean, jnp.square(divide_by_scale(xs, m))))
    bound = jnp.minimum(m * r, _F32_MAX)  # m * r <= m up to rounding
    finite = jnp.isfinite(m)
  else:  # percentile
    p = cal.percentile
    if all(xs.shape[a] for a in red):
      bound = group(lambda v, axis, keepdims: jnp.percentile(v, p, axis=axis, keepdims=keepdims), ax)
    else:  # empty groups (jnp.percentile cannot take them): all zero
      bound = gmax(ax)
    # A 0 percentile of non-zero data is a real bound of 0 (everything clips
    # to the TINY grid); only all-zero data get the exact-zero scale.
    m = top()
    zero = m == 0
    finite = jnp.isfinite(m)
  zero_scale = 0.0 if qt.kind == "binary" else 1.0
  scale = jnp.where(zero, zero_scale, _scale_from_bound(bound, cal.multiplier, qt, codes, sr))
  return jnp.where(finite, scale, jnp.nan).reshape(out_shape), None


def bound_of_bits(bits: jax.Array) -> jax.Array:
  """The float32 ``max |x|`` of a group from the max of its ``|x|`` bits (int32: they order as
  the magnitudes, Inf above every finite value, NaN above Inf): Inf where the group holds a NaN
  or an Inf."""
  return jax.lax.bitcast_convert_type(jnp.minimum(bits, np.int32(_INF_BITS)), jnp.float32)


def absmax_scale(bound: jax.Array, spec: QuantizeSpec) -> jax.Array:
  """:func:`calibrate`'s ``absmax`` scale of each group from its bound (``max |x|``, Inf for a
  non-finite group): a kernel that finds the bounds itself gets the same scales."""
  qt: qtypes.QType = spec.qtype  # type: ignore[assignment]
  cal: Calibration = spec.calibration  # type: ignore[assignment]
  if cal.method != "absmax":
    raise ValueError(f"absmax_scale: the calibration is {cal.method!r}, not 'absmax'")
  zero_scale = 0.0 if qt.kind == "binary" else 1.0
  scale = jnp.where(bound == 0, zero_scale,
                    _scale_from_bound(bound, cal.multiplier, qt, _symmetric_codes(qt, cal),
                                      spec.stochastic_rounding is not None))
  return jnp.where(jnp.isfinite(bound), scale, jnp.nan)


def _abs_mean(ax: jax.Array, red: tuple[int, ...]):
  """(mean, all zero, finite) of each group of ``ax = |x|``, over the whole float32 range.

  The plain sum overflows when the group's values are near the float32 limit;
  a sum pre-scaled by ``2**-c`` (``2**c >= 2n``) cannot (each term is at most
  max / 2n), but it would flush values below ``2**c`` * TINY. Both sums read
  the same data (XLA fuses sibling reductions into one pass); the pre-scaled
  one is used only where the plain one overflowed, where the flushed terms
  are negligible. Cheaper than pre-scaling by the group's absmax, which needs
  a second pass over the data.
  """
  n = max(int(np.prod([ax.shape[a] for a in red])), 1)  # an empty group sums to 0
  c = n.bit_length() + 1  # 2**c >= 2n
  s0 = jnp.sum(ax, axis=red, keepdims=True)
  s1 = jnp.sum(ax * float(2.0 ** -c), axis=red, keepdims=True)  # finite iff the data are
  mean = jnp.where(jnp.isfinite(s0), s0 / n, s1 * float(2.0 ** c / n))
  # s0 > 0 for any non-zero data (no cancellation), even where s0 / n underflows.
  return jnp.minimum(mean, _F32_MAX), s0 == 0, jnp.isfinite(s1)


def _calibrate_minmax(lo: jax.Array, hi: jax.Array, qt: qtypes.QType, multiplier: float,
                      out_shape) -> tuple[jax.Array, jax.Array]:
  """Scale and integer zero point mapping [min(x, 0), max(x, 0)] * multiplier
  onto [qmin, qmax], with every dequantized value ``(q - zp) * scale`` finite.

  The span is ``(hi - lo) / n``, or ``hi / n - lo / n`` where an end is beyond half the float32
  limit (``hi - lo`` could overflow there); not the latter everywhere: for a span near the
  smallest normal float32 each quotient is subnormal and flushed to zero (XLA, CPU and GPU),
  which would floor the scale at TINY. The zero point is rounded to an integer, so
  the grid's ends lie within half a step of the range; where that half step
  would take an end past the float32 limit, the zero point moves one step
  the other way (the values at that end then come back within one step), and
  the scale is capped so that a grid of n steps through 0 fits at all.
  """
  finite = jnp.isfinite(lo) & jnp.isfinite(hi)
  zero = (lo == 0) & (hi == 0)
  lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
  if multiplier != 1.0:
    lo = jnp.maximum(lo * multiplier, -_F32_MAX)
    hi = jnp.minimum(hi * multiplier, _F32_MAX)
  n = qt.qmax - qt.qmin
  # Cap: 2**(bits-1) steps on each side of 0 fit in float32 (with a little
  # room for rounding), so some integer zero point keeps both ends finite.
  cap = max_scale(-qt.qmin) * (1 - 2.0 ** -18)
  big = (hi > _F32_MAX / 2) | (lo < -_F32_MAX / 2)
  span = jnp.where(big, hi / n - lo / n, (hi - lo) / n)
  scale = jnp.clip(span, TINY, cap)
  scale = jnp.where(zero, 1.0, scale)
  r = jnp.round(divide_by_scale(lo, scale))  # the code of 0 is -r: the grid is (r .. r + n) * scale
  # |j * scale| stays finite for |j| <= k.
  k = jnp.floor(divide_by_scale(jnp.full_like(scale, _F32_MAX * (1 - 2.0 ** -20)), scale))
  r = jnp.clip(r, -k, k - n)
  zero_point = jnp.clip(qt.qmin - r, qt.qmin, qt.qmax)
  scale = jnp.where(finite, scale, jnp.nan)
  return scale.reshape(out_shape), zero_point.reshape(out_shape)


def minmax_bounds(x: jax.Array, axis_names: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
  """``(min(x, 0), max(x, 0))`` over the whole of ``x`` as float32 scalars (NaN in ``x`` gives
  ``(-inf, inf)``, so the scale that follows is NaN): the statistics of an asymmetric
  (``minmax``) static scale, averaged over calibration batches before :func:`minmax_scale`.
  ``axis_names``: inside ``jax.shard_map``, the mesh axes ``x`` is split over (skipped outside)."""
  xf = jnp.asarray(x, jnp.float32)
  nan = jnp.isnan(xf)
  lo = jnp.min(jnp.where(nan, -jnp.inf, xf), initial=0.0)
  hi = jnp.max(jnp.where(nan, jnp.inf, xf), initial=0.0)
  names = _lax.bound_axis_names(x, axis_names, "axis_names") if axis_names else ()
  if names:
    lo, hi = jax.lax.pmin(lo, names), jax.lax.pmax(hi, names)
  return lo, hi


def minmax_scale(lo: jax.Array, hi: jax.Array, qtype, multiplier: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
  """``(scale, zero point)`` mapping ``[min(lo, 0), max(hi, 0)] * multiplier`` onto an integer
  qtype's ``[qmin, qmax]``: what ``calibrate`` with ``minmax`` computes from a group's ends,
  for ends given (an asymmetric static scale's averaged statistics). Shaped like ``lo``."""
  qt = qtypes.get_qtype(qtype)
  if qt.kind != "int":
    raise ValueError(f"minmax_scale: qtype {qt.name!r} is not an integer qtype (a zero point "
                     "needs one)")
  lo, hi = jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32)
  return _calibrate_minmax(lo, hi, qt, float(multiplier), jnp.shape(lo))


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

  A scale of magnitude below :data:`TINY` (0, or a subnormal, which XLA reads
  as 0 on CPU and GPU alike) is stored as 0 and means "this group is zero":
  its values dequantize to exact zeros, never NaN/Inf (``binary``'s all-zero
  groups use it). A NaN/Inf scale gives NaN values. A scale above
  ``max_scale`` of the qtype's largest code is lowered to it, so every code
  dequantizes to a finite value. Any other scale is used as given; where
  ``|x| / scale`` exceeds the float32 range (a small fixed or learned scale,
  a huge ``x``) the value saturates to the end of the range, as any value
  beyond the bound does.

  Raises:
    ValueError: for an MX qtype (``mxfp8``, ``mxfp4``): its scales are the e8m0 powers of two
      :func:`quantize` computes per block, not a given (static or learned) scale.
  """
  qt = qtypes.get_qtype(qtype)
  if qt.is_mx:
    raise ValueError(f"quantize_with_scale: qtype {qt.name!r} takes the e8m0 scale computed "
                     "per block of 32 values by quantize(), not a given (static or learned) "
                     "scale; use a non-MX qtype (e.g. float8_e4m3fn) for a given scale")
  top = max_scale(float(max(qt.qmax, -qt.qmin)))
  scale = jnp.asarray(scale, jnp.float32)
  scale = jnp.where(jnp.isfinite(scale), jnp.clip(scale, -top, top), jnp.nan)
  scale = jnp.where(jnp.abs(scale) < TINY, 0.0, scale)
  return _quantize_with_scale(x, qt, scale, zero_point, stochastic_rounding=stochastic_rounding,
                              key=key, check_finite=check_finite, scale_max=top)


def _quantize_with_scale(x, qt: qtypes.QType, scale, zero_point, *, stochastic_rounding, key,
                         check_finite: bool, scale_max: float | None) -> QArray:
  """:func:`quantize_with_scale` for a scale that is 0 or >= TINY; ``scale_max``
  is a static bound on it if known (see :func:`divide_by_scale`)."""
  xf = x.astype(jnp.float32)
  if scale.ndim != x.ndim:
    raise ValueError(f"scale of shape {scale.shape} must have the rank of x {x.shape}")
  if check_finite:
    scale = nonfinite_to_nan(scale, x)
  y = divide_by_scale(xf, scale, scale_max=scale_max)
  if qt.is_mx:
    # A block near the float32 limit (scale up to 2**127) could round its largest value up to
    # an element whose product with the scale overflows: clip to the largest element-grid value
    # v with v * scale finite ((2 - 2**-mantissa_bits) * 2**127 / scale, a grid value).
    lim = _mx_limit(qt) / scale_full(scale, x.shape)
    y = jnp.clip(y, -lim, lim)
  if zero_point is not None:
    y = y + expand_scale(zero_point, x.shape)
  if qt.kind == "binary" and stochastic_rounding is None:
    # y underflows to +-0 for |x| far below the scale (a group spanning more
    # than float32's range); binary keeps x's sign there (+1 for x = +-0).
    y = jnp.where(y == 0, xf, y)
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
  qt: qtypes.QType = spec.qtype  # type: ignore[assignment]
  method = spec.calibration.method  # type: ignore[union-attr]
  # Calibrated scales are 0, 1 (all-zero groups) or in [TINY, this].
  scale_max = (2.0 ** E8M0_MAX_EXP if qt.is_mx else
               max(max_scale(float(min(qt.qmax, -qt.qmin))), 1.0))
  return _quantize_with_scale(
      x, qt, scale, zp, stochastic_rounding=spec.stochastic_rounding, key=key,
      check_finite=method in ("fixed", "percentile"), scale_max=scale_max)


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """``(qvalue - zero_point) * scale`` in ``dtype``.

  fp8 values pass through an optimization barrier first: XLA's GPU backend
  (jax 0.11.2, ``xla_allow_excess_precision``) otherwise folds the
  f32 -> fp8 -> f32 round trip of a value quantized in the same jit into
  nothing, dropping the fp8 rounding (measured on an H200: 4095 of 4096
  round-tripped values were not fp8 values).
  """
  codes = q.qvalue
  if q.qtype.is_float:
    codes = _lax.optimization_barrier(codes)
  v = _code_values(q.qtype, codes)
  if q.zero_point is not None:
    v = v - expand_scale(q.zero_point, q.shape)
  return (v * expand_scale(q.scale, q.shape)).astype(dtype)


def values_of(q: QArray, dtype=jnp.float32) -> jax.Array:
  """The quantized values of ``q`` (before scale and zero point) in ``dtype``: the codes
  themselves, or for a LUT qtype (nf4, mxfp4) the table's value of each code."""
  return _code_values(q.qtype, q.qvalue, dtype)


def _code_values(qt: qtypes.QType, codes: jax.Array, dtype=jnp.float32) -> jax.Array:
  if qt.is_lut:
    return rounding.lut_values(qt, codes, dtype)
  return codes.astype(dtype)


def _mx_limit(qt: qtypes.QType) -> float:
  """``(2 - 2**-m) * 2**127`` for an element format with ``m`` mantissa bits (e4m3: 3,
  e2m1: 1): the largest float32 whose mantissa the element grid holds."""
  m = 1 if qt.is_lut else int(jnp.finfo(qt.compute_dtype).nmant)
  return float((2.0 - 2.0 ** -m) * 2.0 ** 127)


def scale_full(scale: jax.Array, shape) -> jax.Array:
  """A zero scale read as 1 (an all-zero group), expanded to ``shape``."""
  return expand_scale(jnp.where(scale == 0, 1.0, scale), shape)


def fake_quantize(x: jax.Array, spec: QuantizeSpec, *, key=None) -> jax.Array:
  """``dequantize(quantize(x))`` in ``x.dtype`` (no gradient handling)."""
  return dequantize(quantize(x, spec, key=key), x.dtype)
