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

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels/cpu/attention_block.hpp"
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

// Whether the kernels copy the rows of K, V (and in the backward Q and dO) of a tile to
// consecutive memory before using them. The model's rows lie a stride apart that is a multiple
// of 4 KiB at Llama shapes (D 64 with 16 heads of q, k and v: 4 KiB), so every row of a tile
// falls in the same few sets of the L1 cache and the micro-kernels' loads miss it. Measured on
// Zen 4: packing gains 10-20% at D 64 on AVX2 and costs a few percent on AVX-512 (whose loads
// take whole cache lines), so only the narrower targets pack.
constexpr bool kPack = kW < 16;

// dst[r*ldd + c] = src[r*lds + c] for r < rows, c < D.
// Inline vector copies: a call to memcpy per row of 48 or 64 floats costs as much as the copy.
inline void copy_rows(const float* src, int64_t lds, int64_t rows, int64_t D, float* dst,
                      int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    float* d = dst + r * ldd;
    int64_t c = 0;
    for (; c + kW <= D; c += kW) store(d + c, load(s + c));
    for (; c < D; ++c) d[c] = s[c];
  }
}
// Rows of a tile copied to consecutive memory (dst[r*D + c]).
inline void pack_rows(const float* src, int64_t lds, int64_t rows, int64_t D, float* dst) {
  copy_rows(src, lds, rows, D, dst, D);
}

// Query and key tile sizes.
constexpr int64_t kBq = kAttentionTile, kBk = kAttentionTile;
static_assert(kBq % kW == 0 && kBk % kW == 0 && kW <= 16);

// Calls f.template operator()<N>(r) for row blocks [r, r + N) covering [0, rows): blocks of R
// first, then of 4 (when R > 4), then single rows. The micro-kernels keep R rows of accumulators
// in registers; the blocks of 4 keep the rows left over from R (64 = 10 * 6 + 4) from running
// one at a time.
template <int R, class F>
inline void row_blocks(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) f.template operator()<R>(r);
  if constexpr (R > 4)
    for (; r + 4 <= rows; r += 4) f.template operator()<4>(r);
  for (; r < rows; ++r) f.template operator()<1>(r);
}

// ---- "score" products: C[r][kW v + c] = sum_d A[r*lda + d] * BT[d*ldb + kW v + c] ----------
// Rows of A are read as scalars (broadcast), BT is a transposed tile whose rows are vectors; the
// reduction runs over the head dim, whatever it is.
// Blocking: kScoreR rows x kMaxNV vectors of accumulators, plus kMaxNV loaded vectors and one
// broadcast: 6 x 4 + 4 + 1 = 29 of the 32 registers of AVX-512 (4 x 4 was ~10% slower on Zen 4);
// 6 x 2 + 2 + 1 = 15 of the 16 of AVX2 (12 independent FMA chains cover the 2 pipes x 4 cycles of
// FMA latency; 4 x 2 did not).
constexpr int kScoreR = 6;
constexpr int kMaxNV = kRegs == 32 ? 4 : 2;
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

// Rows [0, rows) in blocks (row_blocks); vrange(r0, r1) gives the vectors [v0, v1) that rows
// r0..r1-1 need (the causal mask lets the kernel skip the rest).
template <class VRange>
void scores(const Score& s, int64_t rows, VRange vrange) {
  row_blocks<kScoreR>(rows, [&]<int R>(int64_t r) {
    const auto [v0, v1] = vrange(r, r + R);
    if (v0 < v1) score_block<R>(s, r, v0, v1);
  });
}

// ---- "accumulate" products: C[r][:D] += sum_k A[r*sr + k*sk] * B[k*ldb + :D] ----------------
// The coefficient is broadcast from any layout (sr, sk), rows of B and C are vectors over the
// head dim. ND = D/kW selects the unrolled kernel; ND = 0 is the generic path for other D.
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

// Blocking of accum_kernel: NC vectors of a row of C (a divisor of ND) times R rows of
// accumulators, plus NC loaded vectors and one broadcast. AVX-512: NC = 4 when it divides ND
// (D 64, 128: 4 x 6 = 24 accumulators of 32 registers; 4 x 4 and 8 x 2 were ~10% slower on Zen
// 4), else the largest divisor of ND up to 8 with R = 8, 6, 4 or 2. AVX2 and the baseline (16
// registers): 2 x 6 or 3 x 4, 12 accumulators (12 independent FMA chains cover the 2 pipes x 4
// cycles of FMA latency; the previous 4 x 2 and 3 x 2 did not), or 1 x 8 for odd ND.
constexpr int column_chunk(int nd) {
  if (kRegs == 32) {
    if (nd % 4 == 0) return 4;
    for (int c = 8; c > 1; --c)
      if (nd % c == 0) return c;
    return 1;
  }
  return nd % 2 == 0 ? 2 : nd % 3 == 0 ? 3 : 1;
}
constexpr int accum_rows(int nc) {
  if (kRegs == 32) return nc <= 3 ? 8 : nc <= 4 ? 6 : nc <= 6 ? 4 : 2;
  return nc == 1 ? 8 : nc == 2 ? 6 : 4;
}

