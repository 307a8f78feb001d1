#include "parallel/layers/context_parallel.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "distributed/process_group.hpp"
#include "ops/ops.hpp"

namespace loom {

int CpOptions::size() const {
  return group ? group->size() : 1;
}
int CpOptions::rank() const {
  return group ? group->rank() : 0;
}

std::vector<int64_t> cp_positions(int64_t T, int64_t cp, int64_t rank, int64_t sp_tp) {
  LOOM_CHECK(cp >= 1 && rank >= 0 && rank < cp && sp_tp >= 1,
             "cp_positions: need cp >= 1, 0 <= rank < cp, tp >= 1; got cp=", cp, " rank=", rank,
             " tp=", sp_tp);
  const int64_t div = 2 * cp * sp_tp;
  LOOM_CHECK(T > 0 && T % div == 0, "context parallel: sequence length ", T,
             " must be divisible by 2*cp", sp_tp > 1 ? "*tp (sequence parallel)" : "", " = ", div,
             " (cp=", cp, sp_tp > 1 ? ", tp=" : "",
             sp_tp > 1 ? std::to_string(sp_tp) : std::string(), ")");
  const int64_t c = T / (2 * cp);
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(2 * c));
  for (int64_t chunk : {rank, 2 * cp - 1 - rank})
    for (int64_t t = 0; t < c; ++t) pos.push_back(chunk * c + t);
  return pos;
}

int64_t cp_micro_batch_positions(const CpOptions& cp, int64_t T, int sp_tp,
                                 std::vector<int32_t>& positions,
                                 std::vector<std::vector<int64_t>>& by_rank) {
  positions.resize(size_t(T));
  by_rank.clear();
  const int n = cp.size();
  if (n <= 1) {
    for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = int32_t(t);
    return T;
  }
  for (int s = 0; s < n; ++s) by_rank.push_back(cp_positions(T * n, n, s, sp_tp));
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = int32_t(by_rank[size_t(cp.rank())][t]);
  return T * n;
}

// Some query of rank r sees some key of rank src exactly when the earliest key comes no later
// than the latest query: O(T) per block pair instead of counting every causal entry (the kernel
// itself skips the masked entries of a block without computing their scores).
bool block_has_work(const std::vector<std::vector<int64_t>>& by_rank, int r, int src) {
  const auto& q = by_rank[size_t(r)];
  const auto& k = by_rank[size_t(src)];
  return *std::min_element(k.begin(), k.end()) <= *std::max_element(q.begin(), q.end());
}

std::function<void()> in_flight(std::vector<dist::Work*> works) {
  return [works = std::move(works)] {
    for (dist::Work* w : works)
      if (w) w->test();
  };
}

namespace {

// K and V of this rank's tokens are packed into kv [M, 2*Hkv*hd] (k heads then v heads) so one
// message carries both; the block kernel reads them with the packed row stride.
struct RingViews {
  const RingAttention& g;
  int64_t M, kvw, q_cols;
  explicit RingViews(const RingAttention& ring)
      : g(ring), M(ring.B * ring.T), kvw(2 * ring.Hkv * ring.hd), q_cols(ring.Hq * ring.hd) {}
  Tensor q(const Tensor& qkv) const { return qkv.narrow(1, 0, q_cols); }
  Tensor kv_cols(const Tensor& qkv) const { return qkv.narrow(1, q_cols, kvw); }
  Tensor k(const Tensor& kv) const { return kv.narrow(1, 0, g.Hkv * g.hd); }
  Tensor v(const Tensor& kv) const { return kv.narrow(1, g.Hkv * g.hd, g.Hkv * g.hd); }
  Tensor block(Device dev) const {
    const MemoryUseScope use(dev, MemoryUse::communication);
    return Tensor::empty({M, kvw}, DType::f32, dev);
  }
  Tensor all(int n, Device dev, bool zeroed = false) const {
    const MemoryUseScope use(dev, MemoryUse::communication);
    return zeroed ? Tensor::zeros({n, M, kvw}, DType::f32, dev)
                  : Tensor::empty({n, M, kvw}, DType::f32, dev);
  }
  ops::AttentionBlock shape(int r, int src) const {
    const std::vector<Tensor>* d = g.by_rank_device;
    return {g.B,
            g.Hq,
            g.Hkv,
            &(*g.by_rank)[size_t(r)],
            &(*g.by_rank)[size_t(src)],
            d ? &(*d)[size_t(r)] : nullptr,
            d ? &(*d)[size_t(src)] : nullptr};
  }
};

}  // namespace

