#include "kernels/cpu/attention_bf16.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include <omp.h>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_bf16.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/attention_tiles-inl.hpp"
#include "kernels/cpu/vec_math-inl.hpp"

// See vec_math-inl.hpp: the ABI note on vectors does not apply to functions internal to this file.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

using namespace tiles;

// ---- bf16 vectors ------------------------------------------------------------------------------
// A bf16 tile is handled as 16-bit words (natural layout: one element per word) or as 32-bit words
// holding a pair (low half: element 2p, high half: element 2p + 1), the operand layout of
// vdpbf16ps. vu, vh and vhu come from vec_math-inl.hpp.
typedef uint32_t vuu __attribute__((vector_size(kW * 4), aligned(4), may_alias));

inline vu loadu(const uint32_t* p) {
  return *reinterpret_cast<const vuu*>(p);
}
inline void storeu(uint32_t* p, vu x) {
  *reinterpret_cast<vuu*>(p) = x;
}
inline vh loadh(const uint16_t* p) {
  return *reinterpret_cast<const vhu*>(p);
}
inline void storeh(uint16_t* p, vh x) {
  *reinterpret_cast<vhu*>(p) = x;
}
// bf16 bits (round to nearest even) in the low half of each lane; inputs are finite.
inline vu round_bf16(vf x) {
  const vu u = __builtin_bit_cast(vu, x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
inline uint16_t round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline vf widen(vh x) {
  return __builtin_bit_cast(vf, __builtin_convertvector(x, vu) << 16);
}
inline float hmax(vf x) {
  float m = x[0];
  for (int l = 1; l < kW; ++l) m = std::max(m, x[l]);
  return m;
}

// 2^x for the probabilities (x <= 0 here; clamped to [-127, 127] as vexp2): 2^n times 2^f,
// |f| <= 1/2, by a degree-6 polynomial fitted to 2^f in relative error (1.9e-9; measured 1.7 ulp in
// f32 Horner), two FMAs fewer than vexp2's degree-7 Taylor polynomial of e^(f ln 2) (0.93 ulp):
// P is rounded to bf16 (2^-9) for its products, and its f32 sums keep f32 accuracy.
inline vf exp2_p(vf x) {
  vf scale;
  const vf f = exp2_split(x, scale);
  vf p = splat(1.534579115e-04f);
  p = p * f + 1.339992676e-03f;
  p = p * f + 9.618488988e-03f;
  p = p * f + 5.550328788e-02f;
  p = p * f + 2.402264689e-01f;
  p = p * f + 6.931472057e-01f;
  p = p * f + 1.000000001e+00f;
  return p * scale;
}

// Rounding to bf16 into the two layouts: pack_pairs gives the words (bf16(a[l]), bf16(b[l])), the
// pair layout; pack_rows stores bf16(a), bf16(b) as 2 kW consecutive elements. With AVX512_BF16
// one vcvtne2ps2bf16 rounds both (to nearest even, as round_bf16; it flushes denormals, which
// only the tiniest probabilities are). Inline asm: the instruction runs only where
// attention_bf16_native() holds, and the functions around it need no other target.
template <bool Native>
inline vu pack_pairs(vf a, vf b) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (Native) {
    typedef uint16_t v32h __attribute__((vector_size(64)));
    v32h r;  // bf16(a) in lanes 0..15, bf16(b) in 16..31
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(b), "v"(a));
    constexpr v32h interleave = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return __builtin_bit_cast(vu, __builtin_shuffle(r, interleave));
  }
#endif
  return round_bf16(a) | (round_bf16(b) << 16);
}
template <bool Native>
inline void pack_rows(uint16_t* dst, vf a, vf b) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (Native) {
    vu r;
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(b), "v"(a));
    storeu(reinterpret_cast<uint32_t*>(dst), r);
    return;
  }
#endif
  storeh(dst, __builtin_convertvector(round_bf16(a), vh));
  storeh(dst + kW, __builtin_convertvector(round_bf16(b), vh));
}

// ---- pair products ----------------------------------------------------------------------------
// C[r][kW v + c] (+)= sum_{p in [lo, hi)} a(r, p).lo * b(p, kW v + c).lo + a.hi * b.hi, with
// a(r, p) = A[r*sr + p*sp] and b(p, c) = B[p*ldb + c] pairs of bf16 (32-bit words), C f32: the
// reduction index of the product runs over 2p, 2p + 1. A word of A is broadcast, a vector of B
// words is a register. vdpbf16ps does one such step per vector; elsewhere it is emulated by two
// FMAs on the halves widened to f32 (each product of two bf16 is exact in f32; high half first,
// as Intel's vdpbf16ps).
#if HWY_TARGET == HWY_AVX3
constexpr bool kMayBeNative = true;  // the tier whose CPUs may have AVX512_BF16
#else
constexpr bool kMayBeNative = false;
#endif

// Vectors of C per kernel, and rows: vdpbf16ps takes its A word from memory (broadcast), so 6
// rows x 4 vectors + 4 vectors of B = 28 of 32 registers; the emulation needs two registers per
// vector of B and two broadcasts: 4 x 4 + 8 + 2 on AVX-512, 4 x 2 + 4 + 2 of the 16 otherwise.
constexpr int kPairNV = kRegs == 32 ? 4 : 2;
template <bool Native>
constexpr int pair_rows() {
  return Native ? 6 : 4;
}