// Rows [0, rows); krange(r0, r1) gives the reduction range [lo, hi) that rows r0..r1-1 need.
template <int ND, class KRange>
void accumulate(const Accum& a, int64_t rows, KRange krange) {
  if constexpr (ND == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto [lo, hi] = krange(r, r + 1);
      accum_generic(a, r, lo, hi);
    }
  } else {
    constexpr int NC = column_chunk(ND);
    for (int c0 = 0; c0 < ND; c0 += NC) {
      const float* B = a.B + c0 * kW;
      float* C = a.C + c0 * kW;
      row_blocks<accum_rows(NC)>(rows, [&]<int R>(int64_t r) {
        const auto [lo, hi] = krange(r, r + R);
        if (lo < hi || a.row_scale)
          accum_kernel<R, NC>(a.A + r * a.sr, a.sr, a.sk, B, a.ldb, lo, hi, C + r * a.ldc, a.ldc,
                              a.row_scale ? a.row_scale + r : nullptr);
      });
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
    case 32:  // D 128 on the baseline's 4 lanes (Llama's head dim)
      F<32>::run(args...);
      break;
    default:
      F<0>::run(args...);
      break;
  }
}
// ---- tile pairs of the block kernels (f32 and bf16) ----------------------------------------

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Positions of a block cut into tiles of `tile`: padded to whole tiles with `pad`, the range
// [lo, hi] of every tile's real positions, and whether they are a run of consecutive positions
// (every tile of plain causal attention, every tile inside one zigzag chunk).
struct Tiles {
  Tiles(const int64_t* pos, int64_t n, int64_t tile, int64_t pad)
      : count((n + tile - 1) / tile), padded(static_cast<size_t>(count * tile), pad) {
    std::copy_n(pos, n, padded.begin());
    for (int64_t t = 0; t < count; ++t) {
      const int64_t* first = pos + t * tile;
      const int64_t* last = pos + std::min(n, (t + 1) * tile);
      const auto [mn, mx] = std::minmax_element(first, last);
      lo.push_back(*mn);
      hi.push_back(*mx);
      bool consecutive = true;
      for (const int64_t* p = first + 1; p < last; ++p)
        consecutive = consecutive && *p == p[-1] + 1;
      run.push_back(consecutive);
    }
  }
  int64_t count;
  std::vector<int64_t> padded, lo, hi;
  std::vector<char> run;
};

// What a (query tile, key tile) pair computes: nothing when every key follows every query, the
// whole tile when every key precedes (or equals) every query, masked entries otherwise.
enum class Pair { none, all, masked };
inline Pair classify(const Tiles& qt, int64_t qi, const Tiles& kt, int64_t kj) {
  if (kt.lo[kj] > qt.hi[qi]) return Pair::none;
  return kt.hi[kj] <= qt.lo[qi] ? Pair::all : Pair::masked;
}

// Which entries of a pair of tiles (nq queries from q0, nk keys from k0) are visible. When both
// tiles are runs, key j is visible to query i iff j + off <= i (off = first key position - first
// query position), so the kernels skip whole vectors and rows past the diagonal, as plain causal
// attention does; otherwise (a tile straddling two zigzag chunks) each entry is selected by
// position.
struct PairMask {
  PairMask(const Tiles& qt, int64_t qi, const Tiles& kt, int64_t kj, int64_t nq, int64_t nk)
      : kind(classify(qt, qi, kt, kj)),
        diagonal(kind == Pair::masked && qt.run[qi] && kt.run[kj]),
        off(kt.padded[kj * kBk] - qt.padded[qi * kBq]),
        nq(nq),
        nk(nk) {}
  // Keys [0, key_limit(i)) hold every key query i may see.
  int64_t key_limit(int64_t i) const {
    return diagonal ? std::clamp<int64_t>(i - off + 1, 0, nk) : nk;
  }
  // Queries [first_query(j), nq) hold every query that may see key j.
  int64_t first_query(int64_t j) const {
    return diagonal ? std::clamp<int64_t>(j + off, 0, nq) : 0;
  }
  // Entries within those ranges still to be selected by position.
  bool by_position() const { return kind == Pair::masked && !diagonal; }

