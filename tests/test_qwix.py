"""qtrain.qwix: qwix's QT API (rules with qwix's fields and defaults, its RNG stream,
get_unused_rules), checked against the qtrain rule each qwix rule stands for: the same numbers,
where qwix's documentation says what a field means."""

from __future__ import annotations

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain import qwix
from qtrain.core import qarray
from qtrain.flax import model as model_lib


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(6, (3,), name="conv")(x)
    h = nn.Dense(8, name="dense")(h)
    return jnp.einsum("blf,fo->blo", h, self.param("proj", nn.initializers.normal(1.0), (8, 3)))


def _x():
  return jax.random.normal(jax.random.key(0), (2, 5, 4), jnp.float32)


def _grads(provider, stream, key=7):
  model = qtrain.quantize_model(_Net(), provider)
  x = _x()
  params = model.init(jax.random.key(1), x)
  loss = lambda p, x: (model.apply(p, x, rngs={stream: jax.random.key(key)}) ** 2).sum()
  out = model.apply(params, x, rngs={stream: jax.random.key(key)})
  return out, jax.grad(loss, argnums=(0, 1))(params, x)


def _assert_same(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _assert_differ(a, b):
  assert any(not np.array_equal(np.asarray(u), np.asarray(v))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
def test_qt_rule_trains_as_the_qtrain_rule_it_stands_for_with_qwix_rng_stream():
  common = dict(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8,
                bwd_stochastic_rounding="uniform")
  got = _grads(qwix.QtProvider([qwix.QtRule(**common)]), "stochastic_rounding")
  want = _grads(qtrain.QtProvider([qtrain.QtRule(**common)]), "quant")
  _assert_same(got, want)
  # The stream is really used: another key gives other gradients.
  other = _grads(qwix.QtProvider([qwix.QtRule(**common)]), "stochastic_rounding", key=8)
  _assert_differ(got[1], other[1])
  # And the quantization is really on: the float model differs.
  _assert_differ(got[0], _grads(qtrain.QtProvider([]), "quant")[0])


@pytest.mark.slow
def test_empty_op_names_means_every_op_and_a_list_restricts():
  every = qwix.QtProvider([qwix.QtRule(weight_qtype="int8", act_qtype="int8")])
  model = qtrain.quantize_model(_Net(), every)
  model.init(jax.random.key(1), _x())
  ops = {(r.path, r.op_name): r.status for r in every.records()}
  assert {o for _, o in ops} == {"conv_general_dilated", "dot_general", "einsum"}
  assert all(r.rule_index == 0 for r in every.records())
  only = qwix.QtProvider([qwix.QtRule(op_names=["einsum"], weight_qtype="int8")])
  qtrain.quantize_model(_Net(), only).init(jax.random.key(1), _x())
  assert {r.op_name for r in only.records() if r.rule_index == 0} == {"einsum"}


@pytest.mark.slow
def test_rule_without_weight_qtype_leaves_the_op_float_as_qwix_does():
  x = _x()
  float_model = _Net()
  params = float_model.init(jax.random.key(1), x)
  act_only = qwix.QtProvider([qwix.QtRule(act_qtype="int8", bwd_qtype="int8")])
  qmodel = qtrain.quantize_model(_Net(), act_only)
  np.testing.assert_array_equal(np.asarray(qmodel.apply(params, x)),
                                np.asarray(float_model.apply(params, x)))
  # A qtrain rule with act_qtype alone does quantize: the conversion is qwix's semantics.
  qt = qtrain.quantize_model(_Net(), qtrain.QtProvider([qtrain.QtRule(act_qtype="int8")]))
  assert not np.array_equal(np.asarray(qt.apply(params, x)), np.asarray(float_model.apply(params, x)))


@pytest.mark.slow
@pytest.mark.parametrize("text, cal", [
    ("absmax,0.9", qarray.Calibration(method="absmax", multiplier=0.9)),
    ("rms,3", qarray.Calibration(method="rms", multiplier=3.0)),
    ("fixed,-4,4", qarray.Calibration(method="fixed", bound=4.0)),
    (None, qarray.Calibration(method="absmax")),
])
def test_calibration_strings_and_defaults_map_to_qtrain_calibrations(text, cal):
  rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8", weight_calibration_method="absmax",
                     act_calibration_method=text)
  assert qwix.to_qtrain_rule(rule).act_calibration_method == cal
  got = _grads(qwix.QtProvider([rule]), "stochastic_rounding")
  want = _grads(qtrain.QtProvider([qtrain.QtRule(weight_qtype="int8", act_qtype="int8",
                                                 act_calibration_method=cal)]), "quant")
  _assert_same(got, want)


@pytest.mark.slow
def test_get_unused_rules_returns_the_given_rules_after_the_model_ran():
  used = qwix.QtRule(module_path="dense", weight_qtype="int8")
  unused = qwix.QtRule(module_path="decoder/.*", weight_qtype="int8")
  wrong_op = qwix.QuantizationRule(module_path="conv", op_names=("einsum",), weight_qtype="int8")
  provider = qwix.QtProvider([used, unused, wrong_op])
  with pytest.raises(ValueError, match="has not run yet"):
    provider.get_unused_rules()
  model = qtrain.quantize_model(_Net(), provider)
  with pytest.warns(UserWarning, match="matched no op"):
    model.init(jax.random.key(1), _x())
  got = provider.get_unused_rules()
  assert len(got) == 2 and got[0] is unused and got[1] is wrong_op


def test_fractional_and_backward_tiles_map_onto_the_qtrain_rule():
  rule = qwix.to_qtrain_rule(qwix.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                                         tile_size=0.25, bwd_weight_grad_tile_size=64))
  assert (rule.tile_size, rule.bwd_weight_grad_tile_size, rule.bwd_act_grad_tile_size) == \
      (0.25, 64, None)
  # qwix reads a gradient's tile only where that gradient is quantized
  assert qwix.to_qtrain_rule(qwix.QtRule(weight_qtype="int8", bwd_weight_grad_tile_size=64)
                             ).bwd_weight_grad_tile_size is None


