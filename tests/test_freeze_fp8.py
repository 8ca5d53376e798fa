"""fp8 (float8_e4m3fn, float8_e5m2) and mxfp8 weights frozen: one byte per code, the QT forward's
scales, the QT forward's numbers on the XLA path; save / load; the qwix-layout PTQ over them.

Equality budget: exact (assert_array_equal), eagerly. The frozen layer holds the very fp8 codes
and float32 scales the QT op's ``quantize_operand`` made of the same weight (stored as their
bytes, read back by a bitcast: no rounding), quantizes the input with the QT op's function and
spec, and makes the QT forward's dispatch call with the op's dimension numbers; each op is
deterministic on the CPU, so the two forwards agree bit for bit op by op (as for the integer
qtypes in tests/test_freeze.py). One condition the integer qtypes do not have: an fp8 x fp8
product accumulates in float32, whose sum depends on the operands' layout, and "auto" hands
XLA its operands in GEMM layout where "xla" leaves them as they are; so the frozen model is
compared under the implementation its rules ran with ("auto", the default of both, or "xla").
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import binary, freeze, qlayers, qwix
from qtrain.core import qarray, qtypes
from qtrain.ops import config as C
from qtrain.ops.backends import _base, mosaic, triton

FP8 = ("float8_e4m3fn", "float8_e5m2", "mxfp8")
D, T, B = 32, 6, 2


def _x(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _perturbed(tree, seed=3):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda l: jnp.asarray(
      np.asarray(l, np.float32) + 0.2 * rng.standard_normal(l.shape)
      * (np.abs(np.asarray(l, np.float32)).mean() + 0.1), l.dtype), tree)


def _rules(wq, aq=None, *, conv=True, **kw):
  """A rule for every op; convolutions take no MX qtype, so an mxfp8 model's conv (if
  ``conv``) is e4m3fn."""
  R = qtrain.QtRule
  if conv and (wq == "mxfp8" or aq == "mxfp8"):
    conv_w = "float8_e4m3fn" if wq == "mxfp8" else wq
    conv_a = "float8_e4m3fn" if aq == "mxfp8" else aq
    return [R(module_path=".*", op_names=("dot_general", "einsum"), weight_qtype=wq,
              act_qtype=aq, **kw),
            R(module_path=".*", weight_qtype=conv_w, act_qtype=conv_a, **kw)]
  return [R(module_path=".*", weight_qtype=wq, act_qtype=aq, **kw)]


def _dense(wq, aq=None, *, n=48, k=64, dtype=None, **kw):
  model = nn.Dense(n, dtype=dtype)
  provider = qtrain.QtProvider(_rules(wq, aq, conv=False, **kw))
  qmodel = qtrain.quantize_model(model, provider)
  x = _x((5, k), 0, dtype or jnp.float32)
  v = qmodel.init(jax.random.key(1), x)
  v = {**v, "params": _perturbed(v["params"])}
  return model, provider, qmodel, v, x


# ----------------------------------------------------------------------------
# Storage: the codes' bytes and the QT forward's scales.


@pytest.mark.parametrize("wq", FP8)
@pytest.mark.thin(3)
def test_codes_are_one_byte_each_and_scales_the_qt_ops(wq):
  model, provider, qmodel, v, x = _dense(wq)
  layer = freeze.freeze(v, provider)["layers"][""]
  kernel = v["params"]["kernel"]                                              # (K, N)
  assert layer.words.dtype == jnp.uint8 and layer.words.shape == (48, 64)    # (N, K), a byte each
  qt = qtypes.get_qtype(wq)
  tiles = {0: qt.block_size} if qt.is_mx else {}
  q = qarray.quantize(kernel, qarray.QuantizeSpec(qtype=wq, channelwise_axes=(1,),
                                                  tiled_axes=tiles))
  codes = layer.weight_codes()
  assert codes.dtype == qt.compute_dtype
  np.testing.assert_array_equal(jax.lax.bitcast_convert_type(codes, jnp.uint8),
                                jax.lax.bitcast_convert_type(q.qvalue.T, jnp.uint8))
  if qt.is_mx:  # one e8m0 (power-of-two) scale per 32 values of K
    assert layer.group_size == 32 and layer.w_scale.shape == (48, 2)
    np.testing.assert_array_equal(layer.w_scale, q.scale.T)
    e = np.log2(np.asarray(layer.w_scale))
    assert np.array_equal(e, np.round(e))
  else:
    assert layer.group_size is None and layer.w_scale.shape == (48,)
    np.testing.assert_array_equal(layer.w_scale, q.scale.reshape(-1))
  sizes = freeze.layer_sizes(freeze.freeze(v, provider), v)
  assert 3 < sizes[""]["ratio"] <= 4  # a byte per weight + scales, against float32


# ----------------------------------------------------------------------------
# The frozen product is the QT forward's.


# (weight, input) qtypes; mxfp8 x mxfp8 compiles the longest (over 1 s): slow.
DENSE_CASES = [pytest.param(w, a, marks=pytest.mark.slow) if (w, a) == ("mxfp8", "same")
               else (w, a) for w in FP8 for a in (None, "same", "int8")]


@pytest.mark.parametrize("wq,aq", DENSE_CASES)
@pytest.mark.thin(3)
def test_dense_frozen_equals_qt_forward(wq, aq):
  aq = wq if aq == "same" else aq
  for impl in ("auto", "xla"):
    model, provider, qmodel, v, x = _dense(wq, aq, implementation=impl)
    frozen = freeze.freeze(v, provider)
    np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation=impl),
                                  qmodel.apply(v, x))


@pytest.mark.parametrize("wq", FP8)
def test_bf16_activations_and_empty_batch(wq):
  """A bfloat16 Dense (weight cast to bf16 by the module, bf16 input) and a batch of 0 rows."""
  model, provider, qmodel, v, x = _dense(wq, dtype=jnp.bfloat16)
  frozen = freeze.freeze(v, provider)
  layer = frozen["layers"][""]
  assert layer.weight_dtype == "bfloat16" and layer.words.dtype == jnp.uint8
  ref = qmodel.apply(v, x)
  out = freeze.apply_frozen(model, frozen, x, implementation="auto")
  assert out.dtype == ref.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, ref)
  empty = jnp.zeros((0, 64), jnp.bfloat16)
  out = freeze.apply_frozen(model, frozen, empty, implementation="auto")
  assert out.shape == (0, 48) and out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, qmodel.apply(v, empty))


@pytest.mark.slow
@pytest.mark.parametrize("aq", [None, "same", "int8"])
@pytest.mark.parametrize("wq", FP8)
def test_linen_block_frozen_equals_qt_forward(wq, aq):
  """Attention projections (DenseGeneral), Dense, Einsum, a DenseGeneral over two contracting
  axes (an mxfp8 tile merges them) and a Conv."""
  from tests.test_freeze import LinenBlock
  aq = wq if aq == "same" else aq
  x = _x((B, T, D))
  model = LinenBlock()
  for impl in ("auto", "xla"):
    provider = qtrain.QtProvider(_rules(wq, aq, implementation=impl))
    qmodel = qtrain.quantize_model(model, provider)
    v = jax.jit(qmodel.init)(jax.random.key(1), x)
    v = {**v, "params": _perturbed(v["params"])}
    ref = qmodel.apply(v, x)
    frozen = freeze.freeze(v, provider)
    assert sorted(frozen["layers"]) == sorted(["attn/query", "attn/key", "attn/value",
                                               "attn/out", "mlp_up", "mlp_down", "ein", "dg",
                                               "conv"])
    assert all(l.words.dtype == jnp.uint8 for l in frozen["layers"].values())
    np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation=impl),
                                  ref)


@pytest.mark.slow
@pytest.mark.parametrize("wq", FP8)
def test_nnx_block_frozen_equals_qt_forward(wq):
  """nnx Linear, MultiHeadAttention, Einsum, LinearGeneral, Conv with fp8 inputs."""
  from tests.test_freeze import NnxBlock
  x = _x((B, T, D))
  model = NnxBlock(nnx.Rngs(0))
  _, state = nnx.split(model)
  nnx.update(model, _perturbed(state))
  qtrain.quantize_model(model, qtrain.QtProvider(_rules(wq, wq)), x)
  ref = model(x)
  fr = freeze.freeze(model)
  assert fr.up.dot_general.words[...].dtype == jnp.uint8
  np.testing.assert_array_equal(freeze.apply_frozen(fr, x, implementation="auto"), ref)
  np.testing.assert_array_equal(fr(x), ref)


@pytest.mark.slow
def test_nnx_linear_frozen_equals_qt_forward():
  model = nnx.Linear(64, 48, rngs=nnx.Rngs(0))
  x = _x((3, 7, 64))
  qtrain.quantize_model(model, qtrain.QtProvider(_rules("mxfp8", "float8_e4m3fn", conv=False)), x)
  ref = model(x)
  fr = freeze.freeze(model)
  np.testing.assert_array_equal(fr(x), ref)
  np.testing.assert_array_equal(fr(jnp.zeros((0, 64))), model(jnp.zeros((0, 64))))


@pytest.mark.slow
@pytest.mark.parametrize("wq", ["float8_e4m3fn", "float8_e5m2"])
def test_conv_frozen_equals_qt_forward(wq):
  model = nn.Conv(8, (3, 3), strides=(2, 1), padding="SAME")
  provider = qtrain.QtProvider(_rules(wq, "float8_e4m3fn"))
  qmodel = qtrain.quantize_model(model, provider)
  x = _x((2, 9, 7, 4))
  v = qmodel.init(jax.random.key(1), x)
  frozen = freeze.freeze(v, provider)
  assert frozen["layers"][""].words.shape == (8, 4 * 9)
  np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation="auto"),
                                qmodel.apply(v, x))


@pytest.mark.slow
def test_static_and_learned_fp8_input_scales():
  """An fp8 input with a calibrated static scale (and a QDense with learned scale and shift):
  the frozen layer quantizes the input with the stored scale, as the QT op does."""
  model, provider, qmodel, v, x = _dense("float8_e4m3fn", "float8_e4m3fn", act_static_scale=True)
  for s in (5, 6):
    _, upd = qmodel.apply(v, _x(x.shape, s), mutable=["quant_stats"])
    v = {**v, **upd}
  frozen = freeze.freeze(v, provider)
  assert frozen["layers"][""].act_dict["scale"] == "given"
  np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation="auto"),
                                qmodel.apply(v, x))
  lq = binary.LayerQuant(weight=C.OperandQuant(qtype="float8_e5m2"),
                         act=C.OperandQuant(qtype="float8_e4m3fn"), learn_act_scale=True,
                         learn_act_shift=True)
  layer = qlayers.QDense(16, quant=lq)
  x = _x((4, 32))
  v = {"params": _perturbed(layer.init(jax.random.key(0), x)["params"])}
  frozen = freeze.freeze(v, {"": lq})
  np.testing.assert_array_equal(freeze.apply_frozen(layer, frozen, x, implementation="auto"),
                                layer.apply(v, x))


@pytest.mark.slow  # 8 s on two CPU cores
def test_input_gradient_is_the_float_products_through_the_dequantized_weight():
  model, provider, qmodel, v, x = _dense("mxfp8")
  frozen = freeze.freeze(v, provider)
  layer = frozen["layers"][""]
  w = layer.kernel_qarray().dequantize(jnp.float32)                           # (K, N)
  g = jax.grad(lambda x: jnp.sum(freeze.apply_frozen(model, frozen, x, implementation="auto")
                                 ** 2))(x)
  y = freeze.apply_frozen(model, frozen, x, implementation="auto")
  np.testing.assert_allclose(g, 2 * y @ w.T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# GPU backends decline; save / load.


@pytest.mark.parametrize("wq", FP8)
@pytest.mark.slow
def test_gpu_backends_decline_fp8_frozen_weights_with_a_reason(wq):
  model, provider, qmodel, v, x = _dense(wq, n=16, k=128)
  layer = freeze.freeze(v, provider)["layers"][""]
  w = layer.nk_qarray()
  x8 = qarray.quantize(x, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0,)))
  dn = (((1,), (1,)), ((), ()))
  for lhs in (x.astype(jnp.bfloat16), x8):
    call = _base.DotCall(lhs, w, dn, jnp.dtype(jnp.float32))
    for backend in (triton.TritonBackend(), mosaic.MosaicBackend()):
      reason = _base.supports(backend, call)
      assert reason is not None and wq in reason, (backend, reason)
  # A forced packed-weight kernel raises naming the layer and why; "auto" runs XLA.
  with pytest.raises(ValueError, match=rf"layer '<root> \(dot_general0\)'.*{wq} weights have no packed-weight GPU "
                                       r"kernel"):
    freeze.apply_frozen(model, freeze.freeze(v, provider), x, implementation="interpret")


@pytest.mark.slow
def test_save_load_round_trip_linen_and_nnx(tmp_path):
  """orbax keeps the code bytes (uint8: a float8 array saved with np.save comes back as raw
  bytes of dtype |V1, uint8 survives every serializer) and the metadata."""
  from tests.test_freeze import NnxBlock
  model, provider, qmodel, v, x = _dense("mxfp8", "float8_e5m2")
  frozen = freeze.freeze(v, provider)
  freeze.save_frozen(str(tmp_path / "linen"), frozen)
  back = freeze.load_frozen(str(tmp_path / "linen"))
  l, b = frozen["layers"][""], back["layers"][""]
  assert b.meta() == l.meta() and b.words.dtype == jnp.uint8
  np.testing.assert_array_equal(b.words, l.words)
  np.testing.assert_array_equal(b.w_scale, l.w_scale)
  np.testing.assert_array_equal(freeze.apply_frozen(model, back, x, implementation="auto"),
                                qmodel.apply(v, x))
  xb = _x((B, T, D))
  m = NnxBlock(nnx.Rngs(0))
  qtrain.quantize_model(m, qtrain.QtProvider(_rules("float8_e4m3fn", "float8_e4m3fn")), xb)
  fr = freeze.freeze(m)
  freeze.save_frozen(str(tmp_path / "nnx"), fr)
  template = nnx.eval_shape(lambda: NnxBlock(nnx.Rngs(0)))
  back = freeze.load_frozen(str(tmp_path / "nnx"), model=template)
  np.testing.assert_array_equal(freeze.apply_frozen(back, xb, implementation="auto"), m(xb))


# ----------------------------------------------------------------------------
# qwix's PTQ over fp8 / mxfp8 frozen layers.


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="out")(nn.relu(nn.Dense(64, name="hidden")(x)))


@pytest.mark.slow
@pytest.mark.parametrize("wq", FP8)
def test_linen_ptq_params_hold_fp8_codes_and_predict_the_qt_forward(wq, tmp_path):
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=wq, act_qtype="float8_e4m3fn")]
  x = _x((8, 64))
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(rules))
  v = qt.init(jax.random.key(1), x)
  v = {**v, "params": _perturbed(v["params"])}
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(rules))
  abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
  params = qwix.quantize_params(v["params"], abstract)
  w = params["hidden"]["kernel"]
  qt_ = qtypes.get_qtype(wq)
  assert w.array.qvalue.dtype == qt_.compute_dtype and w.array.qvalue.shape == (64, 64)
  assert w.array.scale.shape == ((2, 64) if qt_.is_mx else (1, 64))
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)),
                                np.asarray(qt.apply(v, x)))
  import orbax.checkpoint as ocp  # the fp8 qvalue (qwix's layout) through orbax
  ck = ocp.StandardCheckpointer()
  ck.save(str(tmp_path / "ptq"), params)
  ck.wait_until_finished()
  back = ck.restore(str(tmp_path / "ptq"), abstract)
  assert back["hidden"]["kernel"].array.qvalue.dtype == qt_.compute_dtype
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": back}, x)),
                                np.asarray(qt.apply(v, x)))


@pytest.mark.slow
def test_nnx_ptq_of_multi_head_attention_with_mxfp8_weights():
  """qwix's ptq_test.test_nnx_multi_head_attention's setting, checked against the QT forward."""
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="mxfp8", tile_size=32)]
  x = _x((2, 16, 64))
  mha = nnx.MultiHeadAttention(num_heads=4, in_features=64, qkv_features=128, out_features=64,
                               decode=False, rngs=nnx.Rngs(0))
  qm = qwix.quantize_model(mha, qwix.QtProvider(rules), x)
  want = np.asarray(qm(x))
  ptq = qwix.quantize_model(qm, qwix.PtqProvider(rules), x)
  assert ptq.query.kernel.array.qvalue.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(ptq(x)), want)
  ptq2 = qwix.quantize_model(mha, qwix.PtqProvider(rules), x)
  np.testing.assert_array_equal(np.asarray(ptq2(x)), want)
