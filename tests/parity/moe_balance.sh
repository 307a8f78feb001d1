#!/bin/bash
# The experts' balance through `loom train` (docs/decisions/moe.md), on the MoE debug model:
# - the auxiliary-loss-free bias (moe.bias_update_rate) against none over 20 steps: the worst
#   layer's load max/mean (expert_load) averaged over steps 11-20 must fall;
# - a run with the bias exported as a Hugging Face directory carries it (config.json's
#   "loom_expert_bias", mlp.gate.e_score_correction_bias, moved by the first step's update);
# - a runaway router: that directory with every sparse layer's bias on expert 0 set to +10 (every
#   token chooses it first), trained with the bias frozen (init_from) in one process and under
#   ep 2, dropless and with moe.capacity_factor = 1.0: every run finishes, rank 0 warns once per
#   sparse layer (held while it lasts), the dropless runs drop nothing and the capacity runs at
#   least expert 0's excess, (M - C) / (M k) = (256 - 64) / 512 = 0.375 of the choices.
# loom generate reads the export with its bias.
#   moe_balance.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup moe_balance
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --checkpoint.interval=0
  --model.config="$src/tests/parity/moe_debug.json")
status=0
# The mean of a metric over steps FIRST..LAST of a metrics file.
mean_of() {  # mean_of METRICS NAME FIRST LAST
  python3 - "$@" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and "val_loss" not in l]
v = [r[sys.argv[2]] for r in rows if int(sys.argv[3]) <= r["step"] <= int(sys.argv[4])]
print(sum(v) / len(v))
PY
}

for rate in 0 1e-3; do
  "$loom" train "${common[@]}" --moe.bias_update_rate=$rate --metrics.jsonl="$work/rate$rate.jsonl" \
    >"$work/rate$rate.log" 2>&1 || { cat "$work/rate$rate.log"; exit 1; }
done
without=$(mean_of "$work/rate0.jsonl" expert_load 11 20)
with=$(mean_of "$work/rate1e-3.jsonl" expert_load 11 20)
echo "expert_load over steps 11-20: without the bias $without, with it (rate 1e-3) $with"
awk -v a="$with" -v b="$without" 'BEGIN { exit !(a < b) }' ||
  { echo "FAILED: the bias did not lower the load"; status=1; }

"$loom" train "${common[@]}" --training.steps=1 --moe.bias_update_rate=1e-3 \
  --checkpoint.dir="$work/ck" --checkpoint.last_save_in_hf=true >"$work/export.log" 2>&1 ||
  { cat "$work/export.log"; exit 1; }
hf="$work/ck/hf-step-00000001"
grep -q '"loom_expert_bias": true' "$hf/config.json" || fail "no loom_expert_bias in $hf/config.json"
/usr/bin/python3 - "$src/tests/parity" "$hf/model.safetensors" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import st
t = st.load(sys.argv[2])
names = sorted(n for n in t if n.endswith("mlp.gate.e_score_correction_bias"))
assert names == [f"model.layers.{l}.mlp.gate.e_score_correction_bias" for l in (1, 2)], names
for n in names:
    # One step: each expert's bias +-rate (0 where its load was the mean, to the choice).
    assert all(x == 0 or abs(abs(float(x)) - 1e-3) < 1e-9 for x in t[n]) and t[n].any(), (n, t[n])
    t[n][:] = 0
    t[n][0] = 10
st.save(sys.argv[2], t, meta=st.metadata(sys.argv[2]))
print("exported biases after one step: +-1e-3; set to +10 on expert 0:", ", ".join(names))
PY

# loom generate builds the model from the export's config.json: with the bias, read back.
"$loom" generate --checkpoint "$hf" --tokenizer "$work/tok.json" --prompt "In the" --max-tokens 4 \
  --seed 1 >"$work/gen.log" 2>&1 || { cat "$work/gen.log"; fail "loom generate of the export"; }

runaway() {  # runaway NAME NP ARGS...: trains 3 steps from the runaway directory
  local name=$1 np=$2
  shift 2
  local log="$work/$name.log"
  if ! "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --model.config="$hf/config.json" \
    --model.init_from="$hf" --training.steps=3 --metrics.jsonl="$work/$name.jsonl" "$@" \
    >"$log" 2>&1; then
    echo "FAILED: $name did not finish:"
    tail -5 "$log"
    status=1
    return
  fi
  local warned dropped
  warned=$(grep -c "router is running away: expert 0 got" "$log" || true)
  dropped=$(mean_of "$work/$name.jsonl" dropped 1 3)
  echo "$name: finished, $warned warnings, dropped $dropped of the choices"
  grep -m1 "running away" "$log" || true
  [ "$warned" = 2 ] || { echo "FAILED: $name: expected one warning per sparse layer"; status=1; }
  if [[ "$*" == *capacity_factor* ]]; then
    awk -v d="$dropped" 'BEGIN { exit !(d >= 0.375) }' ||
      { echo "FAILED: $name: expected at least 0.375 dropped"; status=1; }
  else
    [ "$dropped" = 0.0 ] || { echo "FAILED: $name: dropless, dropped $dropped"; status=1; }
  fi
}
runaway one_dropless 1
runaway one_capacity 1 --moe.capacity_factor=1.0
runaway ep2_dropless 2 --parallelism.dp_shard=2 --parallelism.ep=2
runaway ep2_capacity 2 --parallelism.dp_shard=2 --parallelism.ep=2 --moe.capacity_factor=1.0
exit $status