@pytest.mark.parametrize("field, value, words", [
    ("additional_qt_config", {"lhs": None}, "additional_qt_config"),
    ("act_batch_axes", (0, 1), "one per tensor"),
])
def test_fields_qtrain_cannot_honour_raise_naming_the_field(field, value, words):
  rule = qwix.QtRule(weight_qtype="int8", **{field: value})
  with pytest.raises(ValueError, match=rf"^rules\[0\]: qwix rule.*{words}"):
    qwix.QtProvider([rule])


def test_sparsity_rule_maps_onto_weight_sparsity_and_refuses_what_qwix_qt_ignores():
  """additional_qt_config={"sparsity_rule": SparsityRule(...)}: the weight_sparsity_* fields
  become the qtrain rule's weight_sparsity (m = 0: none); a schedule, eval_mode and activation
  sparsity (which qwix's QtProvider does not apply) raise, naming the field."""
  sr = qwix.SparsityRule(weight_sparsity_n=1, weight_sparsity_m=4, weight_sparsity_order="C",
                         weight_sparsity_block_size=2, weight_sparsity_offset=0)
  rule = qwix.to_qtrain_rule(qwix.QtRule(weight_qtype="int8",
                                         additional_qt_config={"sparsity_rule": sr}))
  assert rule.weight_sparsity == qtrain.sparsity.Sparsity(1, 4, "C", 2, 0)
  assert rule.act_sparsity is None
  off = qwix.to_qtrain_rule(qwix.QtRule(weight_qtype="int8", additional_qt_config={
      "sparsity_rule": qwix.SparsityRule()}))
  assert off.weight_sparsity is None
  for kw, words in ((dict(weight_sparsity_start_step=10), "weight_sparsity_start_step=10"),
                    (dict(eval_mode=True), "eval_mode=True"),
                    (dict(activation_sparsity_n=2, activation_sparsity_m=4),
                     r"activation_sparsity_n=2.*act_sparsity"),
                    (dict(weight_sparsity_n=5, weight_sparsity_m=4),
                     r"n=5 must be in \[1, m=4\]")):
    with pytest.raises(ValueError, match=rf"^rules\[0\]: qwix rule.*sparsity_rule\.?.*{words}"):
      qwix.QtProvider([qwix.QtRule(weight_qtype="int8", additional_qt_config={
          "sparsity_rule": qwix.SparsityRule(**kw)})])


@pytest.mark.slow
def test_qwix_provider_ops_called_in_a_linen_module_quantize_their_rhs():
  """qwix's provider.dot_general(lhs, rhs, dn) / provider.einsum(...) called in a linen
  module's method: the module's ops dot_general0, einsum0 (rhs the weight): int8 weights,
  2:4 pruned: the product of lhs with the pruned rhs within its int8 rounding; outside a
  module it raises."""
  rule = qwix.QtRule(weight_qtype=jnp.int8, additional_qt_config={
      "sparsity_rule": qwix.SparsityRule(weight_sparsity_n=2, weight_sparsity_m=4)})
  provider = qwix.QtProvider([rule])

  class Direct(nn.Module):
    provider: qwix.QtProvider

    def __call__(self, lhs, rhs):
      a = self.provider.dot_general(lhs, rhs, (((1,), (0,)), ((), ())))
      return a, self.provider.einsum("mk,kn->mn", lhs, rhs)

  lhs = jax.random.normal(jax.random.key(0), (3, 8))
  rhs = jax.random.normal(jax.random.key(1), (8, 8))
  a, b = Direct(provider).apply({}, lhs, rhs)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  w = np.asarray(rhs, np.float64)
  wp = np.where(np.asarray(qtrain.sparsity.mask(rhs, qtrain.sparsity.Sparsity(2, 4))), w, 0)
  x = np.asarray(lhs, np.float64)
  bound = np.abs(x) @ np.ones_like(wp) * (np.abs(wp).max(0) / 127) / 2
  assert np.all(np.abs(np.asarray(a) - x @ wp) <= bound + 1e-5)
  assert sorted(r.op_id for r in provider.records()) == ["dot_general0", "einsum0"]
  assert all(r.status == "quantized" and r.weight_operand == "rhs" for r in provider.records())
  with pytest.raises(ValueError, match="called outside a linen module's method"):
    provider.dot_general(lhs, rhs, (((1,), (0,)), ((), ())))


def test_qtrain_provider_points_qwix_rules_to_the_compat_provider():
  with pytest.raises(ValueError, match=r"got a qtrain\.qwix\.QtRule \(qwix's rules go to "
                                       r"qtrain\.qwix\.QtProvider\)"):
    qtrain.QtProvider([qwix.QtRule(weight_qtype="int8")])
  with pytest.raises(ValueError, match="expected a qwix QuantizationRule"):
    qwix.QtProvider([{"weight_qtype": "int8"}])


def test_quantization_rule_is_a_plain_rule_without_backward():
  rule = qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", tile_size=4)
  got = qwix.to_qtrain_rule(rule)
  assert got == qtrain.QtRule(weight_qtype="int8", act_qtype="int8", tile_size=4)
  assert got.bwd_qtype is None and got.op_names is None
  # A qtrain rule passes through unchanged.
  r = qtrain.QtRule(weight_qtype="int4")
  assert qwix.to_qtrain_rule(r) is r


