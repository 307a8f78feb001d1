#pragma once
// The bodies of the flash attention kernels (kernels/cuda/flash_attention.hpp), written against
// the primitives of flash_primitives.cuh so that nvcc compiles them for the GPU
// (flash_attention.cu wraps each in a __global__) and g++ for the host emulation
// (tests/kernels/flash_emulation.hpp defines the primitives and LOOM_FLASH_FN first, then includes
// this file): the emulation test runs this very code on the CPU.
//
// FlashAttention-2's scheme on bf16 operands. A block owns 16 rows per warp of one side (W = 4
// warps: 64 rows, W = 8: 128 rows; the launch chooses, flash_attention.cu) and streams 64-row
// tiles of the other side; a larger block reads each streamed tile from memory for more rows
// (FlashAttention-2 takes 128 query rows), at more shared memory per block:
//   forward   a block per (query rows, sample, q head); each warp owns 16 query rows and streams
//             the key tiles (K, V double-buffered in shared memory by cp.async): S = Q K^T by
//             mma.sync, the online softmax in base 2, O += P V with P rounded to bf16 against the
//             running max (the CPU kernels' rounding), out = O * (1/l) and lse at the end.
//   backward  dK, dV: a block per (key rows, sample, kv head); each warp owns 16 keys and streams
//             the query tiles of every q head of its group (Q, dO double-buffered), in head order:
//             P^T = exp2(K Q^T c - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta) scale,
//             dV += P^T dO, dK += dS^T Q, accumulated in registers and written once.
//             dQ: a block per (query rows, sample, q head); each warp owns 16 query rows and
//             streams the key tiles: dQ += dS K. No atomics: every output element is written by
//             one thread, the sums run in a fixed order (deterministic).
// Tiles in shared memory are [rows][D] bf16 with the 16-byte chunks of row r XOR-swizzled by r % 8,
// so that the 8 row addresses of an ldmatrix (one chunk column) hit 8 different bank groups.
//
// Masking by positions (key j visible to query i iff k_pos[j] <= q_pos[i]; plain causal attention
// has no position arrays: positions 0..T-1): a tile pair is skipped when its earliest key follows
// its latest query, computed unmasked when its latest key precedes its earliest query (and the key
// tile is complete), and masked entry by entry otherwise (selected: a masked score never reaches
// exp2). The position ranges are kept per 64 rows; a block's own rows take the union of theirs.
// Rows past Tq and keys past Tk are zero-filled in shared memory and never written.
#include <cmath>
#include <cstdint>

namespace loom::flash {

constexpr int kTile = 64;  // rows of a streamed tile, and of a position range
// A block of W warps: its own rows (16 a warp) and its threads.
template <int W>
constexpr int kRows = 16 * W;
template <int W>
constexpr int kThreadsOf = 32 * W;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kNoPos = INT64_MIN;  // the position of a row past the end: sees no key

// The earliest and latest position of tile `tile` of n rows (rng: [lo, hi] pairs per tile computed
// by tile_range; null: positions 0..n-1).
struct Range {
  int64_t lo, hi;
};
LOOM_FLASH_FN Range tile_range_of(const int64_t* rng, int64_t n, int tile) {
  if (rng) return {rng[2 * tile], rng[2 * tile + 1]};
  const int64_t lo = int64_t(tile) * kTile;
  return {lo, (lo + kTile < n ? lo + kTile : n) - 1};
}
// rng[2*tile], rng[2*tile+1] = min and max of pos over the tile's rows (a pre-pass per call).
LOOM_FLASH_FN void tile_range(const int64_t* pos, int64_t n, int tile, int64_t* rng) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (int64_t i = int64_t(tile) * kTile; i < n && i < int64_t(tile + 1) * kTile; ++i) {
    lo = pos[i] < lo ? pos[i] : lo;
    hi = pos[i] > hi ? pos[i] : hi;
  }
  rng[2 * tile] = lo, rng[2 * tile + 1] = hi;
}
// The union of the ranges of 64-row tiles [first, first + count) of n rows: a block's own rows.
LOOM_FLASH_FN Range rows_range(const int64_t* rng, int64_t n, int first, int count) {
  const int tiles = int((n + kTile - 1) / kTile);
  const int end = first + count < tiles ? first + count : tiles;
  Range r = tile_range_of(rng, n, first);
  for (int t = first + 1; t < end; ++t) {
    const Range x = tile_range_of(rng, n, t);
    r.lo = x.lo < r.lo ? x.lo : r.lo;
    r.hi = x.hi > r.hi ? x.hi : r.hi;
  }
  return r;
}
LOOM_FLASH_FN int64_t position(const int64_t* pos, int64_t i) {
  return pos ? pos[i] : i;
}
// How a (query rows, key rows) pair is computed; k_complete: no key row lies past Tk.
enum class Pair { skip, full, masked };
LOOM_FLASH_FN Pair classify(Range q, Range k, bool k_complete) {
  if (k.lo > q.hi) return Pair::skip;
  if (k.hi <= q.lo && k_complete) return Pair::full;
  return Pair::masked;
}

