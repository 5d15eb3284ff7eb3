#!/usr/bin/env bash
# One decode step of a Llama-3-8B-shaped model's attention through the
# kvworker service on the GPU machine (issue 21 part 3): decode_step_bench
# with a CUDA worker at batch 64 and batch 16 x 32k context x 32 layers
# (unary Attend per layer against one AttendStream, float32 and BF16
# queries/outputs, a real step with appends and the attention alone),
# beside attention_bench at the same shapes: the kernel alone, in the same
# run on the same GPU.
#
#   scripts/device_decode_step.sh BUNDLE OUT
#
# BUNDLE: a ../shared/device/bundle.sh directory with kvworker,
# decode_step_bench and attention_bench of a CUDA build (the commands:
# bench/results/decode_step.md). Each step's output goes to OUT/<step>.log
# (tables also to OUT/<step>.tsv), its exit status and seconds to
# OUT/summary.txt.
#
# Memory. 64 sequences x 32768 tokens of K/V at this shape (32 layers x 8
# KV heads x head_dim 128) are 256 GiB in BF16: batch 64 runs in the
# tri-3.5 mix only (0.222 of BF16 with the worker's frames and window
# pages: 57 GiB of pool on the 80 GB H100; INT4 with its scales at 16-token
# pages is 0.364 of BF16, 93 GiB, and does not fit), batch 16 in tri-3.5
# (14 GiB) and INT4 (23 GiB). The pool is what the bench computes
# (--pool_mb=0: the cases' frames + 3% + 64 MiB; the pool_b* steps print
# it). Installing writes every token in BF16 through WriteKV (256 GiB at
# batch 64), 8 streams at once.
# Cores: the worker on 0-7, the bench (the frontend) on 8-15.
#
# Environment (to try the script elsewhere, e.g. the CPU backend at a small
# shape): BACKEND (cuda), CONTEXT (32768), LAYERS (32), BATCHES ("64 16"),
# STEPS (8), PATHS (unary,stream; add unary-unix,stream-unix for the
# worker's local socket), CPUS_WORKER (0-7), CPUS_BENCH (8-15).
set -uo pipefail
b=${1:?usage: BUNDLE OUT}
out=${2:?usage: BUNDLE OUT}
backend=${BACKEND:-cuda}
context=${CONTEXT:-32768}
layers=${LAYERS:-32}
batches=${BATCHES:-64 16}
steps=${STEPS:-8}
paths=${PATHS:-unary,stream}
cpus_worker=${CPUS_WORKER:-0-7}
cpus_bench=${CPUS_BENCH:-8-15}
export TRIAX_BIN_DIR=$b/bin
mkdir -p "$out"

step() {  # name, command...
  local name=$1
  shift
  local start=$SECONDS
  "$b/run" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$out/summary.txt"
}

nvidia-smi -L >"$out/gpu.txt" 2>&1 || echo "no nvidia-smi" >"$out/gpu.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem \
  --format=csv >>"$out/gpu.txt" 2>&1
nproc >>"$out/gpu.txt"
for batch in $batches; do
  if [[ -x $b/bin/attention_bench ]]; then
    # The kernel alone at the step's shape: every format, GQA 4 and 8 (the
    # model is GQA 4: 32 query / 8 KV heads).
    step "attention_b$batch" "$b/bin/attention_bench" --batch "$batch" \
      --context "$context" --iters 20
  fi
  encodings=tri-3.5
  [[ $batch -le 16 ]] && encodings=tri-3.5,int4
  common=(--backend="$backend" --batch="$batch" --context="$context"
    --layers="$layers" --encodings="$encodings" --paths="$paths"
    --wires=f32,bf16 --append=yes,no --steps="$steps" --warmup=2
    --install_threads=8 --cpus_worker="$cpus_worker"
    --cpus_bench="$cpus_bench")
  step "pool_b$batch" "$b/bin/decode_step_bench" "${common[@]}" --dry_run
  step "decode_b$batch" "$b/bin/decode_step_bench" "${common[@]}" \
    --tsv="$out/decode_b$batch.tsv"
done
cat "$out/summary.txt"
