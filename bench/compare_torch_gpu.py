#!/usr/bin/python3
"""loom against PyTorch on one GPU: training steps of Llama 3.2 1B, seq 2048, bf16, AdamW.

  compare_torch_gpu.py [--json PATH] [--smoke] [--device cuda|cpu] [--sides loom,eager,compile]
                       [--batches 32,24,...,1] [--budget 230] [--loom-bin PATH] [--loom-ld-path auto|DIRS]

Three systems train the same shape from a random initialization (configs/llama3.2-1b.json: 16
layers, dim 2048, 32 heads, 8 kv heads, vocabulary 128256, tied embeddings, 1.236 B parameters) on
random tokens, seq_len 2048, bf16 GEMMs with fp32 master weights, fp32 gradients and fp32 AdamW
moments (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, gradient norm clipped to 1.0: loom's
defaults), each with the largest local batch of --batches that fits:

  loom           `loom bench step --config configs/bench-tiny.toml --json --model.config=<model>
                 --training.device=cuda --training.mixed_precision_param=bfloat16
                 --training.seq_len=2048 --training.local_batch_size=B --bench.warmup_steps=2
                 --bench.steps=5` ($LOOM_BIN, else build/loom, else .device/bin/loom). B: the
                 largest batch whose `loom plan` peak fits the GPU's memory (less 2 GiB), then
                 smaller ones while loom fails with "out of memory". tokens/s, MFU and peak memory
                 are loom's own (median step; MFU against the bf16 GEMM peak loom measures at start).
  torch eager    an nn.Module Llama written here (torchtitan's layout: q, k, v, o, gate, up, down
                 as nn.Linear; RMSNorm and RoPE in fp32; GQA by repeating k and v; causal
                 F.scaled_dot_product_attention; the loss on full fp32 logits) under
                 torch.autocast(bfloat16) over fp32 parameters (autocast, not bf16 parameters: the
                 fp32 weights are the master copy, autocast casts them to bf16 for the GEMMs each
                 step, gradients and AdamW moments are fp32, as loom's), fused AdamW,
                 clip_grad_norm_(1.0, foreach). Batches tried from the largest down; an
                 OutOfMemoryError frees everything and the next smaller one runs.
  torch compile  the same model with each block and the head (final norm, output GEMM, loss)
                 under torch.compile (default mode, dynamic=False, as torchtitan compiles per
                 block). It starts at eager's batch (compiled code usually needs less memory
                 than eager's; smaller ones after an OOM), then tries larger batches one by one
                 while the memory extrapolated from the last run's peak fits 92% of the GPU and
                 the time left allows another compile (each new batch recompiles).

Each side runs in a process of its own (a crash, hang or OOM of one never touches the others; the
GPU is free between them); torch's processes print their progress as JSON lines, so a side killed
at its time limit still reports its last finished batch. Torch steps are timed with CUDA events
per step (3 warm-up steps: the first holds cuBLAS/SDPA heuristics, the allocator's growth, the
optimizer's lazy state and, compiled, the compilation; then 10 timed steps, their median), and
peak memory is torch.cuda.max_memory_allocated over the timed steps (loom: its allocator's peak
over its timed steps, both reset after warm-up). torch also measures its bf16 GEMM peak: an
8192^3 matmul on random data, 7 samples of 10 timed with CUDA events, the median (what `loom
info` measures with cuBLASLt; when loom's step fails, `loom info` gives loom's figure). FLOPs per
token: torchtitan's 6N + 12 L H Q T (N without the input embedding; a tied output projection
counts), as compare_torch.py and loom. The JSON also holds each torch side's wall-clock step (a
cross-check of the events), the first step's time (compile: the compilation), every batch tried,
and `loom plan`'s predicted tokens/s for loom's batch on this GPU's hardware file.

Time: each phase's limit is its own or what is left of --budget (230 s, so the whole run fits the
4 minutes of a GPU session), whichever is less: loom 80 s (start, weight init on the CPU, loom's
own GEMM peak, 2 + 5 steps: loom bench's defaults; a failed batch costs the start and part of a
step), eager 50 s (torch start, the GEMM peak, OOM probes of about a second each from the largest
batch down, 3 + 10 steps of about 0.2-1 s), compile 110 s (compiling a block and the head,
forward and backward, takes 20-60 s on an H100 host; a recompile per extra batch). 10 timed
torch steps give a median that one slow step cannot move, in a few seconds. A side stopped at
its limit says so in the table: rerun that side alone (--sides) with fewer steps or batches.
The table, printed last: per system the batch,
tokens/s, step time, MFU against loom's and torch's measured GEMM peaks and against 989 TFLOP/s
(H100 SXM dense bf16), peak memory, status (an error's first line when a side failed); above it
the ratios loom / torch compiled (target >= 1.2) and loom / eager, and loom's MFU against 989
(target >= 45%).

  --smoke        configs/debug.json, seq 128, batches 8,4,2, 2 + 5 torch steps, 1 + 3 loom steps:
                 the whole script in seconds (a GPU session can run it first).
  --device cpu   for testing without a GPU: torch on the CPU (autocast bf16 there, wall-clock
                 timing, a 512^3 GEMM peak, no peak memory), loom with --training.device=cpu.
                 torch without torch.compile (1.13) reports compile as unavailable.
  --loom-ld-path LD_LIBRARY_PATH for loom's processes only (torch's never see it). Default:
                 $LOOM_LD_LIBRARY_PATH, else `auto` when the binary is .device/bin/loom: the
                 Debian packages device_check.sh unpacks into /tmp/loom-prefix (unpacked here
                 into /tmp/loom-prefix-compare when that is missing) and the folders holding
                 libcublasLt.so.13 (the CUDA toolkit's, else PyTorch's nvidia-* wheels).

Exit status: 0 when every requested side measured (or, torch.compile, is unavailable), 1 otherwise;
the table is printed either way.
"""
import argparse
import glob
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_torch import fmt, last_json  # noqa: E402  (imports no torch)

