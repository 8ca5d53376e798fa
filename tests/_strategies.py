"""Hypothesis strategies for the property tests (tests/*/test_*_props.py).

Arrays are drawn as *recipes* (:class:`Values`: a magnitude mode, a zero
fraction, non-finite values to plant, a seed) and built with numpy, so a
falsifying example prints in a few readable fields instead of a wall of
numbers. Magnitudes follow the issue: ``mantissa * 10**e`` with ``e`` one
value per tensor in [-30, 30] or one per element (mixed within a tensor),
plus the edges of the float32 range (near its largest value, and values whose
scale falls below its smallest normal), clamped to what each dtype holds.
"""

from __future__ import annotations

import dataclasses
import math
import os

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from qtrain.core import qarray, qtypes, rounding
from qtrain.ops import config as C

DEEP_EXAMPLES_ENV = "QTRAIN_DEEP_EXAMPLES"


def deep(fast: hypothesis.settings, examples: int) -> hypothesis.settings:
  """The settings of a ``*_deep`` property test: ``fast``'s with ``examples`` examples, or
  with ``$QTRAIN_DEEP_EXAMPLES`` where that is set (a longer search than CI's:
  ``QTRAIN_DEEP_EXAMPLES=1000 pytest -m slow -k deep tests``). The examples are
  derandomized, so CI's run is a fixed regression set; a longer run explores further."""
  n = os.environ.get(DEEP_EXAMPLES_ENV)
  if n is not None and not (n.isdigit() and int(n) > 0):
    raise ValueError(f"{DEEP_EXAMPLES_ENV}={n!r}: give a positive number of examples")
  return hypothesis.settings(fast, max_examples=int(n) if n else examples)


# The qtypes the generic property tests draw: every qtype with a free float32 scale and a
# numeric code (the value-set and MX qtypes have their own references and budgets, drawn by
# NEW_QTYPES in tests/core/test_lut_mx_qtypes.py: codes are table indices, MX scales powers of
# two in blocks of 32).
QTYPES: tuple[str, ...] = tuple(n for n in qtypes.VALID_QTYPES
                                if not (qtypes.get_qtype(n).is_lut or qtypes.get_qtype(n).is_mx))
NEW_QTYPES: tuple[str, ...] = tuple(n for n in qtypes.VALID_QTYPES if n not in QTYPES)
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
GRAD_QTYPES: tuple[str, ...] = ("int8", "float8_e4m3fn", "float8_e5m2")
MODES: tuple[str, ...] = ("unit", "tensor", "mixed", "huge", "tiny")


def grad_quants() -> st.SearchStrategy:
  """None or a GradQuant: every gradient qtype x every rounding method (None included)."""
  return st.one_of(st.none(), st.builds(
      C.GradQuant, qtype=st.sampled_from(GRAD_QTYPES),
      stochastic_rounding=st.sampled_from([None, *rounding.STOCHASTIC_METHODS])))


def _exponent_range(dtype) -> tuple[int, int]:
  """Decimal exponents e such that [1, 10) * 10**e is finite and normal in ``dtype``.

  Capped at the issue's [-30, 30]; float16 holds [6.1e-5, 65504] as normals,
  so its range is [-4, 3].
  """
  fi = jnp.finfo(jnp.dtype(dtype))
  lo = math.ceil(math.log10(float(fi.smallest_normal)))
  hi = math.floor(math.log10(float(fi.max))) - 1
  return max(lo, -30), min(hi, 30)


