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
