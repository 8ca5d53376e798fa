"""LoRA / QLoRA: adapters on intercepted dots, their training, freezing and merging."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax import traverse_util

import qtrain
from qtrain import freeze, lora
from qtrain.ops import lora as lora_ops


def _randomize_adapters(params, seed=0):
  """Adapters with random (non-zero) B, so that they change the output."""
  flat = traverse_util.flatten_dict(params)
  rng = np.random.default_rng(seed)
  for k in flat:
    if lora.is_adapter(k[-1]):
      flat[k] = jnp.asarray(rng.normal(size=np.shape(flat[k])) * 0.3, jnp.float32)
  return traverse_util.unflatten_dict(flat)


def _w64(x):
  return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- rules


@pytest.mark.parametrize("kw, msg", [
    (dict(lora_rank=0), "lora_rank=0 must be a positive int"),
    (dict(lora_rank=2.0), "lora_rank=2.0 must be a positive int"),
    (dict(lora_rank=True), "lora_rank=True must be a positive int"),
    (dict(lora_rank=4, lora_alpha=0), "lora_alpha=0 must be a number > 0"),
    (dict(lora_rank=4, lora_alpha=float("nan")), "lora_alpha=nan must be a number > 0"),
    (dict(lora_rank=4, lora_dropout=1.0), "lora_dropout=1.0 must be in [0, 1)"),
    (dict(lora_rank=4, lora_dropout=-0.1), "lora_dropout=-0.1 must be in [0, 1)"),
    (dict(lora_alpha=8.0), "lora_alpha=8.0 is set but lora_rank is None"),
    (dict(lora_dropout=0.1), "lora_dropout=0.1 is set but lora_rank is None"),
    (dict(lora_rank=4, op_names=("conv_general_dilated",)), "not convolutions"),
])
def test_rule_rejects_bad_lora_fields(kw, msg):
  with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")
                     .replace("[", r"\[")):
    qtrain.QtRule(module_path=".*", **kw)


def test_rule_lora_scale_and_activity():
  r = qtrain.QtRule(module_path=".*", lora_rank=8, lora_alpha=16)
  assert r.lora_scale == 2.0 and r.active and r.has_lora and not r.quantizes and r.has_state
  assert qtrain.QtRule(module_path=".*", lora_rank=4).lora_scale == 1.0
  assert not qtrain.QtRule(module_path=".*").active


# ----------------------------------------------------------------------------- numerics


class TwoLayouts(nn.Module):
  """Dense, a 3-D DenseGeneral contracting two axes, and a weight as the dot's lhs."""

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((4, 6), name="up")(x)                       # (B, 4, 6)
    h = nn.DenseGeneral(12, axis=(-2, -1), name="down")(jnp.tanh(h))  # (B, 12)
    w = self.param("w", nn.initializers.normal(0.3), (5, 12))
    return jax.lax.dot_general(w, h, (((1,), (1,)), ((), ())))        # (5, B): weight first


def _adapted_reference(model, params, x, scale):
  """The float model's forward in float64 with each adapter's delta added by hand."""
  p = jax.tree.map(_w64, params)
  x = _w64(x)
  up = p["up"]
  h = np.einsum("bk,kij->bij", x, up["kernel"]) + up["bias"]
  h = h + scale * (x @ up["dot_general0_lora_a"] @ up["dot_general0_lora_b"]).reshape(h.shape)
  h = np.tanh(h)
  dn = p["down"]
  hf = h.reshape(h.shape[0], -1)
  y = np.einsum("bij,ijn->bn", h, dn["kernel"]) + dn["bias"]
  y = y + scale * (hf @ dn["dot_general0_lora_a"] @ dn["dot_general0_lora_b"])
  out = p["w"] @ y.T
  out = out + scale * (y @ p["dot_general0_lora_a"] @ p["dot_general0_lora_b"]).T
  return out