@dataclasses.dataclass(frozen=True)
class Values:
  """How to fill an array (see :func:`make`).

  Attributes:
    mode: ``unit`` (mantissas in [1, 10) times 10**-1), ``tensor`` (one
      exponent for the tensor), ``mixed`` (one exponent per element over the
      dtype's range), ``huge`` (magnitudes in [max / 16, max] of the dtype:
      reductions and epilogues near overflow), ``tiny`` (float32/bf16:
      [1e-37, 1e-36], normal values whose int8/fp8 scale is below the
      smallest normal float32; float16: [6.1e-5, 6.1e-4]).
    exponent: the tensor's exponent for ``tensor`` (clamped to the dtype).
    zeros: the fraction of elements set to 0.0 (some of them -0.0).
    nonfinite: values planted at random positions (``"nan"``, ``"inf"``, ``"-inf"``).
    seed: the numpy seed of the mantissas, signs and positions.
    explicit: the values themselves (for @hypothesis.example regressions);
      overrides everything above.
  """

  mode: str = "unit"
  exponent: int = 0
  zeros: float = 0.0
  nonfinite: tuple[str, ...] = ()
  seed: int = 0
  explicit: tuple[float, ...] | None = None  # exact values (explicit examples), row-major

  def nominal(self, dtype) -> float:
    """A typical magnitude of the values (to size a fixed calibration bound)."""
    lo, hi = _exponent_range(dtype)
    fi = jnp.finfo(jnp.dtype(dtype))
    if self.mode == "tensor":
      return 5.0 * 10.0 ** min(max(self.exponent, lo), hi)
    if self.mode == "mixed":
      return 10.0 ** hi
    if self.mode == "huge":
      return float(fi.max) / 2
    if self.mode == "tiny":
      return 5e-37 if jnp.dtype(dtype) != jnp.float16 else 3e-4
    return 0.5


def make(v: Values, shape: tuple[int, ...], dtype) -> np.ndarray:
  """The array ``v`` describes, in ``dtype`` (bf16 via ml_dtypes)."""
  dtype = jnp.dtype(dtype)
  if v.explicit is not None:
    return np.asarray(v.explicit, np.float64).reshape(shape).astype(dtype)
  rng = np.random.default_rng(v.seed)
  n = int(np.prod(shape, dtype=np.int64))
  lo, hi = _exponent_range(dtype)
  mant = rng.uniform(1.0, 10.0, n)
  fi = jnp.finfo(dtype)
  if v.mode == "unit":
    mag = mant * 0.1
  elif v.mode == "tensor":
    mag = mant * 10.0 ** min(max(v.exponent, lo), hi)
  elif v.mode == "mixed":
    mag = mant * 10.0 ** rng.integers(lo, hi + 1, n).astype(np.float64)
  elif v.mode == "huge":
    mag = float(fi.max) * rng.uniform(1 / 16, 1.0, n)
  elif v.mode == "tiny":
    base = 1e-37 if dtype != jnp.float16 else float(fi.smallest_normal)
    mag = base * mant
  else:
    raise ValueError(f"mode={v.mode!r}; valid: {list(MODES)}")
  x = mag * rng.choice([-1.0, 1.0], n)
  if v.zeros:
    z = rng.uniform(size=n) < v.zeros
    x[z] = rng.choice([0.0, -0.0], int(z.sum()))
  if n and v.nonfinite:
    pos = rng.choice(n, size=min(len(v.nonfinite), n), replace=False)
    for p, kind in zip(pos, v.nonfinite):
      x[p] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
  out = x.reshape(shape).astype(dtype)
  # Rounding into the dtype must not create an Inf the recipe did not ask for.
  assert np.isfinite(out.astype(np.float64)).sum() + len(v.nonfinite) >= n
  return out


def values(*, nonfinite: bool = False, modes: tuple[str, ...] = MODES) -> st.SearchStrategy[Values]:
  return st.builds(
      Values,
      mode=st.sampled_from(modes),
      exponent=st.integers(-30, 30),
      zeros=st.sampled_from([0.0, 0.0, 0.3, 0.9]),
      nonfinite=(st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=2).map(tuple)
                 if nonfinite else st.just(())),
      seed=st.integers(0, 2**16),
  )


