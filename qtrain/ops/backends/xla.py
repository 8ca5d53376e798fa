"""The XLA backend: :func:`qtrain.core.qdot.dot_general_quantized_xla`, the exact reference.

Takes every QArray / float call. ``XlaBackend(gemm_layout=True)`` is "auto"'s
fallback: it hands XLA its int8/fp8 GEMMs in GEMM layout, pinned on a GPU by a
Pallas transpose (:func:`qtrain.kernels.transpose.gemm_transpose`); "xla"
leaves the operands as they are, layouts to XLA. A
:class:`~qtrain.kernels.mosaic_matmul.MosaicWeight` runs here on its stored
codes ("auto" only, where the Mosaic kernel cannot); a
:class:`~qtrain.kernels.prepared.PreparedWeight` never does (XLA cannot read
its packed words).
"""

from __future__ import annotations

import dataclasses

import jax

from qtrain.core import qdot
from qtrain.kernels import mosaic_matmul as _mosaic
from qtrain.kernels import transpose as _transpose
from qtrain.kernels.prepared import PreparedWeight
from qtrain.ops.backends import mosaic as _mosaic_backend
from qtrain.ops.backends._base import DotCall, Unsupported


@dataclasses.dataclass(frozen=True)
class XlaBackend:
  """XLA's own dot over the dequantized or integer operands (see the module docstring)."""

  gemm_layout: bool = False
  name: str = "xla"

  def plan(self, call: DotCall) -> DotCall:
    if isinstance(call.rhs, PreparedWeight):
      raise Unsupported("a PreparedWeight rhs (XLA cannot read its packed words); pass a QArray")
    if isinstance(call.rhs, _mosaic.MosaicWeight):
      return dataclasses.replace(call, rhs=_mosaic_backend.weight_qarray(call.rhs))
    return call

  def run(self, plan: DotCall) -> jax.Array:
    transpose = _transpose.gemm_transpose if self.gemm_layout else None
    return qdot.dot_general_quantized_xla(plan.lhs, plan.rhs, plan.dimension_numbers,
                                          preferred_element_type=plan.out_dtype,
                                          transpose=transpose, compute_dtype=plan.compute_dtype)

  def auto_plan(self, call: DotCall) -> DotCall | None:
    try:
      return self.plan(call)
    except Unsupported:
      return None
