"""float64 references and error budgets for the property tests (tests/*/test_*_props.py).

Every budget is derived from the arithmetic the library documents, never fitted
to its output. Notation: ``u`` is the unit roundoff of a float dtype
(2^-24 float32, 2^-8 bfloat16, 2^-11 float16: half the spacing at 1);
``gamma(k, u) = k u / (1 - k u)`` bounds the relative error of k successive
roundings (Higham, Accuracy and Stability of Numerical Algorithms, 3.1);
``TINY32`` (2^-126, the smallest normal float32) bounds the absolute error of
one float32 operation whose result is flushed to zero (XLA flushes float32
subnormals on the CPU and on GPUs). A float64 sum of n terms adds
``n 2^-53`` of the absolute sum (counted where it matters).
"""

from __future__ import annotations

import string

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qtrain.core import qtypes

U32 = 2.0 ** -24
U64 = 2.0 ** -53
TINY32 = float(np.finfo(np.float32).tiny)


def unit_roundoff(dtype) -> float:
  return 2.0 ** -(jnp.finfo(jnp.dtype(dtype)).nmant + 1)


def flush(dtype) -> float:
  """Absolute error of rounding one value into ``dtype`` near zero: float16
  keeps subnormals (half its subnormal step); float32 and bfloat16 values are
  computed in float32, whose subnormals XLA flushes (TINY32)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float16:
    return 2.0 ** -25
  return TINY32


def overflow_threshold(dtype) -> float:
  """The smallest magnitude that rounds to Inf in ``dtype`` (max + half an ulp)."""
  fi = jnp.finfo(jnp.dtype(dtype))
  return float(fi.max) + 2.0 ** (fi.maxexp - 1 - fi.nmant - 1)


def gamma(k: float, u: float = U32) -> float:
  return k * u / (1 - k * u)


def f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


# ----------------------------------------------------------------------------
# Grids (numpy twins of qtrain.core.qarray's scale layout)


def normalize_grid(shape, cw, tiles):
  nd = len(shape)
  return tuple(sorted(a % nd for a in cw)), {a % nd: t for a, t in tiles.items()}


def group_reduce(x: np.ndarray, cw, tiles, fn) -> np.ndarray:
  """``fn(x, axis=..., keepdims=True)`` per scale group (tiled axes split in tiles)."""
  split, red = [], []
  for a, n in enumerate(x.shape):
    if a in tiles:
      split += [n // tiles[a], tiles[a]]
      red.append(len(split) - 1)
    else:
      if a not in cw:
        red.append(len(split))
      split.append(n)
  out_shape = tuple(n // tiles[a] if a in tiles else (n if a in cw else 1)
                    for a, n in enumerate(x.shape))
  return fn(x.reshape(split), axis=tuple(red), keepdims=True).reshape(out_shape)


def expand(s: np.ndarray, shape) -> np.ndarray:
  """A (tiled) scale repeated to ``shape`` (numpy twin of ``qarray.expand_scale``)."""
  s = np.asarray(s)
  for a, (ns, n) in enumerate(zip(s.shape, shape)):
    if ns not in (1, n):
      s = np.repeat(s, n // ns, axis=a)
  return np.broadcast_to(s, shape)


def group_sizes(shape, cw, tiles) -> int:
  n = 1
  for a, s in enumerate(shape):
    n *= tiles[a] if a in tiles else (1 if a in cw else s)
  return n


# ----------------------------------------------------------------------------
# The per-element contract of quantize / dequantize


def fp8_steps(qt: qtypes.QType) -> tuple[float, float, int]:
  """(smallest normal, subnormal step, mantissa bits) of an fp8 qtype."""
  fi = ml_dtypes.finfo(qt.compute_dtype)
  return float(fi.smallest_normal), float(fi.smallest_subnormal), int(fi.nmant)


def element_budget(x: np.ndarray, s: np.ndarray, zp: np.ndarray | None, qt: qtypes.QType, *,
                   stochastic: bool) -> tuple[np.ndarray, np.ndarray]:
  """(center, bound) with ``|dequantized - center| <= bound`` per element.

  ``x``, ``s`` (the scale expanded to x's shape), ``zp`` in float64; finite.
  center = x clipped to the representable range [(qmin - zp) s, (qmax - zp) s]
  (values outside clip to its end). Bounds:
    * integer, ternary: rounding to nearest is off by <= 1/2 step (s / 2);
      stochastic rounding picks floor or ceil: < 1 step (s).
    * fp8: x / s rounds to the nearest fp8 value: relative 2^-(m+1) in the
      normal range, half a subnormal step below (stochastic: twice that).
    * float32 roundings: y = x / s and y + zp are each rounded once (u |x|
      and u s |y|), the dequantized (q - zp) * s once more (u |x_hat|), and a
      subnormal input may be flushed (TINY32): 4 u (|x| + s (|zp| + 1)) + TINY32.
  Binary is exact (center = sign(x) s with sign(0) = +1, bound 0) and is
  checked apart for stochastic rounding (any of -s, +s).
  """
  zp0 = np.zeros_like(s) if zp is None else zp
  slack = 4 * U32 * (np.abs(x) + s * (np.abs(zp0) + 1)) + TINY32
  if qt.kind == "binary":
    return np.where(x >= 0, s, -s), np.zeros_like(x)
  lo, hi = (qt.qmin - zp0) * s, (qt.qmax - zp0) * s
  center = np.clip(x, lo, hi)
  steps = 1.0 if stochastic else 0.5
  if qt.is_float:
    smallest_normal, sub_step, nmant = fp8_steps(qt)
    y = np.abs(center) / np.where(s == 0, 1, s)
    rel = 2.0 ** -nmant * steps
    bound = s * np.maximum(rel * y, sub_step * steps)
    return center, bound + slack
  return center, s * steps + slack


# The value-set and MX qtypes (nf4, mxfp8, mxfp4): an element rounds to the nearest value of
# its format's set (nf4's 16 table values, e2m1's, e4m3's up to 448) times the scale, and a
# value beyond the set's ends to its end. So |x_hat - clip(x)| <= (the largest gap between
# neighbouring values) / 2 x scale: nf4 0.152 (between -1 and -0.696), mxfp4 1 (between 4 and
# 6), mxfp8 16 (between 416 and 448). An MX block's e8m0 scale puts its absmax below the top
# value plus half the top gap (464 / 7: e8m0_scale), so the clip there is within that too, and
# an absmax nf4 scale puts every element inside [-1, 1]. The same budgets as
# tests/core/test_quantize_props.py, which checks quantize against them.


def element_values(qt: qtypes.QType) -> np.ndarray:
  """The values an element of a value-set or MX qtype takes (before the scale), sorted."""
  if qt.is_lut:
    return np.unique(np.asarray(qt.values, np.float64))
  bits = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  g = np.unique(bits[np.isfinite(bits)])
  return g[np.abs(g) <= qt.qmax]


def max_gap(qt: qtypes.QType) -> float:
  """The largest gap between neighbouring element values of a value-set / MX qtype."""
  return float(np.max(np.diff(element_values(qt))))


def value_set_error(x: np.ndarray, s: np.ndarray, qt: qtypes.QType) -> np.ndarray:
  """Per element, a bound of ``|x_hat - x|`` for a value-set / MX qtype (``x``, ``s`` finite,
  float64, ``s`` expanded to x's shape): inside [qmin s, qmax s] half the largest gap times the
  scale; beyond it the clip itself (the end value is exact), at least that half gap (an MX
  block's top lands up to half a gap above qmax); plus the float32 roundings of x / s and of
  the table value times s (4 u of each side) and a flush (TINY32)."""
  center = np.clip(x, qt.qmin * s, qt.qmax * s)
  slack = 4 * U32 * (np.abs(x) + s * abs(qt.qmax)) + TINY32
  return np.maximum(np.abs(center - x), max_gap(qt) / 2 * s) + slack


def minmax_cap(qt: qtypes.QType) -> float:
  """The largest minmax scale: -qmin steps on each side of 0 finite in float32 (the
  calibration's contract, with its 2**-18 margin for rounding)."""
  return float(np.finfo(np.float32).max) / -qt.qmin * (1 - 2.0 ** -18)


def calibration_scales(x: np.ndarray, qt: qtypes.QType, cal, cw, tiles):
  """Per group of ``x`` (float64, finite where it matters): (expected scale,
  relative tolerance, zero bound) in the scale's shape, per the Calibration
  docstring: scale = bound * multiplier / qmax (minmax: span / (qmax - qmin)),
  an all-zero group gives 1 (binary: 0), a zero bound of other data (a low
  percentile) the TINY32 grid; issue 16's contract clamps it below at
  TINY32 and above where the largest code times it would overflow float32.

  Tolerances: each float32 rounding on the way is one u (multiplier, / qmax);
  a float32 sum of n positive terms is within gamma(n) (absmean, rms; rms
  squares first and halves the relative error in sqrt); percentile
  interpolates two sorted values with a weight rounded to ~n u, times their
  gap (<= max |x|), turned into a relative tolerance of the scale.
  """
  a = np.abs(x)
  n = group_sizes(x.shape, cw, tiles)
  m = cal.multiplier
  if x.size == 0:  # no groups, or only empty ones (all-zero, vacuously)
    sshape = tuple(s // tiles[i] if i in tiles else (s if i in cw else 1) for i, s in enumerate(x.shape))
    s0 = np.ones(sshape)
    if cal.method == "fixed":
      s0 = np.full(sshape, max(float(np.float32(cal.bound)) * m / qt.qmax, TINY32))
    elif qt.kind == "binary":
      s0 = np.zeros(sshape)
    return s0, np.full(sshape, gamma(2)), np.full(sshape, cal.method != "fixed")
  red = lambda v, fn: group_reduce(v, cw, tiles, fn)
  amax = red(a, lambda v, axis, keepdims: np.max(v, axis=axis, keepdims=keepdims, initial=0.0))
  tol_abs = 0.0
  if n == 0:
    bound, tol = np.zeros_like(amax), 0.0
  elif cal.method == "absmax":
    bound, tol = amax, gamma(3)
  elif cal.method == "absmean":
    bound, tol = red(a, np.mean), gamma(n + 3)
  elif cal.method == "rms":
    bound, tol = np.sqrt(red(a * a, np.mean)), gamma(n + 4)
  elif cal.method == "percentile":
    bound = red(a, lambda v, axis, keepdims: np.percentile(v, cal.percentile, axis=axis,
                                                           keepdims=keepdims))
    tol, tol_abs = gamma(4), (n + 8) * U32 * amax
  elif cal.method == "fixed":
    bound, tol = np.full_like(amax, float(np.float32(cal.bound))), gamma(2)
  else:  # minmax
    lo = np.minimum(red(x, lambda v, axis, keepdims: np.min(v, axis=axis, keepdims=keepdims)), 0.0)
    hi = np.maximum(red(x, lambda v, axis, keepdims: np.max(v, axis=axis, keepdims=keepdims)), 0.0)
    span = (hi - lo) * m
    # The documented cap: 2**(bits-1) steps on each side of 0 stay finite in float32.
    s = np.where(span == 0, 1.0, np.clip(span / (qt.qmax - qt.qmin), TINY32, minmax_cap(qt)))
    return s, np.full_like(s, gamma(4)), span == 0
  # Only all-zero groups get the exact zero scale (1, or 0 for binary); a zero
  # bound of data that is not all zero (a low percentile of a mostly-zero group)
  # is a real bound and gives the TINY32 grid.
  zero = (bound == 0) if cal.method == "fixed" else (amax == 0)
  # The cap: the largest scale whose largest code (qmax, or -qmin where values can clip
  # there) times it stays finite in float32 (the contract of qarray.max_scale).
  codes = qt.qmax if (cal.method == "absmax" and m == 1.0) else max(qt.qmax, -qt.qmin)
  cap = float(np.finfo(np.float32).max) / codes
  s_raw = np.minimum(bound * m / qt.qmax, cap)
  s = np.where(zero, 0.0 if qt.kind == "binary" else 1.0, np.maximum(s_raw, TINY32))
  tol_rel = tol + tol_abs * m / qt.qmax / np.maximum(s, TINY32)
  return s, np.where(zero, 0.0, tol_rel), bound == 0


# ----------------------------------------------------------------------------
# dot_general in float64 (einsum), and its transposes for the gradients


def dot_subscripts(lnd: int, rnd: int, dn) -> tuple[str, str, str]:
  (lc, rc), (lb, rb) = dn
  letters = iter(string.ascii_letters)
  L, R = [None] * lnd, [None] * rnd
  for a, b in list(zip(lb, rb)) + list(zip(lc, rc)):
    L[a] = R[b] = next(letters)
  for i in range(lnd):
    L[i] = L[i] or next(letters)
  for i in range(rnd):
    R[i] = R[i] or next(letters)
  lfree = [a for a in range(lnd) if a not in lc and a not in lb]
  rfree = [b for b in range(rnd) if b not in rc and b not in rb]
  out = [L[a] for a in lb] + [L[a] for a in lfree] + [R[b] for b in rfree]
  return "".join(L), "".join(R), "".join(out)


def dot64(a, b, dn) -> np.ndarray:
  """lax.dot_general in float64 (NaN * 0 = NaN, as IEEE)."""
  ls, rs, os_ = dot_subscripts(np.ndim(a), np.ndim(b), dn)
  return np.einsum(f"{ls},{rs}->{os_}", f64(a), f64(b), optimize=False)


def dot64_lhs_bar(g, b, a_ndim: int, dn) -> np.ndarray:
  """The lhs cotangent of dot_general: sum over rhs free axes of g * rhs."""
  ls, rs, os_ = dot_subscripts(a_ndim, np.ndim(b), dn)
  return np.einsum(f"{os_},{rs}->{ls}", f64(g), f64(b), optimize=False)


def dot64_rhs_bar(g, a, b_ndim: int, dn) -> np.ndarray:
  ls, rs, os_ = dot_subscripts(np.ndim(a), b_ndim, dn)
  return np.einsum(f"{os_},{ls}->{rs}", f64(g), f64(a), optimize=False)


# ----------------------------------------------------------------------------
# Comparing an output with its float64 reference


def check_output(out, ref: np.ndarray, budget: np.ndarray, *, out_dtype, may_overflow: np.ndarray,
                 what: str, may_be_nan: np.ndarray | bool = False) -> None:
  """Asserts the output contract element by element.

  * ref NaN -> out NaN; ref +-Inf -> out not finite (never a finite number);
  * finite ref beyond the output dtype's range even after the budget, and no
    intermediate that may overflow first -> out is Inf of ref's sign;
  * otherwise |out - ref| <= budget, or (only where ``may_overflow``: an
    intermediate may legitimately exceed its dtype, e.g. a float32 partial
    sum, with either sign) out not finite;
  * ``may_be_nan``: outputs whose contraction includes a non-finite group
    only through implicit zeros (a convolution's padding or dilation holes,
    the masks of a grouped convolution): NaN is as right there as the finite
    value, whichever of the two the reference has.
  """
  o = f64(out)
  assert o.shape == ref.shape, f"{what}: shape {o.shape} != reference {ref.shape}"
  nan = np.isnan(ref) & ~np.asarray(may_be_nan)  # there a finite output is as right
  bad = np.argwhere(nan & ~np.isnan(o))
  assert not bad.size, f"{what}: NaN expected at {bad[:4].tolist()}, got {o[tuple(bad[0])]}"
  inf = np.isinf(ref)
  bad = np.argwhere(inf & np.isfinite(o))
  assert not bad.size, (f"{what}: non-finite expected at {bad[:4].tolist()} (ref "
                        f"{ref[tuple(bad[0])]}), got {o[tuple(bad[0])]}")
  fin = np.isfinite(ref)
  thr = overflow_threshold(out_dtype)
  must_inf = fin & (np.abs(ref) - budget >= thr) & ~may_overflow & ~np.asarray(may_be_nan)
  bad = np.argwhere(must_inf & ~(np.isinf(o) & (np.sign(o) == np.sign(ref))))
  assert not bad.size, (f"{what}: {ref[tuple(bad[0])]:.3e} overflows {jnp.dtype(out_dtype).name}, "
                        f"expected Inf, got {o[tuple(bad[0])]}")
  err = np.abs(o - ref)
  within = err <= budget
  ok = ~fin | must_inf | within | ((may_overflow | may_be_nan) & ~np.isfinite(o))
  if not ok.all():
    i = tuple(np.argwhere(~ok)[0])
    raise AssertionError(
        f"{what}: {int((~ok).sum())} of {ok.size} outside the budget; e.g. at {list(i)}: out "
        f"{o[i]!r}, ref {ref[i]!r}, |err| {err[i]:.4g} > budget {budget[i]:.4g} "
        f"(err / budget = {err[i] / max(budget[i], 1e-300):.3g})")
