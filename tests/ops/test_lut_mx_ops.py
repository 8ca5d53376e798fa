"""nf4, mxfp8, mxfp4 in the QT ops, rules, training, freeze / PTQ, QLoRA and the qwix surface
(all on the XLA path: no GPU kernel takes them, and each backend says so)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qtrain
from qtrain import freeze, lora
from qtrain import qwix
from qtrain.core import qarray, qtypes
from qtrain.ops import config as C
import qtrain.ops as qops
from qtrain.ops.backends import _base, mosaic, triton
from tests import _props_ref as R

NEW = ("nf4", "mxfp8", "mxfp4")
DN = (((1,), (0,)), ((), ()))


def _x(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.slow
@pytest.mark.parametrize("act", [None, "int8", "same"])
@pytest.mark.parametrize("name", NEW)
def test_dot_general_qt_is_the_product_of_the_dequantized_operands(name, act):
  """Forward = float64 product of the dequantized operands (their blocks along K), within
  float32 accumulation (gamma(K) of sum |a||b|, scales applied after)."""
  act = name if act == "same" else act
  cfg = C.DotGeneralQtConfig(lhs=None if act is None else C.OperandQuant(qtype=act, tile_size=(
      None if act == "int8" else qtypes.get_qtype(act).block_size)),
      rhs=C.OperandQuant(qtype=name, tile_size=qtypes.get_qtype(name).block_size),
      implementation="xla")
  x, w = _x((8, 128), 0), _x((128, 16), 1)
  out = np.asarray(qops.dot_general_qt(x, w, DN, cfg), np.float64)
  block = qtypes.get_qtype(name).block_size
  wq = qarray.quantize(w, qarray.QuantizeSpec(qtype=name, channelwise_axes=(1,), tiled_axes={0: block}))
  a = x if act is None else qarray.quantize(x, qarray.QuantizeSpec(
      qtype=act, channelwise_axes=(0,),
      tiled_axes={} if act == "int8" else {1: qtypes.get_qtype(act).block_size})).dequantize()
  a, b = np.asarray(a, np.float64), np.asarray(wq.dequantize(), np.float64)
  ref = R.dot64(a, b, DN)
  budget = R.gamma(128 + 4) * R.dot64(np.abs(a), np.abs(b), DN) + R.TINY32
  assert np.all(np.abs(out - ref) <= budget)
  # and close to the float product (the format's error, not a wrong table)
  rel = np.linalg.norm(out - np.asarray(x @ w)) / np.linalg.norm(np.asarray(x @ w))
  assert rel < {"nf4": 0.15, "mxfp8": 0.05, "mxfp4": 0.2}[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_gpu_backends_decline_with_a_reason(name):
  w = qarray.quantize(_x((128, 16), 1), qarray.QuantizeSpec(
      qtype=name, channelwise_axes=(1,), tiled_axes={0: qtypes.get_qtype(name).block_size}))
  x8 = qarray.quantize(_x((8, 128), 0), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  for lhs, rhs in ((_x((8, 128), 0).astype(jnp.bfloat16), w), (x8, w)):
    call = _base.DotCall(lhs, rhs, DN, jnp.dtype(jnp.float32))
    for backend in (triton.TritonBackend(), mosaic.MosaicBackend()):
      reason = _base.supports(backend, call)
      assert reason is not None and f"{name} has no GPU kernel" in reason, (backend, reason)


def test_config_errors_name_the_valid_values():
  with pytest.raises(ValueError, match=r"tile_size=16 with qtype 'mxfp8'.*valid: None \(the default, 32\) or 32"):
    C.OperandQuant(qtype="mxfp8", tile_size=16)
  with pytest.raises(ValueError, match="channelwise=False with qtype 'mxfp4'"):
    C.OperandQuant(qtype="mxfp4", channelwise=False)
  assert C.OperandQuant(qtype="mxfp4").tile_size == 32
  assert C.OperandQuant(qtype="nf4").tile_size is None  # per channel at the op; rules default 64
  with pytest.raises(ValueError, match="GradQuant.qtype='nf4': gradients need int2..int8 or fp8"):
    C.GradQuant(qtype="nf4")
  with pytest.raises(ValueError, match="an MX qtype needs blocks of 32"):
    C.ConvGeneralQtConfig(rhs=C.OperandQuant(qtype="mxfp8"))


def test_rules_default_blocks_and_errors():
  assert qtrain.QtRule(weight_qtype="nf4").granularity(weight=True) == (True, 64)
  assert qtrain.QtRule(weight_qtype="nf4", tile_size=16).granularity(weight=True) == (True, 16)
  assert qtrain.QtRule(weight_qtype="nf4", weight_granularity="per_channel").granularity(
      weight=True) == (True, None)
  assert qtrain.QtRule(weight_qtype="mxfp8", act_qtype="mxfp8").granularity(weight=False) == (True, 32)
  with pytest.raises(ValueError, match="tile_size=64 with qtype 'mxfp4'"):
    qtrain.QtRule(weight_qtype="mxfp4", tile_size=64)
  with pytest.raises(ValueError, match="per-tensor granularity"):
    qtrain.QtRule(act_qtype="mxfp8", act_granularity="per_tensor")
  assert qtrain.QtRule(bwd_qtype="mxfp8").bwd_qtype == "mxfp8"  # MX gradients: test_mx_gradients
  with pytest.raises(ValueError, match="bwd_qtype='nf4': gradients need"):
    qtrain.QtRule(bwd_qtype="nf4")


def test_qwix_names_round_trip():
  for name in NEW:
    r = qwix.to_qtrain_rule(qwix.QtRule(module_path=".*", weight_qtype=name, act_qtype=name))
    assert (r.weight_qtype, r.act_qtype) == (name, name)
    assert r.granularity(weight=True)[1] == qtypes.get_qtype(name).block_size


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(128, name="mlp_up")(x))
    return nn.Dense(8, name="head")(x)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_a_rule_with_the_qtype_trains_an_mlp(name):
  rules = [qtrain.QtRule(module_path=".*", weight_qtype=name, act_qtype=name, bwd_qtype="int8",
                         bwd_stochastic_rounding="low_bit_hash", implementation="xla")]
  qm = qtrain.quantize_model(MLP(), qtrain.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (32, 64))
  y = jnp.arange(32) % 8
  params = qm.init(jax.random.key(1), x)["params"]
  opt = optax.adam(1e-2)
  st = opt.init(params)

  @jax.jit
  def step(p, st, key):
    def lf(p):
      logits = qm.apply({"params": p}, x, rngs={"quant": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, g = jax.value_and_grad(lf)(p)
    u, st = opt.update(g, st, p)
    return optax.apply_updates(p, u), st, loss

  losses = []
  for i in range(8):
    params, st, loss = step(params, st, jax.random.key(10 + i))
    losses.append(float(loss))
  assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("name,lora_rank", [("nf4", None), ("mxfp4", None), ("nf4", 4)])
def test_freeze_predicts_the_qt_forward(name, lora_rank):
  """Packed 4-bit codes + scales give the QT forward's numbers (nf4 QLoRA base included)."""
  rule = qtrain.QtRule(module_path=".*", weight_qtype=name, lora_rank=lora_rank)
  prov = qtrain.QtProvider([rule])
  model = MLP()
  qm = qtrain.quantize_model(model, prov)
  x = jax.random.normal(jax.random.key(0), (16, 256))
  v = qm.init(jax.random.key(0), x)
  if lora_rank:  # non-zero adapters, so they change the output
    flat = jax.tree_util.tree_map_with_path(
        lambda p, a: a + 0.1 if lora.is_adapter(str(p[-1].key)) else a, v["params"])
    v = {"params": flat}
  ref = qm.apply(v, x)
  frozen = freeze.freeze(v, prov)
  assert sorted(frozen["layers"]) == ["head", "mlp_up"]
  assert frozen["layers"]["mlp_up"].words.dtype == jnp.uint32
  assert frozen["layers"]["mlp_up"].words.shape == (128, 256 // 8)  # 8 codes per word
  for impl in ("xla", "auto"):
    np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation=impl), ref)
  if lora_rank:
    adapters, rest = lora.split(frozen["variables"]["params"])
    def loss(ad):
      fv = {**frozen["variables"], "params": lora.combine(ad, rest)}
      return jnp.mean(freeze.apply_frozen(model, {**frozen, "variables": fv}, x,
                                          implementation="xla") ** 2)
    g = jax.grad(loss)(adapters)
    assert all(np.isfinite(np.asarray(a)).all() and np.abs(np.asarray(a)).max() > 0
               for a in jax.tree.leaves(g))


