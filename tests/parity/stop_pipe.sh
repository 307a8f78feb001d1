#!/bin/bash
# A closed stdout never kills a run, and a stop saves. Ctrl-C on `loom train ... | tee log` in a
# terminal signals the whole pipeline: tee dies at once, loom finishes its step, finds its stdout
# gone (noted once on stderr and in its rank log), saves the step and exits 3; resumed, it gives
# the losses of an uninterrupted run bit for bit. `loom train ... | head -3` runs to its end and
# saves (it died of SIGPIPE before step 1).
#   stop_pipe.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup stop_pipe
# No decay: the number of steps does not change the learning rate of any step, so the interrupted
# run (100000 steps) and the resumed and uninterrupted ones (a few past the stop) share the math.
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --lr_scheduler.decay_type=none
  --validation.interval=0)
note='cannot write progress to stdout'

# The step, loss, lr and grad_norm of each line of metrics files.

# The pipeline in a pseudo-terminal of its own, as its foreground process group; after 3 steps
# the terminal gets a Ctrl-C (the byte, so the line discipline signals the group, as a terminal
# does). The shell traps SIGINT, as an interactive one survives it, to report loom's exit code.
cat >"$work/pipeline.sh" <<EOF
trap : INT
"$loom" train ${common[*]@Q} --training.steps=100000 --checkpoint.dir="$work/ck" \
  --checkpoint.interval=0 --metrics.jsonl="$work/int.jsonl" --job.rank_logs=true \
  --job.dump_dir="$work/runs" 2>"$work/int.err" | tee "$work/tee.log"
echo "\${PIPESTATUS[0]}" >"$work/rc"
EOF
/usr/bin/python3 - "$work" <<'PY'
import os, pty, select, signal, sys, time
work = sys.argv[1]
pid, fd = pty.fork()
if pid == 0:
    # As in a terminal's shell: Python ignores SIGPIPE, and a harness may run this with SIGINT
    # ignored; both would be inherited, and loom would not meet the closed pipe it must survive.
    for s in (signal.SIGINT, signal.SIGPIPE):
        signal.signal(s, signal.SIG_DFL)
    os.execv("/bin/bash", ["bash", os.path.join(work, "pipeline.sh")])
transcript = b""
def drain(seconds):  # reads what the pipeline shows (a full pty would block tee); False at EOF
    global transcript
    r, _, _ = select.select([fd], [], [], seconds)
    if not r:
        return True
    try:
        data = os.read(fd, 65536)
    except OSError:  # EIO: every writer of the terminal has gone
        return False
    transcript += data
    return bool(data)
def steps():
    try:
        with open(os.path.join(work, "int.jsonl")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
deadline = time.time() + 60
while steps() < 3 and time.time() < deadline and drain(0.05):
    pass
os.write(fd, b"\x03")
while time.time() < deadline and drain(1):
    pass
_, status = os.waitpid(pid, 0)
sys.stdout.write(transcript.decode(errors="replace")[-2000:])
print(f"\n[pty] Ctrl-C after {steps()} logged steps; shell status {status}")
PY
echo "== loom's stderr"
cat "$work/int.err"
echo "== rank log"
tail -n 3 "$work/runs/logs/rank-0.log"
rc=$(cat "$work/rc" 2>/dev/null || echo none)
[ "$rc" = 3 ] || { echo "FAIL: loom train | tee, Ctrl-C: exit code $rc, expected 3"; exit 1; }
n=$(grep -c "$note" "$work/int.err" || true)
[ "$n" = 1 ] || { echo "FAIL: the lost stdout was noted $n times on stderr, expected once"; exit 1; }
grep -q "$note" "$work/runs/logs/rank-0.log" ||
  { echo "FAIL: the lost stdout is not noted in the rank log"; exit 1; }
stopped=$(grep -o 'stopped by signal at step [0-9]*' "$work/runs/logs/rank-0.log") ||
  { echo "FAIL: the rank log does not say where the run stopped"; exit 1; }
step=${stopped##* }
[ -f "$work/ck/$(printf 'step-%08d' "$step")/state.json" ] ||
  { echo "FAIL: no checkpoint of step $step in $work/ck: $(ls "$work/ck")"; exit 1; }
echo "Ctrl-C on loom train | tee: exit 3, the lost stdout noted once, step $step saved"

# Resumed to 6 steps past the stop, against the same steps run straight through.
end=$((step + 6))
"$loom" train "${common[@]}" --training.steps=$end --checkpoint.dir="$work/ck" \
  --checkpoint.resume=true --metrics.jsonl="$work/res.jsonl" >"$work/res.log" 2>&1 ||
  { cat "$work/res.log"; echo "FAIL: the resume failed"; exit 1; }
grep -q "resumed from .*(step $step)" "$work/res.log" ||
  { cat "$work/res.log"; echo "FAIL: did not resume from step $step"; exit 1; }
"$loom" train "${common[@]}" --training.steps=$end --metrics.jsonl="$work/straight.jsonl" \
  >"$work/straight.log" 2>&1 || { cat "$work/straight.log"; exit 1; }
head -n "$step" "$work/int.jsonl" >"$work/int_kept.jsonl"
resumed_equals_straight "$work/int_kept.jsonl" "$work/res.jsonl" "$work/straight.jsonl"

# `| head -3` takes the first lines and goes: the run goes on to its last step and saves it. SIGPIPE
# at its default, as in a terminal, whatever this script inherited.
env --default-signal=PIPE bash -c '"$@" 2>"$0" | head -3; echo "${PIPESTATUS[0]}" >"$0.rc"' \
  "$work/head.err" "$loom" train "${common[@]}" --training.steps=5 --checkpoint.dir="$work/ck_head"
rc=$(cat "$work/head.err.rc")
cat "$work/head.err"
[ "$rc" = 0 ] || { echo "FAIL: loom train | head -3: exit code $rc, expected 0"; exit 1; }
[ -f "$work/ck_head/step-00000005/state.json" ] ||
  { echo "FAIL: loom train | head -3 saved no step 5: $(ls "$work/ck_head")"; exit 1; }
[ "$(grep -c "$note" "$work/head.err")" = 1 ] ||
  { echo "FAIL: loom train | head -3 did not note the lost stdout once"; exit 1; }
echo "loom train | head -3: ran to step 5 and saved it"
