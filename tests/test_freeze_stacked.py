"""freeze / qwix PTQ of nnx layers stacked by nnx.vmap and run by nnx.scan / nnx.vmap: each
layer frozen as its QT op quantized it, the arrays stacked along the stack's axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import freeze, qwix

L, D = 3, 12
X = jax.random.normal(jax.random.key(0), (10, D))
W8A8 = dict(weight_qtype="int8", act_qtype="int8")


def _stack(rngs, make):
  @nnx.split_rngs(splits=L)
  @nnx.vmap(axis_size=L)
  def create(rngs):
    return make(rngs)
  return create(rngs)


class Scanned(nnx.Module):
  """L Linear layers made by nnx.vmap (kernel (L, D, D)), applied in turn by nnx.scan."""

  def __init__(self, rngs):
    self.layers = _stack(rngs, lambda r: nnx.Linear(D, D, rngs=r))

  def __call__(self, x):
    @nnx.scan(out_axes=nnx.Carry)
    def step(x, layer):
      return nnx.tanh(layer(x))
    return step(x, self.layers)


class Parallel(nnx.Module):
  """L Linear layers applied side by side by nnx.vmap (one input per layer)."""

  def __init__(self, rngs):
    self.layers = _stack(rngs, lambda r: nnx.Linear(D, 5, rngs=r))

  def __call__(self, xs):
    return nnx.vmap(lambda layer, x: layer(x), in_axes=(0, 0))(self.layers, xs)


class Cell(nnx.Module):
  """A user module whose product is its own @ (a direct call)."""

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.3)

  def __call__(self, x):
    return nnx.tanh(x @ self.w)


class ScannedCells(nnx.Module):
  def __init__(self, rngs):
    self.cells = _stack(rngs, Cell)

  def __call__(self, x):
    @nnx.scan(out_axes=nnx.Carry)
    def step(x, cell):
      return cell(x)
    return step(x, self.cells)


def _one_layer_frozen(kernel, rules, x):
  """The frozen layer of a plain (unstacked) Linear holding ``kernel``."""
  lin = nnx.Linear(*kernel.shape, rngs=nnx.Rngs(0))
  lin.kernel[...] = kernel
  return freeze.freeze(qtrain.quantize_model(lin, qtrain.QtProvider(rules), x)).dot_general.layer


@pytest.mark.slow
def test_scanned_layers_freeze_layer_by_layer_and_predict_the_qt_forward():
  """freeze of a scanned stack: one FrozenOp whose arrays lead with the stack's axis (L), each
  layer's codes and scales those of that layer frozen alone; the frozen model predicts the QT
  forward bit for bit (eager and nnx.jit); layer_sizes counts the L layers."""
  rules = [qtrain.QtRule(module_path=".*", **W8A8)]
  qm = qtrain.quantize_model(Scanned(nnx.Rngs(0)), qtrain.QtProvider(rules), X)
  want = np.asarray(qm(X))
  fz = freeze.freeze(qm)
  op = fz.layers.dot_general
  assert op.stack == (L,) and op.spec.kernel_shape == (D, D)
  kernels = np.asarray(qm.layers.kernel[...])
  for i in range(L):
    alone = _one_layer_frozen(kernels[i], rules, X)
    np.testing.assert_array_equal(np.asarray(op.words[...][i]), np.asarray(alone.words))
    np.testing.assert_array_equal(np.asarray(op.w_scale[...][i]), np.asarray(alone.w_scale))
  np.testing.assert_array_equal(np.asarray(fz(X)), want)
  np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(fz, X)), want)
  assert np.abs(want - np.asarray(Scanned(nnx.Rngs(0))(X))).max() > 0
  assert freeze.layer_sizes(fz)["layers"]["float32_bytes"] == 4 * (L * D * D)


@pytest.mark.slow
def test_stacked_static_scales_freeze_one_per_layer():
  """A static input scale per layer of the stack (qtrain's and qwix's statistics): the frozen
  layers keep each layer's calibrated scale, and predict the frozen QT forward."""
  for provider, rule, quantize in (
      (qtrain.QtProvider, qtrain.QtRule, qtrain.quantize_model),
      (qwix.QtProvider, qwix.QuantizationRule, qwix.quantize_model)):
    rules = [rule(module_path=".*", act_static_scale=True, **W8A8)]
    qm = quantize(Scanned(nnx.Rngs(1)), provider(rules), X)
    for s in (1.0, 2.0):
      qm(X * s)
    qtrain.set_calibrate(qm, False)
    want = np.asarray(qm(X * 4))
    fz = freeze.freeze(qm)
    scale_a = np.asarray(fz.layers.dot_general.layer.scale_a)
    assert scale_a.shape == (L,) and len(set(scale_a.tolist())) == L, provider
    np.testing.assert_array_equal(np.asarray(fz(X * 4)), want)


