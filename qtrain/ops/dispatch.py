"""Kernel-or-XLA dispatch for dots over quantized operands (the kernels' seam).

:func:`quantized_dot_general` takes the same operands as
:func:`qtrain.core.qdot.dot_general_quantized_xla` (each a ``QArray`` or a float
array) and either runs that XLA reference or one of qtrain's Pallas kernels:

* rhs binary: :func:`~qtrain.kernels.binary_matmul.binary_matmul` with float
  lhs (W1A16), integer-like lhs (W1A8; int8 values) or binary lhs (W1A1).
* rhs int2/ternary/int4/int8 with per-channel or group-wise scales (and
  group zero points): :func:`~qtrain.kernels.nbit_matmul.nbit_matmul`, float
  lhs (WnA16) or integer-like lhs (WnA8); int8 x int8 per-channel goes to
  :func:`~qtrain.kernels.int8_matmul.int8_matmul`.
* rhs may also be a :class:`~qtrain.kernels.prepared.PreparedWeight` (weights
  already in kernel layout, stored (N, K); lhs contracts its last axis):
  this skips the per-call packing that an unpacked ``QArray`` needs.

Canonicalisation: the kernels take (M, K) x (N, K). lhs free axes become M,
rhs free axes N, contracting axes K (transposed and reshaped by XLA); batch
dimensions, fp8, asymmetric (zero-point) activations, activation scales that
vary along K and per-element contracting scales are not handled by a kernel.

``implementation``:
  "auto": XLA, except on a GPU backend where the config is handled by a
    kernel and :data:`AUTO_KERNEL` (measured, benchmarks/kernels.py) says
    the kernel is faster, and on a Hopper GPU (jax >= 0.11) where both
    operands are integer QArrays of <= 8 bits with per-row / per-column
    scales and M >= :data:`AUTO_GEMM_MIN_M`: the Mosaic int8 GEMM
    (:mod:`qtrain.kernels.mosaic_gemm`, scales fused; the training step's
    products), where its shapes tile. The XLA path's int8/fp8 operands are put in GEMM
    layout by :func:`qtrain.kernels.transpose.gemm_transpose` (on CUDA a
    Pallas copy XLA cannot turn into a slow layout, see that module).
  "xla": always the XLA reference, layouts left to XLA.
  "triton": the Pallas Triton kernel (GPU only); ValueError where unsupported.
  "mosaic": the Pallas Mosaic GPU kernels (Hopper, jax >= 0.11). M <= 128:
    :mod:`qtrain.kernels.mosaic_matmul`, bf16/f16 activations or symmetric
    integer QArray activations of <= 8 bits (int8 wgmma) x binary/int4/int8
    weights (int2 with integer activations only) with per-channel scales, as a QArray or a
    :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight`. Larger M: the int8
    GEMM :mod:`qtrain.kernels.mosaic_gemm` for integer QArrays of <= 8 bits on
    both sides (per-row / per-column scales). ValueError elsewhere.
    "auto" runs a MosaicWeight rhs here where it can (a CUDA lowering, jax >=
    0.11, a dot the kernel takes; else XLA on the stored codes), but does not
    choose Mosaic for QArray weights (that would repack them every call).
  "interpret": the Triton kernel in the Pallas interpreter (CPU tests).
Forcing a kernel on an unsupported config raises ValueError (never a silent
fallback, never silently wrong numbers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from qtrain.core import qarray, qdot, qtypes
from qtrain.kernels import _common
from qtrain.kernels import _qmatmul
from qtrain.kernels import binary_matmul as _binary
from qtrain.kernels import int8_matmul as _int8
from qtrain.kernels import mosaic_gemm as _gemm
from qtrain.kernels import mosaic_matmul as _mosaic
from qtrain.kernels import nbit_matmul as _nbit
from qtrain.kernels import transpose as _transpose
from qtrain.kernels.prepared import PreparedWeight, prepare_binary_activations, prepare_weight
from qtrain.ops import config as cfg_lib

IMPLEMENTATIONS = cfg_lib.IMPLEMENTATIONS

_KERNEL_QTYPES = ("binary", "ternary", "int2", "int4", "int8")

# "auto" uses a kernel only where it measured faster than the XLA path for the
# same operands (benchmarks/RESULTS.md, H200, jax 0.11.2, 2026-11-21).
# Key: (kernel, weights form, M bucket); weights form is "qarray" (an unpacked
# QArray that must be packed / transposed per call), "qarray-nk" (an int8
# QArray already stored (N, K) with N, K multiples of 128: used as is) or
# "prepacked" (a PreparedWeight; always a kernel: XLA cannot read it).
# Sub-byte kernels lose to XLA at every measured M once the per-call packing
# pass (which alone reads every int8 weight, as XLA's int8 dot does) is
# counted, and even without it their in-kernel decode is ALU-bound (see
# docs/performance-history.md, "Pallas kernels vs XLA"); only int8 x int8 on (N, K) weights wins, at M <= 16
# (62.1 vs 69.1 us at K=8192, N=28672; 7.1 vs 7.2 us at 4096^2).
# "auto" runs int8 x int8 products (integer QArrays of <= 8 bits on both sides)
# of at least this many rows (M) on the Mosaic GEMM (qtrain.kernels.mosaic_gemm;
# Hopper, jax >= 0.11). Measured against XLA's cuBLAS int8 GEMM + its separate
# int32 -> scaled float pass (docs/performance-history.md, "Mosaic int8 GEMM", H200):
# 1.09-1.44x at M = 512 (with (128, 128) CTA tiles where (128, 256) ones would
# leave most SMs idle), 1.08-1.31x from M = 1024; smaller M is not measured.
AUTO_GEMM_MIN_M = 512

AUTO_KERNEL: dict[tuple[str, str, int], bool] = {
    ("int8", "qarray-nk", 16): True,
    ("int8", "qarray-nk", 64): False,  # 67.9 vs 65.1 us
    ("int8", "qarray-nk", 512): False,  # 253.7 vs 221.3 us
    ("int8", "qarray-nk", 4096): False,  # 1791.6 vs 1607.2 us
}


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A canonicalised call: lhs (M, K), a prepared rhs, and output reshaping."""

  kernel: str  # "binary", "nbit" or "int8"
  lhs: Any  # (M, K) float / int8 array, or int32 binary words
  lhs_scale: Any  # (M,) float32 or None
  rhs: PreparedWeight
  out_shape: tuple[int, ...]
  weights_form: str  # "prepacked", "qarray-nk" or "qarray" (see AUTO_KERNEL)