@st.composite
def calibrations(draw, qtype, nominal: float) -> qarray.Calibration:
  """Every calibration valid for ``qtype`` (``minmax`` needs an integer qtype).

  ``fixed`` bounds are drawn around ``nominal`` (the data's magnitude), so
  some values clip and some do not.
  """
  qt = qtypes.get_qtype(qtype)
  methods = ["absmax", "absmean", "rms", "percentile", "fixed"] + (["minmax"] if qt.kind == "int" else [])
  method = draw(st.sampled_from(methods))
  mult = draw(st.sampled_from([1.0, 1.0, 0.5, 3.0]))
  if method == "fixed":
    # Finite after the multiplier: at most a quarter of the float32 maximum.
    bound = min(nominal * draw(st.sampled_from([0.1, 1.0, 10.0])), float(np.finfo(np.float32).max) / 4)
    bound = float(np.float32(bound))
    return qarray.Calibration(method="fixed", bound=bound, multiplier=mult)
  if method == "percentile":
    return qarray.Calibration(method="percentile", multiplier=mult,
                              percentile=draw(st.sampled_from([1.0, 50.0, 90.0, 100.0])))
  return qarray.Calibration(method=method, multiplier=mult)


def divisors(n: int, cap: int = 64) -> list[int]:
  """Tile sizes for an axis of size ``n`` (any size divides 0)."""
  if n == 0:
    return [1, 2, 4]
  return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


# ----------------------------------------------------------------------------
# quantize grids


@st.composite
def grids(draw, shape: tuple[int, ...]):
  """(channelwise_axes, tiled_axes) on ``shape``: any subset channelwise, any
  of the rest tiled with a dividing tile size; axes sometimes negative."""
  nd = len(shape)
  roles = draw(st.lists(st.sampled_from(["reduce", "channel", "tile"]), min_size=nd, max_size=nd))
  cw, tiles = [], {}
  for a, role in enumerate(roles):
    ax = a - nd if draw(st.booleans()) else a
    if role == "channel":
      cw.append(ax)
    elif role == "tile":
      tiles[ax] = draw(st.sampled_from(divisors(shape[a])))
  return tuple(cw), tiles


@st.composite
def shapes(draw, *, max_rank: int, max_size: int) -> tuple[int, ...]:
  """Shapes of rank 1..max_rank, axes 1..max_size; one axis 0 in about 1 case of 6."""
  shape = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_rank))
  if draw(st.integers(0, 11)) == 5:
    shape[draw(st.integers(0, len(shape) - 1))] = 0
  return tuple(shape)


# ----------------------------------------------------------------------------
# dot_general layouts


@dataclasses.dataclass(frozen=True)
class DotLayout:
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dn: tuple  # ((lc, rc), (lb, rb))

  @property
  def last_contract_size(self) -> int | None:
    (lc, _), _ = self.dn
    return self.lhs_shape[lc[-1]] if lc else None


@st.composite
def dot_layouts(draw, *, max_size: int = 4, max_contract: int = 64, max_rank: int = 4,
                min_contract: int = 0) -> DotLayout:
  """Random dimension numbers: 0-2 batch axes, 0-3 contracting axes (listed in
  any order), 0-2 free axes per side, every axis order, sizes 1..max_size with
  size-1 axes common and a size-0 axis in about 1 case of 6."""
  nb = draw(st.integers(0, 2))
  nc = draw(st.integers(min_contract, 3))
  nlf = draw(st.integers(0, 2))
  nrf = draw(st.integers(0, 2))
  nb = min(nb, max_rank - nc)
  nlf = min(nlf, max_rank - nb - nc)
  nrf = min(nrf, max_rank - nb - nc)
  size = st.integers(1, max_size)
  bs = [draw(size) for _ in range(nb)]
  cs = [draw(size) for _ in range(nc)]
  while cs and int(np.prod(cs)) > max_contract:
    cs[int(np.argmax(cs))] //= 2
  lfs = [draw(size) for _ in range(nlf)]
  rfs = [draw(size) for _ in range(nrf)]
  axes = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)]
  laxes = draw(st.permutations(axes + [("lf", i) for i in range(nlf)]))
  raxes = draw(st.permutations(axes + [("rf", i) for i in range(nrf)]))
  sizes = {**{("b", i): s for i, s in enumerate(bs)}, **{("c", i): s for i, s in enumerate(cs)},
           **{("lf", i): s for i, s in enumerate(lfs)}, **{("rf", i): s for i, s in enumerate(rfs)}}
  if draw(st.integers(0, 11)) == 5 and sizes:  # an empty axis somewhere
    sizes[draw(st.sampled_from(sorted(sizes)))] = 0
  corder = draw(st.permutations(range(nc)))
  border = draw(st.permutations(range(nb)))
  lpos = {k: a for a, k in enumerate(laxes)}
  rpos = {k: a for a, k in enumerate(raxes)}
  lc = tuple(lpos[("c", i)] for i in corder)
  rc = tuple(rpos[("c", i)] for i in corder)
  lb = tuple(lpos[("b", i)] for i in border)
  rb = tuple(rpos[("b", i)] for i in border)
  return DotLayout(lhs_shape=tuple(sizes[k] for k in laxes), rhs_shape=tuple(sizes[k] for k in raxes),
                   dn=((lc, rc), (lb, rb)))


