"""quantize_model on flax.nnx: per-instance hooks, transforms, state, RNG, summary."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qtrain
from qtrain import ops
from _testutil import check_static_calibration
from _testutil import rel_error as _rel

DN = (((1,), (0,)), ((), ()))
W8A8 = dict(weight_qtype="int8", act_qtype="int8")
X = jax.random.normal(jax.random.key(0), (8, 32))


def _rules(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


def _cfg(*, a="int8", g=None, sr=None):
  gq = ops.GradQuant(qtype=g, stochastic_rounding=sr) if g else None
  return ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype=a) if a else None,
                                 rhs=ops.OperandQuant(qtype="int8"), dlhs_grad=gq, drhs_grad=gq)



class TestLayers:

  @pytest.mark.slow
  def test_linear_is_core_dot_general_qt(self):
    m = qtrain.quantize_model(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), _rules(**W8A8))
    assert isinstance(m.dot_general, qtrain.QtOp)
    y = nnx.jit(lambda m, x: m(x))(m, X)
    want = ops.dot_general_qt(X, m.kernel[...], DN, _cfg()) + m.bias[...]
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)

  @pytest.mark.slow
  def test_square_linear_on_square_input(self):
    x = jax.random.normal(jax.random.key(2), (64, 64))
    m = qtrain.quantize_model(nnx.Linear(64, 64, use_bias=False, rngs=nnx.Rngs(0)),
                              _rules(**W8A8, bwd_qtype="int8"))
    np.testing.assert_allclose(m(x), ops.dot_general_qt(x, m.kernel[...], DN, _cfg()),
                               rtol=1e-6, atol=1e-6)
    g = nnx.grad(lambda m: m(x).sum())(m)
    assert g.kernel[...].shape == (64, 64)

  @pytest.mark.slow
  @pytest.mark.parametrize("make, x, op", [
      (lambda r: nnx.LinearGeneral((3, 8), (2, 4), axis=(-2, -1), rngs=r), (4, 3, 8), "dot_general"),
      (lambda r: nnx.Conv(3, 4, (3, 3), rngs=r), (2, 6, 6, 3), "conv_general_dilated"),
      (lambda r: nnx.Einsum("btd,hdk->bthk", (2, 8, 4), rngs=r), (2, 3, 8), "einsum"),
  ])
  def test_builtin_layers(self, make, x, op):
    x = jax.random.normal(jax.random.key(4), x)
    p = _rules(**W8A8, bwd_qtype="int8")
    float_m = make(nnx.Rngs(0))
    yf = nnx.jit(lambda m, x: m(x))(float_m, x)
    m = qtrain.quantize_model(make(nnx.Rngs(0)), p)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    assert y.shape == yf.shape and 0 < _rel(y, yf) < 0.05
    assert [(r.op_id, r.status, r.weight_operand) for r in p.records()] == \
        [(f"{op}0", "quantized", "rhs")]
    g = nnx.jit(nnx.grad(lambda m: m(x).sum()))(m)
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree.leaves(nnx.state(g)))

  def test_bf16_linear(self):
    m = qtrain.quantize_model(nnx.Linear(32, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                              _rules(**W8A8, bwd_qtype="int8"))
    y, g = nnx.jit(lambda m: (m(X), nnx.grad(lambda m: m(X).astype(jnp.float32).sum())(m)))(m)
    yf = nnx.jit(lambda m: m(X))(nnx.Linear(32, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert y.dtype == jnp.bfloat16 and g.kernel[...].dtype == jnp.float32
    assert _rel(y.astype(jnp.float32), yf.astype(jnp.float32)) < 0.05

  @pytest.mark.slow
  def test_mha_projections(self):
    x = jax.random.normal(jax.random.key(6), (2, 5, 16))
    p = _rules(**W8A8)
    m = qtrain.quantize_model(
        nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0)), p)
    yf = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0))(x)
    y = m(x)
    assert 0 < _rel(y, yf) < 0.1
    assert {r.path for r in p.records() if r.status == "quantized"} == \
        {"query", "key", "value", "out"}

  @pytest.mark.slow
  def test_user_module_with_hook_attribute_and_direct_call(self):
    class Hooked(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))
        self.dot_general = jax.lax.dot_general

      def __call__(self, x):
        return self.dot_general(x, self.w[...], DN)

    class Raw(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))

      def __call__(self, x):
        return jax.lax.dot_general(x, self.w[...], DN)

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.hooked, self.raw = Hooked(rngs), Raw(rngs)

      def __call__(self, x):
        return self.hooked(x), self.raw(x)

    net = Net(nnx.Rngs(0))
    # A direct call's op is made by the sample forward: without one, the call raises.
    with pytest.warns(UserWarning, match="'raw'.*sample forward.*raises when the model runs"):
      bare = qtrain.quantize_model(nnx.clone(net), _rules(**W8A8))
    with pytest.raises(ValueError, match="dot_general call 'dot_general0' of nnx module 'raw' "
                       r"\(Raw\), which did not run in quantize_model's sample forward"):
      bare(X)
    net = qtrain.quantize_model(net, _rules(**W8A8), X)
    yh, yr = net(X)
    for y, w in ((yh, net.hooked.w), (yr, net.raw.w)):
      np.testing.assert_allclose(y, ops.dot_general_qt(X, w[...], DN, _cfg()), rtol=1e-6,
                                 atol=1e-6)

  @pytest.mark.slow
  def test_rule_without_qtype_and_op_names(self):
    class Two(nnx.Module):
      def __init__(self, rngs):
        self.first = nnx.Linear(32, 8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

      def __call__(self, x):
        return self.head(self.first(x))

    p = qtrain.QtProvider([qtrain.QtRule(module_path="head"),
                           qtrain.QtRule(module_path=".*", op_names=("dot_general",), **W8A8)])
    m = qtrain.quantize_model(Two(nnx.Rngs(0)), p)
    m(X)
    assert isinstance(m.first.dot_general, qtrain.QtOp)
    assert not isinstance(m.head.dot_general, qtrain.QtOp)
    st = {r.path: (r.rule_index, r.status) for r in p.records()}
    assert st == {"first": (1, "quantized"), "head": (0, "float: rule sets no qtype")}

  def test_quantize_twice_is_an_error(self):
    m = qtrain.quantize_model(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), _rules(**W8A8))
    with pytest.raises(ValueError, match="already quantized"):
      qtrain.quantize_model(m, _rules(**W8A8))

  @pytest.mark.slow
  def test_summary_of_nnx_model(self):
    m = qtrain.quantize_model(nnx.Linear(32, 4, rngs=nnx.Rngs(0)), _rules(**W8A8))
    m(X)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      table = qtrain.summary(m)
    assert "dot_general0" in table and "int8" in table


class Block(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(32, 16, rngs=rngs)
    self.b = nnx.Linear(16, 32, rngs=rngs)

  def __call__(self, x):
    return x + self.b(nnx.relu(self.a(x)))


class TestTransforms:

  @pytest.mark.slow
  def test_scan_stacked_layers_equal_unrolled(self):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    stack = make(nnx.Rngs(0))
    stack = qtrain.quantize_model(stack, _rules(**W8A8, bwd_qtype="int8"))

    @nnx.jit
    def fwd(stack, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, blk):
        return blk(x)
      return body(x, stack)

    y = fwd(stack, X)
    h = X
    gdef, state = nnx.split(stack)
    for i in range(3):
      blk = nnx.merge(gdef, jax.tree.map(lambda a: a[i], state))
      h = blk(h)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)
    g = nnx.grad(lambda s: fwd(s, X).sum())(stack)
    assert g.a.kernel[...].shape == (3, 32, 16)

  @pytest.mark.slow
  def test_remat_equal_to_plain(self):
    m = qtrain.quantize_model(Block(nnx.Rngs(0)), _rules(**W8A8, bwd_qtype="int8"))
    plain = nnx.jit(nnx.value_and_grad(lambda m: (m(X) ** 2).mean()))
    remat = nnx.jit(nnx.value_and_grad(lambda m: (nnx.remat(lambda m, x: m(x))(m, X) ** 2).mean()))
    (l1, g1), (l2, g2) = plain(m), remat(m)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    chex.assert_trees_all_close(nnx.state(g1), nnx.state(g2), rtol=1e-5, atol=1e-6)

  @pytest.mark.slow
  def test_vmap_matches_batched(self):
    m = qtrain.quantize_model(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), _rules(**W8A8))
    yb = m(X)
    yv = nnx.vmap(lambda m, x: m(x[None])[0], in_axes=(None, 0))(m, X)
    np.testing.assert_allclose(yv, yb, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  def test_no_retrace_per_step(self):
    m = qtrain.quantize_model(Block(nnx.Rngs(0)), _rules(
        **W8A8, bwd_qtype="int8", bwd_stochastic_rounding="uniform"), rngs=nnx.Rngs(quant=0))
    opt = nnx.Optimizer(m, optax.sgd(0.01), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(m, opt, x):
      traces.append(1)
      loss, g = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
      opt.update(m, g)
      return loss

    for i in range(5):
      step(m, opt, X + i)
    assert len(traces) == 1


class TestState:

  @pytest.mark.slow
  def test_static_scale_calibrate_then_frozen(self):
    rules = _rules(**W8A8, act_static_scale=True)
    with pytest.raises(ValueError, match="sample inputs"):
      qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules)
    m = qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules, X)
    y, want = check_static_calibration(m, m.dot_general, X)
    ref = ops.dot_general_qt(X * 10, m.kernel[...], DN, _cfg(), lhs_scale=jnp.asarray(want))
    np.testing.assert_allclose(y, ref + m.bias[...], rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  @pytest.mark.parametrize("qtype, grad", [("int8", "lsq"), ("binary", "bitorch")])
  def test_learnable_scale_and_shift_train_with_nnx_optimizer(self, qtype, grad):
    m = qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), _rules(
        weight_qtype=qtype, act_qtype=qtype, act_learnable_scale=True, act_scale_grad=grad,
        act_learnable_shift=True), X)
    op = m.dot_general
    assert isinstance(op.act_scale, qtrain.ActScale) and isinstance(op.act_scale, nnx.Param)
    assert op.act_shift[...].shape == (32,)
    qmax = 127 if qtype == "int8" else 1
    np.testing.assert_allclose(op.act_scale[...], 2 * jnp.mean(jnp.abs(X)) / np.sqrt(qmax),
                               rtol=1e-5)
    s0 = float(op.act_scale[...])
    opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
    target = jax.random.normal(jax.random.key(9), (8, 8))

    @nnx.jit
    def step(m, opt):
      loss, g = nnx.value_and_grad(lambda m: ((m(X) - target) ** 2).mean())(m)
      opt.update(m, g)
      return loss

    step(m, opt)
    assert float(op.act_scale[...]) != s0
    assert float(jnp.abs(op.act_shift[...]).sum()) > 0


class TestRng:

  def test_missing_stream_is_a_clear_error(self):
    rules = _rules(**W8A8, bwd_qtype="int8", bwd_stochastic_rounding="uniform")
    with pytest.raises(ValueError, match=r"RNG stream 'quant'.*nnx.Rngs\(quant=seed\)"):
      qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules)
    # nnx semantics: an Rngs without a "quant" stream falls back to its "default" stream.
    m = qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules, rngs=nnx.Rngs(0))
    assert m.dot_general.rng is not None

  @pytest.mark.slow
  def test_deterministic_per_seed_and_different_per_step(self):
    rules = lambda: _rules(**W8A8, bwd_qtype="int8", bwd_stochastic_rounding="uniform")
    grads = []
    for seed in (5, 5, 6):
      m = qtrain.quantize_model(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules(),
                                rngs=nnx.Rngs(quant=seed))
      gfn = nnx.jit(nnx.grad(lambda m: (m(X) ** 2).sum()))
      grads.append((gfn(m).kernel[...], gfn(m).kernel[...]))  # two steps
    (a1, a2), (b1, b2), (c1, _) = grads
    np.testing.assert_array_equal(a1, b1)    # same seed: same first step
    np.testing.assert_array_equal(a2, b2)    # ... and same second step
    assert not np.array_equal(a1, a2)        # the stream advances: steps differ
    assert not np.array_equal(a1, c1)        # another seed differs