class _Unsupported(Exception):
  pass


def _is_qarray(x) -> bool:
  return isinstance(x, qarray.QArray)


def _canonical_operand(x, contract, free):
  """Transposes ``x`` to (free..., contract...) and flattens to 2-D."""
  perm = tuple(free) + tuple(contract)
  if perm != tuple(range(x.ndim)):
    x = jnp.transpose(x, perm)
  m = math.prod(x.shape[:len(free)])
  return x.reshape(m, -1)


def _row_scale(s, contract, free, shape, what: str = "activation"):
  """A scale that varies only along free axes, as (prod(free),); else _Unsupported."""
  if any(s.shape[a] != 1 for a in contract):
    raise _Unsupported(f"the {what} scale varies along a contracting axis")
  full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free)
  s = jnp.transpose(s, tuple(free) + tuple(contract)).reshape(full)
  return jnp.broadcast_to(s, tuple(shape[a] for a in free)).reshape(-1)


def _weight_scale(s, contract, free, shape):
  """rhs scale -> ("channel", (N,)) or ("group", (N, G), group_size)."""
  n_shape = tuple(shape[a] for a in free)
  tiled = [a for a in contract if s.shape[a] != 1]
  if not tiled:
    full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free)
    s = jnp.transpose(s, tuple(free) + tuple(contract)).reshape(full)
    return "channel", jnp.broadcast_to(s, n_shape).reshape(-1), None
  if len(contract) != 1:
    raise _Unsupported("group-wise weight scales need a single contracting axis")
  (c,) = contract
  groups, k = s.shape[c], shape[c]
  if groups == k or k % groups:
    raise _Unsupported(f"weight scale with {groups} entries along K={k} is not group-wise")
  full = tuple(shape[a] if s.shape[a] != 1 else 1 for a in free) + (groups,)
  s = jnp.transpose(s, tuple(free) + (c,)).reshape(full)
  s = jnp.broadcast_to(s, n_shape + (groups,)).reshape(-1, groups)
  return "group", s, k // groups


