#pragma once
// Context parallelism (docs/decisions/context-parallel.md), for any model with causal attention:
// the sequence of every sample is cut into 2*cp chunks and cp rank r holds chunks r and
// 2*cp-1-r (the "zigzag" layout: every rank computes the same number of causal score entries);
// attention runs as ring attention over the cp group, K/V rotating by send/recv or gathered in
// one all-gather.
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.hpp"

namespace loom {

namespace dist {
class ProcessGroup;
class Work;
}  // namespace dist

struct CpOptions {
  dist::ProcessGroup* group = nullptr;  // the mesh's "cp" group; nullptr: none
  bool allgather = false;               // parallelism.cp_rotate_method = "allgather"
  int size() const;
  int rank() const;
};

// Global positions held by cp rank `rank` of `cp` in a sequence of T tokens (the zigzag layout).
// With sequence parallelism over a TP group of `sp_tp` ranks each chunk pair is further split by
// tp, so T must be divisible by 2*cp*sp_tp; a loom::Error names T and the divisor otherwise.
std::vector<int64_t> cp_positions(int64_t T, int64_t cp, int64_t rank, int64_t sp_tp = 1);

// The positions of one micro-batch of T tokens per sample on this rank: `positions` (this
// rank's, for RoPE) and `by_rank[r]` (cp rank r's, for the causal mask of ring attention).
// Without cp: positions 0..T-1 and no by_rank. Returns the sequence length the RoPE table must
// cover (T * cp).
int64_t cp_micro_batch_positions(const CpOptions& cp, int64_t T, int sp_tp,
                                 std::vector<int32_t>& positions,
                                 std::vector<std::vector<int64_t>>& by_rank);

// Whether the queries of rank r see any key of rank src (with the zigzag layout always).
bool block_has_work(const std::vector<std::vector<int64_t>>& by_rank, int r, int src);

// The kernels call this between work units: Open MPI moves the data of nonblocking send/recv
// only inside MPI calls, so without polling a transfer posted before a block would happen in the
// wait after it, not during it.
std::function<void()> in_flight(std::vector<dist::Work*> works);

// Ring attention over the cp group. qkv [B*T, (Hq + 2 Hkv) hd] (this rank's tokens, after RoPE),
// out [B*T, Hq hd] and lse [B, Hq, T] written; positions by rank as above, and their int64 copies
// on the run's device (ops::AttentionBlock; may be null on the CPU).
struct RingAttention {
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, hd = 0;
  const std::vector<std::vector<int64_t>>* by_rank = nullptr;
  const std::vector<Tensor>* by_rank_device = nullptr;
};
void ring_attention_forward(const CpOptions& cp, const RingAttention& g, const Tensor& qkv,
                            Tensor& out, Tensor& lse);
// dqkv [B*T, (Hq + 2 Hkv) hd] overwritten: dq from every block this rank's queries took part in,
// dk/dv from every rank's queries against this rank's keys (accumulators that travel the ring
// with K/V and come home after cp hops; with allgather, one reduce-scatter).
void ring_attention_backward(const CpOptions& cp, const RingAttention& g, const Tensor& qkv,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             Tensor& dqkv);

}  // namespace loom
