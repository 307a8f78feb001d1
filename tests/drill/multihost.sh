#!/bin/bash
# The multi-host fault drill: two hosts made of network namespaces on this machine, loom trained
# across them with FSDP over Open MPI's TCP transport, then the network degraded and cut.
#   multihost.sh LOOM MPIEXEC PARITY_COMPARE SOURCE_DIR
# Topology (all of it inside namespaces made here and removed on exit, whatever happens):
#   <tag>-c   the launcher's namespace: mpirun, a bridge br0 10.78.0.254/24 (management network)
#   <tag>-a   host A: m0 10.78.0.1 (management, on the bridge), d0 10.77.0.1 (data link)
#   <tag>-b   host B: m0 10.78.0.2 (management, on the bridge), d0 10.77.0.2 (data link)
# Open MPI's daemons talk over the management network (oob_tcp_if_include), the ranks over the
# data link only (pml ob1, btl tcp,self, btl_tcp_if_include), so cutting the data link leaves the
# launcher able to end the job. mpirun reaches each host through an rsh agent that runs the
# command in the host's namespace with nsenter (not `ip netns exec`, which remounts / and fails in a
# chroot such as fresh-debian12's) and in its own UTS namespace, so each host has its own name.
# Drills:
#   1. FSDP dp_shard=2, one rank per host, 20 steps of the debug model: per-step losses and final
#      weights equal the single-process run's (parity_compare, 1e-5).
#   2. tc netem delay 20ms loss 1% on both ends of the data link (without sch_netem in the kernel:
#      tbf 20 Mbit/s and nftables dropping 1%): slower, still equal (1e-5).
#   3. The data link (still degraded, so steps are slow) cut (ip link set down) after step 12 of
#      a run saving every 5 steps with job.collective_timeout_s=5: the job ends non-zero within the timeout (+ a margin for the
#      abort), a TIMEOUT line names the group (mesh dim) and the peer's world rank; the link back
#      up, the run resumes from step 10 and its step 11 loss equals the uninterrupted run's.
# Needs root (ip netns, tc); exits 77 (skipped) where namespaces cannot be made.
# Figures are printed as "figure: ..." lines.
set -euo pipefail
loom=$1 mpiexec=$2 compare=$3 src=$4
loom=$(readlink -f "$loom") compare=$(readlink -f "$compare")
tag=lfd$$
nsc=$tag-c nsa=$tag-a nsb=$tag-b
timeout_s=5
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_drill.XXXXXX")

