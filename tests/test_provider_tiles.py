"""tile_size on layers that contract several axes (issue 16.10): the tile spans the whole
contraction, and an error raised building or running a layer's quantized op names the layer."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import ops

dqt = importlib.import_module("qtrain.ops.dot_general_qt")  # the module (the package exports the op)

D, HEADS = 128, 4
X = jax.random.normal(jax.random.key(0), (2, 8, D))
# The README's rule list.
README_RULES = [
    qtrain.QtRule(module_path=r".*mlp.*", weight_qtype="int8", act_qtype="int8",
                  bwd_qtype="int8", bwd_stochastic_rounding="uniform"),
    qtrain.QtRule(module_path=r".*", weight_qtype="int4", tile_size=64),
]


@pytest.fixture
def weight_scales(monkeypatch):
  """(operand shape, scale shape) of every weight (rhs) the QT dot_general quantizes."""
  seen = []
  real = dqt.quantize_operand

  def spy(x, oq, given_scale, channel_axes, tile_axis, what):
    res = real(x, oq, given_scale, channel_axes, tile_axis, what)
    if what == "rhs" and oq is not None:
      seen.append((tuple(x.shape), tuple(res.value.scale.shape)))
    return res

  monkeypatch.setattr(dqt, "quantize_operand", spy)
  jax.clear_caches()  # the ops trace once per signature: a cached trace would skip the spy
  return seen


def _check_projections(weight_scales, records):
  # q/k/v contract D = 128 (2 tiles of 64 per (head, head_dim) column); the out projection
  # contracts (heads, head_dim) = (4, 32), merged to one 128-long axis: 2 tiles per column too.
  # (Under a trace the op quantizes once per signature: q, k and v share one trace.)
  assert set(weight_scales) == {((D, HEADS, D // HEADS), (2, HEADS, D // HEADS)), ((D, D), (2, D))}
  quantized = {r.path.rsplit("/", 1)[-1]: r.shapes[1] for r in records
               if r.status == "quantized"}  # (the attention's own einsums have no weight)
  qkv = (D, HEADS, D // HEADS)
  assert quantized == {"query": qkv, "key": qkv, "value": qkv, "out": (HEADS, D // HEADS, D)}


def _reference_out(z, kernel, bias):
  """The out projection on operands flattened by hand: one (2, 8, 128) x (128, 128) product."""
  cfg = ops.DotGeneralQtConfig(rhs=ops.OperandQuant(qtype="int4", tile_size=64))
  return ops.dot_general_qt(z.reshape(2, 8, D), kernel.reshape(D, D),
                             (((2,), (0,)), ((), ())), cfg) + bias


@pytest.mark.slow
def test_readme_rules_on_linen_attention(weight_scales):
  p = qtrain.QtProvider(README_RULES)
  qm = qtrain.quantize_model(nn.MultiHeadDotProductAttention(num_heads=HEADS), p)
  with pytest.warns(UserWarning, match=r"rules\[0\] \(module_path='\.\*mlp\.\*'.*matched no op"):
    v = jax.jit(qm.init)(jax.random.key(1), X)  # (no mlp in a bare attention layer)
  y = jax.jit(qm.apply)(v, X)
  assert y.shape == X.shape and bool(jnp.all(jnp.isfinite(y)))
  _check_projections(weight_scales[-4:], p.records())
  # The out projection alone (a DenseGeneral over (heads, head_dim)) is the hand-flattened product.
  z = jax.random.normal(jax.random.key(2), (2, 8, HEADS, D // HEADS))
  out = qtrain.quantize_model(nn.DenseGeneral(D, axis=(-2, -1)), qtrain.QtProvider(README_RULES))
  with pytest.warns(UserWarning, match="matched no op"):
    vo = jax.jit(out.init)(jax.random.key(3), z)
  np.testing.assert_allclose(jax.jit(out.apply)(vo, z), _reference_out(z, vo["params"]["kernel"],
                                                              vo["params"]["bias"]),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_readme_rules_on_nnx_attention(weight_scales):
  p = qtrain.QtProvider(README_RULES)
  m = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match=r"rules\[0\] \(module_path='\.\*mlp\.\*'.*matched no op"):
    qtrain.quantize_model(m, p, rngs=nnx.Rngs(quant=0))
  y = m(X)
  assert y.shape == X.shape and bool(jnp.all(jnp.isfinite(y)))
  _check_projections(weight_scales, p.records())
  z = jax.random.normal(jax.random.key(2), (2, 8, HEADS, D // HEADS))
  np.testing.assert_allclose(m.out(z), _reference_out(z, m.out.kernel[...], m.out.bias[...]),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["linen", "nnx"])
def test_tile_not_dividing_the_contraction_names_the_layer_and_rule(frontend):
  rules = qtrain.QtProvider([qtrain.QtRule(module_path="query"),
                             qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=48)])
  want = (r"qtrain: rules\[1\] \(module_path='\.\*'\) on dot_general in module 'key': "
          r"config\.rhs\.tile_size=48 does not divide")
  if frontend == "linen":
    qm = qtrain.quantize_model(nn.MultiHeadDotProductAttention(num_heads=HEADS), rules)
    with pytest.raises(ValueError, match=want) as e:
      qm.init(jax.random.key(1), X)
  else:
    m = qtrain.quantize_model(nnx.MultiHeadAttention(num_heads=HEADS, in_features=D,
                                                     decode=False, rngs=nnx.Rngs(0)), rules)
    with pytest.raises(ValueError, match=want) as e:
      m(X)
  # The op's own error is chained.
  assert "tile_size=48" in str(e.value.__cause__) and "qtrain: rules" not in str(e.value.__cause__)
  # ... and the out projection's (heads, head_dim) contraction of 4 x 32 = 128 is named as such.
  rules = qtrain.QtProvider([qtrain.QtRule(module_path="out", weight_qtype="int4", tile_size=48)])
  with pytest.raises(ValueError, match=r"rules\[0\] \(module_path='out'\) on dot_general in module "
                                       r"'out': .*contraction of size 128 .*4 x 32"):
    if frontend == "linen":
      qtrain.quantize_model(nn.MultiHeadDotProductAttention(num_heads=HEADS), rules).init(
          jax.random.key(1), X)
    else:
      qtrain.quantize_model(nnx.MultiHeadAttention(num_heads=HEADS, in_features=D,
                                                   decode=False, rngs=nnx.Rngs(0)), rules)(X)


@pytest.mark.slow
def test_conv_under_a_tile_rule_names_the_layer_and_rule():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(4, (3, 3), name="stem")(x)

  p = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int8", tile_size=16)])
  with pytest.raises(ValueError, match=r"^qtrain: rules\[0\] \(module_path='\.\*'\) on "
                                       r"conv_general_dilated in module 'stem': tile_size=16 is "
                                       r"set, and convolutions take no tile_size"):
    qtrain.quantize_model(Net(), p).init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
