"""nnx layers stacked with nnx.vmap and run by nnx.scan: per-layer keys and state (issue 16.9).

How an op's stochastic-rounding keys are derived (``qtrain.flax.model._op_stream``):
``quantize_model`` draws one key per quantized op from the ``"quant"`` stream
of the ``rngs`` it is given (graph order) and splits it over the layer's
stack shape, ``keys = jax.random.split(key, stack)``; layer i's j-th call uses
``fold_in(keys[i], j)`` (an nnx.RngStream whose key and counter are stacked
like the layer's parameters, so nnx.scan / nnx.vmap slice them with it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qtrain

N = 3
D = 16
SR = dict(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
          bwd_stochastic_rounding="uniform")
X = jax.random.normal(jax.random.key(0), (4, D))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.lin(x))


def _provider(**kw):
  return qtrain.QtProvider([qtrain.QtRule(module_path=".*", **kw)])


def _vmap_stack(make=Block):
  @nnx.vmap(in_axes=0, out_axes=0)
  def create(key):
    return make(nnx.Rngs(key))
  return create(jax.random.split(jax.random.key(1), N))


def _scan(stack, x):
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def body(layer, h):
    return layer(h)
  return body(stack, x)


def _loop(stack, x):
  """The stack's layers one by one in a Python loop (each a slice of the stacked state)."""
  gdef, state = nnx.split(stack)
  h = x
  for i in range(N):
    h = nnx.merge(gdef, jax.tree.map(lambda a: a[i], state))(h)
  return h


def _loss(run):
  return lambda stack: jnp.mean((run(stack, X) - 0.5) ** 2)


def _keys(op):
  return np.asarray(jax.random.key_data(op.rng.key[...]))


_scan_step = nnx.jit(nnx.value_and_grad(_loss(_scan)))
_loop_step = nnx.jit(nnx.value_and_grad(_loss(_loop)))


def _check_scan_equals_loop(stack):
  # Both start from the same state (counters at 0): the same keys, layer by layer.
  before, other = nnx.clone(stack), nnx.clone(stack)
  ls, gs = _scan_step(stack)
  ll, gl = _loop_step(before)
  np.testing.assert_allclose(ls, ll, rtol=1e-6)
  np.testing.assert_allclose(gs.lin.kernel[...], gl.lin.kernel[...], rtol=1e-5, atol=1e-7)
  # ... and with other keys the int8 stochastically rounded gradients differ.
  other.lin.dot_general.rng.key[...] = jax.random.split(jax.random.key(99), N)
  _, go = _loop_step(other)
  assert not np.allclose(go.lin.kernel[...], gl.lin.kernel[...], rtol=1e-5, atol=1e-7)


class TestStochasticRounding:

  @pytest.mark.slow
  def test_vmap_created_stack_run_by_scan(self):
    stack = _vmap_stack()
    qtrain.quantize_model(stack, _provider(**SR), rngs=nnx.Rngs(quant=7))
    op = stack.lin.dot_general
    # The documented derivation: one key from the stream (count 0), split over the stack.
    want = jax.random.split(jax.random.fold_in(jax.random.key(7), 0), (N,))
    np.testing.assert_array_equal(_keys(op), jax.random.key_data(want))
    assert len({tuple(k) for k in _keys(op)}) == N  # every layer its own noise
    np.testing.assert_array_equal(op.rng.count[...], np.zeros(N))
    _check_scan_equals_loop(stack)

  @pytest.mark.slow
  def test_vmap_created_stack_trains(self):
    stack = _vmap_stack()
    qtrain.quantize_model(stack, _provider(**SR), rngs=nnx.Rngs(quant=0))
    opt = nnx.Optimizer(stack, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def step(stack, opt):
      loss, g = nnx.value_and_grad(_loss(_scan))(stack)
      opt.update(stack, g)
      return loss

    losses = [float(step(stack, opt)) for _ in range(6)]
    assert losses[-1] < 0.7 * losses[0], losses
    # One forward per step per layer: every layer's counter advanced, so each step draws new noise.
    np.testing.assert_array_equal(stack.lin.dot_general.rng.count[...], np.full(N, 6))

  @pytest.mark.slow
  def test_quantized_inside_the_vmapped_constructor(self):
    provider = _provider(**SR)

    @nnx.split_rngs(splits=N)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return qtrain.quantize_model(Block(rngs), provider, rngs=rngs)

    stack = create(nnx.Rngs(0, quant=3))
    op = stack.lin.dot_general
    assert op.rng.key.shape == (N,) and len({tuple(k) for k in _keys(op)}) == N
    _check_scan_equals_loop(stack)


class Hooked(nnx.Module):
  """A user module that keeps its op as an attribute (quantizable under nnx)."""

  def __init__(self, rngs, sliced=False):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, 2 * D if sliced else D)) / 4)
    self.dot_general = jax.lax.dot_general
    self.sliced = sliced

  def __call__(self, x):
    w = self.w[:, :D] if self.sliced else self.w[...]
    return x + jnp.tanh(self.dot_general(x, w, (((1,), (0,)), ((), ()))))


