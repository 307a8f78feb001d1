#!/bin/bash
# A GPU training step's waits of the host for the GPU do not grow with its micro-batches: `loom
# bench step` on the CUDA emulation with grad_accum_steps 1 and 3 must report the same host waits
# per step (the loss read and the gradient norm: no op of a micro-batch waits).
#   host_waits_check.sh LOOM_EMULATED [bench step arguments ...]
set -uo pipefail
loom=$1
shift
waits() {
  "$loom" bench step --peak-seconds 0 --bench.warmup_steps=1 --bench.steps=1 "$@" \
      --training.grad_accum_steps="$accum" </dev/null | grep '^  host waits/step'
}
accum=1 one=$(waits "$@") || { echo "no host waits line with grad_accum_steps=1" >&2; exit 1; }
accum=3 three=$(waits "$@") || { echo "no host waits line with grad_accum_steps=3" >&2; exit 1; }
echo "grad_accum_steps=1:$one"
echo "grad_accum_steps=3:$three"
if [ "$one" != "$three" ]; then
  echo "FAILED: a step's host waits grow with its micro-batches" >&2
  exit 1
fi
