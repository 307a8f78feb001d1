#include "kernels/cuda/rope.hpp"

#include <algorithm>
#include <climits>

#include "core/error.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// Threads of a token's block (one block per token row of B*T), looping over the row's work.
constexpr int kThreads = 256;

// One pair with the angle's sign Sign: the same operations in both kernels, written out (an FMA
// and a separately rounded product) so that nvcc cannot fuse them differently in the two, and
// rope_rounded has exactly the bits of rope_forward (rope_backward) followed by a cast.
template <int Sign>
__device__ __forceinline__ void rotate(float a, float b, float c, float s, float& o1, float& o2) {
  const float si = float(Sign) * s;
  o1 = fmaf(a, c, -__fmul_rn(b, si));
  o2 = fmaf(b, c, __fmul_rn(a, si));
}

// The table row of token bt's position, and whether it is inside the table (else row 0 is read,
// and the caller writes NaN instead of the rotation).
struct Angle {
  const float* cos;
  const float* sin;
  bool ok;
};
__device__ __forceinline__ Angle angle_of(int64_t bt, int64_t T, const int32_t* positions,
                                          const float* cos, const float* sin, int64_t half,
                                          int64_t num_positions) {
  const int64_t pos = positions[bt % T];
  const bool ok = pos >= 0 && pos < num_positions;
  const int64_t o = ok ? pos * half : 0;
  return {cos + o, sin + o, ok};
}

// Token bt = blockIdx.x: pairs (i, i + half) of its H heads, N consecutive pairs per step
// (N divides half). x is read and written in place by the thread that owns each pair.
template <int N, int Sign>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(float* x, int64_t T, int H, int half, int64_t row_stride,
                const int32_t* __restrict__ positions, const float* __restrict__ cos,
                const float* __restrict__ sin, int64_t num_positions) {
  const int64_t bt = blockIdx.x;
  const Angle a = angle_of(bt, T, positions, cos, sin, half, num_positions);
  float* row = x + bt * row_stride;
  const int per_head = half / N, items = H * per_head;
  for (int p = int(threadIdx.x); p < items; p += int(blockDim.x)) {
    const int h = p / per_head, i = (p - h * per_head) * N;
    float* x1 = row + int64_t(h) * 2 * half + i;
    float* x2 = x1 + half;
    float av[N], bv[N], cv[N], sv[N], o1[N], o2[N];
    load(x1, av);
    load(x2, bv);
    load(a.cos + i, cv);
    load(a.sin + i, sv);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      rotate<Sign>(av[k], bv[k], cv[k], sv[k], o1[k], o2[k]);
      if (!a.ok) o1[k] = o2[k] = __int_as_float(0x7fc00000);
    }
    store(x1, o1);
    store(x2, o2);
  }
}

// Token bt = blockIdx.x: work items [0, H*half/N) rotate N pairs each, the next Hc*D/N copy N
// elements each; every output rounded to bf16 (out holds bf16 bits).
template <int N, int Sign>
__global__ void __launch_bounds__(kThreads)
    rope_rounded_kernel(const float* __restrict__ x, int64_t T, int H, int Hc, int half,
                        int64_t x_stride, const int32_t* __restrict__ positions,
                        const float* __restrict__ cos, const float* __restrict__ sin,
                        int64_t num_positions, uint16_t* __restrict__ out, int64_t out_stride) {
  const int64_t bt = blockIdx.x;
  const Angle a = angle_of(bt, T, positions, cos, sin, half, num_positions);
  const float* row = x + bt * x_stride;
  uint16_t* orow = out + bt * out_stride;
  const int per_head = half / N, rotated = H * per_head;
  const int items = rotated + Hc * 2 * half / N;
  for (int p = int(threadIdx.x); p < items; p += int(blockDim.x)) {
    if (p < rotated) {
      const int h = p / per_head, i = (p - h * per_head) * N;
      const int64_t o = int64_t(h) * 2 * half + i;
      float av[N], bv[N], cv[N], sv[N], o1[N], o2[N];
      load(row + o, av);
      load(row + o + half, bv);
      load(a.cos + i, cv);
      load(a.sin + i, sv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        rotate<Sign>(av[k], bv[k], cv[k], sv[k], o1[k], o2[k]);
        if (!a.ok) o1[k] = o2[k] = __int_as_float(0x7fc00000);
      }
      store(orow + o, o1);
      store(orow + o + half, o2);
    } else {
      const int64_t o = int64_t(H) * 2 * half + int64_t(p - rotated) * N;
      float v[N];
      load(row + o, v);
      store(orow + o, v);
    }
  }
}

int threads_for(int64_t items) {
  return int(std::clamp<int64_t>((items + 31) / 32 * 32, 32, kThreads));
}