@pytest.mark.slow
def test_float_base_adapters_match_a_float64_reference():
  rule = qtrain.QtRule(module_path=".*", lora_rank=3, lora_alpha=6.0)
  qm = qtrain.quantize_model(TwoLayouts(), qtrain.QtProvider([rule]))
  x = jax.random.normal(jax.random.key(0), (7, 10))
  v = qm.init(jax.random.key(1), x)
  shapes = jax.tree.map(jnp.shape, v["params"])
  assert shapes["up"]["dot_general0_lora_a"] == (10, 3)
  assert shapes["up"]["dot_general0_lora_b"] == (3, 24)
  assert shapes["down"]["dot_general0_lora_a"] == (24, 3)
  assert shapes["dot_general0_lora_a"] == (12, 3) and shapes["dot_general0_lora_b"] == (3, 5)
  params = _randomize_adapters(v["params"])
  got = qm.apply({"params": params}, x)
  want = _adapted_reference(TwoLayouts(), params, x, scale=2.0)
  np.testing.assert_allclose(_w64(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.slow
def test_fresh_adapters_leave_the_quantized_model_unchanged():
  """B starts at zero: the adapted QT model computes exactly what the QT model does."""
  base = dict(module_path=".*", weight_qtype="int4", act_qtype="int8", tile_size=2)
  x = jax.random.normal(jax.random.key(0), (7, 10))
  qa = qtrain.quantize_model(TwoLayouts(), qtrain.QtProvider([qtrain.QtRule(**base, lora_rank=2)]))
  qb = qtrain.quantize_model(TwoLayouts(), qtrain.QtProvider([qtrain.QtRule(**base)]))
  va = qa.init(jax.random.key(1), x)
  vb = qb.init(jax.random.key(1), x)
  adapters, rest = lora.split(va["params"])
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), rest, vb["params"]))
  assert float(jnp.abs(adapters["up"]["dot_general0_lora_a"]).max()) > 0
  np.testing.assert_array_equal(qa.apply(va, x), qb.apply(vb, x))


