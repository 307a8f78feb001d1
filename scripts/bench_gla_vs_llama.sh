#!/bin/bash
# GLA against loom's own Llama of the same width and depth (configs/gla-default.json and
# configs/default.json: dim 288, 6 layers, 6 heads, ffn 768, vocabulary 4096), one `loom bench
# step` each per sequence length at a fixed number of tokens per step, as a markdown table of
# tokens/s, MFU and peak memory:
#   scripts/bench_gla_vs_llama.sh [LOOM] [--key=value ...]
# LOOM defaults to build/loom. BENCH_SEQS (default "256 1024 4096 16384") and BENCH_TOKENS
# (tokens per step, default 16384; local_batch_size = BENCH_TOKENS / seq_len, at least 1) choose
# the shapes; other arguments go to every `loom bench step` (e.g.
# --training.mixed_precision_param=bfloat16, --bench.steps=3). Run it on an otherwise idle
# machine: the figures are timings.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
loom=${1:-$here/build/loom}
[ $# -gt 0 ] && shift
seqs=${BENCH_SEQS:-256 1024 4096 16384}
tokens=${BENCH_TOKENS:-16384}
[ -x "$loom" ] || { echo "bench_gla_vs_llama: no loom binary at $loom" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT

echo "| model | seq_len | batch | tokens/s | MFU | peak MiB |"
echo "|---|---|---|---|---|---|"
for seq in $seqs; do
  batch=$((tokens / seq))
  [ "$batch" -ge 1 ] || batch=1
  for model in default gla-default; do
    "$loom" bench step --config "$here/configs/bench-tiny.toml" \
      --model.config="$here/configs/$model.json" --training.seq_len="$seq" \
      --training.local_batch_size="$batch" "$@" >"$out" 2>&1 ||
      { cat "$out" >&2; echo "bench_gla_vs_llama: $model at seq_len $seq failed" >&2; exit 1; }
    tps=$(awk '/^  tokens\/s /{print $2}' "$out")
    mfu=$(awk '/^  MFU /{print $2}' "$out")
    peak=$(awk '/^  peak allocated /{print $3}' "$out")
    [ -n "$tps" ] && [ -n "$mfu" ] && [ -n "$peak" ] ||
      { cat "$out" >&2; echo "bench_gla_vs_llama: no figures in the output of $model at $seq" >&2; exit 1; }
    name=$model; [ "$model" = default ] && name=llama; [ "$model" = gla-default ] && name=gla
    echo "| $name | $seq | $batch | $tps | $mfu | $peak |"
  done
done
