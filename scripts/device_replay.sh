#!/usr/bin/env bash
# pressure_replay runs side by side on the device machine's CPU cores (the
# kvworker CPU backend, --backend=cpu, as on the development VM), from a
# bundle made by ../shared/device/bundle.sh with pressure_replay, kvmanager
# and kvworker, and the data directory packed as a tar.xz (kvproxy-18m's
# model.bin does not travel uncompressed; see docs/bench.md):
#
#   scripts/device_replay.sh BUNDLE DATA_TAR_XZ OUT_DIR NAME=FLAGS...
#
# Each NAME=FLAGS starts one pressure_replay with FLAGS (space-separated)
# plus --data_dir, --out OUT_DIR/NAME.md and --worker_flags=--backend=cpu
# (appended to a --worker_flags in FLAGS); all run at once. Logs are packed
# into OUT_DIR/logs-LABEL.tar.xz (LABEL: $REPLAY_LABEL, default the bundle's
# directory name) to keep the file count low. $REPLAY_TIMEOUT_S, when set,
# stops each run after that many seconds (the device allows 600 s a
# command). Exits non-zero when a run fails.
set -uo pipefail
bundle=$(cd "${1:?usage: scripts/device_replay.sh BUNDLE DATA_TAR_XZ OUT_DIR NAME=FLAGS...}" && pwd)
data_tar=$(realpath "${2:?DATA_TAR_XZ}")
out=${3:?OUT_DIR}
shift 3
mkdir -p "$out"
out=$(cd "$out" && pwd)
data=$(mktemp -d /tmp/replay_data.XXXXXX)
tar xJf "$data_tar" -C "$data" || { echo "device_replay: cannot unpack $data_tar" >&2; exit 1; }
logs=$(mktemp -d /tmp/replay_logs.XXXXXX)
nproc > "$logs/nproc.txt"
lscpu > "$logs/lscpu.txt" 2>&1
declare -A pids
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  worker="--backend=cpu"
  args=()
  for f in $flags; do
    case "$f" in
      --worker_flags=*) worker="${f#--worker_flags=},$worker" ;;
      *) args+=("$f") ;;
    esac
  done
  ( start=$SECONDS
    ${REPLAY_TIMEOUT_S:+timeout "$REPLAY_TIMEOUT_S"} \
    "$bundle/run" "$bundle/bin/pressure_replay" --data_dir="$data" \
      --out="$out/$name.md" --worker_flags="$worker" "${args[@]}" \
      > "$logs/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - start)) s" >> "$logs/summary.txt"
    exit $rc ) &
  pids[$name]=$!
done
status=0
for name in "${!pids[@]}"; do
  wait "${pids[$name]}" || status=1
done
cat "$logs/summary.txt"
tar cJf "$out/logs-${REPLAY_LABEL:-$(basename "$bundle")}.tar.xz" -C "$logs" .
rm -rf "$data" "$logs"
exit $status