@pytest.mark.slow
def test_einsum_adapter_matches_reference():
  class E(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Einsum((3, 8, 5), "btd,hdk->bthk", name="proj")(x)

  rule = qtrain.QtRule(module_path=".*", lora_rank=2, weight_qtype="int8")
  prov = qtrain.QtProvider([rule])
  qm = qtrain.quantize_model(E(), prov)
  x = jax.random.normal(jax.random.key(0), (2, 4, 8))
  v = qm.init(jax.random.key(1), x)
  params = _randomize_adapters(v["params"])
  got = qm.apply({"params": params}, x)
  base = qtrain.quantize_model(E(), qtrain.QtProvider([qtrain.QtRule(module_path=".*",
                                                                     weight_qtype="int8")]))
  b_out = base.apply({"params": lora.split(params)[1]}, x)
  p = params["proj"]
  # The weight (h, d, k) contracts d; its free axes (h, k) flatten to N = 3 * 5.
  d = (_w64(x) @ _w64(p["einsum0_lora_a"]) @ _w64(p["einsum0_lora_b"]))
  want = _w64(b_out) + d.reshape(2, 4, 3, 5)
  np.testing.assert_allclose(_w64(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_mixed_dtypes_compute_in_the_output_dtype():
  class D(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, dtype=jnp.bfloat16)(x)

  qm = qtrain.quantize_model(D(), qtrain.QtProvider([qtrain.QtRule(module_path=".*",
                                                                   lora_rank=4)]))
  x = jax.random.normal(jax.random.key(0), (3, 8), jnp.float32)
  v = qm.init(jax.random.key(1), x)
  assert v["params"]["Dense_0"]["dot_general0_lora_a"].dtype == jnp.float32
  assert qm.apply(v, x).dtype == jnp.bfloat16


@pytest.mark.slow
def test_empty_batch():
  qm = qtrain.quantize_model(nn.Dense(4), qtrain.QtProvider([qtrain.QtRule(
      module_path=".*", weight_qtype="int8", act_qtype="int8", lora_rank=2)]))
  v = qm.init(jax.random.key(1), jnp.ones((2, 8)))
  assert qm.apply(v, jnp.zeros((0, 8))).shape == (0, 4)


@pytest.mark.slow
def test_lora_rule_on_a_convolution_raises_naming_the_layer():
  class C(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.Conv(4, (3, 3), name="conv")(x).reshape(x.shape[0], -1))

  qm = qtrain.quantize_model(C(), qtrain.QtProvider([qtrain.QtRule(module_path=".*",
                                                                   lora_rank=2)]))
  with pytest.raises(ValueError, match=r"lora_rank=2 and matches conv_general_dilated in "
                                       r"module 'conv'.*op_names=\('dot_general', 'einsum'\)"):
    qm.init(jax.random.key(0), jnp.ones((1, 6, 6, 2)))


# ----------------------------------------------------------------------------- training


def _mlp():
  return nn.Sequential([nn.Dense(32), nn.gelu, nn.Dense(32), nn.gelu, nn.Dense(4)])


def _data(n=64):
  x = jax.random.normal(jax.random.key(10), (n, 12))
  w = jax.random.normal(jax.random.key(11), (12, 4))
  return x, jnp.tanh(x @ w)


@pytest.mark.slow
def test_only_adapters_get_gradients_and_dropout_needs_a_key():
  rule = qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8", lora_rank=4,
                       lora_dropout=0.5)
  qm = qtrain.quantize_model(_mlp(), qtrain.QtProvider([rule]))
  x, y = _data()
  v = qm.init(jax.random.key(0), x)
  adapters, rest = lora.split(_randomize_adapters(v["params"]))

  def loss(ad, rngs=None):
    out = qm.apply({"params": lora.combine(ad, rest)}, x, rngs=rngs)
    return jnp.mean((out - y) ** 2)

  g = jax.grad(loss)(adapters)
  assert set(traverse_util.flatten_dict(g)) == set(traverse_util.flatten_dict(adapters))
  assert all(float(jnp.abs(t).max()) > 0 for t in jax.tree.leaves(g))
  # No "dropout" key: evaluation, deterministic; with keys: dropout, differing per key.
  assert float(loss(adapters)) == float(loss(adapters))
  l1 = float(loss(adapters, {"dropout": jax.random.key(1)}))
  l2 = float(loss(adapters, {"dropout": jax.random.key(2)}))
  assert l1 != l2 and l1 != float(loss(adapters))
  mask = lora.adapter_mask(v["params"])
  assert mask["layers_0"]["dot_general0_lora_a"] and not mask["layers_0"]["kernel"]
  n_ad, n_rest = lora.num_params(v["params"])
  assert n_ad == (12 * 4 + 4 * 32) + (32 * 4 + 4 * 32) + (32 * 4 + 4 * 4)
  assert n_rest == 12 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4


@pytest.mark.slow
def test_dropout_rate_and_inverted_scaling():
  lay = lora_ops.layout((64, 8), (((1,), (0,)), ((), ())), weight_operand=1)
  x = jnp.ones((4000, 64))
  a = jnp.eye(64, 1)   # picks input feature 0
  b = jnp.ones((1, 8))
  d = lora_ops.delta(x, a, b, lay, scale=1.0, dropout=0.25, key=jax.random.key(0))
  kept = np.asarray(d[:, 0])
  vals = np.unique(kept)
  assert len(vals) == 2 and vals[0] == 0.0
  np.testing.assert_allclose(vals[1], 1 / 0.75, rtol=1e-6)
  frac = float(np.mean(kept > 0))
  assert abs(frac - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 4000)


def test_split_and_combine_errors():
  with pytest.raises(ValueError, match="hold no adapter"):
    lora.split({"Dense_0": {"kernel": jnp.ones((2, 2))}})
  with pytest.raises(ValueError, match="in both trees"):
    lora.combine({"a": {"k_lora_a": 1}}, {"a": {"k_lora_a": 2}})


# ----------------------------------------------------------------------------- merge


@pytest.mark.slow
def test_merge_folds_adapters_into_float_weights():
  rule = qtrain.QtRule(module_path=".*", lora_rank=3, lora_alpha=1.5)
  prov = qtrain.QtProvider([rule])
  qm = qtrain.quantize_model(TwoLayouts(), prov)
  x = jax.random.normal(jax.random.key(0), (7, 10))
  v = qm.init(jax.random.key(1), x)
  v = {"params": _randomize_adapters(v["params"])}
  merged = lora.merge(v, prov)
  assert not any(lora.is_adapter(k[-1]) for k in traverse_util.flatten_dict(merged["params"]))
  want = qm.apply(v, x)
  got = TwoLayouts().apply(merged, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  with pytest.raises(ValueError, match="must be the qtrain.QtProvider"):
    lora.merge(v, [rule])


class Partitioned(nn.Module):
  """Boxed parameters (nn.with_partitioning): a Dense kernel and a user module's own weight."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(12, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                      (None, "model")), name="up")(x)
    w = self.param("w", nn.with_partitioning(nn.initializers.normal(0.3), ("model", None)),
                   (12, 5))
    return jnp.tanh(h) @ w


@pytest.mark.slow
def test_merge_folds_adapters_into_partitioned_weights():
  rule = qtrain.QtRule(module_path=".*", lora_rank=2, lora_alpha=3.0)
  prov = qtrain.QtProvider([rule])
  qm = qtrain.quantize_model(Partitioned(), prov)
  x = jax.random.normal(jax.random.key(0), (7, 10))
  v = qm.init(jax.random.key(1), x)
  assert isinstance(v["params"]["up"]["kernel"], nn.Partitioned)
  v = {"params": _randomize_adapters(v["params"])}   # the boxes stay (flatten_dict's leaves)
  merged = lora.merge(v, prov)
  flat = traverse_util.flatten_dict(merged["params"], is_leaf=lambda _, x: isinstance(
      x, nn.Partitioned))
  assert sorted(flat) == [("up", "bias"), ("up", "kernel"), ("w",)]
  for key, names in ((("up", "kernel"), (None, "model")), (("w",), ("model", None))):
    assert isinstance(flat[key], nn.Partitioned) and flat[key].names == names
  want = qm.apply(v, x)
  assert float(jnp.abs(want - Partitioned().apply(v, x)).max()) > 0.01  # the adapters count
  got = Partitioned().apply(merged, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


# ----------------------------------------------------------------------------- QLoRA


@pytest.mark.slow
@pytest.mark.parametrize("wq, extra", [("int4", dict(tile_size=4)), ("int8", {}),
                                       ("ternary", {})])
def test_qlora_frozen_base_matches_the_quantized_model_and_its_gradients(wq, extra):
  rule = qtrain.QtRule(module_path=".*", weight_qtype=wq, lora_rank=4, lora_alpha=8.0, **extra)
  prov = qtrain.QtProvider([rule])
  model = _mlp()
  qm = qtrain.quantize_model(model, prov)
  x, y = _data()
  v = qm.init(jax.random.key(0), x)
  v = {"params": _randomize_adapters(v["params"])}
  frozen = freeze.freeze(v, prov)
  assert sorted(frozen["layers"]) == ["layers_0", "layers_2", "layers_4"]
  assert all("kernel" not in m for m in frozen["variables"]["params"].values())
  adapters, rest = lora.split(frozen["variables"]["params"])

  def qlora_loss(ad):
    fv = {**frozen["variables"], "params": lora.combine(ad, rest)}
    out = freeze.apply_frozen(model, {**frozen, "variables": fv}, x, implementation="xla")
    return jnp.mean((out - y) ** 2), out

  def qt_loss(ad):
    _, r = lora.split(v["params"])
    out = qm.apply({"params": lora.combine(ad, r)}, x)
    return jnp.mean((out - y) ** 2), out

  (lf, of), gf = jax.value_and_grad(qlora_loss, has_aux=True)(adapters)
  (lq, oq), gq = jax.value_and_grad(qt_loss, has_aux=True)(adapters)
  scale = float(jnp.abs(oq).max())
  np.testing.assert_allclose(of, oq, rtol=1e-5, atol=1e-5 * scale)
  for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gq)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


@pytest.mark.slow
def test_qlora_training_reduces_the_loss_with_state_for_adapters_only():
  rule = qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=4, lora_rank=4,
                       lora_alpha=8.0, lora_dropout=0.1)
  prov = qtrain.QtProvider([rule])
  model = _mlp()
  x, y = _data()
  v = qtrain.quantize_model(model, prov).init(jax.random.key(0), x)
  frozen = freeze.freeze(v, prov)
  adapters, rest = lora.split(frozen["variables"]["params"])
  tx = optax.adamw(3e-3)
  state = tx.init(adapters)
  n_state = sum(int(np.prod(np.shape(t))) for t in jax.tree.leaves(state))
  assert n_state == 2 * lora.num_params(frozen["variables"]["params"])[0] + 1  # mu, nu, count

  @jax.jit
  def step(ad, state, frozen_layers, k):
    def loss(ad):
      fv = {**frozen["variables"], "params": lora.combine(ad, rest)}
      out = freeze.apply_frozen(model, {"layers": frozen_layers, "variables": fv}, x,
                                rngs={"dropout": k})
      return jnp.mean((out - y) ** 2)
    l, g = jax.value_and_grad(loss)(ad)
    u, state = tx.update(g, state, ad)
    return optax.apply_updates(ad, u), state, l

  losses = []
  for i in range(60):
    adapters, state, l = step(adapters, state, frozen["layers"], jax.random.key(i))
    losses.append(float(l))
  assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.slow
def test_frozen_products_pass_the_float_gradient_to_their_input():
  """dot and conv: d/dx of the frozen op = the float op's with the dequantized weight."""
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(6, (3, 3), padding="SAME", name="conv")(x)
      return nn.Dense(5, name="fc")(h.reshape(h.shape[0], -1))

  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4",
                                          act_qtype="int8")])
  net = Net()
  x = jax.random.normal(jax.random.key(0), (2, 5, 5, 3))
  v = qtrain.quantize_model(net, prov).init(jax.random.key(1), x)
  frozen = freeze.freeze(v, prov)
  ct = jax.random.normal(jax.random.key(2), (2, 5))
  gx = jax.grad(lambda x: jnp.sum(freeze.apply_frozen(net, frozen, x) * ct))(x)
  # Reference: float64 products with the dequantized weights (input quantization: STE).
  wc = _w64(frozen["layers"]["conv"].kernel_qarray().dequantize())
  wf = _w64(frozen["layers"]["fc"].kernel_qarray().dequantize())
  g_flat = _w64(ct) @ wf.T                                    # d/dh
  g_h = g_flat.reshape(2, 5, 5, 6)
  # d/dx of a SAME 3x3 conv: correlate g_h with the flipped, transposed kernel.
  gx_ref = np.asarray(jax.lax.conv_general_dilated(
      jnp.asarray(g_h, jnp.float32), jnp.asarray(np.flip(wc, (0, 1)).transpose(0, 1, 3, 2),
                                                 jnp.float32),
      (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), np.float64)
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-4 * np.abs(gx_ref).max())