child=
# `ip netns add` makes /run/netns a mount point when it is not one; undone at the end when this
# drill made it and left nothing in it (else a chroot's /run could not be removed).
mountpoint -q /run/netns 2>/dev/null && netns_mounted_before=1 || netns_mounted_before=0
cleanup() {
  local ns pid
  [ -n "$child" ] && kill -9 "$child" 2>/dev/null || true
  for ns in "$nsa" "$nsb" "$nsc"; do
    ip netns pids "$ns" 2>/dev/null | while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done
  done
  for ns in "$nsa" "$nsb" "$nsc"; do ip netns del "$ns" 2>/dev/null || true; done
  if [ "$netns_mounted_before" = 0 ] && [ -z "$(ip netns list 2>/dev/null)" ]; then
    umount /run/netns 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
# A command in a namespace. Not `ip -n` / `ip netns exec`: they remount / (mount --make-rslave),
# which a chroot such as fresh-debian12's refuses; nsenter only switches the network namespace.
in_ns() {
  local ns=$1
  shift
  nsenter --net=/run/netns/"$ns" "$@"
}
trap 'exit 130' INT TERM
# Namespaces left by a drill that was killed (SIGKILL, no cleanup): removed when their script is gone.
for ns in $(ip netns list 2>/dev/null | grep -oE '^lfd[0-9]+-[abc]' || true); do
  pid=${ns#lfd}; pid=${pid%-*}
  if ! kill -0 "$pid" 2>/dev/null; then
    ip netns pids "$ns" 2>/dev/null | while read -r p; do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  fi
done

if [ "$(id -u)" != 0 ] || ! ip netns add "$nsc" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces (needs root and iproute2)"
  exit 77
fi
ip netns add "$nsa"
ip netns add "$nsb"
for ns in "$nsc" "$nsa" "$nsb"; do in_ns "$ns" ip link set lo up; done
in_ns "$nsc" ip link add br0 type bridge
in_ns "$nsc" ip addr add 10.78.0.254/24 dev br0
in_ns "$nsc" ip link set br0 up
i=1
for ns in "$nsa" "$nsb"; do
  in_ns "$ns" ip link add m0 type veth peer name p$i netns "$nsc"
  in_ns "$ns" ip addr add 10.78.0.$i/24 dev m0
  in_ns "$ns" ip link set m0 up
  in_ns "$nsc" ip link set p$i master br0
  in_ns "$nsc" ip link set p$i up
  i=$((i + 1))
done
in_ns "$nsa" ip link add d0 type veth peer name d0 netns "$nsb"
in_ns "$nsa" ip addr add 10.77.0.1/24 dev d0
in_ns "$nsb" ip addr add 10.77.0.2/24 dev d0
in_ns "$nsa" ip link set d0 up
in_ns "$nsb" ip link set d0 up

cat >"$work/agent.sh" <<AGENT
#!/bin/sh
# Open MPI's rsh agent: "agent.sh HOST COMMAND..." runs COMMAND (a shell command, as ssh would)
# in HOST's namespace, under a host name of its own.
host=\$1; shift
case \$host in
  10.78.0.1) ns=$nsa name=drill-a ;;
  10.78.0.2) ns=$nsb name=drill-b ;;
  *) echo "agent.sh: unknown host \$host" >&2; exit 1 ;;
esac
exec nsenter --net=/run/netns/"\$ns" unshare --uts sh -c "hostname \$name; \$*"
AGENT
chmod +x "$work/agent.sh"
printf '10.78.0.1 slots=1\n10.78.0.2 slots=1\n' >"$work/hosts"

export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
# mpirun in the launcher's namespace; every run bounded by `timeout`.
# In the background and waited for: `wait` returns at once on a signal, so the cleanup runs then
# (bash would defer the trap until a foreground command ends).
multihost() {
  multihost_bg "$@" &
  child=$!
  wait "$child"
}
multihost_bg() {
  local limit=$1
  shift
  exec timeout -k 5 "$limit" nsenter --net=/run/netns/"$nsc" unshare --uts sh -c 'hostname drill-c; exec "$@"' sh \
    "$mpiexec" --allow-run-as-root -np 2 --hostfile "$work/hosts" --map-by node \
    --mca plm_rsh_agent "$work/agent.sh" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include 10.78.0.0/24 \
    --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 \
    -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x LOOM_SOURCE_DIR="$src" \
    "$loom" train "${common[@]}" "$@"
}
# Mean step time of steps 2.. of a metrics file (the first step includes start-up).
mean_step_s() {
  awk -F'"step_s": ' 'NR > 1 && NF > 1 { split($2, a, /[,}]/); s += a[1]; n++ }
                      END { if (n) printf "%.3f", s / n }' "$1"
}
loss_of() {  # loss_of METRICS STEP
  grep "^{\"step\": $2," "$1" | sed 's/.*"loss": \([^,]*\),.*/\1/'
}

source "$src/tests/parity/setup.sh"
parity_corpus "$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=20
  --training.local_batch_size=4 --validation.interval=0)

echo "== reference: one process, grad_accum_steps=2"
"$loom" train "${common[@]}" --training.grad_accum_steps=2 --checkpoint.interval=0 \
  --checkpoint.dir="$work/ref" --metrics.jsonl="$work/ref.jsonl" >"$work/ref.log" 2>&1 ||
  { cat "$work/ref.log"; exit 1; }

