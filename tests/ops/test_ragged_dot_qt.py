"""``ragged_dot_qt``: the quantized grouped product of mixture-of-experts layers.

Forward and both gradients against a float64 reference, within error budgets computed from each
qtype's rounding step (the largest error a round-to-nearest value can have, per element, from
the scale the calibration gives); edge cases of the groups; stochastic rounding's unbiasedness;
the jaxpr (int8 codes into three ragged products); the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain.ops import config as C
from qtrain.ops.ragged_dot_qt import ragged_dimension_numbers, ragged_dot_qt
from _testutil import all_eqns

M, K, N, G = 37, 64, 24, 5
SIZES = (7, 0, 12, 3, 10)            # a group of size 0; 5 rows past the groups


def _data(m=M, k=K, n=N, g=G, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.3, dtype)
  ct = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return x, w, ct


def _cfg(qt, tile=None, gq="int8", sr=None, **kw):
  oq = None if qt is None else C.OperandQuant(qtype=qt, tile_size=tile)
  g = None if gq is None else C.GradQuant(qtype=gq, stochastic_rounding=sr)
  return C.DotGeneralQtConfig(lhs=oq, rhs=oq, dlhs_grad=g, drhs_grad=g, **kw)


def _groups(sizes, m):
  """(start, stop) of each group's rows."""
  ends = np.cumsum(sizes)
  return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


def _ragged64(x, w, sizes):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[2]))
  for i, (a, b) in enumerate(_groups(sizes, x.shape[0])):
    out[a:b] = x[a:b] @ w[i]
  return out


def _grads64(x, w, ct, sizes):
  """d/dx and d/dw of sum(ct * ragged_dot(x, w)) in float64."""
  x, w, ct = (np.asarray(v, np.float64) for v in (x, w, ct))
  dx, dw = np.zeros_like(x), np.zeros_like(w)
  for i, (a, b) in enumerate(_groups(sizes, x.shape[0])):
    dx[a:b] = ct[a:b] @ w[i].T
    dw[i] = x[a:b].T @ ct[a:b]
  return dx, dw