#if HWY_TARGET == HWY_AVX3
// The vdpbf16ps kernel: compiled for AVX512_BF16 on top of this region's AVX-512 (called only
// where the CPU has it: attention_bf16_native()), so it is a function of its own that the
// callers, compiled without it, call per block of rows.
template <int R, int NV>
__attribute__((target("avx512bf16"))) void pair_kernel_native(const uint32_t* A, int64_t sr,
                                                              int64_t sp, const uint32_t* B,
                                                              int64_t ldb, int64_t lo, int64_t hi,
                                                              float* C, int64_t ldc, bool load_c,
                                                              const float* row_scale, float* Co,
                                                              int64_t ldo) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float rs = row_scale ? row_scale[r] : 1.0f;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = load_c ? _mm512_mul_ps(_mm512_loadu_ps(C + r * ldc + v * kW), _mm512_set1_ps(rs))
                         : _mm512_setzero_ps();
  }
  for (int64_t p = lo; p < hi; ++p) {
    const uint32_t* b = B + p * ldb;
    const uint32_t* a = A + p * sp;
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int32_t(a[r * sr]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(Co + r * ldo + v * kW, acc[r][v]);
}
#endif

// Accumulators start from C (load_c) or zero and end in Co (row stride ldo), which may be C.
template <bool Native, int R, int NV>
inline void pair_kernel(const uint32_t* A, int64_t sr, int64_t sp, const uint32_t* B, int64_t ldb,
                        int64_t lo, int64_t hi, float* C, int64_t ldc, bool load_c,
                        const float* row_scale, float* Co, int64_t ldo) {
#if HWY_TARGET == HWY_AVX3
  if constexpr (Native)
    return pair_kernel_native<R, NV>(A, sr, sp, B, ldb, lo, hi, C, ldc, load_c, row_scale, Co, ldo);
#endif
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float rs = row_scale ? row_scale[r] : 1.0f;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = load_c ? load(C + r * ldc + v * kW) * rs : vf{};
  }
  for (int64_t p = lo; p < hi; ++p) {
    const uint32_t* b = B + p * ldb;
    const uint32_t* a = A + p * sp;
    {
      vf bh[NV], bl[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const vu x = loadu(b + v * kW);
        bh[v] = __builtin_bit_cast(vf, x & 0xffff0000u);
        bl[v] = __builtin_bit_cast(vf, x << 16);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint32_t x = a[r * sr];
        const float ah = __builtin_bit_cast(float, x & 0xffff0000u);
        const float al = __builtin_bit_cast(float, x << 16);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          acc[r][v] += bh[v] * ah;
          acc[r][v] += bl[v] * al;
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(Co + r * ldo + v * kW, acc[r][v]);
}

struct PairProd {
  const uint32_t* A;
  int64_t sr, sp;
  const uint32_t* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  bool load_c = false;               // add to C (else overwrite it)
  const float* row_scale = nullptr;  // with load_c: C[r] *= row_scale[r] first (online softmax)
  float* Co = nullptr;               // if set, the results go there (row stride ldo), not to C
  int64_t ldo = 0;
};
// What rows [r0, r1) compute: pairs [lo, hi) of the reduction, vectors [v0, nv) of C.
struct PairRange {
  int64_t lo, hi, nv, v0 = 0;
};

// Rows [0, rows) in blocks; range(r0, r1) -> PairRange.
template <bool Native, class Range>
void pair_products(const PairProd& x, int64_t rows, Range range) {
  const auto block = [&]<int R>(int64_t r) {
    const PairRange pr = range(r, r + R);
    if (pr.lo >= pr.hi && x.load_c && !x.row_scale && !x.Co) return;
    for (int64_t v0 = pr.v0; v0 < pr.nv; v0 += kPairNV) {
      const auto run = [&]<int NV>() {
        float* C = x.C + r * x.ldc + v0 * kW;
        pair_kernel<Native, R, NV>(x.A + r * x.sr, x.sr, x.sp, x.B + v0 * kW, x.ldb, pr.lo, pr.hi,
                                   C, x.ldc, x.load_c, x.row_scale ? x.row_scale + r : nullptr,
                                   x.Co ? x.Co + r * x.ldo + v0 * kW : C, x.Co ? x.ldo : x.ldc);
      };
      switch (std::min<int64_t>(kPairNV, pr.nv - v0)) {
        case 1:
          run.template operator()<1>();
          break;
        case 2:
          run.template operator()<2>();
          break;
        case 3:
          if constexpr (kPairNV >= 3) run.template operator()<3>();
          break;
        case 4:
          if constexpr (kPairNV >= 4) run.template operator()<4>();
          break;
        default:
          break;
      }
    }
  };
  // vdpbf16ps with at most 3 vectors of C (D 48): 8 rows, 24 accumulators.
  if (Native && range(0, rows).nv <= 3)
    row_blocks<8>(rows, block);
  else
    row_blocks<pair_rows<Native>()>(rows, block);
}

// ---- packing -----------------------------------------------------------------------------------
// Head-dim widths of the packed tiles: Dn (natural rows, a multiple of 2 kW so that their words
// transpose in kW x kW blocks) and Dc (columns of outputs and of the pair-interleaved rows, a
// multiple of kW); both zero-padded past D.
struct Widths {
  explicit Widths(int64_t D)
      : D(D),
        Dn((D + 2 * kW - 1) / (2 * kW) * 2 * kW),
        Dc((D + kW - 1) / kW * kW),
        D2((D + 1) / 2) {}
  int64_t D, Dn, Dc, D2;  // D2: pairs of the reduction over the head dim
};

// dst[r*ldd + c] = src[r*lds + c] for r < rows, c < D; zero for c in [D, ldd) and rows in
// [rows, rpad).
// Inline vector copies, as the f32 kernels' pack_rows: a call to memcpy and memset per row of 48
// or 64 elements costs about as much as the copy.
inline void copy_rows(const uint16_t* src, int64_t lds, int64_t rows, int64_t D, uint16_t* dst,
                      int64_t ldd, int64_t rpad) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = src + r * lds;
    uint16_t* d = dst + r * ldd;
    int64_t c = 0;
    for (; c + kW <= D; c += kW) storeh(d + c, loadh(s + c));
    for (; c < D; ++c) d[c] = s[c];
    for (; c < ldd; ++c) d[c] = 0;
  }
  if (rpad > rows) std::memset(dst + rows * ldd, 0, size_t((rpad - rows) * ldd) * 2);
}
// The f32 rows (dk, dv accumulators) as the f32 kernels copy them.
using tiles::copy_rows;
// The same from f32, rounded to bf16.
inline void round_rows(const float* src, int64_t lds, int64_t rows, int64_t D, uint16_t* dst,
                       int64_t ldd, int64_t rpad) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    uint16_t* d = dst + r * ldd;
    int64_t c = 0;
    for (; c + kW <= D; c += kW)
      storeh(d + c, __builtin_convertvector(round_bf16(load(s + c)), vh));
    for (; c < D; ++c) d[c] = round_bf16(s[c]);
    std::memset(d + D, 0, size_t(ldd - D) * 2);
  }
  if (rpad > rows) std::memset(dst + rows * ldd, 0, size_t((rpad - rows) * ldd) * 2);
}
// dst[p*ldd + c] = (src[2p][c], src[2p+1][c]) for p < rpad/2, c < cols (a multiple of kW), rows
// past `rows` zero: rows of a natural tile (row stride lds) in pairs, the B operand of a reduction
// over its rows.
inline void interleave_rows(const uint16_t* src, int64_t lds, int64_t rows, int64_t rpad,
                            int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t p = 0; p < rpad / 2; ++p)
    for (int64_t c = 0; c < cols; c += kW) {
      const vu a = 2 * p < rows ? __builtin_convertvector(loadh(src + 2 * p * lds + c), vu) : vu{};
      const vu b =
          2 * p + 1 < rows ? __builtin_convertvector(loadh(src + (2 * p + 1) * lds + c), vu) : vu{};
      storeu(dst + p * ldd + c, a | (b << 16));
    }
}
// dst[c*ldd + r] = src[r*lds + c] for r < rpad, c < cols (both multiples of kW), 32-bit words,
// rows past `rows` zero: a natural tile's pairs along its rows become rows of pairs, the B operand
// of a reduction over its columns. (Moves of bits only: the words are not floats.)
inline void transpose_words(const uint32_t* src, int64_t lds, int64_t rows, int64_t rpad,
                            int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t r0 = 0; r0 < rpad; r0 += kW)
    for (int64_t c0 = 0; c0 < cols; c0 += kW) {
      vf x[kW];
      for (int i = 0; i < kW; ++i)
        x[i] =
            r0 + i < rows ? load(reinterpret_cast<const float*>(src + (r0 + i) * lds + c0)) : vf{};
      transpose_stage<0>(x);
      transpose_stage<1>(x);
      if constexpr (kW >= 8) transpose_stage<2>(x);
      if constexpr (kW >= 16) transpose_stage<3>(x);
      for (int i = 0; i < kW; ++i) store(reinterpret_cast<float*>(dst + (c0 + i) * ldd + r0), x[i]);
    }
}

