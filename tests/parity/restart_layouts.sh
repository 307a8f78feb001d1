#!/bin/bash
# A checkpoint taken under FSDP 4 resumes under FSDP 2 (with and without CPU offload), DDP 2 and
# one process (same global batch of 4 samples) with the next-step loss of the uninterrupted FSDP 4 run within 1e-6 relative.
# Why not to the last digit: the step-11 loss is the forward of the same step-10 weights on the
# same samples, but each layout gives a rank 1, 2 or 4 of them, so its GEMMs have other row counts,
# for which oneDNN may choose other blockings (f32 sums in another order; which ones depends on
# the CPU's ISA tier), and the ranks' losses are added in another grouping. Seen: equal on an
# AVX-512 machine, 1.2e-11 apart on another CPU. f32 rounding moves each token's loss by a few
# 1e-7 relative at worst, and their mean no more; weights or a data position read back wrongly
# move it far more (another batch of 4 on the same weights: ~2e-3).
#   restart_layouts.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.dp_shard=4 --checkpoint.dir="$work/ck" --checkpoint.interval=10 \
  --checkpoint.keep=0 --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
status=0
for layout in "2 --parallelism.dp_shard=2 --training.local_batch_size=2" \
  "2 --parallelism.dp_shard=2 --training.local_batch_size=2 --training.enable_cpu_offload=true" \
  "2 --parallelism.dp_replicate=2 --parallelism.dp_shard=1 --training.local_batch_size=2" \
  "1 --training.local_batch_size=4"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "FSDP 4" $layout || status=1
done
exit $status
