"""QtRule validation and matching, QtProvider matching, the einsum planner, the public API."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain import _einsum


class TestQtRuleValidation:

  def test_frozen_and_keyword_only(self):
    r = qtrain.QtRule(module_path=".*", weight_qtype="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
      r.weight_qtype = "int4"  # type: ignore[misc]
    with pytest.raises(TypeError):
      qtrain.QtRule(".*", "int8")  # type: ignore[misc]

  def test_qtypes_normalized(self):
    r = qtrain.QtRule(weight_qtype=jnp.int8, act_qtype="float8_e4m3fn", bwd_qtype=jnp.float8_e5m2)
    assert (r.weight_qtype, r.act_qtype, r.bwd_qtype) == ("int8", "float8_e4m3fn", "float8_e5m2")
    assert isinstance(r.weight_calibration_method, qtrain.core.Calibration)

  @pytest.mark.parametrize("kwargs, fields", [
      (dict(bwd_stochastic_rounding="uniform"), ["bwd_stochastic_rounding", "bwd_qtype"]),
      (dict(weight_qtype="int8", act_static_scale=True), ["act_static_scale", "act_qtype"]),
      (dict(op_names=("dot_general", "matmul")), ["op_names", "matmul"]),
      (dict(op_names="conv"), ["op_names"]),
      (dict(module_path="(unclosed"), ["module_path", "regex"]),
      (dict(weight_qtype="int9"), ["weight_qtype", "int9"]),
      (dict(weight_qtype="int8", tile_size=0), ["tile_size"]),
      (dict(tile_size=64), ["tile_size", "weight_qtype"]),
      (dict(weight_qtype="int8", weight_estimator="magic"), ["weight_estimator"]),
      (dict(act_qtype="int8", act_static_scale=True, act_learnable_scale=True),
       ["act_static_scale", "act_learnable_scale"]),
      (dict(act_learnable_scale=True), ["act_learnable_scale", "act_qtype"]),
      (dict(act_learnable_shift=True), ["act_learnable_shift", "act_qtype"]),
      (dict(act_qtype="int8", act_learnable_scale=True, act_scale_grad="bitorch"),
       ["act_scale_grad", "binary"]),
      (dict(act_qtype="binary", act_scale_grad="bitorch"), ["act_scale_grad", "act_learnable_scale"]),
      (dict(act_qtype="binary", act_calibration_method="minmax"), ["act_calibration_method"]),
      (dict(act_qtype="int8", act_learnable_scale=True, act_calibration_method="minmax"),
       ["act_learnable_scale", "minmax"]),
      (dict(act_qtype="float8_e4m3fn", act_static_scale=True, act_calibration_method="minmax"),
       ["act_calibration_method", "integer"]),
      (dict(weight_qtype="int8", tile_size={0: 2.5}), ["tile_size", "tile 2.5 of axis 0"]),
      (dict(weight_qtype="int8", bwd_act_grad_tile_size=8), ["bwd_act_grad_tile_size",
                                                             "bwd_qtype"]),
      (dict(bwd_qtype="binary"), ["bwd_qtype"]),
      (dict(bwd_qtype="int8", bwd_calibration_method="minmax"), ["bwd_calibration_method"]),
      (dict(bwd_qtype="int8", bwd_stochastic_rounding="nearest"), ["bwd_stochastic_rounding"]),
      (dict(weight_qtype="int8", implementation="cuda"), ["implementation"]),
      (dict(act_qtype="int8", act_static_scale=True, act_static_scale_averaging="median"),
       ["act_static_scale_averaging"]),
      (dict(act_qtype="int8", act_static_scale_ema_decay=1.0), ["act_static_scale_ema_decay"]),
      (dict(weight_qtype="int8", weight_calibration_method="bogus"), ["weight_calibration_method"]),
      (dict(weight_qtype="int8", bwd_weight_grad_axis_names=("data",)),
       ["bwd_weight_grad_axis_names", "bwd_qtype"]),
      (dict(bwd_qtype="int8", bwd_weight_grad_axis_names=(0,)),
       ["bwd_weight_grad_axis_names", "mesh axis names"]),
      (dict(bwd_qtype="int8", bwd_calibration_method="rms", bwd_weight_grad_axis_names="data"),
       ["bwd_weight_grad_axis_names", "'rms'", "absmax"]),
      (dict(bwd_act_grad_axis_names="model"), ["bwd_act_grad_axis_names", "bwd_qtype"]),
      (dict(act_axis_names="model"), ["act_axis_names", "act_qtype"]),
      (dict(weight_qtype="int8", weight_calibration_method="absmean", weight_axis_names="model"),
       ["weight_axis_names", "'absmean'"]),
      (dict(act_qtype="int8", act_learnable_scale=True, act_axis_names="model"),
       ["act_axis_names", "act_learnable_scale"]),
  ])
  def test_invalid_combinations_name_fields(self, kwargs, fields):
    with pytest.raises(ValueError) as e:
      qtrain.QtRule(module_path=kwargs.pop("module_path", ".*"), **kwargs)
    for f in fields:
      assert f in str(e.value), (f, str(e.value))

  def test_valid_full_rule(self):
    r = qtrain.QtRule(module_path=r".*mlp.*", op_names=["dot_general", "einsum"],
                      weight_qtype="binary", act_qtype="binary", act_learnable_scale=True,
                      act_scale_grad="bitorch", act_learnable_shift=True, act_scale_init=4.0,
                      weight_estimator="clipped_ste_unit", act_estimator="clipped_ste",
                      bwd_qtype="int8", bwd_stochastic_rounding="low_bit_uniform",
                      implementation="xla")
    assert r.op_names == ("dot_general", "einsum")
    assert r.needs_rng and r.has_state and r.quantizes
    assert hash(r) == hash(dataclasses.replace(r))

  def test_matching_fullmatch_and_ops(self):
    r = qtrain.QtRule(module_path=r"block_\d+/mlp", op_names=("dot_general",), weight_qtype="int8")
    assert r.matches("block_0/mlp", "dot_general")
    assert not r.matches("block_0/mlp/Dense_0", "dot_general")  # fullmatch, not search
    assert not r.matches("xblock_0/mlp", "dot_general")
    assert not r.matches("block_0/mlp", "einsum")

  def test_float_rule(self):
    assert not qtrain.QtRule(module_path="head").quantizes


class TestProvider:

  def test_first_match_wins(self):
    p = qtrain.QtProvider([
        qtrain.QtRule(module_path=r".*mlp.*", weight_qtype="int8"),
        qtrain.QtRule(module_path=r".*", weight_qtype="int4"),
    ])
    assert p.match("a/mlp/b", "dot_general")[0] == 0
    assert p.match("a/attn/b", "dot_general")[0] == 1
    assert p.match("a/attn/b", "dot_general")[1].weight_qtype == "int4"

  def test_no_match(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path="x", weight_qtype="int8")])
    assert p.match("y", "dot_general") is None

  def test_rejects_non_rules(self):
    with pytest.raises(ValueError, match=r"rules\[1\]"):
      qtrain.QtProvider([qtrain.QtRule(), {"weight_qtype": "int8"}])

  @pytest.mark.slow
  def test_summary_warns_for_unused_rules(self):
    import flax.linen as nn
    p = qtrain.QtProvider([qtrain.QtRule(module_path="layers_0", weight_qtype="int8"),
                           qtrain.QtRule(module_path="nothing_here", weight_qtype="int4")])
    qm = qtrain.quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), p)
    qm.init(jax.random.key(0), jnp.ones((1, 3)))
    with pytest.warns(UserWarning, match=r"rules\[1\].*nothing_here.*matched no op"):
      table = qtrain.summary(qm)
    lines = table.splitlines()
    assert "module path" in lines[0] and "op id" in lines[0]
    row0 = [l for l in lines if l.startswith("layers_0")][0].split()
    assert row0[:5] == ["layers_0", "dot_general0", "0", "rhs", "int8"]
    row1 = [l for l in lines if l.startswith("layers_1")][0]
    assert "float: no rule matched" in row1

  def test_summary_before_running_warns(self):
    p = qtrain.QtProvider([qtrain.QtRule(weight_qtype="int8")])
    with pytest.warns(UserWarning) as rec:
      qtrain.summary(p)
    msgs = [str(w.message) for w in rec]
    assert any("no op recorded yet" in m for m in msgs)
    assert any(r"rules[0]" in m and "matched no op" in m for m in msgs)


class TestEinsumPlanner:

  @pytest.mark.slow
  @pytest.mark.parametrize("spec, ls, rs", [
      ("bi,ij->bj", (3, 4), (4, 5)),
      ("bi,ji->bj", (3, 4), (5, 4)),
      ("bti,ij->btj", (2, 3, 4), (4, 5)),
      ("...i,ij->...j", (2, 3, 4), (4, 5)),
      ("...qhd,...khd->...hqk", (2, 3, 2, 4), (2, 5, 2, 4)),
      ("btd,dhk->bthk", (2, 3, 4), (4, 2, 5)),
      ("bthk,hkd->btd", (2, 3, 2, 5), (2, 5, 4)),
      ("ij,jk", (3, 4), (4, 5)),                 # implicit output
      ("bij,bjk->bki", (2, 3, 4), (2, 4, 5)),    # batch + transposed output
      ("bi,jk->bj", (3, 4), (5, 6)),             # sums out i and k
      ("bi,ij->j", (3, 4), (4, 5)),              # sums out b via contraction
  ])
  def test_matches_jnp_einsum(self, spec, ls, rs):
    a = jax.random.normal(jax.random.key(0), ls)
    b = jax.random.normal(jax.random.key(1), rs)
    plan = _einsum.parse(spec, ls, rs)
    assert plan is not None
    got = _einsum.run(plan, a, b, lambda l, r, dn: jax.lax.dot_general(
        l, r, dn, precision=jax.lax.Precision.HIGHEST))
    want = jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  @pytest.mark.parametrize("spec, ls, rs", [
      ("ii,ij->j", (3, 3), (3, 4)),       # diagonal
      ("bi,ij,jk->bk", (2, 3), (3, 4)),   # three operands
      ("bi,bi->b", (1, 3), (2, 3)),       # size-1 broadcasting
  ])
  def test_unsupported_returns_none(self, spec, ls, rs):
    assert _einsum.parse(spec, ls, rs) is None


def test_public_api():
  """qtrain.__all__ is what a user calls; the rest is reached through its module."""
  assert sorted(qtrain.__all__) == sorted([
      "QtRule", "QtProvider", "quantize_model", "summary", "set_calibrate", "RNG_STREAM",
      "QtOp", "QuantStat", "ActScale", "ActShift",
      "binary", "core", "freeze", "kernels", "lora", "ops", "optim", "qlayers", "qwix",
      "sparsity"])
  for name in qtrain.__all__:
    assert hasattr(qtrain, name), name
  assert qtrain.RNG_STREAM == "quant"
  assert qtrain.ops.dot_general_qt.__module__ == "qtrain.ops.dot_general_qt"


def test_axis_names_reach_their_quantizations_and_round_trip():
  """Each shard_map axis-name field reaches the quantization it names: the weight's and the
  input's OperandQuant, the GradQuant of the product giving the weight's gradient and of the
  one giving the input's; and survives LayerQuant's round trip."""
  from qtrain import binary, provider as provider_lib
  rule = qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                       bwd_weight_grad_axis_names="data", bwd_act_grad_axis_names=("model",),
                       weight_axis_names=("model",), act_axis_names=("model", "x"))
  assert rule.bwd_weight_grad_axis_names == ("data",)
  p = provider_lib.QtProvider([rule])
  assert p._grad(rule, weight=True).axis_names == ("data",)
  assert p._grad(rule).axis_names == ("model",)
  assert p._operand(rule, weight=True, given_scale=False, conv=False).axis_names == ("model",)
  assert p._operand(rule, weight=False, given_scale=False, conv=False).axis_names == ("model", "x")
  lq = binary.LayerQuant.from_rule(rule)
  assert lq.drhs_grad.axis_names == ("data",) and lq.dlhs_grad.axis_names == ("model",)
  assert lq.weight.axis_names == ("model",) and lq.act.axis_names == ("model", "x")
  (back,) = lq.to_rules()
  for f in ("bwd_weight_grad_axis_names", "bwd_act_grad_axis_names", "weight_axis_names",
            "act_axis_names"):
    assert getattr(back, f) == getattr(rule, f), f
  with pytest.raises(ValueError, match=r"GradQuant.axis_names=\('data',\) with calibration 'rms'"):
    qtrain.ops.GradQuant(qtype="int8", calibration="rms", axis_names=("data",))
  with pytest.raises(ValueError, match=r"OperandQuant.axis_names=\('m',\) with calibration "
                                       r"'percentile'"):
    qtrain.ops.OperandQuant(qtype="int8", calibration="percentile,99", axis_names=("m",))