@pytest.mark.slow
def test_freeze_folds_adapters_of_float_ops_and_keeps_quantized_ones():
  rules = [qtrain.QtRule(module_path="layers_4", lora_rank=2),            # float + adapter
           qtrain.QtRule(module_path=".*", weight_qtype="int8", lora_rank=2)]
  prov = qtrain.QtProvider(rules)
  model = _mlp()
  qm = qtrain.quantize_model(model, prov)
  x, _ = _data(8)
  v = {"params": _randomize_adapters(qm.init(jax.random.key(0), x)["params"])}
  frozen = freeze.freeze(v, prov)
  assert sorted(frozen["layers"]) == ["layers_0", "layers_2"]
  assert frozen["layers"]["layers_0"].lora_dict == {"dropout": 0.0, "scale": 1.0}
  p4 = frozen["variables"]["params"]["layers_4"]
  assert sorted(p4) == ["bias", "kernel"]
  assert "dot_general0_lora_a" in frozen["variables"]["params"]["layers_0"]
  want = qm.apply(v, x)
  got = freeze.apply_frozen(model, frozen, x, implementation="xla")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_frozen_adapters_survive_save_and_load(tmp_path):
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=4,
                                          lora_rank=2, lora_alpha=4.0)])
  model = _mlp()
  x, _ = _data(8)
  v = {"params": _randomize_adapters(qtrain.quantize_model(model, prov)
                                     .init(jax.random.key(0), x)["params"])}
  frozen = freeze.freeze(v, prov)
  freeze.save_frozen(str(tmp_path / "ck"), frozen)
  back = freeze.load_frozen(str(tmp_path / "ck"))
  assert back["layers"]["layers_0"].lora == frozen["layers"]["layers_0"].lora
  np.testing.assert_array_equal(freeze.apply_frozen(model, back, x),
                                freeze.apply_frozen(model, frozen, x))


