"""quantize_model on flax.linen: layers, weight identification, transforms, state, RNG, summary."""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qtrain
from qtrain import ops
from _testutil import rel_error as _rel

DN = (((1,), (0,)), ((), ()))
W8A8 = dict(weight_qtype="int8", act_qtype="int8")


def _rules(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


def _cfg(weight="rhs", *, w="int8", a="int8", g=None, sr=None, tile=None, scale_grad="lsq"):
  wq = ops.OperandQuant(qtype=w, tile_size=tile) if w else None
  aq = ops.OperandQuant(qtype=a, tile_size=tile, scale_grad=scale_grad) if a else None
  gq = ops.GradQuant(qtype=g, stochastic_rounding=sr) if g else None
  lhs, rhs = (aq, wq) if weight == "rhs" else (wq, aq)
  return ops.DotGeneralQtConfig(lhs=lhs, rhs=rhs, dlhs_grad=gq, drhs_grad=gq)



X = jax.random.normal(jax.random.key(0), (8, 32))


class TestLayers:

  def test_dense_is_core_dot_general_qt(self):
    qm = qtrain.quantize_model(nn.Dense(16), _rules(**W8A8, tile_size=16))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    y = jax.jit(qm.apply)(v, X)
    p = v["params"]
    want = jax.jit(lambda x, k, b: ops.dot_general_qt(x, k, DN, _cfg(tile=16)) + b)(
        X, p["kernel"], p["bias"])
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    yf = nn.Dense(16).apply(v, X)
    assert 0 < _rel(y, yf) < 0.05  # quantized: close to float, not equal

  @pytest.mark.slow
  def test_weight_only_int4_tiles(self):
    qm = qtrain.quantize_model(nn.Dense(16), _rules(weight_qtype="int4", tile_size=8))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    y = qm.apply(v, X)
    p = v["params"]
    want = ops.dot_general_qt(X, p["kernel"], DN, _cfg(a=None, w="int4", tile=8)) + p["bias"]
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)

  @pytest.mark.slow
  def test_square_dense_on_square_input(self):
    # qwix scar #2: Dense(64) on a (64, 64) input. The kernel is known by convention.
    x = jax.random.normal(jax.random.key(2), (64, 64))
    qm = qtrain.quantize_model(nn.Dense(64, use_bias=False), _rules(**W8A8, bwd_qtype="int8"))
    v = jax.jit(qm.init)(jax.random.key(1), x)
    y, g = jax.jit(jax.value_and_grad(lambda p, x: qm.apply({"params": p}, x).sum()))(v["params"], x)
    want = ops.dot_general_qt(x, v["params"]["kernel"], DN, _cfg())
    np.testing.assert_allclose(y, want.sum(), rtol=1e-5)
    assert g["kernel"].shape == (64, 64)

  @pytest.mark.slow
  def test_user_module_weight_by_identity_either_side(self):
    class WeightLeft(nn.Module):
      @nn.compact
      def __call__(self, x):  # x: (K, N) activation, w: (M, K)
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[0], x.shape[0]))
        return jax.lax.dot_general(w, x, DN)

    x = jax.random.normal(jax.random.key(3), (16, 16))
    p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", **W8A8)])
    qm = qtrain.quantize_model(WeightLeft(), p)
    v = jax.jit(qm.init)(jax.random.key(1), x)
    y = qm.apply(v, x)
    want = ops.dot_general_qt(v["params"]["w"], x, DN, _cfg("lhs"))
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert [r.weight_operand for r in p.records()] == ["lhs"]

  def test_user_module_without_parameter_operand_warns_and_stays_float(self):
    class Cast(nn.Module):
      @nn.compact
      def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (32, 4))
        return jax.lax.dot_general(x, w * 2.0, DN)  # not the parameter object itself

    p = _rules(**W8A8)
    qm = qtrain.quantize_model(Cast(), p)
    with pytest.warns(UserWarning, match="no operand is one of the module's parameters"):
      v = jax.jit(qm.init)(jax.random.key(1), X)
    np.testing.assert_array_equal(qm.apply(v, X), Cast().apply(v, X))
    assert [r.status for r in p.records()] == ["float: no weight operand"]

  @pytest.mark.slow
  @pytest.mark.parametrize("make, x, ops", [
      (lambda: nn.DenseGeneral((2, 4), axis=(-2, -1)), jnp.ones((4, 3, 8)), ["dot_general0"]),
      (lambda: nn.Conv(4, (3, 3)), jnp.ones((2, 6, 6, 3)), ["conv_general_dilated0"]),
      (lambda: nn.Einsum((2, 8, 4), "btd,hdk->bthk"), jnp.ones((2, 3, 8)), ["einsum0"]),
  ])
  def test_builtin_layers(self, make, x, ops):
    x = x * jax.random.normal(jax.random.key(4), x.shape)
    p = _rules(**W8A8, bwd_qtype="int8")
    qm = qtrain.quantize_model(make(), p)
    v = jax.jit(qm.init)(jax.random.key(1), x)

    @jax.jit
    def run(v, x):
      return qm.apply(v, x), make().apply(v, x), jax.grad(lambda v: qm.apply(v, x).sum())(v)

    y, yf, g = run(v, x)
    assert y.shape == yf.shape and y.dtype == yf.dtype
    assert 0 < _rel(y, yf) < 0.05
    recs = {r.op_id: r for r in p.records()}
    assert sorted(recs) == ops
    assert all(r.status == "quantized" and r.weight_operand == "rhs" for r in recs.values())
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree.leaves(g))

  @pytest.mark.slow
  def test_conv_is_core_conv_general_qt(self):
    x = jax.random.normal(jax.random.key(5), (2, 6, 6, 3))
    qm = qtrain.quantize_model(nn.Conv(4, (3, 3), use_bias=False), _rules(**W8A8))
    v = jax.jit(qm.init)(jax.random.key(1), x)
    want = ops.conv_general_qt(
        x, v["params"]["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        config=ops.ConvGeneralQtConfig(lhs=ops.OperandQuant(qtype="int8"),
                                        rhs=ops.OperandQuant(qtype="int8")))
    np.testing.assert_allclose(jax.jit(qm.apply)(v, x), want, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  def test_mha_projections_quantized_attention_float(self):
    x = jax.random.normal(jax.random.key(6), (2, 5, 16))
    p = _rules(**W8A8)
    qm = qtrain.quantize_model(nn.MultiHeadDotProductAttention(num_heads=2), p)
    v = jax.jit(qm.init)(jax.random.key(1), x)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # weightless attention einsums are not warned about
      y, yf = jax.jit(lambda v, x: (qm.apply(v, x), nn.MultiHeadDotProductAttention(
          num_heads=2).apply(v, x)))(v, x)
    assert 0 < _rel(y, yf) < 0.1
    st = {(r.path, r.op_id): r.status for r in p.records()}
    for proj in ("query", "key", "value", "out"):
      assert st[(proj, "dot_general0")] == "quantized"
    assert st[("", "einsum0")] == st[("", "einsum1")] == "float: no weight operand"

  @pytest.mark.slow
  def test_rule_without_qtype_keeps_float_and_op_names(self):
    class Two(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.Dense(8, name="first")(x)
        return nn.Einsum((8, 4), "bi,ij->bj", name="head")(h)

    p = qtrain.QtProvider([qtrain.QtRule(module_path="head"),  # keep float
                           qtrain.QtRule(module_path=".*", op_names=("dot_general",), **W8A8)])
    qm = qtrain.quantize_model(Two(), p)
    v = jax.jit(qm.init)(jax.random.key(1), X)
    qm.apply(v, X)
    st = {r.path: (r.rule_index, r.status) for r in p.records()}
    assert st == {"first": (1, "quantized"), "head": (0, "float: rule sets no qtype")}

  @pytest.mark.slow
  def test_bf16_layer_promoted_kernel_copy(self):
    # dtype != param_dtype: the kernel reaching dot_general is a cast copy, not the parameter
    # object; the layer's calling convention still says it is the weight.
    p = _rules(**W8A8, bwd_qtype="int8")
    qm = qtrain.quantize_model(nn.Dense(16, dtype=jnp.bfloat16), p)
    v = jax.jit(qm.init)(jax.random.key(1), X)
    y, g = jax.jit(lambda v: (qm.apply(v, X), jax.grad(lambda v: qm.apply(v, X).astype(
        jnp.float32).sum())(v)))(v)
    yf = nn.Dense(16, dtype=jnp.bfloat16).apply(v, X)
    assert y.dtype == jnp.bfloat16 and g["params"]["kernel"].dtype == jnp.float32
    assert _rel(y.astype(jnp.float32), yf.astype(jnp.float32)) < 0.05
    assert [r.status for r in p.records()] == ["quantized"]

  @pytest.mark.slow
  def test_param_tree_is_the_float_models(self):
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    qm = qtrain.quantize_model(model, _rules(**W8A8))
    assert jax.tree.structure(jax.jit(qm.init)(jax.random.key(0), X)) == \
        jax.tree.structure(jax.jit(model.init)(jax.random.key(0), X))


class _Seq2Seq(nn.Module):
  """A model used through two methods (encode, and __call__ on top of it)."""

  def setup(self):
    self.enc = nn.Dense(16)
    self.dec = nn.Dense(8)

  def encode(self, x):
    return nn.relu(self.enc(x))

  def __call__(self, x):
    return self.dec(self.encode(x))


class TestMethods:

  @pytest.mark.slow
  def test_other_methods_are_quantized_through_apply_and_init(self):
    """``apply(..., method=...)`` with another method of the model (its name, the class's
    function, or a function taking the model) runs it quantized, as ``__call__`` is: the same
    numbers as the QT op applied by hand; ``init`` through that method makes the variables it
    needs; a name the model lacks raises, naming it."""
    qm = qtrain.quantize_model(_Seq2Seq(), _rules(**W8A8))
    v = qm.init(jax.random.key(1), X)
    p = v["params"]["enc"]
    want = jax.nn.relu(ops.dot_general_qt(X, p["kernel"], DN, _cfg()) + p["bias"])
    for method in ("encode", _Seq2Seq.encode, lambda m, x: m.encode(x)):
      got = qm.apply(v, X, method=method)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert 0 < _rel(qm.apply(v, X, method="encode"), _Seq2Seq().apply(v, X, method="encode"))
    v_enc = qm.init(jax.random.key(1), X, method="encode")
    assert set(v_enc["params"]) == {"enc"}
    with pytest.raises(AttributeError, match="method='decode': _Seq2Seq has no such method"):
      qm.apply(v, X, method="decode")


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(16)(x))), None