def _axes(lhs, rhs, dimension_numbers):
  """(lc, rc, lfree, rfree) of a batch-free dot with contracting axes, else _Unsupported."""

  (lc, rc), (lb, rb) = qdot.normalize_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
  if lb or rb:
    raise _Unsupported("batch dimensions")
  if not lc:
    raise _Unsupported("no contracting dimensions")
  return lc, rc, qdot.free_axes(lhs.ndim, lc, lb), qdot.free_axes(rhs.ndim, rc, rb)


def _check_last_axis_dims(lhs, dimension_numbers, what: str) -> None:
  """A prepared rhs (N, K) must contract lhs's last axis with its axis 1, no batch axes."""
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lb) or tuple(rb) or tuple(rc) != (1,) or tuple(a % lhs.ndim for a in lc) != (lhs.ndim - 1,):
    raise ValueError(
        f"with a {what} rhs, dimension_numbers must contract lhs's last axis with "
        f"rhs axis 1 and have no batch axes; got {dimension_numbers}")


def _plan(lhs, rhs, dimension_numbers) -> _Plan:
  """Canonicalises a call for a kernel, or raises _Unsupported(reason)."""
  lq, rq = _is_qarray(lhs), _is_qarray(rhs)
  if isinstance(rhs, PreparedWeight):
    return _plan_prepared(lhs, rhs, dimension_numbers)
  if not rq:
    raise _Unsupported("the rhs is not quantized (kernels take quantized weights as rhs)")
  lc, rc, lfree, rfree = _axes(lhs, rhs, dimension_numbers)
  if rhs.qtype.name not in _KERNEL_QTYPES:
    raise _Unsupported(f"rhs qtype {rhs.qtype.name} (kernels: {_KERNEL_QTYPES})")
  out_shape = tuple(lhs.shape[a] for a in lfree) + tuple(rhs.shape[a] for a in rfree)
  # lhs.
  if lq:
    if not lhs.qtype.is_integer_like:
      raise _Unsupported(f"lhs qtype {lhs.qtype.name}")
    if lhs.zero_point is not None:
      raise _Unsupported("asymmetric (zero-point) activations")
    x = _canonical_operand(lhs.qvalue, lc, lfree).astype(jnp.int8)
    x_scale = _row_scale(lhs.scale.astype(jnp.float32), lc, lfree, lhs.shape)
  else:
    if lhs.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
      raise _Unsupported(f"float lhs of dtype {lhs.dtype}")
    x, x_scale = _canonical_operand(lhs, lc, lfree), None
  if x.shape[0] == 0 or x.shape[1] == 0:
    raise _Unsupported("empty operand")
  # rhs.
  kind, s, group = _weight_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape)
  zero = None
  if rhs.zero_point is not None:
    if kind != "group":
      raise _Unsupported("weight zero points need group-wise scales")
    _, zero, _ = _weight_scale(rhs.zero_point.astype(jnp.float32), rc, rfree, rhs.shape)
  wq = _canonical_operand(rhs.qvalue, rc, rfree)
  as_is = (tuple(rfree) + tuple(rc) == tuple(range(rhs.ndim)) and rhs.qtype.name == "int8"
           and kind == "channel" and wq.shape[0] % 128 == 0 and wq.shape[1] % 128 == 0)
  try:
    # (K, N) words measured faster for 16-bit activations (benchmarks/explore.py).
    w = prepare_weight(wq, rhs.qtype, scale=s, zero_point=zero, group_size=group,
                       kn=not lq and rhs.qtype.bits < 8)
  except ValueError as e:
    raise _Unsupported(str(e)) from None
  return _finish_plan(lhs, lq, x, x_scale, w, out_shape, "qarray-nk" if as_is else "qarray")