@pytest.mark.slow
def test_layers_run_by_nnx_vmap_and_scanned_direct_calls_freeze():
  """Layers run side by side by nnx.vmap, and a user module's own @ stacked and scanned: each
  frozen per layer, predicting the QT forward bit for bit."""
  rules = [qtrain.QtRule(module_path=".*", **W8A8)]
  xs = jax.random.normal(jax.random.key(1), (L, 6, D))
  qm = qtrain.quantize_model(Parallel(nnx.Rngs(2)), qtrain.QtProvider(rules), xs)
  fz = freeze.freeze(qm)
  assert fz.layers.dot_general.stack == (L,)
  np.testing.assert_array_equal(np.asarray(fz(xs)), np.asarray(qm(xs)))
  qc = qtrain.quantize_model(ScannedCells(nnx.Rngs(3)), qtrain.QtProvider(rules), X)
  fc = freeze.freeze(qc)
  assert fc.cells.dot_general0.stack == (L,)
  assert isinstance(fc.cells.w, freeze.Placeholder) and fc.cells.w.shape == (D, D)
  np.testing.assert_array_equal(np.asarray(fc(X)), np.asarray(qc(X)))


@pytest.mark.slow
def test_stacked_frozen_model_saves_and_loads(tmp_path):
  rules = [qtrain.QtRule(module_path=".*", weight_qtype="int4", act_qtype="int8")]
  fz = freeze.freeze(qtrain.quantize_model(Scanned(nnx.Rngs(0)), qtrain.QtProvider(rules), X))
  want = np.asarray(fz(X))
  freeze.save_frozen(str(tmp_path / "s"), fz)
  back = freeze.load_frozen(str(tmp_path / "s"), nnx.eval_shape(lambda: Scanned(nnx.Rngs(5))))
  assert back.layers.dot_general.stack == (L,)
  np.testing.assert_array_equal(np.asarray(back(X)), want)


@pytest.mark.slow
def test_qwix_ptq_of_a_scanned_stack():
  """qwix's case: PTQ of a vmap-made, scanned Linear stack: the kernel a WithAux of an int8
  QArray (L, D, D) with per-layer, per-channel scales (L, 1, D) = absmax / 127; from the float
  model, and from the abstract model filled by quantize_params with another model's float
  params: the QT forward's predictions, within the int8 rounding of the float model."""
  rules = [qwix.QuantizationRule(module_path=".*", **W8A8)]
  fm = Scanned(nnx.Rngs(0))
  ptq = qwix.quantize_model(fm, qwix.PtqProvider(rules, implementation="xla"), X)
  q = ptq.layers.kernel.array
  assert isinstance(ptq.layers.kernel, qwix.WithAux) and q.qtype == jnp.int8
  assert q.shape == (L, D, D) and q.scale[...].shape == (L, 1, D)
  w = np.asarray(fm.layers.kernel[...], np.float64)
  np.testing.assert_allclose(np.asarray(q.scale[...]), np.abs(w).max(1, keepdims=True) / 127,
                             rtol=1e-6)
  deq = np.asarray(q.qvalue[...], np.float64) * np.asarray(q.scale[...], np.float64)
  assert np.all(np.abs(deq - w) <= np.asarray(q.scale[...]) / 2 + 1e-7)
  qt = qwix.quantize_model(fm, qwix.QtProvider(rules), X)
  want = np.asarray(qt(X))
  got = np.asarray(ptq(X))
  np.testing.assert_array_equal(got, want)
  assert 0 < np.abs(got - np.asarray(fm(X))).max() < 0.05  # int8 x int8, tanh-bounded, L = 3
  abstract = nnx.eval_shape(lambda: qwix.quantize_model(
      Scanned(nnx.Rngs(0)), qwix.PtqProvider(rules, implementation="xla"), X))
  assert abstract.layers.kernel.how.stack == (L,)
  trained = Scanned(nnx.Rngs(7))
  nnx.update(abstract, qwix.quantize_params(nnx.to_pure_dict(nnx.state(trained, nnx.Param)),
                                            abstract))
  np.testing.assert_array_equal(np.asarray(abstract(X)),
                                np.asarray(qwix.quantize_model(trained, qwix.QtProvider(rules),
                                                               X)(X)))
  with pytest.raises(ValueError, match=r"'layers/kernel' has shape \(12, 12\), the template's "
                                       r"\(3, 12, 12\)"):
    qwix.quantize_params({"layers": {"kernel": jnp.ones((D, D))}}, abstract)


@pytest.mark.slow
def test_qwix_ptq_of_a_stack_with_static_scales():
  """Static input scales of a stack in qwix's layout: one `<op id>_lhs_scale` per layer,
  (L, 1, 1), each the layer's sum_of_absmax / count / 127; the QT forward's predictions."""
  rules = [qwix.QuantizationRule(module_path=".*", act_static_scale=True, **W8A8)]
  qm = qwix.quantize_model(Scanned(nnx.Rngs(0)), qwix.QtProvider(rules), X)
  qm(X)
  qm(X * 3)
  qm.set_attributes(disable_quant_stats_update=True)
  want = np.asarray(qm(X * 2))
  stat = qm.layers.dot_general0_lhs.get_value()
  ptq = qwix.quantize_model(qm, qwix.PtqProvider(rules, implementation="xla"), X)
  scale = np.asarray(ptq.layers.dot_general0_lhs_scale.array[...])
  assert scale.shape == (L, 1, 1)
  np.testing.assert_allclose(scale, np.asarray(stat["sum_of_absmax"]) /
                             np.asarray(stat["count"]).reshape(L, 1, 1) / 127, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(ptq(X * 2)), want)
