"""The presets as qtrain.QtRule s: plain nn.Dense / nn.Conv + quantize_model == qlayers, and freeze."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain
from qtrain import binary, freeze, qlayers

NAMES = {"scale_a": "act_scale", "bias_a": "act_shift"}


class Plain(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3), name="conv")(x)
    x = nn.Dense(16, name="dense")(x.reshape(x.shape[0], -1))
    return nn.Dense(4, name="head")(x)


class Mine(nn.Module):
  lq: binary.LayerQuant

  @nn.compact
  def __call__(self, x):
    x = qlayers.QConv(8, (3, 3), quant=self.lq, name="conv")(x)
    x = qlayers.QDense(16, quant=self.lq, name="dense")(x.reshape(x.shape[0], -1))
    return qlayers.QDense(4, name="head")(x)


def _to_provider_names(params):
  out = {}
  for layer, p in params.items():
    op = "conv_general_dilated0_" if layer == "conv" else "dot_general0_"
    out[layer] = {(op + NAMES[k] if k in NAMES else k): v for k, v in p.items()}
  return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["bitorch", "xnor", "w4"])
def test_rules_match_qlayers(preset):
  lq = binary.mpq(bits=4, group_size=32) if preset == "w4" else binary.get_preset(preset)
  rules = binary.rules({"head": None, ".*": lq})
  qmodel = qtrain.quantize_model(Plain(), qtrain.QtProvider(rules))
  mine = Mine(lq)
  x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
  pm = mine.init(jax.random.key(1), x)["params"]
  if "bias_a" in pm["dense"]:
    pm["dense"]["bias_a"] = 0.3 * jax.random.normal(jax.random.key(2), pm["dense"]["bias_a"].shape)
  pq = _to_provider_names(pm)
  assert jax.tree.structure(pq) == jax.tree.structure(qmodel.init(jax.random.key(1), x)["params"])
  ym = mine.apply({"params": pm}, x)
  yq = qmodel.apply({"params": pq}, x)
  np.testing.assert_allclose(yq, ym, rtol=1e-5, atol=1e-5)
  gm = jax.grad(lambda p: jnp.sum(mine.apply({"params": p}, x) ** 2))(pm)
  gq = jax.grad(lambda p: jnp.sum(qmodel.apply({"params": p}, x) ** 2))(pq)
  for a, b in zip(jax.tree.leaves(_to_provider_names(gm)), jax.tree.leaves(gq)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # The rules round-trip into the same LayerQuant fields.
  back = binary.LayerQuant.from_rule(rules[1], conv=False)
  act = back.act
  if lq.learn_act_scale:  # channelwise does not apply to a learned (layer-wise) scale
    act = dataclasses.replace(act, channelwise=lq.act.channelwise)
  assert (back.weight, act, back.learn_act_scale, back.learn_act_shift) == (
      lq.weight, lq.act, lq.learn_act_scale, lq.learn_act_shift)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["bitorch", "w2"])
def test_freeze_rule_trained_model(preset):
  lq = binary.mpq(bits=2, group_size=32) if preset == "w2" else binary.bitorch()
  rules = binary.rules({"head": None, ".*": lq})
  model = Plain()
  qmodel = qtrain.quantize_model(model, qtrain.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
  v = qmodel.init(jax.random.key(1), x)
  frozen = freeze.freeze(v, rules)
  assert sorted(frozen["layers"]) == ["conv", "dense"]
  if preset == "bitorch":
    assert frozen["layers"]["dense"].scale_a is not None
    assert frozen["layers"]["conv"].bias_a.shape == (4,)
  ref = qmodel.apply(v, x)
  out = freeze.apply_frozen(model, frozen, x, implementation="xla")
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
