"""Experiment, measured slower and not shipped: fused absmax + int8 quantization in one
Pallas kernel, against the XLA path (``qtrain.core.qarray.quantize``), on the GPU.

The XLA path of a channelwise int8 quantization is a reduction for the bound
and a quantize pass that reads the array again (plus, for stochastic
rounding, the PRNG words). The kernel below does it in one launch: each
program owns whole scale groups (a block of rows for a per-row scale, of
columns for a per-column scale), finds their bound in a first loop over the
block and quantizes in a second (re-reading the block from L2), hashing the
stochastic-rounding noise in the kernel. It reproduces the XLA path's bits:

* the noise is JAX's own: ``jax.random.bits`` of a threefry key with
  ``jax_threefry_partitionable`` is ``threefry2x32(key, (hi, lo))`` of each
  word's flat index with the two output words xor'ed (:func:`threefry2x32`);
* divisions are IEEE divisions (an inline ``div.rn.f32`` on the GPU: Triton's
  ``/`` is the approximate ``div.full.f32``); round-half-even is built from
  ``floor`` (Pallas-Triton has no ``round``; the ``+ 1.5 * 2**23`` trick is
  folded away by XLA's simplifier in interpret mode).

Measured on an H200 (benchmarks/RESULTS.md, "Fused quantization"): same bits
without a multiplier, 0.5-0.95x the XLA path's speed; with a folded
multiplier the bits differ from XLA's on the GPU. The int8 QT step with the
kernel wired into the QT ops (commit 6295651) ran 40 ms against 33 ms.

  PYTHONPATH=. python benchmarks/explore_quantize.py --json $OUT/quant.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from qtrain.core import rounding  # noqa: E402
from qtrain.pallas import _common  # noqa: E402


QMAX = 127.0
_METHODS = (None,) + rounding.STOCHASTIC_METHODS


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
  """Tiling of the fused quantization kernel.

  Attributes:
    block_r: rows per block (a power of two).
    block_c: columns per block (a power of two, a multiple of 4).
    num_warps: Triton warps per program.
    num_stages: Triton pipelining depth of the block loops.
  """

  block_r: int = 16
  block_c: int = 512
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_r", "block_c"):
      v = getattr(self, name)
      if not _common.is_pow2(v):
        raise ValueError(f"{name}={v} must be a power of two")
    if self.block_c < 4:
      raise ValueError(f"block_c={self.block_c} must be >= 4 (one noise word covers 4 columns)")


def default_config(shape: tuple[int, int], axis: int) -> QuantizeConfig:
  """Per-row scale: short, wide blocks walking along the row; per-column: tall ones."""
  r, c = shape
  if axis == 1:
    return QuantizeConfig(block_r=_fit(r, 8), block_c=_fit(c, 1024), num_warps=8)
  return QuantizeConfig(block_r=_fit(r, 64), block_c=_fit(c, 128), num_warps=8)


def _fit(n: int, want: int) -> int:
  """The largest power of two <= ``want`` that divides ``n`` (at least 1)."""
  b = want
  while b > 1 and n % b:
    b //= 2
  return b


# ---------------------------------------------------------------------------
# Threefry-2x32 (20 rounds), as JAX computes it, in uint32 ops.

_ROT = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x, r: int):
  return (x << jnp.uint32(r)) | lax.shift_right_logical(x, jnp.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """JAX's threefry2x32 hash of the counter pair (x0, x1) under key (k0, k1).

  All uint32 (arrays or scalars broadcasting together); pure jnp, so it runs
  in a Pallas kernel, in the interpreter and in XLA alike.
  """
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
  x0 = x0 + ks[0]
  x1 = x1 + ks[1]
  for i in range(5):
    for r in _ROT[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r)
      x1 = x0 ^ x1
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0, x1


def random_words(k0, k1, flat_index):
  """``jax.random.bits(key, shape, uint32)`` at the given flat indices (< 2**32)."""
  y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(flat_index), flat_index)
  return y0 ^ y1


def key_words(key) -> tuple[jax.Array, jax.Array] | None:
  """(k0, k1) of a threefry key when JAX's bits are the partitionable hash; else None."""
  if not jax.config.jax_threefry_partitionable:
    return None
  if jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    impl = str(jax.random.key_impl(key))
    if "threefry" not in impl:
      return None
    data = jax.random.key_data(key)
  else:
    data = jnp.asarray(key)
  if data.shape != (2,):
    return None
  data = data.astype(jnp.uint32)
  return data[0], data[1]


# ---------------------------------------------------------------------------
# Kernel.


