#!/bin/bash
# Validation under pipeline parallelism (a forward-only schedule, the loss on the last stage summed
# over pp): the validation losses of steps 3 and 6 against the run without pp over the same
# batches. pp alone trains bit for bit like one process with grad_accum_steps = pp_microbatches,
# so its validation losses must be equal to the last bit (1f1b on 2 ranks, interleaved with two
# stages per rank); pp2 x tp2 within 1e-6 relative (tp sums in another order); pp2 x fsdp2 against
# fsdp2 (the same dp layout, so the same validation batches) within 1e-6, per micro-batch and
# with pp_fsdp_gather = "step"; a mixture of experts under pp 2 to the last bit.
#   pp_validation.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup pp_validation
"$loom" tokenize --input "$work/corpus.txt" --output "$work/vdata" --tokenizer "$work/tok.json" \
  --val-fraction 0.2 >/dev/null
common=(--config "$src/configs/debug.toml" --data.path="$work/vdata" --training.steps=6
  --model.config="$src/tests/parity/pp_debug.json" --training.local_batch_size=2
  --validation.interval=3 --validation.steps=3 --checkpoint.interval=0)

# val_losses METRICS: "step=loss" per validation line.
val_losses() { grep -o '"step": [0-9]*, "val_loss": [^}]*' "$1" | sed 's/"step": //; s/, "val_loss": /=/'; }

run() {  # run NAME NP ARGS...
  local name=$1 np=$2
  shift 2
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --checkpoint.dir="$work/$name" \
    --metrics.jsonl="$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; return 1; }
}

compare() {  # compare REF RUN TOL: every validation loss of RUN within TOL (relative) of REF's
  local ref got
  ref=$(val_losses "$work/$1.jsonl")
  got=$(val_losses "$work/$2.jsonl")
  echo "$1: $(echo $ref) | $2: $(echo $got)"
  [ "$(echo "$ref" | wc -l)" = 2 ] || { echo "$1: expected 2 validation losses"; return 1; }
  paste -d' ' <(echo "$ref") <(echo "$got") | awk -v t="$3" -v n="$2" '{
    split($1, a, "="); split($2, b, "=");
    if (a[1] != b[1]) { print n ": step " b[1] " where the reference has " a[1]; bad = 1; next }
    d = a[2] - b[2]; if (d < 0) d = -d; d /= a[2];
    if (t == 0 ? a[2] != b[2] : d > t) { print n ": step " a[1] " val_loss " b[2] " vs " a[2]; bad = 1 }
  } END { exit bad }'
}

status=0
run ref 1 --training.grad_accum_steps=4
run pp2 2 --parallelism.pp=2 --parallelism.pp_microbatches=4
compare ref pp2 0 || status=1
run pp2_interleaved 2 --parallelism.pp=2 --parallelism.pp_microbatches=4 \
  --parallelism.pp_schedule=interleaved_1f1b
compare ref pp2_interleaved 0 || status=1
run pp2_tp2 4 --parallelism.pp=2 --parallelism.tp=2 --parallelism.pp_microbatches=4
compare ref pp2_tp2 1e-6 || status=1
run fsdp2 2 --parallelism.dp_shard=2 --training.grad_accum_steps=4
run pp2_fsdp2 4 --parallelism.pp=2 --parallelism.dp_shard=2 --parallelism.pp_microbatches=4
compare fsdp2 pp2_fsdp2 1e-6 || status=1
# Step mode keeps the units gathered through a step; validation releases them after its forwards.
run pp2_fsdp2_step 4 --parallelism.pp=2 --parallelism.dp_shard=2 --parallelism.pp_microbatches=4 \
  --parallelism.pp_fsdp_gather=step
compare fsdp2 pp2_fsdp2_step 1e-6 || status=1
# A mixture of experts: the forward-only schedule carries the router statistics to the head too
# (its validation loss has the auxiliary term), bit for bit.
moe=--model.config="$src/tests/parity/moe_debug.json"
run moe_ref 1 --training.grad_accum_steps=4 "$moe"
run moe_pp2 2 --parallelism.pp=2 --parallelism.pp_microbatches=4 "$moe"
grep -q "qwen3_moe" "$work/moe_pp2.log" || { echo "moe_pp2: not the mixture of experts"; status=1; }
compare moe_ref moe_pp2 0 || status=1
exit $status