class TestTransforms:

  @pytest.mark.slow
  def test_vmap_matches_batched(self):
    # Per-row activation scales: a vmapped apply equals the batched apply.
    qm = qtrain.quantize_model(nn.Dense(16), _rules(**W8A8))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    yb = qm.apply(v, X)
    yv = jax.vmap(lambda x: qm.apply(v, x[None])[0])(X)
    np.testing.assert_allclose(yv, yb, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  def test_scan_stacked_layers_equal_unrolled(self):
    class Scanned(nn.Module):
      @nn.compact
      def __call__(self, x):
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)
        return stack(name="blocks")(x, None)[0]

    p = _rules(**W8A8, bwd_qtype="int8")
    qm = qtrain.quantize_model(Scanned(), p)
    v = jax.jit(qm.init)(jax.random.key(1), X)
    assert v["params"]["blocks"]["Dense_1"]["kernel"].shape == (3, 32, 16)
    y = jax.jit(qm.apply)(v, X)
    qb = qtrain.quantize_model(Block(), _rules(**W8A8, bwd_qtype="int8"))
    h = X
    for i in range(3):
      h = qb.apply({"params": jax.tree.map(lambda a: a[i], v["params"]["blocks"])}, h)[0]
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)
    assert {r.path for r in p.records() if r.status == "quantized"} == \
        {"blocks/Dense_0", "blocks/Dense_1"}
    g = jax.jit(jax.grad(lambda v: qm.apply(v, X).sum()))(v)
    assert g["params"]["blocks"]["Dense_1"]["kernel"].shape == (3, 32, 16)

  @pytest.mark.slow
  def test_remat_equal_to_plain(self):
    class User(nn.Module):  # direct lax.dot_general inside a remat-ed module
      @nn.compact
      def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 16))
        return jax.lax.dot_general(x, w, DN)

    class Net(nn.Module):
      remat: bool

      @nn.compact
      def __call__(self, x):
        b = (nn.remat(Block) if self.remat else Block)(name="b")
        u = (nn.remat(User) if self.remat else User)(name="u")
        return u(b(x)[0])

    rules = dict(**W8A8, bwd_qtype="int8")
    q1 = qtrain.quantize_model(Net(remat=True), _rules(**rules))
    p2 = _rules(**rules)
    q2 = qtrain.quantize_model(Net(remat=False), p2)
    v = jax.jit(q2.init)(jax.random.key(1), X)
    loss = lambda q: jax.jit(jax.value_and_grad(lambda v: (q.apply(v, X) ** 2).mean()))(v)
    (l1, g1), (l2, g2) = loss(q1), loss(q2)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-6)
    assert ("u", "dot_general0", "quantized") in {(r.path, r.op_id, r.status) for r in p2.records()}
    assert l1 != (Net(remat=False).apply(v, X) ** 2).mean()

  @pytest.mark.slow
  def test_no_retrace_per_step(self):
    qm = qtrain.quantize_model(nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)]),
                               _rules(**W8A8, bwd_qtype="int8", bwd_stochastic_rounding="uniform"))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    tx = optax.sgd(0.1)
    traces = []

    @jax.jit
    def step(params, opt, x, key):
      traces.append(1)
      loss, g = jax.value_and_grad(
          lambda p: (qm.apply({"params": p}, x, rngs={"quant": key}) ** 2).mean())(params)
      upd, opt = tx.update(g, opt)
      return optax.apply_updates(params, upd), opt, loss

    params, opt = v["params"], tx.init(v["params"])
    for i in range(5):
      params, opt, _ = step(params, opt, X + i, jax.random.key(i))
    assert len(traces) == 1

  def test_chex_max_traces(self):
    qm = qtrain.quantize_model(nn.Dense(4), _rules(**W8A8))
    v = jax.jit(qm.init)(jax.random.key(1), X)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(v, x):
      return qm.apply(v, x)

    for i in range(3):
      f(v, X * i)


