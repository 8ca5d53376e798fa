"""Binary / MPQ layer semantics against direct jnp implementations of the reference formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtrain import binary, qlayers

jax.config.update("jax_default_matmul_precision", "highest")


def sgn(v):
  return jnp.where(v >= 0, 1.0, -1.0)


def bitorch_reference(x, kernel, bias_a, scale_a, g):
  """bitorch-engine's BinaryLinearForward, written out (kernel (K, N) = torch weight.T)."""
  w = kernel.T                                               # (N, K) as in torch
  xs = x + bias_a
  scale_w = jnp.mean(jnp.abs(w), axis=1)                     # per output channel
  out = (sgn(xs) @ sgn(w).T) * scale_a * scale_w
  grad_input = g @ (sgn(w) * scale_w[:, None])               # (M, K)
  grad_weight = g.T @ (sgn(xs) * scale_a)                    # (N, K)
  q = xs / scale_a
  grad_input = grad_input * ((q >= -1) & (q <= 1))
  grad_scale_a = jnp.sum(grad_input * sgn(xs)) / np.sqrt(xs.size)
  grad_bias_a = jnp.sum(grad_input, axis=0)
  return out, grad_input, grad_weight.T, grad_scale_a, grad_bias_a


def _grads(layer, params, x, g):
  def f(p, x):
    return jnp.sum(layer.apply({"params": p}, x) * g)
  return jax.grad(f, (0, 1))(params, x)