# ----------------------------------------------------------------------------- nnx


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(12, 32, rngs=rngs)
    self.l2 = nnx.LinearGeneral(32, (4, 8), rngs=rngs)
    self.l3 = nnx.LinearGeneral((4, 8), 4, axis=(-2, -1), rngs=rngs)

  def __call__(self, x):
    return self.l3(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


def _nnx_randomize(model, seed=0):
  rng = np.random.default_rng(seed)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.3, jnp.float32))


@pytest.mark.slow
def test_nnx_needs_sample_inputs_and_a_params_stream():
  x, _ = _data(4)
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", lora_rank=2)])
  with pytest.raises(ValueError, match=r"rngs=nnx.Rngs\(params=seed\)"):
    qtrain.quantize_model(NnxNet(nnx.Rngs(0)), prov, x)
  with pytest.raises(ValueError, match="pass sample inputs"):
    qtrain.quantize_model(NnxNet(nnx.Rngs(0)), prov, rngs=nnx.Rngs(params=1))
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", lora_rank=2, lora_dropout=0.1)])
  with pytest.raises(ValueError, match=r"rngs=nnx.Rngs\(dropout=seed\)"):
    qtrain.quantize_model(NnxNet(nnx.Rngs(0)), prov, x, rngs=nnx.Rngs(params=1))