@pytest.mark.slow
def test_mxfp8_weights_freeze_a_byte_per_code():
  """mxfp8 weights freeze as their e4m3 codes' bytes (uint8 (N, K)) with one e8m0 scale per
  32 values of K, and give the QT forward's numbers (tests/test_freeze_fp8.py: the rest)."""
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="mxfp8",
                                          act_qtype="mxfp8")])
  model = MLP()
  qm = qtrain.quantize_model(model, prov)
  x = jax.random.normal(jax.random.key(0), (16, 256))
  v = qm.init(jax.random.key(0), x)
  frozen = freeze.freeze(v, prov)
  up = frozen["layers"]["mlp_up"]
  assert up.words.dtype == jnp.uint8 and up.words.shape == (128, 256)
  assert up.group_size == 32 and up.w_scale.shape == (128, 256 // 32)
  # "auto" as the rule ran: an mxfp8 x mxfp8 product sums in float32, in the operand layout
  # its implementation gives (tests/test_freeze_fp8.py)
  np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation="auto"),
                                qm.apply(v, x))


@pytest.mark.slow
def test_nf4_convolution_runs_per_channel():
  cfg = C.ConvGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="nf4"),
                              implementation="xla")
  x, k = _x((2, 8, 8, 4), 0), _x((3, 3, 4, 6), 1)
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  out = qops.conv_general_qt(x, k, config=cfg, **kw)
  kq = qarray.quantize(k, qarray.QuantizeSpec(qtype="nf4", channelwise_axes=(3,))).dequantize()
  xq = qarray.quantize(x, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,))).dequantize()
  ref = jax.lax.conv_general_dilated(xq, kq, precision=jax.lax.Precision.HIGHEST, **kw)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