def _plan_prepared(lhs, w: PreparedWeight, dimension_numbers) -> _Plan:
  _check_last_axis_dims(lhs, dimension_numbers, "PreparedWeight")
  lq = _is_qarray(lhs)
  if lq:
    if lhs.zero_point is not None or not lhs.qtype.is_integer_like:
      raise ValueError("PreparedWeight rhs takes float or symmetric integer-like QArray lhs")
    x = lhs.qvalue.reshape(-1, lhs.shape[-1]).astype(jnp.int8)
    x_scale = _row_scale(lhs.scale.astype(jnp.float32), (lhs.ndim - 1,), tuple(range(lhs.ndim - 1)),
                         lhs.shape)
  else:
    x, x_scale = lhs.reshape(-1, lhs.shape[-1]), None
  return _finish_plan(lhs, lq, x, x_scale, w, tuple(lhs.shape[:-1]) + (w.n,), "prepacked")


def _finish_plan(lhs, lq, x, x_scale, w, out_shape, form):
  if w.qtype == "binary":
    if lq and lhs.qtype.kind == "binary":
      x = prepare_binary_activations(x, plane_words=w.plane_k)
    return _Plan("binary", x, x_scale, w, out_shape, form)
  if lq and w.qtype == "int8" and w.group_size is None:
    return _Plan("int8", x, x_scale, w, out_shape, form)
  return _Plan("nbit", x, x_scale, w, out_shape, "qarray" if form == "qarray-nk" else form)


def _mosaic_lhs(lhs, contract, free):
  """(x (M, K), x_scale (M,) or None) for the Mosaic kernel: bf16/f16, or the
  int8 codes and row scales of a symmetric integer QArray; else _Unsupported."""
  if _is_qarray(lhs):
    if not lhs.qtype.is_integer_like or lhs.qtype.bits > 8:
      raise _Unsupported(f"{lhs.qtype.name} activations (the Mosaic kernel takes bf16/f16 "
                         f"activations or integer ones of at most 8 bits)")
    if lhs.zero_point is not None:
      raise _Unsupported("asymmetric (zero-point) activations")
    x = _canonical_operand(lhs.qvalue, contract, free).astype(jnp.int8)
    return x, _row_scale(lhs.scale.astype(jnp.float32), contract, free, lhs.shape)
  if lhs.dtype not in (jnp.bfloat16, jnp.float16):
    raise _Unsupported(f"activations of dtype {lhs.dtype} (the Mosaic kernel takes bf16/f16, "
                       f"or int8 QArrays)")
  return _canonical_operand(lhs, contract, free), None


