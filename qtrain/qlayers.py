"""Flax linen Dense / Conv layers whose product runs through the QT ops.

:class:`QDense` and :class:`QConv` are ``nn.Dense`` / ``nn.Conv`` (same
parameter names and layouts: ``kernel`` (K, N) / HWIO, ``bias``) plus what a
rule-based interception cannot express: the learned input scale ``scale_a``
(a scalar) and the learned per-input-feature shift ``bias_a`` of
bitorch-engine's binary layers (see :mod:`qtrain.binary`). ``quant=None`` (or
a float :class:`~qtrain.binary.LayerQuant`) gives the plain float layer.

When a config asks for stochastic rounding of gradients the layer draws its
key from the ``"quant"`` RNG stream (``rngs={"quant": key}`` in ``apply``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qtrain import binary, qlayers
  >>> layer = qlayers.QDense(8, quant=binary.bitorch())
  >>> x = jax.random.normal(jax.random.key(0), (4, 32))
  >>> params = layer.init(jax.random.key(1), x)["params"]
  >>> sorted(params), params["bias_a"].shape
  (['bias', 'bias_a', 'kernel', 'scale_a'], (32,))
  >>> layer.apply({"params": params}, x).shape
  (4, 8)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from qtrain.binary import LayerQuant
from qtrain.ops.conv_general_qt import conv_general_qt
from qtrain.ops.dot_general_qt import dot_general_qt

__all__ = ["QDense", "QConv", "prepare_input"]

CONV_DN = ("NHWC", "HWIO", "NHWC")


def prepare_input(mod: nn.Module, x: jax.Array, lq: LayerQuant, nfeat: int):
  """Adds the learned shift and returns ``(x + bias_a, scale_a or None)``.

  ``scale_a`` is initialised at ``lq.act_scale_init * mean|x|`` of the init
  batch (bitorch-engine initialises it lazily on the first forward).
  """
  scale = None
  if lq.learn_act_scale:
    x0 = x
    scale = mod.param("scale_a", lambda _: (lq.act_scale_init * jnp.mean(jnp.abs(
        x0.astype(jnp.float32)))).astype(jnp.float32))
  if lq.learn_act_shift:
    bias_a = mod.param("bias_a", nn.initializers.zeros_init(), (nfeat,), jnp.float32)
    x = x + bias_a.astype(x.dtype)
  return x, scale


def _key(mod: nn.Module, lq: LayerQuant):
  return mod.make_rng("quant") if lq.needs_key else None


class QDense(nn.Module):
  """``nn.Dense`` with a quantized product (see the module docstring).

  Attributes:
    features: output features.
    quant: a :class:`~qtrain.binary.LayerQuant`, or None for float.
    use_bias: add a float bias after the product.
    kernel_init, bias_init: initialisers (kernel (K, N), like ``nn.Dense``).
  """

  features: int
  quant: LayerQuant | None = None
  use_bias: bool = True
  kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    k = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (k, self.features), jnp.float32)
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    lq = self.quant
    if lq is None or lq.is_float:
      y = jax.lax.dot_general(x, kernel.astype(x.dtype), dn)
    else:
      x, scale_a = prepare_input(self, x, lq, k)
      y = dot_general_qt(x, kernel.astype(x.dtype), dn, lq.dot_config(), key=_key(self, lq),
                         lhs_scale=scale_a)
    if self.use_bias:
      y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(y.dtype)
    return y


class QConv(nn.Module):
  """``nn.Conv`` (NHWC input, HWIO kernel) with a quantized convolution.

  Attributes:
    features: output channels.
    kernel_size: window, e.g. ``(3, 3)``.
    strides: window strides (default 1).
    padding: ``"SAME"``, ``"VALID"`` or explicit pairs.
    quant: a :class:`~qtrain.binary.LayerQuant`, or None for float.
    use_bias: add a float bias.
  """

  features: int
  kernel_size: Sequence[int] = (3, 3)
  strides: Sequence[int] | None = None
  padding: Any = "SAME"
  quant: LayerQuant | None = None
  use_bias: bool = True
  kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cin = x.shape[-1]
    ks = tuple(self.kernel_size)
    strides = tuple(self.strides) if self.strides else (1,) * len(ks)
    kernel = self.param("kernel", self.kernel_init, ks + (cin, self.features), jnp.float32)
    lq = self.quant
    if lq is None or lq.is_float:
      y = jax.lax.conv_general_dilated(x, kernel.astype(x.dtype), strides, self.padding,
                                       dimension_numbers=CONV_DN)
    else:
      x, scale_a = prepare_input(self, x, lq, cin)
      y = conv_general_qt(x, kernel.astype(x.dtype), strides, self.padding,
                          dimension_numbers=CONV_DN, config=lq.conv_config(), key=_key(self, lq),
                          lhs_scale=scale_a)
    if self.use_bias:
      y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(y.dtype)
    return y
