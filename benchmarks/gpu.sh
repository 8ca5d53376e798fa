#!/usr/bin/env bash
# The maintained GPU work, in named parts that each fit one device call (under 10 minutes).
# Logs and JSON records go to $OUT (default /tmp/qtrain_out); add the records to the
# repository afterwards with `python3 benchmarks/_record.py add <records>` (benchmarks/README.md).
#
#   OUT=/tmp/out bash benchmarks/gpu.sh PART [PART ...]
#
#   tests           the GPU test suite (pytest -m gpu)
#   kernels-mosaic  kernel table, M = 1, 16, 64: the Mosaic small-M kernels
#   kernels-triton  kernel table, M = 1, 16, 64: the Pallas-Triton kernels
#   kernels-large   kernel table, M = 512, 4096: the Mosaic int8 GEMM, Triton int8 / binary
#   step4096        training-step table, D = 4096 (benchmarks/train_step.py's default configs)
#   step1024        training-step table, D = 1024
#   profile         per-kernel GPU time of the int8 and bf16 training steps, D = 4096
#   lm              language-model table, d_model 1024 and 2048, every config (timing only)
#   lm1024, lm2048  the same, one width (where `lm` ran out of its budget)
#   conv            convolution table: a ResNet-18 step, 224x224, batch 64 (bf16, int8, binary)
#   lm-loss         language-model held-out loss after 200 steps, d_model 1024, 3 seeds
#                   (needs the text: .data/fortunes.txt or shared/data/text/fortunes.txt)
#   scaling         weak scaling over every GPU of the host (a multi-GPU kind), data parallel
#
# Where the work tree has no .git, set QTRAIN_GIT_COMMIT to the commit it holds so the
# records name it. qwix (for the qwix_* configs) is installed from a wheel in .whl/.
set -u
OUT=${OUT:-/tmp/qtrain_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site
[ $# -gt 0 ] || { sed -n '2,23p' "$0"; exit 2; }

lm() {  # lm NAME ARGS...: one lm_step.py run, its log in $OUT/NAME.log
  local name=$1; shift
  timeout 570 python3 benchmarks/lm_step.py --out-dir "$OUT" "$@" 2>&1 | grep -v Warn \
    | tee "$OUT/$name.log" | grep "^|\| ms/step \|FAIL\|skipped\|not started\|note:\|record:"
}

kernels() {  # kernels NAME TIMEOUT ARGS...: one kernel-table run, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/kernels.py --check --out-dir "$OUT" "$@" 2>&1 \
    | grep -v Warn | tee "$OUT/$name.log" | grep "^|\|FAIL\|record:"
}

for part in "$@"; do
  echo "== $part"
  case "$part" in
    tests)
      timeout 330 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn \
        | tail -25 | tee "$OUT/gpu_tests.log" ;;
    kernels-mosaic)
      kernels kernels_mosaic 570 --ms 16,1,64 --shapes 8192x28672,4096x4096 --budget-s 500 \
        --kernels "mosaic W1A8 tiled,mosaic W2A8 tiled,mosaic W4A8 tiled,mosaic W8A8 tiled,mosaic W1A16,mosaic W4A16 tiled,mosaic W8A16 tiled" ;;
    kernels-triton)
      kernels kernels_triton 570 --ms 16,1,64 --shapes 8192x28672,4096x4096 --budget-s 500 \
        --kernels "binary W1A8,binary W1A16,binary W1A1,int2 W2A8 g128,int4 W4A8 g128,int2 W2A16 g128,int4 W4A16 g128,int8 W8A16,int8 x int8" ;;
    kernels-large)
      kernels kernels_large 570 --ms 512,4096 --shapes 8192x28672,4096x4096 --budget-s 480 \
        --kernels "mosaic gemm W8A8,mosaic gemm W1A8,int8 x int8,binary W1A8" ;;
    step4096|step1024)
      timeout 570 python3 benchmarks/train_step.py --widths "${part#step}" --tokens 8192 --steps 10 \
        --repeats 3 --out-dir "$OUT" 2>&1 | grep -v Warning | tee "$OUT/$part.log" | tail -16 ;;
    profile)
      timeout 400 python3 benchmarks/profile_step.py --widths 4096 --tokens 8192 \
        --configs qtrain_int8_lowbit,bf16 --top 25 --out-dir "$OUT" 2>&1 | grep -v Warn \
        | tee "$OUT/profile.log" | tail -60 ;;
    lm)
      lm lm --widths 1024,2048 --steps 10 --repeats 3 --budget-s 450 ;;
    lm1024|lm2048)
      lm "$part" --widths "${part#lm}" --steps 10 --repeats 3 --budget-s 450 ;;
    conv)
      timeout 570 python3 benchmarks/conv_step.py --out-dir "$OUT" --results '' \
        --configs bf16,qtrain_int8,qtrain_binary,qtrain_int8_fwd 2>&1 | grep -v Warn \
        | tee "$OUT/conv.log" ;;
    lm-loss)
      lm lm_loss --widths 1024 --steps 10 --repeats 3 --loss-seeds 3 --loss-steps 200 \
        --configs bf16,qtrain_int8,qtrain_fp8,qtrain_w1a8,qtrain_int4w --budget-s 450 ;;
    scaling)
      timeout 570 python3 benchmarks/scaling.py --out-dir "$OUT" 2>&1 | grep -v Warn \
        | tee "$OUT/scaling.log" | grep "^|\| ms/step \|FAIL\|record:" ;;
    *)
      echo "unknown part '$part'; valid: tests kernels-mosaic kernels-triton kernels-large step4096 step1024 profile conv lm lm1024 lm2048 lm-loss scaling"
      exit 2 ;;
  esac
done
