#include "kernels/cuda/embedding.hpp"

#include <algorithm>
#include <bit>
#include <climits>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// Threads of a block: N consecutive columns each.
constexpr int kThreads = 256;
// The most blocks of the accumulation: they take the runs of the sorted keys in turn (the run
// count stays on the device).
constexpr int64_t kRunBlocks = 2048;

// A bad token's record for the deferred check (runtime.hpp): its position in the high word, the
// token in the low one, so that the smallest kept (atomicMin) is the first bad position's. The
// word starts all ones (memset to 0xff bytes: above every record, as positions are < 2^31).
__device__ __forceinline__ void record_bad(unsigned long long* bad, int64_t i, int32_t token) {
  atomicMin(bad, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(token));
}

// Token i = blockIdx.x: its table row t = tokens[i] - v0 copied to out row i when t is in
// [0, vocab). Otherwise: zeros (kRange: another rank holds the row), or (!kRange) nothing written
// and the token recorded in *bad (record_bad), for the host to raise at its next wait.
template <int N, bool kRange>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const int32_t* __restrict__ tokens, const float* __restrict__ table,
                             int64_t v0, int64_t vocab, int64_t dim, float* __restrict__ out,
                             unsigned long long* __restrict__ bad) {
  const int64_t i = blockIdx.x;
  const int64_t t = int64_t(tokens[i]) - v0;
  float* o = out + i * dim;
  const int64_t first = int64_t(threadIdx.x) * N, step = int64_t(blockDim.x) * N;
  if (t < 0 || t >= vocab) {
    if constexpr (kRange) {
      float z[N];
#pragma unroll
      for (int k = 0; k < N; ++k) z[k] = 0.0f;
      for (int64_t j = first; j < dim; j += step) store(o + j, z);
    } else {
      if (threadIdx.x == 0) record_bad(bad, i, tokens[i]);
    }
    return;
  }
  const float* src = table + t * dim;
  for (int64_t j = first; j < dim; j += step) {
    float v[N];
    load(src + j, v);
    store(o + j, v);
  }
}

// The sort's input: key = the table row (tokens[i] - v0) where it is in [0, vocab), else `vocab`,
// which sorts after every row and is skipped; value = the position i. A key out of range is
// recorded in *bad (record_bad) when `strict`.
__global__ void __launch_bounds__(kThreads)
    embedding_keys_kernel(const int32_t* __restrict__ tokens, int64_t n, int64_t v0, int64_t vocab,
                          bool strict, uint32_t* __restrict__ keys, int32_t* __restrict__ pos,
                          unsigned long long* __restrict__ bad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t t = int64_t(tokens[i]) - v0;
  const bool in = t >= 0 && t < vocab;
  keys[i] = in ? uint32_t(t) : uint32_t(vocab);
  pos[i] = int32_t(i);
  if (!in && strict) record_bad(bad, i, tokens[i]);
}

// head[i] = 1 where a run of equal sorted keys starts (a distinct table row), else 0.
__global__ void __launch_bounds__(kThreads)
    embedding_heads_kernel(const uint32_t* __restrict__ keys, int64_t n,
                           int32_t* __restrict__ head) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  head[i] = i == 0 || keys[i] != keys[i - 1] ? 1 : 0;
}

// With idx the exclusive sum of head: run idx[i] starts at sorted position i where head[i], and
// holds table row keys[i]. The last position writes the run count to *runs and closes the last
// run (starts has n + 1 entries: run r is [starts[r], starts[r + 1])).
__global__ void __launch_bounds__(kThreads)
    embedding_runs_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ head,
                          const int32_t* __restrict__ idx, int64_t n,
                          uint32_t* __restrict__ row_of_run, int32_t* __restrict__ starts,
                          uint32_t* __restrict__ runs) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (head[i]) {
    row_of_run[idx[i]] = keys[i];
    starts[idx[i]] = int32_t(i);
  }
  if (i == n - 1) {
    const int32_t count = idx[i] + head[i];
    *runs = uint32_t(count);
    starts[count] = int32_t(n);
  }
}

// Runs r = blockIdx.x, blockIdx.x + gridDim.x, ... below *runs of the sorted keys (each one table
// row, its positions ascending) and the column slice blockIdx.y: the row's elements, plus that row
// of dout for every position in order, one addition at a time (the CPU's serial loop). Four rows'
// loads are issued before their additions, which keep their order. The run count is read here,
// on the device, so that the host never waits for it.
template <int N>
__global__ void __launch_bounds__(kThreads)
    embedding_accumulate_kernel(const uint32_t* __restrict__ row_of_run,
                                const int32_t* __restrict__ starts,
                                const int32_t* __restrict__ pos_sorted,
                                const uint32_t* __restrict__ runs, const float* __restrict__ dout,
                                int64_t dim, uint32_t skip, float* __restrict__ dtable) {
  const int64_t j = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (j >= dim) return;
  const uint32_t count = *runs;
  const float* src = dout + j;
  for (uint32_t r = blockIdx.x; r < count; r += gridDim.x) {
    const uint32_t key = row_of_run[r];
    if (key == skip) continue;
    const int32_t start = starts[r];
    const int32_t* p = pos_sorted + start;
    const int len = starts[r + 1] - start;
    float* row = dtable + int64_t(key) * dim + j;
    float acc[N];
    load(row, acc);
    int k = 0;
    for (; k + 4 <= len; k += 4) {
      float a[N], b[N], c[N], d[N];
      load(src + int64_t(p[k]) * dim, a);
      load(src + int64_t(p[k + 1]) * dim, b);
      load(src + int64_t(p[k + 2]) * dim, c);
      load(src + int64_t(p[k + 3]) * dim, d);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] = acc[e] + a[e] + b[e] + c[e] + d[e];
    }
    for (; k < len; ++k) {
      float a[N];
      load(src + int64_t(p[k]) * dim, a);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] += a[e];
    }
    store(row, acc);
  }
}

