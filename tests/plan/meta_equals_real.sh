#!/bin/bash
# Meta equals real: one layout of the parity suite planned by `loom plan --ranks all` (the step on
# the meta device over simulated groups) against the real step of `loom bench step --json` under
# `mpirun -np NP`, with the same config and overrides:
#   meta_equals_real.sh LOOM MPIEXEC SOURCE_DIR NP [--key=value ...]
# Every rank's bytes of every group equal the real run's counters exactly, and its planned peak
# allocated memory is within 1% of the real allocator's peak (PLAN_MEM_TOL overrides 0.01).
# --ref:* overrides (the parity reference's) are ignored.
set -euo pipefail
loom=$1 mpiexec=$2 src=$3 np=$4
shift 4
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_plan_real.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

args=()
for a in "$@"; do
  case $a in
    --ref:* | --parity:*) ;;
    *) args+=("$a") ;;
  esac
done
common=(--config "$src/configs/debug.toml" --training.local_batch_size=4 "${args[@]}")

"$loom" plan "${common[@]}" --world "$np" --ranks all --json >"$work/plan.json"
# `loom bench step` runs grad_accum_steps micro-batches a step; `loom train` (and the plan) run
# grad_accum_steps x the pipeline's micro-batches: the bench is given the plan's count.
mb=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["micro_batches"])' "$work/plan.json")
bench=("$loom" bench step "${common[@]}" --training.grad_accum_steps="$mb" --json
  --bench.warmup_steps=1 --bench.steps=1)
if [ "$np" -gt 1 ]; then
  "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "${bench[@]}" >"$work/real.out" 2>&1 ||
    { cat "$work/real.out"; exit 1; }
else
  "${bench[@]}" >"$work/real.out" 2>&1 || { cat "$work/real.out"; exit 1; }
fi
grep '^{' "$work/real.out" | tail -1 >"$work/real.json"

python3 - "$work/plan.json" "$work/real.json" "${PLAN_MEM_TOL:-0.01}" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
real = json.load(open(sys.argv[2]))
tol = float(sys.argv[3])
# One process: bench prints one object for its only rank.
real_ranks = real["ranks"] if "ranks" in real else [dict(real, rank=0, groups={})]
ok = True
for p, r in zip(plan["ranks"], sorted(real_ranks, key=lambda x: x["rank"])):
    assert p["rank"] == r["rank"], (p["rank"], r["rank"])
    pa, ra = p["peak_allocated_bytes"], r["peak_allocated_bytes"]
    ratio = pa / ra
    line = f"rank {p['rank']}: peak allocated plan {pa} real {ra} ratio {ratio:.5f}"
    if abs(ratio - 1) > tol:
        ok = False
        line += f"  MISMATCH (tolerance {tol})"
    print(line)
    names = sorted(set(p["groups"]) | set(r["groups"]))
    for n in names:
        pb = p["groups"].get(n, {}).get("bytes", 0)
        rb = r["groups"].get(n, {}).get("bytes", 0)
        pc = p["groups"].get(n, {}).get("calls", 0)
        rc = r["groups"].get(n, {}).get("calls", 0)
        flag = "" if pb == rb else "  MISMATCH"
        ok = ok and pb == rb
        print(f"  group {n}: bytes plan {pb} real {rb}; calls plan {pc} real {rc}{flag}")
if len(plan["ranks"]) != len(real_ranks):
    print(f"plan has {len(plan['ranks'])} ranks, the real run {len(real_ranks)}")
    ok = False
print("meta equals real" if ok else "FAILED: the plan differs from the real run")
sys.exit(0 if ok else 1)
PY