@pytest.mark.slow
def test_nnx_quantize_model_returns_a_quantized_copy_and_reads_the_qwix_stream():
  from flax import nnx
  x = _x().reshape(10, 4)
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  before = np.asarray(model(x))
  rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                     bwd_stochastic_rounding="uniform")
  qmodel = qwix.quantize_model(model, qwix.QtProvider([rule]), x,
                               rngs=nnx.Rngs(stochastic_rounding=3))
  # qtrain's own nnx quantize_model of the same rule gives the same numbers (same seed; each
  # call advances an op's key, so both are compared at their first call).
  same = qtrain.quantize_model(nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
                               qtrain.QtProvider([qwix.to_qtrain_rule(rule)], rng_stream="quant"),
                               x, rngs=nnx.Rngs(quant=3))
  grad = lambda m: nnx.grad(lambda m: (m(x) ** 2).sum())(m)
  _assert_same(nnx.state(grad(qmodel)), nnx.state(grad(same)))
  assert qmodel is not model
  np.testing.assert_array_equal(np.asarray(model(x)), before)  # the float model stays float
  assert not np.array_equal(np.asarray(qmodel(x)), before)
  with pytest.raises(ValueError, match="call_method='encode'"):
    qwix.quantize_model(model, qwix.QtProvider([rule]), x, call_method="encode")


@pytest.mark.slow
def test_nnx_set_attributes_disable_quant_stats_update_freezes_static_scales():
  from flax import nnx
  x = jax.random.normal(jax.random.key(0), (3, 8))
  rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)
  model = qwix.quantize_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), qwix.QtProvider([rule]), x)
  # qwix.QuantStat selects the static-scale state, as qwix's does (in qtrain's layout).
  stats = lambda: [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, qwix.QuantStat))]
  assert qwix.QuantStat is qtrain.QuantStat and stats()
  model.set_attributes(disable_quant_stats_update=True)
  before = stats()
  model(5 * x)
  for u, v in zip(before, stats(), strict=True):
    np.testing.assert_array_equal(u, v)
  model.set_attributes(disable_quant_stats_update=False)
  model(5 * x)
  assert any(not np.array_equal(u, v) for u, v in zip(before, stats(), strict=True))


# ----------------------------------------------------------------------------
# PTQ.


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))


def _trained_qt(rules, x, steps=3):
  """A QT model trained a few SGD steps (its static scales calibrated along the way)."""
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules))
  v = qt.init(jax.random.key(1), x)
  y = jnp.sin(x[:, :4])

  @jax.jit
  def step(v):
    def loss(p):
      out, upd = qt.apply({**v, "params": p}, x, mutable=["quant_stats"])
      return ((out - y) ** 2).mean(), upd
    g, upd = jax.grad(loss, has_aux=True)(v["params"])
    return {**v, **upd, "params": jax.tree.map(lambda p, g: p - 0.1 * g, v["params"], g)}

  for _ in range(steps):
    v = step(v)
  return qt, v


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_linen_ptq_from_a_qt_model_predicts_what_its_forward_does(static):
  """qwix's PTQ flow: template from eval_shape(ptq_model.init), quantize_params(QT params,
  template, quant_stats), ptq_model.apply: the QT model's forward, bit for bit op by op on the
  XLA path (the codes are the QT op's codes of the same weights). The params are qwix's layout:
  each kernel a WithAux(QArray(qvalue, scale)), each static input scale a WithAux at
  <op id>_lhs_scale (sum_of_absmax / count / qmax of the QT model's quant_stats)."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int4", act_qtype="int8",
                                 act_static_scale=static)]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  qt, v = _trained_qt(rules, x)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules, implementation="xla"))
  abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)
  params = qwix.quantize_params(v["params"], abstract["params"],
                                v.get("quant_stats") if static else None)
  assert jax.tree.structure(params) == jax.tree.structure(abstract["params"])
  w = params["hidden"]["kernel"]
  assert isinstance(w, qwix.WithAux) and isinstance(w.array, qwix.QArray)
  assert w.array.qvalue.dtype == jnp.int4 and w.array.qvalue.shape == (16, 32)
  assert w.array.scale.shape == (1, 32) and w.array.zero_point is None
  np.testing.assert_allclose(np.asarray(qwix.dequantize(w.array)),
                             np.asarray(v["params"]["hidden"]["kernel"]),
                             atol=float(np.abs(v["params"]["hidden"]["kernel"]).max()) / 7 / 2 + 1e-6)
  if static:
    stat = v["quant_stats"]["hidden"]["dot_general0_lhs"]
    s = params["hidden"]["dot_general0_lhs_scale"]
    assert isinstance(s, qwix.WithAux) and s.array.shape == (1, 1)
    np.testing.assert_allclose(np.asarray(s.array).reshape(()),
                               np.asarray(stat["sum_of_absmax"]).reshape(()) / float(stat["count"]) / 127, rtol=1e-6)
  else:
    assert "dot_general0_lhs_scale" not in params["hidden"]
  want = np.asarray(qt.apply(v, x))
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)), want)
  assert not np.array_equal(want, np.asarray(_Mlp().apply({"params": v["params"]}, x)))


@pytest.mark.slow
def test_linen_ptq_init_is_usable_and_quantize_params_takes_float_params():
  """PtqModel.init's own variables run; quantize_params of the float model's params equals
  them (the same weights, frozen once)."""
  rules = [qwix.QuantizationRule(module_path="hidden", weight_qtype="int8", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules))
  v = ptq.init(jax.random.key(3), x)
  assert "kernel" in v["params"]["out"]  # the rule left it float: its kernel stays
  fp = _Mlp().init(jax.random.key(3), x)["params"]
  params = qwix.quantize_params(fp, jax.eval_shape(ptq.init, jax.random.key(3), x)["params"])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(v["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)),
                                np.asarray(ptq.apply(v, x)))


@pytest.mark.slow
def test_linen_ptq_errors_name_what_is_wrong():
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                 act_static_scale=True)]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules))
  v = qt.init(jax.random.key(1), x)  # static scales never calibrated (count 0)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules))
  abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="'hidden/dot_general0_lhs' was never calibrated"):
    qwix.quantize_params(v["params"], abstract, v["quant_stats"])
  other = qwix.quantize_model(nn.Dense(4, name="out"), qwix.QtProvider(rules))
  with pytest.raises(ValueError, match=r"no place for: \['bias', 'kernel'\]"):
    qwix.quantize_params(other.init(jax.random.key(0), x)["params"], abstract)
  narrow = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules)).init(jax.random.key(0), x[:, :8])
  with pytest.raises(ValueError, match=r"'hidden/kernel' has shape \(8, 32\), the template's "
                                       r"\(16, 32\)"):
    qwix.quantize_params(narrow["params"], abstract)
  extra = {**v["params"], "head": {"kernel": jnp.ones((4, 2))}}
  with pytest.raises(ValueError, match=r"no place for: \['head'\]"):
    qwix.quantize_params(extra, abstract, jax.tree.map(jnp.ones_like, v["quant_stats"]))
  with pytest.raises(ValueError, match="no static input scale 'dot_general0_rhs_scale'"):
    qwix.quantize_params(v["params"], abstract, {"hidden": {"dot_general0_rhs": {
        "count": 1, "sum_of_absmax": jnp.ones((1, 1))}}})
  with pytest.raises(ValueError, match=r"'hidden/dot_general0_lhs': statistics \['count', "
                                       r"'sum_of_max', 'sum_of_min'\]: the rule's symmetric .*"
                                       r"reads \['count', 'sum_of_absmax'\]"):
    qwix.quantize_params(v["params"], abstract, {"hidden": {"dot_general0_lhs": {
        "count": 1, "sum_of_min": jnp.ones((1, 1)), "sum_of_max": jnp.ones((1, 1))}}})
  with pytest.raises(ValueError, match="hold no quantized weight"):
    ptq.apply(v, x)
  with pytest.raises(ValueError, match="sample inputs here"):
    qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules), x)
  with pytest.raises(ValueError, match="implementation"):
    qwix.PtqProvider(rules, implementation="cuda")


class _NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(16, 32, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


@pytest.mark.slow
def test_nnx_ptq_from_qt_and_float_models_predicts_what_the_qt_forward_does():
  """nnx: quantize_model(qt_model, PtqProvider(rules), x) freezes the trained QT model (a new
  model; the QT model is left as it is); from a float model it quantizes a copy and runs it
  once. Both predict the QT forward's numbers on the XLA path."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int4", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  fm = _NnxMlp(nnx.Rngs(0))
  qm = qwix.quantize_model(fm, qwix.QtProvider(rules), x)
  want = np.asarray(qm(x))
  ptq = qwix.quantize_model(qm, qwix.PtqProvider(rules, implementation="xla"), x)
  np.testing.assert_array_equal(np.asarray(ptq(x)), want)
  assert isinstance(qm.hidden.dot_general, model_lib.QtOp)  # the QT model is unchanged
  ptq2 = qwix.quantize_model(fm, qwix.PtqProvider(rules, implementation="xla"), x)
  np.testing.assert_array_equal(np.asarray(ptq2(x)), want)
  assert not isinstance(fm.hidden.dot_general, model_lib.QtOp)  # nor the float one
  with pytest.raises(ValueError, match="pass a sample batch"):
    qwix.quantize_model(fm, qwix.PtqProvider(rules))
  other = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
  with pytest.raises(ValueError, match="other rules"):
    qwix.quantize_model(qm, qwix.PtqProvider(other), x)
  assert qwix.quantize_params({}, ptq) == {}  # a subtree of the params: here none


