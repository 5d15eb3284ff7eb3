#!/usr/bin/env bash
# manager_bench --security and attend_bench at their smallest: every
# configuration (plain, tls, mtls, token, mtls+token, and local and
# mtls+local+token: the clients on the server's Unix-domain socket) with certificates
# made by make_certs.sh and tokens issued through the managers, one repeat
# of one second (manager_bench with its --floor); each must exit 0, print one comparison row per
# configuration with no errors, and write its TSV. No timing is asserted.
# Then bad flags: exit 2 before starting anything, naming the flag and the
# value.
#
#   security_bench_smoke_test.sh MANAGER_BENCH ATTEND_BENCH MAKE_CERTS
set -u
MANAGER_BENCH="$1"
ATTEND_BENCH="$2"
MAKE_CERTS="$3"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
configs=(plain tls mtls token mtls+token local mtls+local+token)
all=$(
  IFS=,
  echo "${configs[*]}"
)

# check NAME OUT TSV LEVEL: one comparison row per configuration at LEVEL,
# each with 0 errors, and the TSV's pooled rows.
check() {
  local name=$1 out=$2 tsv=$3 level=$4
  for c in "${configs[@]}"; do
    local row
    row=$(grep -F "| $level | $c |" "$out" | tail -n 1)
    if [[ -z $row ]]; then
      fail "$name: no comparison row for $c"
    elif [[ $(awk -F'|' '{v = $(NF - 1); gsub(/ /, "", v); print v}' <<<"$row") != 0 ]]; then
      fail "$name: $c row has errors: $row"
    fi
    awk -F'\t' -v c="$c" '$3 == c && $4 == "all" { found = 1 } END { exit !found }' \
      "$tsv" || fail "$name: TSV lacks the pooled row of $c"
  done
  head -1 "$tsv" | grep -q $'^bench\tlevel\tsecurity\trepeat' || fail "$name: TSV header"
}

# bench NAME BIN ARGS...: runs BIN with ARGS, stdout to $TMP/NAME.out
# (printed), stderr to $TMP/NAME.err (printed when it fails); a non-zero
# exit fails the test.
bench() {
  local name=$1 bin=$2
  shift 2
  "$bin" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
  local rc=$?
  cat "$TMP/$name.out"
  if [[ $rc -ne 0 ]]; then
    fail "$name: $(basename "$bin") exited $rc"
    cat "$TMP/$name.err"
  fi
}

bench manager "$MANAGER_BENCH" --security="$all" --clients=2 --seconds=1 \
  --floor --make_certs="$MAKE_CERTS" --tsv="$TMP/manager.tsv"
check manager_bench "$TMP/manager.out" "$TMP/manager.tsv" 2
# --floor: a row per configuration with calls answered NOT_FOUND (any other
# answer is an error and the bench exits 1).
for c in "${configs[@]}"; do
  awk -F'|' -v c="$c" '{ gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $4) }
    $2 == c && $3 == "2" && $4 + 0 > 0 { found = 1 } END { exit !found }' \
    "$TMP/manager.out" || fail "manager_bench --floor: no floor row for $c"
done

bench attend "$ATTEND_BENCH" --security="$all" --tokens=64 --clients=1 \
  --seconds=1 --repeats=1 --layers=2 --make_certs="$MAKE_CERTS" \
  --tsv="$TMP/attend.tsv"
check attend_bench "$TMP/attend.out" "$TMP/attend.tsv" "64 x 1"

# BF16 queries and outputs (AttendBatch), over TCP with TLS and over the
# worker's local socket: the runs complete without errors.
bench attend_bf16 "$ATTEND_BENCH" --security=tls,mtls+local+token \
  --wire=bf16 --tokens=64 --clients=1 --seconds=1 --repeats=1 --layers=2 \
  --make_certs="$MAKE_CERTS"
grep -q "(bf16 on the wire)" "$TMP/attend_bf16.out" || fail "--wire=bf16 not reported"
grep -qE '^\| 64 x 1 \| mtls\+local\+token \| [0-9]+ .*\| 0 \|$' "$TMP/attend_bf16.out" ||
  fail "attend_bench --wire=bf16: no error-free row for mtls+local+token"

# expect BIN <substring> <args...>: exit code 2 and <substring> on stderr.
expect() {
  local bin="$1" want="$2"
  shift 2
  "$bin" "$@" >"$TMP/bad.out" 2>"$TMP/bad.err"
  local rc=$?
  if [[ $rc -ne 2 ]]; then
    fail "$(basename "$bin") $* exited $rc, expected 2"
  elif ! grep -qF -- "$want" "$TMP/bad.err"; then
    fail "$(basename "$bin") $*: stderr lacks '$want':"
    cat "$TMP/bad.err"
  else
    echo "ok: $(basename "$bin") $*"
  fi
}
expect "$MANAGER_BENCH" '--security=plain,tsl: "tsl" has the unknown part' --security=plain,tsl
expect "$MANAGER_BENCH" '"plain+tls" joins plain' --security=plain+tls
expect "$MANAGER_BENCH" '--security=tls applies to --mode=throughput' --mode=memory --security=tls
expect "$MANAGER_BENCH" '--repeats=0' --repeats=0
expect "$MANAGER_BENCH" '--cpus_manager: "0-x"' --cpus_manager=0-x
expect "$MANAGER_BENCH" '--make_certs=/nonexistent/make_certs.sh: cannot be read' \
  --security=tls --make_certs=/nonexistent/make_certs.sh
expect "$ATTEND_BENCH" '"mtls+tls" names tls twice' --security=plain,mtls+tls
expect "$ATTEND_BENCH" '--tokens=0: "0" is not a count' --tokens=0
expect "$ATTEND_BENCH" '--clients=1,x: "x" is not a count' --clients=1,x
expect "$ATTEND_BENCH" '--q_heads=12: must be a multiple of --kv_heads=8' --q_heads=12
expect "$ATTEND_BENCH" '--seconds=0: must be in 1..3600' --seconds=0
expect "$ATTEND_BENCH" '--cpus_worker: "9-1"' --cpus_worker=9-1
expect "$ATTEND_BENCH" '--pool_mb=-1: must be >= 0' --pool_mb=-1
expect "$ATTEND_BENCH" '--wire=fp16: is not f32 or bf16' --wire=fp16

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all passed"
