#!/usr/bin/python3
"""PyTorch side of loom's training-step benchmark (the model is tests/parity/torch_llama.py).

  torch_step.py --config tiny|small --dtype float32|bfloat16 [--steps 10] [--warmup 3] [--threads 2]
                [--tier native|avx2|avx512]

A step = forward, backward, torch.optim.AdamW step (lr 3e-4), zero_grad, on a random batch of 8 x 256
tokens; parameters are float32, bfloat16 runs under torch.autocast("cpu", bfloat16). Prints one JSON
line: tokens_per_s and step_s of the median step after warm-up, plus the model's FLOPs per token.
"""
import argparse
import json
import os
import statistics
import sys
import time

CONFIGS = {
    # llama2.c "stories" shapes; vocab and kv heads as in loom's bench configs.
    "tiny": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                 intermediate_size=768, vocab_size=4096),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1376, vocab_size=8192),
}
COMMON = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
BATCH, SEQ = 8, 256

# Settings that make Debian's torch 1.13 fastest on this CPU kind, read when the libraries load, so
# set before torch is imported. OpenBLAS 0.3.21 misdetects the CPU without SkylakeX. fp32 GEMMs run
# on OpenBLAS's own pthreads, which spinning OpenMP workers would starve (PASSIVE: 2600 vs 600
# tokens/s, tiny). bf16 GEMMs run on oneDNN inside OpenMP, where spinning workers win on an idle
# machine (ACTIVE: about 6600 vs 5400 tokens/s, tiny) but collapse when another process competes for
# a core (ACTIVE 160..1400, PASSIVE 2000..2500); compare_torch.py therefore tries both for bf16.
TUNED_ENV = {
    "float32": {"OPENBLAS_CORETYPE": "SkylakeX", "OMP_WAIT_POLICY": "PASSIVE"},
    "bfloat16": {"OPENBLAS_CORETYPE": "SkylakeX", "OMP_WAIT_POLICY": "ACTIVE"},
}
WAIT_POLICIES = {"float32": ["PASSIVE"], "bfloat16": ["ACTIVE", "PASSIVE"]}

# PyTorch held to one of loom's CPU tiers (LOOM_CPU_ISA, kernels/cpu/cpu_isa.hpp), applied over
# TUNED_ENV: ATen's own kernels (ATEN_CPU_CAPABILITY), OpenBLAS's fp32 GEMMs (OPENBLAS_CORETYPE) and
# oneDNN's bf16 GEMMs and convolutions (ONEDNN_MAX_CPU_ISA; DNNL_ for older oneDNN builds). native
# changes nothing.
TIER_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "OPENBLAS_CORETYPE": "Haswell",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "OPENBLAS_CORETYPE": "SkylakeX",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}

# torch 1.13 sends fp32 GEMMs to whatever libblas.so.3 the loader finds. Debian's default alternative
# can be netlib's reference BLAS (about 2 GFLOP/s here, 40x slower than OpenBLAS), which would make
# the comparison meaningless; an OpenBLAS libblas.so.3 loaded first (RTLD_GLOBAL) takes its soname.
_HERE = os.path.dirname(os.path.abspath(__file__))
BLAS_CANDIDATES = [
    os.path.join(_HERE, "..", "build", "openblas", "root", "usr", "lib", "x86_64-linux-gnu", "openblas-pthread", "libblas.so.3"),
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
]


def preload_blas(path):
    """Loads an OpenBLAS libblas.so.3 before torch; returns the path used or None."""
    import ctypes

    cands = [path] if path else [os.environ.get("TORCH_BLAS")] + BLAS_CANDIDATES
    for c in cands:
        if c and os.path.exists(c):
            ctypes.CDLL(os.path.realpath(c), mode=ctypes.RTLD_GLOBAL)
            return os.path.realpath(c)
    if path:
        raise SystemExit(f"--blas {path}: no such file")
    return None


def loaded_blas():
    """The BLAS library mapped into this process (after torch is imported)."""
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "blas" in os.path.basename(p):
                libs.add(p)
    return sorted(libs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-env", action="store_true", help="keep the caller's OPENBLAS_CORETYPE and OMP_WAIT_POLICY")
    ap.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"], help="override OMP_WAIT_POLICY")
    ap.add_argument("--blas", help="libblas.so.3 to use (default: $TORCH_BLAS, else an OpenBLAS if found)")
    ap.add_argument("--tier", choices=sorted(TIER_ENV), default="native",
                    help="hold torch to this CPU tier (TIER_ENV); native leaves it alone")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if not a.keep_env:
        os.environ.update(TUNED_ENV[a.dtype])
    if a.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy
    os.environ.update(TIER_ENV[a.tier])

    preload_blas(a.blas)
    import torch  # noqa: E402  (after the environment is set)

    blas = loaded_blas()
    if not any("openblas" in p for p in blas):
        print(f"torch_step.py: WARNING: torch uses {blas or 'no BLAS'}, not OpenBLAS: fp32 GEMMs will be "
              "far below PyTorch's normal speed (see tests/parity/README.md)", file=sys.stderr)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
    import torch_llama as tl  # noqa: E402

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = tl.Config({**CONFIGS[a.config], **COMMON})
    model = tl.Llama(cfg, SEQ)
    P = tl.init_params(cfg, seed=a.seed, std=0.02)
    for t in P.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(list(P.values()), lr=3e-4)
    tokens = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = a.dtype == "bfloat16"

    times, loss = [], float("nan")
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.loss(P, inputs, targets)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = out.item()
        if i >= a.warmup:
            times.append(t1 - t0)
    step_s = statistics.median(times)
    print(json.dumps({
        "tokens_per_s": BATCH * SEQ / step_s, "step_s": step_s, "dtype": a.dtype, "config": a.config,
        "flops_per_token": cfg.flops_per_token(SEQ), "threads": a.threads, "steps": a.steps,
        "min_step_s": min(times), "loss": loss, "torch": torch.__version__,
        "blas": blas,
        "tier": a.tier,
        "env": {k: os.environ.get(k) for k in list(TUNED_ENV[a.dtype]) + list(TIER_ENV["avx2"])},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
