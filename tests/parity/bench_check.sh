#!/bin/bash
# `loom bench step --check` under mpirun, against the analytic cost model:
#   bench_check.sh MPIEXEC NP LOOM [bench step arguments ...]
# Bytes never vary between runs: a byte or host-pool MISMATCH, or any other failure, fails at once.
# A rank's peak allocated memory does: it depends on when MPI completes a non-blocking collective
# (a test that finds a gather done frees its buffer sooner; `loom plan --completion early|late`
# gives the two bounds, about +-8% around the rule on the small GLA x CP models), so a run whose
# only failure is a peak outside the tolerance is run again, up to three runs in all.
set -uo pipefail
mpiexec=$1 np=$2 loom=$3
shift 3
out=$(mktemp "${TMPDIR:-/tmp}/loom_bench_check.XXXXXX")
trap 'rm -f "$out"' EXIT
for attempt in 1 2 3; do
  "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "$loom" bench step "$@" </dev/null \
    >"$out" 2>&1
  rc=$?
  cat "$out"
  [ $rc -eq 0 ] && exit 0
  if grep -q MISMATCH "$out" || ! grep -q "FAILED: bytes differ from the analytic figure or peak off" "$out"; then
    exit 1
  fi
  echo "bench_check: run $attempt: a peak outside the tolerance, bytes equal; running again"
done
echo "bench_check: FAILED: a peak outside the tolerance in 3 runs"
exit 1
