#pragma once
// What the CUDA kernels take from the caching allocator, as plain C++ (no CUDA: every build
// includes it): the kernels size their scratch with these functions, and a meta run that models
// a GPU (ops::ModeledDevice) books the same blocks, so that the planner's peak is the GPU's.
// tests/ops/cuda/scratch_cuda_test.cpp checks each against the GPU allocator's peak.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"
#include "kernels/cpu/cross_entropy.hpp"  // LinearCrossEntropyChunks: a plain struct

namespace loom::cuda {

using cpu::LinearCrossEntropyChunks;

// A block one call allocates (released when the call returns).
struct ScratchBlock {
  int64_t numel = 0;
  DType dtype = DType::f32;
};

// ---- GEMMs: cuBLASLt's workspace, one per process, kept.
inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

// ---- the fused loss (cross_entropy.cu)
// The automatic chunk: the rows whose f32 logits take this much, a multiple of kLossRowMultiple.
inline constexpr int64_t kLossChunkBytes = int64_t{256} << 20;
inline constexpr int64_t kLossRowMultiple = 64;

// The rows of one chunk of f32 logits and of one group of bf16 logit gradients (cross_entropy.hpp
// says how they are chosen).
inline LinearCrossEntropyChunks loss_chunks(int64_t N, int64_t V, int64_t chunk_rows,
                                            int64_t grad_rows) {
  if (N <= 0 || V <= 0) return {};
  int64_t rows = chunk_rows;
  if (rows <= 0) {
    rows = kLossChunkBytes / (V * int64_t(sizeof(float)));
    if (rows >= kLossRowMultiple) rows = rows / kLossRowMultiple * kLossRowMultiple;
    rows = std::max<int64_t>(rows, 1);
  }
  rows = std::min(rows, N);
  return {rows, std::min(N, std::max(rows, grad_rows / rows * rows))};
}

// The call's one block, carved at 256-byte offsets: a chunk of f32 logits, the bf16 logit
// gradients (grad16), N per-row losses (doubles) and a bad-target record.
struct LossLayout {
  size_t logits = 0, g16 = 0, loss = 0, record = 0, bytes = 0;
};
inline LossLayout loss_layout(int64_t N, int64_t V, const LinearCrossEntropyChunks& ch,
                              bool grad16) {
  const auto take = [](size_t& at, size_t n) {
    const size_t o = at;
    at += (n + 255) / 256 * 256;
    return o;
  };
  LossLayout l;
  size_t at = 0;
  l.logits = take(at, size_t(ch.rows) * size_t(V) * sizeof(float));
  l.g16 = grad16 ? take(at, size_t(ch.grad_rows) * size_t(V) * sizeof(uint16_t)) : 0;
  l.loss = take(at, size_t(N) * sizeof(double));
  l.record = take(at, sizeof(uint64_t));
  l.bytes = at;
  return l;
}

// The block as the call allocates it (int32 elements); none for N == 0. `grad`: dx or dw computed.
inline std::vector<ScratchBlock> loss_scratch(int64_t N, int64_t V, DType ab, bool grad,
                                              int64_t chunk_rows, int64_t grad_rows) {
  if (N <= 0) return {};
  const bool grad16 = ab == DType::bf16 && grad;
  const LossLayout l =
      loss_layout(N, V, loss_chunks(N, V, chunk_rows, grad16 ? grad_rows : 0), grad16);
  return {{int64_t((l.bytes + 3) / 4), DType::i32}};
}

// ---- attention (attention.cu, flash_attention.cu)
// The head dims the flash kernels are built for, and their tile (flash_attention.hpp).
inline bool flash_head_dim(int64_t D) {
  return D == 64 || D == 128;
}
inline constexpr int64_t kFlashTile = 64;
// Whether a bf16 call takes the flash kernels, as far as its shape tells (flash_attention_usable
// also wants q, k, v 16-byte aligned, which the fused qkv buffer's columns are at these D).
inline bool flash_attention_takes(bool bf16, int64_t D, int64_t q_stride, int64_t kv_stride) {
  return bf16 && flash_head_dim(D) && q_stride % 8 == 0 && kv_stride % 8 == 0;
}

// The row stride of the exact kernels' score scratch: Tk rounded up to 8.
inline int64_t attention_scratch_ld(int64_t Tk) {
  return (Tk + 7) / 8 * 8;
}

// The blocks of one attention call, in the order it allocates them. `plain`: the whole-sequence
// call (the backward computes delta first; a ring block's positions come as arrays); `bf16`:
// bf16 operands; `out_bf16`: a bf16 forward output; `flash`: flash_attention_takes.
inline std::vector<ScratchBlock> attention_scratch(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                   int64_t D, bool bf16, bool backward,
                                                   bool out_bf16, bool plain, bool flash) {
  const int64_t ld = attention_scratch_ld(Tk), os = Hq * D;
  std::vector<ScratchBlock> s;
  if (flash) {
    // A block call's per-tile position ranges ([lo, hi] int64 per query and key tile, as int32
    // pairs); the backward's dout rounded to bf16 once. O(T) memory.
    const int64_t tiles = (Tq + kFlashTile - 1) / kFlashTile + (Tk + kFlashTile - 1) / kFlashTile;
    if (backward && plain) s.push_back({B * Hq * Tq, DType::f32});  // delta
    if (!plain) s.push_back({4 * tiles, DType::i32});
    if (backward) s.push_back({B * Tq * os, DType::bf16});
    return s;
  }
  if (!backward) {
    s.push_back({Tq * ld, DType::f32});                    // S
    if (bf16) s.push_back({Tq * ld, DType::bf16});         // P
    s.push_back({B * Hq * Tq, DType::f32});                // the row sums
    if (out_bf16) s.push_back({B * Tq * os, DType::f32});  // O before its rounding
    return s;
  }
  if (plain) s.push_back({B * Hq * Tq, DType::f32});  // delta
  if (bf16) s.push_back({B * Tq * os, DType::bf16});  // dout rounded
  s.push_back({Tq * ld, DType::f32});                 // S
  s.push_back({Tq * ld, DType::f32});                 // dP
  if (bf16) {
    s.push_back({Tq * ld, DType::bf16});  // P
    s.push_back({Tq * ld, DType::bf16});  // dS
  }
  return s;
}

// ---- the row kernels
// A gradient's sum over rows by ranges of consecutive rows, each range summed by one block into
// its own partial row (the bounds from the row count alone): RMSNorm's (rmsnorm.cu) and GLA's
// ops' (gla_ops.cu) at most kRowSumRanges ranges, the bias gradient's (bias_gate.cu) also at
// least kBiasMinRangeRows rows a range.
inline constexpr int64_t kRowSumRanges = 512, kBiasMinRangeRows = 32;
struct RowRanges {
  int64_t rows_per = 0, count = 0;
};
inline RowRanges row_ranges(int64_t rows, int64_t min_rows = 1) {
  const int64_t per = std::max(min_rows, (rows + kRowSumRanges - 1) / kRowSumRanges);
  return {per, (rows + per - 1) / per};
}
// RMSNorm's backward (rmsnorm.cu): the weight gradient's partial sums, a row of dim floats per
// range of rows.
inline std::vector<ScratchBlock> rmsnorm_backward_scratch(int64_t rows, int64_t dim) {
  if (rows <= 0 || dim <= 0) return {};
  return {{row_ranges(rows).count * dim, DType::f32}};
}

// The bias gradient (bias_gate.cu): a partial row of N doubles (f32 pairs) per range of dy's rows.
inline std::vector<ScratchBlock> bias_grad_scratch(int64_t M, int64_t N) {
  if (M <= 0 || N <= 0) return {};
  return {{2 * row_ranges(M, kBiasMinRangeRows).count * N, DType::f32}};
}

// ---- GLA (gla.cu, gla_ops.cu)
// The chunked core: the chunk-local gk cumsum (doubles, as f32 pairs) and the decayed scores; the
// backward also the scores' gradient, the states before each chunk and the states' gradients.
// None without tokens.
inline std::vector<ScratchBlock> gla_core_scratch(int64_t B, int64_t T, int64_t H, int64_t Hkv,
                                                  int64_t K, int64_t V, int64_t chunk,
                                                  bool backward) {
  if (B <= 0 || T <= 0) return {};
  const int64_t NT = (T + chunk - 1) / chunk, scores = B * H * T * chunk;
  std::vector<ScratchBlock> s{{2 * B * T * Hkv * K, DType::f32}, {scores, DType::f32}};
  if (backward) {
    s.push_back({scores, DType::f32});
    s.push_back({B * H * (NT + 1) * K * V, DType::f32});
    s.push_back({B * H * NT * K * V, DType::f32});
  }
  return s;
}
// The gate's backward: the bias gradient's partial rows (with a bias).
inline std::vector<ScratchBlock> gla_gate_backward_scratch(int64_t rows, int64_t width, bool bias) {
  if (rows <= 0 || !bias) return {};
  return {{row_ranges(rows).count * width, DType::f32}};
}
// The gated RMSNorm's backward: a partial row of dim floats per warp (kGatedNormWarps a block)
// of each range (with a weight).
inline constexpr int64_t kGatedNormWarps = 8;
inline std::vector<ScratchBlock> gated_rmsnorm_backward_scratch(int64_t rows, int64_t dim,
                                                                bool weight) {
  if (rows <= 0 || !weight) return {};
  return {{row_ranges(rows).count * kGatedNormWarps * dim, DType::f32}};
}
// The short convolution's backward: du (rows x C), then the weight gradient's partial rows.
inline std::vector<ScratchBlock> short_conv_backward_scratch(int64_t rows, int64_t C, int64_t W) {
  if (rows <= 0 || C <= 0) return {};
  return {{rows * C, DType::f32}, {row_ranges(rows).count * C * W, DType::f32}};
}

// The sum of squares (cast.cu): a double per chunk of kSumSquaresChunk elements; every call of
// sum_squares_each shares the largest call's, and the sums come back from one array (doubles as
// pairs of f32 elements).
inline constexpr int64_t kSumSquaresChunk = 8192;
inline int64_t sum_squares_parts(int64_t n) {
  return n > 0 ? (n + kSumSquaresChunk - 1) / kSumSquaresChunk : 1;
}
inline std::vector<ScratchBlock> sum_squares_scratch(const std::vector<int64_t>& numels) {
  int64_t most = 1;
  for (int64_t n : numels) most = std::max(most, sum_squares_parts(n));
  return {{2 * most, DType::f32}, {2 * int64_t(numels.size()), DType::f32}};
}

// The embedding's backward (embedding.cu): one block carved at 256-byte offsets: the keys and
// positions before and after the sort, the run heads and their numbers, each run's row and start,
// the status (a bad token's record, the run count), and CUB's scratch for the sort and the scan.
// CUB's own size is known only to CUB on the GPU: the call takes embedding_cub_bytes(n), a bound of
// it (the alternate keys and values twice over, and 1 MiB for the passes' digit counts), or CUB's
// where more, so that a meta run books what the GPU allocates.
struct EmbeddingLayout {
  size_t keys = 0, keys_sorted = 0, pos = 0, pos_sorted = 0, head = 0, idx = 0, rows = 0,
         starts = 0, info = 0, temp = 0, bytes = 0;
};
inline size_t embedding_cub_bytes(int64_t n) {
  return 2 * size_t(n) * 2 * sizeof(int32_t) + (size_t(1) << 20);
}
inline EmbeddingLayout embedding_backward_layout(int64_t n, size_t temp_bytes) {
  const auto take = [](size_t& at, size_t bytes) {
    const size_t o = at;
    at += (bytes + 255) / 256 * 256;
    return o;
  };
  const size_t ints = size_t(n) * sizeof(int32_t);
  EmbeddingLayout l;
  size_t at = 0;
  l.keys = take(at, ints), l.keys_sorted = take(at, ints), l.pos = take(at, ints);
  l.pos_sorted = take(at, ints), l.head = take(at, ints), l.idx = take(at, ints);
  l.rows = take(at, ints), l.starts = take(at, ints + sizeof(int32_t));
  l.info = take(at, 2 * sizeof(uint64_t)), l.temp = take(at, temp_bytes);
  l.bytes = at;
  return l;
}
// The embedding's forward (embedding.cu): the first bad token's record (64 bits).
inline std::vector<ScratchBlock> embedding_forward_scratch(int64_t n) {
  if (n <= 0) return {};
  return {{2, DType::i32}};
}
inline std::vector<ScratchBlock> embedding_backward_scratch(int64_t n, int64_t vocab) {
  if (n <= 0 || vocab <= 0) return {};
  return {
      {int64_t((embedding_backward_layout(n, embedding_cub_bytes(n)).bytes + 3) / 4), DType::i32}};
}

// ---- the mixture of experts' grouping (moe.cu's moe_permute_per_expert), in its order: each
// chunk's per-expert counts, the experts' starts, the counts and a bad assignment (E + 1 int64,
// the one copy home), the bad assignment's word, and the capacities (E int64) where given.
inline constexpr int64_t kMoeChunk = 512;  // assignments a warp of the grouping walks
inline std::vector<ScratchBlock> moe_permute_scratch(int64_t assignments, int64_t E,
                                                     bool capacity) {
  if (assignments <= 0) return {};
  const int64_t chunks = (assignments + kMoeChunk - 1) / kMoeChunk;
  std::vector<ScratchBlock> b = {
      {chunks * E, DType::i32}, {E, DType::i32}, {2 * (E + 1), DType::i32}, {1, DType::i32}};
  if (capacity) b.push_back({2 * E, DType::i32});
  return b;
}

// ---- the vocabulary-parallel loss's combine (cross_entropy.cu): the rows' losses (doubles).
inline std::vector<ScratchBlock> vocab_shard_combine_scratch(int64_t N) {
  if (N <= 0) return {};
  return {{2 * N, DType::i32}};
}

}  // namespace loom::cuda
