"""Optimizers for binary and low-bit weights, optax style.

* :func:`clip_latent_weights`: an ``optax.GradientTransformation`` (chain it
  last) that keeps latent float weights in ``[-bound, bound]`` - the larq /
  bitorch recipe for binary layers (Adam + latent weights clipped to [-1, 1]).
  :func:`project_latent_weights` is the same as a function on params.
* :func:`bop`: the Binary Optimizer of Helwegen et al. (2019): an exponential
  moving average ``m = (1 - gamma) m + gamma g`` of the gradient, and a weight
  flips sign where ``|m| > tau`` and ``sign(m) == sign(w)``. Combine with Adam
  for the other parameters via :func:`binary_optimizer` (``optax.multi_transform``).
* Training on low-bit STORED weights: :func:`to_lowbit` replaces float weights
  by :class:`LowBitWeight` (packed int2/int4/int8 codes + per-channel scale);
  :func:`lowbit_apply_updates` adds an update and re-quantizes with
  **stochastic rounding**, so ``E[new weight] = old weight + update`` and small
  updates survive in expectation (bitorch-engine's quantized-weight optimizer
  rounds to nearest: an update under half a step is lost, every step).
  :func:`tree_nbytes` measures the bytes of params and optimizer state.

Masks (``mask=``): None (every float leaf), a pytree of bools shaped like the
params, or a callable ``params -> pytree of bools``; :func:`path_mask` builds
one from a regex over ``/``-joined parameter paths.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from qtrain import optim
  >>> params = {"binary": {"kernel": jnp.array([0.9, -0.5])}, "head": {"kernel": jnp.array([3.0])}}
  >>> tx = optax.chain(optax.sgd(1.0), optim.clip_latent_weights(
  ...     mask=optim.path_mask(r"binary/.*")))
  >>> grads = {"binary": {"kernel": jnp.array([-1.0, 1.0])}, "head": {"kernel": jnp.array([-1.0])}}
  >>> updates, _ = tx.update(grads, tx.init(params), params)
  >>> new = optax.apply_updates(params, updates)
  >>> new["binary"]["kernel"].tolist(), new["head"]["kernel"].tolist()
  ([1.0, -1.0], [4.0])
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qtrain.core import packing
from qtrain.core import qtypes
from qtrain.core import rounding

__all__ = [
    "path_mask", "clip_latent_weights", "project_latent_weights", "bop", "BopState",
    "binary_optimizer", "LowBitWeight", "to_lowbit", "from_lowbit", "lowbit_apply_updates",
    "tree_nbytes", "memory_report",
]


# ----------------------------------------------------------------------------
# Masks.


def _path_str(path) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    else:
      parts.append(str(k))
  return "/".join(parts)


def path_mask(pattern: str) -> Callable[[Any], Any]:
  """A mask callable: True for leaves whose ``/``-joined path ``re.fullmatch``-es ``pattern``."""
  rx = re.compile(pattern)

  def fn(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: bool(rx.fullmatch(_path_str(p))), params)
  return fn


def _resolve_mask(mask, params):
  if mask is None:
    return jax.tree.map(lambda x: bool(jnp.issubdtype(jnp.result_type(x), jnp.floating)), params)
  if callable(mask):
    return mask(params)
  return mask


# ----------------------------------------------------------------------------
# Latent-weight clipping.


def project_latent_weights(params, *, bound: float = 1.0, mask=None):
  """Clips the masked leaves of ``params`` to ``[-bound, bound]``."""
  m = _resolve_mask(mask, params)
  return jax.tree.map(lambda p, k: jnp.clip(p, -bound, bound) if k else p, params, m)


def clip_latent_weights(bound: float = 1.0, *, mask=None) -> optax.GradientTransformation:
  """Keeps latent weights in ``[-bound, bound]`` after the update (chain it last).

  The update becomes ``clip(w + u, -bound, bound) - w`` on masked leaves, so
  ``optax.apply_updates`` lands exactly on the clipped weight.
  """
  if bound <= 0:
    raise ValueError(f"bound={bound} must be > 0")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("clip_latent_weights needs params: call tx.update(grads, state, params)")
    m = _resolve_mask(mask, params)
    new = jax.tree.map(
        lambda u, p, k: (jnp.clip(p + u, -bound, bound) - p).astype(u.dtype) if k else u,
        updates, params, m)
    return new, state

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Bop.


class BopState(NamedTuple):
  momentum: Any  # the gradient EMA m, one per parameter (zeros where unmasked)


def bop(threshold: float = 1e-8, gamma: float = 1e-4, *, mask=None) -> optax.GradientTransformation:
  """Bop (Helwegen et al., "Latent Weights Do Not Exist", 2019) for binary weights.

  ``m <- (1 - gamma) m + gamma g``; where ``|m| > threshold`` and
  ``sign(m) == sign(w)`` the weight flips (update ``-2 w``), elsewhere the
  update is 0. Weights should be +-1 (e.g. ``jnp.sign`` of the init); any
  nonzero weights work (a flip negates them). Unmasked leaves get a zero
  update: pair it with another optimizer through :func:`binary_optimizer`.

  Args:
    threshold: tau, the flip threshold.
    gamma: the adaptivity rate of the moving average.
    mask: which leaves are binary weights (see the module docstring).
  """
  if not 0 < gamma <= 1:
    raise ValueError(f"gamma={gamma} must be in (0, 1]")
  if threshold < 0:
    raise ValueError(f"threshold={threshold} must be >= 0")

  def init_fn(params):
    return BopState(momentum=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("bop needs params: call tx.update(grads, state, params)")
    msk = _resolve_mask(mask, params)

    def one(g, m, w, k):
      if not k:
        return jnp.zeros_like(g), m
      m = (1.0 - gamma) * m + gamma * g.astype(jnp.float32)
      flip = (jnp.abs(m) > threshold) & (jnp.sign(m) == jnp.sign(w))
      return jnp.where(flip, -2.0 * w, 0.0).astype(g.dtype), m

    out = jax.tree.map(one, updates, state.momentum, params, msk)
    treedef = jax.tree.structure(updates)
    leaves = treedef.flatten_up_to(out)
    new_updates = treedef.unflatten([u for u, _ in leaves])
    new_m = treedef.unflatten([m for _, m in leaves])
    return new_updates, BopState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)


def binary_optimizer(binary_mask, *, other: optax.GradientTransformation | None = None,
                     threshold: float = 1e-8, gamma: float = 1e-4) -> optax.GradientTransformation:
  """Bop for the ``binary_mask`` leaves, ``other`` (default Adam 1e-3) for the rest."""
  other = other if other is not None else optax.adam(1e-3)

  def labels(params):
    m = _resolve_mask(binary_mask, params)
    return jax.tree.map(lambda k: "bop" if k else "other", m)

  return optax.multi_transform({"bop": bop(threshold, gamma), "other": other}, labels)


# ----------------------------------------------------------------------------
# Low-bit stored weights with stochastic re-quantization.


@dataclasses.dataclass(frozen=True)
class LowBitWeight:
  """A weight stored as packed ``qtype`` codes and one float32 scale per channel.

  ``value = unpack(words) * scale``. The codes are packed along ``axis``
  (:mod:`qtrain.core.packing` layout; int8 is stored unpacked as int8).

  Attributes:
    words: uint32 packed codes (int2/int4), or int8 codes (int8).
    scale: float32, the weight's rank, size 1 on ``axis`` (per-channel).
    qtype: qtype name (static).
    shape: the weight's shape (static).
    axis: the packed / reduced axis (static).
  """

  words: jax.Array
  scale: jax.Array
  qtype: str
  shape: tuple[int, ...]
  axis: int

  def codes(self) -> jax.Array:
    if self.qtype == "int8":
      return self.words
    return packing.unpack(self.words, self.qtype, size=self.shape[self.axis], axis=self.axis)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.codes().astype(jnp.float32) * self.scale).astype(dtype)


jax.tree_util.register_dataclass(LowBitWeight, data_fields=["words", "scale"],
                                 meta_fields=["qtype", "shape", "axis"])


def _encode(codes: jax.Array, qtype: str, axis: int) -> jax.Array:
  return codes if qtype == "int8" else packing.pack(codes, qtype, axis=axis)


def _make_lowbit(w: jax.Array, qtype: str, axis: int, key, stochastic: bool) -> LowBitWeight:
  qt = qtypes.get_qtype(qtype)
  if qt.kind != "int" or qt.bits not in (2, 4, 8):
    raise ValueError(f"qtype={qtype!r}: low-bit stored weights are int2, int4 or int8")
  axis = axis % w.ndim
  wf = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(wf), axis=axis, keepdims=True)
  scale = jnp.where(amax == 0, 1.0, amax / qt.qmax)
  y = wf / scale
  codes = (rounding.stochastic_round(y, qt, key) if stochastic else rounding.round_nearest(y, qt))
  return LowBitWeight(words=_encode(codes, qt.name, axis), scale=scale, qtype=qt.name,
                      shape=tuple(w.shape), axis=axis)


def _is_lowbit(x) -> bool:
  return isinstance(x, LowBitWeight)


def to_lowbit(params, *, qtype: str = "int8", mask=None, axis: int = 0, key=None):
  """Replaces the masked float leaves of ``params`` by :class:`LowBitWeight`.

  Scales are absmax per channel over ``axis`` (0 = the input axis of a Dense
  kernel (K, N): one scale per output channel). Rounding is to nearest, or
  stochastic when ``key`` is given.
  """
  m = _resolve_mask(mask, params)
  leaves, treedef = jax.tree.flatten(params)
  mleaves = treedef.flatten_up_to(m)
  keys = (list(jax.random.split(key, len(leaves))) if key is not None else [None] * len(leaves))
  out = [(_make_lowbit(p, qtype, axis, k, k is not None) if msk and p.ndim > 0 else p)
         for p, msk, k in zip(leaves, mleaves, keys)]
  return treedef.unflatten(out)


def from_lowbit(params, dtype=jnp.float32):
  """The float view of ``params`` (every :class:`LowBitWeight` dequantized)."""
  return jax.tree.map(lambda x: x.dequantize(dtype) if _is_lowbit(x) else x, params,
                      is_leaf=_is_lowbit)


def lowbit_apply_updates(params, updates, *, key=None, rounding_mode: str = "stochastic",
                         rescale: bool = False):
  """``params + updates`` where low-bit leaves are re-quantized.

  Args:
    params: a tree with :class:`LowBitWeight` leaves (and float leaves).
    updates: float updates shaped like :func:`from_lowbit` ``(params)``.
    key: PRNG key (required for ``"stochastic"``).
    rounding_mode: ``"stochastic"`` (unbiased: small updates survive in
      expectation) or ``"nearest"`` (bitorch-engine's behaviour: updates under
      half a step are lost).
    rescale: recompute the absmax scale from the updated weight (else the
      scale is kept and values clip at the qtype's range).

  Returns:
    The updated tree (same structure; float leaves get ``p + u``).
  """
  if rounding_mode not in ("stochastic", "nearest"):
    raise ValueError(f"rounding_mode={rounding_mode!r}; valid: 'stochastic', 'nearest'")
  if rounding_mode == "stochastic" and key is None:
    raise ValueError("rounding_mode='stochastic' needs key=")
  leaves, treedef = jax.tree.flatten(params, is_leaf=_is_lowbit)
  uleaves = treedef.flatten_up_to(updates)
  keys = (list(jax.random.split(key, len(leaves))) if key is not None else [None] * len(leaves))
  out = []
  for p, u, k in zip(leaves, uleaves, keys):
    if not _is_lowbit(p):
      out.append(jnp.asarray(p + u).astype(jnp.result_type(p)))
      continue
    qt = qtypes.get_qtype(p.qtype)
    w = p.dequantize() + u.astype(jnp.float32)
    if rescale:
      amax = jnp.max(jnp.abs(w), axis=p.axis, keepdims=True)
      scale = jnp.where(amax == 0, 1.0, amax / qt.qmax)
    else:
      scale = p.scale
    y = w / scale
    codes = (rounding.stochastic_round(y, qt, k) if rounding_mode == "stochastic"
             else rounding.round_nearest(y, qt))
    out.append(dataclasses.replace(p, words=_encode(codes, qt.name, p.axis), scale=scale))
  return treedef.unflatten(out)


def tree_nbytes(tree) -> int:
  """Bytes held by the arrays of a pytree (LowBitWeight: packed words + scales)."""
  return int(sum(np.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def memory_report(params, opt_state, float_params=None, float_opt_state=None) -> dict:
  """Bytes of params + optimizer state, against a float32 reference.

  ``float_params`` defaults to :func:`from_lowbit` ``(params)`` cast to
  float32; ``float_opt_state`` to ``opt_state`` (pass the float run's state
  when the optimizer state differs).
  """
  fp = float_params if float_params is not None else jax.tree.map(
      lambda x: x.astype(jnp.float32), from_lowbit(params))
  fos = float_opt_state if float_opt_state is not None else opt_state
  lb = tree_nbytes(params) + tree_nbytes(opt_state)
  fl = tree_nbytes(fp) + tree_nbytes(fos)
  return {"params_bytes": tree_nbytes(params), "opt_state_bytes": tree_nbytes(opt_state),
          "total_bytes": lb, "float32_total_bytes": fl, "saving": fl / max(lb, 1)}
