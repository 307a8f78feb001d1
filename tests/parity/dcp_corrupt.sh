#!/bin/bash
# Corruption under two ranks (FSDP 2): one byte flipped in rank 1's file of the latest checkpoint
# (step 4; step 2 beside it). A resume stops on every rank with an error naming the file, both
# checksums and the previous complete checkpoint, exit non-zero and the directory unchanged; with
# --checkpoint.fallback=true both ranks skip it with a note and resume from step 2, with the
# losses of a resume where step 2 is the latest; resharded to one process, the same.
#   dcp_corrupt.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup dcp_corrupt
# decay_type none: a run of 4 steps and its resume to 6 follow the same schedule.
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.local_batch_size=2
  --lr_scheduler.decay_type=none --checkpoint.interval=2)
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --parallelism.dp_shard=2 --training.steps=4 \
  --checkpoint.dir="$work/ck" >"$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
f=step-00000004/rank-00001.safetensors
size=$(stat -c %s "$work/ck/$f")
byte=$(od -An -tu1 -j $((size - 4)) -N1 "$work/ck/$f" | tr -d ' ')
printf "\\x$(printf %02x $((byte ^ 255)))" |
  dd of="$work/ck/$f" bs=1 seek=$((size - 4)) conv=notrunc status=none
cp -r "$work/ck" "$work/ck_ref"
rm -rf "$work/ck_ref/step-00000004"
status=0

# resume NAME DIR NP ARGS...: a copy of DIR resumed to step 6 with NP ranks; its output in
# $work/NAME.log, rank logs in $work/NAME/logs, losses in $work/NAME.jsonl; returns its status.
resume() {
  local name=$1 dir=$2 np=$3
  shift 3
  rm -rf "$work/$name" "$work/$name.ck" "$work/$name.jsonl"
  cp -r "$dir" "$work/$name.ck"
  # One process takes both ranks' samples: the same global batch.
  local layout=(--training.local_batch_size=4)
  [ "$np" = 1 ] || layout=(--parallelism.dp_shard="$np")
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" "${layout[@]}" --training.steps=6 \
    --checkpoint.dir="$work/$name.ck" --checkpoint.resume=true --job.rank_logs=true \
    --job.dump_dir="$work/$name" --metrics.jsonl="$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1
}
want() {  # want NAME FILE PATTERN...: every PATTERN in FILE
  local name=$1 file=$2
  shift 2
  for p in "$@"; do
    grep -qF -- "$p" "$file" 2>/dev/null ||
      { echo "$name: no '$p' in $file:"; cat "$file" "$work/$name.log"; status=1; }
  done
}
same_losses() {  # same_losses NAME REF: steps 3..6 of NAME's metrics equal REF's, digit for digit
  for s in 3 4 5 6; do
    local a b
    a=$(step_loss "$work/$1.jsonl" $s) b=$(step_loss "$work/$2.jsonl" $s)
    [ -n "$a" ] && [ "$a" = "$b" ] ||
      { echo "$1: step $s loss '$a', resumed from step 2 as the latest: '$b'"; status=1; }
  done
  echo "$1: steps 3-6 losses $(for s in 3 4 5 6; do step_loss "$work/$1.jsonl" $s; done | tr '\n' ' ')(= $2's)"
}

ck4="$work/stop.ck/step-00000004"
before=$(cd "$work/ck" && find . -type f | sort | xargs md5sum)
if resume stop "$work/ck" 2; then
  echo "stop: the resume of a corrupt checkpoint succeeded"
  status=1
fi
for r in 0 1; do
  want stop "$work/stop/logs/rank-$r.log" "$ck4/rank-00001.safetensors" "checksum mismatch" \
    "expected xxh3-64:" "found xxh3-64:" \
    "the previous complete checkpoint is $work/stop.ck/step-00000002" "--checkpoint.fallback=true"
done
[ "$(cd "$work/stop.ck" && find . -type f | sort | xargs md5sum)" = "$before" ] ||
  { echo "stop: the checkpoint directory changed"; status=1; }
echo "stop: $(grep -m1 'error:' "$work/stop/logs/rank-1.log")"

resume ref "$work/ck_ref" 2 || { cat "$work/ref.log"; exit 1; }
want ref "$work/ref/logs/rank-0.log" "resumed from $work/ref.ck/step-00000002 (step 2)"
resume fallback "$work/ck" 2 --checkpoint.fallback=true || { cat "$work/fallback.log"; exit 1; }
for r in 0 1; do
  want fallback "$work/fallback/logs/rank-$r.log" \
    "skipping checkpoint $work/fallback.ck/step-00000004" "rank-00001.safetensors" \
    "resumed from $work/fallback.ck/step-00000002 (step 2)"
done
same_losses fallback ref

# Resharded: one process reads both ranks' files.
resume ref1 "$work/ck_ref" 1 || { cat "$work/ref1.log"; exit 1; }
want ref1 "$work/ref1/logs/rank-0.log" "resumed from $work/ref1.ck/step-00000002 (step 2)"
resume fallback1 "$work/ck" 1 --checkpoint.fallback=true || { cat "$work/fallback1.log"; exit 1; }
want fallback1 "$work/fallback1/logs/rank-0.log" \
  "skipping checkpoint $work/fallback1.ck/step-00000004" \
  "resumed from $work/fallback1.ck/step-00000002 (step 2)"
same_losses fallback1 ref1
exit $status
