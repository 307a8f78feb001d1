#!/usr/bin/python3
"""Independent PyTorch reference of a Llama model (loss and parameter gradients) for loom's parity tests.

Written from the math, with Hugging Face's parameter names and conventions; imports nothing of loom.

  torch_llama.py --dir D [--dtype float32|bfloat16] [--threads 2]
      reads D/config.json (HF), D/model.safetensors, D/tokens.bin (int32 [B, T+1]) and D/tokens.json
      ({"batch": B, "seq_len": T}); inputs = first T tokens of a row, targets = last T (target < 0 is
      ignored). Writes D/torch_out.safetensors: every parameter's gradient (F32, under its name) and
      "loss" (F64, [1]). Parameters are float32; bfloat16 runs under torch.autocast("cpu", bfloat16).
  torch_llama.py --selftest
      checks this file against naive formulas and finite differences; exits 0 when all pass.
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


class Config:
    """The subset of a Hugging Face LlamaConfig that defines the math."""

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
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("config.json: attention_bias/mlp_bias are not supported (expected false)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {d.get('hidden_act')!r} unsupported, expected 'silu'")
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
        C, D, H, K, Fh = self.dim, self.head_dim, self.n_heads, self.n_kv_heads, self.ffn
        s = {"model.embed_tokens.weight": (self.vocab, C)}
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = (C,)
            s[p + "self_attn.q_proj.weight"] = (H * D, C)
            s[p + "self_attn.k_proj.weight"] = (K * D, C)
            s[p + "self_attn.v_proj.weight"] = (K * D, C)
            s[p + "self_attn.o_proj.weight"] = (C, H * D)
            s[p + "post_attention_layernorm.weight"] = (C,)
            s[p + "mlp.gate_proj.weight"] = (Fh, C)
            s[p + "mlp.up_proj.weight"] = (Fh, C)
            s[p + "mlp.down_proj.weight"] = (C, Fh)
        s["model.norm.weight"] = (C,)
        if not self.tied:
            s["lm_head.weight"] = (self.vocab, C)
        return s

    def flops_per_token(self, seq_len):
        """torchtitan's convention: 6*N + 12*L*H*Q*T, N = parameters except the input embedding
        (the output projection counts, also when tied)."""
        n = sum(math.prod(v) for k, v in self.param_shapes().items() if k != "model.embed_tokens.weight")
        if self.tied:
            n += self.vocab * self.dim
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def rope_inv_freq(cfg):
    """float64 [head_dim/2]: theta^(-2i/D), with Llama 3.1 "llama3" scaling when configured."""
    D = cfg.head_dim
    inv = cfg.theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rs = cfg.rope_scaling
    if rs is None or rs.get("rope_type", rs.get("type")) != "llama3":
        return inv
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    medium = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < high_wavelen, inv, torch.where(wavelen > low_wavelen, inv / factor, medium))


def rope_cos_sin(cfg, T):
    """float64 [T, D]; column i and i + D/2 share frequency i (Hugging Face rotate_half layout)."""
    ang = torch.arange(T, dtype=torch.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; cos/sin [T, D] already in x's dtype."""
    return x * cos + rotate_half(x) * sin


