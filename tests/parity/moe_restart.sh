#!/bin/bash
# A mixture-of-experts checkpoint saved under expert parallelism 4 (dp_shard 4, each rank holding 2
# of the 8 experts whole) resumes under ep 2 (4 experts per rank), ep 2 x FSDP 4 (the experts
# also sharded), ep 2 x tp 2 and tp 2 (each tp rank holding its slice of the experts), FSDP 2
# without ep and one process, with the next-step loss of the uninterrupted
# run within 1e-6 relative (restart_layouts.sh says why not to the last digit). Each rank's file
# holds its own experts under their global names: the resumed layout reads the slices it holds
# now from whichever files hold them.
#   moe_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup moe_restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/moe_debug.json")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.dp_shard=4 --parallelism.ep=4 --checkpoint.dir="$work/ck" \
  --checkpoint.interval=10 --checkpoint.keep=0 --metrics.jsonl="$work/full.jsonl" \
  >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
status=0
# Micro-batches of one sample everywhere: the auxiliary loss is a function of a micro-batch's
# tokens (transformers' per forward call), so a layout that put two samples in one would add a
# different, equally right, term (seen: 2.9e-6 relative on the step's loss).
for layout in "2 --parallelism.dp_shard=2 --parallelism.ep=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "4 --parallelism.dp_shard=4 --parallelism.ep=2 --training.local_batch_size=1" \
  "2 --parallelism.dp_shard=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "4 --parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.tp=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "2 --parallelism.tp=2 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "1 --training.local_batch_size=1 --training.grad_accum_steps=4"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "ep 4" $layout || status=1
done
exit $status
