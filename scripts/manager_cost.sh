#!/usr/bin/env bash
# The cost of one RPC of kvmanager builds on manager_bench's session
# workload (Open 41 blocks, Extend 7, Close), as figures that depend little
# on what else runs on the machine:
#   --tool callgrind  instructions per RPC (user space), counted by callgrind
#   --tool cpu        CPU microseconds per RPC of the kvmanager process, user
#                     and kernel (/proc/PID/stat, 10 ms ticks: use a few
#                     thousand sessions): what a pinned manager's cores
#                     spend, syscalls and page faults included; one run of
#                     2 x --sessions, start-up included (a difference of two
#                     runs is swamped by the start-up's variation here)
#
#   scripts/manager_cost.sh [options] KVMANAGER [KVMANAGER...]
#
# For each binary, in turns (--rounds), manager_bench runs --sessions and
# then 2 x --sessions sessions at --clients clients with the kvmanager under
# the tool; for callgrind, the difference of the two totals over the
# difference in RPCs (3 x --sessions) is the steady cost of an RPC, without
# start-up, the start snapshot and shut-down. Prints one line per binary and round, then the
# mean per binary and its ratio to the first binary.
#
# Options:
#   --tool T             callgrind (default) or cpu
#   --bench PATH         manager_bench (default: build/bin/manager_bench)
#   --sessions N         sessions of the smaller run (default 1000)
#   --clients C          concurrent clients (default 16)
#   --rounds R           turns over the binaries (default 1)
#   --manager_flags F    passed to manager_bench --manager_flags
#   --bench_flags F      more manager_bench flags, space-separated (e.g.
#                        "--paths=stream --streams=8": the calls on
#                        SequenceCalls streams)
#   --metadata M         file (default) or memory
#   --pin CPUS           run the kvmanager under taskset -c CPUS
#   --keep DIR           keep the tool's files of the larger runs in DIR
#                        (callgrind_annotate DIR/<n>.<round>.out)
set -euo pipefail

bench=build/bin/manager_bench
tool=callgrind
sessions=1000
clients=16
rounds=1
manager_flags=""
bench_flags=""
metadata=file
pin=""
keep=""
binaries=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tool) tool="$2"; shift 2 ;;
    --bench) bench="$2"; shift 2 ;;
    --sessions) sessions="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --manager_flags) manager_flags="$2"; shift 2 ;;
    --bench_flags) bench_flags="$2"; shift 2 ;;
    --metadata) metadata="$2"; shift 2 ;;
    --pin) pin="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) binaries+=("$1"); shift ;;
  esac
done
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "usage: $0 [options] KVMANAGER [KVMANAGER...] (--help)" >&2
  exit 2
fi
case "$tool" in
  callgrind)
    command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
    unit="instructions per RPC" ;;
  cpu)
    unit="CPU us per RPC" ;;
  *) echo "--tool: $tool; want callgrind or cpu" >&2; exit 2 ;;
esac

work=$(mktemp -d /tmp/manager_cost.XXXXXX)
trap 'rm -rf "$work"' EXIT
[[ -n "$keep" ]] && mkdir -p "$keep"

# The tool's total for one bench run of `n` sessions: instructions
# (callgrind) or CPU nanoseconds (cpu).
run() {
  local binary="$1" n="$2" out="$3" taskset=""
  [[ -n "$pin" ]] && taskset="taskset -c $pin"
  if [[ "$tool" == callgrind ]]; then
    printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=%s %s "%s" "$@"\n' \
      "$out" "$taskset" "$binary" >"$work/wrapper.sh"
  else
    # The manager's user and system time (all threads) when the bench
    # stops it, before its shut-down: /proc/PID/stat fields 14 and 15.
    cat >"$work/wrapper.sh" <<WRAPPER
#!/bin/bash
$taskset "$binary" "\$@" &
child=\$!
trap 'cat /proc/\$child/stat >"$out"; kill -TERM \$child' TERM
wait \$child
wait \$child
WRAPPER
  fi
  chmod +x "$work/wrapper.sh"
  rm -f "$out"
  if ! "$bench" --kvmanager="$work/wrapper.sh" --clients="$clients" \
      --level_sessions="$n" --metadata="$metadata" \
      --manager_flags="$manager_flags" $bench_flags >"$work/bench.log" 2>&1; then
    cat "$work/bench.log" >&2
    return 1
  fi
  if [[ "$tool" == callgrind ]]; then
    # The manager is SIGTERM'ed by the bench; callgrind writes as it exits.
    for _ in $(seq 100); do
      grep -q '^totals:' "$out" 2>/dev/null && break
      sleep 0.2
    done
    awk '/^totals:/ {print $2}' "$out"
  else
    local hz
    hz=$(getconf CLK_TCK)
    # Fields after the parenthesized command name: state is field 3.
    sed 's/.*) //' "$out" | awk -v hz="$hz" '{printf "%d\n", ($12 + $13) * 1e9 / hz}'
  fi
}

declare -A sum
for ((r = 1; r <= rounds; r++)); do
  for i in "${!binaries[@]}"; do
    b="${binaries[$i]}"
    small=0
    [[ "$tool" == callgrind ]] && small=$(run "$b" "$sessions" "$work/small.out")
    large=$(run "$b" "$((2 * sessions))" "$work/large.out")
    [[ -n "$keep" ]] && cp "$work/large.out" "$keep/$i.$r.out"
    if [[ "$tool" == callgrind ]]; then
      per=$(( (large - small) / (3 * sessions) ))
    else
      per=$(( large / (6 * sessions) / 1000 ))  # ns -> us
    fi
    sum[$i]=$(( ${sum[$i]:-0} + per ))
    printf 'round %d  %s  %d %s\n' "$r" "$b" "$per" "$unit"
  done
done
base=$(( sum[0] / rounds ))
for i in "${!binaries[@]}"; do
  mean=$(( sum[$i] / rounds ))
  printf 'mean  %s  %d %s  (%.3f of the first)\n' \
    "${binaries[$i]}" "$mean" "$unit" "$(echo "$mean / $base" | bc -l)"
done