@pytest.mark.slow
def test_nnx_lora_trains_adapters_only_and_merges_and_freezes():
  x, y = _data()
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=4,
                                          lora_rank=4, lora_alpha=8.0, lora_dropout=0.1)])
  m = qtrain.quantize_model(NnxNet(nnx.Rngs(0)), prov, x, rngs=nnx.Rngs(params=1, dropout=2))
  assert isinstance(m.l1.dot_general.lora_a, nnx.LoRAParam)
  assert m.l2.dot_general.lora_b.shape == (4, 32)
  frozen_params = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  base = jax.tree.map(jnp.copy, nnx.state(m, frozen_params))
  opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(m, opt):
    def loss(m):
      return jnp.mean((m(x) - y) ** 2)
    l, g = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
    opt.update(m, g)
    return l

  losses = [float(step(m, opt)) for _ in range(40)]
  assert losses[-1] < 0.7 * losses[0]
  after = nnx.state(m, frozen_params)
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), base, after)
  assert all(jax.tree.leaves(same)), "only the adapters may change"
  m.eval()
  out = m(x)
  assert bool(jnp.all(out == m(x)))   # eval: no dropout
  # Freeze: packed int4 base, adapters kept beside it, the same predictions.
  fm = freeze.freeze(m)
  assert isinstance(fm.l1.dot_general, freeze.FrozenOp)
  assert isinstance(fm.l1.dot_general.lora_a, nnx.LoRAParam)
  fm.eval()
  np.testing.assert_allclose(fm(x), out, rtol=1e-5, atol=1e-5 * float(jnp.abs(out).max()))
  # Merge into a float model: what the adapted model computes with float base weights.
  mm = lora.merge(m)
  assert not isinstance(mm.l1.dot_general, qtrain.QtOp)
  want = _nnx_float_adapted(m, x)
  np.testing.assert_allclose(mm(x), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def _nnx_float_adapted(m, x):
  """NnxNet's float forward with each adapter added by hand (float64)."""
  def lin(layer, h):
    k = _w64(layer.kernel[...])
    op = layer.dot_general
    a, b = _w64(op.lora_a[...]), _w64(op.lora_b[...])
    hf = h.reshape(h.shape[0], -1)
    base = hf @ k.reshape(hf.shape[1], -1)
    out = base + 2.0 * hf @ a @ b + _w64(layer.bias[...]).reshape(-1)
    return out
  h = np.asarray(jax.nn.gelu(lin(m.l1, _w64(x))))
  h = np.asarray(jax.nn.gelu(lin(m.l2, h)))
  return lin(m.l3, h)


@pytest.mark.slow
def test_nnx_frozen_adapters_survive_save_and_load(tmp_path):
  x, _ = _data(8)
  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4", tile_size=4,
                                          lora_rank=4, lora_dropout=0.1)])
  m = qtrain.quantize_model(NnxNet(nnx.Rngs(0)), prov, x, rngs=nnx.Rngs(params=1, dropout=2))
  _nnx_randomize(m)
  fm = freeze.freeze(m)
  fm.eval()
  freeze.save_frozen(str(tmp_path / "ck"), fm)
  back = freeze.load_frozen(str(tmp_path / "ck"), nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0))))
  back.eval()
  assert isinstance(back.l3.dot_general.lora_b, nnx.LoRAParam)
  np.testing.assert_array_equal(back(x), fm(x))
  assert float(jnp.abs(back(x) - freeze.freeze(_strip_adapters(m))(x)).max()) > 0