// The element offset of (row, col) in a swizzled [rows][D] tile.
template <int D>
LOOM_FLASH_FN int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

// Rows [row0, row0+R) of a bf16 matrix (stride elements between rows) into a swizzled tile by
// 16-byte cp.async from T threads, rows at or past n zero-filled. Each thread issues R D/8/T
// copies, a row's chunks by consecutive threads (coalesced).
template <int D, int R, int T>
LOOM_FLASH_FN void load_tile(uint16_t* dst, const uint16_t* src, int64_t stride, int64_t row0,
                             int64_t n, int tid) {
  constexpr int kChunks = D / 8;
  LOOM_FLASH_UNROLL
  for (int c = tid; c < R * kChunks; c += T) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = row0 + r < n;
    cp_async16(dst + swz<D>(r, ch * 8), src + (ok ? row0 + r : row0) * stride + ch * 8, ok);
  }
}

// Key tile kt of K and V into buffer bf of the double-buffered sk, sv ([2][64][D] each), by T
// threads.
template <int D, int T>
LOOM_FLASH_FN void load_kv(uint16_t* sk, uint16_t* sv, int bf, const uint16_t* kb,
                           const uint16_t* vb, int64_t stride, int kt, int64_t Tk, int tid) {
  load_tile<D, kTile, T>(sk + bf * kTile * D, kb, stride, int64_t(kt) * kTile, Tk, tid);
  load_tile<D, kTile, T>(sv + bf * kTile * D, vb, stride, int64_t(kt) * kTile, Tk, tid);
}

// The A fragments (16 rows x 16 columns per step) of rows row0..row0+15 of a swizzled tile, for
// the D/16 steps along the row: lane l addresses row row0 + l%16, column 16 kk + 8 (l/16), so
// matrices 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15): mma's a0..a7 order.
template <int D>
LOOM_FLASH_FN void load_a(uint32_t (&a)[4], const uint16_t* tile, int row0, int kk, int lane) {
  ldmatrix_x4(a, tile + swz<D>(row0 + (lane & 15), kk * 16 + (lane >> 4) * 8));
}
// B fragments of two 8-column tiles when B[k][n] = tile[n][k] (n: rows n0..n0+15 of the tile, k:
// columns 16 kk..16 kk+15): b[0], b[1] for rows n0..n0+7, b[2], b[3] for rows n0+8..n0+15.
template <int D>
LOOM_FLASH_FN void load_b_rows(uint32_t (&b)[4], const uint16_t* tile, int n0, int kk, int lane) {
  ldmatrix_x4(b, tile + swz<D>(n0 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8));
}
// B fragments of two 8-column tiles when B[k][n] = tile[k][n] (k: rows k0..k0+15, n: columns
// n0..n0+15), by the transposing load: b[0], b[1] for columns n0..n0+7, b[2], b[3] for n0+8...
template <int D>
LOOM_FLASH_FN void load_b_cols(uint32_t (&b)[4], const uint16_t* tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b,
                    tile + swz<D>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
}

