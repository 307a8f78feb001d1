#!/bin/bash
# `loom bench step --check` under mpirun, against each rank's step on the meta device:
#   bench_check.sh MPIEXEC NP LOOM [bench step arguments ...]
# One run: bytes never vary, and neither does a rank's peak since FSDP completes its collectives
# at fixed points of the program rather than when MPI happens to finish them (parallel/fsdp.cpp).
set -uo pipefail
mpiexec=$1 np=$2 loom=$3
shift 3
exec "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "$loom" bench step "$@" </dev/null
