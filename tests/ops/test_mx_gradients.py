"""MX gradients (``bwd_qtype="mxfp8"`` / ``"mxfp4"``) in dot_general_qt, conv_general_qt and
QtRule.

Each backward product quantizes the incoming gradient in blocks of 32 values along *its own*
contraction (dlhs = g . w^T: the output's N axis; drhs = x^T . g: the batch / M axes, flattened),
one e8m0 (power-of-two) scale per block, e4m3 / e2m1 elements.

Error budgets (float64 references):
  * One gradient element, round to nearest: half the largest element gap times the block's
    scale. The scale is 2**k with ``bmax / 2**k >= h`` (h = 232 for e4m3, 3.5 for e2m1), so
    ``|q - g| <= bmax * (gap / 2) / h``: e4m3 gap 32 (416 -> 448), e2m1 gap 2 (4 -> 6).
  * Stochastic rounding: a whole gap, with the stochastic scale's edge (h = 224, 3: nothing
    clips): ``|q - g| <= bmax * gap / h``.
  * A product: ``|out - ref| <= sum_k E_k |y_k|`` (E the element budgets of the gradient
    along the contraction, y the other operand), plus float32 rounding (2**-20 of
    ``sum_k |g_k| |y_k|``).
  * SR unbiasedness: over n keys the mean's error has standard deviation at most
    ``sqrt(sum_k (E_k |y_k|)^2 / 4 / n)`` (each rounding is a two-point variable of range E_k,
    independent across k): the test allows 6 of those.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain.core import qarray, qtypes
from qtrain.ops import config as C
from qtrain.ops.conv_general_qt import conv_general_qt
from qtrain.ops.dot_general_qt import dot_general_qt
from qtrain.ops.ragged_dot_qt import ragged_dot_qt

MX = ("mxfp8", "mxfp4")
# Tests whose every case takes 8-12 s on two CPU cores (mxfp8's compiles, mxfp4's too): slow.
MX_SLOW = tuple(pytest.param(qt, marks=pytest.mark.slow) for qt in MX)
GAP = {"mxfp8": 32.0, "mxfp4": 2.0}      # the largest gap between neighbouring elements
EDGE = {"mxfp8": 232.0, "mxfp4": 3.5}     # bmax / scale >= EDGE (round to nearest)
EDGE_SR = {"mxfp8": 224.0, "mxfp4": 3.0}  # ... with stochastic rounding
MK_KN = (((1,), (0,)), ((), ()))


def _rand(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _elem_budget(g2, qt, sr):
  """Per-element budget of a 2-D gradient quantized in blocks of 32 along axis 1 (the last
  block may be shorter)."""
  m, k = g2.shape
  pad = -k % 32
  a = np.abs(np.pad(g2.astype(np.float64), ((0, 0), (0, pad))))
  bmax = a.reshape(m, -1, 32).max(axis=2)
  per = bmax * (GAP[qt] / EDGE_SR[qt] if sr else GAP[qt] / 2 / EDGE[qt])
  return np.repeat(per, 32, axis=1)[:, :k]


def _cfg(qt, sr=None, lhs=None, rhs=None):
  gq = C.GradQuant(qtype=qt, stochastic_rounding=sr)
  return C.DotGeneralQtConfig(lhs=lhs, rhs=rhs, dlhs_grad=gq, drhs_grad=gq, implementation="xla")


def _grads(x, w, g, cfg, key=None, dn=MK_KN):
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg, key=key), x, w)
  return vjp(g)


def _check_2d(x, w, g, qt, sr, dx, dw):
  """dlhs = g w^T (blocks along N of each row of g), drhs = x^T g (blocks along M of each
  column of g) against float64, within the budgets above."""
  x64, w64, g64 = (np.asarray(v, np.float64) for v in (x, w, g))
  e_l = _elem_budget(g64, qt, sr)            # (M, N): blocks along N
  e_r = _elem_budget(g64.T, qt, sr).T        # (M, N): blocks along M
  for got, ref, bud, absref in (
      (dx, g64 @ w64.T, e_l @ np.abs(w64).T, np.abs(g64) @ np.abs(w64).T),
      (dw, x64.T @ g64, np.abs(x64).T @ e_r, np.abs(x64).T @ np.abs(g64))):
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref)
    budget = bud + 2.0 ** -20 * absref
    assert np.all(err <= budget), float((err / budget).max())
    return float((err / budget).max())


# ----------------------------------------------------------------------------
# Numerics against float64.


@pytest.mark.parametrize("qt", MX_SLOW)
def test_round_to_nearest_within_budget(qt):
  """M = 40 (not a multiple of 32: drhs's last block holds 8 rows), N = 96 (dlhs's blocks on
  the QArray path)."""
  x, w, g = _rand((40, 64), 1), _rand((64, 96), 2), _rand((40, 96), 3)
  dx, dw = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), _cfg(qt))
  _check_2d(x, w, g, qt, False, dx, dw)


SRS = (None, "uniform", "low_bit_uniform", "low_bit_hash")
SHAPES = ((64, 64, 32), (40, 48, 10), (3, 16, 7))
# Each qtype with every rounding and with every shape (8 cases of ~10 s, not the full product's
# 24); the two qtypes meet the shapes in different orders.
PAIRWISE = [(qt, sr, SHAPES[(i + j) % len(SHAPES)]) for j, qt in enumerate(MX)
            for i, sr in enumerate(SRS)]


@pytest.mark.slow
@pytest.mark.parametrize("qt,sr,shape", PAIRWISE)
def test_gradients_within_budget(qt, sr, shape):
  m, k, n = shape
  x, w, g = _rand((m, k), 4), _rand((k, n), 5), _rand((m, n), 6, 3.0)
  dx, dw = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), _cfg(qt, sr),
                  key=jax.random.key(7) if sr else None)
  _check_2d(x, w, g, qt, sr is not None, dx, dw)


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
def test_batched_contraction_flattens_blocks(qt):
  """x (B, T, K) . w (K, N): drhs contracts (B, T); its blocks are 32 consecutive values of
  the flattened B * T (T = 16: a block spans two batch rows), exactly as for the (B*T, K)
  matrix product."""
  x, w, g = _rand((4, 16, 64), 8), _rand((64, 40), 9), _rand((4, 16, 40), 10)
  dn = (((2,), (0,)), ((), ()))
  dx, dw = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), _cfg(qt), dn=dn)
  dx2, dw2 = _grads(jnp.asarray(x.reshape(64, 64)), jnp.asarray(w),
                    jnp.asarray(g.reshape(64, 40)), _cfg(qt))
  np.testing.assert_array_equal(np.asarray(dx).reshape(64, 64), dx2)
  np.testing.assert_array_equal(dw, dw2)
  _check_2d(x.reshape(64, 64), w, g.reshape(64, 40), qt, False, dx2, dw2)


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
def test_int8_forward_folds_scales_into_mx_blocks(qt):
  """An int8 per-channel weight: its scale (along dlhs's contraction N) is folded into g
  before the blocks are formed, so the budget is that of ``g * s_w`` against the codes."""
  x, w, g = _rand((32, 64), 11), _rand((64, 64), 12), _rand((32, 64), 13)
  cfg = _cfg(qt, rhs=C.OperandQuant(qtype="int8"))
  dx, _ = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), cfg)
  wq = qarray.quantize(jnp.asarray(w), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  q, s = np.asarray(wq.qvalue, np.float64), np.asarray(wq.scale, np.float64)
  gs = g.astype(np.float64) * s
  ref = gs @ q.T
  budget = _elem_budget(gs, qt, False) @ np.abs(q).T + 2.0 ** -20 * (np.abs(gs) @ np.abs(q).T)
  assert np.all(np.abs(np.asarray(dx, np.float64) - ref) <= budget)


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
def test_bfloat16_operands(qt):
  """bf16 operands and gradient: the budget of the float32 case plus bf16's rounding of the
  result (2**-8 relative)."""
  x, w, g = (jnp.asarray(_rand(s, i)).astype(jnp.bfloat16)
             for s, i in (((48, 64), 14), ((64, 32), 15), ((48, 32), 16)))
  dx, dw = _grads(x, w, g, _cfg(qt, "uniform"), key=jax.random.key(1))
  assert dx.dtype == dw.dtype == jnp.bfloat16
  x64, w64, g64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (x, w, g))
  e_l, e_r = _elem_budget(g64, qt, True), _elem_budget(g64.T, qt, True).T
  for got, ref, bud, a in ((dx, g64 @ w64.T, e_l @ np.abs(w64).T, np.abs(g64) @ np.abs(w64).T),
                           (dw, x64.T @ g64, np.abs(x64).T @ e_r, np.abs(x64).T @ np.abs(g64))):
    err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - ref)
    assert np.all(err <= bud + 2.0 ** -8 * (np.abs(ref) + bud) + 2.0 ** -20 * a)


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_extreme_magnitudes_stay_finite_and_within_budget(qt, magnitude):
  """Gradients of 1e-30 and 1e30 (scales 2**-100 .. 2**100, inside e8m0's range): the
  budget scales with them; nothing flushes to zero or overflows."""
  x, w = _rand((40, 64), 17), _rand((64, 48), 18)
  g = _rand((40, 48), 19, magnitude)
  dx, dw = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), _cfg(qt))
  assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
  assert np.abs(np.asarray(dx)).max() > 0 and np.abs(np.asarray(dw)).max() > 0
  _check_2d(x, w, g, qt, False, dx, dw)


@pytest.mark.parametrize("qt", MX_SLOW)
def test_nan_stays_in_its_blocks(qt):
  """A NaN in g[i, n] makes its blocks NaN, as a NaN does to the scale group of any gradient
  qtype: dlhs row i (its block along N) and drhs column n (its block along M); the rest stay
  finite."""
  x, w, g = _rand((64, 32), 20), _rand((32, 64), 21), _rand((64, 64), 22)
  g[5, 40] = np.nan
  dx, dw = (np.asarray(v) for v in _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g),
                                          _cfg(qt)))
  assert np.all(np.isnan(dx[5])) and np.all(np.isfinite(np.delete(dx, 5, 0)))
  assert np.all(np.isnan(dw[:, 40])) and np.all(np.isfinite(np.delete(dw, 40, 1)))


@pytest.mark.parametrize("shapes", [((0, 64), (64, 32)), ((8, 0), (0, 32)), ((8, 64), (64, 0))])
def test_empty_shapes(shapes):
  """Empty operands give lax's zeros and zero (or empty) gradients: nothing is quantized."""
  (xs, ws) = shapes
  x, w = jnp.ones(xs), jnp.ones(ws)
  out = dot_general_qt(x, w, MK_KN, _cfg("mxfp4", "uniform"), key=jax.random.key(0))
  assert out.shape == (xs[0], ws[1])
  dx, dw = jax.grad(lambda x, w: dot_general_qt(x, w, MK_KN, _cfg("mxfp4", "uniform"),
                                                key=jax.random.key(0)).sum(), (0, 1))(x, w)
  assert dx.shape == xs and dw.shape == ws
  assert not np.any(np.asarray(dx)) and not np.any(np.asarray(dw))


# ----------------------------------------------------------------------------
# Stochastic rounding: unbiased on the non-uniform grids.


@pytest.mark.parametrize("qt", MX_SLOW)
def test_sr_scale_leaves_no_value_above_the_top_element(qt):
  """With stochastic rounding a block's largest value lands below the top element (6, 448),
  so it has a grid neighbour on each side: 6.9 gets the doubled scale and rounds between 3
  and 4 (e2m1), unbiased. A round-to-nearest block keeps the finer scale and clips it to the
  top (6.9 -> 6, 460 -> 448)."""
  top = {"mxfp4": 6.9, "mxfp8": 460.0}[qt]
  x = jnp.asarray(np.r_[top, np.linspace(-1, 1, 31)].astype(np.float32))[None]
  sr = qarray.QuantizeSpec(qtype=qt, channelwise_axes=(0,), tiled_axes={1: 32},
                           stochastic_rounding="uniform")
  keys = jax.random.split(jax.random.key(0), 4000)
  v = jax.vmap(lambda k: qarray.fake_quantize(x, sr, key=k))(keys)
  mean = np.asarray(v.mean(axis=0), np.float64)[0]
  step = float(np.asarray(qarray.quantize(x, sr, key=keys[0]).scale)[0, 0]) * GAP[qt]
  assert abs(mean[0] - top) < 6 * step / 2 / np.sqrt(4000), (mean[0], top)
  rtn = qarray.fake_quantize(x, qarray.QuantizeSpec(qtype=qt, channelwise_axes=(0,),
                                                    tiled_axes={1: 32}))
  assert float(rtn[0, 0]) == float(qtypes.get_qtype(qt).qmax)


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
@pytest.mark.parametrize("sr", ["uniform", "low_bit_hash"])
def test_sr_gradients_are_unbiased(qt, sr):
  """The mean over 512 keys of each gradient approaches the float64 gradient within 6 of its
  standard-deviation bounds (module docstring); low_bit_hash's 8-bit probabilities add at
  most 1/512 of a gap per element."""
  n = 512
  x, w, g = _rand((40, 32), 23), _rand((32, 48), 24), _rand((40, 48), 25)
  cfg = _cfg(qt, sr)
  f = jax.jit(jax.vmap(lambda k: _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), cfg,
                                        key=k)))
  dx, dw = (np.asarray(v, np.float64).mean(axis=0) for v in f(jax.random.split(jax.random.key(3), n)))
  x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
  e_l, e_r = _elem_budget(g64, qt, True), _elem_budget(g64.T, qt, True).T
  bias = 1 / 512 if sr == "low_bit_hash" else 0.0
  for got, ref, y, e, contract_lhs in ((dx, g64 @ w64.T, w64, e_l, True),
                                       (dw, x64.T @ g64, x64, e_r, False)):
    if contract_lhs:
      sd = np.sqrt((e ** 2) @ (y ** 2).T / 4 / n)
      b = bias * (e @ np.abs(y).T)
      a = np.abs(g64) @ np.abs(y).T
    else:
      sd = np.sqrt((y ** 2).T @ (e ** 2) / 4 / n)
      b = bias * (np.abs(y).T @ e)
      a = np.abs(y).T @ np.abs(g64)
    err = np.abs(got - ref)
    assert np.all(err <= 6 * sd + b + 2.0 ** -20 * a), float((err / (6 * sd + b)).max())
    # ... and the noise is real: one key alone is further off than the mean.
  one = _grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), cfg, key=jax.random.key(9))[0]
  assert np.abs(np.asarray(one, np.float64) - g64 @ w64.T).mean() > 4 * np.abs(dx - g64 @ w64.T).mean()


