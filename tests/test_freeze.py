"""freeze(): packed weights + scales, packed inference == quantized training forward, orbax round trip."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import binary, freeze, qlayers
from qtrain.core import packing


class SmallCNN(nn.Module):
  """First/last layer float, quantized middle layers, batch norm after them."""
  lq: binary.LayerQuant
  dense_lq: binary.LayerQuant

  @nn.compact
  def __call__(self, x, train=False):
    bn = functools.partial(nn.BatchNorm, use_running_average=not train)
    x = nn.relu(bn()(qlayers.QConv(8, (3, 3), name="conv1")(x)))
    x = bn()(qlayers.QConv(16, (3, 3), strides=(2, 2), quant=self.lq, name="conv2")(x))
    x = x.reshape(x.shape[0], -1)
    x = bn()(qlayers.QDense(32, quant=self.dense_lq, name="dense1")(x))
    return qlayers.QDense(10, name="head")(x)


PRESETS = {
    "bitorch": (binary.bitorch(), binary.bitorch()),
    "larq": (binary.larq(), binary.larq()),
    "xnor": (binary.xnor(), binary.xnor()),
    "w4": (binary.mpq(bits=4, group_size=None), binary.mpq(bits=4, group_size=32)),
    "w2": (binary.mpq(bits=2, group_size=None), binary.mpq(bits=2, group_size=32)),
}


def _trained_like(model, x):
  """Init, then perturb every param and batch stat so nothing is at its init value."""
  v = model.init(jax.random.key(1), x)
  leaves, tdef = jax.tree.flatten(v)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  leaves = [l + 0.1 * jax.random.normal(k, l.shape) * (jnp.abs(l).mean() + 0.1)
            for l, k in zip(leaves, keys)]
  v = jax.tree.unflatten(tdef, leaves)
  v["batch_stats"] = jax.tree.map(jnp.abs, v["batch_stats"])
  return v


CASES = [(n, "xla") for n in sorted(PRESETS)] + [("bitorch", "interpret"), ("w4", "interpret")]


@pytest.mark.slow
@pytest.mark.parametrize("name,impl", CASES)
def test_frozen_model_logits_equal_quantized_forward(name, impl):
  lq, dlq = PRESETS[name]
  model = SmallCNN(lq, dlq)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  v = _trained_like(model, x)
  ref = model.apply(v, x)
  frozen = freeze.freeze(v, {"conv2": lq, "dense1": dlq})
  assert sorted(frozen["layers"]) == ["conv2", "dense1"]
  assert "conv2" not in frozen["variables"]["params"]
  out = freeze.apply_frozen(model, frozen, x, implementation=impl)
  # Integer products are exact; only the order of float scale multiplications can differ.
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
  assert bool(jnp.all(jnp.argmax(out, -1) == jnp.argmax(ref, -1)))


@pytest.mark.slow
def test_frozen_layout_is_packed_nk_and_sizes():
  lq = binary.bitorch()
  model = SmallCNN(lq, lq)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  v = model.init(jax.random.key(1), x)
  frozen = freeze.freeze(v, {"conv2": lq, "dense1": lq})
  d = frozen["layers"]["dense1"]
  kernel = v["params"]["dense1"]["kernel"]                                  # (K, N)
  assert d.words.dtype == jnp.uint32 and d.words.shape == (32, packing.packed_size(kernel.shape[0], 1))
  codes = packing.unpack(d.words, "binary", size=kernel.shape[0])           # (N, K)
  np.testing.assert_array_equal(codes, jnp.where(kernel.T >= 0, 1, -1))
  np.testing.assert_allclose(d.w_scale, jnp.mean(jnp.abs(kernel), axis=0), rtol=1e-6)
  c = frozen["layers"]["conv2"]
  kc = v["params"]["conv2"]["kernel"]                                        # HWIO
  oihw = jnp.transpose(kc, (3, 2, 0, 1)).reshape(16, -1)
  np.testing.assert_array_equal(c.weight_codes(), jnp.where(oihw >= 0, 1, -1))
  sizes = freeze.layer_sizes(frozen, v)
  for layer in ("conv2", "dense1"):
    assert sizes[layer]["ratio"] >= 10, sizes[layer]
  assert sizes["__model__"]["frozen_bytes"] < sizes["__model__"]["float32_bytes"]
  w4 = freeze.layer_sizes(freeze.freeze(v, {"dense1": binary.mpq(bits=4, group_size=32)}))
  assert 4 < w4["dense1"]["ratio"] < 8  # 4-bit codes + a scale and zero per 32 weights


@pytest.mark.slow
def test_orbax_round_trip(tmp_path):
  lq, dlq = PRESETS["w4"]
  model = SmallCNN(binary.bitorch(), dlq)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  v = _trained_like(model, x)
  frozen = freeze.freeze(v, {"conv2": binary.bitorch(), "dense1": dlq})
  path = str(tmp_path / "frozen")
  freeze.save_frozen(path, frozen)
  back = freeze.load_frozen(path)
  assert sorted(back["layers"]) == sorted(frozen["layers"])
  for k, l in frozen["layers"].items():
    b = back["layers"][k]
    assert (b.kind, b.w_qtype, b.k, b.n, b.group_size, b.act) == (l.kind, l.w_qtype, l.k, l.n,
                                                                   l.group_size, l.act)
    for f in freeze._ARRAY_FIELDS:
      if getattr(l, f) is None:
        assert getattr(b, f) is None
      else:
        assert getattr(b, f).dtype == getattr(l, f).dtype
        np.testing.assert_array_equal(getattr(b, f), getattr(l, f))
  np.testing.assert_array_equal(freeze.apply_frozen(model, back, x, implementation="xla"),
                                freeze.apply_frozen(model, frozen, x, implementation="xla"))


@pytest.mark.slow
def test_freeze_rules_and_errors():
  layer = qlayers.QDense(4, quant=binary.bitorch())
  x = jnp.ones((2, 32))
  v = layer.init(jax.random.key(0), x)
  assert freeze.freeze(v, {"other": binary.bitorch()})["layers"] == {}
  assert freeze.freeze(v, [("", None)])["layers"] == {}
  with pytest.raises(ValueError, match="implementation"):
    freeze.apply_frozen(layer, freeze.freeze(v, {"": binary.bitorch()}), x, implementation="cuda")


def _frozen_dense(lq, k=512, n=96, seed=0):
  layer = qlayers.QDense(n, quant=lq)
  x = jax.random.normal(jax.random.key(seed), (4, k))
  v = layer.init(jax.random.key(1), x)
  leaves, tdef = jax.tree.flatten(v["params"])
  keys = jax.random.split(jax.random.key(7), len(leaves))
  params = jax.tree.unflatten(tdef, [l + 0.1 * jax.random.normal(kk, l.shape)
                                     for l, kk in zip(leaves, keys)])  # nonzero bias too
  return freeze.freeze_layer(params, lq), x


_needs_mosaic_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.__version_info__ < (0, 11),
    reason="needs a GPU and jax >= 0.11 (Pallas Mosaic GPU)")


@pytest.mark.slow
def test_mosaic_implementation_says_what_it_cannot_run():
  fl, x = _frozen_dense(binary.bitorch())  # binary activations: the int8-activation path
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="runs on a GPU"):
      freeze.apply_layer(fl, x, implementation="mosaic")
  fl, x = _frozen_dense(binary.mpq(bits=4, group_size=32, asymmetric=True))
  with pytest.raises(ValueError, match="weight zero points"):
    freeze.apply_layer(fl, x.astype(jnp.bfloat16), implementation="mosaic")
  fl, x = _frozen_dense(binary.mpq(bits=4, group_size=None, asymmetric=False))
  with pytest.raises(ValueError, match="activations of dtype float32"):
    freeze.apply_layer(fl, x, implementation="mosaic")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="runs on a GPU"):
      freeze.apply_layer(fl, x.astype(jnp.bfloat16), implementation="mosaic")
  fl, x = _frozen_dense(binary.mpq(bits=4, group_size=32, asymmetric=False))
  with pytest.raises(ValueError, match="group-wise weight scales"):
    freeze.apply_layer(fl, x.astype(jnp.bfloat16), implementation="mosaic")


@pytest.mark.gpu
@_needs_mosaic_gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_mosaic_frozen_layer_matches_xla_gpu(bits):
  lq = binary.mpq(bits=bits, group_size=None, asymmetric=False)
  fl, x = _frozen_dense(lq, k=1024, n=300)
  x = jnp.tile(x, (4, 1)).astype(jnp.bfloat16)  # 16 rows
  a = freeze.apply_layer(fl, x, implementation="mosaic")
  b = freeze.apply_layer(fl, x, implementation="xla")
  codes = np.asarray(fl.weight_codes(), np.float64) * np.asarray(fl.w_scale, np.float64)[:, None]
  exact = np.asarray(x, np.float64) @ codes.T + np.asarray(fl.bias, np.float64)
  rel = lambda o: float(np.linalg.norm(np.asarray(o, np.float64) - exact) / np.linalg.norm(exact))
  # Both round to the bf16 output (and XLA's path the dequantized weights to bf16).
  assert a.shape == b.shape == (16, 300)
  assert rel(a) < 2**-8 and rel(b) < 2**-8


@pytest.mark.gpu
@_needs_mosaic_gpu
def test_mosaic_frozen_binary_layer_matches_xla_gpu():
  # Binary activations x binary weights through the int8-activation kernel:
  # integer products, exact like the XLA path's int8 dot.
  fl, x = _frozen_dense(binary.bitorch(), k=1024, n=300)
  x = jnp.tile(x, (4, 1))  # 16 rows
  a = freeze.apply_layer(fl, x, implementation="mosaic")
  b = freeze.apply_layer(fl, x, implementation="xla")
  assert a.shape == b.shape == (16, 300)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                             atol=1e-6 * float(np.max(np.abs(b))))


# ----------------------------------------------------------------------------
# Rule-quantized models (qtrain.quantize_model): every intercepted layer freezes
# from the provider's record of its op, linen and nnx.
#
# Equality budget: exact. The frozen XLA path rebuilds the weight in its own
# layout from codes and scales that are bitwise those of the QT forward (the
# same quantize_operand call on the same array), quantizes the input with the
# same function and spec, and makes the QT forward's own dispatch call with the
# op's dimension numbers, so every float32 value agrees bit for bit eagerly (each
# op is deterministic). Under jit the two programs differ in how the weight codes
# are made (quantized vs unpacked), and XLA may fuse them differently and
# reassociate a float32 sum: there the budget is a few ulps.
# "auto" is the XLA path off a GPU only (on a GPU it prefers the packed kernels,
# tested against the bound of test_kernel_path_matches_qt_forward).

D, T, B = 32, 6, 2


class LinenBlock(nn.Module):
  """A transformer block plus the other intercepted linen layers."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln1")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h)  # head_dim 16
    h = nn.LayerNorm(name="ln2")(x)
    x = x + nn.Dense(D, name="mlp_down")(nn.gelu(nn.Dense(2 * D, name="mlp_up")(h)))
    e = nn.Einsum((D, 2, 16), "btd,dhk->bthk", name="ein")(x)            # (B, T, 2, 16)
    g = nn.DenseGeneral((4, 8), axis=(-2, -1), name="dg")(e)               # kernel (2, 16, 4, 8)
    return nn.Conv(D, (3,), name="conv")(g.reshape(x.shape)) + x


