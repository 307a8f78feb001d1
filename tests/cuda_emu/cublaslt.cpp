// The CUDA emulation's cuBLASLt (tests/cuda_emu/device.hpp): the calls kernels/cuda/gemm.cpp makes,
// with cuBLASLt's column-major contract (D = alpha op(A) op(B) + beta C; a layout's element (i, j)
// at i + j ld), so the row-major-to-column-major mapping of gemm.cpp runs here as on the GPU. The
// checks cuBLASLt makes fail as it fails: shapes that do not chain, a leading dimension below the
// rows, a type or compute type loom never asks for; and one it leaves undefined: a pointer less
// aligned than the alignment its plan was chosen for (the plan cache keys on alignment). Products
// in f32 in k order (bf16 operands widened exactly; TF32 compute rounds f32 operands to 10
// mantissa bits), a bf16 D rounded to nearest even.
#include <cublasLt.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/cuda_emu/immortal.hpp"

namespace {

struct Desc {
  cublasComputeType_t compute;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Pref {
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};
struct Registry {
  std::mutex mu;
  std::map<void*, std::unique_ptr<Desc>> descs;
  std::map<void*, std::unique_ptr<Layout>> layouts;
  std::map<void*, std::unique_ptr<Pref>> prefs;
};
Registry& reg() {
  return loom::cuda_emu::immortal<Registry>();
}
template <class T, class M>
T* find(M& m, const void* p) {
  std::lock_guard<std::mutex> lock(reg().mu);
  auto it = m.find(const_cast<void*>(p));
  return it == m.end() ? nullptr : it->second.get();
}
template <class Handle, class T, class M>
Handle add(M& m, std::unique_ptr<T> v) {
  std::lock_guard<std::mutex> lock(reg().mu);
  void* key = v.get();
  m[key] = std::move(v);
  return reinterpret_cast<Handle>(key);
}
template <class M>
cublasStatus_t remove(M& m, const void* p) {
  std::lock_guard<std::mutex> lock(reg().mu);
  return m.erase(const_cast<void*>(p)) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float tf32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}
float load(const void* p, cudaDataType_t t, int64_t i) {
  return t == CUDA_R_16BF ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                          : static_cast<const float*>(p)[i];
}
bool aligned(const void* p, uint32_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  static int handle;
  *h = reinterpret_cast<cublasLtHandle_t>(&handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) {
  return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion(void) {
  return CUBLAS_VERSION;
}
const char* cublasLtGetStatusName(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS         ? "CUBLAS_STATUS_SUCCESS"
         : s == CUBLAS_STATUS_INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE"
         : s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED"
                                            : "CUBLAS_STATUS_(emulated)";
}
const char* cublasLtGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "the emulated cuBLASLt refused the call";
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (scale != CUDA_R_32F ||
      (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = add<cublasLtMatmulDesc_t>(reg().descs, std::make_unique<Desc>(Desc{compute}));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  return remove(reg().descs, d);
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void* buf,
                                              size_t bytes) {
  Desc* desc = find<Desc>(reg().descs, d);
  if (!desc || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  if (a != CUBLASLT_MATMUL_DESC_TRANSA && a != CUBLASLT_MATMUL_DESC_TRANSB)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
  cublasOperation_t op;
  std::memcpy(&op, buf, bytes);
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  (a == CUBLASLT_MATMUL_DESC_TRANSA ? desc->ta : desc->tb) = op;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType t, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (t != CUDA_R_16BF && t != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (ld < int64_t(rows) || ld < 1) return CUBLAS_STATUS_INVALID_VALUE;
  *l = add<cublasLtMatrixLayout_t>(reg().layouts,
                                   std::make_unique<Layout>(Layout{t, rows, cols, ld}));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  return remove(reg().layouts, l);
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = add<cublasLtMatmulPreference_t>(reg().prefs, std::make_unique<Pref>());
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  return remove(reg().prefs, p);
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void* buf, size_t bytes) {
  Pref* pref = find<Pref>(reg().prefs, p);
  if (!pref || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  int i = -1;
  switch (a) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return bytes == sizeof(uint64_t) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      i = 0;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      i = 1;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      i = 2;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      i = 3;
      break;
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (bytes != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&pref->align[i], buf, bytes);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* found) {
  const Pref* pref = find<Pref>(reg().prefs, p);
  if (!find<Desc>(reg().descs, op) || !find<Layout>(reg().layouts, a) ||
      !find<Layout>(reg().layouts, b) || !find<Layout>(reg().layouts, c) ||
      !find<Layout>(reg().layouts, d) || !pref || requested < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  // The "algorithm" remembers the alignments it was chosen for.
  static_assert(sizeof pref->align <= sizeof results[0].algo.data);
  std::memcpy(results[0].algo.data, pref->align, sizeof pref->align);
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t op, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a, const void* B,
                              cublasLtMatrixLayout_t b, const void* beta, const void* C,
                              cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t,
                              cudaStream_t) {
  const Desc* desc = find<Desc>(reg().descs, op);
  const Layout *la = find<Layout>(reg().layouts, a), *lb = find<Layout>(reg().layouts, b),
               *lc = find<Layout>(reg().layouts, c), *ld = find<Layout>(reg().layouts, d);
  if (!desc || !la || !lb || !lc || !ld || !algo || !alpha || !beta || !workspace)
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = desc->ta == CUBLAS_OP_T, tb = desc->tb == CUBLAS_OP_T;
  const uint64_t m = ld->rows, n = ld->cols;
  const uint64_t k = ta ? la->rows : la->cols;
  if ((ta ? la->cols : la->rows) != m || (tb ? lb->cols : lb->rows) != k ||
      (tb ? lb->rows : lb->cols) != n || lc->rows != m || lc->cols != n || la->type != lb->type ||
      lc->type != ld->type)
    return CUBLAS_STATUS_INVALID_VALUE;
  uint32_t align[4];
  std::memcpy(align, algo->data, sizeof align);
  if (!aligned(A, align[0]) || !aligned(B, align[1]) || !aligned(C, align[2]) ||
      !aligned(D, align[3]))
    return CUBLAS_STATUS_INVALID_VALUE;  // undefined on a GPU: the plan assumed more alignment
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const bool round_tf32 = desc->compute == CUBLAS_COMPUTE_32F_FAST_TF32 && la->type == CUDA_R_32F;
  auto in = [&](const void* p, const Layout& l, uint64_t i, uint64_t j) {
    const float v = load(p, l.type, int64_t(i) + int64_t(j) * l.ld);
    return round_tf32 ? tf32(v) : v;
  };
  // op(A) as m rows of k and op(B) as n rows of k, so each product is a contiguous dot.
  std::vector<float> pa(m * k), pb(n * k), out(m * n);
  for (uint64_t i = 0; i < m; ++i)
    for (uint64_t p = 0; p < k; ++p) pa[i * k + p] = ta ? in(A, *la, p, i) : in(A, *la, i, p);
  for (uint64_t j = 0; j < n; ++j)
    for (uint64_t p = 0; p < k; ++p) pb[j * k + p] = tb ? in(B, *lb, j, p) : in(B, *lb, p, j);
  for (uint64_t j = 0; j < n; ++j)
    for (uint64_t i = 0; i < m; ++i) {
      const float* x = &pa[i * k];
      const float* y = &pb[j * k];
      float acc = 0;
      for (uint64_t p = 0; p < k; ++p) acc += x[p] * y[p];
      float r = al * acc;
      if (be != 0) r += be * load(C, lc->type, int64_t(i) + int64_t(j) * lc->ld);
      out[i + j * m] = r;
    }
  for (uint64_t j = 0; j < n; ++j)
    for (uint64_t i = 0; i < m; ++i) {
      const int64_t at = int64_t(i) + int64_t(j) * ld->ld;
      if (ld->type == CUDA_R_16BF)
        static_cast<uint16_t*>(D)[at] = f32_to_bf16(out[i + j * m]);
      else
        static_cast<float*>(D)[at] = out[i + j * m];
    }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
