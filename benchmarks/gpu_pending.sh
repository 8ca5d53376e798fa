#!/usr/bin/env bash
# The GPU measurements still open, batched for device calls (under 10 minutes each).
# Each step has its own timeout; logs and JSON go to $OUT (default /tmp/qtrain_out).
#
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 1   # GPU tests, kernel table at M = 1, 16
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 2   # training steps side by side, D = 4096
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 3   # training steps side by side, D = 1024
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 4   # inline-PTX decoder configs: 4096^2, W{2,4}A8
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 5   # deeper pipelines / plane width; fp8 layouts vs qwix
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 6   # GPU suite; Mosaic kernel table
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 7   # fp8 step through XLA's fp8 dot
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 8   # Mosaic int8 activations: tests, table, grid
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 9   # Mosaic ablations, 128x512 int8-activation tiles, GPU suite
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 10  # Mosaic ablations (fixed), A8 kernel table at 4096^2
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 11  # GPU suite; Mosaic row-major vs tile-major, M = 64 table
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 12  # Mosaic int8 GEMM: GPU tests, auto threshold, M = 512 / 4096 table
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 13  # training steps side by side with the Mosaic GEMM, D = 4096
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 14  # GPU suite; training steps with the Mosaic GEMM, D = 1024
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 15  # Mosaic int2 (W2A8): GPU tests, kernel table at M = 1, 16, 64
#   OUT=/tmp/out bash benchmarks/gpu_pending.sh 16  # GPU suite; Mosaic GEMM table at M = 512 / 4096 (wave-aware default)
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
STEP_CONFIGS=bf16,qtrain_int8_lowbit,qwix_int8,qtrain_binary,qtrain_fp8_nosr,qtrain_fp8_lowbit,qwix_fp8

PART=${1:-1}
if [ "$PART" = 1 ]; then
# The GPU test suite (kernels for real, GPU vs CPU numerics, inline-PTX vs jnp decoders).
timeout 230 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -25 | tee "$OUT/gpu_tests.log"
# The kernel table at M = 1 and 16 (default configs), with the XLA baselines.
timeout 330 python3 benchmarks/kernels.py --ms 1,16 --shapes 8192x28672,4096x4096 --budget-s 300 \
  --json "$OUT/kernels.json" 2>&1 | grep -v Warn | tee "$OUT/kernels.log" | tail -40
elif [ "$PART" = 6 ]; then
# The GPU test suite, then the kernel table at M = 1, 16, 64 with the Mosaic rows (checked).
timeout 300 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -25 | tee "$OUT/gpu_tests.log"
timeout 260 python3 benchmarks/kernels.py --ms 1,16,64 --shapes 8192x28672,4096x4096 --budget-s 230 --check \
  --kernels "binary W1A16,int4 W4A16 g128,int4 W4A16,int8 W8A16,mosaic W1A16,mosaic W4A16,mosaic W8A16" \
  --json "$OUT/kernels_mosaic.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_mosaic.log" | tail -45
elif [ "$PART" = 8 ]; then
# The Mosaic int8-activation path: its GPU tests, the kernel table beside Triton/XLA, its config grid.
timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider -k "mosaic or freeze" tests 2>&1 | grep -v Warn | tail -15 | tee "$OUT/gpu_tests_a8.log"
timeout 250 python3 benchmarks/kernels.py --ms 1,16,64 --shapes 8192x28672,4096x4096 --budget-s 220 --check \
  --kernels "binary W1A8,int8 x int8,mosaic W1A16,mosaic W1A8,mosaic W4A16,mosaic W4A8,mosaic W8A16,mosaic W8A8" \
  --json "$OUT/kernels_a8.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_a8.log" | tail -45
timeout 170 python3 benchmarks/explore_mosaic.py --act int8 --budget-s 150 --json "$OUT/mosaic_a8.json" 2>&1 | grep -v Warn | tee "$OUT/mosaic_a8.log" | tail -30
elif [ "$PART" = 9 ]; then
# Where the Mosaic kernel's time goes (ablations), the int8-activation 128x512 tiles, the full GPU suite.
timeout 150 python3 benchmarks/explore_mosaic.py --ablate --json "$OUT/mosaic_ablate.json" 2>&1 | grep -v Warn | tee "$OUT/mosaic_ablate.log" | tail -20
timeout 100 python3 benchmarks/explore_mosaic.py --act int8 --tiles 128x512,128x256 --budget-s 80 --json "$OUT/mosaic_a8_512.json" 2>&1 | grep -v Warn | tee "$OUT/mosaic_a8_512.log" | tail -20
timeout 300 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -25 | tee "$OUT/gpu_tests.log"
elif [ "$PART" = 10 ]; then
# The ablations (fixed: x perturbed, not the weights), the A8 rows at 4096^2 beside Triton and XLA.
timeout 150 python3 benchmarks/explore_mosaic.py --ablate --json "$OUT/mosaic_ablate.json" 2>&1 | grep -v Warn | tee "$OUT/mosaic_ablate.log" | tail -20
timeout 200 python3 benchmarks/kernels.py --ms 1,16,64 --shapes 4096x4096 --budget-s 180 --check \
  --kernels "binary W1A8,int8 x int8,mosaic W1A16,mosaic W1A8,mosaic W4A16,mosaic W4A8,mosaic W8A16,mosaic W8A8" \
  --json "$OUT/kernels_a8_4096.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_a8_4096.log" | tail -30
elif [ "$PART" = 11 ]; then
timeout 330 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -8 | tee "$OUT/gpu_tests_tiles.log"
timeout 250 python3 benchmarks/kernels.py --ms 16,1 --shapes 8192x28672 --budget-s 220 --check \
  --kernels "mosaic W1A8,mosaic W1A8 tiled,mosaic W4A8,mosaic W4A8 tiled,mosaic W8A8,mosaic W8A8 tiled,mosaic W8A16,mosaic W8A16 tiled" \
  --json "$OUT/kernels_tiles.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_tiles.log" | grep "^|"
