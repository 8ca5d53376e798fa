"""``QtRule``: which ops of a model are quantized, and how.

A rule matches an op by the ``'/'``-joined path of the Flax module that
makes the call (``re.fullmatch`` of :attr:`QtRule.module_path`) and by the
op's name (:attr:`QtRule.op_names`). In a list of rules the first rule that
matches an op wins; a rule with no qtype at all (``QtRule(module_path=...)``)
keeps the ops it matches in float (handy for first and last layers).

Field names follow qwix's ``QtRule`` where qwix has the concept
(``weight_qtype``, ``act_qtype``, ``bwd_qtype``, ``tile_size``,
``*_calibration_method``, ``act_static_scale``, ``bwd_stochastic_rounding``,
``disable_channelwise_axes``, ``op_names``); the rest (estimators,
learnable activation scale and shift, averaging of static scales,
``implementation``) go where qwix stops.

Rules are validated when built: a combination that cannot be honoured
raises ``ValueError`` naming the fields.

Example:
  >>> import qtrain
  >>> r = qtrain.QtRule(module_path=r".*mlp.*", weight_qtype="int8", act_qtype="int8",
  ...                   bwd_qtype="int8", bwd_stochastic_rounding="uniform")
  >>> r.matches("block_0/mlp/Dense_0", "dot_general"), r.needs_rng
  (True, True)
  >>> try:
  ...   qtrain.QtRule(module_path=".*", bwd_stochastic_rounding="uniform")
  ... except ValueError as e:
  ...   print(e)
  Invalid QtRule: bwd_stochastic_rounding='uniform' needs bwd_qtype (it is None)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from qtrain import sparsity as sparsity_lib
from qtrain.core import estimators
from qtrain.core import qarray
from qtrain.core import qtypes
from qtrain.core import rounding
from qtrain.ops import config as cfg_lib

OP_NAMES: tuple[str, ...] = ("dot_general", "einsum", "conv_general_dilated", "ragged_dot")
# Per-operand scale granularities (an int N: per channel / per token, in tiles of N along the
# contraction). A weight's non-contracting axes are its output channels, an activation's its
# tokens (rows): the same scale layout, named for what it is on each side.
WEIGHT_GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_channel")
ACT_GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_token")
STATIC_SCALE_AVERAGING: tuple[str, ...] = ("mean", "ema")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QtRule:
  """One quantized-training rule (frozen, keyword-only, validated).

  Matching:
    module_path: regex, ``re.fullmatch``-ed against the ``'/'``-joined path
      of the calling Flax module (``""`` is the root module).
    op_names: the ops this rule applies to, a subset of ``("dot_general",
      "einsum", "conv_general_dilated", "ragged_dot")`` (default: all of them;
      ``ragged_dot`` is ``jax.lax.ragged_dot`` and ``ragged_dot_general`` of its
      form, mixture-of-experts layers).

  Forward:
    weight_qtype: qtype of the weight operand (the layer's parameter), or
      None to keep it float. Any qtype of :data:`qtrain.core.VALID_QTYPES`.
    act_qtype: qtype of the activation operand (the non-weight one), or None.
    tile_size: group-wise scales along the contraction (one scale per
      ``tile_size`` values) for both quantized operands; None: per channel.
      An op that contracts several axes (an attention out projection over
      (heads, head_dim)) is tiled over their product, flattened in the order
      the axes lie in the activation; the tile must divide that product.
      A float in (0, 1] is a fraction of the contraction (``round(K * f)``
      values: ``0.25`` is 4 tiles; qwix's reading). Per-axis tiles
      ``{axis: tile}`` (qwix's dict form; each tile an int or a fraction) name
      axes of each quantized operand, in its own axis order: 2-D scales, e.g.
      ``{0: 128, 1: 128}`` on ``x (M, K) . W (K, N)`` gives the weight one
      scale per 128 x 128 block of (K, N) and the activation one per block of
      (M, K); a contracting axis not named is one group, a free axis not named
      keeps one scale per index. Stored as a sorted tuple of ``(axis, tile)``
      pairs (rules are hashable). Not for convolutions.
    weight_calibration_method, act_calibration_method: a method name
      (``absmax``, ``absmean``, ``rms``, ``minmax``, ``fixed``,
      ``percentile``), the same with arguments as qwix writes them
      (``"absmax,0.9"``, ``"rms,3"``, ``"fixed,-4,4"``; see
      :func:`qtrain.core.qarray.as_calibration`) or a
      :class:`qtrain.core.Calibration`.
    disable_channelwise_axes: one scale per tensor (per tile with
      ``tile_size``) instead of one per row / output channel.
    weight_granularity, act_granularity: the scale granularity of one
      operand, where it should differ from the other's (``tile_size`` and
      ``disable_channelwise_axes`` set both). None (default): from those two
      fields. Otherwise one of :data:`WEIGHT_GRANULARITIES` /
      :data:`ACT_GRANULARITIES`: ``"per_tensor"`` (one scale), ``"per_channel"``
      (a weight: one scale per output channel), ``"per_token"`` (activations:
      one per row, i.e. per index of every non-contracting axis), or a tile
      as ``tile_size`` takes it (an int ``N``: per channel / per token, in
      tiles of ``N`` along the contraction; a fraction; per-axis tiles).
      BitNet b1.58 is ``weight_granularity="per_tensor"`` (ternary, absmean)
      with ``act_granularity="per_token"`` (int8, absmax).
    weight_estimator, act_estimator: gradient estimator through the
      rounding: ``ste``, ``clipped_ste`` or ``clipped_ste_unit``.

  Static activation scale (``quant_stats``):
    act_static_scale: calibrate the activation scale over batches and keep
      it in Flax state (linen collection ``"quant_stats"``, nnx
      :class:`qtrain.QuantStat` variables) instead of calibrating on every
      batch. One scale per tensor. With ``act_calibration_method="minmax"``
      (asymmetric, integer ``act_qtype``) the state is the averaged
      ``min(x, 0)`` and ``max(x, 0)`` of the batches (``act_static_min``,
      ``act_static_max``), and the scale and integer zero point follow from
      them as a ``minmax`` calibration of those ends. Updated while calibrating (linen: when
      ``"quant_stats"`` is mutable in ``apply``; nnx:
      :func:`qtrain.set_calibrate`), frozen otherwise.
    act_static_scale_averaging: ``"mean"`` (running mean over all
      calibration batches) or ``"ema"`` (exponential moving average).
    act_static_scale_ema_decay: the EMA's decay, in (0, 1).

  Learnable activation scale and shift (bitorch-engine's ``scale_a``,
  ``bias_a``; trainable params that optax updates):
    act_learnable_scale: a layer-wise learned activation scale, initialised
      from the first batch the model sees at init to
      ``act_scale_init * mean|x| / sqrt(qmax)`` (``2 * mean|x|`` for
      binary, as bitorch-engine; LSQ's init for intN).
    act_scale_init: the multiplier above (bitorch-engine: 2.0 symmetric,
      4.0 asymmetric).
    act_scale_grad: the learned scale's gradient, ``"lsq"`` (LSQ, any
      qtype) or ``"bitorch"`` (bitorch-engine's rule, binary only).
    act_learnable_shift: a learned per-input-feature shift added to the
      activation before it is quantized (initialised to 0).

  Backward:
    bwd_qtype: qtype of the incoming gradient in both backward products
      (int2..int8, fp8, or mxfp8 / mxfp4: blocks of 32 along each product's
      contraction), or None for a float backward.
    bwd_weight_grad_tile_size, bwd_act_grad_tile_size: group-wise scales of
      the incoming gradient in the product giving the weight's gradient
      (which contracts the tokens: the tile runs along the last token axis)
      or the input's (which contracts the output features), as qwix's
      ``bwd_weight_grad_tile_size`` / ``dlhs_tile_size`` /
      ``drhs_tile_size``: an int, a fraction of that axis, or per-axis tiles
      ``{axis: tile}`` in the gradient's (the op output's) axes. None: per
      channel. Need ``bwd_qtype``. The other operand of the product is the
      forward's quantized residual, as without a tile.
    bwd_calibration_method: calibration of the gradient (symmetric methods).
    bwd_stochastic_rounding: ``None``, ``"uniform"``, ``"low_bit_uniform"``
      or ``"low_bit_hash"`` (:mod:`qtrain.core.rounding`); keys come from the Flax RNG stream
      ``"quant"`` (see :data:`qtrain.RNG_STREAM`).

  Scales shared across ``jax.shard_map`` shards (each: the mesh axes that split the axes a
  scale is reduced over; the scale is then the whole array's, as on one device; needs the
  qtype it quantizes and an ``absmax``, ``minmax`` or ``fixed`` calibration; skipped outside
  shard_map; empty, the default: per shard):
    bwd_weight_grad_axis_names: the axes that split the batch (data parallelism): the weight
      gradient's product contracts the batch.
    bwd_act_grad_axis_names: the axes that split the output features (a column-parallel
      layer): the input gradient's product contracts them.
    weight_axis_names: the axes that split the weight's contraction (a row-parallel layer).
    act_axis_names: the axes that split the input's contraction (a row-parallel layer's
      input features); also a static scale's calibration.

  Structured sparsity (``dot_general`` and ``einsum`` ops; see :mod:`qtrain.sparsity`):
    weight_sparsity: N:M sparsity of the weight: ``(n, m)`` (e.g. ``(2, 4)``: the 2 largest
      of every 4 values kept, the others 0) or a :class:`qtrain.sparsity.Sparsity` (qwix's
      order, block size and offset). The weight is pruned before it is quantized, on every
      call (its gradient reaches the kept values only); ``freeze`` freezes the pruned weight.
      Needs ``weight_qtype``. qwix's ``additional_qt_config={"sparsity_rule": ...}``.
    act_sparsity: the same for the activation operand (pruned before it is quantized).

  Where it runs:
    implementation: ``"auto"``, ``"xla"``, ``"triton"``, ``"mosaic"`` or ``"interpret"``
      (:mod:`qtrain.ops.dispatch`).

  Low-rank adapter (LoRA; ``dot_general`` and ``einsum`` ops, see :mod:`qtrain.lora`):
    lora_rank: adds a trainable adapter ``A (K, r)``, ``B (r, N)`` of this rank
      to each op the rule matches: the op computes ``x . W + (lora_alpha /
      lora_rank) * dropout(x) . A . B``, with ``x . W`` quantized as the rest
      of the rule says (or float: a rule may set only LoRA fields). None: no
      adapter.
    lora_alpha: the adapter's scale numerator (default: ``lora_rank``, scale 1).
    lora_dropout: dropout rate on the adapter's input, in [0, 1); applied when
      the apply is given keys from the ``"dropout"`` RNG stream (linen) or the
      nnx model is in training mode (``rngs`` with a ``"dropout"`` stream).
  """

  module_path: str = ".*"
  op_names: Sequence[str] | None = None
  weight_qtype: object = None
  act_qtype: object = None
  tile_size: int | float | Mapping[int, int | float] | None = None
  weight_calibration_method: object = "absmax"
  act_calibration_method: object = "absmax"
  disable_channelwise_axes: bool = False
  weight_granularity: str | int | float | Mapping[int, int | float] | None = None
  act_granularity: str | int | float | Mapping[int, int | float] | None = None
  weight_estimator: str = "ste"
  act_estimator: str = "ste"
  act_static_scale: bool = False
  act_static_scale_averaging: str = "mean"
  act_static_scale_ema_decay: float = 0.99
  act_learnable_scale: bool = False
  act_scale_init: float = 2.0
  act_scale_grad: str = "lsq"
  act_learnable_shift: bool = False
  bwd_qtype: object = None
  bwd_calibration_method: object = "absmax"
  bwd_stochastic_rounding: str | None = None
  bwd_weight_grad_tile_size: int | float | Mapping[int, int | float] | None = None
  bwd_act_grad_tile_size: int | float | Mapping[int, int | float] | None = None
  bwd_weight_grad_axis_names: Sequence[str] = ()
  bwd_act_grad_axis_names: Sequence[str] = ()
  weight_axis_names: Sequence[str] = ()
  act_axis_names: Sequence[str] = ()
  implementation: str = "auto"
  lora_rank: int | None = None
  lora_alpha: float | None = None
  lora_dropout: float = 0.0
  weight_sparsity: "sparsity_lib.Sparsity | tuple[int, int] | None" = None
  act_sparsity: "sparsity_lib.Sparsity | tuple[int, int] | None" = None

  def __post_init__(self):
    errors: list[str] = []
    # Sparsity.
    for name in ("weight_sparsity", "act_sparsity"):
      try:
        object.__setattr__(self, name, sparsity_lib.as_sparsity(getattr(self, name), name))
      except ValueError as e:
        errors.append(str(e))
        continue
      if getattr(self, name) is not None:
        if self.weight_qtype is None:
          errors.append(f"{name}={getattr(self, name).short()} needs weight_qtype (sparsity "
                        "applies to the ops a rule quantizes; it is None)")
        if self.op_names is not None and not {"dot_general", "einsum"} & set(
            (self.op_names,) if isinstance(self.op_names, str) else self.op_names):
          errors.append(f"{name} with op_names={self.op_names!r}: sparsity applies to "
                        "dot_general and einsum ops")
    # Matching.
    if not isinstance(self.module_path, str):
      errors.append(f"module_path={self.module_path!r} must be a regex string")
    else:
      try:
        object.__setattr__(self, "_regex", re.compile(self.module_path))
      except re.error as e:
        errors.append(f"module_path={self.module_path!r} is not a valid regex: {e}")
    if self.op_names is not None:
      if isinstance(self.op_names, str):
        object.__setattr__(self, "op_names", (self.op_names,))
      object.__setattr__(self, "op_names", tuple(self.op_names))
      bad = [n for n in self.op_names if n not in OP_NAMES]
      if bad:
        errors.append(f"op_names={self.op_names!r}: unknown op name(s) {bad}; valid: {list(OP_NAMES)}")
      if not self.op_names:
        errors.append("op_names=() matches nothing; use None for all ops")
    # qtypes.
    for name in ("weight_qtype", "act_qtype", "bwd_qtype"):
      v = getattr(self, name)
      if v is not None:
        try:
          object.__setattr__(self, name, qtypes.get_qtype(v).name)
        except ValueError as e:
          errors.append(f"{name}: {e}")
    if self.bwd_qtype is not None:
      try:
        qtypes.check_gradient_qtype(qtypes.get_qtype(self.bwd_qtype), "bwd_qtype")
      except ValueError as e:
        errors.append(str(e))
    # Calibrations.
    for name in ("weight_calibration_method", "act_calibration_method", "bwd_calibration_method"):
      try:
        object.__setattr__(self, name, qarray.as_calibration(getattr(self, name)))
      except ValueError as e:
        errors.append(f"{name}: {e}")
    if isinstance(self.bwd_calibration_method, qarray.Calibration) and \
        self.bwd_calibration_method.is_asymmetric:
      errors.append("bwd_calibration_method='minmax': gradients are quantized symmetrically")
    for name, qname in (("weight_calibration_method", "weight_qtype"),
                        ("act_calibration_method", "act_qtype")):
      cal, qt = getattr(self, name), getattr(self, qname)
      if isinstance(cal, qarray.Calibration) and cal.is_asymmetric and qt is not None and \
          qtypes.get_qtype(qt).kind != "int":
        errors.append(f"{name}='minmax' (asymmetric) needs an integer {qname}, got {qt!r}")
    # Granularity.
    for name in ("tile_size", "bwd_weight_grad_tile_size", "bwd_act_grad_tile_size"):
      try:
        object.__setattr__(self, name, cfg_lib.check_tile(getattr(self, name), name))
      except ValueError as e:
        errors.append(str(e))
    if self.tile_size is not None and self.weight_qtype is None and self.act_qtype is None:
      errors.append(f"tile_size={self.tile_size} is set but weight_qtype and act_qtype are None")
    for name in ("bwd_weight_grad_tile_size", "bwd_act_grad_tile_size"):
      if getattr(self, name) is not None and self.bwd_qtype is None:
        errors.append(f"{name}={getattr(self, name)!r} is set but bwd_qtype is None (the "
                      "backward is float)")
    for name, qname, valid, other in (
        ("weight_granularity", "weight_qtype", WEIGHT_GRANULARITIES, ACT_GRANULARITIES),
        ("act_granularity", "act_qtype", ACT_GRANULARITIES, WEIGHT_GRANULARITIES)):
      v = getattr(self, name)
      if v is None:
        continue
      if isinstance(v, str):
        if v not in valid:
          hint = ""
          if v in other:
            hint = (f" ({v!r} is the other operand's name for the same layout: "
                    f"{valid[1]!r} here)")
          errors.append(f"{name}={v!r}; valid: None, {', '.join(map(repr, valid))} or a tile "
                        f"(a positive int, a fraction in (0, 1], per-axis tiles){hint}")
          continue
      else:
        try:
          object.__setattr__(self, name, cfg_lib.check_tile(v, name))
        except ValueError as e:
          errors.append(f"{e}; or one of {', '.join(map(repr, valid))}")
          continue
      if getattr(self, qname) is None:
        errors.append(f"{name}={v!r} is set but {qname} is None")
    # MX qtypes: blocks of 32 values of one row (the format's own tile).
    if not errors:
      for weight, qname in ((True, "weight_qtype"), (False, "act_qtype")):
        qt = None if getattr(self, qname) is None else qtypes.get_qtype(getattr(self, qname))
        if qt is None or not qt.is_mx:
          continue
        channelwise, tile = self.granularity(weight=weight)
        try:
          field = "weight_granularity / tile_size" if weight else "act_granularity / tile_size"
          if cfg_lib.is_per_axis(tile):
            raise ValueError(f"{field}={dict(tile)!r} with {qname}={qt.name!r}: an MX block is "
                             f"{qt.block_size} values of one row along the contraction, not "
                             "per-axis tiles")
          qtypes.check_tile_size(qt, tile, field)
        except ValueError as e:
          errors.append(str(e))
        if not channelwise:
          errors.append(f"{qname}={qt.name!r} with a per-tensor granularity: an MX block is "
                        f"{qt.block_size} values of one row (per_channel / per_token)")
      bq = None if self.bwd_qtype is None else qtypes.get_qtype(self.bwd_qtype)
      for tile, names in (("bwd_weight_grad_tile_size", "bwd_weight_grad_axis_names"),
                          ("bwd_act_grad_tile_size", "bwd_act_grad_axis_names")):
        try:
          if bq is not None:
            cfg_lib.check_mx_grad(bq, getattr(self, tile), getattr(self, names), "QtRule",
                                  (tile, names))
        except ValueError as e:
          errors.append(str(e).replace("QtRule.", "", 1))
    # Estimators.
    for name in ("weight_estimator", "act_estimator"):
      if getattr(self, name) not in estimators.ESTIMATORS:
        errors.append(f"{name}={getattr(self, name)!r}; valid: {list(estimators.ESTIMATORS)}")
    # Static and learned activation scales: both need an activation qtype, both are symmetric.
    act_cal = self.act_calibration_method
    for name in ("act_static_scale", "act_learnable_scale"):
      if getattr(self, name) and self.act_qtype is None:
        errors.append(f"{name}=True needs act_qtype (it is None)")
    if self.act_learnable_scale and isinstance(act_cal, qarray.Calibration) and \
        act_cal.is_asymmetric:
      errors.append("act_learnable_scale=True with act_calibration_method='minmax': learned "
                    "scales are symmetric (use act_learnable_shift for an offset)")
    if self.act_static_scale and self.act_learnable_scale:
      errors.append("act_static_scale=True and act_learnable_scale=True: pick one")
    if self.act_static_scale_averaging not in STATIC_SCALE_AVERAGING:
      errors.append(f"act_static_scale_averaging={self.act_static_scale_averaging!r}; valid: "
                    f"{list(STATIC_SCALE_AVERAGING)}")
    if not (isinstance(self.act_static_scale_ema_decay, (int, float)) and
            0.0 < self.act_static_scale_ema_decay < 1.0):
      errors.append(f"act_static_scale_ema_decay={self.act_static_scale_ema_decay!r} must be in (0, 1)")
    if self.act_learnable_shift and self.act_qtype is None:
      errors.append("act_learnable_shift=True needs act_qtype (it is None)")
    if not (isinstance(self.act_scale_init, (int, float)) and self.act_scale_init > 0):
      errors.append(f"act_scale_init={self.act_scale_init!r} must be a number > 0")
    if self.act_scale_grad not in estimators.SCALE_GRADS:
      errors.append(f"act_scale_grad={self.act_scale_grad!r}; valid: {list(estimators.SCALE_GRADS)}")
    elif self.act_scale_grad == "bitorch":
      if not self.act_learnable_scale:
        errors.append("act_scale_grad='bitorch' is only used with act_learnable_scale=True")
      elif self.act_qtype is not None and qtypes.get_qtype(self.act_qtype).kind != "binary":
        errors.append(f"act_scale_grad='bitorch' is binary's rule; act_qtype is {self.act_qtype!r}")
    # Backward.
    if self.bwd_stochastic_rounding is not None:
      try:
        rounding.check_stochastic_method(self.bwd_stochastic_rounding, "bwd_stochastic_rounding")
      except ValueError as e:
        errors.append(str(e))
      else:
        if self.bwd_qtype is None:
          errors.append(f"bwd_stochastic_rounding={self.bwd_stochastic_rounding!r} needs "
                        "bwd_qtype (it is None)")
    for field, qname, cname in (
        ("bwd_weight_grad_axis_names", "bwd_qtype", "bwd_calibration_method"),
        ("bwd_act_grad_axis_names", "bwd_qtype", "bwd_calibration_method"),
        ("weight_axis_names", "weight_qtype", "weight_calibration_method"),
        ("act_axis_names", "act_qtype", "act_calibration_method")):
      cal = getattr(self, cname)
      try:
        names = (qarray.shared_axis_names(getattr(self, field), cal, field, cname)
                 if isinstance(cal, qarray.Calibration) else  # invalid: reported above
                 qarray.check_axis_names(getattr(self, field), field))
      except ValueError as e:
        errors.append(str(e))
        continue
      object.__setattr__(self, field, names)
      if names and getattr(self, qname) is None:
        errors.append(f"{field}={names!r} needs {qname} (it is None)")
    if self.act_axis_names and self.act_learnable_scale:
      errors.append(f"act_axis_names={self.act_axis_names!r} with act_learnable_scale: a learned "
                    "scale is a parameter, not calibrated (it is the same on every shard)")
    try:
      cfg_lib.check_implementation(self.implementation)
    except ValueError as e:
      errors.append(str(e))
    # LoRA.
    if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or
                                       not isinstance(self.lora_rank, int) or self.lora_rank <= 0):
      errors.append(f"lora_rank={self.lora_rank!r} must be a positive int or None")
    if self.lora_alpha is not None and (isinstance(self.lora_alpha, bool) or
                                        not isinstance(self.lora_alpha, (int, float)) or
                                        not self.lora_alpha > 0):
      errors.append(f"lora_alpha={self.lora_alpha!r} must be a number > 0 or None")
    if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) or \
        not 0.0 <= self.lora_dropout < 1.0:
      errors.append(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
    if self.lora_rank is None:
      for name, default in (("lora_alpha", None), ("lora_dropout", 0.0)):
        if getattr(self, name) != default:
          errors.append(f"{name}={getattr(self, name)!r} is set but lora_rank is None")
    elif self.op_names is not None and "conv_general_dilated" in self.op_names:
      errors.append(f"lora_rank={self.lora_rank} with op_names={self.op_names}: LoRA adapters go "
                    "on dot_general and einsum ops, not convolutions")
    if not isinstance(self.disable_channelwise_axes, bool):
      errors.append(f"disable_channelwise_axes={self.disable_channelwise_axes!r} must be a bool")
    if errors:
      raise ValueError("Invalid QtRule: " + "; ".join(errors))

  # --------------------------------------------------------------------------

  def matches(self, path: str, op_name: str) -> bool:
    """Whether this rule applies to op ``op_name`` called by the module at ``path``."""
    if self.op_names is not None and op_name not in self.op_names:
      return False
    return self._regex.fullmatch(path) is not None  # type: ignore[attr-defined]

  def near_miss(self, path: str) -> bool:
    """Whether ``re.search`` finds :attr:`module_path` in ``path`` but ``re.fullmatch`` does not
    (the common mistake: ``"mlp"`` for ``"block_0/mlp_up"``; write ``".*mlp.*"``)."""
    rx = self._regex  # type: ignore[attr-defined]
    return rx.search(path) is not None and rx.fullmatch(path) is None

  def granularity(self, *, weight: bool) -> tuple[bool, int | float | tuple | None]:
    """``(channelwise, tile_size)`` of the weight's scales (``weight=True``) or the
    activation's: the operand's own granularity field where set, else the
    shared ``disable_channelwise_axes`` and ``tile_size`` (None: the qtype's default block,
    64 for nf4 and 32 for mxfp8 / mxfp4, per channel for the others)."""
    g = self.weight_granularity if weight else self.act_granularity
    if g is None:
      # A value-set or MX qtype's default block (nf4: 64, QLoRA's; MX: 32) where no tile is set.
      qname = self.weight_qtype if weight else self.act_qtype
      tile = self.tile_size
      if tile is None and qname is not None:
        tile = qtypes.get_qtype(qname).block_size
      return not self.disable_channelwise_axes, tile
    if not isinstance(g, str):  # a tile: an int, a fraction or per-axis tiles
      return True, g
    return g != "per_tensor", None

  @property
  def quantizes(self) -> bool:
    """False for a rule that keeps its ops in float (no qtype set)."""
    return any(q is not None for q in (self.weight_qtype, self.act_qtype, self.bwd_qtype))

  @property
  def has_lora(self) -> bool:
    """Whether ops under this rule carry a low-rank adapter."""
    return self.lora_rank is not None

  @property
  def lora_scale(self) -> float:
    """``lora_alpha / lora_rank`` (1.0 when ``lora_alpha`` is None)."""
    if self.lora_rank is None:
      raise ValueError("lora_scale: this rule has no lora_rank")
    return 1.0 if self.lora_alpha is None else float(self.lora_alpha) / self.lora_rank

  @property
  def active(self) -> bool:
    """Whether ops under this rule leave float ``x . W``: quantized, or given an adapter."""
    return self.quantizes or self.has_lora

  @property
  def needs_rng(self) -> bool:
    """Whether ops under this rule draw keys from the ``"quant"`` RNG stream."""
    return self.bwd_stochastic_rounding is not None

  @property
  def has_state(self) -> bool:
    """Whether ops under this rule keep Flax state (static or learned scales, adapters)."""
    return (self.act_static_scale or self.act_learnable_scale or self.act_learnable_shift or
            self.has_lora)

  def short(self) -> str:
    """A one-line description: the qtypes set."""
    parts = [f"w={self.weight_qtype}", f"a={self.act_qtype}", f"g={self.bwd_qtype}"]
    if self.tile_size:
      parts.append(f"tile={_tile_str(self.tile_size)}")
    for name, t in (("w_grad_tile", self.bwd_weight_grad_tile_size),
                    ("a_grad_tile", self.bwd_act_grad_tile_size)):
      if t is not None:
        parts.append(f"{name}={_tile_str(t)}")
    for name, g in (("w", self.weight_granularity), ("a", self.act_granularity)):
      if g is not None:
        parts.append(f"{name}_gran={_tile_str(g)}")
    if self.bwd_stochastic_rounding:
      parts.append(f"sr={self.bwd_stochastic_rounding}")
    if self.has_lora:
      parts.append(f"lora_rank={self.lora_rank}")
    for name, sp in (("w_sparsity", self.weight_sparsity), ("a_sparsity", self.act_sparsity)):
      if sp is not None:
        parts.append(f"{name}={sp.short()}")
    return " ".join(parts)


def _tile_str(t) -> str:
  return str(dict(t)).replace(" ", "") if cfg_lib.is_per_axis(t) else str(t)


def first_match(rules: Sequence[QtRule], path: str, op_name: str) -> tuple[int, QtRule] | None:
  """The first rule matching ``(path, op_name)`` and its index, or None."""
  for i, r in enumerate(rules):
    if r.matches(path, op_name):
      return i, r
  return None
