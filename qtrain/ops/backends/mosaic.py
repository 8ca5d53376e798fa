"""The Mosaic backend: qtrain's Pallas Mosaic GPU kernels (Hopper, jax >= 0.11).

* M <= :data:`~qtrain.kernels.mosaic_matmul.MAX_M`:
  :mod:`qtrain.kernels.mosaic_matmul`, bf16/f16 activations or symmetric
  integer QArray activations of <= 8 bits (int8 wgmma) x binary/int4/int8
  weights (int2 with integer activations only) with per-channel scales, as a
  QArray or a :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight`.
* Larger M: the 8-bit GEMM :mod:`qtrain.kernels.mosaic_gemm` for integer
  QArrays of <= 8 bits on both sides, or fp8 QArrays of one dtype on both
  sides (per-row / per-column scales, fused).

"auto" runs here (a) integer products of at least :data:`AUTO_GEMM_MIN_M`
rows on the GEMM, on a Hopper GPU, where its shapes tile (fp8 ones only when
forced: see :meth:`MosaicBackend.auto_plan`); (b) a MosaicWeight
rhs where the small-M kernel runs (a CUDA lowering, a dot it takes). It does
not choose the small-M kernel for QArray weights (that would repack them
every call).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from qtrain.core import qarray, qtypes
from qtrain.kernels import _common
from qtrain.kernels import mosaic_gemm as _gemm
from qtrain.kernels import mosaic_matmul as _mosaic
from qtrain.kernels import sharded as _sharded
from qtrain.kernels import transpose as _transpose
from qtrain.ops.backends import _base
from qtrain.ops.backends._base import DotCall, Unsupported

# Measured against XLA's cuBLAS int8 GEMM + its separate int32 -> scaled float
# pass (docs/performance-history.md, "Mosaic int8 GEMM", H200): 1.09-1.44x at
# M = 512 (with (128, 128) CTA tiles where (128, 256) ones would leave most SMs
# idle), 1.08-1.31x from M = 1024; smaller M is not measured.
AUTO_GEMM_MIN_M = 512


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """A canonicalised 8-bit call for the Mosaic GEMM: a (M, K), b (N, K), both int8 or both
  of one fp8 dtype."""

  a: Any
  a_scale: Any  # (M,) float32
  b: Any
  b_scale: Any  # (N,) float32
  out_shape: tuple[int, ...]
  out_dtype: jnp.dtype
  # "auto": the GemmConfig checked for the whole product's shapes; None: forced ("mosaic"),
  # checked when it runs. Either way each shard runs the default config for its own shapes.
  config: Any = None


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
  """A canonicalised small-M call: x (M, K) bf16/f16/int8, a MosaicWeight."""

  x: Any
  x_scale: Any  # (M,) float32 or None
  w: _mosaic.MosaicWeight
  out_shape: tuple[int, ...]
  out_dtype: jnp.dtype
  config: Any = None  # a MosaicConfig checked for these shapes ("auto"), or None


@dataclasses.dataclass(frozen=True)
class MosaicBackend:
  """The Mosaic GPU kernels: the small-M matmul and the int8 GEMM."""

  name: str = "mosaic"

  def plan(self, call: DotCall) -> GemmPlan | MatmulPlan:
    # What the kernel cannot take is reported here; mosaic_matmul itself then
    # refuses a non-GPU backend (and jax < 0.11) by name when it runs.
    if not isinstance(call.rhs, _mosaic.MosaicWeight):
      try:  # large M: the GEMM
        return plan_gemm(call, min_m=_mosaic.MAX_M + 1)
      except Unsupported:
        pass
    return plan_matmul(call)

  def run(self, plan: GemmPlan | MatmulPlan) -> jax.Array:
    if isinstance(plan, GemmPlan):
      if plan.config is None:  # forced: what the kernel cannot run raises here, by name
        _gemm.check_call(plan.a, plan.b, None, plan.out_dtype)
      out = _sharded.gemm(_gemm_on_shard, plan.a, plan.b, plan.a_scale, plan.b_scale,
                          out_dtype=plan.out_dtype)
      return out.reshape(plan.out_shape)
    # One kernel call per shard as for the GEMM (qtrain.kernels.sharded.weight_matmul: M, and
    # N in whole N_ALIGN blocks of an unpadded weight, keep their sharding).
    out = _sharded.weight_matmul(_matmul_on_shard, plan.x, plan.w, x_scale=plan.x_scale,
                                 out_dtype=plan.out_dtype, checked=plan.config is not None)
    return out.reshape(plan.out_shape)

  def auto_plan(self, call: DotCall) -> GemmPlan | MatmulPlan | None:
    """(a) or (b) of the module docstring, with a checked kernel config; else None."""
    if isinstance(call.rhs, _mosaic.MosaicWeight):
      _base.check_last_axis_dims(call.lhs, call.dimension_numbers, "MosaicWeight")
    if jax.__version_info__ < (0, 11):
      return None
    if isinstance(call.rhs, _mosaic.MosaicWeight):
      if _common.on_gpu() and not _common.on_hopper():
        return None
      try:
        plan = plan_matmul(call)
        return dataclasses.replace(plan, config=_mosaic.checked_config(plan.x, plan.w))
      except (Unsupported, _mosaic.UnsupportedCall):
        return None
    if not _common.on_hopper():
      return None
    if not all(_base.is_qarray(q) and q.qtype.is_integer_like for q in (call.lhs, call.rhs)):
      # fp8 runs on the GEMM only when forced: its wgmma accumulation (no promotion to a
      # float32 register sum) errs up to ~2x more than cuBLAS's at K >= 4096 (docs/findings.md,
      # "The Mosaic GEMM on fp8"). Checked before planning: a plan traces the transposes.
      return None
    try:
      plan = plan_gemm(call, min_m=AUTO_GEMM_MIN_M)
      return dataclasses.replace(plan, config=_gemm.checked_config(plan.a, plan.b, None,
                                                                   plan.out_dtype))
    except (Unsupported, _mosaic.UnsupportedCall):
      return None


def _gemm_on_shard(a, b, sa, sb, *, out_dtype) -> jax.Array:
  """The Mosaic GEMM with the default config for the shapes it gets: the whole product on one
  device, one shard's under ``jax.jit`` with sharded operands (:mod:`qtrain.kernels.sharded`).
  A shard that does not tile (of a product that does) runs on XLA's int8 GEMM with the same
  epilogue: the same numbers."""
  try:
    cfg = _gemm.checked_config(a, b, None, out_dtype)
  except _mosaic.UnsupportedCall:
    return _gemm.mosaic_gemm_reference(a, b, a_scale=sa, b_scale=sb, out_dtype=out_dtype)
  return _gemm._gemm(a, b, sa, sb, out_dtype, cfg)


def _matmul_on_shard(x, w, *, x_scale, out_dtype, checked: bool) -> jax.Array:
  """The small-M kernel on the rows / columns it gets (the whole product on one device, one
  shard's under ``jax.jit`` with sharded operands). ``checked`` ("auto"): the plan's config
  was checked for the whole product, and each shard runs the default config for its own
  shapes (on one device: that config); otherwise (forced) :func:`mosaic_matmul` checks the
  call and raises what it cannot run, by name."""
  if not checked:
    return _mosaic.mosaic_matmul(x, w, x_scale=x_scale, out_dtype=out_dtype)
  return _mosaic._matmul(x, w, x_scale, out_dtype, _mosaic.checked_config(x, w))


def weight_qarray(w: _mosaic.MosaicWeight) -> qarray.QArray:
  """The QArray a MosaicWeight was prepared from ((N, K) codes, (N, 1) scale)."""
  scale = jnp.ones((w.n, 1), jnp.float32) if w.w_scale is None else w.w_scale[:, None]
  return qarray.QArray(qvalue=_mosaic.mosaic_weight_values(w), scale=scale, zero_point=None,
                       qtype=qtypes.get_qtype(w.qtype))


def _matmul_lhs(lhs, contract, free):
  """(x (M, K), x_scale (M,) or None) for the small-M kernel: bf16/f16, or the
  int8 codes and row scales of a symmetric integer QArray; else Unsupported."""
  if _base.is_qarray(lhs):
    if not lhs.qtype.is_integer_like or lhs.qtype.bits > 8:
      raise Unsupported(f"{lhs.qtype.name} activations (the Mosaic kernel takes bf16/f16 "
                        f"activations or integer ones of at most 8 bits)")
    if lhs.zero_point is not None:
      raise Unsupported("asymmetric (zero-point) activations")
    x = _base.canonical_operand(lhs.qvalue, contract, free).astype(jnp.int8)
    return x, _base.row_scale(lhs.scale.astype(jnp.float32), contract, free, lhs.shape)
  if lhs.dtype not in (jnp.bfloat16, jnp.float16):
    raise Unsupported(f"activations of dtype {lhs.dtype} (the Mosaic kernel takes bf16/f16, "
                      f"or int8 QArrays)")
  return _base.canonical_operand(lhs, contract, free), None


def plan_matmul(call: DotCall) -> MatmulPlan:
  """The small-M kernel's plan, or Unsupported(reason)."""
  _base.decline_emulated(call)
  lhs, rhs, dn = call.lhs, call.rhs, call.dimension_numbers
  if isinstance(rhs, _mosaic.MosaicWeight):
    _base.check_last_axis_dims(lhs, dn, "MosaicWeight")
    nd = lhs.ndim
    x, x_scale = _matmul_lhs(lhs, (nd - 1,), tuple(range(nd - 1)))
    return MatmulPlan(x, x_scale, rhs, tuple(lhs.shape[:-1]) + (rhs.n,), call.out_dtype)
  if not _base.is_qarray(rhs):
    raise Unsupported("the rhs is not quantized (kernels take quantized weights as rhs)")
  container = rhs.qtype.container  # int3 runs as int4, int5..int7 as int8 (the codes fit)
  if container not in _mosaic.QTYPES:
    raise Unsupported(f"rhs qtype {rhs.qtype.name} (the Mosaic kernel takes {_mosaic.QTYPES})")
  if rhs.zero_point is not None:
    raise Unsupported("weight zero points")
  lc, rc, lfree, rfree = _base.axes(lhs, rhs, dn)
  kind, s, _ = _base.weight_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape)
  if kind != "channel":
    raise Unsupported("group-wise weight scales (the Mosaic kernel takes per-channel scales)")
  x, x_scale = _matmul_lhs(lhs, lc, lfree)
  if container == "int2" and x.dtype != jnp.int8:
    raise Unsupported(f"int2 weights with {x.dtype} activations (the Mosaic kernel runs int2 "
                      f"weights with integer activations only)")
  if not 1 <= x.shape[0] <= _mosaic.MAX_M or x.shape[1] == 0:
    raise Unsupported(f"M={x.shape[0]} (the small-M Mosaic kernel serves M in 1..{_mosaic.MAX_M}; "
                      f"larger M runs on the Mosaic GEMM, which takes integer QArrays on both sides)")
  w = _mosaic.prepare_mosaic_weight(_base.canonical_operand(rhs.qvalue, rc, rfree), container,
                                    scale=s, order="int8" if x.dtype == jnp.int8 else "float",
                                    tiles=None)  # repacked per call: no extra transpose
  out_shape = tuple(lhs.shape[a] for a in lfree) + tuple(rhs.shape[a] for a in rfree)
  return MatmulPlan(x, x_scale, w, out_shape, call.out_dtype)