echo "== drill 1: FSDP dp_shard=2 across the two hosts"
multihost 240 --parallelism.dp_shard=2 --checkpoint.interval=0 --checkpoint.dir="$work/run1" \
  --metrics.jsonl="$work/run1.jsonl" >"$work/run1.log" 2>&1 || { cat "$work/run1.log"; exit 1; }
grep -m1 "x dp" "$work/run1.log" || true
"$compare" "$work/ref.jsonl" "$work/ref/step-00000020" "$work/run1.jsonl" \
  "$work/run1/step-00000020" 1e-5
t_plain=$(mean_step_s "$work/run1.jsonl")
echo "figure: losses step 1/10/20 one process $(loss_of "$work/ref.jsonl" 1) $(loss_of "$work/ref.jsonl" 10) $(loss_of "$work/ref.jsonl" 20)"
echo "figure: losses step 1/10/20 two hosts   $(loss_of "$work/run1.jsonl" 1) $(loss_of "$work/run1.jsonl" 10) $(loss_of "$work/run1.jsonl" 20)"
echo "figure: step time two hosts ${t_plain} s"

echo "== drill 2: a degraded data link (delay and loss on both ends)"
# tc netem where the kernel has it; a kernel without sch_netem (CONFIG_NET_SCH_NETEM unset, as in
# some VMs) gets the nearest it has: a token bucket of 20 Mbit/s (queueing delay) and 1% of the
# packets dropped at random by nftables.
if in_ns "$nsa" tc qdisc add dev d0 root netem delay 20ms loss 1% 2>/dev/null; then
  in_ns "$nsb" tc qdisc add dev d0 root netem delay 20ms loss 1%
  how="netem delay 20ms loss 1%"
else
  for ns in "$nsa" "$nsb"; do
    in_ns "$ns" tc qdisc add dev d0 root tbf rate 20mbit burst 64kb latency 500ms
    in_ns "$ns" nft -f - <<'NFT'
table inet drill {
  chain out {
    type filter hook output priority 0;
    oifname "d0" numgen random mod 100 < 1 drop
  }
}
NFT
  done
  how="no sch_netem in this kernel: tbf rate 20mbit + nft 1% random loss"
fi
echo "degraded link: $how"
multihost 300 --parallelism.dp_shard=2 --checkpoint.interval=0 --checkpoint.dir="$work/run2" \
  --metrics.jsonl="$work/run2.jsonl" >"$work/run2.log" 2>&1 || { cat "$work/run2.log"; exit 1; }
"$compare" "$work/ref.jsonl" "$work/ref/step-00000020" "$work/run2.jsonl" \
  "$work/run2/step-00000020" 1e-5
t_netem=$(mean_step_s "$work/run2.jsonl")
echo "figure: step time two hosts, degraded link (${how}) ${t_netem} s (healthy: ${t_plain} s)"
awk -v a="$t_netem" -v b="$t_plain" 'BEGIN { exit !(a > b) }' ||
  { echo "FAIL: the degraded link did not slow the steps"; exit 1; }

# Still on the degraded link, so that steps are slow enough for the cut to land inside step 13.
echo "== drill 3: the data link cut after step 12 (checkpoints every 5, collective timeout ${timeout_s} s)"
multihost_bg 240 --parallelism.dp_shard=2 --checkpoint.interval=5 --checkpoint.keep=0 \
  --checkpoint.dir="$work/run3" --metrics.jsonl="$work/run3.jsonl" \
  --job.collective_timeout_s=$timeout_s >"$work/run3.log" 2>&1 &
job=$! child=$!
cut=0
for _ in $(seq 1200); do
  n=$(cat "$work/run3.jsonl" 2>/dev/null | grep -c '^{"step"' || true)
  if [ "${n:-0}" -ge 12 ]; then
    in_ns "$nsa" ip link set d0 down
    cut=$(date +%s.%N)
    break
  fi
  kill -0 "$job" 2>/dev/null || break
  sleep 0.05