// The CPU's checks (kernels/cpu/rope.cpp) but the positions' values, which are on the device.
void check_args(const char* who, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                const int32_t* positions, const RopeDeviceTable& table) {
  LOOM_CHECK(B >= 0 && T >= 0 && H >= 0, who, ": B, T, H must be >= 0, got B=", B, " T=", T,
             " H=", H);
  LOOM_CHECK(D == table.head_dim, who, ": head dim ", D, " does not match the table's ",
             table.head_dim);
  LOOM_CHECK(D > 0 && D % 2 == 0, who, ": head dim must be even and > 0, got ", D);
  LOOM_CHECK(table.num_positions > 0 && table.cos && table.sin, who,
             ": the table is empty (num_positions ", table.num_positions, ")");
  LOOM_CHECK(row_stride >= H * D, who, ": row_stride (", row_stride, ") must be >= H*D (", H * D,
             ")");
  LOOM_CHECK(T == 0 || positions, who, ": positions is null");
  LOOM_CHECK(B * T <= INT_MAX && H * D <= INT_MAX, who, ": B*T = ", B * T, " tokens of ", H * D,
             " elements, more than one launch covers");
}

template <int N, int Sign>
void launch(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
            const int32_t* positions, const RopeDeviceTable& t, const char* op) {
  const int half = int(D / 2);
  rope_kernel<N, Sign><<<unsigned(B * T), threads_for(H * half / N), 0, stream()>>>(
      x, T, int(H), half, row_stride, positions, t.cos, t.sin, t.num_positions);
  check_launch(op);
}

// 16-byte accesses where every pair's vector is 16-byte aligned: an aligned base, a row stride
// and a half head that are multiples of 4 floats, and an aligned table.
template <int Sign>
void rotate_in_place(const char* op, float* x, int64_t B, int64_t T, int64_t H, int64_t D,
                     int64_t row_stride, const int32_t* positions, const RopeDeviceTable& t) {
  check_args(op, B, T, H, D, row_stride, positions, t);
  if (B * T == 0 || H == 0) return;
  if ((D / 2) % 4 == 0 && row_stride % 4 == 0 && aligned16(x) && aligned16(t.cos) &&
      aligned16(t.sin))
    launch<4, Sign>(x, B, T, H, D, row_stride, positions, t, op);
  else
    launch<1, Sign>(x, B, T, H, D, row_stride, positions, t, op);
}

template <int N, int Sign>
void launch_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                    int64_t x_stride, const int32_t* positions, const RopeDeviceTable& t,
                    uint16_t* out, int64_t out_stride, const char* op) {
  const int half = int(D / 2);
  rope_rounded_kernel<N, Sign>
      <<<unsigned(B * T), threads_for(H * half / N + Hc * D / N), 0, stream()>>>(
          x, T, int(H), int(Hc), half, x_stride, positions, t.cos, t.sin, t.num_positions, out,
          out_stride);
  check_launch(op);
}

// 8 pairs per step (16-byte loads and stores) where a half head is a multiple of 8, x and its
// stride are 16-byte aligned (4 floats) and out and its stride too (8 bf16); 4 pairs (16-byte
// loads, 8-byte stores) where a half head is a multiple of 4 and out is 8-byte aligned; one
// otherwise.
template <int Sign>
void rounded(const char* op, const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
             int64_t x_stride, const int32_t* positions, const RopeDeviceTable& t, uint16_t* out,
             int64_t out_stride) {
  const int64_t half = D / 2;
  const bool x_ok = x_stride % 4 == 0 && aligned16(x) && aligned16(t.cos) && aligned16(t.sin);
  if (x_ok && half % 8 == 0 && out_stride % 8 == 0 && aligned16(out))
    launch_rounded<8, Sign>(x, B, T, H, Hc, D, x_stride, positions, t, out, out_stride, op);
  else if (x_ok && half % 4 == 0 && out_stride % 4 == 0 &&
           (reinterpret_cast<uintptr_t>(out) & 7) == 0)
    launch_rounded<4, Sign>(x, B, T, H, Hc, D, x_stride, positions, t, out, out_stride, op);
  else
    launch_rounded<1, Sign>(x, B, T, H, Hc, D, x_stride, positions, t, out, out_stride, op);
}

}  // namespace

void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                  const int32_t* positions, const RopeDeviceTable& table) {
  rotate_in_place<1>("rope_forward", x, B, T, H, D, row_stride, positions, table);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   const int32_t* positions, const RopeDeviceTable& table) {
  rotate_in_place<-1>("rope_backward", dx, B, T, H, D, row_stride, positions, table);
}

void rope_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                  int64_t x_stride, const int32_t* positions, const RopeDeviceTable& table,
                  bool backward, bf16* out, int64_t out_stride) {
  const char* op = backward ? "rope_rounded (backward)" : "rope_rounded";
  LOOM_CHECK(Hc >= 0, op, ": Hc must be >= 0, got ", Hc);
  check_args(op, B, T, H + Hc, D, x_stride, positions, table);
  LOOM_CHECK(out_stride >= (H + Hc) * D, op, ": out_stride (", out_stride,
             ") must be >= (H+Hc)*D (", (H + Hc) * D, ")");
  if (B * T == 0 || H + Hc == 0) return;
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  if (backward)
    rounded<-1>(op, x, B, T, H, Hc, D, x_stride, positions, table, o, out_stride);
  else
    rounded<1>(op, x, B, T, H, Hc, D, x_stride, positions, table, o, out_stride);
}

}  // namespace loom::cuda
