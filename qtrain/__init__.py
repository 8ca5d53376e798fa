"""qtrain: quantized training for JAX/Flax.

Quantize a Flax model's matmuls and convolutions by rules, then train it with
optax or ``nnx.Optimizer`` exactly as the float model::

  >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
  >>> rules = [qtrain.QtRule(module_path=r"layers_0", weight_qtype="int8", act_qtype="int8",
  ...                        bwd_qtype="int8", bwd_stochastic_rounding="uniform"),
  ...          qtrain.QtRule(module_path=r".*", weight_qtype="int4", tile_size=16)]
  >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
  >>> qmodel = qtrain.quantize_model(model, qtrain.QtProvider(rules))
  >>> x = jnp.ones((8, 16))
  >>> variables = qmodel.init(jax.random.key(0), x)
  >>> loss = lambda p: qmodel.apply({"params": p}, x, rngs={"quant": jax.random.key(1)}).sum()
  >>> jax.grad(loss)(variables["params"])["layers_0"]["kernel"].shape
  (16, 32)

Public API: :class:`QtRule`, :class:`QtProvider`, :func:`quantize_model`,
:func:`summary`, :func:`set_calibrate`, the nnx state types
(:class:`QtOp`, :class:`QuantStat`, :class:`ActScale`, :class:`ActShift`),
:data:`RNG_STREAM` (``"quant"``), :mod:`qtrain.binary` (bitorch-engine / larq /
XNOR / MPQ presets), :mod:`qtrain.qlayers`, :mod:`qtrain.optim` (optax
transforms: latent clipping, Bop, stochastic low-bit weight storage),
:mod:`qtrain.freeze` (packed export and inference), and :mod:`qtrain.core`
(numerics and the QT ops, re-exported below).
"""

from qtrain import core
from qtrain.core import (Calibration, ConvGeneralQtConfig, DotGeneralQtConfig, GradQuant,
                         OperandQuant, QArray, QType, QuantizeSpec, VALID_QTYPES,
                         conv_general_qt, dequantize, dot_general_qt, fake_quantize, get_qtype,
                         quantize, quantize_with_scale)
from qtrain.model import (ActScale, ActShift, QtLinenModel, QtOp, QuantStat, quantize_model,
                          set_calibrate, summary)
from qtrain.provider import RNG_STREAM, OpRecord, QtProvider
from qtrain.rules import OP_NAMES, QtRule
from qtrain import binary, freeze, optim, qlayers  # noqa: E402  (they build on the names above)

__version__ = "0.1.0"

__all__ = [
    # Rules, provider, models.
    "QtRule", "QtProvider", "quantize_model", "summary", "set_calibrate", "RNG_STREAM",
    "OP_NAMES", "OpRecord", "QtLinenModel", "QtOp", "QuantStat", "ActScale", "ActShift",
    # Binary / low-bit networks, optax transforms, export.
    "binary", "freeze", "optim", "qlayers",
    # qtrain.core.
    "core", "Calibration", "ConvGeneralQtConfig", "DotGeneralQtConfig", "GradQuant",
    "OperandQuant", "QArray", "QType", "QuantizeSpec", "VALID_QTYPES", "conv_general_qt",
    "dequantize", "dot_general_qt", "fake_quantize", "get_qtype", "quantize",
    "quantize_with_scale",
]
