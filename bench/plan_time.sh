#!/bin/bash
# The planner's time model on this machine: `loom plan --hardware cpu-local` (calibrated by
# `loom plan calibrate`) against `loom bench step` for 1, 2, 4 and 8 ranks under FSDP, TP, CP and
# PP on bench-tiny, one OpenMP thread per rank (4 and 8 ranks share the 2 cores: the plan is told
# --oversubscribed). Prints predicted and measured step times (the bench's median over the timed
# steps of rank 0, the slowest role for pp) and exits non-zero when one is more than
# TOLERANCE (default 0.15) off.
#   bench/plan_time.sh [LOOM] [TOLERANCE]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
loom=${1:-$src/build/loom}
tol=${2:-0.15}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
config="$src/configs/bench-tiny.toml"
pp=(--parallelism.pp_microbatches=4 --training.local_batch_size=2)
cases=(
  "1 single"
  "2 fsdp2 --parallelism.dp_shard=2"
  "2 tp2 --parallelism.tp=2 --parallelism.dp_shard=1"
  "2 cp2 --parallelism.cp=2 --parallelism.dp_shard=1"
  "2 pp2 --parallelism.pp=2 --parallelism.dp_shard=1 ${pp[*]}"
  "4 fsdp4 --parallelism.dp_shard=4"
  "4 fsdp2_tp2 --parallelism.dp_shard=2 --parallelism.tp=2"
  "4 fsdp2_cp2 --parallelism.dp_shard=2 --parallelism.cp=2"
  "4 pp2_fsdp2 --parallelism.pp=2 --parallelism.dp_shard=2 ${pp[*]}"
  "8 fsdp8 --parallelism.dp_shard=8"
  "8 fsdp4_tp2 --parallelism.dp_shard=4 --parallelism.tp=2"
  "8 fsdp4_cp2 --parallelism.dp_shard=4 --parallelism.cp=2"
  "8 pp2_fsdp4 --parallelism.pp=2 --parallelism.dp_shard=4 ${pp[*]}"
)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-12s %5s %12s %12s %8s\n" layout ranks "plan ms" "bench ms" ratio
fail=0
for c in "${cases[@]}"; do
  read -r np name args <<<"$c"
  # shellcheck disable=SC2086
  plan=$("$loom" plan --config "$config" --world "$np" $args --ranks 0 --json \
    $([ "$np" -gt 2 ] && echo --oversubscribed))
  pred=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ranks"][0]["time"]["step_s"])' "$plan")
  bench=("$loom" bench step --config "$config" --bench.warmup_steps=1 --bench.steps=3)
  # shellcheck disable=SC2086
  if [ "$np" -gt 1 ]; then
    out=$(mpirun --oversubscribe --allow-run-as-root -np "$np" "${bench[@]}" $args --json </dev/null 2>&1)
    real=$(echo "$out" | grep '^{' | tail -1 | python3 -c 'import json,sys; print(max(r["step_s"] for r in json.load(sys.stdin)["ranks"]))')
  else
    real=$("${bench[@]}" --json </dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["step_s"])')
  fi
  ratio=$(python3 -c "print(f'{$pred / $real:.3f}')")
  flag=$(python3 -c "print('' if abs($pred / $real - 1) <= $tol else '  OFF')")
  [ -n "$flag" ] && fail=1
  printf "%-12s %5s %12.1f %12.1f %8s%s\n" "$name" "$np" "$(python3 -c "print($pred*1e3)")" \
    "$(python3 -c "print($real*1e3)")" "$ratio" "$flag"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $fail
