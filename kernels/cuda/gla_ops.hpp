#pragma once
// The pieces of a GLA layer around the core on the device: the counterparts of
// kernels/cpu/gla_gate.hpp, gated_rmsnorm.hpp and short_conv.hpp, with the same argument structs
// (cpu::GatedRmsNorm, cpu::ShortConv: plain structs), layouts, strides and math. Pointers are
// device memory; the work is queued on the compute stream (kernels/cuda/runtime.hpp) and nothing
// waits for it.
//
// f32 throughout, with CUDA's expf/log1pf (within 2 ulp) where the CPU uses its own exp and log1p:
// element-wise outputs differ from the CPU's in the last bits. Every reduction runs in a fixed
// order that depends on the shape alone (no atomics), so the results have the same bits on every
// run: a row norm's sum of squares by a butterfly within one warp per (row, head); a weight or
// bias gradient's sum over rows as fixed ranges of consecutive rows (at most 512, their bounds
// from the row count alone) each summed in order into its own partial row (scratch from the
// caching allocator), then the partials added in order and the total added to the gradient.
#include <cstdint>

#include "kernels/cpu/gated_rmsnorm.hpp"  // GatedRmsNorm: a plain struct, no backend
#include "kernels/cpu/short_conv.hpp"     // ShortConv

namespace loom::cuda {

using cpu::GatedRmsNorm;
using cpu::ShortConv;

// gk = max(logsigmoid(z + bias) / normalizer, clamp_min) (cpu::gla_gate_forward): z and gk
// [rows, width] contiguous, gk may be z; bias [width] or null; clamp_min -inf: no clamp.
// logsigmoid(x) = min(x, 0) - log1p(e^-|x|), never e of a large positive number.
void gla_gate_forward(const float* z, const float* bias, int64_t rows, int64_t width,
                      float normalizer, float clamp_min, float* gk);
// dz = dgk * sigmoid(-(z + bias)) / normalizer where logsigmoid(z + bias) / normalizer >=
// clamp_min, 0 elsewhere (PyTorch's clamp_min gradient); dz OVERWRITTEN, may be dgk. dbias
// [width] (with bias and dbias) ACCUMULATES the column sums of dz.
void gla_gate_backward(const float* dgk, const float* z, const float* bias, int64_t rows,
                       int64_t width, float normalizer, float clamp_min, float* dz, float* dbias);

// y[m, h, :] = x[m, h, :] rstd w * g sigmoid(g) per (row, head) of s.dim values
// (cpu::gated_rmsnorm_forward): x, y [rows, heads*dim] contiguous; g with row stride ldg (0:
// heads*dim) or null (no gate); w [dim] or null (no weight); rstd [rows*heads] written.
void gated_rmsnorm_forward(const GatedRmsNorm& s, const float* x, const float* g, int64_t ldg,
                           const float* w, float* y, float* rstd);
// dx OVERWRITTEN; dg (row stride lddg, 0: heads*dim) OVERWRITTEN when g is given; dw [dim]
// ACCUMULATED when w and dw are given. s.eps is not used (it is in rstd).
void gated_rmsnorm_backward(const GatedRmsNorm& s, const float* dy, const float* x, const float* g,
                            int64_t ldg, const float* w, const float* rstd, float* dx, float* dg,
                            int64_t lddg, float* dw);

// y[b, t, c] = silu(sum_{j<W} w[c, j] x[b, t - W + 1 + j, c]) with zeros before each sample's
// start (cpu::short_conv_forward): x [B*T, C] with row stride ldx (0: C), y with ldy (0: C),
// w [C, W].
void short_conv_forward(const ShortConv& s, const float* x, int64_t ldx, const float* w, float* y,
                        int64_t ldy);
// dx (row stride lddx, 0: C) OVERWRITTEN; dw [C, W] ACCUMULATED. dx must not alias x or dy.
// Scratch: du = dy silu'(u), B*T*C floats.
void short_conv_backward(const ShortConv& s, const float* dy, int64_t lddy, const float* x,
                         int64_t ldx, const float* w, float* dx, int64_t lddx, float* dw);

}  // namespace loom::cuda