inline const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}
inline const uint32_t* words(const uint16_t* p) {
  return reinterpret_cast<const uint32_t*>(p);
}
inline uint32_t* words(uint16_t* p) {
  return reinterpret_cast<uint32_t*>(p);
}

// Per-thread scratch in 32-bit words (Scratch holds floats; every piece starts on a cache line).
struct Words {
  explicit Words(Scratch& s, int64_t n) : w(reinterpret_cast<uint32_t*>(s.take(n))) {}
  uint32_t* w;
  uint16_t* h() const { return reinterpret_cast<uint16_t*>(w); }
};

// ---- forward -----------------------------------------------------------------------------------
// Per tile pair, as the f32 kernel: S^T = K Q^T with keys as rows (A: K rows, B: Q^T in pairs over
// the head dim, packed once per query tile), so the online softmax runs down the columns,
// vectorized over queries; P is rounded into pairs over keys, [kBk/2][kBq] words, which is the A
// operand of O += P V (B: V in pairs over keys, packed once per tile pair).
template <bool Native>
void forward_impl(const BlockShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                  const int64_t* q_pos, const int64_t* k_pos, float* out, uint16_t* out16,
                  float* lse, const std::function<void()>* progress) {
  const int64_t Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, D = s.D, G = s.Hq / s.Hkv;
  const int64_t qs = s.q_stride, kvs = s.kv_stride;
  const Widths wd(D);
  const int64_t Dn = wd.Dn, Dc = wd.Dc;
  // Rows are read in place where whole words (and, for the packing, whole vectors) of them lie
  // inside the row: K as pairs over d (D even), Q and V as vectors.
  const bool even = D % 2 == 0 && qs % 2 == 0 && kvs % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(k) % 4 == 0;
  const bool k_direct = even, q_direct = even && D == Dn, v_direct = D == Dc;
  const Tiles qtiles(q_pos, Tq, kBq, std::numeric_limits<int64_t>::min());
  const Tiles ktiles(k_pos, Tk, kBk, std::numeric_limits<int64_t>::max());
  const int64_t nqt = qtiles.count, nkt = ktiles.count;
  const std::vector<int64_t> order = heaviest_first(qtiles, ktiles, true);
  const int64_t units = s.B * Hq * nqt;
  // Scores in base-2 units: S times scale*log2(e) (in f32, after the bf16 product).
  const float c = s.scale * kLog2e;
#pragma omp parallel
  {
    Scratch scratch(lines(kBq * Dn / 2) + lines(Dn / 2 * kBq) + 2 * lines(kBk * Dn / 2) +
                    lines(kBk / 2 * Dc) + lines(kBk * kBq) + lines(kBk / 2 * kBq) +
                    lines(kBq * Dc) + 3 * lines(kBq));
    const Words qn(scratch, kBq * Dn / 2);   // Q rows, natural bf16 [kBq][Dn] (if not in place)
    const Words qd(scratch, Dn / 2 * kBq);   // Q^T in pairs over d, [Dn/2][kBq] words
    const Words kn(scratch, kBk * Dn / 2);   // K rows, natural (if not in place)
    const Words vn(scratch, kBk * Dn / 2);   // V rows, natural (if not in place)
    const Words vk(scratch, kBk / 2 * Dc);   // V in pairs over keys, [kBk/2][Dc] words
    float* st = scratch.take(kBk * kBq);     // S^T of the tile pair, [kBk][kBq]
    const Words pk(scratch, kBk / 2 * kBq);  // P rounded, in pairs over keys, [kBk/2][kBq] words
    float* o = scratch.take(kBq * Dc);       // unnormalized output rows, [kBq][Dc]
    float* m = scratch.take(kBq);            // running max (base 2)
    float* l = scratch.take(kBq);            // running sum
    float* alpha = scratch.take(kBq);        // rescale factor of the current key tile
    const int64_t vtile_w = kBk / 2 * Dc;
    const bool vcache_ok = nkt * vtile_w * 4 <= (int64_t(8) << 20);
    std::vector<uint32_t> vcache;  // V of every key tile in pairs over keys (vcache_ok)
    std::vector<int64_t> vstamp;   // the (batch, kv group) each cached tile was packed for
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qi = order[u % nqt];
      const int64_t b = u / nqt / Hq, h = u / nqt % Hq, g = h / G;
      const int64_t q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
      const int64_t nvq = (nq + kW - 1) / kW;
      const int64_t* qp = qtiles.padded.data() + q0;
      const uint16_t* qrows = q + (b * Tq + q0) * qs + h * D;
      int64_t qld = qs;
      if (!q_direct) {
        copy_rows(qrows, qs, nq, D, qn.h(), Dn, kBq);
        qrows = qn.h(), qld = Dn;
      }
      transpose_words(words(qrows), qld / 2, nq, kBq, Dn / 2, qd.w, kBq);
      std::fill(m, m + kBq, kNegInf);
      std::fill(l, l + kBq, 0.0f);
      bool first = true;
      for (int64_t kj = 0; kj < nkt; ++kj) {
        const int64_t k0 = kj * kBk, nk = std::min(kBk, Tk - k0);
        const PairMask mask(qtiles, qi, ktiles, kj, nq, nk);
        if (mask.kind == Pair::none) continue;
        const uint16_t* krows = k + (b * Tk + k0) * kvs + g * D;
        const uint16_t* vrows = v + (b * Tk + k0) * kvs + g * D;
        int64_t kld = kvs, vld = kvs;
        if (!k_direct) {
          copy_rows(krows, kvs, nk, D, kn.h(), Dn, kBk);
          krows = kn.h(), kld = Dn;
        }
        // V in pairs over keys: packed once per (batch, kv group) and key tile into the thread's
        // cache where that takes at most 8 MiB (the units of a thread mostly share their batch
        // and head, and the heads of a group their V), else per tile pair.
        const uint32_t* vpk = vk.w;
        bool packed = false;
        if (vcache_ok) {
          if (vcache.empty()) {
            vcache.resize(size_t(nkt * vtile_w));
            vstamp.assign(size_t(nkt), -1);
          }
          uint32_t* slot = vcache.data() + kj * vtile_w;
          vpk = slot;
          packed = vstamp[size_t(kj)] == b * s.Hkv + g;
          vstamp[size_t(kj)] = b * s.Hkv + g;
        }
        if (!packed) {
          if (!v_direct) {
            copy_rows(vrows, kvs, nk, D, vn.h(), Dn, kBk);
            vrows = vn.h(), vld = Dn;
          }
          interleave_rows(vrows, vld, nk, kBk, Dc, const_cast<uint32_t*>(vpk), Dc);
        }
        // S^T = K Q^T: rows are keys; row block [r0, r1) needs the queries from key r0's first.
        pair_products<Native>(PairProd{words(krows), kld / 2, 1, qd.w, kBq, st, kBq}, nk,
                              [&](int64_t r0, int64_t) {
                                return PairRange{0, wd.D2, nvq, mask.first_query(r0) / kW};
                              });
        // Masked entries get -inf, so that exp2 gives them exactly 0. On a diagonal pair, query
        // vector vq sees keys [0, key_end(vq)) only, and the softmax below reads no other rows
        // of its columns: row j is filled from the vector holding its first visible query.
        const auto key_end = [&](int64_t vq) {
          return mask.diagonal ? std::clamp<int64_t>((vq + 1) * kW - mask.off, 0, nk) : nk;
        };
        if (mask.diagonal) {
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t fq = std::min(mask.first_query(j), nvq * kW);
            for (int64_t i = fq / kW * kW; i < fq; ++i) st[j * kBq + i] = kNegInf;
          }
        } else if (mask.by_position()) {
          const int64_t* kp = ktiles.padded.data() + k0;
          for (int64_t j = 0; j < nk; ++j)
            for (int64_t i = 0; i < nvq * kW; ++i)
              if (kp[j] > qp[i]) st[j * kBq + i] = kNegInf;
        }
        // Online softmax, vectorized over kW queries at a time; P rounded into pairs of keys. A
        // query that has seen no key yet has a running max of -inf; subtracting 0 instead keeps
        // exp2's argument at -inf (giving 0) where -inf - -inf would give NaN. Keys past key_end
        // get P = 0 without an exp (the product of P V reads pairs up to its rows' key limit).
        for (int64_t vq = 0; vq < nvq; ++vq) {
          const float* col = st + vq * kW;
          const int64_t ke = key_end(vq);
          // Four running maxima, so that the comparisons do not chain all 64 rows.
          vf mx[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
          int64_t j = 0;
          for (; j + 4 <= ke; j += 4)
            for (int t = 0; t < 4; ++t) mx[t] = vmax(mx[t], load(col + (j + t) * kBq));
          for (; j < ke; ++j) mx[0] = vmax(mx[0], load(col + j * kBq));
          const vf mt = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
          const vf mo = load(m + vq * kW);
          const vf mn = vmax(mo, mt * c);
          const vf ms = mn == splat(kNegInf) ? vf{} : mn;
          const vf al = vexp2(mo - ms);
          // Two running sums (even and odd keys), so that the adds do not chain all 64 rows.
          vf sum0{}, sum1{};
          const int64_t even = ke & ~int64_t(1);
          for (j = 0; j < even; j += 2) {
            const vf p0 = exp2_p(load(col + j * kBq) * c - ms);
            const vf p1 = exp2_p(load(col + (j + 1) * kBq) * c - ms);
            sum0 += p0;
            sum1 += p1;
            storeu(pk.w + j / 2 * kBq + vq * kW, pack_pairs<Native>(p0, p1));
          }
          if (even < ke) {
            const vf p0 = exp2_p(load(col + even * kBq) * c - ms);
            sum0 += p0;
            storeu(pk.w + even / 2 * kBq + vq * kW, pack_pairs<Native>(p0, vf{}));
          }
          for (j = (ke + 1) / 2; j < (nk + 1) / 2; ++j) storeu(pk.w + j * kBq + vq * kW, vu{});
          store(l + vq * kW, load(l + vq * kW) * al + (sum0 + sum1));
          store(m + vq * kW, mn);
          store(alpha + vq * kW, al);
        }
        // O = alpha * O + P V (P rounded to bf16); before the first key tile O is zero.
        pair_products<Native>(
            PairProd{pk.w, 1, kBq, vpk, Dc, o, Dc, !first, first ? nullptr : alpha}, nq,
            [&](int64_t, int64_t r1) {
              return PairRange{0, (mask.key_limit(r1 - 1) + 1) / 2, Dc / kW};
            });
        first = false;
      }
      const int64_t at = ((b * Tq + q0) * Hq + h) * D;
      if (out16)  // rounded as ops::cast rounds the f32 output (the outputs are finite)
        finish_query_tile(o, Dc, m, l, nq, D, out16 + at, Hq * D, lse + (b * Hq + h) * Tq + q0,
                          [](float x) { return round_bf16(x); });
      else
        finish_query_tile(o, Dc, m, l, nq, D, out + at, Hq * D, lse + (b * Hq + h) * Tq + q0);
      report_progress(progress);
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------
// The f32 kernel's schemes (attention_block.cpp: fused units (batch, kv group), or the split
// dk/dv-then-dq scheme), so results are bit-identical for any number of threads. Per tile pair:
//   S = Q K^T      A: Q rows (natural)           B: K^T in pairs over d
//   dP = dO V^T    A: dO rows (natural, rounded) B: V^T in pairs over d
//   dV += P^T dO   A: P in pairs over queries    B: dO in pairs over queries
//   dK += dS^T Q   A: dS in pairs over queries   B: Q in pairs over queries
//   dQ += dS K     A: dS rows (natural)          B: K in pairs over keys
template <bool Native>
class Backward : public BackwardBase {
 public:
  Backward(const BlockShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
           const int64_t* q_pos, const int64_t* k_pos, const float* lse, const float* di,
           const float* dout, float* dq, float* dk, float* dv)
      : BackwardBase(s, q_pos, k_pos, lse, di, dout, dq, dk, dv), wd(s.D), q(q), k(k), v(v) {}

  struct Buffers {
    explicit Buffers(const Widths& w)
        : mem(2 * lines(kBq * w.Dn / 2) + 2 * lines(kBq / 2 * w.Dc) + 2 * lines(kBk * w.Dn / 2) +
              2 * lines(w.Dn / 2 * kBk) + lines(kBk / 2 * w.Dc) + 2 * lines(kBq * kBk) +
              2 * lines(kBq / 2 * kBk) + lines(kBq * kBk / 2) + 2 * lines(kBk * w.Dc) +
              lines(kBq * w.Dc)),
          qn_s(mem, kBq * w.Dn / 2),
          don_s(mem, kBq * w.Dn / 2),
          qk_s(mem, kBq / 2 * w.Dc),
          dok_s(mem, kBq / 2 * w.Dc),
          kn(mem, kBk * w.Dn / 2),
          vn(mem, kBk * w.Dn / 2),
          kd(mem, w.Dn / 2 * kBk),
          vd(mem, w.Dn / 2 * kBk),
          kk(mem, kBk / 2 * w.Dc),
          s(mem.take(kBq * kBk)),
          dp(mem.take(kBq * kBk)),
          pq(mem, kBq / 2 * kBk),
          dsq(mem, kBq / 2 * kBk),
          dsn(mem, kBq * kBk / 2),
          dkacc(mem.take(kBk * w.Dc)),
          dvacc(mem.take(kBk * w.Dc)),
          dqs(mem.take(kBq * w.Dc)) {}
    Scratch mem;
    Words qn_s, don_s;             // Q and dO (rounded) rows, natural bf16 [kBq][Dn]
    Words qk_s, dok_s;             // Q and dO in pairs over queries, [kBq/2][Dc] words
    std::vector<uint32_t> qcache;  // or all those of the unit's query tiles (load_q_tile)
    std::vector<int64_t> stamp;    // the unit each cached tile was packed for
    uint32_t *qn = nullptr, *don = nullptr, *qk = nullptr, *dok = nullptr;  // the tile in use
    Words kn, vn;          // K and V rows, natural [kBk][Dn]
    Words kd, vd;          // K^T and V^T in pairs over d, [Dn/2][kBk] words
    Words kk;              // K in pairs over keys, [kBk/2][Dc] words
    float *s, *dp;         // S then dP, [kBq][kBk] f32
    Words pq, dsq;         // P and dS * scale rounded, in pairs over queries, [kBq/2][kBk] words
    Words dsn;             // dS * scale rounded, natural [kBq][kBk]
    float *dkacc, *dvacc;  // [kBk][Dc]
    float* dqs;            // dq rows when D is not a multiple of kW, [kBq][Dc]
    // The key tile in work (start_key_tile): whether its next products write dk/dv rather than
    // add to them, the last query tile that sees it, its dk and dv rows, and whether the last
    // products store into those directly.
    bool first = false, direct = false;
    int64_t last_qi = 0;
    float *dk_rows = nullptr, *dv_rows = nullptr;
  };

  // The tile walks' steps (backward_key_tile, backward_query_tile in attention_tiles-inl.hpp).

  void start_key_tile(Buffers& w, int64_t b, int64_t g, int64_t kj) const {
    const int64_t k0 = kj * kBk, nk = std::min(kBk, Tk - k0);
    // dk and dv accumulate in dkacc, dvacc: from dk, dv, or (overwrite) from the first query
    // tile's products, written rather than added to zeros. Their columns past D and rows past nk
    // are never copied out, so they need no initial value.
    w.first = overwrite;
    if (!overwrite) {
      copy_rows(dk + (b * Tk + k0) * kvs + g * D, kvs, nk, D, w.dkacc, wd.Dc);
      copy_rows(dv + (b * Tk + k0) * kvs + g * D, kvs, nk, D, w.dvacc, wd.Dc);
    }
    // The last step's products store dk and dv straight into their rows (where they are whole
    // vectors: D == Dc), so that those stores, which miss the cache, spread over its row blocks
    // instead of coming in one burst of copies at the end (14% of the backward at D 48 with 2
    // threads was that burst).
    w.last_qi = 0;
    for (int64_t qi = 0; qi < qtiles.count; ++qi)
      if (classify(qtiles, qi, ktiles, kj) != Pair::none) w.last_qi = qi;
    w.dk_rows = dk + (b * Tk + k0) * kvs + g * D;
    w.dv_rows = dv + (b * Tk + k0) * kvs + g * D;
    w.direct = D == wd.Dc;
  }
  void finish_key_tile(Buffers& w, int64_t, int64_t, int64_t kj) const {
    if (w.direct) return;
    const int64_t nk = std::min(kBk, Tk - kj * kBk);
    copy_rows(w.dkacc, wd.Dc, nk, D, w.dk_rows, kvs);
    copy_rows(w.dvacc, wd.Dc, nk, D, w.dv_rows, kvs);
  }
  // dV += P^T dO, dK += dS^T Q of one tile pair.
  void add_dkdv(Buffers& w, int64_t h, int64_t qi, const PairMask& mask) const {
    const int64_t Dc = wd.Dc, nq = mask.nq;
    // Rows are keys: row block [r0, r1) is seen from key r0's first query on.
    const auto queries = [&](int64_t r0, int64_t) {
      return PairRange{mask.first_query(r0) / 2, (nq + 1) / 2, Dc / kW};
    };
    const bool last = w.direct && h % G == G - 1 && qi == w.last_qi;
    PairProd pv{w.pq.w, 1, kBk, w.dok, Dc, w.dvacc, Dc, !w.first};
    PairProd pk{w.dsq.w, 1, kBk, w.qk, Dc, w.dkacc, Dc, !w.first};
    if (last) {
      pv.Co = w.dv_rows, pv.ldo = kvs;
      pk.Co = w.dk_rows, pk.ldo = kvs;
    }
    pair_products<Native>(pv, mask.nk, queries);
    pair_products<Native>(pk, mask.nk, queries);
    w.first = false;
  }
  // dq is written at the query tile's first key tile (add_dq); only a tile that sees no key is
  // zeroed.
  void start_query_tile(int64_t b, int64_t h, int64_t qi) const {
    const int64_t q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
    if (overwrite && first_key_tile(qi) == ktiles.count)
      for (int64_t i = 0; i < nq; ++i) std::fill_n(dq + (b * Tq + q0 + i) * qs + h * D, D, 0.0f);
  }

  // Only the query tiles that no key tile reaches: add_dq writes the others' dq at their first key
  // tile instead of adding to zeros (zeroing all of dq up front, stores that miss the cache, was
  // 3-5% of the backward at D 48 in perf profiles).
  void zero_dq(int64_t b, int64_t g) const {
    for (int64_t qi = 0; qi < qtiles.count; ++qi)
      if (first_key_tile(qi) == ktiles.count)
        for (int64_t t = qi * kBq; t < std::min(Tq, (qi + 1) * kBq); ++t)
          std::fill_n(dq + (b * Tq + t) * qs + g * G * D, G * D, 0.0f);
  }

  const Widths wd;

  void load_kv_tile(Buffers& w, int64_t b, int64_t g, int64_t k0, int64_t nk) const {
    const int64_t Dn = wd.Dn;
    copy_rows(k + (b * Tk + k0) * kvs + g * D, kvs, nk, D, w.kn.h(), Dn, kBk);
    copy_rows(v + (b * Tk + k0) * kvs + g * D, kvs, nk, D, w.vn.h(), Dn, kBk);
    transpose_words(w.kn.w, Dn / 2, kBk, kBk, Dn / 2, w.kd.w, kBk);
    transpose_words(w.vn.w, Dn / 2, kBk, kBk, Dn / 2, w.vd.w, kBk);
    interleave_rows(w.kn.h(), Dn, kBk, kBk, wd.Dc, w.kk.w, wd.Dc);
  }
  // Q and dO of a query tile, packed (rows, rounded rows, pairs over queries): into the unit's
  // cache of all its query tiles, where that takes at most kQCacheBytes (the fused scheme walks
  // key tiles outermost and meets every query tile again under each), else per use.
  static constexpr int64_t kQCacheBytes = int64_t(8) << 20;
  void load_q_tile(Buffers& w, int64_t b, int64_t h, int64_t qi) const {
    const int64_t Dn = wd.Dn, Dc = wd.Dc, q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
    const int64_t rows_w = kBq * Dn / 2, pairs_w = kBq / 2 * Dc, tile_w = 2 * rows_w + 2 * pairs_w;
    const int64_t slots = G * qtiles.count;
    if (slots * tile_w * 4 <= kQCacheBytes) {
      if (w.qcache.empty()) {
        w.qcache.resize(size_t(slots * tile_w));
        w.stamp.assign(size_t(slots), -1);
      }
      const int64_t slot = (h % G) * qtiles.count + qi, id = b * Hkv + h / G;
      uint32_t* base = w.qcache.data() + slot * tile_w;
      w.qn = base, w.don = base + rows_w, w.qk = base + 2 * rows_w, w.dok = w.qk + pairs_w;
      if (w.stamp[size_t(slot)] == id) return;
      w.stamp[size_t(slot)] = id;
    } else {
      w.qn = w.qn_s.w, w.don = w.don_s.w, w.qk = w.qk_s.w, w.dok = w.dok_s.w;
    }
    uint16_t* qn = reinterpret_cast<uint16_t*>(w.qn);
    uint16_t* don = reinterpret_cast<uint16_t*>(w.don);
    copy_rows(q + (b * Tq + q0) * qs + h * D, qs, nq, D, qn, Dn, kBq);
    round_rows(dout + (b * Tq + q0) * os + h * D, os, nq, D, don, Dn, kBq);
    interleave_rows(qn, Dn, kBq, kBq, Dc, w.qk, Dc);
    interleave_rows(don, Dn, kBq, kBq, Dc, w.dok, Dc);
  }

  // P (exact zeros where masked, and on rows that see no key at all: lse = -inf) and dS * scale,
  // rounded to bf16, in the layouts above; zero past the tile's keys and queries.
  void probs_and_grads(Buffers& w, int64_t b, int64_t h, int64_t q0, int64_t k0,
                       const PairMask& mask) const {
    const int64_t nq = mask.nq;
    const auto key_vectors = [&](int64_t, int64_t r1) {
      return PairRange{0, wd.D2, (mask.key_limit(r1 - 1) + kW - 1) / kW};
    };
    pair_products<Native>(PairProd{w.qn, wd.Dn / 2, 1, w.kd.w, kBk, w.s, kBk}, nq, key_vectors);
    pair_products<Native>(PairProd{w.don, wd.Dn / 2, 1, w.vd.w, kBk, w.dp, kBk}, nq, key_vectors);
    if (mask.by_position()) {
      // Invisible entries get a score of -inf (P = 0, dS = 0): selects, not products.
      const int64_t* qp = qtiles.padded.data() + q0;
      const int64_t* kp = ktiles.padded.data() + k0;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < mask.nk; ++j)
          if (kp[j] > qp[i]) w.s[i * kBk + j] = kNegInf;
    }
    vi iota;
    for (int l = 0; l < kW; ++l) iota[l] = l;
    const float* lrow = lse + (b * Hq + h) * Tq + q0;
    const float* drow = di + (b * Hq + h) * Tq + q0;
    // Rows in pairs (i, i + 1): the pair-interleaved tiles take one word from each.
    constexpr int64_t NK = kBk / kW;
    static_assert(NK % 2 == 0);
    for (int64_t i = 0; i < kBq; i += 2) {
      int64_t lim[2], nv[2];
      float l2[2], dval[2];
      for (int half = 0; half < 2; ++half) {
        const int64_t r = i + half;
        lim[half] = r >= nq || lrow[r] == kNegInf ? 0 : mask.key_limit(r);
        nv[half] = (lim[half] + kW - 1) / kW;
        l2[half] = r < nq ? lrow[r] * kLog2e : 0.0f;
        dval[half] = r < nq ? drow[r] : 0.0f;
      }
      // Two vectors of keys of both rows at a time: what the three layouts take from them, so
      // that P and dS stay in registers (whole rows of them spilled to the stack).
      for (int64_t vk = 0; vk < NK; vk += 2) {
        vf p[2][2], ds[2][2];
        for (int half = 0; half < 2; ++half)
          for (int t = 0; t < 2; ++t) {
            const int64_t r = i + half, v = vk + t;
            p[half][t] = ds[half][t] = vf{};
            if (v >= nv[half]) continue;
            const vf pv = exp2_p(load(w.s + r * kBk + v * kW) * c - l2[half]);
            const vf dv = pv * (load(w.dp + r * kBk + v * kW) - dval[half]) * scale;
            if ((v + 1) * kW <= lim[half]) {
              p[half][t] = pv, ds[half][t] = dv;
            } else {
              const vi visible = iota + int32_t(v * kW) < int32_t(lim[half]);
              p[half][t] = visible ? pv : vf{};
              ds[half][t] = visible ? dv : vf{};
            }
          }
        for (int half = 0; half < 2; ++half)
          if (i + half < nq)
            pack_rows<Native>(w.dsn.h() + (i + half) * kBk + vk * kW, ds[half][0], ds[half][1]);
        for (int t = 0; t < 2; ++t) {
          storeu(w.pq.w + i / 2 * kBk + (vk + t) * kW, pack_pairs<Native>(p[0][t], p[1][t]));
          storeu(w.dsq.w + i / 2 * kBk + (vk + t) * kW, pack_pairs<Native>(ds[0][t], ds[1][t]));
        }
      }
    }
  }

  // dq[q0 + i] += sum_j dS[i][j] k[k0 + j], over the keys query i may see; = at the first key
  // tile query tile qi sees (overwrite).
  void add_dq(Buffers& w, int64_t b, int64_t h, int64_t qi, int64_t kj,
              const PairMask& mask) const {
    const int64_t Dc = wd.Dc, nq = mask.nq, q0 = qi * kBq;
    const bool first = overwrite && kj == first_key_tile(qi);
    float* rows = dq + (b * Tq + q0) * qs + h * D;
    float* C = rows;
    int64_t ldc = qs;
    if (Dc != D) {  // the kernels write whole vectors: through a padded copy
      for (int64_t i = 0; i < nq; ++i) {
        if (!first) std::copy_n(rows + i * qs, D, w.dqs + i * Dc);
        std::fill_n(w.dqs + i * Dc + D, Dc - D, 0.0f);
      }
      C = w.dqs, ldc = Dc;
    }
    // With load_c false every row is written, zeros where the row sees no key of the tile.
    pair_products<Native>(PairProd{w.dsn.w, kBk / 2, 1, w.kk.w, Dc, C, ldc, !first}, nq,
                          [&](int64_t, int64_t r1) {
                            return PairRange{0, (mask.key_limit(r1 - 1) + 1) / 2, Dc / kW};
                          });
    if (Dc != D)
      for (int64_t i = 0; i < nq; ++i) std::copy_n(w.dqs + i * Dc, D, rows + i * qs);
  }

 private:
  const uint16_t *q, *k, *v;
};

template <bool Native>
void backward_impl(const BlockShape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                   const int64_t* q_pos, const int64_t* k_pos, const float* lse, const float* delta,
                   const float* dout, float* dq, float* dk, float* dv,
                   const std::function<void()>* progress) {
  const Backward<Native> bw(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv);
  run_backward(bw, s, bw.wd, progress);
}

}  // namespace

