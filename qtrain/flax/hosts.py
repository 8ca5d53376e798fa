"""Where a linen op keeps its state: the calling module's scope.

:class:`LinenHost` gives the provider an op's parameters (learned scales and
shifts, LoRA adapters, named ``<op id>_<name>``), its calibration statistics (the
``"quant_stats"`` collection) and its PRNG keys, in the scope of the linen
module whose ``dot_general`` / ``einsum`` / ``conv_general_dilated`` was
intercepted; :func:`linen_weight_operand` says which operand is the weight
(:func:`nnx_weight_operand` for an nnx module's direct calls).
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
import flax.linen as nn
from flax import errors as flax_errors
from flax import nnx
from flax.core import meta

from qtrain.provider import DROPOUT_STREAM


# linen layers whose weight operand is known by their calling convention.
_LINEN_RHS_WEIGHT = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Einsum)
# linen layers whose own ops have no weight operand (activation x activation).
_LINEN_NO_WEIGHT = (nn.MultiHeadDotProductAttention,)
NO_WEIGHT_BY_DESIGN = -1


def linen_weight_operand(module, op_name: str, operands, *,
                         by_convention: bool = True) -> int | None:
  """Index of the weight operand: by a Flax layer's calling convention (``by_convention``),
  else by parameter identity."""
  if by_convention and isinstance(module, _LINEN_RHS_WEIGHT):
    return 1
  if by_convention and isinstance(module, _LINEN_NO_WEIGHT):
    return NO_WEIGHT_BY_DESIGN
  try:
    params = module.variables.get("params", {})
  except Exception:  # pragma: no cover - unbound module
    return None
  leaves = jax.tree.leaves(meta.unbox(params))
  hits = [i for i, o in enumerate(operands) if any(o is leaf for leaf in leaves)]
  if len(hits) == 1:
    return hits[0]
  return None


def nnx_weight_operand(module, operands) -> tuple[int | None, str | None]:
  """(index, attribute name) of the operand that is one of the nnx ``module``'s own
  ``nnx.Param`` s (the Variable itself, or its value: ``self.w[...]`` is the stored array, the
  traced one under nnx.jit / nnx.grad / nnx.scan); (None, None) unless exactly one operand is.
  A cast, slice or transpose of a parameter is a new array, not the parameter."""
  params = [(name, v, v.get_value()) for name, v in vars(module).items()
            if isinstance(v, nnx.Param)]
  hits = [(i, name) for i, o in enumerate(operands)
          for name, var, value in params if o is var or o is value]
  if len(hits) == 1:
    return hits[0]
  return None, None


# The op state a provider keeps beside a module's own parameters (``<op id>_<name>``).
OP_PARAM_SUFFIXES = ("_act_scale", "_act_shift", "_lora_a", "_lora_b")


def weight_param_name(module_params: Mapping, shape, *, what: str, where: str) -> str:
  """The name of the module's parameter that an op took as its weight operand, by shape.

  ``kernel`` where several parameters have the shape; the ops' own state
  (learned scales and shifts, adapters) never counts. A boxed parameter
  (``nn.with_partitioning``'s ``nn.Partitioned``) is its array's shape. ``what``
  starts the error (``"freeze"``, ``"lora.merge"``), which names ``where``.
  """
  shape = tuple(shape)
  own = {k: meta.unbox(v) for k, v in module_params.items()
         if not isinstance(v, Mapping) and not k.endswith(OP_PARAM_SUFFIXES)}
  hits = [k for k, v in own.items() if tuple(np.shape(v)) == shape]
  if "kernel" in hits:
    return "kernel"
  if len(hits) == 1:
    return hits[0]
  if not hits:
    stacked = [k for k, v in own.items() if tuple(np.shape(v))[1:] == shape]
    if stacked:
      # (freeze takes nnx layers stacked by nnx.vmap: it freezes them one by one.)
      kinds = "nn.scan / nn.vmap" + ("" if what == "freeze" else " / nnx.scan / nnx.vmap")
      raise ValueError(f"{what}: layer {where!r}: parameter {stacked[0]!r} has shape "
                       f"{tuple(np.shape(own[stacked[0]]))}, the op's weight {shape}: {what} "
                       f"does not take layers stacked by {kinds}")
    raise ValueError(f"{what}: layer {where!r}: no parameter of the module has the weight's shape "
                     f"{shape} (parameters: { {k: tuple(np.shape(v)) for k, v in own.items()} }); "
                     f"an op whose weight is computed from parameters is not supported by {what}")
  raise ValueError(f"{what}: layer {where!r}: parameters {hits} all have the weight's shape "
                   f"{shape}; name the weight 'kernel' for {what}")


_NO_QUANT_STATS = (
    "static activation scales (act_static_scale=True) live in the \"quant_stats\" collection, "
    "which this module's scope does not have: inside nn.scan (or another lifted transform), add "
    "\"quant_stats\" to nn.scan's variable_axes (e.g. variable_axes={\"params\": 0, "
    "\"quant_stats\": 0}); in apply, pass the \"quant_stats\" that init returned")


# linen's lifted transforms that pass a body only the RNG streams their split_rngs names (a
# scope's debug_path shows each as 'scan(<name>)', 'vmap(<name>)', ...).
_RNG_FILTERING_TRANSFORMS = ("scan", "vmap", "while_loop")


def _rng_filtering_frames(debug_path) -> list[str]:
  """The entries of a linen scope's ``debug_path`` made by a lifted transform that filters
  RNG streams (``'scan(blocks)'``)."""
  return [f"{p!r}" for p in debug_path
          if isinstance(p, str) and p.split("(", 1)[0] in _RNG_FILTERING_TRANSFORMS
          and p.endswith(")")]


class LinenHost:
  """An op's state in the calling linen module's scope (names prefixed by op id)."""

  def __init__(self, module, op_id: str):
    self.module = module
    self.op_id = op_id
    self.initializing = module.is_initializing()
    self.calibrating = (not self.initializing) and module.is_mutable_collection("quant_stats")

  def param(self, name, init_fn):
    return self.module.scope.param(f"{self.op_id}_{name}", lambda *_: init_fn())

  def stat(self, name, init_fn):
    try:
      return self.module.scope.variable("quant_stats", f"{self.op_id}_{name}", init_fn).value
    except flax_errors.ScopeCollectionNotFound as e:
      raise ValueError(_NO_QUANT_STATS) from e

  def set_stat(self, name, value):
    try:
      self.module.scope.put_variable("quant_stats", f"{self.op_id}_{name}", value)
    except flax_errors.ScopeCollectionNotFound as e:  # pragma: no cover - stat() raises first
      raise ValueError(_NO_QUANT_STATS) from e

  def rng_key(self, stream, what):
    if not self.module.scope.has_rng(stream):
      return None  # forward-only use is fine; a gradient raises missing_rng_message
    return self.module.make_rng(stream)

  def init_key(self, what):
    if not self.module.scope.has_rng("params"):
      raise ValueError(f"qtrain: {what} is initialised from the 'params' RNG stream, which this "
                       "call was not given: create it in init (qmodel.init(key, ...))")
    return self.module.make_rng("params")

  def dropout_key(self):
    if not self.module.scope.has_rng(DROPOUT_STREAM):
      return None  # evaluation: no dropout
    return self.module.make_rng(DROPOUT_STREAM)

  def missing_rng_message(self, stream, what):
    give = (f"call apply(..., rngs={{{stream!r}: key}}) (fold the step into the key so each "
            "step differs)")
    lifted = _rng_filtering_frames(self.module.scope.debug_path)
    if not lifted:
      return (f"qtrain: {what} needs keys from the Flax RNG stream {stream!r} for its gradient, "
              f"which this apply was not given: {give}")
    # Inside nn.scan / nn.vmap only the streams named in split_rngs reach the body: the
    # apply may well have been given the stream.
    return (f"qtrain: {what} needs keys from the Flax RNG stream {stream!r} for its gradient, "
            f"which this module's scope does not have: it runs inside {', '.join(lifted)}, "
            f"and a lifted transform passes only the streams its split_rngs names: add "
            f"{stream!r} to split_rngs (e.g. split_rngs={{'params': True, {stream!r}: True}}, "
            f"each layer its own keys), and {give}")