def _step_bound(v, qt, axis, tile):
  """The largest round-to-nearest error of each element of ``v`` (float64) quantized with an
  absmax scale over ``axis`` (per tile of ``tile`` along it): half a grid step for integers;
  for fp8 half an ulp of the element's binade (2**-(mantissa + 1) relative), at least half the
  subnormal spacing. Also returns the scale of each element."""
  v = np.asarray(v, np.float64)
  if tile:
    shape = v.shape[:axis] + (v.shape[axis] // tile, tile) + v.shape[axis + 1:]
    vt = v.reshape(shape)
    s = np.abs(vt).max(axis=axis + 1, keepdims=True)
    s = np.broadcast_to(s, shape).reshape(v.shape)
  else:
    s = np.broadcast_to(np.abs(v).max(axis=axis, keepdims=True), v.shape)
  if qt.startswith("int"):
    qmax = 2 ** (int(qt[3:]) - 1) - 1
    return 0.5 * s / qmax * (1 + 1e-6), s / qmax
  fi = jnp.finfo(jnp.dtype(qt))
  fmax, nmant = float(fi.max), int(fi.nmant)
  unit = s / fmax
  rel = np.abs(v) / np.where(unit > 0, unit, 1)
  sub = 2.0 ** (float(np.log2(float(fi.smallest_normal))) - nmant - 1)
  return unit * np.maximum(rel * 2.0 ** -(nmant + 1), sub) * (1 + 1e-6), unit


QTYPES = ["int8", "int4", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("qt", QTYPES)
@pytest.mark.thin(2)
def test_forward_within_the_qtypes_rounding_budget(qt, tile):
  x, w, _ = _data()
  sizes = jnp.array(SIZES, jnp.int32)
  y = jax.jit(lambda x, w: ragged_dot_qt(x, w, sizes, _cfg(qt, tile, gq=None)))(x, w)
  ref = _ragged64(x, w, SIZES)
  ex, _ = _step_bound(x, qt, 1, tile)
  ew, _ = _step_bound(w, qt, 1, tile)
  ax, aw = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
  budget = (_ragged64(ax, ew, SIZES) + _ragged64(ex, aw, SIZES) + _ragged64(ex, ew, SIZES)
            + 1e-5 * _ragged64(ax, aw, SIZES))
  err = np.abs(np.asarray(y, np.float64) - ref)
  assert np.all(err <= budget + 1e-30), float((err - budget).max())
  assert err.max() > 0                         # quantized, not float
  assert np.all(np.asarray(y)[sum(SIZES):] == 0)   # rows past the groups


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("qt", ["int8", "int4", "float8_e4m3fn"])
@pytest.mark.thin(2)
def test_gradients_within_the_budget_of_weights_and_int8_gradients(qt, tile):
  """Straight-through gradients with int8 gradients (round to nearest): the error against the
  float64 gradient is at most the other operand's rounding times |g| plus the gradient's own
  rounding (per row for dx, per column for dw, after the residual's scale is folded into g;
  unfolded with tiles) times the codes it multiplies."""
  x, w, ct = _data(seed=1)
  sizes = jnp.array(SIZES, jnp.int32)
  cfg = _cfg(qt, tile)
  dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(ragged_dot_qt(x, w, sizes, cfg) * ct),
                            (0, 1)))(x, w)
  rdx, rdw = _grads64(x, w, ct, SIZES)
  ex, sx = _step_bound(x, qt, 1, tile)
  ew, sw = _step_bound(w, qt, 1, tile)
  x64, w64, g = (np.asarray(v, np.float64) for v in (x, w, ct))
  rows = np.zeros(M, bool)
  rows[:sum(SIZES)] = True
  g = g * rows[:, None]
  gid = np.repeat(np.arange(G), SIZES)
  # dx: |g| . ew^T, plus g's rounding: g' = g * (w's scale of the row's group) per row.
  bx = _grads64(np.zeros_like(x64), ew, np.abs(g), SIZES)[0]
  if tile is None:
    gp = np.zeros_like(g)
    gp[:len(gid)] = g[:len(gid)] * sw[gid, 0, :]
    eg = 0.5 * np.abs(gp).max(axis=1, keepdims=True) / 127
    codes = (np.abs(w64) + ew) / sw
  else:
    eg = 0.5 * np.abs(g).max(axis=1, keepdims=True) / 127
    codes = np.abs(w64) + ew
  bx += _grads64(np.zeros_like(x64), codes, eg * np.ones_like(g), SIZES)[0]
  # dw: ex^T . |g|, plus g's rounding: g'' = g * (x's row scale) per column.
  bw = _grads64(ex, np.zeros_like(w64), np.abs(g), SIZES)[1]
  if tile is None:
    gpp = g * sx[:, :1]
    eg = 0.5 * np.abs(gpp).max(axis=0, keepdims=True) / 127
    codes = (np.abs(x64) + ex) / sx
  else:
    eg = 0.5 * np.abs(g).max(axis=0, keepdims=True) / 127
    codes = np.abs(x64) + ex
  bw += _grads64(codes, np.zeros_like(w64), eg * np.ones_like(g), SIZES)[1]
  for got, ref, b in ((dx, rdx, bx), (dw, rdw, bw)):
    scale = np.abs(ref).max()
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= b * (1 + 1e-4) + 1e-5 * scale), float((err - b).max())
    assert err.max() > 0
  assert np.all(np.asarray(dx)[sum(SIZES):] == 0)      # rows past the groups: no gradient
  assert np.all(np.asarray(dw)[1] == 0)                # the empty group: none either


@pytest.mark.slow
def test_w8a8_matches_the_fake_quantized_product_to_float32_rounding():
  """int8 codes into an int32 accumulation, scales after: the quantized math exactly (up to the
  float32 epilogue), against dequantize-then-multiply in float64."""
  from qtrain.core import qarray as qa
  x, w, _ = _data(seed=2)
  sizes = jnp.array(SIZES, jnp.int32)
  y = ragged_dot_qt(x, w, sizes, _cfg("int8", gq=None))
  xq = qa.dequantize(qa.quantize(x, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0,))))
  wq = qa.dequantize(qa.quantize(w, qa.QuantizeSpec(qtype="int8", channelwise_axes=(0, 2))))
  np.testing.assert_allclose(y, _ragged64(xq, wq, SIZES), rtol=2e-6, atol=2e-6)


