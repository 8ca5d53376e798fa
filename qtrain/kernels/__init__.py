"""qtrain's Pallas GPU kernels (Triton and Mosaic GPU backends). Imports :mod:`qtrain.core` only.

* :mod:`qtrain.kernels.binary_matmul` — 1-bit weights x bf16/f16/f32, int8 or binary activations.
* :mod:`qtrain.kernels.nbit_matmul` — 2/4/8-bit (and ternary) weights, group-wise scales and zero points.
* :mod:`qtrain.kernels.int8_matmul` — int8 x int8 with per-row x per-column scales.
* :mod:`qtrain.kernels.mosaic_matmul` — Mosaic GPU (Hopper wgmma/TMA) small-M binary/int4/int8
  weights x bf16/f16/int8; :mod:`qtrain.kernels.mosaic_layout` — its storage orders.
* :mod:`qtrain.kernels.prepared` — weights re-laid out once for the Triton kernels.
* :mod:`qtrain.kernels.transpose` — a materialized transpose that pins XLA's GEMM operand layout.

Every Triton kernel runs in the Pallas interpreter on CPU (``interpret=True``)
and has a pure-jnp ``*_reference`` next to it; the Mosaic kernel runs on a
Hopper GPU only (its layouts are checked on CPU, its numbers on the GPU).
The backend choice (which kernel, or XLA) is :mod:`qtrain.ops.dispatch`.
"""
