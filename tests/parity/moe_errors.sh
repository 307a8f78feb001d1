#!/bin/bash
# A mixture of experts refuses, on every rank and before any step, the layouts it does not build
# or cannot split, naming the key and the numbers: ep not dividing the experts or dp_shard x cp,
# ep on one process or on a model without experts, tensor parallelism without sequence parallelism
# or with ep x tp not dividing the experts, more pipeline stages than layers (a sparse layer's two
# blocks stay on one stage) or a stage split that does not sum to the layers, [moe] keys out of
# range or on a model without experts; and loom generate runs from an ep checkpoint. The dividing
# layouts train, pipeline parallelism too.
#   moe_errors.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup moe_errors
moe="$src/tests/parity/moe_debug.json"
sed 's/"num_experts": 8/"num_experts": 6/' "$moe" >"$work/six.json"
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=1
  --training.local_batch_size=1 --checkpoint.interval=0 --model.config="$moe")
source "$(dirname "$0")/error_checks.sh"
expect 4 "parallelism.ep = 4: expected a divisor of the model's 6 experts" --parallelism.dp_shard=4 --parallelism.ep=4 --model.config="$work/six.json"
expect 4 "parallelism.ep = 3: expected a divisor of dp_shard x cp = 4" --parallelism.dp_shard=4 --parallelism.ep=3
expect 1 "parallelism.ep = 2: expected a divisor of dp_shard x cp = 1" --parallelism.ep=2
expect 2 "model_type \"llama\" has none" --parallelism.dp_shard=2 --parallelism.ep=2 --model.config=debug
expect 2 "parallelism.tp_sequence_parallel = false: a mixture-of-experts model" --parallelism.tp=2 --parallelism.tp_sequence_parallel=false
expect 4 "parallelism.ep x parallelism.tp = 2 x 2: expected a divisor of the model's 6 experts" --parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.tp=2 --model.config="$work/six.json"
expect 4 "the model has 3 layers (num_hidden_layers); expected at least one layer per stage" --parallelism.pp=4
expect 2 "pp_stage_layers sums to 5 layers; expected the model's num_hidden_layers = 3" --parallelism.pp=2 --parallelism.pp_stage_layers=2,3
# [moe]: out of range, or on a model without experts.
expect 1 "moe.capacity_factor: expected a number >= 0" --moe.capacity_factor=-1
expect 1 "moe.load_warning: expected a load max/mean > 1" --moe.load_warning=0.5
expect 1 "moe.bias_update_rate = 0.001: the model" --moe.bias_update_rate=1e-3 --model.config=debug
works 2 --parallelism.dp_shard=2 --parallelism.ep=2 --model.config="$work/six.json"
works 2 --parallelism.tp=2 --model.config="$work/six.json"
works 4 --parallelism.dp_shard=4 --parallelism.ep=2 --checkpoint.dir="$work/ck" --checkpoint.interval=1
works 2 --parallelism.pp=2 --parallelism.pp_stage_layers=1,2
# loom generate from the ep 2 x FSDP 4 checkpoint (the experts' shards in four ranks' files): the
# model loads whole into one process and generates (moe_generate.sh compares its text with one
# process's).
gen=("$loom" generate --checkpoint "$work/ck/step-00000001" --tokenizer "$work/tok.json" --prompt "In the"
  --max-tokens 8 --temperature 1 --top-p 1 --seed 3)
rc=0
"${gen[@]}" >"$work/gen.log" 2>"$work/gen.err" || rc=$?
if [ "$rc" = 0 ] && grep -q "^In the" "$work/gen.log" && grep -q "generated [1-8] tokens" "$work/gen.err"; then
  echo "ok: loom generate -> $(grep -o 'generated.*' "$work/gen.err")"
else
  echo "FAILED: loom generate from the ep checkpoint (exit $rc):"
  tail -3 "$work/gen.log" "$work/gen.err"
  status=1
fi
exit $status
