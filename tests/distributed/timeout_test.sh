#!/usr/bin/env bash
# Usage: timeout_test.sh MPIEXEC TIMEOUT_EXE
# Checks that a collective one rank never joins ends the job: non-zero exit, within 10 s, with
# one line naming the collective, the group, this rank and the peers.
set -u
mpiexec=$1 exe=$2
start=$(date +%s%N)
out=$(timeout 60 "$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$exe" 2 2>&1)
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
echo "$out"
echo "--- exit code $rc after ${elapsed_ms} ms"
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -ne 0 ] || fail "the job exited with 0"
[ "$rc" -ne 124 ] || fail "the job hung until killed"
[ "$elapsed_ms" -lt 10000 ] || fail "took ${elapsed_ms} ms, expected < 10000"
pattern="^loom: TIMEOUT in all_reduce on group 'tp' \(size 2, world ranks \[0, 1\]\): world rank 0 waited [0-9.]+ s \(limit 2 s\) for peers \[1\] \(world ranks\), 148 bytes; aborting the job$"
[ "$(grep -cE "$pattern" <<< "$out")" -eq 1 ] || fail "expected one line matching: $pattern"
[ "$(grep -c "TIMEOUT" <<< "$out")" -eq 1 ] || fail "expected exactly one TIMEOUT line"
echo "PASS"
