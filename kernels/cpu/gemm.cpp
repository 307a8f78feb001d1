#include "kernels/cpu/gemm.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cpu_isa.hpp"

namespace loom::cpu {
namespace {

using dnnl::memory;

struct Key {
  int64_t M, N, K, lda, ldb, ldc;
  bool ta, tb, accumulate;
  DType ab;
  bool c16 = false;     // C written in bf16 (GemmArgs::C16)
  bool packed = false;  // B in the layout oneDNN picks (PackedB); ldb and tb are then 0
  // 0: the whole call, on oneDNN's threads; p > 0: part p - 1 of a call split by rows of C, a
  // matmul built for one thread (each part its own entry, so parts never share memory objects).
  int part = 0;
  auto tie() const {
    return std::tie(M, N, K, lda, ldb, ldc, ta, tb, accumulate, ab, c16, packed, part);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

// A compiled matmul with its three memory objects. Only the data handles change between calls,
// so executing allocates nothing on our side; `mu` serializes the rare concurrent use of one entry
// from two host threads (oneDNN parallelizes each call over OpenMP threads anyway).
struct Entry {
  bool widen = false;  // oneDNN refused this bf16 shape although others built: widen it
  dnnl::matmul prim;
  memory a, b, c;
  std::mutex mu;
};

// Process-wide oneDNN state: one engine, one stream and the primitive cache. This is the one
// accepted piece of kernel-level global state; `mu` guards the map, not the execution.
struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex mu;
  std::map<Key, std::unique_ptr<Entry>> cache;

  static Context& get() {
    cpu_isa();  // LOOM_CPU_ISA caps oneDNN's ISA, which must happen before the engine exists
    static Context ctx;
    return ctx;
  }
};

memory::data_type to_dnnl(DType t) {
  return t == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

std::unique_ptr<Entry> build(const Key& k, const dnnl::engine& eng) {
  const auto dt = to_dnnl(k.ab);
  // Row-major with leading dimensions: op(A)[m,k] lives at m*lda + k, or at k*lda + m when A is
  // stored transposed; the transposes are just swapped strides.
  memory::desc a_md({k.M, k.K}, dt, k.ta ? memory::dims{1, k.lda} : memory::dims{k.lda, 1});
  memory::desc b_md =
      k.packed
          ? memory::desc({k.K, k.N}, dt, memory::format_tag::any)
          : memory::desc({k.K, k.N}, dt, k.tb ? memory::dims{1, k.ldb} : memory::dims{k.ldb, 1});
  memory::desc c_md({k.M, k.N}, k.c16 ? memory::data_type::bf16 : memory::data_type::f32,
                    memory::dims{k.ldc, 1});
  dnnl::primitive_attr attr;
  if (k.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, eng);
  auto e = std::make_unique<Entry>();
  e->prim = dnnl::matmul(pd);
  e->a = memory(a_md, eng, DNNL_MEMORY_NONE);
  e->b = memory(pd.weights_desc(), eng, DNNL_MEMORY_NONE);
  e->c = memory(c_md, eng, DNNL_MEMORY_NONE);
  return e;
}

// How bf16 GEMMs run in this process, decided on first use.
struct Bf16Path {
  bool native = false;
  std::string why;
};

// Whether oneDNN builds bf16 matmuls of the three linear-layer forms here (with and without the
// accumulating post-op); the error text when not.
std::string probe_bf16(const dnnl::engine& eng) {
  try {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool acc : {false, true})
          build({64, 48, 32, ta ? 64 : 32, tb ? 32 : 48, 48, ta, tb, acc, DType::bf16}, eng);
  } catch (const dnnl::error& e) {
    return e.what();
  }
  return "";
}

const Bf16Path& bf16_path() {
  static const Bf16Path path = [] {
    const CpuIsa& isa = cpu_isa();
    const char* env = std::getenv("LOOM_GEMM_BF16");
    const std::string mode = env && *env ? env : "auto";
    LOOM_CHECK(mode == "auto" || mode == "native" || mode == "widen", "LOOM_GEMM_BF16='", mode,
               "' is not a bf16 GEMM path; expected auto, native or widen");
    Bf16Path p;
    if (mode == "widen") {
      p.why = "widened to f32 (LOOM_GEMM_BF16=widen)";
      return p;
    }
    const std::string err = probe_bf16(dnnl::engine(dnnl::engine::kind::cpu, 0));
    if (err.empty()) {
      p.native = true;
      p.why = str_cat("native (oneDNN ", isa.onednn,
                      isa.onednn_native_bf16 ? "" : ", bf16 emulated: no AVX512_BF16/AMX", ")");
      return p;
    }
    LOOM_CHECK(mode != "native", "LOOM_GEMM_BF16=native: oneDNN ", isa.onednn,
               " cannot build a bf16 matmul (", err, ")");
    p.why = str_cat("widened to f32 (oneDNN ", isa.onednn, " has no bf16 matmul)");
    return p;
  }();
  return path;
}

std::atomic<bool> g_force_widen{false};
std::atomic<size_t> g_scratch_bytes{0};
std::atomic<size_t> g_chunk_bytes{kGemmWidenChunkBytes};

// One thread's f32 copy of a bf16 operand; grows to the largest chunk seen, never shrinks.
struct Scratch {
  std::unique_ptr<float[]> data;
  size_t size = 0;  // floats
  float* get(size_t n) {
    if (n > size) {
      data = std::make_unique_for_overwrite<float[]>(n);
      g_scratch_bytes.fetch_add((n - size) * sizeof(float));
      size = n;
    }
    return data.get();
  }
  ~Scratch() { g_scratch_bytes.fetch_sub(size * sizeof(float)); }
};

// dst[r * cols + c] = src[r * ld + c] for a rows x cols block of bf16.
void widen_block(const bf16* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r) cast_bf16_to_f32(src + r * ld, dst + r * cols, cols);
}

// dst[r * ld + c] = bf16(src[r * cols + c]) for a rows x cols block.
void round_block(const float* src, int64_t rows, int64_t cols, bf16* dst, int64_t ld) {
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r) cast_f32_to_bf16(src + r * cols, dst + r * ld, cols);
}

void run_matmul(const GemmArgs& a);

// bf16 GEMM as an f32 GEMM of widened copies: op(A)'s rows in chunks of mc, op(B)'s columns in
// chunks of nc, so that each copy stays within kGemmWidenChunkBytes. Every element of C is
// still one dot product over the whole K, accumulated in f32 by oneDNN.
void gemm_widened(const GemmArgs& a) {
  thread_local Scratch sa, sb, sc;
  const bool ta = a.ta == Trans::T, tb = a.tb == Trans::T;
  const int64_t max_floats = int64_t(g_chunk_bytes.load(std::memory_order_relaxed) / sizeof(float));
  const int64_t mc = std::clamp<int64_t>(max_floats / a.K, 1, a.M);
  const int64_t nc = std::clamp<int64_t>(max_floats / a.K, 1, a.N);
  const auto* A = static_cast<const bf16*>(a.A);
  const auto* B = static_cast<const bf16*>(a.B);
  for (int64_t n0 = 0; n0 < a.N; n0 += nc) {
    const int64_t n = std::min(nc, a.N - n0);
    // op(B)[:, n0:n0+n]: columns of B stored [K, N], or rows of B stored [N, K].
    float* b = sb.get(size_t(n * a.K));
    if (tb)
      widen_block(B + n0 * a.ldb, a.ldb, n, a.K, b);
    else
      widen_block(B + n0, a.ldb, a.K, n, b);
    for (int64_t m0 = 0; m0 < a.M; m0 += mc) {
      const int64_t m = std::min(mc, a.M - m0);
      // op(A)[m0:m0+m, :]: rows of A stored [M, K], or columns of A stored [K, M]. Widened
      // again for each chunk of B's columns only when A itself is chunked.
      float* w = sa.get(size_t(m * a.K));
      if (n0 == 0 || mc < a.M) {
        if (ta)
          widen_block(A + m0, a.lda, a.K, m, w);
        else
          widen_block(A + m0 * a.lda, a.lda, m, a.K, w);
      }
      GemmArgs f = a;
      f.M = m;
      f.N = n;
      f.A = w;
      f.lda = ta ? m : a.K;
      f.B = b;
      f.ldb = tb ? a.K : n;
      f.ab = DType::f32;
      if (a.C16) {  // the chunk of C in f32 scratch, then rounded into place
        f.C16 = nullptr;
        f.C = sc.get(size_t(m * n));
        f.ldc = n;
        run_matmul(f);
        round_block(f.C, m, n, a.C16 + m0 * a.ldc + n0, a.ldc);
        continue;
      }
      f.C = a.C + m0 * a.ldc + n0;
      run_matmul(f);
    }
  }
}

// An f32 product rounded to bf16: through f32 scratch, in chunks of rows of at most
// kGemmWidenChunkBytes.
void gemm_rounded_f32(const GemmArgs& a) {
  thread_local Scratch sc;
  const int64_t max_floats = int64_t(g_chunk_bytes.load(std::memory_order_relaxed) / sizeof(float));
  const int64_t mc = std::clamp<int64_t>(max_floats / a.N, 1, a.M);
  const auto* A = static_cast<const float*>(a.A);
  for (int64_t m0 = 0; m0 < a.M; m0 += mc) {
    GemmArgs f = a;
    f.M = std::min(mc, a.M - m0);
    f.A = a.ta == Trans::T ? A + m0 : A + m0 * a.lda;
    f.C16 = nullptr;
    f.C = sc.get(size_t(f.M * a.N));
    f.ldc = a.N;
    run_matmul(f);
    round_block(f.C, f.M, a.N, a.C16 + m0 * a.ldc, a.ldc);
  }
}

// Sizes, dtype and leading dimensions; check_args adds the pointers.
void check_shape(const GemmArgs& a) {
  LOOM_CHECK(a.M >= 0 && a.N >= 0 && a.K >= 0, "gemm: negative size M=", a.M, " N=", a.N,
             " K=", a.K);
  LOOM_CHECK(a.ab == DType::f32 || a.ab == DType::bf16, "gemm: A and B must be float32 or ",
             "bfloat16, got ", dtype_name(a.ab));
  const bool ta = a.ta == Trans::T, tb = a.tb == Trans::T;
  // The stored widths: A is [M,K] or [K,M], B is [K,N] or [N,K], C is [M,N].
  const int64_t wa = ta ? a.M : a.K, wb = tb ? a.K : a.N;
  LOOM_CHECK(a.lda >= std::max<int64_t>(wa, 1), "gemm: lda=", a.lda, " is less than the width ", wa,
             " of A as stored (", ta ? "transposed" : "not transposed", ")");
  LOOM_CHECK(a.ldb >= std::max<int64_t>(wb, 1), "gemm: ldb=", a.ldb, " is less than the width ", wb,
             " of B as stored (", tb ? "transposed" : "not transposed", ")");
  LOOM_CHECK(a.ldc >= std::max<int64_t>(a.N, 1), "gemm: ldc=", a.ldc,
             " is less than the width N=", a.N, " of C");
  LOOM_CHECK(!(a.C && a.C16), "gemm: both C and C16 are set; the product goes to one of them");
  LOOM_CHECK(!(a.C16 && a.accumulate), "gemm: C16 (a rounded bf16 product) cannot accumulate");
  LOOM_CHECK(!a.R || (!a.C16 && !a.accumulate), "gemm: a residual R goes with a plain f32 C (",
             a.C16 ? "C16 is set" : "accumulate is set", ")");
  LOOM_CHECK(!a.R || a.ldr >= std::max<int64_t>(a.N, 1), "gemm: ldr=", a.ldr,
             " is less than the width N=", a.N, " of R");
}

Key key_of(const GemmArgs& a, bool packed) {
  return {a.M,
          a.N,
          a.K,
          a.lda,
          packed ? 0 : a.ldb,
          a.ldc,
          a.ta == Trans::T,
          !packed && a.tb == Trans::T,
          a.accumulate,
          a.ab,
          a.C16 != nullptr,
          packed};
}

// The compiled matmul for `key`, built on first use; an entry marked `widen` where oneDNN refuses
// a bf16 shape (after the probe passed).
Entry& entry(const Key& key) {
  Context& ctx = Context::get();
  std::lock_guard<std::mutex> lock(ctx.mu);
  auto it = ctx.cache.find(key);
  if (it == ctx.cache.end()) {
    try {
      it = ctx.cache.emplace(key, build(key, ctx.engine)).first;
    } catch (const dnnl::error& err) {
      if (key.ab != DType::bf16)
        fail("gemm: oneDNN cannot build a ", dtype_name(key.ab), " matmul M=", key.M, " N=", key.N,
             " K=", key.K, " ta=", key.ta, " tb=", key.tb, " lda=", key.lda, " ldb=", key.ldb,
             " ldc=", key.ldc, ": ", err.what());
      auto w = std::make_unique<Entry>();
      w->widen = true;
      it = ctx.cache.emplace(key, std::move(w)).first;
    }
  }
  return *it->second;
}

// Runs entry e (not widened) on A, B and C, on this thread's stream (the parts of a split call
// run concurrently; a stream is not meant to be shared between threads).
void execute(Entry& e, const void* A, const void* B, void* C, const GemmArgs& a) {
  thread_local dnnl::stream stream(Context::get().engine);
  std::lock_guard<std::mutex> lock(e.mu);
  e.a.set_data_handle(const_cast<void*>(A));
  e.b.set_data_handle(const_cast<void*>(B));
  e.c.set_data_handle(C);
  // The C API takes the arguments as an array; the C++ one would build an unordered_map per call.
  const dnnl_exec_arg_t args[3] = {
      {DNNL_ARG_SRC, e.a.get()}, {DNNL_ARG_WEIGHTS, e.b.get()}, {DNNL_ARG_DST, e.c.get()}};
  const dnnl_status_t st = dnnl_primitive_execute(e.prim.get(), stream.get(), 3, args);
  LOOM_CHECK(st == dnnl_success, "gemm: oneDNN matmul M=", a.M, " N=", a.N, " K=", a.K,
             " failed to execute (dnnl status ", static_cast<int>(st), ")");
  stream.wait();
}

void* c_of(const GemmArgs& a) {
  return a.C16 ? static_cast<void*>(a.C16) : static_cast<void*>(a.C);
}

// a with its residual copied into C: the same product, accumulating.
GemmArgs residual_copied(const GemmArgs& a) {
  if (!a.R) return a;
  for (int64_t i = 0; i < a.M; ++i) std::memcpy(a.C + i * a.ldc, a.R + i * a.ldr, a.N * 4);
  GemmArgs b = a;
  b.R = nullptr;
  b.accumulate = true;
  return b;
}

// Rows of C of each part of a split call: parts of fewer rows lose more to their own copy of
// B's blocks than the split saves.
constexpr int64_t kSplitMinRows = 128;

// How many parts gemm(a) splits into (1: oneDNN's own threading). A call whose rows give every
// OpenMP thread kSplitMinRows or more (with fewer some threads would idle, where oneDNN would
// split the columns too) runs as one single-threaded matmul per thread, each on the block of
// contiguous rows of C that `omp for schedule(static)` gives it, as loom's own kernels partition
// rows: a thread reads the rows it wrote. Measured at the bench-tiny shapes on two threads
// against oneDNN's own two-thread matmul, operands evicted from the caches between calls (as
// between a layer's forward and its backward): bf16 weight gradients (A transposed, K the
// tokens) 7-15% faster, the other forms 0-7%; f32 weight gradients 4-16% (oneDNN sums two halves
// of K there: its results differ from one thread's in the last bits), the others within 1%;
// warm operands 1-4% (bf16). Only where oneDNN runs at AVX-512 or AMX (its brgemm matmuls): at
// AVX2 the split left bench-tiny's f32 step as it was and ran bench-small's 3.8% slower. Each
// element of C is still one matmul's dot product over all of K.
int split_parts(const GemmArgs& a) {
  static const bool brgemm_isa =
      cpu_isa().onednn.rfind("avx512", 0) == 0 || cpu_isa().onednn.rfind("amx", 0) == 0;
  if (!brgemm_isa || omp_in_parallel()) return 1;
  const int threads = omp_get_max_threads();
  return a.M / kSplitMinRows >= threads ? threads : 1;
}

// Rows [r0, r1) of C of part `p` of `parts`: what `omp for schedule(static)` gives thread p
// (libgomp: the first M % parts threads one row more).
GemmArgs part_of(const GemmArgs& a, int p, int parts) {
  const int64_t base = a.M / parts, extra = a.M % parts;
  const int64_t r0 = p * base + std::min<int64_t>(p, extra);
  GemmArgs q = a;
  q.M = base + (p < extra ? 1 : 0);
  const size_t esz = dtype_size(a.ab);
  q.A = static_cast<const char*>(a.A) + (a.ta == Trans::T ? r0 : r0 * a.lda) * esz;
  if (a.C16)
    q.C16 = a.C16 + r0 * a.ldc;
  else
    q.C = a.C + r0 * a.ldc;
  if (a.R) q.R = a.R + r0 * a.ldr;
  return q;
}

void run_split(const GemmArgs& a, int parts) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
#pragma omp parallel num_threads(parts)
  {
    // oneDNN sizes a matmul for the threads it may use when it is built; inside this region the
    // part's own runs on this thread alone, so it is built for one.
    omp_set_num_threads(1);
    for (int p = omp_get_thread_num(); p < parts; p += omp_get_num_threads()) {
      try {
        const GemmArgs q = residual_copied(part_of(a, p, parts));
        Key k = key_of(q, false);
        k.part = p + 1;
        Entry& e = entry(k);
        if (e.widen)
          gemm_widened(q);
        else
          execute(e, q.A, q.B, c_of(q), q);
      } catch (...) {
        errors[size_t(p)] = std::current_exception();
      }
    }
  }
  for (const std::exception_ptr& err : errors)
    if (err) std::rethrow_exception(err);
}

