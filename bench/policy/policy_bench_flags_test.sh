#!/usr/bin/env bash
# policy_bench's bad flags and bad shards: each run must exit 1 before
# starting anything, with a message that names the flag (or shard file and
# line) and the value. Usage: policy_bench_flags_test.sh <policy_bench>
# <calibration table>.
set -u
BIN="$1"
CAL="$2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
failures=0

# expect <substring> <args...>: exit code 1 and <substring> on stderr.
expect() {
  local want="$1"
  shift
  "$BIN" --calibration="$CAL" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [[ $rc -ne 1 ]]; then
    echo "FAIL: $* exited $rc, expected 1"
    failures=$((failures + 1))
  elif ! grep -qF -- "$want" "$TMP/err"; then
    echo "FAIL: $*: stderr lacks '$want':"
    cat "$TMP/err"
    failures=$((failures + 1))
  else
    echo "ok: $*"
  fi
}

expect '--configs: "int5"' --configs=bf16,int5
expect '--configs: ","' --configs=,
expect '--bfcl_ids: "multi_turn_base_1"' --bfcl_ids=multi_turn_base_1
expect '--budgets: "0"' --budgets=3,0
expect '--budgets: "x"' --budgets=x
expect '--tri_windows: "-1"' --tri_windows=-1
expect '--answer_weights: "-1"' --answer_weights=0,-1
expect '--answer_weights: ","' --answer_weights=,
expect '--objectives: "mse"' --objectives=dnll,mse
expect '--objectives: "kl"' --objectives=kl,kl
# An attention-metric table cannot serve the NLL objective.
expect '--objectives: "dnll" needs an output-metric table' --configs=bf16,tri-3 \
  --calibration="$(dirname "$CAL")/calibration_kvproxy-18m.txtpb"
# Variant names: tri-<budget>[-a<answer weight>][-<objective after the
# first>][-w<window>], and the ablations at --ablation_budget.
variants=(--budgets=3.6 --answer_weights=0,1 --objectives=dnll,kl --tri_windows=0,32 --configs=bogus)
expect 'tq2,tri-3.6,tri-3.6-a1,tri-3.6-w32,tri-3.6-a1-w32,tri-3.6-kl,' "${variants[@]}"
expect 'tri-3.6-a1-kl-w32,tri-3.5-no-temporal,tri-3.5-no-role' "${variants[@]}"
expect '"tri-3.7" is not a configuration of this run' --budgets=3.6 --configs=tri-3.7
expect '--kivi_window: "0"' --kivi_window=0
expect '--ablation_budget: "-2"' --ablation_budget=-2
expect '--bootstrap: "0"' --bootstrap=0
expect '--chunk: "0"' --chunk=0
expect "--merge: \"$TMP/none.tsv\"" --merge="$TMP/none.tsv"
printf 'conversation\tconfig\n' >"$TMP/bad.tsv"
expect "$TMP/bad.tsv:1: expected the header line" --merge="$TMP/bad.tsv"

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all passed"
