"""LoRA and QLoRA: train low-rank adapters on a (quantized, frozen) base model.

A rule with ``lora_rank`` (:class:`~qtrain.QtRule`) gives every
``dot_general`` / ``einsum`` op it matches a trainable adapter: the op
computes ``x . W + (lora_alpha / lora_rank) * dropout(x) . A . B``
(:mod:`qtrain.ops.lora`), ``x . W`` quantized as the rest of the rule says.
``A`` (K, r) starts Gaussian, ``B`` (r, N) at zero, so the adapted model
starts as the base model. The adapters are Flax parameters of the op's
module: linen ``<op id>_lora_a`` / ``<op id>_lora_b`` beside the kernel
(``dot_general0_lora_a``), nnx :class:`~qtrain.flax.model.LoraA` /
:class:`~qtrain.flax.model.LoraB` variables (subclasses of ``nnx.LoRAParam``)
of the op.

Three ways to train them, by how the base weight is stored:

* **LoRA** (float base): a rule with only LoRA fields; train the adapters
  alone (linen: :func:`split` the params and differentiate the adapters;
  nnx: ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``).
* **LoRA on a quantized forward**: the rule also quantizes (``weight_qtype``,
  ``act_qtype``...); the base weight is stored in float and quantized on
  every step, as in quantized training.
* **QLoRA** (quantized, frozen base): train the adapters of a frozen model
  (:func:`qtrain.freeze.freeze`): the base weights are stored packed (int8,
  int4 groups, ...) and never change; :func:`qtrain.freeze.apply_frozen`
  runs the model, its frozen products differentiable with respect to their
  inputs (the float gradient through the dequantized weight), so the loss
  reaches every adapter. Only the adapters are differentiated and only they
  have optimizer state.

Export: :func:`merge` folds the adapters into the base weights (a float model
that computes what the adapted one did); a frozen model keeps its adapters
beside the packed weights (:func:`qtrain.freeze.save_frozen` saves them), and
freezing folds the adapters of ops left in float into their kernels.

Example (QLoRA on a linen model with int4 base weights):
  >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, qtrain
  >>> from qtrain import freeze, lora
  >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
  >>> provider = qtrain.QtProvider([qtrain.QtRule(module_path=".*", weight_qtype="int4",
  ...                                             tile_size=16, lora_rank=4)])
  >>> qmodel = qtrain.quantize_model(model, provider)
  >>> x, y = jax.random.normal(jax.random.key(0), (32, 16)), jnp.ones((32, 8))
  >>> frozen = freeze.freeze(qmodel.init(jax.random.key(1), x), provider)
  >>> adapters, rest = lora.split(frozen["variables"]["params"])
  >>> def loss(adapters):
  ...   v = {**frozen["variables"], "params": lora.combine(adapters, rest)}
  ...   out = freeze.apply_frozen(model, {**frozen, "variables": v}, x)
  ...   return jnp.mean((out - y) ** 2)
  >>> tx = optax.adam(1e-2)
  >>> state = tx.init(adapters)
  >>> l0 = loss(adapters)
  >>> for _ in range(20):
  ...   grads = jax.grad(loss)(adapters)
  ...   updates, state = tx.update(grads, state)
  ...   adapters = optax.apply_updates(adapters, updates)
  >>> bool(loss(adapters) < 0.5 * l0)
  True
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from flax import nnx
from flax import traverse_util
from flax.core import meta as flax_meta

from qtrain import provider as provider_lib
from qtrain.flax import hosts
from qtrain.flax import model as model_lib
from qtrain.flax.model import variable_get, variable_set
from qtrain.ops import lora as lora_ops

__all__ = ["is_adapter", "adapter_mask", "split", "combine", "merge", "merge_params", "num_params"]

_SUFFIXES = ("_" + lora_ops.A_NAME, "_" + lora_ops.B_NAME)


def is_adapter(name: str) -> bool:
  """Whether a linen parameter name is an adapter's (``<op id>_lora_a`` / ``_lora_b``)."""
  return str(name).endswith(_SUFFIXES)


