#!/usr/bin/env bash
# Produces the reference fixtures of the tokenizer tests and benchmark:
#   tests/tokenizer/setup.sh OUT_DIR
# Installs the npm reference tokenizers (npm ci, from the committed package-lock.json) when they
# are missing or stale, prints the King James Bible with Debian's bible-kjv, and runs
# gen_fixtures.mjs. Does nothing when OUT_DIR already holds fixtures made by the same scripts,
# lock file and Node version. Safe to run from several test processes at once (flock).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?usage: setup.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

die() {
  echo "tokenizer fixtures: $*" >&2
  exit 1
}
command -v node > /dev/null || die "node is not installed (scripts/deps.sh installs it)"
command -v npm > /dev/null || die "npm is not installed (scripts/deps.sh installs it)"
[ -x /usr/bin/bible ] || die "/usr/bin/bible is missing (Debian package bible-kjv; scripts/deps.sh)"

exec 9> "$out/.lock"
flock 9

key="$(cat "$here/package-lock.json" "$here/gen_fixtures.mjs" "$here/setup.sh" | sha256sum | cut -c1-32) $(node --version)"
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$key" ]; then
  exit 0
fi
rm -f "$out/stamp"

lock_sum="$(sha256sum < "$here/package-lock.json" | cut -c1-32)"
if [ ! -f "$here/node_modules/.loom-lock-sum" ] ||
   [ "$(cat "$here/node_modules/.loom-lock-sum")" != "$lock_sum" ]; then
  echo "tokenizer fixtures: npm ci in $here" >&2
  (cd "$here" && npm ci --no-audit --no-fund --loglevel=error) ||
    die "npm ci failed in $here (the npm registry must be reachable once)"
  echo "$lock_sum" > "$here/node_modules/.loom-lock-sum"
fi

# The whole Bible, pretty-printed (book and chapter headings, indented verses, wrapped lines).
bible Gen1:1-Rev22:21 > "$out/bible.txt" || die "bible failed"
[ "$(stat -c %s "$out/bible.txt")" -gt 4000000 ] || die "bible printed less than 4 MB"

echo "tokenizer fixtures: generating into $out" >&2
node "$here/gen_fixtures.mjs" "$out" > "$out/counts.json" || die "gen_fixtures.mjs failed"
echo "$key" > "$out/stamp"
