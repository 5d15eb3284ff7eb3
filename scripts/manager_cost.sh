#!/usr/bin/env bash
# Instructions per RPC of kvmanager builds on manager_bench's session
# workload (Open 41 blocks, Extend 7, Close), counted by callgrind: a
# figure that does not depend on what else runs on the machine.
#
#   scripts/manager_callgrind.sh [options] KVMANAGER [KVMANAGER...]
#
# For each binary, in turns (--rounds), manager_bench runs --sessions and
# then 2 x --sessions sessions at --clients clients with the kvmanager under
# `valgrind --tool=callgrind`; the difference of the two totals over the
# difference in RPCs (3 x --sessions) is the steady cost of an RPC, without
# start-up, the start snapshot and shut-down. Prints one line per binary and
# round, then the mean per binary and its ratio to the first binary.
#
# Options:
#   --bench PATH         manager_bench (default: build/bin/manager_bench)
#   --sessions N         sessions of the smaller run (default 1000)
#   --clients C          concurrent clients (default 16)
#   --rounds R           turns over the binaries (default 1)
#   --manager_flags F    passed to manager_bench --manager_flags
#   --metadata M         file (default) or memory
#   --keep DIR           keep the callgrind files of the larger runs in DIR
#                        (callgrind_annotate DIR/<n>.<round>.out)
set -euo pipefail

bench=build/bin/manager_bench
sessions=1000
clients=16
rounds=1
manager_flags=""
metadata=file
keep=""
binaries=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bench) bench="$2"; shift 2 ;;
    --sessions) sessions="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --manager_flags) manager_flags="$2"; shift 2 ;;
    --metadata) metadata="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) binaries+=("$1"); shift ;;
  esac
done
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "usage: $0 [options] KVMANAGER [KVMANAGER...] (--help)" >&2
  exit 2
fi
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }

work=$(mktemp -d /tmp/manager_callgrind.XXXXXX)
trap 'rm -rf "$work"' EXIT
[[ -n "$keep" ]] && mkdir -p "$keep"

# Total instructions (Ir) of one bench run of `sessions` sessions.
run() {
  local binary="$1" n="$2" out="$3"
  cat >"$work/wrapper.sh" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --callgrind-out-file=$out "$binary" "\$@"
EOF
  chmod +x "$work/wrapper.sh"
  rm -f "$out"
  if ! "$bench" --kvmanager="$work/wrapper.sh" --clients="$clients" \
      --level_sessions="$n" --metadata="$metadata" \
      --manager_flags="$manager_flags" >"$work/bench.log" 2>&1; then
    cat "$work/bench.log" >&2
    return 1
  fi
  # The manager is SIGTERM'ed by the bench; callgrind writes on exit.
  for _ in $(seq 100); do
    grep -q '^totals:' "$out" 2>/dev/null && break
    sleep 0.2
  done
  awk '/^totals:/ {print $2}' "$out"
}

declare -A sum
for ((r = 1; r <= rounds; r++)); do
  for i in "${!binaries[@]}"; do
    b="${binaries[$i]}"
    small=$(run "$b" "$sessions" "$work/small.out")
    large=$(run "$b" "$((2 * sessions))" "$work/large.out")
    [[ -n "$keep" ]] && cp "$work/large.out" "$keep/$i.$r.out"
    per=$(( (large - small) / (3 * sessions) ))
    sum[$i]=$(( ${sum[$i]:-0} + per ))
    printf 'round %d  %s  %d instructions per RPC\n' "$r" "$b" "$per"
  done
done
base=$(( sum[0] / rounds ))
for i in "${!binaries[@]}"; do
  mean=$(( sum[$i] / rounds ))
  printf 'mean  %s  %d instructions per RPC  (%.3f of the first)\n' \
    "${binaries[$i]}" "$mean" "$(echo "$mean / $base" | bc -l)"
done
