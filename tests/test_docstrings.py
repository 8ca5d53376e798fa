"""Every docstring example in qtrain runs (doctest), module by module."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "qtrain"


def _modules() -> list[str]:
  out = []
  for f in sorted(ROOT.rglob("*.py")):
    parts = f.relative_to(ROOT.parent).with_suffix("").parts
    out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return out


MODULES = _modules()


def _examples(name: str) -> int:
  finder = doctest.DocTestFinder()
  return sum(len(t.examples) for t in finder.find(importlib.import_module(name)))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  mod = importlib.import_module(name)
  res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                        verbose=False, report=True)
  assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} docstring examples failed"


def test_the_public_api_has_examples():
  """The modules a user starts from show how they are used."""
  for name in ("qtrain", "qtrain.flax.model", "qtrain.provider", "qtrain.rules",
               "qtrain.ops.dot_general_qt", "qtrain.ops.conv_general_qt", "qtrain.core.qarray",
               "qtrain.freeze", "qtrain.binary", "qtrain.optim", "qtrain.lora"):
    assert _examples(name) > 0, f"{name} has no docstring example"
