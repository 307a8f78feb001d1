#!/usr/bin/env bash
# [metrics] tensorboard with real runs, each directory read back by an independent decoder
# (tensorboard_read.py: Python's crc32c and protobuf, not loom's C++) and compared with the same
# run's metrics.jsonl: one process, and the default under job.dump_dir; a fresh run refused on
# another run's event files, and --metrics.overwrite=true; a directory under a regular file and a
# read-only one refused before step 1; a resume after steps past its checkpoint and a torn last
# record, which keeps each step once; two ranks (FSDP, dp_shard=2), where world rank 0 alone
# writes.
#   tensorboard.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$src/tests/parity/setup.sh"
# Debian's python3-protobuf and python3-crc32c (scripts/deps.sh test): the pyenv python3 that may
# come first on PATH lacks Debian's modules.
py=/usr/bin/python3
"$py" -c "import google.protobuf, crc32c" ||
  fail "$py needs python3-protobuf and python3-crc32c (scripts/deps.sh test)"
command -v protoc >/dev/null || fail "no protoc (protobuf-compiler, scripts/deps.sh build)"
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_tensorboard.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
mpi=("$mpiexec" --oversubscribe --allow-run-as-root)
parity_corpus "$work/corpus.txt"
# A validation split: the validation loss is one of the figures.
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --val-fraction 0.05 --save-tokenizer "$work/data/tokenizer.json" >/dev/null
mkdir "$work/pb"
protoc -I "$src" --python_out="$work/pb" "$src/train/tensorboard_event.proto"
read_tb() { "$py" "$src/tests/train/tensorboard_read.py" "$work/pb" "$@"; }
# debug.toml turns TensorBoard off (it is trained over and over); each run here names its own.
train=("$loom" train --config "$src/configs/debug.toml" --data.path="$work/data"
  --training.steps=6 --validation.interval=3 --validation.steps=2)
run() {  # run LOG ARGS...: a training that must succeed
  local log=$1
  shift
  "$@" >"$log" 2>&1 || { cat "$log"; fail "$* failed"; }
}
config() {  # config FILE ARGS...: the resolved configuration of `loom train ARGS` (TOML)
  local out=$1
  shift
  "$loom" train "$@" --print-config >"$out"
}

echo "== one process: each step and validation as in metrics.jsonl, the config as text"
a=(--metrics.jsonl="$work/a.jsonl" --metrics.tensorboard="$work/tb_a")
run "$work/a.log" "${train[@]}" "${a[@]}"
config "$work/a.toml" "${train[@]:2}" "${a[@]}"
read_tb "$work/tb_a" "$work/a.jsonl" --files 1 --config 0="$work/a.toml"
grep -q '"mfu": 0[,}]' "$work/a.jsonl" && fail "MFU was not measured: the test needs a non-zero one"

echo "== the default: <job.dump_dir>/tensorboard"
grep -v '^tensorboard' "$src/configs/debug.toml" >"$work/debug.toml"
d=(--config "$work/debug.toml" --model.config="$src/configs/debug.json" --data.path="$work/data"
  --training.steps=2 --job.dump_dir="$work/dump" --metrics.jsonl="$work/d.jsonl")
run "$work/d.log" "$loom" train "${d[@]}"
config "$work/d.toml" "${d[@]}"
grep -qxF "tensorboard = \"$work/dump/tensorboard\"" "$work/d.toml" ||
  fail "--print-config: $(grep tensorboard "$work/d.toml")"
read_tb "$work/dump/tensorboard" "$work/d.jsonl" --files 1 --config 0="$work/d.toml"

echo "== a fresh run refuses another run's event files; --metrics.overwrite=true replaces them"
before=$(md5sum "$work"/tb_a/*)
rc=0
"${train[@]}" --training.steps=2 --metrics.tensorboard="$work/tb_a" >"$work/b.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || { cat "$work/b.log"; fail "a fresh run took tb_a"; }
expect_refused "$work/b.log" "metrics.tensorboard '$work/tb_a' already holds 8 events of another run in 1 event file (up to step 6)" \
  "--metrics.overwrite=true"
[ "$(md5sum "$work"/tb_a/*)" = "$before" ] || fail "the refused run changed tb_a"
echo "refused: $(grep -o "metrics.tensorboard '.*already holds[^,]*" "$work/b.log")"
run "$work/b.log" "${train[@]}" --training.steps=2 --metrics.tensorboard="$work/tb_a" \
  --metrics.overwrite=true --metrics.jsonl="$work/b.jsonl"
read_tb "$work/tb_a" "$work/b.jsonl" --files 1

echo "== an unwritable directory, refused before step 1"
echo x >"$work/file"
rc=0
"${train[@]}" --metrics.tensorboard="$work/file/tb" >"$work/e.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || { cat "$work/e.log"; fail "a directory under a regular file was taken"; }
expect_refused "$work/e.log" "metrics.tensorboard '$work/file/tb' cannot be created: Not a directory"
echo "refused: $(grep -o "metrics.tensorboard '$work/file/tb'.*" "$work/e.log")"
mkdir "$work/ro"
chmod 555 "$work/ro"
as_nobody
rc=0
HOME=/tmp "${as_user[@]}" "${train[@]}" --metrics.tensorboard="$work/ro" >"$work/f.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || { cat "$work/f.log"; fail "a read-only directory was taken"; }
expect_refused "$work/f.log" "metrics.tensorboard '$work/ro' is not writable" "Permission denied"
echo "refused: $(grep -o "metrics.tensorboard '$work/ro' is not writable[^(]*" "$work/f.log")"

echo "== a resume: the steps after the checkpoint dropped, a new file, each step once"
ck=(--checkpoint.dir="$work/ck" --checkpoint.interval=3 --metrics.jsonl="$work/r.jsonl"
  --metrics.tensorboard="$work/tb_r")
run "$work/r.log" "${train[@]}" "${ck[@]}"
config "$work/r.toml" "${train[@]:2}" "${ck[@]}"
# As if the run had died after step 6 but before its save, in the middle of an event: steps 4-6
# and the validation at 6 are redone from the checkpoint of step 3.
rm -rf "$work/ck/step-00000006"
printf '\x20\x00\x00\x00\x00' >>"$(ls "$work"/tb_r/*tfevents*)"
run "$work/r2.log" "${train[@]}" "${ck[@]}" --checkpoint.resume=true
config "$work/r2.toml" "${train[@]:2}" "${ck[@]}" --checkpoint.resume=true
grep -q "resumed from .*step-00000003 (step 3)" "$work/r2.log" || { cat "$work/r2.log"; fail "no resume"; }
read_tb "$work/tb_r" "$work/r.jsonl" --files 2 --start 4 --config 0="$work/r.toml" \
  --config 4="$work/r2.toml"

echo "== two ranks (FSDP, dp_shard=2): world rank 0 alone writes"
# One file with each step once, equal to rank 0's metrics.jsonl: rank 1 measures no GEMM peak (its
# MFU would be 0) and times its own steps.
m=(--parallelism.dp_shard=2 --metrics.jsonl="$work/m.jsonl" --metrics.tensorboard="$work/tb_m")
run "$work/m.log" "${mpi[@]}" -np 2 "${train[@]}" "${m[@]}"
config "$work/m.toml" "${train[@]:2}" "${m[@]}"
read_tb "$work/tb_m" "$work/m.jsonl" --files 1 --config 0="$work/m.toml"
echo "all TensorBoard checks held"
