#!/bin/bash
# Regenerates the seed corpora tests/fuzz/corpus/<harness>/ from small real files: a tokenizer,
# token shards and a checkpoint of a tiny model made by loom itself, the repo's configs, and the
# formats loom only reads (tiktoken ranks, GPT-2 encoder.json + vocab.bpe, sharded index, the
# other safetensors dtypes) converted from them by tests/fuzz/make_corpus.py.
#   tests/fuzz/make_corpus.sh [LOOM]   (default build/loom)
set -euo pipefail
cd "$(dirname "$0")/../.."
loom=$(readlink -f "${1:-build/loom}")
out=tests/fuzz/corpus
tmp=$(mktemp -d "${TMPDIR:-/tmp}/loom_corpus.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
head -c 4000 docs/design.md >"$tmp/text.txt"
"$loom" tokenize --input "$tmp/text.txt" --output "$tmp/data" --train-vocab 300 \
  --save-tokenizer "$tmp/tok.json" --val-fraction 0.1 >/dev/null
cat >"$tmp/tiny.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
 "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 300, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false}
JSON
"$loom" train --config configs/debug.toml --model.config="$tmp/tiny.json" \
  --data.path="$tmp/data" --training.steps=2 --training.seq_len=16 \
  --training.local_batch_size=2 --checkpoint.dir="$tmp/ck" --checkpoint.interval=2 >/dev/null
"$loom" train --config configs/debug.toml --print-config >"$tmp/resolved.toml"
rm -rf "$out"
python3 tests/fuzz/make_corpus.py "$tmp" "$out"
du -sh "$out"