// Two 16x8 products sharing A: c0 += A B0, c1 += A B1 with b = {B0, B1} as load_b_* return them.
LOOM_FLASH_FN void mma_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                          const uint32_t (&b)[4]) {
  mma_bf16(c0, a, b[0], b[1]);
  mma_bf16(c1, a, b[2], b[3]);
}

// Two 16x8 f32 accumulator tiles (columns 0-7 and 8-15 of 16) rounded to bf16 as the A fragment
// of the next product: mma's C layout of two n-tiles is its A layout of one k-step.
LOOM_FLASH_FN void pack_a(const float (&c0)[4], const float (&c1)[4], uint32_t (&a)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// ---- forward -----------------------------------------------------------------------------------

struct FwdParams {
  const uint16_t *q, *k, *v;     // bf16 bits, strided views (attention.hpp)
  const int64_t *q_pos, *k_pos;  // null: plain causal
  const int64_t *q_rng, *k_rng;  // per tile [lo, hi] (null with null positions)
  float* out_f32;                // exactly one of out_f32 / out_bf16
  uint16_t* out_bf16;
  float* lse;
  int64_t Tq, Tk, Hq, Hkv, q_stride, kv_stride;
  float c;               // scale * log2(e)
  int q_tiles, k_tiles;  // 64-row tiles
};

// The next key tile from kt on that the query tile sees (k_tiles when none); P: FwdParams or
// BwdParams.
template <class P>
LOOM_FLASH_FN int next_key_tile(const P& p, Range qr, int kt) {
  for (; kt < p.k_tiles; ++kt)
    if (classify(qr, tile_range_of(p.k_rng, p.Tk, kt), int64_t(kt + 1) * kTile <= p.Tk) !=
        Pair::skip)
      break;
  return kt;
}

// The blocks of W warps that cover `tiles` 64-row tiles.
template <int W>
LOOM_FLASH_FN int blocks_of(int tiles) {
  return (tiles + kRows<W> / kTile - 1) / (kRows<W> / kTile);
}

// Shared memory of the forward: Q ([16 W][D]), then K[2], V[2] ([64][D] each), bf16.
template <int D, int W>
constexpr int fwd_smem_bytes() {
  return (kRows<W> + 4 * kTile) * D * 2;
}

// One block: bx counts query row blocks from the last (the longest rows under causal masking
// start first), by = b * Hq + h.
template <int D, int W>
LOOM_FLASH_FN void forward_block(const FwdParams& p, int bx, int by, int tid, char* smem) {
  constexpr int kNd = D / 8;  // 8-column tiles of the output
  constexpr int R = kRows<W>, T = kThreadsOf<W>;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int qt = blocks_of<W>(p.q_tiles) - 1 - bx;
  const int64_t b = by / p.Hq, h = by % p.Hq, hk = h / (p.Hq / p.Hkv);
  const int64_t q0 = int64_t(qt) * R;
  const uint16_t* qb = p.q + b * p.Tq * p.q_stride + h * D;
  const uint16_t* kb = p.k + b * p.Tk * p.kv_stride + hk * D;
  const uint16_t* vb = p.v + b * p.Tk * p.kv_stride + hk * D;
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sk = sq + R * D;          // [2][64][D]
  uint16_t* sv = sk + 2 * kTile * D;  // [2][64][D]
  const Range qr = rows_range(p.q_rng, p.Tq, qt * (R / kTile), R / kTile);

  int kt = next_key_tile(p, qr, 0);
  load_tile<D, R, T>(sq, qb, p.q_stride, q0, p.Tq, tid);
  if (kt < p.k_tiles) {
    load_kv<D, T>(sk, sv, 0, kb, vb, p.kv_stride, kt, p.Tk, tid);
  }
  cp_async_commit();

  // This thread's rows (mma's C layout): row0 + g (r = 0) and row0 + g + 8 (r = 1).
  const int row0 = warp * 16;
  int64_t qp[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t i = q0 + row0 + g + 8 * r;
    qp[r] = i < p.Tq ? position(p.q_pos, i) : kNoPos;
  }
  float o[kNd][4];
  for (int j = 0; j < kNd; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[D / 16][4];
  bool have_q = false;
  int buf = 0;
  while (kt < p.k_tiles) {
    const int nxt = next_key_tile(p, qr, kt + 1);
    if (nxt < p.k_tiles) {  // prefetch the next pair into the other buffer
      load_kv<D, T>(sk, sv, buf ^ 1, kb, vb, p.kv_stride, nxt, p.Tk, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group (and Q) landed, for this thread's copies
    block_sync();        // and for everyone's
    if (!have_q) {
      for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], sq, row0, kk, lane);
      have_q = true;
    }
    const uint16_t* ks = sk + buf * kTile * D;
    const uint16_t* vs = sv + buf * kTile * D;

    // S = Q K^T: 16 rows x 64 keys per warp, 8 tiles of 8 keys.
    float s[8][4];
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    LOOM_FLASH_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      LOOM_FLASH_UNROLL
      for (int nn = 0; nn < 4; ++nn) {
        uint32_t bf[4];
        load_b_rows<D>(bf, ks, nn * 16, kk, lane);
        mma_x2(s[2 * nn], s[2 * nn + 1], qf[kk], bf);
      }
    }

    // The online softmax of rows r (entries s[n][2r], s[n][2r+1]: keys 8n + 2 t4 + e).
    const int64_t k0 = int64_t(kt) * kTile;
    const bool masked =
        classify(qr, tile_range_of(p.k_rng, p.Tk, kt), k0 + kTile <= p.Tk) == Pair::masked;
    LOOM_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
      LOOM_FLASH_UNROLL
      for (int n = 0; n < 8; ++n) {
        LOOM_FLASH_UNROLL
        for (int e = 0; e < 2; ++e) {
          float x = mul_rn(s[n][2 * r + e], p.c);
          if (masked) {
            const int64_t j = k0 + 8 * n + 2 * t4 + e;
            if (j >= p.Tk || position(p.k_pos, j) > qp[r]) x = -INFINITY;
          }
          s[n][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, shfl_xor(mx, 1));  // the 4 lanes of a quad hold one row
      mx = fmaxf(mx, shfl_xor(mx, 2));
      const float mnew = fmaxf(m[r], mx);
      const float ms = mnew == -INFINITY ? 0.0f : mnew;  // nothing seen yet: no exp is taken
      const float alpha = exp2_(m[r] - ms);              // 0 while m was -inf
      m[r] = mnew;
      float sum = 0.0f;
      LOOM_FLASH_UNROLL
      for (int n = 0; n < 8; ++n) {
        LOOM_FLASH_UNROLL
        for (int e = 0; e < 2; ++e) {
          const float x = s[n][2 * r + e];
          const float pv = x == -INFINITY ? 0.0f : exp2_(x - ms);
          s[n][2 * r + e] = pv;
          sum += pv;
        }
      }
      l[r] = l[r] * alpha + sum;
      LOOM_FLASH_UNROLL
      for (int j = 0; j < kNd; ++j) o[j][2 * r] *= alpha, o[j][2 * r + 1] *= alpha;
    }

    // O += P V: P (bf16) from the S accumulators as A fragments, 16 keys per step.
    LOOM_FLASH_UNROLL
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[4];
      pack_a(s[2 * kk], s[2 * kk + 1], a);
      LOOM_FLASH_UNROLL
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        load_b_cols<D>(bf, vs, kk * 16, dn * 16, lane);
        mma_x2(o[2 * dn], o[2 * dn + 1], a, bf);
      }
    }
    block_sync();  // everyone is done with this buffer before the next prefetch overwrites it
    buf ^= 1;
    kt = nxt;
  }
  cp_async_wait<0>();  // no copy outlives the block (a query tile that sees no key)

  const int64_t os = p.Hq * D;
  LOOM_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    float lt = l[r];
    lt += shfl_xor(lt, 1);
    lt += shfl_xor(lt, 2);
    const int64_t i = q0 + row0 + g + 8 * r;
    if (i >= p.Tq) continue;
    const float inv = lt == 0.0f ? 0.0f : 1.0f / lt;
    const int64_t base = (b * p.Tq + i) * os + h * D + 2 * t4;
    LOOM_FLASH_UNROLL
    for (int j = 0; j < kNd; ++j) {
      const float v0 = o[j][2 * r] * inv, v1 = o[j][2 * r + 1] * inv;
      if (p.out_f32) {
        p.out_f32[base + 8 * j] = v0;
        p.out_f32[base + 8 * j + 1] = v1;
      } else {
        *reinterpret_cast<uint32_t*>(p.out_bf16 + base + 8 * j) = pack_bf16(v0, v1);
      }
    }
    if (t4 == 0)
      p.lse[(b * p.Hq + h) * p.Tq + i] = lt == 0.0f ? -INFINITY : (m[r] + log2_(lt)) * kLn2;
  }
}

