"""The ``thin`` marker: a parametrized grid keeps every ``keep``-th case in the fast suite.

``@pytest.mark.thin(4)`` on a test marks all but one in four of its collected cases
``slow``: of each run of ``keep`` consecutive cases one stays, at a position that moves on by
one from run to run, so the cases kept spread over every axis of the grid (a fixed stride
equal to an axis's length would keep one value of that axis only). Every case still runs:
the README's fast command runs the kept ones, ``.ci/run``'s slow step the rest.
"""

from __future__ import annotations

import collections

import pytest


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks added here
def pytest_collection_modifyitems(config, items):
  seen: collections.Counter = collections.Counter()
  for item in items:
    mark = item.get_closest_marker("thin")
    if mark is None or item.get_closest_marker("slow") is not None:
      continue
    keep = mark.args[0] if mark.args else None
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
      raise pytest.UsageError(f"{item.nodeid}: thin(keep) takes a positive int keep, got {keep!r}")
    function = item.nodeid.split("[", 1)[0]
    i = seen[function]
    if i % keep != (i // keep) % keep:
      item.add_marker(pytest.mark.slow)
    seen[function] += 1
