#!/bin/bash
# Distributed checkpoint benchmark (issue 13; docs/decisions/distributed-checkpoints.md). The real
# `loom train` on bench/ckpt-316m.json (Llama, dim 1024, 24 layers, ffn 2816, 16 heads, vocab
# 4096: 316,720,128 parameters), float32, one sample of 16 tokens per rank and step so that the
# compute is small. FSDP over NPS ranks (oversubscribed on a small machine: one OpenMP thread per
# rank, passive waits):
#   - a synchronous save at step 1, then a resume that verifies it (each file against its
#     checksum, the ranks sharing the reads; VERIFY=false: not) and loads it: per rank the
#     verification's wall time apart, and the load's wall time, the bytes
#     it held before (its shards of weights, gradients and moments and its working buffers), its
#     shards of the checkpoint (f32 weights + 2 moments) and the allocator's peak during the save
#     (load) over what it held before, against the bound: 64 KiB for the ranks' agreements (the
#     file is written from views of the shards; the load reads into them);
#   - under FSDP ASYNC_NP, 4 steps saving at steps 2 and 4, synchronously and asynchronously: the
#     training stall of each async save (the training thread's time in the save, the agreement,
#     plus its time in before_modify before the next optimizer update, the copy of what the
#     writer had not written by then; the wait for the previous save's write is printed apart,
#     "waited") against the synchronous save's wall time, at most 10% for each (the trainer
#     allocates the staging buffer at start and a thread faults its pages in while the first
#     steps run), and the peak over held (which includes that buffer) against the staging copy +
#     64 KiB.
# ASYNC_NP=0 skips the async part.
# Exits non-zero when a rank breaks its bound, or the stall is over 10% of the synchronous save.
# Each checkpoint is 12 bytes x 316.7M = 3.8 GB on disk, removed once measured; the ranks
# together need about 16 bytes per parameter (5.1 GB) of memory, 8.9 GB with the async staging.
#   [NPS="1 2 4 8"] [ASYNC_NP=4] [VERIFY=true] [MODEL=config.json] [TMPDIR=DIR] \
#     bench/ckpt_bench.sh [BUILD_DIR]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$src/build}
loom=$build/loom
nps=${NPS:-1 2 4 8} async_np=${ASYNC_NP:-4} verify=${VERIFY:-true}
model=${MODEL:-$src/bench/ckpt-316m.json}
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_ckpt_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive

"$loom" info | grep -E '^ +(cpu |kernels|oneDNN|bf16)'
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg) ($(getconf _NPROCESSORS_ONLN) cores)"
params=$(awk '{gsub(/[",:]/, " ")} $1 == "hidden_size" {d = $2} $1 == "intermediate_size" {f = $2}
  $1 == "num_hidden_layers" {l = $2} $1 == "vocab_size" {v = $2}
  $1 == "num_attention_heads" {h = $2} $1 == "num_key_value_heads" {k = $2}
  END {kv = d / h * k; printf "%d", l * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d}' \
  "$model")
echo "model $model: $params parameters (counted from its config.json); checkpoint $((params * 12)) bytes"

cat "$src"/docs/*.md "$src"/docs/decisions/*.md "$src"/train/*.cpp >"$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null

train() {  # train NAME NP ARGS...: loom train under FSDP NP; rank logs in $work/NAME/logs
  local name=$1 np=$2
  shift 2
  local cmd=("$loom" train --config "$src/configs/debug.toml" --data.path="$work/data"
    --model.config="$model" --training.seq_len=16 --training.local_batch_size=1
    --training.mixed_precision_param=float32 --job.rank_logs=true --job.dump_dir="$work/$name"
    --checkpoint.keep=1 "$@")
  if [ "$np" = 1 ]; then
    "${cmd[@]}" >"$work/$name.out" 2>&1 || { cat "$work/$name.out"; exit 1; }
  else
    mpirun --oversubscribe --allow-run-as-root -np "$np" "${cmd[@]}" --parallelism.dp_shard="$np" \
      >"$work/$name.out" 2>&1 || { cat "$work/$name.out"; exit 1; }
  fi
  grep -q "$params parameters" "$work/$name.out" ||
    { echo "$name: the model is not the one counted"; cat "$work/$name.out"; exit 1; }
}

status=0
# table NAME KIND [STEP]: the per-rank "checkpoint stats: KIND" lines of run NAME (of the save of
# STEP), each against its bound; sets $wall to the slowest rank's seconds.
table() {
  local name=$1 kind=$2 at=${3:+step $3 | } out
  out=$(cat "$work/$1"/logs/rank-*.log | grep -F "${at}checkpoint stats: $kind " |
    grep -o "checkpoint stats: $kind .*" |
    awk '{for (i = 4; i <= NF; ++i) {split($i, kv, "="); v[kv[1]] = kv[2]}
      ok = v["extra_peak_bytes"] <= v["bound_extra_bytes"]
      printf "  %4d %9.3f %12.1f %12.1f %14.1f %14.1f  %s\n", v["rank"], v["seconds"],
        v["held_bytes"] / 2^20, v["shard_bytes"] / 2^20, v["extra_peak_bytes"] / 2^10,
        v["bound_extra_bytes"] / 2^10, ok ? "ok" : "OVER THE BOUND"}' | sort -n)
  [ -n "$out" ] || { echo "$name: no '$kind' figures in the rank logs"; status=1; wall=0; return; }
  printf "  %4s %9s %12s %12s %14s %14s\n" rank seconds "held MiB" "shards MiB" "peak+ KiB" \
    "bound+ KiB"
  echo "$out"
  grep -q "OVER" <<<"$out" && status=1
  wall=$(awk 'NR == 1 || $2 > m {m = $2} END {print m}' <<<"$out")
}

declare -A save_s load_s verify_s
for np in $nps; do
  echo "== FSDP $np: synchronous save of step 1 (load average $(cut -d' ' -f1 /proc/loadavg))"
  train "save$np" "$np" --training.steps=1 --checkpoint.dir="$work/ck$np"
  table "save$np" save
  save_s[$np]=$wall
  echo "== FSDP $np: resume, loading it (load average $(cut -d' ' -f1 /proc/loadavg))"
  train "load$np" "$np" --training.steps=1 --checkpoint.dir="$work/ck$np" --checkpoint.resume=true \
    --checkpoint.verify="$verify"
  grep -q "resumed from .*step-00000001" "$work/load$np.out" ||
    { echo "did not resume"; cat "$work/load$np.out"; exit 1; }
  verify_s[$np]=0
  if [ "$verify" = true ]; then
    echo " verification (every file against its checksum, the ranks sharing the reads):"
    table "load$np" verify
    verify_s[$np]=$wall
  fi
  echo " load:"
  table "load$np" load
  load_s[$np]=$wall
  rm -rf "$work/ck$np"
done

# The stall: the same run under FSDP ASYNC_NP, saving at steps 2 and 4, synchronously and with
# checkpoint.async (the second async save waits for the first one's write if it is not done:
# printed apart, "waited").
declare -A stall sync
for mode in $([ "$async_np" = 0 ] || echo sync async); do
  echo "== FSDP $async_np: $mode saves at steps 2 and 4 (load average $(cut -d' ' -f1 /proc/loadavg))"
  train "$mode$async_np" "$async_np" --training.steps=4 --checkpoint.interval=2 \
    --checkpoint.dir="$work/ck_$mode" --checkpoint.async=$([ $mode = async ] && echo true || echo false)
  for st in 2 4; do
    echo " save of step $st:"
    table "$mode$async_np" "$([ $mode = async ] && echo save_async || echo save)" "$st"
    [ $mode = async ] && stall[$st]=$wall || sync[$st]=$wall
  done
  grep -ao "step [0-9]*/[0-9]* [^[:cntrl:]]*" "$work/$mode$async_np.out" | sed 's/^/  /' || true
  grep -ao "step [0-9]* | [0-9.]* s stall: [^[:cntrl:]]*" "$work/$mode$async_np.out" |
    sed 's/^/  /' || true
  grep -ao "saved [^ ]* (waited [0-9.]* s for it)" "$work/$mode$async_np.out" |
    sed 's/^/  background write: /' || true
  rm -rf "$work/ck_$mode"
done

echo "== summary ($((params * 12)) bytes per checkpoint; load average $(cut -d' ' -f1-3 /proc/loadavg))"
printf "  %5s %10s %10s %10s %12s %12s\n" ranks save_s verify_s load_s "save MB/s" "load MB/s"
for np in $nps; do
  awk -v n="$np" -v s="${save_s[$np]}" -v v="${verify_s[$np]}" -v l="${load_s[$np]}" \
    -v b="$((params * 12))" 'BEGIN {printf "  %5d %10.2f %10.2f %10.2f %12.0f %12.0f\n", n, s, v, l,
      s ? b / s / 1e6 : 0, l ? b / l / 1e6 : 0}'
done
[ "$async_np" = 0 ] && exit $status
for st in 2 4; do
  ratio=$(awk -v a="${stall[$st]}" -v s="${sync[$st]}" 'BEGIN {printf "%.4f", s ? a / s : 99}')
  echo "  FSDP $async_np, save of step $st: async stall ${stall[$st]} s, synchronous save ${sync[$st]} s:" \
    "$(awk -v r="$ratio" 'BEGIN {printf "%.1f%%", 100 * r}') (bound 10%)"
  if ! awk -v r="$ratio" 'BEGIN {exit !(r <= 0.10)}'; then
    echo "  OVER THE BOUND"
    status=1
  fi
done
exit $status
