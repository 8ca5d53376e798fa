"""qtrain.ops.dot_general_qt: forward numerics, gradients, jaxpr, residuals, config errors.

Every op call uses implementation="xla" (the exact XLA reference).

Error budgets:
  * Forward vs the float64 product of the *reference-quantized* operands
    (x_hat = dequantize(quantize(x)) with the documented per-channel / per-tile
    spec): |out - x_hat . w_hat| <= ACC_RTOL * (|x_hat| . |w_hat|). Integer
    products accumulate exactly in int32; what remains is float32 scaling
    (and fp8's float32 accumulation over K terms).
  * Forward vs the float64 product of the *original* operands:
    x_hat w_hat - x w = (x_hat - x) w_hat + x (w_hat - w), so
    |out - x . w| <= E_x . |w_hat| + |x| . E_w (+ the term above), with E the
    per-element quantization budget (int: scale / 2; fp8: 2^-(m+1) |x| or half
    a subnormal step).
  * Gradients, float backward: identical math to the fake-quant
    straight-through reference, so within ACC_RTOL of |g| . |w_hat|.
  * Gradients, int8 backward (round to nearest): the gradient's quantization
    error is <= half its step per element; after folding the residual's
    per-channel scale in, |dlhs - ref| <= (t_i / 2) * sum_n |q_w[j, n]| with
    t_i = max_n |g[i, n] s_w[n]| / 127 (and the same for drhs).
"""

import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _testutil import all_eqns as _all_eqns
from qtrain.ops import config as C
from qtrain.core import qarray
from qtrain.core import qdot as qdot_lib
from qtrain.ops.dot_general_qt import dot_general_qt

dqt = importlib.import_module("qtrain.ops.dot_general_qt")  # the module (the package exports the op)

ACC_RTOL = 2.0 ** -18          # >= K * 2^-24 for K <= 64 (fp8 float32 accumulation) + scaling
HIGHEST = jax.lax.Precision.HIGHEST

# name -> (dimension_numbers, lhs shape, rhs shape)
LAYOUTS = {
    "mk,kn": ((((1,), (0,)), ((), ())), (8, 64), (64, 16)),
    "bmk,bnk": ((((2,), (2,)), ((0,), (0,))), (2, 8, 64), (2, 16, 64)),
    "bmk,kn": ((((2,), (0,)), ((), ())), (2, 8, 64), (64, 16)),
    "mab,abn": ((((1, 2), (0, 1)), ((), ())), (8, 4, 32), (4, 32, 16)),
}

OQ = C.OperandQuant
CONFIGS = {
    "w8a8": (OQ(qtype="int8"), OQ(qtype="int8")),
    "w4t32a16": (None, OQ(qtype="int4", tile_size=32)),
    "w4t32a8": (OQ(qtype="int8"), OQ(qtype="int4", tile_size=32)),
    "w4t64a8t64": (OQ(qtype="int8", tile_size=64), OQ(qtype=jnp.int4, tile_size=64)),
    "w2a8": (OQ(qtype="int8"), OQ(qtype="int2")),
    "binary_absmean": (OQ(qtype="binary", calibration="absmean"),
                       OQ(qtype="binary", calibration="absmean")),
    "ternary_w_a8": (OQ(qtype="int8"), OQ(qtype="ternary")),
    "fp8_e4m3": (OQ(qtype="float8_e4m3fn"), OQ(qtype=jnp.float8_e4m3fn)),
    "per_tensor_int8": (OQ(qtype="int8", channelwise=False), OQ(qtype="int8", channelwise=False)),
}


def _rand(shape, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * scale).astype(np.float32)


def _free(nd, contract, batch):
  return tuple(a for a in range(nd) if a not in contract and a not in batch)


def ref_spec(oq, nd, contract, batch):
  """The documented operand spec for one contracting axis (or an untiled operand): per index
  of every non-contracting axis, tiles on the contracting axis."""
  if oq is None:
    return None
  cw = tuple(sorted(set(batch) | set(_free(nd, contract, batch)))) if oq.channelwise else ()
  tiles = {contract[-1]: oq.tile_size} if oq.tile_size else {}
  return qarray.QuantizeSpec(qtype=oq.qtype, channelwise_axes=cw, tiled_axes=tiles,
                             calibration=oq.calibration)


def _on_merged_contraction(x, contract, f):
  """``f`` applied to ``x`` with its contracting axes (adjacent, ascending in these layouts)
  merged into one, the result reshaped back: a tile spans the whole contraction."""
  c = sorted(contract)
  assert c == list(range(c[0], c[0] + len(c)))
  shape = x.shape
  merged = shape[:c[0]] + (int(np.prod([shape[a] for a in c])),) + shape[c[-1] + 1:]
  return f(x.reshape(merged), c[0]).reshape(shape)


def _tiled_over_several_axes(oq, contract):
  return oq is not None and oq.tile_size and len(contract) > 1


@functools.partial(jax.jit, static_argnames=("oq", "nd", "contract", "batch"))
def ref_quant(x, oq, nd, contract, batch):
  """(x_hat, QArray in x's layout) of the documented quantization of one operand."""
  if _tiled_over_several_axes(oq, contract):
    qs = []
    def quant(xm, axis):
      spec = ref_spec(oq, xm.ndim, (axis,), tuple(a if a < axis else a - len(contract) + 1
                                                   for a in batch))
      qs.append(qarray.quantize(xm, spec))
      return qarray.dequantize(qs[0])
    xh = _on_merged_contraction(x, contract, quant)
    q = qs[0]
    back = lambda v: None if v is None else _on_merged_contraction(
        x, contract, lambda *_: qarray.expand_scale(v, q.shape))
    # Per-element scale (and zero point) in x's layout.
    return xh, qarray.QArray(qvalue=_on_merged_contraction(x, contract, lambda *_: q.qvalue),
                             scale=back(q.scale), zero_point=back(q.zero_point), qtype=q.qtype)
  spec = ref_spec(oq, nd, contract, batch)
  if spec is None:
    return x, None
  q = qarray.quantize(x, spec)
  return qarray.dequantize(q), q


