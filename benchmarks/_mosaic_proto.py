import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def _tiles(bits, minor_elems, what):
  sw = plgpu.find_swizzle(minor_elems * bits, what)
  return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))

def wmm(w, xt, *, tile_k=256, steps=4, num_sms=132, split=1, delay=0):
  """(Np, K) int8/int4 weights x (K, Mp) bf16 -> (split, Np, Mp) f32 partial sums."""
  np_, k = w.shape
  _, mp = xt.shape
  wbits = jnp.dtype(w.dtype).itemsize * 8 if w.dtype != jnp.int4 else 4
  tile_w = 64
  cta_n = 2 * tile_w
  n_iters = np_ // cta_n
  kpart = k // split
  k_iters = kpart // tile_k
  w_tr = _tiles(wbits, tile_k, "lhs")
  x_tr = _tiles(16, mp, "rhs")
  o_tr = _tiles(32, mp, "out")

  def kernel(w_gmem, x_gmem, o_gmem, o_smem):
    def pipeline(body, ctx):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((cta_n, tile_k), lambda kk: (0, kk), transforms=w_tr,
                                    memory_space=plgpu.SMEM, delay_release=delay),
                    plgpu.BlockSpec((tile_k, mp), lambda kk: (kk, 0), transforms=x_tr,
                                    memory_space=plgpu.SMEM, delay_release=delay)],
          wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps, compute_context=ctx)
    nothing = lambda *_, **__: None
    @functools.partial(pl.run_scoped, allocs=pipeline(nothing, nothing).get_allocations(w_gmem, x_gmem),
                       collective_axes="wg")
    def _scope(allocs):
      wg = lax.axis_index("wg")
      @plgpu.nd_loop((n_iters * split,), collective_axes="sm")
      def _loop(info):
        (lin,) = info.index
        n_idx, s_idx = lin // split, lin % split
        ks = pl.ds(s_idx * kpart, kpart)
        rows = pl.ds(n_idx * cta_n, cta_n)
        wg_rows = pl.ds(wg * tile_w, tile_w)
        def ctx(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_w, mp), jnp.float32))
          def _acc(acc):
            run(acc)
            res = acc[...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = res
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[s_idx].at[rows].at[wg_rows])
        def body(_, w_smem, x_smem, acc):
          a = w_smem[wg_rows].astype(jnp.bfloat16)
          plgpu.wgmma(acc, a, x_smem)
          plgpu.wgmma_wait(delay)
          return acc
        pipeline(body, ctx)(w_gmem.at[rows, ks], x_gmem.at[ks], allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split, np_, mp), jnp.float32),
                   grid=(min(num_sms, n_iters * split),), grid_names=("sm",), num_threads=3, thread_name="wg",
                   compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                   scratch_types=dict(o_smem=plgpu.SMEM((2, tile_w, mp), jnp.float32, transforms=o_tr)))
  return f(w, xt)



# ---- Lane-semantics variant: weights pre-permuted so the upcast layout IS the
# wgmma operand layout (no warp shuffles), decoded inside inline_mgpu.
from jax.experimental import mosaic as _mosaic  # noqa: E402
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402
from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402


