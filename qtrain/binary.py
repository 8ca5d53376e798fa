"""Binary (1-bit), ternary and low-bit layer presets: bitorch-engine, larq, XNOR-Net, BitNet b1.58, MPQ.

A :class:`LayerQuant` says how one linear or convolution layer is quantized:
the forward quantization of its input (``act``) and weight (``weight``) as
:class:`~qtrain.ops.config.OperandQuant`, whether the layer learns an input
scale and shift, and the backward's gradient quantization. It builds the
:class:`~qtrain.ops.config.DotGeneralQtConfig` /
:class:`~qtrain.ops.config.ConvGeneralQtConfig` of the QT ops and is what the
layers of :mod:`qtrain.qlayers` and :func:`qtrain.freeze.freeze` take.

The binary schemes side by side
-------------------------------

=====================  ===============================  ===========================  ===========================
                       bitorch-engine (:func:`bitorch`)  larq default (:func:`larq`)  XNOR-Net (:func:`xnor`)
=====================  ===============================  ===========================  ===========================
input shift            learnable ``bias_a`` per input    none                         none
                       feature: ``sign(x + bias_a)``
input scale            learnable, one per layer,         none (1)                     ``mean|x|`` per row (dense:
                       init ``2 * mean|x|`` (``4 *``                                  per example; conv: per
                       when asymmetric)                                               example, not per pixel)
weight scale           ``mean|w|`` per output channel    none (1)                     ``mean|w|`` per output
                       (absmean = L2-optimal)                                         channel
input gradient         clipped STE: zero where           ``ste_sign``: zero where     zero where ``|x| > 1``
                       ``|x / scale_a| > 1``             ``|x| > 1``                  (BNN's htanh STE)
weight gradient        STE, ``g^T @ (sign(x)*scale_a)``  ``ste_sign``: zero where     STE
                                                         ``|w| > 1`` (+ weight clip)
input-scale gradient   ``sum(g_x_clipped * sign(x))      -                            - (computed, not learned)
                       / sqrt(numel(x))``
=====================  ===============================  ===========================  ===========================

All three compute ``sign(x) . sign(w)`` exactly (int8 x int8 -> int32 on the
XLA path, packed 1-bit words in the kernels and after
:func:`qtrain.freeze.freeze`) and multiply the scales after.

Differences from bitorch-engine, on purpose:

* ``sign(0) = +1`` here (every value is +-1, so it packs into one bit);
  ``torch.sign(0) = 0``. Inputs exactly at ``-bias_a`` are measure zero.
* bitorch quantizes the weight gradient to int8 (``nv_tensor_quant``) before
  its optimizer; here it stays float unless ``drhs_grad`` asks for int8.
* Convolutions take per-output-channel weight scales but no group-wise
  (``tile_size``) scales (:class:`~qtrain.ops.config.ConvGeneralQtConfig`),
  so :func:`mpq` conv layers use one scale (and zero point) per output channel.

N-bit weights (bitorch's MPQ layers): :func:`mpq` - 2/4/8-bit weights,
group-wise scales over 32/64/128 input features with asymmetric zero points
(``minmax`` calibration), activations left in 16/32-bit float.

With the rule API (plain ``nn.Dense`` / ``nn.Conv`` + :func:`qtrain.quantize_model`),
:meth:`LayerQuant.to_rules` / :func:`rules` give the equivalent :class:`qtrain.QtRule` s
(learned scale and shift included; the provider names them ``<op>0_act_scale`` /
``<op>0_act_shift``, the layers of :mod:`qtrain.qlayers` ``scale_a`` / ``bias_a``).

Example:
  >>> from qtrain import binary
  >>> lq = binary.bitorch()
  >>> lq.learn_act_scale, lq.learn_act_shift, lq.act.estimator, lq.weight.calibration.method
  (True, True, 'clipped_ste', 'absmean')
  >>> binary.mpq(bits=4, group_size=64).weight.qtype.name
  'int4'
"""

from __future__ import annotations

import dataclasses

from qtrain.core import qarray
from qtrain.ops import config as cfg_lib
from qtrain.rules import QtRule

