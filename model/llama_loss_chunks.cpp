// The fused loss's chunk sizes (LlamaModel::loss_chunks): product policy, how much of the step's
// memory the head's output projection + loss may take at once.
#include <algorithm>

#include "model/llama.hpp"

namespace loom {

LlamaModel::LossChunks LlamaModel::loss_chunks(const LlamaConfig& c, int64_t B, int64_t T,
                                               DType compute) {
  // The fused loss's workspace (f32 logits, plus their bf16 gradient in bf16 mode) may take what a
  // block's working buffers take beyond its saved tensors, less what else the head holds (its
  // input x, xf, dxf, rstd): then the head is never the step's peak. Small models get a floor,
  // where the peak may then grow by what it takes beyond the working buffers: in f32, 2% of the
  // saved activations at the head; in bf16 the room for 64 + 512 rows (f32 logits + bf16
  // gradients), within 4% of them. Each call of the dW GEMM re-reads and re-writes all of the f32
  // dW, and its inner dimension wants rows: bench-small bf16 64 + 256 rows in 6.7 MiB gave the
  // loss 77 ms of a 500 ms step, 64 + 512 rows in 10 MiB 72 ms for 3 MiB (0.4%) more at the peak;
  // past 512 rows little is left to gain (1024: 4% more), while 4% of a large model's activations
  // is a GiB (8B FSDP: 1.1). The f32 floor stays 2% because the chunk depends on the micro-batch's
  // rows: the f32 parity tests compare pp's one-sequence micro-batches with a single rank's whole
  // batch to 5e-5, and at 4% their chunks (64 rows at 2%) differed (parity_pp2_ddp2_tied drifted
  // past it). The figures are those of one rank without checkpointing, so every layout with the
  // same micro-batch takes the same chunks and sums in the same order.
  const double M = double(B * T), d = double(c.hidden_size), V = double(c.vocab_size);
  const double cs = double(dtype_size(compute)), F = double(c.intermediate_size);
  const double hd = double(c.head_dim()), Hq = double(c.num_attention_heads);
  const double Hkv = double(c.num_key_value_heads);
  // What one block saves for its backward (LlamaBlock, no checkpointing, one rank): x, xn1, xn2,
  // qkv, the attention output, gu and act in the compute dtype; h, rstd1, rstd2 and the attention's
  // log-sum-exp in f32. The head sees every block's.
  const double block = M * d * cs * 3 + M * d * 4 + M * 4 * 2 + M * (Hq + 2 * Hkv) * hd * cs +
                       M * Hq * hd * cs + double(B) * Hq * double(T) * 4 + M * 2 * F * cs +
                       M * F * cs;
  const double saved = block * double(c.num_hidden_layers);
  // A block's backward's working buffers beyond what it saved: the gradient from above (f32), the
  // SwiGLU's f32 gradient and, in bf16, the former rounded for the down projection's GEMM.
  const double working = M * d * 4 + M * F * 4 + (cs == 4 ? 0 : M * d * 2);
  const double head = M * d * (4 + cs + 4) + M * 4;
  const double floor =
      compute == DType::bf16 ? std::min(0.04 * saved, (64 * 4 + 512 * 2) * V) : 0.02 * saved;
  const double budget = std::max(floor, working - head);
  const auto rows_of = [&](double bytes, double per_row) {
    const int64_t rows = int64_t(bytes / per_row) / 16 * 16;
    return std::clamp<int64_t>(rows, std::min<int64_t>(64, B * T), B * T);
  };
  if (compute != DType::bf16) return {rows_of(budget, 4 * V), 0};
  // bf16: the logits GEMM needs few rows to run at speed, the dW GEMM many (its inner dimension;
  // each call re-reads and re-writes all of the f32 dW): a chunk of at most 64 rows of f32
  // logits, the rest of the budget for the bf16 gradients (linear_cross_entropy at V 8192, D 512,
  // 2 threads: 64 + 512 rows in 10 MiB take 72 ms, 112 + 112 rows in 5.25 MiB 89 ms).
  const int64_t rows = std::min<int64_t>(64, rows_of(budget / 3, 4 * V));
  const int64_t grad_rows = rows_of(budget - double(rows) * 4 * V, 2 * V) / rows * rows;
  return {rows, std::max(rows, grad_rows)};
}

}  // namespace loom
