#!/usr/bin/env bash
# The GPU measurements still open, batched for two device calls (under 10 minutes each).
# Each step has its own timeout; logs and JSON go to $OUT (default /tmp/qtrain_out).
#
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 1   # tests, inline-PTX decoders, Pallas epilogue
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 2   # fp8 / int8 training steps side by side
#
# Needs qwix as a wheel in .whl/ for the qwix rows (see benchmarks/RESULTS.md).
set -u
OUT=${OUT:-/tmp/qtrain_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site

PART=${1:-1}
if [ "$PART" = 1 ]; then
# 1. The GPU test suite (kernels for real, GPU vs CPU numerics).
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
# 2. Inline-PTX decoders in the small-M sub-byte kernels (checked against the shipped kernel).
timeout 150 python3 benchmarks/explore_asm.py --json "$OUT/asm.json" 2>&1 | tail -8 | tee "$OUT/asm.log"
# 3. The scaled int32 -> bf16 epilogue as one Pallas pass in the int8 QT step.
timeout 230 python3 benchmarks/explore_epilogue.py --pallas-epilogue-step --json "$OUT/epilogue_step.json" 2>&1 | grep -v Warn | tail -6 | tee "$OUT/epilogue_step.log"
else
# 4. fp8 training step like for like with qwix (no SR / low-bit SR), int8 with low-bit SR.
timeout 360 python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --steps 10 --repeats 3 \
  --configs bf16,qtrain_int8_lowbit,qtrain_fp8_nosr,qtrain_fp8_nosr_xla,qtrain_fp8_lowbit,qwix_fp8 \
  --json "$OUT/step.json" 2>&1 | grep -v Warning | tail -14 | tee "$OUT/step.log"
fi
