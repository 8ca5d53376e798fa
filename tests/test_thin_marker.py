"""The ``thin`` marker (tests/conftest.py): which cases of a grid the fast suite keeps."""

import os

import pytest

pytest_plugins = ["pytester"]

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
GRID = """
import pytest

@pytest.mark.thin({keep})
@pytest.mark.parametrize("a", range(3))
@pytest.mark.parametrize("b", range(3))
def test_grid(a, b):
  pass

@pytest.mark.thin({keep})
@pytest.mark.slow
@pytest.mark.parametrize("a", range(2))
def test_already_slow(a):
  pass

def test_plain():
  pass
"""


def _run(pytester, keep, *args):
  with open(CONFTEST) as f:
    pytester.makeconftest(f.read())
  pytester.makeini("[pytest]\nmarkers =\n  slow: slow\n  thin(keep): thin\n")
  pytester.makepyfile(GRID.format(keep=keep))
  return pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args)


def test_every_keep_th_case_stays_fast_and_the_rest_are_slow(pytester):
  fast = _run(pytester, 4, "-m", "not slow", "--co")
  kept = [line for line in fast.outlines if "::test_" in line]
  assert kept == ["test_every_keep_th_case_stays_fast_and_the_rest_are_slow.py::test_grid[0-0]",
                  "test_every_keep_th_case_stays_fast_and_the_rest_are_slow.py::test_grid[1-1]",
                  "test_every_keep_th_case_stays_fast_and_the_rest_are_slow.py::test_grid[2-2]",
                  "test_every_keep_th_case_stays_fast_and_the_rest_are_slow.py::test_plain"]
  slow = _run(pytester, 4, "-m", "slow")
  slow.assert_outcomes(passed=6 + 2)  # the grid's other 6 and the slow test's 2: every case runs


@pytest.mark.parametrize("keep", ["0", "'4'", "True"])
def test_a_bad_keep_is_named(pytester, keep):
  r = _run(pytester, keep)
  assert r.ret != 0
  r.stderr.fnmatch_lines([f"*test_grid*thin(keep) takes a positive int keep, got {keep}*"])
