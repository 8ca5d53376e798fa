#!/usr/bin/env bash
# Runs qwix's own QT / PTQ tests against qtrain.qwix: extracts the test files from a qwix
# checkout, writes a `qwix` shim package whose modules re-export qtrain's counterparts, and runs
# pytest with the shim first on PYTHONPATH. Nothing of qwix is copied into this repository; the
# tests are read from the checkout given and written under the scratch directory only.
#
# Usage: tools/run_qwix_tests.sh QWIX [SCRATCH] [-- PYTEST_ARGS...]
#   QWIX     a qwix work tree, or a bare git directory of it (its HEAD is read)
#   SCRATCH  where the tests and the shim go (default /tmp/qwixrun); must be outside this repo
set -euo pipefail

QWIX=${1:?usage: tools/run_qwix_tests.sh QWIX [SCRATCH] [-- PYTEST_ARGS...]}
shift
SCRATCH=/tmp/qwixrun
if [[ $# -gt 0 && $1 != "--" ]]; then SCRATCH=$1; shift; fi
if [[ $# -gt 0 && $1 == "--" ]]; then shift; fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
case "$(realpath -m "$SCRATCH")/" in
  "$REPO"/*) echo "SCRATCH=$SCRATCH is inside $REPO: qwix's files must stay out of it" >&2; exit 2;;
esac

# The files holding qwix's tests of QtRule / QtProvider / PtqProvider.
TESTS=(tests/_src/providers/qt_test.py tests/_src/providers/ptq_test.py
       tests/_src/utils/checkpoint_util_test.py integration_tests/coverage_test.py)

read_qwix() {  # read_qwix PATH: one file of the qwix checkout
  if [[ -d $QWIX/.git || -f $QWIX/.git ]]; then git -C "$QWIX" show "HEAD:$1"
  elif git -C "$QWIX" rev-parse --is-bare-repository 2>/dev/null | grep -q true; then
    git -C "$QWIX" show "HEAD:$1"
  else cat "$QWIX/$1"; fi
}

rm -rf "$SCRATCH/tests" "$SCRATCH/qwix"
mkdir -p "$SCRATCH/tests"
for t in "${TESTS[@]}"; do read_qwix "$t" > "$SCRATCH/tests/$(basename "$t")"; done

# The shim: each qwix module the tests import, holding qtrain's counterpart of each name that
# has one. Names without one are left out, so a test using them fails on that name alone.
S=$SCRATCH/qwix
mkdir -p "$S/_src/core" "$S/_src/providers" "$S/_src/utils"
touch "$S/_src/__init__.py" "$S/_src/core/__init__.py" "$S/_src/providers/__init__.py" \
      "$S/_src/utils/__init__.py"
cat > "$S/__init__.py" <<'PY'
from qtrain.qwix import *  # noqa: F401,F403
PY
cat > "$S/_src/model.py" <<'PY'
from qtrain.qwix import quantize_model  # noqa: F401
PY
cat > "$S/_src/qconfig.py" <<'PY'
from qtrain.qwix import QuantizationRule  # noqa: F401
from qtrain.provider import QtProvider as QuantizationProvider  # noqa: F401  (the providers' base)
PY
cat > "$S/_src/providers/qt.py" <<'PY'
from qtrain.qwix import QtProvider, QtRule  # noqa: F401
PY
cat > "$S/_src/providers/ptq.py" <<'PY'
from qwix._src.core import qarray  # noqa: F401
from qtrain.qwix import PtqProvider, WithAux, quantize_params  # noqa: F401
PY
cat > "$S/_src/core/qarray.py" <<'PY'
from qtrain.qwix import QArray, dequantize  # noqa: F401
PY
cat > "$S/_src/core/sparsity.py" <<'PY'
from qtrain.qwix import SparsityRule  # noqa: F401
PY
cat > "$S/_src/utils/flax_util.py" <<'PY'
from qtrain.qwix import QuantStat  # noqa: F401
PY
cat > "$S/_src/utils/checkpoint_util.py" <<'PY'
import logging  # noqa: F401
from qtrain.qwix import process_prequantized_params, restore_quantization_rules  # noqa: F401
PY

cd "$SCRATCH"
# The mesh tests ask for 4 CPU devices. qwix's test files set XLA_FLAGS when imported, which
# comes too late if anything collected before them has started JAX's backend: it is set here.
XLA_FLAGS="--xla_force_host_platform_device_count=4${XLA_FLAGS:+ $XLA_FLAGS}" \
PYTHONPATH="$SCRATCH:$REPO${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -p no:cacheprovider \
  -o addopts="" --rootdir="$SCRATCH" tests "$@"