void ring_attention_forward(const CpOptions& cp, const RingAttention& g, const Tensor& qkv,
                            Tensor& out, Tensor& lse) {
  dist::ProcessGroup& grp = *cp.group;
  const int n = cp.size(), r = cp.rank();
  const RingViews rv(g);
  const Tensor q = rv.q(qkv);
  ops::fill(out, 0.0f);
  ops::fill(lse, -std::numeric_limits<float>::infinity());
  Tensor bo = Tensor::empty({rv.M, rv.q_cols}, DType::f32, qkv.device());
  Tensor bl = Tensor::empty({g.B * g.Hq * g.T}, DType::f32, qkv.device());
  auto consume = [&](const Tensor& kv, int src, const std::function<void()>& progress = {}) {
    if (!block_has_work(*g.by_rank, r, src)) return;
    ops::attention_block_forward(rv.shape(r, src), q, rv.k(kv), rv.v(kv), bo, bl, progress);
    ops::attention_merge(g.B, g.Hq, out, lse, bo, bl);
  };
  if (cp.allgather) {
    Tensor all = rv.all(n, qkv.device());
    Tensor mine = all[r];
    ops::copy_rows(rv.kv_cols(qkv), mine);
    grp.all_gather(all[r], all)->wait();
    for (int s = 0; s < n; ++s) consume(all[s], s);
    return;
  }
  Tensor cur = rv.block(qkv.device()), nxt = rv.block(qkv.device());
  ops::copy_rows(rv.kv_cols(qkv), cur);
  for (int i = 0; i < n; ++i) {
    // The next block's transfer is in flight while this one is computed.
    std::unique_ptr<dist::Work> sw, rw;
    if (i + 1 < n) {
      sw = grp.send(cur, (r + 1) % n, i);
      rw = grp.recv(nxt, (r + n - 1) % n, i);
    }
    consume(cur, (r + n - i) % n, in_flight({sw.get(), rw.get()}));
    if (sw) {
      sw->wait();
      rw->wait();
      std::swap(cur, nxt);
    }
  }
}

void ring_attention_backward(const CpOptions& cp, const RingAttention& g, const Tensor& qkv,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             Tensor& dqkv) {
  dist::ProcessGroup& grp = *cp.group;
  const int n = cp.size(), r = cp.rank();
  const RingViews rv(g);
  const Tensor q = rv.q(qkv);
  Tensor dq = rv.q(dqkv);
  Tensor delta = Tensor::empty({g.B * g.Hq * g.T}, DType::f32, qkv.device());
  ops::attention_delta(g.B, g.Hq, out, dout, delta);
  ops::fill(dqkv, 0.0f);
  auto consume = [&](const Tensor& kv, Tensor& dkv, int src,
                     const std::function<void()>& progress = {}) {
    if (!block_has_work(*g.by_rank, r, src)) return;
    Tensor dk = rv.k(dkv), dv = rv.v(dkv);
    ops::attention_block_backward(rv.shape(r, src), q, rv.k(kv), rv.v(kv), lse, delta, dout, dq, dk,
                                  dv, progress);
  };
  Tensor own = rv.block(qkv.device());
  if (cp.allgather) {
    Tensor all = rv.all(n, qkv.device());
    Tensor dall = rv.all(n, qkv.device(), true);
    Tensor mine = all[r];
    ops::copy_rows(rv.kv_cols(qkv), mine);
    grp.all_gather(all[r], all)->wait();
    for (int s = 0; s < n; ++s) {
      Tensor ds = dall[s];
      consume(all[s], ds, s);
    }
    grp.reduce_scatter(dall, own, dist::ReduceOp::sum)->wait();
  } else {
    // dK/dV accumulators travel with their K/V block: the one for block (r - i) arrives from the
    // previous rank while this rank computes block (r - i)'s contribution into `part`, so the hop
    // overlaps compute; the sum is sent on at once. After n hops each rank holds its own keys'.
    Tensor cur = rv.block(qkv.device()), nxt = rv.block(qkv.device()),
           part = rv.block(qkv.device()), in = rv.block(qkv.device());
    Tensor out_acc = rv.block(qkv.device());
    ops::copy_rows(rv.kv_cols(qkv), cur);
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::unique_ptr<dist::Work> acc_send, acc_recv;
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<dist::Work> sw, rw;
      if (i + 1 < n) {
        sw = grp.send(cur, next, 2 * i);
        rw = grp.recv(nxt, prev, 2 * i);
      }
      part.zero_();
      consume(cur, part, (r + n - i) % n,
              in_flight({sw.get(), rw.get(), acc_send.get(), acc_recv.get()}));
      if (acc_send) acc_send->wait();
      if (i == 0) {
        std::swap(part, out_acc);
      } else {
        acc_recv->wait();
        ops::add_inplace(in, part);
        std::swap(in, out_acc);
      }
      acc_send = grp.send(out_acc, next, 2 * i + 1);
      acc_recv = grp.recv(in, prev, 2 * i + 1);
      if (sw) {
        sw->wait();
        rw->wait();
        std::swap(cur, nxt);
      }
    }
    acc_send->wait();
    acc_recv->wait();
    own = in;
  }
  Tensor dkv = rv.kv_cols(dqkv);
  ops::copy_rows(own, dkv);
}

}  // namespace loom
