"""The matmul family (``x @ w``, ``jnp.matmul``, ``jnp.dot``, ``jnp.tensordot``, ``jnp.inner``,
``jax.lax.dot``, ``x.dot(w)``, ``jnp.vdot`` of vectors) in
a user's linen or nnx module: each call one dot_general op of the module, quantized bit for bit
as the Flax layer that computes the same product; Flax's own layers' calls pass through."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import freeze, lora
from _testutil import rel_error as _rel

X = jax.random.normal(jax.random.key(0), (6, 16))
RULE = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
            bwd_stochastic_rounding="uniform", implementation="xla")
# nnx: round to nearest (a layer's op draws stochastic-rounding keys in quantize_model's sample
# forward, a direct call's op gets its stream after it, so the two streams are at other counts).
NNX_RULE = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8", implementation="xla")
DN = (((1,), (0,)), ((), ()))


def _provider(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


def _qwarnings(rec):
  return [str(w.message) for w in rec if str(w.message).startswith("qtrain")]


# Each form computes x (6, 16) times the (16, 8) parameter "kernel"; "inner" takes it transposed
# ((8, 16): jnp.inner contracts the last axes of both).
FORMS = {
    "@": lambda x, w: x @ w,
    "matmul": lambda x, w: jnp.matmul(x, w),
    "dot": lambda x, w: jnp.dot(x, w),
    "tensordot": lambda x, w: jnp.tensordot(x, w, axes=1),
    "tensordot_pairs": lambda x, w: jnp.tensordot(x, w, axes=([1], [0])),
    "inner": lambda x, w: jnp.inner(x, w),
    "inner_reference": lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))),
    "lax.dot": lambda x, w: jax.lax.dot(x, w),
    "lax.dot_dimension_numbers": lambda x, w: jax.lax.dot(x, w, dimension_numbers=DN),
    "x.dot": lambda x, w: x.dot(w),
}


class LinenProduct(nn.Module):
  form: str

  @nn.compact
  def __call__(self, x):
    shape = (8, 16) if self.form.startswith("inner") else (16, 8)
    w = self.param("kernel", nn.initializers.lecun_normal(), shape)
    return FORMS[self.form](x, w)


class LinenModel(nn.Module):
  """A product named ``proj`` between two float layers: ``nn.Dense`` or a LinenProduct."""
  form: str

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(x)
    if self.form == "dense":
      h = nn.Dense(8, use_bias=False, name="proj")(x)
    else:
      h = LinenProduct(self.form, name="proj")(x)
    return jnp.sum(h ** 2, axis=-1)


def _value_and_grads(model, params, x, key):
  fn = lambda p, x: jnp.mean(model.apply({"params": p}, x, rngs={"quant": key}))
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(params, x)


class TestLinen:

  @pytest.mark.slow
  @pytest.mark.parametrize("form", sorted(set(FORMS) - {"inner", "inner_reference"}))
  def test_forward_and_gradients_equal_dense_bit_for_bit(self, form):
    dense = qtrain.quantize_model(LinenModel("dense"), _provider(**RULE))
    params = dense.init(jax.random.key(1), X)["params"]
    p = _provider(**RULE)
    qm = qtrain.quantize_model(LinenModel(form), p)
    assert jax.tree.map(jnp.shape, qm.init(jax.random.key(1), X)["params"]) == \
        jax.tree.map(jnp.shape, params)
    key = jax.random.key(2)
    (y, (g_p, g_x)), (y_ref, (g_p_ref, g_x_ref)) = (
        _value_and_grads(qm, params, X, key), _value_and_grads(dense, params, X, key))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(g_p["proj"]["kernel"], g_p_ref["proj"]["kernel"])
    np.testing.assert_array_equal(g_x, g_x_ref)
    assert float(jnp.abs(g_p["proj"]["kernel"]).max()) > 0
    # Quantized, not float: the float model gives other numbers.
    y_float = jnp.mean(LinenModel("dense").apply({"params": params}, X))
    assert y != y_float and abs(float(y - y_float)) < 0.05 * abs(float(y_float))
    assert [(r.path, r.op_id, r.status, r.weight_operand, r.weight_qtype)
            for r in p.records()] == [("proj", "dot_general0", "quantized", "rhs", "int8")]
    assert "proj         dot_general0  0     rhs     int8     int8     int8     quantized" in \
        qtrain.summary(qm)

  @pytest.mark.slow
  def test_inner_equals_the_direct_dot_general_bit_for_bit(self):
    ref = qtrain.quantize_model(LinenModel("inner_reference"), _provider(**RULE))
    params = ref.init(jax.random.key(1), X)["params"]
    p = _provider(**RULE)
    qm = qtrain.quantize_model(LinenModel("inner"), p)
    qm.init(jax.random.key(1), X)
    key = jax.random.key(2)
    y, (g_p, g_x) = _value_and_grads(qm, params, X, key)
    y_ref, (g_p_ref, g_x_ref) = _value_and_grads(ref, params, X, key)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(g_p["proj"]["kernel"], g_p_ref["proj"]["kernel"])
    np.testing.assert_array_equal(g_x, g_x_ref)
    assert [(r.op_id, r.status, r.weight_operand) for r in p.records()] == [
        ("dot_general0", "quantized", "rhs")]

  @pytest.mark.slow
  def test_weight_on_the_left_and_batched_matmul(self):
    class Forms(nn.Module):
      @nn.compact
      def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (5, 16))
        s = self.param("s", nn.initializers.normal(1.0), (3, 16, 4))
        return w @ x.T, jnp.matmul(jnp.stack([x] * 3), s)   # (5, 6); (3, 6, 16) x (3, 16, 4)

    p = _provider(weight_qtype="int8", act_qtype="int8")
    qm = qtrain.quantize_model(Forms(), p)
    v = qm.init(jax.random.key(0), X)
    left, batched = qm.apply(v, X)
    w, s = v["params"]["w"], v["params"]["s"]
    cfg = qtrain.ops.DotGeneralQtConfig(lhs=qtrain.ops.OperandQuant(qtype="int8"),
                                        rhs=qtrain.ops.OperandQuant(qtype="int8"))
    np.testing.assert_array_equal(left, qtrain.ops.dot_general_qt(w, X.T, DN, cfg))
    xs = jnp.stack([X] * 3)
    np.testing.assert_array_equal(
        batched, qtrain.ops.dot_general_qt(xs, s, (((2,), (1,)), ((0,), (0,))), cfg))
    assert [(r.op_id, r.status, r.weight_operand) for r in p.records()] == [
        ("dot_general0", "quantized", "lhs"), ("dot_general1", "quantized", "rhs")]

  def test_no_weight_operand_stays_float_with_a_warning(self):
    class Attention(nn.Module):
      @nn.compact
      def __call__(self, x):
        w = self.param("kernel", nn.initializers.normal(1.0), (16, 16))
        return (x @ w.astype(jnp.bfloat16).astype(jnp.float32)) @ x.T   # a cast weight; two acts

    p = _provider(weight_qtype="int8", act_qtype="int8")
    qm = qtrain.quantize_model(Attention(), p)
    with pytest.warns(UserWarning, match=r"dot_general in module '' matches rules\[0\] but no "
                                         r"operand is one of the module's parameters"):
      v = qm.init(jax.random.key(0), X)
    w = v["params"]["kernel"].astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(qm.apply(v, X), (X @ w) @ X.T)
    assert [(r.op_id, r.status) for r in p.records()] == [
        ("dot_general0", "float: no weight operand"), ("dot_general1", "float: no weight operand")]

  @pytest.mark.slow
  def test_flax_layers_matmuls_pass_through(self):
    """nn.Embed.attend computes jnp.dot itself: its frame passes the call (no op recorded),
    exactly float; the Dense beside it is quantized as before."""

    class Tied(nn.Module):
      @nn.compact
      def __call__(self, ids):
        emb = nn.Embed(32, 16, name="emb")
        return emb.attend(nn.Dense(16, name="mid")(emb(ids)))

    ids = jnp.arange(6) % 32
    p = _provider(weight_qtype="int8", act_qtype="int8")
    qm = qtrain.quantize_model(Tied(), p)
    v = qm.init(jax.random.key(0), ids)
    out = qm.apply(v, ids)
    assert [(r.path, r.op_id, r.status) for r in p.records()] == [
        ("mid", "dot_general0", "quantized")]
    # The same numbers as the attend in float after the quantized Dense.
    mid = qtrain.quantize_model(nn.Dense(16), _provider(weight_qtype="int8", act_qtype="int8"))
    table = v["params"]["emb"]["embedding"]
    hidden = mid.apply({"params": v["params"]["mid"]}, table[ids])
    np.testing.assert_array_equal(out, jnp.dot(hidden, table.T))

  @pytest.mark.slow
  def test_lifted_user_module_is_the_users(self):
    """nn.remat(UserModule) is a class Flax derives from the user's: its matmuls are caught."""
    p = _provider(**RULE)
    qm = qtrain.quantize_model(nn.remat(LinenProduct)("@"), p)
    ref = qtrain.quantize_model(LinenProduct("@"), _provider(**RULE))
    v = qm.init(jax.random.key(0), X)
    np.testing.assert_array_equal(qm.apply(v, X, rngs={"quant": jax.random.key(1)}),
                                  ref.apply(v, X, rngs={"quant": jax.random.key(1)}))
    assert [(r.op_id, r.status) for r in p.records()] == [("dot_general0", "quantized")]

  def test_rule_without_qtype_keeps_the_exact_float_call(self):
    p = qtrain.QtProvider([qtrain.QtRule(module_path="proj"), qtrain.QtRule(weight_qtype="int8")])
    for form in ("@", "dot", "matmul", "tensordot"):
      qm = qtrain.quantize_model(LinenModel(form), p)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # rules[1] matches no op
        v = qm.init(jax.random.key(0), X)
      np.testing.assert_array_equal(qm.apply(v, X), LinenModel(form).apply(v, X))

  @pytest.mark.slow
  def test_freeze_runs_the_frozen_weight_bit_for_bit(self):
    p = _provider(weight_qtype="int8", act_qtype="int8", implementation="xla")
    qm = qtrain.quantize_model(LinenModel("dot"), p)
    v = qm.init(jax.random.key(0), X)
    y_qt = qm.apply(v, X)
    frozen = freeze.freeze(v, p)
    assert [(k, layer.op_id) for k, layer in frozen["layers"].items()] == [
        ("proj", "dot_general0")]
    np.testing.assert_array_equal(
        freeze.apply_frozen(LinenModel("dot"), frozen, X, implementation="xla"), y_qt)

  def test_lora_adapters_and_merge(self):
    p = _provider(lora_rank=2, lora_alpha=4.0)
    qm = qtrain.quantize_model(LinenModel("@"), p)
    params = qm.init(jax.random.key(0), X)["params"]
    assert set(params["proj"]) == {"kernel", "dot_general0_lora_a", "dot_general0_lora_b"}
    params["proj"]["dot_general0_lora_b"] = jax.random.normal(jax.random.key(3), (2, 8))
    merged = lora.merge({"params": params}, p)
    assert set(merged["params"]["proj"]) == {"kernel"}
    np.testing.assert_allclose(LinenModel("@").apply(merged, X), qm.apply({"params": params}, X),
                               rtol=1e-5, atol=1e-5)


