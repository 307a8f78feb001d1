#!/usr/bin/env bash
# The README's quick start, on a fresh Debian 12 machine (as root or with sudo):
#   1. installs only what building and training need and builds only the loom binary
#      (scripts/build.sh loom; the tests, PyTorch, Node and clang come with scripts/test.sh);
#   2. once: writes the King James Bible (Debian's bible-kjv) to data/kjv.txt and tokenizes it
#      into data/kjv with a 4096-token BPE vocabulary trained on it, 1% held out for validation;
#   3. trains the default model (configs/default.toml: about four minutes on two cores, sized for
#      AVX2 in float32), resuming if an earlier run of it was interrupted;
#   4. samples a continuation of "And God said" from the last checkpoint.
# Each phase's seconds are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
scripts/build.sh loom
t1=$(date +%s)
loom=build/loom

if ! compgen -G "data/kjv/train-*.bin" > /dev/null || [ ! -f data/kjv/tokenizer.json ]; then
  mkdir -p data
  if [ ! -s data/kjv.txt ]; then
    # `bible -f` prints one verse per line after its reference ("Ge1:1 In the beginning ...");
    # the range from the first verse to the last is the whole text. The references are dropped.
    echo "writing data/kjv.txt (King James Bible, from bible-kjv)"
    bible -f Gen1:1-Rev22:21 < /dev/null | sed -E 's/^[^ ]+ //' > data/kjv.txt.tmp
    mv data/kjv.txt.tmp data/kjv.txt
  fi
  rm -rf data/kjv
  mkdir -p data/kjv
  "$loom" tokenize --input data/kjv.txt --output data/kjv --train-vocab 4096 \
    --save-tokenizer data/kjv/tokenizer.json --val-fraction 0.01
fi
t2=$(date +%s)

"$loom" train --config configs/default.toml --checkpoint.resume=true
t3=$(date +%s)
"$loom" generate --checkpoint runs/default/checkpoints --prompt "And God said"
t4=$(date +%s)
echo "quickstart.sh: packages and build $((t1 - t0)) s, data $((t2 - t1)) s, training $((t3 - t2)) s," \
  "sample $((t4 - t3)) s; $((t4 - t0)) s in all"
