"""Importing qtrain starts no JAX backend: a user's XLA_FLAGS / jax_platforms set after
``import qtrain`` still take effect (the interception resolves JAX's array class lazily)."""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import importlib, os, pkgutil
    import qtrain
    for info in pkgutil.walk_packages(qtrain.__path__, "qtrain."):
      importlib.import_module(info.name)
    from jax._src import xla_bridge
    assert not xla_bridge._backends, sorted(xla_bridge._backends)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.config.update("jax_platforms", "cpu")
    print(len(jax.devices()), jax.devices()[0].platform)
""")


def test_import_starts_no_backend_and_later_flags_apply():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["4", "cpu"], out.stdout
