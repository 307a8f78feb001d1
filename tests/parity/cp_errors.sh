#!/bin/bash
# Context parallelism refuses a seq_len it cannot cut into 2*cp chunks (2*cp*tp with sequence
# parallelism), on every rank, naming seq_len and the divisor; a dividing seq_len trains.
#   cp_errors.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup cp_errors
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=1
  --training.local_batch_size=1 --checkpoint.interval=0 --parallelism.dp_shard=1)
tp_model="--model.config=$src/tests/parity/tp_debug.json"
source "$(dirname "$0")/error_checks.sh"
expect 4 "sequence length 60 must be divisible by 2\*cp = 8" --parallelism.cp=4 --training.seq_len=60
works 4 --parallelism.cp=4 --training.seq_len=56
expect 4 "sequence length 68 must be divisible by 2\*cp\*tp (sequence parallel) = 8" \
  --parallelism.cp=2 --parallelism.tp=2 --training.seq_len=68 "$tp_model"
works 4 --parallelism.cp=2 --parallelism.tp=2 --parallelism.tp_sequence_parallel=false \
  --training.seq_len=68 "$tp_model"
exit $status
