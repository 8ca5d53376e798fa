"""qtrain.core: pure-JAX quantization numerics and the QT custom_vjp ops (no Flax)."""

from qtrain.core.config import ConvGeneralQtConfig, DotGeneralQtConfig, GradQuant, OperandQuant
from qtrain.core.conv_general_qt import conv_general_qt
from qtrain.core.dot_general_qt import dot_general_qt
from qtrain.core.packing import pack, packed_size, unpack, values_per_word
from qtrain.core.qarray import (Calibration, QArray, QuantizeSpec, calibrate, dequantize,
                                fake_quantize, quantize, quantize_with_scale)
from qtrain.core.qdot import dot_general_quantized_xla
from qtrain.core.qtypes import VALID_QTYPES, QType, get_qtype
from qtrain.core.rounding import STOCHASTIC_METHODS, round_nearest, stochastic_round

__all__ = [
    "Calibration", "ConvGeneralQtConfig", "DotGeneralQtConfig", "GradQuant", "OperandQuant",
    "QArray", "QType", "QuantizeSpec", "STOCHASTIC_METHODS", "VALID_QTYPES", "calibrate",
    "conv_general_qt", "dequantize", "dot_general_qt", "dot_general_quantized_xla",
    "fake_quantize", "get_qtype", "pack", "packed_size", "quantize", "quantize_with_scale",
    "round_nearest", "stochastic_round", "unpack", "values_per_word",
]