def elem_budget(x, q):
  """Per-element quantization budget E (see the module docstring)."""
  x = np.asarray(x, np.float64)
  if q is None:
    return np.zeros_like(x)
  s = np.asarray(q.scale, np.float64)
  for a, (ns, n) in enumerate(zip(s.shape, x.shape)):
    s = np.repeat(s, n // ns, axis=a) if ns not in (1, n) else s
  s = np.broadcast_to(s, x.shape)
  if q.qtype.is_float:
    fi = jnp.finfo(q.qtype.compute_dtype)
    normal = np.abs(x / s) >= 2.0 ** fi.minexp
    return np.where(normal, 2.0 ** -(fi.nmant + 1) * np.abs(x), 2.0 ** (fi.minexp - fi.nmant - 1) * s) \
        + 2.0 ** -21 * np.abs(x)
  return s / 2 + 2.0 ** -21 * np.abs(x)


def _letters(a_ndim, b_ndim, dn):
  """einsum subscripts (lhs, rhs, out) of dot_general(a, b, dn) in jax's semantics."""
  (lc, rc), (lb, rb) = dn
  letters = iter("abcdefghijklmnop")
  la = [None] * a_ndim
  ra = [None] * b_ndim
  for i, j in zip(lb, rb):
    la[i] = ra[j] = next(letters)
  for i, j in zip(lc, rc):
    la[i] = ra[j] = next(letters)
  for i in range(a_ndim):
    if la[i] is None:
      la[i] = next(letters)
  for j in range(b_ndim):
    if ra[j] is None:
      ra[j] = next(letters)
  out = [la[i] for i in lb] + [la[i] for i in range(a_ndim) if i not in lb and i not in lc] + \
        [ra[j] for j in range(b_ndim) if j not in rb and j not in rc]
  return "".join(la), "".join(ra), "".join(out)


def np_dot(a, b, dn):
  """float64 dot_general through jax's semantics (numpy einsum)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  la, ra, out = _letters(a.ndim, b.ndim, dn)
  return np.einsum(f"{la},{ra}->{out}", a, b)


def np_dot_vjp(ct, a, b, dn):
  """float64 (d lhs, d rhs) of sum(ct * dot_general(a, b, dn))."""
  ct, a, b = (np.asarray(v, np.float64) for v in (ct, a, b))
  la, ra, out = _letters(a.ndim, b.ndim, dn)
  return np.einsum(f"{out},{ra}->{la}", ct, b), np.einsum(f"{out},{la}->{ra}", ct, a)


def _cfg(lhs, rhs, dlhs=None, drhs=None):
  return C.DotGeneralQtConfig(lhs=lhs, rhs=rhs, dlhs_grad=dlhs, drhs_grad=drhs, implementation="xla")


@functools.partial(jax.jit, static_argnames=("dn", "cfg"))
def _op(x, w, dn, cfg):
  return dot_general_qt(x, w, dn, cfg)


# ----------------------------------------------------------------------------
# Forward.


# Every config on 'mk,kn' and with batch dims ('bmk,bnk'); the main configs on
# every layout. (Tile 64 on 'mab,abn', whose last contracting axis is 32 long, spans the
# whole 128-long contraction: tested below.)
_MAIN = ("w8a8", "w4t32a8", "binary_absmean", "fp8_e4m3")
FWD_CASES = ([(n, "mk,kn") for n in CONFIGS] + [(n, "bmk,bnk") for n in CONFIGS] +
             [(n, l) for n in _MAIN for l in ("bmk,kn", "mab,abn")])


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", FWD_CASES)
def test_forward_vs_float64(name, layout):
  dn, ls, rs = LAYOUTS[layout]
  lq, rq = CONFIGS[name]
  x = _rand(ls, zlib.crc32(f"{name}/{layout}".encode()) % 1000)
  w = _rand(rs, zlib.crc32(f"{name}/{layout}".encode()) % 1000 + 1, scale=0.2)
  (lc, rc), (lb, rb) = dn
  out = _op(jnp.asarray(x), jnp.asarray(w), dn, _cfg(lq, rq))
  assert out.dtype == jnp.float32
  xh, xq = ref_quant(jnp.asarray(x), lq, len(ls), lc, lb)
  wh, wq = ref_quant(jnp.asarray(w), rq, len(rs), rc, rb)
  ref_hat = np_dot(xh, wh, dn)
  abs_hat = np_dot(np.abs(np.asarray(xh)), np.abs(np.asarray(wh)), dn)
  assert out.shape == ref_hat.shape
  err_hat = np.abs(np.asarray(out, np.float64) - ref_hat)
  assert np.all(err_hat <= ACC_RTOL * abs_hat), np.max(err_hat / abs_hat)
  kinds = {o.qtype.kind for o in (lq, rq) if o is not None}
  if kinds <= {"int", "float"}:
    bound = np_dot(elem_budget(x, xq), np.abs(np.asarray(wh)), dn) + \
        np_dot(np.abs(x), elem_budget(w, wq), dn) + ACC_RTOL * abs_hat
    err = np.abs(np.asarray(out, np.float64) - np_dot(x, w, dn))
    assert np.all(err <= bound), np.max(err / bound)
    # ... and the budget is a real constraint: the quantized product is not exact.
    assert np.max(err) > 0


@pytest.mark.slow
@pytest.mark.parametrize("lhs_order", ["ab", "ba"])
def test_tile_spans_the_whole_contraction_of_several_axes(lhs_order):
  # 'mab,abn' contracts (a, b) = (4, 32): a 64 tile spans two a's. The contraction is flattened
  # in the order its axes lie in lhs ("ba": lhs stored as (m, b, a), so b-major), and the op
  # equals the product of the flattened operands, values and gradients (through the reshape).
  dn, ls, rs = LAYOUTS["mab,abn"]
  cfg = _cfg(*CONFIGS["w4t64a8t64"])
  x, w = jnp.asarray(_rand(ls, 41)), jnp.asarray(_rand(rs, 42))
  if lhs_order == "ba":
    x, dn = jnp.transpose(x, (0, 2, 1)), (((2, 1), (0, 1)), ((), ()))
  w_flat = w if lhs_order == "ab" else jnp.transpose(w, (1, 0, 2))   # rhs in lhs's order
  mk = LAYOUTS["mk,kn"][0]
  op = lambda x, w: dot_general_qt(x, w, dn, cfg)
  flat = lambda x, w: dot_general_qt(x.reshape(8, 128), w.reshape(128, 16), mk, cfg)
  np.testing.assert_array_equal(op(x, w), flat(x, w_flat))
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)
  gx, gw = jax.grad(loss(op), (0, 1))(x, w)
  gx_f, gw_f = jax.grad(loss(flat), (0, 1))(x, w_flat)
  np.testing.assert_array_equal(gx, gx_f)
  np.testing.assert_array_equal(gw, gw_f if lhs_order == "ab" else jnp.transpose(gw_f, (1, 0, 2)))
  # Two scales per weight column (64-long tiles), not one per a (32-long tiles).
  per_32 = _cfg(OQ(qtype="int8", tile_size=32), OQ(qtype=jnp.int4, tile_size=32))
  assert not np.array_equal(
      op(x, w), dot_general_qt(x.reshape(8, 128), w_flat.reshape(128, 16), mk, per_32))


def test_tile_not_dividing_the_contraction_is_rejected():
  # 48 divides neither the 128-long contraction of 'mab,abn' (4 x 32) nor its last axis.
  dn, ls, rs = LAYOUTS["mab,abn"]
  with pytest.raises(ValueError, match=r"config\.rhs\.tile_size=48 does not divide the "
                                       r"contraction of size 128 .*4 x 32"):
    dot_general_qt(jnp.ones(ls), jnp.ones(rs), dn, _cfg(None, OQ(qtype="int4", tile_size=48)))


def test_nan_in_one_row_stays_in_that_row():
  dn, ls, rs = LAYOUTS["mk,kn"]
  x = _rand(ls, 1)
  x[3, 5] = np.nan
  out = np.asarray(_op(jnp.asarray(x), jnp.asarray(_rand(rs, 2)), dn, _cfg(*CONFIGS["w8a8"])))
  assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, 0)))


@pytest.mark.slow
def test_binary_all_zero_row_gives_zero_output_and_passes_gradient():
  # An all-zero activation row (e.g. padding) is binarized with scale 0: its
  # output row is exactly 0 (not +1 * 1 . w_hat), and clipped_ste lets the
  # gradient through (x = 0 is inside the range).
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq = OQ(qtype="binary", calibration="absmean", estimator="clipped_ste")
  rq = OQ(qtype="binary", calibration="absmean")
  x = _rand(ls, 35)
  x[2] = 0.0
  w = jnp.asarray(_rand(rs, 36))
  ct = jnp.asarray(_rand((ls[0], rs[1]), 37))
  out = np.asarray(_op(jnp.asarray(x), w, dn, _cfg(lq, rq)))
  np.testing.assert_array_equal(out[2], 0.0)
  assert np.count_nonzero(np.delete(out, 2, 0)) > 0.5 * out.size  # (a +-1 dot may be 0)
  gx, _ = _op_grads(jnp.asarray(x), w, ct, dn, _cfg(lq, rq))
  rx, _ = _ref_grads(jnp.asarray(x), w, ct, dn, lq, rq)
  np.testing.assert_allclose(np.asarray(gx)[2], np.asarray(rx)[2], rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(gx)[2] != 0)


# ----------------------------------------------------------------------------
# Gradients vs a fake-quant straight-through reference.


def _fq_ste(x, oq, contract, batch):
  if oq is None:
    return x
  if _tiled_over_several_axes(oq, contract):
    xh = ref_quant(x, oq, x.ndim, contract, batch)[0]
  else:
    xh = qarray.fake_quantize(x, ref_spec(oq, x.ndim, contract, batch))
  return x + jax.lax.stop_gradient(xh - x)


@functools.partial(jax.jit, static_argnames=("dn", "lq", "rq"))
def _ref_grads(x, w, ct, dn, lq, rq):
  (lc, rc), (lb, rb) = dn

  def loss(x, w):
    xh, wh = _fq_ste(x, lq, lc, lb), _fq_ste(w, rq, rc, rb)
    return jnp.sum(jax.lax.dot_general(xh, wh, dn, precision=HIGHEST) * ct)

  return jax.grad(loss, (0, 1))(x, w)


def _abs_grads(x, w, ct, dn, lq, rq):
  """|ct| . |w_hat| and |x_hat| . |ct|: the scale of each gradient's terms."""
  return tuple(np.asarray(g, np.float64) for g in _abs_grads_jit(x, w, ct, dn, lq, rq))


@functools.partial(jax.jit, static_argnames=("dn", "lq", "rq"))
def _abs_grads_jit(x, w, ct, dn, lq, rq):
  (lc, rc), (lb, rb) = dn
  xh = jnp.abs(ref_quant(x, lq, x.ndim, lc, lb)[0])
  wh = jnp.abs(ref_quant(w, rq, w.ndim, rc, rb)[0])
  gx = jax.grad(lambda a: jnp.sum(jax.lax.dot_general(a, wh, dn, precision=HIGHEST) * jnp.abs(ct)))(x)
  gw = jax.grad(lambda b: jnp.sum(jax.lax.dot_general(xh, b, dn, precision=HIGHEST) * jnp.abs(ct)))(w)
  return gx, gw


@functools.partial(jax.jit, static_argnames=("dn", "cfg"))
def _op_grads(x, w, ct, dn, cfg, key=None):
  return jax.grad(lambda x, w: jnp.sum(dot_general_qt(x, w, dn, cfg, key=key) * ct), (0, 1))(x, w)


GRAD_CASES = ([("w8a8", l) for l in LAYOUTS] +
              [(n, l) for n in ("w4t32a8", "binary_absmean") for l in ("bmk,bnk", "mab,abn")] +
              [("fp8_e4m3", "bmk,kn"), ("w4t32a16", "mk,kn")])


@pytest.mark.parametrize("name,layout", GRAD_CASES)
@pytest.mark.thin(5)
def test_float_backward_matches_fake_quant_ste_reference(name, layout):
  dn, ls, rs = LAYOUTS[layout]
  lq, rq = CONFIGS[name]
  x, w = jnp.asarray(_rand(ls, 3)), jnp.asarray(_rand(rs, 4, 0.2))
  out_shape = np_dot(np.zeros(ls), np.zeros(rs), dn).shape
  ct = jnp.asarray(_rand(out_shape, 5))
  gx, gw = _op_grads(x, w, ct, dn, _cfg(lq, rq))
  rx, rw = _ref_grads(x, w, ct, dn, lq, rq)
  ax, aw = _abs_grads(x, w, ct, dn, lq, rq)
  assert gx.shape == x.shape and gw.shape == w.shape
  assert np.all(np.abs(np.asarray(gx, np.float64) - np.asarray(rx)) <= ACC_RTOL * ax + 1e-30)
  assert np.all(np.abs(np.asarray(gw, np.float64) - np.asarray(rw)) <= ACC_RTOL * aw + 1e-30)


def _int8_grad_bounds_2d(x, w, ct, lq, rq):
  """Elementwise bounds of int8 (round-to-nearest) backward products, 'mk,kn'."""
  xq = qarray.quantize(x, ref_spec(lq, 2, (1,), ()))
  wq = qarray.quantize(w, ref_spec(rq, 2, (0,), ()))
  g = np.asarray(ct, np.float64)
  s_w = np.asarray(wq.scale, np.float64)          # (1, n)
  s_x = np.asarray(xq.scale, np.float64)          # (m, 1)
  q_w = np.abs(np.asarray(wq.qvalue, np.float64))  # (k, n)
  q_x = np.abs(np.asarray(xq.qvalue, np.float64))  # (m, k)
  t = np.max(np.abs(g * s_w), axis=1, keepdims=True) / 127  # (m, 1)
  bx = (t / 2) * q_w.sum(1)[None, :]                        # (m, k)
  u = np.max(np.abs(g * s_x), axis=0, keepdims=True) / 127  # (1, n)
  bw = q_x.sum(0)[:, None] * (u / 2)                        # (k, n)
  return bx, bw


@pytest.mark.slow
def test_int8_backward_within_rounding_budget_2d():
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq, rq = CONFIGS["w8a8"]
  x, w = jnp.asarray(_rand(ls, 6)), jnp.asarray(_rand(rs, 7, 0.2))
  ct = jnp.asarray(_rand((ls[0], rs[1]), 8))
  cfg = _cfg(lq, rq, C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  gx, gw = _op_grads(x, w, ct, dn, cfg)
  rx, rw = _ref_grads(x, w, ct, dn, lq, rq)
  ax, aw = _abs_grads(x, w, ct, dn, lq, rq)
  bx, bw = _int8_grad_bounds_2d(x, w, ct, lq, rq)
  ex = np.abs(np.asarray(gx, np.float64) - np.asarray(rx))
  ew = np.abs(np.asarray(gw, np.float64) - np.asarray(rw))
  assert np.all(ex <= bx + ACC_RTOL * ax), np.max(ex / bx)
  assert np.all(ew <= bw + ACC_RTOL * aw), np.max(ew / bw)
  assert ex.max() > 0 and ew.max() > 0  # the gradient really was quantized


@pytest.mark.parametrize("name,layout", [("w8a8", l) for l in LAYOUTS] +
                         [("w4t32a8", "mab,abn"), ("fp8_e4m3", "bmk,bnk")])
@pytest.mark.thin(3)
def test_quantized_backward_any_layout_within_budget(name, layout):
  """Any layout, quantized backward vs the float-backward reference, in a layout-free
  form: relative Frobenius error <= 2^-6 (1.6%) for int8 gradients (per-channel int8
  rounding gives ~0.5%), <= 2^-4 for fp8 e4m3 gradients (3 mantissa bits: ~3%), and
  > 0 (the gradient really was quantized)."""
  dn, ls, rs = LAYOUTS[layout]
  lq, rq = CONFIGS[name]
  gq = "float8_e4m3fn" if name.startswith("fp8") else "int8"
  x, w = jnp.asarray(_rand(ls, 9)), jnp.asarray(_rand(rs, 10, 0.2))
  out_shape = np_dot(np.zeros(ls), np.zeros(rs), dn).shape
  ct = jnp.asarray(_rand(out_shape, 11))
  cfg = _cfg(lq, rq, C.GradQuant(qtype=gq), C.GradQuant(qtype=gq))
  gx, gw = _op_grads(x, w, ct, dn, cfg)
  rx, rw = _ref_grads(x, w, ct, dn, lq, rq)
  tol = 2.0 ** -4 if gq != "int8" else 2.0 ** -6
  for g, r in ((gx, rx), (gw, rw)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert 0 < rel <= tol, rel


@pytest.mark.slow
def test_stochastic_rounding_grads_need_key_and_are_unbiased():
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq, rq = CONFIGS["w8a8"]
  gq = C.GradQuant(qtype="int8", stochastic_rounding="uniform")
  cfg = _cfg(lq, rq, gq, gq)
  x, w = jnp.asarray(_rand(ls, 12)), jnp.asarray(_rand(rs, 13, 0.2))
  with pytest.raises(ValueError, match="key"):
    dot_general_qt(x, w, dn, cfg)
  ct = jnp.asarray(_rand((ls[0], rs[1]), 14) * 0.1)
  g1 = _op_grads(x, w, ct, dn, cfg, jax.random.key(0))
  g1b = _op_grads(x, w, ct, dn, cfg, jax.random.key(0))
  g2 = _op_grads(x, w, ct, dn, cfg, jax.random.key(1))
  for a, b, c in zip(g1, g1b, g2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(a) != np.asarray(c))
  # Unbiased: the mean over 16 keys is much closer to the float-backward
  # reference than a single draw (ideal ratio 1/sqrt(16) = 0.25; bound 0.45).
  keys = jax.random.split(jax.random.key(2), 16)
  many = jax.vmap(lambda k: _op_grads(x, w, ct, dn, cfg, k))(keys)
  ref = _ref_grads(x, w, ct, dn, lq, rq)
  for m, single, r in zip(many, g1, ref):
    r = np.asarray(r, np.float64)
    e_single = np.linalg.norm(np.asarray(single, np.float64) - r)
    e_mean = np.linalg.norm(np.asarray(m, np.float64).mean(0) - r)
    assert e_mean <= 0.45 * e_single, (e_mean, e_single)
  # A raw uint32 key works too.
  graw = _op_grads(x, w, ct, dn, cfg, jax.random.key_data(jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(graw[0]), np.asarray(g1[0]))


# ----------------------------------------------------------------------------
# The jaxpr: w8a8 with int8 backward is three int8 x int8 -> int32 dots.



@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jaxpr_w8a8_int8_backward_has_three_int8_dots(layout):
  dn, ls, rs = LAYOUTS[layout]
  lq, rq = CONFIGS["w8a8"]
  cfg = _cfg(lq, rq, C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  f = lambda x, w: jnp.sum(dot_general_qt(x, w, dn, cfg) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(jnp.ones(ls), jnp.ones(rs))
  dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3, [str(e) for e in dots]
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8], str(e)
    assert e.params["preferred_element_type"] == jnp.int32, str(e)
  assert not any(e.primitive.name in ("conv_general_dilated",) for e in _all_eqns(jaxpr.jaxpr))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("qtype", ["int8", "float8_e4m3fn"])
def test_jaxpr_quantized_dots_read_gemm_layout(layout, qtype):
  # cuBLAS runs an int8/fp8 GEMM at full speed only with both operands K-minor: every
  # quantized product of the forward and of both backward products must be handed to XLA
  # as (batch, free, contracting) x (batch, free, contracting).
  dn, ls, rs = LAYOUTS[layout]
  gq = "float8_e5m2" if qtype.startswith("float8") else "int8"
  # implementation="auto" (the default; "xla" hands XLA the operands as they are).
  cfg = C.DotGeneralQtConfig(lhs=OQ(qtype=qtype), rhs=OQ(qtype=qtype),
                             dlhs_grad=C.GradQuant(qtype=gq, stochastic_rounding="uniform"),
                             drhs_grad=C.GradQuant(qtype=gq, stochastic_rounding="uniform"))
  f = lambda x, w, k: jnp.sum(dot_general_qt(x, w, dn, cfg, key=k) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(jnp.ones(ls), jnp.ones(rs), jax.random.key(0))
  dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3, [str(e) for e in dots]
  for e in dots:
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    nl, nr = (v.aval.ndim for v in e.invars)
    assert tuple(lb) == tuple(rb) == tuple(range(len(lb))), str(e)
    assert tuple(lc) == tuple(range(nl - len(lc), nl)), str(e)
    assert tuple(rc) == tuple(range(nr - len(rc), nr)), str(e)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemm_layout_leaves_gradients_unchanged(layout):
  # Storing residuals transposed and quantizing gradients in GEMM layout must give the
  # same numbers as the logical-layout math: deterministic gradient rounding makes the
  # backward exactly reproducible, so compare against a float64 recomputation of it.
  dn, ls, rs = LAYOUTS[layout]
  cfg = _cfg(OQ(qtype="int8"), OQ(qtype="int8"), C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  x, w = jnp.asarray(_rand(ls, 31)), jnp.asarray(_rand(rs, 32))
  g = jnp.asarray(_rand(jax.eval_shape(lambda: jax.lax.dot_general(x, w, dn)).shape, 33))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)
  gx, gw = vjp(g)
  (lc, rc), (lb, rb) = dn
  xq = qarray.quantize(x, qarray.QuantizeSpec(qtype="int8", channelwise_axes=dqt._channel_axes(x.ndim, lc, lb)))
  wq = qarray.quantize(w, qarray.QuantizeSpec(qtype="int8", channelwise_axes=dqt._channel_axes(w.ndim, rc, rb)))
  # Reference: the same products on the logical layout (dims from transpose_dims), float64.
  for x_bar, y, dn_x, swap, shape in ((gx, wq, dn, False, ls), (gw, xq, ((rc, lc), (rb, lb)), True, rs)):
    dims, perm, g_free = dqt.transpose_dims(dn_x, len(shape), y.ndim, swap_ans=swap)
    x_kept = len(qdot_lib.free_axes(len(shape), dn_x[0][0], dn_x[1][0]))
    g2, y2 = dqt._fold_scale(g, y, dims, swap, x_kept)
    gq = qarray.quantize(g2, qarray.QuantizeSpec(qtype="int8", channelwise_axes=g_free))
    ref = jax.lax.dot_general(np.asarray(qarray.dequantize(gq), np.float64),
                              np.asarray(qarray.dequantize(y2), np.float64), dims)
    ref = np.transpose(np.asarray(ref), perm).reshape(shape)
    np.testing.assert_allclose(np.asarray(x_bar, np.float64), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("edge", ["tiny_scale_big_gradient", "huge_scale_zero_codes"])
def test_gradient_fold_keeps_channels_at_float32_edges(edge):
  """The backward folds w's per-channel scale into g before quantizing it
  (dot_general_qt._fold_scale), shifted by a power of two per batch index.
  Scales far apart must neither flush a channel (a TINY32 scale times a
  gradient of 1e30 is a real 8e-8) nor overflow one (a gradient of 1e25 times
  a scale of 1.4e21 is Inf in float32, though that channel's codes are 0 on
  every row but one). Budget: the int8 gradient's half step per element,
  t_m / 2 * sum_n |q[k, n]| with t_m = max_n |g[m, n] s_n| / 127, plus float32
  rounding of the scaled products."""
  dn = (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(7)
  signs = np.where(rng.random(7) < 0.5, -1.0, 1.0)
  w = np.zeros((7, 2), np.float32)
  g = np.zeros((3, 2), np.float32)
  if edge == "tiny_scale_big_gradient":
    # The 1st percentile of mostly-zero data is a zero bound: the TINY32 grid.
    cal = qarray.Calibration(method="percentile", percentile=1.0)
    w[3, 0], w[:, 1] = 0.75, 20.0 * signs
    g[:, 0], g[:, 1] = 1e30, 1e-8 * rng.standard_normal(3)
  else:
    cal = qarray.Calibration(method="percentile", percentile=100.0)
    w[:, 0], w[:, 1] = rng.standard_normal(7), 1e-3 * signs
    w[0, 1] = 1e22
    g[:] = 1e25 * rng.standard_normal((3, 2))
  oq = OQ(qtype="int4", calibration=cal, channelwise=True)
  cfg = _cfg(None, oq, dlhs=C.GradQuant(qtype="int8"))
  x = jnp.asarray(_rand((3, 7), 5))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, jnp.asarray(w))
  out = np.asarray(vjp(jnp.asarray(g))[0], np.float64)
  wq = qarray.quantize(jnp.asarray(w), qarray.QuantizeSpec(qtype="int4", channelwise_axes=(1,),
                                                           calibration=cal))
  s, q = np.asarray(wq.scale, np.float64).reshape(2), np.asarray(wq.qvalue, np.float64)
  if edge == "tiny_scale_big_gradient":  # the case is what it says
    assert s[0] == np.finfo(np.float32).tiny and s[1] > 2, s
  else:
    assert s[1] > 1e21 and np.all(q[1:, 1] == 0), (s, q[:, 1])
  g64 = g.astype(np.float64)
  ref = g64 @ (q * s).T
  t = np.max(np.abs(g64 * s), axis=1, keepdims=True) / 127
  budget = t / 2 * (np.abs(q).sum(axis=1)[None, :]) + 8 * 2.0 ** -24 * (np.abs(g64 * s) @ np.abs(q).T)
  finite = np.abs(ref) < np.finfo(np.float32).max
  assert finite.sum() >= 18, finite  # row k = 0 of the huge channel overflows, as it must
  assert np.all(np.abs(out - ref)[finite] <= budget[finite]), (out, ref, budget)
  assert np.all(np.isinf(out[~finite]) & (np.sign(out[~finite]) == np.sign(ref[~finite])))


@pytest.mark.slow
def test_gradient_fold_with_batch_axes_listed_out_of_order():
  """The fold's power of two is kept per batch index in y's scale; with batch
  axes listed out of axis order ((3, 0) x (2, 0)) it must land on the right
  index (it once landed transposed: gradients off by powers of two). Budget:
  the int8 gradient's half step, bounded by the largest |g * s| / 254 times
  sum |q| over the contraction, plus float32 rounding."""
  dn = (((2,), (1,)), ((3, 0), (2, 0)))
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((4, 6, 8, 3)).astype(np.float32))
  # Per (batch) magnitudes from 2**12 to 2**22: scales >= 2, a different shift per index.
  mag = 2.0 ** rng.integers(12, 23, (4, 1, 3, 1))
  w = jnp.asarray((rng.standard_normal((4, 8, 3, 2)) * mag).astype(np.float32))
  cfg = _cfg(None, OQ(qtype="int8"), dlhs=C.GradQuant(qtype="int8"))
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), x, w).shape
  g = jnp.asarray(rng.standard_normal(out_shape).astype(np.float32))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)
  lbar = np.asarray(vjp(g)[0], np.float64)
  wq = qarray.quantize(w, qarray.QuantizeSpec(qtype="int8", channelwise_axes=(0, 2, 3)))
  q, s = np.asarray(wq.qvalue, np.float64), np.asarray(wq.scale, np.float64)
  assert s.min() >= 2, s.min()
  # out[b0, b3, m, n] (batch axes in dn's order: lhs 3, lhs 0), lbar[b0, m, k, b3].
  g64 = np.asarray(g, np.float64)
  ref = np.einsum("dbmn,bkdn->bmkd", g64, q * s)
  gs = np.abs(g64).max() * s.max()
  budget = gs / 254 * np.einsum("bkdn->bkd", np.abs(q)).max() + 1e-5 * np.abs(ref).max()
  assert np.all(np.abs(lbar - ref) <= budget), np.abs(lbar - ref).max() / budget



@pytest.mark.slow
@pytest.mark.parametrize("gq", ["int8", "float8_e4m3fn"])
def test_gradient_fold_of_float32_max_gradients_stays_finite(gq):
  """A gradient near float32's max times a channel scale above 1 overflows, though where that
  channel's codes are 0 the product it feeds is finite. The fold divides the scale into
  [0.5, 1), so ``|g * s| <= |g|`` stays finite (a shift into [1, 2) made an Inf there, and
  the Inf turned its whole gradient group NaN). Expected: the float64 product where it is
  finite, within the gradient's half step (int8: max |g s| / 254; e4m3: 2**-4 relative, and
  2**-10 of the scale max |g s| / 448 for subnormal codes) times |q| summed over the
  contraction, plus float32 rounding; an Inf of the right sign where it is
  not."""
  dn = (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((3, 16)).astype(np.float32))
  w = rng.standard_normal((16, 4)).astype(np.float32)
  w[:, 1] = 0.0
  w[0, 1] = 190.0  # channel 1: scale 190 / 127 ~ 1.5, codes 0 on every row but k = 0
  g = np.zeros((3, 4), np.float32)
  g[0] = [1e35, -3.0e38, -1e35, 1e35]
  g[1:] = rng.standard_normal((2, 4))
  cfg = _cfg(None, OQ(qtype="int8"), dlhs=C.GradQuant(qtype=gq))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, jnp.asarray(w))
  lbar = np.asarray(vjp(jnp.asarray(g))[0], np.float64)
  wq = qarray.quantize(jnp.asarray(w), qarray.QuantizeSpec(qtype="int8", channelwise_axes=(1,)))
  q, s = np.asarray(wq.qvalue, np.float64), np.asarray(wq.scale, np.float64).reshape(1, 4)
  g64 = g.astype(np.float64)
  f32_max = np.finfo(np.float32).max
  # The case is what it says: g * s overflows float32 in row 0, channel 1 only.
  assert np.argwhere(np.abs(g64 * s) > f32_max).tolist() == [[0, 1]], g64 * s
  ref = g64 @ (q * s).T
  finite = np.abs(ref) < f32_max
  assert finite.sum() == 3 * 16 - 1 and not finite[0, 0], ref
  gs = np.abs(g64 * s)
  if gq == "int8":
    step = gs.max(axis=1, keepdims=True) / 254 * np.abs(q).sum(axis=1)[None, :]
  else:
    # Half a step: 2**-4 relative for normal codes, 2**-10 times the scale for subnormal ones.
    step = 2.0 ** -4 * (gs @ np.abs(q).T) + (gs.max(axis=1, keepdims=True) / 448 * 2.0 ** -10
                                              * np.abs(q).sum(axis=1)[None, :])
  budget = step + 1e-5 * (gs @ np.abs(q).T)
  assert np.all(np.abs(lbar - ref)[finite] <= budget[finite]), (np.abs(lbar - ref) / budget)
  assert np.isinf(lbar[0, 0]) and np.sign(lbar[0, 0]) == np.sign(ref[0, 0]), lbar[0, 0]


# ----------------------------------------------------------------------------
# Residuals are quantized.


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["ste", "clipped_ste"])
def test_residuals_are_quantized(estimator):
  dn, ls, rs = LAYOUTS["bmk,bnk"]
  cfg = _cfg(OQ(qtype="int8", estimator=estimator), OQ(qtype="int4", tile_size=32, estimator=estimator),
             C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  x, w = jnp.asarray(_rand(ls, 15)), jnp.asarray(_rand(rs, 16))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)
  leaves = jax.tree_util.tree_leaves(vjp)
  big = [(tuple(sorted(l.shape)), l.dtype) for l in leaves
         if hasattr(l, "shape") and np.prod(l.shape) >= min(x.size, w.size)]
  # Operand-sized residuals: the int8 qvalues (and bool masks), never a float copy. A
  # residual may be stored transposed (its backward product's GEMM layout): compare sorted shapes.
  assert (tuple(sorted(ls)), jnp.dtype(jnp.int8)) in big, big
  assert (tuple(sorted(rs)), jnp.dtype(jnp.int8)) in big, big
  assert not any(jnp.issubdtype(d, jnp.floating) for _, d in big), big
  nbytes = sum(l.size * l.dtype.itemsize for l in leaves if hasattr(l, "dtype"))
  # int8 values are 1/4 of the float32 operands (+ 1/4 for a clipped_ste bool mask).
  assert nbytes < (0.3 if estimator == "ste" else 0.55) * (x.nbytes + w.nbytes), nbytes


def test_residuals_keep_float_operand_only_when_unquantized():
  dn, ls, rs = LAYOUTS["mk,kn"]
  cfg = _cfg(None, OQ(qtype="int8"))
  x, w = jnp.asarray(_rand(ls, 17)), jnp.asarray(_rand(rs, 18))
  _, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)
  leaves = [(l.shape, l.dtype) for l in jax.tree_util.tree_leaves(vjp) if hasattr(l, "shape")]
  assert (rs, jnp.dtype(jnp.int8)) in leaves and (rs, jnp.dtype(jnp.float32)) not in leaves