@pytest.mark.slow
def test_bitorch_dense_forward_and_backward_match_formulas():
  k, n, m = 96, 24, 16
  x = jax.random.normal(jax.random.key(0), (m, k)) * 1.5
  layer = qlayers.QDense(n, quant=binary.bitorch(), use_bias=False)
  params = layer.init(jax.random.key(1), x)["params"]
  # Scale_a is initialised at 2 mean|x| (bitorch's symmetric rule).
  np.testing.assert_allclose(params["scale_a"], 2 * jnp.mean(jnp.abs(x)), rtol=1e-6)
  params = dict(params, bias_a=0.3 * jax.random.normal(jax.random.key(2), (k,)),
                scale_a=jnp.float32(1.1))  # some inputs clip (|x / s| > 1), some do not
  g = jax.random.normal(jax.random.key(3), (m, n))
  out, gx, gw, gs, gb = bitorch_reference(x, params["kernel"], params["bias_a"], params["scale_a"], g)
  y = layer.apply({"params": params}, x)
  np.testing.assert_allclose(y, out, rtol=1e-5, atol=1e-5)
  gp, gxx = _grads(layer, params, x, g)
  frac_clipped = float(jnp.mean(jnp.abs((x + params["bias_a"]) / params["scale_a"]) > 1))
  assert 0.1 < frac_clipped < 0.7
  np.testing.assert_allclose(gxx, gx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gp["kernel"], gw, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gp["scale_a"], gs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gp["bias_a"], gb, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bitorch_asymmetric_init_and_no_act():
  x = jax.random.normal(jax.random.key(0), (8, 32))
  p = qlayers.QDense(4, quant=binary.bitorch(asymmetric=True)).init(jax.random.key(1), x)["params"]
  np.testing.assert_allclose(p["scale_a"], 4 * jnp.mean(jnp.abs(x)), rtol=1e-6)
  lw = qlayers.QDense(4, quant=binary.bitorch(binary_act=False), use_bias=False)
  pw = lw.init(jax.random.key(1), x)["params"]
  assert sorted(pw) == ["kernel"]
  w = pw["kernel"]
  ref = x @ (sgn(w) * jnp.mean(jnp.abs(w), axis=0))
  np.testing.assert_allclose(lw.apply({"params": pw}, x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_larq_ste_sign_forward_and_clipped_gradients():
  x = jax.random.normal(jax.random.key(0), (16, 64)) * 1.5
  layer = qlayers.QDense(8, quant=binary.larq(), use_bias=False)
  params = layer.init(jax.random.key(1), x)["params"]
  params = {"kernel": 1.5 * jax.random.uniform(jax.random.key(2), (64, 8), minval=-1, maxval=1)}
  w = params["kernel"]
  g = jax.random.normal(jax.random.key(3), (16, 8))
  np.testing.assert_allclose(layer.apply({"params": params}, x), sgn(x) @ sgn(w), atol=1e-5)
  gp, gx = _grads(layer, params, x, g)
  np.testing.assert_allclose(gx, (g @ sgn(w).T) * (jnp.abs(x) <= 1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gp["kernel"], (sgn(x).T @ g) * (jnp.abs(w) <= 1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_xnor_scales():
  x = jax.random.normal(jax.random.key(0), (16, 64)) * 0.7
  layer = qlayers.QDense(8, quant=binary.xnor(), use_bias=False)
  params = layer.init(jax.random.key(1), x)["params"]
  w = params["kernel"]
  beta = jnp.mean(jnp.abs(x), axis=1, keepdims=True)   # per row (example)
  alpha = jnp.mean(jnp.abs(w), axis=0)                 # per output channel
  ref = (sgn(x) @ sgn(w)) * beta * alpha
  np.testing.assert_allclose(layer.apply({"params": params}, x), ref, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(jax.random.key(3), (16, 8))
  _, gx = _grads(layer, params, x, g)
  # Clipped at |x| > 1 (BNN htanh STE); the incoming gradient times alpha * sign(w).
  np.testing.assert_allclose(gx, (g @ (sgn(w) * alpha).T) * (jnp.abs(x) <= 1), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 32), (2, None), (8, 64)])
def test_mpq_forward_is_minmax_groupwise(bits, group):
  k, n = 128, 16
  x = jax.random.normal(jax.random.key(0), (8, k))
  layer = qlayers.QDense(n, quant=binary.mpq(bits=bits, group_size=group), use_bias=False)
  w = layer.init(jax.random.key(1), x)["params"]["kernel"]
  gs = group or k
  wg = w.reshape(k // gs, gs, n)
  lo = jnp.minimum(wg.min(axis=1, keepdims=True), 0)
  hi = jnp.maximum(wg.max(axis=1, keepdims=True), 0)
  qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  s = (hi - lo) / (qmax - qmin)
  z = jnp.clip(qmin - jnp.round(lo / s), qmin, qmax)
  q = jnp.clip(jnp.round(wg / s + z), qmin, qmax)
  w_hat = ((q - z) * s).reshape(k, n)
  assert len(np.unique(np.asarray(q))) <= 2 ** bits
  np.testing.assert_allclose(layer.apply({"params": {"kernel": w}}, x), x @ w_hat, rtol=1e-5, atol=1e-5)
  # STE: the weight gradient is the float one.
  g = jax.random.normal(jax.random.key(3), (8, n))
  gp, _ = _grads(layer, {"kernel": w}, x, g)
  np.testing.assert_allclose(gp["kernel"], x.T @ g, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["bitorch", "larq", "w4ch"])
def test_conv_1x1_equals_dense(preset):
  lq = binary.mpq(bits=4, group_size=None) if preset == "w4ch" else binary.get_preset(preset)
  c, n = 32, 8
  x = jax.random.normal(jax.random.key(0), (2, 5, 5, c))
  conv = qlayers.QConv(n, (1, 1), quant=lq)
  dense = qlayers.QDense(n, quant=lq)
  pc = conv.init(jax.random.key(1), x)["params"]
  if "bias_a" in pc:
    pc = dict(pc, bias_a=0.2 * jax.random.normal(jax.random.key(4), (c,)))
  pd = dict(pc, kernel=pc["kernel"].reshape(c, n))
  xd = x.reshape(-1, c)
  yc = conv.apply({"params": pc}, x)
  yd = dense.apply({"params": pd}, xd)
  np.testing.assert_allclose(yc.reshape(-1, n), yd, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(jax.random.key(3), yc.shape)
  gpc, gxc = _grads(conv, pc, x, g)
  gpd, gxd = _grads(dense, pd, xd, g.reshape(-1, n))
  np.testing.assert_allclose(gxc.reshape(-1, c), gxd, rtol=1e-4, atol=1e-5)
  for name in gpc:
    np.testing.assert_allclose(gpc[name].reshape(gpd[name].shape), gpd[name], rtol=1e-4,
                               atol=1e-4, err_msg=name)


@pytest.mark.slow
def test_bitorch_conv_padding_contributes_zero():
  """A SAME-padded binary conv: padded positions add 0 (not sign(0 + bias_a))."""
  c, n = 4, 3
  x = jax.random.normal(jax.random.key(0), (1, 4, 4, c))
  conv = qlayers.QConv(n, (3, 3), quant=binary.bitorch(), use_bias=False)
  p = conv.init(jax.random.key(1), x)["params"]
  p = dict(p, bias_a=0.5 * jnp.ones((c,)))
  xs = sgn(x + p["bias_a"])
  w = p["kernel"]
  sw = jnp.mean(jnp.abs(w), axis=(0, 1, 2))
  ref = jax.lax.conv_general_dilated(xs, sgn(w), (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) * p["scale_a"] * sw
  np.testing.assert_allclose(conv.apply({"params": p}, x), ref, rtol=1e-5, atol=1e-5)


def test_presets_and_validation():
  assert set(binary.PRESETS) >= {"bitorch", "larq", "xnor", "w4", "w2"}
  for name in binary.PRESETS:
    binary.get_preset(name).dot_config()
  with pytest.raises(ValueError, match="bits"):
    binary.mpq(bits=3)
  with pytest.raises(ValueError, match="unknown preset"):
    binary.get_preset("nope")
  with pytest.raises(ValueError, match="learn_act_scale"):
    binary.LayerQuant(learn_act_scale=True)
  assert binary.mpq(bits=4, group_size=64).conv_config().rhs.tile_size is None
