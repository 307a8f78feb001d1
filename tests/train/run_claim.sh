#!/usr/bin/env bash
# What a run claims before it trains, with real processes: a second run (or resume) on a
# checkpoint.dir in use is refused naming the holder; a dead holder's lock is taken over with a
# note; a fresh run does not truncate another run's metrics.jsonl; a checkpoint.dir that is a file
# or not writable and a broken tokenizer.json are refused before step 1.
#   run_claim.sh LOOM SOURCE_DIR
set -euo pipefail
loom=$1 src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_claim.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
source "$src/tests/parity/setup.sh"
parity_corpus "$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/data/tokenizer.json" >/dev/null
train=("$loom" train --config "$src/configs/debug.toml" --data.path="$work/data"
  --validation.interval=0 --checkpoint.interval=0)

echo "== a second run and a resume on a checkpoint.dir in use"
"${train[@]}" --training.steps=100000 --checkpoint.dir="$work/ck" \
  --metrics.jsonl="$work/a.jsonl" >"$work/a.log" 2>&1 &
a=$!
pids+=("$a")
for _ in $(seq 300); do
  [ "$(cat "$work/a.jsonl" 2>/dev/null | wc -l)" -ge 2 ] && break
  kill -0 "$a" 2>/dev/null || { cat "$work/a.log"; fail "the first run ended early"; }
  sleep 0.1
done
for mode in "--checkpoint.resume=false" "--checkpoint.resume=true"; do
  rc=0
  "${train[@]}" --training.steps=2 --checkpoint.dir="$work/ck" "$mode" \
    --metrics.jsonl="$work/b.jsonl" >"$work/b.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] || { cat "$work/b.log"; fail "a second run ($mode) was not refused"; }
  expect_refused "$work/b.log" "checkpoint.dir '$work/ck' is in use by another loom run (pid=$a host="
  echo "refused ($mode): $(grep -o 'is in use.*lock file [^)]*' "$work/b.log")"
done
[ ! -e "$work/b.jsonl" ] || fail "the refused run wrote $work/b.jsonl"

echo "== a holder that died (kill -9): its lock is taken over with a note"
kill -9 "$a"
wait "$a" 2>/dev/null || true
"${train[@]}" --training.steps=2 --checkpoint.dir="$work/ck" --checkpoint.resume=true \
  --metrics.jsonl="$work/c.jsonl" >"$work/c.log" 2>&1 || { cat "$work/c.log"; fail "takeover run"; }
grep -qF "took over the lock of checkpoint.dir '$work/ck' from a run that ended without releasing it (pid=$a host=" \
  "$work/c.log" || { cat "$work/c.log"; fail "no note of the stale lock"; }
[ ! -s "$work/ck/loom.lock" ] || fail "the lock file still names a holder after a clean end: $(cat "$work/ck/loom.lock")"
echo "taken over: $(grep -o 'took over.*' "$work/c.log")"

echo "== a fresh run does not truncate another run's metrics.jsonl"
lines=$(wc -l <"$work/a.jsonl")
for extra in "--checkpoint.dir=$work/ck2" "--checkpoint.dir=$work/ck3 --checkpoint.resume=true" ""; do
  rc=0
  # shellcheck disable=SC2086
  "${train[@]}" --training.steps=2 $extra --metrics.jsonl="$work/a.jsonl" >"$work/d.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] || { cat "$work/d.log"; fail "a fresh run ($extra) took a.jsonl"; }
  expect_refused "$work/d.log" "metrics.jsonl '$work/a.jsonl' already holds $lines lines of another run" \
    "--metrics.overwrite=true"
done
[ "$(wc -l <"$work/a.jsonl")" = "$lines" ] || fail "a.jsonl changed"
"${train[@]}" --training.steps=2 --metrics.jsonl="$work/a.jsonl" --metrics.overwrite=true \
  >"$work/d.log" 2>&1 || { cat "$work/d.log"; fail "--metrics.overwrite=true was refused"; }
[ "$(wc -l <"$work/a.jsonl")" = 2 ] || fail "overwrite: a.jsonl holds $(wc -l <"$work/a.jsonl") lines, expected 2"
echo "refused $lines lines, replaced with --metrics.overwrite=true"

echo "== an unusable checkpoint.dir, refused before step 1"
echo x >"$work/file"
rc=0
"${train[@]}" --checkpoint.dir="$work/file" >"$work/e.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || fail "checkpoint.dir as a regular file was taken"
expect_refused "$work/e.log" "checkpoint.dir '$work/file' exists and is not a directory"
mkdir "$work/ro"
chmod 555 "$work/ro"
as_nobody
rc=0
HOME=/tmp "${as_user[@]}" "${train[@]}" --checkpoint.dir="$work/ro" >"$work/f.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || { cat "$work/f.log"; fail "a read-only checkpoint.dir was taken"; }
expect_refused "$work/f.log" "checkpoint.dir '$work/ro' is not writable" "Permission denied"
echo "refused: $(grep -o "checkpoint.dir '$work/file' exists[^(]*" "$work/e.log")"
echo "refused: $(grep -o "checkpoint.dir '$work/ro' is not writable.*" "$work/f.log")"

echo "== a truncated tokenizer.json, refused before step 1"
cp -r "$work/data" "$work/data2"
head -c 2000 "$work/data/tokenizer.json" >"$work/data2/tokenizer.json"
rc=0
"${train[@]}" --data.path="$work/data2" --checkpoint.dir="$work/ck4" >"$work/g.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || { cat "$work/g.log"; fail "a truncated tokenizer.json was taken"; }
expect_refused "$work/g.log" "the tokenizer '$work/data2/tokenizer.json'" "cannot be read"
[ -z "$(ls -A "$work/ck4" 2>/dev/null | grep -v loom.lock)" ] || fail "the refused run saved into ck4"
echo "refused: $(grep -o "the tokenizer .*cannot be read" "$work/g.log")"
echo "all claims held"