@st.composite
def new_dot_layouts(draw, *, max_size: int = 4, max_rank: int = 4, max_blocks: int = 2) -> DotLayout:
  """:func:`dot_layouts` with at least one contracting axis, the last listed one
  ``32 * k`` long (k in 1..max_blocks; 0 in about 1 case of 8), so that an MX block of
  32 divides it, and the whole contraction (which a tile of several contracting axes
  groups) too. Other axes as :func:`dot_layouts` draws them (empty ones included)."""
  lay = draw(dot_layouts(max_size=max_size, max_contract=max_size ** 2, max_rank=max_rank,
                         min_contract=1))
  (lc, rc), _ = lay.dn
  k = 0 if draw(st.integers(0, 7)) == 3 else draw(st.integers(1, max_blocks))
  l, r = list(lay.lhs_shape), list(lay.rhs_shape)
  l[lc[-1]] = r[rc[-1]] = qtypes.MX_BLOCK * k
  return dataclasses.replace(lay, lhs_shape=tuple(l), rhs_shape=tuple(r))


@st.composite
def operand_quants(draw, v: Values, dtype, *, tile_axis_size: int | None, allow_none: bool = True,
                   qtypes_: tuple[str, ...] = QTYPES, tiles: bool = True) -> C.OperandQuant | None:
  """None (float) or an OperandQuant of any qtype x calibration, channelwise
  on/off, a tile size dividing the last contracting axis, ste / clipped_ste
  (``qtypes_=NEW_QTYPES``: nf4 as any other; MX channelwise in blocks of 32)."""
  qt = draw(st.sampled_from(((None,) if allow_none else ()) + tuple(qtypes_)))
  if qt is None:
    return None
  cal = draw(calibrations(qt, v.nominal(dtype)))
  if qtypes.get_qtype(qt).is_mx:
    # An MX qtype's only form: its block of 32 along the contraction, per row (the caller
    # makes the contraction a multiple of 32; see new_dot_layouts).
    assert tiles and tile_axis_size is not None and tile_axis_size % qtypes.MX_BLOCK == 0
    return C.OperandQuant(qtype=qt, calibration=cal, channelwise=True, tile_size=None,
                          estimator=draw(st.sampled_from(["ste", "clipped_ste"])))
  tile = None
  if tiles and tile_axis_size is not None and draw(st.booleans()):
    tile = draw(st.sampled_from(divisors(tile_axis_size)))
  return C.OperandQuant(qtype=qt, calibration=cal, channelwise=draw(st.booleans()), tile_size=tile,
                        estimator=draw(st.sampled_from(["ste", "clipped_ste"])))


# ----------------------------------------------------------------------------
# convolution layouts

_SPECS = {1: (("NWC", "NCW", "WNC"), ("WIO", "OIW", "IOW")),
          2: (("NHWC", "NCHW"), ("HWIO", "OIHW"))}


