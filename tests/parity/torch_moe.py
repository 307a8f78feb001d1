#!/usr/bin/python3
"""Independent PyTorch reference of mixture-of-experts decoders (loss, router aux loss, logits and
parameter gradients) for loom's parity tests.

Written from the Hugging Face modeling semantics (transformers' modeling_qwen3_moe.py,
modeling_mixtral.py, modeling_qwen2_moe.py for the shared expert) with their parameter names; imports
nothing of loom and nothing of torch_llama.py (only the safetensors helper st.py).

  torch_moe.py --dir D [--dtype float32|bfloat16] [--threads 2]
      reads D/config.json (HF; model_type "qwen3_moe", "qwen2_moe" or "mixtral"), D/model.safetensors, D/tokens.bin
      (int32 [B, T+1]) and D/tokens.json ({"batch": B, "seq_len": T}); inputs = first T tokens of a
      row, targets = last T (target < 0 is ignored). Writes D/torch_out.safetensors:
        <every parameter name>  F32, its gradient (no lm_head.weight when tied; zeros for an expert
                                no token was routed to)
        "loss"                  F64 [1], ce_loss + router_aux_loss_coef * aux_loss when
                                output_router_logits is true, else ce_loss (what is differentiated)
        "ce_loss"               F64 [1], mean cross-entropy over targets >= 0
        "aux_loss"              F64 [1], HF's load_balancing_loss_func, unscaled (also computed, but
                                not differentiated, when output_router_logits is false)
        "logits"                F32 [B*T, V]
      Parameters are float32; bfloat16 runs under torch.autocast("cpu", bfloat16).
  torch_moe.py --selftest
      checks this file against naive formulas and finite differences; exits 0 when all pass.

Semantics:
  Decoder: Llama-style pre-norm (RMSNorm in float32), rotate_half RoPE (rope_theta, optional llama3
  rope_scaling), GQA causal softmax attention, no biases (but Qwen2-MoE's q/k/v), SwiGLU MLPs, final
  norm model.norm.weight, lm_head.weight or tied model.embed_tokens.weight.
  qwen2_moe: Qwen3-MoE's routing and layer rule without q/k norms, with q/k/v projection biases
    (self_attn.{q,k,v}_proj.bias, always present) and the shared expert (always present; below);
    head_dim = hidden_size / num_attention_heads.
  qwen3_moe: q_norm / k_norm (RMSNorm over head_dim, weight [head_dim], eps rms_norm_eps) applied per
    head to q and k BEFORE RoPE. Layer l is sparse iff l not in mlp_only_layers and num_experts > 0
    and (l + 1) % decoder_sparse_step == 0; dense layers: mlp.{gate,up,down}_proj (intermediate_size).
    Sparse: router mlp.gate.weight [E, C]; experts mlp.experts.{e}.{gate,up,down}_proj
    (moe_intermediate_size); normalized top-k iff norm_topk_prob (default false). Optional Qwen2-MoE
    shared expert (qwen2_moe only, shared_expert_intermediate_size): mlp.shared_expert.{gate,up,down}_proj and
    mlp.shared_expert_gate.weight [1, C]; out += sigmoid(x . shared_expert_gate) * shared_expert(x).
  mixtral: no q/k norms, every layer sparse: block_sparse_moe.gate.weight [num_local_experts, C],
    experts block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down) (intermediate_size); top-k
    always renormalized; no shared expert.
  Router: logits = x W^T (x = the post-attention norm output); p = softmax(logits) in float32; top-k
    (num_experts_per_tok) of p, ties to the LOWER expert index (a stable descending sort; torch.topk
    leaves tie order unspecified); optional renormalization by the sum of the k; weights cast to x's
    dtype; out = sum_j w_j * expert_{e_j}(x), expert(x) = down(silu(gate(x)) * up(x)).
  Aux loss (HF load_balancing_loss_func, no attention mask): over the router logits of ALL sparse layers
    concatenated along tokens ([N = tokens * sparse layers, E]): p = softmax(logits); sel = top-k(p)
    (same tie rule); tokens_per_expert = mean_N one_hot(sel, E) [k, E]; prob_per_expert = mean_N p [E];
    aux = E * sum(tokens_per_expert * prob_per_expert). Computed in float32; 0 without sparse layers.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402

_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


class Config:
    """The subset of a Hugging Face Qwen3MoeConfig / MixtralConfig that defines the math. Missing keys
    take the Hugging Face defaults of that model type."""

    def __init__(self, d):
        self.kind = d.get("model_type")
        if self.kind not in _EXPERT_NAMES:
            raise ValueError(f"config.json: model_type {self.kind!r} unsupported (qwen3_moe, qwen2_moe or mixtral)")
        mixtral = self.kind == "mixtral"
        qwen2 = self.kind == "qwen2_moe"
        g = lambda k, default: d[k] if d.get(k) is not None else default  # noqa: E731
        self.dim = int(d["hidden_size"])
        self.n_layers = int(d["num_hidden_layers"])
        self.n_heads = int(d["num_attention_heads"])
        self.n_kv_heads = int(g("num_key_value_heads", self.n_heads))
        self.head_dim = int(g("head_dim", self.dim // self.n_heads))
        if qwen2 and self.head_dim != self.dim // self.n_heads:
            raise ValueError(f"config.json: head_dim {self.head_dim}: Qwen2-MoE's is hidden_size // num_attention_heads")
        self.vocab = int(d["vocab_size"])
        self.eps = float(g("rms_norm_eps", 1e-5 if mixtral else 1e-6))
        self.theta = float(g("rope_theta", 1e6 if mixtral else 10000.0))
        self.rope_scaling = d.get("rope_scaling")
        self.tied = bool(g("tie_word_embeddings", False))
        self.top_k = int(g("num_experts_per_tok", 2 if mixtral else 4 if qwen2 else 8))
        self.aux_coef = float(g("router_aux_loss_coef", 0.001))
        self.output_router_logits = bool(g("output_router_logits", False))
        self.qk_norm = self.kind == "qwen3_moe"
        # Qwen2-MoE's q, k and v projections always have biases (modeling_qwen2_moe: bias=True).
        self.qkv_bias = qwen2
        for key in ("attention_bias", "qkv_bias", "mlp_bias", "use_sliding_window"):
            if qwen2 and key == "qkv_bias":
                continue
            if d.get(key):
                raise ValueError(f"config.json: {key} = {d[key]!r} is not supported (expected false)")
        if g("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {d.get('hidden_act')!r} unsupported, expected 'silu'")
        for key in ("router_jitter_noise", "attention_dropout"):
            if float(g(key, 0.0)) != 0.0:
                raise ValueError(f"config.json: {key} = {d[key]!r} is not supported (expected 0)")
        if mixtral:
            self.sliding_window = d.get("sliding_window")  # only an error if shorter than the sequence
            self.n_experts = int(g("num_local_experts", 8))
            self.moe_ffn = int(d["intermediate_size"])
            self.ffn = 0
            self.norm_topk = True
            self.shared_ffn = 0
            if int(g("shared_expert_intermediate_size", 0)) > 0:
                raise ValueError("config.json: shared_expert_intermediate_size > 0: mixtral has no shared expert")
            self.sparse = set(range(self.n_layers))
            self.moe_prefix = "block_sparse_moe."
        else:
            self.sliding_window = None
            self.n_experts = int(g("num_experts", 60 if qwen2 else 128))
            self.moe_ffn = int(g("moe_intermediate_size", 1408 if qwen2 else 768))
            self.ffn = int(d["intermediate_size"])
            self.norm_topk = bool(g("norm_topk_prob", False))
            # Qwen2-MoE always has its shared expert; Qwen3-MoE never (transformers ignores the key).
            self.shared_ffn = int(g("shared_expert_intermediate_size", 5632)) if qwen2 else 0
            if not qwen2 and int(g("shared_expert_intermediate_size", 0)) > 0:
                raise ValueError("config.json: shared_expert_intermediate_size > 0: qwen3_moe has no shared "
                                 "expert (Qwen2-MoE's is model_type qwen2_moe)")
            step = int(g("decoder_sparse_step", 1))
            if step <= 0:
                raise ValueError(f"config.json: decoder_sparse_step {step} must be positive")
            mlp_only = {int(i) for i in g("mlp_only_layers", [])}
            self.sparse = {l for l in range(self.n_layers)
                           if l not in mlp_only and self.n_experts > 0 and (l + 1) % step == 0}
            self.moe_prefix = "mlp."
        self.expert_names = _EXPERT_NAMES[self.kind]
        if self.sparse and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"config.json: num_experts_per_tok {self.top_k} not in [1, {self.n_experts}]")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"config.json: {self.n_heads} heads not a multiple of {self.n_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim {self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"config.json: rope_scaling type {kind!r} unsupported (llama3 or default)")

    def param_shapes(self):
        """Ordered {name: shape} in Hugging Face naming; lm_head absent when tied."""
        C, D, H, K = self.dim, self.head_dim, self.n_heads, self.n_kv_heads
        gate, up, down = self.expert_names
        s = {"model.embed_tokens.weight": (self.vocab, C)}
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = (C,)
            s[p + "self_attn.q_proj.weight"] = (H * D, C)
            s[p + "self_attn.k_proj.weight"] = (K * D, C)
            s[p + "self_attn.v_proj.weight"] = (K * D, C)
            s[p + "self_attn.o_proj.weight"] = (C, H * D)
            if self.qkv_bias:
                s[p + "self_attn.q_proj.bias"] = (H * D,)
                s[p + "self_attn.k_proj.bias"] = (K * D,)
                s[p + "self_attn.v_proj.bias"] = (K * D,)
            if self.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (D,)
                s[p + "self_attn.k_norm.weight"] = (D,)
            s[p + "post_attention_layernorm.weight"] = (C,)
            if i in self.sparse:
                m = p + self.moe_prefix
                s[m + "gate.weight"] = (self.n_experts, C)
                for e in range(self.n_experts):
                    s[m + f"experts.{e}.{gate}.weight"] = (self.moe_ffn, C)
                    s[m + f"experts.{e}.{up}.weight"] = (self.moe_ffn, C)
                    s[m + f"experts.{e}.{down}.weight"] = (C, self.moe_ffn)
                if self.shared_ffn:
                    s[m + "shared_expert.gate_proj.weight"] = (self.shared_ffn, C)
                    s[m + "shared_expert.up_proj.weight"] = (self.shared_ffn, C)
                    s[m + "shared_expert.down_proj.weight"] = (C, self.shared_ffn)
                    s[m + "shared_expert_gate.weight"] = (1, C)
            else:
                s[p + "mlp.gate_proj.weight"] = (self.ffn, C)
                s[p + "mlp.up_proj.weight"] = (self.ffn, C)
                s[p + "mlp.down_proj.weight"] = (C, self.ffn)
        s["model.norm.weight"] = (C,)
        if not self.tied:
            s["lm_head.weight"] = (self.vocab, C)
        return s


def _f32(t):
    """float32, except that float64 stays float64 (the fp64 self-test)."""
    return t if t.dtype == torch.float64 else t.float()


def rope_inv_freq(cfg):
    """float64 [head_dim/2]: theta^(-2i/D), with Llama 3.1 "llama3" scaling when configured."""
    D = cfg.head_dim
    inv = cfg.theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rs = cfg.rope_scaling
    if rs is None or rs.get("rope_type", rs.get("type")) != "llama3":
        return inv
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    medium = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < old / high, inv, torch.where(wavelen > old / low, inv / factor, medium))


def rope_cos_sin(cfg, T):
    """float64 [T, D]; column i and i + D/2 share frequency i (Hugging Face rotate_half layout)."""
    ang = torch.arange(T, dtype=torch.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; cos/sin [T, D] already in x's dtype."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


def rms_norm(x, w, eps):
    """Over the last dim, in float32 (float64 stays float64), whatever autocast does around it."""
    xf = _f32(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def attention(q, k, v, mask):
    """Causal softmax attention with GQA. q [B, H, T, D], k/v [B, Hkv, T, D]; query head h reads kv
    head h // (H/Hkv) (grouped heads folded into the rows instead of repeating K/V)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    qg = (q * (1.0 / math.sqrt(D))).reshape(B, Hkv, rep * T, D)
    s = torch.matmul(qg, k.transpose(-1, -2)).view(B, Hkv, rep, T, T)
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(_f32(s), dim=-1).to(v.dtype)
    return torch.matmul(p.view(B, Hkv, rep * T, T), v).view(B, H, T, D)


