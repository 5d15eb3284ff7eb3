#!/usr/bin/env bash
# Starts a kvmanager and two CPU kvworkers as separate processes on loopback,
# runs the reference frontend's demo (kvdemo) against them, and stops them.
#   scripts/demo.sh BIN_DIR [extra kvdemo flags]
set -euo pipefail

bin=${1:?usage: scripts/demo.sh BIN_DIR [kvdemo flags]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
data=${TRIAX_DATA_DIR:-$root/../shared/data}
run=$(mktemp -d /tmp/triaxkv-demo.XXXXXX)
pids=()

cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT

wait_port() {  # file, name, pid
  for _ in $(seq 1 100); do
    if [ -s "$1" ]; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then
      echo "demo: $2 exited during start-up; its log:" >&2
      cat "$run/$2.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "demo: $2 did not start within 10 s" >&2
  exit 1
}

"$bin/kvmanager" --listen 127.0.0.1:0 --port_file "$run/manager.port" \
  --metadata "file:$run/metadata" \
  >"$run/kvmanager.log" 2>&1 &
pids+=($!)
wait_port "$run/manager.port" kvmanager "${pids[-1]}"
manager="127.0.0.1:$(cat "$run/manager.port")"

# Two workers: step (a) also prefills on one and decodes on the other.
for i in 0 1; do
  "$bin/kvworker" --listen 127.0.0.1:0 --port_file "$run/worker$i.port" \
    --manager "$manager" --worker_id demo-cpu-$i --pool_mb 1024 \
    >"$run/kvworker$i.log" 2>&1 &
  pids+=($!)
  wait_port "$run/worker$i.port" kvworker$i "${pids[-1]}"
done

echo "demo: kvmanager on $manager (pid ${pids[0]}), kvworkers on 127.0.0.1:$(cat "$run/worker0.port") and 127.0.0.1:$(cat "$run/worker1.port") (pids ${pids[1]} ${pids[2]})"
echo "demo: data directory $data"
status=0
"$bin/kvdemo" --manager "$manager" --data_dir "$data" \
  --calibration "$root/bench/results/calibration_kvproxy-18m-output.txtpb" "$@" || status=$?
if [ $status -ne 0 ]; then
  echo "demo: kvdemo failed with exit code $status; last lines of the service logs:" >&2
  tail -n 20 "$run/kvmanager.log" "$run/kvworker0.log" "$run/kvworker1.log" >&2
fi
exit $status