class NnxBlock(nnx.Module):
  """The nnx twins: MultiHeadAttention, LinearGeneral, Einsum, Linear, Conv."""

  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)
    self.ein = nnx.Einsum("btd,dhk->bthk", (D, 2, 16), (2, 16), rngs=rngs)
    self.lg = nnx.LinearGeneral((2, 16), (4, 8), axis=(-2, -1), rngs=rngs)
    self.conv = nnx.Conv(D, D, (3,), rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x))
    x = x + self.down(nnx.gelu(self.up(x)))
    g = self.lg(self.ein(x))
    return self.conv(g.reshape(x.shape)) + x


def _rules(name):
  R = qtrain.QtRule
  if name == "w8a8":
    return [R(module_path=".*", weight_qtype="int8", act_qtype="int8")]
  if name == "w4g16":  # group scales and zero points; convolutions take no tile_size
    kw = dict(weight_qtype="int4", weight_calibration_method="minmax")
    return [R(module_path=".*", op_names=("dot_general", "einsum"), tile_size=16, **kw),
            R(module_path=".*", **kw)]
  if name == "w1a8":
    return [R(module_path=".*", weight_qtype="binary", weight_calibration_method="absmean",
              act_qtype="int8")]
  if name == "bitorch":  # binary inputs with learned scales and shifts
    return binary.rules({".*": "bitorch"})
  if name == "w8a8_static":
    return [R(module_path=".*", weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
  raise ValueError(name)


RULES = ["w8a8", "w4g16", "w1a8", "bitorch", "w8a8_static"]
# Each transformer case compiles its model 3 times (~3 s each on 2 cores): both transformer
# tests below run in the slow step.
EXACT_IMPLS = ("xla",) if jax.default_backend() == "gpu" else ("xla", "auto")


def _perturbed(tree, seed=3):
  """Every leaf moved off its init value (biases, shifts and scales included); numpy's
  generator, so no per-shape compile."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda l: jnp.asarray(
      np.asarray(l) + 0.2 * rng.standard_normal(l.shape) * (np.abs(np.asarray(l)).mean() + 0.1),
      l.dtype), tree)


def _linen_qt(rules, x):
  model = LinenBlock()
  provider = qtrain.QtProvider(rules)
  qmodel = qtrain.quantize_model(model, provider)
  v = jax.jit(qmodel.init)(jax.random.key(1), x)  # one compile; records are made while tracing
  v = {**v, "params": _perturbed(v["params"])}
  if "quant_stats" in v:  # calibrate the static scales on two batches
    for s in (5, 6):
      _, upd = qmodel.apply(v, jax.random.normal(jax.random.key(s), x.shape), mutable=["quant_stats"])
      v = {**v, **upd}
  return model, provider, qmodel, v


def _quantized_paths(provider):
  from qtrain import provider as provider_lib
  return sorted(r.path for r in provider.records() if r.status == provider_lib.QUANTIZED)


def _leaf(tree, path):
  for p in path.split("/"):
    tree = tree[p]
  return tree


@pytest.mark.slow
@pytest.mark.parametrize("rules", RULES)
def test_linen_transformer_frozen_equals_qt_forward(rules):
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  model, provider, qmodel, v = _linen_qt(_rules(rules), x)
  # Eager on both sides: under jit XLA fuses each graph its own way and may sum a float x
  # dequantized product in another order (an ulp apart); op by op the two run the same products.
  ref = qmodel.apply(v, x)
  frozen = freeze.freeze(v, provider)
  paths = _quantized_paths(provider)
  assert paths == sorted(["attn/query", "attn/key", "attn/value", "attn/out", "mlp_up",
                          "mlp_down", "ein", "dg", "conv"])
  assert sorted(frozen["layers"]) == paths
  params = frozen["variables"]["params"]
  for p in paths:  # the weights are gone, the biases (added by the modules) stay
    assert "kernel" not in _leaf(params, p) and "bias" in _leaf(params, p)
    assert not any(k.endswith(("act_scale", "act_shift")) for k in _leaf(params, p))
  assert set(params["ln1"]) == {"scale", "bias"}
  assert "quant_stats" not in frozen["variables"]
  for impl in EXACT_IMPLS:
    np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation=impl), ref)
  assert freeze.layer_sizes(frozen, v)["__model__"]["ratio"] > 1.5


@pytest.mark.slow
@pytest.mark.parametrize("rules", RULES)
def test_nnx_model_frozen_equals_qt_forward(rules):
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  model = NnxBlock(nnx.Rngs(0))
  _, state = nnx.split(model)
  nnx.update(model, _perturbed(state))
  provider = qtrain.QtProvider(_rules(rules))
  qtrain.quantize_model(model, provider, x)
  qtrain.set_calibrate(model, False)  # static scales stay uncalibrated: one scale per batch
  ref = model(x)
  fr = freeze.freeze(model)
  assert _quantized_paths(provider) == sorted(["attn/query", "attn/key", "attn/value", "attn/out",
                                               "up", "down", "ein", "lg", "conv"])
  for impl in EXACT_IMPLS:
    np.testing.assert_array_equal(freeze.apply_frozen(fr, x, implementation=impl), ref)
  # The frozen copy holds no float kernel of a quantized layer; the QT model is untouched.
  flat = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(fr))}
  assert not [k for k in flat if k.endswith("kernel")], flat
  assert isinstance(fr.up.kernel, freeze.Placeholder) and fr.up.kernel.shape == (D, 2 * D)
  assert isinstance(model.up.kernel, nnx.Param)
  np.testing.assert_array_equal(model(x), ref)


@pytest.mark.slow
def test_placeholders_are_dead_under_jit_and_nnx_jit():
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  model, provider, qmodel, v = _linen_qt(_rules("w8a8"), x)
  frozen = freeze.freeze(v, provider)
  f = jax.jit(lambda fr, x: freeze.apply_frozen(model, fr, x, implementation="xla"))
  out = f(frozen, x)
  assert not bool(jnp.any(jnp.isnan(out)))
  # The NaN placeholder of dg's float kernel is in the traced program, and XLA drops it.
  shape = "f32[2,16,4,8]"
  assert shape in str(jax.make_jaxpr(f)(frozen, x)).replace(" ", "")
  assert shape not in f.lower(frozen, x).compile().as_text().replace(" ", "")
  # nnx: the same under nnx.jit.
  m = NnxBlock(nnx.Rngs(0))
  qtrain.quantize_model(m, qtrain.QtProvider(_rules("w1a8")), x)
  fr = freeze.freeze(m)
  run = nnx.jit(lambda mm, x: mm(x))
  # apply_frozen sets the frozen ops' implementation ("auto" prefers kernels on a GPU).
  np.testing.assert_array_equal(freeze.apply_frozen(fr, x, implementation="xla"), m(x))
  # Under jit XLA fuses the two programs each its own way and may reassociate a
  # float32 sum: a few ulps of the output's magnitude, no more.
  ref = run(m, x)
  budget = 16 * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(ref)))
  np.testing.assert_allclose(run(fr, x), ref, rtol=0, atol=budget)


class Custom(nn.Module):
  """A user's own module: weight as the lhs, not named ``kernel``, bf16 compute."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(1.0), (16, x.shape[-1]))
    y = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())))                 # (16, B)
    z = nn.Dense(8, dtype=jnp.bfloat16, name="half")(y.T)
    return z.astype(jnp.float32)


