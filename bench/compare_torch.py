#!/usr/bin/python3
"""loom against PyTorch on one training step (forward, backward, AdamW), fp32 and bf16.

  compare_torch.py [--tiers native,avx2] [--configs tiny,small] [--dtypes float32,bfloat16]
                   [--repeats 3] [--json]

For each repeat, each config and each dtype it runs `loom bench step --config configs/bench-<c>.toml
--json [--training.mixed_precision_param=bfloat16]` (binary: $LOOM_BIN or ./build/loom) and then
bench/torch_step.py, so slow phases of a shared machine hit both sides alike. It prints the median
tokens/s of each side, their ratio against the target (1.5x), MFU of both against the GEMM
peak loom reports (torch's FLOP/s = tokens/s x FLOPs per token, torchtitan's 6N + 12 L H Q T), and
the load average before and after. For bf16, torch runs with OMP_WAIT_POLICY=ACTIVE and =PASSIVE and
the faster counts (ACTIVE wins on an idle machine, PASSIVE under contention). --torch-only skips loom.

--tiers runs every case once per CPU tier, loom under LOOM_CPU_ISA=<tier> and torch held to the same
tier (torch_step.py's TIER_ENV: ATEN_CPU_CAPABILITY, OPENBLAS_CORETYPE, ONEDNN_MAX_CPU_ISA; native
sets nothing). bf16 runs only on tiers where loom's oneDNN has native bf16 matmuls (`loom info
--json`; elsewhere loom widens bf16 to f32 and its default, "auto", is float32). loom's MFU is
against the GEMM peak it measures on that tier.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from torch_step import TIER_ENV, TUNED_ENV, WAIT_POLICIES  # noqa: E402  (torch_step imports torch only in main)

TARGET = {"float32": 1.5, "bfloat16": 1.5}  # issue "every x86-64 CPU": every ratio at least 1.5x
NOISY = 0.2  # CPU cores taken by other processes above which a case's timings are suspect


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def cpu_ticks():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v[:8]) - idle, sum(v[:8])


def run_child(cmd, env, timeout):
    """Runs cmd; returns (parsed JSON or None, error text, CPU cores used by other processes meanwhile)."""
    hz = os.sysconf("SC_CLK_TCK")
    r0, (b0, _), t0 = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_ticks(), time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired:
        out, err, rc = "", f"timed out after {timeout} s", -1
    r1, (b1, _), t1 = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_ticks(), time.monotonic()
    own = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    other = max(0.0, ((b1 - b0) / hz - own) / max(t1 - t0, 1e-9))
    res = last_json(out) if rc == 0 else None
    if res is None:
        msg = f"{' '.join(cmd)}: exit {rc}: " + (err.strip().splitlines() or ["no JSON on stdout"])[-1]
        return None, msg, other
    return res, "", other


def loom_info(loom_bin, tier):
    """`loom info --json` under LOOM_CPU_ISA=tier (no GEMM peaks), or None when it fails."""
    env = dict(os.environ, LOOM_CPU_ISA=tier)
    p = subprocess.run([loom_bin, "info", "--json", "--peak-seconds", "0"], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    return last_json(p.stdout) if p.returncode == 0 else None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="native",
                    help="CPU tiers to run, e.g. native,avx2 (loom's LOOM_CPU_ISA; torch held alike)")
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed torch steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="torch warm-up steps per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loom-bin", default=os.environ.get("LOOM_BIN", os.path.join(ROOT, "build", "loom")))
    ap.add_argument("--loom-configs", default=os.path.join(ROOT, "configs"),
                    help="folder holding bench-<config>.toml")
    ap.add_argument("--torch-only", action="store_true")
    ap.add_argument("--gemm-peak-tflops", type=float, help="peak for torch MFU when loom is not run")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per child run")
    ap.add_argument("--json", action="store_true", help="also print the table as one JSON object")
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    dtypes = [d for d in a.dtypes.split(",") if d]
    for d in dtypes:
        if d not in TARGET:
            ap.error(f"--dtypes: {d!r} is not float32 or bfloat16")
    tiers = [t for t in a.tiers.split(",") if t]
    for t in tiers:
        if t not in TIER_ENV:
            ap.error(f"--tiers: {t!r} is not one of {', '.join(sorted(TIER_ENV))}")
    run_loom = not a.torch_only
    if run_loom and not os.access(a.loom_bin, os.X_OK):
        ap.error(f"loom binary {a.loom_bin} not found or not executable (set LOOM_BIN, or --torch-only)")
    # The dtypes of each tier: bf16 only where oneDNN has native bf16 matmuls there.
    tier_dtypes, tier_isa = {}, {}
    for t in tiers:
        info = loom_info(a.loom_bin, t) if run_loom else None
        if run_loom and info is None:
            ap.error(f"`LOOM_CPU_ISA={t} {a.loom_bin} info --json` failed: does this CPU have the {t} tier?")
        native_bf16 = info is None or info.get("onednn_isa") in ("avx512_core_bf16", "avx512_core_amx")
        tier_isa[t] = info and f"{info['kernels']}/{info['onednn_isa']}"
        tier_dtypes[t] = [d for d in dtypes if d != "bfloat16" or native_bf16]

    cases = [(t, c, d) for t in tiers for c in configs for d in tier_dtypes[t]]
    samples = {k: {"loom": [], "torch": [], "other_cpu": []} for k in cases}
    errors = []
    load_before = os.getloadavg()
    for r in range(a.repeats):
        for (t, c, d) in cases:
            s = samples[(t, c, d)]
            if run_loom:
                cmd = [a.loom_bin, "bench", "step", "--config", os.path.join(a.loom_configs, f"bench-{c}.toml"),
                       "--json", f"--training.mixed_precision_param={d}"]
                res, err, other = run_child(cmd, dict(os.environ, LOOM_CPU_ISA=t), a.timeout)
                s["loom"].append(res)
                s["other_cpu"].append(other)
                if err:
                    errors.append(err)
            # torch gets its best OpenMP wait policy of this moment (see torch_step.py).
            res = None
            for pol in WAIT_POLICIES[d]:
                env = dict(os.environ, **{**TUNED_ENV[d], "OMP_WAIT_POLICY": pol, **TIER_ENV[t]})
                cmd = [sys.executable, os.path.join(HERE, "torch_step.py"), "--config", c, "--dtype", d,
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
                       "--omp-wait-policy", pol, "--tier", t]
                r1, err, other = run_child(cmd, env, a.timeout)
                s["other_cpu"].append(other)
                if err:
                    errors.append(err)
                if r1 and (res is None or r1["tokens_per_s"] > res["tokens_per_s"]):
                    res = r1
            s["torch"].append(res)
            print(f"[{r + 1}/{a.repeats}] {t} {c} {d}: loom "
                  f"{fmt(s['loom'][-1] and s['loom'][-1].get('tokens_per_s'), '.0f') if run_loom else '-'}"
                  f" torch {fmt(res and res['tokens_per_s'], '.0f')} tokens/s, other load {other:.2f} cores",
                  file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    rows = []
    for (t, c, d) in cases:
        s = samples[(t, c, d)]
        lt = med([x["tokens_per_s"] for x in s["loom"] if x])
        tt = med([x["tokens_per_s"] for x in s["torch"] if x])
        fpt = med([x["flops_per_token"] for x in s["torch"] if x])
        peak = med([x.get("gemm_peak_tflops") for x in s["loom"] if x]) or a.gemm_peak_tflops
        lmfu = med([x.get("mfu") for x in s["loom"] if x])
        loom_fpt = med([x["tflops"] * 1e12 / x["tokens_per_s"] for x in s["loom"]
                        if x and x.get("tflops") and x.get("tokens_per_s")])
        if loom_fpt and fpt and abs(loom_fpt / fpt - 1) > 0.01:
            errors.append(f"{t} {c} {d}: loom counts {loom_fpt:.4g} FLOPs/token, torch side {fpt:.4g} "
                          "(torchtitan 6N + 12LHQT); MFUs are not comparable")
        rows.append({
            "tier": t, "isa": tier_isa[t], "config": c, "dtype": d,
            "loom_tokens_per_s": lt, "torch_tokens_per_s": tt,
            "ratio": lt / tt if lt and tt else None, "target_ratio": TARGET[d],
            "meets_target": (lt / tt >= TARGET[d]) if lt and tt else None,
            "loom_mfu": lmfu,
            "torch_mfu": tt * fpt / (peak * 1e12) if tt and fpt and peak else None,
            "gemm_peak_tflops": peak, "flops_per_token": fpt,
            "loom_peak_allocated_bytes": med([x.get("peak_allocated_bytes") for x in s["loom"] if x]),
            "other_cpu_cores": statistics.mean(s["other_cpu"]) if s["other_cpu"] else None,
            "other_cpu_samples": s["other_cpu"],
            "loom_samples": [x and x.get("tokens_per_s") for x in s["loom"]],
            "torch_samples": [x and x.get("tokens_per_s") for x in s["torch"]],
            "torch_wait_policies": [x and x["env"].get("OMP_WAIT_POLICY") for x in s["torch"]],
        })

    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
          f"({os.cpu_count()} CPUs; median of {a.repeats} interleaved runs)")
    hdr = ["tier", "config", "dtype", "loom tok/s", "torch tok/s", "ratio", "target", "loom MFU", "torch MFU", "other CPU"]
    table = [hdr] + [[
        r["tier"] + (f" ({r['isa']})" if r["isa"] else ""), r["config"], r["dtype"], fmt(r["loom_tokens_per_s"], ".0f"), fmt(r["torch_tokens_per_s"], ".0f"),
        fmt(r["ratio"], ".2f") + ("" if r["meets_target"] is None else " ok" if r["meets_target"] else " LOW"),
        f"{r['target_ratio']:.1f}x",
        fmt(r["loom_mfu"] and 100 * r["loom_mfu"], ".1f") + ("%" if r["loom_mfu"] else ""),
        fmt(r["torch_mfu"] and 100 * r["torch_mfu"], ".1f") + ("%" if r["torch_mfu"] else ""),
        fmt(r["other_cpu_cores"], ".2f") + (" !" if (r["other_cpu_cores"] or 0) > NOISY else ""),
    ] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(hdr))]
    for row in table:
        print("  ".join(x.ljust(w) if i < 3 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    if any((r["other_cpu_cores"] or 0) > NOISY for r in rows):
        print(f"! other processes used more than {NOISY} of the {os.cpu_count()} cores during these runs "
              "on average: these numbers are unreliable; rerun on an idle machine")
    for e in errors:
        print("error:", e, file=sys.stderr)
    if a.json:
        print(json.dumps({"rows": rows, "load_before": load_before, "load_after": load_after,
                          "repeats": a.repeats, "threads": a.threads, "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
