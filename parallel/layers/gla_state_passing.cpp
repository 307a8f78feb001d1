#include "parallel/layers/gla_state_passing.hpp"

#include "core/error.hpp"
#include "distributed/process_group.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

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

}  // namespace loom