SPEC_PEAK_TFLOPS = 989.0  # H100 SXM (and H200) dense bf16 tensor-core peak
TARGET_RATIO = 1.2        # loom / torch compiled tokens/s (issue "loom on NVIDIA GPUs")
TARGET_MFU = 0.45         # loom's MFU against SPEC_PEAK_TFLOPS
BATCHES = "32,24,20,16,12,10,8,6,5,4,3,2,1"
PHASE_S = {"loom": 80, "eager": 50, "compile": 110}
BUDGET_S = 230
SIDES = ("loom", "eager", "compile")
LABEL = {"loom": "loom", "eager": "torch eager", "compile": "torch compile"}
LOOM_PREFIX = "/tmp/loom-prefix"  # where scripts/device_check.sh unpacks .device/debs
GIB = 1024.0 ** 3


# ---- the model's shape and FLOPs (no torch needed) ------------------------------------------------

def model_path(name):
    """A config name from configs/ or a path to a Hugging Face config.json (absolute)."""
    p = name if ("/" in name or name.endswith(".json")) else os.path.join(ROOT, "configs", name + ".json")
    return os.path.abspath(p)


class Shape:
    """The Llama numbers of a Hugging Face config.json."""

    def __init__(self, d):
        self.dim = int(d["hidden_size"])
        self.n_layers = int(d["num_hidden_layers"])
        self.n_heads = int(d["num_attention_heads"])
        self.n_kv_heads = int(d.get("num_key_value_heads") or self.n_heads)
        self.head_dim = int(d.get("head_dim") or self.dim // self.n_heads)
        self.ffn = int(d["intermediate_size"])
        self.vocab = int(d["vocab_size"])
        self.eps = float(d.get("rms_norm_eps", 1e-6))
        self.theta = float(d.get("rope_theta", 10000.0))
        self.rope_scaling = d.get("rope_scaling")
        self.tied = bool(d.get("tie_word_embeddings", False))

    def params(self):
        C, D, H, K, L = self.dim, self.head_dim, self.n_heads, self.n_kv_heads, self.n_layers
        block = 2 * C + (H + 2 * K) * D * C + H * D * C + 3 * self.ffn * C
        return self.vocab * C * (1 if self.tied else 2) + L * block + C

    def flops_per_token(self, seq_len):
        """torchtitan: 6N + 12 L H Q T, N without the input embedding (a tied head counts)."""
        n = self.params() - (0 if self.tied else self.vocab * self.dim)
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def rope_inv_freq(self):
        """[head_dim/2] floats: theta^(-2i/D), with Llama 3.1's "llama3" scaling when configured."""
        D = self.head_dim
        out = []
        rs = self.rope_scaling
        llama3 = rs is not None and rs.get("rope_type", rs.get("type")) == "llama3"
        for i in range(D // 2):
            f = self.theta ** (-2 * i / D)
            if llama3:
                old, lo, hi = float(rs["original_max_position_embeddings"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
                w = 2 * math.pi / f
                if w > old / lo:
                    f = f / float(rs["factor"])
                elif w >= old / hi:
                    sm = (old / w - lo) / (hi - lo)
                    f = (1 - sm) * f / float(rs["factor"]) + sm * f
            out.append(f)
        return out


# ---- the torch side (runs in a child: --worker eager|compile) ---------------------------------------

def human(x, unit):
    """1.2 T / 3.4 G / 5.6 M / 7.8 k of unit."""
    if x is None:
        return "n/a"
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f:
            return f"{x / f:.3g} {p}{unit}" if f != 1e12 or abs(x) < 1e15 else f"{x / f:.0f} {p}{unit}"
    return f"{x:.3g} {unit}"


def count(n):
    return f"{n / 1e9:.3f} B parameters" if n >= 1e8 else f"{n / 1e6:.3f} M parameters"


def first_line(e):
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0] if s else ''}"[:300]


def is_oom(torch, e):
    return isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


def build_model(torch, shape, T, dev):
    """torchtitan's Llama as nn.Modules; parameters fp32 on dev, N(0, 0.02) matrices, norms ones."""
    import torch.nn as nn
    import torch.nn.functional as F

    C, H, K, D, eps = shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.eps
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    fused_norm = getattr(F, "rms_norm", None)

    def rms_norm(x, w):  # in fp32 whatever autocast does around it
        xf = x.float()
        if fused_norm is not None:
            return fused_norm(xf, (C,), w, eps)
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, cos, sin):  # x [B, T, h, D]; cos, sin [T, 1, D] fp32, rotate-half layout; in fp32
        xf = x.float()
        rot = torch.cat([-xf[..., D // 2:], xf[..., :D // 2]], dim=-1)
        return (xf * cos + rot * sin).type_as(x)

    def attend(q, k, v):  # [B, h, T, D] -> [B, H, T, D], causal
        B, _, Tq, _ = q.shape
        if K != H:  # torchtitan's repeat_kv: every SDPA backend takes it
            k = k[:, :, None].expand(B, K, H // K, Tq, D).reshape(B, H, Tq, D)
            v = v[:, :, None].expand(B, K, H // K, Tq, D).reshape(B, H, Tq, D)
        if sdpa is not None:
            return sdpa(q, k, v, is_causal=True)
        s = torch.matmul(q, k.transpose(-1, -2)) * D ** -0.5  # torch < 2.0: no SDPA
        mask = torch.ones(Tq, Tq, dtype=torch.bool, device=q.device).triu(1)
        p = torch.softmax(s.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
        return torch.matmul(p, v)

    def linear(i, o):
        return nn.Linear(i, o, bias=False, device=dev)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.Parameter(torch.ones(C, device=dev))
            self.wq, self.wk, self.wv, self.wo = linear(C, H * D), linear(C, K * D), linear(C, K * D), linear(H * D, C)
            self.ffn_norm = nn.Parameter(torch.ones(C, device=dev))
            self.w1, self.w3, self.w2 = linear(C, shape.ffn), linear(C, shape.ffn), linear(shape.ffn, C)

        def forward(self, x, cos, sin):
            B, Tx, _ = x.shape
            h = rms_norm(x, self.attention_norm)
            q = rope(self.wq(h).view(B, Tx, H, D), cos, sin).transpose(1, 2)
            k = rope(self.wk(h).view(B, Tx, K, D), cos, sin).transpose(1, 2)
            v = self.wv(h).view(B, Tx, K, D).transpose(1, 2)
            x = x + self.wo(attend(q, k, v).transpose(1, 2).reshape(B, Tx, H * D))
            h = rms_norm(x, self.ffn_norm)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Head(nn.Module):
        def __init__(self, tied_weight):
            super().__init__()
            self.norm = nn.Parameter(torch.ones(C, device=dev))
            self.weight = tied_weight if tied_weight is not None else nn.Parameter(torch.empty(shape.vocab, C, device=dev))

        def forward(self, x, targets):
            logits = F.linear(rms_norm(x, self.norm), self.weight)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(shape.vocab, C, device=dev)
            self.layers = nn.ModuleList([Block() for _ in range(shape.n_layers)])
            self.head = Head(self.tok_embeddings.weight if shape.tied else None)
            inv = torch.tensor(shape.rope_inv_freq(), dtype=torch.float64)
            ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
            ang = torch.cat([ang, ang], dim=-1)[:, None, :]  # [T, 1, D]
            self.register_buffer("cos", ang.cos().float().to(dev), persistent=False)
            self.register_buffer("sin", ang.sin().float().to(dev), persistent=False)

        def forward(self, idx, targets):
            x = self.tok_embeddings(idx)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            return self.head(x, targets)

    model = Llama()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model


def gemm_peak(torch, dev, n):
    """bf16 n^3 matmul on random data: FLOP/s, median of 7 samples of 10 (CUDA events on a GPU)."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    reps = 10 if dev.type == "cuda" else 2
    for _ in range(3):
        torch.matmul(a, b, out=c)
    rates = []
    for _ in range(7):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                torch.matmul(a, b, out=c)
            e.record()
            e.synchronize()
            t = s.elapsed_time(e) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.matmul(a, b, out=c)
            t = time.perf_counter() - t0
        rates.append(2.0 * n ** 3 * reps / t)
    del a, b, c
    return statistics.median(rates)


def worker(a):
    """One torch side in this process; prints its state as a JSON line after every phase."""
    t_start = time.monotonic()
    out = {"system": a.worker, "status": "starting", "attempts": []}

    def emit():
        print(json.dumps(out), flush=True)

    def left():
        return a.budget - (time.monotonic() - t_start)

    try:
        if a.device == "cpu":
            from torch_step import preload_blas  # an OpenBLAS before torch (Debian's torch 1.13)
            preload_blas(None)
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = getattr(torch.version, "cuda", None)
        dev = torch.device(a.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch {torch.__version__} sees no usable CUDA GPU (torch.cuda.is_available() is False)")
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(a.threads)
        out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        if a.peak_n:
            out["gemm_peak_n"] = a.peak_n
            out["gemm_peak_flops"] = gemm_peak(torch, dev, a.peak_n)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            emit()
        if a.worker == "compile" and not hasattr(torch, "compile"):
            out["status"] = f"unavailable: torch {torch.__version__} has no torch.compile"
            emit()
            return 0

        with open(a.model_path) as f:
            shape = Shape(json.load(f))
        out["flops_per_token"] = shape.flops_per_token(a.seq)
        try:  # the parity tests' independent reference, where it imports (it needs numpy)
            sys.path.insert(0, os.path.join(ROOT, "tests", "parity"))
            import torch_llama as tl
            with open(a.model_path) as f:
                ref = tl.Config(json.load(f))
            mine, theirs = shape.rope_inv_freq(), tl.rope_inv_freq(ref).tolist()
            ok = ref.flops_per_token(a.seq) == out["flops_per_token"] and max(
                abs(x - y) / y for x, y in zip(mine, theirs)) < 1e-12
            out["self_check"] = "FLOPs and RoPE match tests/parity/torch_llama.py" if ok else "MISMATCH with torch_llama.py"
        except Exception as e:  # noqa: BLE001
            out["self_check"] = "skipped: " + first_line(e)

        torch.manual_seed(0)
        model = build_model(torch, shape, a.seq, dev)
        params = list(model.parameters())
        out["params"] = sum(p.numel() for p in params)
        if out["params"] != shape.params():
            raise RuntimeError(f"the torch model has {out['params']} parameters, the config {shape.params()}")
        if a.worker == "compile":
            import torch._dynamo
            # Room for a recompile per batch tried (and per block, should blocks not share their
            # code). cache_size_limit is the old name of recompile_limit (torch 2.11 has both).
            for name in ("recompile_limit", "cache_size_limit"):
                try:
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
                except Exception:  # noqa: BLE001
                    pass
            for i, layer in enumerate(model.layers):
                model.layers[i] = torch.compile(layer, dynamic=False)
            model.head = torch.compile(model.head, dynamic=False)
        hp = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        opt = None
        for kind, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {})):
            try:
                opt = torch.optim.AdamW(params, **hp, **kw)
                out["optimizer"] = f"AdamW ({kind})"
                break
            except (TypeError, RuntimeError, ValueError):
                continue
        try:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)  # noqa: E731
        except TypeError:  # torch < 2.0
            clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)  # noqa: E731
        out["attention"] = "F.scaled_dot_product_attention(is_causal=True)" if hasattr(
            torch.nn.functional, "scaled_dot_product_attention") else "matmul + masked softmax (torch has no SDPA)"
        out["precision"] = "torch.autocast(bfloat16) over fp32 parameters; fp32 grads and AdamW moments"
        cuda = dev.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def step(inp, tgt):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(inp, tgt)
            loss.backward()
            clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def run(b):
            g = torch.Generator(device="cpu").manual_seed(b)
            tok = torch.randint(0, shape.vocab, (b, a.seq + 1), generator=g).to(dev)
            inp, tgt = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
            losses = []
            t0 = time.perf_counter()
            losses.append(step(inp, tgt))
            sync()
            first = time.perf_counter() - t0
            for _ in range(a.warmup - 1):
                losses.append(step(inp, tgt))
            sync()
            rest = torch.cuda.memory_allocated() if cuda else None  # weights + moments, no grads
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            t_loop = time.perf_counter()
            if cuda:
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
                for s, e in ev:
                    s.record()
                    losses.append(step(inp, tgt))
                    e.record()
                sync()
                times = [s.elapsed_time(e) / 1e3 for s, e in ev]
            else:
                for _ in range(a.steps):
                    t1 = time.perf_counter()
                    losses.append(step(inp, tgt))
                    times.append(time.perf_counter() - t1)
            wall = (time.perf_counter() - t_loop) / a.steps  # the loop's wall clock: a cross-check
            lv = torch.stack(losses).float().tolist()
            if not all(math.isfinite(x) for x in lv):
                raise RuntimeError(f"non-finite loss: {lv}")
            step_s = statistics.median(times)
            return {"batch": b, "step_s": step_s, "tokens_per_s": b * a.seq / step_s,
                    "min_step_s": min(times), "max_step_s": max(times), "wall_step_s": wall, "first_step_s": first,
                    "loss_first": lv[0], "loss_last": lv[-1],
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
                    "rest_bytes": rest}

        def attempt(b):
            """(result, None) or (None, (error, oom)); frees the failed step's tensors."""
            t0 = time.monotonic()
            err = None
            try:
                r = run(b)
            except Exception as e:  # noqa: BLE001
                err, r = (first_line(e), is_oom(torch, e)), None
            # Out of the except clause: the traceback, and the activations its frames held, are gone.
            if err:
                opt.zero_grad(set_to_none=True)
                import gc
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            out["attempts"].append({"batch": b, "seconds": round(time.monotonic() - t0, 2),
                                    "result": "ok" if r else ("OOM" if err[1] else "error"),
                                    **({"error": err[0]} if err else {})})
            if r:
                out.update(r)
                out["status"] = "ok"
            emit()
            return r, err

        batches = [int(x) for x in a.batches.split(",") if x]
        start = a.start_batch or batches[0]
        down = [b for b in batches if b <= start]
        up = sorted(b for b in batches if b > start) if a.start_batch else []
        got, last_s = None, 0.0
        for b in down:  # an OOM shows within the first step: these probes are short
            if left() < 5:
                out["attempts"].append({"batch": b, "result": "skipped: no time left"})
                break
            t0 = time.monotonic()
            got, err = attempt(b)
            last_s = time.monotonic() - t0
            if got or not err[1]:
                break
        if got and up and cuda:
            # Larger batches than the start while the memory extrapolated from the last run fits
            # and another compile (the last attempt's time) fits in what is left.
            total = out["gpu_memory_bytes"]
            for b in up:
                # Batch-independent: the weights and moments at rest, fp32 gradients and autocast's
                # bf16 copies of the weights (4 + 2 bytes a parameter).
                fixed = got["rest_bytes"] + 6 * out["params"]
                need = fixed + b * max(0.0, (got["peak_allocated_bytes"] - fixed) / got["batch"])
                if need > 0.92 * total or left() < 1.3 * last_s:
                    out["attempts"].append({"batch": b, "result": "skipped: predicted %.1f GiB of %.1f, %.0f s left"
                                            % (need / GIB, total / GIB, left())})
                    break
                t0 = time.monotonic()
                r, err = attempt(b)
                last_s = time.monotonic() - t0
                if not r:  # the smaller batch's figures stay
                    out.update(got)
                    out["status"] = "ok"
                    break
                got = r
        if not got:
            fails = [x for x in out["attempts"] if x.get("error")]
            out["status"] = "error"
            out["error"] = fails[-1]["error"] if fails else "no batch tried"
            if fails and all(x["result"] == "OOM" for x in fails):
                out["error"] = f"out of memory at every batch down to {fails[-1]['batch']}: " + fails[-1]["error"]
    except Exception as e:  # noqa: BLE001
        out["status"] = "error"
        out["error"] = first_line(e)
    emit()
    return 0


# ---- running the sides -------------------------------------------------------------------------------

def run_proc(cmd, env, timeout):
    """(rc, stdout, stderr, seconds, timed_out); the child's whole process group is killed at timeout
    (torch.compile's compile workers included)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(1, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        timed_out = True
    return p.returncode, out or "", err or "", time.monotonic() - t0, timed_out


def error_line(stderr, stdout=""):
    """The first line that looks like the error, else the last non-empty line."""
    lines = [x.strip() for x in (stderr + "\n" + stdout).splitlines() if x.strip()]
    for x in lines:
        if re.search(r"error|exception|terminate|what\(\)|fatal|not found|No such file", x, re.I):
            return x[:300]
    return lines[-1][:300] if lines else "no output"


def find_loom_bin(arg):
    if arg:
        return arg
    for p in (os.path.join(ROOT, "build", "loom"), os.path.join(ROOT, ".device", "bin", "loom")):
        if os.access(p, os.X_OK):
            return p
    return os.path.join(ROOT, "build", "loom")


def auto_ld_path(python):
    """The carried Debian libraries (device_check.sh's prefix, or unpacked here) and the folders of
    the CUDA libraries loom needs, as scripts/device_check.sh composes them."""
    notes = []
    prefix = LOOM_PREFIX
    libdir = os.path.join(prefix, "usr", "lib", "x86_64-linux-gnu")
    debs = sorted(glob.glob(os.path.join(ROOT, ".device", "debs", "*.deb")))
    if not os.path.isdir(libdir) and debs:
        prefix = LOOM_PREFIX + "-compare"
        libdir = os.path.join(prefix, "usr", "lib", "x86_64-linux-gnu")
        if not os.path.isdir(libdir):
            os.makedirs(prefix, exist_ok=True)
            bad = [d for d in debs if subprocess.run(["dpkg", "-x", d, prefix], capture_output=True).returncode]
            if os.path.isdir(os.path.join(prefix, "usr", "lib", "libpsm1")):
                subprocess.run(["ldconfig", "-n", os.path.join(prefix, "usr", "lib", "libpsm1")], capture_output=True)
            notes.append(f"unpacked {len(debs) - len(bad)} of {len(debs)} .device/debs into {prefix}")
    dirs = [d for d in (libdir, os.path.join(prefix, "lib", "x86_64-linux-gnu"), os.path.join(prefix, "usr", "lib", "libpsm1"))
            if os.path.isdir(d)]
    try:
        with open(os.path.join(ROOT, ".device", "cuda-sonames.txt")) as f:
            wanted = [x.strip() for x in f if x.strip()]
    except OSError:
        wanted = ["libcublasLt.so.13"]
    cands = [d for pat in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/*/lib", "/usr/local/cuda-*/lib64",
                           "/usr/local/cuda-*/targets/*/lib") for d in sorted(glob.glob(pat))]
    try:
        sps = subprocess.run([python, "-c", "import site, sysconfig; print('\\n'.join(site.getsitepackages() + "
                              "[site.getusersitepackages()] + [sysconfig.get_paths()[k] for k in ('purelib', 'platlib')]))"],
                             capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        sps = []
    for sp in dict.fromkeys(sps):
        cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))) + sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib64")))
    for s in wanted:
        hit = next((d for d in cands if os.path.exists(os.path.join(d, s))), None)
        if hit and hit not in dirs:
            dirs.append(hit)
        notes.append(f"{s}: {hit or 'not found in the toolkit or wheels (the system loader may have it)'}")
    return ":".join(dirs), notes


def loom_side(a, mpath, shape, deadline, env):
    res = {"system": "loom", "status": "error", "attempts": []}
    if not os.access(a.loom_bin, os.X_OK):
        res["error"] = f"{a.loom_bin}: no such executable (set LOOM_BIN or --loom-bin)"
        return res
    rc, out, err, _, to = run_proc([a.loom_bin, "info", "--json", "--peak-seconds", "0"], env, min(30, deadline - time.monotonic()))
    info = last_json(out) if rc == 0 else None
    if info is None:
        res["error"] = "loom info: " + ("timed out" if to else error_line(err, out))
        return res
    gpu = info.get("gpu") or {}
    res["gpu_backend"] = gpu.get("backend")
    total = None
    if a.device == "cuda":
        if gpu.get("none") or not gpu.get("cuda_backend", False):
            res["error"] = "loom info: no usable GPU: " + (gpu.get("none") or "built without the CUDA backend")
            return res
        res["gpu"] = (gpu.get("gpus") or [None])[0]
        m = re.search(r", ([0-9.]+) GiB,", res["gpu"] or "")
        total = float(m.group(1)) * GIB if m else None
    batches = [int(x) for x in a.batches.split(",") if x]
    base = [a.loom_bin, "bench", "step", "--config", os.path.join(ROOT, "configs", "bench-tiny.toml"), "--json",
            f"--model.config={mpath}", f"--training.device={a.device}",
            "--training.mixed_precision_param=bfloat16", f"--training.seq_len={a.seq}",
            f"--bench.warmup_steps={a.loom_warmup}", f"--bench.steps={a.loom_steps}"]
    plans = {}

    def plan(b):
        """`loom plan` of batch b on this GPU's hardware model (the meta device, under a second):
        its peak reserved bytes and predicted tokens/s, or Nones. Exit 2 = does not fit."""
        if b not in plans:
            rc, out, err, _, _ = run_proc([a.loom_bin, "plan", "--config", base[4], "--world", "1", "--json",
                                           "--hardware", hw, f"--model.config={mpath}",
                                           "--training.mixed_precision_param=bfloat16", f"--training.seq_len={a.seq}",
                                           f"--training.local_batch_size={b}"], env, 20)
            p = last_json(out) if rc in (0, 2) else None
            try:
                r0 = p["ranks"][0]
                plans[b] = (r0["peak_reserved_bytes"], r0["time"]["job_tokens_per_s"])
            except (TypeError, KeyError, IndexError):
                plans[b] = (None, None)
            res.setdefault("plan", {})[b] = {"peak_reserved_gib": plans[b][0] and round(plans[b][0] / GIB, 2),
                                             "tokens_per_s": plans[b][1], "hardware": hw}
        return plans[b]

    gname = res.get("gpu") or ""
    hw = "h200" if "H200" in gname else "h100-96g-500w" if (total or 0) > 90 * GIB else "h100-sxm-80g"
    if total:
        # loom's cost model: start at the largest batch whose planned peak fits the GPU with 2 GiB
        # to spare (CUDA context, cuBLASLt's workspace, the attention's scratch).
        start = batches[-1]
        for b in batches:
            if time.monotonic() > deadline - 30:
                break
            need = plan(b)[0]
            if need is None or need + 2 * GIB <= total:
                start = b
                break  # the list descends: the rest fit too
        batches = [b for b in batches if b <= start]
    for b in batches:
        left = deadline - time.monotonic()
        if left < 10:
            res["attempts"].append({"batch": b, "result": "skipped: no time left"})
            break
        cmd = base + [f"--training.local_batch_size={b}"]
        res["command"] = " ".join(cmd)
        rc, out, err, secs, to = run_proc(cmd, env, left)
        j = last_json(out) if rc == 0 else None
        if j:
            res["attempts"].append({"batch": b, "seconds": round(secs, 1), "result": "ok"})
            res.update(status="ok", batch=b, step_s=j["step_s"], tokens_per_s=j["tokens_per_s"],
                       mfu_loom=j.get("mfu"), gemm_peak_flops=(j.get("gemm_peak_tflops") or 0) * 1e12 or None,
                       peak_allocated_bytes=j.get("peak_allocated_bytes"), peak_reserved_bytes=j.get("peak_reserved_bytes"),
                       expected_bytes=j.get("expected_bytes"), loss_first=j.get("loss_first"), loss_last=j.get("loss_last"),
                       loom_flops_per_token=j["tflops"] * 1e12 / j["tokens_per_s"] if j.get("tokens_per_s") else None,
                       precision=j.get("precision"), commit=(j.get("system") or {}).get("commit"))
            res.pop("error", None)
            if total and time.monotonic() < deadline - 5:
                res["plan_tokens_per_s"] = plan(b)[1]  # the planner's prediction of this run
            return res
        msg = f"timed out after {secs:.0f} s at batch {b}" if to else error_line(err, out)
        oom = "out of memory" in (err + out).lower()
        res["attempts"].append({"batch": b, "seconds": round(secs, 1), "result": "OOM" if oom else "error", "error": msg})
        res["error"] = msg
        if not oom:
            break
    if total and time.monotonic() < deadline - 15:
        # No step ran: loom's GEMM peak from `loom info` (the same measurement), for torch's MFUs.
        rc, out, err, _, _ = run_proc([a.loom_bin, "info", "--json", "--peak-seconds", "0.5"], env, 15)
        info = last_json(out) if rc == 0 else None
        res["gemm_peak_flops"] = ((info or {}).get("gpu") or {}).get("gemm_peak_bf16_flops") or None
    return res


def torch_side(a, mode, deadline, env, start_batch=None, peak=True):
    left = deadline - time.monotonic()
    res = {"system": mode, "status": "error"}
    if left < 10:
        res["error"] = "skipped: no time left"
        return res
    cmd = [a.torch_python, os.path.abspath(__file__), "--worker", mode, "--model", a.model_path,
           "--seq", str(a.seq), "--batches", a.batches, "--device", a.device, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--threads", str(a.threads), "--budget", str(max(5, left - 8)),
           "--peak-n", str(a.peak_n if peak else 0)]
    if start_batch:
        cmd += ["--start-batch", str(start_batch)]
    rc, out, err, secs, to = run_proc(cmd, env, left)
    j = last_json(out)
    if j:
        res = j
    if to:
        res.setdefault("notes", []).append(f"killed at its time limit ({secs:.0f} s)")
        if res.get("status") != "ok":
            res["status"], res["error"] = "error", f"timed out after {secs:.0f} s" + (
                f" ({res['error']})" if res.get("error") else "")
    elif not j:
        res["error"] = f"exit {rc}: " + error_line(err, out)
    elif rc != 0 and res.get("status") != "ok":
        res["error"] = res.get("error") or f"exit {rc}: " + error_line(err, out)
    res["seconds"] = round(secs, 1)
    res["system"] = mode
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["eager", "compile"], help=argparse.SUPPRESS)
    ap.add_argument("--start-batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", help="model config name (configs/NAME.json) or config.json path (default llama3.2-1b; --smoke: debug)")
    ap.add_argument("--seq", type=int, help="seq_len (default 2048; --smoke: 128)")
    ap.add_argument("--batches", help=f"local batches to try, largest first (default {BATCHES}; --smoke: 8,4,2)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sides", default=",".join(SIDES), help="which of loom,eager,compile to run")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few steps: the whole script in seconds")
    ap.add_argument("--steps", type=int, help="timed torch steps (default 10; --smoke: 5)")
    ap.add_argument("--warmup", type=int, help="torch warm-up steps (default 3; --smoke: 2)")
    ap.add_argument("--loom-steps", type=int, help="loom's timed steps (default 5; --smoke: 3)")
    ap.add_argument("--loom-warmup", type=int, help="loom's warm-up steps (default 2; --smoke: 1)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    for s in SIDES:
        ap.add_argument(f"--{s}-timeout", type=float, default=PHASE_S[s], help=f"most seconds for {s} (default {PHASE_S[s]})")
    ap.add_argument("--peak-n", type=int, help="n of torch's n^3 bf16 GEMM peak (default 8192; cpu: 512)")
    ap.add_argument("--spec-tflops", type=float, default=SPEC_PEAK_TFLOPS, help="the datasheet bf16 peak (989: H100 SXM)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads with --device cpu")
    ap.add_argument("--loom-bin", default=os.environ.get("LOOM_BIN"), help="default $LOOM_BIN, else build/loom, else .device/bin/loom")
    ap.add_argument("--loom-ld-path", default=os.environ.get("LOOM_LD_LIBRARY_PATH"),
                    help="LD_LIBRARY_PATH for loom's processes only, or auto (default $LOOM_LD_LIBRARY_PATH; "
                         "auto when the binary is .device/bin/loom)")
    ap.add_argument("--torch-python", default=sys.executable, help="the python3 with torch (default this one)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    # Defaults, the smoke run's second.
    for k, full, smoke in (("model", "llama3.2-1b", "debug"), ("seq", 2048, 128), ("batches", BATCHES, "8,4,2"),
                           ("steps", 10, 5), ("warmup", 3, 2), ("loom_steps", 5, 3), ("loom_warmup", 2, 1)):
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    if a.peak_n is None:
        a.peak_n = 8192 if a.device == "cuda" else 512
    try:
        bl = [int(x) for x in a.batches.split(",") if x]
    except ValueError:
        bl = []
    if not bl or min(bl) < 1 or bl != sorted(bl, reverse=True):
        ap.error(f"--batches {a.batches!r}: positive integers, largest first")
    if a.steps < 1 or a.warmup < 1 or a.loom_steps < 1 or a.loom_warmup < 0:
        ap.error("--steps and --warmup must be >= 1, --loom-steps >= 1, --loom-warmup >= 0")
    a.model_path = model_path(a.model)
    if a.worker:
        return worker(a)

    t_start = time.monotonic()
    deadline = t_start + a.budget
    sides = [s for s in a.sides.split(",") if s]
    for s in sides:
        if s not in SIDES:
            ap.error(f"--sides: {s!r} is not one of {', '.join(SIDES)}")
    try:
        with open(a.model_path) as f:
            shape = Shape(json.load(f))
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"--model {a.model}: {a.model_path}: {e}")
    fpt = shape.flops_per_token(a.seq)
    a.loom_bin = os.path.abspath(find_loom_bin(a.loom_bin))
    notes = []
    ld = a.loom_ld_path
    if ld is None and os.path.realpath(a.loom_bin).startswith(os.path.realpath(os.path.join(ROOT, ".device")) + os.sep):
        ld = "auto"
    auto = ld == "auto"
    if auto:
        ld, more = auto_ld_path(a.torch_python)
        notes += more
    loom_env = dict(os.environ)
    loom_env.setdefault("LOOM_SOURCE_DIR", ROOT)  # configs/ (hardware files) for a carried binary
    if auto:
        # As device_check.sh's loom_env: an image's own MPI settings would steer the carried Open MPI wrong.
        for k in [k for k in loom_env if re.match(r"OMPI_MCA_|PMIX_MCA_|OPAL_|PMIX_PREFIX|PMIX_INSTALL_PREFIX", k)]:
            del loom_env[k]
    if ld:
        loom_env["LD_LIBRARY_PATH"] = ld + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
    torch_env = dict(os.environ)
    torch_env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    print(f"compare_torch_gpu: {a.model} ({count(shape.params())}), seq {a.seq}, "
          f"{fpt / 1e9:.3f} GFLOP/token, device {a.device}, budget {a.budget:.0f} s; loom {a.loom_bin}"
          + (f" (LD_LIBRARY_PATH {ld})" if ld else ""), file=sys.stderr, flush=True)
    load_before = os.getloadavg()

    results = {}
    for s in SIDES:
        if s not in sides:
            continue
        # This phase's limit, cut to what is left.
        phase_deadline = min(deadline, time.monotonic() + getattr(a, f"{s}_timeout"))
        t0 = time.monotonic()
        try:
            if s == "loom":
                r = loom_side(a, a.model_path, shape, phase_deadline, loom_env)
            else:
                eager = results.get("eager", {})
                start = eager.get("batch") if s == "compile" and eager.get("status") == "ok" else None
                r = torch_side(a, s, phase_deadline, torch_env, start, peak=s == "eager" or "eager" not in sides)
        except Exception as e:  # noqa: BLE001  (a bug here must not cost the other sides)
            r = {"system": s, "status": "error", "error": "compare_torch_gpu.py: " + first_line(e)}
        r.setdefault("seconds", round(time.monotonic() - t0, 1))
        results[s] = r
        print(f"[{time.monotonic() - t_start:5.0f} s] {LABEL[s]}: {r.get('status')}"
              + (f", batch {r['batch']}, {r['tokens_per_s']:.0f} tokens/s" if r.get("status") == "ok" else "")
              + (f": {r['error']}" if r.get("error") else ""), file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    # The figures.
    loom_peak = results.get("loom", {}).get("gemm_peak_flops")
    torch_peak = results.get("eager", {}).get("gemm_peak_flops") or results.get("compile", {}).get("gemm_peak_flops")
    spec = a.spec_tflops * 1e12
    rows = []
    for s in [s for s in SIDES if s in sides]:
        r = results[s]
        tps = r.get("tokens_per_s") if r.get("status") == "ok" else None
        fl = tps * fpt if tps else None
        row = {"system": LABEL[s], "status": r.get("status"), "error": r.get("error"),
               "batch": r.get("batch") if tps else None, "tokens_per_s": tps, "step_s": r.get("step_s") if tps else None,
               "mfu_vs_loom_peak": fl / loom_peak if fl and loom_peak else None,
               "mfu_vs_torch_peak": fl / torch_peak if fl and torch_peak else None,
               "mfu_vs_spec": fl / spec if fl else None,
               "peak_allocated_bytes": r.get("peak_allocated_bytes") if tps else None,
               "details": r}
        rows.append(row)
    by = {r["system"]: r for r in rows}

    def ratio(x, y):
        tx, ty = by.get(x, {}).get("tokens_per_s"), by.get(y, {}).get("tokens_per_s")
        return tx / ty if tx and ty else None

    r_compile, r_eager = ratio("loom", "torch compile"), ratio("loom", "torch eager")
    loom_mfu = by.get("loom", {}).get("mfu_vs_spec")
    lfpt = results.get("loom", {}).get("loom_flops_per_token")
    if lfpt and abs(lfpt / fpt - 1) > 0.01:
        notes.append(f"loom counts {lfpt:.4g} FLOPs/token, this script {fpt:.4g} (6N + 12LHQT): MFUs differ in convention")
    if results.get("loom", {}).get("command"):
        print("loom:", results["loom"]["command"], file=sys.stderr)
    lr = results.get("loom", {})
    if lr.get("plan_tokens_per_s") and lr.get("tokens_per_s"):
        notes.append(f"loom plan on {lr['plan'][lr['batch']]['hardware']} predicts {lr['plan_tokens_per_s']:.0f} tokens/s "
                     f"at batch {lr['batch']}; measured {lr['tokens_per_s']:.0f} ({lr['tokens_per_s'] / lr['plan_tokens_per_s']:.2f}x)")
    if lr.get("attempts") and (len(lr["attempts"]) > 1 or lr.get("plan")):
        notes.append("loom batches tried: " + ", ".join(f"{x['batch']} {x['result']}" for x in lr["attempts"])
                     + (" (plan's peak GiB: " + ", ".join(f"{b} {p['peak_reserved_gib']}" for b, p in lr["plan"].items()) + ")"
                        if lr.get("plan") else ""))
    for s in ("eager", "compile"):
        r = results.get(s, {})
        if r.get("status") == "ok" and r.get("first_step_s"):
            notes.append(f"torch {s}: first step {r['first_step_s']:.1f} s" + (" (compilation)" if s == "compile" else "")
                         + "; batches tried: " + ", ".join(f"{x['batch']} {x['result']}" for x in r.get("attempts", [])))
        if r.get("status") == "ok" and r.get("wall_step_s") and abs(r["wall_step_s"] / r["step_s"] - 1) > 0.1:
            notes.append(f"torch {s}: wall clock {1e3 * r['wall_step_s']:.1f} ms a step against the median step "
                         f"{1e3 * r['step_s']:.1f} ms")
        sc = r.get("self_check")
        if sc and not sc.startswith("FLOPs and RoPE match"):
            notes.append(f"torch {s}: self-check {sc}")
    summary = {
        "model": a.model, "model_path": a.model_path, "seq_len": a.seq, "device": a.device,
        "params": shape.params(), "flops_per_token": fpt, "spec_peak_flops": spec,
        "loom_gemm_peak_flops": loom_peak, "torch_gemm_peak_flops": torch_peak,
        "loom_over_torch_compile": r_compile, "loom_over_torch_eager": r_eager,
        "target_ratio": TARGET_RATIO, "meets_ratio": None if r_compile is None else r_compile >= TARGET_RATIO,
        "loom_mfu_vs_spec": loom_mfu, "target_mfu": TARGET_MFU,
        "meets_mfu": None if loom_mfu is None else loom_mfu >= TARGET_MFU,
        "torch_steps": {"warmup": a.warmup, "timed": a.steps}, "loom_steps": {"warmup": a.loom_warmup, "timed": a.loom_steps},
        "batches": a.batches, "budget_s": a.budget, "seconds": round(time.monotonic() - t_start, 1),
        "load_before": load_before, "load_after": load_after, "loom_ld_path": ld, "notes": notes,
        "rows": rows,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)

    # The report: context, then the table, last.
    tv = results.get("eager", {}).get("torch") or results.get("compile", {}).get("torch")
    gpu = results.get("eager", {}).get("gpu") or results.get("loom", {}).get("gpu")
    print()
    print(f"{a.model}: {count(shape.params())}, seq {a.seq}, bf16 GEMMs, fp32 master weights and AdamW "
          f"moments; {fpt / 1e9:.3f} GFLOP/token (6N + 12LHQT); device {a.device}" + (f" ({gpu})" if gpu else "")
          + (f"; torch {tv}" if tv else ""))
    print(f"bf16 GEMM peak measured: loom {human(loom_peak, 'FLOP/s')} (loom's {'8192^3 cuBLASLt GEMM' if a.device == 'cuda' else 'CPU GEMMs'}), "
          f"torch {human(torch_peak, 'FLOP/s')} ({a.peak_n}^3 matmul); datasheet {a.spec_tflops:.0f} TFLOP/s")
    print(f"steps: torch {a.warmup} warm-up + {a.steps} timed (median), loom {a.loom_warmup} + {a.loom_steps}; "
          f"{summary['seconds']:.0f} s in all; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for n in notes:
        print("note:", n)
    ok = lambda v: "" if v is None else (" ok" if v else " LOW")  # noqa: E731
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print(f"loom / torch compile: {fmt(r_compile, '.2f')}{ok(summary['meets_ratio'])} (target >= {TARGET_RATIO})"
          + ("" if r_compile is not None else " [compile: %s]" % (by.get("torch compile", {}).get("error")
                                                               or by.get("torch compile", {}).get("status") or "not run"))
          + f"; loom / torch eager: {fmt(r_eager, '.2f')}; loom MFU of {a.spec_tflops:.0f}: "
          f"{pct(loom_mfu)}{ok(summary['meets_mfu'])} (target >= {100 * TARGET_MFU:.0f}%)"
          + (" [cpu: the targets are for the GPU]" if a.device == "cpu" else ""))
    print()
    hdr = ["system", "batch", "tokens/s", "step ms", "MFU/loom pk", "MFU/torch pk", f"MFU/{a.spec_tflops:.0f}",
           "peak GiB", "status"]
    table = [hdr] + [[
        r["system"], fmt(r["batch"], "d"), fmt(r["tokens_per_s"], ".0f"), fmt(r["step_s"] and 1e3 * r["step_s"], ".1f"),
        pct(r["mfu_vs_loom_peak"]), pct(r["mfu_vs_torch_peak"]), pct(r["mfu_vs_spec"]),
        fmt(r["peak_allocated_bytes"] and r["peak_allocated_bytes"] / GIB, ".2f"),
        "ok" if r["status"] == "ok" else (r["error"] or r["status"] or "?")[:110],
    ] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(hdr) - 1)]
    for row in table:
        print("  ".join([row[0].ljust(widths[0])] + [x.rjust(w) for x, w in zip(row[1:-1], widths[1:])] + [row[-1]]))
    return 0 if all(r["status"] == "ok" or str(r["status"]).startswith("unavailable") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