// The oneDNN matmul of arguments already checked, M, N, K > 0, split by rows of C where that
// pays (split_parts). A bf16 shape oneDNN refuses (after the probe passed) is widened.
void run_matmul(const GemmArgs& in) {
  if (const int parts = split_parts(in); parts > 1) return run_split(in, parts);
  const GemmArgs a = residual_copied(in);
  Entry& e = entry(key_of(a, false));
  if (e.widen) return gemm_widened(a);
  execute(e, a.A, a.B, c_of(a), a);
}

// Whether gemm(a) of arguments already checked runs oneDNN's matmul on a.A and a.B as they are
// (not widened, not rounded from an f32 product, not empty).
bool runs_matmul(const GemmArgs& a) {
  if (a.M == 0 || a.N == 0 || a.K == 0) return false;
  if (a.ab == DType::bf16 && (g_force_widen.load(std::memory_order_relaxed) || !bf16_path().native))
    return false;
  return !(a.C16 && a.ab == DType::f32);
}

}  // namespace

void check_gemm_args(const GemmArgs& a) {
  check_shape(a);
  if (a.M > 0 && a.N > 0) {
    LOOM_CHECK(a.C != nullptr || a.C16 != nullptr, "gemm: C is null for a ", a.M, "x", a.N,
               " product");
    if (a.R) {
      const float *r0 = a.R, *r1 = a.R + (a.M - 1) * a.ldr + a.N;
      const float *c0 = a.C, *c1 = a.C + (a.M - 1) * a.ldc + a.N;
      LOOM_CHECK(r1 <= c0 || c1 <= r0, "gemm: the residual R overlaps C");
    }
    LOOM_CHECK(a.K == 0 || (a.A != nullptr && a.B != nullptr), "gemm: A or B is null with K=", a.K);
  }
}