# ----------------------------------------------------------------------------
# Dtypes.


@pytest.mark.slow
def test_preferred_element_type_and_grad_dtypes():
  dn, ls, rs = LAYOUTS["bmk,kn"]
  cfg = _cfg(OQ(qtype="int8"), OQ(qtype="int8"), C.GradQuant(qtype="int8"), C.GradQuant(qtype="int8"))
  xb = jnp.asarray(_rand(ls, 19)).astype(jnp.bfloat16)
  wb = jnp.asarray(_rand(rs, 20)).astype(jnp.bfloat16)
  assert dot_general_qt(xb, wb, dn, cfg).dtype == jnp.bfloat16
  assert dot_general_qt(xb, wb, dn, cfg, preferred_element_type=jnp.float32).dtype == jnp.float32
  wf = wb.astype(jnp.float32)
  assert dot_general_qt(xb, wf, dn, cfg).dtype == jnp.float32
  gx, gw = jax.grad(lambda x, w: jnp.sum(dot_general_qt(x, w, dn, cfg, preferred_element_type=jnp.float32)),
                    (0, 1))(xb, wf)
  assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
  gx, gw = jax.grad(lambda x, w: jnp.sum(dot_general_qt(x, w, dn, cfg).astype(jnp.float32)), (0, 1))(xb, wb)
  assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
  # bf16 output is the f32 output rounded once.
  o32 = dot_general_qt(xb, wb, dn, cfg, preferred_element_type=jnp.float32)
  o16 = dot_general_qt(xb, wb, dn, cfg)
  np.testing.assert_array_equal(np.asarray(o16, np.float32), np.asarray(o32.astype(jnp.bfloat16), np.float32))
  with pytest.raises(ValueError, match="preferred_element_type"):
    dot_general_qt(xb, wb, dn, cfg, preferred_element_type=jnp.int32)
  with pytest.raises(ValueError, match="lhs"):
    dot_general_qt(xb.astype(jnp.int32), wb, dn, cfg)