def _strip_adapters(m):
  """The same model with its adapters zeroed (what the base alone computes)."""
  m = nnx.clone(m)
  for _, var in nnx.iter_graph(m):
    if isinstance(var, nnx.LoRAParam):
      var.set_value(jnp.zeros_like(var[...]))
  m.eval()
  return m


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("wq, extra", [("int4", dict(tile_size=64)), ("int8", {})])
def test_qlora_on_gpu_kernels_matches_xla_gpu(wq, extra):
  """bf16 activations x the packed base through the GPU kernels ("triton"), and the gradients
  the adapters get, agree with the XLA path (dequantized weight) to bf16 rounding."""
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(1024, dtype=jnp.bfloat16, name="up")(x))
      return nn.Dense(256, dtype=jnp.bfloat16, name="down")(h)

  prov = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype=wq, lora_rank=8,
                                          **extra)])
  model = Block()
  x = jax.random.normal(jax.random.key(0), (512, 256), jnp.float32).astype(jnp.bfloat16)
  v = qtrain.quantize_model(model, prov).init(jax.random.key(1), x)
  frozen = freeze.freeze({"params": _randomize_adapters(v["params"])}, prov)
  adapters, rest = lora.split(frozen["variables"]["params"])

  def run(ad, impl):
    fv = {"params": lora.combine(ad, rest)}
    out = freeze.apply_frozen(model, {"layers": frozen["layers"], "variables": fv}, x,
                              implementation=impl)
    return jnp.mean(out.astype(jnp.float32) ** 2), out

  (la, oa), ga = jax.jit(jax.value_and_grad(lambda a: run(a, "triton"), has_aux=True))(adapters)
  (lx, ox), gx = jax.jit(jax.value_and_grad(lambda a: run(a, "xla"), has_aux=True))(adapters)
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) /
                           jnp.linalg.norm(b.astype(jnp.float32)))
  assert rel(oa, ox) < 2**-6
  for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gx)):
    assert rel(a, b) < 2**-5