class NnxProduct(nnx.Module):
  def __init__(self, form, rngs):
    self.form = form
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 16) if form == "inner" else (16, 8)))

  def __call__(self, x):
    return FORMS[self.form](nnx.tanh(x), self.w[...] if self.form != "dot" else self.w)


class TestNnx:

  @pytest.mark.slow
  @pytest.mark.parametrize("form", ["dot", "tensordot", "tensordot_pairs", "matmul", "lax.dot",
                                    "x.dot"])
  def test_forward_and_gradients_equal_linear_bit_for_bit(self, form):
    m = NnxProduct(form, nnx.Rngs(0))
    lin = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(1))
    lin.kernel[...] = m.w[...]
    float_y = m(X)
    p = _provider(**NNX_RULE)
    qtrain.quantize_model(m, p, X)
    qtrain.quantize_model(lin, _provider(**NNX_RULE), X)
    loss = lambda mod, x: jnp.mean(mod(x) ** 2)
    grad = nnx.jit(nnx.value_and_grad(loss))
    y, g = grad(m, X)
    y_lin, g_lin = nnx.jit(nnx.value_and_grad(lambda mod, x: loss(mod, nnx.tanh(x))))(lin, X)
    np.testing.assert_array_equal(y, y_lin)
    np.testing.assert_array_equal(g.w[...], g_lin.kernel[...])
    assert float(jnp.abs(g.w[...]).max()) > 0
    assert 0 < _rel(nnx.jit(lambda mod, x: mod(x))(m, X), float_y) < 0.03
    assert [(r.op_id, r.status, r.weight_operand) for r in p.records()] == [
        ("dot_general0", "quantized", "rhs")]
    assert isinstance(m.dot_general0, qtrain.QtOp)

  @pytest.mark.slow
  def test_inner(self):
    m = NnxProduct("inner", nnx.Rngs(0))
    p = _provider(weight_qtype="int8", act_qtype="int8")
    qtrain.quantize_model(m, p, X)
    cfg = qtrain.ops.DotGeneralQtConfig(lhs=qtrain.ops.OperandQuant(qtype="int8"),
                                        rhs=qtrain.ops.OperandQuant(qtype="int8"))
    np.testing.assert_array_equal(
        m(X), qtrain.ops.dot_general_qt(nnx.tanh(X), m.w[...], (((1,), (1,)), ((), ())), cfg))
    assert [(r.op_id, r.status) for r in p.records()] == [("dot_general0", "quantized")]

  def test_scalar_product_stays_float_and_is_named(self):
    class Scaled(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 8)))

      def __call__(self, x):
        return jnp.dot(x, self.w) * jnp.dot(2.0, self.w[...]).sum()

    p = _provider(weight_qtype="int8")
    m = Scaled(nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"dot_general in module '' matches rules\[0\] but stays "
                                         r"in float \(float: unsupported form\)"):
      qtrain.quantize_model(m, p, X)
    assert [(r.op_id, r.status) for r in p.records()] == [
        ("dot_general0", "quantized"), ("dot_general1", "float: unsupported form")]


