"""qtrain.core: quantization numerics in pure JAX (imports nothing else of qtrain).

qtypes (the one vocabulary of quantized types), :class:`QArray` with its
calibrations, quantize / dequantize, rounding (nearest and stochastic),
bit packing, straight-through estimators, and :mod:`qtrain.core.qdot`, the
XLA products of quantized operands (the reference every kernel is checked
against). The custom_vjp QT ops built on them live in :mod:`qtrain.ops`.
"""

from qtrain.core.packing import pack, packed_size, unpack, values_per_word
from qtrain.core.qarray import (Calibration, QArray, QuantizeSpec, calibrate, dequantize,
                                fake_quantize, quantize, quantize_with_scale)
from qtrain.core.qdot import dot_general_quantized_xla
from qtrain.core.qtypes import VALID_QTYPES, QType, get_qtype
from qtrain.core.rounding import STOCHASTIC_METHODS, round_nearest, stochastic_round

__all__ = [
    "Calibration", "QArray", "QType", "QuantizeSpec", "STOCHASTIC_METHODS", "VALID_QTYPES",
    "calibrate", "dequantize", "dot_general_quantized_xla", "fake_quantize", "get_qtype", "pack",
    "packed_size", "quantize", "quantize_with_scale", "round_nearest", "stochastic_round",
    "unpack", "values_per_word",
]