void attention_bf16_forward_impl(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                 const int64_t* q_pos, const int64_t* k_pos, float* out,
                                 bf16* out16, float* lse, const std::function<void()>* progress,
                                 bool native) {
  uint16_t* o16 = reinterpret_cast<uint16_t*>(out16);
  if constexpr (kMayBeNative)
    if (native)
      return forward_impl<true>(s, bits(q), bits(k), bits(v), q_pos, k_pos, out, o16, lse,
                                progress);
  (void)native;
  forward_impl<false>(s, bits(q), bits(k), bits(v), q_pos, k_pos, out, o16, lse, progress);
}

void attention_bf16_backward_impl(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                  const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                                  const float* delta, const float* dout, float* dq, float* dk,
                                  float* dv, const std::function<void()>* progress, bool native) {
  if constexpr (kMayBeNative)
    if (native)
      return backward_impl<true>(s, bits(q), bits(k), bits(v), q_pos, k_pos, lse, delta, dout, dq,
                                 dk, dv, progress);
  (void)native;
  backward_impl<false>(s, bits(q), bits(k), bits(v), q_pos, k_pos, lse, delta, dout, dq, dk, dv,
                       progress);
}

void attention_bf16_delta_impl(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const bf16* out,
                               const float* dout, float* delta) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * Tq; ++bt) {
    const int64_t b = bt / Tq, t = bt % Tq;
    for (int64_t h = 0; h < Hq; ++h) {
      const uint16_t* o = bits(out) + (bt * Hq + h) * D;
      const float* g = dout + (bt * Hq + h) * D;
      vf acc{};
      int64_t d = 0;
      for (; d + kW <= D; d += kW)
        acc += widen(loadh(o + d)) * __builtin_bit_cast(vf, round_bf16(load(g + d)) << 16);
      float sum = reduce_add(acc);
      for (; d < D; ++d) sum += bf16_to_float(bf16{o[d]}) * bf16_to_float(bf16{round_bf16(g[d])});
      delta[(b * Hq + h) * Tq + t] = sum;
    }
  }
}

