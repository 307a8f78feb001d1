#include "kernels/cuda/gemm.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"

namespace loom::cuda {

namespace {

void check_lt(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail("gemm: ", call, " failed: ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
         ")");
}
#define LOOM_LT_CHECK(call) check_lt((call), #call)

bool g_allow_tf32 = false;

// The cached form of one problem: descriptors and the heuristic's algorithm.
struct Key {
  bool ta, tb, accumulate, residual, c16, tf32;
  DType ab;
  int64_t M, N, K, lda, ldb, ldc, ldr;
  unsigned align_a, align_b, align_c, align_r;
  auto tie() const {
    return std::tie(ta, tb, accumulate, residual, c16, tf32, ab, M, N, K, lda, ldb, ldc, ldr,
                    align_a, align_b, align_c, align_r);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // At process exit cuBLASLt may be gone before this cache: nothing to report then.
    if (d && d != c) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct State {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;
  std::map<Key, std::unique_ptr<Plan>> plans;
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    plans.clear();
    if (handle) cublasLtDestroy(handle);
  }
};
State& state() {
  // The allocator of Device::cuda is made first, so this state (and its workspace) goes before it
  // at exit: statics are destroyed in the reverse order of their construction.
  Allocator::get(Device::cuda);
  static State s;
  return s;
}

cublasLtMatrixLayout_t layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  LOOM_LT_CHECK(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld));
  return l;
}

std::unique_ptr<Plan> make_plan(const Key& k, const LtProblem& p, cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  const cublasComputeType_t compute =
      k.ab == DType::f32 && k.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  LOOM_LT_CHECK(cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F));
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LOOM_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  const cudaDataType_t in = k.ab == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t out = k.c16 ? CUDA_R_16BF : CUDA_R_32F;
  plan->a = layout(in, p.a_rows, p.a_cols, p.lda);
  plan->b = layout(in, p.b_rows, p.b_cols, p.ldb);
  // C is what beta scales: R for a residual (its own leading dimension), D itself otherwise.
  plan->d = layout(out, p.c_rows, p.c_cols, p.ldc);
  plan->c = k.residual ? layout(out, p.c_rows, p.c_cols, k.ldr) : plan->d;

  cublasLtMatmulPreference_t pref = nullptr;
  LOOM_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } guard{pref};
  const uint64_t ws = kGemmWorkspaceBytes;
  LOOM_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &ws, sizeof ws));
  // cuBLASLt's A is loom's B buffer and its B is loom's A (lt_problem).
  const uint32_t aa = k.align_b, ab = k.align_a, ac = k.residual ? k.align_r : k.align_c,
                 ad = k.align_c;
  LOOM_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
  LOOM_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
  LOOM_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac));
  LOOM_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  LOOM_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->d,
                                               pref, 1, &result, &found));
  LOOM_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for ", dtype_name(k.ab), " M=", k.M,
             " N=", k.N, " K=", k.K, k.ta ? " A^T" : "", k.tb ? " B^T" : "", " lda=", k.lda,
             " ldb=", k.ldb, " ldc=", k.ldc);
  plan->algo = result.algo;
  return plan;
}

// K == 0: the product is zero, so C = 0, C += 0 or C = R (no cuBLASLt call).
void empty_product(const GemmArgs& a) {
  if (a.accumulate) return;
  const size_t elem = a.C16 ? 2 : 4;
  void* c = a.C16 ? static_cast<void*>(a.C16) : static_cast<void*>(a.C);
  if (a.R)
    LOOM_CUDA_CHECK(cudaMemcpy2DAsync(c, a.ldc * elem, a.R, a.ldr * elem, a.N * elem, a.M,
                                      cudaMemcpyDeviceToDevice, stream()),
                    "gemm");
  else
    LOOM_CUDA_CHECK(cudaMemset2DAsync(c, a.ldc * elem, 0, a.N * elem, a.M, stream()), "gemm");
}

}  // namespace

void set_allow_tf32(bool allow) {
  g_allow_tf32 = allow;
}
bool allow_tf32() {
  return g_allow_tf32;
}

unsigned pointer_alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  unsigned a = 16;
  while (a > 1 && (u % a) != 0) a /= 2;
  return a;
}

LtProblem lt_problem(const GemmArgs& a) {
  // Row-major X [r, c] with leading dimension ld is column-major X^T [c, r] with the same ld.
  LtProblem p;
  // cuBLASLt's A = op(B)^T [N, K]: B stored [K, N] (not transposed) is that matrix already;
  // stored [N, K] (transposed) it is column-major [K, N] and needs cuBLASLt's transpose.
  p.trans_a = a.tb == Trans::T;
  p.a_rows = uint64_t(p.trans_a ? a.K : a.N);
  p.a_cols = uint64_t(p.trans_a ? a.N : a.K);
  p.lda = a.ldb;
  // cuBLASLt's B = op(A)^T [K, M]: A stored [M, K] is column-major [K, M]; stored [K, M] it is
  // column-major [M, K], transposed.
  p.trans_b = a.ta == Trans::T;
  p.b_rows = uint64_t(p.trans_b ? a.M : a.K);
  p.b_cols = uint64_t(p.trans_b ? a.K : a.M);
  p.ldb = a.lda;
  p.c_rows = uint64_t(a.N);
  p.c_cols = uint64_t(a.M);
  p.ldc = a.ldc;
  return p;
}

void gemm(const GemmArgs& a) {
  cpu::check_gemm_args(a);
  if (a.M == 0 || a.N == 0) return;
  if (a.K == 0) return empty_product(a);
  State& s = state();
  void* d = a.C16 ? static_cast<void*>(a.C16) : static_cast<void*>(a.C);
  const Key k{a.ta == Trans::T,
              a.tb == Trans::T,
              a.accumulate,
              a.R != nullptr,
              a.C16 != nullptr,
              g_allow_tf32,
              a.ab,
              a.M,
              a.N,
              a.K,
              a.lda,
              a.ldb,
              a.ldc,
              a.R ? a.ldr : 0,
              pointer_alignment(a.A),
              pointer_alignment(a.B),
              pointer_alignment(d),
              a.R ? pointer_alignment(a.R) : 16u};
  const Plan* plan = nullptr;
  void* workspace = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.handle) {
      LOOM_LT_CHECK(cublasLtCreate(&s.handle));
      MemoryUseScope use(Device::cuda, MemoryUse::work);
      s.workspace = Tensor::empty({int64_t(kGemmWorkspaceBytes / 4)}, DType::i32, Device::cuda);
    }
    auto& slot = s.plans[k];
    if (!slot) slot = make_plan(k, lt_problem(a), s.handle);
    plan = slot.get();
    workspace = s.workspace.raw();
  }
  const float alpha = 1.0f, beta = a.accumulate || a.R ? 1.0f : 0.0f;
  const void* c = a.R ? static_cast<const void*>(a.R) : d;
  LOOM_LT_CHECK(cublasLtMatmul(s.handle, plan->op, &alpha, a.B, plan->a, a.A, plan->b, &beta, c,
                               plan->c, d, plan->d, &plan->algo, workspace, kGemmWorkspaceBytes,
                               stream()));
}

}  // namespace loom::cuda
