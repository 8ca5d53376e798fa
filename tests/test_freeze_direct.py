"""freeze / qwix PTQ of nnx modules that call jnp.einsum / jax.lax.dot_general / @ themselves
(direct calls): each quantized call frozen under its op id, the products the QT forward's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import freeze, qwix
from qtrain.flax import model as model_lib

DN = (((1,), (0,)), ((), ()))
X = jax.random.normal(jax.random.key(0), (8, 16))
W8A8 = dict(weight_qtype="int8", act_qtype="int8")


class Direct(nnx.Module):
  """Four products written four ways, the last with its weight as the first operand."""

  def __init__(self, rngs):
    self.w1 = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.3)
    self.w2 = nnx.Param(jax.random.normal(rngs.params(), (32, 24)) * 0.3)
    self.w3 = nnx.Param(jax.random.normal(rngs.params(), (24, 12)) * 0.3)
    self.w4 = nnx.Param(jax.random.normal(rngs.params(), (12, 4)) * 0.3)

  def __call__(self, x):
    h = nnx.relu(jnp.einsum("bd,df->bf", x, self.w1))
    h = nnx.relu(jax.lax.dot_general(h, self.w2[...], DN))
    h = nnx.relu(h @ self.w3)
    return jnp.einsum("kn,bk->bn", self.w4[...], h)


def _qt(rules, seed=0, provider=qtrain.QtProvider, x=X):
  return qtrain.quantize_model(Direct(nnx.Rngs(seed)), provider(rules), x) \
      if provider is qtrain.QtProvider else qwix.quantize_model(Direct(nnx.Rngs(seed)),
                                                                provider(rules), x)


def _rounding_bound(x, w):
  """|x_q . w_q - x . w| for int8 absmax rows of x (per token) and columns of w (per output
  channel), each value off by at most half its step: sum_k |x| sw/2 + |w| sx/2 + sx sw/4."""
  sx = np.abs(x).max(1, keepdims=True) / 127
  sw = np.abs(w).max(0, keepdims=True) / 127
  return (np.abs(x).sum(1, keepdims=True) * sw / 2 + sx / 2 * np.abs(w).sum(0, keepdims=True)
          + sx * sw / 4 * x.shape[1])


@pytest.mark.slow
def test_frozen_direct_calls_predict_the_qt_forward_bit_for_bit():
  """freeze takes a module's einsum / dot_general / @ calls (the weight either side): one
  FrozenOp per call under its op id, each parameter a Placeholder; eager and under nnx.jit
  the frozen model predicts what the QT model does (XLA), which is not the float model."""
  qm = _qt([qtrain.QtRule(module_path=".*", **W8A8)])
  want = np.asarray(qm(X))
  fz = freeze.freeze(qm)
  for name in ("einsum0", "dot_general0", "dot_general1", "einsum1"):
    assert isinstance(getattr(fz, name), freeze.FrozenOp), name
    assert isinstance(getattr(qm, name), model_lib.QtOp)  # the QT model is left as it is
  assert fz.einsum1.spec.weight_operand == 0 and fz.einsum0.spec.weight_operand == 1
  for w in ("w1", "w2", "w3", "w4"):
    assert isinstance(getattr(fz, w), freeze.Placeholder)
  np.testing.assert_array_equal(np.asarray(freeze.apply_frozen(fz, X, implementation="xla")),
                                want)
  np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(fz, X)), want)
  assert np.abs(want - np.asarray(Direct(nnx.Rngs(0))(X))).max() > 0
  sizes = freeze.layer_sizes(fz)
  assert sorted(sizes) == [":dot_general0", ":dot_general1", ":einsum0", ":einsum1"]
  assert sizes[":einsum0"]["float32_bytes"] == 16 * 32 * 4


@pytest.mark.slow
def test_one_frozen_direct_call_is_within_the_int8_rounding_bound_of_float64():
  """A single frozen jnp.einsum (weight first) against float64: within the bound the int8
  roundings of the inputs (per token) and of the weight (per output channel) allow."""

  class One(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jax.random.normal(jax.random.key(3), (16, 6)))

    def __call__(self, x):
      return jnp.einsum("kn,mk->mn", self.w, x)

  x = jax.random.normal(jax.random.key(4), (10, 16)) * 3
  m = qtrain.quantize_model(One(), qtrain.QtProvider([qtrain.QtRule(**W8A8)]), x)
  w = np.asarray(m.w[...], np.float64)
  got = np.asarray(freeze.freeze(m)(x), np.float64)
  ref = np.asarray(x, np.float64) @ w
  bound = _rounding_bound(np.asarray(x, np.float64), w)
  assert np.all(np.abs(got - ref) <= bound + 1e-5 * np.abs(ref).max())
  assert np.abs(got - ref).max() > 0


@pytest.mark.slow
def test_frozen_direct_calls_keep_static_scales_and_float_calls():
  """A static input scale of a direct call freezes as calibrated (the frozen model ignores the
  batch it sees); a call the rules leave float stays float (the float model's numbers for that
  product)."""
  rules = [qtrain.QtRule(module_path=".*", op_names=("einsum",)),  # einsums float
           qtrain.QtRule(module_path=".*", act_static_scale=True, **W8A8)]
  qm = _qt(rules)
  for s in (1.0, 2.0):
    qm(X * s)  # calibrates
  qtrain.set_calibrate(qm, False)
  want = np.asarray(qm(X * 5))  # a frozen QT forward: its calibrated scales
  fz = freeze.freeze(qm)
  assert "einsum0" not in vars(fz) and isinstance(fz.w1, nnx.Param)  # float: kept as it was
  assert fz.dot_general0.spec.act_dict["scale"] == "given"
  np.testing.assert_allclose(np.asarray(fz.dot_general0.layer.scale_a),
                             np.asarray(qm.dot_general0.act_static_scale[...]), rtol=0)
  np.testing.assert_array_equal(np.asarray(freeze.apply_frozen(fz, X * 5, implementation="xla")),
                                want)


@pytest.mark.slow
def test_frozen_direct_calls_save_and_load(tmp_path):
  """save_frozen / load_frozen into the float architecture built in nnx.eval_shape: the loaded
  model puts its modules' calls in frames again and predicts what the frozen one does."""
  fz = freeze.freeze(_qt([qtrain.QtRule(module_path=".*", **W8A8)]))
  want = np.asarray(fz(X))
  freeze.save_frozen(str(tmp_path / "d"), fz)
  back = freeze.load_frozen(str(tmp_path / "d"), nnx.eval_shape(lambda: Direct(nnx.Rngs(9))))
  assert isinstance(back.dot_general1, freeze.FrozenOp) and back.dot_general1.op_id == \
      "dot_general1"
  np.testing.assert_array_equal(np.asarray(back(X)), want)


