#!/usr/bin/env bash
# The cost of security on the GPU machine's cores (16): manager_bench
# --security and attend_bench, with TLS, mutual TLS and bearer tokens with
# worker capabilities on and off, each configuration against plaintext in
# the same run (docs/security.md "What security costs").
#
#   scripts/device_security.sh BUNDLE OUT [manager|attend_cpu|attend_cuda|all]
#
# BUNDLE: a ../shared/device/bundle.sh directory holding kvmanager,
# kvworker, manager_bench and attend_bench. The certificates are made by
# tests/tls/make_certs.sh (openssl) into OUT/certs. Pinning: the kvmanager
# processes on CPUS_MANAGER (0-1), the kvworker processes on CPUS_WORKER
# (2-5), the benches' client threads on CPUS_CLIENTS (6-15; manager_bench's
# on 2-15, it has no worker). attend_bench runs with CPU workers
# (attend_cpu) and with CUDA workers (attend_cuda; "all" runs it when
# nvidia-smi sees a GPU). With the defaults each step takes 3 to 6 minutes.
#
# Writes OUT/<step>.md (the bench's output: every run, then the table
# against plain), OUT/<step>.tsv (every run and the pooled rows, with the
# ratio), OUT/<step>.err and OUT/summary.txt (exit status and seconds per
# step). SECURITY, SECONDS_PER_RUN, REPEATS, MANAGER_CLIENTS,
# ATTEND_TOKENS and ATTEND_CLIENTS override the defaults below. CERTS=DIR
# copies make_certs.sh's files from DIR instead of making them (for a
# machine without the openssl command: make them here, carry them along).
set -uo pipefail
b=$(cd "${1:?usage: scripts/device_security.sh BUNDLE OUT [manager|attend_cpu|attend_cuda|all]}" && pwd)
out=${2:?OUT}
what=${3:-all}
case $what in manager | attend_cpu | attend_cuda | all) ;; *)
  echo "device_security.sh: unknown step \"$what\" (manager, attend_cpu, attend_cuda or all)" >&2
  exit 2
  ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

security=${SECURITY:-plain,tls,mtls,token,mtls+token,mtls+local+token}
seconds=${SECONDS_PER_RUN:-3}
repeats=${REPEATS:-3}
cpus_manager=${CPUS_MANAGER:-0-1}
cpus_worker=${CPUS_WORKER:-2-5}
cpus_clients=${CPUS_CLIENTS:-6-15}

if [[ -n ${CERTS:-} ]]; then
  [[ -f $CERTS/ca.crt ]] || { echo "device_security.sh: CERTS=$CERTS has no ca.crt" >&2; exit 2; }
  mkdir -p "$out/certs" && cp "$CERTS"/* "$out/certs/" || exit 1
else
  bash "$root/tests/tls/make_certs.sh" "$out/certs" || exit 1
fi
{
  nproc
  lscpu | grep -E '^Model name' || true
  nvidia-smi -L 2>/dev/null || echo "no GPU"
} >"$out/machine.txt"
cat "$out/machine.txt"

step() {  # name, command...
  local name=$1
  shift
  local start=$SECONDS
  "$b/run" "$@" >"$out/$name.md" 2>"$out/$name.err"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$out/summary.txt"
}

if [[ $what == manager || $what == all ]]; then
  step manager "$b/bin/manager_bench" --security="$security" \
    --clients="${MANAGER_CLIENTS:-1,16,64}" --seconds="$seconds" \
    --repeats="$repeats" --cpus_manager="$cpus_manager" \
    --cpus_bench="${CPUS_MANAGER_CLIENTS:-2-15}" --tls_dir="$out/certs" \
    --make_certs="$root/tests/tls/make_certs.sh" --tsv="$out/manager.tsv"
fi
backends=()
case $what in
  attend_cpu) backends=(cpu) ;;
  attend_cuda) backends=(cuda) ;;
  all)
    backends=(cpu)
    if nvidia-smi -L >/dev/null 2>&1; then backends+=(cuda); fi
    ;;
esac
for backend in "${backends[@]}"; do
  step "attend_$backend" "$b/bin/attend_bench" --security="$security" \
    --backend="$backend" --tokens="${ATTEND_TOKENS:-512,4096,16384}" \
    --clients="${ATTEND_CLIENTS:-1,8}" --seconds="$seconds" \
    --repeats="$repeats" --cpus_manager="$cpus_manager" \
    --cpus_worker="$cpus_worker" --cpus_bench="$cpus_clients" \
    --tls_dir="$out/certs" --make_certs="$root/tests/tls/make_certs.sh" \
    --tsv="$out/attend_$backend.tsv"
done
