"""qtrain's Pallas GPU kernels (Triton and Mosaic GPU backends) and their dispatch.

* :mod:`qtrain.pallas.binary_matmul` — 1-bit weights x bf16/f16/f32, int8 or binary activations.
* :mod:`qtrain.pallas.nbit_matmul` — 2/4/8-bit (and ternary) weights, group-wise scales and zero points.
* :mod:`qtrain.pallas.int8_matmul` — int8 x int8 with per-row x per-column scales.
* :mod:`qtrain.pallas.mosaic_matmul` — Mosaic GPU (Hopper wgmma/TMA) small-M binary/int4/int8
  weights x bf16/f16/int8; :mod:`qtrain.pallas.mosaic_layout` — its storage orders.
* :mod:`qtrain.pallas.prepared` — weights re-laid out once for the Triton kernels.
* :mod:`qtrain.pallas.transpose` — a materialized transpose that pins XLA's GEMM operand layout.
* :mod:`qtrain.pallas.dispatch` — ``quantized_dot_general``: kernel or XLA.

Every Triton kernel runs in the Pallas interpreter on CPU (``interpret=True``)
and has a pure-jnp ``*_reference`` next to it; the Mosaic kernel runs on a
Hopper GPU only (its layouts are checked on CPU, its numbers on the GPU).
Submodules are imported lazily by the caller (``from qtrain.pallas import
dispatch``) so importing :mod:`qtrain.core` stays cheap.
"""