@pytest.mark.slow
def test_a_frozen_call_that_takes_another_parameter_raises():
  """Calls are told apart by their order: a frozen call that now takes a parameter the module
  still holds (not the one it was frozen from) raises, naming both."""

  class Swap(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jax.random.normal(jax.random.key(0), (16, 4)))
      self.v = nnx.Param(jax.random.normal(jax.random.key(1), (16, 4)))

    def __call__(self, x, flip=False):
      return x @ (self.v if flip else self.w)

  rules = [qtrain.QtRule(module_path=".*", op_names=("dot_general",), **W8A8)]
  m = qtrain.quantize_model(Swap(), qtrain.QtProvider(rules), X)
  fz = freeze.freeze(m)
  np.testing.assert_array_equal(np.asarray(fz(X)), np.asarray(m(X)))
  with pytest.raises(ValueError, match=r"'dot_general0' of frozen nnx module '<root>' takes "
                                       r"parameter 'v' as its weight, and was frozen from 'w'"):
    fz(X, flip=True)


@pytest.mark.slow
def test_qwix_ptq_of_direct_calls_from_qt_float_and_abstract_models():
  """qwix PTQ of a module with direct calls (static input scales, one on the rhs side where
  the weight is lhs): each weight a WithAux(QArray) in its parameter's place and a PtqOp under
  the call's op id; from the calibrated QT model, and from an abstract model filled by
  quantize_params with the QT model's params and quant_stats: the QT forward's numbers."""
  rules = [qwix.QuantizationRule(module_path=".*", act_static_scale=True, **W8A8)]
  qm = _qt(rules, provider=qwix.QtProvider)
  qm(X)
  qm(X * 2)
  qm.set_attributes(disable_quant_stats_update=True)
  want = np.asarray(qm(X * 3))
  ptq = qwix.quantize_model(qm, qwix.PtqProvider(rules, implementation="xla"), X)
  assert isinstance(ptq.w3, qwix.WithAux) and isinstance(ptq.dot_general1, qwix.PtqOp)
  assert isinstance(ptq.einsum1_rhs_scale, qwix.WithAux)  # weight lhs: the input is rhs
  np.testing.assert_array_equal(np.asarray(ptq(X * 3)), want)
  abstract = nnx.eval_shape(lambda: qwix.quantize_model(
      Direct(nnx.Rngs(5)), qwix.PtqProvider(rules, implementation="xla"), X))
  stats = nnx.to_pure_dict(nnx.state(qm, qwix.QuantStat))
  assert set(stats) == {"einsum0", "dot_general0", "dot_general1", "einsum1"}  # on each op
  filled = qwix.quantize_params(nnx.to_pure_dict(nnx.state(qm, nnx.Param)), abstract, stats)
  nnx.update(abstract, filled)
  np.testing.assert_array_equal(np.asarray(abstract(X * 3)), want)
  # From the float model: quantized and run once on X (one input scale per batch).
  fp = qwix.quantize_model(Direct(nnx.Rngs(0)), qwix.PtqProvider(
      [qwix.QuantizationRule(module_path=".*", **W8A8)], implementation="xla"), X)
  qt = qwix.quantize_model(Direct(nnx.Rngs(0)), qwix.QtProvider(
      [qwix.QuantizationRule(module_path=".*", **W8A8)]), X)
  np.testing.assert_array_equal(np.asarray(fp(X)), np.asarray(qt(X)))


@pytest.mark.slow
def test_qwix_ptq_einsum_with_2d_block_scales():
  """qwix's own case: a module's jnp.einsum with tile_size={0: 2, 1: 2}: the PTQ weight holds
  (4, 8) block scales (block absmax / 127) and predicts the QT forward."""

  class EinsumModel(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jax.random.normal(jax.random.key(2), (8, 16)))

    def __call__(self, x):
      return jnp.einsum("ij,jk->ik", x, self.w)

  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8, tile_size={0: 2, 1: 2})]
  x = jax.random.normal(jax.random.key(0), (2, 8))
  ptq = qwix.quantize_model(EinsumModel(), qwix.PtqProvider(rules, implementation="xla"), x)
  scale = np.asarray(ptq.w.array.scale[...])
  w = np.asarray(EinsumModel().w[...], np.float64)
  assert scale.shape == (4, 8)
  np.testing.assert_allclose(scale, np.abs(w).reshape(4, 2, 8, 2).max((1, 3)) / 127, rtol=1e-6)
  qt = qwix.quantize_model(EinsumModel(), qwix.QtProvider(rules), x)
  np.testing.assert_array_equal(np.asarray(ptq(x)), np.asarray(qt(x)))
