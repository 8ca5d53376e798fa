"""BitNet b1.58 as a rule, and per-operand scale granularity in QtRule."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import binary, freeze
from qtrain.ops import config as cfg_lib


class Block(nn.Module):
  """Two BitLinear-style projections with a norm before the second, and a float head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(24, name="up")(x)
    x = nn.Dense(16, name="down")(nn.RMSNorm()(x))
    return nn.Dense(3, name="head")(x)


def _grid_activations(rng, rows, k):
  """Rows x = a_row * j / 127 with integer j in [-127, 127] and |j| = 127 in every row, so the
  per-token int8 codes are exactly j (nowhere near a rounding tie, in float32 or float64)."""
  a = rng.uniform(0.5, 3.0, (rows, 1))
  j = rng.integers(-127, 128, (rows, k))
  j[:, 0] = 127 * rng.choice([-1, 1], rows)
  return (a * j / 127).astype(np.float32), j, a


def _grid_weight(rng, k, n):
  """Weights of magnitudes {0.1, 0.7, 1.9} (random signs): W / mean|W| lies far from every
  rounding tie of the ternary grid, so the codes are known exactly."""
  mags = rng.choice([0.1, 0.7, 1.9], (k, n))
  return (mags * rng.choice([-1, 1], (k, n))).astype(np.float32)


def _bitnet_reference(x, w):
  """The paper's BitLinear (no norm) in float64: returns (y, x_q, w_q)."""
  x, w = x.astype(np.float64), w.astype(np.float64)
  s_x = 127.0 / np.abs(x).max(axis=-1, keepdims=True)
  x_q = np.clip(np.round(x * s_x), -128, 127) / s_x
  g = np.abs(w).mean()
  w_q = np.clip(np.round(w / g), -1, 1) * g
  return x_q @ w_q, x_q, w_q


@pytest.mark.slow
def test_bitnet_rule_is_the_papers_bitlinear_forward_and_ste_backward():
  rng = np.random.default_rng(0)
  x, _, _ = _grid_activations(rng, 6, 40)
  w = _grid_weight(rng, 40, 24)
  model = qtrain.quantize_model(nn.Dense(24, use_bias=False),
                                qtrain.QtProvider(binary.rules({".*": "bitnet_b158"})))
  params = {"kernel": jnp.asarray(w)}
  y = model.apply({"params": params}, jnp.asarray(x))
  y_ref, x_q, w_q = _bitnet_reference(x, w)
  # Exact codes on both sides: only float32 accumulation and scale rounding differ.
  np.testing.assert_allclose(np.asarray(y, np.float64), y_ref, rtol=2e-6, atol=2e-6 * np.abs(y_ref).max())
  # The weight really is ternary with one scale: three distinct dequantized values.
  assert len(np.unique(np.round(w_q / np.abs(w).mean(), 6))) <= 3
  # Straight-through gradients: d/dx = g w_q^T, d/dW = x_q^T g (nothing masked).
  ct = rng.standard_normal(y_ref.shape).astype(np.float32)
  gx, gw = jax.grad(lambda x, p: jnp.vdot(model.apply({"params": p}, x), ct), (0, 1))(
      jnp.asarray(x), params)
  np.testing.assert_allclose(np.asarray(gx, np.float64), ct @ w_q.T, rtol=2e-6,
                             atol=2e-6 * np.abs(ct @ w_q.T).max())
  np.testing.assert_allclose(np.asarray(gw["kernel"], np.float64), x_q.T @ ct, rtol=2e-6,
                             atol=2e-6 * np.abs(x_q.T @ ct).max())


@pytest.mark.slow
def test_bitnet_rules_match_the_layer_quant_and_freeze_to_two_bit_words():
  lq = binary.bitnet_b158()
  rules = binary.rules({"head": None, ".*": lq})
  assert [r.short() for r in rules] == ["w=None a=None g=None",
                                        "w=ternary a=int8 g=None w_gran=per_tensor a_gran=per_token"]
  back = binary.LayerQuant.from_rule(rules[1])
  assert (back.weight, back.act) == (lq.weight, lq.act)
  model = qtrain.quantize_model(Block(), qtrain.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (5, 32))
  v = model.init(jax.random.key(1), x)
  y = model.apply(v, x)
  frozen = freeze.freeze(v, rules)
  up = frozen["layers"]["up"]
  assert up.w_qtype == "ternary" and up.words.dtype == jnp.uint32
  assert up.words.shape == (24, 32 // 16)  # 16 two-bit codes per word along K
  # One weight scale for the whole tensor (stored per output channel, all equal).
  np.testing.assert_array_equal(np.asarray(up.w_scale), np.full(24, np.asarray(up.w_scale)[0]))
  np.testing.assert_allclose(np.asarray(up.w_scale)[0],
                             np.abs(np.asarray(v["params"]["up"]["kernel"])).mean(), rtol=1e-6)
  yf = freeze.apply_frozen(Block(), frozen, x)
  np.testing.assert_array_equal(np.asarray(yf), np.asarray(y))


@pytest.mark.slow
def test_bitnet_rule_on_nnx_matches_linen():
  rules = binary.rules({".*": "bitnet_b158"})
  x = jax.random.normal(jax.random.key(2), (4, 12))
  lin = nnx.Linear(12, 8, rngs=nnx.Rngs(0))
  w, b = lin.kernel[...], lin.bias[...]
  qn = qtrain.quantize_model(lin, qtrain.QtProvider(rules))
  ql = qtrain.quantize_model(nn.Dense(8), qtrain.QtProvider(rules))
  yl = ql.apply({"params": {"kernel": w, "bias": b}}, x)
  np.testing.assert_array_equal(np.asarray(qn(x)), np.asarray(yl))


@pytest.mark.slow
def test_per_operand_granularity_overrides_the_shared_fields():
  rule = qtrain.QtRule(weight_qtype="int4", act_qtype="int8", tile_size=16,
                       weight_granularity="per_channel")
  assert rule.granularity(weight=True) == (True, None)
  assert rule.granularity(weight=False) == (True, 16)  # the shared tile_size
  rule = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", disable_channelwise_axes=True,
                       act_granularity=32)
  assert rule.granularity(weight=True) == (False, None)
  assert rule.granularity(weight=False) == (True, 32)
  # The provider builds the op from them: the model equals dot_general_qt with those configs.
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
  model = qtrain.quantize_model(nn.Dense(8, use_bias=False), qtrain.QtProvider([rule]))
  y = model.apply({"params": {"kernel": w}}, x)
  cfg = cfg_lib.DotGeneralQtConfig(
      lhs=cfg_lib.OperandQuant(qtype="int8", channelwise=True, tile_size=32),
      rhs=cfg_lib.OperandQuant(qtype="int8", channelwise=False))
  ref = qtrain.ops.dot_general_qt(x, w, (((1,), (0,)), ((), ())), cfg)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  # ... and differs from the shared setting it overrides (per-tensor activations).
  shared = qtrain.quantize_model(nn.Dense(8, use_bias=False), qtrain.QtProvider(
      [qtrain.QtRule(weight_qtype="int8", act_qtype="int8", disable_channelwise_axes=True)]))
  assert not np.array_equal(np.asarray(shared.apply({"params": {"kernel": w}}, x)), np.asarray(y))


