#!/bin/bash
# `loom plan` against the published large runs (issue 16; the facts and their settings are in
# ../shared/specs/PIPELINE-AND-PLAN.md part B2 and ../shared/REFERENCE.md "Published runs"). Each
# run's own settings go through `loom plan --json` (bf16 compute set explicitly, never "auto"),
# plus two `--search` runs (405B on 64 x h100-sxm-80g at seq 4096, 8B on 8 x h100-96g-500w at
# seq 8192) timed, and for torchtitan's 8B with FSDP 8 x CP 1/2/4/8 the longest sequence loom
# plans to fit (secant on the planned peak over seq_len in steps of 2048 x cp, each step verified
# by a plan: the answer fits and one step more does not). A mixture of experts (issue 37): NeMo
# AutoModel's Qwen3-30B-A3B pre-training on 8 H100s, FSDP 8 x EP 8 (the performance summary of
# https://docs.nvidia.com/nemo/automodel/latest/performance-summary.html, its settings in
# NVIDIA-NeMo/Automodel examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml), planned as
# published and by `--search` (which tries every ep), with the worst case a dropless router
# allows beside the balanced figure (both AutoModel and loom's meta run route balanced).
#
# Prints one markdown table: loom's layout and settings, planned peak allocated and reserved GiB
# (max over the planned ranks), fits, predicted tokens/s per GPU and step time, the published
# figure and loom / published (memory: against what the source measured, torchtitan's max
# reserved or Lambda's allocated; time: tokens/s per GPU). Then, per row, the split of the peak
# rank's allocation by use, which says what dominates. Settings loom cannot express (CPU
# offload, Float8, torch.compile, bf16 master weights, AsyncTP) are named in the notes column;
# nothing is tuned to match.
#   bench/plan_published.sh [LOOM]
# Environment: CP_DEGREES (default "1 2 4 8"; empty: none) limits the longest-sequence searches;
# ROWS=0 skips the table and the searches, ROWS=moe keeps only the mixture-of-experts rows. On
# this machine (2 cores) the dense table and searches take about 2.5 minutes, the CP searches
# 20 s, the mixture-of-experts rows and search about 4 minutes (the search plans 70 layouts of 16
# micro-batches).
# Writes nothing; one plan at a time, one OpenMP thread.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
loom=$(realpath "${1:-$src/build/loom}")
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive LOOM_SOURCE_DIR=${LOOM_SOURCE_DIR:-$src}
[ -x "$loom" ] || { echo "plan_published.sh: no loom binary at $loom" >&2; exit 1; }
echo "loom: $loom ($(stat -c %y "$loom" | cut -d. -f1)); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
exec /usr/bin/python3 - "$loom" "$src" "${CP_DEGREES-1 2 4 8}" "${ROWS:-1}" <<'EOF'
import json, subprocess, sys, time, tomllib

loom, src, cp_degrees = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split()]
with_rows, moe_only = sys.argv[4] != "0", sys.argv[4] == "moe"
config = f"{src}/configs/default.toml"
GiB, GB = float(2**30), 1e9


def capacity(hw):
    with open(f"{src}/configs/hardware/{hw}.toml", "rb") as f:
        return float(tomllib.load(f)["capacity"])


def run(world, hw, over, extra=()):
    cmd = [loom, "plan", "--config", config, "--world", str(world), "--hardware", hw, "--json",
           "--training.mixed_precision_param=bfloat16"]
    cmd += [f"--{k}={v}" for k, v in over.items()] + list(extra)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if p.returncode not in (0, 2):  # 2 = some rank does not fit
        sys.exit(f"loom plan failed (exit {p.returncode}):\n  {' '.join(cmd)}\n{p.stderr}")
    line = [l for l in p.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line), dt


def summary(d):
    r = max(d["ranks"], key=lambda r: r["peak_allocated_bytes"])
    return {
        "fits": d["fits"], "layout": d["layout"], "micro_batches": d["micro_batches"],
        "alloc": r["peak_allocated_bytes"] / GiB,
        "reserved": max(x["peak_reserved_bytes"] for x in d["ranks"]) / GiB,
        "step": max(x["time"]["step_s"] for x in d["ranks"]),
        "tps": min(x["time"]["job_tokens_per_s"] for x in d["ranks"]) / d["world"],
        "mfu": min(x["time"]["mfu"] for x in d["ranks"]),
        "bubble": r["time"]["bubble"], "role": r["role"], "at_peak": r["at_peak"],
        "exposed": r["time"]["exposed_comm_s"], "compute": r["time"]["compute_s"],
        "flushes": max(x["cache_flushes"] for x in d["ranks"]),
    }


