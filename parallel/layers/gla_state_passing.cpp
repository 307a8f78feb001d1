#include "parallel/layers/gla_state_passing.hpp"

#include "core/error.hpp"
#include "distributed/process_group.hpp"

namespace loom {

namespace {

// The local segments: loom's zigzag layout gives every cp rank two segments of T/2 consecutive
// positions (rank r: segments r and 2cp-1-r; for the middle ranks they are adjacent).
struct Segments {
  int64_t n = 0;
  std::vector<int64_t> global;  // global segment index of each local segment
};

Segments segments(const std::vector<int32_t>& pos) {
  const int64_t T = int64_t(pos.size());
  LOOM_CHECK(T % 2 == 0, "GLA state passing: ", T, " tokens per rank, expected an even number");
  Segments s;
  s.n = T / 2;
  for (int64_t i = 0; i < 2; ++i) {
    const int64_t first = pos[size_t(i * s.n)];
    for (int64_t t = 1; t < s.n; ++t)
      LOOM_CHECK(pos[size_t(i * s.n + t)] == first + t,
                 "GLA state passing: positions are not the zigzag layout's two runs");
    LOOM_CHECK(first % s.n == 0, "GLA state passing: a segment starts at position ", first,
               ", not a multiple of its length ", s.n);
    s.global.push_back(first / s.n);
  }
  return s;
}

// Rows [t0, t0 + n) of every sample of x [B*T, W] (a view allowed), as a contiguous [B*n, W].
Tensor take(const Tensor& x, int64_t B, int64_t T, int64_t t0, int64_t n) {
  Tensor out = f32({B * n, x.size(1)}, x.device());
  for (int64_t b = 0; b < B; ++b) {
    Tensor dst = out.narrow(0, b * n, n);
    ops::copy_rows(x.narrow(0, b * T + t0, n), dst);
  }
  return out;
}
void put(const Tensor& seg, int64_t B, int64_t T, int64_t t0, int64_t n, Tensor& x) {
  for (int64_t b = 0; b < B; ++b) {
    Tensor dst = x.narrow(0, b * T + t0, n);
    ops::copy_rows(seg.narrow(0, b * n, n), dst);
  }
}

// All ranks' [local segments, n] blocks, by global segment index: out [segments, n].
Tensor gather_by_segment(const CpOptions& cp, const Tensor& local, int64_t T_global,
                         int64_t n_local) {
  const int ranks = cp.size();
  Tensor all = f32({ranks * n_local, local.numel() / n_local}, local.device());
  cp.group->all_gather(local.view({local.numel()}), all.view({all.numel()}))->wait();
  Tensor out = f32(all.shape(), local.device());
  for (int r = 0; r < ranks; ++r) {
    const auto pos = cp_positions(T_global, ranks, r);
    std::vector<int32_t> p32(pos.begin(), pos.end());
    const Segments sg = segments(p32);
    for (size_t i = 0; i < sg.global.size(); ++i) {
      Tensor dst = out.narrow(0, sg.global[i], 1);
      ops::copy_rows(all.narrow(0, r * n_local + int64_t(i), 1), dst);
    }
  }
  return out;
}

}  // namespace

void gla_cp_forward(const CpOptions& cp, const ops::Gla& s, const std::vector<int32_t>& positions,
                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk, Tensor& o,
                    GlaCpSaved& saved) {
  const Device dev = q.device();
  const int64_t T = int64_t(positions.size()), K = q.size(1) / s.H, V = v.size(1) / s.Hkv;
  const Segments sg = segments(positions);
  const int64_t L = int64_t(sg.global.size()), state = s.B * s.H * K * V, dec = s.B * s.Hkv * K;
  Tensor none;
  // Summaries: a (the sum of gk over the segment) and E (the final state from zero).
  Tensor mine_a = f32({L, dec}, dev), mine_E = f32({L, state}, dev);
  std::vector<Tensor> qs, ks, vs, gs;
  for (int64_t i = 0; i < L; ++i) {
    qs.push_back(take(q, s.B, T, i * sg.n, sg.n));
    ks.push_back(take(k, s.B, T, i * sg.n, sg.n));
    vs.push_back(take(v, s.B, T, i * sg.n, sg.n));
    gs.push_back(take(gk, s.B, T, i * sg.n, sg.n));
    Tensor o_zero = f32({s.B * sg.n, s.H * V}, dev);
    Tensor E = mine_E.narrow(0, i, 1).view({s.B, s.H, K, V});
    ops::gla_forward(s, qs.back(), ks.back(), vs.back(), gs.back(), none, o_zero, E);
    Tensor a = mine_a.narrow(0, i, 1).view({s.B, s.Hkv, K});
    ops::gla_decay_total(s, gs.back(), a);
  }
  saved.a_all = gather_by_segment(cp, mine_a, T * cp.size(), L);
  const Tensor all_E = gather_by_segment(cp, mine_E, T * cp.size(), L);
  // The prefix fold in segment order, in f32 (the spec: fp32 for the fold).
  saved.S_in.assign(size_t(L), Tensor());
  Tensor S = Tensor::zeros({s.B, s.H, K, V}, DType::f32, dev);
  for (int64_t g = 0; g < all_E.size(0); ++g) {
    for (int64_t i = 0; i < L; ++i)
      if (sg.global[size_t(i)] == g) {
        saved.S_in[size_t(i)] = f32(S.shape(), dev);
        saved.S_in[size_t(i)].copy_from(S);
      }
    ops::gla_state_fold(s, saved.a_all.narrow(0, g, 1), all_E.narrow(0, g, 1), S);
  }
  for (int64_t i = 0; i < L; ++i) {
    Tensor os = f32({s.B * sg.n, s.H * V}, dev);
    ops::gla_forward(s, qs[size_t(i)], ks[size_t(i)], vs[size_t(i)], gs[size_t(i)],
                     saved.S_in[size_t(i)], os, none);
    put(os, s.B, T, i * sg.n, sg.n, o);
  }
}

void gla_cp_backward(const CpOptions& cp, const ops::Gla& s, const std::vector<int32_t>& positions,
                     const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                     const GlaCpSaved& saved, const Tensor& dout, Tensor& dq, Tensor& dk,
                     Tensor& dv, Tensor& dgk) {
  const Device dev = q.device();
  const int64_t T = int64_t(positions.size()), K = q.size(1) / s.H, V = v.size(1) / s.Hkv;
  const Segments sg = segments(positions);
  const int64_t L = int64_t(sg.global.size()), state = s.B * s.H * K * V;
  Tensor none;
  struct Seg {
    Tensor q, k, v, g, dout, dq, dk, dv, dg;
  };
  std::vector<Seg> seg(static_cast<size_t>(L));
  Tensor mine = f32({L, state}, dev);
  for (int64_t i = 0; i < L; ++i) {
    Seg& x = seg[size_t(i)];
    x.q = take(q, s.B, T, i * sg.n, sg.n);
    x.k = take(k, s.B, T, i * sg.n, sg.n);
    x.v = take(v, s.B, T, i * sg.n, sg.n);
    x.g = take(gk, s.B, T, i * sg.n, sg.n);
    x.dout = take(dout, s.B, T, i * sg.n, sg.n);
    x.dq = f32(x.q.shape(), dev);
    x.dk = f32(x.k.shape(), dev);
    x.dv = f32(x.v.shape(), dev);
    x.dg = f32(x.g.shape(), dev);
    // D: the segment's dh0 with no gradient from later segments (it does not depend on h0).
    Tensor D = mine.narrow(0, i, 1).view({s.B, s.H, K, V});
    ops::gla_backward(s, x.q, x.k, x.v, x.g, none, x.dout, none, x.dq, x.dk, x.dv, x.dg, D);
  }
  const Tensor all = gather_by_segment(cp, mine, T * cp.size(), L);
  // The suffix fold: dS_out(g) = e^{a_{g+1}} dS_out(g+1) + D_{g+1}, from 0 after the last.
  std::vector<Tensor> dht(static_cast<size_t>(L));
  Tensor dS = Tensor::zeros({s.B, s.H, K, V}, DType::f32, dev);
  for (int64_t g = all.size(0) - 1; g >= 0; --g) {
    for (int64_t i = 0; i < L; ++i)
      if (sg.global[size_t(i)] == g) {
        dht[size_t(i)] = f32(dS.shape(), dev);
        dht[size_t(i)].copy_from(dS);
      }
    ops::gla_state_fold(s, saved.a_all.narrow(0, g, 1), all.narrow(0, g, 1), dS);
  }
  for (int64_t i = 0; i < L; ++i) {
    Seg& x = seg[size_t(i)];
    ops::gla_backward(s, x.q, x.k, x.v, x.g, saved.S_in[size_t(i)], x.dout, dht[size_t(i)], x.dq,
                      x.dk, x.dv, x.dg, none);
    put(x.dq, s.B, T, i * sg.n, sg.n, dq);
    put(x.dk, s.B, T, i * sg.n, sg.n, dk);
    put(x.dv, s.B, T, i * sg.n, sg.n, dv);
    put(x.dg, s.B, T, i * sg.n, sg.n, dgk);
  }
}

namespace {

// Each local segment's previous segment's last W1 rows, [L, B*W1*C] (zero before a sample's first
// segment), from every rank's own segments' last rows.
Tensor conv_halos(const CpOptions& cp, const Segments& sg, const Tensor& x, int64_t B, int64_t T,
                  int64_t W1) {
  const Device dev = x.device();
  const int64_t L = int64_t(sg.global.size()), C = x.size(1);
  LOOM_CHECK(sg.n >= W1, "GLA short convolution under context parallelism: segments of ", sg.n,
             " tokens are shorter than conv_size - 1 = ", W1,
             " (expected training.seq_len / (2 x parallelism.cp) >= conv_size - 1)");
  Tensor mine = f32({L, B * W1 * C}, dev);
  for (int64_t i = 0; i < L; ++i) {
    Tensor dst = mine.narrow(0, i, 1).view({B * W1, C});
    ops::copy_rows(take(x, B, T, i * sg.n + sg.n - W1, W1), dst);
  }
  const Tensor all = gather_by_segment(cp, mine, T * cp.size(), L);
  Tensor halo = Tensor::zeros({L, B * W1 * C}, DType::f32, dev);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t g = sg.global[size_t(i)];
    if (g == 0) continue;
    Tensor dst = halo.narrow(0, i, 1).view({B * W1, C});
    ops::copy_rows(all.narrow(0, g - 1, 1).view({B * W1, C}), dst);
  }
  return halo;
}

// Per sample: the W1 halo rows, then the segment's n rows: [B*(W1+n), C].
Tensor extend(const Tensor& halo, const Tensor& seg, int64_t B, int64_t W1, int64_t n) {
  Tensor ext = f32({B * (W1 + n), seg.size(1)}, seg.device());
  for (int64_t b = 0; b < B; ++b) {
    Tensor h = ext.narrow(0, b * (W1 + n), W1), s = ext.narrow(0, b * (W1 + n) + W1, n);
    ops::copy_rows(halo.narrow(0, b * W1, W1), h);
    ops::copy_rows(seg.narrow(0, b * n, n), s);
  }
  return ext;
}

int64_t conv_width(const Tensor& w) {
  return w.size(w.ndim() - 1);
}

}  // namespace