def test_unquantized_config_is_a_plain_dot():
  dn, ls, rs = LAYOUTS["bmk,bnk"]
  x, w = jnp.asarray(_rand(ls, 21)), jnp.asarray(_rand(rs, 22))
  cfg = _cfg(None, None)
  out = dot_general_qt(x, w, dn, cfg, precision=HIGHEST)
  np.testing.assert_allclose(np.asarray(out), np_dot(x, w, dn), rtol=1e-5, atol=1e-5)
  gx, gw = jax.grad(lambda x, w: jnp.sum(dot_general_qt(x, w, dn, cfg, precision=HIGHEST) ** 2), (0, 1))(x, w)
  rx, rw = jax.grad(lambda x, w: jnp.sum(jax.lax.dot_general(x, w, dn, precision=HIGHEST) ** 2), (0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# Estimator masks and learned scales.


@pytest.mark.slow
@pytest.mark.parametrize("qtype,cal", [("int8", qarray.Calibration(method="fixed", bound=1.0)),
                                       ("int4", qarray.Calibration(method="percentile", percentile=90.0)),
                                       ("binary", "absmean")])
def test_clipped_ste_masks_gradient(qtype, cal):
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq = OQ(qtype=qtype, calibration=cal, estimator="clipped_ste")
  rq = OQ(qtype="int8", estimator="clipped_ste_unit")
  x = jnp.asarray(_rand(ls, 23, 1.5))
  w = jnp.asarray(_rand(rs, 24, 0.8))
  ct = jnp.asarray(_rand((ls[0], rs[1]), 25))
  gx, gw = _op_grads(x, w, ct, dn, _cfg(lq, rq))
  rx, rw = _ref_grads(x, w, ct, dn, lq, rq)
  xq = qarray.quantize(x, ref_spec(lq, 2, (1,), ()))
  y = np.asarray(x) / np.asarray(qarray.expand_scale(xq.scale, ls))
  mx = np.abs(y) <= xq.qtype.qmax
  mw = np.abs(np.asarray(w)) <= 1.0
  assert (~mx).any() and mx.any() and (~mw).any() and mw.any()
  ax, aw = _abs_grads(x, w, ct, dn, lq, rq)
  np.testing.assert_array_equal(np.asarray(gx)[~mx], 0)
  np.testing.assert_array_equal(np.asarray(gw)[~mw], 0)
  assert np.all(np.abs(np.asarray(gx) - np.where(mx, rx, 0)) <= ACC_RTOL * ax)
  assert np.all(np.abs(np.asarray(gw) - np.where(mw, rw, 0)) <= ACC_RTOL * aw)


@pytest.mark.slow
@pytest.mark.parametrize("scale_shape", [(), (8, 1), (1, 1)])
@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_learned_lhs_scale_gets_lsq_gradient(qtype, scale_shape):
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq = OQ(qtype=qtype, scale_grad="lsq")
  rq = OQ(qtype="int8")
  qmin, qmax = float(lq.qtype.qmin), float(lq.qtype.qmax)
  x = jnp.asarray(_rand(ls, 26))
  w = jnp.asarray(_rand(rs, 27, 0.2))
  ct = jnp.asarray(_rand((ls[0], rs[1]), 28))
  # |x| > ~1.5 clips.
  s = jnp.asarray((1.0 + 0.2 * np.abs(_rand(scale_shape, 29))) * 1.5 / qmax)
  cfg = _cfg(lq, rq)
  gx, gs = jax.grad(lambda x, s: jnp.sum(dot_general_qt(x, w, dn, cfg, lhs_scale=s) * ct), (0, 1))(x, s)
  assert gs.shape == s.shape and gs.dtype == s.dtype
  # Direct LSQ: d x_hat / d s = q - x/s inside, the clip value outside, / sqrt(n * qmax).
  wh = np.asarray(qarray.fake_quantize(w, ref_spec(rq, 2, (0,), ())), np.float64)
  g_x = np.asarray(ct, np.float64) @ wh.T
  s2 = np.asarray(s, np.float64).reshape((1,) * (2 - s.ndim) + s.shape)
  s_full = np.broadcast_to(s2, ls)
  y = np.asarray(x, np.float64) / s_full
  q = np.clip(np.round(y), qmin, qmax)
  assert ((y > qmax) | (y < qmin)).any()
  d = np.where(y > qmax, qmax, np.where(y < qmin, qmin, q - y))
  n = x.size // max(int(np.prod(scale_shape)), 1)
  per = g_x * d / np.sqrt(n * qmax)
  ref = per.sum(axis=tuple(a for a in range(2) if s2.shape[a] == 1)).reshape(scale_shape)
  np.testing.assert_allclose(np.asarray(gs), ref, rtol=2e-4, atol=1e-4 * np.abs(per).sum())
  # The operand gradient is the plain STE one (estimator "ste").
  np.testing.assert_allclose(np.asarray(gx), g_x, rtol=1e-4, atol=1e-5 * np.abs(g_x).max())


@pytest.mark.slow
def test_learned_binary_activation_scale_gets_bitorch_gradient():
  dn, ls, rs = LAYOUTS["mk,kn"]
  lq = OQ(qtype="binary", estimator="clipped_ste", scale_grad="bitorch")
  rq = OQ(qtype="binary", calibration="absmean")
  x = jnp.asarray(_rand(ls, 30, 1.0))
  w = jnp.asarray(_rand(rs, 31, 0.2))
  ct = jnp.asarray(_rand((ls[0], rs[1]), 32))
  s = jnp.asarray(0.8, jnp.float32)
  cfg = _cfg(lq, rq)
  out, (gx, gs) = jax.value_and_grad(
      lambda x, s: jnp.sum(dot_general_qt(x, w, dn, cfg, lhs_scale=s) * ct), (0, 1))(x, s)
  # bitorch-engine: grad_x = g @ (sign(w) * scale_w); clipped where |x / s| > 1;
  # grad_scale_a = sum(grad_x_clipped * sign(x)) / sqrt(numel(x)).
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  sign = lambda v: np.where(v >= 0, 1.0, -1.0)
  scale_w = np.abs(wn).mean(0, keepdims=True)
  grad_x = np.asarray(ct, np.float64) @ (sign(wn) * scale_w).T
  clipped = np.where(np.abs(xn / 0.8) <= 1, grad_x, 0.0)
  assert (np.abs(xn / 0.8) > 1).any()
  ref_gs = np.sum(clipped * sign(xn)) / np.sqrt(xn.size)
  np.testing.assert_allclose(float(gs), ref_gs, rtol=1e-4, atol=1e-5 * np.abs(clipped).sum())
  np.testing.assert_allclose(np.asarray(gx), clipped, rtol=1e-4, atol=1e-5 * np.abs(grad_x).max())
  # Forward: sign(x) * s . sign(w) * scale_w.
  ref_out = np.sum(((sign(xn) * 0.8) @ (sign(wn) * scale_w)) * np.asarray(ct))
  np.testing.assert_allclose(float(out), ref_out, rtol=1e-4)


# ----------------------------------------------------------------------------
# Config validation: every error names its field.


def test_bad_configs_raise_naming_the_field():
  with pytest.raises(ValueError, match="qtype"):
    OQ(qtype="int9")
  with pytest.raises(ValueError, match="qtype"):
    C.GradQuant(qtype="uint8")
  with pytest.raises(ValueError, match="scale_grad"):
    OQ(qtype="int8", scale_grad="bitorch")
  with pytest.raises(ValueError, match="calibration"):
    OQ(qtype="binary", calibration="minmax")
  with pytest.raises(ValueError, match="GradQuant.qtype"):
    C.GradQuant(qtype="binary")
  with pytest.raises(ValueError, match="GradQuant.qtype"):
    C.GradQuant(qtype="ternary")
  with pytest.raises(ValueError, match="calibration"):
    C.GradQuant(qtype="int8", calibration="minmax")
  with pytest.raises(ValueError, match="stochastic_rounding"):
    C.GradQuant(qtype="int8", stochastic_rounding="maybe")
  with pytest.raises(ValueError, match="tile_size"):
    OQ(qtype="int4", tile_size=0)
  with pytest.raises(ValueError, match="estimator"):
    OQ(qtype="int4", estimator="magic")
  with pytest.raises(ValueError, match="implementation"):
    C.DotGeneralQtConfig(implementation="cuda")
  with pytest.raises(ValueError, match="lhs"):
    C.DotGeneralQtConfig(lhs="int8")
  with pytest.raises(ValueError, match="dlhs_grad"):
    C.DotGeneralQtConfig(dlhs_grad=OQ(qtype="int8"))
  dn, ls, rs = LAYOUTS["mk,kn"]
  x, w = jnp.asarray(_rand(ls, 33)), jnp.asarray(_rand(rs, 34))
  with pytest.raises(ValueError, match=r"config\.rhs\.tile_size=48"):
    dot_general_qt(x, w, dn, _cfg(OQ(qtype="int8"), OQ(qtype="int4", tile_size=48)))
  with pytest.raises(ValueError, match=r"lhs_scale"):
    dot_general_qt(x, w, dn, _cfg(None, OQ(qtype="int8")), lhs_scale=jnp.ones(()))
  with pytest.raises(ValueError, match="config"):
    dot_general_qt(x, w, dn, "int8")
  with pytest.raises(ValueError, match="dimension_numbers"):
    dot_general_qt(x, w, ((1,), (0,)), _cfg(None, None))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_stochastic_rounding_keys_of_any_prng_implementation(impl):
  """Typed keys keep their implementation through the custom_vjp (rbg included)."""
  cfg = C.DotGeneralQtConfig(
      lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"),
      dlhs_grad=C.GradQuant(qtype="int8", stochastic_rounding="uniform"),
      drhs_grad=C.GradQuant(qtype="int8", stochastic_rounding="uniform"), implementation="xla")
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  grad = jax.jit(jax.grad(lambda x, key: dot_general_qt(x, w, dn, cfg, key=key).sum()))
  g1 = grad(x, jax.random.key(0, impl=impl))
  g1_again = grad(x, jax.random.key(0, impl=impl))
  g2 = grad(x, jax.random.key(1, impl=impl))
  np.testing.assert_array_equal(np.asarray(g1), np.asarray(g1_again))   # deterministic per key
  assert not np.array_equal(np.asarray(g1), np.asarray(g2))             # different key, different noise
  ref = np.ones((16, 8)) @ np.asarray(w, np.float64).T                  # the float gradient
  assert np.linalg.norm(np.asarray(g1) - ref) / np.linalg.norm(ref) < 0.05


# ----------------------------------------------------------------------------
# Dtype policy (qtrain.ops.qt_operand): float dtype pairs x quantized sides,
# forward and gradients vs float64.
#
# Reference: float64 products of the dequantized operands (q * s, exact in
# float64) and of the float operands. Budget per output element, from the
# dtype c the product runs in (promote_types(lhs.dtype, rhs.dtype) with a
# float side; float32 for two quantized sides the exact paths do not serve):
#   * a quantized side dequantized into c rounds each value v by at most
#     u_c |v| + eta_c (unit roundoff; half the smallest subnormal step), so
#     the output by u_c (|a|.|b|) + eta_c (1.|other side|); a float side cast
#     up to c, int8 -> int32 and fp8 x fp8 products round nothing;
#   * float32 accumulation of K terms, one float32 rounding of each product
#     (bf16 and f16 products are exact) and the two float32 scalings of the
#     quantized epilogue: (K + 3) 2^-24 (|a|.|b|);
#   * the cast to the output dtype o: u_o (|ref| + E) + eta_o.
# Gradients (float backward, STE): the same, with the cotangent as the float
# side (its values, multiples of 1/4 in [-1, 1], are exact in every dtype),
# c' = promote_types(o, the other operand's dtype), K' = the terms each
# gradient element sums, and the operand's own dtype as o.

_DT = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _rounding(dtype):
  """(u, eta): rounding into ``dtype`` errs by <= u |v| + eta."""
  fi = jnp.finfo(dtype)
  return 2.0 ** -(fi.nmant + 1), 2.0 ** (fi.minexp - fi.nmant - 1)


def _deq64(q):
  """A QArray's dequantized values, exactly, in float64."""
  v = np.asarray(q.qvalue.astype(jnp.float32), np.float64)
  if q.zero_point is not None:
    v = v - np.asarray(qarray.expand_scale(q.zero_point, q.shape), np.float64)
  return v * np.asarray(qarray.expand_scale(q.scale, q.shape), np.float64)


def _budget(a_abs, n_terms, ref, out_dtype, rounded=()):
  """The budget above; ``rounded``: (dtype, u-weight, eta-weight) per dequantized
  side that is rounded into a float dtype (u-weight = |a|.|b|, eta-weight = 1.|other|)."""
  e = (n_terms + 3) * 2.0 ** -24 * a_abs
  for dtype, uw, ew in rounded:
    u, eta = _rounding(dtype)
    e = e + u * uw + eta * ew
  uo, eo = _rounding(out_dtype)
  return e + uo * (np.abs(ref) + e) + eo


@functools.partial(jax.jit, static_argnames=("dn", "cfg"))
def _fwd_vjp(x, w, ct, dn, cfg):
  """(out, d lhs, d rhs, lhs QArray, rhs QArray): the op and the reference
  quantization (documented spec) in one program."""
  (lc, rc), (lb, rb) = dn
  out, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)
  q = lambda v, oq, c, b: oq and qarray.quantize(v, ref_spec(oq, v.ndim, c, b))
  return (out, *vjp(ct.astype(out.dtype)), q(x, cfg.lhs, lc, lb), q(w, cfg.rhs, rc, rb))


def _same_family(lq, rq):
  return lq.qtype.is_float == rq.qtype.is_float


def check_against_float64(x, w, dn, lq, rq, *, impl="auto", seed=0, ct_scale=1.0):
  """Runs forward + VJP once (one jit) and checks dtypes and the budgets above."""
  (lc, rc), (lb, rb) = dn
  ld, rd = x.dtype, w.dtype
  o = jnp.result_type(ld, rd)
  c = jnp.promote_types(ld, rd)
  out_shape = np_dot(np.zeros(x.shape), np.zeros(w.shape), dn).shape
  ct = np.random.default_rng(seed).integers(-4, 5, out_shape) * 0.25 * ct_scale
  cfg = C.DotGeneralQtConfig(lhs=lq, rhs=rq, implementation=impl)
  out, gx, gw, xq, wq = _fwd_vjp(x, w, jnp.asarray(ct, o), dn, cfg)
  assert (out.dtype, gx.dtype, gw.dtype) == (o, ld, rd)
  assert out.shape == out_shape and gx.shape == x.shape and gw.shape == w.shape
  xh = _deq64(xq) if lq else np.asarray(x, np.float64)
  wh = _deq64(wq) if rq else np.asarray(w, np.float64)
  ax, aw = np.abs(xh), np.abs(wh)
  k = int(np.prod([x.shape[a] for a in lc]))
  # Forward.
  ref = np_dot(xh, wh, dn)
  a_abs = np_dot(ax, aw, dn)
  if lq and rq:
    rounded = [] if _same_family(lq, rq) else [(jnp.float32, 2 * a_abs, 0 * a_abs)]
  elif lq:
    rounded = [(c, a_abs, np_dot(np.ones_like(ax), aw, dn))]
  else:
    rounded = [(c, a_abs, np_dot(ax, np.ones_like(aw), dn))]
  err = np.abs(np.asarray(out, np.float64) - ref)
  bound = _budget(a_abs, k, ref, o, rounded)
  assert np.all(np.isfinite(np.asarray(out, np.float64)))
  assert np.all(err <= bound), np.max(err / bound)
  # Gradients: the other side's residual, dequantized into promote_types(o, its dtype).
  rx, rw = np_dot_vjp(ct, xh, wh, dn)
  gax, _ = np_dot_vjp(np.abs(ct), ax, aw, dn)
  _, gaw = np_dot_vjp(np.abs(ct), ax, aw, dn)
  nx = int(np.prod([w.shape[a] for a in qdot_lib.free_axes(w.ndim, rc, rb)]))
  nw = int(np.prod([x.shape[a] for a in qdot_lib.free_axes(x.ndim, lc, lb)]))
  rounded_x = [(jnp.promote_types(o, rd), gax,
                np_dot_vjp(np.abs(ct), ax, np.ones_like(aw), dn)[0])] if rq else []
  rounded_w = [(jnp.promote_types(o, ld), gaw,
                np_dot_vjp(np.abs(ct), np.ones_like(ax), aw, dn)[1])] if lq else []
  for g, r, a, n, rd_, dt in ((gx, rx, gax, nx, rounded_x, ld), (gw, rw, gaw, nw, rounded_w, rd)):
    err = np.abs(np.asarray(g, np.float64) - r)
    bound = _budget(a, n, r, dt, rd_)
    assert np.all(err <= bound), np.max(err / bound)
  return out


# The layout where XLA's CPU runtime rejects a bf16 x bf16 -> f32 dot
# (lhs (6, 9) contracting axis 0, rhs (5, 6, 3) contracting axis 1), and one
# whose batch axis is not leading (the same failure).
POLICY_LAYOUTS = dict(LAYOUTS, **{
    "km,akb": ((((0,), (1,)), ((), ())), (6, 9), (5, 6, 3)),
    "nbk,bkl": ((((2,), (1,)), ((1,), (0,))), (4, 2, 8), (2, 8, 5)),
})

_QS = ("int8", "int4", "binary", "float8_e4m3fn", "float8_e5m2")
_ALL_PAIRS = [(a, b) for a in _DT for b in _DT]
POLICY_CASES = (
    # int8 on either side under every float dtype pair (mixed included).
    [(p, "int8", None) for p in _ALL_PAIRS] + [(p, None, "int8") for p in _ALL_PAIRS] +
    # every qtype on either side: bf16 x bf16 and a float32-quantized side x float16.
    [(p, q, None) for q in _QS[1:] for p in (("bf16", "bf16"), ("f32", "f16"))] +
    [(p, None, q) for q in _QS[1:] for p in (("bf16", "bf16"), ("f16", "f32"))] +
    # both sides quantized: same kinds, mixed fp8 kinds, integer x fp8.
    [(p, lq, rq) for lq, rq in (("int8", "int8"), ("float8_e4m3fn", "float8_e4m3fn"),
                                ("float8_e5m2", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
                                ("int8", "float8_e4m3fn"), ("binary", "int4"))
     for p in (("bf16", "bf16"), ("f16", "f32"))])


@pytest.mark.slow
@pytest.mark.parametrize("dtypes,lq,rq", POLICY_CASES)
def test_dtype_policy_vs_float64(dtypes, lq, rq):
  dn, ls, rs = POLICY_LAYOUTS["km,akb"]
  seed = zlib.crc32(f"{dtypes}/{lq}/{rq}".encode()) % 1000
  x = jnp.asarray(_rand(ls, seed), _DT[dtypes[0]])
  w = jnp.asarray(_rand(rs, seed + 1), _DT[dtypes[1]])
  check_against_float64(x, w, dn, lq and OQ(qtype=lq), rq and OQ(qtype=rq), seed=seed)


@pytest.mark.parametrize("layout", list(POLICY_LAYOUTS))
@pytest.mark.parametrize("side", ["lhs", "rhs"])
@pytest.mark.thin(4)
def test_bf16_times_quantized_bf16_every_layout(layout, side):
  """bf16 x a bf16-quantized operand runs on the CPU for every layout (the
  result is read back, so a runtime rejection of the dot cannot hide behind
  asynchronous dispatch), within the bf16 budget."""
  dn, ls, rs = POLICY_LAYOUTS[layout]
  x = jnp.asarray(_rand(ls, 41), jnp.bfloat16)
  w = jnp.asarray(_rand(rs, 42), jnp.bfloat16)
  oq = OQ(qtype="int8")
  check_against_float64(x, w, dn, oq if side == "lhs" else None, oq if side == "rhs" else None)


def test_bf16_product_stays_bf16_and_float32_quantized_is_not_dequantized_into_float16():
  dn, ls, rs = POLICY_LAYOUTS["mk,kn"]
  oq = OQ(qtype="int8")
  dots = lambda f, *a: [(tuple(str(v.aval.dtype) for v in e.invars), e.params["preferred_element_type"])
                        for e in _all_eqns(jax.make_jaxpr(f)(*a).jaxpr) if e.primitive.name == "dot_general"]
  # bf16 activations x a bf16-quantized weight: a bf16 x bf16 -> float32 dot,
  # forward and backward (the GPU's fast path; the CPU lowering runs it in float32).
  xb, wb = jnp.ones(ls, jnp.bfloat16), jnp.ones(rs, jnp.bfloat16)
  f = lambda x, w: jax.vjp(lambda x, w: dot_general_qt(x, w, dn, _cfg(None, oq)), x, w)[1](
      jnp.ones((ls[0], rs[1]), jnp.bfloat16))
  found = dots(f, xb, wb)
  assert (("bfloat16", "bfloat16"), jnp.float32) in found, found
  # A float32-quantized operand x float16: no product reads float16 operands.
  xh, wf = jnp.ones(ls, jnp.float16), jnp.ones(rs, jnp.float32)
  for cfg in (_cfg(None, oq), _cfg(oq, None)):
    g = lambda x, w: jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg), x, w)[1](
        jnp.ones((ls[0], rs[1]), jnp.float32))
    found = dots(g, xh, wf)
    assert found and all("float16" not in ins for ins, _ in found), found