@pytest.mark.slow
def test_nnx_ptq_from_an_abstract_model_and_float_params():
  """qwix's nnx flow: the PTQ model from nnx.eval_shape (no weights computed), filled by
  quantize_params(float pure dict, abstract model) and nnx.update: the predictions of the PTQ
  model frozen from the float model itself, and of the QT forward, bit for bit (XLA path)."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int4", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  create = lambda: qwix.quantize_model(_NnxMlp(nnx.Rngs(0)),
                                       qwix.PtqProvider(rules, implementation="xla"), x)
  abstract = nnx.eval_shape(create)
  pure = nnx.to_pure_dict(nnx.state(abstract))
  assert set(pure["hidden"]["kernel"]["array"]) == {"qvalue", "scale"}
  assert pure["hidden"]["kernel"]["array"]["qvalue"].dtype == jnp.int4
  assert isinstance(abstract.hidden.kernel, qwix.WithAux)
  trained = _NnxMlp(nnx.Rngs(7))  # other weights than the template's
  fp = nnx.to_pure_dict(nnx.state(trained, nnx.Param))
  nnx.update(abstract, qwix.quantize_params(fp, abstract))
  want = np.asarray(qwix.quantize_model(trained, qwix.QtProvider(rules), x)(x))
  np.testing.assert_array_equal(np.asarray(abstract(x)), want)
  frozen = qwix.quantize_model(trained, qwix.PtqProvider(rules, implementation="xla"), x)
  np.testing.assert_array_equal(np.asarray(frozen(x)), want)
  bad = jax.tree.map(lambda a: a, fp)
  bad["out"]["kernel"] = jnp.ones((16, 4))
  with pytest.raises(ValueError, match=r"'out/kernel' has shape \(16, 4\), the template's "
                                       r"\(32, 4\)"):
    qwix.quantize_params(bad, abstract)
  with pytest.raises(ValueError, match="belong to no static-scale layer"):
    qwix.quantize_params(fp, abstract, {"hidden": {"dot_general0_lhs": {
        "count": 1, "sum_of_absmax": jnp.ones((1, 1))}}})
  static = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                  act_static_scale=True)]
  qm = qwix.quantize_model(_NnxMlp(nnx.Rngs(0)), qwix.QtProvider(static), x)
  qm(x)  # a training-mode forward calibrates the static scales
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(qm)))
  m = qwix.quantize_model(qm, qwix.PtqProvider(static), 2 * x)
  assert m.hidden.dot_general.how.spec.act_dict["scale"] == "given"
  # The QT model passed in keeps its state (its sample forward calibrates nothing), and the
  # frozen input scale is the one it had: sum_of_absmax / count / qmax.
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(qm)))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  stat = qm.hidden.dot_general0_lhs.get_value()
  assert int(stat["count"]) == 1 and stat["sum_of_absmax"].shape == (1, 1)
  np.testing.assert_allclose(np.asarray(m.hidden.dot_general0_lhs_scale.array[...]),
                             np.asarray(stat["sum_of_absmax"]) / 127, rtol=1e-6)
  assert "dot_general0_lhs" not in vars(m.hidden)  # the PTQ model keeps the scale, not the stats
  with pytest.raises(ValueError, match="keeps a static input scale: pass the QT model's "
                                       "quant_stats"):
    qwix.quantize_params(fp, m)
  stats = nnx.to_pure_dict(nnx.state(qm, qwix.QuantStat))
  filled = qwix.quantize_params(nnx.to_pure_dict(nnx.state(qm, nnx.Param)), m, stats)
  jax.tree.map(np.testing.assert_array_equal, filled,
               jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m))))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("weight_qtype", ["int4", "int8"])
@pytest.mark.parametrize("implementation", ["auto", "triton"])
def test_ptq_on_the_packed_kernels_predicts_the_qt_forward_gpu(weight_qtype, implementation):
  """PTQ on a GPU: 8 rows (decoding), the frozen weights through the packed Triton kernels
  ("auto" picks them at <= 16 rows). With int8 activations both sides accumulate integers
  exactly; what remains is float32 rounding of the scaled sums, bounded by
  K * eps * (|x_hat| . |w_hat|) per output."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=weight_qtype, act_qtype="int8")]
  k, n = 512, 256
  model = nn.Dense(n)
  x = jax.random.normal(jax.random.key(0), (8, k), jnp.float32)
  qt = qwix.quantize_model(model, qwix.QtProvider(rules))
  v = qt.init(jax.random.key(1), x)
  ref = np.asarray(qt.apply(v, x), np.float64)
  ptq = qwix.quantize_model(model, qwix.PtqProvider(rules, implementation=implementation))
  params = qwix.quantize_params(v["params"], jax.eval_shape(ptq.init, jax.random.key(0), x)["params"])
  out = np.asarray(jax.jit(ptq.apply)({"params": params}, x), np.float64)
  w = np.abs(np.asarray(qwix.dequantize(params["kernel"].array), np.float64)).T
  xq = qarray.quantize(x, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  xh = np.abs(np.asarray(xq.dequantize(), np.float64))
  bound = k * np.finfo(np.float32).eps * (xh @ w.T) + np.finfo(np.float32).eps * np.abs(ref)
  assert out.shape == ref.shape == (8, n)
  assert np.all(np.abs(out - ref) <= bound), float(np.max(np.abs(out - ref) / bound))


@pytest.mark.slow
def test_linen_ptq_params_save_and_restore_with_orbax(tmp_path):
  """Offline quantization: PTQ params saved with orbax and restored into the abstract template
  (jax.eval_shape of ptq_model.init) predict as before, bit for bit."""
  import orbax.checkpoint as ocp
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int4", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules, implementation="xla"))
  abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  params = qwix.quantize_params(_Mlp().init(jax.random.key(3), x)["params"], abstract)
  ck = ocp.StandardCheckpointer()
  ck.save(str(tmp_path / "ptq"), params)
  ck.wait_until_finished()
  back = ck.restore(str(tmp_path / "ptq"), abstract)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": back}, x)),
                                np.asarray(ptq.apply({"params": params}, x)))