def rms_norm(x, w, eps):
    """In float32 (or float64 when x is float64), whatever autocast does to its neighbours."""
    xf = x.float() if x.dtype != torch.float64 else x
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def attention(q, k, v, mask):
    """Causal softmax attention with GQA. q [B, H, T, D], k/v [B, Hkv, T, D]; query head h reads kv
    head h // (H/Hkv). The grouped heads are folded into the row dimension instead of repeating K/V."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    qg = (q * (1.0 / math.sqrt(D))).reshape(B, Hkv, rep * T, D)
    s = torch.matmul(qg, k.transpose(-1, -2)).view(B, Hkv, rep, T, T)
    s = s.masked_fill(mask, float("-inf"))
    # float32 softmax as Hugging Face does under bf16; fp64 stays fp64.
    p = torch.softmax(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = p.to(v.dtype)
    o = torch.matmul(p.view(B, Hkv, rep * T, T), v)
    return o.view(B, H, T, D)


class Llama:
    """Functional model over a {name: tensor} dict, so the same code runs float32, float64 and under
    autocast, and optimizers see plain tensors."""

    def __init__(self, cfg, seq_len):
        self.cfg = cfg
        self.T = seq_len
        cos, sin = rope_cos_sin(cfg, seq_len)
        self._rope = {torch.float64: (cos, sin)}
        self.mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)

    def rope(self, dtype):
        if dtype not in self._rope:
            c, s = self._rope[torch.float64]
            self._rope[dtype] = (c.to(dtype), s.to(dtype))
        return self._rope[dtype]

    def logits(self, P, idx):
        cfg = self.cfg
        B, T = idx.shape
        if T > self.T:
            raise ValueError(f"sequence length {T} exceeds the {self.T} this model was built for")
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        mask = self.mask[:T, :T]
        x = F.embedding(idx, P["model.embed_tokens.weight"])
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, P[p + "input_layernorm.weight"], cfg.eps)
            q = F.linear(h, P[p + "self_attn.q_proj.weight"]).view(B, T, H, D).transpose(1, 2)
            k = F.linear(h, P[p + "self_attn.k_proj.weight"]).view(B, T, Hkv, D).transpose(1, 2)
            v = F.linear(h, P[p + "self_attn.v_proj.weight"]).view(B, T, Hkv, D).transpose(1, 2)
            cos, sin = self.rope(q.dtype)
            q = apply_rope(q, cos[:T], sin[:T])
            k = apply_rope(k, cos[:T], sin[:T])
            a = attention(q, k, v, mask).transpose(1, 2).reshape(B, T, H * D)
            x = x + F.linear(a, P[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, P[p + "post_attention_layernorm.weight"], cfg.eps)
            g = F.linear(h, P[p + "mlp.gate_proj.weight"])
            u = F.linear(h, P[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(g) * u, P[p + "mlp.down_proj.weight"])
        h = rms_norm(x, P["model.norm.weight"], cfg.eps)
        w_out = P["model.embed_tokens.weight"] if cfg.tied else P["lm_head.weight"]
        return F.linear(h, w_out)

    def loss(self, P, idx, targets):
        """Mean cross-entropy over targets >= 0, in float32 (float64 for float64 parameters)."""
        lg = self.logits(P, idx)
        lg = lg.float() if lg.dtype != torch.float64 else lg
        t = torch.where(targets < 0, torch.full_like(targets, -100), targets)
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1), ignore_index=-100)


def init_params(cfg, seed=0, std=0.02, dtype=torch.float32):
    """Random parameters: N(0, std) matrices, norm weights 1 + N(0, 0.1) (never exactly ones)."""
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape in cfg.param_shapes().items():
        if len(shape) == 1:
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
    model = Llama(cfg, inputs.shape[1])
    if dtype == "bfloat16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(P, inputs, targets)
    elif dtype == "float32":
        loss = model.loss(P, inputs, targets)
    else:
        raise ValueError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    loss.backward()
    out = {name: t.grad.detach().float().numpy() for name, t in P.items()}
    out["loss"] = np.array([loss.item()], dtype=np.float64)
    st.save(os.path.join(d, "torch_out.safetensors"), out)
    return loss.item()


# ----------------------------------------------------------------------------------------------
# Self-test


def _naive_loss_np(cfg, P, inputs, targets):
    """Whole-model loss in numpy float64 with explicit loops and scalar formulas, sharing no code
    with the torch path above (RoPE pairs, GQA head mapping and RMSNorm written out)."""
    P = {k: v.detach().double().numpy() for k, v in P.items()}
    inputs, targets = inputs.numpy(), targets.numpy()
    B, T = inputs.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    freqs = _direct_llama3_freqs(cfg)

    def norm(x, w):
        return np.array([row / math.sqrt(np.mean(row * row) + cfg.eps) for row in x]) * w

    def rope(vec, pos):
        out = vec.copy()
        for i in range(D // 2):
            c, s = math.cos(pos * freqs[i]), math.sin(pos * freqs[i])
            out[i] = vec[i] * c - vec[i + D // 2] * s
            out[i + D // 2] = vec[i + D // 2] * c + vec[i] * s
        return out

    total, count = 0.0, 0
    for b in range(B):
        x = P["model.embed_tokens.weight"][inputs[b]].copy()
        for li in range(cfg.n_layers):
            p = f"model.layers.{li}."
            h = norm(x, P[p + "input_layernorm.weight"])
            q, k, v = (h @ P[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            att = np.zeros((T, H * D))
            for hh in range(H):
                g = hh // (H // Hkv)
                for i in range(T):
                    qi = rope(q[i, hh * D:(hh + 1) * D], i)
                    sc = np.array([qi @ rope(k[j, g * D:(g + 1) * D], j) / math.sqrt(D) for j in range(i + 1)])
                    e = np.exp(sc - sc.max())
                    e /= e.sum()
                    att[i, hh * D:(hh + 1) * D] = sum(e[j] * v[j, g * D:(g + 1) * D] for j in range(i + 1))
            x = x + att @ P[p + "self_attn.o_proj.weight"].T
            h = norm(x, P[p + "post_attention_layernorm.weight"])
            gt, up = h @ P[p + "mlp.gate_proj.weight"].T, h @ P[p + "mlp.up_proj.weight"].T
            x = x + (gt / (1 + np.exp(-gt)) * up) @ P[p + "mlp.down_proj.weight"].T
        h = norm(x, P["model.norm.weight"])
        lg = h @ (P["model.embed_tokens.weight"] if cfg.tied else P["lm_head.weight"]).T
        for i in range(T):
            if targets[b, i] < 0:
                continue
            m = lg[i].max()
            total += m + math.log(np.exp(lg[i] - m).sum()) - lg[i, targets[b, i]]
            count += 1
    return total / count


def _direct_llama3_freqs(cfg):
    """Scalar transcription of the llama3 frequency rule, independent of rope_inv_freq."""
    D = cfg.head_dim
    rs = cfg.rope_scaling
    out = []
    for i in range(D // 2):
        f = 1.0 / cfg.theta ** (2 * i / D)
        if rs is not None and rs.get("rope_type", rs.get("type")) == "llama3":
            old = rs["original_max_position_embeddings"]
            low, high = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
            w = 2 * math.pi / f
            if w < high:
                pass
            elif w > low:
                f = f / rs["factor"]
            else:
                sm = (old / w - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
                f = (1 - sm) * f / rs["factor"] + sm * f
        out.append(f)
    return out


def _tiny_config(tied, scaled=True):
    d = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 24, "vocab_size": 13, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": tied, "head_dim": 8, "hidden_act": "silu", "model_type": "llama"}
    if scaled:
        # With head_dim 8 and theta 1e4 the wavelengths are 6.3, 63, 628, 6283: original 400 with
        # factors low 0.25 / high 8 puts them in keep (<50), smooth, smooth, scaled (>1600).
        d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.25,
                             "high_freq_factor": 8.0, "original_max_position_embeddings": 400}
    return d


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def selftest():
    import tempfile

    torch.set_num_threads(2)
    fails = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            fails.append(what)

    # safetensors round trip; BF16 rounding compared with torch's own float->bfloat16 conversion.
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((3, 5)).astype(np.float32) * 100
        t = {"a": x, "b": rng.standard_normal(7), "c": x.astype(np.float16),
             "d": rng.integers(-5, 5, (2, 2, 3)).astype(np.int32), "e": x}
        path = os.path.join(tmp, "t.safetensors")
        st.save(path, t, dtypes={"e": "BF16"}, meta={"format": "pt"})
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        r = st.load(path, raw_bf16=False)
        bits = st.load(path, raw_bf16=True)["e"]
        ref_bits = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
        check((8 + n) % 8 == 0 and st.metadata(path) == {"format": "pt"}, "safetensors header aligned, metadata")
        check(all(np.array_equal(r[k], t[k]) and r[k].dtype == t[k].dtype for k in "abcd"), "safetensors F32/F64/F16/I32 round trip")
        check(np.array_equal(bits, ref_bits) and np.array_equal(r["e"], st.bf16_bits_to_f32(ref_bits)),
              "safetensors BF16 matches torch's round-to-nearest-even")

    # RoPE frequencies and rotation against the scalar formulas.
    cfg = Config(_tiny_config(tied=False))
    direct = _direct_llama3_freqs(cfg)
    ours = rope_inv_freq(cfg).tolist()
    base = [1.0 / cfg.theta ** (2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
    old = cfg.rope_scaling["original_max_position_embeddings"]
    w = [2 * math.pi / f for f in base]
    regimes = {"keep" if x < old / 8.0 else "scale" if x > old / 0.25 else "smooth" for x in w}
    check(regimes == {"keep", "scale", "smooth"}, f"rope test config covers all llama3 regimes {sorted(regimes)}")
    check(max(abs(a - b) / b for a, b in zip(ours, direct)) < 1e-14, "llama3 inv_freq matches the direct formula")
    T = 9
    xq = torch.randn(2, 3, T, cfg.head_dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(cfg, T)
    got = apply_rope(xq, cos, sin)
    ref = torch.empty_like(xq)
    h2 = cfg.head_dim // 2
    for pos in range(T):
        for i in range(h2):
            c, s = math.cos(pos * direct[i]), math.sin(pos * direct[i])
            ref[:, :, pos, i] = xq[:, :, pos, i] * c - xq[:, :, pos, i + h2] * s
            ref[:, :, pos, i + h2] = xq[:, :, pos, i + h2] * c + xq[:, :, pos, i] * s
    check(float((got - ref).abs().max()) < 1e-12, "apply_rope matches (i, i+D/2) rotation by pos*freq")
    check(float((rope_inv_freq(Config(_tiny_config(False, scaled=False))) - torch.tensor(base, dtype=torch.float64)).abs().max()) < 1e-15,
          "unscaled inv_freq = theta^(-2i/D)")

    # GQA attention against per-head loops.
    B, H, Hkv, D = 2, 6, 2, 5
    q, k, v = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, Hkv, T, D, dtype=torch.float64), torch.randn(B, Hkv, T, D, dtype=torch.float64)
    got = attention(q, k, v, torch.ones(T, T, dtype=torch.bool).triu(1))
    ref = torch.zeros_like(got)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(T):
                s = torch.stack([q[b, h, i] @ k[b, g, j] / math.sqrt(D) for j in range(i + 1)])
                ref[b, h, i] = torch.softmax(s, 0) @ v[b, g, :i + 1]
    check(float((got - ref).abs().max()) < 1e-12, "GQA causal attention matches per-head loops (h -> h // (H/Hkv))")

    for tied in (False, True):
        cfg = Config(_tiny_config(tied))
        B, T = 2, 7
        g = torch.Generator().manual_seed(3 + tied)
        tokens = torch.randint(0, cfg.vocab, (B, T + 1), generator=g)
        # Ignored targets: in tokens.bin only the last column can be negative (the others are also
        # inputs); the in-memory checks also ignore one in the middle.
        tokens[1, T] = -7
        inputs, file_targets = tokens[:, :T], tokens[:, 1:]
        targets = file_targets.clone()
        targets[0, 2] = -1
        # std 0.3: large enough that attention, SiLU and the norms are far from linear.
        P = init_params(cfg, seed=5 + tied, std=0.3, dtype=torch.float64)
        model = Llama(cfg, T)
        loss64 = model.loss(P, inputs, targets).item()
        naive = _naive_loss_np(cfg, P, inputs, targets)
        check(abs(loss64 - naive) < 1e-12 * abs(naive), f"tied={tied}: loss {loss64:.12f} = naive numpy fp64 model {naive:.12f}")

        # fp64 autograd against central finite differences over every parameter element (gradcheck).
        names = list(P)
        flat = [P[n].clone().requires_grad_(True) for n in names]
        ok = torch.autograd.gradcheck(lambda *ts: model.loss(dict(zip(names, ts)), inputs, targets), flat,
                                      eps=1e-6, atol=1e-8, rtol=1e-6, raise_exception=False)
        check(ok, f"tied={tied}: fp64 gradients match central finite differences (gradcheck, all elements)")

        # The CLI path (files in, files out) in float32 and bf16 autocast against fp64 autograd.
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(_tiny_config(tied), f)
            # BF16 storage for one tensor exercises conversion on load; the fp64 reference uses
            # the same rounded values.
            arrs = {n: P[n].float().numpy() for n in names}
            st.save(os.path.join(tmp, "model.safetensors"), arrs, dtypes={"model.norm.weight": "BF16"})
            with open(os.path.join(tmp, "tokens.json"), "w") as f:
                json.dump({"batch": B, "seq_len": T}, f)
            tokens.numpy().astype("<i4").tofile(os.path.join(tmp, "tokens.bin"))
            _, Pl, _, _ = load_dir(tmp)
            Pr = {n: Pl[n].double().requires_grad_(True) for n in names}
            lr = model.loss(Pr, inputs, file_targets)
            lr.backward()
            for dt, tol_l, tol_g in (("float32", 1e-6, 1e-5), ("bfloat16", 1e-2, 0.1)):
                run_dir(tmp, dt)
                out = st.load(os.path.join(tmp, "torch_out.safetensors"))
                want = set(names) | {"loss"}
                check(set(out) == want and out["loss"].dtype == np.float64 and out["loss"].shape == (1,)
                      and all(out[n].dtype == np.float32 for n in names), f"tied={tied} {dt}: output names/dtypes")
                errl = abs(out["loss"][0] - lr.item()) / abs(lr.item())
                errg = max(_rel_l2(out[n], Pr[n].grad.numpy()) for n in names)
                check(errl < tol_l and errg < tol_g, f"tied={tied} {dt}: CLI loss rel err {errl:.1e} < {tol_l:.0e}, worst grad rel-L2 {errg:.1e} < {tol_g:.0e}")

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
    loss = run_dir(a.dir, a.dtype, a.threads)
    print(f"loss {loss:.9f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