@pytest.mark.parametrize("side", ["lhs", "rhs"])
@pytest.mark.parametrize("magnitude", [1e5, 1e-9])
def test_float32_quantized_times_float16_extreme_but_finite(side, magnitude):
  """A float32 operand of magnitude 1e5 (products of 4 terms ~2.4e10) or 1e-9,
  quantized, times a float16 one of magnitude up to 6e4: finite, nonzero, within
  the float32 budget (dequantized into float16 it gave inf or 0)."""
  rng = np.random.default_rng(7)
  q_side = (rng.uniform(0.5, 1.0, (3, 4)) * rng.choice([-1, 1], (3, 4)) * magnitude).astype(np.float32)
  f_side = (rng.uniform(0.5, 1.0, (4, 2)) * rng.choice([-1, 1], (4, 2)) *
            (6e4 if magnitude > 1 else 1.0)).astype(np.float16)
  oq = OQ(qtype="int8")
  # Gradients into the float16 side stay finite: cotangents scaled down for 1e5.
  ct_scale = 2.0 ** -8 if magnitude > 1 else 1.0
  if side == "lhs":
    out = check_against_float64(jnp.asarray(q_side), jnp.asarray(f_side), (((1,), (0,)), ((), ())),
                                oq, None, ct_scale=ct_scale)
  else:
    out = check_against_float64(jnp.asarray(f_side.T), jnp.asarray(q_side.T), (((1,), (0,)), ((), ())),
                                None, oq, ct_scale=ct_scale)
  assert np.all(np.abs(np.asarray(out)) > 0)


