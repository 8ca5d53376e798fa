"""Configs of the quantized-training (QT) ops: frozen, keyword-only, validated.

A QT op (:func:`~qtrain.ops.dot_general_qt.dot_general_qt`,
:func:`~qtrain.ops.conv_general_qt.conv_general_qt`) has three parts:

* the forward: how each operand is quantized (:class:`OperandQuant`, or
  ``None`` to leave it in float);
* the backward: how the incoming gradient is quantized for each of the two
  backward products (:class:`GradQuant`, or ``None`` for float);
* where it runs (``implementation``: ``"auto"``, ``"xla"``, ``"triton"``,
  ``"mosaic"``, ``"interpret"``; see :mod:`qtrain.ops.dispatch`).

Example:
  >>> from qtrain.ops import config
  >>> cfg = config.DotGeneralQtConfig(
  ...     lhs=config.OperandQuant(qtype="int8"),
  ...     rhs=config.OperandQuant(qtype="int8"),
  ...     dlhs_grad=config.GradQuant(qtype="int8", stochastic_rounding="uniform"),
  ...     drhs_grad=config.GradQuant(qtype="int8", stochastic_rounding="uniform"))
  >>> cfg.needs_key
  True
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping

from qtrain.core import estimators
from qtrain.core import qarray
from qtrain.core import qtypes
from qtrain.core import rounding

# Where a QT op's products run: the one list of backend names (rules, configs, dispatch and
# freeze all validate through check_implementation). "auto": an ordered policy over what each
# backend supports (qtrain.ops.dispatch); "xla": the exact reference; "triton" / "mosaic": the
# Pallas GPU kernels; "interpret": the Triton kernels in the Pallas interpreter (any device).
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla", "triton", "mosaic", "interpret")


def check_implementation(value, field: str = "implementation") -> str:
  """``value`` if it is one of :data:`IMPLEMENTATIONS`; else a ValueError naming ``field``
  and the valid values."""
  if value not in IMPLEMENTATIONS:
    raise ValueError(f"{field}={value!r}; valid: {list(IMPLEMENTATIONS)}")
  return value


# ----------------------------------------------------------------------------
# Tiles: an int (elements), a float (a fraction of the axis: 1 / tile count), or per-axis tiles.

_TILE_VALUES = ("a positive int (elements per tile), a float in (0, 1] (a fraction of the axis, "
                "1 / tile count: 0.25 is 4 tiles)")


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_fraction(v) -> bool:
  return isinstance(v, float) and 0.0 < v <= 1.0


def check_tile(value, field: str) -> "int | float | tuple | None":
  """``value`` as a tile spec, validated (errors name ``field``): None; a positive int (elements
  per tile); a float in (0, 1] (a fraction of the axis: the tile is ``round(size * value)``
  elements, qwix's reading; it must divide the axis); or per-axis tiles ``{axis: tile}`` (each
  tile an int or a fraction), returned as a sorted tuple of ``(axis, tile)`` pairs so that
  configs and rules stay hashable."""
  if value is None:
    return None
  if _is_int(value):
    if value <= 0:
      raise ValueError(f"{field}={value!r} is not valid; valid: None, {_TILE_VALUES} or "
                       "per-axis tiles {axis: tile}")
    return int(value)
  if isinstance(value, float):
    if not _is_fraction(value):
      raise ValueError(f"{field}={value!r} is not valid: a float tile is a fraction of the axis, "
                       f"in (0, 1]; valid: None, {_TILE_VALUES} or per-axis tiles {{axis: tile}}")
    return value
  pairs = None
  if isinstance(value, Mapping):
    pairs = list(value.items())
  elif isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
    pairs = list(value)
  if pairs is None:
    raise ValueError(f"{field}={value!r} is not valid; valid: None, {_TILE_VALUES} or per-axis "
                     "tiles {axis: tile}, e.g. {0: 128, 1: 128}")
  if not pairs:
    raise ValueError(f"{field}={{}} names no axis; use None for no tiles")
  out = {}
  for a, t in pairs:
    if not _is_int(a):
      raise ValueError(f"{field}={value!r}: axis {a!r} is not an int axis")
    if a in out:
      raise ValueError(f"{field}={value!r} names axis {a} twice")
    if not (_is_int(t) and t > 0) and not _is_fraction(t):
      raise ValueError(f"{field}={value!r}: the tile {t!r} of axis {a} is not valid; valid: "
                       f"{_TILE_VALUES}")
    out[int(a)] = int(t) if _is_int(t) else t
  return tuple(sorted(out.items()))


def is_per_axis(tile) -> bool:
  """Whether a checked tile spec (:func:`check_tile`) is per-axis tiles (a tuple of pairs)."""
  return isinstance(tile, tuple)


def resolve_tile(tile: "int | float", size: int, what: str) -> int:
  """The tile in elements along an axis of ``size``: an int as given, a fraction ``f`` as
  ``round(size * f)`` (qwix's reading of a float tile); raises, naming ``what``, where it does
  not divide ``size``."""
  t = int(tile) if _is_int(tile) else int(round(size * tile))
  if t <= 0 or size % t:
    got = "" if _is_int(tile) else f" (round({size} * {tile!r}) = {t})"
    divisors = [d for d in range(1, size + 1) if size % d == 0][-6:]
    raise ValueError(f"{what}={tile!r}{got} does not divide the axis of size {size}; valid: a "
                     f"divisor of {size} (e.g. {divisors})" +
                     ("" if _is_int(tile) else " or a fraction 1 / n with n dividing it"))
  return t


def resolve_axis_tiles(tiles: tuple, shape, what: str) -> dict[int, int]:
  """Per-axis tiles (pairs from :func:`check_tile`) on an array of ``shape``: ``{axis: tile in
  elements}`` with axes made non-negative; raises naming ``what`` for an axis out of range or a
  tile that does not divide its axis."""
  nd = len(shape)
  out = {}
  for a, t in tiles:
    if not -nd <= a < nd:
      raise ValueError(f"{what}={dict(tiles)!r}: axis {a} is out of range for an operand of "
                       f"shape {tuple(shape)}")
    if a % nd in out:
      raise ValueError(f"{what}={dict(tiles)!r} names axis {a % nd} of shape {tuple(shape)} twice")
    out[a % nd] = resolve_tile(t, int(shape[a]), f"{what}[{a}]")
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandQuant:
  """Forward quantization of one operand.

  Attributes:
    qtype: qtype name or dtype.
    calibration: a :class:`~qtrain.core.qarray.Calibration` or method name.
    channelwise: one scale per index of every non-contracting axis (per row of
      activations, per output channel of weights); ``False``: one scale per
      tensor (per batch index for batch axes).
    tile_size: group-wise scales along the contraction: an int, one scale per
      ``tile_size`` values of the last contracting axis (must divide it); a
      float in (0, 1], a fraction of that axis (``round(size * f)`` values:
      ``0.25`` is 4 tiles, qwix's reading); or per-axis tiles ``{axis: tile}``
      in the operand's own axes (each an int or a fraction): 2-D scales, e.g.
      ``{0: 128, 1: 128}`` on a ``(K, N)`` weight is one scale per 128 x 128
      block. With per-axis tiles a contracting axis not named is one group and
      a free axis not named keeps one scale per index (none without
      ``channelwise``); stored as a sorted tuple of ``(axis, tile)`` pairs.
      MX qtypes (``mxfp8``,
      ``mxfp4``): None means their block of 32, and any other value raises
      (the block is the format's); they also need ``channelwise`` (an MX block
      is 32 values of one row). ``nf4`` here: None is per channel (the rules'
      default for nf4 is 64, :meth:`qtrain.QtRule.granularity`).
    estimator: gradient estimator, see :mod:`qtrain.core.estimators`.
    scale_grad: gradient rule for a scale passed into the op (a learned
      scale): ``"lsq"`` or ``"bitorch"`` (binary only).
    axis_names: inside ``jax.shard_map``, the mesh axes that split the axes this operand's
      scales are reduced over (its contraction: a row-parallel layer's weight and input);
      the scales are then the whole array's (see
      :attr:`qtrain.core.qarray.QuantizeSpec.axis_names`). Empty: per shard.
  """

  qtype: object
  calibration: qarray.Calibration | str = "absmax"
  channelwise: bool = True
  tile_size: int | float | Mapping[int, int | float] | None = None
  estimator: str = "ste"
  scale_grad: str = "lsq"
  axis_names: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "qtype", qtypes.get_qtype(self.qtype))
    object.__setattr__(self, "calibration", qarray.as_calibration(self.calibration))
    qt: qtypes.QType = self.qtype  # type: ignore[assignment]
    object.__setattr__(self, "tile_size", check_tile(self.tile_size, "tile_size"))
    if qt.is_mx and is_per_axis(self.tile_size):
      raise ValueError(f"tile_size={dict(self.tile_size)!r} with qtype {qt.name!r}: an MX block "
                       f"is {qt.block_size} values of one row along the contraction (None or "
                       f"{qt.block_size}), not per-axis tiles")
    qtypes.check_tile_size(qt, self.tile_size)
    if qt.is_mx:
      object.__setattr__(self, "tile_size", qt.block_size)
      if not self.channelwise:
        raise ValueError(f"channelwise=False with qtype {qt.name!r}: an MX block is "
                         f"{qt.block_size} values of one row (channelwise=True)")
    if self.estimator not in estimators.ESTIMATORS:
      raise ValueError(f"estimator={self.estimator!r}; valid: {list(estimators.ESTIMATORS)}")
    if self.scale_grad not in estimators.SCALE_GRADS:
      raise ValueError(f"scale_grad={self.scale_grad!r}; valid: {list(estimators.SCALE_GRADS)}")
    if self.scale_grad == "bitorch" and qt.kind != "binary":
      raise ValueError(f"scale_grad='bitorch' is binary's rule; qtype is {qt.name!r} (use 'lsq')")
    if self.calibration.is_asymmetric and qt.kind != "int":  # type: ignore[union-attr]
      raise ValueError(f"calibration 'minmax' needs an integer qtype, got qtype={qt.name!r}")
    object.__setattr__(self, "axis_names", qarray.shared_axis_names(
        self.axis_names, self.calibration, "OperandQuant.axis_names"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradQuant:
  """Quantization of the incoming gradient for one backward product.

  Attributes:
    qtype: qtype name or dtype: int2..int8, fp8, or MX (``mxfp8``, ``mxfp4``: e4m3 / e2m1
      values with one e8m0 scale per block of 32 values along this product's contraction;
      a contraction that is not a multiple of 32 ends in a shorter block).
    calibration: method for the gradient's scale (symmetric only).
    stochastic_rounding: ``None`` or one of :data:`qtrain.core.rounding.STOCHASTIC_METHODS`;
      works for integer, fp8 and MX qtypes alike (the upper of the two neighbouring grid
      values with probability proportional to the distance: unbiased).
    axis_names: inside ``jax.shard_map``, the mesh axes that split this product's contraction
      (data parallelism: the batch, in the weight gradient's product): the gradient's scales,
      and the power of two the residual's scale is folded with, are then those of the whole
      array, as on one device (see :attr:`qtrain.core.qarray.QuantizeSpec.axis_names`).
      Empty: per shard.
    tile_size: group-wise scales of the gradient along this product's contraction (qwix's
      ``dlhs_tile_size`` / ``drhs_tile_size``): an int, one scale per ``tile_size`` values of
      the product's last contracting axis (in the weight gradient's product that is the last
      batch / token axis; in the input gradient's, the last output feature axis), a float in
      (0, 1] (a fraction of that axis), or per-axis tiles ``{axis: tile}`` in the gradient's
      own axes (the op's output axes). A contracting axis not tiled is one group; the other
      axes keep one scale per index. None (default): per channel. MX qtypes: None or 32
      (their block).
  """

  qtype: object
  calibration: qarray.Calibration | str = "absmax"
  stochastic_rounding: str | None = None
  axis_names: tuple[str, ...] = ()
  tile_size: int | float | Mapping[int, int | float] | None = None

  def __post_init__(self):
    object.__setattr__(self, "tile_size", check_tile(self.tile_size, "GradQuant.tile_size"))
    object.__setattr__(self, "qtype", qtypes.get_qtype(self.qtype))
    object.__setattr__(self, "calibration", qarray.as_calibration(self.calibration))
    if self.calibration.is_asymmetric:  # type: ignore[union-attr]
      raise ValueError("GradQuant.calibration='minmax' is not supported: gradients are "
                       "quantized symmetrically (use absmax, rms, percentile or fixed)")
    qtypes.check_gradient_qtype(self.qtype, "GradQuant.qtype")  # type: ignore[arg-type]
    rounding.check_stochastic_method(self.stochastic_rounding)
    object.__setattr__(self, "axis_names", qarray.shared_axis_names(
        self.axis_names, self.calibration, "GradQuant.axis_names"))
    check_mx_grad(self.qtype, self.tile_size, self.axis_names, "GradQuant")  # type: ignore[arg-type]


def check_mx_grad(qt: qtypes.QType, tile_size, axis_names, where: str,
                  fields: tuple[str, str] = ("tile_size", "axis_names")) -> None:
  """An MX gradient's block is the format's (32 values along the product's contraction): a
  ``tile_size`` other than None / 32 raises, and so do ``axis_names`` (each block lies in one
  shard: there is no scale to share across shards)."""
  if not qt.is_mx:
    return
  if is_per_axis(tile_size):
    raise ValueError(f"{where}.{fields[0]}={dict(tile_size)!r} with qtype {qt.name!r}: an MX "
                     f"block is {qt.block_size} values along the product's contraction, not "
                     f"per-axis tiles; valid: None or {qt.block_size}")
  qtypes.check_tile_size(qt, tile_size, f"{where}.{fields[0]}")
  if axis_names:
    raise ValueError(f"{where}.{fields[1]}={axis_names!r} with qtype {qt.name!r}: an "
                     f"MX block ({qt.block_size} consecutive values) lies inside one shard, so "
                     "its scale is the same per shard as on one device; valid: ()")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotGeneralQtConfig:
  """Config of :func:`~qtrain.ops.dot_general_qt.dot_general_qt`.

  Attributes:
    lhs, rhs: forward quantization of each operand (None: float).
    dlhs_grad: quantization of the gradient in ``dlhs = g . rhs``.
    drhs_grad: quantization of the gradient in ``drhs = lhs . g``.
    implementation: where the quantized products run (see
      :mod:`qtrain.ops.dispatch`).
  """

  lhs: OperandQuant | None = None
  rhs: OperandQuant | None = None
  dlhs_grad: GradQuant | None = None
  drhs_grad: GradQuant | None = None
  implementation: str = "auto"

  def __post_init__(self):
    for name in ("lhs", "rhs"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, OperandQuant):
        raise ValueError(f"{name}={v!r} must be an OperandQuant or None")
    for name in ("dlhs_grad", "drhs_grad"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, GradQuant):
        raise ValueError(f"{name}={v!r} must be a GradQuant or None")
    check_implementation(self.implementation)

  @property
  def needs_key(self) -> bool:
    return any(g is not None and g.stochastic_rounding for g in (self.dlhs_grad, self.drhs_grad))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvGeneralQtConfig(DotGeneralQtConfig):
  """Config of :func:`~qtrain.ops.conv_general_qt.conv_general_qt`.

  ``lhs`` is the input, ``rhs`` the kernel. ``tile_size`` is not supported
  for convolutions (the contraction spans the window and input features).
  """

  def __post_init__(self):
    super().__post_init__()
    for name in ("lhs", "rhs"):
      v = getattr(self, name)
      if v is not None and v.qtype.is_mx:
        raise ValueError(f"{name}.qtype={v.qtype.name!r}: an MX qtype needs blocks of "
                         f"{v.qtype.block_size} along a contracting axis, and convolutions take "
                         "no tile_size; use it on dot_general / einsum ops")
      if v is not None and v.tile_size is not None:
        raise ValueError(f"{name}.tile_size={v.tile_size}: convolutions take no tile_size")
    for name in ("dlhs_grad", "drhs_grad"):
      v = getattr(self, name)
      if v is not None and v.tile_size is not None:
        raise ValueError(f"{name}.tile_size={v.tile_size}: convolutions take no tile_size")