void gla_cp_short_conv_forward(const CpOptions& cp, const std::vector<int32_t>& positions,
                               const Tensor& x, const Tensor& w, int64_t B, Tensor& y) {
  const int64_t T = int64_t(positions.size()), W1 = conv_width(w) - 1, C = x.size(1);
  const Segments sg = segments(positions);
  const int64_t n = sg.n;
  const Tensor halo = conv_halos(cp, sg, x, B, T, W1);
  for (int64_t i = 0; i < int64_t(sg.global.size()); ++i) {
    const Tensor ext =
        extend(halo.narrow(0, i, 1).view({B * W1, C}), take(x, B, T, i * n, n), B, W1, n);
    Tensor y_ext = f32(ext.shape(), x.device());
    ops::short_conv_forward(ext, w, B, y_ext);
    for (int64_t b = 0; b < B; ++b) {
      Tensor dst = y.narrow(0, b * T + i * n, n);
      ops::copy_rows(y_ext.narrow(0, b * (W1 + n) + W1, n), dst);
    }
  }
}

void gla_cp_short_conv_backward(const CpOptions& cp, const std::vector<int32_t>& positions,
                                const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B,
                                Tensor& dx, Tensor& dw) {
  const Device dev = x.device();
  const int64_t T = int64_t(positions.size()), W1 = conv_width(w) - 1, C = x.size(1);
  const Segments sg = segments(positions);
  const int64_t n = sg.n, L = int64_t(sg.global.size());
  const Tensor halo = conv_halos(cp, sg, x, B, T, W1);
  // The gradient of each local segment's halo rows, sent to the segment that holds them.
  Tensor halo_grad = f32({L, B * W1 * C}, dev);
  for (int64_t i = 0; i < L; ++i) {
    const Tensor ext =
        extend(halo.narrow(0, i, 1).view({B * W1, C}), take(x, B, T, i * n, n), B, W1, n);
    // The halo rows' outputs belong to the previous segment: no gradient flows into them here.
    const Tensor dy_ext =
        extend(Tensor::zeros({B * W1, C}, DType::f32, dev), take(dy, B, T, i * n, n), B, W1, n);
    Tensor dx_ext = f32(ext.shape(), dev);
    ops::short_conv_backward(dy_ext, ext, w, B, dx_ext, dw);
    for (int64_t b = 0; b < B; ++b) {
      Tensor own = dx.narrow(0, b * T + i * n, n);
      ops::copy_rows(dx_ext.narrow(0, b * (W1 + n) + W1, n), own);
      Tensor h = halo_grad.narrow(0, i, 1).view({B * W1, C}).narrow(0, b * W1, W1);
      ops::copy_rows(dx_ext.narrow(0, b * (W1 + n), W1), h);
    }
  }
  const Tensor all = gather_by_segment(cp, halo_grad, T * cp.size(), L);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t g = sg.global[size_t(i)];
    if (g + 1 >= all.size(0)) continue;  // the last segment: no segment reads its rows
    Tensor tail = take(dx, B, T, i * n + n - W1, W1);
    ops::add_inplace(tail, all.narrow(0, g + 1, 1).view({B * W1, C}));
    put(tail, B, T, i * n + n - W1, W1, dx);
  }
}

}  // namespace loom
