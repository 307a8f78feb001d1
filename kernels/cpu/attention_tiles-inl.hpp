// Tile primitives of the flash attention kernels (attention_block.cpp, which also serves causal
// attention for attention.cpp): register transposes, the "score" and "accumulate" micro-kernels,
// per-thread scratch and the head-dim dispatch. Internal; compiled once per Highway target (the
// vector width kW and the register budget differ), included after vec_math-inl.hpp.

// Highway's per-target include guard: the body is compiled once for every target.
#if defined(LOOM_KERNELS_CPU_ATTENTION_TILES_INL_) == defined(HWY_TARGET_TOGGLE)
#ifdef LOOM_KERNELS_CPU_ATTENTION_TILES_INL_
#undef LOOM_KERNELS_CPU_ATTENTION_TILES_INL_
#else
#define LOOM_KERNELS_CPU_ATTENTION_TILES_INL_
#endif

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE::tiles {

// Vector registers of the target: 32 with AVX-512, 16 otherwise. The micro-kernels size their
// blocks of accumulators to fit.
constexpr int kRegs = kW == 16 ? 32 : 16;

inline vf vmax(vf a, vf b) {
  return a > b ? a : b;
}
// Loads a vector that several FMAs reuse. Without the empty asm GCC folds the load into every
// FMA as a memory operand, so the kernels below would issue R loads per vector instead of one
// and become load-bound.
inline vf load_reg(const float* p) {
  vf x = load(p);
#if HWY_TARGET != HWY_SCALAR
  asm("" : "+x"(x));
#endif
  return x;
}

// Sum of a[i]*b[i], vectorized (a plain loop would be summed in order, one add at a time).
inline float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc += load(a + i) * load(b + i);
  float sum = 0;
  for (int l = 0; l < kW; ++l) sum += acc[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// kW x kW transpose in registers: stage K swaps bit K of the row index with bit K of the column
// index, one two-source shuffle per row.
constexpr int transpose_index(int k, bool upper, int c) {
  const bool hi = (c >> k) & 1;
  return upper ? (hi ? kW + c : c + (1 << k)) : (hi ? kW + c - (1 << k) : c);
}
template <int K, bool Upper, int... C>
constexpr vi transpose_mask(std::integer_sequence<int, C...>) {
  return vi{transpose_index(K, Upper, C)...};
}
template <int K>
inline void transpose_stage(vf* x) {
  constexpr vi lo = transpose_mask<K, false>(std::make_integer_sequence<int, kW>());
  constexpr vi hi = transpose_mask<K, true>(std::make_integer_sequence<int, kW>());
  for (int r = 0; r < kW; ++r) {
    if ((r >> K) & 1) continue;
    const vf a = x[r], b = x[r + (1 << K)];
    x[r] = __builtin_shuffle(a, b, lo);
    x[r + (1 << K)] = __builtin_shuffle(a, b, hi);
  }
}

// dst[c*ldd + r] = src[r*lds + c] * mul for r < rows, c < cols; columns [rows, rpad) of dst are
// zero (rpad a multiple of 16).
inline void transpose_tile(const float* src, int64_t lds, int64_t rows, int64_t rpad, int64_t cols,
                           float* dst, int64_t ldd, float mul) {
  for (int64_t r0 = 0; r0 < rpad; r0 += kW) {
    int64_t c0 = 0;
    for (; c0 + kW <= cols; c0 += kW) {
      vf x[kW];
      for (int i = 0; i < kW; ++i)
        x[i] = r0 + i < rows ? load(src + (r0 + i) * lds + c0) * mul : vf{};
      transpose_stage<0>(x);
      transpose_stage<1>(x);
      if constexpr (kW >= 8) transpose_stage<2>(x);
      if constexpr (kW >= 16) transpose_stage<3>(x);
      for (int i = 0; i < kW; ++i) store(dst + (c0 + i) * ldd + r0, x[i]);
    }
    for (; c0 < cols; ++c0)
      for (int64_t i = 0; i < kW; ++i)
        dst[c0 * ldd + r0 + i] = r0 + i < rows ? src[(r0 + i) * lds + c0] * mul : 0.0f;
  }
}

// Query and key tile sizes. The score kernels take up to kMaxNV vectors of a tile row at a time.
constexpr int64_t kBq = 64, kBk = 64;
constexpr int kMaxNV = kRegs == 32 ? 4 : 2;
static_assert(kBq % kW == 0 && kBk % kW == 0 && kW <= 16);

// ---- "score" products: C[r][16v + c] = sum_d A[r*lda + d] * BT[d*ldb + 16v + c] -------------
// Rows of A are read as scalars (broadcast), BT is a transposed tile whose rows are vectors; the
// reduction runs over the head dim, whatever it is.
struct Score {
  const float* A;
  int64_t lda;
  const float* BT;
  int64_t ldb;
  float* C;
  int64_t ldc;
  int64_t D;
};

template <int R, int NV>
inline void score_kernel(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t D,
                         float* C, int64_t ldc) {
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_reg(BT + d * ldb + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = A[r * lda + d];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kW, acc[r][v]);
}

template <int R>
inline void score_block(const Score& s, int64_t r, int64_t v0, int64_t v1) {
  const float* A = s.A + r * s.lda;
  for (; v0 < v1; v0 += kMaxNV) {
    const float* BT = s.BT + v0 * kW;
    float* C = s.C + r * s.ldc + v0 * kW;
    switch (std::min<int64_t>(v1 - v0, kMaxNV)) {
      case 1:
        score_kernel<R, 1>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
        break;
      case 2:
        score_kernel<R, 2>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
        break;
      case 3:
        if constexpr (kMaxNV >= 3) score_kernel<R, 3>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
        break;
      case 4:
        if constexpr (kMaxNV >= 4) score_kernel<R, 4>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
        break;
      default:
        break;
    }
  }
}

// Rows [0, rows) in blocks of 4; vrange(r0, r1) gives the vectors [v0, v1) that rows r0..r1-1
// need (the causal mask lets the kernel skip the rest).
template <class VRange>
void scores(const Score& s, int64_t rows, VRange vrange) {
  constexpr int R = 4;
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    const auto [v0, v1] = vrange(r, r + R);
    if (v0 < v1) score_block<R>(s, r, v0, v1);
  }
  for (; r < rows; ++r) {
    const auto [v0, v1] = vrange(r, r + 1);
    if (v0 < v1) score_block<1>(s, r, v0, v1);
  }
}

// ---- "accumulate" products: C[r][:D] += sum_k A[r*sr + k*sk] * B[k*ldb + :D] ----------------
// The coefficient is broadcast from any layout (sr, sk), rows of B and C are vectors over the
// head dim. ND = D/16 selects the unrolled kernel; ND = 0 is the generic path for other D.
struct Accum {
  const float* A;
  int64_t sr, sk;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  int64_t D;
  const float* row_scale = nullptr;  // if set, C[r] *= row_scale[r] first (online softmax)
};

template <int R, int ND>
inline void accum_kernel(const float* A, int64_t sr, int64_t sk, const float* B, int64_t ldb,
                         int64_t lo, int64_t hi, float* C, int64_t ldc, const float* row_scale) {
  vf acc[R][ND];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float rs = row_scale ? row_scale[r] : 1.0f;
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) acc[r][v] = load(C + r * ldc + v * kW) * rs;
  }
  for (int64_t k = lo; k < hi; ++k) {
    vf b[ND];
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) b[v] = load_reg(B + k * ldb + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = A[r * sr + k * sk];
#pragma GCC unroll 8
      for (int v = 0; v < ND; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) store(C + r * ldc + v * kW, acc[r][v]);
}

