"""The lax functions qtrain itself calls, bound once when qtrain is imported.

The provider swaps ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``,
``jax.lax.ragged_dot_general`` (and the other intercepted names) for dispatchers
while a quantized model runs. qtrain's own products must never go through
those dispatchers, so every internal call uses these
references, taken before any swap can happen.
"""

import jax

dot_general = jax.lax.dot_general
conv_general_dilated = jax.lax.conv_general_dilated
optimization_barrier = jax.lax.optimization_barrier
ragged_dot_general = jax.lax.ragged_dot_general


def has_symbolic_dim(*shapes) -> bool:
  """Whether any of ``shapes`` has a symbolic dimension (``jax.export`` with a shape
  variable): the kernels tile and pick configs on concrete sizes, so such products run on XLA."""
  return any(jax.export.is_symbolic_dim(d) for shape in shapes for d in shape)


def varying_axes(x) -> frozenset:
  """The ``jax.shard_map`` mesh axes ``x`` varies over (empty outside shard_map, and for None)."""
  if x is None:
    return frozenset()
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def bound_axis_names(x, names: tuple[str, ...], what: str) -> tuple[str, ...]:
  """The names in ``names`` bound by an enclosing ``jax.shard_map``: outside one the array
  is whole and there is nothing to reduce across. A name not bound while ``x`` is a shard
  of a shard_map (a misspelt axis) raises, naming ``what``."""
  out = []
  for n in names:
    try:
      jax.lax.axis_size(n)
    except NameError:
      have = varying_axes(x)
      if have:
        raise ValueError(f"{what}: {n!r} is not a mesh axis of the enclosing shard_map (the "
                         f"array varies over {sorted(have)})") from None
      continue
    out.append(n)
  return tuple(out)