# ----------------------------------------------------------------------------
# Convolutions.


@pytest.mark.slow
@pytest.mark.parametrize("qt", MX)
@pytest.mark.parametrize("groups", [1, "batch"])
def test_conv_gradients_close_to_float(qt, groups):
  """conv_general_qt with MX gradients: the matmul path (patches) and XLA's convolution
  (batch_group_count > 1) both give gradients within the format's relative error of float."""
  x, w = jnp.asarray(_rand((4, 8, 8, 16), 26)), jnp.asarray(_rand((3, 3, 16, 32), 27))
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  if groups == "batch":
    kw["batch_group_count"] = 2
  gq = C.GradQuant(qtype=qt, stochastic_rounding="uniform")
  cfg = C.ConvGeneralQtConfig(dlhs_grad=gq, drhs_grad=gq, implementation="xla")
  f = lambda x, w: jnp.sum(jnp.sin(conv_general_qt(x, w, config=cfg, key=jax.random.key(1), **kw)))
  fr = lambda x, w: jnp.sum(jnp.sin(jax.lax.conv_general_dilated(
      x, w, precision=jax.lax.Precision.HIGHEST, **kw)))
  got, ref = jax.grad(f, (0, 1))(x, w), jax.grad(fr, (0, 1))(x, w)
  tol = {"mxfp8": 0.08, "mxfp4": 0.4}[qt]
  for a, b in zip(got, ref):
    assert np.all(np.isfinite(a))
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert 0 < rel < tol, rel


