#!/usr/bin/env bash
# The trainer's pre-flight memory estimate (rank 0's step on the meta device, train/rank_plan.hpp)
# against the peak the allocator measured on rank 0 over a few steps: the two are the same number,
# so this fails when they differ by more than the line's rounding to 0.1 MiB (PREFLIGHT_TOL
# overrides 0.002).
# usage: preflight_estimate.sh LOOM MPIEXEC SRC NP [--section.key=value ...]
set -euo pipefail
loom=$1 mpiexec=$2 src=$3 np=$4
shift 4
source "$src/tests/parity/setup.sh"
parity_setup preflight
# No TensorBoard files: the preflight tests run side by side in one directory, where the default
# <job.dump_dir>/tensorboard of one would hold another's events.
"${mpi[@]}" -np "$np" "$loom" train \
  --config "$src/configs/bench-tiny.toml" --data.path="$work/data" --training.steps=3 \
  --validation.interval=0 --metrics.log_every=1 --metrics.jsonl="$work/m.jsonl" --metrics.tensorboard= "$@" \
  >"$work/log.txt" 2>&1 || { cat "$work/log.txt"; exit 1; }
line=$(grep "memory estimate" "$work/log.txt")
echo "$line"
python3 - "$line" "$work/m.jsonl" "${PREFLIGHT_TOL:-0.002}" <<'PY'
import json, re, sys
m = re.search(r"memory estimate ([0-9.]+) (MiB|GiB)", sys.argv[1])
est = float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1) * 2**20
peak = max(json.loads(l)["peak_allocated_bytes"] for l in open(sys.argv[2]) if '"step"' in l)
ratio = peak / est
print(f"pre-flight estimate {est / 2**20:.1f} MiB, measured peak {peak / 2**20:.2f} MiB, "
      f"measured/estimate {ratio:.3f}")
sys.exit(0 if abs(ratio - 1) <= float(sys.argv[3]) else 1)
PY
