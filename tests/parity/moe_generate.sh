#!/bin/bash
# loom generate from mixture-of-experts checkpoints, for each family's debug model (qwen3_moe with
# q/k norms and a dense first layer, qwen2_moe with biases and a shared expert, mixtral tied): 30
# steps trained under expert parallelism 2 (dp_shard 2, each rank's file holding 4 of the 8
# experts of every sparse layer) and in one process (accumulation 2: the same micro-batches) draw
# the same text, greedy and sampled at temperature 1 with one seed (a draw depends on every logit,
# so weights loaded into the wrong places would draw other tokens at once); the step-20 checkpoint
# draws other text (what the comparison can see); the Hugging Face directory exported from the
# ep-2 checkpoint draws the same text as the checkpoint.
#   moe_generate.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup moe_generate
status=0
prompt="And God said"
# gen NAME DIR ARGS...: the text `loom generate` draws from DIR into $work/NAME.txt.
gen() {
  local name=$1 dir=$2
  shift 2
  "$loom" generate --checkpoint "$dir" --tokenizer "$work/tok.json" --prompt "$prompt" \
    --max-tokens 48 "$@" >"$work/$name.txt" 2>"$work/$name.err" ||
    { cat "$work/$name.err"; fail "loom generate $name from $dir"; }
  grep -q "tokens/s" "$work/$name.err" || { cat "$work/$name.err"; fail "$name: no statistics line"; }
}
# same A B WHAT / differs A B WHAT: the two texts are (not) the same.
same() {
  if cmp -s "$work/$1.txt" "$work/$2.txt"; then
    echo "ok: $3: the same text ($(($(wc -c <"$work/$1.txt") - ${#prompt} - 1)) bytes generated)"
  else
    echo "FAILED: $3: the texts differ"
    diff "$work/$1.txt" "$work/$2.txt" || true
    status=1
  fi
}
differs() {
  if cmp -s "$work/$1.txt" "$work/$2.txt"; then
    echo "FAILED: $3: the same text, expected another"
    status=1
  else
    echo "ok: $3: other text"
  fi
}
sampled=(--temperature 1 --top-p 1 --seed 7)
for model in moe_debug moe_qwen2_debug moe_mixtral_debug; do
  common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=30
    --training.local_batch_size=1 --checkpoint.interval=10 --checkpoint.keep=0
    --model.config="$src/tests/parity/$model.json")
  "$loom" train "${common[@]}" --training.grad_accum_steps=2 --checkpoint.dir="$work/$model.one" \
    >"$work/train.log" 2>&1 || { cat "$work/train.log"; fail "$model: one process did not train"; }
  "${mpi[@]}" -np 2 "$loom" train "${common[@]}" --parallelism.dp_shard=2 --parallelism.ep=2 \
    --checkpoint.dir="$work/$model.ep2" >"$work/train.log" 2>&1 ||
    { cat "$work/train.log"; fail "$model: ep 2 did not train"; }
  [ -f "$work/$model.ep2/step-00000030/rank-00001.safetensors" ] || fail "$model: no rank-1 file"
  gen one_greedy "$work/$model.one" --temperature 0
  gen ep2_greedy "$work/$model.ep2" --temperature 0
  same one_greedy ep2_greedy "$model greedy, one process against ep 2"
  gen one "$work/$model.one" "${sampled[@]}"
  gen ep2 "$work/$model.ep2" "${sampled[@]}"
  same one ep2 "$model sampled, one process against ep 2"
  gen ep2_step20 "$work/$model.ep2/step-00000020" "${sampled[@]}"
  differs ep2 ep2_step20 "$model sampled, ep 2's step 20 against its step 30"
  "$loom" convert "$work/$model.ep2/step-00000030" "$work/$model.hf" >/dev/null
  gen hf "$work/$model.hf" "${sampled[@]}"
  same ep2 hf "$model sampled, ep 2's checkpoint against its Hugging Face export"
done
exit $status
