"""The docs hold: the qtrain names their code blocks use exist, their links resolve, and the
figures they link to benchmarks/RESULTS.md are in the rows linked.

Each ```python block of README.md and docs/*.md is parsed (not run: most continue a user's own
model). Every name bound from qtrain by an import (``import qtrain``, ``import qtrain.ops as
qo``, ``from qtrain.freeze import freeze``) and every attribute chain read from such a name
(``qo.DotGeneralQtConfig``, ``qtrain.binary.rules``) must resolve: a renamed or moved API
fails here instead of in a reader's first try.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, int, str]]:
  out = []
  for path in DOCS:
    text = path.read_text()
    for m in BLOCK.finditer(text):
      out.append((str(path.relative_to(ROOT)), text[:m.start()].count("\n") + 1, m.group(1)))
  return out


def _resolve(dotted: str):
  """The object a dotted path names: the longest importable module prefix, then attributes."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for name in parts[i:]:
      obj = getattr(obj, name)
    return obj
  raise ImportError(dotted)


def _qtrain_names(tree: ast.AST) -> dict[str, str]:
  """Local name -> the dotted qtrain path it is bound to by the block's imports."""
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] == "qtrain":
          names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "qtrain"
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qtrain":
      for a in node.names:
        names[a.asname or a.name] = f"{node.module}.{a.name}"
  return names


def _chains(tree: ast.AST, names: dict[str, str]) -> set[str]:
  """Every maximal ``name.attr.attr`` read from a qtrain-bound name, as a dotted qtrain path."""
  out = set()
  parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and node.id in names:
      path, cur = [names[node.id]], node
      while isinstance(parents.get(cur), ast.Attribute) and parents[cur].value is cur:
        cur = parents[cur]
        path.append(cur.attr)
      out.add(".".join(path))
  return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks():
  assert len(BLOCKS) >= 5, [b[:2] for b in BLOCKS]


@pytest.mark.parametrize("where,line,code", BLOCKS, ids=[f"{w}:{n}" for w, n, _ in BLOCKS])
def test_qtrain_names_in_a_docs_code_block_exist(where, line, code):
  tree = ast.parse(code)  # a block that is not valid Python fails here
  names = _qtrain_names(tree)
  missing = []
  for dotted in sorted(set(names.values()) | _chains(tree, names)):
    try:
      _resolve(dotted)
    except (ImportError, AttributeError) as e:
      missing.append(f"{dotted} ({type(e).__name__}: {e})")
  assert not missing, f"{where}, block at line {line}: {missing}"


# ----------------------------------------------------------------------------
# Links, and the figures linked to benchmarks/RESULTS.md rows.


def test_links_resolve_and_linked_figures_are_in_their_rows(tmp_path):
  """docs/check_links.py passes on the repository: every relative link and #anchor resolves,
  and every figure linked to a RESULTS.md row (``[1.64x](...RESULTS.md#row)``) is in that row
  (the table keeps each case's latest run; a figure quoted from an earlier one goes stale)."""
  run = lambda root: subprocess.run([sys.executable, str(ROOT / "docs" / "check_links.py"),
                                     str(root)], capture_output=True, text=True)
  out = run(ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "0 broken links or stale figures" in out.stdout
  # The check itself: a copy of the docs with one figure changed is refused, naming it (the
  # copy's other links to code and records do not resolve; only this message is asserted).
  for name in ("README.md", "docs", "benchmarks/RESULTS.md"):
    src = ROOT / name
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
  readme = (tmp_path / "README.md").read_text()
  m = re.search(r"\[([0-9]+\.[0-9]+)x\]\(benchmarks/RESULTS\.md#([\w-]+)\)", readme)
  assert m, "README.md links no ratio to a RESULTS.md row"
  stale = f"{float(m.group(1)) + 7.77:.2f}x"
  link = f"[{stale}](benchmarks/RESULTS.md#{m.group(2)})"
  (tmp_path / "README.md").write_text(readme.replace(m.group(0), link, 1))
  out = run(tmp_path)
  assert out.returncode == 1 and f"{stale} is not in RESULTS.md's row #{m.group(2)}" in out.stdout, out.stdout