def test_the_float_forms_are_jaxs_own_again_after_a_call():
  qm = qtrain.quantize_model(LinenModel("x.dot"), _provider(**RULE))
  qm.apply(qm.init(jax.random.key(1), X), X, rngs={"quant": jax.random.key(2)})
  assert jax.lax.dot.__name__ == "dot" and "_dispatch" not in type(X).dot.__name__


@pytest.mark.slow
def test_vdot_of_vectors_is_jnp_dot_and_other_ranks_stay_float():
  class Vdot(nn.Module):
    @nn.compact
    def __call__(self, x):
      v = self.param("v", nn.initializers.normal(1.0), (16,))
      w = self.param("w", nn.initializers.normal(1.0), (6, 16))
      return jnp.vdot(x[0], v), jnp.dot(x[0], v), jnp.vdot(x, w)

  params = Vdot().init(jax.random.key(1), X)
  p = _provider(weight_qtype="int8", act_qtype="int8")
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    a, b, c = qtrain.quantize_model(Vdot(), p).apply(params, X)
  np.testing.assert_array_equal(a, b)                  # the quantized 1-D jnp.dot
  assert a != Vdot().apply(params, X)[0]
  np.testing.assert_array_equal(c, Vdot().apply(params, X)[2])
  assert [(r.op_id, r.status) for r in p.records()] == [
      ("dot_general0", "quantized"), ("dot_general1", "quantized"),
      ("dot_general2", "float: unsupported form")]
  assert any("dot_general in module ''" in m and "unsupported form" in m
             for m in _qwarnings(rec)), _qwarnings(rec)
