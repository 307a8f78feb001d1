#!/bin/bash
# Meta equals real: one layout of the parity suite planned by `loom plan --ranks all` (the step on
# the meta device over simulated groups) against the real step of `loom bench step --json` under
# `mpirun -np NP`, with the same config and overrides:
#   meta_equals_real.sh LOOM MPIEXEC SOURCE_DIR NP [--key=value ...]
# Every rank's bytes of every group and its peak allocated memory equal the real run's exactly;
# with CPU offload the host pool's peak (the offloaded states) too. Under expert parallelism
# (--parallelism.ep > 1) the tokens the all-to-alls carry, and the rows each rank's experts
# compute, follow the routing, which the meta run does not know (it prices a balanced router): the
# ep group's bytes and the peaks are printed, not compared; every other group's bytes still are.
# So do the rows a capacity keeps (--moe.capacity_factor > 0: the meta run drops nothing where a
# balanced router stays under it): the peaks are printed, not compared.
# Under tensor parallelism a mixture of experts' tp ranks each compute their slice of the experts
# for the same tokens: the rows each computes follow the routing too (the peaks are printed), the
# tp group's bytes (gathers and reduce-scatters of every row) do not (compared).
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
# `loom bench step`, `loom train` and the plan run the same step: grad_accum_steps x the
# pipeline's micro-batches.
bench=("$loom" bench step "${common[@]}" --json --bench.warmup_steps=1 --bench.steps=1)
# One real run: when a collective or a pipeline send frees its buffers is fixed by the program
# (parallel/fsdp.cpp, parallel/pipeline_executor.cpp), not by when MPI finishes it, so a rank's
# peak is the same in every run, under any load, and the plan's meta run of the same program
# predicts it to the byte.
if [ "$np" -gt 1 ]; then
  "$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "${bench[@]}" </dev/null >"$work/real.out" 2>&1 ||
    { cat "$work/real.out"; exit 1; }
else
  "${bench[@]}" </dev/null >"$work/real.out" 2>&1 || { cat "$work/real.out"; exit 1; }
fi
grep '^{' "$work/real.out" | tail -1 >"$work/real.json"
routed=0 tp=1 experts=0
for a in "${args[@]}"; do
  case $a in
    --parallelism.ep=1 | --moe.capacity_factor=0 | --moe.capacity_factor=0.0) ;;
    --parallelism.ep=* | --moe.capacity_factor=*) routed=1 ;;
    --parallelism.tp=*) tp=${a#*=} ;;
    --model.config=*) grep -qE '"num_(local_)?experts"' "${a#*=}" 2>/dev/null && experts=1 ;;
  esac
done
routed_rows=$routed
[ "$tp" != 1 ] && [ "$experts" = 1 ] && routed_rows=1
python3 - "$work/plan.json" "$work/real.json" "$routed" "$routed_rows" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
real = json.load(open(sys.argv[2]))
routed = sys.argv[3] == "1"  # the ep group's bytes follow the routing
routed_rows = sys.argv[4] == "1"  # each rank's expert rows (so its peak) follow the routing
# One process: bench prints one object for its only rank.
ranks = {r["rank"]: r for r in (real["ranks"] if "ranks" in real else [dict(real, rank=0, groups={})])}
ok = len(ranks) == len(plan["ranks"])
if not ok:
    print(f"plan has {len(plan['ranks'])} ranks, the real run {len(ranks)}")
for p in plan["ranks"]:
    r = ranks[p["rank"]]
    pa, ra = p["peak_allocated_bytes"], r["peak_allocated_bytes"]
    note = "  (follows the routing: not compared)" if routed_rows and pa != ra else ""
    print(f"rank {p['rank']}: peak allocated plan {pa} real {ra}" +
          ("" if pa == ra or routed_rows else "  MISMATCH") + note)
    ok = ok and (pa == ra or routed_rows)
    # CPU offload: the host pool holds the states from the start.
    if p.get("host_bytes", 0) != r.get("host_peak_bytes", 0):
        print(f"  host memory: plan {p.get('host_bytes', 0)} real {r.get('host_peak_bytes', 0)}"
              "  MISMATCH")
        ok = False
    elif p.get("host_bytes", 0):
        print(f"  host memory (offloaded states): {p['host_bytes']}")
    for n in sorted(set(p["groups"]) | set(r["groups"])):
        pb = p["groups"].get(n, {}).get("bytes", 0)
        rb = r["groups"].get(n, {}).get("bytes", 0)
        free = routed and n == "ep"
        print(f"  group {n}: bytes plan {pb} real {rb}" + ("" if pb == rb else
              "  (the routed tokens: not compared)" if free else "  MISMATCH"))
        ok = ok and (pb == rb or free)
print("meta equals real" if ok else "FAILED: the plan differs from the real run")
sys.exit(0 if ok else 1)
PY
