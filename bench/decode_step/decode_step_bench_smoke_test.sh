#!/usr/bin/env bash
# decode_step_bench at a tiny shape on the CPU backend (4 sequences x 40
# tokens, 3 layers, INT4 and the tri-3.5 mix, every path (unary and stream,
# over TCP and over the worker's local socket), wire and append mode, one
# measured round): it must exit 0, print one row per case,
# path, wire and mode, and write them to the TSV. No timing is asserted.
# --dry_run prints the pool the cases need and starts nothing. Then bad
# flags: exit 1 before starting anything, naming the flag and the value.
# Usage:
# decode_step_bench_smoke_test.sh <decode_step_bench> (kvworker from
# $TRIAX_BIN_DIR).
set -u
BIN="$1"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

"$BIN" --backend=cpu --batch=4 --context=40 --layers=3 --q_heads=4 \
  --kv_heads=2 --head_dim=32 --encodings=int4,tri-3.5 --steps=1 --warmup=1 \
  --append=yes,no --paths=unary,stream,unary-unix,stream-unix \
  --install_threads=2 --tsv="$TMP/out.tsv" >"$TMP/out" \
  2>"$TMP/err"
rc=$?
cat "$TMP/out"
if [[ $rc -ne 0 ]]; then
  fail "decode_step_bench exited $rc"
  cat "$TMP/err"
fi
for enc in int4 tri-3.5; do
  for path in unary stream unary-unix stream-unix; do
    for wire in f32 bf16; do
      for append in yes no; do
        grep -qE "^${enc//./\\.} +$path +$wire +$append +[0-9]" "$TMP/out" ||
          fail "no row for $enc $path $wire append=$append"
      done
    done
  done
done
# Three layers: three device batches per step, whatever the path.
awk '$1=="int4" || $1=="tri-3.5" {if ($NF != 3) bad=1} END {exit bad}' \
  "$TMP/out" || fail "a row's batches is not 3"
[[ -s "$TMP/out.tsv" ]] || fail "no TSV written"
head -1 "$TMP/out.tsv" | grep -q $'^case\tpath\twire' || fail "TSV header"
for metric in step_ms device_ms kernel_ms server_ms overhead_ms \
  overhead_over_device overhead_over_kernel layer_request_bytes; do
  grep -q $'\t'"$metric"$'\t' "$TMP/out.tsv" || fail "TSV lacks $metric"
done
# The kernels are a part of the device batches (counted on the CPU backend
# too: the reference kernel's time).
awk -F'\t' '$5=="device_ms" {d[$1 $2 $3 $4]=$6} $5=="kernel_ms" {k[$1 $2 $3 $4]=$6}
  END {n=0; for (x in d) {n++; if (!(k[x] > 0 && k[x] <= d[x])) bad=1}
       exit bad || n == 0}' "$TMP/out.tsv" ||
  fail "a row's kernel_ms is not in (0, device_ms]"
# BF16 halves the queries: a layer's request is smaller than with f32.
awk -F'\t' '$5=="layer_request_bytes" && $2=="unary" && $4=="yes" {b[$1 $3]=$6}
  END {exit !(b["int4bf16"] < b["int4f32"])}' "$TMP/out.tsv" ||
  fail "bf16 requests are not smaller than f32 ones"

# The pool the cases need, and nothing started.
"$BIN" --dry_run --encodings=tri-3.5,int4 >"$TMP/dry" 2>&1 ||
  fail "--dry_run exited non-zero"
grep -qE '^# tri-3\.5: [0-9]+ MiB of pool, 0\.[0-9]+ of the same tokens in BF16' \
  "$TMP/dry" || fail "--dry_run printed no pool for tri-3.5"
grep -q '^# worker ' "$TMP/dry" && fail "--dry_run started a worker"

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
expect '--batch: "0"' --batch=0
expect '--context: "-5"' --context=-5
expect '--q_heads: "6" is not a multiple of --kv_heads=4' --q_heads=6 --kv_heads=4
expect '--block_tokens: "24"' --block_tokens=24
expect '--encodings: "int3"' --encodings=bf16,int3
expect '--encodings: "bf16->int4" names a transfer' '--encodings=bf16->int4'
expect '--paths: "rpc" is not unary, stream, unary-unix or stream-unix' --paths=unary,rpc
expect '--wires: "fp16" is not f32 or bf16' --wires=fp16
expect '--steps: "0"' --steps=0
expect '--append: "maybe" is not yes or no' --append=yes,maybe
expect '--frame_kb: "20"' --frame_kb=20
expect '--cpus_worker: "a-b"' --cpus_worker=a-b

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all passed"