@pytest.mark.slow
def test_quantize_model_takes_qwix_methods():
  """qwix's ``methods``: a linen model's ops are quantized in every method, so any of its
  methods is accepted (the model then quantizes a second method's ops too); a name it lacks
  raises; an nnx model takes ("__call__",) only."""

  class TwoWays(nn.Module):
    def setup(self):
      self.proj = nn.Dense(4)

    def __call__(self, x):
      return self.proj(x)

    def decode(self, x):
      return self.proj(x) * 2

  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (2, 8), jnp.float32)
  model = qwix.quantize_model(TwoWays(), qwix.QtProvider(rules), methods=["__call__", "decode"])
  v = model.init(jax.random.key(1), x)
  float_out = TwoWays().apply(v, x, method="decode")
  out = model.apply(v, x, method="decode")
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(model.apply(v, x)))
  assert not np.array_equal(np.asarray(out), np.asarray(float_out))  # quantized
  np.testing.assert_array_equal(np.asarray(model.apply(v, x, method=TwoWays.decode)),
                                np.asarray(out))
  v2 = model.init(jax.random.key(1), x, method="decode")  # init through another method
  assert jax.tree.structure(v2) == jax.tree.structure(v)
  with pytest.raises(ValueError, match="TwoWays has no method 'encode'"):
    qwix.quantize_model(TwoWays(), qwix.QtProvider(rules), methods=("encode",))
  with pytest.raises(ValueError, match="nnx model is quantized through its __call__"):
    qwix.quantize_model(_NnxMlp(nnx.Rngs(0)), qwix.QtProvider(rules), x[:, :1].repeat(16, 1),
                        methods=("decode",))


