"""The shared start of the kernel tests' subprocess scripts (``_sharded_run.py``,
``_sharded_weight_run.py``): 4 fake CPU devices (``XLA_FLAGS`` must be set before jax starts)
and the partitioner named by ``argv[1]``. Import it before jax."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

PARTITIONER = sys.argv[1]
jax.config.update("jax_use_shardy_partitioner", PARTITIONER == "shardy")
# The collective ops of a compiled HLO text (async forms included).
COLLECTIVES = r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
