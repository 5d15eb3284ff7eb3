#!/usr/bin/env bash
# Host instructions per page of the ipc transfer path, counted by callgrind
# (instruction counts do not depend on the machine's load, unlike times):
# transfer_bench with both kvworkers under valgrind --tool=callgrind, CPU
# backend (shared memfd arenas), then the inclusive instructions of the
# source's SharePages handler (its whole export: pins, page references,
# batches, gRPC) and of the destination's import pieces, per page moved.
# The CPU backend's CopyPagesChecked (memcpy + CRC32C on the host) is
# reported apart: on a GPU it is the device's copy kernel.
#
#   bench/transfer/callgrind_workers.sh BIN_DIR [SIZE] [REPEATS]
#
# BIN_DIR holds kvworker and transfer_bench (a Release build); SIZE is a
# transfer_bench --sizes entry (default 64M), REPEATS its --repeats (3).
# KEEP_DIR=DIR keeps the two workers' profiles there (src.out, dst.out) for
# callgrind_annotate.
set -euo pipefail
bin=$(cd "${1:?usage: BIN_DIR [SIZE] [REPEATS]}" && pwd)
size=${2:-64M}
repeats=${3:-3}
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/cg"
for f in "$bin"/*; do ln -s "$f" "$work/bin/"; done
rm "$work/bin/kvworker"
printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=%s/cg/kvworker.%%p.out "%s/kvworker" "$@"\n' \
  "$work" "$bin" >"$work/bin/kvworker"
chmod +x "$work/bin/kvworker"
"$bin/transfer_bench" --bin_dir="$work/bin" --backend=cpu \
  --worker_flags=--transfer_path=ipc --sizes="$size" --encodings=bf16 \
  --repeats="$repeats" --overlap_sizes= --device_copy=off >"$work/bench.out"
tokens=$(awk -v s="$size" '$1 == s && $3 == "bf16" && $4 == "ipc" {print $2; exit}' "$work/bench.out")
[[ -n $tokens ]] || { cat "$work/bench.out"; echo "no transfer row" >&2; exit 1; }
# Every repeat and the one-block warm-up move 32 layers of each block.
pages=$(( (tokens / 16 * repeats + 1) * 32 ))
ir() {  # file, function pattern: the largest inclusive count of a match (0: none)
  { callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
    grep -E "$2" || true; } | head -1 | awk '{gsub(",", "", $1); n = $1} END {print n + 0}'
}
src="" dst=""
for f in "$work"/cg/kvworker.*.out; do
  if [[ $(ir "$f" 'WorkerService::SharePages\(') -gt 0 ]]; then src=$f; else dst=$f; fi
done
share=$(ir "$src" 'WorkerService::SharePages\(')
import=$(ir "$dst" 'WorkerService::ImportSequence\(')
copy=$(ir "$dst" 'CpuDevice::CopyPagesChecked\(')
begin=$(ir "$dst" 'SequenceStore::BeginImport\(')
# Installs: checks, copies and installs of the batches, at once
# (InstallSharedRuns, which InstallShared calls) or in the pipeline
# (StartSharedRuns, FinishShared); the first calls FinishShared only when
# the pipeline holds batches (never on the same path). A build before runs
# (f61c0f2 and older) has InstallShared only.
install=$(( $(ir "$dst" 'ImportSession::InstallSharedRuns\(') +
            $(ir "$dst" 'ImportSession::StartSharedRuns\(') +
            $(ir "$dst" 'ImportSession::FinishShared\(') ))
[[ $install -gt 0 ]] || install=$(ir "$dst" 'ImportSession::InstallShared\(')
fetch=$(ir "$dst" 'TransferClient::FetchShared\(')
if [[ -n ${KEEP_DIR:-} ]]; then
  mkdir -p "$KEEP_DIR"
  cp "$src" "$KEEP_DIR/src.out"
  cp "$dst" "$KEEP_DIR/dst.out"
fi
echo "size $size, $pages pages (64 KiB BF16 each) moved in $repeats repeats and the warm-up"
printf '%-48s %14s %10s\n' "" "instructions" "per page"
row() { printf '%-48s %14d %10d\n' "$1" "$2" $(( $2 / pages )); }
row "src: SharePages (the whole export)" "$share"
row "dst: ImportSequence (whole, copies included)" "$import"
row "dst:   CopyPagesChecked (host memcpy + CRC32C)" "$copy"
row "dst:   BeginImport (reserving pages)" "$begin"
row "dst:   checks and installs (less the copies)" $(( install - copy ))
row "dst:   receiving batches (FetchShared less installs)" $(( fetch - install ))
row "dst: ImportSequence less the copies" $(( import - copy ))
row "both: host work per page, copies left out" $(( share + import - copy ))