// Whether this tier's code can run vdpbf16ps (the avx512 tier; the CPU is asked separately).
bool attention_bf16_tier_native() {
  return kMayBeNative;
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check(const BlockShape& s, const char* who) {
  LOOM_CHECK(s.B > 0 && s.Tq > 0 && s.Tk > 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, who,
             ": B, Tq, Tk, Hq, Hkv, D must be positive, got B=", s.B, " Tq=", s.Tq, " Tk=", s.Tk,
             " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, who, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, who, ": q_stride ", s.q_stride, " < Hq*D = ", s.Hq * s.D);
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, who, ": kv_stride ", s.kv_stride,
             " < Hkv*D = ", s.Hkv * s.D);
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale must be finite and > 0, got ",
             s.scale);
}

BlockShape block_shape(const AttentionShape& s) {
  return {s.B, s.T, s.T, s.Hq, s.Hkv, s.D, s.q_stride, s.kv_stride, s.scale};
}
std::vector<int64_t> iota_positions(int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), int64_t(0));
  return pos;
}

}  // namespace

HWY_EXPORT(attention_bf16_forward_impl);
HWY_EXPORT(attention_bf16_backward_impl);
HWY_EXPORT(attention_bf16_delta_impl);
HWY_EXPORT(attention_bf16_tier_native);

