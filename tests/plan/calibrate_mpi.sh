#!/bin/bash
# `loom plan calibrate --quick` under `mpirun -np 2`: every rank makes the same collectives in
# the same order (a mismatch aborts MPI), the file it writes names the measured collectives and
# the waits for the last rank, and `loom plan` loads it and prices a two-rank layout with them.
#   calibrate_mpi.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_calibrate.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
"$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$loom" plan calibrate --quick \
  --config "$src/configs/debug.toml" --output "$work/hw.toml" >"$work/log" 2>&1 ||
  { cat "$work/log"; exit 1; }
for want in '^\[collectives.all_gather\]' '^\[collectives.reduce_scatter\]' \
  '^\[collectives.all_reduce\]' '^\[collectives.send\]' '^transfers_on_core = true' \
  'sync_wait (the median): [0-9.e+-]*% of the compute'; do
  grep -q "$want" "$work/hw.toml" || { echo "calibrate_mpi: no '$want' in the file:"; cat "$work/hw.toml"; exit 1; }
done
"$loom" plan --config "$src/configs/debug.toml" --world 2 --parallelism.dp_shard=2 \
  --hardware "$work/hw.toml" >"$work/plan" || { cat "$work/plan"; exit 1; }
grep -q "time on cpu-local: step" "$work/plan" || { cat "$work/plan"; exit 1; }
echo "calibrate_mpi: ok ($(grep -o 'sync_wait (the median): [^%]*%' "$work/hw.toml"))"