@pytest.mark.slow
def test_nf4_and_mx_run_and_stay_close():
  x, w, ct = _data(seed=3)
  sizes = jnp.array(SIZES, jnp.int32)
  ref = _ragged64(x, w, SIZES)
  for qt, tile, tol in (("nf4", 16, 0.15), ("mxfp8", None, 0.08), ("mxfp4", None, 0.3)):
    y = ragged_dot_qt(x, w, sizes, _cfg(qt, tile, gq=None))
    rel = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert 0 < rel < tol, (qt, rel)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [(0, 0, 0), (9, 0, 0), (0, 0, 9), (3, 3, 3), (2, 0, 4)])
def test_group_edge_cases(sizes):
  """All rows in one group, empty groups (first, last, all), rows past the groups."""
  x, w, ct = _data(m=9, k=32, n=8, g=3, seed=4)
  gs = jnp.array(sizes, jnp.int32)
  cfg = _cfg("int8")
  f = lambda x, w: jnp.sum(ragged_dot_qt(x, w, gs, cfg) * ct)
  y = jax.jit(lambda x, w: ragged_dot_qt(x, w, gs, cfg))(x, w)
  dx, dw = jax.jit(jax.grad(f, (0, 1)))(x, w)
  ref = _ragged64(x, w, sizes)
  rdx, rdw = _grads64(x, w, ct, sizes)
  for got, r in ((y, ref), (dx, rdx), (dw, rdw)):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    assert np.abs(got - r).max() <= 0.03 * max(np.abs(r).max(), 1e-30)
    assert np.all((r == 0) <= (got == 0))      # exact zeros where the reference has them


def test_random_group_sizes_under_jit_one_trace():
  """group_sizes is data: one compiled function takes any sizes (summing to at most M)."""
  x, w, ct = _data(m=24, k=32, n=8, g=4, seed=5)
  cfg = _cfg("int8")
  traces = []

  @jax.jit
  def step(x, w, gs):
    traces.append(1)
    return jax.value_and_grad(lambda x, w: jnp.sum(ragged_dot_qt(x, w, gs, cfg) * ct),
                              (0, 1))(x, w)
  rng = np.random.default_rng(6)
  for _ in range(4):
    sizes = rng.multinomial(int(rng.integers(0, 25)), [0.25] * 4)
    _, (dx, dw) = step(x, w, jnp.asarray(sizes, jnp.int32))
    rdx, rdw = _grads64(x, w, ct, sizes)
    for got, r in ((dx, rdx), (dw, rdw)):
      assert np.abs(np.asarray(got, np.float64) - r).max() <= 0.03 * max(np.abs(r).max(), 1e-9)
  assert len(traces) == 1


