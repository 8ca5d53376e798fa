"""Mosaic GPU (Hopper wgmma + TMA) 8-bit GEMM for large M, scales fused.

``out = ((a @ b.T) as f32 * a_scale[:, None]) * b_scale[None, :]`` cast to
``out_dtype``, with ``a`` (M, K) and ``b`` (N, K) of one 8-bit dtype
(:data:`OPERAND_DTYPES`: int8, accumulated in int32, exact; or one fp8 dtype,
accumulated by the fp8 tensor cores into float32 registers with fewer bits per
addition, docs/findings.md "The Mosaic GEMM on fp8"), both K-contiguous (what
8-bit wgmma reads). This is the product every int8 GEMM of a quantized training step
computes (forward and both backward products), and the fp8 forward's
(e4m3 x e4m3; wgmma takes one element type for both operands, so e5m2 x e4m3
gradient products are not its). XLA runs it as cuBLAS's GEMM, whose int32 /
float32 output a separate pass converts and scales; here the epilogue does
that in registers and the kernel writes the scaled bf16/f16/f32 output
directly:

* a persistent grid (one CTA per SM) walks the (M, N) output tiles in a
  snake order (``config.grid_minor`` / ``config.snake``: neighbouring CTAs
  share operand tiles in L2);
* a warp-specialized pipeline (one producer warpgroup issuing TMA copies,
  two consumer warpgroups, ``config.steps`` stages in flight) streams the
  a and b tiles of ``config.tile_k`` columns; each consumer warpgroup
  accumulates its (tile_m, tile_n) part with wgmma (int32 for int8: exact;
  float32 for fp8);
* the epilogue converts, scales in the order of
  :func:`qtrain.core.qdot.scale_product` (for int8 the XLA path's numbers, bit
  for bit), casts, and stores through shared memory with TMA.

Shapes must tile: M by the CTA's rows, N by its columns, K by ``tile_k``
(:func:`checked_config` names what does not; :mod:`qtrain.ops.dispatch`
then runs XLA under ``implementation="auto"``).

Needs a Hopper GPU and jax >= 0.11 (Pallas Mosaic GPU); tests run it on the
GPU only.

Example (GPU)::

  a = jax.random.randint(k1, (8192, 4096), -127, 128, jnp.int8)
  b = jax.random.randint(k2, (16384, 4096), -127, 128, jnp.int8)
  out = mosaic_gemm(a, b, a_scale=sa, b_scale=sb, out_dtype=jnp.bfloat16)  # (8192, 16384)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from qtrain.kernels import _common
from qtrain.kernels.mosaic_matmul import SMEM_BYTES, UnsupportedCall

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
OPERAND_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
TILE_MS = (64, 128)  # rows per consumer warpgroup (one or two wgmma M=64 instructions)
TILE_NS = (64, 128, 256)  # columns per consumer warpgroup (wgmma N)
TILE_KS = (64, 128, 256)
AXES = ("m", "n")
_WGS = 2  # consumer warpgroups per CTA
# int32 accumulation is exact while K * 128 * 128 < 2**31 (int8 operands; fp8 ones accumulate
# in float32 and take any K)
MAX_K = (2**31 - 1) // (128 * 128)
_EPI = 64  # epilogue block edge
_ACC_REGS = 128 * 128  # int32 accumulator elements per warpgroup that leave room for the epilogue


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig:
  """Tiling of :func:`mosaic_gemm`.

  Attributes:
    tile_m, tile_n: the (rows, columns) each consumer warpgroup accumulates
      (``tile_m * tile_n`` <= 16384 int32 registers' worth).
    tile_k: K columns per pipeline step.
    steps: pipeline stages in flight (2-8; shared memory bounds it).
    wg_axis: "m" or "n": the two consumer warpgroups split the CTA tile along
      this axis (the CTA tile is ``(2 * tile_m, tile_n)`` or ``(tile_m, 2 * tile_n)``).
    grid_minor: "m" or "n": the output-tile walk's minor axis.
    snake: width of the walk's bands along ``grid_minor`` (L2 reuse).

  The epilogue stores (64, 64) blocks through two shared-memory slots per
  warpgroup (64 rows: one wgmma row tile; smaller blocks have no layout).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  steps: int = 4
  wg_axis: str = "n"
  grid_minor: str = "n"
  snake: int = 8

  def __post_init__(self):
    for name, valid in (("tile_m", TILE_MS), ("tile_n", TILE_NS), ("tile_k", TILE_KS)):
      if getattr(self, name) not in valid:
        raise ValueError(f"{name}={getattr(self, name)}; valid: {valid}")
    if self.tile_m * self.tile_n > _ACC_REGS:
      raise ValueError(f"tile_m * tile_n = {self.tile_m * self.tile_n} int32 accumulators per "
                       f"warpgroup; at most {_ACC_REGS}")
    if not 2 <= self.steps <= 8:
      raise ValueError(f"steps={self.steps}; valid: 2..8")
    for name in ("wg_axis", "grid_minor"):
      if getattr(self, name) not in AXES:
        raise ValueError(f"{name}={getattr(self, name)!r}; valid: {AXES}")
    if self.snake < 1:
      raise ValueError(f"snake={self.snake} must be >= 1")

  @property
  def cta_m(self) -> int:
    return self.tile_m * (_WGS if self.wg_axis == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (_WGS if self.wg_axis == "n" else 1)


def smem_bytes(cfg: GemmConfig, out_dtype=jnp.bfloat16) -> int:
  """Shared memory :func:`mosaic_gemm` allocates: ``steps`` a + b tiles and the epilogue slots."""
  stage = (cfg.cta_m + cfg.cta_n) * cfg.tile_k
  return cfg.steps * stage + _WGS * 2 * _EPI**2 * jnp.dtype(out_dtype).itemsize


def default_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16,
                   num_sms: int | None = None) -> GemmConfig:
  """Measured default (docs/performance-history.md, "Mosaic int8 GEMM", H200): (128, 256)
  CTA tiles; (128, 128) where the larger tiles would leave more than half of the SMs
  without a tile (M = 512 at K = N = 4096: 16.7 against 26.5 µs); the deepest
  pipeline (at most 4 steps) that fits in shared memory with ``out_dtype``."""
  del k
  sms = num_sms or _common.num_sms()
  base = GemmConfig()
  if (m // base.cta_m) * (n // base.cta_n) <= sms // 2 and n % (base.cta_n // 2) == 0:
    base = GemmConfig(tile_n=base.tile_n // 2)
  for steps in range(4, 1, -1):
    cfg = dataclasses.replace(base, steps=steps)
    if smem_bytes(cfg, out_dtype) <= SMEM_BYTES:
      return cfg
  raise AssertionError("unreachable: two steps of the default tiles always fit")


def checked_config(a: jax.Array, b: jax.Array, config: GemmConfig | None = None,
                   out_dtype=jnp.bfloat16) -> GemmConfig:
  """The config :func:`mosaic_gemm` would run with; ValueError for operands that
  are not (M, K) x (N, K) of one dtype of :data:`OPERAND_DTYPES`,
  :class:`UnsupportedCall` for shapes the kernel cannot tile."""
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"a and b must be (M, K) and (N, K); got {a.shape} and {b.shape}")
  if a.dtype != b.dtype or jnp.dtype(a.dtype) not in OPERAND_DTYPES:
    raise ValueError(f"a and b must have one dtype of {[str(d) for d in OPERAND_DTYPES]} "
                     f"(wgmma reads one element type); got {a.dtype} and {b.dtype}")
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f"out_dtype={jnp.dtype(out_dtype)}; valid: {[str(d) for d in OUT_DTYPES]}")
  (m, k), n = a.shape, b.shape[0]
  if a.dtype == jnp.int8 and k > MAX_K:
    raise UnsupportedCall(f"K={k} could overflow the int32 accumulator; the kernel takes K <= {MAX_K}")
  cfg = config or default_config(m, n, k, out_dtype)
  if m % cfg.cta_m or n % cfg.cta_n or k % cfg.tile_k:
    raise UnsupportedCall(f"(M, N, K) = {(m, n, k)} does not tile by the CTA's {(cfg.cta_m, cfg.cta_n)} "
                          f"and tile_k={cfg.tile_k}: M, N and K must be multiples of them")
  need = smem_bytes(cfg, out_dtype)
  if need > SMEM_BYTES:
    raise UnsupportedCall(f"{cfg} needs {need} bytes of shared memory (limit {SMEM_BYTES}); use "
                          f"fewer steps or smaller tiles")
  return cfg


def check_call(a: jax.Array, b: jax.Array, config: GemmConfig | None = None,
               out_dtype=jnp.bfloat16) -> GemmConfig:
  """:func:`checked_config`, and a ValueError off a GPU or on jax < 0.11: every check
  :func:`mosaic_gemm` makes before it runs (the backend's forced path makes them too)."""
  cfg = checked_config(a, b, config, out_dtype)
  if not _common.on_gpu():
    raise ValueError(f"the Mosaic GEMM runs on a GPU; this backend is {jax.default_backend()!r}")
  if jax.__version_info__ < (0, 11):
    raise ValueError(f"the Mosaic GEMM needs jax >= 0.11 (Pallas Mosaic GPU); this is jax {jax.__version__}")
  return cfg


def acc_dtype(dtype) -> jnp.dtype:
  """The wgmma accumulator for operands of ``dtype``: int32 for int8, float32 for fp8."""
  return jnp.dtype(jnp.int32 if jnp.dtype(dtype) == jnp.int8 else jnp.float32)


def _as_vector(s, size: int, what: str) -> jax.Array:
  if s is None:
    return jnp.ones((size,), jnp.float32)
  s = jnp.asarray(s, jnp.float32)
  if s.size not in (1, size):
    raise ValueError(f"{what} has {s.size} entries; expected 1 or {size}")
  return jnp.broadcast_to(s.reshape(-1), (size,))


def mosaic_gemm(a: jax.Array, b: jax.Array, *, a_scale=None, b_scale=None,
                out_dtype=jnp.bfloat16, config: GemmConfig | None = None) -> jax.Array:
  """``((a @ b.T) * a_scale[:, None]) * b_scale[None, :]`` on a Hopper GPU.

  Args:
    a: (M, K) int8, float8_e4m3fn or float8_e5m2.
    b: (N, K) of a's dtype.
    a_scale: None, a scalar or (M,) per-row scales.
    b_scale: None, a scalar or (N,) per-column scales.
    out_dtype: bfloat16, float16 or float32.
    config: a :class:`GemmConfig`; default :func:`default_config`.

  Returns:
    (M, N) ``out_dtype``: the product (int8: exact in int32; fp8: accumulated by
    the tensor cores, not bit for bit cuBLAS's), converted and scaled in float32
    as :func:`mosaic_gemm_reference`.
  """
  return _gemm(a, b, a_scale, b_scale, out_dtype, check_call(a, b, config, out_dtype))


def mosaic_gemm_reference(a: jax.Array, b: jax.Array, *, a_scale=None, b_scale=None,
                          out_dtype=jnp.bfloat16) -> jax.Array:
  """Pure-jnp reference: the product in the accumulator dtype (int8: int32, fp8: float32),
  then ``(acc * a_scale) * b_scale`` in f32."""
  acc = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=acc_dtype(a.dtype))
  sa = _as_vector(a_scale, a.shape[0], "a_scale")
  sb = _as_vector(b_scale, b.shape[0], "b_scale")
  return (acc.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(out_dtype)


def _gemm(a, b, a_scale, b_scale, out_dtype, cfg: GemmConfig) -> jax.Array:
  """:func:`mosaic_gemm` after its checks (traceable off a GPU)."""
  sa = _as_vector(a_scale, a.shape[0], "a_scale")
  sb = _as_vector(b_scale, b.shape[0], "b_scale")
  return _kernel(a, b, sa, sb, cfg=cfg, out_dtype=jnp.dtype(out_dtype))


# ----------------------------------------------------------------------------
# The kernel (Pallas Mosaic GPU; imported lazily: jax 0.10 has an older API).


# A jit boundary per (shapes, config): every call of one kernel shape then shares one
# traced jaxpr, and JAX lowers a repeated jitted jaxpr once per module. Lowering a Mosaic
# GPU kernel takes ~0.5 s of Python; a transformer's step calls each shape once per layer
# and product (74 lowerings for a 4-block decoder: 35 of its 46 s of lowering).
@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype"))
def _kernel(a, b, sa, sb, *, cfg: GemmConfig, out_dtype) -> jax.Array:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  (m, k), n = a.shape, b.shape[0]
  tm, tn, tk, epi = cfg.tile_m, cfg.tile_n, cfg.tile_k, _EPI
  m_tiles, n_tiles, k_steps = m // cfg.cta_m, n // cfg.cta_n, k // tk
  minor = AXES.index(cfg.grid_minor)

  in_sw = plgpu.find_swizzle(tk * 8, "8-bit operand")
  in_tr = (plgpu.TilingTransform((8, in_sw)), plgpu.SwizzleTransform(in_sw))
  o_bits = out_dtype.itemsize * 8
  o_sw = plgpu.find_swizzle(epi * o_bits, "output")
  o_tr = (plgpu.TilingTransform((8, o_sw * 8 // o_bits)), plgpu.SwizzleTransform(o_sw))

  def body(a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, o_smem):
    def pipeline(step, context):
      return plgpu.emit_pipeline_warp_specialized(
          step, grid=(k_steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((cfg.cta_m, tk), lambda kk: (0, kk), transforms=in_tr,
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((cfg.cta_n, tk), lambda kk: (0, kk), transforms=in_tr,
                                    memory_space=plgpu.SMEM)],
          wg_axis="wg", num_compute_wgs=_WGS, max_concurrent_steps=cfg.steps,
          compute_context=context)

    unused = lambda *_, **__: None

    @functools.partial(pl.run_scoped,
                       allocs=pipeline(unused, unused).get_allocations(a_gmem, b_gmem),
                       collective_axes="wg")
    def _scope(allocs):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tile(info):
        (lin,) = info.index
        mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), minor, cfg.snake)
        cta_rows = pl.ds(mi * cfg.cta_m, cfg.cta_m)
        cta_cols = pl.ds(ni * cfg.cta_n, cfg.cta_n)
        if cfg.wg_axis == "m":
          wg_rows, wg_cols = pl.ds(wg * tm, tm), slice(None)
          row0, col0 = mi * cfg.cta_m + wg * tm, ni * cfg.cta_n
        else:
          wg_rows, wg_cols = slice(None), pl.ds(wg * tn, tn)
          row0, col0 = mi * cfg.cta_m, ni * cfg.cta_n + wg * tn

        def context(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), acc_dtype(a.dtype)))
          def _acc(acc):
            run(acc)
            ra = plgpu.load(sa_gmem.at[pl.ds(row0, tm)], layout=plgpu.Layout.WGMMA.reduce(1),
                            optimized=False)
            rb = plgpu.load(sb_gmem.at[pl.ds(col0, tn)], layout=plgpu.Layout.WGMMA.reduce(0),
                            optimized=False)
            out = (acc[...].astype(jnp.float32) * ra[:, None] * rb[None, :]).astype(out_dtype)
            for ei in range(tm // epi):
              for ej in range(tn // epi):
                slot = (ei * (tn // epi) + ej) % 2
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last copy is done
                o_smem[wg, slot] = out[ei * epi:(ei + 1) * epi, ej * epi:(ej + 1) * epi]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg, slot],
                    o_gmem.at[pl.ds(row0 + ei * epi, epi), pl.ds(col0 + ej * epi, epi)])

        def step(_, a_smem, b_smem, acc):
          plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem.at[wg_cols].transpose((1, 0)))
          plgpu.wgmma_wait(0)  # the slot is released when the step returns
          return acc

        pipeline(step, context)(a_gmem.at[cta_rows], b_gmem.at[cta_cols], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(
      body, out_type=_common.out_struct((m, n), out_dtype, a, b, sa, sb),
      grid=(min(_common.num_sms(), m_tiles * n_tiles),), grid_names=("sm",),
      num_threads=_WGS + 1, thread_name="wg",
      scratch_types=dict(o_smem=plgpu.SMEM((_WGS, 2, epi, epi), out_dtype, transforms=o_tr)))
  return _common.varying_like(call(a, b, sa, sb), a, b, sa, sb)
