#!/bin/bash
# TP benchmark (issue 5): `loom bench step` on an 8- and a 16-layer model (bench/tp-*l.json: heads
# 8, kv heads 4, ffn 768, vocab 4096, dim 256), local batch 4 x 128, for TP 1/2/4 with and without
# sequence parallelism and both tp_recompute_allgather values. Each table prints per rank the
# peak allocated bytes and the bytes sent per step, each against the rank's step on the meta
# device (whose peak is printed by use: states, optimizer, gathered, communication, loss, work).
#   bench/tp_bench.sh [LOOM] [extra --section.key=value ...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
loom=${1:-$here/build/loom}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive
common=(--config "$here/configs/bench-tiny.toml" --training.local_batch_size=4 --training.seq_len=128)
for layers in 8 16; do
  model=--model.config="$here/bench/tp-${layers}l.json"
  echo "== $layers layers, TP 1"
  "$loom" bench step "${common[@]}" "$model" "$@"
  for tp in 2 4; do
    for sp in false true; do
      for rc in false true; do
        [ "$sp" = false ] && [ "$rc" = true ] && continue  # recompute applies to SP only
        echo "== $layers layers, TP $tp, sequence_parallel $sp, recompute_allgather $rc"
        mpirun --oversubscribe --allow-run-as-root -np "$tp" "$loom" bench step "${common[@]}" \
          "$model" --parallelism.dp_shard=1 --parallelism.tp="$tp" \
          --parallelism.tp_sequence_parallel="$sp" --parallelism.tp_recompute_allgather="$rc" "$@"
      done
    done
  done
done
