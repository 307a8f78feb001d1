#!/bin/bash
# Pipeline benchmark (issue 14): for (p, m) in (2,4) (2,8) (4,8) (4,16) (8,16) and each schedule
# (gpipe, 1f1b, interleaved_1f1b with 2 and 4 stages per rank where the 16-layer model has a
# block for every stage, zb1p, zbv), a short pp job (bench/pp-16l.json: dim 128, ffn
# 384, 16 layers; one sample of 64 tokens per micro-batch) writes Chrome traces ([profiling]
# trace); bench/pp_trace replays each action's mean CPU time (steps after the first) through the
# simulator and prints the bubble next to the closed form, and each rank's point-to-point bytes
# of a step next to the analytic figure (exit non-zero when they differ). CPU times, not wall
# times: 8 ranks sharing 2 cores would measure the OS scheduler, not the schedule.
#   bench/pp_bench.sh [--smoke] [LOOM [PP_TRACE]]
# --smoke: (2, 4) only, 3 steps (the pipeline_bench_smoke test).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
smoke=0
if [ "${1:-}" = --smoke ]; then smoke=1; shift; fi
loom=${1:-$here/build/loom}
pp_trace=${2:-$here/build/bench/pp_trace}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_pp_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc --all) cores" \
  "($(nproc) available to this process); $("$loom" info --peak-seconds 0 2>/dev/null | grep -m1 kernels | sed "s/^ *//; s/  */ /g");" \
  "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
cat "$here"/docs/design.md "$here"/train/*.cpp >"$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null

layers=16 dim=128 B=1 T=64
steps=4 cases="2,4 2,8 4,8 4,16 8,16"
[ $smoke = 1 ] && steps=3 cases="2,4"
bytes=$((B * T * dim * 4))  # one activation or gradient message, f32
status=0
for c in $cases; do
  p=${c%,*} m=${c#*,}
  for sv in gpipe:1 1f1b:1 interleaved_1f1b:2 interleaved_1f1b:4 zb1p:1 zbv:2; do
    s=${sv%:*} v=${sv#*:}
    if [ $((p * v)) -gt $layers ]; then
      echo "$s p $p v $v m $m: not run ($((p * v)) stages, $layers blocks)"
      continue
    fi
    dir="$work/$s-$p-$v-$m"
    mpirun --oversubscribe --allow-run-as-root -np "$p" "$loom" train \
      --config "$here/configs/debug.toml" --model.config="$here/bench/pp-16l.json" \
      --data.path="$work/data" --training.steps=$steps --training.local_batch_size=$B \
      --training.seq_len=$T --checkpoint.interval=0 --validation.interval=0 \
      --parallelism.pp="$p" --parallelism.pp_microbatches="$m" --parallelism.pp_schedule="$s" \
      --parallelism.pp_stages_per_rank="$v" --profiling.trace="$dir" >"$work/run.log" 2>&1 ||
      { cat "$work/run.log"; exit 1; }
    "$pp_trace" replay "$dir" "$s" "$p" "$v" "$m" "$bytes" || status=1
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
