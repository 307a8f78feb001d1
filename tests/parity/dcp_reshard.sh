#!/bin/bash
# Sharded checkpoints reshard on load. Saved at step 10 under FSDP 4, TP 2 x FSDP 2 and CP 2 x
# FSDP 2 (global batch of 4 samples each), each resumes under one process, FSDP 2, DDP 2 and TP 4:
# the step-11 loss within 5e-5 (absolute) of the uninterrupted run of the saving layout (TP and CP
# sum in another order, so not to the last digit; another batch on the same weights moves it by
# ~2e-3), which needs every rank's weights, moments and data position read back from the right
# slices of the right files. (That the moments reassemble bit for bit under every layout is
# tests/train/checkpoint_reshard_test.cpp.)
# The FSDP 4 and TP 2 x FSDP 2 runs save with checkpoint.async = true (written by a background
# thread on each rank, completed by rank 0's).
#   dcp_reshard.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup dcp_reshard
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/tp_debug.json" --checkpoint.keep=0)
status=0
for saved in "4 fsdp4 --parallelism.dp_shard=4 --training.local_batch_size=1 --checkpoint.async=true" \
  "4 tp2_fsdp2 --parallelism.tp=2 --parallelism.dp_shard=2 --training.local_batch_size=2 --checkpoint.async=true" \
  "4 cp2_fsdp2 --parallelism.cp=2 --parallelism.dp_shard=2 --training.local_batch_size=2"; do
  set -- $saved
  np=$1 name=$2
  shift 2
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --training.steps=12 "$@" \
    --checkpoint.dir="$work/$name" --checkpoint.interval=10 --metrics.jsonl="$work/$name.jsonl" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  rm -rf "$work/$name/step-00000012"
  ls "$work/$name/step-00000010"/rank-*.safetensors >/dev/null
  want=$(step_loss "$work/$name.jsonl" 11)
  for layout in "1 --training.local_batch_size=4" \
    "2 --parallelism.dp_shard=2 --training.local_batch_size=2" \
    "2 --parallelism.dp_replicate=2 --parallelism.dp_shard=1 --training.local_batch_size=2" \
    "4 --parallelism.tp=4 --training.local_batch_size=4"; do
    resume_step11 "$work/$name" "$want" 5e-5 abs "$name" $layout || status=1
  done
done
exit $status
