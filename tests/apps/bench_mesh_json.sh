#!/usr/bin/env bash
# `loom bench step --json` under a mesh: rank 0's last line is one JSON object with every rank,
# positive peaks (reserved >= allocated), and per-group figures that add up to the table's
# bytes/step, exactly (the figures `loom plan` is checked against).
# usage: bench_mesh_json.sh LOOM MPIEXEC SRC NP GROUPS [--section.key=value ...]
# GROUPS: the groups that carry traffic, joined by '+' (names hold commas: "dp_shard,cp+cp"); the
# others must carry none, so with one group its bytes are the table's.
set -euo pipefail
loom=$1 mpiexec=$2 src=$3 np=$4 groups=$5
shift 5
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_bench_json.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
"$mpiexec" --oversubscribe --allow-run-as-root -np "$np" "$loom" bench step --json \
  --config "$src/configs/bench-tiny.toml" --bench.warmup_steps=1 --bench.steps=1 "$@" \
  >"$work/out.txt" 2>&1 || { cat "$work/out.txt"; exit 1; }
cat "$work/out.txt"
python3 - "$work/out.txt" "$np" "$groups" <<'PY'
import json, re, sys
lines = open(sys.argv[1]).read().splitlines()
np, busy = int(sys.argv[2]), sys.argv[3].split("+")
j = json.loads(lines[-1])
# The table's rows: "  rank | peak expected ratio | bytes/step expected ok | ...".
table = {}
for l in lines:
    m = re.match(r"^\s+(\d+) \|[^|]*\|\s+(\d+)\s+(\d+)\s+(\S+)\s+\|", l)
    if m:
        table[int(m.group(1))] = int(m.group(2))
errors = []
def check(ok, what):
    if not ok:
        errors.append(what)
check(j["world"] == np, f"world {j['world']}, expected {np}")
check(sorted(table) == list(range(np)), f"table rows {sorted(table)}")
check([r["rank"] for r in j["ranks"]] == list(range(np)), "ranks not 0..np-1")
for r in j["ranks"]:
    k = r["rank"]
    check(r["peak_allocated_bytes"] > 0, f"rank {k}: peak allocated not positive")
    check(r["peak_reserved_bytes"] >= r["peak_allocated_bytes"], f"rank {k}: reserved < allocated")
    check(r["step_s"] > 0 and r["tokens_per_s"] > 0, f"rank {k}: no time")
    g = r["groups"]
    for name in busy:
        check(name in g and g[name]["bytes"] > 0 and g[name]["calls"] > 0,
              f"rank {k}: no traffic on group {name}: {g}")
    check(all(v["bytes"] == 0 for name, v in g.items() if name not in busy),
          f"rank {k}: traffic on a group other than {busy}: {g}")
    check(all(v["exact"] for v in g.values()), f"rank {k}: counters not a whole number of steps")
    total = sum(v["bytes"] for v in g.values())
    check(total == r["bytes_per_step"] == table.get(k),
          f"rank {k}: groups' bytes {total}, bytes_per_step {r['bytes_per_step']}, "
          f"table {table.get(k)}")
for e in errors:
    print("FAILED:", e)
print("bench step --json:", "ok" if not errors else "FAILED")
sys.exit(1 if errors else 0)
PY