@pytest.mark.slow
def test_ptq_and_qt_models_export_with_a_symbolic_batch():
  """jax.export with a shape variable for the batch (qwix's symbolic-export flow): the exported
  PTQ / QT forward computes, at each concrete batch size, what the model's apply does (the
  product runs on XLA for every size: kernels plan on concrete shapes)."""
  from jax import export
  rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8, tile_size=4)]
  ptq = qwix.quantize_model(nn.Dense(5), qwix.PtqProvider(rules))
  qt = qwix.quantize_model(nn.Dense(5), qwix.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float32)
  (b,) = export.symbolic_shape("b")
  spec = jax.ShapeDtypeStruct((b, 32), jnp.float32)
  qt_vars = qt.init(jax.random.key(1), x)
  fp = np.asarray(nn.Dense(5).apply(qt_vars, x))
  for model in (ptq, qt):
    v = model.init(jax.random.key(1), x)  # the same float kernel for both
    exp = export.export(jax.jit(model.apply))(v, spec)
    assert exp.out_avals[0].shape == (b, 5)
    for n in (3, 16):
      got = np.asarray(exp.call(v, x[:n]))
      np.testing.assert_allclose(got, np.asarray(qt.apply(qt_vars, x[:n])), rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(got, fp[:n], atol=0.05 * np.abs(fp).max())
      assert not np.array_equal(got, fp[:n])


@pytest.mark.slow
def test_quantize_params_allow_extra_params_drops_what_the_ptq_model_never_uses():
  """qwix's allow_extra_params: params the PTQ template has no place for (a loss head the served
  method never calls) raise, naming them, unless allowed, and are then dropped; whole variables
  with a whole-variables template work as params with a params template."""

  class WithLoss(nn.Module):
    def setup(self):
      self.body = nn.Dense(8)
      self.loss_head = nn.Dense(1)

    def __call__(self, x):
      return self.body(x)

    def loss(self, x):
      return self.loss_head(self(x)).mean()

  rules = [qwix.QuantizationRule(weight_qtype=jnp.int8, act_qtype=jnp.int8)]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  variables = WithLoss().init(jax.random.key(1), x, method="loss")
  ptq = qwix.quantize_model(WithLoss(), qwix.PtqProvider(rules, implementation="xla"),
                            methods=["__call__"])
  abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"no place for: \['loss_head'\].*allow_extra_params"):
    qwix.quantize_params(variables["params"], abstract["params"])
  with pytest.raises(ValueError, match=r"no place for: \['loss_head'\]"):
    qwix.quantize_params(variables, abstract)
  params = qwix.quantize_params(variables["params"], abstract["params"], allow_extra_params=True)
  whole = qwix.quantize_params(variables, abstract, allow_extra_params=True)
  assert "loss_head" not in params and sorted(whole) == ["params"]
  _assert_same(params, whole["params"])
  # The served forward is the QT forward of the same weights.
  qt = qwix.quantize_model(WithLoss(), qwix.QtProvider(rules))
  want = np.asarray(qt.apply(variables, x))
  np.testing.assert_array_equal(np.asarray(ptq.apply(whole, x)), want)
  fp = np.asarray(WithLoss().apply(variables, x))
  np.testing.assert_allclose(want, fp, atol=0.05 * np.abs(fp).max())
  assert not np.array_equal(want, fp)


@pytest.mark.slow
def test_nnx_quantize_params_extra_params_raise_unless_allowed():
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  rules = [qwix.QuantizationRule(weight_qtype=jnp.int8)]
  fp = _NnxMlp(nnx.Rngs(0))
  abstract = nnx.eval_shape(lambda: qwix.quantize_model(fp, qwix.PtqProvider(rules), x))
  params = nnx.to_pure_dict(nnx.state(fp, nnx.Param))
  params["head"] = {"kernel": jnp.ones((4, 2))}
  with pytest.raises(ValueError, match=r"no place for: \['head/kernel'\]"):
    qwix.quantize_params(params, abstract)
  nnx.update(abstract, qwix.quantize_params(params, abstract, allow_extra_params=True))
  want = qwix.quantize_model(fp, qwix.PtqProvider(rules), x)
  np.testing.assert_array_equal(np.asarray(abstract(x)), np.asarray(want(x)))


@pytest.mark.slow
def test_linen_ptq_takes_partitioned_params():
  """nn.with_partitioning on the kernel and bias (qwix's sharded-model case): PtqModel.init
  freezes the boxed kernel, quantize_params takes the unboxed float params (the template keeps
  the boxes) and both predict what the QT model predicts from the same weights."""
  part = nn.with_partitioning
  dense = nn.Dense(5, kernel_init=part(nn.initializers.lecun_normal(), ("contraction", "out")),
                   bias_init=part(nn.initializers.normal(1.0), ("out",)))
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8,
                                 tile_size=4)]
  x = jax.random.normal(jax.random.key(0), (10, 12), jnp.float32)
  ptq = qwix.quantize_model(dense, qwix.PtqProvider(rules, implementation="xla"))
  v = ptq.init(jax.random.key(1), x)
  w = v["params"]["kernel"]
  assert isinstance(w, qwix.WithAux)
  assert isinstance(w.array.qvalue, nn.Partitioned) and w.array.qvalue.names == ("contraction", "out")
  assert w.array.scale.value.shape == (3, 5) and w.array.scale.names == ("contraction", "out")
  abstract = jax.eval_shape(ptq.init, jax.random.key(1), x)["params"]
  fp = dense.init(jax.random.key(1), x)
  qt = qwix.quantize_model(dense, qwix.QtProvider(rules))
  want = np.asarray(qt.apply(fp, x))
  np.testing.assert_array_equal(np.asarray(ptq.apply(v, x)), want)
  for given in (nn.unbox(fp["params"]), fp["params"]):
    params = qwix.quantize_params(given, abstract)
    np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)), want)
  ref = np.asarray(dense.apply(fp, x))
  np.testing.assert_allclose(want, ref, atol=0.05 * np.abs(ref).max())
  assert not np.array_equal(want, ref)


