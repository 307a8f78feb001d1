#!/bin/bash
# training.device = "cuda" where no GPU is usable: `loom train` (one process, and two ranks under
# mpirun) stops before training with an error naming the key and what was found, and exits
# non-zero; `auto` trains on the CPU and says why. Skipped (77) where a GPU is usable.
#   device_errors.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
if "$loom" info --peak-seconds 0 | grep -q "^  gpu           0: "; then
  echo "skipped: a GPU is usable here (gpu_step_parity covers training on it)"
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_device_errors.XXXXXX")
trap 'rm -rf "$work"' EXIT
why=$("$loom" info --peak-seconds 0 | sed -n 's/^  gpu           none: //p')
[ -n "$why" ] || { echo "loom info gave no reason for having no GPU"; exit 1; }
common=(--config "$src/configs/debug.toml" --data.path="$work/none" --training.steps=1
  --checkpoint.dir="$work/ck")
status=0
expect_error() {  # expect_error NAME COMMAND...
  local name=$1 rc=0
  shift
  "$@" > "$work/out.txt" 2>&1 || rc=$?
  if [ $rc -eq 0 ] || ! grep -q "training.device = \"cuda\"" "$work/out.txt" ||
    ! grep -qF "$why" "$work/out.txt"; then
    echo "$name: expected an error naming training.device and '$why' (exit $rc):"
    cat "$work/out.txt"
    status=1
  else
    echo "$name: $(grep -m1 'training.device' "$work/out.txt")"
  fi
}
expect_error "one process" "$loom" train "${common[@]}" --training.device=cuda
expect_error "two ranks" "$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$loom" train \
  "${common[@]}" --training.device=cuda
# auto resolves to the CPU and --print-config says why.
"$loom" train "${common[@]}" --training.device=auto --print-config > "$work/cfg.txt" 2>&1 || true
grep -q '^device = "cpu"  # auto: no GPU' "$work/cfg.txt" ||
  { echo "auto: expected device = \"cpu\" with its reason:"; cat "$work/cfg.txt"; status=1; }
exit $status
