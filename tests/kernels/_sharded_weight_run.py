"""Run by tests/kernels/test_kernels_sharded.py in a subprocess with 4 fake CPU devices: the
weight-times-activation kernels (:func:`qtrain.kernels.sharded.weight_matmul`) under
``jax.jit`` with sharded operands, one partitioner (argv[1]). The Triton kernels run for real
in the Pallas interpreter, through the dispatch (``implementation="interpret"``); the Mosaic
kernel has no CPU interpreter, so a stand-in reads its weight layout (a shard of a
MosaicWeight must hold that shard's channels). Prints one JSON object."""

import json
import re

from _four_devices import COLLECTIVES  # 4 fake devices and argv[1]'s partitioner, before jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from qtrain.core import qarray as qa, qtypes  # noqa: E402
from qtrain.kernels import mosaic_matmul as mm, nbit_matmul as nbm, prepared, sharded  # noqa: E402
from qtrain.ops import dispatch  # noqa: E402

DN = (((1,), (1,)), ((), ()))
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
S = lambda *spec: NamedSharding(mesh, P(*spec))
rng = np.random.default_rng(0)
M, K = 32, 256


def spec_of(a):
  s = [None if e is None else (list(e) if isinstance(e, tuple) else e) for e in a.sharding.spec]
  return s + [None] * (a.ndim - len(s))


def weight_shardings(w, n_spec):
  """The weight's arrays sharded along N on ``n_spec`` (layout axes), else replicated."""
  lay = sharded.weight_layout(w)
  leaves, tree = jax.tree_util.tree_flatten(w)
  return tree.unflatten([S(*[n_spec if i == a else None for i in range(l.ndim)])
                         for l, a in zip(leaves, lay.n_axes)])


def shard_calls():
  """The per-shard kernels lowered so far: [x's shard shape, the shard's N], one per signature."""
  return sorted([list(key[2][0][0]), dict(key[1])["n_local"]] for key in sharded._EXPORTED
                if key[0] is sharded._weight_matmul_flat)


def check(f, args, in_shardings, one):
  sharded._EXPORTED.clear()  # what this case lowers per shard, alone
  g = jax.jit(f, in_shardings=in_shardings)
  got = g(*args)
  hlo = g.lower(*args).compile().as_text()
  got_np, one = np.asarray(got, np.float64), np.asarray(one, np.float64)
  return dict(equal=bool(np.array_equal(got_np, one)),
              rel_err=float(np.max(np.abs(got_np - one)) / np.max(np.abs(one))),
              out_spec=spec_of(got), collectives=sorted(set(re.findall(COLLECTIVES, hlo))),
              shard_calls=shard_calls())


def int8_acts(m, k):
  codes = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, (m, 1)), jnp.float32)
  return qa.QArray(qvalue=codes, scale=scale, zero_point=None, qtype=qtypes.get_qtype("int8"))


