#!/bin/bash
# A training run on the GPU against the same run on the CPU (issue "loom on NVIDIA GPUs (1 of 2)"):
#   gpu_step_parity.sh LOOM COMPARE SOURCE_DIR NAME TOLERANCE [--key=value ...]
# Trains the debug model (or the one the overrides name) for 20 steps with --training.device=cpu
# and with --training.device=cuda, the same initialization (the GPU's weights are drawn by the
# CPU's Philox) and tokens, and compares per-step losses and final weights with parity_compare
# (float32: 1e-5; bf16: the loss within TOLERANCE). Then a checkpoint the GPU run saved at step
# 10 resumes on the CPU, and the CPU run's step-10 checkpoint on the GPU, each with the step-11
# loss within 1e-5 relative of the uninterrupted run's.
# Without a usable GPU it exits 77 (ctest's SKIP_RETURN_CODE), unless LOOM_REQUIRE_GPU=1.
# LOOM_PARITY_DATA: a tokenized parity corpus to use (the GPU machine has no bible-kjv;
# scripts/device_prepare.sh carries one), else it is made here.
set -euo pipefail
loom=$1 compare=$2 src=$3 name=$4 tol=$5
shift 5
if ! "$loom" info --peak-seconds 0 | grep -q "^  gpu           0: "; then
  reason=$("$loom" info --peak-seconds 0 | grep "^  gpu  " || true)
  if [ "${LOOM_REQUIRE_GPU:-0}" = 1 ]; then
    echo "LOOM_REQUIRE_GPU=1 but no GPU: $reason"
    exit 1
  fi
  echo "skipped: no GPU ($reason)"
  exit 77
fi
source "$src/tests/parity/setup.sh"
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_gpu_${name}.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -n "${LOOM_PARITY_DATA:-}" ]; then
  data=$LOOM_PARITY_DATA
else
  parity_corpus "$work/corpus.txt"
  "$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
    --save-tokenizer "$work/tok.json" >/dev/null
  data=$work/data
fi
common=(--config "$src/configs/debug.toml" --peak-seconds 0 --data.path="$data" --training.steps=20
  --training.local_batch_size=4 --checkpoint.interval=10 --checkpoint.keep=0 "$@")
for dev in cpu cuda; do
  "$loom" train "${common[@]}" --training.device="$dev" --metrics.jsonl="$work/$dev.jsonl" \
    --checkpoint.dir="$work/$dev" >"$work/$dev.log" 2>&1 || { cat "$work/$dev.log"; exit 1; }
done
grep -m1 -i "device\|gpu" "$work/cuda.log" || true
status=0
"$compare" "$work/cpu.jsonl" "$work/cpu/step-00000020" "$work/cuda.jsonl" \
  "$work/cuda/step-00000020" "$tol" || status=1

# Across devices: each run's step-10 checkpoint resumed on the other device for step 11.
# resume_step11 (setup.sh) runs "${mpi[@]}" -np N LOOM ...: here one process, without mpirun.
# shellcheck disable=SC2317  # called through "${mpi[@]}"
resume_one() { shift 2; "$@"; }
mpi=(resume_one)
resume_args=("${common[@]}")
for pair in "cuda cpu" "cpu cuda"; do
  read -r from to <<<"$pair"
  rm -rf "$work/$from/step-00000020"
  want=$(step_loss "$work/$from.jsonl" 11)
  common=("${resume_args[@]}" --training.device="$to")
  resume_step11 "$work/$from" "$want" 1e-5 rel "$from run" 1 || status=1
done
exit $status
