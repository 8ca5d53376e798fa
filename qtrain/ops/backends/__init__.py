"""The backends :func:`qtrain.ops.dispatch.quantized_dot_general` runs a product on.

One module each: :mod:`~qtrain.ops.backends.xla` (the exact reference; takes
every call), :mod:`~qtrain.ops.backends.triton` (the Pallas Triton kernels,
and their interpreter twin), :mod:`~qtrain.ops.backends.mosaic` (the Pallas
Mosaic GPU kernels). Each implements the :class:`~qtrain.ops.backends._base.Backend`
protocol: ``plan(call)`` (raises :class:`Unsupported` with the reason),
``run(plan)`` and ``auto_plan(call)`` (where "auto" should use it).
:mod:`qtrain.ops.dispatch` holds the registry by name and the "auto" policy.
Convolutions reach them as matrix products (:mod:`qtrain.ops.im2col`).
"""

from qtrain.ops.backends._base import Backend, DotCall, Unsupported, supports

__all__ = ["Backend", "DotCall", "Unsupported", "supports"]
