#include "model/norm_input.hpp"

namespace loom {

Tensor norm_gemm_input(const TpRuntime& tp, BranchPrecision precision, DType compute,
                       const Tensor& saved, bool saved_gathered, const Tensor& in,
                       const Tensor& weight, float eps) {
  if (saved.defined()) return tp.sp() && !saved_gathered ? tp_gather_input(tp, saved) : saved;
  const int64_t rows = in.shape()[0];
  Tensor xn = Tensor::empty(in.shape(), output_dtype(precision, compute), in.device()),
         rstd = Tensor::empty({rows}, DType::f32, in.device());
  ops::rmsnorm_forward(in, weight, eps, xn, rstd);
  const Tensor gemm_input = in_compute(xn, compute);
  return tp.sp() ? tp_gather_input(tp, gemm_input) : gemm_input;
}

}  // namespace loom