inline void accum_generic(const Accum& a, int64_t r, int64_t lo, int64_t hi) {
  float* c = a.C + r * a.ldc;
  if (a.row_scale)
    for (int64_t d = 0; d < a.D; ++d) c[d] *= a.row_scale[r];
  for (int64_t k = lo; k < hi; ++k) {
    const float coef = a.A[r * a.sr + k * a.sk];
    const float* b = a.B + k * a.ldb;
    for (int64_t d = 0; d < a.D; ++d) c[d] += coef * b[d];
  }
}

// Vectors of a row of C that one accum_kernel call keeps in registers: the largest divisor of ND
// that fits the target's register budget.
constexpr int column_chunk(int nd) {
  const int max = kRegs == 32 ? 8 : 4;
  for (int c = max; c > 1; --c)
    if (nd % c == 0) return c;
  return 1;
}

// Rows [0, rows); krange(r0, r1) gives the reduction range [lo, hi) that rows r0..r1-1 need.
// Row blocks keep R*NC accumulators near 16..24 of the 32 vector registers (AVX-512), or 8 of 16.
template <int ND, class KRange>
void accumulate(const Accum& a, int64_t rows, KRange krange) {
  if constexpr (ND == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto [lo, hi] = krange(r, r + 1);
      accum_generic(a, r, lo, hi);
    }
  } else {
    constexpr int NC = column_chunk(ND);
    constexpr int R = kRegs == 32 ? (NC <= 3   ? 8
                                     : NC <= 6 ? 4
                                               : 2)
                                  : (NC <= 1   ? 8
                                     : NC <= 2 ? 4
                                               : 2);
    for (int c0 = 0; c0 < ND; c0 += NC) {
      const float* B = a.B + c0 * kW;
      float* C = a.C + c0 * kW;
      int64_t r = 0;
      for (; r + R <= rows; r += R) {
        const auto [lo, hi] = krange(r, r + R);
        if (lo < hi || a.row_scale)
          accum_kernel<R, NC>(a.A + r * a.sr, a.sr, a.sk, B, a.ldb, lo, hi, C + r * a.ldc, a.ldc,
                              a.row_scale ? a.row_scale + r : nullptr);
      }
      for (; r < rows; ++r) {
        const auto [lo, hi] = krange(r, r + 1);
        if (lo < hi || a.row_scale)
          accum_kernel<1, NC>(a.A + r * a.sr, a.sr, a.sk, B, a.ldb, lo, hi, C + r * a.ldc, a.ldc,
                              a.row_scale ? a.row_scale + r : nullptr);
      }
    }
  }
}