def _round_half_even(y):
  """``jnp.round`` (half to even) from floor and exact f32 compares (Pallas-Triton
  has no round; the ``+ 1.5 * 2**23`` trick is folded away by XLA's simplifier)."""
  f = jnp.floor(y)
  d = y - f  # exact for |y| < 2**23
  odd = (f - jnp.float32(2.0) * jnp.floor(f * jnp.float32(0.5))) == jnp.float32(1.0)
  up = (d > jnp.float32(0.5)) | ((d == jnp.float32(0.5)) & odd)
  return f + up.astype(jnp.float32)


def _div(a, b, exact_asm: bool):
  """IEEE a / b (float32). Triton's ``/`` is approximate: use ``div.rn.f32``."""
  if not exact_asm:
    return a / b
  a, b = jnp.broadcast_arrays(a, b)
  (out,) = _common.plt.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return out


def _noise(k0, k1, r0, c0, *, br: int, bc: int, n_cols: int, method: str):
  """The XLA path's stochastic-rounding noise for the (br, bc) block at (r0, c0).

  ``uniform``: word ``r * n_cols + c`` per element; ``low_bit_uniform``: word
  ``r * ceil(n_cols / 4) + c // 4``, byte ``c % 4`` (``c0`` and ``bc`` are
  multiples of 4, so the block holds whole words).
  """
  rows = (jnp.arange(br, dtype=jnp.int32) + r0).astype(jnp.uint32)[:, None]
  if method == "uniform":
    cols = (jnp.arange(bc, dtype=jnp.int32) + c0).astype(jnp.uint32)[None, :]
    bits = random_words(k0, k1, rows * jnp.uint32(n_cols) + cols)
    f = lax.bitcast_convert_type(lax.shift_right_logical(bits, jnp.uint32(9))
                                 | jnp.uint32(0x3F800000), jnp.float32) - jnp.float32(1.0)
    return jnp.maximum(jnp.float32(0.0), f * jnp.float32(1.0) + jnp.float32(0.0))
  wcols = (jnp.arange(bc // 4, dtype=jnp.int32) + c0 // 4).astype(jnp.uint32)[None, :]
  words = random_words(k0, k1, rows * jnp.uint32(-(-n_cols // 4)) + wcols)
  shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
  b = lax.shift_right_logical(words[:, :, None], shifts[None, None, :]) & jnp.uint32(0xFF)
  b = b.reshape(br, bc)
  return (b.astype(jnp.int32).astype(jnp.float32) + jnp.float32(0.5)) * jnp.float32(1.0 / 256.0)


def _quantize_kernel(*refs, axis: int, blocks: int, br: int, bc: int, n_cols: int,
                     mult_axis: int | None, method: str | None, exact_asm: bool):
  """Refs: x, [mult], [key (1, 2) uint32], q, scale."""
  it = iter(refs)
  x_ref = next(it)
  m_ref = next(it) if mult_axis is not None else None
  k_ref = next(it) if method else None
  q_ref, s_ref = next(it), next(it)
  pid = pl.program_id(0)

  def block(j):
    """(rows, cols, f32 values) of the j-th block of this program's groups."""
    if axis == 1:
      sl = (slice(None), pl.ds(j * bc, bc))
      r0, c0 = pid * br, j * bc
    else:
      sl = (pl.ds(j * br, br), slice(None))
      r0, c0 = j * br, pid * bc
    x = x_ref[sl].astype(jnp.float32)
    if m_ref is not None:
      m = m_ref[sl] if mult_axis == axis else m_ref[...]
      x = x * m
    return sl, r0, c0, x

  def amax(j, acc):
    _, _, _, x = block(j)
    a = jnp.abs(x)
    a = jnp.where(a == a, a, jnp.float32(np.inf))  # NaN -> Inf (Triton's max drops NaN)
    return jnp.maximum(acc, jnp.max(a, axis=axis, keepdims=True))

  red_shape = (br, 1) if axis == 1 else (1, bc)
  bound = lax.fori_loop(0, blocks, amax, jnp.zeros(red_shape, jnp.float32))
  scale = jnp.where(bound == 0, jnp.float32(1.0), _div(bound, jnp.float32(QMAX), exact_asm))
  scale = jnp.where(jnp.abs(scale) < jnp.float32(np.inf), scale, jnp.float32(np.nan))
  s_ref[...] = scale
  safe = jnp.where(scale == 0, jnp.float32(1.0), scale)
  if method:
    k0, k1 = k_ref[0, 0], k_ref[0, 1]

  def quant(j, carry):
    sl, r0, c0, x = block(j)
    y = _div(x, safe, exact_asm)
    if method:
      q = jnp.floor(y + _noise(k0, k1, r0, c0, br=br, bc=bc, n_cols=n_cols, method=method))
    else:
      q = _round_half_even(y)
    q = jnp.minimum(jnp.maximum(q, jnp.float32(-128.0)), jnp.float32(127.0))
    q = jnp.where(q == q, q, jnp.float32(0.0))  # NaN -> 0, as XLA converts it
    q_ref[sl] = q.astype(jnp.int32).astype(jnp.int8)
    return carry

  lax.fori_loop(0, blocks, quant, 0)


def supported(x_shape, *, axis: int, config: QuantizeConfig | None = None) -> str | None:
  """None if the kernel takes this call, else the reason it does not."""
  if len(x_shape) != 2:
    return f"the kernel takes 2-D arrays, got shape {tuple(x_shape)}"
  if axis not in (0, 1):
    return f"axis={axis} must be 0 (per-column scale) or 1 (per-row scale)"
  cfg = config or default_config(tuple(x_shape), axis)
  r, c = x_shape
  if r % cfg.block_r or c % cfg.block_c:
    return f"shape {tuple(x_shape)} is not a multiple of the block ({cfg.block_r}, {cfg.block_c})"
  if cfg.block_c < 4 or cfg.block_r < 1:
    return "blocks too small"
  if r * c >= 2**32:
    return "more than 2**32 elements (the noise counter is 32-bit)"
  return None


@functools.partial(jax.jit, static_argnames=("axis", "mult_axis", "stochastic_rounding",
                                             "config", "interpret"))
def _call(x, mult, key_data, *, axis, mult_axis, stochastic_rounding, config, interpret):
  r, c = x.shape
  br, bc = config.block_r, config.block_c
  if axis == 1:
    grid, blocks = (r // br,), c // bc
    x_spec = pl.BlockSpec((br, c), lambda i: (i, 0))
    s_shape, s_spec = (r, 1), pl.BlockSpec((br, 1), lambda i: (i, 0))
    m_specs = {1: pl.BlockSpec((1, c), lambda i: (0, 0)), 0: pl.BlockSpec((br, 1), lambda i: (i, 0))}
  else:
    grid, blocks = (c // bc,), r // br
    x_spec = pl.BlockSpec((r, bc), lambda j: (0, j))
    s_shape, s_spec = (1, c), pl.BlockSpec((1, bc), lambda j: (0, j))
    m_specs = {0: pl.BlockSpec((r, 1), lambda j: (0, 0)), 1: pl.BlockSpec((1, bc), lambda j: (0, j))}
  in_specs, args = [x_spec], [x]
  if mult_axis is not None:
    in_specs.append(m_specs[mult_axis])
    args.append(mult)
  if stochastic_rounding:
    in_specs.append(pl.BlockSpec((1, 2), lambda i: (0, 0)))
    args.append(key_data)
  kernel = functools.partial(
      _quantize_kernel, axis=axis, blocks=blocks, br=br, bc=bc, n_cols=c, mult_axis=mult_axis,
      method=stochastic_rounding, exact_asm=not interpret)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    q, s = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((r, c), jnp.int8), jax.ShapeDtypeStruct(s_shape, jnp.float32)),
        grid=grid,
        in_specs=in_specs,
        out_specs=(x_spec, s_spec),
        compiler_params=_common.triton_params(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
        interpret=interpret,
        name="qtrain_quantize_int8",
    )(*args)
  return q, s


def quantize_int8_2d(x: jax.Array, *, axis: int, mult: jax.Array | None = None,
                     stochastic_rounding: str | None = None, key=None,
                     config: QuantizeConfig | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Channelwise absmax int8 quantization of ``x * mult`` in one kernel.

  Computes exactly what :func:`quantize_int8_2d_reference` computes (the
  XLA path: :func:`qtrain.core.qarray.quantize` of ``x.astype(f32) * mult``
  with ``channelwise_axes=(1 - axis,)``).

  Args:
    x: (R, C) float array.
    axis: the reduced axis: 1 for one scale per row, 0 for one per column.
    mult: None, or a float32 (R, 1) or (1, C) multiplier applied to ``x``
      first (a folded scale of the other operand).
    stochastic_rounding: None (round to nearest even), "uniform" or
      "low_bit_uniform" (:mod:`qtrain.core.rounding`).
    key: the PRNG key for stochastic rounding (a threefry key).
    config: tiling; default :func:`default_config`.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    ``(q, scale)``: int8 (R, C) and float32 (R, 1) or (1, C).

  Raises:
    ValueError: on a call the kernel does not take (the message says why).
  """
  if stochastic_rounding not in _METHODS:
    raise ValueError(f"{stochastic_rounding=} is not valid; valid: {list(_METHODS)}")
  config = config or default_config(tuple(x.shape), axis)
  why = supported(x.shape, axis=axis, config=config)
  if why:
    raise ValueError(f"quantize_int8_2d: {why}")
  mult_axis = None
  if mult is not None:
    mult = jnp.asarray(mult, jnp.float32)
    if mult.shape == (x.shape[0], 1):
      mult_axis = 0
    elif mult.shape == (1, x.shape[1]):
      mult_axis = 1
    else:
      raise ValueError(f"mult of shape {mult.shape} must be (R, 1) = {(x.shape[0], 1)} or "
                       f"(1, C) = {(1, x.shape[1])}")
  key_data = None
  if stochastic_rounding:
    if key is None:
      raise ValueError(f"stochastic_rounding={stochastic_rounding!r} needs a PRNG key, got key=None")
    kw = key_words(key)
    if kw is None:
      raise ValueError("the fused kernel hashes JAX's partitionable threefry; this key or "
                       "config (jax_threefry_partitionable) is not that")
    key_data = jnp.stack(kw).reshape(1, 2)
  return _call(x, mult, key_data, axis=axis, mult_axis=mult_axis,
               stochastic_rounding=stochastic_rounding, config=config, interpret=interpret)


def quantize_int8_2d_reference(x: jax.Array, *, axis: int, mult: jax.Array | None = None,
                               stochastic_rounding: str | None = None, key=None):
  """The XLA path (:func:`qtrain.core.qarray.quantize`) the kernel reproduces."""
  from qtrain.core import qarray as qa  # noqa: PLC0415

  xf = x.astype(jnp.float32)
  if mult is not None:
    xf = xf * jnp.asarray(mult, jnp.float32)
  spec = qa.QuantizeSpec(qtype="int8", channelwise_axes=(1 - axis,),
                         stochastic_rounding=stochastic_rounding)
  q = qa.quantize(xf, spec, key=key)
  return q.qvalue, q.scale



def part1(r: int, c: int, rows: list):
  x = jax.random.normal(jax.random.key(0), (r, c), jnp.bfloat16)
  key = jax.random.key(5)
  mults = {None: None, "row": jax.random.uniform(jax.random.key(1), (r, 1)) + 0.5,
           "col": jax.random.uniform(jax.random.key(2), (1, c)) + 0.5}
  for axis in (1, 0):
    for sr in (None, "low_bit_uniform"):
      for mname in (None, "row" if axis == 0 else "col"):
        m = mults[mname]
        kw = dict(axis=axis, mult=m, stochastic_rounding=sr, key=key if sr else None)
        ref_fn = jax.jit(lambda x: quantize_int8_2d_reference(x, **kw))
        qr, sr_ = ref_fn(x)
        t_xla = _timing.time_in_loop(lambda x: quantize_int8_2d_reference(x, **kw), x)
        cfgs = [None] + ([QuantizeConfig(block_r=4, block_c=2048, num_warps=8),
                          QuantizeConfig(block_r=16, block_c=512, num_warps=8),
                          QuantizeConfig(block_r=8, block_c=1024, num_warps=4)] if axis == 1 else
                         [QuantizeConfig(block_r=32, block_c=256, num_warps=8),
                          QuantizeConfig(block_r=128, block_c=64, num_warps=8),
                          QuantizeConfig(block_r=64, block_c=128, num_warps=4)])
        for cfg in cfgs:
          name = f"axis={axis} sr={sr} mult={mname} cfg={cfg}"
          try:
            q, s = jax.jit(lambda x: quantize_int8_2d(x, config=cfg, **kw))(x)
            same = bool(np.array_equal(np.asarray(q), np.asarray(qr))
                        and np.array_equal(np.asarray(s), np.asarray(sr_)))
            t = _timing.time_in_loop(lambda x: quantize_int8_2d(x, config=cfg, **kw), x)
          except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
          gbs = r * c * 3 / t / 1e9  # read bf16 once + write int8 once
          rows.append(dict(axis=axis, sr=sr, mult=mname, cfg=str(cfg), kernel_us=t * 1e6,
                           xla_us=t_xla * 1e6, speedup=t_xla / t, same_bits=same, gbs=gbs))
          print(f"{name}: kernel {t * 1e6:8.1f} us ({gbs:6.0f} GB/s)  xla {t_xla * 1e6:8.1f} us  "
                f"{t_xla / t:5.2f}x  same bits: {same}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
  rows: list = []
  try:
    part1(8192, 16384, rows)
  finally:
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
