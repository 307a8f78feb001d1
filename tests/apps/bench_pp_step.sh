#!/usr/bin/env bash
# `loom bench step` times the trainer's step under pipeline parallelism: grad_accum_steps runs of
# the schedule's pp_microbatches (8 micro-batches here), as `loom train` and `loom plan` count it.
# usage: bench_pp_step.sh LOOM MPIEXEC SRC
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_bench_pp.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
keys=(--parallelism.pp=2 --parallelism.pp_microbatches=4 --training.grad_accum_steps=2
  --training.local_batch_size=1 --training.seq_len=64)
"$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$loom" bench step \
  --config "$src/configs/bench-tiny.toml" --bench.warmup_steps=1 --bench.steps=1 "${keys[@]}" \
  >"$work/bench.txt" 2>&1 || { cat "$work/bench.txt"; echo "FAIL: bench step exited non-zero"; exit 1; }
cat "$work/bench.txt"
"$loom" plan --config "$src/configs/bench-tiny.toml" --world 2 "${keys[@]}" --json >"$work/plan.json"
planned=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["micro_batches"])' "$work/plan.json")
timed=$(sed -nE 's/.*local batch ([0-9]+) x .*/\1/p' "$work/bench.txt" | head -1)
[ "$planned" = 8 ] || { echo "FAIL: the plan counts $planned micro-batches, expected 2 x 4 = 8"; exit 1; }
[ "$timed" = "$planned" ] ||
  { echo "FAIL: the bench timed ${timed:-no} micro-batches a step, the trainer's step has $planned"; exit 1; }
echo "bench step timed the trainer's step: $timed micro-batches"
