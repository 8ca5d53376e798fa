"""qtrain: quantized training for JAX/Flax.

Quantize a Flax model's matmuls and convolutions by rules, then train it with
optax or ``nnx.Optimizer`` exactly as the float model::

  >>> import jax, jax.numpy as jnp, flax.linen as nn, qtrain
  >>> rules = [qtrain.QtRule(module_path=r"layers_0", weight_qtype="int8", act_qtype="int8",
  ...                        bwd_qtype="int8", bwd_stochastic_rounding="uniform"),
  ...          qtrain.QtRule(module_path=r".*", weight_qtype="int4", tile_size=16)]
  >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
  >>> qmodel = qtrain.quantize_model(model, qtrain.QtProvider(rules))
  >>> x = jnp.ones((8, 16))
  >>> variables = qmodel.init(jax.random.key(0), x)
  >>> loss = lambda p: qmodel.apply({"params": p}, x, rngs={"quant": jax.random.key(1)}).sum()
  >>> jax.grad(loss)(variables["params"])["layers_0"]["kernel"].shape
  (16, 32)

Public API: :class:`QtRule`, :class:`QtProvider`, :func:`quantize_model`,
:func:`summary`, :func:`set_calibrate`, the nnx state types
(:class:`QtOp`, :class:`QuantStat`, :class:`ActScale`, :class:`ActShift`),
:data:`RNG_STREAM` (``"quant"``), and the submodules: :mod:`qtrain.binary`
(bitorch-engine / larq / XNOR / MPQ presets), :mod:`qtrain.qlayers`,
:mod:`qtrain.optim` (optax transforms: latent clipping, Bop, stochastic
low-bit weight storage), :mod:`qtrain.freeze` (packed export and inference),
:mod:`qtrain.lora` (LoRA / QLoRA adapters: split, merge), :mod:`qtrain.sparsity` (N:M
structured sparsity), :mod:`qtrain.qwix` (qwix's QT and PTQ API: rules, providers,
``get_unused_rules``, ``quantize_params``), :mod:`qtrain.ops` (the QT ops ``dot_general_qt`` /
``conv_general_qt`` and their configs), :mod:`qtrain.core` (qtypes, QArray, calibration, rounding,
packing) and :mod:`qtrain.kernels` (the Pallas GPU kernels). Everything else
stays reachable through its module (e.g. :class:`qtrain.provider.OpRecord`).
"""

from qtrain import core, kernels, ops
from qtrain.flax.model import (ActScale, ActShift, QtOp, QuantStat, quantize_model, set_calibrate,
                               summary)
from qtrain.provider import RNG_STREAM, QtProvider
from qtrain.rules import QtRule
from qtrain import binary, freeze, lora, optim, qlayers, qwix, sparsity  # noqa: E402  (they build on the names above)

__version__ = "0.1.0"

__all__ = [
    "QtRule", "QtProvider", "quantize_model", "summary", "set_calibrate", "RNG_STREAM",
    "QtOp", "QuantStat", "ActScale", "ActShift",
    "binary", "core", "freeze", "kernels", "lora", "ops", "optim", "qlayers", "qwix", "sparsity",
]