// ---- backward ----------------------------------------------------------------------------------

struct BwdParams {
  const uint16_t *q, *k, *v;     // bf16 bits, strided views
  const uint16_t* dout;          // bf16(dout), [B*Tq, Hq*D]
  const int64_t *q_pos, *k_pos;  // null: plain causal
  const int64_t *q_rng, *k_rng;
  const float *lse, *delta;  // [B, Hq, Tq]
  float *dq, *dk, *dv;       // layouts of q, k, v
  int64_t Tq, Tk, Hq, Hkv, q_stride, kv_stride;
  float c, scale;
  bool accumulate;
  int q_tiles, k_tiles;  // 64-row tiles
};

// Shared memory of the dK/dV kernel: K, V ([16 W][D] each), Q[2], dO[2] ([64][D] each), bf16,
// then lse*log2(e) and delta of the query tiles ([2][64] f32 each). The dQ kernel: Q, dO
// ([16 W][D] each), K[2], V[2] ([64][D] each).
template <int D, int W>
constexpr int bwd_kv_smem_bytes() {
  return (2 * kRows<W> + 4 * kTile) * D * 2 + 4 * kTile * 4;
}
template <int D, int W>
constexpr int bwd_q_smem_bytes() {
  return (2 * kRows<W> + 4 * kTile) * D * 2;
}