def test_ptq_of_a_model_with_no_op_to_quantize_is_the_float_model():
  """qwix leaves a model with no matmul / conv as it is under a PtqProvider (the rules match no
  op, with the usual warning); qtrain.qwix does too, on linen and nnx, instead of raising."""

  class Scale(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x * self.param("s", nn.initializers.normal(1.0), (x.shape[-1],))

  class NnxScale(nnx.Module):
    def __init__(self):
      self.s = nnx.Param(jax.random.normal(jax.random.key(2), (16,)))

    def __call__(self, x):
      return jnp.tanh(x) * self.s

  rules = [qwix.QuantizationRule(weight_qtype=jnp.int8, act_qtype=jnp.int8)]
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  with pytest.warns(UserWarning, match="matched no op"):
    ptq = qwix.quantize_model(Scale(), qwix.PtqProvider(rules))
    v = ptq.init(jax.random.key(1), x)
  want = Scale().apply({"params": {"s": v["params"]["s"]}}, x)
  np.testing.assert_array_equal(np.asarray(ptq.apply(v, x)), np.asarray(want))
  fp = NnxScale()
  with pytest.warns(UserWarning, match="matched no op"):
    served = qwix.quantize_model(fp, qwix.PtqProvider(rules), x)
  assert served is not fp
  np.testing.assert_array_equal(np.asarray(served(x)), np.asarray(fp(x)))


# ----------------------------------------------------------------------------
# Pre-quantized checkpoints (qwix's offline quantization).


def _prequantized(w: jax.Array, *, tile: int | None, minmax: bool = False):
  """``w`` quantized to int8 by qtrain, written as a qwix checkpoint leaf (qvalue, scale per tile
  of the contraction and per output channel[, zero_point]), and its dequantized reference."""
  spec = qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,),
                             tiled_axes={0: tile} if tile else {},
                             calibration="minmax" if minmax else "absmax")
  q = qarray.quantize(w, spec)
  leaf = {"qvalue": np.asarray(q.qvalue), "scale": np.asarray(q.scale)}
  if minmax:
    leaf["zero_point"] = np.asarray(q.zero_point)
  return leaf, np.asarray(qarray.dequantize(q))


