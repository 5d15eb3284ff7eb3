#!/usr/bin/env bash
# Instructions per call of the server under each security configuration,
# counted by callgrind: a measure of what TLS, mutual TLS and tokens with
# capabilities cost that does not depend on what else the machine runs
# (wall time and CPU time on the shared 2-core dev VM move by tens of
# percent from one run to the next). bench/results/manager.md "Security on
# and off", bench/results/attend_security.md.
#
#   bench/security/instructions.sh BIN_DIR OUT [manager|attend|all]
#
# BIN_DIR holds kvmanager, kvworker, manager_bench and attend_bench (a
# Release build). For each configuration of SECURITY (default
# plain,tls,mtls,token,mtls+token), one bench runs with the server
# (manager: kvmanager under manager_bench, 4 clients; attend: kvworker under
# attend_bench, 1 client, ATTEND_TOKENS tokens, default 512) started under
# valgrind --tool=callgrind with instrumentation off. Once the calls flow
# (WARMUP seconds after the start, default 15 for the manager and 40 for
# the worker, whose sequence is written first) instrumentation is on for
# WINDOW seconds (default 20), then the counts are dumped. Ir per call =
# the instructions the whole server process executed in the window (every
# thread: gRPC, TLS, the handlers, the journal, heartbeats) over the calls
# its handlers ran in it (ManagerService::OpenSequence + ExtendSequence +
# CloseSequence, or WorkerService::Attend). Writes
# OUT/<bench>-<config>.callgrind (the dump), OUT/<bench>-<config>.log (the
# bench's output), OUT/<bench>.tsv (bench, security, calls, Ir, Ir per
# call, ratio to the first configuration) and prints the table. Needs
# valgrind and python3.
set -euo pipefail
bin=$(cd "${1:?usage: instructions.sh BIN_DIR OUT [manager|attend|all]}" && pwd)
out=${2:?OUT}
what=${3:-all}
case $what in manager | attend | all) ;; *)
  echo "instructions.sh: unknown bench \"$what\" (manager, attend or all)" >&2
  exit 2
  ;;
esac
for tool in valgrind callgrind_control python3; do
  command -v $tool >/dev/null || {
    echo "instructions.sh: $tool not found" >&2
    exit 2
  }
done
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
IFS=, read -r -a configs <<<"${SECURITY:-plain,tls,mtls,token,mtls+token}"
window=${WINDOW:-20}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
bash "$root/tests/tls/make_certs.sh" "$scratch/certs"

# The server binary NAME under callgrind (instrumentation off), dumping to
# OUT/cg.<pid>.
wrap() {  # NAME
  printf '#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=%s/cg.%%p "%s/%s" "$@"\n' \
    "$scratch" "$bin" "$1" >"$scratch/bin/$1"
  chmod +x "$scratch/bin/$1"
}

# Counts the instructions of a dump and the calls of the functions matching
# PATTERN; prints "calls Ir".
count() {  # DUMP PATTERN
  python3 - "$1" "$2" <<'PY'
import re, sys
path, pattern = sys.argv[1], re.compile(sys.argv[2])
names, calls, cfn, total = {}, 0, None, 0
for line in open(path, errors="replace"):
    if line.startswith(("fn=", "cfn=")):
        m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
        if m and m.group(2):
            names[m.group(1)] = m.group(2)
        cfn = m.group(1) if line.startswith("cfn=") and m else None
    elif line.startswith("calls=") and cfn is not None:
        if pattern.search(names.get(cfn, "")):
            calls += int(line.split("=")[1].split()[0])
        cfn = None
    elif line.startswith(("summary:", "totals:")):
        total = int(line.split()[1])
print(calls, total)
PY
}

# Runs BENCH with its server wrapped, measures the window, appends a row.
measure() {  # bench config pattern server-name warmup command...
  local bench=$1 config=$2 pattern=$3 server=$4 warmup=$5
  shift 5
  rm -f "$scratch"/cg.*
  "$@" >"$out/$bench-$config.log" 2>&1 &
  local pid=$!
  sleep "$warmup"
  local spid=""
  for child in $(pgrep -P $pid); do
    if grep -q "$server" "/proc/$child/cmdline" 2>/dev/null &&
      grep -q valgrind "/proc/$child/cmdline" 2>/dev/null; then
      spid=$child
    fi
  done
  if [[ -z $spid ]]; then
    echo "instructions.sh: $bench $config: no $server under valgrind; log:" >&2
    cat "$out/$bench-$config.log" >&2
    kill $pid 2>/dev/null
    return 1
  fi
  callgrind_control -i on $spid >/dev/null 2>&1
  sleep "$window"
  callgrind_control -d $spid >/dev/null 2>&1
  callgrind_control -i off $spid >/dev/null 2>&1
  wait $pid || true
  local dump
  dump=$(ls "$scratch"/cg.$spid.* | sort -t. -k3 -n | tail -n 1)
  cp "$dump" "$out/$bench-$config.callgrind"
  read -r calls ir < <(count "$dump" "$pattern")
  printf '%s\t%s\t%s\t%s\n' "$bench" "$config" "$calls" "$ir" >>"$out/$bench.raw"
}

report() {  # bench
  printf 'bench\tsecurity\tcalls\tIr\tIr_per_call\tratio\n' >"$out/$1.tsv"
  awk -F'\t' -v OFS='\t' 'NR == 1 { base = $4 / $3 }
    { per = $3 > 0 ? $4 / $3 : 0; print $1, $2, $3, $4, int(per + 0.5),
      sprintf("%.3f", base > 0 ? per / base : 0) }' "$out/$1.raw" >>"$out/$1.tsv"
  echo "| bench | security | calls in the window | Ir | Ir per call | vs ${configs[0]} |"
  echo "|---|---|---:|---:|---:|---:|"
  tail -n +2 "$out/$1.tsv" | awk -F'\t' '{ printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6 }'
  rm -f "$out/$1.raw"
}

mkdir -p "$scratch/bin"
if [[ $what == manager || $what == all ]]; then
  wrap kvmanager
  for c in "${configs[@]}"; do
    warmup=${WARMUP:-15}
    measure manager "$c" 'ManagerService::(Open|Extend|Close)Sequence\(grpc' \
      kvmanager "$warmup" "$bin/manager_bench" \
      --kvmanager="$scratch/bin/kvmanager" --security="$c" --clients=4 \
      --seconds=$((warmup + window + 10)) --cpus_manager=0 \
      --cpus_bench=1 --tls_dir="$scratch/certs"
  done
  report manager
fi
if [[ $what == attend || $what == all ]]; then
  rm -f "$scratch/bin/kvmanager"
  ln -s "$bin/kvmanager" "$scratch/bin/kvmanager"
  wrap kvworker
  for c in "${configs[@]}"; do
    warmup=${WARMUP:-40}
    measure attend "$c" 'WorkerService::Attend\(grpc' kvworker "$warmup" \
      "$bin/attend_bench" --bin_dir="$scratch/bin" --security="$c" \
      --tokens="${ATTEND_TOKENS:-512}" --clients=1 \
      --seconds=$((warmup + window)) \
      --repeats=1 --cpus_worker=0 --cpus_manager=0 --cpus_bench=1 \
      --tls_dir="$scratch/certs"
  done
  report attend
fi
