"""nnx modules that call jnp.einsum / jax.lax.dot_general / @ directly: quantized like layers."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import qtrain
from qtrain import lora, ops
from qtrain import qwix
from _testutil import check_static_calibration
from _testutil import rel_error as _rel

DN = (((1,), (0,)), ((), ()))
X = jax.random.normal(jax.random.key(0), (16, 32))
W8A8G8 = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")


def _provider(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


class DirectMLP(nnx.Module):
  """Three products, one per way of writing one: einsum, lax.dot_general, @."""

  def __init__(self, rngs):
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (32, 64)) * 0.2)
    self.w2 = nnx.Param(jax.random.normal(rngs.params(), (64, 48)) * 0.2)
    self.w3 = nnx.Param(jax.random.normal(rngs.params(), (48, 8)) * 0.2)

  def __call__(self, x):
    h = nnx.relu(jnp.einsum("bd,df->bf", x, self.w1[...]))
    h = nnx.relu(jax.lax.dot_general(h, self.w2[...], DN))
    return h @ self.w3


class LinearMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(32, 64, use_bias=False, rngs=rngs)
    self.l2 = nnx.Linear(64, 48, use_bias=False, rngs=rngs)
    self.l3 = nnx.Linear(48, 8, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def _pair(seed=0):
  """A DirectMLP and the LinearMLP with the same weights."""
  d = DirectMLP(nnx.Rngs(seed))
  lin = LinearMLP(nnx.Rngs(seed + 1))
  for layer, w in ((lin.l1, d.w1), (lin.l2, d.w2), (lin.l3, d.w3)):
    layer.kernel[...] = w[...]
  return d, lin


def _loss(m, x):
  return jnp.mean((m(x) - 0.5) ** 2)


class TestSameAsLayers:

  @pytest.mark.slow
  def test_forward_and_gradients_equal_the_linear_model_bit_for_bit(self):
    d, lin = _pair()
    float_y = d(X)
    p = _provider(**W8A8G8)
    qtrain.quantize_model(d, p, X)
    qtrain.quantize_model(lin, _provider(**W8A8G8), X)
    fwd = nnx.jit(lambda m, x: m(x))
    y_d, y_l = fwd(d, X), fwd(lin, X)
    np.testing.assert_array_equal(y_d, y_l)
    assert 0 < _rel(y_d, float_y) < 0.03   # int8 weights and activations, three layers
    grad = nnx.jit(nnx.grad(_loss))
    g_d, g_l = grad(d, X), grad(lin, X)
    for a, b in ((g_d.w1, g_l.l1.kernel), (g_d.w2, g_l.l2.kernel), (g_d.w3, g_l.l3.kernel)):
      assert float(jnp.abs(a[...]).max()) > 0
      np.testing.assert_array_equal(a[...], b[...])
    assert {(r.path, r.op_id, r.status, r.weight_operand) for r in p.records()} == {
        ("", "einsum0", "quantized", "rhs"), ("", "dot_general0", "quantized", "rhs"),
        ("", "dot_general1", "quantized", "rhs")}

  @pytest.mark.slow
  def test_the_variable_itself_as_operand_equals_its_value(self):
    # jnp / lax accept an nnx Variable (its __jax_array__); the weight is found by identity and
    # the op must get the array (the Variable reached the op and its type check failed).
    class ByVariable(DirectMLP):
      def __call__(self, x):
        h = nnx.relu(jnp.einsum("bd,df->bf", x, self.w1))
        h = nnx.relu(jax.lax.dot_general(h, self.w2, DN))
        return h @ self.w3

    d, _ = _pair()
    v = ByVariable(nnx.Rngs(0))
    for name in ("w1", "w2", "w3"):
      getattr(v, name)[...] = getattr(d, name)[...]
    qtrain.quantize_model(d, _provider(**W8A8G8), X)
    p = _provider(**W8A8G8)
    qtrain.quantize_model(v, p, X)
    np.testing.assert_array_equal(nnx.jit(lambda m: m(X))(v), nnx.jit(lambda m: m(X))(d))
    assert [(r.op_id, r.status, r.weight_operand) for r in sorted(p.records(),
            key=lambda r: r.op_id)] == [("dot_general0", "quantized", "rhs"),
                                        ("dot_general1", "quantized", "rhs"),
                                        ("einsum0", "quantized", "rhs")]

  @pytest.mark.slow  # 18 s on two CPU cores
  def test_one_op_per_call_site_in_the_models_state(self):
    d, _ = _pair()
    qtrain.quantize_model(d, _provider(**W8A8G8), X)
    assert [type(getattr(d, n)) for n in ("einsum0", "dot_general0", "dot_general1")] == \
        [qtrain.QtOp] * 3
    clone = nnx.clone(d)
    np.testing.assert_array_equal(clone(X), d(X))
    graphdef, state = nnx.split(d)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(X), d(X))

  @pytest.mark.slow
  def test_weight_first_einsum(self):
    class WeightFirst(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 16)))

      def __call__(self, x):
        return jnp.einsum("df,bd->bf", self.w[...], x)

    p = _provider(weight_qtype="int8", act_qtype="int8")
    m = qtrain.quantize_model(WeightFirst(nnx.Rngs(0)), p, X)
    cfg = ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                 rhs=ops.OperandQuant(qtype="int8"))
    want = ops.dot_general_qt(m.w[...], X, (((0,), (1,)), ((), ())), cfg).T
    np.testing.assert_allclose(m(X), want, rtol=1e-6, atol=1e-6)
    assert [(r.op_id, r.weight_operand) for r in p.records()] == [("einsum0", "lhs")]

  @pytest.mark.slow
  def test_module_with_a_linear_child_and_a_direct_einsum_quantizes_each_once(self):
    class Mixed(nnx.Module):
      def __init__(self, rngs):
        self.proj = nnx.Linear(32, 16, use_bias=False, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 8)))

      def __call__(self, x):
        return jnp.einsum("bd,df->bf", self.proj(x), self.w[...])

    p = _provider(weight_qtype="int8", act_qtype="int8")
    m = qtrain.quantize_model(Mixed(nnx.Rngs(0)), p, X)
    y = nnx.jit(lambda m, x: m(x))(m, X)
    cfg = ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                 rhs=ops.OperandQuant(qtype="int8"))
    h = ops.dot_general_qt(X, m.proj.kernel[...], DN, cfg)
    np.testing.assert_allclose(y, ops.dot_general_qt(h, m.w[...], DN, cfg), rtol=1e-6,
                               atol=1e-6)
    assert sorted((r.path, r.op_id, r.status) for r in p.records()) == [
        ("", "einsum0", "quantized"), ("proj", "dot_general0", "quantized")]
    assert isinstance(m.proj.dot_general, qtrain.QtOp) and isinstance(m.einsum0, qtrain.QtOp)

  @pytest.mark.slow
  def test_flax_attention_inside_a_user_module_keeps_its_own_ops(self):
    class Att(nnx.Module):
      def __init__(self, rngs):
        self.mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 4)))

      def __call__(self, x):
        h = self.mha(x)
        scores = jnp.einsum("bqd,bkd->bqk", h, h)   # two activations: stays float
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), h) @ self.w

    x = jax.random.normal(jax.random.key(2), (2, 5, 16))
    p = _provider(weight_qtype="int8", act_qtype="int8")
    with pytest.warns(UserWarning, match="no operand is one of the module's parameters"):
      m = qtrain.quantize_model(Att(nnx.Rngs(0)), p, x)
    st = sorted((r.path, r.op_id, r.status) for r in p.records())
    assert st == [("", "dot_general0", "quantized"), ("", "einsum0", "float: no weight operand"),
                  ("", "einsum1", "float: no weight operand")] + [
        (f"mha/{n}", "dot_general0", "quantized") for n in ("key", "out", "query", "value")]
    h = m.mha(x)
    scores = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", h, h))
    mixed = jnp.einsum("bqk,bkd->bqd", scores, h)
    cfg = ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                 rhs=ops.OperandQuant(qtype="int8"))
    want = ops.dot_general_qt(mixed, m.w[...], (((2,), (0,)), ((), ())), cfg)
    np.testing.assert_allclose(m(x), want, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  def test_other_methods_and_matmul_forms(self):
    class Enc(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))

      def encode(self, x):   # called by the parent, not through __call__
        return jnp.matmul(x, self.w[...])

    class Parent(nnx.Module):
      def __init__(self, rngs):
        self.enc = Enc(rngs)
        self.v = nnx.Param(jax.random.normal(rngs.params(), (4, 8)))

      def __call__(self, x):
        h = self.enc.encode(x)                 # (16, 8)
        stack = jnp.stack([h.T, h.T])          # (2, 8, 16)
        return self.v @ h.T, self.v @ stack    # one dot_general; a 2-D times a stack: float

    p = _provider(weight_qtype="int8", act_qtype="int8")
    with pytest.warns(UserWarning, match="stays in float \\(float: unsupported form\\)"):
      m = qtrain.quantize_model(Parent(nnx.Rngs(0)), p, X)
    assert sorted((r.path, r.op_id, r.status, r.weight_operand) for r in p.records()) == [
        ("", "dot_general0", "quantized", "lhs"), ("", "dot_general1", "float: unsupported form",
                                                   None),
        ("enc", "dot_general0", "quantized", "rhs")]
    cfg = ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                 rhs=ops.OperandQuant(qtype="int8"))
    h = ops.dot_general_qt(X, m.enc.w[...], DN, cfg)
    y, y_stack = m(X)
    np.testing.assert_allclose(y, ops.dot_general_qt(m.v[...], h.T, DN, cfg), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(y_stack, m.v[...] @ jnp.stack([h.T, h.T]))

  @pytest.mark.slow
  def test_qwix_surface_quantizes_direct_calls_the_same(self):
    d, _ = _pair()
    rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
    qd = qwix.quantize_model(d, qwix.QtProvider([rule]), X)
    ref = qtrain.quantize_model(nnx.clone(d), _provider(weight_qtype="int8", act_qtype="int8"),
                                X)
    assert type(d.w1) is nnx.Param and not hasattr(d, "einsum0")   # qwix copies: d stays float
    np.testing.assert_array_equal(qd(X), ref(X))
    assert not np.array_equal(qd(X), d(X))


class TestTraining:

  @pytest.mark.slow
  def test_optax_steps_under_nnx_jit_reduce_the_loss_without_retracing(self):
    d, _ = _pair()
    qtrain.quantize_model(d, _provider(**W8A8G8), X)
    opt = nnx.Optimizer(d, optax.adam(1e-2), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(m, opt, x):
      traces.append(1)
      loss, g = nnx.value_and_grad(_loss)(m, x)
      opt.update(m, g)
      return loss

    losses = [float(step(d, opt, X)) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0] and len(traces) == 1

  @pytest.mark.slow
  def test_orbax_resume_follows_the_same_trajectory(self, tmp_path):
    provider = _provider(**W8A8G8, bwd_stochastic_rounding="uniform", act_static_scale=True)
    tx = optax.adam(1e-2)

    def fresh():
      m = qtrain.quantize_model(_pair()[0], provider, X, rngs=nnx.Rngs(quant=1))
      return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    @nnx.jit
    def step(m, opt):
      loss, g = nnx.value_and_grad(_loss)(m, X)
      opt.update(m, g)
      return loss

    m, opt = fresh()
    straight = [float(step(m, opt)) for _ in range(6)]
    m, opt = fresh()
    resumed = [float(step(m, opt)) for _ in range(3)]
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "direct", {"model": nnx.state(m), "opt": nnx.state(opt)})
    ckpt.wait_until_finished()
    m, opt = fresh()
    restored = ckpt.restore(tmp_path / "direct", jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"model": nnx.state(m), "opt": nnx.state(opt)}))
    nnx.update(m, restored["model"])
    nnx.update(opt, restored["opt"])
    assert float(m.einsum0.act_static_count[...]) == 3 and int(m.einsum0.rng.count[...]) == 3
    resumed += [float(step(m, opt)) for _ in range(3)]
    assert resumed == straight

  @pytest.mark.slow
  def test_stochastic_rounding_keys_per_op_deterministic_per_seed(self):
    rules = dict(**W8A8G8, bwd_stochastic_rounding="uniform")
    grads = []
    for seed in (5, 5, 6):
      d, _ = _pair()
      qtrain.quantize_model(d, _provider(**rules), X, rngs=nnx.Rngs(quant=seed))
      assert isinstance(d.einsum0.rng, nnx.RngStream)
      gfn = nnx.jit(nnx.grad(_loss))
      grads.append((gfn(d, X).w1[...], gfn(d, X).w1[...]))   # two steps
    (a1, a2), (b1, b2), (c1, _) = grads
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2) and not np.array_equal(a1, c1)
    with pytest.raises(ValueError, match=r"call 'einsum0' .*RNG stream 'quant'.*"
                       r"nnx.Rngs\(quant=seed\)"):
      qtrain.quantize_model(_pair()[0], _provider(**rules), X)

  @pytest.mark.slow
  def test_static_scale_calibrates_then_stops(self):
    d, _ = _pair()
    qtrain.quantize_model(d, _provider(weight_qtype="int8", act_qtype="int8",
                                       act_static_scale=True), X)
    y, want = check_static_calibration(d, d.einsum0, X)
    cfg = ops.DotGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                 rhs=ops.OperandQuant(qtype="int8"))
    h = ops.dot_general_qt(X * 10, d.w1[...], DN, cfg, lhs_scale=jnp.asarray(want))
    h = nnx.relu(h)
    h2 = nnx.relu(ops.dot_general_qt(
        h, d.w2[...], DN, cfg, lhs_scale=d.dot_general0.act_static_scale[...]))
    want_y = ops.dot_general_qt(h2, d.w3[...], DN, cfg,
                                lhs_scale=d.dot_general1.act_static_scale[...])
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  def test_summary_lists_the_direct_calls(self):
    d, _ = _pair()
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # the rule matches ops: only the sample forward shows them
      qtrain.quantize_model(d, _provider(**W8A8G8), X)
      table = qtrain.summary(d)
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["<root>", "dot_general0"], ["<root>", "dot_general1"],
                                     ["<root>", "einsum0"]]
    assert all(r[-1] == "quantized" and r[4:7] == ["int8"] * 3 for r in rows)


class TestStacked:

  @pytest.mark.slow
  def test_vmap_stack_run_by_scan_gets_stacked_state_and_keys(self):
    class Blk(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.2)

      def __call__(self, x):
        return x + nnx.relu(jnp.einsum("bd,df->bf", x, self.w[...]))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Blk(rngs)

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.stack = make(rngs)

      def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, blk):
          return blk(x)
        return body(x, self.stack)

    net = qtrain.quantize_model(Net(nnx.Rngs(0)), _provider(
        **W8A8G8, bwd_stochastic_rounding="uniform", act_static_scale=True), X,
        rngs=nnx.Rngs(quant=1))
    op = net.stack.einsum0
    assert op.act_static_scale[...].shape == (3,) and op.rng.key[...].shape == (3,)
    keys = jax.random.key_data(op.rng.key[...])
    assert len({tuple(np.asarray(k).ravel()) for k in keys}) == 3   # a key per layer
    y = nnx.jit(lambda m, x: m(x))(net, X)
    h = X
    graphdef, state = nnx.split(net.stack)
    for i in range(3):
      h = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))(h)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(op.act_static_count[...], [1.0] * 3)
    g = nnx.jit(nnx.grad(lambda m: m(X).sum()))(net)
    assert g.stack.w[...].shape == (3, 32, 32)


class TestErrors:

  def test_a_call_the_sample_forward_did_not_run_raises(self):
    class TwoPaths(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))
        self.v = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))

      def __call__(self, x, other=False):
        y = jnp.einsum("bd,df->bf", x, self.w[...])
        if other:
          y = y + jax.lax.dot_general(x, self.v[...], DN)
        return y

    m = qtrain.quantize_model(TwoPaths(nnx.Rngs(0)), _provider(weight_qtype="int8"), X)
    m(X)
    with pytest.raises(ValueError, match=r"dot_general call 'dot_general0' of nnx module '' "
                       r"\(TwoPaths\), which did not run in quantize_model's sample forward"):
      m(X, other=True)

  def test_a_call_site_that_changes_its_weight_raises(self):
    class Swap(nnx.Module):
      def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))
        self.v = nnx.Param(jax.random.normal(rngs.params(), (32, 8)))

      def __call__(self, x, flip=False):
        return jnp.einsum("bd,df->bf", x, (self.v if flip else self.w)[...])

    m = qtrain.quantize_model(Swap(nnx.Rngs(0)), _provider(weight_qtype="int8"), X)
    with pytest.raises(ValueError, match="took parameter 'w' as its weight in quantize_model's "
                       "sample forward, and now it takes parameter 'v'"):
      m(X, flip=True)

  def test_lora_rule_on_a_direct_call_raises(self):
    with pytest.raises(ValueError, match=r"lora_rank=4\) matches the einsum call 'einsum0' of "
                       "nnx module ''.*not supported"):
      qtrain.quantize_model(_pair()[0], _provider(weight_qtype="int8", lora_rank=4), X,
                            rngs=nnx.Rngs(params=0))

  @pytest.mark.slow
  def test_lora_merge_leaves_direct_calls_float(self):
    class WithAdapter(nnx.Module):
      def __init__(self, rngs):
        self.lin = nnx.Linear(32, 16, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 4)))

      def __call__(self, x):
        return jnp.einsum("bd,df->bf", self.lin(x), self.w[...])

    float_m = WithAdapter(nnx.Rngs(0))
    p = qtrain.QtProvider([
        qtrain.QtRule(module_path="lin", lora_rank=2),
        qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")])
    m = qtrain.quantize_model(nnx.clone(float_m), p, X, rngs=nnx.Rngs(params=0))
    assert isinstance(m.einsum0, qtrain.QtOp)
    merged = lora.merge(m)
    assert not hasattr(merged, "einsum0") and type(merged) is WithAdapter
    np.testing.assert_allclose(merged(X), float_m(X), rtol=1e-6, atol=1e-6)   # B = 0

  def test_float_instances_of_the_same_class_stay_float(self):
    d, _ = _pair()
    other = nnx.clone(d)
    before = nnx.jit(lambda m, x: m(x))(other, X)
    qtrain.quantize_model(d, _provider(**W8A8G8), X)
    d(X)
    after = nnx.jit(lambda m, x: m(x))(other, X)
    np.testing.assert_array_equal(before, after)
    w1, w2, w3 = (np.asarray(w[...], np.float64) for w in (other.w1, other.w2, other.w3))
    want = np.maximum(np.maximum(np.asarray(X, np.float64) @ w1, 0) @ w2, 0) @ w3
    np.testing.assert_allclose(after, want, rtol=1e-5, atol=1e-5)
