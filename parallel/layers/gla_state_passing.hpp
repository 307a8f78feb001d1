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

// The short convolution (use_short_conv) under context parallelism: a segment's convolution
// reads the previous segment's last W - 1 rows before it (zero before a sample's first segment),
// which another cp rank may hold: one all-gather of every segment's last W - 1 rows, each local
// segment convolved over (those rows | its own) as a sample of its own. Backward gathers them
// again, and the gradient of those rows goes back to their segment's rank (a second all-gather).
// x, y, dy, dx: this rank's [B*T, C] (views allowed), w fla's [C, 1, W]; y and dx overwritten,
// dw accumulated. A segment shorter than W - 1 rows is refused.
void gla_cp_short_conv_forward(const CpOptions& cp, const std::vector<int32_t>& positions,
                               const Tensor& x, const Tensor& w, int64_t B, Tensor& y);
void gla_cp_short_conv_backward(const CpOptions& cp, const std::vector<int32_t>& positions,
                                const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B,
                                Tensor& dx, Tensor& dw);

}  // namespace loom
