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
upward arrow from this test), nor through ``importlib.import_module`` / ``__import__``;
relative imports are resolved like absolute ones; and the module graph has no cycle.
Every top-level module a user reaches is exported (``qtrain.__all__``), and docs/design.md's
layer map names every top-level module and subpackage.
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


def _package(mod: str) -> str:
  """The package a module's relative imports start from."""
  return mod if MODULES[mod].name == "__init__.py" else mod.rpartition(".")[0]


def _target(node: ast.ImportFrom | ast.Import, mod: str) -> list[str]:
  """The qtrain modules an import statement of module ``mod`` loads."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name.split(".")[0] == "qtrain"]
  base = node.module or ""
  if node.level:  # from . import x / from ..core import y: resolved against mod's package
    pkg = _package(mod).split(".")
    pkg = pkg[:len(pkg) - (node.level - 1)]
    base = ".".join(pkg + ([base] if base else []))
  if base.split(".")[0] != "qtrain":
    return []
  out = []
  for a in node.names:
    sub = f"{base}.{a.name}"
    out.append(sub if sub in MODULES else base)
  return out


def _dynamic_import(node: ast.AST) -> bool:
  """An ``importlib.import_module("qtrain...")`` / ``__import__("qtrain...")`` call (or a
  relative name): an import this test could not otherwise see."""
  if not isinstance(node, ast.Call) or not node.args:
    return False
  f = node.func
  name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
  if name not in ("import_module", "__import__"):
    return False
  arg = node.args[0]
  return not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
              and not arg.value.startswith(("qtrain", ".")))


def imports(mod: str) -> tuple[set[str], list[str]]:
  """(qtrain modules imported at module level, function-level qtrain imports as text)."""
  tree = ast.parse(MODULES[mod].read_text())
  top, inner = set(), []
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      top.update(_target(node, mod))
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0 and _target(node, mod):
      inner.append(f"line {node.lineno}: {ast.unparse(node)}")
    elif _dynamic_import(node):
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


def test_the_reader_sees_relative_and_dynamic_imports(monkeypatch, tmp_path):
  """The import reader resolves relative imports and reports dynamic ones (else a cycle or an
  upward arrow written that way would pass this file unseen)."""
  src = tmp_path / "qarray.py"
  src.write_text("from . import qtypes\nfrom ..ops import dispatch\n"
                 "import importlib\n"
                 "def f():\n  return importlib.import_module('qtrain.flax.model')\n")
  monkeypatch.setitem(MODULES, "qtrain.core.qarray", src)
  top, inner = imports("qtrain.core.qarray")
  assert top == {"qtrain.core.qtypes", "qtrain.ops.dispatch"}, top
  assert len(inner) == 1 and "qtrain.flax.model" in inner[0], inner


# Top-level modules whose user-facing names (QtRule, QtProvider, quantize_model, ...) are
# exported themselves, rather than the module.
_NAMES_EXPORTED = {"qtrain.rules": ["QtRule"], "qtrain.provider": ["QtProvider", "RNG_STREAM"],
                   "qtrain.flax": ["quantize_model", "summary", "QtOp"]}


def _top_level() -> list[str]:
  return sorted(m for m in MODULES if m.count(".") == 1)


def test_every_public_top_level_module_is_exported():
  """A public (non-underscore) top-level module or subpackage is in qtrain.__all__, or its
  user-facing names are: a new user module cannot be left reachable only by accident."""
  import qtrain
  for mod in _top_level():
    short = mod.split(".")[1]
    if short.startswith("_"):
      continue
    if mod in _NAMES_EXPORTED:
      assert set(_NAMES_EXPORTED[mod]) <= set(qtrain.__all__), mod
    else:
      assert short in qtrain.__all__, f"{mod} is not in qtrain.__all__ (or _NAMES_EXPORTED)"


def test_design_doc_maps_every_top_level_module():
  """docs/design.md's layer map names every top-level module and subpackage."""
  doc = (ROOT.parent / "docs" / "design.md").read_text()
  for mod in _top_level():
    short = mod.split(".")[1]
    path = f"qtrain/{short}/" if MODULES[mod].name == "__init__.py" else f"qtrain/{short}.py"
    assert path in doc, f"docs/design.md does not name {path}"
