"""Gradient estimators for quantized operands, and gradients of learned scales.

The forward uses ``x_hat = dequantize(quantize(x))``; rounding has zero
gradient almost everywhere, so the backward needs an *estimator* of
``d x_hat / d x``:

* ``"ste"``: identity straight-through (the gradient passes unchanged).
* ``"clipped_ste"``: zero where ``x`` was outside the calibration range,
  ``|x / scale| > qmax`` (for ``binary``, ``|x / scale| > 1``: the
  bitorch-engine rule for activations), up to float32 rounding: the element
  that set an ``absmax`` scale is inside. With a zero point (``minmax``) the
  range is ``[qmin - 1/2, qmax + 1/2]`` after the shift (see
  :func:`pass_mask`).
* ``"clipped_ste_unit"``: zero where ``|x| > 1`` (larq's ``ste_sign``; used
  on latent binary weights kept in [-1, 1]).

For a learned scale ``s`` (passed into the op instead of calibrated), the
gradient follows ``scale_grad``:

* ``"lsq"``: LSQ (Esser et al. 2020): ``d x_hat / d s = q - x / s`` inside the
  range and ``q`` (the clip value) outside, times ``1 / sqrt(n * qmax)`` with
  ``n`` the number of values a scale covers.
* ``"bitorch"``: bitorch-engine's binary rule:
  ``grad_s = sum(grad_x_clipped * sign(x)) / sqrt(numel(x))``.

Example:
  >>> import jax.numpy as jnp
  >>> from qtrain.core import estimators
  >>> x = jnp.array([-2.0, -0.5, 0.5, 2.0]); s = jnp.ones(())
  >>> estimators.pass_mask("clipped_ste", x, s[None], qmax=1.0).tolist()
  [False, True, True, False]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qtrain.core import qarray

ESTIMATORS: tuple[str, ...] = ("ste", "clipped_ste", "clipped_ste_unit")
SCALE_GRADS: tuple[str, ...] = ("lsq", "bitorch")

# Relative float32 slack of clipped_ste's range test |x| <= qmax * scale. The
# scale is fl(fl(bound * multiplier) / qmax) and the test's bound
# fl(fl(qmax * (1 + SLACK)) * scale): up to 4 roundings of at most 2**-24 each
# (the forward's x / scale, 0.3 / (0.3 / 127), is 127.00001 in float32); the
# clamp of a scale to max_scale is one more. 2**-21 (8 roundings) covers them
# all: the element that set an absmax scale passes, an element beyond the
# bound by more than 2**-21 of it is masked.
SLACK = 2.0 ** -21


def pass_mask(estimator: str, x: jax.Array, scale_full: jax.Array, *, qmax: float,
              zero_point_full: jax.Array | None = None, qmin: float | None = None) -> jax.Array | None:
  """Where the gradient passes (bool, shaped like ``x``); None means everywhere.

  ``scale_full`` must broadcast against ``x``.
  """
  if estimator == "ste":
    return None
  if estimator == "clipped_ste_unit":
    return jnp.abs(x) <= 1.0
  if estimator == "clipped_ste":
    # The range test is done on x against bound = end * scale, not on x / scale:
    # no division (XLA turns it into a reciprocal, subnormal for scales above
    # 2**126). A bound that overflows to inf means every finite x is inside; a
    # zero scale (binary's all-zero group) holds only zeros, which pass.
    xf = x.astype(jnp.float32)
    s = scale_full.astype(jnp.float32)
    if zero_point_full is not None:
      # The zero point is rounded to an integer, which shifts the grid by up
      # to half a step against the calibrated range [lo, hi]: the range's
      # ends land within [qmin - 1/2, qmax + 1/2] steps of the grid. Values
      # there round to an end code with at most half a step of error, like
      # any value inside.
      lo, hi = float(qmin) - 0.5, float(qmax) + 0.5
      tol = SLACK * (hi - lo)
      return (xf >= (lo - tol - zero_point_full) * s) & (xf <= (hi + tol - zero_point_full) * s)
    return jnp.abs(xf) <= float(qmax) * (1.0 + SLACK) * s
  raise ValueError(f"Unknown estimator={estimator!r}; valid: {list(ESTIMATORS)}")


def reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Sums ``x`` down to ``shape`` (size-1 axes summed; tiled axes summed per tile)."""
  if x.shape == tuple(shape):
    return x
  if len(shape) < x.ndim:
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
  split, red = [], []
  for a, (n, ns) in enumerate(zip(x.shape, shape)):
    if ns == n:
      split.append(n)
    elif ns == 1:
      red.append(len(split))
      split.append(n)
    else:
      split += [ns, n // ns]
      red.append(len(split) - 1)
  return jnp.sum(x.reshape(split), axis=tuple(red)).reshape(shape)


def lsq_scale_grad(g_x: jax.Array, x: jax.Array, q: jax.Array, scale: jax.Array,
                   scale_full: jax.Array, *, qmin: float, qmax: float) -> jax.Array:
  """LSQ gradient of a learned scale, summed to ``scale.shape``."""
  y = qarray.divide_by_scale(x.astype(jnp.float32), scale)
  inside = (y >= qmin) & (y <= qmax)
  d = jnp.where(inside, q.astype(jnp.float32) - y, q.astype(jnp.float32))
  per_scale = x.size // max(scale.size, 1)
  factor = 1.0 / jnp.sqrt(float(per_scale) * float(max(qmax, 1.0)))
  return reduce_to(g_x.astype(jnp.float32) * d, scale.shape).reshape(scale.shape) * factor


def bitorch_scale_grad(g_x_clipped: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
  """bitorch-engine's binary activation-scale gradient, summed to ``scale.shape``."""
  sign = q.astype(jnp.float32)
  return reduce_to(g_x_clipped.astype(jnp.float32) * sign, scale.shape).reshape(scale.shape) / jnp.sqrt(
      float(g_x_clipped.size))
