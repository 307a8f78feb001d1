#!/usr/bin/python3
"""Independent PyTorch reference of a GLA model (fla's GLAForCausalLM) for loom's parity tests.

Written from the equations of ../shared/specs/GLA.md section 3 (fla's definitions) with fla's
parameter names; imports nothing of loom and nothing of fla. PyTorch 1.13: RMSNorm by hand, the
GLA core as the token-by-token recurrence under autograd, the short convolution by F.conv1d.

  torch_gla.py --dir D
      reads D/config.json (fla's GLAConfig fields), D/model.safetensors, D/tokens.bin (int32
      [B, T+1]) and D/tokens.json ({"batch": B, "seq_len": T}); inputs = first T tokens of a row,
      targets = last T. Writes D/torch_out.safetensors: every parameter's gradient (F32) and
      "loss" (F64, [1], the mean over tokens). float32 throughout.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


class Config:
    def __init__(self, d):
        g = lambda k, default: d[k] if d.get(k) is not None else default  # noqa: E731
        self.d = int(g("hidden_size", 2048))
        self.L = int(g("num_hidden_layers", 24))
        self.H = int(g("num_heads", 4))
        self.Hkv = int(g("num_kv_heads", self.H))
        self.Kd = int(self.d * float(g("expand_k", 0.5)))
        self.Vd = int(self.d * float(g("expand_v", 1.0)))
        ratio = float(g("hidden_ratio", 4))
        f = int(self.d * ratio * 2 / 3)
        self.F = int(g("intermediate_size", 256 * ((f + 255) // 256)))
        self.vocab = int(g("vocab_size", 32000))
        self.eps = float(g("norm_eps", 1e-6))
        self.gate = bool(g("use_output_gate", True))
        self.affine = bool(g("elementwise_affine", True))
        self.fuse_norm = bool(g("fuse_norm", True))
        self.clamp_min = d.get("clamp_min")
        self.tied = bool(g("tie_word_embeddings", False))
        self.normalizer = float(g("gate_logit_normalizer", 16))
        self.rank = int(g("gate_low_rank_dim", 16))
        self.conv = bool(g("use_short_conv", False))
        self.W = int(g("conv_size", 4))
        if d.get("feature_map") or d.get("attn"):
            raise ValueError("this reference has no feature map or hybrid layers")
        self.G = self.H // self.Hkv
        self.K = self.Kd // self.H
        self.V = self.Vd // self.H

    def norm_name(self):
        return "g_norm_swish_gate" if self.fuse_norm and self.gate else "g_norm"

    def param_shapes(self):
        d, G = self.d, self.G
        s = {"model.embeddings.weight": (self.vocab, d), "model.norm.weight": (d,)}
        for i in range(self.L):
            p = f"model.layers.{i}."
            s[p + "attn_norm.weight"] = (d,)
            s[p + "attn.q_proj.weight"] = (self.Kd, d)
            s[p + "attn.k_proj.weight"] = (self.Kd // G, d)
            s[p + "attn.v_proj.weight"] = (self.Vd // G, d)
            if self.gate:
                s[p + "attn.g_proj.weight"] = (self.Vd, d)
            s[p + "attn.gk_proj.0.weight"] = (self.rank, d)
            s[p + "attn.gk_proj.1.weight"] = (self.Kd // G, self.rank)
            s[p + "attn.gk_proj.1.bias"] = (self.Kd // G,)
            if self.affine:
                s[p + f"attn.{self.norm_name()}.weight"] = (self.V,)
            s[p + "attn.o_proj.weight"] = (d, self.Vd)
            if self.conv:
                s[p + "attn.q_conv1d.weight"] = (self.Kd, 1, self.W)
                s[p + "attn.k_conv1d.weight"] = (self.Kd // G, 1, self.W)
                s[p + "attn.v_conv1d.weight"] = (self.Vd // G, 1, self.W)
            s[p + "mlp_norm.weight"] = (d,)
            s[p + "mlp.gate_proj.weight"] = (self.F, d)
            s[p + "mlp.up_proj.weight"] = (self.F, d)
            s[p + "mlp.down_proj.weight"] = (d, self.F)
        if not self.tied:
            s["lm_head.weight"] = (self.vocab, d)
        return s


def rms_norm(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def gla_recurrence(q, k, v, gk, scale):
    """q [B,T,H,K], k/gk [B,T,H,K], v [B,T,H,V] (kv heads already expanded):
    S_t = Diag(exp(gk_t)) S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=q.dtype)
    out = []
    for t in range(T):
        S = gk[:, t].exp().unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        out.append(scale * (q[:, t].unsqueeze(-1) * S).sum(-2))
    return torch.stack(out, 1)