// The i-th (head, query tile) pair from `from` on (i = hh * q_tiles + qt over the kv head's G q
// heads) that the key rows see; G * q_tiles when none.
LOOM_FLASH_FN int next_query_item(const BwdParams& p, Range kr, bool k_complete, int from,
                                  int items) {
  for (; from < items; ++from)
    if (classify(tile_range_of(p.q_rng, p.Tq, from % p.q_tiles), kr, k_complete) != Pair::skip)
      break;
  return from;
}

// Writes (or adds) a warp's 16-row f32 accumulator (mma's C layout: this thread's rows g and g + 8,
// columns 8n + 2 t4 + e) to rows row, row + 8 of dst (stride elements apart), skipping rows at or
// past n.
template <int D>
LOOM_FLASH_FN void put_rows(float* dst, int64_t stride, int64_t row, int64_t n,
                            const float (&acc)[D / 8][4], int t4, bool accumulate) {
  for (int r = 0; r < 2; ++r) {
    if (row + 8 * r >= n) continue;
    float* d = dst + (row + 8 * r) * stride + 2 * t4;
    for (int j = 0; j < D / 8; ++j)
      for (int e = 0; e < 2; ++e) {
        float* x = d + 8 * j + e;
        *x = accumulate ? *x + acc[j][2 * r + e] : acc[j][2 * r + e];
      }
  }
}

