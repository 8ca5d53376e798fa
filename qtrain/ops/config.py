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


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandQuant:
  """Forward quantization of one operand.

  Attributes:
    qtype: qtype name or dtype.
    calibration: a :class:`~qtrain.core.qarray.Calibration` or method name.
    channelwise: one scale per index of every non-contracting axis (per row of
      activations, per output channel of weights); ``False``: one scale per
      tensor (per batch index for batch axes).
    tile_size: group-wise scales along the last contracting axis, one per
      ``tile_size`` values (must divide that axis). MX qtypes (``mxfp8``,
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
  tile_size: int | None = None
  estimator: str = "ste"
  scale_grad: str = "lsq"
  axis_names: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "qtype", qtypes.get_qtype(self.qtype))
    object.__setattr__(self, "calibration", qarray.as_calibration(self.calibration))
    qt: qtypes.QType = self.qtype  # type: ignore[assignment]
    if self.tile_size is not None and (not isinstance(self.tile_size, int) or self.tile_size <= 0):
      raise ValueError(f"tile_size={self.tile_size!r} must be a positive int or None")
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
    qtype: qtype name or dtype (int8 and fp8 are the useful ones).
    calibration: method for the gradient's scale (symmetric only).
    stochastic_rounding: ``None`` or one of :data:`qtrain.core.rounding.STOCHASTIC_METHODS`;
      works for integer and fp8 qtypes alike.
    axis_names: inside ``jax.shard_map``, the mesh axes that split this product's contraction
      (data parallelism: the batch, in the weight gradient's product): the gradient's scales,
      and the power of two the residual's scale is folded with, are then those of the whole
      array, as on one device (see :attr:`qtrain.core.qarray.QuantizeSpec.axis_names`).
      Empty: per shard.
  """

  qtype: object
  calibration: qarray.Calibration | str = "absmax"
  stochastic_rounding: str | None = None
  axis_names: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "qtype", qtypes.get_qtype(self.qtype))
    object.__setattr__(self, "calibration", qarray.as_calibration(self.calibration))
    if self.calibration.is_asymmetric:  # type: ignore[union-attr]
      raise ValueError("GradQuant.calibration='minmax' is not supported: gradients are "
                       "quantized symmetrically (use absmax, rms, percentile or fixed)")
    qtypes.check_gradient_qtype(self.qtype, "GradQuant.qtype")  # type: ignore[arg-type]
    rounding.check_stochastic_method(self.stochastic_rounding)
    object.__setattr__(self, "axis_names", qarray.shared_axis_names(
        self.axis_names, self.calibration, "GradQuant.axis_names"))


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