# ----------------------------------------------------------------------------
# Empty operands: zeros of lax.dot_general's output, zero / empty gradients.

EMPTY_CASES = {
    "M=0": ((((1,), (0,)), ((), ())), (0, 8), (8, 4)),
    "K=0": ((((1,), (0,)), ((), ())), (4, 0), (0, 3)),
    "N=0": ((((1,), (0,)), ((), ())), (4, 8), (8, 0)),
    "batch=0": ((((2,), (1,)), ((0,), (0,))), (0, 4, 8), (0, 8, 3)),
}


@pytest.mark.parametrize("impl", ["auto", "xla", "interpret"])
@pytest.mark.parametrize("case", list(EMPTY_CASES))
@pytest.mark.parametrize("qs", [("int8", "int8"), (None, "int4"), ("float8_e4m3fn", None)])
def test_empty_operands_give_lax_results(impl, case, qs):
  dn, ls, rs = EMPTY_CASES[case]
  gq = C.GradQuant(qtype="int8", stochastic_rounding="uniform")
  cfg = C.DotGeneralQtConfig(lhs=qs[0] and OQ(qtype=qs[0]),
                             rhs=qs[1] and OQ(qtype=qs[1]), dlhs_grad=gq, drhs_grad=gq,
                             implementation=impl)
  x, w = jnp.ones(ls, jnp.bfloat16), jnp.ones(rs, jnp.float32)
  want = jax.lax.dot_general(x, w, dn)
  ct = jnp.ones(want.shape, want.dtype)

  @jax.jit
  def run(x, w, key):
    out, vjp = jax.vjp(lambda x, w: dot_general_qt(x, w, dn, cfg, key=key), x, w)
    return (out, *vjp(ct))

  out, gx, gw = run(x, w, jax.random.key(0))
  assert (out.shape, out.dtype) == (want.shape, want.dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  assert (gx.shape, gx.dtype, gw.shape, gw.dtype) == (ls, x.dtype, rs, w.dtype)
  assert not np.any(np.asarray(gx, np.float32)) and not np.any(np.asarray(gw, np.float32))


# ----------------------------------------------------------------------------
# Dimension numbers: rejected before any work, naming the axes.

BAD_DIMS = [
    ((((1, 1), (0, 0)), ((), ())), (4, 4), (4, 4), r"lhs contracting axes \(1, 1\) repeat"),
    ((((1, -1), (0, 1)), ((), ())), (4, 4), (4, 4), r"lhs contracting axes \(1, -1\) repeat"),
    ((((2,), (1,)), ((0, 0), (0, 0))), (2, 3, 4), (2, 4, 5), r"lhs batch axes \(0, 0\) repeat"),
    ((((1,), (1,)), ((1,), (0,))), (3, 4), (3, 4), r"lhs axes \[1\] are both contracting and batch"),
    ((((1,), (0, 1)), ((), ())), (3, 4), (4, 4), r"lhs has 1 contracting axes, rhs 2"),
    ((((1,), (0,)), ((0,), ())), (3, 4), (4, 5), r"lhs has 1 batch axes, rhs 0"),
    ((((1,), (0,)), ((), ())), (3, 4), (5, 6), r"contracting axes lhs 1 \(size 4\) and rhs 0 \(size 5\)"),
    ((((2,), (1,)), ((0,), (0,))), (2, 3, 4), (3, 4, 5), r"batch axes lhs 0 \(size 2\) and rhs 0 \(size 3\)"),
    ((((2,), (0,)), ((), ())), (3, 4), (4, 5), r"lhs contracting axis 2 is out of range for lhs of rank 2"),
    ((((1.5,), (0,)), ((), ())), (3, 4), (4, 5), r"with int axes"),
]


@pytest.mark.parametrize("dn,ls,rs,msg", BAD_DIMS)
def test_bad_dimension_numbers_raise_naming_the_axes(dn, ls, rs, msg):
  cfg = _cfg(OQ(qtype="int8"), OQ(qtype="int8"))
  with pytest.raises(ValueError, match=r"dimension_numbers=.*" + msg):
    dot_general_qt(jnp.ones(ls), jnp.ones(rs), dn, cfg)
  with pytest.raises(ValueError, match=msg):
    qdot_lib.normalize_dimension_numbers(dn, len(ls), len(rs), lhs_shape=ls, rhs_shape=rs)


@pytest.mark.slow
def test_fold_exponent_matches_its_definition_on_float32_edges():
  """dot_general_qt._fold_exponent reads both ends of each group from one integer reduction of
  the float32 bits: compare with the definition (one above the exponent of the largest finite
  value, capped 126 above the smallest positive normal one's, clipped to [0, 127]; subnormals
  count as zero) on scales spanning subnormals to the float32 limit, with zeros, negatives, Inf and NaN
  in the groups."""
  rng = np.random.default_rng(3)
  tiny = np.finfo(np.float32).tiny

  def exponent(v):  # floor(log2 v) for normal v; -127 for 0 and subnormals
    return np.where(v >= tiny, np.frexp(np.maximum(v, tiny))[1] - 1, -127)

  fold = jax.jit(dqt._fold_exponent, static_argnums=1)
  for trial in range(200):
    # A few shapes (each is one compile), random values in each trial.
    b, k = int(rng.choice([1, 3])), int(rng.choice([1, 2, 7, 29]))
    t = (2.0 ** rng.uniform(-149, 128, (b, k)) * rng.uniform(1, 2, (b, k)))
    with np.errstate(over="ignore"):
      t = t.astype(np.float32)
    pick = rng.random((b, k))
    t[pick < 0.05] = 0
    t[(pick >= 0.05) & (pick < 0.08)] = np.inf
    t[(pick >= 0.08) & (pick < 0.1)] = np.nan
    t[(pick >= 0.1) & (pick < 0.13)] *= -1
    got = np.asarray(fold(jnp.asarray(t), (1,))).reshape(b)
    finite = np.isfinite(t)
    top = np.max(np.where(finite & (t > 0), t, 0), axis=1)
    low = np.min(np.where(finite & (t >= tiny), t, 1), axis=1)
    want = np.clip(np.minimum(exponent(top) + 1, exponent(low) + 126), 0, 127)
    np.testing.assert_array_equal(got, want, err_msg=str(t))


# ----------------------------------------------------------------------------
# Both gradient quantizations from one pass (qtrain.kernels.grad_pair), interpreted.


def _pair_cfg(implementation, method="low_bit_hash", **grad):
  gq = C.GradQuant(qtype=grad.pop("qtype", "int8"), stochastic_rounding=method, **grad)
  return C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"),
                              dlhs_grad=gq, drhs_grad=gq, implementation=implementation)


