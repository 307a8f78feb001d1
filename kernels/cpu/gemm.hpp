#pragma once
// Matrix multiply through oneDNN. Row-major. C[M,N] = op(A)[M,K] * op(B)[K,N] (+ C if accumulate).
// A and B are both f32 or both bf16 (then the products accumulate in f32; on CPUs with AMX or
// AVX512-BF16 oneDNN uses them). C is always f32.
//
// bf16 on every CPU: where oneDNN cannot build a bf16 matmul (oneDNN 2.6 has none below
// avx512_core, so on AVX2-only CPUs and under LOOM_CPU_ISA=avx2), the bf16 operands are widened
// to f32 in per-thread scratch buffers and the f32 matmul runs: bf16 inputs, f32 accumulation, the
// semantics of the native path (only the order of the f32 sums differs). The path is decided once
// per process (gemm_bf16_path() says which and why); LOOM_GEMM_BF16=widen forces the widening
// (tests), LOOM_GEMM_BF16=native makes a missing native matmul an error.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/dtype.hpp"

namespace loom::cpu {

enum class Trans : bool { N = false, T = true };

struct GemmArgs {
  Trans ta = Trans::N, tb = Trans::N;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;  // leading dimension of A as stored (row stride)
  const void* B = nullptr;
  int64_t ldb = 0;
  float* C = nullptr;
  int64_t ldc = 0;
  DType ab = DType::f32;
  bool accumulate = false;
  // Instead of C: the product rounded to bf16 (round to nearest even, as float_to_bf16), written
  // here with leading dimension ldc; not with accumulate. The rounded copy of an f32 GEMM output
  // without the f32 one: oneDNN rounds in its kernel, the widening path through a scratch chunk.
  bf16* C16 = nullptr;
  // C = R + op(A) op(B), R [M, N] f32 with leading dimension ldr (not with accumulate or C16; R
  // must not overlap C). R's rows are copied into C by the thread that then multiplies them, so a
  // residual branch's sum costs no pass of its own.
  const float* R = nullptr;
  int64_t ldr = 0;
};

void gemm(const GemmArgs& a);
// The checks of gemm's arguments (shapes, leading dimensions, the exclusive options, the
// pointers, a residual overlapping C): a loom::Error naming what is wrong. Every backend's GEMM
// runs them.
void check_gemm_args(const GemmArgs& a);

// The common linear-layer forms (W stored [out, in] as in Hugging Face):
//   y[M,N] (+)= x[M,K] * W[N,K]^T        linear_forward
//   dx[M,K] (+)= dy[M,N] * W[N,K]        linear_backward_input
//   dW[N,K] (+)= dy[M,N]^T * x[M,K]      linear_backward_weight (accumulates by default)
void linear_forward(const void* x, const void* w, float* y, int64_t M, int64_t N, int64_t K,
                    DType ab, bool accumulate = false);
void linear_backward_input(const void* dy, const void* w, float* dx, int64_t M, int64_t N,
                           int64_t K, DType ab, bool accumulate);
void linear_backward_weight(const void* dy, const void* x, float* dw, int64_t M, int64_t N,
                            int64_t K, DType ab, bool accumulate = true);
// y[M,N] = r[M,N] + x[M,K] * W[N,K]^T (GemmArgs::R): a residual branch's output projection.
void linear_forward_residual(const void* x, const void* w, const float* r, float* y, int64_t M,
                             int64_t N, int64_t K, DType ab);
// y[M,N] = bf16(x[M,K] * W[N,K]^T): linear_forward rounded to bf16 (GemmArgs::C16).
void linear_forward_rounded(const void* x, const void* w, bf16* y, int64_t M, int64_t N, int64_t K,
                            DType ab);

// B reordered once into the blocked layout oneDNN's matmul picks for a shape, for a product that
// repeats with the same B and new A (the loss's row chunks). A plain call reorders B into that
// layout on every call, which for 64 rows of A against the head's weight costs about a fifth of
// the product. The packed copy comes from the device allocator (booked like any workspace) and
// lives as long as the PackedB.
class PackedB {
 public:
  struct Impl;
  PackedB() = default;
  // False where packing does not apply (the product is widened to f32, rounded to bf16 from an
  // f32 product, or empty): gemm_packed then runs the plain GEMM on the original B.
  explicit operator bool() const { return impl_ != nullptr; }
  size_t bytes() const;

 private:
  std::shared_ptr<const Impl> impl_;
  friend PackedB pack_b(const GemmArgs& a);
  friend void gemm_packed(const GemmArgs& a, const PackedB& b);
};
// Packs a.B for products of a's shape (a.M: the rows most of the repeated calls have; A and C are
// not read).
PackedB pack_b(const GemmArgs& a);
// gemm(a) with its B read from `b`, packed from this a.B for the same N, K and dtype. a.B must
// stay valid: a call whose M gets another layout from oneDNN (a short last chunk may) runs the
// plain GEMM on it. The products are those of gemm(a); the order of their sums may differ.
void gemm_packed(const GemmArgs& a, const PackedB& b);
// How many blocks of rows of C gemm(a) runs as, one single-threaded matmul per OpenMP thread
// (gemm.cpp says when and why); 1: one matmul on oneDNN's threads. Each element of C is one
// matmul's dot product either way. The widening path's f32 matmuls split the same way (a chunk of
// fewer rows than M, past kGemmWidenChunkBytes, into fewer blocks).
int gemm_parts(const GemmArgs& a);
// The bytes pack_b(a) takes (the layout oneDNN picks may pad), 0 where it would not pack.
size_t packed_b_bytes(const GemmArgs& a);
// linear_forward's W packed for x of M rows (its bytes), and linear_forward with it.
PackedB pack_linear_forward(const void* w, int64_t M, int64_t N, int64_t K, DType ab);
size_t packed_linear_forward_bytes(int64_t M, int64_t N, int64_t K, DType ab);
void linear_forward(const void* x, const void* w, const PackedB& packed, float* y, int64_t M,
                    int64_t N, int64_t K, DType ab);

// Measures this machine's GEMM throughput (FLOP/s) for the dtype on square-ish transformer shapes;
// the denominator of MFU in `loom bench`.
double measure_gemm_peak(DType ab, double seconds = 0.5);

// True when bf16 GEMMs run as oneDNN bf16 matmuls, false when they are widened to f32.
bool gemm_bf16_native();
// One line saying how bf16 GEMMs run and why, e.g. "native (oneDNN avx512_core_bf16)" or
// "widened to f32 (oneDNN avx2 has no bf16 matmul)".
std::string gemm_bf16_path();
// Bytes of f32 scratch the widening path holds, summed over threads (0 when it never ran). Each
// thread keeps at most two buffers of kGemmWidenChunkBytes: larger operands are widened and
// multiplied in row/column chunks.
size_t gemm_widen_scratch_bytes();
inline constexpr size_t kGemmWidenChunkBytes = size_t(32) << 20;

// Tests: widens every bf16 GEMM of the process while alive, in chunks of at most `chunk_bytes`
// per operand (not thread-safe; the path is process-wide), so the widened result can be compared
// with the native one and the chunking exercised on small shapes.
class ScopedGemmBf16Widen {
 public:
  explicit ScopedGemmBf16Widen(size_t chunk_bytes = kGemmWidenChunkBytes);
  ~ScopedGemmBf16Widen();
  ScopedGemmBf16Widen(const ScopedGemmBf16Widen&) = delete;
  ScopedGemmBf16Widen& operator=(const ScopedGemmBf16Widen&) = delete;

 private:
  bool prev_;
  size_t prev_chunk_;
};

}  // namespace loom::cpu