@dataclasses.dataclass(frozen=True)
class ConvLayout:
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dimension_numbers: tuple[str, str, str]
  window_strides: tuple[int, ...]
  padding: object
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  feature_group_count: int
  batch_group_count: int

  def kwargs(self) -> dict:
    return dict(window_strides=self.window_strides, padding=self.padding,
                lhs_dilation=self.lhs_dilation, rhs_dilation=self.rhs_dilation,
                dimension_numbers=self.dimension_numbers,
                feature_group_count=self.feature_group_count,
                batch_group_count=self.batch_group_count)


def _conv_out_size(n, k, stride, pad, ld, rd) -> int:
  n_eff = (n - 1) * ld + 1 if n > 0 else 0
  k_eff = (k - 1) * rd + 1
  return (n_eff + pad[0] + pad[1] - k_eff) // stride + 1


@st.composite
def conv_layouts(draw, *, max_spatial: int = 5, max_kernel: int = 3, max_batch: int = 3,
                 max_features: int = 3) -> ConvLayout:
  """1-D and 2-D convolutions: every layout of the tables above, strides,
  VALID / SAME / explicit padding, lhs and rhs dilation, feature or batch
  groups, an empty batch in about 1 case of 6."""
  nsp = draw(st.sampled_from([1, 2]))
  lspecs, rspecs = _SPECS[nsp]
  lspec, ospec = draw(st.sampled_from(lspecs)), draw(st.sampled_from(lspecs))
  rspec = draw(st.sampled_from(rspecs))
  groups = draw(st.sampled_from(["none", "feature", "batch"]))
  fg = draw(st.integers(2, 3)) if groups == "feature" else 1
  bg = 2 if groups == "batch" else 1
  cin = fg * draw(st.integers(1, max_features))
  cout = fg * bg * draw(st.integers(1, max_features))
  n = bg * draw(st.integers(1, max_batch))
  if draw(st.integers(0, 11)) == 5:
    n = 0
  spatial = [draw(st.integers(1, max_spatial)) for _ in range(nsp)]
  kernel = [draw(st.integers(1, max_kernel)) for _ in range(nsp)]
  strides = tuple(draw(st.integers(1, 2)) for _ in range(nsp))
  ld = tuple(draw(st.integers(1, 2)) for _ in range(nsp))
  rd = tuple(draw(st.integers(1, 2)) for _ in range(nsp))
  # String padding is not defined with lhs dilation (a transposed convolution).
  pad_kind = draw(st.sampled_from(["VALID", "SAME", "explicit"] if ld == (1,) * nsp else ["explicit"]))
  explicit = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(nsp))

  def pads_for(spatial):
    if pad_kind == "explicit":
      return explicit
    return jax.lax.padtype_to_pads([(s - 1) * d + 1 for s, d in zip(spatial, ld)],
                                   [(k - 1) * d + 1 for k, d in zip(kernel, rd)], strides, pad_kind)

  # Output sizes >= 1 (an empty batch is drawn above): grow the input until so.
  while True:
    pads = pads_for(spatial)
    short = [i for i in range(nsp)
             if _conv_out_size(spatial[i], kernel[i], strides[i], pads[i], ld[i], rd[i]) < 1]
    if not short:
      break
    spatial[short[0]] += 1
  padding = explicit if pad_kind == "explicit" else pad_kind
  dims = {"N": n, "C": cin}
  lhs_shape = []
  sp = iter(spatial)
  for c in lspec:
    lhs_shape.append(dims[c] if c in dims else next(sp))
  rdims = {"O": cout, "I": cin // fg}
  kp = iter(kernel)
  rhs_shape = [rdims[c] if c in rdims else next(kp) for c in rspec]
  return ConvLayout(lhs_shape=tuple(lhs_shape), rhs_shape=tuple(rhs_shape),
                    dimension_numbers=(lspec, rspec, ospec), window_strides=strides,
                    padding=padding, lhs_dilation=ld, rhs_dilation=rd,
                    feature_group_count=fg, batch_group_count=bg)
