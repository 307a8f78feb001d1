#!/bin/bash
# Slurm for real: Debian's slurmctld, slurmd and munged, configured here for this one node (a
# private slurm.conf, munge key and socket, state and spool in a scratch directory, the daemons
# started here and stopped on exit whatever happens), and loom run as a cluster's users run it,
# through scripts/slurm/train.sbatch:
#   1. `srun --mpi=list` offers pmix (Debian's slurm-wlm-basic-plugins: mpi_pmix_v4).
#   2. sbatch of a 2-task job whose `srun --mpi=pmix loom train` (FSDP dp_shard=2, the debug
#      model, 20 steps) logs the losses of `mpirun -np 2` of the same job, bit for bit.
#   3. srun --mpi=none (and --mpi=pmi2) of 2 tasks: loom stops before MPI_Init, saying to launch
#      with `srun --mpi=pmix` or mpirun (Open MPI's own message asks to rebuild Open MPI); one
#      task under --mpi=none trains as a single process.
#   4. Two 2-task jobs with a 1-minute time limit, side by side, each stopped and requeued:
#      T  no --signal: the time limit's SIGTERM reaches every rank (twice: from the step daemon
#         and again through srun); they finish the step, save it within KillWait and exit 3;
#         the finished job is requeued by hand (scontrol requeue).
#      U  train.sbatch's recipe, --signal=B:USR1@N: the batch script hands SIGUSR1 to srun, which
#         forwards it to the ranks; they save and exit 3 before the limit; the script requeues
#         the job itself.
#      Each requeued job resumes from its checkpoint, and its steps up to 3 past the stop equal an
#      uninterrupted run's (job S, alongside) bit for bit (step, loss, lr, gradient norm). Then T is
#      cancelled, and U stopped by `scancel --signal=USR1`: saved, exit 3, not requeued.
#   slurm.sh LOOM MPIEXEC SOURCE_DIR
# Needs root (the daemons run as root, SlurmUser=root); exits 77 (skipped) without root or
# without slurmctld, slurmd and munged (scripts/deps.sh test installs them). Figures are printed
# as "figure: ..." lines.
set -euo pipefail
loom=$(readlink -f "$1") mpiexec=$2 src=$(readlink -f "$3")
for c in slurmctld slurmd munged sbatch srun scontrol; do
  command -v "$c" >/dev/null || { echo "SKIP: no $c (Debian's slurmctld, slurmd, munge)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "SKIP: the private Slurm's daemons run as root"; exit 77; }
source "$src/tests/parity/setup.sh"
t0=$(date +%s)
parity_setup slurm
# The daemons read this, and the jobs and the commands below inherit it.
export SLURM_CONF=$work/slurm.conf
# Munge refuses a socket directory others cannot enter, and a key others can write.
chmod 755 "$work"

pids=()
cleanup() {
  local p rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then
    for f in "$work"/log/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 20 "$f"; }; done
  fi
  # The jobs first, while the daemons can still end them (the ranks save and exit).
  if [ -n "${SLURM_CONF:-}" ] && scontrol ping >/dev/null 2>&1; then
    local ids
    mapfile -t ids < <(squeue -h -o %i 2>/dev/null)
    [ ${#ids[@]} = 0 ] || scancel --full "${ids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  # What the daemons started and outlived them (slurmstepd daemonizes): found by the tag they
  # and the jobs inherit from this script.
  # Read whole before any kill: the reading processes carry the tag too, and are gone by then.
  local stray
  mapfile -t stray < <(grep -lsz "^LOOM_SLURM_DRILL=$tag\$" /proc/[0-9]*/environ | cut -d/ -f3)
  for p in "${stray[@]}"; do
    if [ "$p" != $$ ]; then kill -9 "$p" 2>/dev/null || true; fi
  done
  rm -rf "$work"
}
export LOOM_SLURM_DRILL=slurm$$
tag=$LOOM_SLURM_DRILL
trap cleanup EXIT
trap 'exit 130' INT TERM

# Two free ports for slurmctld and slurmd.
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 30000))
    [ -z "$(ss -Hltn "sport = :$p" 2>/dev/null)" ] && { echo "$p"; return; }
  done
}
ctld_port=$(free_port)
slurmd_port=$(free_port)
[ "$slurmd_port" != "$ctld_port" ] || slurmd_port=$((ctld_port + 1))
node=$(hostname -s)
mkdir -p "$work/munge" "$work/state" "$work/spool" "$work/log"
chmod 711 "$work/munge"
head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 400 "$work/munge/munge.key"
# cred_expire: how long a requeued job waits before it may start again (120 s by default);
# sched_interval: how often pending jobs are tried (60 s by default), a requeued one among them.
# KillWait: the grace between a time limit's SIGTERM and the SIGKILL (Slurm's default, 30 s).
# CPUs=6 on any machine (config_overrides): jobs T, U and S, 2 tasks each, run side by side.
cat >"$SLURM_CONF" <<EOF
ClusterName=loomdrill
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.socket,cred_expire=10
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=6 State=UNKNOWN
PartitionName=drill Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
# slurmd 22.05 starts its cgroup plugin whatever the other plugins (CgroupPlugin=autodetect: "No
# filesystem mounted on /sys/fs/cgroup" in a chroot such as fresh-debian12's, and slurmd exits).
# Named, cgroup/v1 starts without touching /sys/fs/cgroup, and nothing here uses it.
echo "CgroupPlugin=cgroup/v1" >"$work/cgroup.conf"
munged --foreground --force --socket="$work/munge/munge.socket" \
  --key-file="$work/munge/munge.key" --pid-file="$work/munge/munged.pid" \
  --seed-file="$work/munge/munged.seed" --log-file="$work/log/munged.log" \
  >"$work/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/munge/munge.socket" ] && break; sleep 0.1; done
