#include "kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/attention_block.hpp"

namespace loom::cpu {
namespace {

void check_shape(const AttentionShape& s, const char* who) {
  LOOM_CHECK(s.B > 0 && s.T > 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, who,
             ": B, T, Hq, Hkv, D must be positive, got B=", s.B, " T=", s.T, " Hq=", s.Hq,
             " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, who, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, who, ": q_stride (", s.q_stride, ") must be >= Hq*D (",
             s.Hq * s.D, ")");
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, who, ": kv_stride (", s.kv_stride, ") must be >= Hkv*D (",
             s.Hkv * s.D, ")");
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale must be finite and > 0, got ",
             s.scale);
}

// Causal attention is block attention of a sequence against itself with positions 0..T-1: the
// block kernels take the tile pairs on the diagonal as runs of consecutive positions and skip
// what lies past it, so this costs what a dedicated causal kernel would.
std::vector<int64_t> iota_positions(int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), int64_t(0));
  return pos;
}
BlockShape block_shape(const AttentionShape& s) {
  return {s.B, s.T, s.T, s.Hq, s.Hkv, s.D, s.q_stride, s.kv_stride, s.scale};
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse) {
  check_shape(s, "attention_forward");
  LOOM_CHECK(q && k && v && out && lse, "attention_forward: null pointer among q, k, v, out, lse");
  const std::vector<int64_t> pos = iota_positions(s.T);
  attention_block_forward(block_shape(s), q, k, v, pos.data(), pos.data(), out, lse);
}

void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv) {
  check_shape(s, "attention_backward");
  LOOM_CHECK(q && k && v && out && lse && dout && dq && dk && dv,
             "attention_backward: null pointer among q, k, v, out, lse, dout, dq, dk, dv");
  std::vector<float> delta(static_cast<size_t>(s.B * s.Hq * s.T));
  attention_delta(s.B, s.T, s.Hq, s.D, out, dout, delta.data());
  BlockShape bs = block_shape(s);
  bs.accumulate = false;  // dq, dk, dv are outputs here
  const std::vector<int64_t> pos = iota_positions(s.T);
  attention_block_backward(bs, q, k, v, pos.data(), pos.data(), lse, delta.data(), dout, dq, dk,
                           dv);
}

}  // namespace loom::cpu
