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


def check_static_calibration(model, op, x, scales=(1.0, 2.0, 3.0), after=10.0):
  """An nnx QT op with a static activation scale (int8, absmax): ``quantize_model``'s sample
  forward did not calibrate; forwards under ``nnx.jit`` on ``x * s`` for each of ``scales``
  make the scale the mean of their absmax / 127; after ``qtrain.set_calibrate(model, False)``
  one more forward (on ``x * after``, returned with the scale) changes nothing."""
  import qtrain
  from flax import nnx
  assert isinstance(op.act_static_scale, qtrain.QuantStat)
  assert float(op.act_static_count[...]) == 0.0  # the sample forward does not calibrate
  fwd = nnx.jit(lambda m, v: m(v))
  batches = [x * s for s in scales]
  for b in batches:
    fwd(model, b)
  want = np.mean([float(jnp.max(jnp.abs(b))) / 127 for b in batches])
  np.testing.assert_allclose(op.act_static_scale[...], want, rtol=1e-6)
  qtrain.set_calibrate(model, False)
  y = fwd(model, x * after)
  assert float(op.act_static_count[...]) == float(len(scales))
  np.testing.assert_allclose(op.act_static_scale[...], want, rtol=1e-6)
  return y, want