PAIR_CASES = [  # (lhs shape, rhs shape, dimension numbers): layouts whose g tiles by 64
    ((128, 64), (64, 192), (((1,), (0,)), ((), ()))),        # x @ W
    ((2, 64, 32), (32, 4, 32), (((2,), (0,)), ((), ()))),    # DenseGeneral: two free axes each
    ((64, 32), (128, 32), (((1,), (1,)), ((), ()))),         # x @ W.T
    ((32, 128), (32, 64), (((0,), (0,)), ((), ()))),         # x.T @ W
    ((2, 64, 4, 16), (4, 16, 64), (((2, 3), (0, 1)), ((), ()))),  # attention's out projection
]


def _pair_grads(cfg, xs, ws, dn, seed=0):
  x = jax.random.normal(jax.random.key(seed), xs, jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(seed + 1), ws) *
       jnp.exp(jax.random.normal(jax.random.key(seed + 2), ws[-1:]) * 2)).astype(jnp.bfloat16)
  out = qdot_lib.output_shape(xs, ws, qdot_lib.normalize_dimension_numbers(dn, len(xs), len(ws)))
  weights = jax.random.normal(jax.random.key(seed + 3), out)

  def f(x, w):
    y = dot_general_qt(x, w, dn, cfg, key=jax.random.key(seed + 4))
    return (y.astype(jnp.float32) * weights).sum()
  return jax.jit(jax.grad(f, (0, 1)))(x, w), jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)