class Net(nnx.Module):
  """A model that runs its stack through nnx.scan (what a sample forward needs)."""

  def __init__(self, make=Block):
    self.blocks = _vmap_stack(make)

  def __call__(self, x):
    return _scan(self.blocks, x)


class TestUserModules:

  @pytest.mark.slow
  def test_stacking_learnt_from_the_sample_forward(self):
    net = Net(Hooked)
    qtrain.quantize_model(net, _provider(**SR), X, rngs=nnx.Rngs(quant=7))
    op = net.blocks.dot_general
    want = jax.random.split(jax.random.fold_in(jax.random.key(7), 0), (N,))
    np.testing.assert_array_equal(_keys(op), jax.random.key_data(want))
    g = nnx.jit(nnx.grad(lambda n: jnp.mean(n(X) ** 2)))(net)
    assert g.blocks.w[...].shape == (N, D, D)
    assert bool(jnp.all(jnp.isfinite(g.blocks.w[...])))

  @pytest.mark.slow
  def test_without_sample_inputs_is_a_clear_error(self):
    with pytest.raises(ValueError, match=r"rules\[0\].*'blocks' \(Hooked\).*pass sample inputs"):
      qtrain.quantize_model(Net(Hooked), _provider(**SR), rngs=nnx.Rngs(quant=0))

  @pytest.mark.slow
  def test_weight_that_is_no_parameter_is_a_clear_error(self):
    with pytest.raises(ValueError, match=r"'blocks' \(Hooked\).*weight operand of shape"):
      qtrain.quantize_model(Net(lambda r: Hooked(r, sliced=True)), _provider(**SR), X,
                            rngs=nnx.Rngs(quant=0))


class TestState:

  @pytest.mark.slow
  @pytest.mark.parametrize("kw", [dict(act_static_scale=True), dict(act_learnable_scale=True)])
  def test_state_of_stacked_layers_is_stacked_and_per_layer(self, kw):
    net = Net()
    qtrain.quantize_model(net, _provider(weight_qtype="int8", act_qtype="int8", **kw), X)
    op = net.blocks.lin.dot_general
    # Each layer's input, from the same layers run one by one.
    gdef, state = nnx.split(net.blocks)
    h, inputs = X, []
    for i in range(N):
      inputs.append(h)
      h = nnx.merge(gdef, jax.tree.map(lambda a: a[i], state))(h)
    if "act_static_scale" in kw:
      assert op.act_static_scale.shape == (N,)
      net(X)  # one calibration batch: each layer's scale is its own input's absmax / 127
      want = [float(jnp.max(jnp.abs(x))) / 127 for x in inputs]
      np.testing.assert_allclose(op.act_static_scale[...], want, rtol=1e-6)
      np.testing.assert_array_equal(op.act_static_count[...], np.ones(N))
    else:
      assert op.act_scale.shape == (N,)
      want = [2 * float(jnp.mean(jnp.abs(x))) / np.sqrt(127) for x in inputs]
      np.testing.assert_allclose(op.act_scale[...], want, rtol=1e-5)
    assert len(set(np.asarray(want).round(8))) == N  # the layers' values differ

  @pytest.mark.slow
  def test_sample_forward_on_the_bare_stack_names_the_stacked_layers(self):
    with pytest.raises(ValueError, match=r"sample forward failed.*'lin \(3,\)'.*nnx.scan"):
      qtrain.quantize_model(_vmap_stack(), _provider(weight_qtype="int8", act_qtype="int8",
                                                     act_static_scale=True), X)
