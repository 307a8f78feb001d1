#pragma once
// The GPU's two ceilings, measured now (the denominators of MFU and of a bandwidth-bound kernel's
// efficiency in `loom info` and `loom bench`): a bf16 GEMM through cuBLASLt on random data and a
// device-to-device copy, each timed with events after a warm-up, the median of repeats.
#include <cstdint>

namespace loom::cuda {

// bf16 GEMM FLOP/s at n x n x n (8192: large enough to fill an H100), about `seconds` of timing.
double measure_gemm_peak_bf16(double seconds = 0.5, int64_t n = 8192);
// Device-to-device copy bandwidth in bytes/s counting bytes read plus bytes written, over a buffer
// of `bytes` (1 GiB: far beyond the L2).
double measure_copy_bandwidth(double seconds = 0.5, int64_t bytes = int64_t(1) << 30);
// Fills x with uniform values in [-scale, scale) from a counter hash of (seed, index): random data
// for timings (never zeros, which run faster than real data).
void fill_uniform_bf16(void* x, int64_t n, uint64_t seed, float scale);

}  // namespace loom::cuda
