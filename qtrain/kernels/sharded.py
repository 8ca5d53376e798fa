"""Kernel calls that partition: one kernel call per shard under ``jax.jit`` with sharded operands.

Why: a Pallas call lowers to a custom call, and XLA's SPMD partitioner runs a custom call it
knows nothing about on replicated operands. Under data parallelism every device then
all-gathers the global batch and computes the whole product: the int8 LM step on two H200s ran
at 0.59 of perfect weak scaling where bf16 ran at 0.92 (``benchmarks/scaling.py``, RESULTS.md
"Weak scaling"). These wrappers tell the partitioner what a kernel computes, per shard
(``jax.experimental.custom_partitioning`` with a Shardy rule and the GSPMD callbacks):

* :func:`transpose`: any permutation; every axis keeps its sharding (a local transpose).
* :func:`gemm`: ``out[m, n] = (sum_k a[m, k] b[n, k]) * sa[m] * sb[n]``. M and N keep their
  sharding. A sharded K (a weight gradient under data parallelism contracts the sharded batch)
  runs the kernel per shard into float32 partial products and sums them across the shards
  (``psum``), then casts: the same reduction XLA inserts for a sharded dot, so the result can
  differ from one device's by float32 rounding of the partial sums.

On one device, or inside a ``jax.shard_map`` whose axes are all manual, the wrapped function
is inlined (no partitioning happens). Under ``jax.vmap`` the kernel function is vmapped
directly (``custom_partitioning`` has no batching rule): batched calls are not partitioned.

The partitioner asks for each call site's per-shard computation separately, and each answer is
lowered into a module of its own: a Pallas kernel would be lowered again at every site (a Mosaic
GEMM takes seconds; an 8-block decoder's step compiled in 184 s on two GPUs against 46 s on one).
The per-shard kernel is therefore lowered once per argument signature through ``jax.export``
and each site calls that copy (:func:`_lowered_once`): the same custom call, merged into the
site's module instead of lowered again.

The kernel functions are static arguments: module-level functions (or ``functools.partial``
of them) that compute on whatever (local) shapes they get, choosing their configs there.

Example (fake CPU devices; ``kernel`` stands in for a Pallas kernel):
  >>> import jax, jax.numpy as jnp
  >>> from qtrain.kernels import sharded
  >>> def kernel(a, b, sa, sb, out_dtype):
  ...   acc = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
  ...   return (acc.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(out_dtype)
  >>> a = jnp.ones((8, 16), jnp.int8); b = jnp.ones((4, 16), jnp.int8)
  >>> out = sharded.gemm(kernel, a, b, jnp.ones(8), jnp.ones(4), out_dtype=jnp.bfloat16)
  >>> out.shape, out.dtype, float(out[0, 0])
  ((8, 4), dtype(bfloat16), 16.0)
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax import export as jax_export
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def _names(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(names: tuple[str, ...]):
  return None if not names else (names[0] if len(names) == 1 else names)


# Custom calls of this package's kernels that jax.export refuses by default because their IR
# carries no compatibility guarantee across jax versions (Pallas Triton kernels). The exported
# copies here are merged back into the same process's programs, never serialized.
_KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)

# Exported per-shard kernels (or the reason one could not be exported), by (function, static
# arguments, argument shapes and dtypes).
_EXPORTED: dict[tuple, jax_export.Exported | str] = {}


def export_kernel(fn: Callable[..., jax.Array], specs, *, platforms=None) -> jax_export.Exported:
  """``jax.export`` of ``jax.jit(fn)`` for ``specs``, accepting this package's kernel calls."""
  checks = [jax_export.DisabledSafetyCheck.custom_call(t) for t in _KERNEL_CUSTOM_CALLS]
  return jax_export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*specs)


def _lowered_once(fn: Callable[..., jax.Array], *args: jax.Array, **static) -> jax.Array:
  """``fn(*args, **static)`` through one ``jax.export`` of it per argument signature.

  Called while a partitioner builds one site's per-shard module: the first site of a signature
  exports (lowers) ``fn``, later sites merge that module instead of lowering the kernel again.
  A function that does not export is lowered at each site (slower to compile, the same
  program), with a warning naming it and why.
  """
  key = (fn, tuple(sorted(static.items())), tuple((a.shape, jnp.dtype(a.dtype)) for a in args))
  exp = _EXPORTED.get(key)
  if exp is None:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    try:
      exp = export_kernel(functools.partial(fn, **static), specs)
    except Exception as e:  # noqa: BLE001 - any refusal: lower at the site instead
      exp = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      warnings.warn(f"qtrain: the per-shard kernel {getattr(fn, '__name__', fn)!r} for "
                    f"{[f'{a.dtype}{list(a.shape)}' for a in specs]} could not be exported "
                    f"({exp}); it is lowered again at every call site (slower compile, the "
                    "same program)", RuntimeWarning, stacklevel=2)
    _EXPORTED[key] = exp
  if isinstance(exp, str):
    return fn(*args, **static)
  return exp.call(*args)


# ---------------------------------------------------------------------------------------------
# Transpose


