#!/usr/bin/env bash
# transfer_bench at its smallest: one 1M sequence (16 tokens), every
# encoding case, one repeat, and the layer-by-layer case; it must exit 0 and
# print every table's rows, and write them to the TSV. No timing is
# asserted. Then bad flags: exit 1 before starting anything, naming the flag
# and the value. Usage: transfer_bench_smoke_test.sh <transfer_bench>
# (kvworker from $TRIAX_BIN_DIR).
set -u
BIN="$1"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

"$BIN" --backend=cpu --sizes=1M --repeats=1 --overlap_sizes=1M \
  --cpus_src=0 --cpus_dst=0 --cpus_bench=0 \
  '--overlap_encodings=bf16->int4' --layer_compute_ms=0.5 \
  --tsv="$TMP/out.tsv" >"$TMP/out" 2>"$TMP/err"
rc=$?
cat "$TMP/out"
if [[ $rc -ne 0 ]]; then
  fail "transfer_bench exited $rc"
  cat "$TMP/err"
fi
# One transfer row per encoding case, the overlap rows and the layer rows.
for enc in bf16 int4 'bf16->int4' tri-3.5 'bf16->tri-3.5'; do
  grep -qE "^1M +16 +${enc//./\\.} " "$TMP/out" || fail "no transfer row for $enc"
done
for mode in serial overlap; do
  grep -qE "^1M +16 +bf16->int4 +$mode " "$TMP/out" || fail "no $mode row"
done
grep -qE '^ +31 ' "$TMP/out" || fail "no row for layer 31"
[[ -s "$TMP/out.tsv" ]] || fail "no TSV written"
head -1 "$TMP/out.tsv" | grep -q $'^table\tsize\ttokens' || fail "TSV header"
for metric in seconds_per_sequence wire_over_bf16 probe_throughput \
  memcpy_throughput done_to_decode_seconds landed_ms; do
  grep -q $'\t'"$metric"$'\t' "$TMP/out.tsv" || fail "TSV lacks $metric"
done
# bf16 moves as stored: wire bytes equal BF16 bytes.
awk -F'\t' '$1=="transfer" && $4=="bf16" && $7=="wire_over_bf16" && $8!=1 {bad=1}
  END {exit bad}' "$TMP/out.tsv" || fail "bf16 wire_over_bf16 is not 1"

# expect <substring> <args...>: exit code 1 and <substring> on stderr.
expect() {
  local want="$1"
  shift
  "$BIN" "$@" >"$TMP/bad.out" 2>"$TMP/bad.err"
  local rc=$?
  if [[ $rc -ne 1 ]]; then
    fail "$* exited $rc, expected 1"
  elif ! grep -qF -- "$want" "$TMP/bad.err"; then
    fail "$*: stderr lacks '$want':"
    cat "$TMP/bad.err"
  else
    echo "ok: $*"
  fi
}
expect '--sizes: "0"' --sizes=0
expect '--encodings: "int3" names no encoding' --encodings=bf16,int3
expect '--overlap_encodings: "x->y->z"' '--overlap_encodings=x->y->z'
expect '--repeats: "0"' --repeats=0
expect '--layer_compute_ms: "-1"' --layer_compute_ms=-1
expect '--cpus_src: "a-b"' --cpus_src=a-b
expect '--cpus_dst: "3-1"' --cpus_dst=3-1
expect '--device_copy: "on"' --device_copy=on
expect '--block_tokens: "24"' --block_tokens=24
expect '--block_tokens: "0"' --block_tokens=0

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all passed"