def storage_perm(bits):
  """perm[s] = logical column held at stored column s, per chunk of 32 (int4) / 16 (int8)."""
  if bits == 4:
    return np.array([8 * (i // 2) + 2 * q + (i % 2) for q in range(4) for i in range(8)])
  return np.array([8 * (v // 2) + 2 * q + (v % 2) for q in (0, 2, 1, 3) for v in range(4)])


def permute_weights(wq, bits):
  p = storage_perm(bits)
  c = len(p)
  n, k = wq.shape
  idx = (np.arange(k // c)[:, None] * c + p[None, :]).reshape(-1)
  return wq[:, idx]


def wmm_lane(w, xt, *, tile_k=256, steps=4, num_sms=132, split=1, relabel=True, binary=False,
             stream_only=False, wgs=2, x_mk=False):
  np_, k = w.shape
  _, mp = xt.shape
  bits = 4 if w.dtype == jnp.int4 else 8
  if binary:
    k = k * 8
  if x_mk:
    mp = xt.shape[0]  # xt is (Mp, K) here
  tile_w = 64
  cta_n = wgs * tile_w
  n_iters = np_ // cta_n
  kpart = k // split
  k_iters = kpart // tile_k
  w_cols = tile_k // 8 if binary else tile_k
  w_tr = _tiles(bits, w_cols, "lhs")
  x_tr = _tiles(16, tile_k if x_mk else mp, "rhs")
  o_tr = _tiles(32, mp, "out")
  w_swizzle = w_tr[1].swizzle
  x_spec = (plgpu.BlockSpec((mp, tile_k), lambda kk: (0, kk), transforms=x_tr, memory_space=plgpu.SMEM)
            if x_mk else
            plgpu.BlockSpec((tile_k, mp), lambda kk: (kk, 0), transforms=x_tr, memory_space=plgpu.SMEM))
  up_layout = fa.WGMMA_LAYOUT_UPCAST_4X if bits == 4 else fa.WGMMA_LAYOUT_UPCAST_2X

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(w_tr),),
                     return_type=plgpu.ShapeDtypeStruct((tile_w, tile_k), jnp.bfloat16,
                                                        layout=plgpu.Layout.WGMMA))
  def decode(ctx, ref):
    del ctx
    q = mgpu.FragmentedArray.load_tiled(ref, swizzle=w_swizzle, is_signed=True, layout=up_layout)
    if binary:
      return _decode_binary(q, tile_w, tile_k)
    if not relabel:
      return q.to_layout(fa.WGMMA_LAYOUT).astype(ir.BF16Type.get())
    y = q.astype(ir.BF16Type.get())
    regs = y.registers
    per = 4 if bits == 4 else 2  # wgmma 2-vectors per upcast vector
    new = np.empty(fa.WGMMA_LAYOUT.registers_shape((tile_w, tile_k)), dtype=object)
    for idx, r in np.ndenumerate(regs):
      for j in range(per):
        new[(idx[0], idx[1] * per + j, *idx[2:new.ndim])] = mgpu.utils.vector_slice(r, slice(2 * j, 2 * j + 2))
    assert all(r is not None for r in new.flat)
    return mgpu.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  def kernel(w_gmem, x_gmem, o_gmem, o_smem):
    def pipeline(body, ctx):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((cta_n, w_cols), lambda kk: (0, kk), transforms=w_tr,
                                    memory_space=plgpu.SMEM),
                    x_spec],
          wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=steps, compute_context=ctx)
    nothing = lambda *_, **__: None
    @functools.partial(pl.run_scoped, allocs=pipeline(nothing, nothing).get_allocations(w_gmem, x_gmem),
                       collective_axes="wg")
    def _scope(allocs):
      wg = lax.axis_index("wg")
      @plgpu.nd_loop((n_iters * split,), collective_axes="sm")
      def _loop(info):
        (lin,) = info.index
        n_idx, s_idx = lin // split, lin % split
        ks = pl.ds(s_idx * kpart, kpart)
        wks = pl.ds(s_idx * (kpart // 8), kpart // 8) if binary else ks
        rows = pl.ds(n_idx * cta_n, cta_n)
        wg_rows = pl.ds(wg * tile_w, tile_w)
        def ctx(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_w, mp), jnp.float32))
          def _acc(acc):
            run(acc)
            res = acc[...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = res
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[s_idx].at[rows].at[wg_rows])
        def body(_, w_smem, x_smem, acc):
          if not stream_only:
            plgpu.wgmma(acc, decode(w_smem.at[wg_rows]), x_smem.transpose((1, 0)) if x_mk else x_smem)
            plgpu.wgmma_wait(0)
          return acc
        pipeline(body, ctx)(w_gmem.at[rows, wks], x_gmem.at[:, ks] if x_mk else x_gmem.at[ks],
                            allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split, np_, mp), jnp.float32),
                   grid=(min(num_sms, n_iters * split),), grid_names=("sm",), num_threads=wgs + 1, thread_name="wg",
                   scratch_types=dict(o_smem=plgpu.SMEM((wgs, tile_w, mp), jnp.float32, transforms=o_tr)))
  return f(w, xt)


_I32 = lambda v: v - (1 << 32) if v >= (1 << 31) else v


def _decode_binary(q, rows, tile_k):
  """UPCAST_2X int8 fragment of packed bits -> bf16 +-1 fragment in WGMMA layout.

  Each thread's 32-bit register holds, for one 128-column block, bit j = logical
  column 8j + 2q and bit 16 + j = column 8j + 2q + 1 (q = lane % 4): one shift
  puts both at bf16 sign positions 15 and 31."""
  from jax._src.lib.mlir.dialects import arith
  i32 = ir.IntegerType.get_signless(32)
  bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
  mask = mgpu.utils.c(_I32(0x80008000), i32)
  ones = mgpu.utils.c(_I32(0xBF80BF80), i32)
  new = np.empty(fa.WGMMA_LAYOUT.registers_shape((rows, tile_k)), dtype=object)
  for idx, r in np.ndenumerate(q.registers):
    word = mgpu.utils.bitcast(r, i32)
    for j in range(16):
      s = word if j == 15 else arith.shli(word, mgpu.utils.c(15 - j, i32))
      v = arith.xori(arith.andi(s, mask), ones)
      new[(idx[0], idx[1] * 16 + j, *idx[2:new.ndim])] = mgpu.utils.bitcast(v, bf2)
  assert all(r is not None for r in new.flat)
  return mgpu.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def pack_binary(b):
  """(N, K) {0,1} (1 = +1) -> (N, K // 8) int8 in the relabel layout of _decode_binary."""
  b = np.asarray(b, np.uint32)
  n, k = b.shape
  blk = b.reshape(n, k // 128, 16, 4, 2)  # logical col = 128 blk + 8 j + 2 q + e
  sh = (np.arange(16)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)  # (j, e)
  words = (blk << sh[None, None, :, None, :]).sum(axis=(2, 4)).astype(np.uint32)  # (n, nblk, q)
  out = np.zeros((n, k // 128, 16), np.uint8)
  for q in range(4):
    for v in range(4):
      out[:, :, (q % 2) * 8 + (q // 2) * 4 + v] = (words[:, :, q] >> (8 * v)) & 0xFF
  return out.reshape(n, k // 8).view(np.int8)
