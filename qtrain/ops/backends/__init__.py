"""The backends :func:`qtrain.ops.dispatch.quantized_dot_general` runs a product on.

One module each: :mod:`~qtrain.ops.backends.xla` (the exact reference; takes
every call), :mod:`~qtrain.ops.backends.triton` (the Pallas Triton kernels,
and their interpreter twin), :mod:`~qtrain.ops.backends.mosaic` (the Pallas
Mosaic GPU kernels). Each implements the :class:`~qtrain.ops.backends._base.Backend`
protocol: ``plan(call)`` (raises :class:`Unsupported` with the reason),
``run(plan)``, ``auto_plan(call)`` (where "auto" should use it) and
``conv_unsupported()``. :mod:`qtrain.ops.dispatch` holds the registry by name
and the "auto" policy.
"""

from qtrain.ops.backends._base import Backend, DotCall, Unsupported, supports

__all__ = ["Backend", "DotCall", "Unsupported", "supports"]
