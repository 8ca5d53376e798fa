"""The Triton backend: qtrain's Pallas Triton kernels (and their interpreter twin).

* rhs binary: :func:`~qtrain.kernels.binary_matmul.binary_matmul` with float
  lhs (W1A16), integer-like lhs (W1A8; int8 values) or binary lhs (W1A1).
* rhs int2/ternary/int4/int8 with per-channel or group-wise scales (and
  group zero points): :func:`~qtrain.kernels.nbit_matmul.nbit_matmul`, float
  lhs (WnA16) or integer-like lhs (WnA8); int8 x int8 per-channel goes to
  :func:`~qtrain.kernels.int8_matmul.int8_matmul`.
* rhs may also be a :class:`~qtrain.kernels.prepared.PreparedWeight` (weights
  already in kernel layout, stored (N, K); lhs contracts its last axis):
  this skips the per-call packing that an unpacked ``QArray`` needs.

Not taken: batch dimensions, fp8, asymmetric (zero-point) activations,
activation scales that vary along K, per-element contracting scales.
``TritonBackend(interpret=True)`` ("interpret") runs the same kernels in the
Pallas interpreter, on any device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from qtrain.kernels import _qmatmul
from qtrain.kernels import binary_matmul as _binary
from qtrain.kernels import int8_matmul as _int8
from qtrain.kernels import nbit_matmul as _nbit
from qtrain.kernels import sharded as _sharded
from qtrain.kernels.prepared import PreparedWeight, prepare_binary_activations, prepare_weight
from qtrain.ops.backends import _base
from qtrain.ops.backends._base import DotCall, Unsupported

QTYPES = ("binary", "ternary", "int2", "int4", "int8")

# "auto" uses a Triton kernel only where it measured faster than the XLA path for
# the same operands (benchmarks/RESULTS.md, H200, jax 0.11.2, 2026-11-21).
# Key: (kernel, weights form, M bucket); weights form is "qarray" (an unpacked
# QArray that must be packed / transposed per call), "qarray-nk" (an int8
# QArray already stored (N, K) with N, K multiples of 128: used as is) or
# "prepacked" (a PreparedWeight; always a kernel: XLA cannot read it).
# Sub-byte kernels lose to XLA at every measured M once the per-call packing
# pass (which alone reads every int8 weight, as XLA's int8 dot does) is
# counted, and even without it their in-kernel decode is ALU-bound (see
# docs/performance-history.md, "Pallas kernels vs XLA"); only int8 x int8 on
# (N, K) weights wins, at M <= 16 (62.1 vs 69.1 us at K=8192, N=28672; 7.1 vs
# 7.2 us at 4096^2).
AUTO_KERNEL: dict[tuple[str, str, int], bool] = {
    ("int8", "qarray-nk", 16): True,
    ("int8", "qarray-nk", 64): False,  # 67.9 vs 65.1 us
    ("int8", "qarray-nk", 512): False,  # 253.7 vs 221.3 us
    ("int8", "qarray-nk", 4096): False,  # 1791.6 vs 1607.2 us
}


@dataclasses.dataclass(frozen=True)
class TritonPlan:
  """A canonicalised call: lhs (M, K), a prepared rhs, and output reshaping."""

  kernel: str  # "binary", "nbit" or "int8"
  lhs: Any  # (M, K) float / int8 array, or int32 binary words
  lhs_scale: Any  # (M,) float32 or None
  rhs: PreparedWeight
  out_shape: tuple[int, ...]
  weights_form: str  # "prepacked", "qarray-nk" or "qarray" (see AUTO_KERNEL)
  out_dtype: jnp.dtype = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class TritonBackend:
  """The Triton kernels; ``interpret=True``: the same kernels in the Pallas interpreter."""

  interpret: bool = False

  @property
  def name(self) -> str:
    return "interpret" if self.interpret else "triton"

  def plan(self, call: DotCall) -> TritonPlan:
    _base.decline_emulated(call)
    lhs, rhs, dn = call.lhs, call.rhs, call.dimension_numbers
    if isinstance(rhs, PreparedWeight):
      return _plan_prepared(lhs, rhs, dn, call.out_dtype)
    if not _base.is_qarray(rhs):
      raise Unsupported("the rhs is not quantized (kernels take quantized weights as rhs)")
    lq = _base.is_qarray(lhs)
    lc, rc, lfree, rfree = _base.axes(lhs, rhs, dn)
    if rhs.qtype.container not in QTYPES:  # int3 runs as int4, int5..int7 as int8
      raise Unsupported(f"rhs qtype {rhs.qtype.name} (kernels: {QTYPES})")
    out_shape = tuple(lhs.shape[a] for a in lfree) + tuple(rhs.shape[a] for a in rfree)
    if lq:
      if not lhs.qtype.is_integer_like:
        raise Unsupported(f"lhs qtype {lhs.qtype.name}")
      if lhs.zero_point is not None:
        raise Unsupported("asymmetric (zero-point) activations")
      x = _base.canonical_operand(lhs.qvalue, lc, lfree).astype(jnp.int8)
      x_scale = _base.row_scale(lhs.scale.astype(jnp.float32), lc, lfree, lhs.shape)
    else:
      if lhs.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise Unsupported(f"float lhs of dtype {lhs.dtype}")
      x, x_scale = _base.canonical_operand(lhs, lc, lfree), None
    if x.shape[0] == 0 or x.shape[1] == 0:
      raise Unsupported("empty operand")
    kind, s, group = _base.weight_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape)
    zero = None
    if rhs.zero_point is not None:
      if kind != "group":
        raise Unsupported("weight zero points need group-wise scales")
      _, zero, _ = _base.weight_scale(rhs.zero_point.astype(jnp.float32), rc, rfree, rhs.shape)
    wq = _base.canonical_operand(rhs.qvalue, rc, rfree)
    as_is = (tuple(rfree) + tuple(rc) == tuple(range(rhs.ndim)) and rhs.qtype.container == "int8"
             and kind == "channel" and wq.shape[0] % 128 == 0 and wq.shape[1] % 128 == 0)
    try:
      # (K, N) words measured faster for 16-bit activations (docs/performance-history.md).
      w = prepare_weight(wq, rhs.qtype, scale=s, zero_point=zero, group_size=group,
                         kn=not lq and rhs.qtype.bits < 8)
    except ValueError as e:
      raise Unsupported(str(e)) from None
    return _finish(lhs, lq, x, x_scale, w, out_shape, "qarray-nk" if as_is else "qarray",
                   call.out_dtype)

  def run(self, plan: TritonPlan) -> jax.Array:
    # One kernel call per shard under jit with sharded operands (qtrain.kernels.sharded:
    # M and a cleanly splitting N keep their sharding); on one device, the kernel as it is.
    out = _sharded.weight_matmul(_on_shard, plan.lhs, plan.rhs, x_scale=plan.lhs_scale,
                                 out_dtype=plan.out_dtype, kernel=plan.kernel,
                                 interpret=self.interpret)
    return out.reshape(plan.out_shape)

  def auto_plan(self, call: DotCall) -> TritonPlan | None:
    """The plan where :data:`AUTO_KERNEL` says the kernel is faster (a
    PreparedWeight always: XLA cannot read it), else None."""
    if isinstance(call.rhs, PreparedWeight):
      return self.plan(call)
    if not _base.is_qarray(call.rhs) or not _m_may_prefer(call):
      return None  # no plan traced: its ops would be dead on every lowering
    try:
      plan = self.plan(call)
    except Unsupported:
      return None
    return plan if auto_prefers(plan) else None


_KERNELS = {"binary": _binary.binary_matmul, "int8": _int8.int8_matmul, "nbit": _nbit.nbit_matmul}


def _on_shard(x, w: PreparedWeight, *, x_scale, out_dtype, kernel: str, interpret: bool):
  """The plan's kernel on the rows / columns it is given: the whole product on one device, one
  shard's under ``jax.jit`` with sharded operands (:func:`qtrain.kernels.sharded.weight_matmul`)."""
  return _KERNELS[kernel](x, w, x_scale=x_scale, out_dtype=out_dtype, interpret=interpret)


