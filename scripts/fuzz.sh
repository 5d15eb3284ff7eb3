#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, docs/fuzzing.md) with clang,
# ASan and UBSan in their own build directory and runs each one for SECONDS
# (default 60), one after another, one job each (the machine is shared).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      e.g. scripts/fuzz.sh 300 tagger
#
# Corpora: tests/fuzz/corpus/<target>/ is read and grows with what libFuzzer
# finds (new inputs are written to build-fuzz/corpus/<target>/ so the
# committed seeds stay small; merge the interesting ones by hand with
# -merge=1). A crash leaves its reproducer in tests/fuzz/regressions/<target>/
# and the script exits non-zero; once fixed, keep the file: ctest replays it
# (fuzz_<target>_replay). Variables: FUZZ_BUILD_DIR (build-fuzz), JOBS (2),
# TRIAX_DATA_DIR, FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail

cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(manager_core worker_core tagger spill_file calibration_table llama2c)
fi
build="${FUZZ_BUILD_DIR:-build-fuzz}"
jobs="${JOBS:-2}"

if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found; scripts/install_deps.sh installs it" >&2
  exit 1
fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DTRIAX_FUZZ=ON -DTRIAX_WITH_CUDA=OFF \
    -DTRIAX_BUILD_TESTS=OFF -DTRIAX_BUILD_BENCH=OFF "${launcher[@]}"
fi
cmake --build "$build" -j "$jobs" --target "${targets[@]/#/fuzz_}"

status=0
for t in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$t"
  grown="$build/corpus/$t"
  crashes="tests/fuzz/regressions/$t"
  mkdir -p "$grown" "$crashes"
  echo "fuzz.sh: fuzz_$t for ${seconds}s"
  # In-process, one job (-jobs=N would fork and log to ./fuzz-N.log).
  # -rss_limit_mb: a loader that allocates for a size its input cannot hold
  # is a bug (fuzz_util.h); -timeout: one input must not take seconds.
  if ! "$build/bin/fuzz_$t" "$grown" "$seeds" -max_total_time="$seconds" \
      -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
      -print_final_stats=1 -artifact_prefix="$crashes/" ${FUZZ_ARGS:-}; then
    echo "fuzz.sh: fuzz_$t found a crash; reproducer in $crashes/" >&2
    status=1
  fi
done
exit $status
