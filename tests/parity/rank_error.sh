#!/bin/bash
# An error on one rank ends the whole job at once, with its message: MPMD launches of FSDP 2 where
# only rank 1 fails, (a) on its command line, before the ranks first communicate, (b) after the
# mesh is built, while rank 0 goes on into the trainer's collectives (which would otherwise wait
# the 300 s collective timeout for it), and (c) in its first GEMM, mid-step, while rank 0 waits
# in FSDP's collectives. Each must exit non-zero within 10 s and name the cause with the failing
# rank. Then (d): parity_detects_mismatch's mode does not count a run that fails as a detected
# mismatch.
#   rank_error.sh LOOM MPIEXEC COMPARE SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 compare=$3 src=$4
source "$(dirname "$0")/setup.sh"
parity_setup rank_error
common=(train --config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=5
  --training.local_batch_size=1 --checkpoint.interval=0 --parallelism.dp_shard=2)
status=0

# one_rank_fails NAME PATTERN ARGS...: rank 1 gets ARGS (and runs under the command prefix
# ${rank1[@]}, when set); the job must end within 10 s (a hang is cut at 60 s), non-zero, with
# PATTERN in its output. With moot=REASON, a job that trains to the end is skipped instead.
rank1=() moot=
one_rank_fails() {
  local name=$1 pat=$2
  shift 2
  local rc=0 t0 t1
  t0=$(date +%s.%N)
  timeout -k 5 60 "${mpi[@]}" -np 1 "$loom" "${common[@]}" : \
    -np 1 "${rank1[@]}" "$loom" "${common[@]}" "$@" >"$work/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  if [ "$rc" = 0 ] && [ -n "$moot" ]; then
    echo "skipped: $name: the job trained ($moot)"
    return
  fi
  if [ "$rc" != 0 ] && [ "$rc" != 124 ] && awk -v s="$secs" 'BEGIN { exit !(s < 10) }' &&
    grep -q -- "$pat" "$work/$name.log"; then
    echo "ok: $name: exit $rc after $secs s: $(grep -m1 -o -- "$pat.*" "$work/$name.log" | cut -c1-150)"
  else
    echo "FAILED: $name: exit $rc after $secs s (want non-zero within 10 s, naming '$pat'):"
    tail -5 "$work/$name.log"
    status=1
  fi
}

one_rank_fails config "rank 1: loom train: error: .*optimizer.lr" --optimizer.lr=bad
# Rank 1's log file cannot be opened (a directory holds its name, even for root), with the same
# configuration on both ranks: the ranks refuse to start with different ones.
mkdir -p "$work/runs/logs/rank-1.log"
plain=("${common[@]}")
common+=(--job.rank_logs=true --job.dump_dir="$work/runs")
one_rank_fails after_mesh "rank 1: loom train: error: job.rank_logs: cannot write"
common=("${plain[@]}")

# bf16 GEMMs on a rank whose oneDNN is held to AVX2, which has no bf16 matmul (the job that
# hung before on an AVX2 machine). Where a bf16 matmul exists under AVX2, the case is moot.
common+=(--training.mixed_precision_param=bfloat16)
rank1=(env ONEDNN_MAX_CPU_ISA=AVX2) moot="this oneDNN has a bf16 matmul under AVX2"
one_rank_fails mid_step "rank [01]: loom train: error: gemm: oneDNN cannot build a bfloat16"

# (d) The mismatch mode of run_parity.sh: the run fails (on every rank here), so the verdict must
# be a failure that shows the run's error, not "mismatch detected".
rc=0
PARITY_EXPECT=mismatch timeout -k 5 60 "$(dirname "$0")/run_parity.sh" "$loom" "$mpiexec" "$compare" \
  "$src" crash 2 1e-5 --parallelism.dp_shard=2 --optimizer.lr=bad >"$work/crash.log" 2>&1 || rc=$?
if [ "$rc" = 1 ] && ! grep -q "mismatch detected" "$work/crash.log" &&
  grep -q "optimizer.lr" "$work/crash.log"; then
  echo "ok: a failed run is not a detected mismatch (run_parity.sh exit $rc, shows the error)"
else
  echo "FAILED: run_parity.sh in mismatch mode with a failing run: exit $rc:"
  tail -5 "$work/crash.log"
  status=1
fi
exit $status