@pytest.mark.parametrize("kw, match", [
    (dict(weight_qtype="int8", weight_granularity="per_token"),
     r"weight_granularity='per_token'; valid: None, 'per_tensor', 'per_channel' or a tile \(a "
     r"positive int, a fraction in \(0, 1\], per-axis tiles\) \('per_token' is the other "
     r"operand's name for the same layout: 'per_channel' here\)"),
    (dict(act_qtype="int8", act_granularity="per_channel"),
     r"act_granularity='per_channel'.*'per_token' here"),
    (dict(weight_qtype="int8", weight_granularity=0), r"weight_granularity=0 is not valid; valid"),
    (dict(weight_qtype="int8", weight_granularity=True),
     r"weight_granularity=True is not valid; valid"),
    (dict(weight_qtype="int8", weight_granularity="row"), r"weight_granularity='row'; valid"),
    (dict(weight_qtype="int8", act_granularity="per_token"),
     r"act_granularity='per_token' is set but act_qtype is None"),
])
def test_bad_granularity_is_refused_by_name(kw, match):
  with pytest.raises(ValueError, match=match):
    qtrain.QtRule(**kw)


@pytest.mark.slow
def test_granularity_tile_on_a_conv_is_refused_naming_the_field():
  rule = qtrain.QtRule(weight_qtype="int8", act_qtype="int8", weight_granularity=16)
  model = qtrain.quantize_model(nn.Conv(4, (3, 3)), qtrain.QtProvider([rule]))
  with pytest.raises(ValueError, match=r"weight_granularity=16 is set, and convolutions take no "
                                       r"tile_size"):
    model.init(jax.random.key(0), jnp.ones((1, 6, 6, 16)))
  # Per-tensor / per-channel granularity is fine on a conv.
  ok = qtrain.quantize_model(nn.Conv(4, (3, 3)), qtrain.QtProvider(
      [qtrain.QtRule(weight_qtype="int8", act_qtype="int8", weight_granularity="per_tensor")]))
  assert ok.apply(ok.init(jax.random.key(0), jnp.ones((1, 6, 6, 16))),
                  jnp.ones((1, 6, 6, 16))).shape == (1, 6, 6, 4)


def test_layer_quants_with_different_channelwise_per_operand_become_one_rule():
  # Used to raise ("one channelwise switch for both operands").
  lq = binary.LayerQuant(weight=cfg_lib.OperandQuant(qtype="int8", channelwise=True),
                         act=cfg_lib.OperandQuant(qtype="int8", channelwise=False))
  (rule,) = lq.to_rules()
  assert (rule.weight_granularity, rule.act_granularity) == ("per_channel", "per_tensor")
  back = binary.LayerQuant.from_rule(rule)
  assert (back.weight, back.act) == (lq.weight, lq.act)


@pytest.mark.slow
def test_bitnet_forward_product_is_int8_times_int8():
  # Ternary codes are integers: the forward product runs on the int8 path (int8 x int8 -> int32,
  # the int8 GEMM on a GPU), not as a float product of dequantized values.
  model = qtrain.quantize_model(nn.Dense(8, use_bias=False),
                                qtrain.QtProvider(binary.rules({".*": "bitnet_b158"})))
  x = jax.random.normal(jax.random.key(0), (4, 16))
  v = model.init(jax.random.key(1), x)
  dots = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "dot_general":
        dots.append(([str(a.aval.dtype) for a in e.invars], str(e.outvars[0].aval.dtype)))
      for p in e.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else [p]):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(lambda x: model.apply(v, x))(x).jaxpr)
  assert dots and all(d == (["int8", "int8"], "int32") for d in dots), dots
