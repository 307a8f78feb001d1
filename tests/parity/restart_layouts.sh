#!/bin/bash
# A checkpoint taken under FSDP 4 resumes under FSDP 2, DDP 2 and one process (same global batch
# of 4 samples) with the next-step loss of the uninterrupted FSDP 4 run within 1e-6 relative.
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
parity_setup restart "$src"/docs/design.md "$src"/train/*.cpp
common=(--config "$src/configs/debug.toml" --data.path="$work/data")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.dp_shard=4 --checkpoint.dir="$work/ck" --checkpoint.interval=10 \
  --checkpoint.keep=0 --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(grep '"step": 11,' "$work/full.jsonl" | grep -o '"loss": [0-9.e-]*' | cut -d' ' -f2)
status=0
for layout in "2 --parallelism.dp_shard=2 --training.local_batch_size=2" \
  "2 --parallelism.dp_replicate=2 --parallelism.dp_shard=1 --training.local_batch_size=2" \
  "1 --training.local_batch_size=4"; do
  set -- $layout
  np=$1
  shift
  rm -rf "$work/ck2" "$work/res.jsonl"
  cp -r "$work/ck" "$work/ck2"
  # 11 steps instead of 12 (to stop after the compared step) change the cosine schedule, which
  # the step-11 loss does not depend on: allowed explicitly.
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --training.steps=11 --checkpoint.dir="$work/ck2" \
    --checkpoint.resume=true --checkpoint.allow_config_change=true --metrics.jsonl="$work/res.jsonl" \
    "$@" >"$work/res.log" 2>&1 ||
    { cat "$work/res.log"; exit 1; }
  # Within the tolerance a run that trained from scratch might pass too: it must have resumed.
  grep -q "resumed from .*step-00000010 (step 10)" "$work/res.log" ||
    { echo "np $np $*: did not resume from step 10"; cat "$work/res.log"; exit 1; }
  got=$(grep '"step": 11,' "$work/res.jsonl" | grep -o '"loss": [0-9.e-]*' | cut -d' ' -f2)
  rel=$(awk -v a="$got" -v b="$want" 'BEGIN { d = a - b; if (d < 0) d = -d; print d / b }')
  echo "np $np $*: step 11 loss $got (uninterrupted FSDP 4: $want; relative difference $rel)"
  awk -v r="$rel" 'BEGIN { exit !(r <= 1e-6) }' || status=1
done
exit $status
