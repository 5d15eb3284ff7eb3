#!/usr/bin/env bash
# manager_bench with the kvmanager pinned to some cores and the clients to
# others, for one or more kvmanager builds in alternating turns, so that
# a baseline and a change are measured in the same run on the same machine.
#
#   scripts/manager_pinned.sh [options] KVMANAGER [KVMANAGER...]
#
# Each turn (--rounds) runs manager_bench once per binary, in the order
# given; the tables are printed under a line naming the binary and round.
#
# Options:
#   --manager_cpus C   taskset list of the kvmanager (default 0-1)
#   --bench_cpus C     taskset list of manager_bench and its clients
#                      (default: the other online cores, 2-(nproc-1))
#   --bench PATH       manager_bench (default: build/bin/manager_bench)
#   --rounds R         turns over the binaries (default 2)
#   --                 the rest goes to manager_bench (default:
#                      --clients=1,16,64 --seconds=5)
#
# The issue 21 figure (16-core GPU host, the manager on 2 cores):
#   scripts/manager_pinned.sh --manager_cpus 0-1 --bench_cpus 2-15 \
#     BASELINE/kvmanager build/bin/kvmanager
set -euo pipefail

manager_cpus=0-1
bench_cpus=""
bench=build/bin/manager_bench
rounds=2
binaries=()
bench_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --manager_cpus) manager_cpus="$2"; shift 2 ;;
    --bench_cpus) bench_cpus="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --) shift; bench_args=("$@"); break ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) binaries+=("$(realpath "$1")"); shift ;;
  esac
done
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "usage: $0 [options] KVMANAGER [KVMANAGER...] (--help)" >&2
  exit 2
fi
[[ ${#bench_args[@]} -eq 0 ]] && bench_args=(--clients=1,16,64 --seconds=5)
if [[ -z "$bench_cpus" ]]; then
  n=$(nproc --all)
  if (( n < 3 )); then
    echo "--bench_cpus: only $n cores; name the bench's cores" >&2
    exit 2
  fi
  bench_cpus="2-$((n - 1))"
fi

work=$(mktemp -d /tmp/manager_pinned.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "manager on cores $manager_cpus, bench on $bench_cpus; load average:" \
  "$(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; r++)); do
  for b in "${binaries[@]}"; do
    printf '#!/bin/sh\nexec taskset -c %s "%s" "$@"\n' "$manager_cpus" "$b" \
      >"$work/kvmanager.sh"
    chmod +x "$work/kvmanager.sh"
    echo
    echo "## round $r: $b"
    taskset -c "$bench_cpus" "$bench" --kvmanager="$work/kvmanager.sh" \
      "${bench_args[@]}"
  done
done