def common(model, seq, lbs, ac, **par):
    o = {"model.config": model, "training.seq_len": seq, "training.local_batch_size": lbs,
         "activation_checkpoint.mode": ac}
    if ac == "selective":
        o["activation_checkpoint.selective_option"] = "op"
    o.update({f"parallelism.{k}": v for k, v in par.items()})
    return o


rows, details = [], []


def row(name, world, hw, over, pub, pub_mem=None, pub_mem_kind="reserved", pub_tps=None,
        notes=""):
    d, dt = run(world, hw, over)
    s = summary(d)
    mem = s["reserved"] if pub_mem_kind == "reserved" else s["alloc"]
    settings = " ".join(f"{k.split('.')[-1]}={v}" for k, v in over.items() if k != "model.config")
    rows.append([
        name, f"{world} x {hw}: {settings}", f"{s['alloc']:.1f}", f"{s['reserved']:.1f}",
        "yes" if s["fits"] else "**no**", f"{s['tps']:.0f} ({s['step']:.2f} s)", pub,
        (f"{mem / pub_mem:.2f} ({pub_mem_kind[:3]})" if pub_mem else "-") + " / " +
        (f"{s['tps'] / pub_tps:.2f}" if pub_tps else "-"), notes])
    split = ", ".join(f"{k} {v / GiB:.1f}" for k, v in s["at_peak"].items() if v)
    extra = f", bubble {s['bubble']:.0%}" if s["bubble"] else ""
    if s["flushes"]:
        # plan_whole planned it again under the capacity: the allocator gave its cache back.
        split += (f"; reserved {s['reserved']:.1f} GiB held within the capacity by "
                  f"{s['flushes']} cache flushes a step")
    worst = d.get("ep_worst_case")
    if worst:
        # A mixture of experts under ep: the peak if one rank's experts got every choice they can.
        extra += (f"; routing balanced (load 1); worst case dropless (load {worst['load']:g}): "
                  f"{worst['peak_allocated_bytes'] / GiB:.1f} GiB"
                  f"{'' if worst['fits'] else '+, does not fit'}")
    details.append(f"- {name}: {s['role']} peak {s['alloc']:.1f} GiB = {split}; "
                   f"compute {s['compute']:.2f} s, exposed comm {s['exposed']:.2f} s{extra}, "
                   f"MFU {s['mfu']:.1%}; planned in {dt:.1f} s")
    return s


def search(name, world, hw, over, pub, notes=""):
    d, dt = run(world, hw, over, ["--search"])
    L = d["layouts"]
    fit = [l for l in L if l["fits"]]
    best = fit[0] if fit else min(L, key=lambda l: l["peak_allocated_bytes"])
    states_only = " (states only)" if best.get("states_exceed_capacity") else ""
    tps = best["job_tokens_per_s"] / world
    settings = " ".join(f"{k.split('.')[-1]}={v}" for k, v in over.items() if k != "model.config")
    rows.append([
        name, f"{world} x {hw}: {settings} --search -> {best['layout']}" +
        ("" if fit else " (none fits; least memory shown)"),
        f"{best['peak_allocated_bytes'] / GiB:.1f}{states_only}", "-",
        "yes" if best["fits"] else "**no**",
        f"{tps:.0f} ({best['step_s']:.2f} s)" if best["fits"] else "-", pub, "-", notes])
    details.append(f"- {name}: {len(L)} layouts ({len(fit)} fit, {d['refused']} refused) "
                   f"in {dt:.1f} s; first three: " +
                   "; ".join(f"{l['layout']} {l['peak_allocated_bytes'] / GiB:.1f} GiB "
                             f"{l['job_tokens_per_s'] / world:.0f} tok/s/GPU"
                             + ("" if l["fits"] else " no fit") for l in L[:3]) +
                   (f"; the first's worst case dropless (load {w['load']:g}): "
                    f"{w['peak_allocated_bytes'] / GiB:.1f} GiB"
                    f"{'' if w['fits'] else '+, does not fit'}"
                    if (w := d.get("first_ep_worst_case")) else ""))
    return dt


