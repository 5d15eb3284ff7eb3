#!/usr/bin/env bash
# End to end on a GPU machine: starts a kvmanager and a kvworker with
# --backend cuda on loopback from a bundle made by shared/device/bundle.sh,
# runs the reference frontend's demo (kvdemo) step (a) - stories260k greedy
# decoding with its KV held by the worker, compared by kvdemo itself with
# expected_greedy_200.txt - and checks that the worker served from CUDA.
#
#   scripts/device_e2e.sh BUNDLE DATA_DIR LOG_DIR [BACKEND...]
#
# BUNDLE holds run and bin/{kvmanager,kvworker,kvdemo}. DATA_DIR needs
# models/stories260k/ (model.bin, tokenizer.bin, expected_greedy_200.txt),
# text/tinystories_val.txt and bfcl/BFCL_v4_multi_turn_base.json. BACKENDS
# (default: cuda) are run one after the other, each with fresh processes; a
# cpu run on the same machine gives the reference timing.
#
# kvdemo runs steps (a) greedy, (b) BFCL on kvproxy-18m and (c) NLL in one go
# and has no flag to skip (b). kvproxy-18m's model.bin (72 MB) does not fit
# the 64 MiB that travels to the GPU machine, so when DATA_DIR lacks it the
# script puts an EMPTY placeholder at models/kvproxy-18m/model.bin in a
# private copy of the data dir: kvdemo then runs step (a) on the real model
# and stops at (b) failing to load the placeholder. The verdict is then
# step (a)'s (both greedy texts MATCH); (b) and (c) are reported as not run.
# With a complete DATA_DIR the whole demo must pass.
#
# Writes LOG_DIR/<backend>-{kvmanager,kvworker,kvdemo}.log; exits non-zero
# when any backend's check fails.
set -uo pipefail

bundle=${1:?usage: scripts/device_e2e.sh BUNDLE DATA_DIR LOG_DIR [BACKEND...]}
data_in=${2:?usage: scripts/device_e2e.sh BUNDLE DATA_DIR LOG_DIR [BACKEND...]}
logs=${3:?usage: scripts/device_e2e.sh BUNDLE DATA_DIR LOG_DIR [BACKEND...]}
shift 3
backends=("$@")
[ ${#backends[@]} -eq 0 ] && backends=(cuda)
bundle=$(cd "$bundle" && pwd)
data_in=$(cd "$data_in" && pwd)
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
run=$(mktemp -d /tmp/triaxkv-e2e.XXXXXX)
pids=()

stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
cleanup() {
  stop_all
  rm -rf "$run"
}
trap cleanup EXIT

wait_port() {  # file, name, pid, log
  for _ in $(seq 1 300); do
    if [ -s "$1" ]; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then
      echo "e2e: $2 exited during start-up; its log:" >&2
      cat "$4" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "e2e: $2 did not start within 30 s" >&2
  return 1
}

# A private data dir: links to the real files, a placeholder for what is
# missing (see above).
data="$run/data"
mkdir -p "$data/models/kvproxy-18m" "$data/text" "$data/bfcl"
ln -s "$data_in/models/stories260k" "$data/models/stories260k"
ln -s "$data_in/text/tinystories_val.txt" "$data/text/tinystories_val.txt"
ln -s "$data_in/bfcl/BFCL_v4_multi_turn_base.json" \
  "$data/bfcl/BFCL_v4_multi_turn_base.json"
partial=0
if [ -f "$data_in/models/kvproxy-18m/model.bin" ]; then
  for f in "$data_in"/models/kvproxy-18m/*; do
    ln -s "$f" "$data/models/kvproxy-18m/"
  done
  for d in "$data_in"/bfcl/*; do
    [ -e "$data/bfcl/$(basename "$d")" ] || ln -s "$d" "$data/bfcl/"
  done
else
  partial=1
  : >"$data/models/kvproxy-18m/model.bin"
  echo "e2e: NOTE: $data_in has no models/kvproxy-18m/model.bin; an empty" \
    "placeholder stands in, so kvdemo stops at step (b) and only step (a)" \
    "(stories260k greedy) is checked"
fi

status=0
for backend in "${backends[@]}"; do
  echo "== e2e backend=$backend =="
  mlog="$logs/$backend-kvmanager.log"
  wlog="$logs/$backend-kvworker.log"
  dlog="$logs/$backend-kvdemo.log"
  rm -f "$run/manager.port" "$run/worker.port"
  "$bundle/run" "$bundle/bin/kvmanager" --listen 127.0.0.1:0 \
    --port_file "$run/manager.port" >"$mlog" 2>&1 &
  pids+=($!)
  if ! wait_port "$run/manager.port" kvmanager "${pids[-1]}" "$mlog"; then
    status=1; stop_all; continue
  fi
  manager="127.0.0.1:$(cat "$run/manager.port")"
  "$bundle/run" "$bundle/bin/kvworker" --listen 127.0.0.1:0 \
    --port_file "$run/worker.port" --manager "$manager" \
    --worker_id "e2e-$backend-0" --backend "$backend" --pool_mb 1024 \
    >"$wlog" 2>&1 &
  pids+=($!)
  if ! wait_port "$run/worker.port" kvworker "${pids[-1]}" "$wlog"; then
    status=1; stop_all; continue
  fi
  if ! grep -q "backend=\"\?$backend\"\?" "$wlog"; then
    echo "e2e: FAIL: kvworker does not report backend=$backend:" >&2
    cat "$wlog" >&2
    status=1
  fi
  t0=$(date +%s.%N)
  "$bundle/run" "$bundle/bin/kvdemo" --manager "$manager" --data_dir "$data" \
    --nll_chars 2000 >"$dlog" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  grep -E "^(== |-- |local fp32 vs|service bf16 vs|\(a\)|FAILED at|NOTE)" \
    "$dlog" | sed 's/^/  kvdemo: /'
  ok=1
  grep -q "local fp32 vs expected_greedy_200.txt: MATCH" "$dlog" || ok=0
  grep -q "service bf16 vs expected_greedy_200.txt: MATCH" "$dlog" || ok=0
  if [ $partial -eq 1 ]; then
    # Expected stop: step (b) cannot load the placeholder model.
    grep -q "FAILED at (b) BFCL session" "$dlog" || ok=0
    echo "  step (b) BFCL and (c) NLL: NOT RUN (kvproxy-18m not carried)"
  else
    [ $rc -eq 0 ] || ok=0
  fi
  if ! kill -0 "${pids[-1]}" 2>/dev/null; then
    echo "e2e: FAIL: kvworker died during the demo" >&2
    ok=0
  fi
  if grep -qi "unhealthy" "$wlog"; then
    echo "e2e: FAIL: the worker reported an unhealthy device" >&2
    ok=0
  fi
  awk -v rc="$rc" -v a="$t0" -v b="$t1" \
    'BEGIN { printf "  kvdemo exit %d in %.1f s\n", rc, b - a }'
  if [ $ok -eq 1 ]; then
    echo "e2e: PASS backend=$backend: stories260k greedy text through the" \
      "service matches expected_greedy_200.txt"
  else
    echo "e2e: FAIL backend=$backend (logs in $logs); last lines:" >&2
    tail -n 20 "$dlog" "$wlog" >&2
    status=1
  fi
  stop_all
done
exit $status
