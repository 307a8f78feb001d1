#pragma once
// Fused AdamW on the device (the counterpart of kernels/cpu/adamw.hpp, the same arguments and
// the same per-element steps: PyTorch's single-tensor formula on fp32 master weights and moments).
// Pointers are device memory; the work is queued on the compute stream.
#include <cstdint>

#include "core/dtype.hpp"
#include "kernels/cpu/adamw.hpp"  // AdamWArgs: a plain struct, no backend

namespace loom::cuda {

using cpu::AdamWArgs;
// If param_bf16 is not null, also writes the updated weights rounded to bf16 there.
void adamw_step(const AdamWArgs& a, float* param, const float* grad, float* m, float* v, int64_t n,
                bf16* param_bf16 = nullptr);

}  // namespace loom::cuda