elif [ "$PART" = 12 ]; then
timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/pallas/test_pallas_gemm.py tests/test_core_gpu.py \
  2>&1 | grep -v Warn | tail -8 | tee "$OUT/gpu_tests_gemm.log"
timeout 200 python3 benchmarks/explore_gemm.py --configs "wg_axis=m;tile_m=64,tile_n=256,wg_axis=m" \
  --shapes 512x4096x4096,1024x4096x4096,2048x4096x4096,4096x4096x4096,512x8192x28672,4096x8192x28672 \
  2>&1 | grep -v Warn | tee "$OUT/explore_gemm.log" | grep "^|"
timeout 150 python3 benchmarks/kernels.py --ms 512,4096 --check --budget-s 120 \
  --kernels "int8 x int8,binary W1A8,mosaic gemm W8A8,mosaic gemm W1A8" \
  --json "$OUT/kernels_gemm.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_gemm.log" | grep "^|"
elif [ "$PART" = 13 ]; then
timeout 570 python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --steps 10 --repeats 3 \
  --configs bf16,qtrain_int8_lowbit,qtrain_int8_cublas,qwix_int8,qtrain_binary,qtrain_fp8_lowbit,qwix_fp8 \
  --json "$OUT/step4096_gemm.json" 2>&1 | grep -v Warning | tee "$OUT/step4096_gemm.log" | tail -14
elif [ "$PART" = 14 ]; then
timeout 330 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -8 | tee "$OUT/gpu_tests_gemm_all.log"
timeout 250 python3 benchmarks/train_step.py --widths 1024 --tokens 8192 --steps 10 --repeats 3 \
  --configs bf16,qtrain_int8_lowbit,qtrain_int8_cublas,qwix_int8,qtrain_binary \
  --json "$OUT/step1024_gemm.json" 2>&1 | grep -v Warning | tee "$OUT/step1024_gemm.log" | tail -10
elif [ "$PART" = 15 ]; then
timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/pallas/test_pallas_gpu.py -k "mosaic" \
  2>&1 | grep -v Warn | tail -8 | tee "$OUT/gpu_tests_int2.log"
timeout 330 python3 benchmarks/kernels.py --ms 16,1,64 --shapes 8192x28672,4096x4096 --budget-s 300 --check \
  --kernels "int2 W2A16 g128,mosaic W1A8,mosaic W2A8,mosaic W2A8 tiled,mosaic W4A8 tiled" \
  --json "$OUT/kernels_int2.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_int2.log" | grep "^|"
elif [ "$PART" = 16 ]; then
timeout 330 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | grep -v Warn | tail -8 | tee "$OUT/gpu_tests_final.log"
timeout 150 python3 benchmarks/kernels.py --ms 512,4096 --check --budget-s 120 \
  --kernels "mosaic gemm W8A8,mosaic gemm W1A8" \
  --json "$OUT/kernels_gemm2.json" 2>&1 | grep -v Warn | tee "$OUT/kernels_gemm2.log" | grep "^|"
elif [ "$PART" = 7 ]; then
timeout 330 python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --steps 10 --repeats 3 \
  --configs bf16,qtrain_fp8_nosr_xla,qwix_fp8 --json "$OUT/step_fp8_xla.json" 2>&1 | grep -v Warning | tee "$OUT/step_fp8_xla.log" | tail -9
elif [ "$PART" = 4 ]; then
timeout 200 python3 benchmarks/explore_decode.py --k 4096 --n 4096 --budget-s 170 \
  --kernels "binary W1A16,binary W1A8,int2 W2A16 g128,int4 W4A16 g128" --json "$OUT/decode4096.json" 2>&1 | tee "$OUT/decode4096.log" | tail -8
timeout 200 python3 benchmarks/explore_decode.py --budget-s 170 --kernels "int4 W4A8 g128,int2 W2A8 g128" \
  --json "$OUT/decode_a8.json" 2>&1 | tee "$OUT/decode_a8.log" | tail -8
elif [ "$PART" = 5 ]; then
timeout 130 python3 benchmarks/explore_decode.py --extra --budget-s 110 \
  --kernels "binary W1A8,binary W1A16,int4 W4A8 g128" --json "$OUT/decode_extra.json" 2>&1 | tee "$OUT/decode_extra.log" | tail -8
timeout 110 python3 benchmarks/explore_decode.py --plane-words 64 --budget-s 90 \
  --kernels "binary W1A8,binary W1A16" --json "$OUT/decode_pw64.json" 2>&1 | tee "$OUT/decode_pw64.log" | tail -6
timeout 280 python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --steps 10 --repeats 3 \
  --configs bf16,qtrain_fp8_nosr,qtrain_fp8_nosr_xla,qwix_fp8 --json "$OUT/step_fp8.json" 2>&1 | grep -v Warning | tee "$OUT/step_fp8.log" | tail -9
elif [ "$PART" = 2 ]; then
timeout 560 python3 benchmarks/train_step.py --widths 4096 --tokens 8192 --steps 10 --repeats 3 \
  --configs $STEP_CONFIGS --json "$OUT/step4096.json" 2>&1 | grep -v Warning | tee "$OUT/step4096.log" | tail -14
else
timeout 560 python3 benchmarks/train_step.py --widths 1024 --tokens 8192 --steps 10 --repeats 3 \
  --configs $STEP_CONFIGS --json "$OUT/step1024.json" 2>&1 | grep -v Warning | tee "$OUT/step1024.log" | tail -14
fi