slurmctld -D -c >"$work/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D >"$work/log/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 300); do
  [ "$(sinfo -h -n "$node" -o %T 2>/dev/null)" = idle ] && break
  sleep 0.2
done
[ "$(sinfo -h -n "$node" -o %T 2>/dev/null)" = idle ] ||
  { cat "$work/log/"*.out; fail "the node did not come up idle: $(sinfo 2>&1)"; }
echo "figure: private Slurm $(sinfo -V | cut -d' ' -f2) up in $(($(date +%s) - t0)) s (node $node)"

# 1. What srun offers to wire MPI tasks up.
plugins=$(srun --mpi=list 2>&1)
echo "$plugins"
echo "$plugins" | grep -qw pmix || fail "srun --mpi=list offers no pmix (slurm-wlm-basic-plugins)"

# No decay: the number of steps does not change the learning rate of any step, so interrupted
# jobs (100000 steps) and an uninterrupted run stopped a few steps past them share the math.
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --lr_scheduler.decay_type=none
  --validation.interval=0 --parallelism.dp_shard=2 --training.local_batch_size=2)
export LOOM=$loom

# 2. sbatch + srun against mpirun.
show() { grep -v '^step *[0-9]*/' "$1" || true; }  # a job's output without its step lines
rc=0
sbatch --parsable --wait --chdir="$work" --ntasks=2 --output="$work/a.out" \
  "$src/scripts/slurm/train.sbatch" "${common[@]}" --training.steps=20 --checkpoint.dir="$work/ck_a" \
  --metrics.jsonl="$work/a.jsonl" >/dev/null || rc=$?
show "$work/a.out"
[ "$rc" = 0 ] || { cat "$work/a.out"; fail "the sbatch job exited $rc"; }
grep -q "dp_shard=2 .*(2 ranks), FSDP" "$work/a.out" || fail "the srun job did not train as 2 ranks"
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=20 \
  --metrics.jsonl="$work/a_mpirun.jsonl" >"$work/a_mpirun.log" 2>&1 ||
  { cat "$work/a_mpirun.log"; fail "mpirun -np 2 failed"; }
losses "$work/a.jsonl" >"$work/a_srun.txt"
losses "$work/a_mpirun.jsonl" >"$work/a_mpirun.txt"
[ "$(wc -l <"$work/a_srun.txt")" = 20 ] || fail "the srun job logged $(wc -l <"$work/a_srun.txt") steps, not 20"
diff "$work/a_mpirun.txt" "$work/a_srun.txt" || fail "sbatch + srun losses differ from mpirun's (< mpirun)"
echo "figure: sbatch + srun --mpi=pmix, 20 steps, FSDP 2: losses equal mpirun -np 2's bit for bit" \
  "(step 1 $(step_loss "$work/a.jsonl" 1), step 20 $(step_loss "$work/a.jsonl" 20))"

# 3. Without PMIx: loom's own message, before MPI_Init.
for plugin in none pmi2; do
  rc=0
  srun --ntasks=2 --mpi=$plugin "$loom" train "${common[@]}" --training.steps=2 \
    >"$work/np.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] || { cat "$work/np.log"; fail "srun --mpi=$plugin: loom trained"; }
  expect_refused "$work/np.log" "without PMIx (srun's MPI plugin: $plugin)" "srun --mpi=pmix" \
    "mpirun loom"
  ! grep -q "OMPI was not built with SLURM's PMI support" "$work/np.log" ||
    { cat "$work/np.log"; fail "srun --mpi=$plugin: Open MPI's message, not loom's"; }
  echo "srun --mpi=$plugin, 2 tasks: refused (exit $rc): $(grep -m1 -o 'srun started.*PMIx[^:]*' "$work/np.log")"