def swiglu(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _topk_lower_index(p, k):
    """Top-k along the last dim with ties going to the LOWER index: a stable sort by descending value
    keeps equal values in index order. Returns (values [.., k], indices [.., k]), largest first."""
    idx = torch.sort(p, dim=-1, descending=True, stable=True)[1][..., :k]
    return torch.gather(p, -1, idx), idx


topk_lower_index = _topk_lower_index  # the self-test swaps this name to record/replay routing


def moe_block(cfg, P, m, x):
    """Sparse MLP of one layer, parameters under prefix m (".../mlp." or ".../block_sparse_moe.").
    x [N, C] -> (out [N, C] in x's dtype, router logits [N, E] in float32 for the aux loss)."""
    gate, up, down = cfg.expert_names
    logits = F.linear(x, P[m + "gate.weight"])
    probs = torch.softmax(_f32(logits), dim=-1)
    w, sel = topk_lower_index(probs, cfg.top_k)
    if cfg.norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(cfg.n_experts):
        tok, slot = torch.where(sel == e)
        if tok.numel() == 0:
            continue
        e_ = f"{m}experts.{e}."
        y = swiglu(x[tok], P[e_ + gate + ".weight"], P[e_ + up + ".weight"], P[e_ + down + ".weight"])
        out = out.index_add(0, tok, (y * w[tok, slot, None]).to(out.dtype))
    if cfg.shared_ffn:
        s = m + "shared_expert."
        y = swiglu(x, P[s + "gate_proj.weight"], P[s + "up_proj.weight"], P[s + "down_proj.weight"])
        out = out + (torch.sigmoid(F.linear(x, P[m + "shared_expert_gate.weight"])) * y).to(out.dtype)
    return out, _f32(logits)


def load_balancing_loss(router_logits, n_experts, top_k):
    """HF load_balancing_loss_func without attention mask over the list of per-layer [N, E] logits,
    concatenated along tokens (not a per-layer sum)."""
    if not router_logits:
        return torch.zeros((), dtype=torch.float32)
    p = torch.softmax(_f32(torch.cat(router_logits, dim=0)), dim=-1)
    _, sel = topk_lower_index(p, top_k)
    tokens_per_expert = F.one_hot(sel, n_experts).to(p.dtype).mean(dim=0)  # [k, E]
    prob_per_expert = p.mean(dim=0)  # [E]
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * n_experts


class MoEModel:
    """Functional model over a {name: tensor} dict, so the same code runs float32, float64 and under
    autocast, and gradients land on plain tensors."""

    def __init__(self, cfg, seq_len):
        if cfg.sliding_window is not None and seq_len > int(cfg.sliding_window):
            raise ValueError(f"config.json: sliding_window {cfg.sliding_window} < seq_len {seq_len} is not supported")
        self.cfg = cfg
        self.T = seq_len
        self._rope = {torch.float64: rope_cos_sin(cfg, seq_len)}
        self.mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)

    def rope(self, dtype):
        if dtype not in self._rope:
            c, s = self._rope[torch.float64]
            self._rope[dtype] = (c.to(dtype), s.to(dtype))
        return self._rope[dtype]

    def forward(self, P, idx):
        """idx [B, T] -> (logits [B, T, V], [router logits [B*T, E] of each sparse layer in order])."""
        cfg = self.cfg
        B, T = idx.shape
        if T > self.T:
            raise ValueError(f"sequence length {T} exceeds the {self.T} this model was built for")
        C, H, Hkv, D = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        mask = self.mask[:T, :T]
        routers = []
        x = F.embedding(idx, P["model.embed_tokens.weight"])
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, P[p + "input_layernorm.weight"], cfg.eps)
            q = F.linear(h, P[p + "self_attn.q_proj.weight"], P.get(p + "self_attn.q_proj.bias")).view(B, T, H, D)
            k = F.linear(h, P[p + "self_attn.k_proj.weight"], P.get(p + "self_attn.k_proj.bias")).view(B, T, Hkv, D)
            v = F.linear(h, P[p + "self_attn.v_proj.weight"],
                         P.get(p + "self_attn.v_proj.bias")).view(B, T, Hkv, D).transpose(1, 2)
            if cfg.qk_norm:  # Qwen3: per head over head_dim, before RoPE
                q = rms_norm(q, P[p + "self_attn.q_norm.weight"], cfg.eps)
                k = rms_norm(k, P[p + "self_attn.k_norm.weight"], cfg.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            cos, sin = self.rope(q.dtype)
            q = apply_rope(q, cos[:T], sin[:T])
            k = apply_rope(k, cos[:T], sin[:T])
            a = attention(q, k, v, mask).transpose(1, 2).reshape(B, T, H * D)
            x = x + F.linear(a, P[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, P[p + "post_attention_layernorm.weight"], cfg.eps)
            if i in cfg.sparse:
                y, rl = moe_block(cfg, P, p + cfg.moe_prefix, h.reshape(B * T, C))
                routers.append(rl)
                x = x + y.view(B, T, C)
            else:
                x = x + swiglu(h, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                               P[p + "mlp.down_proj.weight"])
        h = rms_norm(x, P["model.norm.weight"], cfg.eps)
        w_out = P["model.embed_tokens.weight"] if cfg.tied else P["lm_head.weight"]
        return F.linear(h, w_out), routers

    def losses(self, P, idx, targets):
        """{"loss", "ce_loss", "aux_loss", "logits" [B*T, V]}: cross-entropy (mean over targets >= 0)
        and aux loss in float32 (float64 for float64 parameters); loss = what HF would backpropagate."""
        lg, routers = self.forward(P, idx)
        lg = _f32(lg).reshape(-1, lg.shape[-1])
        t = torch.where(targets < 0, torch.full_like(targets, -100), targets)
        ce = F.cross_entropy(lg, t.reshape(-1), ignore_index=-100)
        aux = load_balancing_loss(routers, self.cfg.n_experts, self.cfg.top_k).to(ce.dtype)
        loss = ce + self.cfg.aux_coef * aux if self.cfg.output_router_logits else ce
        return {"loss": loss, "ce_loss": ce, "aux_loss": aux, "logits": lg}


def init_params(cfg, seed=0, std=0.02, dtype=torch.float32):
    """Random parameters: N(0, std) matrices and biases, norm weights 1 + N(0, 0.1) (never exactly ones)."""
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith(".bias"):
            P[name] = std * torch.randn(shape, generator=g, dtype=torch.float64)
        elif len(shape) == 1:
            P[name] = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            P[name] = std * torch.randn(shape, generator=g, dtype=torch.float64)
        P[name] = P[name].to(dtype)
    return P


def load_dir(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = Config(json.load(f))
    raw = st.load(os.path.join(d, "model.safetensors"))
    P = {}
    for name, shape in cfg.param_shapes().items():
        if name not in raw:
            raise ValueError(f"{d}/model.safetensors: missing parameter {name}")
        if tuple(raw[name].shape) != tuple(shape):
            raise ValueError(f"{d}/model.safetensors: {name} has shape {raw[name].shape}, expected {shape}")
        P[name] = torch.from_numpy(raw[name].astype(np.float32))
    extra = sorted(set(raw) - set(P))
    if extra:
        raise ValueError(f"{d}/model.safetensors: unexpected tensors {extra[:5]}")
    with open(os.path.join(d, "tokens.json")) as f:
        tj = json.load(f)
    B, T = int(tj["batch"]), int(tj["seq_len"])
    tok = np.fromfile(os.path.join(d, "tokens.bin"), dtype="<i4")
    if tok.size != B * (T + 1):
        raise ValueError(f"{d}/tokens.bin: {tok.size} int32 values, expected batch*(seq_len+1) = {B * (T + 1)}")
    tok = torch.from_numpy(tok.astype(np.int64).reshape(B, T + 1))
    inputs, targets = tok[:, :T], tok[:, 1:]
    if int(inputs.min()) < 0 or int(inputs.max()) >= cfg.vocab:
        raise ValueError(f"{d}/tokens.bin: input ids must lie in [0, {cfg.vocab})")
    if int(targets.max()) >= cfg.vocab:
        raise ValueError(f"{d}/tokens.bin: target ids must be < {cfg.vocab} (negative = ignored)")
    return cfg, P, inputs, targets


def run_dir(d, dtype="float32", threads=2):
    torch.set_num_threads(threads)
    cfg, P, inputs, targets = load_dir(d)
    for t in P.values():
        t.requires_grad_(True)
    model = MoEModel(cfg, inputs.shape[1])
    if dtype == "bfloat16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r = model.losses(P, inputs, targets)
    elif dtype == "float32":
        r = model.losses(P, inputs, targets)
    else:
        raise ValueError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    r["loss"].backward()
    # An expert that no token chose has no gradient (as in HF); written as zeros.
    out = {name: (t.grad if t.grad is not None else torch.zeros_like(t)).detach().float().numpy()
           for name, t in P.items()}
    for key in ("loss", "ce_loss", "aux_loss"):
        out[key] = np.array([r[key].item()], dtype=np.float64)
    out["logits"] = r["logits"].detach().float().numpy()
    st.save(os.path.join(d, "torch_out.safetensors"), out)
    return {key: r[key].item() for key in ("loss", "ce_loss", "aux_loss")}


# ----------------------------------------------------------------------------------------------
# Self-test: naive numpy fp64 transcriptions with explicit loops, sharing no code with the above.


def _naive_topk(prob, k):
    """Repeatedly take the largest remaining value; strict '>' so ties go to the lower index."""
    chosen = []
    for _ in range(k):
        best = None
        for e in range(len(prob)):
            if e not in chosen and (best is None or prob[e] > prob[best]):
                best = e
        chosen.append(best)
    return chosen


def _naive_softmax(z):
    m = max(z)
    ex = [math.exp(v - m) for v in z]
    s = sum(ex)
    return [v / s for v in ex]


def _naive_mlp(h, wg, wu, wd):
    g = wg @ h
    return wd @ (g / (1 + np.exp(-g)) * (wu @ h))


def _naive_moe_token(cfg, P, m, h):
    """One token h [C] through a sparse block (numpy fp64 P). Returns (out [C], router logits [E])."""
    gate, up, down = cfg.expert_names
    z = P[m + "gate.weight"] @ h
    prob = _naive_softmax(list(z))
    chosen = _naive_topk(prob, cfg.top_k)
    w = [prob[e] for e in chosen]
    if cfg.norm_topk:
        tot = sum(w)
        w = [v / tot for v in w]
    out = np.zeros_like(h)
    for e, we in zip(chosen, w):
        x = f"{m}experts.{e}."
        out = out + we * _naive_mlp(h, P[x + gate + ".weight"], P[x + up + ".weight"], P[x + down + ".weight"])
    if cfg.shared_ffn:
        s = m + "shared_expert."
        g = float(P[m + "shared_expert_gate.weight"][0] @ h)
        out = out + 1 / (1 + math.exp(-g)) * _naive_mlp(h, P[s + "gate_proj.weight"], P[s + "up_proj.weight"],
                                                        P[s + "down_proj.weight"])
    return out, z


def _naive_aux(zs, E, k):
    """zs: router logit vectors of every (layer, token). aux = E * sum_e f_e * Pbar_e with f_e the
    fraction of vectors whose top-k holds e and Pbar_e the mean probability of e."""
    count, psum = [0] * E, [0.0] * E
    for z in zs:
        prob = _naive_softmax(list(z))
        for e in _naive_topk(prob, k):
            count[e] += 1
        for e in range(E):
            psum[e] += prob[e]
    N = len(zs)
    return E * sum(count[e] / N * psum[e] / N for e in range(E))


def _direct_freqs(cfg):
    """Scalar transcription of the (llama3-scaled) RoPE frequency rule."""
    D, rs, out = cfg.head_dim, cfg.rope_scaling, []
    for i in range(D // 2):
        f = 1.0 / cfg.theta ** (2 * i / D)
        if rs is not None and rs.get("rope_type", rs.get("type")) == "llama3":
            old = rs["original_max_position_embeddings"]
            w = 2 * math.pi / f
            if w > old / rs["low_freq_factor"]:
                f = f / rs["factor"]
            elif w >= old / rs["high_freq_factor"]:
                sm = (old / w - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
                f = (1 - sm) * f / rs["factor"] + sm * f
        out.append(f)
    return out


def _naive_model_np(cfg, P, inputs, targets, qk_norm_after_rope=False):
    """Whole model in numpy fp64 with loops. Returns (ce, aux, logits [B*T, V]).
    qk_norm_after_rope: the wrong placement, to show the check can tell."""
    P = {k: v.detach().double().numpy() for k, v in P.items()}
    inputs, targets = inputs.numpy(), targets.numpy()
    B, T = inputs.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    freqs = _direct_freqs(cfg)

    def norm(vec, w):
        return vec / math.sqrt(float(np.mean(vec * vec)) + cfg.eps) * w

    def rope(vec, pos):
        out = vec.copy()
        for i in range(D // 2):
            c, s = math.cos(pos * freqs[i]), math.sin(pos * freqs[i])
            out[i] = vec[i] * c - vec[i + D // 2] * s
            out[i + D // 2] = vec[i + D // 2] * c + vec[i] * s
        return out

    def head(vec, pos, w):  # Qwen3: norm, then RoPE
        if w is None:
            return rope(vec, pos)
        return norm(rope(vec, pos), w) if qk_norm_after_rope else rope(norm(vec, w), pos)

    total, count, all_logits = 0.0, 0, []
    zs = [[] for _ in range(cfg.n_layers)]
    for b in range(B):
        x = P["model.embed_tokens.weight"][inputs[b]].copy()
        for li in range(cfg.n_layers):
            p = f"model.layers.{li}."
            qn = P.get(p + "self_attn.q_norm.weight")
            kn = P.get(p + "self_attn.k_norm.weight")
            h = np.array([norm(r, P[p + "input_layernorm.weight"]) for r in x])
            q, k, v = (h @ P[p + f"self_attn.{n}_proj.weight"].T + P.get(p + f"self_attn.{n}_proj.bias", 0.0)
                       for n in "qkv")
            att = np.zeros((T, H * D))
            for hh in range(H):
                g = hh // (H // Hkv)
                for i in range(T):
                    qi = head(q[i, hh * D:(hh + 1) * D], i, qn)
                    sc = [qi @ head(k[j, g * D:(g + 1) * D], j, kn) / math.sqrt(D) for j in range(i + 1)]
                    e = _naive_softmax(sc)
                    att[i, hh * D:(hh + 1) * D] = sum(e[j] * v[j, g * D:(g + 1) * D] for j in range(i + 1))
            x = x + att @ P[p + "self_attn.o_proj.weight"].T
            for t in range(T):
                h = norm(x[t], P[p + "post_attention_layernorm.weight"])
                if li in cfg.sparse:
                    y, z = _naive_moe_token(cfg, P, p + cfg.moe_prefix, h)
                    zs[li].append(z)
                else:
                    y = _naive_mlp(h, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                                   P[p + "mlp.down_proj.weight"])
                x[t] = x[t] + y
        w_out = P["model.embed_tokens.weight"] if cfg.tied else P["lm_head.weight"]
        for i in range(T):
            lg = w_out @ norm(x[i], P["model.norm.weight"])
            all_logits.append(lg)
            if targets[b, i] < 0:
                continue
            m = lg.max()
            total += m + math.log(np.exp(lg - m).sum()) - lg[targets[b, i]]
            count += 1
    flat = [z for li in range(cfg.n_layers) for z in zs[li]]
    aux = _naive_aux(flat, cfg.n_experts, cfg.top_k) if flat else 0.0
    return total / count, aux, np.array(all_logits)


def _tiny_config(kind, shared=False):
    if kind == "mixtral":
        return {"model_type": "mixtral", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 12, "vocab_size": 13, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "tie_word_embeddings": True, "hidden_act": "silu", "num_local_experts": 4,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": False,
                "sliding_window": None}
    d = {"model_type": "qwen3_moe", "hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24, "moe_intermediate_size": 12,
         "vocab_size": 13, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu", "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [0], "output_router_logits": True,
         "router_aux_loss_coef": 0.05, "attention_bias": False, "use_sliding_window": False,
         "sliding_window": 4096,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.25,
                          "high_freq_factor": 8.0, "original_max_position_embeddings": 400}}
    if shared:  # Qwen2-MoE: the shared expert and q/k/v biases, no q/k norms, head_dim = hidden / heads
        d.update({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 20, "head_dim": 4})
    return d


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _topk_margin(routers, k):
    """Smallest gap between the k-th and (k+1)-th router probability over all tokens (finite
    differences of the piecewise-constant selection are valid when this is far above eps)."""
    if not routers:
        return float("inf")
    p = torch.softmax(torch.cat([r.detach() for r in routers]), -1).sort(-1, descending=True)[0]
    return float((p[:, k - 1] - p[:, k]).min()) if p.shape[1] > k else float("inf")


class _Routing:
    """Records the top-k choices of one run (by swapping this module's topk_lower_index), then either
    compares them with another run's or replays them. A router margin below bf16 precision flips a
    token's experts, which changes those experts' gradients wholesale; so the bf16 check compares with
    an fp64 reference that follows the bf16 run's choices, and counts how many differed."""

    def __init__(self):
        self.sel, self.flips = [], 0

    def _swap(self, fn):
        import contextlib

        @contextlib.contextmanager
        def cm():
            saved = globals()["topk_lower_index"]
            globals()["topk_lower_index"] = fn
            try:
                yield self
            finally:
                globals()["topk_lower_index"] = saved
        return cm()

    def record(self):
        def fn(p, k):
            v, i = _topk_lower_index(p, k)
            self.sel.append(i)
            return v, i
        return self._swap(fn)

    def compare(self, replay=False):
        it = iter(list(self.sel))

        def fn(p, k):
            v, i = _topk_lower_index(p, k)
            mine = next(it)
            self.flips += int((i.sort(-1)[0] != mine.sort(-1)[0]).any(-1).sum())
            return (torch.gather(p, -1, mine), mine) if replay else (v, i)
        return self._swap(fn)

    def replay(self):
        return self.compare(replay=True)


def selftest():
    import tempfile

    torch.set_num_threads(2)
    fails = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            fails.append(what)

    # Tie-breaking of the top-k: lower index first, against the naive loop.
    rows = [[0.2] * 5, [0.1, 0.3, 0.1, 0.3, 0.2], [0.3, 0.1, 0.3, 0.3, 0.0]]
    g = torch.Generator().manual_seed(11)
    rows += (torch.randint(0, 3, (40, 8), generator=g).double() / 4).tolist()  # many ties
    ok = True
    for r in rows:
        for k in (1, 2, 3):
            v, i = topk_lower_index(torch.tensor([r], dtype=torch.float64), k)
            ok &= i[0].tolist() == _naive_topk(r, k) and v[0].tolist() == [r[e] for e in i[0].tolist()]
    check(ok, "top-k with ties picks the lower expert index (43 rows, k = 1..3, vs naive loop)")

    # The MoE block against the per-token loop (fp64), for each routing variant.
    variants = [("qwen3_moe norm_topk", _tiny_config("qwen3_moe"), {}),
                ("qwen3_moe no norm_topk", _tiny_config("qwen3_moe"), {"norm_topk_prob": False}),
                ("qwen2_moe shared expert", _tiny_config("qwen3_moe", shared=True), {"norm_topk_prob": False}),
                ("mixtral", _tiny_config("mixtral"), {})]
    for what, d, over in variants:
        cfg = Config({**d, **over})
        P = init_params(cfg, seed=21, std=0.4, dtype=torch.float64)
        m = f"model.layers.1.{cfg.moe_prefix}"
        x = torch.randn(30, cfg.dim, generator=g, dtype=torch.float64)
        got, logits = moe_block(cfg, P, m, x)
        Pn = {k: v.numpy() for k, v in P.items()}
        ref = np.array([_naive_moe_token(cfg, Pn, m, row)[0] for row in x.numpy()])
        err = float(np.abs(got.numpy() - ref).max())
        check(err < 1e-12, f"MoE block = naive per-token loop: {what} (max err {err:.1e})")
        if what == "qwen2_moe shared expert":
            # Equal router logits: every token takes experts 0..k-1 with weight 1/E each (no renorm).
            Pz = dict(P, **{m + "gate.weight": torch.zeros_like(P[m + "gate.weight"])})
            got0, lz = moe_block(cfg, Pz, m, x)
            ref0 = np.array([_naive_moe_token(cfg, {k: v.numpy() for k, v in Pz.items()}, m, row)[0] for row in x.numpy()])
            by_hand = sum(_naive_mlp(x.numpy().T, Pn[f"{m}experts.{e}.gate_proj.weight"], Pn[f"{m}experts.{e}.up_proj.weight"],
                                     Pn[f"{m}experts.{e}.down_proj.weight"]).T for e in range(cfg.top_k)) / cfg.n_experts
            gs = 1 / (1 + np.exp(-(x.numpy() @ Pn[m + "shared_expert_gate.weight"].T)))
            by_hand = by_hand + gs * _naive_mlp(x.numpy().T, Pn[m + "shared_expert.gate_proj.weight"],
                                                Pn[m + "shared_expert.up_proj.weight"], Pn[m + "shared_expert.down_proj.weight"]).T
            e0 = max(float(np.abs(got0.numpy() - ref0).max()), float(np.abs(got0.numpy() - by_hand).max()))
            aux0 = load_balancing_loss([lz, lz], cfg.n_experts, cfg.top_k).item()
            check(e0 < 1e-12 and abs(aux0 - cfg.top_k) < 1e-12,
                  f"all-equal router logits: experts 0..k-1 chosen (err {e0:.1e}), aux = k ({aux0:.15f})")

    # The aux loss: concatenated over layers, against the naive loop; a per-layer sum would differ.
    cfg = Config(_tiny_config("qwen3_moe"))
    zs = [torch.randn(12, cfg.n_experts, generator=g, dtype=torch.float64) * 2 for _ in range(3)]
    zs[2][:4] = 0.5  # some all-tie rows
    got = load_balancing_loss(zs, cfg.n_experts, cfg.top_k).item()
    ref = _naive_aux([z for zz in zs for z in zz.numpy()], cfg.n_experts, cfg.top_k)
    per_layer = sum(load_balancing_loss([z], cfg.n_experts, cfg.top_k).item() for z in zs)
    check(abs(got - ref) < 1e-13 and abs(per_layer - got) > 1e-3,
          f"aux loss = naive formula over all layers' tokens ({got:.12f} vs {ref:.12f}; per-layer sum {per_layer:.4f})")

    # Whole models in fp64 against the naive numpy model; q/k norm placement; gradcheck.
    B, T = 2, 6
    for what, d in (("qwen3_moe", _tiny_config("qwen3_moe")), ("qwen2_moe", _tiny_config("qwen3_moe", True)),
                    ("mixtral", _tiny_config("mixtral"))):
        cfg = Config(d)
        tokens = torch.randint(0, cfg.vocab, (B, T + 1), generator=g)
        inputs, targets = tokens[:, :T], tokens[:, 1:].clone()
        targets[0, 2] = -1
        P = init_params(cfg, seed=31, std=0.4, dtype=torch.float64)
        model = MoEModel(cfg, T)
        r = model.losses(P, inputs, targets)
        ce, aux, lg = _naive_model_np(cfg, P, inputs, targets)
        elg = float(np.abs(r["logits"].detach().numpy() - lg).max())
        check(abs(r["ce_loss"].item() - ce) < 1e-12 * ce and abs(r["aux_loss"].item() - aux) < 1e-12 * aux and elg < 1e-12,
              f"{what}: fp64 ce {ce:.12f}, aux {aux:.12f}, logits (err {elg:.1e}) = naive numpy model")
        want = ce + cfg.aux_coef * aux if cfg.output_router_logits else ce
        check(abs(r["loss"].item() - want) < 1e-12, f"{what}: loss = ce{' + coef*aux' if cfg.output_router_logits else ''}")
        if what == "qwen3_moe":
            ce_after, _, _ = _naive_model_np(cfg, P, inputs, targets, qk_norm_after_rope=True)
            check(abs(ce_after - ce) > 1e-4, f"q/k norm after RoPE would differ ({ce_after:.6f} vs {ce:.6f}): placement is tested")
        _, routers = model.forward(P, inputs)
        margin = _topk_margin(routers, cfg.top_k)
        m = f"model.layers.1.{cfg.moe_prefix}"
        gate = cfg.expert_names[0]
        names = [m + "gate.weight", m + f"experts.1.{gate}.weight", "model.embed_tokens.weight"]
        if cfg.qk_norm:
            names += ["model.layers.1.self_attn.q_norm.weight", "model.layers.2.self_attn.k_norm.weight"]
        if cfg.shared_ffn:
            names += [m + "shared_expert_gate.weight", m + "shared_expert.up_proj.weight"]
        if cfg.qkv_bias:
            names += ["model.layers.1.self_attn.q_proj.bias", "model.layers.2.self_attn.v_proj.bias"]
        rest = {n: v for n, v in P.items() if n not in names}
        fn = lambda *ts: model.losses({**rest, **dict(zip(names, ts))}, inputs, targets)["loss"]  # noqa: E731
        ok = torch.autograd.gradcheck(fn, [P[n].clone().requires_grad_(True) for n in names],
                                      eps=1e-6, atol=1e-8, rtol=1e-6, raise_exception=False)
        check(ok and margin > 1e-4, f"{what}: fp64 gradients = central finite differences (gradcheck; router, expert, "
              f"embedding{', q/k norm' if cfg.qk_norm else ''}{', shared expert' if cfg.shared_ffn else ''}"
              f"{', q/v bias' if cfg.qkv_bias else ''}; "
              f"top-k margin {margin:.1e})")
        if not cfg.output_router_logits:
            cfg_aux = Config({**d, "output_router_logits": True})
            r2 = MoEModel(cfg_aux, T).losses(P, inputs, targets)
            check(abs(r2["loss"].item() - r2["ce_loss"].item() - cfg.aux_coef * aux) < 1e-12,
                  f"{what}: output_router_logits true adds coef*aux")

    # Unsupported configs are rejected, naming the key.
    bad = [("attention_bias", True), ("qkv_bias", True), ("use_sliding_window", True), ("hidden_act", "gelu"),
           ("model_type", "qwen2_moe_xl"), ("router_jitter_noise", 0.1),
           ("shared_expert_intermediate_size", 8)]
    ok = True
    for key, val in bad:
        try:
            Config({**_tiny_config("qwen3_moe"), key: val})
            ok = False
        except ValueError as e:
            ok &= key in str(e)
    try:
        MoEModel(Config({**_tiny_config("mixtral"), "sliding_window": 4}), 6)
        ok = False
    except ValueError as e:
        ok &= "sliding_window" in str(e)
    check(ok, "unsupported configs raise ValueError naming the key")

    # The CLI path (files in, files out), float32 and bf16 autocast, against fp64 autograd.
    B, T = 2, 7
    for what, d in (("qwen3_moe", _tiny_config("qwen3_moe")), ("qwen2_moe", _tiny_config("qwen3_moe", True)),
                    ("mixtral", _tiny_config("mixtral"))):
        cfg = Config(d)
        tokens = torch.randint(0, cfg.vocab, (B, T + 1), generator=g)
        tokens[1, T] = -7  # only the last column can be an ignored target in tokens.bin
        inputs, targets = tokens[:, :T], tokens[:, 1:]
        P = init_params(cfg, seed=41, std=0.4)
        names = list(P)
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(d, f)
            st.save(os.path.join(tmp, "model.safetensors"), {n: P[n].numpy() for n in names},
                    dtypes={"model.norm.weight": "BF16"})
            with open(os.path.join(tmp, "tokens.json"), "w") as f:
                json.dump({"batch": B, "seq_len": T}, f)
            tokens.numpy().astype("<i4").tofile(os.path.join(tmp, "tokens.bin"))
            _, Pl, _, _ = load_dir(tmp)
            model = MoEModel(cfg, T)
            margin = _topk_margin(model.forward({n: Pl[n].double() for n in names}, inputs)[1], cfg.top_k)
            for dt, tol_l, tol_g in (("float32", 1e-6, 1e-5), ("bfloat16", 2e-2, 0.1)):
                routing = _Routing()
                with routing.record():
                    run_dir(tmp, dt)
                # fp64 reference; under bf16 it replays the run's expert choices (see _Routing).
                Pr = {n: Pl[n].double().requires_grad_(True) for n in names}
                with routing.compare() if dt == "float32" else routing.replay():
                    ref = model.losses(Pr, inputs, targets)
                ref["loss"].backward()
                out = st.load(os.path.join(tmp, "torch_out.safetensors"))
                scal = ("loss", "ce_loss", "aux_loss")
                check(set(out) == set(names) | set(scal) | {"logits"}
                      and all(out[k].dtype == np.float64 and out[k].shape == (1,) for k in scal)
                      and out["logits"].dtype == np.float32 and out["logits"].shape == (B * T, cfg.vocab)
                      and all(out[n].dtype == np.float32 and out[n].shape == P[n].shape for n in names),
                      f"{what} {dt}: output names/dtypes/shapes")
                errl = max(abs(out[k][0] - ref[k].item()) / abs(ref[k].item()) for k in scal)
                errlg = _rel_l2(out["logits"], ref["logits"].detach().numpy())
                # The k bias's gradient nearly cancels (q . b_k shifts a query's scores alike but for
                # RoPE's rotation): in bf16 its rounding is most of it (0.13 rel-L2 seen); f32 checks it.
                graded = [n for n in names if dt == "float32" or not n.endswith("k_proj.bias")]
                errg, worst = max((_rel_l2(out[n], Pr[n].grad.numpy()) if Pr[n].grad is not None
                                   else float(np.abs(out[n]).max()), n) for n in graded)  # unrouted: zeros
                check(errl < tol_l and errlg < tol_l and errg < tol_g and (dt != "float32" or routing.flips == 0),
                      f"{what} {dt}: loss/ce/aux worst rel err {errl:.1e}, logits rel-L2 {errlg:.1e} < {tol_l:.0e}, "
                      f"worst grad rel-L2 {errg:.1e} < {tol_g:.0e} ({worst}; top-k margin {margin:.1e}, "
                      f"{routing.flips} top-k rows differ from fp64{', replayed' if dt != 'float32' else ''})")

    print("selftest:", "FAILED " + str(len(fails)) if fails else "all passed")
    return 0 if not fails else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    if not a.dir:
        ap.error("--dir is required (or --selftest)")
    r = run_dir(a.dir, a.dtype, a.threads)
    print(f"loss {r['loss']:.9f} ce_loss {r['ce_loss']:.9f} aux_loss {r['aux_loss']:.9f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
