#!/bin/bash
# A pp rank that stops mid-step: the job must end (not hang) with a non-zero exit and the timeout
# line naming the pipeline schedule, action, stage, micro-batch and peer.
#   timeout_test.sh MPIEXEC PIPELINE_MPI_TEST
set -uo pipefail
mpiexec=$1 bin=$2
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
out=$("$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$bin" --gtest_also_run_disabled_tests \
  --gtest_filter='*StoppedRankEndsTheJobWithTheTimeoutLine' 2>&1)
rc=$?
echo "$out" | grep "TIMEOUT"
[ "$rc" -ne 0 ] || { echo "expected a non-zero exit, got 0"; echo "$out"; exit 1; }
# Rank 0 of 1f1b with p = 2 sends 0F0's activation and waits for that send at the test the
# schedule fixes for it (where rank 1 would have posted the receive): a send MPI cannot complete
# without its receive (rendezvous) times out there; one it buffered (eager) completes, and rank 0
# then waits for the gradient of 0B0 from rank 1. Either line names schedule, action and peer.
send="loom: TIMEOUT in send .*(pipeline schedule 1f1b, action 0F0 (stage 0, micro-batch 0): sending the activation of stage 1 with pp rank 1, tag [0-9]*); aborting the job"
recv="loom: TIMEOUT in recv .*(pipeline schedule 1f1b, action 0B0 (stage 0, micro-batch 0): receiving the gradient of stage 0 with pp rank 1, tag [0-9]*); aborting the job"
echo "$out" | grep -q -e "$send" -e "$recv" ||
  { echo "no pipeline timeout line"; echo "$out"; exit 1; }
echo "timeout line found, exit $rc"
