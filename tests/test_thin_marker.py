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


def _kept(result) -> list[str]:
  return [line.split("::", 1)[1] for line in result.outlines if "::test_" in line]


def test_one_case_in_keep_stays_fast_and_the_rest_are_slow(pytester):
  fast = _run(pytester, 4, "-m", "not slow", "--co")
  # Of the 3 x 3 grid's runs of 4 cases (0-3, 4-7, 8) the first keeps its first, the second
  # its second; the third is too short to reach its third.
  assert _kept(fast) == ["test_grid[0-0]", "test_grid[1-2]", "test_plain"]
  slow = _run(pytester, 4, "-m", "slow")
  slow.assert_outcomes(passed=7 + 2)  # the grid's other 7 and the slow test's 2: every case runs


def test_a_keep_equal_to_an_axis_length_still_spreads_over_that_axis(pytester):
  # A fixed stride of 3 over a 3 x 3 grid would keep b == 0 only; the moving position keeps
  # the diagonal: each value of each axis once.
  fast = _run(pytester, 3, "-m", "not slow", "--co")
  assert _kept(fast) == ["test_grid[0-0]", "test_grid[1-1]", "test_grid[2-2]", "test_plain"]
  _run(pytester, 3, "-m", "slow").assert_outcomes(passed=6 + 2)


@pytest.mark.parametrize("keep", ["0", "'4'", "True"])
def test_a_bad_keep_is_named(pytester, keep):
  r = _run(pytester, keep)
  assert r.ret != 0
  r.stderr.fnmatch_lines([f"*test_grid*thin(keep) takes a positive int keep, got {keep}*"])