done
rc=0
wait "$job" || rc=$?
end=$(date +%s.%N)
[ "$cut" != 0 ] || { cat "$work/run3.log"; echo "FAIL: the run never reached step 12"; exit 1; }
took=$(awk -v a="$cut" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
grep -m2 'TIMEOUT' "$work/run3.log" || true
echo "figure: link cut -> job exit ${took} s (collective timeout ${timeout_s} s), exit status $rc"
[ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ] ||
  { cat "$work/run3.log"; echo "FAIL: the job did not end on its own with an error (status $rc)"; exit 1; }
awk -v t="$took" -v l="$timeout_s" 'BEGIN { exit !(t <= l + 10) }' ||
  { echo "FAIL: the job took ${took} s to end after the cut (timeout ${timeout_s} s)"; exit 1; }
grep -qE "TIMEOUT in .* on group '[a-z_]+' .* for peers \[[01]\]" "$work/run3.log" ||
  { cat "$work/run3.log"; echo "FAIL: no TIMEOUT line naming the group and the peer"; exit 1; }
last=$(ls "$work/run3" | grep -E '^step-[0-9]+$' | sort | tail -n1)
[ "$last" = step-00000010 ] || { echo "FAIL: the last checkpoint is '$last', expected step-00000010"; exit 1; }

echo "== drill 3: the link back up (and healthy), resume from $last"
for ns in "$nsa" "$nsb"; do
  in_ns "$ns" tc qdisc del dev d0 root
  in_ns "$ns" nft delete table inet drill 2>/dev/null || true
done
in_ns "$nsa" ip link set d0 up
# Both ends up, and no neighbour entry left FAILED by the cut: seen under load, the first Open MPI
# TCP connect after the flap failed ("failed to TCP connect to a peer", EINPROGRESS) and its
# wire-up hung until the launch limit, before loom ran a step.
for ns in "$nsa" "$nsb"; do
  for _ in $(seq 50); do in_ns "$ns" ip link show d0 | grep -q LOWER_UP && break; sleep 0.1; done
  in_ns "$ns" ip neigh flush dev d0 || true
done
resume3() {
  multihost 90 --parallelism.dp_shard=2 --checkpoint.interval=5 --checkpoint.keep=0 \
    --checkpoint.dir="$work/run3" --checkpoint.resume=true --metrics.jsonl="$work/run3r.jsonl" \
    --job.collective_timeout_s=$timeout_s >"$work/run3r.log" 2>&1
}
# One more launch only when Open MPI's own wire-up failed (no loom step ran: the test is about
# loom's resume, not the transport's reconnect); any other failure fails the drill.
if ! resume3; then
  grep -q 'failed to TCP connect' "$work/run3r.log" && ! grep -q '^{"step"' "$work/run3r.jsonl" 2>/dev/null ||
    { cat "$work/run3r.log"; exit 1; }
  echo "figure: Open MPI's TCP wire-up failed after the link came back; launched once more"
  rm -f "$work/run3r.jsonl"
  resume3 || { cat "$work/run3r.log"; exit 1; }
fi
grep -m1 -i 'resum' "$work/run3r.log" || true
ref11=$(loss_of "$work/ref.jsonl" 11) got11=$(loss_of "$work/run3r.jsonl" 11)
echo "figure: resumed step 11 loss $got11, uninterrupted $ref11"
awk -v a="$got11" -v b="$ref11" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-5 * (b < 0 ? -b : b)) }' ||
  { echo "FAIL: resumed step 11 loss $got11 differs from $ref11"; exit 1; }
# And every later step of the resumed run.
for s in $(seq 12 20); do
  a=$(loss_of "$work/run3r.jsonl" "$s") b=$(loss_of "$work/ref.jsonl" "$s")
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-5 * (b < 0 ? -b : b)) }' ||
    { echo "FAIL: resumed step $s loss $a differs from $b"; exit 1; }
done
echo "multi-host drill passed"
