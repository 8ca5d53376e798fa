"""qtrain.ops: the quantized-training ops and the backends they run on.

:func:`dot_general_qt` and :func:`conv_general_qt` are ``custom_vjp`` twins
of ``jax.lax.dot_general`` / ``jax.lax.conv_general_dilated``: each operand
quantized per its :class:`OperandQuant`, gradients per :class:`GradQuant`,
configured by a frozen :class:`DotGeneralQtConfig` /
:class:`ConvGeneralQtConfig`; :func:`ragged_dot_qt` is ``jax.lax.ragged_dot``'s
(mixture-of-experts grouped products, on XLA) with a DotGeneralQtConfig. Their products go through
:func:`qtrain.ops.dispatch.quantized_dot_general`, which runs a named backend
of :data:`IMPLEMENTATIONS` or picks one (``"auto"``) by an ordered policy
over what each backend supports. Imports :mod:`qtrain.core` and
:mod:`qtrain.kernels` only.
"""

from qtrain.ops.config import (IMPLEMENTATIONS, ConvGeneralQtConfig, DotGeneralQtConfig, GradQuant,
                               OperandQuant)
from qtrain.ops.conv_general_qt import conv_general_qt
from qtrain.ops.dot_general_qt import dot_general_qt
from qtrain.ops.ragged_dot_qt import ragged_dot_qt

__all__ = ["IMPLEMENTATIONS", "ConvGeneralQtConfig", "DotGeneralQtConfig", "GradQuant",
           "OperandQuant", "conv_general_qt", "dot_general_qt", "ragged_dot_qt"]