class TestState:

  def _static(self, averaging="mean"):
    return qtrain.quantize_model(nn.Dense(8), _rules(
        **W8A8, act_static_scale=True, act_static_scale_averaging=averaging,
        act_static_scale_ema_decay=0.5))

  @pytest.mark.slow
  def test_static_scale_calibrate_then_frozen(self):
    qm = self._static()
    v = jax.jit(qm.init)(jax.random.key(1), X)
    qs = v["quant_stats"]
    assert float(qs["dot_general0_act_static_count"]) == 0.0  # init does not calibrate
    batches = [X * s for s in (1.0, 2.0, 3.0)]
    apply_cal = jax.jit(lambda v, x: qm.apply(v, x, mutable=["quant_stats"]))
    for b in batches:
      _, upd = apply_cal(v, b)
      v = {**v, **upd}
    qs = v["quant_stats"]
    want = np.mean([float(jnp.max(jnp.abs(b))) / 127 for b in batches])
    np.testing.assert_allclose(qs["dot_general0_act_static_scale"], want, rtol=1e-6)
    assert float(qs["dot_general0_act_static_count"]) == 3.0
    # Frozen: no mutable collection -> the stored scale, not this batch's.
    x = X * 10.0
    y = jax.jit(qm.apply)(v, x)
    k, b = v["params"]["kernel"], v["params"]["bias"]
    want_y = ops.dot_general_qt(x, k, DN, _cfg(), lhs_scale=jnp.asarray(want)) + b
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    dyn = ops.dot_general_qt(x, k, DN, _cfg()) + b
    assert not np.allclose(y, dyn)  # clipped by the static scale

  @pytest.mark.slow
  def test_static_scale_ema(self):
    qm = self._static("ema")
    v = jax.jit(qm.init)(jax.random.key(1), X)
    s = []
    for m in (1.0, 3.0):
      _, upd = qm.apply(v, X * m, mutable=["quant_stats"])
      v = {**v, **upd}
      s.append(float(jnp.max(jnp.abs(X * m))) / 127)
    np.testing.assert_allclose(v["quant_stats"]["dot_general0_act_static_scale"],
                               0.5 * s[0] + 0.5 * s[1], rtol=1e-6)

  @pytest.mark.slow  # 6 s on two CPU cores
  def test_frozen_before_calibration_uses_dynamic_scale(self):
    qm = self._static()
    v = jax.jit(qm.init)(jax.random.key(1), X)
    p = v["params"]
    per_tensor = jnp.max(jnp.abs(X)) / 127  # this batch's scale, one per tensor
    want = ops.dot_general_qt(X, p["kernel"], DN, _cfg(), lhs_scale=per_tensor) + p["bias"]
    np.testing.assert_allclose(qm.apply(v, X), want, rtol=1e-5, atol=1e-5)

  @pytest.mark.slow
  @pytest.mark.parametrize("qtype, grad", [("int8", "lsq"), ("binary", "bitorch")])
  def test_learnable_scale_and_shift_are_trained(self, qtype, grad):
    qm = qtrain.quantize_model(nn.Dense(8), _rules(
        weight_qtype=qtype, act_qtype=qtype, act_learnable_scale=True, act_scale_grad=grad,
        act_learnable_shift=True))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    p = v["params"]
    assert p["dot_general0_act_shift"].shape == (32,)
    qmax = 127 if qtype == "int8" else 1
    np.testing.assert_allclose(p["dot_general0_act_scale"],
                               2 * jnp.mean(jnp.abs(X)) / np.sqrt(qmax), rtol=1e-5)
    tx = optax.adam(1e-2)
    opt = tx.init(p)
    target = jax.random.normal(jax.random.key(9), (8, 8))
    loss = lambda p: ((qm.apply({"params": p}, X) - target) ** 2).mean()
    g = jax.grad(loss)(p)
    assert float(jnp.abs(g["dot_general0_act_scale"])) > 0
    assert float(jnp.abs(g["dot_general0_act_shift"]).sum()) > 0
    upd, opt = tx.update(g, opt, p)
    p2 = optax.apply_updates(p, upd)
    assert float(p2["dot_general0_act_scale"]) != float(p["dot_general0_act_scale"])

  @pytest.mark.slow
  def test_learned_scale_is_used(self):
    qm = qtrain.quantize_model(nn.Dense(8, use_bias=False), _rules(**W8A8, act_learnable_scale=True))
    v = jax.jit(qm.init)(jax.random.key(1), X)
    p = dict(v["params"], dot_general0_act_scale=jnp.asarray(0.01))
    want = ops.dot_general_qt(X, p["kernel"], DN, _cfg(), lhs_scale=jnp.asarray(0.01))
    np.testing.assert_allclose(qm.apply({"params": p}, X), want, rtol=1e-5, atol=1e-5)