int threads_for(int64_t vectors) {
  return int(std::clamp<int64_t>((vectors + 31) / 32 * 32, 32, kThreads));
}

void check_args(const char* what, const int32_t* tokens, int64_t n, int64_t vocab, int64_t dim,
                bool range) {
  LOOM_CHECK(n >= 0, what, ": token count must be >= 0, got ", n);
  LOOM_CHECK(vocab >= (range ? 0 : 1) && vocab <= (int64_t{1} << 31), what,
             ": vocab size must be in [", range ? 0 : 1, ", 2^31], got ", vocab);
  LOOM_CHECK(dim > 0, what, ": embedding dim must be > 0, got ", dim);
  LOOM_CHECK(n <= INT_MAX, what, ": ", n, " tokens, more than one launch covers (", INT_MAX, ")");
  LOOM_CHECK(n == 0 || tokens, what, ": tokens is null");
}

// Queues the deferred check of a bad-token word (record_bad): raised at the host's next wait
// with the CPU's message.
void check_tokens_later(const char* what, const unsigned long long* bad, int64_t vocab) {
  defer_check(reinterpret_cast<const uint64_t*>(bad), [what, vocab](uint64_t word) {
    fail(what, ": token id ", int32_t(uint32_t(word)), " at position ", word >> 32,
         " is out of range [0, ", vocab, ") (vocab size ", vocab, ")");
  });
}

template <int N, bool kRange>
void launch_forward(const char* what, const int32_t* tokens, int64_t n, const float* table,
                    int64_t v0, int64_t vocab, int64_t dim, float* out, unsigned long long* bad) {
  embedding_forward_kernel<N, kRange><<<unsigned(n), threads_for((dim + N - 1) / N), 0, stream()>>>(
      tokens, table, v0, vocab, dim, out, bad);
  check_launch(what);
}

template <bool kRange>
void forward(const char* what, const int32_t* tokens, int64_t n, const float* table, int64_t v0,
             int64_t vocab, int64_t dim, float* out, unsigned long long* bad) {
  if (dim % 4 == 0 && aligned16(table) && aligned16(out))
    launch_forward<4, kRange>(what, tokens, n, table, v0, vocab, dim, out, bad);
  else
    launch_forward<1, kRange>(what, tokens, n, table, v0, vocab, dim, out, bad);
}

// At most kRunBlocks blocks per column slice, fewer where there are fewer positions (each run
// has at least one): the run count itself stays on the device.
template <int N>
void launch_accumulate(int64_t n, const uint32_t* runs, const uint32_t* row_of_run,
                       const int32_t* starts, const int32_t* pos_sorted, const float* dout,
                       int64_t dim, uint32_t skip, float* dtable, const char* what) {
  const int threads = threads_for((dim + N - 1) / N);
  const int64_t slices = ((dim + N - 1) / N + threads - 1) / threads;
  LOOM_CHECK(slices <= 65535, what, ": embedding dim ", dim, " is more than one launch covers");
  const unsigned blocks = unsigned(std::min(n, kRunBlocks));
  embedding_accumulate_kernel<N><<<dim3(blocks, unsigned(slices)), threads, 0, stream()>>>(
      row_of_run, starts, pos_sorted, runs, dout, dim, skip, dtable);
  check_launch(what);
}