def adapter_mask(params: Mapping) -> dict:
  """A pytree like ``params`` of bools, True at adapter leaves (for ``optax.masked`` or
  ``optax.multi_transform``)."""
  flat = traverse_util.flatten_dict(dict(params))
  return traverse_util.unflatten_dict({k: is_adapter(k[-1]) for k in flat})


def split(params: Mapping) -> tuple[dict, dict]:
  """``(adapters, rest)``: the linen params split into the adapters and everything else
  (nested dicts; :func:`combine` puts them back together)."""
  flat = traverse_util.flatten_dict(dict(params))
  ad = {k: v for k, v in flat.items() if is_adapter(k[-1])}
  if not ad:
    raise ValueError("lora.split: the params hold no adapter (no '*_lora_a' / '*_lora_b' "
                     "parameter): give a rule lora_rank and init the quantized model")
  rest = {k: v for k, v in flat.items() if not is_adapter(k[-1])}
  return traverse_util.unflatten_dict(ad), traverse_util.unflatten_dict(rest)


def combine(adapters: Mapping, rest: Mapping) -> dict:
  """The inverse of :func:`split`."""
  fa, fr = traverse_util.flatten_dict(dict(adapters)), traverse_util.flatten_dict(dict(rest))
  both = sorted(set(fa) & set(fr))
  if both:
    raise ValueError(f"lora.combine: {['/'.join(map(str, k)) for k in both[:4]]} are in both trees")
  return traverse_util.unflatten_dict({**fr, **fa})


def num_params(params) -> tuple[int, int]:
  """``(adapter parameters, other parameters)`` of linen params (counts of values)."""
  flat = traverse_util.flatten_dict(dict(flax_meta.unbox(params)))
  n = lambda ks: int(sum(np.prod(np.shape(flat[k])) for k in ks))
  return n([k for k in flat if is_adapter(k[-1])]), n([k for k in flat if not is_adapter(k[-1])])


def _layouts(provider: provider_lib.QtProvider):
  """(path, op id, rule, Layout) of every op the provider gave an adapter."""
  out = []
  for r in provider.records():
    if r.rule_index is None or r.status not in (provider_lib.QUANTIZED, provider_lib.FLOAT_LORA):
      continue
    rule = provider.rules[r.rule_index]
    if not rule.has_lora:
      continue
    _, dn, shapes, _ = r.contraction
    w = {"lhs": 0, "rhs": 1}[r.weight_operand]
    out.append((r.path, r.op_id, rule, lora_ops.layout(shapes[w], dn, weight_operand=w)))
  return out


def merge_params(params: Mapping, provider: provider_lib.QtProvider, *,
                 keep=lambda path, op_id: False) -> dict:
  """linen params with each adapter folded into its weight and removed, except the ops
  for which ``keep(path, op_id)`` is true (their adapters stay)."""
  flat = traverse_util.flatten_dict(dict(params))
  for path, op_id, rule, lay in _layouts(provider):
    if keep(path, op_id):
      continue
    pre = tuple(path.split("/")) if path else ()
    names = [pre + (f"{op_id}_{n}",) for n in (lora_ops.A_NAME, lora_ops.B_NAME)]
    if any(k not in flat for k in names):
      raise ValueError(f"lora.merge: the params hold no adapter for {op_id} of module "
                       f"{path or '<root>'!r}: pass the params of the model the provider ran with")
    module = {k[-1]: v for k, v in flat.items() if k[:-1] == pre}
    wname = hosts.weight_param_name(module, lay.w_shape, what="lora.merge", where=path or "<root>")
    w = flat[pre + (wname,)]
    a, b = (flax_meta.unbox(flat.pop(k)) for k in names)
    lora_ops.check_shapes(a, b, lay, f"module {path or '<root>'!r}")
    if isinstance(w, flax_meta.AxisMetadata):
      w = w.replace_boxed(lora_ops.fold(w.unbox(), a, b, lay, scale=rule.lora_scale))
    else:
      w = lora_ops.fold(w, a, b, lay, scale=rule.lora_scale)
    flat[pre + (wname,)] = w
  return traverse_util.unflatten_dict(flat)