void gemm(const GemmArgs& a) {
  check_gemm_args(a);
  if (a.M == 0 || a.N == 0) return;
  if (a.K == 0) {  // an empty sum: C = 0 (or R), or C unchanged when accumulating
    if (a.R)
      residual_copied(a);
    else if (a.C16)
      for (int64_t i = 0; i < a.M; ++i) std::fill_n(a.C16 + i * a.ldc, a.N, bf16{});
    else if (!a.accumulate)
      for (int64_t i = 0; i < a.M; ++i) std::fill_n(a.C + i * a.ldc, a.N, 0.0f);
    return;
  }
  if (a.ab == DType::bf16 && (g_force_widen.load(std::memory_order_relaxed) || !bf16_path().native))
    return gemm_widened(residual_copied(a));
  if (a.C16 && a.ab == DType::f32) return gemm_rounded_f32(a);
  run_matmul(a);
}

struct PackedB::Impl {
  int64_t N, K;
  DType ab;
  memory::desc md;
  Tensor storage;
};

size_t PackedB::bytes() const {
  return impl_ ? impl_->md.get_size() : 0;
}

size_t packed_b_bytes(const GemmArgs& a) {
  check_shape(a);
  if (!runs_matmul(a)) return 0;
  const Entry& e = entry(key_of(a, true));
  return e.widen ? 0 : e.b.get_desc().get_size();
}

