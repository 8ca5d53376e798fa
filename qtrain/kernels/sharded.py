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
* :func:`weight_matmul`: ``out[m, n] = (x @ W.T)[m, n] * x_scale[m]`` for activations ``x``
  (M, K) and a packed weight ``W`` (a :class:`~qtrain.kernels.prepared.PreparedWeight` of the
  Triton kernels, a :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight` of the small-M Mosaic
  kernel: codes or words plus scales, maybe in groups along K). M keeps its sharding (data
  parallel: each shard its rows against the whole weight, no communication). N keeps its
  sharding where the layout splits cleanly (:func:`weight_layout`): both layouts keep N as
  whole rows (PreparedWeight: rows of ``data``, or its columns when stored (K, N), and the
  scale columns; MosaicWeight: rows, or with ``tiles`` row bands of whole tiles, one band
  after another), so N splits where the arrays hold exactly N channels (no padding past N)
  and each shard is a multiple of the layout's block (:data:`PREPARED_N_BLOCK` = 16, the
  Triton kernels' smallest N tile; ``N_ALIGN`` = 256 for Mosaic, whose shard must pad to
  itself and hold whole tile bands); otherwise the weight is gathered along N. K (the
  contraction, of ``x`` and of the weight) is gathered: a partial-sum version would have to
  split the packed K tiles, group scales and padding per shard. Each shard's weight is the
  same dataclass with its own arrays and its own ``n``; the kernel picks its config for the
  shard's shapes, so float activations or group-wise scales may differ from one device by
  float32 summation order (integer activations with per-channel scales: the same bits).

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

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax import export as jax_export
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from qtrain.kernels import mosaic_matmul as _mosaic
from qtrain.kernels.prepared import PreparedWeight


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
      name = static.get("kernel", fn)  # a wrapper's inner kernel where it passes one
      name = getattr(getattr(name, "func", name), "__name__", name)
      warnings.warn(f"qtrain: the per-shard kernel {name!r} for "
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


# ---------------------------------------------------------------------------------------------
# Weight x activation products: out (M, N) from x (M, K) (with per-row scales x_scale (M,) or
# none) and a packed weight whose arrays hold N along one axis each (a PreparedWeight for the
# Triton kernels, a MosaicWeight for the small-M Mosaic kernel).


@dataclasses.dataclass(frozen=True)
class WeightLayout:
  """How a packed weight's arrays lie along N (its output channels).

  Attributes:
    n_axes: per array of the weight (``jax.tree_util.tree_leaves`` order): the axis that holds
      N (padded), or None for an array with no N axis (kept whole on every shard).
    n: the true N (the product's columns).
    splits: whether N can split at all: the arrays hold exactly ``n`` channels along N (no
      padding past them), so a shard of the arrays is a shard of the output's columns.
    block: a shard's N must be a multiple of this (the layout's blocks along N).
  """

  n_axes: tuple[int | None, ...]
  n: int
  splits: bool
  block: int


# The smallest N tile the Triton kernels take (their heuristic block_n falls back to 16): a
# shard's (unpadded) N must tile by it.
PREPARED_N_BLOCK = 16


def weight_layout(w) -> WeightLayout:
  """The :class:`WeightLayout` of a :class:`~qtrain.kernels.prepared.PreparedWeight` or a
  :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight` (ValueError for anything else)."""
  if isinstance(w, PreparedWeight):
    # data (Np, Kw) or (Kw, Np) (kn); w_scale (1, Np); g_scale, g_zero (G, Np): rows are
    # channels, the packing runs along K only.
    ax = dataclasses.replace(w, data=1 if w.kn else 0,
                             **{f: None if getattr(w, f) is None else 1
                                for f in ("w_scale", "g_scale", "g_zero")})
    return WeightLayout(tuple(jax.tree_util.tree_leaves(ax)), w.n, w.n_pad == w.n,
                        PREPARED_N_BLOCK)
  if isinstance(w, _mosaic.MosaicWeight):
    # data (Np, Kcols), rows are channels (the storage order permutes K only); with tiles,
    # (CTA rows, tile_k) tiles one row band after another: a run of whole bands is a run of
    # rows. w_scale (N,). A shard must be a whole number of N_ALIGN rows so that its own
    # padded N is its N (and its bands whole).
    ax = dataclasses.replace(w, data=0, w_scale=None if w.w_scale is None else 0)
    return WeightLayout(tuple(jax.tree_util.tree_leaves(ax)), w.n, w.n_pad == w.n,
                        _mosaic.N_ALIGN)
  raise ValueError(f"weight of type {type(w).__name__}: weight_matmul takes a PreparedWeight "
                   f"or a MosaicWeight")


def _wmm_shapes(arg_shapes):
  x, x_scale, w = arg_shapes
  return x, x_scale, jax.tree_util.tree_leaves(w)


def _wmm_specs(layout: WeightLayout, mesh, arg_shapes, result_shape):
  """(m, n): the mesh axes that shard M, and N (empty where N gathers)."""
  x, _, leaves = _wmm_shapes(arg_shapes)
  out = _spec(result_shape.sharding, 2)
  m = _names(_spec(x.sharding, 2)[0]) or _names(out[0])
  n = ()
  if layout.splits:
    ws = [_names(_spec(l.sharding, l.ndim)[a]) for l, a in zip(leaves, layout.n_axes)
          if a is not None]
    n = next((v for v in ws if v), ()) or _names(out[1])
    n = tuple(a for a in n if a not in m)
    shards = 1
    for a in n:
      shards *= mesh.shape[a]
    if layout.n % shards or (layout.n // shards) % layout.block:
      n = ()
  return m, n


def _wmm_partition(fn, out_dtype, static, layout, mesh, arg_shapes, result_shape):
  m, n = _wmm_specs(layout, mesh, arg_shapes, result_shape)
  em, en = _entry(m), _entry(n)
  x, x_scale, w = arg_shapes
  shards = 1
  for a in n:
    shards *= mesh.shape[a]
  leaves, tree = jax.tree_util.tree_flatten(w)
  w_shardings = tree.unflatten([
      NamedSharding(mesh, P(*[en if i == a else None for i in range(l.ndim)]))
      for l, a in zip(leaves, layout.n_axes)])
  args = (NamedSharding(mesh, P(em, None)),
          None if x_scale is None else NamedSharding(mesh, P(em)), w_shardings)
  out = NamedSharding(mesh, P(em, en))
  n_local = layout.n // shards

  def lower(x, x_scale, w):
    flat, tree = jax.tree_util.tree_flatten((x, x_scale, w))
    return _lowered_once(_weight_matmul_flat, *flat, kernel=fn, tree=tree, n_local=n_local,
                         out_dtype=out_dtype, static=static)
  return mesh, lower, out, args


def _weight_matmul_flat(*flat, kernel, tree, n_local, out_dtype, static):
  """One shard's product: the weight rebuilt with the shard's N, then ``fn``."""
  x, x_scale, w = tree.unflatten(flat)
  if n_local != w.n:
    w = dataclasses.replace(w, n=n_local)
  return kernel(x, w, x_scale=x_scale, out_dtype=out_dtype, **dict(static))


def _wmm_infer(fn, out_dtype, static, layout, mesh, arg_shapes, result_shape):
  m, n = _wmm_specs(layout, mesh, arg_shapes, result_shape)
  return NamedSharding(mesh, P(_entry(m), _entry(n)))


def _wmm_rule(fn, out_dtype, static, layout, mesh, value_types, result_types):
  # Operands in order: x, x_scale (if any), the weight's arrays. N is one factor where the
  # arrays hold exactly N channels (else each array's N axis is a factor of its own); the K
  # axes (x's, and every weight axis but N) are gathered.
  has_scale = len(value_types) == 2 + len(layout.n_axes)
  terms, repl = ["m k"] + (["m"] if has_scale else []), ["k"]
  for i, (t, a) in enumerate(zip(value_types[1 + has_scale:], layout.n_axes)):
    dims = []
    for d in range(len(t.shape)):
      if d == a:
        dims.append("n" if layout.splits and t.shape[d] == layout.n else f"n{i}")
      else:
        dims.append(f"w{i}_{d}")
        repl.append(dims[-1])
    terms.append(" ".join(dims))
  return f"{', '.join(terms)} -> m n", {"need_replication_factors": tuple(repl)}


@functools.partial(jax.jit, static_argnames=("fn", "out_dtype", "static"))
def _call_kernel(x, x_scale, w, *, fn, out_dtype, static):
  # A jit boundary: custom_partitioning takes a body without constants, and a kernel's
  # index tables (numpy arrays) would be constants of the body's jaxpr; inside a jit they
  # are the jit's own.
  return fn(x, w, x_scale=x_scale, out_dtype=out_dtype, **dict(static))


@functools.partial(custom_partitioning, static_argnums=(3, 4, 5, 6))
def _weight_matmul_cp(x, x_scale, w, fn, out_dtype, static, layout):
  return _call_kernel(x, x_scale, w, fn=fn, out_dtype=out_dtype, static=static)


_weight_matmul_cp.def_partition(partition=_wmm_partition, infer_sharding_from_operands=_wmm_infer,
                                sharding_rule=_wmm_rule)


def weight_matmul(fn: Callable[..., jax.Array], x: jax.Array, w, *, x_scale=None, out_dtype,
                  **static) -> jax.Array:
  """``fn(x, w, x_scale=x_scale, out_dtype=out_dtype, **static)``, one call per shard.

  ``fn`` computes ``(x @ W.T) * x_scale[:, None]`` (M, N) in ``out_dtype`` for activations
  ``x`` (M, K) (float, int8 codes, or binary plane words) and the packed weight ``w`` (a
  :class:`~qtrain.kernels.prepared.PreparedWeight` or a
  :class:`~qtrain.kernels.mosaic_matmul.MosaicWeight`, its scales included), on any shard
  it is given: a shard's weight has its own arrays and its own ``n``. ``static``: hashable
  keyword arguments for ``fn`` (a ``functools.partial`` compares by identity: one made per
  call would lower the kernel at every site).

  Per shard: M keeps its sharding (each shard its rows against the whole weight); N keeps
  its sharding where the weight's layout splits cleanly (:func:`weight_layout`: no channels
  padded past N, and each shard a multiple of the layout's block), else N is gathered; K
  (the contraction, of x and of the weight) is gathered.
  """
  layout = weight_layout(w)
  if x.ndim != 2:
    raise ValueError(f"x has shape {x.shape}; weight_matmul takes (M, K) activations")
  if x_scale is not None:
    x_scale = jnp.asarray(x_scale, jnp.float32).reshape(-1)
    if x_scale.shape[0] not in (1, x.shape[0]):
      raise ValueError(f"x_scale has {x_scale.shape[0]} entries; expected 1 or M={x.shape[0]}")
    x_scale = jnp.broadcast_to(x_scale, (x.shape[0],))
  out_dtype = jnp.dtype(out_dtype)
  static = tuple(sorted(static.items()))

  @jax.custom_batching.custom_vmap
  def call(x, x_scale, w):
    return _weight_matmul_cp(x, x_scale, w, fn, out_dtype, static, layout)

  @call.def_vmap
  def _(axis_size, in_batched, x, x_scale, w):
    axes = jax.tree_util.tree_map(lambda b: 0 if b else None, in_batched)
    f = lambda x, xs, w: fn(x, w, x_scale=xs, out_dtype=out_dtype, **dict(static))
    return jax.vmap(f, in_axes=tuple(axes))(x, x_scale, w), True

  return call(x, x_scale, w)
