"""Helpers shared by the test modules (importable because pyproject sets pytest's pythonpath)."""

import jax
import jax.numpy as jnp
import numpy as np


def rel_error(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64 (a tiny floor keeps an all-zero ref finite)."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def all_eqns(jaxpr):
  """Every equation of ``jaxpr``, including those of nested (closed) jaxprs."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from all_eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from all_eqns(sub)


def random_acts(rng: np.random.Generator, m: int, k: int, kind: str) -> jax.Array:
  """(m, k) activations: int8 values over the full range, or standard normal floats."""
  if kind == "int8":
    return jnp.asarray(rng.integers(-128, 128, (m, k)), jnp.int8)
  return jnp.asarray(rng.standard_normal((m, k)), jnp.dtype(kind))