// dK, dV of one block of key rows: bx = the block, by = b * Hkv + kv head.
template <int D, int W>
LOOM_FLASH_FN void backward_kv_block(const BwdParams& p, int bx, int by, int tid, char* smem) {
  constexpr int kNd = D / 8;
  constexpr int R = kRows<W>, T = kThreadsOf<W>;
  // The warp's K and V fragments are read from shared memory per step (held in registers, they
  // make D = 64 spill).
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kt = bx;
  const int64_t G = p.Hq / p.Hkv, b = by / p.Hkv, hk = by % p.Hkv;
  const int64_t k0 = int64_t(kt) * R;
  const int64_t os = p.Hq * D;
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sv = sk + R * D;
  uint16_t* sq = sv + R * D;                                  // [2][64][D]
  uint16_t* sdo = sq + 2 * kTile * D;                         // [2][64][D]
  float* sl = reinterpret_cast<float*>(sdo + 2 * kTile * D);  // [2][64] lse * log2(e)
  float* sd = sl + 2 * kTile;                                 // [2][64] delta
  const Range kr = rows_range(p.k_rng, p.Tk, kt * (R / kTile), R / kTile);
  const bool k_complete = k0 + R <= p.Tk;
  const int items = int(G) * p.q_tiles;

  // Query tile `it` into buffer bf: Q and dO by cp.async, lse and delta by plain loads (rows past
  // Tq: lse -inf, i.e. no contribution).
  auto load_item = [&](int it, int bf) {
    const int64_t h = hk * G + it / p.q_tiles, q0 = int64_t(it % p.q_tiles) * kTile;
    load_tile<D, kTile, T>(sq + bf * kTile * D, p.q + b * p.Tq * p.q_stride + h * D, p.q_stride, q0,
                           p.Tq, tid);
    load_tile<D, kTile, T>(sdo + bf * kTile * D, p.dout + b * p.Tq * os + h * D, os, q0, p.Tq, tid);
    if (tid < kTile) {
      const int64_t i = q0 + tid;
      const float li = i < p.Tq ? p.lse[(b * p.Hq + h) * p.Tq + i] : -INFINITY;
      sl[bf * kTile + tid] = li == -INFINITY ? -INFINITY : li * kLog2e;
      sd[bf * kTile + tid] = i < p.Tq ? p.delta[(b * p.Hq + h) * p.Tq + i] : 0.0f;
    }
  };

  int it = next_query_item(p, kr, k_complete, 0, items);
  load_tile<D, R, T>(sk, p.k + b * p.Tk * p.kv_stride + hk * D, p.kv_stride, k0, p.Tk, tid);
  load_tile<D, R, T>(sv, p.v + b * p.Tk * p.kv_stride + hk * D, p.kv_stride, k0, p.Tk, tid);
  if (it < items) load_item(it, 0);
  cp_async_commit();

  const int row0 = warp * 16;  // this warp's keys
  int64_t kp[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t j = k0 + row0 + g + 8 * r;
    kp[r] = j < p.Tk ? position(p.k_pos, j) : INT64_MAX;
  }
  float dk[kNd][4], dv[kNd][4];
  for (int j = 0; j < kNd; ++j)
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.0f;
  int buf = 0;
  while (it < items) {
    const int nxt = next_query_item(p, kr, k_complete, it + 1, items);
    if (nxt < items) load_item(nxt, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    block_sync();
    const int64_t q0 = int64_t(it % p.q_tiles) * kTile;
    const bool masked =
        classify(tile_range_of(p.q_rng, p.Tq, it % p.q_tiles), kr, k_complete) == Pair::masked;
    const uint16_t* qs = sq + buf * kTile * D;
    const uint16_t* dos = sdo + buf * kTile * D;
    const float* ls = sl + buf * kTile;
    const float* ds = sd + buf * kTile;
    // 16 queries at a time: S^T, dP^T (16 keys x 16 queries per warp), then dV, dK.
    for (int qc = 0; qc < kTile; qc += 16) {
      float st[2][4], dpt[2][4];
      for (int n = 0; n < 2; ++n)
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
      LOOM_FLASH_UNROLL
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4], bf[4];
        load_a<D>(a, sk, row0, kk, lane);
        load_b_rows<D>(bf, qs, qc, kk, lane);
        mma_x2(st[0], st[1], a, bf);
        load_a<D>(a, sv, row0, kk, lane);
        load_b_rows<D>(bf, dos, qc, kk, lane);
        mma_x2(dpt[0], dpt[1], a, bf);
      }
      // P^T and dS^T (entries [n][2r+e]: key row0 + g + 8r, query qc + 8n + 2 t4 + e).
      LOOM_FLASH_UNROLL
      for (int n = 0; n < 2; ++n) {
        LOOM_FLASH_UNROLL
        for (int r = 0; r < 2; ++r) {
          LOOM_FLASH_UNROLL
          for (int e = 0; e < 2; ++e) {
            const int qi = qc + 8 * n + 2 * t4 + e;
            const float l2 = ls[qi];
            bool vis = l2 != -INFINITY;
            if (vis && masked) vis = kp[r] <= position(p.q_pos, q0 + qi);
            float pv = 0.0f, dsv = 0.0f;
            if (vis) {
              pv = exp2_(mul_rn(st[n][2 * r + e], p.c) - l2);
              dsv = mul_rn(mul_rn(pv, dpt[n][2 * r + e] - ds[qi]), p.scale);
            }
            st[n][2 * r + e] = pv;
            dpt[n][2 * r + e] = dsv;
          }
        }
      }
      uint32_t pa[4], sa[4];
      pack_a(st[0], st[1], pa);
      pack_a(dpt[0], dpt[1], sa);
      LOOM_FLASH_UNROLL
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        load_b_cols<D>(bf, dos, qc, dn * 16, lane);  // dV += P^T dO
        mma_x2(dv[2 * dn], dv[2 * dn + 1], pa, bf);
        load_b_cols<D>(bf, qs, qc, dn * 16, lane);  // dK += dS^T Q
        mma_x2(dk[2 * dn], dk[2 * dn + 1], sa, bf);
      }
    }
    block_sync();
    buf ^= 1;
    it = nxt;
  }
  cp_async_wait<0>();
  const int64_t kbase = b * p.Tk * p.kv_stride + hk * D;
  put_rows<D>(p.dk + kbase, p.kv_stride, k0 + row0 + g, p.Tk, dk, t4, p.accumulate);
  put_rows<D>(p.dv + kbase, p.kv_stride, k0 + row0 + g, p.Tk, dv, t4, p.accumulate);
}