def auto_prefers(plan: TritonPlan) -> bool:
  """Whether :data:`AUTO_KERNEL` measured this plan's kernel faster than XLA."""
  return AUTO_KERNEL.get((plan.kernel, plan.weights_form, _qmatmul.m_bucket(plan.lhs.shape[0])),
                         False)


def _m_may_prefer(call: DotCall) -> bool:
  """Shape-only: whether call's M falls in a bucket where :data:`AUTO_KERNEL`
  prefers some kernel (training-size M never does); the plan decides the rest."""
  try:
    lc, _, lfree, _ = _base.axes(call.lhs, call.rhs, call.dimension_numbers)
  except Unsupported:
    return False
  m = math.prod(call.lhs.shape[a] for a in lfree)
  return any(v and b == _qmatmul.m_bucket(m) for (_, _, b), v in AUTO_KERNEL.items())


def _plan_prepared(lhs, w: PreparedWeight, dimension_numbers, out_dtype) -> TritonPlan:
  _base.check_last_axis_dims(lhs, dimension_numbers, "PreparedWeight")
  lq = _base.is_qarray(lhs)
  if lq:
    if lhs.zero_point is not None or not lhs.qtype.is_integer_like:
      raise ValueError("PreparedWeight rhs takes float or symmetric integer-like QArray lhs")
    x = lhs.qvalue.reshape(-1, lhs.shape[-1]).astype(jnp.int8)
    x_scale = _base.row_scale(lhs.scale.astype(jnp.float32), (lhs.ndim - 1,),
                              tuple(range(lhs.ndim - 1)), lhs.shape)
  else:
    x, x_scale = lhs.reshape(-1, lhs.shape[-1]), None
  return _finish(lhs, lq, x, x_scale, w, tuple(lhs.shape[:-1]) + (w.n,), "prepacked", out_dtype)


def _finish(lhs, lq, x, x_scale, w, out_shape, form, out_dtype) -> TritonPlan:
  if w.qtype == "binary":
    if lq and lhs.qtype.kind == "binary":
      x = prepare_binary_activations(x, plane_words=w.plane_k)
    return TritonPlan("binary", x, x_scale, w, out_shape, form, out_dtype)
  if lq and w.qtype == "int8" and w.group_size is None:
    return TritonPlan("int8", x, x_scale, w, out_shape, form, out_dtype)
  return TritonPlan("nbit", x, x_scale, w, out_shape, "qarray" if form == "qarray-nk" else form,
                    out_dtype)
