#!/bin/bash
# FSDP benchmark (issue 4): `loom bench step` on configs/bench-tiny.toml under FSDP with 1, 2, 4
# and 8 ranks (oversubscribed on a small machine: one OpenMP thread per rank, passive waits).
# Prints each run's table: per rank, the peak allocated bytes and the bytes sent by collectives per
# step, each against the rank's step on the meta device, and tokens/s.
#   bench/fsdp_bench.sh [LOOM] [extra --section.key=value ...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
loom=${1:-$here/build/loom}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive
for np in 1 2 4 8; do
  echo "== FSDP $np"
  if [ "$np" = 1 ]; then
    "$loom" bench step --config "$here/configs/bench-tiny.toml" "$@"
  else
    mpirun --oversubscribe --allow-run-as-root -np "$np" "$loom" bench step \
      --config "$here/configs/bench-tiny.toml" --parallelism.dp_shard=-1 "$@"
  fi
done
