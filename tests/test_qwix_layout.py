"""qtrain.qwix's PTQ params in qwix's layout (WithAux / QArray leaves) and its static-scale
statistics (quant_stats/<path>/<op id>_lhs/{count, sum_of_absmax})."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain import qwix


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))


@pytest.mark.slow
@pytest.mark.parametrize("qtype,bits,tile", [("int8", 8, None), ("int4", 4, 8), ("int8", 8, 4)])
def test_linen_qt_to_ptq_round_trip_is_within_the_qtypes_error_of_float64(qtype, bits, tile):
  """QT params -> quantize_params -> PTQ apply: each weight's QArray dequantizes to the float
  weight within half a step of its scale (per channel or per tile), and the PTQ predictions
  equal the QT forward's (XLA path) and sit within the weights' and inputs' rounding of a
  float64 reference."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=qtype, act_qtype="int8",
                                 tile_size=tile)]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  fp = _Mlp().init(jax.random.key(1), x)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules, implementation="xla"))
  template = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  params = qwix.quantize_params(fp["params"], template)
  qmax = 2 ** (bits - 1) - 1
  for name in ("hidden", "out"):
    w = np.asarray(fp["params"][name]["kernel"], np.float64)
    q = params[name]["kernel"].array
    k = w.shape[0]
    assert q.scale.shape == ((k // tile) if tile else 1, w.shape[1])
    step = np.repeat(np.asarray(q.scale, np.float64), tile or k, axis=0)
    err = np.abs(np.asarray(qwix.dequantize(q), np.float64) - w)
    assert np.all(err <= step / 2 + 1e-7)
    np.testing.assert_allclose(np.asarray(q.scale), np.abs(w).reshape(
        -1 if tile is None else k // tile, tile or k, w.shape[1]).max(1).reshape(q.scale.shape)
        / qmax if tile else np.abs(w).max(0, keepdims=True) / qmax, rtol=1e-6)
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules))
  got = np.asarray(ptq.apply({"params": params}, x))
  np.testing.assert_array_equal(got, np.asarray(qt.apply(fp, x)))
  ref = np.asarray(_Mlp().apply(jax.tree.map(lambda a: np.asarray(a, np.float64), fp),
                                np.asarray(x, np.float64)))
  assert np.max(np.abs(got - ref)) <= (0.05 if bits == 8 else 0.3) * np.abs(ref).max()


@pytest.mark.slow
def test_static_scale_statistics_have_qwix_names_and_meaning():
  """linen and nnx: <op id>_lhs = {count (int32), sum_of_absmax (1, 1) float32}: the number of
  calibration batches and the sum of each batch's mean per-token absmax; the scale is
  sum / count / qmax; a frozen apply (no mutable) leaves them."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                 act_static_scale=True)]
  xs = [jax.random.normal(jax.random.key(i), (6, 16), jnp.float32) * (i + 1) for i in range(3)]
  qt = qwix.quantize_model(nn.Dense(4), qwix.QtProvider(rules))
  v = qt.init(jax.random.key(0), xs[0])
  assert v["quant_stats"]["dot_general0_lhs"]["count"].dtype == jnp.int32
  for x in xs:
    _, upd = qt.apply(v, x, mutable=["quant_stats"])
    v = {**v, **upd}
  stat = v["quant_stats"]["dot_general0_lhs"]
  want = sum(np.abs(np.asarray(x, np.float64)).max(1).mean() for x in xs)
  assert int(stat["count"]) == 3
  np.testing.assert_allclose(np.asarray(stat["sum_of_absmax"]).reshape(()), want, rtol=1e-6)
  _, again = qt.apply(v, xs[0], mutable=["quant_stats"])
  assert int(again["quant_stats"]["dot_general0_lhs"]["count"]) == 4
  m = qwix.quantize_model(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), qwix.QtProvider(rules), xs[0])
  for x in xs:
    m(x)
  s = nnx.to_pure_dict(nnx.state(m, qwix.QuantStat))
  assert list(s) == ["dot_general0_lhs"] and int(s["dot_general0_lhs"]["count"]) == 3
  np.testing.assert_allclose(np.asarray(s["dot_general0_lhs"]["sum_of_absmax"]).reshape(()),
                             want, rtol=1e-6)


@pytest.mark.slow
def test_a_qwix_static_scale_checkpoint_loads_into_ptq():
  """quant_stats written by hand in qwix's layout (count, sum_of_absmax) give the PTQ static
  scale sum / count / qmax; the PTQ model then quantizes its input with that scale."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                 act_static_scale=True)]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  fp = nn.Dense(4).init(jax.random.key(1), x)
  ptq = qwix.quantize_model(nn.Dense(4), qwix.PtqProvider(rules, implementation="xla"))
  template = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  stats = {"dot_general0_lhs": {"count": np.int32(2), "sum_of_absmax": np.full((1, 1), 5.08,
                                                                              np.float32)}}
  params = qwix.quantize_params(fp["params"], template, stats)
  np.testing.assert_allclose(np.asarray(params["dot_general0_lhs_scale"].array), [[0.02]],
                             rtol=1e-6)
  out = np.asarray(ptq.apply({"params": params}, x))
  xq = np.clip(np.round(np.asarray(x) / 0.02), -127, 127) * 0.02
  w = np.asarray(qwix.dequantize(params["kernel"].array))
  np.testing.assert_allclose(out, xq @ w + np.asarray(fp["params"]["bias"]), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="one per tensor"):
    qwix.quantize_params(fp["params"], template, {"dot_general0_lhs": {
        "count": 1, "sum_of_absmax": np.ones((1, 3), np.float32)}})


def test_with_aux_and_qarray_behave_as_qwixs():
  """WithAux: shape / ndim / dtype of its array, astype keeps a box's metadata, reshape only to
  its own shape (names both shapes otherwise); QArray's qtype defaults to the codes' dtype."""
  q = qwix.QArray(jnp.ones((4, 2), jnp.int8), jnp.ones((1, 2)))
  assert q.qtype == "int8" and q.shape == (4, 2) and q.dtype == jnp.float32
  wa = qwix.WithAux(nn.Partitioned(jnp.ones((4, 2)), names=("a", "b")), "int8")
  assert wa.shape == (4, 2) and wa.ndim == 2 and wa.dtype == jnp.float32
  cast = wa.astype(jnp.bfloat16)
  assert cast.dtype == jnp.bfloat16 and cast.array.names == ("a", "b")
  assert wa.reshape(4, 2) is wa
  with pytest.raises(ValueError, match=r"keeps its shape \(4, 2\); reshape to \(8,\)"):
    wa.reshape(8)
  leaves = jax.tree.leaves(qwix.WithAux(q, "int8"))
  assert len(leaves) == 2  # qvalue, scale (no zero point)
  np.testing.assert_array_equal(np.asarray(qwix.dequantize(q)), np.ones((4, 2)))


# ----------------------------------------------------------------------------
# jnp.asarray inside a PTQ model's call.


class _AsArray(nnx.Module):
  def __call__(self, v, dtype=None):
    return jnp.asarray(v, dtype)


def _rand_qarray(key, zero_point=False):
  k1, k2, k3 = jax.random.split(key, 3)
  qv = jax.random.randint(k1, (6, 4), -127, 128, jnp.int32).astype(jnp.int8)
  scale = jax.random.uniform(k2, (1, 4), jnp.float32, 0.01, 0.1)
  zp = jax.random.randint(k3, (1, 4), -5, 6, jnp.int32).astype(jnp.int8) if zero_point else None
  return qwix.QArray(qv, scale, zp)


def _assert_same_arrays(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert u.dtype == v.dtype
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.slow
def test_asarray_in_a_ptq_call_passes_quantized_weights_through():
  """Inside an nnx PTQ model's call, jnp.asarray(x, dtype) (as Flax's promote_dtype calls it)
  keeps a QArray (its dequantized dtype cast, codes untouched), a WithAux (its how kept),
  nnx.Param(WithAux), and makes a quantized weight's nnx.State a QArray; plain arrays get
  JAX's own result. Outside the call jnp.asarray is JAX's again and rejects a WithAux."""
  original = jnp.asarray
  with pytest.warns(UserWarning, match="matched no op"):
    m = qwix.quantize_model(_AsArray(), qwix.PtqProvider([qwix.QuantizationRule(
        weight_qtype="int8")]), jnp.ones((2, 2)))
  q = _rand_qarray(jax.random.key(0))
  assert m(q) is q
  half = m(q, jnp.bfloat16)
  assert isinstance(half, qwix.QArray) and half.dtype == jnp.bfloat16
  assert half.qvalue is q.qvalue
  np.testing.assert_array_equal(np.asarray(half.scale, np.float32),
                                np.asarray(q.scale.astype(jnp.bfloat16), np.float32))
  wa = qwix.WithAux(q, "how")
  assert m(wa).array is q and m(wa).how == "how"
  got = m(nnx.Param(wa))
  assert isinstance(got, qwix.WithAux) and got.how == "how" and isinstance(got.array, qwix.QArray)
  _assert_same_arrays(got.array, q)
  cast = m(qwix.WithAux(jnp.arange(6.0).reshape(2, 3), "h"), jnp.float16)
  assert isinstance(cast, qwix.WithAux) and cast.array.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(cast.array), np.arange(6.0).reshape(2, 3))
  zq = _rand_qarray(jax.random.key(1), zero_point=True)
  state = nnx.State({"array": nnx.State({k: nnx.Variable(getattr(zq, k))
                                         for k in ("qvalue", "scale", "zero_point")})})
  got = m(state)
  assert isinstance(got, qwix.QArray)
  np.testing.assert_array_equal(np.asarray(qwix.dequantize(got)), np.asarray(qwix.dequantize(zq)))
  x = jax.random.normal(jax.random.key(2), (3, 5))
  assert m(x) is x
  np.testing.assert_array_equal(np.asarray(m(nnx.Param(x), jnp.bfloat16)),
                                np.asarray(x.astype(jnp.bfloat16)))
  with pytest.raises(ValueError, match=r"nnx.State with keys \['kernel'\].*'qvalue', 'scale'"):
    m(nnx.State({"kernel": x}))
  assert jnp.asarray is original
  with pytest.raises((TypeError, ValueError)):
    jnp.asarray(wa)


@pytest.mark.slow
def test_asarray_in_a_ptq_model_reads_a_layers_quantized_weight_under_jit():
  """A user's module of an nnx PTQ model reading its layer's quantized weight with
  jnp.asarray (under nnx.jit) gets the WithAux(QArray) qwix's layout keeps, whose values are
  the float weight within half a step of its per-channel scale; the layer's product is the
  QT model's forward."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
      return self.dense(x), jnp.asarray(self.dense.kernel, jnp.float32)

  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  fp = Net(nnx.Rngs(1))
  ptq = qwix.quantize_model(fp, qwix.PtqProvider(rules, implementation="xla"), x)
  y, w = nnx.jit(lambda m, x: m(x))(ptq, x)
  assert isinstance(w, qwix.WithAux) and isinstance(w.array, qwix.QArray)
  kernel = np.asarray(fp.dense.kernel[...])
  step = np.abs(kernel).max(0, keepdims=True) / 127
  assert np.all(np.abs(np.asarray(qwix.dequantize(w.array)) - kernel) <= step / 2 + 1e-7)
  qt = qwix.quantize_model(fp, qwix.QtProvider(rules), x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(qt(x)[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_asarray_in_a_linen_ptq_apply_only():
  """linen: PtqModel.apply runs its model with the same jnp.asarray (a WithAux input passes
  through, arrays are JAX's), and only inside apply."""

  class M(nn.Module):
    @nn.compact
    def __call__(self, x, aux):
      return nn.Dense(4)(x), jnp.asarray(aux, jnp.bfloat16)

  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (2, 8), jnp.float32)
  aux = qwix.WithAux(_rand_qarray(jax.random.key(1)), "how")
  ptq = qwix.quantize_model(M(), qwix.PtqProvider(rules, implementation="xla"))
  v = ptq.init(jax.random.key(2), x, aux)
  y, got = ptq.apply(v, x, aux)
  assert isinstance(got, qwix.WithAux) and got.array.dtype == jnp.bfloat16
  assert got.array.qvalue is aux.array.qvalue and y.shape == (2, 4)
  with pytest.raises((TypeError, ValueError)):
    M().apply({"params": {"Dense_0": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}}, x, aux)


# ----------------------------------------------------------------------------
# Asymmetric (minmax) static input scales.


def _minmax_reference(xs, x, qmin=-128, qmax=127):
  """qwix's meaning of minmax statistics, in float64: the sums of each batch's per-token
  min(x, 0) / max(x, 0) averaged over the tokens; the scale maps the averaged range onto
  [qmin, qmax] and the zero point is the code of 0. Returns (sums, scale, zero point, x
  quantized and dequantized with them)."""
  xs = [np.asarray(b, np.float64) for b in xs]
  lo = sum(np.minimum(b.min(1), 0).mean() for b in xs)
  hi = sum(np.maximum(b.max(1), 0).mean() for b in xs)
  scale = (hi - lo) / len(xs) / (qmax - qmin)
  zp = np.round(qmin - lo / len(xs) / scale)
  xq = (np.clip(np.round(np.asarray(x, np.float64) / scale) + zp, qmin, qmax) - zp) * scale
  return (lo, hi), scale, zp, xq


@pytest.mark.slow
def test_minmax_static_scale_statistics_and_linen_ptq():
  """A minmax static-scale rule keeps qwix's {count, sum_of_min, sum_of_max}; PTQ params gain
  <op id>_lhs_scale (WithAux) and an int8 <op id>_lhs_zero_point from them; the PTQ model
  predicts the QT forward bit for bit (XLA path) and is the product of the input quantized
  asymmetrically with that scale and zero point (float64 reference)."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                 act_static_scale=True, act_calibration_method="minmax")]
  # Shifted inputs: a symmetric scale would waste most of the codes on values never seen.
  xs = [jax.random.normal(jax.random.key(i), (6, 16), jnp.float32) * (i + 1) + 1.5
        for i in range(3)]
  qt = qwix.quantize_model(nn.Dense(4), qwix.QtProvider(rules))
  v = qt.init(jax.random.key(0), xs[0])
  assert set(v["quant_stats"]["dot_general0_lhs"]) == {"count", "sum_of_min", "sum_of_max"}
  for x in xs:
    _, upd = qt.apply(v, x, mutable=["quant_stats"])
    v = {**v, **upd}
  x = jax.random.normal(jax.random.key(7), (5, 16), jnp.float32) * 2 + 1.5
  (lo, hi), scale, zp, xq = _minmax_reference(xs, x)
  stat = v["quant_stats"]["dot_general0_lhs"]
  assert int(stat["count"]) == 3 and stat["sum_of_min"].shape == (1, 1)
  np.testing.assert_allclose(np.asarray(stat["sum_of_min"]).reshape(()), lo, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(stat["sum_of_max"]).reshape(()), hi, rtol=1e-6)
  ptq = qwix.quantize_model(nn.Dense(4), qwix.PtqProvider(rules, implementation="xla"))
  template = jax.eval_shape(ptq.init, jax.random.key(0), xs[0])["params"]
  assert template["dot_general0_lhs_zero_point"].shape == (1, 1)
  params = qwix.quantize_params(v["params"], template, v["quant_stats"])
  assert jax.tree.structure(params) == jax.tree.structure(template)
  z = params["dot_general0_lhs_zero_point"]
  assert z.dtype == jnp.int8 and int(z.reshape(())) == zp
  np.testing.assert_allclose(np.asarray(params["dot_general0_lhs_scale"].array).reshape(()),
                             scale, rtol=1e-5)
  got = np.asarray(ptq.apply({"params": params}, x))
  np.testing.assert_array_equal(got, np.asarray(qt.apply(v, x)))
  w = np.asarray(qwix.dequantize(params["kernel"].array), np.float64)
  want = xq @ w + np.asarray(v["params"]["bias"], np.float64)
  # float32 accumulation of 16 products of values up to ~|x| |w|.
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(xq).max() * np.abs(w).sum(0).max())
  # The input's rounding error within the range is at most half a step.
  inside = (np.asarray(x) >= lo / 3) & (np.asarray(x) <= hi / 3)
  assert np.all(np.abs(xq - np.asarray(x, np.float64))[inside] <= scale / 2 + 1e-7)
  with pytest.raises(ValueError, match=r"statistics \['count', 'sum_of_absmax'\]: the rule's "
                                       r"asymmetric .*reads \['count', 'sum_of_max', 'sum_of_min'\]"):
    qwix.quantize_params(v["params"], template, {"dot_general0_lhs": {
        "count": np.int32(1), "sum_of_absmax": np.ones((1, 1), np.float32)}})


@pytest.mark.slow
def test_minmax_static_scale_nnx_ptq_both_flows():
  """nnx: a QT model calibrated with minmax, made PTQ by quantize_model (its statistics carried
  over) and by quantize_params into an abstract PTQ model: both hold the same int8 zero point
  and scale, and predict what the QT model predicts once calibration stops."""
  from qtrain.flax import model as model_lib
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                 act_static_scale=True, act_calibration_method="minmax")]
  xs = [jax.random.normal(jax.random.key(i), (6, 16), jnp.float32) - 2.0 * (i + 1)
        for i in range(3)]
  qt = qwix.quantize_model(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), qwix.QtProvider(rules), xs[0])
  for x in xs:  # the sample forward does not calibrate
    qt(x)
  _, scale, zp, _ = _minmax_reference(xs, xs[0])
  ptq = qwix.quantize_model(qt, qwix.PtqProvider(rules, implementation="xla"), xs[0])
  assert ptq.dot_general0_lhs_zero_point[...].dtype == jnp.int8
  assert int(ptq.dot_general0_lhs_zero_point[...].reshape(())) == zp
  np.testing.assert_allclose(np.asarray(ptq.dot_general0_lhs_scale.array[...]).reshape(()),
                             scale, rtol=1e-5)
  abstract = nnx.eval_shape(lambda: qwix.quantize_model(
      qt, qwix.PtqProvider(rules, implementation="xla"), xs[0]))
  stats = nnx.to_pure_dict(nnx.state(qt, qwix.QuantStat))
  nnx.update(abstract, qwix.quantize_params(nnx.to_pure_dict(nnx.state(qt, nnx.Param)),
                                            abstract, stats))
  x = jax.random.normal(jax.random.key(9), (3, 16), jnp.float32) - 4.0
  model_lib.set_calibrate(qt, False)
  want = np.asarray(qt(x))
  np.testing.assert_array_equal(np.asarray(ptq(x)), want)
  np.testing.assert_array_equal(np.asarray(abstract(x)), want)


# ----------------------------------------------------------------------------
# 2-D (per-axis tile) scales in the PTQ leaf.


def _block_scales(a: np.ndarray, tiles: tuple[int, int], qmax: int = 127) -> np.ndarray:
  """absmax / qmax of each (tiles[0] x tiles[1]) block of a 2-D array: its block scales."""
  r, c = a.shape
  return np.abs(a).reshape(r // tiles[0], tiles[0], c // tiles[1], tiles[1]).max((1, 3)) / qmax


def _rounding_bound(x, w, sx, sw):
  """|x_q . w_q - x . w| for values rounded to steps ``sx`` (per element of x) and ``sw`` (per
  element of w), each off by at most half its step: sum_k |x| sw/2 + |w| sx/2 + sx sw/4."""
  ax, aw = np.abs(x), np.abs(w)
  return ax @ (sw / 2) + (sx / 2) @ aw + (sx / 2) @ (sw / 2)


@pytest.mark.slow
@pytest.mark.parametrize("act", [None, "int8"])
def test_nnx_ptq_keeps_2d_block_scales_and_predicts_the_qt_forward(act):
  """tile_size={0: 4, 1: 8} on nnx.Linear(16, 24): the PTQ leaf holds one scale per 4 x 8
  block of the (K, N) kernel, (4, 3) (qwix's layout), each the block's absmax / 127; its
  dequantized weight is within half a block step of the float one; the PTQ forward equals the
  QT forward bit for bit (XLA path) and sits within the rounding bound of a float64 reference
  (the activation quantized in its own 4 x 8 blocks of (M, K) when act_qtype is set)."""
  tiles = (4, 8)
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype=act,
                                 tile_size={0: tiles[0], 1: tiles[1]})]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  layer = nnx.Linear(16, 24, rngs=nnx.Rngs(1))
  w = np.asarray(layer.kernel[...], np.float64)
  ptq = qwix.quantize_model(layer, qwix.PtqProvider(rules, implementation="xla"), x)
  q = ptq.kernel.array
  assert q.qvalue[...].dtype == jnp.int8 and q.qtype == jnp.int8
  assert q.scale[...].shape == (16 // tiles[0], 24 // tiles[1])
  np.testing.assert_allclose(np.asarray(q.scale[...]), _block_scales(w, tiles), rtol=1e-6)
  sw = np.repeat(np.repeat(np.asarray(q.scale[...], np.float64), tiles[0], 0), tiles[1], 1)
  deq = np.asarray(qwix.dequantize(qwix.QArray(q.qvalue[...], q.scale[...])), np.float64)
  assert np.all(np.abs(deq - w) <= sw / 2 + 1e-7)
  got = np.asarray(ptq(x))
  qt = qwix.quantize_model(layer, qwix.QtProvider(rules), x)
  np.testing.assert_array_equal(got, np.asarray(qt(x)))
  xf = np.asarray(x, np.float64)
  sx = (np.zeros_like(xf) if act is None else
        np.repeat(np.repeat(_block_scales(xf, tiles), tiles[0], 0), tiles[1], 1))
  ref = xf @ w + np.asarray(layer.bias[...], np.float64)
  bound = _rounding_bound(xf, w, sx, sw)
  assert np.all(np.abs(got - ref) <= bound + 1e-5 * np.abs(ref).max())
  assert np.abs(got - ref).max() > 0  # quantized: not the float product


@pytest.mark.slow
def test_2d_block_scales_in_linen_ptq_and_the_abstract_nnx_flow():
  """The same 2-D block scales where PTQ params are built from float params: linen
  (PtqModel.init's template, quantize_params) and nnx's abstract model (nnx.eval_shape +
  quantize_params): one scale per block, each the block's absmax / 127; predictions the QT
  forward's bit for bit (XLA path)."""
  tiles = {"hidden": (4, 8), "out": (8, 2)}  # kernels (16, 32) and (32, 4)
  rules = [qwix.QuantizationRule(module_path=name, weight_qtype="int8", act_qtype="int8",
                                 tile_size={0: t[0], 1: t[1]}) for name, t in tiles.items()]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  fp = _Mlp().init(jax.random.key(1), x)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules, implementation="xla"))
  template = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  params = qwix.quantize_params(fp["params"], template)
  for name, t in tiles.items():
    w = np.asarray(fp["params"][name]["kernel"], np.float64)
    want = _block_scales(w, t)
    assert template[name]["kernel"].array.scale.shape == want.shape
    np.testing.assert_allclose(np.asarray(params[name]["kernel"].array.scale), want, rtol=1e-6)
  assert params["hidden"]["kernel"].array.scale.shape == (4, 4)
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules))
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)),
                                np.asarray(qt.apply(fp, x)))
  # nnx: the abstract PTQ model's template, filled from another model's float params.
  rule = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", tile_size={0: 4, 1: 8})]
  abstract = nnx.eval_shape(lambda: qwix.quantize_model(
      nnx.Linear(16, 24, rngs=nnx.Rngs(0)), qwix.PtqProvider(rule, implementation="xla"), x))
  assert abstract.kernel.array.scale.get_value().shape == (4, 3)
  trained = nnx.Linear(16, 24, rngs=nnx.Rngs(5))
  nnx.update(abstract, qwix.quantize_params(nnx.to_pure_dict(nnx.state(trained, nnx.Param)),
                                            abstract))
  np.testing.assert_allclose(np.asarray(abstract.kernel.array.scale[...]), _block_scales(
      np.asarray(trained.kernel[...], np.float64), (4, 8)), rtol=1e-6)
  want = qwix.quantize_model(trained, qwix.QtProvider(rule), x)(x)
  np.testing.assert_array_equal(np.asarray(abstract(x)), np.asarray(want))