def longest_seq(cp, hw):
    """Longest seq_len (a multiple of 2048 x cp) whose plan fits: rank 0 only (under FSDP x CP at
    batch 1 every rank holds the same; the last shard's padding is bytes)."""
    unit, cap, world = 2048 * cp, capacity(hw), 8 * cp
    over = lambda s: common("llama3-8b", s, 1, "full", dp_shard=8, cp=cp)
    pts, lo, hi, spent, plans, lo_d = [], None, None, 0.0, 0, None
    s = 8192 * cp
    while True:
        d, dt = run(world, hw, over(s), ["--ranks", "0"])
        spent, plans = spent + dt, plans + 1
        peak = max(r["peak_allocated_bytes"] for r in d["ranks"])
        pts.append((s, peak))
        if d["fits"]:
            if lo is None or s > lo:
                lo, lo_d = s, d
        elif hi is None or s < hi:
            hi = s
        if lo is not None and hi is not None and hi - lo <= unit:
            return lo, spent, plans, lo_d
        if plans >= 12:
            return lo, spent, plans, None
        if len(pts) < 2:
            s = 2 * s
            continue
        # Secant through the two points nearest the capacity.
        (s0, p0), (s1, p1) = sorted(pts, key=lambda q: abs(q[1] - cap))[:2]
        est = s1 + (cap - p1) * (s1 - s0) / (p1 - p0) if p1 != p0 else 2 * s1
        s = int(est // unit) * unit
        if lo is not None and s <= lo:
            s = lo + unit
        if hi is not None and s >= hi:
            s = hi - unit
        if s in (q[0] for q in pts):  # the secant stalls: step from the bracket
            s = lo + unit if lo is not None else max(unit, (hi or s) - unit)


t_all = time.monotonic()
sxm, tt = "h100-sxm-80g", "h100-96g-500w"
t405 = t8 = tmoe = None
if with_rows and not moe_only:
    row("Lambda 405B FSDP 64, seq 4096, CPU offload", 64, sxm,
        dict(common("llama3-405b", 4096, 1, "full", dp_shard=64),
             **{"training.enable_cpu_offload": "true"}),
        "52.9 GB alloc (49.3 GiB), 77.9 GB reserved, 30 s/step = 136.5 tok/s/GPU; fits (CPU offload)",
        52.9 * GB / GiB, "allocated", 4096 * 64 / 30 / 64,
        "Lambda keeps bf16 masters on the host, loom f32 ones (host memory only); "
        "reserved against Lambda's 72.5 GiB: see the details")
    row("Lambda 405B FSDP 64, seq 4096, no offload", 64, sxm,
        common("llama3-405b", 4096, 1, "full", dp_shard=64),
        "(does not fit without offload)", None, "allocated", None,
        "f32 states alone are 94.5 GiB a rank")
    t405 = search("loom --search 405B, 64 H100 80 GB, seq 4096", 64, sxm,
                  common("llama3-405b", 4096, 1, "full"),
                  "(Lambda's layout: FSDP 64 with CPU offload)",
                  "AC full set; the search varies AC itself")
    row("torchtitan 8B FSDP 8, bs 2, seq 8192, op AC", 8, tt,
        common("llama3-8b", 8192, 2, "selective", dp_shard=8),
        "5,762 tok/s/GPU, 82.4 GiB reserved", 82.4, "reserved", 5762, "no compile, no Float8")
    t8 = search("loom --search 8B, 8 H100 96 GB, bs 2, seq 8192", 8, tt,
                common("llama3-8b", 8192, 2, "selective"), "(torchtitan: FSDP 8, op AC, 5,762)",
                "AC op set; the search varies AC itself")
    pp_args = dict(dp_shard=8, tp=8, pp=8)
    for gather in ("microbatch", "step"):
        sfx = "" if gather == "microbatch" else ", pp_fsdp_gather=step"
        note = "compile+Float8+AsyncTP not in loom; " + (
            "loom default: FSDP gathers per micro-batch" if gather == "microbatch" else
            "torchtitan under PP keeps params gathered and reduce-scatters once per step")
        row(f"torchtitan 405B 512 GPUs 1F1B (m 8 x 4){sfx}", 512, tt,
            common("llama3-405b", 8192, 4, "full", **pp_args, pp_schedule="1f1b",
                   pp_microbatches=8, pp_fsdp_gather=gather),
            "100 tok/s/GPU, 82.5 GiB reserved (local bs 32)", 82.5, "reserved", 100, note)
        row(f"torchtitan 405B 512 GPUs interleaved (v 2, m 16 x 2){sfx}", 512, tt,
            common("llama3-405b", 8192, 2, "full", **pp_args, pp_schedule="interleaved_1f1b",
                   pp_stages_per_rank=2, pp_microbatches=16, pp_fsdp_gather=gather),
            "128 tok/s/GPU, 72.7 GiB reserved (local bs 32)", 72.7, "reserved", 128,
            note + "; v 2, m 16 assumed (torchtitan's then-default m = stages)")
    for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2),
                              (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5)):
        row(f"torchtitan 8B 8 GPUs FSDP {8 // cp} x CP {cp}, seq {seq // 1024}k", 8, tt,
            common("llama3-8b", seq, 1, "full", dp_shard=8 // cp, cp=cp),
            f"{tps:,} tok/s/GPU, {mem} GiB reserved", mem, "reserved", tps,
            "torchtitan: compile+Float8")
    row("nanotron 70B TP 8 x PP 4, seq 8192, mb 1", 32, sxm,
        common("llama3-70b", 8192, 1, "none", dp_shard=1, tp=8, pp=4, pp_schedule="1f1b"),
        "OOM without a buffer pool (no figure published)", notes="m = pp (loom's default), no AC, "
        "no DP: the seed gives only TP 8 x PP 4, seq 8k, mb 1")
if with_rows:
    # NeMo AutoModel's Qwen3 MoE 30B row (DGX-H100, BF16): GBS 512 = 8 GPUs x LBS 4 x GA 16,
    # seq 4096, TP 1 PP 1 CP 1, EP 8, FSDP 8, activation checkpointing on, fake balanced gate,
    # 21.773 s a step, 277 model TFLOP/s/GPU, 12,040 tokens/s/GPU; no memory figure.
    qwen = dict(common("qwen3-30b-a3b", 4096, 4, "full"), **{"training.grad_accum_steps": 16})
    moe_note = ("TE + DeepEP not in loom (loom's all-to-alls block the compute); both route "
                "balanced; AutoModel counts 23.0 GFLOP a token, loom 27.9")
    pub_moe = "12,040 tok/s/GPU (21.77 s/step, 277 TFLOP/s/GPU); memory not published"
    row("NeMo AutoModel Qwen3-30B-A3B FSDP 8 x EP 8, bs 4 x GA 16, seq 4096", 8, sxm,
        dict(qwen, **{"parallelism.dp_shard": 8, "parallelism.ep": 8}), pub_moe, None,
        "reserved", 12040, moe_note + "; loom's f32 masters, gradients and AdamW moments "
        "(63.6 GiB a rank) leave too little for bs 4: AutoModel's config asks no f32 masters")
    # The nearest layout that fits in loom: the same global batch (512 x 4096) at bs 1 x GA 64.
    row("the same, bs 1 x GA 64 (fits in loom)", 8, sxm,
        dict(qwen, **{"training.local_batch_size": 1, "training.grad_accum_steps": 64,
                      "parallelism.dp_shard": 8, "parallelism.ep": 8}), pub_moe, None,
        "reserved", 12040, moe_note)
    tmoe = search("loom --search Qwen3-30B-A3B, 8 H100 80 GB, bs 4 x GA 16, seq 4096", 8, sxm,
                  qwen, "(AutoModel: FSDP 8 x EP 8, AC, 12,040)",
                  "AC full set; the search varies AC, ep, TP and PP")

    print(f"\n| row | loom layout, settings | alloc GiB | reserved GiB | fits | tok/s/GPU (step) "
          f"| published | loom/published: memory / tok/s | notes |")
    print("|" + "---|" * 9)
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()

if cp_degrees:
    print("\nLongest sequence loom plans to fit, Llama 3 8B, FSDP 8 x CP c on 8c x h100-96g-500w, "
          "batch 1, full AC (rank 0; torchtitan's figures were with torch.compile + Float8):\n")
    print("| cp | GPUs | loom longest seq | peak GiB there (alloc/reserved) | tok/s/GPU there "
          "| torchtitan | loom/torchtitan | plans, s |")
    print("|" + "---|" * 8)
published = {1: 32, 2: 80, 4: 144, 8: 300}
for cp in cp_degrees:
    lo, spent, plans, d = longest_seq(cp, tt)
    if d is None or lo is None:
        print(f"| {cp} | {8 * cp} | not bracketed ({'>= ' + str(lo) if lo else 'none fits'}) "
              f"| - | - | {published.get(cp, '?')}k | - | {plans}, {spent:.0f} |")
        continue
    s = summary(d)
    print(f"| {cp} | {8 * cp} | {lo} ({lo / 1024:.0f}k) | {s['alloc']:.1f} / {s['reserved']:.1f} "
          f"| {s['tps']:.0f} | {published.get(cp, '?')}k | {lo / 1024 / published[cp]:.2f} "
          f"| {plans}, {spent:.0f} |")
    sys.stdout.flush()

if details:
    print("\nAt each row's peak rank (GiB by use):")
    print("\n".join(details))
print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")
if t405 is not None:
    print(f"--search times: 405B on 64: {t405:.1f} s; 8B on 8: {t8:.1f} s (limit 60 s each)")
if tmoe is not None:
    print(f"--search time: Qwen3-30B-A3B on 8 (GA 16): {tmoe:.1f} s")
print(f"all: {time.monotonic() - t_all:.0f} s")
EOF