@pytest.mark.slow
def test_custom_module_weight_as_lhs_and_cast_weight():
  x = jax.random.normal(jax.random.key(0), (B, 48))
  provider = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4",
                                              act_qtype="int8")])
  qmodel = qtrain.quantize_model(Custom(), provider)
  v = qmodel.init(jax.random.key(1), x)
  fr = freeze.freeze(v, qmodel)  # the quantized model stands for its provider
  assert (fr["layers"][""].param, fr["layers"][""].weight_operand) == ("w", 0)
  assert fr["layers"]["half"].weight_dtype == "bfloat16"  # quantized as the op saw it
  assert "w" not in fr["variables"]["params"]
  ref = qmodel.apply(v, x)
  np.testing.assert_array_equal(freeze.apply_frozen(Custom(), fr, x, implementation="xla"), ref)
  np.testing.assert_array_equal(freeze.apply_frozen(qmodel, fr, x, implementation="xla"),
                                ref)  # the quantized wrapper is unwrapped


KERNEL_LAYERS = {  # single layers whose dot layouts the kernels take after reshaping
    "einsum": (nn.Einsum((D, 2, 16), "btd,dhk->bthk"), (B, T, D)),
    "dense_general": (nn.DenseGeneral((2, 16), axis=(-2, -1)), (B, T, 2, D)),
    "conv1d": (nn.Conv(D, (3,), strides=2, kernel_dilation=2, padding=((2, 1),)), (B, 9, D)),
}