# Triton kernels (interpreted), through the dispatch: int8 x int8 per channel (the int8
# kernel, exact), int8 x binary (exact), float32 x int4 in groups of 64 stored (K, N) (the
# N-bit kernel; float sums).
x8 = int8_acts(M, K)
xf = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
weights = {
    "int8": (x8, prepared.prepare_weight(
        jnp.asarray(rng.integers(-127, 128, (256, K)), jnp.int8), "int8",
        scale=jnp.asarray(rng.uniform(0.5, 2.0, 256), jnp.float32))),
    "binary": (x8, prepared.prepare_weight(
        jnp.asarray(np.where(rng.random((256, K)) > 0.5, 1, -1), jnp.int8), "binary",
        scale=jnp.asarray(rng.uniform(0.5, 2.0, 256), jnp.float32))),
    "int4_groups_kn": (xf, prepared.prepare_weight(
        jnp.asarray(rng.integers(-8, 8, (256, K)), jnp.int8), "int4",
        scale=jnp.asarray(rng.uniform(0.5, 2.0, (256, K // 64)), jnp.float32), group_size=64,
        kn=True)),
    # N = 200 is padded to 256 channels: N cannot split (a shard of the arrays is not a shard
    # of the output's 200 columns) and is gathered.
    "int8_padded": (x8, prepared.prepare_weight(
        jnp.asarray(rng.integers(-127, 128, (200, K)), jnp.int8), "int8",
        scale=jnp.asarray(rng.uniform(0.5, 2.0, 200), jnp.float32))),
}


def product(x, w):
  return dispatch.quantized_dot_general(x, w, DN, preferred_element_type=jnp.float32,
                                        implementation="interpret")


def x_sharding(x, m_spec, k_spec=None):
  if isinstance(x, qa.QArray):
    return qa.QArray(qvalue=S(m_spec, k_spec), scale=S(m_spec, None), zero_point=None,
                     qtype=x.qtype)
  return S(m_spec, k_spec)


out = {}
for name, (x, w) in weights.items():
  one = product(x, w)  # one device, eagerly: the kernel as it is
  # jit on one device inlines the kernel: the same numbers, bit for bit
  out[f"{name}_one_device_equal"] = bool(np.array_equal(np.asarray(jax.jit(product)(x, w)),
                                                        np.asarray(one)))
  cases = {"m": ("data", None), "n": (None, "model"), "m_n": ("data", "model")}
  if name == "int8":
    cases["k"] = ("k", None)
  for case, (m_spec, n_spec) in cases.items():
    xs = x_sharding(x, None, "model") if m_spec == "k" else x_sharding(x, m_spec)
    out[f"{name}_{case}"] = check(product, (x, w), (xs, weight_shardings(w, n_spec)), one)

# A QArray weight: packed per call inside the step (XLA), then the kernel per shard.
wq = qa.QArray(qvalue=jnp.asarray(rng.integers(-127, 128, (128, K)), jnp.int8),
               scale=jnp.asarray(rng.uniform(0.5, 2.0, (128, 1)), jnp.float32), zero_point=None,
               qtype=qtypes.get_qtype("int8"))
out["qarray_m"] = check(product, (x8, wq), (x_sharding(x8, "data"),
                                             qa.QArray(qvalue=S(), scale=S(), zero_point=None,
                                                       qtype=wq.qtype)), product(x8, wq))

# Inside shard_map the kernel runs on the block it is given (inlined).
w8 = weights["int8"][1]
g = jax.jit(jax.shard_map(lambda q, s: product(qa.QArray(qvalue=q, scale=s, zero_point=None,
                                                          qtype=x8.qtype), w8),
                          mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                          check_vma=False))  # Pallas out_shapes carry no vma
out["shard_map_equal"] = bool(np.array_equal(np.asarray(g(x8.qvalue, x8.scale)),
                                             np.asarray(product(x8, w8))))


# The Mosaic weight layout, with a stand-in for its kernel (exact: int32 sums).
def mosaic_stand_in(x, w, *, x_scale, out_dtype):
  acc = jax.lax.dot_general(x, mm.mosaic_weight_values(w), DN, preferred_element_type=jnp.int32)
  out = acc.astype(jnp.float32) * w.w_scale[None, :]
  return (out if x_scale is None else out * x_scale[:, None]).astype(out_dtype)


xm = jnp.asarray(rng.integers(-127, 128, (8, 512)), jnp.int8)
xms = jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32)
codes = jnp.asarray(rng.integers(-8, 8, (512, 512)), jnp.int8)
ms = jnp.asarray(rng.uniform(0.5, 2.0, 512), jnp.float32)
for name, tiles in (("row_major", None), ("tiled", (256, 256))):
  w = mm.prepare_mosaic_weight(codes, "int4", scale=ms, order="int8", tiles=tiles)
  f = lambda x, s, w: sharded.weight_matmul(mosaic_stand_in, x, w, x_scale=s,
                                            out_dtype=jnp.float32)
  one = f(xm, xms, w)
  # 4 shards of N = 512 would be 128 rows, not whole 256-row blocks: N is gathered
  for case, (m_spec, n_spec) in {"m": ("data", None), "n": (None, "model"),
                                 "m_n": ("data", "model"),
                                 "n4": (None, ("data", "model"))}.items():
    out[f"mosaic_{name}_{case}"] = check(f, (xm, xms, w),
                                         (S(m_spec, None), S(m_spec), weight_shardings(w, n_spec)),
                                         one)

# vmap runs the kernel function vmapped (no partitioning).
w = mm.prepare_mosaic_weight(codes, "int4", scale=ms, order="int8")
got = jax.vmap(lambda x: sharded.weight_matmul(mosaic_stand_in, x, w, x_scale=xms,
                                               out_dtype=jnp.float32))(jnp.stack([xm, -xm]))
one = sharded.weight_matmul(mosaic_stand_in, xm, w, x_scale=xms, out_dtype=jnp.float32)
out["vmap_equal"] = bool(np.array_equal(np.asarray(got[0]), np.asarray(one))
                         and np.array_equal(np.asarray(got[1]), -np.asarray(one)))

# Several call sites of one per-shard signature: the kernel is traced for the shard once.
TRACED = []


def counting_nbit(x, w, *, x_scale, out_dtype):
  TRACED.append(tuple(x.shape))
  return nbm.nbit_matmul(x, w, x_scale=x_scale, out_dtype=out_dtype, interpret=True)


xf2, w4 = weights["int4_groups_kn"]
sites = 4
f = jax.jit(lambda x: sum(sharded.weight_matmul(counting_nbit, x * (i + 1), w4,
                                                out_dtype=jnp.float32) for i in range(sites)),
            in_shardings=S("data", None))
got = f(xf2)
ref = sum(np.asarray(nbm.nbit_matmul(xf2 * (i + 1), w4, interpret=True), np.float64)
          for i in range(sites))
out["sites"] = dict(sites=sites, shard_traces=TRACED.count((M // 2, K)),
                    rel_err=float(np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref))))
print(json.dumps(out))