PackedB pack_b(const GemmArgs& a) {
  LOOM_CHECK(a.B != nullptr || a.K == 0 || a.N == 0, "pack_b: B is null with K=", a.K, " N=", a.N);
  if (packed_b_bytes(a) == 0) return {};
  Entry& e = entry(key_of(a, true));
  auto impl = std::make_shared<PackedB::Impl>();
  impl->N = a.N, impl->K = a.K, impl->ab = a.ab;
  impl->md = e.b.get_desc();
  const size_t esz = dtype_size(a.ab);
  impl->storage = Tensor::empty({int64_t((impl->md.get_size() + esz - 1) / esz)}, a.ab);
  Context& ctx = Context::get();
  const auto dt = to_dnnl(a.ab);
  memory src(memory::desc({a.K, a.N}, dt,
                          a.tb == Trans::T ? memory::dims{1, a.ldb} : memory::dims{a.ldb, 1}),
             ctx.engine, const_cast<void*>(a.B));
  memory dst(impl->md, ctx.engine, impl->storage.raw());
  dnnl::reorder(src, dst).execute(ctx.stream, src, dst);
  ctx.stream.wait();
  PackedB p;
  p.impl_ = std::move(impl);
  return p;
}

void gemm_packed(const GemmArgs& a, const PackedB& b) {
  check_gemm_args(a);
  if (!b) return gemm(a);
  if (a.R) return gemm_packed(residual_copied(a), b);
  const PackedB::Impl& p = *b.impl_;
  LOOM_CHECK(a.N == p.N && a.K == p.K && a.ab == p.ab, "gemm_packed: B was packed for N=", p.N,
             " K=", p.K, " ", dtype_name(p.ab), ", used for N=", a.N, " K=", a.K, " ",
             dtype_name(a.ab));
  if (!runs_matmul(a)) return gemm(a);
  Entry& e = entry(key_of(a, true));
  if (e.widen || e.b.get_desc() != p.md) return gemm(a);
  execute(e, a.A, p.storage.raw(), c_of(a), a);
}