def _plan_mosaic(lhs, rhs, dimension_numbers):
  """(x, x_scale, MosaicWeight, out_shape) for the Mosaic kernel, or _Unsupported(reason)."""
  if isinstance(rhs, _mosaic.MosaicWeight):
    _check_last_axis_dims(lhs, dimension_numbers, "MosaicWeight")
    nd = lhs.ndim
    x, x_scale = _mosaic_lhs(lhs, (nd - 1,), tuple(range(nd - 1)))
    return x, x_scale, rhs, tuple(lhs.shape[:-1]) + (rhs.n,)
  if not _is_qarray(rhs):
    raise _Unsupported("the rhs is not quantized (kernels take quantized weights as rhs)")
  if rhs.qtype.name not in _mosaic.QTYPES:
    raise _Unsupported(f"rhs qtype {rhs.qtype.name} (the Mosaic kernel takes {_mosaic.QTYPES})")
  if rhs.zero_point is not None:
    raise _Unsupported("weight zero points")
  lc, rc, lfree, rfree = _axes(lhs, rhs, dimension_numbers)
  kind, s, _ = _weight_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape)
  if kind != "channel":
    raise _Unsupported("group-wise weight scales (the Mosaic kernel takes per-channel scales)")
  x, x_scale = _mosaic_lhs(lhs, lc, lfree)
  if rhs.qtype.name == "int2" and x.dtype != jnp.int8:
    raise _Unsupported(f"int2 weights with {x.dtype} activations (the Mosaic kernel runs int2 "
                       f"weights with integer activations only)")
  if not 1 <= x.shape[0] <= _mosaic.MAX_M or x.shape[1] == 0:
    raise _Unsupported(f"M={x.shape[0]} (the small-M Mosaic kernel serves M in 1..{_mosaic.MAX_M}; "
                       f"larger M runs on the Mosaic GEMM, which takes integer QArrays on both sides)")
  w = _mosaic.prepare_mosaic_weight(_canonical_operand(rhs.qvalue, rc, rfree), rhs.qtype.name,
                                    scale=s, order="int8" if x.dtype == jnp.int8 else "float",
                                    tiles=None)  # repacked per call: no extra transpose
  out_shape = tuple(lhs.shape[a] for a in lfree) + tuple(rhs.shape[a] for a in rfree)
  return x, x_scale, w, out_shape


@dataclasses.dataclass(frozen=True)
class _GemmPlan:
  """A canonicalised int8 x int8 call for the Mosaic GEMM: a (M, K), b (N, K)."""

  a: Any
  a_scale: Any  # (M,) float32
  b: Any
  b_scale: Any  # (N,) float32
  out_shape: tuple[int, ...]


def _plan_gemm(lhs, rhs, dimension_numbers, out_dtype, min_m: int = 1) -> _GemmPlan:
  """Both operands symmetric integer QArrays of <= 8 bits with per-row / per-column
  scales, no batch axes, a float output, at least ``min_m`` rows: the Mosaic GEMM's
  call; else _Unsupported (raised before any operand is transposed)."""
  for what, q in (("lhs", lhs), ("rhs", rhs)):
    if not _is_qarray(q):
      raise _Unsupported(f"the {what} is not a QArray (the Mosaic GEMM takes int8 x int8)")
    if not q.qtype.is_integer_like or q.qtype.bits > 8:
      raise _Unsupported(f"{what} qtype {q.qtype.name} (the Mosaic GEMM takes integers of <= 8 bits)")
    if q.zero_point is not None:
      raise _Unsupported(f"asymmetric (zero-point) {what}")
  if jnp.dtype(out_dtype) not in _gemm.OUT_DTYPES:
    raise _Unsupported(f"output dtype {jnp.dtype(out_dtype)} (the Mosaic GEMM writes "
                       f"{[str(d) for d in _gemm.OUT_DTYPES]})")
  lc, rc, lfree, rfree = _axes(lhs, rhs, dimension_numbers)
  m = math.prod(lhs.shape[i] for i in lfree)
  if m < min_m:
    raise _Unsupported(f"M={m} (below {min_m} rows)")
  a = _gemm_operand(lhs.qvalue, lc, lfree)
  b = _gemm_operand(rhs.qvalue, rc, rfree)
  if 0 in a.shape or b.shape[0] == 0:
    raise _Unsupported("empty operand")
  sa = _row_scale(lhs.scale.astype(jnp.float32), lc, lfree, lhs.shape, "lhs")
  sb = _row_scale(rhs.scale.astype(jnp.float32), rc, rfree, rhs.shape, "rhs")
  out_shape = tuple(lhs.shape[i] for i in lfree) + tuple(rhs.shape[i] for i in rfree)
  return _GemmPlan(a, sa, b, sb, out_shape)