def short_conv(x, w):
    """Causal depthwise convolution + SiLU over the sequence: x [B, T, C], w [C, 1, W];
    y_t = silu(sum_j w[c, 0, j] x_{t-W+1+j}) with zeros before the start."""
    T, W = x.shape[1], w.shape[-1]
    u = F.conv1d(x.transpose(1, 2), w, padding=W - 1, groups=x.shape[2])[..., :T]
    return F.silu(u).transpose(1, 2)


def gla_layer(cfg, P, p, xn):
    B, T, _ = xn.shape
    lin = lambda x, n: x @ P[p + n].t()  # noqa: E731
    q, k, v = lin(xn, "attn.q_proj.weight"), lin(xn, "attn.k_proj.weight"), lin(xn, "attn.v_proj.weight")
    if cfg.conv:
        q = short_conv(q, P[p + "attn.q_conv1d.weight"])
        k = short_conv(k, P[p + "attn.k_conv1d.weight"])
        v = short_conv(v, P[p + "attn.v_conv1d.weight"])
    q = q.reshape(B, T, cfg.H, cfg.K)
    k = k.reshape(B, T, cfg.Hkv, cfg.K)
    v = v.reshape(B, T, cfg.Hkv, cfg.V)
    z = lin(lin(xn, "attn.gk_proj.0.weight"), "attn.gk_proj.1.weight") + P[p + "attn.gk_proj.1.bias"]
    gk = F.logsigmoid(z) / cfg.normalizer
    if cfg.clamp_min is not None:
        gk = torch.clamp(gk, min=float(cfg.clamp_min))
    gk = gk.view(B, T, cfg.Hkv, cfg.K)
    # kv head h serves query heads h*G .. h*G+G-1
    k, v, gk = (t.repeat_interleave(cfg.G, dim=2) for t in (k, v, gk))
    o = gla_recurrence(q, k, v, gk, cfg.K ** -0.5)  # [B,T,H,V]
    w = P[p + f"attn.{cfg.norm_name()}.weight"] if cfg.affine else None
    o = rms_norm(o, w, cfg.eps)
    if cfg.gate:
        g = lin(xn, "attn.g_proj.weight").view(B, T, cfg.H, cfg.V)
        o = o * (g * torch.sigmoid(g))
    return lin(o.reshape(B, T, cfg.Vd), "attn.o_proj.weight")


def loss_fn(cfg, P, inputs, targets):
    x = F.embedding(inputs, P["model.embeddings.weight"])
    for i in range(cfg.L):
        p = f"model.layers.{i}."
        h = x + gla_layer(cfg, P, p, rms_norm(x, P[p + "attn_norm.weight"], cfg.eps))
        hn = rms_norm(h, P[p + "mlp_norm.weight"], cfg.eps)
        gate, up = hn @ P[p + "mlp.gate_proj.weight"].t(), hn @ P[p + "mlp.up_proj.weight"].t()
        x = h + (F.silu(gate) * up) @ P[p + "mlp.down_proj.weight"].t()
    x = rms_norm(x, P["model.norm.weight"], cfg.eps)
    w = P["model.embeddings.weight"] if cfg.tied else P["lm_head.weight"]
    logits = x @ w.t()
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))


def run_dir(d, threads=2):
    torch.set_num_threads(threads)
    with open(os.path.join(d, "config.json")) as f:
        cfg = Config(json.load(f))
    raw = st.load(os.path.join(d, "model.safetensors"))
    P = {}
    for name, shape in cfg.param_shapes().items():
        if name not in raw:
            raise ValueError(f"{d}/model.safetensors: missing parameter {name}")
        if tuple(raw[name].shape) != tuple(shape):
            raise ValueError(f"{d}/model.safetensors: {name} has shape {raw[name].shape}, expected {shape}")
        P[name] = torch.from_numpy(raw[name].astype(np.float32)).requires_grad_(True)
    extra = sorted(set(raw) - set(P))
    if extra:
        raise ValueError(f"{d}/model.safetensors: unexpected tensors {extra[:5]}")
    with open(os.path.join(d, "tokens.json")) as f:
        tj = json.load(f)
    B, T = int(tj["batch"]), int(tj["seq_len"])
    tok = np.fromfile(os.path.join(d, "tokens.bin"), dtype="<i4")
    if tok.size != B * (T + 1):
        raise ValueError(f"{d}/tokens.bin: {tok.size} values, expected {B * (T + 1)}")
    tok = torch.from_numpy(tok.astype(np.int64).reshape(B, T + 1))
    loss = loss_fn(cfg, P, tok[:, :T], tok[:, 1:])
    loss.backward()
    out = {name: t.grad.detach().float().numpy() for name, t in P.items()}
    out["loss"] = np.array([loss.item()], dtype=np.float64)
    st.save(os.path.join(d, "torch_out.safetensors"), out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    run_dir(a.dir, a.threads)


if __name__ == "__main__":
    main()
