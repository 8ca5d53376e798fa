"""Mosaic GPU (Hopper wgmma + TMA) small-M matmul: binary / int2 / int4 / int8 weights x bf16/f16/int8.

``out = (x @ w.T) * w_scale * x_scale`` for decode-sized M (<= :data:`MAX_M`),
with weights from :func:`prepare_mosaic_weight`. The kernel swaps the operands
so that the weights fill wgmma's 64-row M side and the few activation rows its
N side (``out.T = w @ x.T``):

* a warp-specialized pipeline (one producer warpgroup issuing TMA copies, two
  consumer warpgroups, ``config.steps`` stages in flight) streams a weight
  tile of ``2 * config.wg_rows`` rows and the matching activation tile per K
  step;
* each consumer warpgroup loads its ``wg_rows`` weight rows from shared memory with
  32-bit loads, decodes them in registers straight into wgmma's A-operand
  layout (the weights are stored pre-permuted, :mod:`qtrain.kernels.mosaic_layout`:
  no warp shuffles), and issues ``wgmma`` with the activations as the B
  operand from shared memory;
* binary decode: one shift and one ``(w & 0x80008000) ^ ±1`` per pair of
  weights; int4/int8: Mosaic's vectorized integer-to-float conversion;
* int8 activations (``x`` int8, the "A8" path): int8 wgmma with int32
  accumulation, which takes twice the K per instruction. int8 weights are
  read by wgmma straight from shared memory; binary weights decode to
  ``±64`` bytes (one shift and one ``(w & 0x80808080) ^ 0xC0C0C0C0`` per 4
  weights), int4 to ``16 * value`` and int2 to ``64 * value`` (one shift and
  one mask per 4), and the factor is divided out with the scales; int2
  weights run with int8 activations only;
* the weights' storage order is laid out for one kind of activations
  (``prepare_mosaic_weight(..., order="float" | "int8")``); the other kind
  is permuted along K per call to match
  (:func:`qtrain.kernels.mosaic_layout.activation_permutation`);
* without split-K, the epilogue applies the scales, casts and writes the
  (M, N) output (transposed through shared memory, one TMA copy per tile);
  ``config.split_k`` > 1 splits K across CTAs (for small N), and XLA adds
  the partial sums and applies the scales on the small (N, M) result.

Needs a Hopper GPU and jax >= 0.11 (Pallas Mosaic GPU); tests run it on the
GPU only (Mosaic GPU kernels have no CPU interpreter here). The
``implementation="mosaic"`` switch of :mod:`qtrain.ops.dispatch` routes
bf16/f16 or integer-activation dots with binary/int4/int8 per-channel weights here.

Example (GPU)::

  w = prepare_mosaic_weight(codes, "int4", scale=s)     # codes: (N, K) int8 in [-8, 7]
  y = mosaic_matmul(x.astype(jnp.bfloat16), w, out_dtype=jnp.bfloat16)   # x: (M, K)
  w8 = prepare_mosaic_weight(codes, "int4", scale=s, order="int8")
  y8 = mosaic_matmul(x_codes, w8, x_scale=x_s)    # x_codes: (M, K) int8, x_s: (M,)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qtrain.core import qtypes
from qtrain.kernels import _common
from qtrain.kernels import binary_matmul, nbit_matmul
from qtrain.kernels import mosaic_layout

QTYPES = ("binary", "int2", "int4", "int8")
ACT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.int8)
# int8 activations: the decoded weight is this multiple of its value (divided out with the scales)
A8_FACTOR = {"binary": 64, "int2": 64, "int4": 16, "int8": 1}
# int8 activations accumulate in int32: |w code * factor| <= 128 and |x| <= 128, so K_pad
# products of at most 2**14 each stay within int32
A8_MAX_K = (2**31 - 1) // (128 * 128)
MAX_M = 128  # the activation rows are wgmma's N side (<= 256); decode sizes only
K_ALIGN = 512  # K is padded to this at preparation (a multiple of every tile_k / chunk)
WG_ROWS = (64, 128)  # weight rows per consumer warpgroup (wgmma M: 1 or 2 instructions)
_WGS = 2  # consumer warpgroups per CTA
N_ALIGN = _WGS * max(WG_ROWS)  # N is padded to this
TILE_KS = (128, 256, 512)
_MAX_A_BYTES = 64 * 512 * 2  # decoded A fragment per warpgroup: 128 registers per thread
_EPILOGUE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class UnsupportedCall(ValueError):
  """The Mosaic kernel cannot take this call (activation dtype, M, K, or a
  config that does not fit): ``implementation="auto"`` runs XLA instead."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Tiling of the Mosaic kernel.

  Attributes:
    tile_k: K values per pipeline step (128, 256 or 512; binary weights >= 256).
    steps: pipeline stages in flight (2-8; shared memory bounds it: the
      kernel reports a shape that does not fit).
    split_k: CTAs sharing one weight tile's K range (a power of two).
    wg_rows: weight rows per consumer warpgroup (64 or 128; a CTA takes
      twice that). More rows share each activation tile (less activation
      traffic per weight byte). The decoded weights of a step live in
      registers: with bf16/f16 activations ``wg_rows * tile_k`` <= 32768
      (:func:`mosaic_matmul` checks it), with int8 ones every config fits.
  """

  tile_k: int = 512
  steps: int = 3
  split_k: int = 1
  wg_rows: int = 64

  def __post_init__(self):
    if self.tile_k not in TILE_KS:
      raise ValueError(f"tile_k={self.tile_k}; valid: {TILE_KS}")
    if not 2 <= self.steps <= 8:
      raise ValueError(f"steps={self.steps}; valid: 2..8")
    if self.split_k < 1 or not _common.is_pow2(self.split_k):
      raise ValueError(f"split_k={self.split_k} must be a power of two >= 1")
    if self.wg_rows not in WG_ROWS:
      raise ValueError(f"wg_rows={self.wg_rows}; valid: {WG_ROWS}")

  @property
  def cta_rows(self) -> int:
    return _WGS * self.wg_rows


@dataclasses.dataclass(frozen=True)
class MosaicWeight:
  """A quantized (N, K) weight in the Mosaic kernel's storage order.

  Attributes:
    data: binary (Np, Kp // 8) int8 packed bits; int2 (Np, Kp // 4) int8
      packed 2-bit fields; int4 (Np, Kp) ``jnp.int4``;
      int8 (Np, Kp) int8 (columns in ``order``, :mod:`qtrain.kernels.mosaic_layout`).
    w_scale: (N,) float32 per-channel scale, or None.
    qtype: "binary", "int2", "int4" or "int8" (static).
    n: true output channels (static).
    k: true contracting size (static).
    order: the activations the storage order is laid out for (static):
      "float" (bf16/f16) or "int8". Either serves both; the other kind of
      activations is permuted along K per call.
    tiles: None (rows of ``data`` are weight rows), or the (CTA rows,
      tile_k) tiles the weights are stored in, each tile contiguous, in the
      order the kernel streams them (static; :func:`prepare_mosaic_weight`).
  """

  data: jax.Array
  w_scale: jax.Array | None
  qtype: str
  n: int
  k: int
  order: str = "float"
  tiles: tuple[int, int] | None = None

  @property
  def n_pad(self) -> int:
    return _common.round_up(self.n, N_ALIGN)

  @property
  def k_pad(self) -> int:
    return _common.round_up(self.k, K_ALIGN)


jax.tree_util.register_dataclass(MosaicWeight, data_fields=["data", "w_scale"],
                                 meta_fields=["qtype", "n", "k", "order", "tiles"])

TILES = tuple((2 * r, tk) for r in WG_ROWS for tk in TILE_KS)  # (CTA rows, tile_k) storage tiles


def _bits(qtype: str) -> int:
  """Stored bits per weight of a container qtype (the vocabulary's own figure)."""
  return qtypes.get_qtype(qtype).bits


def auto_tiles(n: int, num_sms: int | None = None) -> tuple[int, int] | None:
  """What ``prepare_mosaic_weight(..., tiles="auto")`` stores for N output channels
  (for decode sizes: the tiles bound M, see :func:`prepare_mosaic_weight`).

  Large layers (more 128-row tiles than SMs, where :func:`default_config`
  takes 256-row CTA tiles with tile_k 256): (256, 256) tiles, measured 3-5%
  faster than row-major for int4 and int8 weights on the (8192, 28672) layer
  (docs/performance-history.md, session 4: tile-major weights). Smaller layers: None
  (row-major; tile-major measured equal or slower at (4096, 4096)).
  """
  return (_WGS * 128, 256) if _large_layer(_common.round_up(n, N_ALIGN), num_sms) else None


def _large_layer(n_pad: int, num_sms: int | None = None) -> bool:
  """More 64-row-warpgroup CTA tiles than SMs: where the defaults take 256-row CTA tiles."""
  return n_pad // (_WGS * 64) > (num_sms or _common.num_sms())


def prepare_mosaic_weight(values: jax.Array, qtype: str, *, scale=None,
                          order: str | None = None, tiles=None) -> MosaicWeight:
  """Lays out quantized weights (N, K) for :func:`mosaic_matmul` (jit-friendly).

  Args:
    values: (N, K) integer codes: binary (> 0 means +1, else -1), int2 in
      [-2, 1], int4 in [-8, 7], int8 in [-128, 127].
    qtype: "binary", "int2", "int4" or "int8".
    scale: None, a scalar, or (N,) / (N, 1) per-channel scales.
    order: the activations the weights will mostly meet: "float" (bf16/f16)
      or "int8"; None: "float" (int2: "int8"). Both kinds run with either;
      the order saves the other kind's per-call permutation of the
      activations. int2 weights have only "int8" (they run with int8
      activations only).
    tiles: None (row-major), "auto" (:func:`auto_tiles`: tile by tile for
      large layers), or (CTA rows, tile_k) from :data:`TILES`: store the
      weights tile by tile, each tile one contiguous block in the order the
      kernel streams them (fewer DRAM pages per TMA copy). Configs must then
      use these tiles, which bounds M by shared memory: (256, 256) tiles take
      M <= 48 (int8 weights, bf16 activations) to 128 (binary, int8
      activations); row-major weights take every M <= :data:`MAX_M`.

  Returns:
    A :class:`MosaicWeight` (N padded to a multiple of 256, K to 512; padded
    columns meet zero activations, padded rows are sliced off).
  """
  if qtype not in QTYPES:
    raise ValueError(f"qtype={qtype!r}; the Mosaic kernel takes {QTYPES}")
  if order is None:
    order = mosaic_layout.orders(qtype)[0]
  if order not in mosaic_layout.orders(qtype):
    raise ValueError(f"order={order!r}; valid for {qtype} weights: {mosaic_layout.orders(qtype)} (the "
                     f"activations the weights are laid out for)")
  values = jnp.asarray(values)
  if values.ndim != 2:
    raise ValueError(f"weights must be 2-D (N, K); got shape {values.shape}")
  n, k = values.shape
  if tiles == "auto":
    tiles = auto_tiles(n)
  if tiles is not None:
    tiles = tuple(tiles)
    if tiles not in TILES or (qtype == "binary" and tiles[1] < 256):
      raise ValueError(f"tiles={tiles}: valid (CTA rows, tile_k) are {TILES} (binary: tile_k >= 256), "
                       f"'auto' or None")
  n_pad, k_pad = _common.round_up(n, N_ALIGN), _common.round_up(k, K_ALIGN)
  values = jnp.pad(values.astype(jnp.int8), ((0, n_pad - n), (0, k_pad - k)))
  if qtype in mosaic_layout.PACKED:
    data = mosaic_layout.pack_bits(values, qtype, order)
  else:
    data = mosaic_layout.permute_columns(values, qtype, order)
  if tiles is not None:
    data = mosaic_layout.tile_major(data, tiles[0], _w_cols(qtype, tiles[1]))
  if qtype == "int4":
    data = data.astype(jnp.int4)
  w_scale = None
  if scale is not None:
    s = jnp.asarray(scale, jnp.float32).reshape(-1)
    if s.shape[0] not in (1, n):
      raise ValueError(f"per-channel scale has {s.shape[0]} entries; expected 1 or {n=}")
    w_scale = jnp.broadcast_to(s, (n,))
  return MosaicWeight(data=data, w_scale=w_scale, qtype=qtype, n=n, k=k, order=order, tiles=tiles)


def mosaic_weight_values(w: MosaicWeight) -> jax.Array:
  """The (N, K) int8 codes a :class:`MosaicWeight` holds (its storage order undone;
  binary as +-1): what :func:`prepare_mosaic_weight` was given, for XLA paths."""
  data = w.data.astype(jnp.int8)
  if w.tiles is not None:
    data = mosaic_layout.untile(data, w.n_pad, w.tiles[0], _w_cols(w.qtype, w.tiles[1]))
  if w.qtype in mosaic_layout.PACKED:
    values = mosaic_layout.unpack_bits(data, w.qtype, w.k_pad, w.order)
  else:
    values = mosaic_layout.unpermute_columns(data, w.qtype, w.order)
  return values[:w.n, :w.k]


SMEM_BYTES = 232448 - 1024  # Hopper's per-block shared memory, less barriers


def smem_bytes(qtype: str, m: int, cfg: MosaicConfig, act_bytes: int = 2) -> int:
  """Shared memory the kernel allocates: ``steps`` weight + activation tiles and the output tiles
  (``act_bytes``: 2 for bf16/f16 activations, 1 for int8)."""
  mp = _common.round_up(m, 16)
  w_tile = cfg.cta_rows * cfg.tile_k * _bits(qtype) // 8
  return cfg.steps * (w_tile + mp * cfg.tile_k * act_bytes) + cfg.cta_rows * mp * 4


def default_config(w: MosaicWeight, m: int, num_sms: int | None = None,
                   act_dtype=jnp.bfloat16) -> MosaicConfig:
  """Measured defaults (docs/performance-history.md, "Mosaic GPU kernels", H200).

  Where 64-row warpgroup tiles would take more than one wave of SMs (large N),
  128 rows per warpgroup with tile_k 256 (half the activation traffic per
  weight byte); otherwise 64 rows with tile_k 512 (int8: 256) and split K
  while the CTAs fit in one wave. Pipeline depth: binary / int2 4, int4/int8 3,
  fewer (then smaller tiles) where M's activation tiles would overflow shared
  memory. int8 activations (``act_dtype``) use the same tiles.
  """
  sms = num_sms or _common.num_sms()
  ab = jnp.dtype(act_dtype).itemsize
  steps = 4 if w.qtype in mosaic_layout.PACKED else 3
  if w.tiles is not None:  # the stored tiles; the deepest pipeline that fits
    for st in range(steps, 1, -1):
      cfg = MosaicConfig(tile_k=w.tiles[1], steps=st, wg_rows=w.tiles[0] // _WGS)
      if smem_bytes(w.qtype, m, cfg, ab) <= SMEM_BYTES:
        return with_split(w, cfg, sms)
    raise UnsupportedCall(f"M={m}: weights stored in {w.tiles} tiles leave no {w.qtype} config that "
                          f"fits in shared memory; prepare them with smaller tiles or tiles=None")
  if _large_layer(w.n_pad, sms):
    for st in range(steps, 1, -1):
      cfg = MosaicConfig(tile_k=256, steps=st, wg_rows=128)
      if smem_bytes(w.qtype, m, cfg, ab) <= SMEM_BYTES:
        return with_split(w, cfg, sms)
  tile_k = 256 if w.qtype == "int8" else 512
  while smem_bytes(w.qtype, m, MosaicConfig(tile_k=tile_k, steps=steps), ab) > SMEM_BYTES:
    if steps > 2:
      steps -= 1
    elif tile_k > (256 if w.qtype == "binary" else min(TILE_KS)):
      tile_k, steps = tile_k // 2, 3
    else:
      raise UnsupportedCall(f"M={m}: no {w.qtype} config fits in shared memory")
  return with_split(w, MosaicConfig(tile_k=tile_k, steps=steps), sms)


def with_split(w: MosaicWeight, cfg: MosaicConfig, num_sms: int | None = None) -> MosaicConfig:
  """``cfg`` with ``split_k`` doubled while the CTAs still fit in one wave of SMs."""
  sms = num_sms or _common.num_sms()
  tiles = w.n_pad // cfg.cta_rows
  split = 1
  while tiles * split * 2 <= sms and w.k_pad % (cfg.tile_k * split * 2) == 0:
    split *= 2
  return dataclasses.replace(cfg, split_k=split)


def _w_cols(qtype: str, tile_k: int) -> int:
  """Stored columns of one tile_k step (binary: 8 weights per byte, int2: 4)."""
  return tile_k * _bits(qtype) // 8 if qtype in mosaic_layout.PACKED else tile_k


def mosaic_matmul(x: jax.Array, w: MosaicWeight, *, x_scale=None, out_dtype=jnp.float32,
                  config: MosaicConfig | None = None) -> jax.Array:
  """``(x @ w.T) * w_scale * x_scale`` on the GPU by the Mosaic kernel.

  Args:
    x: (M, K) bf16 or f16 activations, or int8 activation codes (then
      ``x_scale`` carries their scale), M <= :data:`MAX_M`.
    w: a :class:`MosaicWeight` with ``w.k == K``.
    x_scale: None, a scalar, or (M,) per-row scale.
    out_dtype: output dtype.
    config: a :class:`MosaicConfig`; default :func:`default_config`.

  Returns:
    (M, N) ``out_dtype`` (f32 accumulation; int32 for int8 activations, exact).
  """
  cfg = checked_config(x, w, config)
  if not _common.on_gpu():
    raise ValueError(f"the Mosaic kernel runs on a GPU; this backend is {jax.default_backend()!r} "
                     f"(use implementation='interpret' or 'xla' on the CPU)")
  if jax.__version_info__ < (0, 11):
    raise ValueError(f"the Mosaic kernel needs jax >= 0.11 (Pallas Mosaic GPU); this is "
                     f"jax {jax.__version__}: use implementation='triton'")
  return _matmul(x, w, x_scale, out_dtype, cfg)


def checked_config(x: jax.Array, w: MosaicWeight, config: MosaicConfig | None = None) -> MosaicConfig:
  """The config :func:`mosaic_matmul` would run ``x`` with (``config`` or the
  default); :class:`UnsupportedCall` naming the problem where the kernel cannot
  take the call (whatever the backend), ValueError where ``x`` does not match ``w``."""
  if x.ndim != 2 or x.shape[1] != w.k:
    raise ValueError(f"x has shape {x.shape}; expected (M, {w.k})")
  if x.dtype not in ACT_DTYPES:
    raise UnsupportedCall(f"activations of dtype {x.dtype}: the Mosaic kernel takes bfloat16, "
                          f"float16 or int8 (cast them, or use implementation='triton' for float32)")
  m = x.shape[0]
  if not 1 <= m <= MAX_M:
    raise UnsupportedCall(f"M={m}: the Mosaic kernel serves decode sizes 1..{MAX_M}; use "
                          f"implementation='triton' or 'xla' for larger M")
  a8 = x.dtype == jnp.int8
  if w.qtype == "int2" and not a8:
    raise UnsupportedCall(f"int2 weights with {x.dtype} activations: the Mosaic kernel runs int2 "
                          f"weights with int8 activations only (quantize them, or use "
                          f"implementation='triton')")
  if a8 and w.k_pad > A8_MAX_K:
    raise UnsupportedCall(f"K={w.k} (padded {w.k_pad}) with int8 activations could overflow the int32 "
                          f"accumulator; the Mosaic kernel takes K <= {A8_MAX_K} there")
  cfg = config or default_config(w, m, act_dtype=x.dtype)
  if w.tiles is not None and (cfg.cta_rows, cfg.tile_k) != w.tiles:
    raise UnsupportedCall(f"{cfg} has (CTA rows, tile_k) = {(cfg.cta_rows, cfg.tile_k)}; the weights "
                          f"are stored in {w.tiles} tiles")
  if cfg.wg_rows * cfg.tile_k * x.dtype.itemsize > _MAX_A_BYTES:
    raise UnsupportedCall(f"wg_rows={cfg.wg_rows} x tile_k={cfg.tile_k} decodes more than "
                          f"{_MAX_A_BYTES // x.dtype.itemsize} {x.dtype} weights per warpgroup step "
                          f"(register file); lower one")
  if w.qtype == "binary" and cfg.tile_k < 256:
    raise UnsupportedCall(f"tile_k={cfg.tile_k}: binary weights need tile_k >= 256 (rows of at least "
                          f"32 bytes of packed bits per step)")
  need = smem_bytes(w.qtype, m, cfg, x.dtype.itemsize)
  if need > SMEM_BYTES:
    raise UnsupportedCall(f"{cfg} at M={m} needs {need} bytes of shared memory "
                          f"(limit {SMEM_BYTES}); use fewer steps or a smaller tile_k")
  if w.k_pad % (cfg.tile_k * cfg.split_k):
    raise UnsupportedCall(f"{cfg} does not tile K={w.k_pad} (padded): tile_k * split_k must divide it")
  return cfg


def _matmul(x, w: MosaicWeight, x_scale, out_dtype, cfg: MosaicConfig, *,
            fuse_epilogue: bool = True) -> jax.Array:
  """:func:`mosaic_matmul` after its checks (traceable off a GPU, e.g. as the
  CUDA branch of ``lax.platform_dependent``). Without split-K the kernel's
  epilogue applies the scales and writes the (M, N) output; with it (or with
  ``fuse_epilogue=False``) XLA sums the (N, M) partial sums and scales them."""
  m = x.shape[0]
  a8 = x.dtype == jnp.int8
  mp = _common.round_up(m, 16)
  # TMA zero-fills the rows past x's, but takes only row counts below 8 or a multiple of 8
  rows_in = m if m < 8 else _common.round_up(m, 8)
  xp = jnp.pad(x, ((0, rows_in - m), (0, w.k_pad - w.k)))
  xp = mosaic_layout.permute_activations(xp, w.qtype, w.order, "int8" if a8 else "float")
  if fuse_epilogue and cfg.split_k == 1 and jnp.dtype(out_dtype) in _EPILOGUE_DTYPES:
    # scales, transpose and cast in the kernel's epilogue, in the XLA epilogue's order (same
    # bits); aligned shapes need no XLA op around the kernel
    ws = jnp.ones((w.n,), jnp.float32) if w.w_scale is None else w.w_scale
    xs = jnp.ones((m,), jnp.float32) if x_scale is None else jnp.broadcast_to(
        jnp.asarray(x_scale, jnp.float32).reshape(-1), (m,))
    out = _kernel(w.data, xp, jnp.pad(ws, (0, w.n_pad - w.n)), jnp.pad(xs, (0, mp - m)),
                  qtype=w.qtype, k_pad=w.k_pad, cfg=cfg, out_dtype=out_dtype,
                  tile_major=w.tiles is not None)
    return out[:m, :w.n]
  parts = _kernel(w.data, xp, qtype=w.qtype, k_pad=w.k_pad, cfg=cfg,
                  tile_major=w.tiles is not None)
  acc = (parts[0] if cfg.split_k == 1 else parts.sum(0))[:w.n, :m].T
  if a8:
    acc = acc.astype(jnp.float32) * (1.0 / A8_FACTOR[w.qtype])
  if w.w_scale is not None:
    acc = acc * w.w_scale[None, :]
  if x_scale is not None:
    s = jnp.asarray(x_scale, jnp.float32).reshape(-1)
    acc = acc * jnp.broadcast_to(s, (m,))[:, None]
  return acc.astype(out_dtype)


def mosaic_matmul_reference(x: jax.Array, w_values: jax.Array, qtype: str, *, w_scale=None,
                            x_scale=None, out_dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference (f32, HIGHEST precision) of :func:`mosaic_matmul`: the
  Triton kernels' references, which compute the same product."""
  ref = binary_matmul.binary_matmul_reference if qtype == "binary" else nbit_matmul.nbit_matmul_reference
  return ref(x, w_values, w_scale=w_scale, x_scale=x_scale, out_dtype=out_dtype)


# ----------------------------------------------------------------------------
# The kernel (Pallas Mosaic GPU; imported lazily: jax 0.10 has an older API).


def _i32(v: int) -> int:
  return v - (1 << 32) if v >= (1 << 31) else v


def wgmma_register(idx: tuple[int, ...], j: int, per: int, ndim: int) -> tuple[int, ...]:
  """The wgmma-layout register that takes part ``j`` (of ``per``) of upcast register ``idx``.

  Both layouts give a thread the same rows; column chunk ``c`` of the upcast
  layout (32 int4 / 16 int8 columns / 128 binary columns) covers wgmma
  8-column chunks ``c * per .. c * per + per - 1`` (the storage order of
  :mod:`qtrain.kernels.mosaic_layout` makes the columns match). ``ndim``: rank
  of the wgmma register array (the upcast one may have an extra unit dim).
  """
  return (idx[0], idx[1] * per + j, *idx[2:ndim])


def binary_pair_bits(word: int, j: int, one_bits: int) -> int:
  """The two 16-bit floats (as one 32-bit word) the kernel decodes for pair ``j``
  of a packed word: ``((word << (15 - j)) & 0x80008000) ^ minus_ones``. Python-int
  model of the PTX the kernel emits (tests check the storage order with it)."""
  minus = one_bits | 0x8000
  return (((word << (15 - j)) & 0xFFFFFFFF) & 0x80008000) ^ (minus | minus << 16)


def binary_int8_bits(word: int, t: int) -> int:
  """The four int8 weights (one 32-bit word, ``±64`` each) the int8-activation
  kernel decodes for shift ``t`` of a packed word: ``((word << t) & 0x80808080)
  ^ 0xC0C0C0C0`` (bit set -> 0x40 = +64). Python-int model of the kernel's PTX."""
  return (((word << t) & 0xFFFFFFFF) & 0x80808080) ^ 0xC0C0C0C0


def int2_int8_bits(word: int, j: int) -> int:
  """The four int8 weights (``64 * value``) the int8-activation kernel decodes
  from a word of sixteen int2 fields: field ``3 - j`` of each byte moved to the
  byte's top two bits, ``(word << 2j) & 0xC0C0C0C0``. Python-int model."""
  return ((word << (2 * j)) & 0xFFFFFFFF) & 0xC0C0C0C0


def int4_int8_bits(word: int, j: int) -> int:
  """The four int8 weights (``16 * value``) the int8-activation kernel decodes
  from a word of eight int4 values: the even nibbles (``j = 0``, moved to the
  high half of each byte) or the odd ones (``j = 1``). Python-int model."""
  return ((word << 4) & 0xF0F0F0F0) if j == 0 else (word & 0xF0F0F0F0)


def _wgmma_fragment(q, rows: int, tile_k: int, per: int, part, *, words: bool = False,
                    eight_bit: bool = False):
  """Upcast-layout fragment ``q`` -> a fragment in wgmma's A layout (16-bit, or
  the 8-bit one), thread-locally: register ``j`` (of ``per``) taken from each
  upcast register ``reg`` is ``part(reg, j)`` (``part(word, j)`` on ``reg``
  bitcast to one 32-bit word, with ``words``); the storage order of
  :mod:`qtrain.kernels.mosaic_layout` makes the columns match."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa

  layout = fa.WGMMA_LAYOUT_8BIT if eight_bit else fa.WGMMA_LAYOUT
  i32 = ir.IntegerType.get_signless(32)
  out = np.empty(layout.registers_shape((rows, tile_k)), dtype=object)
  for idx, reg in np.ndenumerate(q.registers):
    src = mgpu.utils.bitcast(reg, i32) if words else reg
    for j in range(per):
      out[wgmma_register(idx, j, per, out.ndim)] = part(src, j)
  return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=True if eight_bit else None)


def _int8_fragment(q, rows: int, tile_k: int, per: int, decode_word):
  """Upcast-layout fragment -> an int8 fragment in wgmma's 8-bit A layout:
  ``decode_word(word, j)`` gives the 32-bit register of part ``j`` of ``per``."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic import gpu as mgpu

  quad = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
  return _wgmma_fragment(q, rows, tile_k, per,
                         lambda word, j: mgpu.utils.bitcast(decode_word(word, j), quad),
                         words=True, eight_bit=True)


def _decode_binary_a8(q, rows: int, tile_k: int):
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu

  i32 = ir.IntegerType.get_signless(32)
  sign, flip = (mgpu.utils.c(_i32(v), i32) for v in (0x80808080, 0xC0C0C0C0))

  def word_to_quad(word, t):
    shifted = word if t == 0 else arith.shli(word, mgpu.utils.c(t, i32))
    return arith.xori(arith.andi(shifted, sign), flip)

  return _int8_fragment(q, rows, tile_k, 8, word_to_quad)


def _decode_int4_a8(q, rows: int, tile_k: int):
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu

  i32 = ir.IntegerType.get_signless(32)
  high = mgpu.utils.c(_i32(0xF0F0F0F0), i32)

  def word_to_quad(word, j):
    return arith.andi(arith.shli(word, mgpu.utils.c(4, i32)) if j == 0 else word, high)

  return _int8_fragment(q, rows, tile_k, 2, word_to_quad)


def _decode_int2_a8(q, rows: int, tile_k: int):
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu

  i32 = ir.IntegerType.get_signless(32)
  top = mgpu.utils.c(_i32(0xC0C0C0C0), i32)

  def word_to_quad(word, j):
    return arith.andi(word if j == 0 else arith.shli(word, mgpu.utils.c(2 * j, i32)), top)

  return _int8_fragment(q, rows, tile_k, 4, word_to_quad)


def _decode_binary(q, rows: int, tile_k: int, float_type, one_bits: int):
  """Packed-bit fragment (int8, upcast layout) -> +-1 fragment in the wgmma A layout."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu

  i32 = ir.IntegerType.get_signless(32)
  pair = ir.VectorType.get((2,), float_type)
  sign = mgpu.utils.c(_i32(0x80008000), i32)
  minus_ones = mgpu.utils.c(_i32(one_bits | 0x8000 | (one_bits | 0x8000) << 16), i32)

  def word_to_pair(word, j):
    s = word if j == 15 else arith.shli(word, mgpu.utils.c(15 - j, i32))
    v = arith.xori(arith.andi(s, sign), minus_ones)  # bit set -> sign cleared -> +1
    return mgpu.utils.bitcast(v, pair)

  return _wgmma_fragment(q, rows, tile_k, 16, word_to_pair, words=True)


def _relabel(y, rows: int, tile_k: int, per: int):
  """Upcast-layout fragment of a permuted tile -> the same registers in wgmma A layout."""
  from jax.experimental.mosaic import gpu as mgpu

  return _wgmma_fragment(y, rows, tile_k, per,
                         lambda reg, j: mgpu.utils.vector_slice(reg, slice(2 * j, 2 * j + 2)))


# A jit boundary per (shapes, config): every call of one kernel shape then shares one
# traced jaxpr, and JAX lowers a repeated jitted jaxpr once per module. Lowering a Mosaic
# GPU kernel takes ~0.5 s of Python; a transformer's step calls each shape once per layer
# and product (74 lowerings for a 4-block decoder: 35 of its 46 s of lowering).
@functools.partial(jax.jit, static_argnames=("qtype", "k_pad", "cfg", "ablate", "out_dtype",
                                             "tile_major"))
def _kernel(w, x, *scales, qtype: str, k_pad: int, cfg: MosaicConfig, ablate: str | None = None,
            out_dtype=None, tile_major: bool = False) -> jax.Array:
  """(Np, Kw) weights x (Mp, Kp) activations -> (split_k, Np, Mp) partial sums
  (f32; int32 for int8 activations); with ``scales`` = (w_scale (Np,), x_scale
  (Mp,)) f32 (split_k 1), the scaled (M, Np) ``out_dtype`` product instead:
  the epilogue multiplies the accumulator by 1 / A8 factor and both scales,
  casts, and stores it transposed to shared memory element by element for one
  TMA copy per warpgroup tile. ``x`` may have fewer rows than Mp (a multiple
  of 16; fewer than 8 or a multiple of 8, TMA's rule): the TMA loads zero-fill
  the rest. ``tile_major``: ``w`` stored by
  :func:`qtrain.kernels.mosaic_layout.tile_major` in (CTA rows, tile_k) tiles.

  ``ablate`` (measurement only, wrong results; benchmarks/explore_mosaic.py):
  "stream" leaves each pipeline step empty (the TMA pipeline alone);
  "no_decode" (int8 activations) feeds the loaded words to wgmma undecoded;
  "one_op" (binary weights, int8 activations) decodes each register with one
  AND (``word & (0x80808080 >> t)``) instead of a shift and a ``lop3``: the
  ALU cost of a bit-plane decode, without its per-plane accumulators.
  """
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental import pallas as pl
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu

  n_pad = w.shape[0] // (k_pad // cfg.tile_k) if tile_major else w.shape[0]
  mp = _common.round_up(x.shape[0], 16)  # TMA zero-fills the rows past x's
  tile_k, split = cfg.tile_k, cfg.split_k
  act = x.dtype
  a8 = act == jnp.int8
  acc_dtype = jnp.int32 if a8 else jnp.float32
  float_type = ir.BF16Type.get if act == jnp.bfloat16 else ir.F16Type.get
  one_bits = 0x3F80 if act == jnp.bfloat16 else 0x3C00
  bits = 4 if qtype == "int4" else 8  # shared-memory element bits (packed qtypes as bytes)
  w_cols = _w_cols(qtype, tile_k)
  kpart = k_pad // split
  k_steps = kpart // tile_k
  rows = cfg.wg_rows
  cta_rows = cfg.cta_rows
  n_tiles = n_pad // cta_rows

  def tiled(elem_bits, minor, what):
    sw = plgpu.find_swizzle(minor * elem_bits, what)
    return plgpu.TilingTransform((8, sw * 8 // elem_bits)), plgpu.SwizzleTransform(sw)

  w_tr = tiled(bits, w_cols, "lhs")
  x_tr = tiled(8 * act.itemsize, tile_k, "rhs")
  o_tr = tiled(32, mp, "out")
  w_swizzle = w_tr[1].swizzle
  load_layout = fa.WGMMA_LAYOUT_UPCAST_4X if qtype == "int4" else fa.WGMMA_LAYOUT_UPCAST_2X

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(w_tr),),
                     return_type=plgpu.ShapeDtypeStruct(
                         (rows, tile_k), act,
                         layout=plgpu.Layout.WGMMA_8BIT if a8 else plgpu.Layout.WGMMA))
  def decode(ctx, ref):
    del ctx
    q = mgpu.FragmentedArray.load_tiled(ref, swizzle=w_swizzle, is_signed=True, layout=load_layout)
    if a8 and qtype == "binary" and ablate == "one_op":
      i32 = ir.IntegerType.get_signless(32)
      return _int8_fragment(q, rows, tile_k, 8, lambda word, t: arith.andi(
          word, mgpu.utils.c(_i32(0x80808080 >> t), i32)))
    if a8 and ablate == "no_decode":
      per = {"binary": 8, "int2": 4}.get(qtype, 2)
      return _int8_fragment(q, rows, tile_k, per, lambda word, j: word)
    if a8:
      decode_a8 = {"binary": _decode_binary_a8, "int2": _decode_int2_a8, "int4": _decode_int4_a8}
      return decode_a8[qtype](q, rows, tile_k)
    if qtype == "binary":
      return _decode_binary(q, rows, tile_k, float_type(), one_bits)
    return _relabel(q.astype(float_type()), rows, tile_k, per=4 if qtype == "int4" else 2)

  fused = bool(scales)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store_transposed(ctx, r, o_ref):
    """(rows, mp) fragment -> this warpgroup's (mp, rows) slot of ``o_ref``, element by element."""
    del ctx
    from jax._src.lib.mlir import ir as _ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    index = _ir.IndexType.get()
    wgi = arith.index_cast(index, mgpu.utils.warpgroup_idx(sync=False))
    for (row, col), reg in zip(r.layout.thread_idxs(r.shape), r.registers.flat):
      for e in range(_ir.VectorType(reg.type).shape[0]):
        val = vector.extract(reg, dynamic_position=[], static_position=[e])
        c = arith.addi(col, arith.constant(index, e)) if e else col
        memref.store(val, o_ref, [wgi, c, row])

  # tile_major: tile (n, kk) of a row band is row block kk of the band's slice below
  w_index = (lambda kk: (kk, 0)) if tile_major else (lambda kk: (0, kk))

  def body(w_gmem, x_gmem, *refs, o_smem):
    if fused:
      ws_gmem, xs_gmem, o_gmem = refs
    else:
      (o_gmem,) = refs

    def pipeline(step, context):
      return plgpu.emit_pipeline_warp_specialized(
          step, grid=(k_steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((cta_rows, w_cols), w_index, transforms=w_tr,
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((mp, tile_k), lambda kk: (0, kk), transforms=x_tr,
                                    memory_space=plgpu.SMEM)],
          wg_axis="wg", num_compute_wgs=_WGS, max_concurrent_steps=cfg.steps,
          compute_context=context)

    unused = lambda *_, **__: None

    @functools.partial(pl.run_scoped,
                       allocs=pipeline(unused, unused).get_allocations(w_gmem, x_gmem),
                       collective_axes="wg")
    def _scope(allocs):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((n_tiles * split,), collective_axes="sm")
      def _tile(info):
        (lin,) = info.index
        n_idx, s_idx = lin // split, lin % split
        ks = pl.ds(s_idx * kpart, kpart)
        wks = pl.ds(s_idx * _w_cols(qtype, kpart), _w_cols(qtype, kpart))  # stored columns
        tile_rows = pl.ds(n_idx * cta_rows, cta_rows)
        wg_rows = pl.ds(wg * rows, rows)

        def context(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((rows, mp), acc_dtype))
          def _acc(acc):
            run(acc)
            res = acc[...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if fused:
              row0 = n_idx * cta_rows + wg * rows
              ws = plgpu.load(ws_gmem.at[pl.ds(row0, rows)],
                              layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
              xs = plgpu.load(xs_gmem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
              r = res.astype(jnp.float32)
              if a8:
                r = r * (1.0 / A8_FACTOR[qtype])
              r = r * ws[:, None] * xs[None, :]
              store_transposed(r.astype(out_dtype), o_smem)
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(o_smem.at[wg].at[:x.shape[0]],
                                      o_gmem.at[:, pl.ds(row0, rows)])
            else:
              o_smem[wg] = res
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[s_idx].at[tile_rows].at[wg_rows])

        def step(_, w_smem, x_smem, acc):
          if ablate == "stream":
            return acc
          # int8 x int8: wgmma reads the weight tile from shared memory as stored
          lhs = w_smem.at[wg_rows] if a8 and qtype == "int8" else decode(w_smem.at[wg_rows])
          plgpu.wgmma(acc, lhs, x_smem.transpose((1, 0)))
          plgpu.wgmma_wait(0)  # the slot is released when the step returns
          return acc

        if tile_major:  # tile (n_idx, kk) is row block n_idx * K steps + kk
          first = (n_idx * (k_pad // tile_k) + s_idx * k_steps) * cta_rows
          w_src = w_gmem.at[pl.ds(first, k_steps * cta_rows)]
        else:
          w_src = w_gmem.at[tile_rows, wks]
        pipeline(step, context)(w_src, x_gmem.at[:, ks], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  if fused:
    out_type = _common.out_struct((x.shape[0], n_pad), out_dtype, w, x, *scales)
    o_smem = plgpu.SMEM((_WGS, mp, rows), out_dtype)
  else:
    out_type = _common.out_struct((split, n_pad, mp), acc_dtype, w, x, *scales)
    o_smem = plgpu.SMEM((_WGS, rows, mp), acc_dtype, transforms=o_tr)
  call = plgpu.kernel(
      body, out_type=out_type,
      grid=(min(_common.num_sms(), n_tiles * split),), grid_names=("sm",),
      num_threads=_WGS + 1, thread_name="wg",
      scratch_types=dict(o_smem=o_smem))
  return _common.varying_like(call(w, x, *scales), w, x, *scales)
