"""Output placement of a quantized op: the sharding the float op it replaces would give.

A quantized op stands in for ``jax.lax.dot_general`` / ``jnp.einsum`` /
``jax.lax.conv_general_dilated`` and must place its result where the float op
would: at its ``out_sharding``, or (under Explicit mesh axes, ``jax.set_mesh``)
where explicit sharding infers it. The provider (training) and the frozen ops
(serving) both go through :func:`as_float_sharded`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def explicit_sharding() -> bool:
  """Whether the context mesh (``jax.set_mesh``) has Explicit axes: then arrays carry their
  sharding in their type and a product's output sharding is part of its result."""
  mesh = jax.sharding.get_abstract_mesh()
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def needs_placement(out_sharding: Any) -> bool:
  """Whether a call must go through :func:`as_float_sharded`."""
  return out_sharding is not None or explicit_sharding()


def as_float_sharded(float_call: Callable, quantized: Callable, *args, out_sharding=None,
                     carried: Any = None):
  """``quantized(*args)`` with the output sharding ``float_call(*args)`` has (its
  ``out_sharding``, or what explicit sharding infers; the float op's own error where it has
  none). ``quantized`` is called without ``out_sharding``; with ``carried`` (a pytree of the
  arrays it reads besides ``args``: a frozen layer's packed weight, an adapter), as
  ``quantized(*args, carried)``: arrays closed over would keep their Explicit types inside.

  Under Explicit mesh axes every product inside the op would need its own output sharding (a
  weight gradient contracts the sharded batch): the op runs with the axes Auto instead
  (``jax.sharding.auto_axes``), partitioned as under ``jit``, and its result is cast to the
  float op's sharding; the gradients come back in their operands' shardings.
  """
  if carried is not None:
    args = (*args, carried)
  want = getattr(jax.eval_shape(float_call, *args[:len(args) - (carried is not None)]),
                 "sharding", None)
  if want is None:  # no mesh in context: the float op took out_sharding as a placement
    out = quantized(*args)
    if isinstance(out_sharding, jax.sharding.NamedSharding):
      out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out
  return jax.sharding.auto_axes(quantized, out_sharding=want.spec)(*args)
