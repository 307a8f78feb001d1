#!/usr/bin/env bash
# `loom tokenize` throughput on a compressed JSONL dataset, by thread count:
#   bench/tokenize_bench.sh [BUILD_DIR] [WORK_DIR]     (defaults: build, /tmp/loom-tokenize-bench)
# Makes WORK_DIR/kjv.jsonl.zst (~50 MB of JSONL before compression) from Debian's bible-kjv: the
# Bible's verses grouped into documents of 1-40 verses, 12 times over, each pass with its own
# grouping and wording (references dropped, case changed, words swapped) so that documents
# differ. Trains a 4096-id tokenizer on it once (--train-vocab), then runs `loom tokenize
# --tokenizer` 3 times at each OMP_NUM_THREADS (1 and 2; THREADS="1 2 4" to change) and prints
# the median tokens/s of each, the load average before and after, and `cmp`s every run's shards
# with the first's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="${2:-/tmp/loom-tokenize-bench}"
threads=(${THREADS:-1 2})
loom="$build/loom"
[ -x "$loom" ] || { echo "no $loom: build the loom target first" >&2; exit 1; }
command -v bible > /dev/null || { echo "bible (Debian's bible-kjv) is missing: scripts/deps.sh" >&2; exit 1; }
command -v zstd > /dev/null || { echo "zstd is missing: scripts/deps.sh" >&2; exit 1; }
mkdir -p "$work"

if [ ! -s "$work/kjv.jsonl.zst" ]; then
  bible -f Gen1:1-Rev22:21 > "$work/kjv.txt"
  python3 - "$work/kjv.txt" > "$work/kjv.jsonl" << 'EOF'
import json, random, sys
verses = [l.rstrip("\n") for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
swaps = [("LORD", "Lord"), (" and ", " & "), ("unto", "to"), ("thee", "you"), ("hath", "has"),
         ("shalt", "shall"), ("saith", "says"), ("behold", "look")]
for p in range(12):
    rng = random.Random(p)
    i = 0
    while i < len(verses):
        n = rng.randint(1, 40)
        doc = []
        for v in verses[i:i + n]:
            if p % 3 != 0:
                v = v.split(" ", 1)[-1]  # drop the "Ge1:1" reference
            for a, b in swaps[p % len(swaps):p % len(swaps) + p % 4]:
                v = v.replace(a, b)
            if p % 5 == 4:
                v = v.lower()
            doc.append(v)
        if p % 2:
            doc.reverse()
        print(json.dumps({"id": f"{p}-{i}", "text": ("\n" if p % 4 else " ").join(doc)}))
        i += n
EOF
  zstd -q -f -19 -T0 "$work/kjv.jsonl" -o "$work/kjv.jsonl.zst"
  rm -f "$work/kjv.txt"
fi
echo "input: $(du -b "$work/kjv.jsonl.zst" | cut -f1) bytes of zstd ($(du -b "$work/kjv.jsonl" | cut -f1) of JSONL)"
if [ ! -s "$work/kjv4096.json" ]; then
  "$loom" tokenize --input "$work/kjv.jsonl.zst" --output "$work/trained" --train-vocab 4096 \
    --save-tokenizer "$work/kjv4096.json" | grep -E "trained|encoded"
fi

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)  ($(nproc) cores)"
first=""
for t in "${threads[@]}"; do
  rates=()
  for run in 1 2 3; do
    out="$work/out-t$t-r$run"
    log=$(OMP_NUM_THREADS=$t "$loom" tokenize --input "$work/kjv.jsonl.zst" --output "$out" \
            --tokenizer "$work/kjv4096.json" --val-fraction 0.01)
    line=$(grep "^encoded in" <<< "$log")
    rates+=("$(sed -E 's/.* ([0-9]+) tokens\/s/\1/' <<< "$line")")
    echo "  threads $t run $run: $line"
    if [ -z "$first" ]; then
      first=$out
    else
      for f in "$first"/train-*.bin "$first"/val-*.bin; do
        cmp "$f" "$out/$(basename "$f")"
      done
      [ "$(ls "$first" | grep -c '\.bin$')" = "$(ls "$out" | grep -c '\.bin$')" ] ||
        { echo "$out has another number of shards than $first" >&2; exit 1; }
    fi
  done
  median=$(printf '%s\n' "${rates[@]}" | sort -n | sed -n 2p)
  echo "threads $t: median $median tokens/s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "shards of every run identical (cmp)"
