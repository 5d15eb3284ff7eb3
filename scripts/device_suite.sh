#!/usr/bin/env bash
# The whole tree's GPU checks on the device machine, from a bundle made by
# ../shared/device/bundle.sh (see docs/bench.md):
#   kernels_cuda_test and cuda_device_test (CUDA against the CPU reference),
#   the integration tests with real processes (kvworker --backend auto picks
#   CUDA there), scripts/device_e2e.sh (stories260k greedy text through a
#   CUDA worker) and, with --bench, attention_bench's full sweep.
#
#   scripts/device_suite.sh BUNDLE DATA_DIR OUT_DIR [--tests] [--bench [BASE]]
#
# --tests runs the tests (the default when neither flag is given). --bench
# runs BUNDLE's attention_bench --iters 20, and with BASE (the attention_bench
# binary of another build, run with BUNDLE's libraries) both in the same run,
# alternating base, new, base, new so that both see the same machine. Writes one log per step
# under OUT_DIR and a summary to stdout; exits non-zero when a test fails.
set -uo pipefail
bundle=$(cd "${1:?usage: scripts/device_suite.sh BUNDLE DATA_DIR OUT_DIR [--tests] [--bench [BASE]]}" && pwd)
data=$(cd "${2:?DATA_DIR}" && pwd)
out=${3:?OUT_DIR}
shift 3
tests=0 bench=0 base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1 ;;
    --bench) bench=1
             if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then base=$(realpath "$2"); shift; fi ;;
    *) echo "device_suite: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ $tests -eq 0 ] && [ $bench -eq 0 ] && tests=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
status=0

run_test() {  # name [env...]
  local name=$1
  shift
  if [ ! -x "$bundle/bin/$name" ]; then
    echo "$name: not in the bundle"
    return
  fi
  local start=$SECONDS
  env "$@" "$bundle/run" "$bundle/bin/$name" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ($((SECONDS - start)) s) $(grep -E '^\[  (PASSED|FAILED) ' "$out/$name.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
}

if [ $tests -eq 1 ]; then
  run_test kernels_cuda_test
  run_test cuda_device_test
  for t in memory_pressure_test session_test encoding_test allocation_test \
           bad_input_test worker_failure_test daemon_test kvctl_test; do
    run_test "$t" TRIAX_BIN_DIR="$bundle/bin" TRIAX_DATA_DIR="$data"
  done
  bash "$here/device_e2e.sh" "$bundle" "$data" "$out/e2e" cuda > "$out/device_e2e.txt" 2>&1
  rc=$?
  grep -E "^e2e: (PASS|FAIL)" "$out/device_e2e.txt"
  echo "device_e2e rc=$rc"
  [ $rc -eq 0 ] || status=1
fi

if [ $bench -eq 1 ]; then
  rounds=("$bundle/bin/attention_bench")
  [ -n "$base" ] && rounds=("$base" "$bundle/bin/attention_bench" "$base" "$bundle/bin/attention_bench")
  i=0
  for b in "${rounds[@]}"; do
    i=$((i + 1))
    tag=new
    [ "$b" = "$base" ] && tag=base
    start=$SECONDS
    "$bundle/run" "$b" --iters 20 > "$out/attention_${i}_$tag.md" 2>&1
    echo "attention_bench $tag (round $i) rc=$? ($((SECONDS - start)) s) $(grep -m1 'streaming read' "$out/attention_${i}_$tag.md")"
  done
fi
exit $status
