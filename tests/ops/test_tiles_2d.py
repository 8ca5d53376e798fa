"""Per-axis (2-D) tiles, fractional tiles and backward-product tiles of dot_general_qt.

Every product is checked against a numpy reference that quantizes each operand block by block
(absmax / qmax per block, round half to even, clip) and multiplies in float64: the same numbers
(up to float32 accumulation) prove the blocks are what the tile says, and an error budget from
the blocks' steps bounds the distance to the float64 product of the unquantized operands.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain.core import qarray
from qtrain.ops import config as C
from qtrain.ops import dot_general_qt
from qtrain.ops.qt_operand import operand_spec

DN = (((1,), (0,)), ((), ()))  # x (M, K) . w (K, N)


def _blocks(x: np.ndarray, tiles: dict[int, int]) -> np.ndarray:
  """The per-element scale of int8 absmax quantization with ``tiles`` ({axis: tile}; an axis
  not named is one scale per index)."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  ts = [tiles.get(a, 1) for a in range(x.ndim)]
  for idx in np.ndindex(*[n // t for n, t in zip(x.shape, ts)]):
    sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(idx, ts))
    m = np.abs(x[sl]).max()
    out[sl] = np.float32(np.float32(m) / np.float32(127)) if m > 0 else 1.0
  return out


def _fake_int8(x: np.ndarray, tiles: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """(dequantized x, per-element scale) of int8 absmax quantization with ``tiles``."""
  s = _blocks(x, tiles)
  q = np.clip(np.round(np.asarray(x, np.float32) / s.astype(np.float32)), -127, 127)
  return q * s, s


def _cfg(lhs_tile, rhs_tile, *, dlhs=None, drhs=None):
  return C.DotGeneralQtConfig(
      lhs=C.OperandQuant(qtype="int8", tile_size=lhs_tile),
      rhs=C.OperandQuant(qtype="int8", tile_size=rhs_tile),
      dlhs_grad=None if dlhs is None else C.GradQuant(qtype="int8", tile_size=dlhs),
      drhs_grad=None if drhs is None else C.GradQuant(qtype="int8", tile_size=drhs),
      implementation="xla")


def _data(seed=0, m=8, k=16, n=32):
  r = np.random.default_rng(seed)
  # Rows / columns of very different magnitudes: a per-channel or per-tensor scale in place of
  # a block's would change many codes.
  x = r.standard_normal((m, k)) * np.exp(r.uniform(-3, 3, (m, 1))) * np.exp(r.uniform(-2, 2, (1, k)))
  w = r.standard_normal((k, n)) * np.exp(r.uniform(-3, 3, (1, n))) * np.exp(r.uniform(-2, 2, (k, 1)))
  return x.astype(np.float32), w.astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("xt, wt", [
    ({0: 2, 1: 4}, {0: 4, 1: 8}),     # 2-D blocks on both operands
    ({1: 4}, {0: 4, 1: 2}),           # per-row activation tiles along K, 2-D weight blocks
    ({0: 4}, {1: 8}),                 # blocks along free axes only: K is one group
    ({0: 0.25, 1: 0.5}, {0: 0.5, 1: 4}),  # fractions of each axis
])
def test_forward_2d_tiles_match_block_reference(xt, wt):
  x, w = _data()
  cfg = _cfg(xt, wt)
  y = np.asarray(dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, cfg), np.float64)
  # A contracting axis not named is one group; a free axis not named, one scale per index.
  res = lambda t, shape, c: {c: shape[c], **{a: (v if isinstance(v, int) else round(shape[a] * v))
                                              for a, v in t.items()}}
  xd, xs = _fake_int8(x, res(xt, x.shape, 1))
  wd, ws = _fake_int8(w, res(wt, w.shape, 0))
  ref_q = xd @ wd  # float64 product of the block-quantized operands
  acc = (np.abs(xd) @ np.abs(wd)) * 16 * 2.0 ** -23  # float32 accumulation
  np.testing.assert_array_less(np.abs(y - ref_q), acc + 1e-30)
  # Budget to the exact product: each element is within half its block's step.
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  budget = (xs / 2) @ np.abs(w64) + np.abs(x64) @ (ws / 2) + (xs / 2) @ (ws / 2)
  np.testing.assert_array_less(np.abs(y - x64 @ w64), budget * (1 + 1e-6) + acc)


@pytest.mark.slow
def test_2d_scale_shapes_and_per_channel_differs():
  _, w = _data()
  q = qarray.quantize(jnp.asarray(w), operand_spec(C.OperandQuant(qtype="int8", tile_size={0: 2, 1: 4}),
                                                   2, (1,), 0, shape=w.shape))
  assert q.scale.shape == (8, 8)
  x, w = _data(1)
  y2d = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, _cfg({0: 2, 1: 4}, {0: 4, 1: 8}))
  y1d = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, _cfg(4, 4))
  assert not np.allclose(y2d, y1d, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_fraction_equals_int_tile():
  x, w = _data(2)
  a = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, _cfg(0.25, 0.25))
  b = dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, _cfg(4, 4))
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_per_axis_tile_stays_on_int8_path(monkeypatch):
  """2-D weight blocks factor out of the contraction along N: the product stays int8 x int8."""
  from qtrain.core import qdot
  seen = []
  real = qdot._lax.dot_general
  def spy(a, b, *args, **kw):
    seen.append((a.dtype, b.dtype))
    return real(a, b, *args, **kw)
  monkeypatch.setattr(qdot._lax, "dot_general", spy)
  jax.clear_caches()  # the ops trace once per signature: a cached trace would skip the spy
  x, w = _data(3)
  dot_general_qt(jnp.asarray(x), jnp.asarray(w), DN, _cfg(4, {0: 4, 1: 8}))
  assert seen and all(d == (jnp.int8, jnp.int8) for d in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("gt_dlhs, gt_drhs", [
    ({0: 2, 1: 2}, {0: 2, 1: 2}),
    (2, 4),               # int: along each product's last contracting axis (N for dlhs, M for drhs)
    (None, {1: 8}),       # blocks along the gradient's free axis only
    (0.5, None),
])
def test_backward_tiles_match_block_reference(gt_dlhs, gt_drhs):
  x, w = _data(4)
  r = np.random.default_rng(5)
  ct = (r.standard_normal((8, 32)) * np.exp(r.uniform(-2, 2, (8, 1)))).astype(np.float32)
  xt, wt = {0: 2, 1: 4}, {0: 4, 1: 8}
  cfg = _cfg(xt, wt, dlhs=gt_dlhs, drhs=gt_drhs)
  _, vjp = jax.vjp(lambda a, b: dot_general_qt(a, b, DN, cfg), jnp.asarray(x), jnp.asarray(w))
  gx, gw = (np.asarray(v, np.float64) for v in vjp(jnp.asarray(ct)))
  xd, _ = _fake_int8(x, xt)
  wd, _ = _fake_int8(w, wt)

  def g_tiles(t, contract_axis):
    if t is None:
      return None
    if isinstance(t, dict):
      return t
    return {contract_axis: t if isinstance(t, int) else round(ct.shape[contract_axis] * t)}

  # dlhs = g . w^T contracts N (g's axis 1); drhs = x^T . g contracts M (g's axis 0). The
  # residuals' 2-D scales vary along both axes of each product, so nothing is folded into g.
  for got, tiles, contract_axis, prod, abs_prod in (
      (gx, g_tiles(gt_dlhs, 1), 1, lambda gd: gd @ wd.T, lambda gd: np.abs(gd) @ np.abs(wd.T)),
      (gw, g_tiles(gt_drhs, 0), 0, lambda gd: xd.T @ gd, lambda gd: np.abs(xd.T) @ np.abs(gd))):
    if tiles is None:  # float gradient in this product
      gd, gs = ct.astype(np.float64), np.zeros(ct.shape)
    else:
      # A contracting axis not tiled is one group (per-axis), the kept axis one scale per index.
      full = {a: ct.shape[a] for a in (contract_axis,) if a not in tiles}
      gd, gs = _fake_int8(ct, {**full, **tiles})
    ref = prod(gd)
    acc = abs_prod(gd) * 64 * 2.0 ** -23 + 1e-30
    np.testing.assert_array_less(np.abs(got - ref), acc)
    # Budget to the gradient through the quantized residual with an unquantized g: each of g's
    # elements is within half its block's step.
    exact = prod(ct.astype(np.float64))
    np.testing.assert_array_less(np.abs(got - exact), abs_prod(gs / 2) * (1 + 1e-6) + acc)


@pytest.mark.slow
def test_rule_2d_tiles_train_through_provider():
  import flax.linen as nn

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32)(x)

  rule = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                       tile_size={0: 2, 1: 2}, bwd_weight_grad_tile_size={0: 2, 1: 2},
                       bwd_act_grad_tile_size=2)
  qm = qtrain.quantize_model(M(), qtrain.QtProvider([rule]))
  x, _ = _data(6)
  v = qm.init(jax.random.key(0), jnp.asarray(x))
  y = qm.apply(v, jnp.asarray(x))
  k, b = (np.asarray(v["params"]["Dense_0"][n]) for n in ("kernel", "bias"))
  xd, _ = _fake_int8(x, {0: 2, 1: 2})
  wd, _ = _fake_int8(k, {0: 2, 1: 2})
  np.testing.assert_allclose(np.asarray(y, np.float64), xd @ wd + b, rtol=1e-5, atol=1e-5)
  # The kernel's gradient (of sum(y)) is x_q^T . Q(ones) with g blocks of 2 x 2: all ones.
  g = jax.grad(lambda p: qm.apply({"params": p}, jnp.asarray(x)).sum())(v["params"])
  np.testing.assert_allclose(np.asarray(g["Dense_0"]["kernel"], np.float64),
                             xd.T @ np.ones((8, 32)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kwargs, names", [
    (dict(weight_qtype="int8", tile_size={0: 0}), ["tile_size", "tile 0 of axis 0"]),
    (dict(weight_qtype="int8", tile_size=1.5), ["tile_size=1.5", "(0, 1]"]),
    (dict(weight_qtype="int8", tile_size={"a": 2}), ["tile_size", "'a'"]),
    (dict(weight_qtype="int8", tile_size={}), ["tile_size", "no axis"]),
    (dict(weight_qtype="int8", bwd_weight_grad_tile_size=4), ["bwd_weight_grad_tile_size",
                                                              "bwd_qtype"]),
    (dict(bwd_qtype="int8", bwd_act_grad_tile_size=-1), ["bwd_act_grad_tile_size"]),
    (dict(weight_qtype="mxfp4", tile_size={0: 32, 1: 32}), ["mxfp4", "per-axis"]),
    (dict(weight_qtype="int8", weight_granularity=2.0), ["weight_granularity"]),
])
def test_rule_errors_name_bad_values(kwargs, names):
  with pytest.raises(ValueError) as e:
    qtrain.QtRule(**kwargs)
  for n in names:
    assert n in str(e.value), (n, str(e.value))