// dQ of one block of query rows: bx counts them from the last, by = b * Hq + h.
template <int D, int W>
LOOM_FLASH_FN void backward_q_block(const BwdParams& p, int bx, int by, int tid, char* smem) {
  constexpr int kNd = D / 8;
  constexpr int R = kRows<W>, T = kThreadsOf<W>;
  constexpr bool kKeep = D <= 64;  // Q, dO fragments held in registers
  constexpr int kParts = D <= 64 ? 1 : 2, kKeys = kTile / kParts;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int qt = blocks_of<W>(p.q_tiles) - 1 - bx;
  const int64_t b = by / p.Hq, h = by % p.Hq, hk = h / (p.Hq / p.Hkv);
  const int64_t q0 = int64_t(qt) * R, os = p.Hq * D;
  const uint16_t* kb = p.k + b * p.Tk * p.kv_stride + hk * D;
  const uint16_t* vb = p.v + b * p.Tk * p.kv_stride + hk * D;
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdo = sq + R * D;
  uint16_t* sk = sdo + R * D;         // [2][64][D]
  uint16_t* sv = sk + 2 * kTile * D;  // [2][64][D]
  const Range qr = rows_range(p.q_rng, p.Tq, qt * (R / kTile), R / kTile);

  int kt = next_key_tile(p, qr, 0);
  load_tile<D, R, T>(sq, p.q + b * p.Tq * p.q_stride + h * D, p.q_stride, q0, p.Tq, tid);
  load_tile<D, R, T>(sdo, p.dout + b * p.Tq * os + h * D, os, q0, p.Tq, tid);
  if (kt < p.k_tiles) {
    load_kv<D, T>(sk, sv, 0, kb, vb, p.kv_stride, kt, p.Tk, tid);
  }
  cp_async_commit();

  const int row0 = warp * 16;
  int64_t qp[2];
  float l2[2], dl[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t i = q0 + row0 + g + 8 * r;
    const float li = i < p.Tq ? p.lse[(b * p.Hq + h) * p.Tq + i] : -INFINITY;
    qp[r] = i < p.Tq ? position(p.q_pos, i) : kNoPos;
    l2[r] = li == -INFINITY ? -INFINITY : li * kLog2e;
    dl[r] = i < p.Tq ? p.delta[(b * p.Hq + h) * p.Tq + i] : 0.0f;
  }
  float dq[kNd][4];
  for (int j = 0; j < kNd; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
  uint32_t qf[kKeep ? D / 16 : 1][4], of[kKeep ? D / 16 : 1][4];
  bool have_q = false;
  int buf = 0;
  while (kt < p.k_tiles) {
    const int nxt = next_key_tile(p, qr, kt + 1);
    if (nxt < p.k_tiles) {
      load_kv<D, T>(sk, sv, buf ^ 1, kb, vb, p.kv_stride, nxt, p.Tk, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    block_sync();
    if (kKeep && !have_q) {
      for (int kk = 0; kk < D / 16; ++kk) {
        load_a<D>(qf[kKeep ? kk : 0], sq, row0, kk, lane);
        load_a<D>(of[kKeep ? kk : 0], sdo, row0, kk, lane);
      }
      have_q = true;
    }
    const uint16_t* ks = sk + buf * kTile * D;
    const uint16_t* vs = sv + buf * kTile * D;
    const int64_t k0 = int64_t(kt) * kTile;
    const bool masked =
        classify(qr, tile_range_of(p.k_rng, p.Tk, kt), k0 + kTile <= p.Tk) == Pair::masked;
    // The key tile in kParts parts of kKeys keys (D = 128: two, so S, dP and dQ fit the registers).
    for (int part = 0; part < kParts; ++part) {
      const int kc = part * kKeys;
      // S = Q K^T and dP = dO V^T, 16 rows x kKeys keys per warp.
      float s[kKeys / 8][4], dp[kKeys / 8][4];
      for (int n = 0; n < kKeys / 8; ++n)
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
      LOOM_FLASH_UNROLL
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4], ao[4];
        if (kKeep) {
          for (int e = 0; e < 4; ++e) a[e] = qf[kKeep ? kk : 0][e], ao[e] = of[kKeep ? kk : 0][e];
        } else {
          load_a<D>(a, sq, row0, kk, lane);
          load_a<D>(ao, sdo, row0, kk, lane);
        }
        LOOM_FLASH_UNROLL
        for (int nn = 0; nn < kKeys / 16; ++nn) {
          uint32_t bf[4];
          load_b_rows<D>(bf, ks, kc + nn * 16, kk, lane);
          mma_x2(s[2 * nn], s[2 * nn + 1], a, bf);
          load_b_rows<D>(bf, vs, kc + nn * 16, kk, lane);
          mma_x2(dp[2 * nn], dp[2 * nn + 1], ao, bf);
        }
      }
      // dS (rounded to bf16 below), entries [n][2r+e]: row row0 + g + 8r, key kc + 8n + 2 t4 + e.
      LOOM_FLASH_UNROLL
      for (int n = 0; n < kKeys / 8; ++n) {
        LOOM_FLASH_UNROLL
        for (int r = 0; r < 2; ++r) {
          LOOM_FLASH_UNROLL
          for (int e = 0; e < 2; ++e) {
            bool vis = l2[r] != -INFINITY;
            if (vis && masked) {
              const int64_t j = k0 + kc + 8 * n + 2 * t4 + e;
              vis = j < p.Tk && position(p.k_pos, j) <= qp[r];
            }
            float dsv = 0.0f;
            if (vis) {
              const float pv = exp2_(mul_rn(s[n][2 * r + e], p.c) - l2[r]);
              dsv = mul_rn(mul_rn(pv, dp[n][2 * r + e] - dl[r]), p.scale);
            }
            s[n][2 * r + e] = dsv;
          }
        }
      }
      // dQ += dS K.
      LOOM_FLASH_UNROLL
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t a[4];
        pack_a(s[2 * kk], s[2 * kk + 1], a);
        LOOM_FLASH_UNROLL
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bf[4];
          load_b_cols<D>(bf, ks, kc + kk * 16, dn * 16, lane);
          mma_x2(dq[2 * dn], dq[2 * dn + 1], a, bf);
        }
      }
    }
    block_sync();
    buf ^= 1;
    kt = nxt;
  }
  cp_async_wait<0>();
  put_rows<D>(p.dq + b * p.Tq * p.q_stride + h * D, p.q_stride, q0 + row0 + g, p.Tq, dq, t4,
              p.accumulate);
}

}  // namespace loom::flash
