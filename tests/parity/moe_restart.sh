#!/bin/bash
# A mixture-of-experts checkpoint saved under expert parallelism 4 (dp_shard 4, each rank holding 2
# of the 8 experts whole) resumes under ep 2 (4 experts per rank), ep 2 x FSDP 4 (the experts
# also sharded), ep 2 x tp 2 and tp 2 (each tp rank holding its slice of the experts), FSDP 2
# without ep, pp 2 x ep 2 and one process, with the next-step loss of the uninterrupted run within
# 1e-6 relative (restart_layouts.sh says why not to the last digit). Each rank's file holds its own
# experts under their global names: the resumed layout reads the slices it holds now from
# whichever files hold them. One saved under pp 2 x ep 2 (each pp rank's file holds its stages'
# layers) resumes under one process and ep 4.
# Then the same with the auxiliary-loss-free bias (moe.bias_update_rate) and a capacity that drops
# (moe.capacity_factor = 1.0): saved under ep 2, resumed under one process and FSDP 2, the bias
# of step 10 read back from the checkpoint (a tensor of its layer's unit); a copy whose biases
# were zeroed (checksums off) must miss that loss, or the comparison proves nothing.
#   moe_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup moe_restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/moe_debug.json")
straight12 "$work/ck" full 4 --training.local_batch_size=1 --parallelism.dp_shard=4 \
  --parallelism.ep=4
pp=(--parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.pp=2 --parallelism.pp_microbatches=2
  --training.local_batch_size=1)
status=0
# Micro-batches of one sample everywhere: the auxiliary loss is a function of a micro-batch's
# tokens (transformers' per forward call), so a layout that put two samples in one would add a
# different, equally right, term (seen: 2.9e-6 relative on the step's loss).
for layout in "2 --parallelism.dp_shard=2 --parallelism.ep=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "4 --parallelism.dp_shard=4 --parallelism.ep=2 --training.local_batch_size=1" \
  "2 --parallelism.dp_shard=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "4 --parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.tp=2 --training.local_batch_size=1 --training.grad_accum_steps=2" \
  "2 --parallelism.tp=2 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "4 ${pp[*]}" \
  "1 --training.local_batch_size=1 --training.grad_accum_steps=4"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "ep 4" $layout || status=1
done
straight12 "$work/ckpp" fullpp 4 "${pp[@]}"
for layout in "1 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "4 --parallelism.dp_shard=4 --parallelism.ep=4 --training.local_batch_size=1"; do
  resume_step11 "$work/ckpp" "$want" 1e-6 rel "pp 2 x ep 2" $layout || status=1
done

common+=(--moe.bias_update_rate=1e-2 --moe.capacity_factor=1.0)
straight12 "$work/ckb" bias 2 --training.local_batch_size=1 --training.grad_accum_steps=2 \
  --parallelism.dp_shard=2 --parallelism.ep=2
for layout in "1 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "2 --parallelism.dp_shard=2 --training.local_batch_size=1 --training.grad_accum_steps=2"; do
  resume_step11 "$work/ckb" "$want" 1e-6 rel "ep 2, bias + capacity" $layout || status=1
done
cp -r "$work/ckb" "$work/ckz"
/usr/bin/python3 - "$src/tests/parity" "$work/ckz/step-00000010" <<'PY'
import glob, sys
sys.path.insert(0, sys.argv[1])
import st
zeroed = 0
for f in glob.glob(sys.argv[2] + "/rank-*.safetensors"):
    t = st.load(f)
    for n in t:
        if n.endswith("e_score_correction_bias"):
            assert t[n].any(), f"{n} in {f} is zero already: the bias never moved"
            t[n][:] = 0
            zeroed += 1
    st.save(f, t, meta=st.metadata(f))
assert zeroed > 0, "no e_score_correction_bias in the checkpoint"
print(f"control: zeroed {zeroed} bias tensors")
PY
rc=0
out=$(resume_step11 "$work/ckz" "$want" 1e-6 rel "ep 2, biases zeroed" 1 --training.local_batch_size=1 \
  --training.grad_accum_steps=4 --checkpoint.verify=false) || rc=$?
echo "$out"
if [ "$rc" = 0 ] || ! grep -q "step 11 loss" <<<"$out"; then
  echo "FAILED: the control (biases zeroed) should resume and miss the loss (exit $rc)"
  status=1
fi
exit $status
