"""The generic dequantize-in-the-loop matmul that the public kernels specialise.

``out[m, n] = epilogue(sum_k a[m, k] * w[n, k])`` with ``a`` (M, K) and ``w``
(N, K) — or stored (K, N) when the PreparedWeight says ``kn`` (measured faster
for 16-bit activations). The grid is (M / block_m, N / block_n, split_k).

Two loop structures:

* small-M plane path (``BlockConfig.block_k is None``): each program loops
  over its share of K tiles, loads a word tile once and decodes it one
  *plane* at a time (see :mod:`qtrain.kernels._common` for the plane layout),
  each plane a tensor-core dot (int8 x int8 -> int32, or float -> float32);
* flat large-M path (``block_k`` set): one dot of ``block_k`` K values per
  iteration, its operand decoded from several slots of a word tile and
  flattened, so Triton pipelines one load per operand.

Group-wise weight scales (and zero points) are applied to the per-group
partial sums; per-channel weight scales and per-row activation scales in the
epilogue. With ``split_k > 1`` the kernel writes raw partial sums and the
(tiny) epilogue runs in XLA after the sum over splits. Measured behaviour and
limits: benchmarks/RESULTS.md (figures) and docs/performance-history.md ("Pallas kernels vs XLA").

:mod:`binary_matmul`, :mod:`nbit_matmul` and :mod:`int8_matmul` hold the
public configs, wrappers and references.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from qtrain.kernels import _asm
from qtrain.kernels import _common

WFormat = Literal["packed", "dense"]
AFormat = Literal["float", "int8", "binary"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """Tiling of one kernel launch.

  Attributes:
    block_m: rows of the activation per program (power of two, >= 16).
    block_n: output channels per program (power of two, >= 16).
    split_k: number of programs that share one output tile along K (their
      partial sums are added by XLA); > 1 fills the GPU at small M.
    block_k: None (small-M path: each packed K tile is decoded one plane at
      a time, every plane a dot, the word tile loaded once), or K values per
      dot for the flat large-M path (a multiple of plane_k dividing the K
      tile: each iteration decodes block_k // plane_k slots into one operand
      and runs one dot; one load per operand per iteration keeps Triton's
      pipelining buffers within shared memory).
    decode16: for bf16/f16 activations, build the decoded weights as 16-bit
      float bit patterns (no float32 detour and no float conversion).
    byte_decode: for int8/binary activations on the small-M path, decode
      from the words' bytes with int8 ops, each field moved to the top bits
      (value * 2**(8 - bits)); the exact scale-back is a final shift.
    asm: on the GPU, decode packed binary/int2/int4 weights on the small-M
      path with the inline-PTX decoders of :mod:`qtrain.kernels._asm` (two or
      four values per instruction; the same bits as the jnp decoders, which
      interpret mode always uses).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the K loop.
  """

  block_m: int = 16
  block_n: int = 64
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  block_k: int | None = None
  decode16: bool = True
  byte_decode: bool = True
  asm: bool = True

  def __post_init__(self):
    for name in ("block_m", "block_n"):
      v = getattr(self, name)
      if not _common.is_pow2(v) or v < 16:
        raise ValueError(f"{name}={v} must be a power of two >= 16")
    if self.split_k < 1:
      raise ValueError(f"split_k={self.split_k} must be >= 1")
    if self.block_k is not None and (not _common.is_pow2(self.block_k) or self.block_k < 16):
      raise ValueError(f"block_k={self.block_k} must be None or a power of two >= 16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSpec:
  """Static description of the operands (internal).

  Attributes:
    w_format: "packed" (int32 words in the plane layout) or "dense" (int8).
    w_bits: bits per weight value (1 for binary, 2, 4 or 8).
    w_binary: weights are binary (+-1) codes.
    a_format: "float" (bf16/f16/f32), "int8", or "binary" (int32 words in
      the plane layout, same plane_words as the weights).
    plane_k: K values per plane (= words per plane for packed weights).
    planes: planes per K tile (32 // w_bits for packed weights).
    group_planes: planes per scale group, or None (per-channel scales).
    has_zero: group zero points are present.
    kn: weights stored transposed, (K words, N): the decoded plane is the
      dot's (K, N) operand directly (no transpose before the dot).
    decode16: 16-bit pattern decoders for bf16/f16 activations.
    byte_decode: int8 "field to top bits" decoders (see BlockConfig).
    asm: inline-PTX decoders (:mod:`qtrain.kernels._asm`; GPU only).
  """

  w_format: WFormat
  w_bits: int
  w_binary: bool
  a_format: AFormat
  plane_k: int
  planes: int
  group_planes: int | None = None
  has_zero: bool = False
  kn: bool = False
  decode16: bool = False
  byte_decode: bool = False
  asm: bool = False

  @property
  def block_k(self) -> int:
    return self.plane_k * self.planes

  @property
  def acc_dtype(self):
    return jnp.float32 if (self.a_format == "float" or self.group_planes) else jnp.int32

  @property
  def dot_dtype(self):
    return jnp.float32 if self.a_format == "float" else jnp.int32

  @property
  def byte_shift(self) -> int:
    """log2 of the factor byte decoding multiplies each weight by (0 if off)."""
    if not self.byte_decode or self.w_format != "packed" or self.a_format == "float":
      return 0
    return 8 - self.w_bits

  @property
  def bits_trick(self) -> bool:
    """Binary weights decoded as {0, 1} bits; the epilogue does 2*acc - rowsum(a)."""
    return self.w_binary and self.a_format != "float"


def _decode(words, s, spec: KernelSpec, a_dtype):
  """Decoded weights of slot(s) ``s`` of ``words`` (``~words`` for binary x float)."""
  if spec.w_binary:
    if spec.a_format != "float":
      return _common.decode_binary_to_bits_int8(words, s)
    if spec.decode16 and _common.has_16bit_decode(a_dtype, 1):
      return _common.decode_binary_to_16bit(words, s, a_dtype)
    return _common.decode_binary_to_float(words, s, a_dtype)
  if spec.a_format != "float":
    return _common.decode_int_to_int8(words, s, spec.w_bits)
  if spec.decode16 and _common.has_16bit_decode(a_dtype, spec.w_bits):
    return _common.decode_int_to_16bit(words, s, spec.w_bits, a_dtype)
  return _common.decode_int_to_float(words, s, spec.w_bits, a_dtype)


def _w_slice(w_ref, start, size, kn: bool):
  """Rows [start, start + size) of the weights' K (words) axis."""
  return w_ref[pl.ds(start, size), :] if kn else w_ref[:, pl.ds(start, size)]


def _dims(kn: bool):
  return (((1,), (0,)), ((), ())) if kn else (((1,), (1,)), ((), ()))


def _dot(a, w, dims, out_dtype):
  """Tensor-core dot; float32 operands get an IEEE dot (Triton would use TF32)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, w, dims, preferred_element_type=out_dtype, precision=prec)


def _decode_weight_plane(w_tile, w_ref, k0, s: int, spec: KernelSpec, a_dtype):
  """One (block_n, plane_k) plane of decoded weights ((plane_k, block_n) if kn)."""
  if spec.w_format == "dense":
    w = _w_slice(w_ref, k0, spec.plane_k, spec.kn)
    return w if spec.a_format != "float" else w.astype(a_dtype)
  return _decode(w_tile, s, spec, a_dtype)


def _unpack_refs(refs, *, spec: KernelSpec, has_w_scale: bool, has_a_scale: bool, final: bool):
  """Names the kernel refs; the order the wrapper passes them in, written once:
  a, w, [w_scale], [g_scale], [g_zero], [a_scale], [rowsum], out (None where absent)."""
  it = iter(refs)
  a_ref, w_ref = next(it), next(it)
  ws_ref = next(it) if has_w_scale else None
  gs_ref = next(it) if spec.group_planes else None
  gz_ref = next(it) if spec.has_zero else None
  as_ref = next(it) if has_a_scale else None
  rs_ref = next(it) if (spec.bits_trick and final) else None
  o_ref = next(it)
  return a_ref, w_ref, ws_ref, gs_ref, gz_ref, as_ref, rs_ref, o_ref


def qmatmul_kernel(*refs, spec: KernelSpec, num_tiles: int, split_k: int,
                   has_w_scale: bool, has_a_scale: bool, final: bool):
  """Kernel body. Refs, in order: a, w, [w_scale (1,bn)], [g_scale (G,bn)],
  [g_zero (G,bn)], [a_scale (bm,1)], [rowsum (bm,1)], out."""
  a_ref, w_ref, ws_ref, gs_ref, gz_ref, as_ref, rs_ref, o_ref = _unpack_refs(
      refs, spec=spec, has_w_scale=has_w_scale, has_a_scale=has_a_scale, final=final)
  bm, bn = a_ref.shape[0], w_ref.shape[1 if spec.kn else 0]
  pk, block_k = spec.plane_k, spec.block_k
  a_dtype = a_ref.dtype

  tiles_per_split = _common.cdiv(num_tiles, split_k)
  t0 = pl.program_id(2) * tiles_per_split
  t1 = jnp.minimum(t0 + tiles_per_split, num_tiles)
  dims = _dims(spec.kn)

  def body(t, acc):
    w_tile = a_tile = None
    if spec.w_format == "packed":
      w_tile = _w_slice(w_ref, t * pk, pk, spec.kn)
      if spec.w_binary and spec.a_format == "float" and not spec.asm:
        w_tile = ~w_tile
    if spec.a_format == "binary":
      a_tile = a_ref[:, pl.ds(t * pk, pk)]
    gacc = zacc = None
    per_byte = 8 // spec.w_bits
    byte = None
    for s in range(spec.planes):
      k0 = t * block_k + s * pk
      if spec.a_format == "binary":
        a = _common.decode_binary_to_pm1_int8(a_tile, s)
      else:
        a = a_ref[:, pl.ds(k0, pk)]
      if spec.asm:
        w = _asm.decode_slot(w_tile, s, w_binary=spec.w_binary, w_bits=spec.w_bits,
                             a_format=spec.a_format, a_dtype=a_dtype)
      elif spec.byte_shift:
        if s % per_byte == 0:
          byte = _common.word_byte(w_tile, s // per_byte)
        w = _common.byte_slot_to_top(byte, s % per_byte, spec.w_bits)
      else:
        w = _decode_weight_plane(w_tile, w_ref, k0, s, spec, a_dtype)
      d = _dot(a, w, dims, spec.dot_dtype)
      if not spec.group_planes:
        acc = acc + d
        continue
      gacc = d if gacc is None else gacc + d
      if spec.has_zero:
        rs = jnp.sum(a.astype(spec.dot_dtype), axis=1)
        zacc = rs if zacc is None else zacc + rs
      if (s + 1) % spec.group_planes == 0:
        gi = t * (spec.planes // spec.group_planes) + s // spec.group_planes
        part = _unscale(gacc, spec).astype(jnp.float32)
        if spec.has_zero:
          part = part - zacc.astype(jnp.float32)[:, None] * gz_ref[pl.ds(gi, 1), :]
        acc = acc + part * gs_ref[pl.ds(gi, 1), :]
        gacc = zacc = None
    return acc

  acc = lax.fori_loop(t0, t1, body, jnp.zeros((bm, bn), spec.acc_dtype))
  if not spec.group_planes:
    acc = _unscale(acc, spec)
  _write_out(acc, o_ref, rs_ref, as_ref, ws_ref, spec=spec, final=final,
             has_a_scale=has_a_scale, has_w_scale=has_w_scale)


def _write_out(acc, o_ref, rs_ref, as_ref, ws_ref, *, spec: KernelSpec, final: bool,
               has_a_scale: bool, has_w_scale: bool):
  """The epilogue both loop shapes share: the raw accumulator for a split-K
  partial, else the +-1 correction and the activation / weight scales."""
  if not final:
    o_ref[...] = acc
    return
  if spec.bits_trick:
    acc = 2 * acc - rs_ref[...]
  out = _scale(acc.astype(jnp.float32), as_ref[...] if has_a_scale else None,
               ws_ref[...] if has_w_scale else None)
  o_ref[...] = out.astype(o_ref.dtype)


def _scale(acc, a_scale, w_scale):
  """``(acc * a_scale) * w_scale``, the order of :func:`qtrain.core.qdot.scale_product`
  (same bits), with its fallback ``acc * (a_scale * w_scale)`` where the first is
  not finite (one huge scale times a small one)."""
  out = acc
  if a_scale is not None:
    out = out * a_scale
  if w_scale is not None:
    out = out * w_scale
  if a_scale is not None and w_scale is not None:
    out = jnp.where(jnp.isfinite(out), out, acc * (a_scale * w_scale))
  return out


def _unscale(acc, spec: KernelSpec):
  """Undoes byte decoding's 2**(8 - bits) factor exactly (binary: factor -128)."""
  sh = spec.byte_shift
  if not sh:
    return acc
  out = acc >> jnp.int32(sh)  # exact: every term is a multiple of 2**sh
  return -out if spec.w_binary else out


def _decode_weight_chunk(words, lane, base, spec: KernelSpec, a_dtype):
  """Decodes slots ``base + [0, c)`` of a word tile into one operand, K in order.

  (bn, plane_k) words -> (bn, c * plane_k); with ``kn``, (plane_k, bn) ->
  (c * plane_k, bn). ``lane`` is arange(c) as int32.
  """
  if spec.w_binary and spec.a_format == "float":
    words = ~words
  if spec.kn:
    d = _decode(words[None, :, :], (base + lane)[:, None, None], spec, a_dtype)
    return d.reshape(-1, words.shape[1])
  d = _decode(words[:, None, :], (base + lane)[None, :, None], spec, a_dtype)
  return d.reshape(words.shape[0], -1)


def qmatmul_flat_kernel(*refs, spec: KernelSpec, block_k: int, num_chunks: int, split_k: int,
                        has_w_scale: bool, has_a_scale: bool, final: bool):
  """Large-M kernel body: one (bm, block_k) x (bn, block_k) dot per iteration.

  Iteration c covers K values [c * block_k, (c + 1) * block_k): the slots
  ``(c % chunks_per_tile) * cs + [0, cs)`` of K tile ``c // chunks_per_tile``
  (cs = block_k // plane_k). In the plane layout those slots, broadcast
  against the (bn, plane_k) word tile and flattened, are exactly that K range
  in order. Refs as in :func:`qmatmul_kernel` (packed weights only).
  """
  a_ref, w_ref, ws_ref, gs_ref, gz_ref, as_ref, rs_ref, o_ref = _unpack_refs(
      refs, spec=spec, has_w_scale=has_w_scale, has_a_scale=has_a_scale, final=final)
  bm, bn = a_ref.shape[0], w_ref.shape[1 if spec.kn else 0]
  pk = spec.plane_k
  cs = block_k // pk
  cpt = spec.planes // cs
  group = spec.group_planes * pk if spec.group_planes else None
  per_split = _common.cdiv(num_chunks, split_k)
  c0 = pl.program_id(2) * per_split
  c1 = jnp.minimum(c0 + per_split, num_chunks)
  dims = _dims(spec.kn)
  lane = jnp.arange(cs, dtype=jnp.int32)

  def body(c, acc):
    t = c // cpt
    base = (c % cpt) * cs
    words = _w_slice(w_ref, t * pk, pk, spec.kn)
    if spec.a_format == "binary":
      a = _common.decode_binary_to_pm1_int8(a_ref[:, pl.ds(t * pk, pk)][:, None, :],
                                            (base + lane)[None, :, None])
      a = a.reshape(bm, block_k)
    else:
      a = a_ref[:, pl.ds(c * block_k, block_k)]
    w = _decode_weight_chunk(words, lane, base, spec, a_ref.dtype)
    d = _dot(a, w, dims, spec.dot_dtype)
    if not group:
      return acc + d
    gi = (c * block_k) // group
    part = d.astype(jnp.float32)
    if spec.has_zero:
      rs = jnp.sum(a.astype(spec.dot_dtype), axis=1).astype(jnp.float32)
      part = part - rs[:, None] * gz_ref[pl.ds(gi, 1), :]
    return acc + part * gs_ref[pl.ds(gi, 1), :]

  acc = lax.fori_loop(c0, c1, body, jnp.zeros((bm, bn), spec.acc_dtype))
  _write_out(acc, o_ref, rs_ref, as_ref, ws_ref, spec=spec, final=final,
             has_a_scale=has_a_scale, has_w_scale=has_w_scale)


def epilogue_reference(acc, *, rowsum=None, a_scale=None, w_scale=None, out_dtype):
  """The kernel's epilogue in jnp (same operation order); also used after split-K."""
  if rowsum is not None:
    acc = 2 * acc - rowsum
  return _scale(acc.astype(jnp.float32), a_scale, w_scale).astype(out_dtype)


def qmatmul(a: jax.Array, w: jax.Array, *, spec: KernelSpec, k: int,
            w_scale: jax.Array | None, g_scale: jax.Array | None,
            g_zero: jax.Array | None, a_scale: jax.Array | None,
            rowsum: jax.Array | None, out_dtype, config: BlockConfig,
            interpret: bool, name: str) -> jax.Array:
  """Runs the generic kernel on prepared operands.

  Args:
    a: activations (M, Ka): float/int8 with Ka >= K (padded with zeros to the
      weights' padded K here), or binary plane-layout words.
    w: weights (Np, Kw): plane-layout int32 words or dense int8, Np padded;
      (Kw, Np) when ``spec.kn``.
    spec: operand description.
    k: the true contracting size.
    w_scale: (1, Np) float32 per-channel scale or None.
    g_scale: (G, Np) float32 group scales or None; g_zero likewise.
    a_scale: (M, 1) float32 per-row activation scale or None.
    rowsum: (M, 1) row sums of ``a`` over the true K (needed when
      ``spec.bits_trick``), int32 for int8/binary activations.
    out_dtype: output dtype.
    config: tiling.
    interpret: run the Pallas interpreter (CPU tests).
    name: kernel name for profiles.

  Returns:
    (M, Np) array of ``out_dtype``.
  """
  m = a.shape[0]
  n_pad, kw = (w.shape[1], w.shape[0]) if spec.kn else w.shape
  bm, bn = config.block_m, config.block_n
  if n_pad % bn:
    raise ValueError(f"{n_pad=} (padded N) must be a multiple of block_n={bn}")
  block_k = spec.block_k
  kp = kw if spec.w_format == "dense" else kw // spec.plane_k * block_k
  num_tiles = kp // block_k
  if kp % block_k or kp < k:
    raise ValueError(f"padded K {kp} does not fit {k=} and block_k={block_k}")
  m_pad = _common.round_up(max(m, 1), bm)
  a_cols = kw if spec.a_format == "binary" else kp
  if a.shape[1] > a_cols:
    raise ValueError(f"activation K {a.shape[1]} exceeds the weights' padded K {a_cols}")
  if (m_pad, a_cols) != a.shape:
    a = jnp.pad(a, ((0, m_pad - m), (0, a_cols - a.shape[1])))

  def rows(x):
    return x if x.shape[0] == m_pad else jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0)))

  grid = (m_pad // bm, n_pad // bn, config.split_k)
  final = config.split_k == 1
  w_spec = (pl.BlockSpec((kw, bn), lambda i, j, s: (0, j)) if spec.kn
            else pl.BlockSpec((bn, kw), lambda i, j, s: (j, 0)))
  in_specs = [pl.BlockSpec((bm, a_cols), lambda i, j, s: (i, 0)), w_spec]
  args = [a, w]
  if w_scale is not None and final:
    in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))
    args.append(w_scale)
  for g in (g_scale, g_zero):
    if g is not None:
      in_specs.append(pl.BlockSpec((g.shape[0], bn), lambda i, j, s: (0, j)))
      args.append(g)
  if a_scale is not None and final:
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))
    args.append(rows(a_scale))
  if spec.bits_trick and final:
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))
    args.append(rows(rowsum.astype(spec.acc_dtype)))
  if final:
    out_shape = _common.out_struct((m_pad, n_pad), out_dtype, *args)
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
  else:
    gn = n_pad // bn
    out_shape = _common.out_struct((m_pad, config.split_k * n_pad), spec.acc_dtype, *args)
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, s * gn + j))
  flags = dict(split_k=config.split_k, has_w_scale=w_scale is not None and final,
               has_a_scale=a_scale is not None and final, final=final)
  bk_flat = config.block_k
  spec = dataclasses.replace(spec, decode16=config.decode16,
                             byte_decode=config.byte_decode and config.block_k is None)
  if (config.asm and not interpret and spec.w_format == "packed" and bk_flat is None
      and _asm.supports(w_binary=spec.w_binary, w_bits=spec.w_bits, a_format=spec.a_format,
                        a_dtype=a.dtype, byte_shift=spec.byte_shift)):
    spec = dataclasses.replace(spec, asm=True)
  if bk_flat is not None and spec.w_format == "packed":
    if spec.group_planes:
      bk_flat = min(bk_flat, spec.group_planes * spec.plane_k)
    if bk_flat % spec.plane_k or spec.planes % (bk_flat // spec.plane_k):
      raise ValueError(f"block_k={bk_flat} must be a multiple of plane_k={spec.plane_k} "
                       f"dividing the K tile {block_k}")
    kernel = functools.partial(qmatmul_flat_kernel, spec=spec, block_k=bk_flat,
                               num_chunks=kp // bk_flat, **flags)
  else:
    kernel = functools.partial(qmatmul_kernel, spec=spec, num_tiles=num_tiles, **flags)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=_common.triton_params(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*args)
  if not final:
    acc = out.reshape(m_pad, config.split_k, n_pad).sum(axis=1)
    out = epilogue_reference(
        acc, rowsum=rows(rowsum.astype(acc.dtype)) if spec.bits_trick else None,
        a_scale=None if a_scale is None else rows(a_scale),
        w_scale=w_scale, out_dtype=out_dtype)
  return out[:m]


# ---------------------------------------------------------------------------
# Block-config selection shared by the public kernels.
# ---------------------------------------------------------------------------

M_BUCKETS = (16, 64, 512, 4096)


def m_bucket(m: int) -> int:
  """The measured-table bucket of M: the smallest of M_BUCKETS >= m (else the largest)."""
  for b in M_BUCKETS:
    if m <= b:
      return b
  return M_BUCKETS[-1]


def heuristic_config(m: int, n_pad: int, num_tiles: int, *, sms: int = 132) -> BlockConfig:
  """A reasonable config when the measured table has no entry.

  Small M: block_m = 16/32/64 and enough split-K to put ~2 programs on each
  of the GPU's ``sms`` multiprocessors (weights stream from HBM). Large M:
  128 x 128 tiles.
  """
  if m <= 16:
    # block_n = 128 measured best at M = 16 for every packed kernel with the
    # inline-PTX decoders (docs/performance-history.md, "Inline-PTX decoders").
    bn = next((b for b in (128, 64) if n_pad % b == 0), 16)
    split = 1
    programs = n_pad // bn
    while programs * split < 2 * sms and num_tiles // (split * 2) >= 4:
      split *= 2
    return BlockConfig(block_m=16, block_n=bn, split_k=split, num_warps=4, num_stages=3)
  if m <= 64:
    # The plane path's 32 separate activation loads per K tile, pipelined,
    # overflow shared memory at block_m = 64 (measured): use the flat path.
    bn = 128 if n_pad % 128 == 0 else 16
    return BlockConfig(block_m=_common.round_up(m, 16) if m <= 32 else 64, block_n=bn,
                       num_warps=4, num_stages=3, block_k=64)
  bn = 128 if n_pad % 128 == 0 else 16
  return BlockConfig(block_m=128, block_n=bn, split_k=1, num_warps=8, num_stages=3, block_k=128)


def select_config(table: dict, key: tuple, m: int, n_pad: int, num_tiles: int) -> BlockConfig:
  """Measured config for ``key + (m_bucket(m),)`` if present and valid, else the heuristic."""
  cfg = table.get(key + (m_bucket(m),))
  if cfg is not None and n_pad % cfg.block_n == 0:
    return cfg
  return heuristic_config(m, n_pad, num_tiles)


def as_row_scale(scale, m: int) -> jax.Array | None:
  """Per-row (M,), (M, 1) or scalar activation scale as float32 (M, 1); None stays None."""
  if scale is None:
    return None
  s = jnp.asarray(scale, jnp.float32).reshape(-1)
  if s.shape[0] not in (1, m):
    raise ValueError(f"activation scale has {s.shape[0]} entries; expected 1 or {m=}")
  return jnp.broadcast_to(s, (m,))[:, None]
