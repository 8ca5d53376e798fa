"""Loop-amortized GPU timing helpers (reusable by every qtrain benchmark).

Timing one call from the host adds ~0.3-0.7 ms of dispatch noise on the GPU
machine, more than a small-M matmul takes. :func:`time_in_loop` runs ``iters``
calls inside ONE jitted ``lax.fori_loop`` whose body perturbs the first
argument with the loop index (so XLA cannot hoist the work out of the loop)
and carries the full output (so nothing is dead code), then divides.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


def _perturb(x: jax.Array, i: jax.Array) -> jax.Array:
  """A cheap, index-dependent change of ``x`` that keeps its dtype and scale."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x + (i % 3).astype(x.dtype) * jnp.asarray(2.0**-8, x.dtype)
  return x ^ (i % 3).astype(x.dtype)  # flips low bits (int8 values / packed words)


def time_in_loop(fn: Callable, *args, iters: int | None = None, repeats: int = 5,
                 target_s: float = 0.05, unroll: int = 8) -> float:
  """Median seconds per call of ``fn(*args)``, timed inside one jitted loop.

  Args:
    fn: a jax-traceable function; its first argument is perturbed each iteration.
    *args: arrays or pytrees; only ``args[0]`` must be an array.
    iters: loop trip count; default picks one so a repeat takes ~``target_s``.
    repeats: timed repeats (median reported).
    target_s: wall time per repeat when ``iters`` is chosen automatically.
    unroll: calls per loop iteration (each with its own perturbation; every
      output is carried so none is dead). XLA's GPU while loop reads its
      predicate back to the host each iteration (~10-20 µs), which
      ``unroll`` amortizes. Call j+1's input passes through an
      ``optimization_barrier`` together with call j's output, so XLA cannot
      merge the unrolled calls (its dot merger would otherwise fuse the
      unrolled ``x @ w`` into one dot that reads ``w`` once: measured 8x too
      fast on the GPU).

  Returns:
    Median seconds per call.
  """
  out_struct = jax.eval_shape(fn, *args)

  @jax.jit
  def loop(n, *a):
    def body(i, carry):
      outs, prev = [], None
      for j in range(unroll):
        xj = _perturb(a[0], i * unroll + j)
        if prev is not None:
          xj, _ = lax.optimization_barrier((xj, prev))  # call j+1 after call j
        prev = fn(xj, *a[1:])
        outs.append(prev)
      return tuple(outs)
    init = tuple(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_struct)
                 for _ in range(unroll))
    return lax.fori_loop(0, n, body, init)

  def run(n):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(n, *args))
    return time.perf_counter() - t0

  run(2)  # compile + warm up (trip count is a traced value: one compile)
  if iters is None:
    est = max(run(4) / 4, 1e-7)
    iters = int(min(max(target_s / est, 3), 2000))
  times = [run(iters) / (iters * unroll) for _ in range(repeats)]
  return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20, repeats: int = 5) -> float:
  """Measured device memory bandwidth in bytes/s: a chain of XLA elementwise
  passes (each reads and writes an f32 array of ``nbytes``; each depends on the
  last, so none can be fused away), counting both directions."""
  x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
  loop = jax.jit(lambda x, n: lax.fori_loop(0, n, lambda i, y: y * 1.0001, x))
  jax.block_until_ready(loop(x, 2))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, iters))
    times.append((time.perf_counter() - t0) / iters)
  return 2 * nbytes / statistics.median(times)


def bf16_peak(size: int = 8192) -> float:
  """Measured XLA bf16 matmul rate in FLOP/s on a ``size``^3 product."""
  k1, k2 = jax.random.split(jax.random.key(1))
  a = jax.random.normal(k1, (size, size), jnp.bfloat16)
  b = jax.random.normal(k2, (size, size), jnp.bfloat16)
  t = time_in_loop(lambda x, y: x @ y, a, b, repeats=5, target_s=0.1)
  return 2 * size**3 / t