def _kernel_bound(layer, x, model):
  """K * eps32 * (|x_hat| . |w_hat|) + eps32 * |y|: the float32 dot-product error bound of a
  product whose K terms are summed in another order, scales applied after, cast once."""
  from qtrain import _frozen
  from qtrain.core import qarray as qa

  w = np.abs(np.asarray(layer.kernel_qarray().dequantize(), np.float64))
  if layer.kind == "conv":
    xh = _frozen.quantize_act(layer, x, contract=(x.ndim - 1,), channel_axes=(0,), tile_axis=None)
    xh = np.abs(np.asarray(qa.dequantize(xh) if isinstance(xh, qa.QArray) else xh))
    dot = jax.lax.conv_general_dilated(
        jnp.asarray(xh, jnp.float32), jnp.asarray(w, jnp.float32), (model.strides,),
        model.padding, rhs_dilation=(model.kernel_dilation,),
        dimension_numbers=("NHC", "HIO", "NHC"), precision=jax.lax.Precision.HIGHEST)
    return layer.k * np.finfo(np.float32).eps * (1 + 1e-6) * np.asarray(dot, np.float64)
  contract = layer.layout[0]
  ac = tuple(range(x.ndim - len(contract), x.ndim))
  xh = _frozen.quantize_act(layer, x, contract=ac, channel_axes=tuple(range(x.ndim - len(ac))),
                            tile_axis=ac[-1])
  xh = np.abs(np.asarray(qa.dequantize(xh) if isinstance(xh, qa.QArray) else xh, np.float64))
  return layer.k * np.finfo(np.float32).eps * np.tensordot(xh, w, axes=(ac, contract))