int gemm_parts(const GemmArgs& a) {
  check_shape(a);
  return a.M > 0 && a.N > 0 && a.K > 0 ? split_parts(a) : 1;
}

bool gemm_bf16_native() {
  return bf16_path().native && !g_force_widen.load();
}

std::string gemm_bf16_path() {
  return g_force_widen.load() ? "widened to f32 (forced by a test)" : bf16_path().why;
}

size_t gemm_widen_scratch_bytes() {
  return g_scratch_bytes.load();
}

ScopedGemmBf16Widen::ScopedGemmBf16Widen(size_t chunk_bytes)
    : prev_(g_force_widen.exchange(true)), prev_chunk_(g_chunk_bytes.exchange(chunk_bytes)) {}
ScopedGemmBf16Widen::~ScopedGemmBf16Widen() {
  g_force_widen.store(prev_);
  g_chunk_bytes.store(prev_chunk_);
}

namespace {

// y = x W^T: A is x [M, K], B is W [N, K] read transposed; C is y [M, N].
GemmArgs linear_forward_args(const void* x, const void* w, int64_t M, int64_t N, int64_t K,
                             DType ab) {
  return {.ta = Trans::N,
          .tb = Trans::T,
          .M = M,
          .N = N,
          .K = K,
          .A = x,
          .lda = K,
          .B = w,
          .ldb = K,
          .ldc = N,
          .ab = ab};
}

}  // namespace

