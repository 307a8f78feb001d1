#!/bin/bash
# A damaged sharded checkpoint stops a 2-rank resume with an error naming the file (and the
# tensor where there is one), exit non-zero, and nothing written: a missing rank file, a torn
# index, an index that does not match its files, a checkpoint of another model; and a Hugging
# Face directory as model.init_from missing a tensor or holding one of another shape.
#   dcp_errors.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup dcp_errors
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.local_batch_size=2
  --parallelism.dp_shard=2)
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=2 --checkpoint.dir="$work/ck" \
  --checkpoint.interval=2 >"$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
ck=step-00000002
status=0
# expect NAME EDIT PATTERN...: applies EDIT to a copy, resumes, wants a non-zero exit, every
# PATTERN in every rank's error (its log, job.rank_logs), and the directory as it was.
expect() {
  local name=$1 edit=$2
  shift 2
  rm -rf "$work/c"
  cp -r "$work/ck" "$work/c"
  (cd "$work/c/$ck" && eval "$edit")
  local before
  before=$(cd "$work/c" && find . -type f | sort | xargs md5sum)
  rm -rf "$work/logs"
  if "${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=3 --checkpoint.dir="$work/c" \
    --checkpoint.resume=true --job.rank_logs=true --job.dump_dir="$work" "${extra[@]}" \
    >"$work/out.log" 2>&1; then
    echo "$name: the resume succeeded"
    status=1
    return
  fi
  # Every rank's own error names them, not only the first rank's.
  for r in 0 1; do
    for p in "$@"; do
      grep "error:" "$work/logs/rank-$r.log" 2>/dev/null | grep -qF -- "$p" ||
        { echo "$name: rank $r's log has no error with '$p':"; cat "$work/logs/rank-$r.log" "$work/out.log"; status=1; }
    done
  done
  [ "$(cd "$work/c" && find . -type f | sort | xargs md5sum)" = "$before" ] ||
    { echo "$name: the checkpoint directory changed"; status=1; }
  echo "$name: $(grep -m1 'loom train: error' "$work/out.log")"
}
extra=()
expect "missing rank file" "rm rank-00001.safetensors" "$ck/loom.index.json" "rank-00001.safetensors" "missing"
expect "torn index" "head -c 300 loom.index.json > x && mv x loom.index.json" "$ck/loom.index.json" "not valid JSON"
expect "swapped rank files" \
  "mv rank-00000.safetensors x && mv rank-00001.safetensors rank-00000.safetensors && mv x rank-00001.safetensors" \
  "$ck/loom.index.json" "rank-00000.safetensors" "mismatched index"
sed 's/"hidden_size": 64/"hidden_size": 96/' "$src/tests/parity/tp_debug.json" >"$work/wide.json"
extra=(--model.config="$work/wide.json" --checkpoint.allow_config_change=true)
expect "another model" ":" "model.embed_tokens.weight" "[512, 96]" "[512, 64]"

# A Hugging Face directory (the checkpoint exported by `loom convert`) as model.init_from of a
# model it does not fit: a tensor it lacks, a tensor of another shape. Every rank's own log
# (job.rank_logs) names the file or directory and the tensor, the job exits non-zero, nothing is
# written into the directory or the checkpoint.dir.
"$loom" convert "$work/ck/$ck" "$work/hf" >/dev/null
sed 's/"num_hidden_layers": 2/"num_hidden_layers": 3/' "$src/configs/debug.json" >"$work/deep.json"
expect_init() {  # expect_init NAME MODEL_CONFIG PATTERN...
  local name=$1 config=$2
  shift 2
  rm -rf "$work/logs" "$work/fresh"
  local before
  before=$(cd "$work/hf" && find . -type f | sort | xargs md5sum)
  if "${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=2 --model.config="$config" \
    --model.init_from="$work/hf" --checkpoint.dir="$work/fresh" --checkpoint.interval=1 \
    --job.rank_logs=true --job.dump_dir="$work" >"$work/out.log" 2>&1; then
    echo "$name: the run succeeded"
    status=1
    return
  fi
  for r in 0 1; do
    for p in "$@"; do
      grep "error:" "$work/logs/rank-$r.log" 2>/dev/null | grep -qF -- "$p" ||
        { echo "$name: rank $r's log has no error with '$p':"; cat "$work/logs/rank-$r.log" "$work/out.log"; status=1; }
    done
  done
  [ "$(cd "$work/hf" && find . -type f | sort | xargs md5sum)" = "$before" ] ||
    { echo "$name: the Hugging Face directory changed"; status=1; }
  # Nothing saved: the run's lock file (train/run_claim.hpp) is all the directory may hold.
  [ -z "$(ls -A "$work/fresh" 2>/dev/null | grep -vx loom.lock)" ] ||
    { echo "$name: the checkpoint.dir holds: $(ls "$work/fresh")"; status=1; }
  echo "$name: $(grep -m1 'error:' "$work/logs/rank-1.log")"
}
expect_init "Hugging Face dir missing a tensor" "$work/deep.json" "$work/hf" "model.layers.2."
expect_init "Hugging Face dir with a mis-shaped tensor" "$work/wide.json" "$work/hf" \
  "model.embed_tokens.weight" "[512, 96]" "[512, 64]"
exit $status