def _gemm_operand(x, contract, free):
  """(free..., contract...) as 2-D int8 in GEMM layout, transposed (where needed) by
  :func:`qtrain.kernels.transpose.gemm_transpose` as on the XLA path."""
  perm = tuple(free) + tuple(contract)
  if perm != tuple(range(x.ndim)):
    x = _transpose.gemm_transpose(x, perm)
  return x.reshape(math.prod(x.shape[:len(free)]), -1).astype(jnp.int8)


def _run_gemm(plan: _GemmPlan, out_dtype, cfg) -> jax.Array:
  out = _gemm._gemm(plan.a, plan.b, plan.a_scale, plan.b_scale, out_dtype, cfg)
  return out.reshape(plan.out_shape)


def _auto_gemm(lhs, rhs, dimension_numbers, out_dtype) -> tuple[_GemmPlan, Any] | None:
  """(plan, config) where "auto" runs the Mosaic GEMM: jax >= 0.11 with a Hopper
  GPU, an int8 x int8 call it takes, and M >= :data:`AUTO_GEMM_MIN_M`."""
  if jax.__version_info__ < (0, 11) or not _common.on_hopper():
    return None
  try:
    plan = _plan_gemm(lhs, rhs, dimension_numbers, out_dtype, min_m=AUTO_GEMM_MIN_M)
    return plan, _gemm.checked_config(plan.a, plan.b, None, out_dtype)
  except (_Unsupported, _mosaic.UnsupportedCall):
    return None


def _run_mosaic(lhs, rhs, dimension_numbers, out_dtype) -> jax.Array:
  # What the kernel cannot take is reported first; mosaic_matmul then refuses a
  # non-GPU backend (and jax < 0.11) by name.
  if not isinstance(rhs, _mosaic.MosaicWeight):
    try:  # large M: the GEMM
      gemm = _plan_gemm(lhs, rhs, dimension_numbers, out_dtype, min_m=_mosaic.MAX_M + 1)
    except _Unsupported:
      gemm = None
    if gemm is not None:
      return _gemm.mosaic_gemm(gemm.a, gemm.b, a_scale=gemm.a_scale, b_scale=gemm.b_scale,
                               out_dtype=out_dtype).reshape(gemm.out_shape)
  try:
    x, x_scale, w, out_shape = _plan_mosaic(lhs, rhs, dimension_numbers)
  except _Unsupported as e:
    raise ValueError(f"implementation='mosaic': the Mosaic kernel does not handle this dot ({e}); "
                     f"use implementation='triton', 'xla' or 'auto'") from None
  return _mosaic.mosaic_matmul(x, w, x_scale=x_scale, out_dtype=out_dtype).reshape(out_shape)


def _mosaic_weight_qarray(w):
  """The QArray a MosaicWeight was prepared from ((N, K) codes, (N, 1) scale)."""
  scale = jnp.ones((w.n, 1), jnp.float32) if w.w_scale is None else w.w_scale[:, None]
  return qarray.QArray(qvalue=_mosaic.mosaic_weight_values(w), scale=scale, zero_point=None,
                       qtype=qtypes.get_qtype(w.qtype))


