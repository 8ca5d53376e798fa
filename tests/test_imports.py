"""The package's layering, read from the source: every import points down.

Layers, lowest first (a module may import its own layer and the ones below):

  core     numerics: qtypes, QArray, calibration, rounding, packing, estimators, qdot
  kernels  the Pallas GPU kernels (Triton, Mosaic)
  ops      the QT ops, their configs and the backend dispatch
  api      rules, the binary presets, the provider, optax transforms, N:M sparsity
  flax     the linen / nnx adapters and the interception
  layers   qlayers (modules built on the ops and the presets)
  export   freeze and the frozen layers
  compat   qwix (qwix's QT and PTQ API over the provider, quantize_model and freeze)
  package  qtrain/__init__.py

No module imports qtrain inside a function (a lazy import hides a cycle or an
upward arrow from this test), and the module graph has no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "qtrain"
LAYERS = ("core", "kernels", "ops", "api", "flax", "layers", "export", "compat", "package")
API = {"qtrain.rules", "qtrain.binary", "qtrain.provider", "qtrain.optim", "qtrain._einsum",
       "qtrain.sparsity"}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for f in sorted(ROOT.rglob("*.py")):
    parts = f.relative_to(ROOT.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = f
  return out


MODULES = _modules()


def layer(mod: str) -> str:
  if mod == "qtrain":
    return "package"
  for pkg in ("core", "kernels", "ops", "flax"):
    if mod == f"qtrain.{pkg}" or mod.startswith(f"qtrain.{pkg}."):
      return pkg
  if mod in API:
    return "api"
  if mod == "qtrain.qlayers":
    return "layers"
  if mod == "qtrain.qwix" or mod == "qtrain._qwix" or mod.startswith("qtrain._qwix."):
    return "compat"
  if mod in ("qtrain.freeze", "qtrain._frozen", "qtrain.lora"):
    return "export"
  raise AssertionError(f"{mod}: no layer assigned; add it to tests/test_imports.py")


def _target(node: ast.ImportFrom | ast.Import, name: str | None = None) -> list[str]:
  """The qtrain modules an import statement loads."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name.split(".")[0] == "qtrain"]
  base = node.module or ""
  if base.split(".")[0] != "qtrain":
    return []
  out = []
  for a in node.names:
    sub = f"{base}.{a.name}"
    out.append(sub if sub in MODULES else base)
  return out


def imports(mod: str) -> tuple[set[str], list[str]]:
  """(qtrain modules imported at module level, function-level qtrain imports as text)."""
  tree = ast.parse(MODULES[mod].read_text())
  top, inner = set(), []
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      top.update(_target(node))
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0 and _target(node):
      inner.append(f"line {node.lineno}: {ast.unparse(node)}")
  top.discard(mod)
  return top, inner


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_point_down(mod):
  top, inner = imports(mod)
  assert not inner, f"{mod} imports qtrain inside a function: {inner}"
  mine = LAYERS.index(layer(mod))
  up = sorted(t for t in top if LAYERS.index(layer(t)) > mine)
  assert not up, f"{mod} ({layer(mod)}) imports from a higher layer: {up}"


def test_core_imports_only_core():
  for mod in MODULES:
    if layer(mod) == "core":
      top, _ = imports(mod)
      assert all(layer(t) == "core" for t in top), (mod, sorted(top))


def test_no_import_cycles():
  graph = {m: imports(m)[0] for m in MODULES}
  state: dict[str, int] = {}  # 1 on the stack, 2 done

  def visit(m, path):
    state[m] = 1
    for t in sorted(graph[m]):
      # A package's __init__ importing its own submodules is how packages work; a submodule
      # importing its package's __init__ back would be a cycle through it.
      if t not in graph:
        continue
      if state.get(t) == 1:
        raise AssertionError("import cycle: " + " -> ".join(path + [t]))
      if t not in state:
        visit(t, path + [t])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
