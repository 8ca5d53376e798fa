"""A convolution as a matrix product: input patches (im2col) times the kernel as a matrix.

For ``batch_group_count == 1`` a convolution with ``G = feature_group_count``
groups is, at every output position, the product of the input window with
its group's kernel::

  out[n, s', g*Og + o] = sum_k P[n, s', g, k] * W[g, k, o]

with ``K = (C / G) * prod(window)``, window-major by default (window
position row-major, then channel: each window position's channels are one
contiguous run, the layout a GPU copies fastest) or channel-major
(``channel_major=True``: the order of
:func:`jax.lax.conv_general_dilated_patches`, frozen weights' layout). The patches are read from the
zero-padded (and, for ``lhs_dilation``, zero-interleaved) input by one
strided slice per window position, so they work for any dtype: int8 and fp8
codes stay codes, and a padded position holds the code 0. That is why
:mod:`qtrain.ops.conv_general_qt` takes patches of the *quantized* input:
padding contributes exactly 0, whatever the qtype's grid (binary's has no 0).

The product then runs on :func:`qtrain.ops.dispatch.quantized_dot_general`
(a GEMM, or a Pallas kernel), and the gradients on the same op's backward
products; :func:`patches_transpose` takes a gradient of the patches back to
the input (the transpose of the slicing: a scatter-add of the windows).

Layouts: ``G == 1``: patches ``(N, out spatial..., K)``, kernel ``(K, O)``;
``G > 1``: patches ``(N, out spatial..., G, K)``, kernel ``(G, K, O / G)``,
the group a batch axis of the product.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import qarray as qa
from qtrain.core import qdot
from qtrain.core import qtypes
from qtrain.ops.qt_operand import match_varying, varying_axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Geometry:
  """The static shape of a convolution seen as a matrix product.

  Attributes:
    lhs_spec, rhs_spec, out_spec: lax's ``ConvDimensionNumbers`` fields
      (``(batch, feature, spatial...)`` axes; the kernel's ``(out, in, spatial...)``).
    window: the kernel's spatial sizes.
    strides, lhs_dilation, rhs_dilation: per spatial dimension.
    padding: resolved ``(low, high)`` pairs (negative: cropping).
    out_spatial: the output's spatial sizes.
    groups: ``feature_group_count``.
    in_features, out_features: C and O.
    channel_major: K's order (see the module docstring).
  """

  lhs_spec: tuple[int, ...]
  rhs_spec: tuple[int, ...]
  out_spec: tuple[int, ...]
  window: tuple[int, ...]
  strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  out_spatial: tuple[int, ...]
  groups: int
  in_features: int
  out_features: int
  channel_major: bool = False

  @property
  def nsp(self) -> int:
    return len(self.window)

  @property
  def k(self) -> int:
    """The contraction per group: (C / G) * prod(window)."""
    return self.in_features // self.groups * math.prod(self.window)

  def dot_dimension_numbers(self):
    """``dot_general`` dimension numbers of patches x kernel matrix."""
    nd = self.nsp + (2 if self.groups == 1 else 3)
    if self.groups == 1:
      return (((nd - 1,), (0,)), ((), ()))
    return (((nd - 1,), (1,)), ((nd - 2,), (0,)))


def geometry(lhs_shape, rhs_shape, p, *, channel_major: bool = False) -> Geometry:
  """The :class:`Geometry` of a convolution (``p``: its parameters as
  :mod:`qtrain.ops.conv_general_qt` holds them, ``batch_group_count == 1``)."""
  lhs_spec, rhs_spec, out_spec = (tuple(int(a) for a in s) for s in p["dn"])
  out_shape = jax.eval_shape(
      lambda a, b: jax.lax.conv_general_dilated(
          a, b, p["window_strides"], p["padding"], lhs_dilation=p["lhs_dilation"],
          rhs_dilation=p["rhs_dilation"], dimension_numbers=p["dn"],
          feature_group_count=p["feature_group_count"]),
      jax.ShapeDtypeStruct(tuple(lhs_shape), jnp.float32),
      jax.ShapeDtypeStruct(tuple(rhs_shape), jnp.float32)).shape
  window = tuple(int(rhs_shape[a]) for a in rhs_spec[2:])
  padding = p["padding"]
  if isinstance(padding, str):
    eff = tuple(0 if k == 0 else (k - 1) * d + 1 for k, d in zip(window, p["rhs_dilation"]))
    padding = jax.lax.padtype_to_pads(tuple(lhs_shape[a] for a in lhs_spec[2:]), eff,
                                      p["window_strides"], padding)
  return Geometry(
      lhs_spec=lhs_spec, rhs_spec=rhs_spec, out_spec=out_spec, window=window,
      strides=tuple(int(s) for s in p["window_strides"]),
      padding=tuple((int(lo), int(hi)) for lo, hi in padding),
      lhs_dilation=tuple(int(d) for d in p["lhs_dilation"]),
      rhs_dilation=tuple(int(d) for d in p["rhs_dilation"]),
      out_spatial=tuple(int(out_shape[a]) for a in out_spec[2:]),
      groups=int(p["feature_group_count"]),
      in_features=int(lhs_shape[lhs_spec[1]]), out_features=int(rhs_shape[rhs_spec[0]]),
      channel_major=channel_major)


def _canonical_input(x, geo: Geometry):
  """(N, spatial..., C) from the lhs layout."""
  return jnp.transpose(x, (geo.lhs_spec[0],) + geo.lhs_spec[2:] + (geo.lhs_spec[1],))


def _patches_canonical(xc, geo: Geometry):
  """(N, spatial..., C) -> (N, out spatial..., [G,] K)."""
  zero = jnp.zeros((), xc.dtype)
  cfg = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(geo.padding, geo.lhs_dilation)]
  xp = jax.lax.pad(xc, zero, cfg + [(0, 0, 0)])
  n, c = xp.shape[0], xp.shape[-1]
  taps = []
  for offs in itertools.product(*(range(k) for k in geo.window)):
    start = [0] + [o * d for o, d in zip(offs, geo.rhs_dilation)] + [0]
    limit = ([n] + [s + (m - 1) * st + 1 for s, m, st in zip(start[1:], geo.out_spatial, geo.strides)]
             + [c])
    taps.append(jax.lax.slice(xp, start, limit, [1] + list(geo.strides) + [1]))
  return _merge_k(jnp.stack(taps, axis=_taps_axis(geo)), geo)


def _taps_axis(geo: Geometry) -> int:
  return -1 if geo.channel_major else -2


def _merge_k(t, geo: Geometry):
  """(..., window, C) (channel-major: (..., C, window)) -> (..., [G,] K)."""
  lead, g = t.shape[:-2], geo.groups
  if g > 1 and not geo.channel_major:  # each group's channels together, window-major within
    kk, c = t.shape[-2:]
    t = jnp.moveaxis(t.reshape(lead + (kk, g, c // g)), -2, -3)
  return t.reshape(lead + ((g, geo.k) if g > 1 else (geo.k,)))


def patches(x: jax.Array, geo: Geometry) -> jax.Array:
  """The input windows of every output position (see the module docstring);
  ``x`` in the convolution's lhs layout, any dtype; padding reads 0."""
  return _patches_canonical(_canonical_input(x, geo), geo)


def patches_transpose(dp: jax.Array, geo: Geometry, x_shape) -> jax.Array:
  """The transpose of :func:`patches`: window gradients summed back into the
  input (lhs layout, ``dp``'s dtype)."""
  perm = (geo.lhs_spec[0],) + geo.lhs_spec[2:] + (geo.lhs_spec[1],)
  xc_shape = tuple(int(x_shape[a]) for a in perm)
  f = lambda xc: _patches_canonical(xc, geo)
  # The vjp of the (linear) patch gather at a zero input: XLA drops the unused forward. The
  # zeros vary over dp's shard_map axes, so the cotangent's type matches the output's.
  zeros = match_varying(jnp.zeros(xc_shape, dp.dtype), varying_axes(dp))
  (xc,) = jax.vjp(f, zeros)[1](dp)
  return jnp.transpose(xc, tuple(int(i) for i in np.argsort(perm)))


def _kernel_perm(geo: Geometry):
  if geo.channel_major:
    return (geo.rhs_spec[1],) + geo.rhs_spec[2:] + (geo.rhs_spec[0],)  # (C/G, window..., O)
  return geo.rhs_spec[2:] + (geo.rhs_spec[1], geo.rhs_spec[0])  # (window..., C/G, O)


def kernel_matrix(w: jax.Array, geo: Geometry) -> jax.Array:
  """The kernel (rhs layout) as ``(K, O)``, or ``(G, K, O / G)`` for groups."""
  m = jnp.transpose(w, _kernel_perm(geo)).reshape(geo.k, geo.out_features)
  if geo.groups == 1:
    return m
  return jnp.transpose(m.reshape(geo.k, geo.groups, -1), (1, 0, 2))


def kernel_from_matrix(m: jax.Array, geo: Geometry, w_shape) -> jax.Array:
  """The inverse of :func:`kernel_matrix`: back to the rhs layout."""
  if geo.groups > 1:
    m = jnp.transpose(m, (1, 0, 2)).reshape(geo.k, geo.out_features)
  perm = _kernel_perm(geo)
  t = m.reshape(tuple(int(w_shape[a]) for a in perm))
  return jnp.transpose(t, tuple(int(i) for i in np.argsort(perm)))


def output_layout(y: jax.Array, geo: Geometry) -> jax.Array:
  """The product's output -> the convolution's output layout."""
  if geo.groups > 1:  # (G, N, out spatial..., O/G) -> (N, out spatial..., O)
    y = jnp.moveaxis(y, 0, -2)
    y = y.reshape(y.shape[:-2] + (geo.out_features,))
  perm = (geo.out_spec[0],) + geo.out_spec[2:] + (geo.out_spec[1],)
  return jnp.transpose(y, tuple(int(i) for i in np.argsort(perm)))


def product_layout(g: jax.Array, geo: Geometry) -> jax.Array:
  """The inverse of :func:`output_layout` (an output gradient into the product's layout)."""
  g = jnp.transpose(g, (geo.out_spec[0],) + geo.out_spec[2:] + (geo.out_spec[1],))
  if geo.groups == 1:
    return g
  g = g.reshape(g.shape[:-1] + (geo.groups, geo.out_features // geo.groups))
  return jnp.moveaxis(g, -2, 0)


# ----------------------------------------------------------------------------
# Quantized operands.


def _spatially_constant(q: qa.QArray, spatial) -> bool:
  return q.zero_point is None and all(q.scale.shape[a] == 1 for a in spatial)


def keeps_codes(x, spatial) -> bool:
  """Whether :func:`patches_operand` / :func:`kernel_operand` keep a QArray's codes (no LUT
  qtype, no zero point, a scale constant over the ``spatial`` axes); a QArray that does not is
  dequantized into float32 first. False for a float array."""
  return qdot.is_quantized(x) and not x.qtype.is_lut and _spatially_constant(x, spatial)


def patches_operand(x, geo: Geometry):
  """:func:`patches` of the conv's input as a product operand.

  A QArray whose scale is constant over the spatial axes (and has no zero
  point) stays quantized: patches of its codes, its scale laid onto the
  patches (per batch element, per tensor, or per input channel repeated over
  the window); integer-like codes travel as int8 (a padded position holds 0,
  which a binary operand's ``+-1`` grid could not say). Any other QArray is
  dequantized into float32 first (its padding is then the value 0). A float
  array's patches are in its dtype.
  """
  if not qdot.is_quantized(x):
    return patches(x, geo)
  # A LUT qtype's code 0 is not the value 0 (nf4's is -1): its padding must be the value.
  if not keeps_codes(x, geo.lhs_spec[2:]):
    return patches(x.dequantize(jnp.float32), geo)
  codes = patches(x.qvalue, geo)
  s = _canonical_input(x.scale.astype(jnp.float32), geo)  # (N|1, 1..., C|1)
  nd = codes.ndim
  if s.shape[-1] == 1:
    s = s.reshape(s.shape[:-1] + (1,) * (nd - s.ndim + 1))
  else:  # per input channel: the same scale at every window position
    s = jnp.expand_dims(s, _taps_axis(geo))
    shape = list(s.shape)
    shape[_taps_axis(geo)] = math.prod(geo.window)
    s = _merge_k(jnp.broadcast_to(s, tuple(shape)), geo)
  qtype = x.qtype
  if qtype.is_integer_like and qtype.name != "int8":
    qtype = qtypes.get_qtype("int8")
  return qa.QArray(qvalue=codes, scale=s, zero_point=None, qtype=qtype)


def kernel_operand(w, geo: Geometry):
  """:func:`kernel_matrix` of the conv's kernel as a product operand (a
  QArray keeps its qtype; its scale per output feature, per tensor or per
  input channel is laid onto the matrix; others are dequantized into float32)."""
  if not qdot.is_quantized(w):
    return kernel_matrix(w, geo)
  if not keeps_codes(w, geo.rhs_spec[2:]):
    return kernel_matrix(w.dequantize(jnp.float32), geo)
  s = jnp.transpose(w.scale.astype(jnp.float32), _kernel_perm(geo))  # C/G|1 and O|1 sized
  ci, co, kk = s.shape[0 if geo.channel_major else -2], s.shape[-1], math.prod(geo.window)
  if ci == 1:
    s = s.reshape(1, co)
  elif geo.channel_major:
    s = jnp.broadcast_to(s.reshape(ci, 1, co), (ci, kk, co)).reshape(geo.k, co)
  else:
    s = jnp.broadcast_to(s.reshape(1, ci, co), (kk, ci, co)).reshape(geo.k, co)
  if geo.groups > 1:
    s = jnp.transpose(s.reshape(s.shape[0], geo.groups if co > 1 else 1, -1), (1, 0, 2))
  return qa.QArray(qvalue=kernel_matrix(w.qvalue, geo), scale=s, zero_point=None, qtype=w.qtype)