@pytest.mark.slow
@pytest.mark.parametrize("rule", [
    dict(weight_qtype="int8", act_qtype="int8"),
    dict(weight_qtype="int4", tile_size=16),
    dict(weight_qtype="binary", act_qtype="binary", weight_calibration_method="absmean",
         act_calibration_method="absmean"),
], ids=["w8a8", "w4g16", "w1a1"])
def test_kernel_path_matches_qt_forward(rule):
  """The Triton kernels (interpreted) on the packed weights: a weight with two contracting
  axes and 2-D features, an einsum, a strided dilated padded 1-D conv (im2col)."""
  for name, (model, shape) in KERNEL_LAYERS.items():
    if name == "conv1d":
      rule = {k: v for k, v in rule.items() if k != "tile_size"}
    provider = qtrain.QtProvider([qtrain.QtRule(module_path=".*", **rule)])
    qmodel = qtrain.quantize_model(model, provider)
    x = jax.random.normal(jax.random.key(0), shape)
    v = qmodel.init(jax.random.key(1), x)
    frozen = freeze.freeze(v, provider)
    ref = np.asarray(qmodel.apply(v, x), np.float64)
    out = np.asarray(freeze.apply_frozen(model, frozen, x, implementation="interpret"), np.float64)
    layer = frozen["layers"][""]
    assert layer.group_size == rule.get("tile_size"), name
    bound = _kernel_bound(layer, x, model) + np.finfo(np.float32).eps * np.abs(ref)
    assert out.shape == ref.shape and np.all(np.abs(out - ref) <= bound), (
        name, float(np.max(np.abs(out - ref) - bound)))