def _gemm_dtype(qt: qtypes.QType) -> jnp.dtype | None:
  """The Mosaic GEMM's operand dtype for values of ``qt``: int8 for integers of <= 8 bits,
  the fp8 dtype for per-channel fp8 (not MX: its block scales vary along K); else None."""
  if qt.is_integer_like and qt.bits <= 8:
    return jnp.dtype(jnp.int8)
  if qt.is_float and not qt.is_mx and jnp.dtype(qt.compute_dtype) in _gemm.OPERAND_DTYPES:
    return jnp.dtype(qt.compute_dtype)
  return None


def plan_gemm(call: DotCall, min_m: int = 1) -> GemmPlan:
  """Both operands symmetric QArrays of one 8-bit kind (integers of <= 8 bits, or one fp8
  dtype: wgmma reads one element type) with per-row / per-column scales, no batch axes, a
  float output, at least ``min_m`` rows: the Mosaic GEMM's plan; else Unsupported (raised
  before any operand is transposed)."""
  _base.decline_emulated(call)
  lhs, rhs, out_dtype = call.lhs, call.rhs, call.out_dtype
  dtypes = []
  for what, q in (("lhs", lhs), ("rhs", rhs)):
    if not _base.is_qarray(q):
      raise Unsupported(f"the {what} is not a QArray (the Mosaic GEMM takes 8-bit x 8-bit)")
    dtypes.append(_gemm_dtype(q.qtype))
    if dtypes[-1] is None:
      raise Unsupported(f"{what} qtype {q.qtype.name} (the Mosaic GEMM takes integers of <= 8 "
                        f"bits and per-channel fp8)")
    if q.zero_point is not None:
      raise Unsupported(f"asymmetric (zero-point) {what}")
  if dtypes[0] != dtypes[1]:
    raise Unsupported(f"{lhs.qtype.name} x {rhs.qtype.name} (wgmma reads one element type for "
                      f"both operands)")
  if jnp.dtype(out_dtype) not in _gemm.OUT_DTYPES:
    raise Unsupported(f"output dtype {jnp.dtype(out_dtype)} (the Mosaic GEMM writes "
                      f"{[str(d) for d in _gemm.OUT_DTYPES]})")
  lc, rc, lfree, rfree = _base.axes(lhs, rhs, call.dimension_numbers)
  m = math.prod(lhs.shape[i] for i in lfree)
  if m < min_m:
    raise Unsupported(f"M={m} (below {min_m} rows)")
  a = _gemm_operand(lhs.qvalue, lc, lfree, dtypes[0])
  b = _gemm_operand(rhs.qvalue, rc, rfree, dtypes[1])
  if 0 in a.shape or b.shape[0] == 0:
    raise Unsupported("empty operand")
  sa = _base.row_scale(lhs.scale.astype(jnp.float32), lc, lfree, lhs.shape, "lhs")
  sb = _base.row_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape, "rhs")
  out_shape = tuple(lhs.shape[i] for i in lfree) + tuple(rhs.shape[i] for i in rfree)
  return GemmPlan(a, sa, b, sb, out_shape, jnp.dtype(out_dtype))


def _gemm_operand(x, contract, free, dtype):
  """(free..., contract...) as 2-D ``dtype`` in GEMM layout, transposed (where needed) by
  :func:`qtrain.kernels.transpose.gemm_transpose` as on the XLA path."""
  perm = tuple(free) + tuple(contract)
  if perm != tuple(range(x.ndim)):
    x = _transpose.gemm_transpose(x, perm)
  return x.reshape(math.prod(x.shape[:len(free)]), -1).astype(dtype)
