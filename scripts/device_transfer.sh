#!/usr/bin/env bash
# The transfer path on the GPU machine, with CUDA workers (--backend=auto
# picks cuda there): the GPU tests, the two-process transfer tests on both
# data paths (ipc = CUDA IPC between two workers on one GPU), the cluster
# tests, the prefill-on-one / decode-on-the-other demo, and transfer_bench
# over the ipc and stream paths against the device's own copy bandwidth;
# "link": the transfer tests and a bench over NCCL links between the two
# workers (each its own NCCL_HOSTID: on one GPU, NCCL's socket transport).
#
#   scripts/device_transfer.sh BUNDLE DATA_DIR OUT [tests|link|probe|bench|all]
#
# BUNDLE: a ../shared/device/bundle.sh directory holding kvmanager,
# kvworker, kvdemo, transfer_bench, device_copy_probe and the test
# binaries named below. Each step's output goes to OUT/<step>.log and its
# exit status to OUT/summary.txt. BENCH_SIZES / BENCH_STREAM_SIZES /
# BENCH_REPEATS override the bench's sizes (ipc path / stream path) and
# repeats; BENCH_ENCODINGS / BENCH_OVERLAP_SIZES the ipc bench's encodings
# and layer-by-layer sizes; BENCH_BLOCK_TOKENS a list of block sizes for
# it (default 16); BENCH_STREAM_SIZES=none skips the stream bench.
# "probe": page_copy_probe (the device work alone: copy, copy + CRC32C and
# CRC32C by every checksum kernel) at 256, 64, 17 and 4 KiB pages.
set -uo pipefail
b=${1:?usage: BUNDLE DATA_DIR OUT [tests|bench|all]}
data=${2:?DATA_DIR}
out=${3:?OUT}
what=${4:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
export TRIAX_BIN_DIR=$b/bin TRIAX_DATA_DIR=$data
mkdir -p "$out"

step() {  # name, command...
  local name=$1
  shift
  local start=$SECONDS
  "$b/run" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$out/summary.txt"
}

nvidia-smi -L | tee "$out/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  step crc32c_cuda_test "$b/bin/crc32c_cuda_test"
  step cuda_device_test "$b/bin/cuda_device_test"
  step cuda_copy_test "$b/bin/cuda_copy_test"
  step worker_ipc_test "$b/bin/worker_ipc_test"
  # The link path runs in the "link" step (it needs NCCL_HOSTID per worker).
  step transfer_test "$b/bin/transfer_test" --gtest_filter=-*/2
  step transfer_cluster_test "$b/bin/transfer_cluster_test"
  step kvdemo_transfer_test "$b/bin/kvdemo_transfer_test"
  step demo bash "$root/scripts/demo.sh" "$b/bin" --steps=ab
fi
if [[ $what == link || $what == all ]]; then
  # The link path between two CUDA workers on one GPU: NCCL refuses two
  # ranks on one GPU of one host, so each worker process runs as its own
  # NCCL "host" (NCCL_HOSTID) and NCCL uses its socket transport on
  # loopback. Correctness and the watchdog, not NVLink speed.
  wrap=$(mktemp -d)
  for f in "$b"/bin/*; do ln -s "$f" "$wrap/"; done
  rm "$wrap/kvworker"
  printf '#!/bin/sh\nexport NCCL_HOSTID=triax-$$ NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}\nexec "%s" "$@"\n' \
    "$b/bin/kvworker" >"$wrap/kvworker"
  chmod +x "$wrap/kvworker"
  TRIAX_BIN_DIR=$wrap step link_transfer_test "$b/bin/transfer_test" \
    --gtest_filter='*/2'
  TRIAX_BIN_DIR=$wrap step bench_link "$b/bin/transfer_bench" --backend=cuda \
    --worker_flags=--transfer_path=link \
    --sizes="${BENCH_LINK_SIZES:-1M,16M,256M}" --overlap_sizes=16M \
    --repeats="${BENCH_REPEATS:-3}" \
    --cpus_src=0-3 --cpus_dst=4-7 --cpus_bench=8-15 \
    --tsv="$out/bench_link.tsv"
fi
if [[ $what == probe || $what == bench || $what == all ]]; then
  for page in 262144 65536 17408 4096; do
    step "probe_$page" "$b/bin/page_copy_probe" 1073741824 "$page" 20
  done
fi
if [[ $what == bench || $what == all ]]; then
  sizes=${BENCH_SIZES:-1M,16M,256M,1G,4G}
  stream_sizes=${BENCH_STREAM_SIZES:-1M,16M,256M,1G}
  repeats=${BENCH_REPEATS:-3}
  for bt in ${BENCH_BLOCK_TOKENS:-16}; do
    name=bench_ipc
    [[ $bt == 16 ]] || name=bench_ipc_b$bt
    step $name "$b/bin/transfer_bench" --backend=cuda --block_tokens="$bt" \
      --worker_flags=--transfer_path=ipc --sizes="$sizes" \
      --encodings="${BENCH_ENCODINGS:-bf16,int4,bf16->int4,tri-3.5,bf16->tri-3.5}" \
      --overlap_sizes="${BENCH_OVERLAP_SIZES:-16M,256M,1G}" --repeats="$repeats" \
      --cpus_src=0-3 --cpus_dst=4-7 --cpus_bench=8-15 \
      --tsv="$out/$name.tsv"
  done
  [[ $stream_sizes == none ]] || step bench_stream "$b/bin/transfer_bench" --backend=cuda \
    --worker_flags=--transfer_path=stream --sizes="$stream_sizes" \
    --overlap_sizes=256M --repeats="$repeats" \
    --cpus_src=0-3 --cpus_dst=4-7 --cpus_bench=8-15 \
    --tsv="$out/bench_stream.tsv"
fi
