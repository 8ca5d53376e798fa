"""freeze(): packed weights + scales, packed inference == quantized training forward, orbax round trip."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
