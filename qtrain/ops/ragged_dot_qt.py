"""``ragged_dot_qt``: a quantized-training ``jax.lax.ragged_dot`` as a ``jax.custom_vjp``.

``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` is the grouped product of a
mixture-of-experts layer: ``lhs`` (M, K) holds the tokens sorted by expert,
``group_sizes`` (G,) how many rows each expert takes (in order; rows past their
sum give zeros), ``rhs`` (G, K, N) one weight per expert; row ``m`` of group
``i`` gives ``lhs[m] @ rhs[i]``.

Forward: ``lhs`` is quantized per row (``config.lhs``: the activations, one
scale per token, or per tensor with ``channelwise=False``), ``rhs`` per group
and output channel (``config.rhs``: the weights; per group with
``channelwise=False``); both take ``tile_size`` along K. The grouped product
runs on the codes (``ragged_dot`` of int8 x int8 -> int32, fp8 x fp8 ->
float32) and the scales are applied after: each row's own scale and its
group's output-channel scales (tiles: one product per tile, each tile's partial
sum scaled, then summed). Codes that are not numbers of one kind (nf4 / mxfp4
table values, integer x fp8, asymmetric codes minus their zero points) multiply
in float32 at HIGHEST, scales after (each product exact); one float side: the
quantized side dequantized into ``promote_types`` of the two dtypes.

Backward (``g`` is (M, N); rows past ``sum(group_sizes)`` are zeroed first):

* ``dlhs = ragged_dot(g, rhs^T)``: the weight's per-(group, channel) scale
  varies along N, this product's contraction, so it is multiplied into ``g``
  row by row (each row's group; a power of two per group keeps it in float32's
  range, as :func:`~qtrain.ops.dot_general_qt.backward_product` does), then
  ``g`` is quantized per row (``config.dlhs_grad``) and the product runs on
  int8 codes again.
* ``drhs[i] = lhs[rows of i]^T g[rows of i]``: a ragged contraction over the
  tokens (``ragged_dot_general`` with ``lhs``'s ragged axis contracted). The
  activation's per-row scale is folded into ``g`` the same way, and ``g`` is
  quantized per output column over all tokens (``config.drhs_grad``), so each
  group's sum is int8 x int8 -> int32 with its scales after.

Both take the config's stochastic rounding with a key split from ``key`` as
dot_general_qt does. Where a residual's scale varies along both axes of the
product (tiles along K), that product runs in float32 on the dequantized
values (the same numbers, no speed). The estimators' masks and learned scales'
gradients are dot_general_qt's.

Where it runs: on XLA only (``implementation`` ``"auto"`` or ``"xla"``).
On the CPU ``ragged_dot`` lowers to one dense masked product per group (G
times the work of the rows; fine for tests); on a GPU jax lowers it to XLA's
ragged-dot instruction (or, with ``jax_ragged_dot_use_gpu_pallas_triton_lowering``,
to jax's Pallas kernel). Whether that instruction takes int8 x int8 -> int32 on
a GPU has not been measured here; the numbers do not depend on it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import qtrain.ops as qops
  >>> cfg = qops.DotGeneralQtConfig(
  ...     lhs=qops.OperandQuant(qtype="int8"), rhs=qops.OperandQuant(qtype="int8"),
  ...     dlhs_grad=qops.GradQuant(qtype="int8"), drhs_grad=qops.GradQuant(qtype="int8"))
  >>> x = jax.random.normal(jax.random.key(0), (8, 32))
  >>> w = jax.random.normal(jax.random.key(1), (3, 32, 4))
  >>> sizes = jnp.array([3, 0, 5], jnp.int32)
  >>> y = qops.ragged_dot_qt(x, w, sizes, cfg)
  >>> gx, gw = jax.grad(lambda x, w: qops.ragged_dot_qt(x, w, sizes, cfg).sum(), (0, 1))(x, w)
  >>> y.shape, gx.shape, gw.shape
  ((8, 4), (8, 32), (3, 32, 4))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import _lax
from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.ops import config as cfg_lib
from qtrain.ops.dot_general_qt import _fold_exponent, _pow2
from qtrain.ops.qt_operand import (OperandResidual, as_key, check_given_scale, check_operands,
                                   compute_dtype, finish_operand_grad, operand_axes,
                                   quantize_grad, quantize_operand, split_key,
                                   traced_once, typed_like_operands)

# Where a ragged product can run (a subset of config.IMPLEMENTATIONS).
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla")

RaggedDims = jax.lax.RaggedDotDimensionNumbers

# lhs (M, K) x rhs (G, K, N) -> (M, N): ragged_dot's own form.
_FWD = RaggedDims(dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0],
                  rhs_group_dimensions=[0])
# The same, one product per tile: lhs (T, M, t) x rhs (T, G, t, N) -> (T, M, N).
_FWD_TILED = RaggedDims(dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                        lhs_ragged_dimensions=[1], rhs_group_dimensions=[1])
# g (M, N) x rhs (G, K, N) -> (M, K): dlhs.
_DLHS = RaggedDims(dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
                   rhs_group_dimensions=[0])
# lhs (M, K) x g (M, N), the ragged M contracted -> (G, K, N): drhs.
_DRHS = RaggedDims(dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
                   rhs_group_dimensions=[])


def ragged_dimension_numbers(dims, lhs_ndim: int, rhs_ndim: int) -> tuple[int, int] | None:
  """``(rhs group axis, rhs contracting axis)`` when ``ragged_dot_general``'s ``dims`` mean
  what ``ragged_dot`` does: a 2-D ``lhs`` ragged along its rows (axis 0) and contracting its
  axis 1, a 3-D ``rhs`` with one group axis and one contracting axis (the third is the
  output's), no batch axes. None for the other forms (a ragged contraction, ragged batch
  axes), which have another meaning."""
  try:
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    ragged = tuple(int(a) for a in dims.lhs_ragged_dimensions)
    group = tuple(int(a) for a in dims.rhs_group_dimensions)
    lc, rc = tuple(int(a) % max(lhs_ndim, 1) for a in lc), tuple(int(a) % max(rhs_ndim, 1)
                                                                 for a in rc)
  except (AttributeError, TypeError, ValueError):
    return None
  if (lhs_ndim, rhs_ndim) != (2, 3) or tuple(lb) or tuple(rb):
    return None
  if ragged != (0,) or lc != (1,) or len(group) != 1 or len(rc) != 1:
    return None
  g, c = group[0] % 3, rc[0]
  if g == c:
    return None
  return g, c


# ----------------------------------------------------------------------------
# Products.


def _on_cpu_f32(fn, a, b):
  """``fn(a, b)``, with bf16 operands cast to float32 on a CPU lowering (XLA's CPU runtime
  rejects some bf16 x bf16 -> float32 dot layouts; bf16 products are exact in float32), as
  :func:`qtrain.core.qdot.float_dot_general` does. Other platforms keep the bf16 product."""
  if a.dtype == b.dtype == jnp.bfloat16:
    return jax.lax.platform_dependent(
        a, b, cpu=lambda x, y: fn(x.astype(jnp.float32), y.astype(jnp.float32)), default=fn)
  return fn(a, b)


def _ragged(a, b, group_sizes, dims, *, precision=None, out=jnp.float32):
  """The grouped product of two arrays: int8 x int8 -> int32, fp8 x fp8 -> float32 (codes);
  any other pair in float with float32 accumulation (``out``)."""
  fn = lambda x, y: _lax.ragged_dot_general(x, y, group_sizes, dims, precision=precision,
                                            preferred_element_type=out)
  return _on_cpu_f32(fn, a, b)


def _codes(q: qa.QArray) -> jax.Array:
  """What a quantized operand multiplies with before its scale: int8 or fp8 codes; for a table
  qtype (nf4, mxfp4) or asymmetric codes, their values (minus the zero point) in float32."""
  if q.qtype.is_lut or q.zero_point is not None:
    v = qa.values_of(q)
    if q.zero_point is not None:
      v = v - qa.expand_scale(q.zero_point, q.shape)
    return v
  return q.qvalue


def _code_product(a, b, group_sizes, dims) -> jax.Array:
  """The exact product of two code arrays (:func:`_codes`): int8 x int8 -> int32, fp8 x fp8
  -> float32; mixed or float32 codes in float32 at HIGHEST (each product exact)."""
  int8 = jnp.dtype(jnp.int8)
  if a.dtype == b.dtype == int8:
    return _ragged(*_lax.optimization_barrier((a, b)), group_sizes, dims, out=jnp.int32)
  fp8 = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 8
  if fp8(a) and fp8(b):
    return _ragged(*_lax.optimization_barrier((a, b)), group_sizes, dims, out=jnp.float32)
  return _ragged(a.astype(jnp.float32), b.astype(jnp.float32), group_sizes, dims,
                 precision=jax.lax.Precision.HIGHEST, out=jnp.float32)


def group_ids(group_sizes, m: int) -> jax.Array:
  """The group of each of ``m`` rows (int32; ``G`` for rows past ``sum(group_sizes)``)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.sum(jnp.arange(m, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1,
                 dtype=jnp.int32)


def _rows(per_group: jax.Array, gid: jax.Array) -> jax.Array:
  """``per_group[gid]`` (a group's values for each row); rows past the groups read the last
  group's (their products are 0). A per-tensor value (leading size 1) is broadcast."""
  if per_group.shape[0] == 1:
    return jnp.broadcast_to(per_group, (gid.shape[0],) + per_group.shape[1:])
  return per_group[jnp.minimum(gid, per_group.shape[0] - 1)]


def _float_product(a, b, group_sizes, dims, dtype, precision, out_dtype):
  """A product with a float side: QArrays dequantized into ``dtype``, float sides cast to it,
  float32 accumulation (HIGHEST where ``dtype`` is float32 and nothing says otherwise)."""
  a = a.dequantize(dtype) if qdot.is_quantized(a) else a.astype(dtype)
  b = b.dequantize(dtype) if qdot.is_quantized(b) else b.astype(dtype)
  if precision is None and jnp.dtype(dtype) == jnp.float32:
    precision = jax.lax.Precision.HIGHEST
  return _ragged(a, b, group_sizes, dims, precision=precision).astype(out_dtype)


def forward_product(lq, rq, group_sizes, *, out_dtype, compute_dtype_=jnp.float32,
                    precision=None) -> jax.Array:
  """``ragged_dot`` of a quantized (or float) ``lq`` (M, K) and ``rq`` (G, K, N).

  Two QArrays: the codes' product, scales after (per tile when tiled; both dequantized
  into float32 where the two tilings differ). One float side: :func:`_float_product`.
  """
  if not (qdot.is_quantized(lq) and qdot.is_quantized(rq)):
    return _float_product(lq, rq, group_sizes, _FWD, compute_dtype_, precision, out_dtype)
  m, k = lq.shape
  ls, rs = lq.scale, rq.scale            # (M|1, T_l), (G|1, T_r, N|1)
  tl, tr = ls.shape[1], rs.shape[1]
  if tl != 1 and tr != 1 and tl != tr:
    return _float_product(lq, rq, group_sizes, _FWD, jnp.float32, precision, out_dtype)
  t = max(tl, tr)
  a, b = _codes(lq), _codes(rq)
  gid = group_ids(group_sizes, m)
  rs_rows = _rows(rs, gid)               # (M, T_r, N|1)
  if t == 1:
    acc = _code_product(a, b, group_sizes, _FWD)
    return qdot.scale_product(acc, ls[:, 0:1], rs_rows[:, 0, :], grouped=False,
                              out_dtype=out_dtype)
  a = jnp.transpose(a.reshape(m, t, k // t), (1, 0, 2))
  b = jnp.transpose(b.reshape(b.shape[0], t, k // t, b.shape[2]), (1, 0, 2, 3))
  acc = _code_product(a, b, group_sizes, _FWD_TILED)            # (T, M, N)
  ls_o = jnp.broadcast_to(jnp.transpose(ls)[:, :, None], (t, ls.shape[0], 1))
  rs_o = jnp.broadcast_to(jnp.transpose(rs_rows, (1, 0, 2)), (t,) + rs_rows.shape[::2])
  return qdot.scale_product(acc, ls_o, rs_o, grouped=True, out_dtype=out_dtype)


def _fold(g, scale_rows, per, axis_names):
  """``g * scale_rows`` (``scale_rows``: (M, N|1), the residual's scale for each row), with the
  scale divided by a power of two ``2**e`` per group of rows first, so that the product stays
  within float32 wherever ``g`` does (see dot_general_qt's ``_fold_scale``).

  ``per``: ``(values (P, X), index (M,))``: the scale's values by group (P groups, the shift
  is one per group: its largest value is brought into [0.5, 1)) and each row's group.
  Returns ``(g', 2**e for each row (M, 1))``.
  """
  values, index = per
  e = _fold_exponent(values.astype(jnp.float32), tuple(range(1, values.ndim)), axis_names)
  e_rows = e.reshape(e.shape[0])[index]                                # (M,)
  half = e_rows >> 1   # two exact steps: no factor is subnormal (a GPU flushes those)
  factor = (_pow2(-half) * _pow2(half - e_rows))[:, None]
  g2 = g.astype(jnp.float32) * (scale_rows.astype(jnp.float32) * factor)
  return g2, _pow2(e_rows)[:, None]


def _dlhs(g, rres: OperandResidual, group_sizes, gid, gq, key, *, g_dtype, r_dtype):
  """``dlhs`` (M, K) in float32 (see the module docstring)."""
  rq = rres.value
  ctype = compute_dtype(g_dtype, r_dtype)
  if gq is None:
    return _float_product(g, rq, group_sizes, _DLHS, ctype, None, jnp.float32)
  if not qdot.is_quantized(rq) or rq.scale.shape[1] != 1:
    # A float weight, or tiles along K (this product's free axis) with channel scales along
    # N (its contraction): g quantized per row, the product in float.
    gqa = quantize_grad(g, gq, (0,), key)
    dtype = ctype if not qdot.is_quantized(rq) else jnp.float32
    return _float_product(gqa, rq, group_sizes, _DLHS, dtype, None, jnp.float32)
  rs = rq.scale[:, 0, :]                                               # (G|1, N|1)
  if rs.shape[1] != 1:   # a channel scale: along this product's contraction, into g
    n_groups = rs.shape[0]
    idx = jnp.minimum(gid, n_groups - 1) if n_groups > 1 else jnp.zeros_like(gid)
    g_in, r_rows = _fold(g, _rows(rs, gid), (rs, idx), gq.axis_names)
  else:                  # one scale per group: it factors out of each row's sum
    g_in, r_rows = g, _rows(rs, gid)
  gqa = quantize_grad(g_in, gq, (0,), key)
  acc = _code_product(_codes(gqa), _codes(rq), group_sizes, _DLHS)     # (M, K)
  return qdot.scale_product(acc, gqa.scale, r_rows, grouped=False, out_dtype=jnp.float32)


def _drhs(lhs_res: OperandResidual, g, group_sizes, gq, key, *, g_dtype, l_dtype):
  """``drhs`` (G, K, N) in float32 (see the module docstring)."""
  lq = lhs_res.value
  ctype = compute_dtype(g_dtype, l_dtype)
  if gq is None:
    return _float_product(lq, g, group_sizes, _DRHS, ctype, None, jnp.float32)
  if not qdot.is_quantized(lq) or lq.scale.shape[1] != 1:
    gqa = quantize_grad(g, gq, (1,), key)
    dtype = ctype if not qdot.is_quantized(lq) else jnp.float32
    return _float_product(lq, gqa, group_sizes, _DRHS, dtype, None, jnp.float32)
  ls = lq.scale                                                        # (M|1, 1)
  m = g.shape[0]
  if ls.shape[0] != 1:   # per-row scales vary along this product's contraction: into g
    g_in, l_rows = _fold(g, ls, (ls.reshape(1, m), jnp.zeros((m,), jnp.int32)), gq.axis_names)
    l_scale = l_rows[:1, :1]                                           # one power of two
  else:
    g_in, l_scale = g, ls
  gqa = quantize_grad(g_in, gq, (1,), key)
  acc = _code_product(_codes(lq), _codes(gqa), group_sizes, _DRHS)     # (G, K, N)
  return qdot.scale_product(acc, l_scale[None], gqa.scale[None], grouped=False,
                            out_dtype=jnp.float32)


# ----------------------------------------------------------------------------
# The op.


def _quantize(lhs, rhs, lhs_scale, rhs_scale, config):
  lres = quantize_operand(lhs, _channelwise(config.lhs), lhs_scale,
                          (0,) if config.lhs is not None and config.lhs.channelwise else (),
                          1, "lhs")
  # Weights: per group and output channel, or (channelwise=False) per group: each group is
  # its own weight matrix.
  rres = quantize_operand(rhs, _channelwise(config.rhs), rhs_scale,
                          (0, 2) if config.rhs is not None and config.rhs.channelwise else (0,),
                          1, "rhs")
  return lres, rres


def _channelwise(oq):
  """``oq`` with channelwise set: the channel axes are passed explicitly (per tensor is
  ``()``), so quantize_operand must use them."""
  return oq if oq is None or oq.channelwise else dataclasses.replace(oq, channelwise=True)


@traced_once(static_argnums=(5, 6, 7))
def _forward(lhs, rhs, group_sizes, lhs_scale, rhs_scale, config, precision, out_dtype):
  lres, rres = _quantize(lhs, rhs, lhs_scale, rhs_scale, config)
  if config.lhs is None and config.rhs is None:
    out = _lax.ragged_dot_general(lhs, rhs, group_sizes, _FWD, precision=precision,
                                  preferred_element_type=out_dtype)
  else:
    out = forward_product(lres.value, rres.value, group_sizes, out_dtype=out_dtype,
                          compute_dtype_=compute_dtype(lhs.dtype, rhs.dtype), precision=precision)
  return out, (lres, rres)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ragged_dot_qt(lhs, rhs, group_sizes, lhs_scale, rhs_scale, kd, config, precision, out_dtype,
                   shapes):
  return _forward(lhs, rhs, group_sizes, lhs_scale, rhs_scale, config, precision, out_dtype)[0]


def _fwd(lhs, rhs, group_sizes, lhs_scale, rhs_scale, kd, config, precision, out_dtype, shapes):
  out, (lres, rres) = _forward(lhs, rhs, group_sizes, lhs_scale, rhs_scale, config, precision,
                               out_dtype)
  return out, (lres, rres, group_sizes, kd)


@traced_once(static_argnums=(0, 1, 2, 3))
def _bwd(config, precision, out_dtype, shapes, res, g):
  lres, rres, group_sizes, kd = res
  lshape, rshape, ldtype, rdtype, varying = shapes
  m = lshape[0]
  gid = group_ids(group_sizes, m)
  g = jnp.where((gid < rshape[0])[:, None], g, jnp.zeros((), g.dtype))  # rows past the groups
  k_l, k_r = split_key(kd, (config.dlhs_grad, config.drhs_grad))
  lhs_bar = _dlhs(g, rres, group_sizes, gid, config.dlhs_grad, k_l, g_dtype=g.dtype,
                  r_dtype=rdtype)
  rhs_bar = _drhs(lres, g, group_sizes, config.drhs_grad, k_r, g_dtype=g.dtype, l_dtype=ldtype)
  lhs_bar, ls_bar = finish_operand_grad(lhs_bar, lres, config.lhs, ldtype)
  rhs_bar, rs_bar = finish_operand_grad(rhs_bar, rres, config.rhs, rdtype)
  lhs_bar, rhs_bar, ls_bar, rs_bar = typed_like_operands((lhs_bar, rhs_bar, ls_bar, rs_bar),
                                                         varying)
  return lhs_bar, rhs_bar, None, ls_bar, rs_bar, None


_ragged_dot_qt.defvjp(_fwd, _bwd)


def _check(lhs, rhs, group_sizes, config, group_offset):
  """Validates a call up front (every message names the bad value and what is valid); returns
  the config with its tiles in elements."""
  if not isinstance(config, cfg_lib.DotGeneralQtConfig):
    raise ValueError(f"config must be a DotGeneralQtConfig (lhs: the tokens, rhs: the expert "
                     f"weights), got {type(config).__name__}")
  if config.implementation not in IMPLEMENTATIONS:
    raise ValueError(f"config.implementation={config.implementation!r}: ragged_dot_qt runs on "
                     f"XLA only (no Pallas kernel takes grouped products); valid: "
                     f"{list(IMPLEMENTATIONS)}")
  if group_offset is not None:
    raise ValueError(f"group_offset={group_offset!r}: a ragged_dot over a shard of the groups "
                     "is not supported (neither does jax.lax.ragged_dot lower one on CPU or "
                     "GPU); valid: None")
  ls, rs = jnp.shape(lhs), jnp.shape(rhs)
  if len(ls) != 2 or len(rs) != 3:
    raise ValueError(f"lhs of shape {tuple(ls)} and rhs of shape {tuple(rs)}: ragged_dot_qt "
                     "takes lhs (M, K) and rhs (G, K, N), as jax.lax.ragged_dot does")
  if ls[1] != rs[1]:
    raise ValueError(f"lhs of shape {tuple(ls)} and rhs of shape {tuple(rs)} contract K: "
                     f"lhs's axis 1 ({ls[1]}) must equal rhs's axis 1 ({rs[1]})")
  gdt = jnp.result_type(group_sizes)
  if jnp.shape(group_sizes) != (rs[0],) or not jnp.issubdtype(gdt, jnp.integer):
    raise ValueError(f"group_sizes of shape {tuple(jnp.shape(group_sizes))} and dtype {gdt}: "
                     f"must be an integer array of shape ({rs[0]},), one size per group of rhs "
                     f"(shape {tuple(rs)})")
  for name in ("dlhs_grad", "drhs_grad"):
    gq = getattr(config, name)
    if gq is not None and gq.qtype.is_mx:
      raise ValueError(f"config.{name}.qtype={gq.qtype.name!r}: ragged_dot_qt quantizes the "
                       "gradient per row / per column, not in MX blocks; valid: int2..int8 or "
                       "fp8 (MX gradients: dot_general_qt, conv_general_qt)")
    if gq is not None and getattr(gq, "tile_size", None) is not None:
      raise ValueError(f"config.{name}.tile_size={gq.tile_size!r}: ragged_dot_qt quantizes the "
                       "gradient per row (dlhs) or per output column (drhs); valid: None")
  return dataclasses.replace(config, lhs=_tiled(config.lhs, "lhs", ls, rs),
                             rhs=_tiled(config.rhs, "rhs", ls, rs))


def _tiled(oq, name, ls, rs):
  """``oq`` with its ``tile_size`` in elements along K (an int, or a fraction of K as qwix
  reads a float tile); raises for one that does not divide K and for per-axis tiles."""
  if oq is None or oq.tile_size is None:
    return oq
  k, t = int(ls[1]), oq.tile_size
  where = f"(lhs {tuple(ls)}, rhs {tuple(rs)})"
  if isinstance(t, float):
    n = int(round(k * t))
  elif isinstance(t, (int, np.integer)) and not isinstance(t, bool):
    n = int(t)
  else:
    raise ValueError(f"config.{name}.tile_size={t!r}: ragged_dot_qt tiles only the contraction "
                     f"K={k} {where}; valid: an int dividing {k}, a fraction of it, or None")
  if n <= 0 or k % n:
    raise ValueError(f"config.{name}.tile_size={t!r} does not divide the contraction K={k} "
                     f"{where}; valid: a divisor of {k}, or None (per channel)")
  return oq if n == t else dataclasses.replace(oq, tile_size=n)


def ragged_dot_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    config: cfg_lib.DotGeneralQtConfig,
    *,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    key: jax.Array | None = None,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
) -> jax.Array:
  """Quantized-training ``jax.lax.ragged_dot``: ``lhs`` (M, K), ``rhs`` (G, K, N) -> (M, N).

  Args:
    lhs: the tokens, rows sorted by group (float).
    rhs: one weight per group (float).
    group_sizes: int (G,): the rows of each group, in order; rows past their sum give zeros
      (and zero gradients).
    config: a :class:`~qtrain.ops.config.DotGeneralQtConfig`: ``lhs`` the activations' (per
      row), ``rhs`` the weights' (per group and output channel; ``channelwise=False``: per
      group), ``dlhs_grad`` / ``drhs_grad`` the gradients' in the two backward products;
      ``implementation`` ``"auto"`` or ``"xla"``.
    precision: used by float products.
    preferred_element_type: the output dtype (default ``result_type(lhs, rhs)``); a float.
    group_offset: must be None (as jax's CPU and GPU lowerings of ragged_dot require).
    key: PRNG key for stochastic rounding (required when the config asks for it).
    lhs_scale, rhs_scale: scales to use instead of calibrating (static or learned; they get
      gradients per ``scale_grad``), as in :func:`~qtrain.ops.dot_general_qt.dot_general_qt`.

  Returns:
    ``ragged_dot(lhs, rhs, group_sizes)`` computed with quantized operands.

  Raises:
    ValueError: for shapes ragged_dot does not take, a bad ``group_sizes``, a
      ``tile_size`` that does not divide K, another ``implementation``, a
      ``group_offset``, non-float operands or output dtype, a missing key.
  """
  config = _check(lhs, rhs, group_sizes, config, group_offset)
  out_dtype = check_operands(lhs, rhs, preferred_element_type)
  if config.needs_key and key is None:
    raise ValueError("config asks for stochastic_rounding in dlhs_grad/drhs_grad: pass key=")
  check_given_scale(config.lhs, lhs_scale, "lhs")
  check_given_scale(config.rhs, rhs_scale, "rhs")
  m, _ = jnp.shape(lhs)
  if jnp.size(lhs) == 0 or jnp.size(rhs) == 0:   # M, K, N or G = 0: an empty sum is 0
    return jnp.zeros((m, jnp.shape(rhs)[2]), out_dtype)
  group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  shapes = (tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs)), jnp.result_type(lhs),
            jnp.result_type(rhs), operand_axes(lhs, rhs, lhs_scale, rhs_scale))
  return _ragged_dot_qt(lhs, rhs, group_sizes, lhs_scale, rhs_scale, as_key(key), config,
                        precision, out_dtype, shapes)
