"""What quantize_model says about mistakes (issue 16.11, 16.13): rules that match nothing,
layers a rule cannot quantize (and no noise about layers without a matmul), a list of rules
passed for a provider, nn.scan without "quant_stats" in its variable_axes or without the
"quant" stream in its split_rngs."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qtrain

X = jax.random.normal(jax.random.key(0), (2, 8))


def _qwarnings(record):
  return [str(w.message) for w in record if str(w.message).startswith("qtrain:")]


class LinenBlocks(nn.Module):
  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(10, 8, name="embed")(ids)
    for i in range(2):
      h = LinenBlock(name=f"block_{i}")(h)
    return h


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(name="norm")(x)
    return x + nn.Dense(8, name="mlp_down")(nn.relu(nn.Dense(16, name="mlp_up")(x)))


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.mlp_up = nnx.Linear(8, 16, rngs=rngs)
    self.mlp_down = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    x = self.bn(self.norm(x), use_running_average=True)
    return x + self.mlp_down(nnx.relu(self.mlp_up(x)))


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(10, 8, rngs=rngs)
    self.block_0 = NnxBlock(rngs)
    self.block_1 = NnxBlock(rngs)

  def __call__(self, ids):
    return self.block_1(self.block_0(self.embed(ids)))


IDS = jnp.arange(6).reshape(2, 3)


class TestUnmatchedRules:

  @pytest.mark.slow
  def test_linen_warns_once_at_first_call_with_near_misses(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path="mlp", weight_qtype="int8"),
                           qtrain.QtRule(module_path=".*", weight_qtype="int8")])
    qm = qtrain.quantize_model(LinenBlocks(), p)
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      v = qm.init(jax.random.key(0), IDS)
      apply = jax.jit(qm.apply)
      apply(v, IDS)
      apply(v, IDS + 1)
    msgs = _qwarnings(rec)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("qtrain: rules[0] (module_path='mlp'") and "matched no op" in msgs[0]
    # The near misses: paths re.search finds 'mlp' in but re.fullmatch does not.
    for path in ("block_0/mlp_up", "block_1/mlp_down"):
      assert repr(path) in msgs[0]
    assert "'.*mlp.*'" in msgs[0]

  @pytest.mark.slow
  def test_nnx_warns_once_at_quantize_model_with_near_misses(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path="mlp_up", weight_qtype="int8"),
                           qtrain.QtRule(module_path=".*", weight_qtype="int8")])
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      m = qtrain.quantize_model(NnxNet(nnx.Rngs(0)), p)
      m(IDS)
    msgs = _qwarnings(rec)
    assert len(msgs) == 1, msgs
    assert "rules[0] (module_path='mlp_up'" in msgs[0] and "matched no op" in msgs[0]
    assert "'block_0/mlp_up'" in msgs[0] and "'block_1/mlp_up'" in msgs[0]
    assert "mlp_down" not in msgs[0]  # not a near miss of 'mlp_up'

  def test_rule_shadowed_or_excluded_by_op_names(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8"),
                           qtrain.QtRule(module_path=".*mlp.*", weight_qtype="int4"),
                           qtrain.QtRule(module_path=".*", op_names=("einsum",), act_qtype="int8")])
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      qtrain.quantize_model(NnxNet(nnx.Rngs(0)), p)
    msgs = _qwarnings(rec)
    assert len(msgs) == 2, msgs
    assert "rules[1]" in msgs[0] and "earlier rules match first on" in msgs[0]
    assert "rules[2]" in msgs[1] and "op_names=('einsum',) excludes" in msgs[1]

  @pytest.mark.slow  # 7 s on two CPU cores
  def test_all_rules_used_no_warning(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path=".*mlp_up", weight_qtype="int8"),
                           qtrain.QtRule(module_path=".*", weight_qtype="int4")])
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      qm = qtrain.quantize_model(LinenBlocks(), p)
      qm.init(jax.random.key(0), IDS)
      qtrain.quantize_model(NnxNet(nnx.Rngs(0)), qtrain.QtProvider(p.rules))(IDS)


class TestNoHookNoise:

  @pytest.mark.slow
  def test_flax_layers_without_a_matmul_are_not_warned_about(self):
    # LayerNorm, BatchNorm, Dropout and Embed have no op to quantize: a '.*' rule is silent.
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      m = qtrain.quantize_model(NnxNet(nnx.Rngs(0)), qtrain.QtProvider(
          [qtrain.QtRule(module_path=".*", weight_qtype="int8")]))
    m(IDS)

  @pytest.mark.slow
  def test_user_modules_aggregated_flax_op_layers_named(self):
    class Raw(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

      def __call__(self, x):
        return x @ self.w[...]

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.raw_a, self.raw_b = Raw(rngs), Raw(rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.up = nnx.ConvTranspose(8, 8, (3,), rngs=rngs)
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      qtrain.quantize_model(Net(nnx.Rngs(0)), qtrain.QtProvider(
          [qtrain.QtRule(module_path=".*", weight_qtype="int8")]))
    msgs = _qwarnings(rec)
    assert len(msgs) == 2, msgs
    user = [m for m in msgs if "raw_a" in m]
    assert len(user) == 1 and "'raw_b' (Raw, rules[0])" in user[0]
    assert "such a call raises when the model runs (pass sample inputs" in user[0]
    conv = [m for m in msgs if "'up'" in m]
    assert len(conv) == 1 and "ConvTranspose" in conv[0] and "stays in float" in conv[0]


class TestProviderArgument:

  @pytest.mark.parametrize("frontend", ["linen", "nnx"])
  def test_list_of_rules_is_a_short_error(self, frontend):
    rules = [qtrain.QtRule(module_path=".*", weight_qtype="int8"),
             qtrain.QtRule(module_path="x", weight_qtype="int4")]
    model = nn.Dense(4) if frontend == "linen" else nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as e:
      qtrain.quantize_model(model, rules)
    assert str(e.value) == ("provider must be a qtrain.QtProvider; got a list of 2 QtRule: pass "
                            "qtrain.QtProvider(rules)")
    with pytest.raises(ValueError, match=r"^provider must be a qtrain.QtProvider; got a QtRule: "
                                         r"pass qtrain.QtProvider\(\[rule\]\)$"):
      qtrain.quantize_model(model, rules[0])
    with pytest.raises(ValueError, match=r"^provider must be a qtrain.QtProvider; got a dict$"):
      qtrain.quantize_model(model, {"rules": rules})

  def test_non_rule_in_provider_is_named_by_type(self):
    with pytest.raises(ValueError, match=r"^rules\[1\] must be a qtrain.QtRule, got a builtins.dict \(qwix's rules go to "
                       r"qtrain.qwix.QtProvider\)$"):
      qtrain.QtProvider([qtrain.QtRule(), {"weight_qtype": "int8" * 100}])


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(8, name="mlp")(x), None


class ScanNet(nn.Module):
  variable_axes: tuple

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(ScanBlock, variable_axes=dict(self.variable_axes),
                    split_rngs={"params": True}, length=3)
    return stack(name="blocks")(x, None)[0]


class TestScanQuantStats:

  @pytest.mark.slow
  def test_missing_quant_stats_axis_names_the_fix(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8",
                                         act_qtype="int8", act_static_scale=True)])
    qm = qtrain.quantize_model(ScanNet(variable_axes=(("params", 0),)), p)
    with pytest.raises(ValueError) as e:
      qm.init(jax.random.key(0), X)
    msg = str(e.value)
    assert msg.startswith("qtrain: rules[0] (module_path='.*') on dot_general in module "
                          "'blocks/mlp'")
    assert ('add "quant_stats" to nn.scan\'s variable_axes (e.g. variable_axes={"params": 0, '
            '"quant_stats": 0})') in msg
    cause = e.value.__cause__
    while cause is not None and type(cause).__name__ != "ScopeCollectionNotFound":
      cause = cause.__cause__
    assert cause is not None  # Flax's own error is chained
    # With the axis, it works: one static scale per layer.
    qm = qtrain.quantize_model(ScanNet(variable_axes=(("params", 0), ("quant_stats", 0))), p)
    v = qm.init(jax.random.key(0), X)
    assert v["quant_stats"]["blocks"]["mlp"]["dot_general0_act_static_scale"].shape == (3,)


class ScanNetRngs(nn.Module):
  split_rngs: tuple

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs=dict(self.split_rngs),
                    length=3)
    return stack(name="blocks")(x, None)[0]


class TestScanRngStream:

  @pytest.mark.slow
  def test_quant_stream_missing_from_split_rngs_names_the_fix(self):
    """nn.scan passes its body only the RNG streams split_rngs names: an apply given
    rngs={'quant': key} must not be told it was not given the stream."""
    p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                                         bwd_qtype="int8", bwd_stochastic_rounding="uniform")])
    qm = qtrain.quantize_model(ScanNetRngs(split_rngs=(("params", True),)), p)
    params = qm.init(jax.random.key(0), X)["params"]
    loss = lambda p, key: qm.apply({"params": p}, X, rngs={"quant": key}).sum()
    with pytest.raises(ValueError) as e:
      jax.grad(loss)(params, jax.random.key(1))
    msg = str(e.value)
    assert "was not given" not in msg, msg
    assert "'scan(blocks)'" in msg
    assert "add 'quant' to split_rngs (e.g. split_rngs={'params': True, 'quant': True}" in msg
    # With the stream split over the layers, the gradient runs and is keyed.
    qm = qtrain.quantize_model(ScanNetRngs(split_rngs=(("params", True), ("quant", True))), p)
    g = jax.jit(jax.grad(loss))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    g1, g1b, g2 = (g(params, k)["blocks"]["mlp"]["kernel"] for k in (k1, k1, k2))
    assert g1.shape == (3, 8, 8) and bool(jnp.isfinite(g1).all())
    assert bool((g1 == g1b).all()) and not bool((g1 == g2).all())


class _Moe(nn.Module):
  """A mixture-of-experts layer: rows grouped by expert, one weight per expert."""

  @nn.compact
  def __call__(self, x, group_sizes):
    w = self.param("experts", nn.initializers.normal(1.0), (3, x.shape[-1], 5))
    return jax.lax.ragged_dot(x, w, group_sizes)


@pytest.mark.slow
def test_ragged_dot_is_quantized_and_a_rule_restricted_to_other_ops_leaves_it_float():
  """A rule that quantizes ragged_dot (issue 20): the op is quantized (recorded, listed by the
  summary, close to the float model); a rule restricted to other ops leaves it float without
  that warning."""
  x = jax.random.normal(jax.random.key(0), (7, 4))
  sizes = jnp.array([2, 0, 5], jnp.int32)
  params = _Moe().init(jax.random.key(1), x, sizes)
  want = _Moe().apply(params, x, sizes)
  provider = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8")])
  qmodel = qtrain.quantize_model(_Moe(), provider)
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    got = qmodel.apply(params, x, sizes)
  assert 0 < float(jnp.abs(got - want).max()) < 0.05 * float(jnp.abs(want).max())
  assert not [m for m in _qwarnings(rec) if "ragged_dot" in m], _qwarnings(rec)
  (r,) = [r for r in provider.records() if r.op_name == "ragged_dot"]
  assert r.status == "quantized" and r.rule_index == 0 and r.weight_operand == "rhs"
  assert "ragged_dot" in qtrain.summary(provider)
  quiet = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8",
                                           op_names=("dot_general", "einsum"))])
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    got = qtrain.quantize_model(_Moe(), quiet).apply(params, x, sizes)
  assert bool(jnp.all(got == want))
  # (The rule quantizes nothing in this model: only the unused-rule warning names the op.)
  assert [m for m in _qwarnings(rec) if "ragged_dot" in m] == [
      "qtrain: rules[0] (module_path='.*', w=int8 a=None g=None) matched no op; "
      "op_names=('dot_general', 'einsum') excludes [' (ragged_dot)']"], _qwarnings(rec)