def _auto_mosaic(lhs, w, dimension_numbers, out_dtype) -> jax.Array:
  """"auto" with a MosaicWeight: the Mosaic kernel where it runs (a CUDA
  lowering, jax >= 0.11, a dot it takes; not on a GPU older than Hopper),
  elsewhere XLA on the stored codes."""
  _check_last_axis_dims(lhs, dimension_numbers, "MosaicWeight")
  xla = lambda: qdot.dot_general_quantized_xla(lhs, _mosaic_weight_qarray(w), dimension_numbers,
                                               preferred_element_type=out_dtype)
  if jax.__version_info__ < (0, 11) or (_common.on_gpu() and not _common.on_hopper()):
    return xla()
  try:
    x, x_scale, w, out_shape = _plan_mosaic(lhs, w, dimension_numbers)
    cfg = _mosaic.checked_config(x, w)
  except (_Unsupported, _mosaic.UnsupportedCall):  # what the kernel cannot take runs on XLA
    return xla()
  kernel = lambda: _mosaic._matmul(x, w, x_scale, out_dtype, cfg).reshape(out_shape)
  return jax.lax.platform_dependent(cuda=kernel, default=xla)


def _run(plan: _Plan, out_dtype, interpret: bool) -> jax.Array:
  kw = dict(x_scale=plan.lhs_scale, out_dtype=out_dtype, interpret=interpret)
  if plan.kernel == "binary":
    out = _binary.binary_matmul(plan.lhs, plan.rhs, **kw)
  elif plan.kernel == "int8":
    out = _int8.int8_matmul(plan.lhs, plan.rhs, **kw)
  else:
    out = _nbit.nbit_matmul(plan.lhs, plan.rhs, **kw)
  return out.reshape(plan.out_shape)


def supports(lhs, rhs, dimension_numbers) -> tuple[bool, str]:
  """Whether a kernel handles this call, and if not, why."""
  try:
    _plan(lhs, rhs, dimension_numbers)
  except _Unsupported as e:
    return False, str(e)
  return True, ""


def _auto_wants_kernel(plan: _Plan) -> bool:
  return AUTO_KERNEL.get((plan.kernel, plan.weights_form, _qmatmul.m_bucket(plan.lhs.shape[0])),
                         False)


def _empty_product(lhs, rhs, dimension_numbers, out_dtype) -> jax.Array | None:
  """Zeros of ``lax.dot_general``'s output shape where an operand has no
  elements (M, N or K = 0; with K = 0 the (M, N) output is all zeros), else None."""
  if isinstance(rhs, (PreparedWeight, _mosaic.MosaicWeight)):
    if math.prod(lhs.shape) != 0:
      return None
    _check_last_axis_dims(lhs, dimension_numbers, type(rhs).__name__)
    return jnp.zeros(tuple(lhs.shape[:-1]) + (rhs.n,), out_dtype)
  if math.prod(lhs.shape) != 0 and math.prod(rhs.shape) != 0:
    return None
  dn = qdot.normalize_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim,
                                        lhs_shape=lhs.shape, rhs_shape=rhs.shape)
  return jnp.zeros(qdot.output_shape(lhs.shape, rhs.shape, dn), out_dtype)


def _as_compute_dtype(x, compute_dtype):
  """A float (not quantized, not prepared) operand cast to ``compute_dtype``."""
  if compute_dtype is None or _is_qarray(x) or isinstance(x, (PreparedWeight, _mosaic.MosaicWeight)):
    return x
  return x if x.dtype == compute_dtype else x.astype(compute_dtype)


