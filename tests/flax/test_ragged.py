"""Mixture-of-experts layers: ``jax.lax.ragged_dot`` (and ``ragged_dot_general`` of its form) in a
linen or nnx module is a quantized ``ragged_dot`` op of the module; and ``jax.lax.dot``,
``jnp.vdot`` and ``x.dot(w)`` in a user's module, each a dot_general op like ``jnp.dot``."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qtrain
from qtrain import freeze
from qtrain.ops import config as C
from qtrain.ops.ragged_dot_qt import ragged_dot_qt

E, D, H = 4, 16, 32           # experts, model width, expert width
RULE = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
            bwd_stochastic_rounding="uniform")


def _provider(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


def _qwarnings(rec):
  return [str(w.message) for w in rec if str(w.message).startswith("qtrain")]


def _route(x, logits):
  """Top-1 routing: rows sorted by expert, the group sizes, and the order to undo it."""
  expert = jnp.argmax(logits, axis=-1)
  order = jnp.argsort(expert)
  sizes = jnp.bincount(expert, length=logits.shape[-1]).astype(jnp.int32)
  gate = jax.nn.softmax(logits)[jnp.arange(x.shape[0]), expert][:, None]
  return x[order], sizes, order, gate


class LinenMoe(nn.Module):
  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(E, name="router")(x)
    xs, sizes, order, gate = _route(x, logits)
    up = self.param("up", nn.initializers.lecun_normal(batch_axis=(0,)), (E, D, H))
    down = self.param("down", nn.initializers.lecun_normal(batch_axis=(0,)), (E, H, D))
    h = nn.gelu(jax.lax.ragged_dot(xs, up, sizes))
    y = jax.lax.ragged_dot(h, down, sizes)
    return x + gate * jnp.zeros_like(y).at[order].set(y)


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="embed")(x)
    x = LinenMoe(name="moe")(x)
    return nn.Dense(1, name="head")(x)[:, 0]


def _data(n=64, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (n, 8))
  y = jnp.sin(x[:, 0] * 2) + x[:, 1] * x[:, 2]
  return x, y


def _train_linen(model, params, steps, rngs=True):
  x, y = _data()
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    def loss_fn(p):
      out = model.apply({"params": p}, x, rngs={"quant": key} if rngs else None)
      return jnp.mean((out - y) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, loss
  losses = []
  for i in range(steps):
    params, state, loss = step(params, state, jax.random.key(100 + i))
    losses.append(float(loss))
  return losses


class TestLinen:

  @pytest.mark.slow
  def test_moe_trains_quantized_close_to_float(self):
    x, _ = _data()
    params = LinenNet().init(jax.random.key(1), x)["params"]
    p = _provider(**RULE)
    qm = qtrain.quantize_model(LinenNet(), p)
    assert jax.tree.map(jnp.shape, qm.init(jax.random.key(1), x)["params"]) == \
        jax.tree.map(jnp.shape, params)
    recs = {(r.path, r.op_id): r for r in p.records()}
    for op_id in ("ragged_dot0", "ragged_dot1"):
      r = recs[("moe", op_id)]
      assert (r.op_name, r.status, r.weight_operand, r.weight_qtype, r.bwd_qtype) == \
          ("ragged_dot", "quantized", "rhs", "int8", "int8")
    assert "moe          ragged_dot1   0     rhs     int8     int8     int8     quantized" in \
        qtrain.summary(qm)
    y_f = LinenNet().apply({"params": params}, x)
    y_q = qm.apply({"params": params}, x)
    assert 0 < float(jnp.abs(y_q - y_f).max()) < 0.05 * float(jnp.abs(y_f).max())
    lf = _train_linen(LinenNet(), params, 30, rngs=False)
    lq = _train_linen(qm, params, 30)
    assert lq[-1] < 0.6 * lq[0]
    assert abs(lq[-1] - lf[-1]) < 0.15 * lf[-1] + 0.02, (lq[-1], lf[-1])

  @pytest.mark.slow
  def test_op_names_and_the_float_model_untouched(self):
    class Small(nn.Module):
      @nn.compact
      def __call__(self, x, sizes):
        w = self.param("w", nn.initializers.normal(1.0), (2, D, 4))
        return jax.lax.ragged_dot(nn.Dense(D, name="proj")(x), w, sizes)
    x = jax.random.normal(jax.random.key(0), (6, 8))
    sizes = jnp.array([2, 4], jnp.int32)
    params = Small().init(jax.random.key(1), x, sizes)
    want = Small().apply(params, x, sizes)
    only = _provider(op_names=("ragged_dot",), weight_qtype="int8")
    qtrain.quantize_model(Small(), only).apply(params, x, sizes)
    assert {(r.op_name, r.status) for r in only.records()} == {
        ("ragged_dot", "quantized"), ("dot_general", "float: no rule matched")}
    quiet = _provider(op_names=("dot_general",), weight_qtype="int8")
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      qtrain.quantize_model(Small(), quiet).apply(params, x, sizes)
    assert not [m for m in _qwarnings(rec) if "ragged_dot" in m]
    assert {(r.op_name, r.status) for r in quiet.records()} == {
        ("ragged_dot", "float: no rule matched"), ("dot_general", "quantized")}
    # A float model run after is the float model; the public names are JAX's again.
    np.testing.assert_array_equal(Small().apply(params, x, sizes), want)
    assert jax.lax.ragged_dot.__name__ == "ragged_dot"

  @pytest.mark.slow
  def test_ragged_dot_general_of_the_same_meaning_is_quantized(self):
    """rhs stored (G, N, K): ragged_dot_general with rhs contracting axis 2 is the op on the
    transposed weight, bit for bit; a ragged contraction (another meaning) stays float,
    recorded as an unsupported form, with a warning."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    contraction = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])

    class Gen(nn.Module):
      @nn.compact
      def __call__(self, x, sizes):
        w = self.param("w", nn.initializers.normal(1.0), (3, 5, x.shape[-1]))   # (G, N, K)
        y = jax.lax.ragged_dot_general(x, w, sizes, dims)
        v = self.param("v", nn.initializers.normal(1.0), (x.shape[0], 2))
        z = jax.lax.ragged_dot_general(x, v, sizes, contraction)            # (G, K, 2)
        return y, z
    x = jax.random.normal(jax.random.key(0), (9, 16))
    sizes = jnp.array([4, 0, 5], jnp.int32)
    params = Gen().init(jax.random.key(1), x, sizes)
    p = _provider(weight_qtype="int8", act_qtype="int8")
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      y, z = qtrain.quantize_model(Gen(), p).apply(params, x, sizes)
    cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"))
    np.testing.assert_array_equal(
        y, ragged_dot_qt(x, jnp.transpose(params["params"]["w"], (0, 2, 1)), sizes, cfg))
    np.testing.assert_array_equal(z, Gen().apply(params, x, sizes)[1])
    assert [(r.op_id, r.status) for r in p.records()] == [
        ("ragged_dot0", "quantized"), ("ragged_dot1", "float: unsupported form")]
    assert any("ragged_dot in module ''" in m and "unsupported form" in m
               for m in _qwarnings(rec)), _qwarnings(rec)

  @pytest.mark.slow
  def test_unsupported_rules_raise_naming_the_rule_and_what_is_valid(self):
    x, _ = _data(16)
    with pytest.raises(ValueError, match=r"rules\[0\].*lora_rank=4.*ragged_dot in module "
                       r"'moe'.*op_names=\('dot_general', 'einsum'\)"):
      qtrain.quantize_model(LinenNet(), _provider(lora_rank=4)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"rules\[0\] \(module_path='\.\*'\) on ragged_dot in "
                       r"module 'moe': config.implementation='triton'.*valid: \['auto', 'xla'\]"):
      qtrain.quantize_model(LinenNet(), _provider(weight_qtype="int8", implementation="triton",
                                                  op_names=("ragged_dot",))
                            ).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"ragged_dot in module 'moe'.*tile_size=24 does not "
                       r"divide the contraction K=16"):
      qtrain.quantize_model(LinenNet(), _provider(
          weight_qtype="int8", tile_size=24, op_names=("ragged_dot",))).init(jax.random.key(0), x)

  @pytest.mark.slow
  def test_freeze_raises_naming_the_op(self):
    x, _ = _data(16)
    p = _provider(weight_qtype="int8", op_names=("ragged_dot",))
    qm = qtrain.quantize_model(LinenNet(), p)
    variables = jax.eval_shape(qm.init, jax.random.key(0), x)
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
    with pytest.raises(ValueError, match=r"freeze: .*moe.*quantized ragged_dot.*op_names="
                       r"\('ragged_dot',\)"):
      freeze.freeze(variables, p)

  @pytest.mark.slow
  def test_no_weight_operand_stays_float_with_a_warning(self):
    class TwoActs(nn.Module):
      @nn.compact
      def __call__(self, x, sizes):
        w = self.param("w", nn.initializers.normal(1.0), (2, x.shape[-1], 3))
        return jax.lax.ragged_dot(x, w * 2.0, sizes)     # a computed weight: no parameter
    x = jax.random.normal(jax.random.key(0), (5, 8))
    sizes = jnp.array([2, 3], jnp.int32)
    params = TwoActs().init(jax.random.key(1), x, sizes)
    p = _provider(weight_qtype="int8")
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      got = qtrain.quantize_model(TwoActs(), p).apply(params, x, sizes)
    np.testing.assert_array_equal(got, TwoActs().apply(params, x, sizes))
    assert [r.status for r in p.records()] == ["float: no weight operand"]
    assert any("no operand is one of the module's parameters" in m for m in _qwarnings(rec))