def _uses_pair_kernel(jaxpr) -> bool:
  return any(e.primitive.name == "pallas_call" and "qtrain_grad_pair" in str(e.params.get("name", ""))
             + str(e.params.get("name_and_src_info", "")) for e in _all_eqns(jaxpr.jaxpr))


@pytest.mark.slow
@pytest.mark.parametrize("xs,ws,dn", PAIR_CASES)
@pytest.mark.parametrize("method", ["low_bit_hash", None])
def test_gradient_pair_kernel_gives_the_xla_gradients_bit_for_bit(xs, ws, dn, method):
  (gx, gw), jaxpr = _pair_grads(_pair_cfg("interpret", method), xs, ws, dn)
  (rx, rw), ref_jaxpr = _pair_grads(_pair_cfg("xla", method), xs, ws, dn)
  assert _uses_pair_kernel(jaxpr) and not _uses_pair_kernel(ref_jaxpr)
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(rx, np.float32))
  np.testing.assert_array_equal(np.asarray(gw, np.float32), np.asarray(rw, np.float32))
  assert float(jnp.abs(gw.astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("what,cfg,xs,expected", [
    ("int8, low_bit_hash", _pair_cfg("auto"), (128, 64), True),
    ("uniform noise (threefry)", _pair_cfg("auto", "uniform"), (128, 64), False),
    ("a gradient tile", _pair_cfg("auto", tile_size=32), (128, 64), False),
    ("fp8 gradients", _pair_cfg("auto", qtype="float8_e5m2"), (128, 64), True),
    ("mxfp8 gradients (blocks along each contraction)", _pair_cfg("auto", qtype="mxfp8"),
     (128, 64), False),
    ("rows that do not tile", _pair_cfg("auto"), (100, 64), False),
    ("the XLA reference", _pair_cfg("xla"), (128, 64), False),
])
def test_gradient_pair_kernel_only_where_it_computes_the_same_numbers(what, cfg, xs, expected):
  """"auto" traces the kernel for a CUDA lowering (both platform branches are in the jaxpr)
  exactly where it reproduces the per-product quantizations."""
  dn = (((1,), (0,)), ((), ()))
  x = jnp.ones(xs, jnp.bfloat16)
  w = jnp.ones((64, 128), jnp.bfloat16)
  f = lambda x, w: dot_general_qt(x, w, dn, cfg, key=jax.random.key(0)).astype(jnp.float32).sum()
  assert _uses_pair_kernel(jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)) == expected, what


# ----------------------------------------------------------------------------
# Kernels inside a user's jax.shard_map (check_vma=True, the default).


def test_kernels_trace_inside_shard_map_typed_like_their_operands():
  """Every Pallas kernel of a quantized dot's step (the Triton product kernels, the gradient
  pair kernels) types its outputs as varying over the mesh axes its operands vary over, as
  XLA's ops do; a Pallas output left untyped is refused inside ``shard_map``. Traced only: the
  Pallas interpreter itself does not run under ``check_vma`` (it mixes the kernel's constants
  with the operands' types), so the values are compared on a GPU (test_ops_gpu.py)."""
  from jax.sharding import Mesh, PartitionSpec as P
  gq = C.GradQuant(qtype="int8", stochastic_rounding="low_bit_hash")
  cfg = C.DotGeneralQtConfig(lhs=C.OperandQuant(qtype="int8"), rhs=C.OperandQuant(qtype="int8"),
                             dlhs_grad=gq, drhs_grad=gq, implementation="interpret")
  x = jax.random.normal(jax.random.key(0), (128, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
  loss = lambda x, w: (dot_general_qt(x, w, (((1,), (0,)), ((), ())), cfg, key=jax.random.key(4))
                       .astype(jnp.float32) ** 2).sum()

  def step(x, w):
    gx, gw = jax.grad(loss, (0, 1))(x, w)
    return gx, jax.lax.psum(gw, "data")

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  f = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
  jaxpr = jax.make_jaxpr(f)(x, w)
  names = [str(e.params.get("name", "")) + str(e.params.get("name_and_src_info", ""))
           for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
  assert sum("qtrain_grad_pair" in n for n in names) == 2, names
  assert len(names) >= 5, names  # the forward and both backward products too