def quantized_dot_general(lhs, rhs, dimension_numbers, *, preferred_element_type,
                          implementation: str = "auto", compute_dtype=None) -> jax.Array:
  """``dot_general`` over QArray/float operands, by a Pallas kernel or by XLA.

  Args:
    lhs: a ``QArray`` or a float array (activations).
    rhs: a ``QArray`` or a float array (weights), a
      :class:`~qtrain.kernels.prepared.PreparedWeight`, or (with "mosaic" or
      "auto") a :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight`.
    dimension_numbers: as for :func:`jax.lax.dot_general`.
    preferred_element_type: the float output dtype (None: float32).
    implementation: one of :data:`IMPLEMENTATIONS`.
    compute_dtype: the float dtype of a product with a float operand (see
      :func:`qtrain.core.qdot.dot_general_quantized_xla`): float operands are
      cast to it before a kernel or XLA sees them. None: as they are.

  Returns:
    The product, shaped like ``jax.lax.dot_general``'s output. An operand with
    no elements gives zeros of that shape for every implementation, forced
    kernels included: there is nothing to compute, so no kernel is planned or
    run and no other path stands in for one.

  Raises:
    ValueError: for an unknown ``implementation``, or a forced kernel
      ("triton"/"mosaic"/"interpret") on a config no kernel handles (the
      message says why), or "triton"/"mosaic" off a GPU; not for an empty
      product (see Returns), except for a weight form the implementation
      never takes (a MosaicWeight off "mosaic"/"auto", a PreparedWeight on "xla").
  """
  cfg_lib.check_implementation(implementation)
  out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None else jnp.float32)
  # Weight forms an implementation cannot take are refused whatever the shapes.
  if isinstance(rhs, _mosaic.MosaicWeight) and implementation not in ("mosaic", "auto"):
    raise ValueError(f"a MosaicWeight rhs runs with implementation='mosaic' or 'auto'; got "
                     f"{implementation=}")
  prepared_rhs = isinstance(rhs, PreparedWeight)
  if prepared_rhs and implementation == "xla":
    raise ValueError("implementation='xla' cannot take a PreparedWeight rhs; pass a QArray")
  empty = _empty_product(lhs, rhs, dimension_numbers, out_dtype)
  if empty is not None:
    return empty
  if compute_dtype is not None:
    compute_dtype = jnp.dtype(compute_dtype)
    lhs, rhs = _as_compute_dtype(lhs, compute_dtype), _as_compute_dtype(rhs, compute_dtype)
  if implementation == "mosaic":
    return _run_mosaic(lhs, rhs, dimension_numbers, out_dtype)
  if isinstance(rhs, _mosaic.MosaicWeight):
    return _auto_mosaic(lhs, rhs, dimension_numbers, out_dtype)

  def xla():
    # "auto" hands XLA its int8/fp8 GEMMs in GEMM layout, pinned on a GPU by
    # a Pallas transpose (see qtrain.kernels.transpose); "xla" leaves the
    # operands as they are, layouts to XLA.
    transpose = None if implementation == "xla" else _transpose.gemm_transpose
    return qdot.dot_general_quantized_xla(lhs, rhs, dimension_numbers,
                                          preferred_element_type=out_dtype, transpose=transpose,
                                          compute_dtype=compute_dtype)

  if implementation == "xla":
    return xla()
  if implementation == "auto" and not prepared_rhs:
    gemm = _auto_gemm(lhs, rhs, dimension_numbers, out_dtype)
    if gemm is not None:
      plan, cfg = gemm
      return jax.lax.platform_dependent(cuda=lambda: _run_gemm(plan, out_dtype, cfg), default=xla)
  try:
    plan = _plan(lhs, rhs, dimension_numbers)
  except _Unsupported as e:
    if implementation == "auto" and not prepared_rhs:
      return xla()
    raise ValueError(f"implementation={implementation!r}: no qtrain kernel handles this dot "
                     f"({e}); use implementation='xla' or 'auto'") from None
  if implementation == "auto":
    # Chosen per lowering platform (not the process's default backend), so the
    # same code also runs on a CPU device of a GPU process.
    gpu_kernel = lambda: _run(plan, out_dtype, interpret=False)
    if prepared_rhs:
      return jax.lax.platform_dependent(cuda=gpu_kernel,
                                        default=lambda: _run(plan, out_dtype, interpret=True))
    if not _auto_wants_kernel(plan):
      return xla()
    return jax.lax.platform_dependent(cuda=gpu_kernel, default=xla)
  if implementation == "triton" and not _common.on_gpu():
    raise ValueError(f"implementation='triton' needs a GPU backend; this one is "
                     f"{jax.default_backend()!r} (use 'interpret' on CPU)")
  return _run(plan, out_dtype, interpret=implementation == "interpret")