// Both backward variants: keys (the row, or `vocab` for a token outside the range) sorted with
// their positions (stable: positions ascending within a row), the runs of equal keys found (a
// flag per run head, its exclusive sum numbers the runs), then the runs shared out among the
// blocks of each column slice. No wait: the run count stays on the device and a bad token (strict)
// is a deferred check. (CUB's run-length encoding would do the middle step, but its kernel spills
// registers on sm_90a.)
void backward(const char* what, const int32_t* tokens, int64_t n, const float* dout, int64_t v0,
              int64_t vocab, int64_t dim, float* dtable, bool strict) {
  if (n == 0 || vocab == 0) return;
  const int count = int(n);
  const uint32_t skip = uint32_t(vocab);
  // Keys are in [0, vocab]: the bits up to vocab's highest sort them.
  const int end_bit = std::bit_width(uint64_t(vocab));

  // CUB's scratch: the sizes asked with the same pointer types as the calls below, or the bound a
  // meta run books (scratch.hpp) where CUB asks less.
  uint32_t *keys = nullptr, *keys_sorted = nullptr;
  int32_t *pos = nullptr, *pos_sorted = nullptr, *head = nullptr, *idx = nullptr;
  size_t sort_bytes = 0, scan_bytes = 0;
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, keys_sorted, pos,
                                                  pos_sorted, count, 0, end_bit, stream()),
                  what);
  LOOM_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, head, idx, count, stream()),
                  what);
  const size_t temp_bytes = std::max({sort_bytes, scan_bytes, embedding_cub_bytes(n)});
  const EmbeddingLayout l = embedding_backward_layout(n, temp_bytes);
  // Released when this returns: the caching allocator hands the block out again only to work
  // queued later on the same stream (runtime.hpp).
  Tensor ws = Tensor::empty({int64_t((l.bytes + 3) / 4)}, DType::i32, Device::cuda);
  char* base = static_cast<char*>(ws.raw());
  keys = reinterpret_cast<uint32_t*>(base + l.keys);
  keys_sorted = reinterpret_cast<uint32_t*>(base + l.keys_sorted);
  pos = reinterpret_cast<int32_t*>(base + l.pos);
  pos_sorted = reinterpret_cast<int32_t*>(base + l.pos_sorted);
  head = reinterpret_cast<int32_t*>(base + l.head);
  idx = reinterpret_cast<int32_t*>(base + l.idx);
  auto* rows = reinterpret_cast<uint32_t*>(base + l.rows);
  auto* starts = reinterpret_cast<int32_t*>(base + l.starts);
  // The first bad token's record (record_bad; all ones: none), then the number of runs.
  auto* bad = reinterpret_cast<unsigned long long*>(base + l.info);
  auto* runs = reinterpret_cast<uint32_t*>(base + l.info + sizeof(unsigned long long));
  void* temp = base + l.temp;

  const unsigned blocks = blocks_for(n, kThreads);
  if (strict) LOOM_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof *bad, stream()), what);
  embedding_keys_kernel<<<blocks, kThreads, 0, stream()>>>(tokens, n, v0, vocab, strict, keys, pos,
                                                           bad);
  check_launch(what);
  size_t bytes = temp_bytes;
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, keys, keys_sorted, pos, pos_sorted,
                                                  count, 0, end_bit, stream()),
                  what);
  embedding_heads_kernel<<<blocks, kThreads, 0, stream()>>>(keys_sorted, n, head);
  check_launch(what);
  bytes = temp_bytes;
  LOOM_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, bytes, head, idx, count, stream()), what);
  embedding_runs_kernel<<<blocks, kThreads, 0, stream()>>>(keys_sorted, head, idx, n, rows, starts,
                                                           runs);
  check_launch(what);
  if (strict) check_tokens_later(what, bad, vocab);
  if (dim % 4 == 0 && aligned16(dout) && aligned16(dtable))
    launch_accumulate<4>(n, runs, rows, starts, pos_sorted, dout, dim, skip, dtable, what);
  else
    launch_accumulate<1>(n, runs, rows, starts, pos_sorted, dout, dim, skip, dtable, what);
}

}  // namespace

void embedding_forward(const int32_t* tokens, int64_t n, const float* table, int64_t vocab,
                       int64_t dim, float* out) {
  const char* what = "embedding_forward";
  check_args(what, tokens, n, vocab, dim, false);
  if (n == 0) return;
  const ScratchBlock word = embedding_forward_scratch(n)[0];  // what a meta run books
  // Freed on return: the check's copy is queued before any later use of the block.
  Tensor bad = Tensor::empty({word.numel}, word.dtype, Device::cuda);
  auto* b = reinterpret_cast<unsigned long long*>(bad.raw());
  LOOM_CUDA_CHECK(cudaMemsetAsync(b, 0xff, sizeof *b, stream()), what);
  forward<false>(what, tokens, n, table, 0, vocab, dim, out, b);
  check_tokens_later(what, b, vocab);
}

void embedding_backward(const int32_t* tokens, int64_t n, const float* dout, int64_t vocab,
                        int64_t dim, float* dtable) {
  check_args("embedding_backward", tokens, n, vocab, dim, false);
  backward("embedding_backward", tokens, n, dout, 0, vocab, dim, dtable, true);
}

void embedding_forward_range(const int32_t* tokens, int64_t n, const float* table, int64_t v0,
                             int64_t vocab, int64_t dim, float* out) {
  const char* what = "embedding_forward_range";
  check_args(what, tokens, n, vocab, dim, true);
  if (n == 0) return;
  forward<true>(what, tokens, n, table, v0, vocab, dim, out, nullptr);
}

void embedding_backward_range(const int32_t* tokens, int64_t n, const float* dout, int64_t v0,
                              int64_t vocab, int64_t dim, float* dtable) {
  check_args("embedding_backward_range", tokens, n, vocab, dim, true);
  backward("embedding_backward_range", tokens, n, dout, v0, vocab, dim, dtable, false);
}

}  // namespace loom::cuda