@pytest.mark.slow
def test_fp8_weights_freeze_beside_integer_ones():
  """fp8 weights freeze as a byte per code (uint8 (N, K): the fp8 bit patterns) with per-channel
  scales, beside int8 ones, and predict the QT forward's numbers (tests/test_freeze_fp8.py has
  the rest: mxfp8, fp8 inputs, conv, save / load, the qwix PTQ)."""
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  rules = [qtrain.QtRule(module_path="mlp_up", weight_qtype="float8_e4m3fn"),
           qtrain.QtRule(module_path=".*", weight_qtype="int8")]
  model, provider, qmodel, v = _linen_qt(rules, x)
  frozen = freeze.freeze(v, provider)
  up, down = frozen["layers"]["mlp_up"], frozen["layers"]["mlp_down"]
  assert up.words.dtype == jnp.uint8 and up.words.shape == (2 * D, D) and up.w_scale.shape == (2 * D,)
  assert up.weight_codes().dtype == jnp.float8_e4m3fn
  assert down.words.dtype == jnp.uint32
  np.testing.assert_array_equal(freeze.apply_frozen(model, frozen, x, implementation="auto"),
                                qmodel.apply(v, x))
  m = NnxBlock(nnx.Rngs(0))
  qtrain.quantize_model(m, qtrain.QtProvider([qtrain.QtRule(module_path="up",
                                                            weight_qtype="float8_e5m2")]), x)
  fr = freeze.freeze(m)
  assert fr.up.dot_general.words[...].dtype == jnp.uint8
  np.testing.assert_array_equal(fr(x), m(x))
  lq = binary.weight_only("float8_e4m3fn")
  layer = qlayers.QDense(4, quant=lq)
  xs = jax.random.normal(jax.random.key(2), (3, 8))
  v = layer.init(jax.random.key(0), xs)
  frozen = freeze.freeze(v, {"": lq})
  assert frozen["layers"][""].words.shape == (4, 8)
  np.testing.assert_array_equal(freeze.apply_frozen(layer, frozen, xs, implementation="auto"),
                                layer.apply(v, xs))