void linear_forward(const void* x, const void* w, float* y, int64_t M, int64_t N, int64_t K,
                    DType ab, bool accumulate) {
  GemmArgs a = linear_forward_args(x, w, M, N, K, ab);
  a.C = y;
  a.accumulate = accumulate;
  gemm(a);
}

void linear_forward_residual(const void* x, const void* w, const float* r, float* y, int64_t M,
                             int64_t N, int64_t K, DType ab) {
  GemmArgs a = linear_forward_args(x, w, M, N, K, ab);
  a.C = y;
  a.R = r;
  a.ldr = N;
  gemm(a);
}

PackedB pack_linear_forward(const void* w, int64_t M, int64_t N, int64_t K, DType ab) {
  return pack_b(linear_forward_args(nullptr, w, M, N, K, ab));
}

size_t packed_linear_forward_bytes(int64_t M, int64_t N, int64_t K, DType ab) {
  return packed_b_bytes(linear_forward_args(nullptr, nullptr, M, N, K, ab));
}

void linear_forward(const void* x, const void* w, const PackedB& packed, float* y, int64_t M,
                    int64_t N, int64_t K, DType ab) {
  GemmArgs a = linear_forward_args(x, w, M, N, K, ab);
  a.C = y;
  gemm_packed(a, packed);
}

