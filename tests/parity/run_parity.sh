#!/bin/bash
# One layout of the data-parallel parity harness (ctest runs one per layout):
#   run_parity.sh LOOM MPIEXEC COMPARE SOURCE_DIR NAME NP TOLERANCE [--key=value ...]
# Trains the debug model for 20 steps under `mpirun -np NP` with the given overrides, and the
# single-process reference over the same global batches (local_batch_size 4, grad_accum_steps =
# DP x the run's accumulation with DP = NP / tp: micro-batch m of the reference is exactly the
# batch of dp rank m mod DP), then compares per-step losses and final weights (parity_compare).
# A reference override is given as --ref:key=value (e.g. the param dtype of the reference);
# --parity:norm_tol=X holds the gradient norms to X instead of 10 x TOLERANCE (parity_compare).
# PARITY_EXPECT=mismatch inverts the verdict: exit 0 only when the comparison ran to the end and
# reported the run out of tolerance.
set -euo pipefail
loom=$1 mpiexec=$2 compare=$3 src=$4 name=$5 np=$6 tol=$7
shift 7
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_parity_${name}.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

run_args=() ref_args=() accum=1 tp=1 cp=1 pp=1 ppm=1 norm_tol=
for a in "$@"; do
  case $a in
    --ref:*) ref_args+=("--${a#--ref:}") ;;
    --parity:norm_tol=*) norm_tol=${a#*=} ;;
    --training.grad_accum_steps=*) accum=${a#*=}; run_args+=("$a") ;;
    --parallelism.tp=*) tp=${a#*=}; run_args+=("$a") ;;
    --parallelism.cp=*) cp=${a#*=}; run_args+=("$a") ;;
    --parallelism.pp=*) pp=${a#*=}; run_args+=("$a") ;;
    # A pipeline run takes pp_microbatches micro-batches per accumulation step (given explicitly
    # in the pp layouts).
    --parallelism.pp_microbatches=*) ppm=${a#*=}; run_args+=("$a") ;;
    --model.* | --moe.* | --training.seq_len=*) run_args+=("$a"); ref_args+=("$a") ;;  # same for both runs
    *) run_args+=("$a") ;;
  esac
done
# The tp and cp ranks of a dp rank see the same batch: the reference accumulates over the dp ranks
# only.
dp=$((np / tp / cp / pp))
accum=$((accum * ppm))

# The corpus (tests/parity/setup.sh), tokenized with a small trained vocabulary.
source "$src/tests/parity/setup.sh"
parity_corpus "$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null

common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=20
  --training.local_batch_size=4 --checkpoint.interval=0)
"$loom" train "${common[@]}" --training.grad_accum_steps=$((dp * accum)) \
  --metrics.jsonl="$work/ref.jsonl" --checkpoint.dir="$work/ref" "${ref_args[@]}" >"$work/ref.log" 2>&1 ||
  { cat "$work/ref.log"; exit 1; }
"$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "$loom" train "${common[@]}" \
  --metrics.jsonl="$work/run.jsonl" --checkpoint.dir="$work/run" "${run_args[@]}" >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; exit 1; }
grep -m1 "x dp" "$work/run.log" || true
compare_args=("$work/ref.jsonl" "$work/ref/step-00000020" "$work/run.jsonl" "$work/run/step-00000020" "$tol")
[ -n "$norm_tol" ] && compare_args+=("$norm_tol")
if [ "${PARITY_EXPECT:-match}" = mismatch ]; then
  # The harness's own test: both runs must complete and the comparison must fail on the
  # tolerance (not on a crash, a missing step or a missing tensor).
  rc=0
  out=$("$compare" "${compare_args[@]}") || rc=$?
  echo "$out"
  if [ "$rc" = 1 ] && grep -q '^out of tolerance' <<<"$out"; then
    echo "mismatch detected, as expected"
    exit 0
  fi
  echo "expected the comparison to fail on the tolerance (parity_compare exit $rc)"
  exit 1
fi
"$compare" "${compare_args[@]}"
