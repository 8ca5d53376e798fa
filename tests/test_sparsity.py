"""N:M structured sparsity (qtrain.sparsity): the mask against an independent reference, its
gradient, and rules that prune a weight / an activation in QT, freeze and qwix's PTQ."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qtrain
from qtrain import freeze, qwix
from qtrain.sparsity import Sparsity, mask, sparsify


def _reference_mask(x: np.ndarray, n, m, order="R", block_size=0, offset=0) -> np.ndarray:
  """The N:M mask by explicit group assignment: each value (or block) of the grouped array gets
  (group id, slot); in each group the n largest magnitudes are kept, ties to the lower slot."""
  a = np.abs(np.asarray(x, np.float64))
  if order == "C":
    a = np.swapaxes(a, -1, -2)
  bs = block_size if block_size > 1 else 1
  s = a.reshape(a.shape[:-1] + (a.shape[-1] // bs, bs)).sum(-1)
  step = max(offset, 1)
  last = s.shape[-1]
  rowwise = last % (m * step) == 0
  flat = s.reshape(-1)
  groups: dict = {}
  for f in range(flat.size):
    row, p = (divmod(f, last) if rowwise else (0, f))
    run, within = divmod(p, m * step)
    groups.setdefault((row, run, within % step), []).append((within // step, f))
  keep = np.zeros(flat.size, bool)
  for members in groups.values():
    assert len(members) == m
    members.sort()
    order_ = sorted(range(m), key=lambda i: (-flat[members[i][1]], i))
    for i in order_[:n]:
      keep[members[i][1]] = True
  keep = np.repeat(keep.reshape(s.shape), bs, axis=-1)
  return np.swapaxes(keep, -1, -2) if order == "C" else keep


CASES = [
    ((6, 8), dict(n=2, m=4)),
    ((6, 8), dict(n=1, m=4, order="C")),            # swapped (8, 6): 6 % 4, all flattened
    ((8, 6), dict(n=3, m=4, order="C")),            # along the second-to-last axis (8)
    ((3, 5, 4), dict(n=2, m=4)),
    ((5, 4, 3), dict(n=1, m=2)),                    # last axis 3: the whole array flattened
    ((2, 16), dict(n=2, m=4, offset=2)),            # values 2 apart in runs of 8
    ((4, 6), dict(n=1, m=4, offset=3)),             # 6 % 12: flattened runs of 12
    ((4, 16), dict(n=1, m=2, block_size=4)),        # blocks of 4 kept or pruned whole
    ((12, 4), dict(n=2, m=3, order="C", block_size=2)),
    ((4, 8), dict(n=4, m=4)),                       # nothing pruned
]


@pytest.mark.parametrize("shape, kw", CASES)
@pytest.mark.thin(5)
def test_mask_matches_the_reference_on_random_values(shape, kw):
  for seed in range(3):
    x = jax.random.normal(jax.random.key(seed), shape)
    got = np.asarray(mask(x, Sparsity(**kw)))
    np.testing.assert_array_equal(got, _reference_mask(np.asarray(x), **kw))
    y = np.asarray(sparsify(x, Sparsity(**kw)))
    np.testing.assert_array_equal(y, np.where(got, np.asarray(x), 0))
  kept = got.sum() / got.size
  assert kept == pytest.approx(kw["n"] / kw["m"])


def test_ties_keep_the_earlier_values_and_the_gradient_reaches_the_kept_ones():
  """All-equal magnitudes keep the first n of each group (qwix's 2:4 of ones: 2.0); the
  gradient of sum(c * sparsify(x)) is c on the kept values, 0 on the pruned."""
  np.testing.assert_array_equal(np.asarray(mask(jnp.ones((4, 1)), Sparsity(2, 4)))[:, 0],
                                [True, True, False, False])
  x = jax.random.normal(jax.random.key(0), (4, 8))
  c = jax.random.normal(jax.random.key(1), (4, 8))
  g = jax.grad(lambda v: jnp.sum(c * sparsify(v, Sparsity(2, 4))))(x)
  np.testing.assert_array_equal(np.asarray(g), np.where(np.asarray(mask(x, Sparsity(2, 4))),
                                                        np.asarray(c), 0))
  assert sparsify(x, None) is x


@pytest.mark.parametrize("kw, words", [
    (dict(n=0, m=4), r"n=0 must be in \[1, m=4\]"),
    (dict(n=5, m=4), r"n=5 must be in \[1, m=4\]"),
    (dict(n=1, m=0), "m=0 must be >= 1"),
    (dict(n=1, m=2, order="X"), r"order='X'; valid: \['R', 'C'\]"),
    (dict(n=1, m=2, offset=-1), "offset=-1 must be >= 0"),
    (dict(n=1, m=2, block_size=1.5), "block_size=1.5 must be an int"),
])
def test_bad_sparsity_raises_naming_the_value(kw, words):
  with pytest.raises(ValueError, match=words):
    Sparsity(**kw)


@pytest.mark.parametrize("shape, kw, words", [
    ((3, 3), dict(n=1, m=4), r"9 values \(shape \(3, 3\)\) do not split into groups of m=4"),
    ((8,), dict(n=1, m=4, order="C"), "order='C' groups along the second-to-last axis"),
    ((4, 6), dict(n=1, m=2, block_size=4), "block_size=4 does not divide"),
    ((4, 4), dict(n=1, m=4, offset=3), "must split into runs of m \\* offset = 12"),
])
def test_shapes_the_groups_do_not_fit_raise(shape, kw, words):
  with pytest.raises(ValueError, match=words):
    mask(jnp.ones(shape), Sparsity(**kw), what="the weight")


def test_rule_fields_take_pairs_and_sparsity_and_check_them():
  r = qtrain.QtRule(weight_qtype="int8", weight_sparsity=(2, 4), act_sparsity=Sparsity(1, 2))
  assert r.weight_sparsity == Sparsity(2, 4) and r.act_sparsity == Sparsity(1, 2)
  assert "w_sparsity=2:4" in r.short() and "a_sparsity=1:2" in r.short()
  with pytest.raises(ValueError, match="weight_sparsity=2:4 needs weight_qtype"):
    qtrain.QtRule(act_qtype="int8", weight_sparsity=(2, 4))
  with pytest.raises(ValueError, match=r"act_sparsity=\(3, 2\): Invalid Sparsity: n=3"):
    qtrain.QtRule(weight_qtype="int8", act_sparsity=(3, 2))
  with pytest.raises(ValueError, match="weight_sparsity=4; valid: None, \\(n, m\\)"):
    qtrain.QtRule(weight_qtype="int8", weight_sparsity=4)
  with pytest.raises(ValueError, match="sparsity applies to dot_general and einsum ops"):
    qtrain.QtRule(weight_qtype="int8", weight_sparsity=(2, 4),
                  op_names=("conv_general_dilated",))


# ----------------------------------------------------------------------------
# In QT, freeze and PTQ.


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))


def _bound_w8(x, w):
  """|x . w_q - x . w| for an int8 absmax per-output-channel w: sum_k |x_k| s_n / 2."""
  s = np.abs(w).max(0, keepdims=True) / 127
  return np.abs(x) @ np.ones_like(w) * s / 2


@pytest.mark.slow
def test_qt_prunes_the_weight_before_quantizing_it():
  """QtRule(weight_sparsity=(2, 4)) on a Dense (kernel (16, 8)): the forward is x times the
  pruned kernel quantized (int8 per channel of the pruned values), within that rounding of a
  float64 reference, not the dense one's; the pruned values get no gradient."""
  rules = [qtrain.QtRule(module_path=".*", weight_qtype="int8", weight_sparsity=(2, 4))]
  x = jax.random.normal(jax.random.key(0), (6, 16))
  qm = qtrain.quantize_model(nn.Dense(8, use_bias=False), qtrain.QtProvider(rules))
  v = qm.init(jax.random.key(1), x)
  w = np.asarray(v["params"]["kernel"], np.float64)
  keep = _reference_mask(w, 2, 4)
  wp = np.where(keep, w, 0)
  got = np.asarray(qm.apply(v, x), np.float64)
  xf = np.asarray(x, np.float64)
  assert np.all(np.abs(got - xf @ wp) <= _bound_w8(xf, wp) + 1e-5)
  assert np.abs(got - xf @ w).max() > 10 * _bound_w8(xf, wp).max()
  g = jax.grad(lambda p: jnp.sum(qm.apply({"params": p}, x) ** 2))(v["params"])["kernel"]
  g = np.asarray(g)
  assert np.all(g[~keep] == 0) and np.all(g[keep] != 0)


@pytest.mark.slow
def test_qt_prunes_the_activation_before_quantizing_it():
  """act_sparsity=(1, 2) with int8 weights: x pruned per pair of its last axis (the
  contraction), then the product: within the int8 weight rounding of x_pruned . w."""
  rules = [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_sparsity=(1, 2))]
  x = jax.random.normal(jax.random.key(2), (5, 16))
  qm = qtrain.quantize_model(nn.Dense(8, use_bias=False), qtrain.QtProvider(rules))
  v = qm.init(jax.random.key(1), x)
  w = np.asarray(v["params"]["kernel"], np.float64)
  xp = np.where(_reference_mask(np.asarray(x), 1, 2), np.asarray(x, np.float64), 0)
  got = np.asarray(qm.apply(v, x), np.float64)
  assert np.all(np.abs(got - xp @ w) <= _bound_w8(xp, w) + 1e-5)
  assert np.abs(got - np.asarray(x, np.float64) @ w).max() > 10 * _bound_w8(xp, w).max()


