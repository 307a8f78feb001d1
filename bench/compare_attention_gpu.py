#!/usr/bin/python3
"""loom's attention kernels against PyTorch's SDPA on one GPU: causal, bf16, grouped-query.

  compare_attention_gpu.py [--json PATH] [--smoke] [--device cuda|cpu] [--dims 64,128]
                           [--seq 2048,4096,8192] [--heads 32/8] [--tokens 16384] [--iters 10]
                           [--flash-warps 4,8] [--loom-bin PATH] [--loom-ld-path auto|DIRS]
                           [--timeout 120]

Both sides run the same shapes: B = tokens / T samples of T tokens, Hq query heads over Hkv
key/value heads (Llama 3's 32/8) at head dims 64 (Llama 3.2 1B) and 128 (Llama 3 8B), bf16 inputs,
causal. loom: `loom bench attention --json` (ops::attention_forward and attention_backward on a
fused qkv buffer's views: the flash kernels at these head dims; each call timed with CUDA events,
the median of --iters after two warm-ups). PyTorch: F.scaled_dot_product_attention(is_causal=True)
under sdpa_kernel(FLASH_ATTENTION) (FlashAttention-2, PyTorch's default fused kernel), and
under CUDNN_ATTENTION where this PyTorch has it, on [B, H, T, D] views of a fused buffer with k and v
repeated to Hq heads outside the timing (SDPA's flash kernel takes no GQA); forward alone, and the
backward (out.backward(dout)) after an untimed forward, CUDA events, the median of --iters after
two warm-ups. TFLOP/s counted as FlashAttention's papers: the causal half of 2 (forward) and 5
(backward) products of 2 D FLOPs per (query, key) pair, the same formula on both sides.

loom runs once per flash block size of --flash-warps (LOOM_FLASH_WARPS: blocks of 4 warps own 64
rows, of 8 warps 128; on a GPU both by default, so one run shows which is faster per head dim and
the default of kernels/cuda/flash_attention.cu can follow it).

The table: per shape loom's (per block size) and SDPA's forward and backward TFLOP/s, and loom /
SDPA-flash for forward + backward time, per block size and the best (the issue's target: at
least 1.0 at head dims 64 and 128, seq 2k-8k).
--smoke --device cpu runs tiny shapes on the CPU (loom's CPU kernels; PyTorch's SDPA where the
installed torch has it, else a plain softmax(QK^T)V), to check the script without a GPU.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_torch_gpu import ROOT, auto_ld_path, find_loom_bin  # noqa: E402  (imports no torch)

TARGET = 1.0  # loom / SDPA flash, forward + backward (issue "loom on NVIDIA GPUs (1 of 2)")


def flops(B, Hq, T, D):
    product = 2.0 * B * Hq * T * (T + 1) / 2 * D
    return 2 * product, 5 * product


def loom_rows(a, warps):
    """loom's rows by (D, T) and its device line, with LOOM_FLASH_WARPS=warps (None: as set)."""
    cmd = [a.loom_bin, "bench", "attention", "--json", "--device", a.device, "--dims", a.dims,
           "--seq", a.seq, "--heads", a.heads, "--tokens", str(a.tokens), "--iters", str(a.iters)]
    env = dict(os.environ)
    if warps:
        env["LOOM_FLASH_WARPS"] = warps
    ld = a.loom_ld_path
    if ld == "auto" or (ld is None and "/.device/" in a.loom_bin):
        ld, notes = auto_ld_path(sys.executable)
        for n in notes:
            print("  loom libraries:", n)
    if ld:
        env["LD_LIBRARY_PATH"] = ld + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return None, f"loom: no result within {a.timeout} s"
    except OSError as e:
        return None, f"loom: {e}"
    if p.returncode != 0:
        return None, "loom: " + (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    j = json.loads(p.stdout)
    where = j["device"] + (f"; flash blocks: {j['flash_blocks']}" if j.get("flash_blocks") else "")
    return {(r["D"], r["T"]): r for r in j["rows"]}, where


def torch_rows(a, backends):
    import torch
    import torch.nn.functional as F
    dev = torch.device(a.device)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    out = {}
    for name in backends:
        ctx = None
        if name != "naive":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}[name]
            if kind is None:
                continue
            ctx = lambda: sdpa_kernel(kind)  # noqa: E731
        for D in (int(x) for x in a.dims.split(",")):
            for T in (int(x) for x in a.seq.split(",")):
                B = max(1, a.tokens // T)
                g = torch.Generator(device=dev).manual_seed(1)
                qkv = torch.randn(B, T, hq + 2 * hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
                q = qkv[:, :, :hq].transpose(1, 2)
                k = qkv[:, :, hq:hq + hkv].transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
                v = qkv[:, :, hq + hkv:].transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
                q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
                dout = torch.randn(B, hq, T, D, device=dev, dtype=torch.bfloat16, generator=g)

                def fwd():
                    if name == "naive" or sdpa is None:
                        s = (q.float() @ k.float().transpose(-1, -2)) / D ** 0.5
                        s = s.masked_fill(torch.ones(T, T, device=dev, dtype=torch.bool).triu(1), float("-inf"))
                        return (s.softmax(-1) @ v.float()).to(q.dtype)
                    return sdpa(q, k, v, is_causal=True)

                def timed(fn):
                    ts = []
                    for i in range(a.iters + 2):
                        if dev.type == "cuda":
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                            fn()
                            e1.record()
                            torch.cuda.synchronize()
                            t = e0.elapsed_time(e1) * 1e-3
                        else:
                            import time
                            t0 = time.perf_counter()
                            fn()
                            t = time.perf_counter() - t0
                        if i >= 2:
                            ts.append(t)
                    return statistics.median(ts)

                def bwd_once():
                    o = fwd()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    return o

                try:
                    if ctx:
                        with ctx():
                            tf = timed(fwd)
                            tb = timed_backward(a, dev, bwd_once, dout)
                    else:
                        tf = timed(fwd)
                        tb = timed_backward(a, dev, bwd_once, dout)
                except RuntimeError as e:
                    out[(name, D, T)] = {"error": str(e).splitlines()[0][:200]}
                    continue
                ff, fb = flops(B, hq, T, D)
                out[(name, D, T)] = {"B": B, "forward_ms": tf * 1e3, "backward_ms": tb * 1e3,
                                     "forward_tflops": ff / tf * 1e-12, "backward_tflops": fb / tb * 1e-12}
                del qkv, q, k, v, dout
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def timed_backward(a, dev, forward, dout):
    """The backward alone: a forward (untimed), then out.backward(dout) timed."""
    import time
    import torch
    ts = []
    for i in range(a.iters + 2):
        o = forward()
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            o.backward(dout)
            e1.record()
            torch.cuda.synchronize()
            t = e0.elapsed_time(e1) * 1e-3
        else:
            t0 = time.perf_counter()
            o.backward(dout)
            t = time.perf_counter() - t0
        if i >= 2:
            ts.append(t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: no GPU needed)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dims")
    ap.add_argument("--seq")
    ap.add_argument("--heads")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--timeout", type=float, default=120, help="most seconds for each loom run")
    ap.add_argument("--flash-warps", help="LOOM_FLASH_WARPS values to run loom with, comma-separated "
                    "(default: 4,8 on cuda; on cpu one run, the setting unused)")
    ap.add_argument("--loom-bin", default=os.environ.get("LOOM_BIN"))
    ap.add_argument("--loom-ld-path", default=os.environ.get("LOOM_LD_LIBRARY_PATH"))
    a = ap.parse_args()
    for k, full, smoke in (("dims", "64,128", "64"), ("seq", "2048,4096,8192", "128,256"), ("heads", "32/8", "4/2"),
                           ("tokens", 16384, 512), ("iters", 10, 2)):
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    a.loom_bin = os.path.abspath(find_loom_bin(a.loom_bin))
    if a.flash_warps is None:
        a.flash_warps = "4,8" if a.device == "cuda" else ""
    settings = [w for w in a.flash_warps.split(",") if w] or [None]

    looms = {}  # LOOM_FLASH_WARPS (None: as set) -> rows by (D, T)
    for w in settings:
        rows_w, where = loom_rows(a, w)
        print(f"loom{' LOOM_FLASH_WARPS=' + w if w else ''}: {where}")
        if rows_w:
            looms[w] = rows_w
    loom = bool(looms)
    try:
        import torch
        backends = ["flash", "cudnn"] if a.device == "cuda" else (
            ["naive"] if not hasattr(torch.nn.functional, "scaled_dot_product_attention") else ["flash"])
        if a.device == "cpu" and backends == ["flash"]:
            backends = ["naive"]  # SDPA's flash kernel is CUDA-only
        sd = torch_rows(a, backends)
        tinfo = f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name(0)}" if a.device == "cuda" else "")
    except Exception as e:  # noqa: BLE001: the table says why torch has no figures
        sd, tinfo, backends = {}, f"torch failed: {str(e).splitlines()[0][:200]}", []
    print(f"torch: {tinfo}")
    ref = backends[0] if backends else None

    rows = []
    tag = {w: "loom" + (w or "") for w in settings}
    hdr = (f"{'D':>4} {'T':>5} {'B':>3}  " + "".join(f"{tag[w] + ' fwd':>10} {'bwd':>6}  " for w in settings)
           + "  ".join(f"{b + ' fwd':>10} {'bwd':>6}" for b in backends)
           + "".join(f"  {tag[w] + '/' + (ref or '-'):>12}" for w in settings if len(settings) > 1)
           + f"  {'best/' + (ref or '-'):>11}")
    print(f"\nattention, bf16, causal, {a.heads} heads, {a.tokens} tokens a call; TFLOP/s (fwd: 2, bwd: 5 causal products)")
    print(hdr)
    ok = True
    for D in (int(x) for x in a.dims.split(",")):
        for T in (int(x) for x in a.seq.split(",")):
            line = f"{D:>4} {T:>5} {max(1, a.tokens // T):>3}  "
            row = {"D": D, "T": T, "loom": {}}
            for w in settings:
                lr = looms.get(w, {}).get((D, T))
                row["loom"][w or "as set"] = lr
                line += f"{lr['forward_tflops']:>10.3g} {lr['backward_tflops']:>6.3g}  " if lr else f"{'-':>10} {'-':>6}  "
            for b in backends:
                r = sd.get((b, D, T))
                row[b] = r
                line += (f"{r['forward_tflops']:>10.3g} {r['backward_tflops']:>6.3g}  " if r and "error" not in r
                         else f"{'error' if r else '-':>10} {'-':>6}  ")
            r = sd.get((ref, D, T)) if ref else None
            ratios = {}
            for w in settings:
                lr = looms.get(w, {}).get((D, T))
                if lr and r and "error" not in r:
                    ratios[w] = (r["forward_ms"] + r["backward_ms"]) / (lr["forward_ms"] + lr["backward_ms"])
                if len(settings) > 1:
                    line += f"  {ratios[w]:>12.2f}" if w in ratios else f"  {'-':>12}"
            if ratios:
                best = max(ratios, key=ratios.get)
                row["ratios"] = {w or "as set": v for w, v in ratios.items()}
                row["ratio"], row["best_warps"] = ratios[best], best
                ok = ok and ratios[best] >= TARGET
                line += f"  {ratios[best]:>11.2f}"
            else:
                ok = False
                line += f"  {'-':>11}"
            rows.append(row)
            print(line)
    print(f"\ntarget loom (best block size) / SDPA flash (forward + backward time) >= {TARGET}: "
          f"{'met' if ok else 'NOT met'}"
          + (" (smoke run: not the target's shapes)" if a.smoke else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"loom_device": where, "flash_warps": settings, "torch": tinfo, "rows": rows,
                       "target": TARGET, "met": ok}, f, indent=1)
    return 0 if loom else 1


if __name__ == "__main__":
    sys.exit(main())