class TestRng:

  def _model(self):
    qm = qtrain.quantize_model(nn.Dense(8), _rules(**W8A8, bwd_qtype="int8",
                                                   bwd_stochastic_rounding="uniform"))
    return qm, jax.jit(qm.init)(jax.random.key(1), X)  # init needs no "quant" stream

  @pytest.mark.slow
  def test_missing_stream_is_a_clear_error_for_gradients(self):
    qm, v = self._model()
    y = qm.apply(v, X)  # evaluation needs no keys
    np.testing.assert_array_equal(y, qm.apply(v, X, rngs={"quant": jax.random.key(0)}))
    with pytest.raises(ValueError, match=r"RNG stream 'quant'.*rngs=\{'quant': key\}"):
      jax.grad(lambda p: qm.apply({"params": p}, X).sum())(v["params"])

  @pytest.mark.slow
  def test_deterministic_per_key_and_different_per_step(self):
    qm, v = self._model()
    grad = jax.jit(jax.grad(lambda p, k: (qm.apply({"params": p}, X, rngs={"quant": k}) ** 2).sum()))
    g1 = grad(v["params"], jax.random.key(7))
    g2 = grad(v["params"], jax.random.key(7))
    g3 = grad(v["params"], jax.random.fold_in(jax.random.key(7), 1))
    chex.assert_trees_all_equal(g1, g2)
    assert not np.array_equal(g1["kernel"], g3["kernel"])
    # The forward does not depend on the key.
    y1 = qm.apply(v, X, rngs={"quant": jax.random.key(1)})
    y2 = qm.apply(v, X, rngs={"quant": jax.random.key(2)})
    np.testing.assert_array_equal(y1, y2)

  def test_linen_rejects_nnx_only_arguments(self):
    with pytest.raises(ValueError, match="linen"):
      qtrain.quantize_model(nn.Dense(2), _rules(**W8A8), X)
    with pytest.raises(ValueError, match="mutable=\\['quant_stats'\\]"):
      qtrain.set_calibrate(nn.Dense(2), True)