  Pair kind;
  bool diagonal;
  int64_t off, nq, nk;
};

// Tile indices ordered by decreasing number of partner tiles they work with (ties by index): the
// dynamic schedule then hands out the heaviest units first.
inline std::vector<int64_t> heaviest_first(const Tiles& a, const Tiles& b, bool a_is_query) {
  std::vector<int64_t> work(static_cast<size_t>(a.count), 0), order(work.size());
  for (int64_t i = 0; i < a.count; ++i)
    for (int64_t j = 0; j < b.count; ++j)
      work[i] += (a_is_query ? classify(a, i, b, j) : classify(b, j, a, i)) != Pair::none;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  return order;
}

inline void report_progress(const std::function<void()>* progress) {
  if (*progress && omp_get_thread_num() == 0) (*progress)();
}

// The forward's last step for a query tile: its output rows (stride out_stride), the
// unnormalized rows o (stride ldo) over their running sums l, and their log-sum-exps (natural
// log) from the running maxima m (base 2). A row that saw no key (l = 0; otherwise the max alone
// gives 1) gets out = 0 and lse = -inf, which attention_merge treats as no contribution. `put`
// turns each f32 output into the type of out (the bf16 kernels: bf16 bits, rounded).
struct AsIs {
  float operator()(float x) const { return x; }
};
template <class Out = float, class Put = AsIs>
inline void finish_query_tile(const float* o, int64_t ldo, const float* m, const float* l,
                              int64_t nq, int64_t D, Out* out, int64_t out_stride, float* lse,
                              Put put = {}) {
  for (int64_t i = 0; i < nq; ++i) {
    Out* orow = out + i * out_stride;
    if (l[i] == 0) {
      std::fill_n(orow, D, Out{});
      lse[i] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float inv = 1.0f / l[i];
    for (int64_t d = 0; d < D; ++d) orow[d] = put(o[i * ldo + d] * inv);
    lse[i] = (m[i] + std::log2(l[i])) * kLn2;
  }
}

// What the backward kernels of both dtypes share: sizes, strides, the tiles of the positions
// (padded: a padded query sees nothing, a padded key is seen by nobody), the scale of the scores in
// base-2 units, and the f32 arrays (lse, delta and dO in; dq, dk and dv out).
struct BackwardBase {
  BackwardBase(const BlockShape& s, const int64_t* q_pos, const int64_t* k_pos, const float* lse,
               const float* di, const float* dout, float* dq, float* dk, float* dv)
      : B(s.B),
        Tq(s.Tq),
        Tk(s.Tk),
        Hq(s.Hq),
        Hkv(s.Hkv),
        D(s.D),
        G(s.Hq / s.Hkv),
        qs(s.q_stride),
        kvs(s.kv_stride),
        os(s.Hq * s.D),
        overwrite(!s.accumulate),
        qtiles(q_pos, s.Tq, kBq, std::numeric_limits<int64_t>::min()),
        ktiles(k_pos, s.Tk, kBk, std::numeric_limits<int64_t>::max()),
        c(s.scale * kLog2e),
        scale(s.scale),
        lse(lse),
        di(di),
        dout(dout),
        dq(dq),
        dk(dk),
        dv(dv) {}

  // The first key tile (in the order both schemes walk them) that query tile qi sees; count if
  // none.
  int64_t first_key_tile(int64_t qi) const {
    int64_t kj = 0;
    while (kj < ktiles.count && classify(qtiles, qi, ktiles, kj) == Pair::none) ++kj;
    return kj;
  }

  const int64_t B, Tq, Tk, Hq, Hkv, D, G, qs, kvs, os;
  const bool overwrite;
  const Tiles qtiles, ktiles;
  const float c, scale;
  const float *lse, *di, *dout;
  float *dq, *dk, *dv;
};

// The tile walks of the flash backward (attention_block.cpp's Backward explains the schemes), for
// a Backward `bw` of either dtype. Per tile pair it calls bw's load_q_tile (Q and dO of a query
// tile), probs_and_grads (P and dS), add_dkdv and add_dq; per key tile load_kv_tile,
// start_key_tile and finish_key_tile (where dk and dv accumulate); per query tile of the split
// scheme start_query_tile (what dq starts from).

// dk/dv of key tile kj of (b, g), over the group's heads and every query tile that sees it, in
// order; with_dq also adds this key tile's contribution to dq (fused scheme).
template <class BW>
void backward_key_tile(const BW& bw, typename BW::Buffers& w, int64_t b, int64_t g, int64_t kj,
                       bool with_dq) {
  const int64_t k0 = kj * kBk, nk = std::min(kBk, bw.Tk - k0);
  bool any = false;
  for (int64_t qi = 0; qi < bw.qtiles.count; ++qi)
    any = any || classify(bw.qtiles, qi, bw.ktiles, kj) != Pair::none;
  if (!any) {
    if (bw.overwrite)
      for (int64_t j = 0; j < nk; ++j) {
        std::fill_n(bw.dk + (b * bw.Tk + k0 + j) * bw.kvs + g * bw.D, bw.D, 0.0f);
        std::fill_n(bw.dv + (b * bw.Tk + k0 + j) * bw.kvs + g * bw.D, bw.D, 0.0f);
      }
    return;
  }
  bw.load_kv_tile(w, b, g, k0, nk);
  bw.start_key_tile(w, b, g, kj);
  for (int64_t h = g * bw.G; h < (g + 1) * bw.G; ++h)
    for (int64_t qi = 0; qi < bw.qtiles.count; ++qi) {
      const int64_t q0 = qi * kBq, nq = std::min(kBq, bw.Tq - q0);
      const PairMask mask(bw.qtiles, qi, bw.ktiles, kj, nq, nk);
      if (mask.kind == Pair::none) continue;
      bw.load_q_tile(w, b, h, qi);
      bw.probs_and_grads(w, b, h, q0, k0, mask);
      bw.add_dkdv(w, h, qi, mask);
      if (with_dq) bw.add_dq(w, b, h, qi, kj, mask);
    }
  bw.finish_key_tile(w, b, g, kj);
}

// dq of query tile qi of head h (split scheme), from every key tile that it sees, in order.
template <class BW>
void backward_query_tile(const BW& bw, typename BW::Buffers& w, int64_t b, int64_t h, int64_t qi) {
  const int64_t q0 = qi * kBq, nq = std::min(kBq, bw.Tq - q0);
  bw.start_query_tile(b, h, qi);
  bw.load_q_tile(w, b, h, qi);
  for (int64_t kj = 0; kj < bw.ktiles.count; ++kj) {
    const int64_t k0 = kj * kBk, nk = std::min(kBk, bw.Tk - k0);
    const PairMask mask(bw.qtiles, qi, bw.ktiles, kj, nq, nk);
    if (mask.kind == Pair::none) continue;
    bw.load_kv_tile(w, b, h / bw.G, k0, nk);
    bw.probs_and_grads(w, b, h, q0, k0, mask);
    bw.add_dq(w, b, h, qi, kj, mask);
  }
}

// The flash backward's two thread schemes, for a Backward `bw` of either dtype whose per-thread
// Buffers are made from `buffers_arg`: the fused one, units (batch, kv group), when they keep at
// least 70% of the threads busy; otherwise the split one, units (batch, kv group, key tile) for
// dk/dv, then (batch, head, query tile) for dq.
template <class BW, class Arg>
void run_backward(const BW& bw, const BlockShape& s, const Arg& buffers_arg,
                  const std::function<void()>* progress) {
  const int64_t groups = s.B * s.Hkv, nkt = bw.ktiles.count, nqt = bw.qtiles.count;
  const int64_t threads = omp_get_max_threads();
  // Fraction of the threads that the fused scheme keeps busy with equal-sized units.
  const double busy = double(groups) / double(threads * ((groups + threads - 1) / threads));
  if (busy >= 0.7) {
#pragma omp parallel
    {
      typename BW::Buffers w(buffers_arg);
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < groups; ++u) {
        if (bw.overwrite) bw.zero_dq(u / s.Hkv, u % s.Hkv);
        for (int64_t kj = 0; kj < nkt; ++kj) {
          backward_key_tile(bw, w, u / s.Hkv, u % s.Hkv, kj, /*with_dq=*/true);
          report_progress(progress);
        }
      }
    }
    return;
  }
  const std::vector<int64_t> korder = heaviest_first(bw.ktiles, bw.qtiles, false);
  const std::vector<int64_t> qorder = heaviest_first(bw.qtiles, bw.ktiles, true);
#pragma omp parallel
  {
    typename BW::Buffers w(buffers_arg);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t u = 0; u < groups * nkt; ++u) {
      const int64_t bg = u % groups;
      backward_key_tile(bw, w, bg / s.Hkv, bg % s.Hkv, korder[u / groups], /*with_dq=*/false);
      report_progress(progress);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < s.B * s.Hq * nqt; ++u) {
      const int64_t bh = u % (s.B * s.Hq);
      backward_query_tile(bw, w, bh / s.Hq, bh % s.Hq, qorder[u / (s.B * s.Hq)]);
      report_progress(progress);
    }
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE::tiles
HWY_AFTER_NAMESPACE();

#pragma GCC diagnostic pop

#endif  // per-target include guard