// Per-thread scratch, allocated once per call and 64-byte aligned.
struct alignas(64) Line {
  float f[16];
};
class Scratch {
 public:
  explicit Scratch(int64_t floats) : buf_(std::make_unique<Line[]>((floats + 15) / 16)) {}
  float* take(int64_t floats) {  // consecutive pieces, each starting on a cache line
    float* p = buf_[used_].f;
    used_ += (floats + 15) / 16;
    return p;
  }

 private:
  std::unique_ptr<Line[]> buf_;
  int64_t used_ = 0;
};
inline int64_t lines(int64_t floats) {
  return (floats + 15) / 16 * 16;
}

template <template <int> class F, class... Args>
void dispatch_head_dim(int64_t D, Args&&... args) {
  switch (D % kW == 0 ? D / kW : 0) {
    case 1:
      F<1>::run(args...);
      break;
    case 2:
      F<2>::run(args...);
      break;
    case 3:
      F<3>::run(args...);
      break;
    case 4:
      F<4>::run(args...);
      break;
    case 5:
      F<5>::run(args...);
      break;
    case 6:
      F<6>::run(args...);
      break;
    case 7:
      F<7>::run(args...);
      break;
    case 8:
      F<8>::run(args...);
      break;
    case 12:
      F<12>::run(args...);
      break;
    case 16:
      F<16>::run(args...);
      break;
    default:
      F<0>::run(args...);
      break;
  }
}
}  // namespace loom::cpu::HWY_NAMESPACE::tiles
HWY_AFTER_NAMESPACE();

#pragma GCC diagnostic pop

#endif  // per-target include guard
