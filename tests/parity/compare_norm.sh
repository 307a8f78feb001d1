#!/bin/bash
# parity_compare checks the gradient norms: a run equal to its reference passes at tolerance 0;
# the same run with one step's grad_norm changed in its last digits (losses and weights
# untouched) must fail on the tolerance, naming the gradient norm; a run whose metrics lack a
# step's grad_norm fails as incomplete.
#   compare_norm.sh LOOM MPIEXEC COMPARE SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 compare=$3 src=$4
source "$(dirname "$0")/setup.sh"
parity_setup compare_norm
"$loom" train --config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=3 \
  --checkpoint.dir="$work/ck" --checkpoint.interval=0 --metrics.jsonl="$work/ref.jsonl" \
  >"$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
ck="$work/ck/step-00000003"
"$compare" "$work/ref.jsonl" "$ck" "$work/ref.jsonl" "$ck" 0
# Step 2's norm with its last digit changed (one ulp or a few).
sed -E '/"step": 2,/ s/("grad_norm": [0-9.e-]*)([0-9])/\1X\2/; s/X0/1/; s/X([1-9])/0/' \
  "$work/ref.jsonl" >"$work/norm.jsonl"
if cmp -s "$work/ref.jsonl" "$work/norm.jsonl"; then echo "the edit changed nothing"; exit 1; fi
rc=0
out=$("$compare" "$work/ref.jsonl" "$ck" "$work/norm.jsonl" "$ck" 0) || rc=$?
echo "$out"
[ "$rc" = 1 ] && grep -q '^out of tolerance: loss 0, gradient norm [0-9.e-]*[1-9]' <<<"$out" ||
  { echo "a changed gradient norm was not caught (exit $rc)"; exit 1; }
grep -v '"step": 2,' "$work/ref.jsonl" >"$work/short.jsonl"
grep '"step": 2,' "$work/ref.jsonl" | sed 's/, "grad_norm": [^,]*//' >>"$work/short.jsonl"
rc=0
out=$("$compare" "$work/ref.jsonl" "$ck" "$work/short.jsonl" "$ck" 0) || rc=$?
echo "$out"
[ "$rc" = 1 ] && grep -q 'grad_norm: step 2 missing' <<<"$out" ||
  { echo "a missing gradient norm was not caught (exit $rc)"; exit 1; }
echo "gradient norms compared, as expected"