def test_empty_operands():
  """M = 0, K = 0, G = 0, N = 0: zeros of the output's shape, and zero gradients."""
  cfg = _cfg("int8")
  for (m, k, n, g) in ((0, 16, 4, 3), (5, 0, 4, 3), (5, 16, 4, 0), (5, 16, 0, 2)):
    x, w = jnp.ones((m, k)), jnp.ones((g, k, n))
    gs = jnp.full((g,), min(m, 2), jnp.int32)
    y = ragged_dot_qt(x, w, gs, cfg)
    assert y.shape == (m, n) and not np.any(np.asarray(y))
    dx, dw = jax.grad(lambda x, w: ragged_dot_qt(x, w, gs, cfg).sum(), (0, 1))(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert not np.any(np.asarray(dx)) and not np.any(np.asarray(dw))


@pytest.mark.slow
def test_bf16_inputs():
  """bf16 in, bf16 out, bf16 gradients; the numbers those of the float32 op to bf16 rounding."""
  x, w, ct = _data(seed=7)
  sizes = jnp.array(SIZES, jnp.int32)
  cfg = _cfg("int8")
  f = lambda x, w, ct: jnp.sum(ragged_dot_qt(x, w, sizes, cfg).astype(jnp.float32) * ct)
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  y = ragged_dot_qt(xb, wb, sizes, cfg)
  assert y.dtype == jnp.bfloat16
  dx, dw = jax.jit(jax.grad(f, (0, 1)))(xb, wb, ct)
  assert dx.dtype == dw.dtype == jnp.bfloat16
  ref = _ragged64(xb, wb, SIZES)
  rdx, rdw = _grads64(xb, wb, ct, SIZES)
  for got, r in ((y, ref), (dx, rdx), (dw, rdw)):
    rel = np.linalg.norm(np.asarray(got, np.float64) - r) / np.linalg.norm(r)
    assert 0 < rel < 0.02, rel
  # Weight-only (float activations): the bf16 x bf16 product, a float32 accumulation.
  wo = C.DotGeneralQtConfig(rhs=C.OperandQuant(qtype="int8"))
  y = ragged_dot_qt(xb, wb, sizes, wo)
  assert y.dtype == jnp.bfloat16
  assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 0.02


@pytest.mark.slow
def test_weight_only_and_float_forward_with_quantized_gradients():
  x, w, ct = _data(seed=8)
  sizes = jnp.array(SIZES, jnp.int32)
  ref, (rdx, rdw) = _ragged64(x, w, SIZES), _grads64(x, w, ct, SIZES)
  for cfg in (C.DotGeneralQtConfig(rhs=C.OperandQuant(qtype="int4")),
              C.DotGeneralQtConfig(dlhs_grad=C.GradQuant(qtype="int8"),
                                   drhs_grad=C.GradQuant(qtype="float8_e5m2"))):
    y = ragged_dot_qt(x, w, sizes, cfg)
    dx, dw = jax.grad(lambda x, w: jnp.sum(ragged_dot_qt(x, w, sizes, cfg) * ct), (0, 1))(x, w)
    for got, r, tol in ((y, ref, 0.2), (dx, rdx, 0.2), (dw, rdw, 0.2)):
      rel = np.linalg.norm(np.asarray(got, np.float64) - r) / np.linalg.norm(r)
      assert rel < tol, rel
  # Nothing quantized at all: jax.lax.ragged_dot itself.
  y = ragged_dot_qt(x, w, sizes, C.DotGeneralQtConfig())
  np.testing.assert_array_equal(y, jax.lax.ragged_dot(x, w, sizes))


@pytest.mark.slow
def test_stochastic_rounding_needs_a_key_and_is_unbiased():
  """The gradients' stochastic rounding: the same key gives the same gradients, another key
  others, and the mean over 16 keys is much closer to the float-backward reference (the
  gradient through the quantized forward, unquantized g) than one draw (ideal 1/4; bound 0.45),
  as dot_general_qt's test checks."""
  x, w, ct = _data(m=20, k=32, n=16, g=3, seed=9)
  sizes = jnp.array([6, 0, 11], jnp.int32)
  cfg = _cfg("int8", sr="uniform")
  with pytest.raises(ValueError, match="key"):
    ragged_dot_qt(x, w, sizes, cfg)
  ct = ct * 0.1

  def grads(key, cfg=cfg):
    return jax.grad(lambda x, w: jnp.sum(ragged_dot_qt(x, w, sizes, cfg, key=key) * ct),
                    (0, 1))(x, w)
  g1, g1b, g2 = grads(jax.random.key(0)), grads(jax.random.key(0)), grads(jax.random.key(1))
  for a, b, c in zip(g1, g1b, g2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(a) != np.asarray(c))
  ref = grads(None, _cfg("int8", gq=None))
  # (A loop, not jax.vmap: JAX batches ragged_dot only along axis 0.)
  jgrads = jax.jit(grads)
  draws = [jgrads(k) for k in jax.random.split(jax.random.key(2), 16)]
  many = [np.stack([d[i] for d in draws]) for i in range(2)]
  for mean, single, r in zip(many, g1, ref):
    r = np.asarray(r, np.float64)
    e_single = np.linalg.norm(np.asarray(single, np.float64) - r)
    e_mean = np.linalg.norm(np.asarray(mean, np.float64).mean(0) - r)
    assert e_mean <= 0.45 * e_single, (e_mean, e_single)
  # A raw uint32 key works too.
  graw = grads(jax.random.key_data(jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(graw[0]), np.asarray(g1[0]))


def test_jaxpr_w8a8_int8_backward_is_three_int8_ragged_products():
  cfg = _cfg("int8")
  sizes = jnp.array([2, 3], jnp.int32)
  f = lambda x, w: jnp.sum(ragged_dot_qt(x, w, sizes, cfg) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(jnp.ones((6, 16)), jnp.ones((2, 16, 4)))
  prods = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "ragged_dot_general"]
  assert len(prods) == 3, [e.primitive.name for e in all_eqns(jaxpr.jaxpr)]
  for e in prods:
    assert [v.aval.dtype for v in e.invars[:2]] == [jnp.int8, jnp.int8]
    assert e.outvars[0].aval.dtype == jnp.int32
  modes = sorted(tuple(e.params["ragged_dot_dimension_numbers"].rhs_group_dimensions)
                 for e in prods)
  assert modes == [(), (0,), (0,)]          # drhs: a ragged contraction (no rhs group axis)


@pytest.mark.slow
def test_learned_act_scale_gets_a_gradient():
  x, w, ct = _data(seed=10)
  sizes = jnp.array(SIZES, jnp.int32)
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"))
  f = lambda s: jnp.sum(ragged_dot_qt(x, w, sizes, cfg, lhs_scale=s) * ct)
  g = jax.grad(f)(jnp.float32(0.02))
  assert np.isfinite(float(g)) and float(g) != 0


def test_errors_name_the_bad_value_and_what_is_valid():
  x, w, _ = _data(m=6, k=32, n=4, g=2)
  gs = jnp.array([3, 3], jnp.int32)
  cfg = _cfg("int8")
  cases = [
      (lambda: ragged_dot_qt(x, w, gs, _cfg("int8", implementation="triton")),
       r"implementation='triton'.*XLA only.*valid: \['auto', 'xla'\]"),
      (lambda: ragged_dot_qt(x, w, gs, cfg, group_offset=jnp.array([0])),
       r"group_offset=.*valid: None"),
      (lambda: ragged_dot_qt(x[None], w, gs, cfg), r"lhs of shape \(1, 6, 32\).*\(M, K\)"),
      (lambda: ragged_dot_qt(x, w[0], gs, cfg), r"rhs of shape \(32, 4\).*\(G, K, N\)"),
      (lambda: ragged_dot_qt(x[:, :16], w, gs, cfg), r"axis 1 \(16\) must equal.*\(32\)"),
      (lambda: ragged_dot_qt(x, w, jnp.array([3, 3, 0]), cfg),
       r"group_sizes of shape \(3,\).*shape \(2,\)"),
      (lambda: ragged_dot_qt(x, w, gs.astype(jnp.float32), cfg), r"dtype float32.*integer"),
      (lambda: ragged_dot_qt(x, w, gs, _cfg("int8", tile=12)),
       r"tile_size=12 does not divide the contraction K=32.*divisor of 32"),
      (lambda: ragged_dot_qt(x, w, gs, _cfg("int8", sr="uniform")), r"pass key="),
      (lambda: ragged_dot_qt(x.astype(jnp.int32), w, gs, cfg), r"lhs must be a float array"),
      (lambda: ragged_dot_qt(x, w, gs, "int8"), r"config must be a DotGeneralQtConfig"),
  ]
  for fn, pattern in cases:
    with pytest.raises(ValueError, match=pattern):
      fn()


def test_ragged_dimension_numbers_accepts_only_ragged_dots_meaning():
  D = jax.lax.RaggedDotDimensionNumbers
  ok = D(dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0],
         rhs_group_dimensions=[0])
  assert ragged_dimension_numbers(ok, 2, 3) == (0, 1)
  n_first = D(dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
              rhs_group_dimensions=[0])
  assert ragged_dimension_numbers(n_first, 2, 3) == (0, 2)       # rhs (G, N, K)
  ragged_contraction = D(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  batched = D(dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))), lhs_ragged_dimensions=[1],
              rhs_group_dimensions=[1])
  assert ragged_dimension_numbers(ragged_contraction, 2, 2) is None
  assert ragged_dimension_numbers(batched, 3, 4) is None
  assert ragged_dimension_numbers("nonsense", 2, 3) is None
