"""Run by tests/kernels/test_kernels_sharded.py in a subprocess with 4 fake CPU devices
(``XLA_FLAGS`` must be set before jax starts): the per-shard kernel wrappers of
:mod:`qtrain.kernels.sharded` under ``jax.jit`` with sharded operands, each partitioner, and
under ``jax.vmap`` / ``jax.shard_map``. Prints one JSON object."""

import json
import re

from _four_devices import COLLECTIVES  # 4 fake devices and argv[1]'s partitioner, before jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from qtrain.kernels import sharded  # noqa: E402



# A pure-jnp stand-in for the kernel. (A host callback, opaque like a Pallas call, is placed on
# one device by the partitioner and cannot stand in here.)


TRACED_SHAPES = []  # the lhs shape of each trace of the kernel function


def kernel(a, b, sa, sb, *, out_dtype):
  TRACED_SHAPES.append(tuple(a.shape))
  acc = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
  return (acc.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(out_dtype)


def local_transpose(x):
  return jnp.transpose(x, (1, 0))


mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
rng = np.random.default_rng(0)
a = jnp.asarray(rng.integers(-127, 128, (64, 96)), jnp.int8)
b = jnp.asarray(rng.integers(-127, 128, (32, 96)), jnp.int8)
sa = jnp.asarray(rng.uniform(0.5, 2.0, 64), jnp.float32)
sb = jnp.asarray(rng.uniform(0.5, 2.0, 32), jnp.float32)
exact = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * np.asarray(sa, np.float64)[:, None] \
    * np.asarray(sb, np.float64)[None, :]
one_device = np.asarray(kernel(a, b, sa, sb, out_dtype=jnp.float32))
out = {}
cases = {"m": (P("data", None), P(None, None)), "m_n": (P("data", None), P("model", None)),
         "k": (P(None, "data"), P(None, "data")), "m_k": (P("data", "model"), P(None, "model"))}
for name, (aspec, bspec) in cases.items():
  shard = lambda s: NamedSharding(mesh, s)
  f = jax.jit(lambda a, b, sa, sb: sharded.gemm(kernel, a, b, sa, sb, out_dtype=jnp.float32),
              in_shardings=(shard(aspec), shard(bspec), shard(P(aspec[0])), shard(P(bspec[0]))))
  got = f(a, b, sa, sb)
  hlo = f.lower(a, b, sa, sb).compile().as_text()
  out[name] = dict(
      equal_one_device=bool(np.array_equal(np.asarray(got), one_device)),
      rel_err=float(np.max(np.abs(np.asarray(got, np.float64) - exact) / np.max(np.abs(exact)))),
      out_spec=[None if e is None else str(e) for e in tuple(got.sharding.spec)],
      collectives=sorted(set(re.findall(COLLECTIVES, hlo))))
x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
f = jax.jit(lambda x: sharded.transpose(x, (1, 0), local_transpose),
            in_shardings=NamedSharding(mesh, P("data", "model")))
got = f(x)
out["transpose"] = dict(equal=bool(np.array_equal(np.asarray(got), np.asarray(x).T)),
                        out_spec=[None if e is None else str(e) for e in tuple(got.sharding.spec)],
                        collectives=sorted(set(re.findall(COLLECTIVES, f.lower(x).compile().as_text()))))
stacked = jnp.stack([a, -a])
got = jax.vmap(lambda a: sharded.gemm(kernel, a, b, sa, sb, out_dtype=jnp.float32))(stacked)
out["vmap_equal"] = bool(np.array_equal(np.asarray(got[0]), one_device)
                         and np.array_equal(np.asarray(got[1]), -one_device))
got = jax.vmap(lambda x: sharded.transpose(x, (1, 0), local_transpose))(jnp.stack([x, 2 * x]))
out["vmap_transpose_equal"] = bool(np.array_equal(np.asarray(got[1]), 2 * np.asarray(x).T))
g = jax.jit(jax.shard_map(
    lambda a, sa: sharded.gemm(kernel, a, b, sa, sb, out_dtype=jnp.float32), mesh=mesh,
    in_specs=(P("data"), P("data")), out_specs=P("data")))
out["shard_map_equal"] = bool(np.array_equal(np.asarray(g(a, sa)), one_device))
out["single_device_equal"] = bool(np.array_equal(
    np.asarray(jax.jit(lambda *v: sharded.gemm(kernel, *v, out_dtype=jnp.float32))(a, b, sa, sb)),
    one_device))
# Several call sites of one per-shard signature: the partitioner asks for each site's per-shard
# computation, and the kernel function is lowered for the shard shape once, not once per site.
sites = 5


def site_kernel(a, b, sa, sb, *, out_dtype):  # a signature no case above has lowered
  return kernel(a, b, sa, sb, out_dtype=out_dtype)


TRACED_SHAPES.clear()
shard = NamedSharding(mesh, P("data", None))
f = jax.jit(lambda a, sa: sum(sharded.gemm(site_kernel, a, b, sa * (i + 1), sb, out_dtype=jnp.float32)
                              for i in range(sites)), in_shardings=(shard, NamedSharding(mesh, P("data"))))
got = f(a, sa)
out["sites"] = dict(sites=sites, shard_traces=TRACED_SHAPES.count((a.shape[0] // 2, a.shape[1])),
                    equal=bool(np.allclose(np.asarray(got), sum((i + 1) * one_device
                                                                 for i in range(sites)), rtol=1e-6)))
print(json.dumps(out))