@pytest.mark.slow
def test_freeze_and_ptq_keep_the_pruned_weight(tmp_path):
  """freeze (linen, nnx) and qwix PTQ of sparse rules: the frozen codes are 0 where the rule
  prunes, the frozen input is pruned too, the predictions are the QT forward's bit for bit;
  PTQ params quantized from float params (quantize_params) prune as well; save / load keep
  the sparsity."""
  rules = [qtrain.QtRule(module_path="hidden", weight_qtype="int8", act_qtype="int8",
                         weight_sparsity=(2, 4), act_sparsity=Sparsity(2, 4, order="R")),
           qtrain.QtRule(module_path="out", weight_qtype="int4",
                         weight_sparsity=Sparsity(1, 2, order="C"))]
  x = jax.random.normal(jax.random.key(0), (6, 12))
  p = qtrain.QtProvider(rules)
  qm = qtrain.quantize_model(_Mlp(), p)
  v = qm.init(jax.random.key(1), x)
  want = np.asarray(qm.apply(v, x))
  fz = freeze.freeze(v, p)
  for name, kw in (("hidden", dict(n=2, m=4)), ("out", dict(n=1, m=2, order="C"))):
    codes = np.asarray(fz["layers"][name].kernel_qarray().qvalue)
    keep = _reference_mask(np.asarray(v["params"][name]["kernel"]), **kw)
    assert np.all(codes[~keep] == 0) and np.count_nonzero(codes[keep]) > 0.9 * keep.sum()
  np.testing.assert_array_equal(
      np.asarray(freeze.apply_frozen(_Mlp(), fz, x, implementation="xla")), want)
  freeze.save_frozen(str(tmp_path / "f"), fz)
  back = freeze.load_frozen(str(tmp_path / "f"))
  assert back["layers"]["hidden"].w_sparsity == (2, 4, "R", 0, 0)
  np.testing.assert_array_equal(
      np.asarray(freeze.apply_frozen(_Mlp(), back, x, implementation="xla")), want)
  # qwix PTQ, from float params.
  qrules = [qwix.QtRule(module_path="hidden", weight_qtype="int8", act_qtype="int8",
                        additional_qt_config={"sparsity_rule": qwix.SparsityRule(
                            weight_sparsity_n=2, weight_sparsity_m=4)})]
  ptq = qwix.quantize_model(_Mlp(), qwix.PtqProvider(qrules, implementation="xla"))
  params = qwix.quantize_params(v["params"], jax.eval_shape(ptq.init, jax.random.key(0),
                                                            x)["params"])
  keep = _reference_mask(np.asarray(v["params"]["hidden"]["kernel"]), 2, 4)
  assert np.all(np.asarray(params["hidden"]["kernel"].array.qvalue)[~keep] == 0)
  qt = qwix.quantize_model(_Mlp(), qwix.QtProvider(qrules))
  np.testing.assert_array_equal(np.asarray(ptq.apply({"params": params}, x)),
                                np.asarray(qt.apply(v, x)))
  # nnx.
  lin = nnx.Linear(12, 8, rngs=nnx.Rngs(0))
  qn = qtrain.quantize_model(lin, qtrain.QtProvider([qtrain.QtRule(
      module_path=".*", weight_qtype="int8", weight_sparsity=(2, 4))]), x)
  np.testing.assert_array_equal(np.asarray(freeze.freeze(qn)(x)), np.asarray(qn(x)))


@pytest.mark.slow
def test_sparsity_on_a_convolution_raises():
  rules = [qtrain.QtRule(module_path=".*", weight_qtype="int8", weight_sparsity=(2, 4))]
  qm = qtrain.quantize_model(nn.Conv(4, (3, 3)), qtrain.QtProvider(rules))
  with pytest.raises(ValueError, match="sets N:M sparsity and matches conv_general_dilated in "
                                       "module '': sparsity goes on dot_general and einsum ops"):
    qm.init(jax.random.key(0), jnp.ones((1, 6, 6, 2)))
  with pytest.raises(ValueError, match="its rule sets N:M sparsity, which a list of rules does "
                                       "not freeze"):
    freeze.freeze({"params": {"kernel": jnp.ones((4, 4))}}, rules)
