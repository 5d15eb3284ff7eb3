#!/usr/bin/env bash
# The transformers backend on the GPU machine (bench/results/transformers.md):
# kvmanager + kvworker --backend cuda, then
#   1. kvdemo --steps=b: the triaxial policy's dNLL on a held-out BFCL session;
#   2. the same session through transformers (triaxkv.hf.generate --bfcl_id),
#      and two controls: keys in the rotate-half layout, and policy bf16;
#   3. stories260k greedy 200 steps, plain transformers and the triaxkv backend
#      (BF16), each compared byte for byte with expected_greedy_200.txt;
#   4. generate() tokens/s with and without the backend, batch 1 and 16, on
#      stories260k and kvproxy-18m;
#   5. the Python suite's transformers tests (test_hf.py) when pytest imports.
# Usage: scripts/device_hf.sh BUNDLE DATA_DIR OUT_DIR
#   BUNDLE: kvmanager, kvworker, kvdemo with their libraries (bin/, lib/, run);
#   PYTHONPATH must hold client/python and the generated stubs (build/python).
set -uo pipefail

bundle=${1:?usage: scripts/device_hf.sh BUNDLE DATA_DIR OUT_DIR}
data=${2:?usage: scripts/device_hf.sh BUNDLE DATA_DIR OUT_DIR}
out=${3:?usage: scripts/device_hf.sh BUNDLE DATA_DIR OUT_DIR}
mkdir -p "$out"
run=$(mktemp -d /tmp/triaxkv-hf.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT

wait_port() {  # file, name, pid, log
  for _ in $(seq 1 300); do
    [ -s "$1" ] && return 0
    if ! kill -0 "$3" 2>/dev/null; then
      echo "device_hf: $2 exited during start-up:" >&2
      cat "$4" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "device_hf: $2 did not start within 30 s" >&2
  return 1
}

"$bundle/run" "$bundle/bin/kvmanager" --listen 127.0.0.1:0 \
  --metadata "file:$run/metadata" \
  --port_file "$run/manager.port" >"$out/kvmanager.log" 2>&1 &
pids+=($!)
wait_port "$run/manager.port" kvmanager "${pids[-1]}" "$out/kvmanager.log" || exit 1
manager="127.0.0.1:$(cat "$run/manager.port")"
"$bundle/run" "$bundle/bin/kvworker" --listen 127.0.0.1:0 \
  --port_file "$run/worker.port" --manager "$manager" --worker_id hf-cuda-0 \
  --backend cuda --pool_mb 4096 >"$out/kvworker.log" 2>&1 &
pids+=($!)
wait_port "$run/worker.port" kvworker "${pids[-1]}" "$out/kvworker.log" || exit 1
sleep 0.5  # registration

status=0
step() {  # name, command...
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

gen=(python3 -m triaxkv.hf.generate --manager "$manager")
step kvdemo_bfcl "$bundle/run" "$bundle/bin/kvdemo" --manager "$manager" \
  --data_dir "$data" --steps b --disaggregate_prefill 0
bfcl=(--model "$data/models/kvproxy-18m/model.bin" --bfcl_id multi_turn_base_42
  --data_dir "$data")
step hf_bfcl "${gen[@]}" "${bfcl[@]}" \
  --calibration bench/results/calibration_kvproxy-18m-output.txtpb --budget_bits 3.5
# Controls: the same policy with keys in transformers' rotate-half layout
# (quantized groups see other channels than kvdemo's), and all-BF16 KV.
step hf_bfcl_rotate_half "${gen[@]}" "${bfcl[@]}" --key_layout rotate_half \
  --calibration bench/results/calibration_kvproxy-18m-output.txtpb --budget_bits 3.5
step hf_bfcl_bf16 "${gen[@]}" "${bfcl[@]}" --policy bf16
for backend in local triaxkv; do
  step "stories_$backend" "${gen[@]}" --model "$data/models/stories260k/model.bin" \
    --backend "$backend" --policy bf16 --steps 200 --batch 1,16 --repeat 3 \
    --expected "$data/models/stories260k/expected_greedy_200.txt"
  step "kvproxy_$backend" "${gen[@]}" --model "$data/models/kvproxy-18m/model.bin" \
    --backend "$backend" --policy bf16 --prompt "Once upon a time" --steps 200 \
    --batch 1,16 --repeat 3
done
if python3 -c "import pytest" 2>/dev/null; then
  # The suite starts its own manager and CPU workers from TRIAX_BIN_DIR.
  step pytest_hf env TRIAX_BIN_DIR="$bundle/bin" TRIAX_DATA_DIR="$data" \
    LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    python3 -m pytest -q -rs -p no:cacheprovider client/python/tests/test_hf.py
else
  echo "== pytest_hf: not run (pytest does not import)"
fi
echo "device_hf: exit $status"
exit $status