done
# One task without a plugin needs no MPI: it trains as a single process.
srun --ntasks=1 --mpi=none "$loom" train "${common[@]}" --parallelism.dp_shard=1 \
  --training.steps=2 >"$work/np.log" 2>&1 || { cat "$work/np.log"; fail "srun --mpi=none, 1 task"; }
grep -q "^step *2/2 " "$work/np.log" ||
  { cat "$work/np.log"; fail "srun --mpi=none, 1 task: no step 2"; }
echo "srun --mpi=none, 1 task: trained as one process"

# 4. Time limits. The uninterrupted run is a job too, S, alongside T and U at the same pace (as
# a mpirun run beside them it went at a third of theirs), stopped once past both stops.
long=("${common[@]}" --training.steps=100000 --checkpoint.interval=0)
straight=$(sbatch --parsable --chdir="$work" --ntasks=2 --output="$work/s.out" \
  --wrap="srun --mpi=pmix $loom train ${long[*]} --metrics.jsonl=$work/straight.jsonl")
# T: the same srun line without the script's --signal; requeued by hand once it timed out.
t=$(sbatch --parsable --chdir="$work" --ntasks=2 --time=1 --open-mode=append --output="$work/t.out" \
  --wrap="srun --mpi=pmix $loom train ${long[*]} --checkpoint.resume=true \
--checkpoint.dir=$work/ck_t --metrics.jsonl=$work/t.jsonl")
# U: the example script, its SIGUSR1 N s ahead of the limit. Slurm sends it once at most N + 30 s
# ahead (its checks run every 30 s): with N = 10, between 20 and 50 s into the minute.
u=$(sbatch --parsable --chdir="$work" --ntasks=2 --time=1 --signal=B:USR1@10 --output="$work/u.out" \
  "$src/scripts/slurm/train.sbatch" "${long[@]}" --checkpoint.dir="$work/ck_u" \
  --metrics.jsonl="$work/u.jsonl")
echo "submitted T = job $t (time limit, SIGTERM) and U = job $u (train.sbatch, SIGUSR1 ahead)" \
  "$(($(date +%s) - t0)) s in"

job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
restarts() { scontrol show job "$1" | grep -o 'Restarts=[0-9]*' | cut -d= -f2; }
# wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds, or fails naming WHAT.
wait_for() {
  local limit=$1 what=$2
  shift 2
  local end=$(($(date +%s) + limit))
  until "$@"; do
    [ "$(date +%s)" -lt "$end" ] ||
      { for j in t u; do echo "== ${j^^}"; show "$work/$j.out"; done; fail "$what (waited $limit s)"; }
    sleep 0.5
  done
}
stopped_at() { { grep -m 1 -o 'stopped by signal at step [0-9]*' "$1" | grep -o '[0-9]*$'; } || true; }
saved_took() {  # saved_took OUT STEP: the save's own time, as loom printed it
  { grep -m 1 -o "saved .*step-0*$2 ([0-9.]* s)" "$1" | grep -o '[0-9.]* s'; } || true
}
# When the job's script printed "$2 <date>" (train.sbatch's lines), in seconds.
printed_at() { date -d "$(grep -m 1 -o "$2 [0-9]\{4\}-[0-9T:+-]*" "$1" | awk '{ print $NF }')" +%s; }
resumed() { grep -qs "resumed from .*(step $2)" "$1"; }
logged() { grep -qs "\"step\": $2," "$1"; }