void linear_forward_rounded(const void* x, const void* w, bf16* y, int64_t M, int64_t N, int64_t K,
                            DType ab) {
  GemmArgs a = linear_forward_args(x, w, M, N, K, ab);
  a.C16 = y;
  gemm(a);
}

void linear_backward_input(const void* dy, const void* w, float* dx, int64_t M, int64_t N,
                           int64_t K, DType ab, bool accumulate) {
  gemm({.ta = Trans::N,
        .tb = Trans::N,
        .M = M,
        .N = K,
        .K = N,
        .A = dy,
        .lda = N,
        .B = w,
        .ldb = K,
        .C = dx,
        .ldc = K,
        .ab = ab,
        .accumulate = accumulate});
}

void linear_backward_weight(const void* dy, const void* x, float* dw, int64_t M, int64_t N,
                            int64_t K, DType ab, bool accumulate) {
  gemm({.ta = Trans::T,
        .tb = Trans::N,
        .M = N,
        .N = K,
        .K = M,
        .A = dy,
        .lda = N,
        .B = x,
        .ldb = K,
        .C = dw,
        .ldc = K,
        .ab = ab,
        .accumulate = accumulate});
}

double measure_gemm_peak(DType ab, double seconds) {
  // Linear layers of the model sizes this framework targets, in their three forms; the best
  // is what a well-shaped GEMM reaches here.
  const int64_t M = 2048;
  const std::pair<int64_t, int64_t> nk[] = {{1376, 512}, {512, 1376}, {1024, 512}};
  int64_t max_elems = 0;
  for (auto [n, k] : nk) max_elems = std::max({max_elems, M * n, M * k, n * k});
  const size_t esz = dtype_size(ab);
  std::vector<char> x(max_elems * esz), w(max_elems * esz), dy(max_elems * esz);
  std::vector<float> out(max_elems);
  // Small non-zero values so nothing denormal or infinite slows the timing.
  for (size_t i = 0; i < static_cast<size_t>(max_elems); ++i) {
    const float v = 0.01f * static_cast<float>(static_cast<int>(i % 17) - 8);
    if (ab == DType::bf16) {
      const bf16 b = float_to_bf16(v);
      std::memcpy(&x[i * 2], &b, 2);
      std::memcpy(&w[i * 2], &b, 2);
      std::memcpy(&dy[i * 2], &b, 2);
    } else {
      std::memcpy(&x[i * 4], &v, 4);
      std::memcpy(&w[i * 4], &v, 4);
      std::memcpy(&dy[i * 4], &v, 4);
    }
  }
  using clock = std::chrono::steady_clock;
  const double per_case = seconds / (3.0 * std::size(nk));
  double best = 0;
  for (auto [n, k] : nk) {
    for (int form = 0; form < 3; ++form) {
      auto run = [&] {
        if (form == 0) linear_forward(x.data(), w.data(), out.data(), M, n, k, ab);
        if (form == 1) linear_backward_input(dy.data(), w.data(), out.data(), M, n, k, ab, false);
        if (form == 2) linear_backward_weight(dy.data(), x.data(), out.data(), M, n, k, ab);
      };
      run();  // builds the primitive and warms the caches
      run();  // the thread pool awake, the cores' clocks up
      // The fastest single call: other processes sharing the cores only ever slow a call down,
      // so the minimum is the machine's capability, not the load of the moment. At least
      // kMinCalls of them whatever `seconds`: on two AVX2 cores a case's share of the trainer's
      // 0.2 s was one call, and one slow call made the peak 86 GFLOP/s where it is 160 (MFU
      // printed as 157%).
      constexpr int kMinCalls = 4;
      double fastest = 1e30, spent = 0;
      int calls = 0;
      do {
        const auto t0 = clock::now();
        run();
        const double dt = std::chrono::duration<double>(clock::now() - t0).count();
        fastest = std::min(fastest, dt);
        spent += dt;
        ++calls;
      } while (spent < per_case || calls < kMinCalls);
      best = std::max(best, 2.0 * M * n * k / fastest);
    }
  }
  return best;
}

}  // namespace loom::cpu
