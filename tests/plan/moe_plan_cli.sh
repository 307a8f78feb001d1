#!/bin/bash
# `loom plan` for a mixture of experts, through the command line: the search's table names each
# layout's ep and its first layout shards the experts (ep > 1) with the worst-case line under
# it; a plan under ep says what routing its figures assume, and its worst case (JSON
# ep_worst_case) equals the plan at that load (--ep-load); loads past the bound are refused by
# name. The model: tests/plan/moe_many_experts.json (64 experts, top-2) on 4 H100s.
#   moe_plan_cli.sh LOOM SOURCE_DIR
set -euo pipefail
loom=$1 src=$2
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive LOOM_SOURCE_DIR=$src
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_moe_plan.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "moe_plan_cli: $*" >&2; exit 1; }
plan=("$loom" plan --config "$src/configs/debug.toml" --world 4 --hardware h100-sxm-80g
      "--model.config=$src/tests/plan/moe_many_experts.json"
      --training.mixed_precision_param=bfloat16)

"${plan[@]}" --search >"$work/search.txt"
# The table's first row (after the header line and the column names) is the fastest layout.
first=$(sed -n 3p "$work/search.txt")
echo "first: $first"
[[ $first =~ ,\ ep\ [24],\ ac ]] || fail "the first layout does not shard the experts: $first"
grep -q ', ep 1, ac' "$work/search.txt" || fail "no layout without ep in the table"
grep -q 'experts, worst case dropless' "$work/search.txt" || fail "no worst case under the table"

ep=("${plan[@]}" --parallelism.dp_shard=4 --parallelism.ep=4)
"${ep[@]}" >"$work/plan.txt"
grep -q 'experts: balanced routing assumed' "$work/plan.txt" || fail "no routing note"
grep -q 'worst case dropless .*load 4.00' "$work/plan.txt" || fail "no worst-case line at load 4"
"${ep[@]}" --json >"$work/plan.json"
"${ep[@]}" --json --ep-load=4 >"$work/worst.json"
/usr/bin/python3 - "$work/plan.json" "$work/worst.json" <<'PY'
import json, sys
plan, worst = (json.load(open(p)) for p in sys.argv[1:])
w = plan["ep_worst_case"]
assert plan["ep_load"] == 1 and w["load"] == 4, (plan["ep_load"], w)
peak = max(r["peak_allocated_bytes"] for r in worst["ranks"])
balanced = max(r["peak_allocated_bytes"] for r in plan["ranks"])
assert w["peak_allocated_bytes"] == peak, (w, peak)
assert peak > balanced, (peak, balanced)
print(f"balanced peak {balanced}, worst {peak} bytes")
PY

# Past the bound, or without experts under ep: refused, naming the bound.
if "${ep[@]}" --ep-load=4.5 >/dev/null 2>"$work/err"; then fail "--ep-load 4.5 accepted"; fi
grep -q 'expected a load from 1 to 4' "$work/err" || { cat "$work/err"; fail "bad message"; }
if "${plan[@]}" --ep-load=2 >/dev/null 2>"$work/err"; then fail "--ep-load without ep accepted"; fi
grep -q 'parallelism.ep > 1' "$work/err" || { cat "$work/err"; fail "bad message"; }
echo "moe_plan_cli: ok"
