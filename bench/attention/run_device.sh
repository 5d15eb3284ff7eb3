#!/usr/bin/env bash
# Runs the CUDA correctness tests and the attention benchmark on the GPU
# machine from a bundle made by /work/shared/device/bundle.sh:
#   bench/attention/run_device.sh BUNDLE_DIR OUT_DIR [attention_bench flags]
set -uo pipefail
bundle=$1; out=$2; shift 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
"$bundle/run" "$bundle/bin/kernels_cuda_test" 2>&1 | tee "$out/cuda_correctness.log" |
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|FAILED|max_abs|demote|tests ran" | sort | uniq -c | head -60
"$bundle/run" "$bundle/bin/attention_bench" "$@" 2>&1 | tee "$out/attention.md"
