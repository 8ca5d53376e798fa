"""Each QT op's forward and backward is traced and lowered once per signature
(``qt_operand.traced_once``): same-shaped layers share one function, and the
compiled numbers are those of the op written inline."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qtrain.ops as qops

# The op modules (``qtrain.ops.dot_general_qt`` the package exports as a function) and their
# custom_vjp functions.
MODULES = {name: importlib.import_module(f"qtrain.ops.{name}")
           for name in ("dot_general_qt", "conv_general_qt", "ragged_dot_qt")}
VJPS = {"dot_general_qt": "_dot_general_qt", "conv_general_qt": "_conv_qt",
        "ragged_dot_qt": "_ragged_dot_qt"}

DN = (((1,), (0,)), ((), ()))
GQ = qops.GradQuant(qtype="int8", stochastic_rounding="low_bit_hash")
W8A8G8 = dict(lhs=qops.OperandQuant(qtype="int8"), rhs=qops.OperandQuant(qtype="int8"),
              dlhs_grad=GQ, drhs_grad=GQ)


def _dot(x, w, k):
  return qops.dot_general_qt(x, w, DN, qops.DotGeneralQtConfig(**W8A8G8), key=k)


def _conv(x, w, k):
  return qops.conv_general_qt(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                              config=qops.ConvGeneralQtConfig(**W8A8G8), key=k)


def _ragged(x, w, k):
  sizes = jnp.array([3, 5], jnp.int32)
  return qops.ragged_dot_qt(x, w, sizes, qops.DotGeneralQtConfig(**W8A8G8), key=k)


OPS = {  # op, input shape, weight shape (a layer's output has the input's shape)
    "dot_general_qt": (_dot, (8, 16), (16, 16)),
    "conv_general_qt": (_conv, (2, 5, 5, 4), (3, 3, 4, 4)),
    "ragged_dot_qt": (_ragged, (8, 16), (2, 16, 16)),
}


def _stack(op, x, ws, k):
  for w in ws:
    x = jnp.tanh(op(x, w, k))
  return jnp.sum(x * jnp.arange(x.size, dtype=x.dtype).reshape(x.shape))


@pytest.mark.slow  # 6-11 s each on 2 CPU cores (test_a_new_config_or_shape_traces_again is fast)
@pytest.mark.parametrize("name", sorted(OPS))
def test_same_shaped_layers_share_one_lowered_forward_and_backward(name, monkeypatch):
  op, xs, ws_shape = OPS[name]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
  ws = [jnp.asarray(rng.standard_normal(ws_shape) * 0.3, jnp.float32) for _ in range(3)]
  key = jax.random.key(1)
  grad = jax.grad(lambda ws, x: _stack(op, x, ws, key), (0, 1))
  text = jax.jit(grad).lower(ws, x).as_text()
  defined = re.findall(r"func\.func private @(_forward|_bwd)(_\d+)?\(", text)
  called = re.findall(r"call @(_forward|_bwd)\b", text)
  assert sorted(n for n, _ in defined) == ["_bwd", "_forward"], defined
  assert sorted(called) == ["_bwd"] * 3 + ["_forward"] * 3, called
  got = jax.jit(grad)(ws, x)
  # Inlined (the op's undecorated forward and backward): the same compiled numbers.
  mod = MODULES[name]
  vjp = getattr(mod, VJPS[name])
  monkeypatch.setattr(mod, "_forward", mod._forward.__wrapped__)
  monkeypatch.setattr(vjp, "bwd", vjp.bwd.__wrapped__)
  jax.clear_caches()
  inline = jax.jit(grad)
  assert "call @_forward" not in inline.lower(ws, x).as_text()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(inline(ws, x))):
    assert float(jnp.max(jnp.abs(w))) > 0
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_new_config_or_shape_traces_again(monkeypatch):
  mod = MODULES["dot_general_qt"]
  traces = []  # the backward's body runs once per trace
  real = mod.split_key
  monkeypatch.setattr(mod, "split_key", lambda *a: traces.append(1) or real(*a))
  jax.clear_caches()
  x = jnp.ones((4, 8), jnp.float32)
  w = jnp.full((8, 4), 0.5, jnp.float32)
  g = lambda f: jax.jit(jax.grad(f))(w)  # traced (eager calls run as written)
  g(lambda w: jnp.sum(_dot(x, w, jax.random.key(0))))
  assert len(traces) == 1
  g(lambda w: 2 * jnp.sum(_dot(x, w, jax.random.key(1))))  # another program, same signature
  assert len(traces) == 1
  g(lambda w: jnp.sum(_dot(x[:2], w, jax.random.key(0))))  # another shape
  cfg = qops.DotGeneralQtConfig(**dict(W8A8G8, dlhs_grad=None))  # another config
  g(lambda w: jnp.sum(qops.dot_general_qt(x, w, DN, cfg, key=jax.random.key(0))))
  assert len(traces) == 3


def test_eager_calls_run_as_written_and_trace_nothing():
  # Eagerly (no tracer among the arguments) the forward runs op by op, as the frozen and
  # float layers it is compared with do; only traced calls go through the cached jit.
  fwd = MODULES["dot_general_qt"]._forward.traced
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
  n = fwd._cache_size()
  eager = _dot(x, w, jax.random.key(0))
  assert fwd._cache_size() == n
  dot = jax.jit(_dot)
  assert "call @_forward" in dot.lower(x, w, jax.random.key(0)).as_text()
  jitted = dot(x, w, jax.random.key(0))
  ref = x @ w
  budget = 4 * 2.0**-7 * float(jnp.max(jnp.abs(ref)))  # two int8 operands' rounding
  np.testing.assert_allclose(np.asarray(eager), np.asarray(ref), rtol=0, atol=budget)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=0,
                             atol=1e-5 * float(jnp.max(jnp.abs(ref))))