def fold_nnx_op(node, op, where: str) -> None:
  """Folds the adapter of ``op`` (a QtOp of nnx module ``node``) into the module's weight."""
  rec = [r for r in op.provider.records() if r.path == op.path and r.contraction]
  if len(rec) != 1:
    raise ValueError(f"the op of nnx module {where!r} has not run: call the model once first")
  _, dn, shapes, _ = rec[0].contraction
  lay = lora_ops.layout(shapes[1], dn, weight_operand=1)
  params = {k: v for k, v in vars(node).items()
            if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam)}
  name = hosts.weight_param_name({k: variable_get(v) for k, v in params.items()}, lay.w_shape,
                                 what="LoRA fold", where=where)
  rule = op.provider.rules[rec[0].rule_index]
  a, b = variable_get(getattr(op, lora_ops.A_NAME)), variable_get(getattr(op, lora_ops.B_NAME))
  variable_set(params[name], lora_ops.fold(variable_get(params[name]), a, b, lay,
                                           scale=rule.lora_scale))


def _merge_nnx(model):
  out = nnx.clone(model)
  found = False
  for path, node in list(nnx.iter_graph(out)):
    if not isinstance(node, nnx.Module):
      continue
    for attr in ("dot_general", "einsum_op", "conv_general_dilated"):
      op = vars(node).get(attr)
      if not isinstance(op, model_lib.QtOp):
        continue
      original = op.original
      if getattr(op, lora_ops.A_NAME, None) is not None:
        found = True
        fold_nnx_op(node, op, op.path)
      setattr(node, attr, getattr(nnx, "static", lambda v: v)(original))
  model_lib.float_direct_calls(out)  # a float model: direct calls too
  if not found:
    raise ValueError("lora.merge: this nnx model has no LoRA adapter (quantize it with a rule "
                     "that sets lora_rank, with sample inputs)")
  return out


def merge(variables, provider: provider_lib.QtProvider | None = None):
  """Folds every adapter into its base weight: the float model's variables (linen) or a
  new float nnx model, computing what the adapted model computed (in float; the base
  weights as stored, so a rule's quantization of ``x . W`` is dropped with the rule).

  Args:
    variables: linen: ``{"params": ...}`` (or bare params) of the quantized model.
      nnx: the model quantized by :func:`qtrain.quantize_model` (left as it is).
    provider: linen: the :class:`~qtrain.QtProvider` the model ran with (or the
      quantized model). nnx: None.

  Returns:
    linen: the variables without adapter parameters, each weight ``W`` replaced
    by ``W + (lora_alpha / lora_rank) * A . B`` in its own layout and dtype.
    nnx: a new nnx model whose ops are the float originals and whose weights
    hold the folded sums.
  """
  if isinstance(variables, nnx.Module):
    if provider is not None:
      raise ValueError("lora.merge(model): an nnx model knows its provider; pass no provider")
    return _merge_nnx(variables)
  if isinstance(provider, model_lib.QtLinenModel):
    provider = provider.provider
  if not isinstance(provider, provider_lib.QtProvider):
    raise ValueError(f"lora.merge(variables, provider): provider must be the qtrain.QtProvider "
                     f"the model ran with, got {type(provider).__name__}")
  if not _layouts(provider):
    raise ValueError("lora.merge: the provider recorded no op with an adapter: run the model "
                     "once (init or jax.eval_shape of apply) with a rule that sets lora_rank")
  bare = "params" not in variables
  v = {"params": variables} if bare else dict(variables)
  v["params"] = merge_params(v["params"], provider)
  return v["params"] if bare else v
