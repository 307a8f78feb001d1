#pragma once
// Context parallelism for GLA by state passing (../shared/specs/GLA.md section 9): each cp rank
// holds segments of every sample (loom's zigzag layout, context_parallel.hpp). Forward: each
// local segment's total log-decay a and zero-start final state E, one all-gather of (a, E) over
// cp, a prefix fold S <- e^a S + E in segment order for each segment's starting state, then the
// segment's chunked core from it. Backward mirrors it: each segment's dh0 from dht = 0 (D), one
// all-gather, a suffix fold for each segment's dht, then the segment's full backward. The bytes
// moved do not grow with the sequence: B*H*K*(V+1) floats per segment.
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/context_parallel.hpp"

namespace loom {

// What backward needs from forward: every segment's total decay (all ranks', by global segment)
// and the starting state of each local segment.
struct GlaCpSaved {
  Tensor a_all;              // [segments, B, Hkv, K]
  std::vector<Tensor> S_in;  // per local segment [B, H, K, V]
};

// q, k, v, gk, o (and the gradients) hold this rank's T tokens per sample ([B*T, ...] views
// allowed), at global positions `positions` (length T, cp_micro_batch_positions' layout).
void gla_cp_forward(const CpOptions& cp, const ops::Gla& s, const std::vector<int32_t>& positions,
                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk, Tensor& o,
                    GlaCpSaved& saved);
// dq, dk, dv, dgk overwritten.
void gla_cp_backward(const CpOptions& cp, const ops::Gla& s, const std::vector<int32_t>& positions,
                     const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                     const GlaCpSaved& saved, const Tensor& dout, Tensor& dq, Tensor& dk,
                     Tensor& dv, Tensor& dgk);

}  // namespace loom