# ----------------------------------------------------------------------------
# Rules and configs.


def test_rules_and_configs_accept_mx_and_refuse_the_rest():
  for qt in MX:
    for sr in (None, "uniform", "low_bit_uniform", "low_bit_hash"):
      r = qtrain.QtRule(bwd_qtype=qt, bwd_stochastic_rounding=sr, bwd_weight_grad_tile_size=32)
      assert r.bwd_qtype == qt
    assert C.GradQuant(qtype=qt, tile_size=32).qtype.name == qt
  with pytest.raises(ValueError, match=r"bwd_qtype='nf4': gradients need int2..int8 or fp8 "
                                       r"\(or MX: mxfp8, mxfp4\).*'mxfp4'.*nf4 is a weight format"):
    qtrain.QtRule(bwd_qtype="nf4")
  with pytest.raises(ValueError, match="bwd_qtype='binary': gradients need"):
    qtrain.QtRule(bwd_qtype="binary")
  with pytest.raises(ValueError, match=r"bwd_act_grad_tile_size=64 with qtype 'mxfp4'.*valid: "
                                       r"None \(the default, 32\) or 32"):
    qtrain.QtRule(bwd_qtype="mxfp4", bwd_act_grad_tile_size=64)
  with pytest.raises(ValueError, match=r"bwd_weight_grad_tile_size=\{0: 32\} with qtype 'mxfp8'"
                                       r".*not per-axis tiles"):
    qtrain.QtRule(bwd_qtype="mxfp8", bwd_weight_grad_tile_size={0: 32})
  with pytest.raises(ValueError, match=r"bwd_weight_grad_axis_names=\('data',\) with qtype "
                                       r"'mxfp4'.*valid: \(\)"):
    qtrain.QtRule(bwd_qtype="mxfp4", bwd_weight_grad_axis_names=("data",))
  with pytest.raises(ValueError, match=r"bwd_stochastic_rounding='nearest'; valid"):
    qtrain.QtRule(bwd_qtype="mxfp4", bwd_stochastic_rounding="nearest")
  with pytest.raises(ValueError, match=r"GradQuant.tile_size=16 with qtype 'mxfp8'"):
    C.GradQuant(qtype="mxfp8", tile_size=16)
  with pytest.raises(ValueError, match=r"config.dlhs_grad.qtype='mxfp4': ragged_dot_qt"):
    ragged_dot_qt(jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.array([2, 2], jnp.int32),
                  C.DotGeneralQtConfig(dlhs_grad=C.GradQuant(qtype="mxfp4"),
                                       implementation="xla"))