bool attention_bf16_native() {
  return avx512_bf16_native() && LOOM_DISPATCH(attention_bf16_tier_native)();
}

void attention_block_forward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                  const int64_t* q_pos, const int64_t* k_pos, float* out,
                                  float* lse, const std::function<void()>& progress) {
  check(s, "attention_block_forward_bf16");
  LOOM_CHECK(q && k && v && q_pos && k_pos && out && lse,
             "attention_block_forward_bf16: null pointer among q, k, v, q_pos, k_pos, out, lse");
  if (progress) progress();  // as in attention_block_forward
  const bool native = attention_bf16_native();
  LOOM_DISPATCH(attention_bf16_forward_impl)
  (s, q, k, v, q_pos, k_pos, out, nullptr, lse, &progress, native);
}

void attention_block_backward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                   const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                                   const float* delta, const float* dout, float* dq, float* dk,
                                   float* dv, const std::function<void()>& progress) {
  check(s, "attention_block_backward_bf16");
  LOOM_CHECK(q && k && v && q_pos && k_pos && lse && delta && dout && dq && dk && dv,
             "attention_block_backward_bf16: null pointer among q, k, v, q_pos, k_pos, lse, "
             "delta, dout, dq, dk, dv");
  if (progress) progress();
  const bool native = attention_bf16_native();
  LOOM_DISPATCH(attention_bf16_backward_impl)
  (s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv, &progress, native);
}