def test_rule_normalizes_per_axis_tiles():
  r = qtrain.QtRule(weight_qtype="int8", tile_size={1: 4, 0: 0.5}, act_qtype="int8",
                    act_granularity={-1: 8})
  assert r.tile_size == ((0, 0.5), (1, 4))
  assert r.granularity(weight=True) == (True, ((0, 0.5), (1, 4)))
  assert r.granularity(weight=False) == (True, ((-1, 8),))
  hash(r)


def test_op_errors_name_bad_tiles():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  with pytest.raises(ValueError, match=r"config\.rhs\.tile_size\[1\]=3 does not divide the axis "
                                       r"of size 32"):
    dot_general_qt(x, w, DN, _cfg(None, {1: 3}))
  with pytest.raises(ValueError, match=r"config\.lhs\.tile_size=\{2: 2\}: axis 2 is out of range"):
    dot_general_qt(x, w, DN, _cfg({2: 2}, None))
  with pytest.raises(ValueError, match=r"config\.rhs\.tile_size=0\.3 does not divide"):
    dot_general_qt(x, w, DN, _cfg(None, 0.3))
  with pytest.raises(ValueError, match=r"config\.drhs_grad\.tile_size=3 .*round|config\.drhs_grad"
                                       r"\.tile_size=3 does not divide the axis of size 8"):
    dot_general_qt(x, w, DN, _cfg(None, None, drhs=3))
  with pytest.raises(ValueError, match=r"dlhs_grad\.tile_size.*convolutions"):
    C.ConvGeneralQtConfig(dlhs_grad=C.GradQuant(qtype="int8", tile_size=4))
  with pytest.raises(ValueError, match=r"tile_size=\{0: 32\} with qtype 'mxfp8'"):
    C.OperandQuant(qtype="mxfp8", tile_size={0: 32})


@pytest.mark.slow
def test_multi_axis_contraction_mixed_forms_raise():
  x, w = jnp.ones((2, 4, 8)), jnp.ones((4, 8, 6))
  dn = (((1, 2), (0, 1)), ((), ()))
  with pytest.raises(ValueError, match=r"per-axis tiles.*renumbers"):
    dot_general_qt(x, w, dn, _cfg(8, {2: 2}))
  # Per-axis tiles on both: no merge; contracting axes not named are one group.
  y = dot_general_qt(x, w, dn, _cfg({2: 4}, {1: 4, 2: 2}))
  np.testing.assert_allclose(y, jnp.einsum("bij,ijn->bn", x, w), rtol=1e-6)