@pytest.mark.slow
def test_qtrule_with_mxfp4_gradients_trains_an_mlp():
  """A 2-layer MLP regression, int8 weights and activations, mxfp4 gradients with stochastic
  rounding: the loss falls as the float model's does (within 15% of it after 150 steps)."""
  import flax.linen as nn
  import optax

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="out")(nn.relu(nn.Dense(64, name="up")(x)))

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
  y = jnp.asarray(np.tanh(np.asarray(x) @ rng.standard_normal((32, 8)) / 4).astype(np.float32))

  def train(model):
    params = model.init(jax.random.key(0), x)["params"]
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
      def loss_fn(p):
        return jnp.mean((model.apply({"params": p}, x, rngs={"quant": key}) - y) ** 2)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      upd, state = opt.update(grads, state, params)
      return optax.apply_updates(params, upd), state, loss

    losses = []
    for i in range(150):
      params, state, loss = step(params, state, jax.random.key(i))
      losses.append(float(loss))
    return losses

  rule = qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                       bwd_qtype="mxfp4", bwd_stochastic_rounding="uniform")
  q = train(qtrain.quantize_model(MLP(), qtrain.QtProvider([rule])))
  f = train(MLP())
  assert q[-1] < 0.2 * q[0], (q[0], q[-1])
  assert abs(q[-1] - f[-1]) < 0.15 * f[0], (q[-1], f[-1])