void attention_delta_bf16(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const bf16* out,
                          const float* dout, float* delta) {
  LOOM_DISPATCH(attention_bf16_delta_impl)(B, Tq, Hq, D, out, dout, delta);
}

void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            float* out, float* lse) {
  const std::vector<int64_t> pos = iota_positions(std::max<int64_t>(s.T, 0));
  attention_block_forward_bf16(block_shape(s), q, k, v, pos.data(), pos.data(), out, lse);
}

void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            bf16* out, float* lse) {
  const BlockShape bs = block_shape(s);
  check(bs, "attention_forward_bf16");
  LOOM_CHECK(q && k && v && out && lse,
             "attention_forward_bf16: null pointer among q, k, v, out, lse");
  const std::vector<int64_t> pos = iota_positions(std::max<int64_t>(s.T, 0));
  const std::function<void()> no_progress;
  LOOM_DISPATCH(attention_bf16_forward_impl)
  (bs, q, k, v, pos.data(), pos.data(), nullptr, out, lse, &no_progress, attention_bf16_native());
}

void attention_backward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                             const bf16* out, const float* lse, const float* dout, float* dq,
                             float* dk, float* dv) {
  check(block_shape(s), "attention_backward_bf16");
  LOOM_CHECK(q && k && v && out && lse && dout && dq && dk && dv,
             "attention_backward_bf16: null pointer among q, k, v, out, lse, dout, dq, dk, dv");
  std::vector<float> delta(static_cast<size_t>(s.B * s.Hq * s.T));
  attention_delta_bf16(s.B, s.T, s.Hq, s.D, out, dout, delta.data());
  BlockShape bs = block_shape(s);
  bs.accumulate = false;
  const std::vector<int64_t> pos = iota_positions(s.T);
  attention_block_backward_bf16(bs, q, k, v, pos.data(), pos.data(), lse, delta.data(), dout, dq,
                                dk, dv);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
