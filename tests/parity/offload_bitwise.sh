#!/bin/bash
# CPU offload changes where the states live, not what is computed: the same layout trained with
# and without training.enable_cpu_offload gives the same losses, gradient norms and final weights,
# every bit (the same kernels on the same values, in the same order).
#   offload_bitwise.sh LOOM MPIEXEC COMPARE SOURCE_DIR NP [--key=value ...]
set -euo pipefail
loom=$1 mpiexec=$2 compare=$3 src=$4 np=$5
shift 5
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_offload.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

source "$src/tests/parity/setup.sh"
parity_corpus "$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null

common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=10
  --training.local_batch_size=4 --checkpoint.interval=0 "$@")
for off in false true; do
  "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "$loom" train "${common[@]}" \
    --training.enable_cpu_offload=$off --metrics.jsonl="$work/$off.jsonl" \
    --checkpoint.dir="$work/$off" >"$work/$off.log" 2>&1 || { cat "$work/$off.log"; exit 1; }
done
grep -m1 "CPU offload" "$work/true.log" || { echo "the offload run does not say it offloads"; exit 1; }
"$compare" "$work/false.jsonl" "$work/false/step-00000010" "$work/true.jsonl" \
  "$work/true/step-00000010" 0