@pytest.mark.slow
def test_freeze_errors_name_the_problem():
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  model = nn.MultiHeadDotProductAttention(num_heads=2)
  rules = _rules("w8a8")
  provider = qtrain.QtProvider(rules)
  qmodel = qtrain.quantize_model(model, provider)
  with pytest.raises(ValueError, match="recorded no op.*eval_shape"):
    freeze.freeze({"params": {}}, provider)
  # Records come from any trace of the quantized model: an abstract one costs no compute.
  v = qmodel.init(jax.random.key(1), x)
  fresh = qtrain.QtProvider(rules)
  jax.eval_shape(qtrain.quantize_model(model, fresh).apply, v, x)
  assert sorted(freeze.freeze(v, fresh)["layers"]) == ["key", "out", "query", "value"]
  # A list of rules freezes whole nn.Dense / nn.Conv layers: not attention projections.
  with pytest.raises(ValueError, match=r"'query' is a DenseGeneral.*QtProvider"):
    freeze.apply_frozen(model, freeze.freeze(v, rules), x)
  frozen = freeze.freeze(v, provider)
  with pytest.raises(ValueError, match=r"implementation='pallas'; valid: \['auto', 'xla', "
                                       r"'triton', 'mosaic', 'interpret'\]"):
    freeze.apply_frozen(model, frozen, x, implementation="pallas")
  # The records must belong to these variables.
  with pytest.raises(ValueError, match=r"module 'key \(dot_general0\)'.*no params for it"):
    freeze.freeze({"params": {"query": v["params"]["query"]}}, provider)
  # A forced kernel names the layer it cannot take: int8 inputs with group scales.
  p4 = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4", act_qtype="int8",
                                        tile_size=16)])
  v4 = qtrain.quantize_model(model, p4).init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"implementation='interpret': layer 'query "
                                       r"\(dot_general0\)'.*varies along the contraction"):
    freeze.apply_frozen(model, freeze.freeze(v4, p4), x, implementation="interpret")
  # A frozen op called with another layout than its record says fails loudly.
  dense = nn.Dense(D, use_bias=False)
  pd = qtrain.QtProvider(rules)
  vd = qtrain.quantize_model(dense, pd).init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"frozen layer '<root> \(dot_general0\)': its op "
                                       r"contracts weight axes \(1,\).*frozen for \(0,\)"):
    freeze.apply_frozen(Transposed(), freeze.freeze(vd, pd), x)
  # A masked convolution's op multiplies kernel * mask: not a parameter freeze could pack.
  conv = nn.Conv(D, (3,), mask=jnp.tril(jnp.ones((3, D, D))))
  pc = qtrain.QtProvider(rules)
  vc = qtrain.quantize_model(conv, pc).init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"'<root> \(conv_general_dilated0\)' \(Conv\) has a mask"):
    freeze.apply_frozen(conv, freeze.freeze(vc, pc), x)
  mc = nnx.Conv(D, D, (3,), mask=jnp.tril(jnp.ones((3, D, D))), rngs=nnx.Rngs(0))
  qtrain.quantize_model(mc, qtrain.QtProvider(rules), x)
  with pytest.raises(ValueError, match=r"\(Conv\) has a mask"):
    freeze.freeze(mc)
  # Stacked layers: the record's weight is one slice of the parameter.
  ps = qtrain.QtProvider(rules)
  vs = qtrain.quantize_model(Stacked(), ps).init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"'stack/d \(dot_general0\)'.*\(2, 32, 32\).*stacked"):
    freeze.freeze(vs, ps)


class Stacked(nn.Module):
  """Dense layers stacked by nn.scan: one kernel (L, K, N), each op sees (K, N)."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    return stack(name="stack")(x, None)[0]


class _Cell(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return nn.Dense(D, name="d")(c), None


class Transposed(nn.Module):
  """A kernel of nn.Dense's shape, contracted along its other axis."""

  @nn.compact
  def __call__(self, x):
    k = self.param("kernel", nn.initializers.normal(1.0), (D, D))
    return jax.lax.dot_general(x, k, (((x.ndim - 1,), (1,)), ((), ())))