@pytest.mark.slow
@pytest.mark.parametrize("tile, minmax", [(4, False), (None, True)])
def test_process_prequantized_params_dequantizes_into_float_and_qt_models(tile, minmax):
  """qwix's full-precision path of offline quantization: a checkpoint's {qvalue, scale
  [, zero_point]} weight (optionally under "array") becomes (qvalue - zero_point) * scale in the
  model's dtype; a float leaf is taken as it is; nnx.update then runs the model on those weights
  (a float model, or a QT model to fine-tune)."""
  fp = _NnxMlp(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  params = nnx.to_pure_dict(nnx.state(fp, nnx.Param))
  hidden, want_hidden = _prequantized(jnp.asarray(params["hidden"]["kernel"]), tile=tile,
                                      minmax=minmax)
  out, want_out = _prequantized(jnp.asarray(params["out"]["kernel"]), tile=tile, minmax=minmax)
  bias = np.asarray(jax.random.normal(jax.random.key(3), (32,)))
  ckpt = {"hidden": {"kernel": {"array": hidden}, "bias": bias}, "out": {"kernel": out}}
  rules = [qwix.QtRule(weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8)]
  models = [nnx.eval_shape(lambda: _NnxMlp(nnx.Rngs(0))),
            qwix.quantize_model(fp, qwix.QtProvider(rules), x)]
  for model in models:
    got = qwix.process_prequantized_params(ckpt, model)
    np.testing.assert_array_equal(np.asarray(got["hidden"]["kernel"]), want_hidden)
    np.testing.assert_array_equal(np.asarray(got["out"]["kernel"]), want_out)
    np.testing.assert_array_equal(np.asarray(got["hidden"]["bias"]), bias)
    assert "bias" not in got["out"]  # not in the checkpoint: left to the model
    assert got["hidden"]["kernel"].dtype == jnp.float32
    w = np.asarray(params["hidden"]["kernel"])
    assert 0 < np.abs(want_hidden - w).max() <= np.abs(w).max() / 127
  float_model = models[0]
  nnx.update(float_model, qwix.process_prequantized_params(ckpt, float_model))
  ref = nnx.relu(x @ want_hidden + bias) @ want_out + np.asarray(params["out"]["bias"])
  nnx.update(float_model, {"out": {"bias": params["out"]["bias"]}})
  np.testing.assert_allclose(np.asarray(float_model(x)), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_process_prequantized_params_errors_name_what_is_wrong():
  fp = _NnxMlp(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  leaf, _ = _prequantized(jnp.asarray(fp.out.kernel[...]), tile=None)
  with pytest.raises(TypeError, match="NNX models.*got Dense"):
    qwix.process_prequantized_params({}, nn.Dense(4))
  with pytest.raises(ValueError, match="no parameter 'head/kernel'.*allow_extra_params"):
    qwix.process_prequantized_params({"head": {"kernel": leaf}}, fp)
  assert qwix.process_prequantized_params({"head": {"kernel": leaf}}, fp,
                                          allow_extra_params=True) == {}
  with pytest.raises(ValueError, match=r"'out/kernel'.*missing \['scale'\]"):
    qwix.process_prequantized_params({"out": {"kernel": {"qvalue": leaf["qvalue"]}}}, fp)
  with pytest.raises(ValueError, match=r"'out/kernel' has unsupported quantized leaves \['extra'\]"):
    qwix.process_prequantized_params({"out": {"kernel": {**leaf, "extra": 1}}}, fp)
  with pytest.raises(ValueError, match=r"'out/kernel' has shape \(31, 4\).*\(32, 4\)"):
    qwix.process_prequantized_params(
        {"out": {"kernel": {"qvalue": leaf["qvalue"][:-1], "scale": leaf["scale"]}}}, fp)
  with pytest.raises(ValueError, match=r"scale of shape \(3, 4\) does not tile"):
    qwix.process_prequantized_params(
        {"out": {"kernel": {"qvalue": leaf["qvalue"], "scale": np.ones((3, 4), np.float32)}}}, fp)
  ptq = qwix.quantize_model(fp, qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")]), x)
  with pytest.raises(ValueError, match="invalid parameter combination for 'out/kernel'"):
    qwix.process_prequantized_params({"out": {"kernel": fp.out.kernel[...]}}, ptq)
  with pytest.raises(ValueError, match="'out/kernel' has an unexpected 'zero_point'"):
    qwix.process_prequantized_params(
        {"out": {"kernel": {**leaf, "zero_point": np.zeros((1, 4), np.int8)}}}, ptq)
  got = qwix.process_prequantized_params({"out": {"kernel": leaf}}, ptq)
  assert got["out"]["kernel"]["array"]["qvalue"].dtype == jnp.int8


@pytest.mark.slow
def test_process_prequantized_params_fills_a_template_value_that_carries_its_array():
  """A template parameter whose (abstract) value carries its array as an ``array`` attribute
  takes a checkpoint entry at <param>/array into that array: a {qvalue, scale} entry
  dequantized (qvalue * scale, per tile) into its dtype and shape; a float entry at <param>
  itself still goes to the parameter."""

  class Boxed(jax.ShapeDtypeStruct):
    def __init__(self, shape, dtype, array):
      super().__init__(shape, dtype)
      object.__setattr__(self, "array", array)

  class M(nnx.Module):
    def __init__(self):
      self.kernel = nnx.Param(Boxed((12, 6), jnp.float32,
                                    jax.ShapeDtypeStruct((12, 6), jnp.bfloat16)))

  leaf, ref = _prequantized(jax.random.normal(jax.random.key(3), (12, 6)), tile=4)
  got = qwix.process_prequantized_params({"kernel": {"array": leaf}}, M())
  out = got["kernel"]["array"]
  assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and out.shape == (12, 6)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(jnp.asarray(ref).astype(jnp.bfloat16), np.float32))
  flat = qwix.process_prequantized_params({"kernel": np.ones((12, 6), np.float32)}, M())
  assert flat["kernel"].shape == (12, 6) and flat["kernel"].dtype == jnp.float32
  with pytest.raises(ValueError, match=r"'kernel/array' has shape \(12, 5\)"):
    qwix.process_prequantized_params(
        {"kernel": {"array": {"qvalue": leaf["qvalue"][:, :5], "scale": leaf["scale"][:, :5]}}},
        M())


def test_restore_quantization_rules_reads_one_rule_per_module():
  """qwix's restore_quantization_rules: a rule per module holding a {qvalue, scale} leaf, its
  qtype the codes' dtype, minmax where a zero point is stored, integer keys as a wildcard; rules
  that differ under one wildcard path warn and the later wins; the rules run in a QtProvider."""
  q8 = {"qvalue": np.zeros((4, 4), np.int8), "scale": np.ones((1, 4), np.float32)}
  ckpt = {"layers": {0: {"kernel": q8}, 1: {"kernel": {"array": q8}}},
          "head": {"kernel": {**q8, "zero_point": np.zeros((1, 4), np.int8)},
                   "bias": np.zeros(4, np.float32)}}
  rules = qwix.restore_quantization_rules(ckpt, qwix.QtRule, tile_size=4, bwd_qtype=jnp.int8)
  assert rules == [
      qwix.QtRule(module_path="layers/[^/]+", weight_qtype=jnp.int8, act_qtype=jnp.int8,
                  weight_calibration_method="absmax", tile_size=4, bwd_qtype=jnp.int8),
      qwix.QtRule(module_path="head", weight_qtype=jnp.int8, act_qtype=jnp.int8,
                  weight_calibration_method="minmax", tile_size=4, bwd_qtype=jnp.int8)]
  assert qwix.restore_quantization_rules(ckpt, tile_size=None, act_qtype=None)[0] == (
      qwix.QuantizationRule(module_path="layers/[^/]+", weight_qtype=jnp.int8))
  mixed = {"layers": {0: {"kernel": q8}, 1: {"kernel": {**q8, "qvalue": np.zeros((4, 4), "int4")}}}}
  with pytest.warns(UserWarning, match="'layers/\\[\\^/\\]\\+' has weights of different rules"):
    (rule,) = qwix.restore_quantization_rules(mixed, tile_size=None)
  assert rule.weight_qtype == jnp.int4
  with pytest.raises(ValueError, match="rule_type=.*QuantizationRule or"):
    qwix.restore_quantization_rules(ckpt, qtrain.QtRule, tile_size=4)
  qwix.QtProvider(rules)  # valid rules for qtrain


class _NnxDirect(nnx.Module):
  """A module whose products are its own calls: jnp.einsum and @ on its nnx.Params."""

  def __init__(self, rngs):
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.2)
    self.w2 = nnx.Param(jax.random.normal(rngs.params(), (32, 4)) * 0.2)

  def __call__(self, x):
    return nnx.relu(jnp.einsum("bd,df->bf", x, self.w1[...])) @ self.w2


@pytest.mark.slow
def test_nnx_ptq_of_a_qt_model_with_direct_calls_freezes_them():
  """A QT model whose quantized ops are direct calls (no layer op attribute) is a QT model to
  PTQ: it is not quantized a second time ('already quantized'); its calls are frozen (PtqOps
  under their op ids) and predict the QT forward; the QT model is left as it is."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  qm = qwix.quantize_model(_NnxDirect(nnx.Rngs(0)), qwix.QtProvider(rules), x)
  want = np.asarray(qm(x))
  for inputs in ((x,), ()):
    ptq = qwix.quantize_model(qm, qwix.PtqProvider(rules, implementation="xla"), *inputs)
    assert isinstance(ptq.einsum0, qwix.PtqOp) and isinstance(ptq.w1, qwix.WithAux)
    np.testing.assert_array_equal(np.asarray(ptq(x)), want)
  other = [qwix.QuantizationRule(module_path=".*", weight_qtype="int4", act_qtype="int8")]
  with pytest.raises(ValueError, match=r"the op of '' was quantized with other rules"):
    qwix.quantize_model(qm, qwix.PtqProvider(other), x)
  np.testing.assert_array_equal(np.asarray(qm(x)), want)
  assert isinstance(qm.einsum0, model_lib.QtOp) and isinstance(qm.dot_general0, model_lib.QtOp)