class NnxMoe(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(8, D, rngs=rngs)
    self.router = nnx.Linear(D, E, rngs=rngs)
    init = nnx.initializers.lecun_normal(batch_axis=(0,))
    self.up = nnx.Param(init(rngs.params(), (E, D, H)))
    self.down = nnx.Param(init(rngs.params(), (E, H, D)))
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    xs, sizes, order, gate = _route(x, self.router(x))
    h = nnx.gelu(jax.lax.ragged_dot(xs, self.up[...], sizes))
    y = jax.lax.ragged_dot(h, self.down[...], sizes)
    x = x + gate * jnp.zeros_like(y).at[order].set(y)
    return self.head(x)[:, 0]


def _train_nnx(model, steps):
  x, y = _data()
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, g)
    return loss
  return [float(step(model, opt)) for _ in range(steps)]


class TestNnx:

  @pytest.mark.slow
  def test_moe_trains_quantized_close_to_float(self):
    x, _ = _data()
    model = NnxMoe(nnx.Rngs(0))
    float_model = nnx.clone(model)
    y_f = float_model(x)
    p = _provider(**RULE)
    qtrain.quantize_model(model, p, x, rngs=nnx.Rngs(quant=1))
    assert isinstance(model.ragged_dot0, qtrain.QtOp) and isinstance(model.ragged_dot1,
                                                                     qtrain.QtOp)
    assert [(r.op_id, r.status, r.weight_operand) for r in p.records()
            if r.op_name == "ragged_dot"] == [("ragged_dot0", "quantized", "rhs"),
                                               ("ragged_dot1", "quantized", "rhs")]
    y_q = nnx.jit(lambda m: m(x))(model)
    assert 0 < float(jnp.abs(y_q - y_f).max()) < 0.05 * float(jnp.abs(y_f).max())
    lf = _train_nnx(float_model, 30)
    lq = _train_nnx(model, 30)
    assert lq[-1] < 0.6 * lq[0]
    assert abs(lq[-1] - lf[-1]) < 0.15 * lf[-1] + 0.02, (lq[-1], lf[-1])
    with pytest.raises(ValueError, match="ragged_dot"):
      freeze.freeze(model)


  @pytest.mark.slow
  def test_a_ragged_dot_rule_without_sample_inputs_warns(self):
    # quantize_model cannot see a user module's direct calls without a sample forward: a rule
    # for ragged_dot alone must warn as one for the other ops does (such a call raises later).
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      qtrain.quantize_model(NnxMoe(nnx.Rngs(0)), qtrain.QtProvider(
          [qtrain.QtRule(module_path=".*", op_names=("ragged_dot",), weight_qtype="int8")]))
    msgs = [str(w.message) for w in rec if "pass sample inputs" in str(w.message)]
    assert len(msgs) == 1 and "ragged_dot" in msgs[0] and "rules[0]" in msgs[0], msgs


def test_static_minmax_activation_scales_raise_on_ragged_dot():
  # ragged_dot_qt takes a symmetric given scale only: a (scale, zero point) pair must not reach it.
  class Moe(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.lecun_normal(), (2, 8, 4))
      return jax.lax.ragged_dot(x, w, jnp.array([10, 6], jnp.int32))

  q = qtrain.quantize_model(Moe(), qtrain.QtProvider([qtrain.QtRule(
      module_path=".*", weight_qtype="int8", act_qtype="int8", act_static_scale=True,
      act_calibration_method="minmax")]))
  with pytest.raises(NotImplementedError, match=r"rules\[0\].*'minmax'.*ragged_dot.*'absmax'"):
    q.init(jax.random.key(1), jax.random.normal(jax.random.key(0), (16, 8)))