@pytest.mark.slow
def test_orbax_round_trip_transformer(tmp_path):
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  rules = [qtrain.QtRule(module_path="attn/.*", weight_qtype="int4", act_qtype="int8",
                         weight_calibration_method="minmax")] + _rules("bitorch")
  model, provider, qmodel, v = _linen_qt(rules, x)
  frozen = freeze.freeze(v, provider)
  freeze.save_frozen(str(tmp_path / "linen"), frozen)
  back = freeze.load_frozen(str(tmp_path / "linen"))
  assert sorted(back["layers"]) == sorted(frozen["layers"])
  for k, l in frozen["layers"].items():
    b = back["layers"][k]
    assert b.meta() == l.meta()
    for f in freeze._ARRAY_FIELDS:
      assert (getattr(b, f) is None) == (getattr(l, f) is None)
      if getattr(l, f) is not None:
        assert getattr(b, f).dtype == getattr(l, f).dtype
        np.testing.assert_array_equal(getattr(b, f), getattr(l, f))
  np.testing.assert_array_equal(freeze.apply_frozen(model, back, x, implementation="xla"),
                                qmodel.apply(v, x))
  # nnx: restored into the float architecture built abstractly (no float weights made).
  m = NnxBlock(nnx.Rngs(0))
  qtrain.quantize_model(m, qtrain.QtProvider(rules), x)
  fr = freeze.freeze(m)
  freeze.save_frozen(str(tmp_path / "nnx"), fr)
  template = nnx.eval_shape(lambda: NnxBlock(nnx.Rngs(0)))
  back = freeze.load_frozen(str(tmp_path / "nnx"), model=template)
  np.testing.assert_array_equal(freeze.apply_frozen(back, x, implementation="xla"), m(x))


@pytest.mark.slow
def test_docstring_example():
  import doctest
  res = doctest.testmod(freeze, optionflags=doctest.ELLIPSIS)
  assert res.failed == 0 and res.attempted > 0


@pytest.mark.slow
@pytest.mark.parametrize("qtype, act, tile", [("int3", "int8", None), ("int5", None, 32),
                                               ("int6", "int8", None), ("int7", None, None)])
def test_int3_to_int7_weights_freeze_into_their_container_and_run_its_kernels(qtype, act, tile):
  """int3 weights are stored in int4's 4-bit fields and int5..int7 in bytes; the frozen layer
  runs the container's kernels (interpreted) and the XLA path, both as the QT forward does.
  Integer products are exact, so only float32 rounding of the scaled sums separates them."""
  rule = qtrain.QtRule(module_path=".*", weight_qtype=qtype, act_qtype=act, tile_size=tile)
  provider = qtrain.QtProvider([rule])
  model = nn.Dense(48)
  qmodel = qtrain.quantize_model(model, provider)
  x = jax.random.normal(jax.random.key(0), (5, 64))
  v = qmodel.init(jax.random.key(1), x)
  frozen = freeze.freeze(v, provider)
  layer = frozen["layers"][""]
  bits = qtrain.core.get_qtype(qtype).bits
  assert layer.words.dtype == jnp.uint32 and layer.words.shape == (48, 64 * bits // 32)
  ref = np.asarray(qmodel.apply(v, x), np.float64)
  for impl in ("xla", "interpret"):
    out = np.asarray(freeze.apply_frozen(model, frozen, x, implementation=impl), np.float64)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=impl)
  # The codes use the qtype's own range, not the container's.
  codes = np.asarray(qtrain.core.packing.unpack(layer.words, qtype, size=64))
  qt = qtrain.core.get_qtype(qtype)
  assert codes.min() >= qt.qmin and codes.max() <= qt.qmax
  assert np.abs(codes).max() == qt.qmax  # absmax: each channel's largest value lands on qmax


@pytest.mark.slow
def test_input_axis_names_survive_freeze_save_and_load(tmp_path):
  """A rule's act_axis_names (a shard_map-shared input scale) is frozen with the layer's input
  quantization and comes back from save_frozen / load_frozen (JSON lists back to tuples: the
  metadata must stay hashable)."""
  rules = [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                         act_axis_names=("model",))]
  provider = qtrain.QtProvider(rules)
  qmodel = qtrain.quantize_model(nn.Dense(8), provider)
  x = jax.random.normal(jax.random.key(0), (2, 16))
  v = qmodel.init(jax.random.key(1), x)
  frozen = freeze.freeze(v, provider)
  assert frozen["layers"][""].act_dict["axis_names"] == ("model",)
  freeze.save_frozen(str(tmp_path / "f"), frozen)
  back = freeze.load_frozen(str(tmp_path / "f"))
  assert back["layers"][""].act == frozen["layers"][""].act
  hash(back["layers"][""].act)
  np.testing.assert_array_equal(np.asarray(freeze.apply_frozen(nn.Dense(8), back, x)),
                                np.asarray(qmodel.apply(v, x)))
