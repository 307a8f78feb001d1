#!/bin/bash
# Tensor parallelism refuses what it cannot split, on every rank, with a message naming the
# quantity and tp: heads, kv heads, ffn size not divisible by tp, and (sequence parallel) B*T rows
# not divisible by tp. The same layouts with a dividing value must train, and so must a vocabulary
# that tp does not divide (padded).
#   tp_errors.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup tp_errors
base="$src/tests/parity/tp_debug.json"
model() {  # model NAME KEY VALUE: tp_debug.json with one key changed
  sed "s/\"$2\": [0-9]*/\"$2\": $3/" "$base" >"$work/$1.json"
}
model heads num_attention_heads 12  # hidden 96 below: head_dim 8
sed -i 's/"hidden_size": 64/"hidden_size": 96/; s/"num_key_value_heads": 4/"num_key_value_heads": 2/' "$work/heads.json"
model kv num_key_value_heads 2
model ffn intermediate_size 162
model vocab vocab_size 514
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=1
  --training.local_batch_size=1 --checkpoint.interval=0)
source "$(dirname "$0")/error_checks.sh"
expect 8 "num_attention_heads = 12 is not divisible by parallelism.tp = 8" --parallelism.tp=8 --model.config="$work/heads.json"
expect 4 "num_key_value_heads = 2 is not divisible by parallelism.tp = 4" --parallelism.tp=4 --model.config="$work/kv.json"
expect 4 "intermediate_size = 162 is not divisible by parallelism.tp = 4" --parallelism.tp=4 --model.config="$work/ffn.json"
expect 2 "B\*T = 1\*63 = 63 rows are not divisible by parallelism.tp = 2" --parallelism.tp=2 --training.seq_len=63 --model.config="$base"
works 2 --parallelism.tp=2 --training.seq_len=63 --parallelism.tp_sequence_parallel=false --model.config="$base"
works 2 --parallelism.tp=2 --model.config="$work/ffn.json"
# A vocabulary that tp does not divide is padded inside (514 -> 516), not refused.
works 4 --parallelism.tp=4 --model.config="$work/vocab.json"
exit $status
