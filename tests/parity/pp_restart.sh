#!/bin/bash
# A checkpoint taken under pp 2 x tp 2 (1f1b, 4 micro-batches of 1 sample) resumes under one
# process (grad_accum_steps 4), pp 4 (interleaved, 8 stages) and FSDP 2 x TP 2 with the
# uninterrupted run's step-11 loss within 1e-6 relative (why not to the last digit: see
# restart_layouts.sh). Every pp rank holds only its stages' weights and moments up to date and
# writes only those: the pp 2 x tp 2 checkpoint's rank files fall into 2 groups holding disjoint
# sets of units that together are the whole model, the pp 4 resume's step-11 checkpoint into 4;
# a resume under pp reads only its stages' units (and the pp 4 resume's loss needs them right),
# plus, with tied embeddings, the last stage's replica of the embedding.
#   pp_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup pp_restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/pp_debug.json")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.pp=2 --parallelism.tp=2 --parallelism.pp_microbatches=4 \
  --checkpoint.dir="$work/ck" --checkpoint.interval=10 --checkpoint.keep=0 \
  --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)

# disjoint_units CKPT PP: the units (embedding, layer N, head) of each rank file in CKPT's index;
# files of one pp rank (its tp ranks) hold the same units, of two pp ranks none in common: PP
# distinct sets, disjoint, covering every unit.
disjoint_units() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, re, sys
ck, pp = sys.argv[1], int(sys.argv[2])
index = json.load(open(ck + "/loom.index.json"))
def unit(name):
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return "layer %s" % m.group(1) if m else ("embedding" if "embed_tokens" in name else "head")
held = {f: set() for f in index["files"]}
for name, t in index["tensors"].items():
    for s in t["slices"]:
        held[s["file"]].add(unit(name))
sets = {frozenset(u) for u in held.values()}
for f, u in sorted(held.items()):
    print("  %s: %s" % (f, ", ".join(sorted(u))))
every = set().union(*sets)
ok = len(sets) == pp and all(a == b or not (a & b) for a in sets for b in sets)
ok = ok and sum(len(s) for s in sets) == len(every) and len(every) == 8 + 2
print("%s: %d files, %d distinct unit sets (want %d, disjoint, covering all %d units): %s"
      % (ck, len(held), len(sets), pp, len(every), "ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
}

status=0
disjoint_units "$work/ck/step-00000010" 2 || status=1
for layout in "1 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "4 --training.local_batch_size=1 --parallelism.pp=4 --parallelism.pp_schedule=interleaved_1f1b --parallelism.pp_microbatches=4" \
  "4 --training.local_batch_size=2 --parallelism.dp_shard=2 --parallelism.tp=2"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "pp2 x tp2" $layout || status=1
  case $layout in *pp=4*) disjoint_units "$work/ck2/step-00000011" 4 || status=1 ;; esac
done

# Tied embeddings across the pp ranks: the last stage's replica of the embedding is not its own
# unit (the first stage writes it), yet the resume must read it, or the head would start from a
# zeroed table (a loss near ln(vocab)).
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/pp_tied.json")
rm -rf "$work/ck" "$work/full.jsonl"  # a fresh run: its history starts anew
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.pp=2 --parallelism.pp_microbatches=4 \
  --checkpoint.dir="$work/ck" --checkpoint.interval=10 --checkpoint.keep=0 \
  --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
for layout in "2 --training.local_batch_size=1 --parallelism.pp=2 --parallelism.pp_microbatches=4" \
  "1 --training.local_batch_size=1 --training.grad_accum_steps=4"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "pp2 tied" $layout || status=1
done
exit $status
