# The parity corpus, written to FILE: Genesis and Exodus of the King James Bible (Debian's
# bible-kjv, which scripts/deps.sh installs; 366 KB of fixed text). Not the repository's own files,
# as it was: that corpus changed with every edit of docs/design.md, every 20-step comparison moved
# with it, and a layout near its tolerance passed or failed by the last commit to the docs.
parity_corpus() {  # parity_corpus FILE
  command -v bible >/dev/null ||
    { echo "parity corpus: no 'bible' command (Debian package bible-kjv; scripts/deps.sh)" >&2; exit 1; }
  bible -f Gen1:1-Exo40:38 </dev/null | sed -E 's/^[^ ]+ //' >"$1"
}

# Sourced by the parity scripts: `parity_setup NAME` makes a scratch directory $work (removed on
# exit), sets single-threaded passive OpenMP for oversubscribed ranks, the mpirun command array
# `mpi` (needs $mpiexec), and tokenizes the parity corpus into $work/data with a 512-token
# vocabulary (needs $loom).
parity_setup() {
  local name=$1
  work=$(mktemp -d "${TMPDIR:-/tmp}/loom_${name}.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
  mpi=("$mpiexec" --oversubscribe --allow-run-as-root)
  parity_corpus "$work/corpus.txt"
  "$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
    --save-tokenizer "$work/tok.json" >/dev/null
}

# The loss of STEP in a metrics file (--metrics.jsonl).
step_loss() {  # step_loss METRICS STEP
  grep "\"step\": $2," "$1" | grep -o '"loss": [0-9.e-]*' | cut -d' ' -f2
}

# straight12 CKPT_DIR NAME NP ARGS...: the uninterrupted run the resumes are held to: 12 steps with
# NP ranks and the array $common plus ARGS, saving step 10 into CKPT_DIR (step 12's save removed,
# so that a resume takes step 10); sets `want` to its step-11 loss.
straight12() {
  local ck=$1 name=$2 np=$3
  shift 3
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --training.steps=12 --checkpoint.dir="$ck" \
    --checkpoint.interval=10 --checkpoint.keep=0 --metrics.jsonl="$work/$name.jsonl" "$@" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  rm -rf "$ck/step-00000012"
  want=$(step_loss "$work/$name.jsonl" 11)
}

# resume_step11 CKPT_DIR WANT TOL rel|abs NAME NP ARGS...: resumes a copy of CKPT_DIR (a run
# saved at step 10) with NP ranks and the array $common plus ARGS for 11 steps, checks that it
# resumed from step 10 (a run that trained from scratch might pass the tolerance too), prints its
# step-11 loss next to WANT (the uninterrupted run of NAME) and fails when they differ by more than
# TOL, relative or absolute. 11 steps instead of the saved run's 12 change the cosine schedule,
# which the step-11 loss does not depend on: allowed explicitly.
resume_step11() {
  local ck=$1 want=$2 tol=$3 kind=$4 name=$5 np=$6
  shift 6
  rm -rf "$work/ck2" "$work/res.jsonl"
  cp -r "$ck" "$work/ck2"
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --training.steps=11 --checkpoint.dir="$work/ck2" \
    --checkpoint.resume=true --checkpoint.allow_config_change=true --metrics.jsonl="$work/res.jsonl" \
    "$@" >"$work/res.log" 2>&1 || { cat "$work/res.log"; return 1; }
  grep -q "resumed from .*step-00000010 (step 10)" "$work/res.log" ||
    { echo "$name -> np $np $*: did not resume from step 10"; cat "$work/res.log"; return 1; }
  local got diff
  got=$(step_loss "$work/res.jsonl" 11)
  [ -n "$got" ] && [ -n "$want" ] ||
    { echo "$name -> np $np $*: no step-11 loss (resumed '$got', uninterrupted '$want')"; return 1; }
  diff=$(awk -v a="$got" -v b="$want" -v k="$kind" \
    'BEGIN { d = a - b; if (d < 0) d = -d; if (k == "rel") d /= (b < 0 ? -b : b); print d }')
  echo "$name -> np $np $*: step 11 loss $got (uninterrupted: $want; $kind difference $diff)"
  awk -v d="$diff" -v t="$tol" 'BEGIN { exit !(d <= t) }'
}

# as_nobody: sets the array `as_user` to the prefix that runs a command as an ordinary user
# (nobody) when this script runs as root, who writes anywhere, so that a refusal of a read-only
# directory can be proven; empty otherwise. Makes $work readable to that user.
as_nobody() {
  as_user=()
  [ "$(id -u)" = 0 ] || return 0
  command -v setpriv >/dev/null ||
    { echo "running as root needs setpriv (util-linux) to test a read-only directory" >&2; exit 1; }
  chmod -R a+rX "$work"
  as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
}

fail() { echo "FAIL: $*"; exit 1; }
# expect_refused LOG TEXT...: the run of LOG stopped before step 1, saying each TEXT.
expect_refused() {  # expect_refused LOG TEXT...: exited non-zero before step 1, saying each TEXT
  local log=$1
  shift
  ! grep -q '^step' "$log" || { cat "$log"; fail "trained before refusing"; }
  for t in "$@"; do grep -qF -- "$t" "$log" || { cat "$log"; fail "'$t' not in the message"; }; done
}

# resumed_equals_straight STOPPED RESUMED STRAIGHT (metrics files; needs $step, where STOPPED
# stopped, and $end): steps 1-$end of STOPPED then RESUMED equal STRAIGHT's, bit for bit (step,
# loss, lr, gradient norm).
losses() { cat "$@" | grep -o '"step": [0-9]*, "loss": [^,]*, "lr": [^,]*, "grad_norm": [^,]*'; }
resumed_equals_straight() {
  losses "$1" "$2" >"$work/got.txt"
  losses "$3" >"$work/want.txt"
  [ "$(wc -l <"$work/want.txt")" = "$end" ] || fail "the straight run logged no $end steps"
  diff "$work/want.txt" "$work/got.txt" ||
    fail "stopped at $step and resumed, the losses differ from a straight run (< straight)"
  echo "resumed from step $step: steps 1-$end identical to the uninterrupted run"
}