# T stopped at its limit: both ranks saved and exited 3; requeued by hand.
t_stopped() {
  [ "$(job_state "$t")" = TIMEOUT ] || return 1
  show "$work/t.out"
  s_t=$(stopped_at "$work/t.out")
  [ -n "$s_t" ] || fail "job T: the time limit's SIGTERM did not stop the run with a save"
  grep -q "tasks 0-1: Exited with exit code 3" "$work/t.out" ||
    fail "job T: the ranks did not both exit 3 (saved) after the time limit's SIGTERM"
  local ck limit_at
  ck=$(printf '%s/ck_t/step-%08d' "$work" "$s_t")
  [ -f "$ck/state.json" ] || fail "job T: no checkpoint of step $s_t: $(ls "$work/ck_t")"
  limit_at=$(date -d "$(grep -m 1 -o 'CANCELLED AT [0-9T:-]* DUE TO TIME LIMIT' "$work/t.out" |
    cut -d' ' -f3)" +%s)
  echo "figure: job T: the time limit's SIGTERM -> both ranks saved step $s_t" \
    "($(saved_took "$work/t.out" "$s_t")) and exited 3; checkpoint complete" \
    "$(($(stat -c %Y "$ck/state.json") - limit_at)) s after the limit (1 s resolution; KillWait 30 s;" \
    "$(($(date +%s) - t0)) s in)"
  scontrol requeue "$t"
}
# U stopped by its script's SIGUSR1: both ranks saved and exited 3; the script requeued the job.
u_stopped() {
  grep -qs "loom job $u end" "$work/u.out" || return 1
  s_u=$(stopped_at "$work/u.out")
  grep -q "SIGUSR1 at" "$work/u.out" || { show "$work/u.out"; fail "job U: the script saw no SIGUSR1"; }
  [ -n "$s_u" ] && grep -q "tasks 0-1: Exited with exit code 3" "$work/u.out" ||
    { show "$work/u.out"; fail "job U: the ranks did not both save and exit 3 after SIGUSR1"; }
  echo "figure: job U: SIGUSR1 $(($(printed_at "$work/u.out" 'SIGUSR1 at') - $(printed_at \
    "$work/u.out" start))) s into its minute (--signal=B:USR1@10), handed to srun -> both ranks" \
    "saved step $s_u ($(saved_took "$work/u.out" "$s_u")) and exited 3; the script requeued the job" \
    "($(($(date +%s) - t0)) s in)"
}
# A requeued job resumed from its stop and logged 3 more steps: stopped before U's script could
# stop and requeue it again: T by scancel (SIGTERM), U by `scancel --signal=USR1`, which reaches
# the ranks alone: they save and exit 3, and the script, which saw no SIGUSR1 of its own, does not
# requeue the job.
resumed3() {  # resumed3 NAME JOB STEP
  local j=${1,}
  resumed "$work/$j.out" "$3" && logged "$work/$j.jsonl" $(($3 + 3)) || return 1
  if [ "$1" = T ]; then scancel "$2"; else scancel --signal=USR1 "$2"; fi
  echo "job $1 (restarts: $(restarts "$2")) resumed from step $3 ($(($(date +%s) - t0)) s in)"
}
# Both jobs at once: each moves on as soon as it can, so that U (stopped 20-50 s in, requeued 11+
# s later) is caught before its next SIGUSR1 while T waits for its limit (60-90 s).
phase_t=run phase_u=run
jobs_done() {
  case $phase_t in
    run) t_stopped && phase_t=requeued ;;
    requeued) resumed3 T "$t" "$s_t" && phase_t=over ;;
  esac
  case $phase_u in
    run) u_stopped && phase_u=requeued ;;
    requeued) resumed3 U "$u" "$s_u" && phase_u=over ;;
  esac
  [ "$phase_t$phase_u" = overover ]
}
wait_for 400 "the jobs did not stop, requeue and resume" jobs_done
u_ended() { [ "$(job_state "$u")" = FAILED ]; }  # FAILED: the script's exit 3
wait_for 120 "job U did not end after scancel --signal=USR1 (requeued?)" u_ended
scontrol show job "$u" | grep -q "ExitCode=3:0" ||
  fail "job U: $(scontrol show job "$u" | grep -o 'ExitCode=[0-9:]*') after scancel --signal=USR1"
echo "job U: scancel --signal=USR1 -> saved, exit 3, not requeued (restarts: $(restarts "$u");" \
  "$(($(date +%s) - t0)) s in)"
declare -A stop=([T]=$s_t [U]=$s_u)
end=$((s_t > s_u ? s_t + 3 : s_u + 3))
wait_for 300 "the uninterrupted run logged no step $end" logged "$work/straight.jsonl" "$end"
scancel --signal=USR1 "$straight"
echo "the uninterrupted run stopped past step $end ($(($(date +%s) - t0)) s in)"
losses "$work/straight.jsonl" >"$work/want.txt"
for j in T U; do
  n=$((stop[$j] + 3))
  losses "$work/${j,}.jsonl" >"$work/got_all.txt"
  head -n "$n" "$work/got_all.txt" >"$work/got.txt"
  head -n "$n" "$work/want.txt" | diff - "$work/got.txt" ||
    fail "job $j: stopped at ${stop[$j]} and requeued, the losses differ from an uninterrupted run's (<)"
  echo "figure: job $j: stopped at step ${stop[$j]}, requeued; step $((stop[$j] + 1)) loss" \
    "$(step_loss "$work/${j,}.jsonl" $((stop[$j] + 1)))" \
    "(uninterrupted: $(step_loss "$work/straight.jsonl" $((stop[$j] + 1)))); steps 1-$n identical"
done
echo "figure: the Slurm drill took $(($(date +%s) - t0)) s"