__all__ = ["LayerQuant", "bitorch", "larq", "xnor", "mpq", "bitnet_b158", "weight_only", "PRESETS",
           "get_preset", "rules"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerQuant:
  """How one linear or convolution layer is quantized.

  Attributes:
    weight: forward quantization of the weight (None: float).
    act: forward quantization of the layer's input (None: float).
    learn_act_scale: the layer owns a learned scalar input scale ``scale_a``
      (initialised at ``act_scale_init * mean|x|`` on the init batch) passed to
      the op as ``lhs_scale``; its gradient follows ``act.scale_grad``.
    act_scale_init: multiplier of ``mean|x|`` for the initial ``scale_a``
      (bitorch: 2 symmetric, 4 asymmetric).
    learn_act_shift: the layer owns a learned per-input-feature shift
      ``bias_a`` (zeros at init), added before the input is quantized.
    dlhs_grad, drhs_grad: gradient quantization of the two backward products.
    implementation: where quantized products run (``"auto"``, ``"xla"``,
      ``"triton"``, ``"mosaic"``, ``"interpret"``).
    name: a label (for summaries).
  """

  weight: cfg_lib.OperandQuant | None = None
  act: cfg_lib.OperandQuant | None = None
  learn_act_scale: bool = False
  act_scale_init: float = 2.0
  learn_act_shift: bool = False
  dlhs_grad: cfg_lib.GradQuant | None = None
  drhs_grad: cfg_lib.GradQuant | None = None
  implementation: str = "auto"
  name: str = "custom"

  def __post_init__(self):
    if self.learn_act_scale and self.act is None:
      raise ValueError("learn_act_scale=True needs act= (a quantized input)")
    if self.act_scale_init <= 0:
      raise ValueError(f"act_scale_init={self.act_scale_init} must be > 0")

  @property
  def is_float(self) -> bool:
    return self.weight is None and self.act is None

  @property
  def needs_key(self) -> bool:
    return self.dot_config().needs_key

  def dot_config(self) -> cfg_lib.DotGeneralQtConfig:
    """The config of :func:`~qtrain.ops.dot_general_qt.dot_general_qt` (lhs = input)."""
    return cfg_lib.DotGeneralQtConfig(lhs=self.act, rhs=self.weight, dlhs_grad=self.dlhs_grad,
                                      drhs_grad=self.drhs_grad, implementation=self.implementation)

  def conv_config(self) -> cfg_lib.ConvGeneralQtConfig:
    """The config of :func:`~qtrain.ops.conv_general_qt.conv_general_qt`.

    Group-wise weight scales (``tile_size``) become per-output-channel scales:
    convolutions take no ``tile_size``.
    """
    w = self.weight
    if w is not None and w.tile_size is not None:
      w = dataclasses.replace(w, tile_size=None)
    a = self.act
    if a is not None and a.tile_size is not None:
      a = dataclasses.replace(a, tile_size=None)
    return cfg_lib.ConvGeneralQtConfig(lhs=a, rhs=w, dlhs_grad=self.dlhs_grad,
                                       drhs_grad=self.drhs_grad, implementation=self.implementation)

  def replace(self, **kw) -> "LayerQuant":
    return dataclasses.replace(self, **kw)

  # -- qtrain.QtRule interop (rules for qtrain.quantize_model) --------------

  def to_rules(self, module_path: str = ".*") -> list:
    """The :class:`qtrain.QtRule` s that give plain ``nn.Dense`` / ``nn.Conv`` layers this
    quantization under :func:`qtrain.quantize_model` (same forward and gradients as
    :class:`qtrain.qlayers.QDense` / :class:`~qtrain.qlayers.QConv`).

    One rule, or two when the weight has group-wise scales (``tile_size``:
    one rule for dot_general / einsum, one for convolutions without it).
    """

    w, a = self.weight, self.act
    strip = lambda gq: gq if gq is None else dataclasses.replace(gq, axis_names=())
    if strip(self.dlhs_grad) != strip(self.drhs_grad):
      raise ValueError("QtRule has one bwd_qtype for both backward products")
    g = self.drhs_grad
    # Each operand's granularity in its own field; per-tensor tiles (no per-operand name) go
    # through the shared disable_channelwise_axes + tile_size, which one operand at most may use.
    shared = [(n, oq) for n, oq in (("weight", w), ("act", a))
              if oq is not None and not oq.channelwise and oq.tile_size]
    if len(shared) > 1 and shared[0][1].tile_size != shared[1][1].tile_size:
      raise ValueError("per-tensor tiles of different sizes on both operands: a QtRule has one "
                       f"tile_size for those (weight {w.tile_size}, act {a.tile_size})")

    def granularity(oq, per_row: str, *, conv: bool):
      if oq is None or (not oq.channelwise and oq.tile_size and not conv):
        return None
      if oq.tile_size and not conv:
        return oq.tile_size
      return per_row if oq.channelwise else "per_tensor"

    kw = dict(
        module_path=module_path,
        weight_qtype=None if w is None else w.qtype.name,
        act_qtype=None if a is None else a.qtype.name,
        weight_calibration_method=w.calibration if w is not None else "absmax",
        act_calibration_method=a.calibration if a is not None else "absmax",
        disable_channelwise_axes=bool(shared),
        weight_estimator=w.estimator if w is not None else "ste",
        act_estimator=a.estimator if a is not None else "ste",
        act_learnable_scale=self.learn_act_scale, act_scale_init=self.act_scale_init,
        act_scale_grad=a.scale_grad if (a is not None and self.learn_act_scale) else "lsq",
        act_learnable_shift=self.learn_act_shift,
        bwd_qtype=None if g is None else g.qtype.name,
        bwd_calibration_method=g.calibration if g is not None else "absmax",
        bwd_stochastic_rounding=None if g is None else g.stochastic_rounding,
        bwd_weight_grad_axis_names=() if g is None else g.axis_names,
        bwd_act_grad_axis_names=() if self.dlhs_grad is None else self.dlhs_grad.axis_names,
        weight_axis_names=() if w is None else w.axis_names,
        act_axis_names=() if a is None else a.axis_names,
        implementation=self.implementation)
    tile = shared[0][1].tile_size if shared else None

    def rule(conv: bool, **extra):
      return QtRule(**kw, **extra, tile_size=None if conv else tile,
                    weight_granularity=granularity(w, "per_channel", conv=conv),
                    act_granularity=granularity(a, "per_token", conv=conv))

    if not any(oq is not None and oq.tile_size for oq in (w, a)):
      return [rule(False)]
    return [rule(False, op_names=("dot_general", "einsum")),
            rule(True, op_names=("conv_general_dilated",))]

  @classmethod
  def from_rule(cls, rule, *, conv: bool = False) -> "LayerQuant":
    """The LayerQuant of what a :class:`qtrain.QtRule` gives one layer (the provider's mapping)."""
    if rule.act_static_scale:
      raise ValueError("rules with act_static_scale are not supported here (no LayerQuant field)")

    def op(weight: bool):
      qt = rule.weight_qtype if weight else rule.act_qtype
      if qt is None:
        return None
      learned = (not weight) and rule.act_learnable_scale
      channelwise, tile_size = rule.granularity(weight=weight)
      return cfg_lib.OperandQuant(
          qtype=qt,
          calibration=rule.weight_calibration_method if weight else rule.act_calibration_method,
          channelwise=channelwise,
          tile_size=None if (conv or learned) else tile_size,
          estimator=rule.weight_estimator if weight else rule.act_estimator,
          scale_grad=rule.act_scale_grad if learned else "lsq",
          axis_names=rule.weight_axis_names if weight else rule.act_axis_names)

    g = None if rule.bwd_qtype is None else cfg_lib.GradQuant(
        qtype=rule.bwd_qtype, calibration=rule.bwd_calibration_method,
        stochastic_rounding=rule.bwd_stochastic_rounding)
    ga = None if g is None else dataclasses.replace(g, axis_names=rule.bwd_act_grad_axis_names)
    gw = None if g is None else dataclasses.replace(g, axis_names=rule.bwd_weight_grad_axis_names)
    return cls(weight=op(True), act=op(False), learn_act_scale=rule.act_learnable_scale,
               act_scale_init=rule.act_scale_init, learn_act_shift=rule.act_learnable_shift,
               dlhs_grad=ga, drhs_grad=gw, implementation=rule.implementation,
               name=f"rule:{rule.short()}")


_UNIT = qarray.Calibration(method="fixed", bound=1.0)


def bitorch(*, binary_act: bool = True, asymmetric: bool = False, learn_act_shift: bool = True,
            int8_weight_grad: bool = False, implementation: str = "auto") -> LayerQuant:
  """bitorch-engine's BinaryLinear / BinaryConv2d.

  Forward ``binmm(sign(x + bias_a), sign(w)) * scale_a * scale_w``; backward
  per the table in the module docstring.

  Training note (measured on Fashion-MNIST, examples/fashion_mnist.py): with
  batch norm after the layer the loss does not depend on the output scale,
  and bitorch's scale gradient then drives ``scale_a`` steadily towards 0
  under Adam's normalised steps (lr 2e-3: from ~1.6 to ~0 within 3 epochs);
  once ``|x / scale_a| > 1`` everywhere the clipped STE passes no gradient
  and the network collapsed to 10% test accuracy. Give ``scale_a`` a smaller
  learning rate (0.01x kept it within ~10% of its init, 91% test accuracy),
  e.g. ``optax.multi_transform`` with :func:`qtrain.optim.path_mask`
  ``(r".*(scale_a|_act_scale)")``.

  Args:
    binary_act: binarize the input (False: binary weights, float inputs).
    asymmetric: initialise ``scale_a`` at ``4 * mean|x|`` instead of 2.
    learn_act_shift: learn ``bias_a`` (bitorch does).
    int8_weight_grad: quantize ``g`` in the weight-gradient product to int8
      (bitorch quantizes the weight gradient to int8; off by default).
    implementation: see :class:`LayerQuant`.
  """
  weight = cfg_lib.OperandQuant(qtype="binary", calibration="absmean", channelwise=True,
                                estimator="ste")
  act = None
  if binary_act:
    act = cfg_lib.OperandQuant(qtype="binary", calibration="absmean", channelwise=False,
                               estimator="clipped_ste", scale_grad="bitorch")
  return LayerQuant(
      weight=weight, act=act, learn_act_scale=binary_act,
      act_scale_init=4.0 if asymmetric else 2.0, learn_act_shift=binary_act and learn_act_shift,
      drhs_grad=cfg_lib.GradQuant(qtype="int8") if int8_weight_grad else None,
      implementation=implementation, name="bitorch" if binary_act else "bitorch_w1")


def larq(*, binary_act: bool = True, implementation: str = "auto") -> LayerQuant:
  """larq's default QuantDense/QuantConv2D: ``ste_sign`` on inputs and weights, no scales.

  The gradient is zeroed where ``|x| > 1`` (inputs) and ``|w| > 1`` (latent
  weights; with :func:`qtrain.optim.clip_latent_weights` they stay in [-1, 1]).
  """
  op = cfg_lib.OperandQuant(qtype="binary", calibration=_UNIT, channelwise=False,
                            estimator="clipped_ste_unit")
  return LayerQuant(weight=op, act=op if binary_act else None, implementation=implementation,
                    name="larq" if binary_act else "larq_w1")


def xnor(*, binary_act: bool = True, implementation: str = "auto") -> LayerQuant:
  """XNOR-Net: ``mean|w|`` per output channel, ``mean|x|`` per input row.

  Weights: STE. Inputs: gradient zeroed where ``|x| > 1``. For convolutions the
  input scale is one per example (XNOR-Net's per-pixel ``K`` map is not
  modelled: it would need a scale varying along the spatial axes).
  """
  weight = cfg_lib.OperandQuant(qtype="binary", calibration="absmean", channelwise=True,
                                estimator="ste")
  act = None
  if binary_act:
    act = cfg_lib.OperandQuant(qtype="binary", calibration="absmean", channelwise=True,
                               estimator="clipped_ste_unit")
  return LayerQuant(weight=weight, act=act, implementation=implementation,
                    name="xnor" if binary_act else "xnor_w1")


def mpq(*, bits: int = 4, group_size: int | None = 64, asymmetric: bool = True,
        implementation: str = "auto") -> LayerQuant:
  """bitorch-engine's MPQ layers: ``bits``-bit weights (2, 4 or 8), float (16-bit) inputs.

  Args:
    bits: 2, 4 or 8.
    group_size: K values per weight scale (32, 64 or 128 in bitorch; any
      divisor of K works here); None: one scale per output channel.
    asymmetric: ``minmax`` calibration (scales and zero points, bitorch's
      ``asym``); False: symmetric ``absmax``.
    implementation: see :class:`LayerQuant`.
  """
  if bits not in (2, 4, 8):
    raise ValueError(f"bits={bits}: MPQ weights are 2, 4 or 8 bits")
  if group_size is not None and group_size <= 0:
    raise ValueError(f"group_size={group_size} must be a positive int or None")
  weight = cfg_lib.OperandQuant(qtype=f"int{bits}",
                                calibration="minmax" if asymmetric else "absmax",
                                channelwise=True, tile_size=group_size, estimator="ste")
  return LayerQuant(weight=weight, implementation=implementation,
                    name=f"w{bits}g{group_size or 'ch'}" + ("a" if asymmetric else "s"))


def bitnet_b158(*, implementation: str = "auto") -> LayerQuant:
  """BitNet b1.58 (Ma et al., 2024): ternary weights, 8-bit activations.

  * Weights: ternary {-1, 0, +1} with one scale per tensor, ``mean|W|``
    (``absmean``): ``W_q = clip(round(W / mean|W|), -1, 1) * mean|W|``.
  * Activations: int8 with one scale per token, ``max|x| / 127``
    (``absmax``): ``x_q = round(x * 127 / max|x|) * max|x| / 127``.
  * Gradients: the straight-through estimator through both roundings (no
    clipping), float backward; the latent weights stay float (bf16/float32)
    in the optimizer.

  The products run as int8 x int8 -> int32 (the int8 GEMM on a GPU); after
  :func:`qtrain.freeze.freeze` the ternary weights are stored packed in 2 bits.

  What the preset does not do (the model's part, as in the paper's BitLinear):
  BitNet normalises every quantized layer's input (a LayerNorm / RMSNorm
  right before each projection, "SubLN"), keeps the embeddings, the output
  head and the norms in high precision, and trains with a larger learning
  rate than the float model and a two-stage schedule (weight decay switched
  off halfway). Put the norms in the model and the first / last layers in a
  float rule (``QtRule(module_path="head")``) before the preset's rule.
  """
  weight = cfg_lib.OperandQuant(qtype="ternary", calibration="absmean", channelwise=False,
                                estimator="ste")
  act = cfg_lib.OperandQuant(qtype="int8", calibration="absmax", channelwise=True, estimator="ste")
  return LayerQuant(weight=weight, act=act, implementation=implementation, name="bitnet_b158")


def weight_only(qtype: str, **operand_kw) -> LayerQuant:
  """Weights quantized to ``qtype`` (any OperandQuant fields), float inputs."""
  return LayerQuant(weight=cfg_lib.OperandQuant(qtype=qtype, **operand_kw), name=f"w_{qtype}")


PRESETS = {
    "float": lambda: LayerQuant(name="float"),
    "bitorch": bitorch,
    "bitorch_w1": lambda: bitorch(binary_act=False),
    "larq": larq,
    "xnor": xnor,
    "w8": lambda: mpq(bits=8, group_size=64),
    "w4": lambda: mpq(bits=4, group_size=64),
    "w2": lambda: mpq(bits=2, group_size=32),
    "bitnet_b158": bitnet_b158,
}


def get_preset(name: str) -> LayerQuant:
  """A :class:`LayerQuant` by name (keys of :data:`PRESETS`)."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
  return PRESETS[name]()


def rules(layers: "dict[str, LayerQuant | str | None]") -> list:
  """``{module path regex: LayerQuant, preset name or None}`` -> a list of :class:`qtrain.QtRule`.

  None keeps the matched layers float (a rule with no qtype). Feed the result to
  ``qtrain.QtProvider`` / ``qtrain.quantize_model``; :func:`qtrain.freeze.freeze`
  takes the same rules.

  Example:
    >>> from qtrain import binary
    >>> rs = binary.rules({"conv1|head": None, ".*": "bitorch"})
    >>> [r.weight_qtype for r in rs], rs[1].act_scale_grad
    ([None, 'binary'], 'bitorch')
  """

  out = []
  for path, lq in layers.items():
    if lq is None:
      out.append(QtRule(module_path=path))
      continue
    if isinstance(lq, str):
      lq = get_preset(lq)
    out.extend(lq.to_rules(path))
  return out