def _transpose_specs(perm, arg_shapes):
  x = arg_shapes[0]
  spec = _spec(x.sharding, len(perm))
  return spec, tuple(spec[a] for a in perm)


def _transpose_partition(perm, fn, mesh, arg_shapes, result_shape):
  spec, out = _transpose_specs(perm, arg_shapes)
  return mesh, functools.partial(_lowered_once, fn), NamedSharding(mesh, P(*out)), (NamedSharding(mesh, P(*spec)),)


def _transpose_infer(perm, fn, mesh, arg_shapes, result_shape):
  return NamedSharding(mesh, P(*_transpose_specs(perm, arg_shapes)[1]))


def _transpose_rule(perm, fn, mesh, value_types, result_types):
  dims = [f"d{i}" for i in range(len(perm))]
  return f"{' '.join(dims)} -> {' '.join(dims[a] for a in perm)}"


@functools.partial(custom_partitioning, static_argnums=(1, 2))
def _transpose_cp(x, perm, fn):
  return fn(x)


_transpose_cp.def_partition(partition=_transpose_partition,
                            infer_sharding_from_operands=_transpose_infer,
                            sharding_rule=_transpose_rule)


def transpose(x: jax.Array, perm: tuple[int, ...], fn: Callable[[jax.Array], jax.Array]
              ) -> jax.Array:
  """``fn(x)`` (which must compute ``jnp.transpose(x, perm)``), one call per shard."""
  perm = tuple(int(a) for a in perm)

  @jax.custom_batching.custom_vmap
  def call(v):
    return _transpose_cp(v, perm, fn)

  @call.def_vmap
  def _(axis_size, in_batched, v):
    return jax.vmap(fn)(v), True

  return call(x)


# ---------------------------------------------------------------------------------------------
# GEMM: out (M, N) from a (M, K), b (N, K), sa (M,), sb (N,)


def _gemm_specs(arg_shapes):
  a, b = arg_shapes[0], arg_shapes[1]
  sa_, sb_ = _spec(a.sharding, 2), _spec(b.sharding, 2)
  m = _names(sa_[0])
  n = tuple(x for x in _names(sb_[0]) if x not in m)
  k = _names(sa_[1]) if _names(sa_[1]) == _names(sb_[1]) else ()
  k = tuple(x for x in k if x not in m and x not in n)
  return m, n, k


def _gemm_partition(fn, out_dtype, mesh, arg_shapes, result_shape):
  m, n, k = _gemm_specs(arg_shapes)
  em, en, ek = _entry(m), _entry(n), _entry(k)
  args = (NamedSharding(mesh, P(em, ek)), NamedSharding(mesh, P(en, ek)),
          NamedSharding(mesh, P(em)), NamedSharding(mesh, P(en)))
  out = NamedSharding(mesh, P(em, en))
  if not k:
    lower = functools.partial(_lowered_once, fn, out_dtype=out_dtype)
  else:
    def lower(a, b, sa, sb):
      partial = _lowered_once(fn, a, b, sa, sb, out_dtype=jnp.float32)
      return jax.lax.psum(partial, k).astype(out_dtype)
  return mesh, lower, out, args


def _gemm_infer(fn, out_dtype, mesh, arg_shapes, result_shape):
  m, n, _ = _gemm_specs(arg_shapes)
  return NamedSharding(mesh, P(_entry(m), _entry(n)))


def _gemm_rule(fn, out_dtype, mesh, value_types, result_types):
  return "m k, n k, m, n -> m n", {"reduction_factors": ("k",)}


@functools.partial(custom_partitioning, static_argnums=(4, 5))
def _gemm_cp(a, b, sa, sb, fn, out_dtype):
  return fn(a, b, sa, sb, out_dtype=out_dtype)


_gemm_cp.def_partition(partition=_gemm_partition, infer_sharding_from_operands=_gemm_infer,
                       sharding_rule=_gemm_rule)


def gemm(fn: Callable[..., jax.Array], a: jax.Array, b: jax.Array, sa: jax.Array,
         sb: jax.Array, *, out_dtype) -> jax.Array:
  """``fn(a, b, sa, sb, out_dtype=out_dtype)``, one call per shard (see the module docstring).

  ``fn`` computes ``(a @ b.T) * sa[:, None] * sb[None, :]`` in ``out_dtype`` for int8 ``a``
  (M, K), ``b`` (N, K) and float32 ``sa`` (M,), ``sb`` (N,), on any shapes it is given, and
  must take ``out_dtype=jnp.float32`` too (a sharded K sums float32 partial products).
  """
  out_dtype = jnp.dtype(out_dtype)

  @jax.custom_batching.custom_vmap
  def call(a, b, sa, sb):
    return _gemm_cp(a, b, sa, sb, fn, out_dtype)

  @call.def_vmap
  def _(axis_size, in_batched, *args):
    axes = tuple(0 if bat else None for bat in in_batched)
    return jax.vmap(functools.partial(fn, out_dtype=out_dtype), in_axes=axes)(*args), True

  return call(a, b, sa, sb)
