#pragma once
// Tensor-level operations that dispatch on the tensors' device (docs/architecture.md "The
// device seam"): cpu runs the kernels of kernels/cpu; meta runs nothing (its allocations,
// made by Tensor::empty before the call, are booked like the CPU's, so a meta run measures
// memory); any other device is a loom::Error naming the op. The layers above (parallel/layers,
// model/) call these and never a backend's kernel, so a new backend adds a case here.
//
// Layouts are the kernels' (kernels/cpu/*.hpp): row-major, token-major activations [rows, cols].
// A strided 2-D view (Tensor::narrow along dim 1, e.g. q, k or v inside a fused qkv buffer) is
// read with its row stride. A GEMM weight is given by its first parameter's tensor: the op reads
// as many rows as its output has columns, so adjacent parameters (q, k, v) read as one matrix.
#include <climits>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/cpu/rope.hpp"  // RopeScaling, RopeTable: plain structs, no backend

namespace loom::ops {

// Whether `device` has kernels that compute (cpu) rather than only book memory (meta).
bool computes(Device device);

// ---- the work of a kernel on the meta device (the planner's time model) -----------------------
// What one op call would do: its floating-point operations (a multiply-add is 2) and the bytes it
// reads and writes in memory, from its tensors' shapes and dtypes.
struct KernelWork {
  const char* op = "";       // the op's name in this header ("linear", "attention_forward", ...)
  DType dtype = DType::f32;  // the dtype of its main operands (a GEMM's inputs)
  double flops = 0;
  double bytes = 0;
  // GEMMs: the shape (M x N x K) of each multiplication, for an efficiency by shape.
  int64_t m = 0, n = 0, k = 0;
  // Bytes that cross between host memory and the device (CPU offload's transfers, ops::copy and
  // ops::add_inplace across pools): the time model prices them at the host link's bandwidth.
  double link_bytes = 0;
};
// While one lives on this thread, every op called on the meta device reports its work to `sink`
// (ops on other devices report nothing). Not nestable. An op may report several pieces:
// linear_backward its dx GEMM ("linear_backward") and its dw GEMM ("linear_backward_weight", or
// later from run_weight_grads when deferred); linear_cross_entropy its GEMMs and its softmax
// passes (m = 0). Attention counts the tiles its kernel computes (cpu::tiled_entries).
class RecordWork {
 public:
  explicit RecordWork(std::function<void(const KernelWork&)> sink);
  ~RecordWork();
  RecordWork(const RecordWork&) = delete;
  RecordWork& operator=(const RecordWork&) = delete;
};

// While one lives on this thread, ops on the meta device book the scratch of `device`'s kernels
// (without one, the CPU's): for cuda, the blocks its kernels take from the caching allocator per
// call (kernels/cuda/scratch.hpp: the fused loss's chunk, the exact attention's score matrices)
// and cuBLASLt's workspace once, at the first GEMM, held until the scope ends. So a meta run of a
// GPU job (the planner, `loom bench --check`) peaks where the GPU's run does. Not nestable.
class ModeledDevice {
 public:
  explicit ModeledDevice(Device device);
  ~ModeledDevice();
  ModeledDevice(const ModeledDevice&) = delete;
  ModeledDevice& operator=(const ModeledDevice&) = delete;
};
Device modeled_device();

// While one lives on this thread, every op run on the cpu device is timed: `sink` gets the op's
// name, the work it would report on meta and its wall seconds (`loom bench step --profile` sets
// them beside the time model's price). An op run inside another is the outer one's time.
// Not nestable.
class ProfileOps {
 public:
  using Sink = std::function<void(const char* op, const std::vector<KernelWork>&, double seconds)>;
  explicit ProfileOps(Sink sink);
  ~ProfileOps();
  ProfileOps(const ProfileOps&) = delete;
  ProfileOps& operator=(const ProfileOps&) = delete;
};

// ---- element-wise and copies ----------------------------------------------------------------
// A GEMM input in the compute dtype: `x` itself in f32, a rounded bf16 copy otherwise.
Tensor to_compute(const Tensor& x, DType dt);
// An f32 kernel's input: `x` itself in f32, a widened (exact) f32 copy of a bf16 `x`.
Tensor to_f32(const Tensor& x);
// dst = src in dst's dtype (f32 -> bf16 rounds, bf16 -> f32 widens), the same number of
// elements, both contiguous.
void cast(const Tensor& src, Tensor& dst);
// dst = src: a copy, or a cast when the dtypes differ; the same number of elements, both
// contiguous. Between Pool::host and the device it is the offload transfer "host_to_device" or
// "device_to_host" (what crosses is the smaller of the two sides: a GPU would cast on the side
// that makes the transfer smaller).
void copy(const Tensor& src, Tensor& dst);
// y += x, same numel. With y in the host pool and x on the device (an offloaded gradient shard
// and its reduce-scatter's result) it is "device_to_host": x crosses.
void add_inplace(Tensor& y, const Tensor& x);
void fill(Tensor& x, float value);
// dst[m, :] = src[m, :], both [rows, width], either may be a strided view.
void copy_rows(const Tensor& src, Tensor& dst);
// Standard normal samples (Philox stream `key`, samples [first, first + x.numel())) * std.
void philox_normal(Tensor& x, uint64_t key, int64_t first, float std);

// ---- optimizer and gradient norm (train/optimizer.cpp) ---------------------------------------
// AdamW on fp32 master weights p, gradients g and moments m, v (the same number of elements, 1-D
// views of a unit's flat buffers), the bf16 mirror rounded from the new weights where given
// (cpu::AdamWArgs: PyTorch's formula; grad_scale multiplies each gradient as it is read).
struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;
  float grad_scale = 1;
};
void adamw_step(const AdamWStep& a, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                Tensor* mirror = nullptr);
// The sum of x's squares in double, in an order fixed by x's size (the same bits on every run).
double sum_squares(const Tensor& x);
// sum_squares of each tensor (all on one device), with one wait for the results: a GPU sums
// them all on the device and copies the doubles back once (the gradient norm's one read a step).
std::vector<double> sum_squares_each(std::span<const Tensor> xs);
void scale_inplace(Tensor& x, float s);

// ---- linear layers -----------------------------------------------------------------------------
// y [M, N] (+)= x [M, K] w^T, w [N, K] in x's dtype (f32, or bf16 with f32 accumulation). A
// bf16 y receives the f32 product rounded (no accumulate): the rounded copy without the f32 one.
void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false);
// y [M, N] = r [M, N] + x w^T, y and r f32 (a residual branch's output projection): each thread
// copies its rows of r into y as it multiplies them, no pass of its own.
void linear(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y);
// A weight gradient the dW GEMM adds to. `unwritten`, where given, holds the flags of the
// parameters the GEMM writes (a fused matrix: several): set, they say the gradient holds nothing
// yet, not even zeros (ParamUnit::zero_grad leaves such gradients as they are), and the GEMM
// writes instead of adding, then clears them. All are set or none.
struct WeightGrad {
  WeightGrad() = default;
  WeightGrad(const Tensor& grad) : t(grad) {}  // NOLINT(google-explicit-constructor): plain add
  WeightGrad(const Tensor& grad, std::span<uint8_t> flags) : t(grad), unwritten(flags) {}
  // Whether the next write overwrites (the gradient holds nothing yet).
  bool first_write() const { return !unwritten.empty() && unwritten.front(); }
  // first_write(), clearing the flags (the caller then writes).
  bool take_first_write() const;
  Tensor t;
  std::span<uint8_t> unwritten;
};
// For y = x w^T: dx [M, K] = dy w (overwritten), then dw [N, K] += dy^T x (= where unwritten).
void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const WeightGrad& dw,
                     Tensor& dx);

// A weight gradient left for later (zero-bubble pipelines split a backward into the input
// gradient I and the weight gradient W): dw += dy^T x with the kernel linear_backward uses.
struct DeferredWeightGrad {
  Tensor dy, x;
  WeightGrad dw;
};
// While one lives on this thread, linear_backward computes dx only and appends its weight
// gradient's operands to `into`: dy copied (callers overwrite or reuse it), dw by reference, x by
// reference (saved activations are not written afterwards) or, with `copy_inputs`, copied (tensor
// parallelism gathers inputs into pooled buffers that the next layer reuses). Not nestable.
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(std::vector<DeferredWeightGrad>& into, bool copy_inputs = false);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;
};
// While one lives on this thread, linear_backward computes its weight gradient at once even inside
// a DeferWeightGrads: for a caller that works on the gradient right after the GEMM (GLA's
// gk_proj.0 rows, summed over tp). Restores the deferral when it goes.
class WeightGradsNow {
 public:
  WeightGradsNow();
  ~WeightGradsNow();
  WeightGradsNow(const WeightGradsNow&) = delete;
  WeightGradsNow& operator=(const WeightGradsNow&) = delete;

 private:
  std::vector<DeferredWeightGrad>* deferred_;
  bool copy_inputs_;
};
// Runs the deferred weight gradients in the order they were deferred, then clears the list: each
// dw gets the same additions, in the same order, as linear_backward would have given it.
void run_weight_grads(std::vector<DeferredWeightGrad>& list);

// ---- normalization, activation, position -------------------------------------------------------
// y [rows, d] = x / rms(x) * w, rstd [rows] saved for backward. y is f32, or bf16 (rounded in
// the kernel: the bits of the f32 result cast to bf16).
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
// Mixed precision's block input: f32 x rounded to bf16 into x16 and in place, then the norm of the
// rounded x into bf16 y; the bits of ops::cast twice and rmsnorm_forward, in one pass.
void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                    Tensor& rstd);
// dx [rows, d] and dw [d] accumulated; x f32, or bf16 (a saved block input, read widened).
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw);
// act [M, F] = silu(gate) * up, gu [M, 2F] = [gate | up]. act is f32, or bf16 (rounded in the
// kernel: the bits of the f32 result cast to bf16, an f32 denormal flushed to zero where
// cpu::avx512_bf16_native() holds). A bf16 gu (mixed precision's saved gate/up)
// needs a bf16 act, and its gradient dgu is bf16 too (rounded in the kernel).
void swiglu_forward(const Tensor& gu, Tensor& act);
void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu);  // dgu may be gu
// The rotary table where the device's rope kernels read it: the host table (the CPU's kernels read
// it) and, on a GPU, its cos and sin [num_positions, head_dim / 2] f32 in device memory, copied
// once when the table is made (a model makes one per sequence length), never per call.
struct Rope {
  RopeTable host;
  Tensor cos, sin;  // defined on a GPU only
  int64_t num_positions() const { return host.num_positions; }
};
Rope rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s,
                Device device = Device::cpu);
// x [B*T, H*D] (a strided view allowed), rotated in place at positions[t]: positions int32 [T] on
// x's device, each in [0, table.num_positions()) (index_tensor checks them where they are made;
// the CPU kernel checks again, a GPU's gives NaN rows for one outside).
void rope_forward(Tensor& x, int64_t B, int64_t H, const Tensor& positions, const Rope& table);
void rope_backward(Tensor& dx, int64_t B, int64_t H, const Tensor& positions, const Rope& table);
// out [B*T, (H+Hc)*D] (bf16, contiguous) = x [B*T, (H+Hc)*D] (f32, a strided view allowed) with
// its first H heads rotated (by the negative angle when `backward`) and the next Hc heads as they
// are, rounded: rope_forward (rope_backward) and a cast in one pass, the same bits (an f32 denormal
// flushed to zero where cpu::avx512_bf16_native() holds); x unchanged.
void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc, const Tensor& positions,
                  const Rope& table, bool backward, Tensor& out);

// ---- index arrays ------------------------------------------------------------------------------
// Host data the ops read per token (tokens, targets, positions) as a tensor on `device`
// (int32 or int64 [n]): one copy, made where the array is made (once per micro-batch, by
// Model::micro_batch), so that no op copies host data per call. On meta a tensor without data.
// Each value must lie in [lo, hi) (int64 arrays, positions: by default, not negative): the error
// names `what`, the index and the value.
Tensor index_tensor(std::span<const int32_t> values, Device device, const char* what,
                    int64_t lo = INT32_MIN, int64_t hi = INT32_MAX + int64_t{1});
Tensor index_tensor(std::span<const int64_t> values, Device device, const char* what,
                    int64_t lo = 0, int64_t hi = INT64_MAX);

// ---- embedding ------------------------------------------------------------------------------
// out [n, d] = table[tokens]; dtable[tokens] += dout (deterministic). tokens int32 [n] on the
// op's device (index_tensor).
void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& tokens, const Tensor& dout, Tensor& dtable);
// The same over vocabulary rows [v0, v0 + table rows) only: other tokens give zero rows and no
// gradient (a table split by rows across ranks).
void embedding_forward_range(const Tensor& tokens, const Tensor& table, int64_t v0, Tensor& out);
void embedding_backward_range(const Tensor& tokens, const Tensor& dout, int64_t v0, Tensor& dtable);

// ---- attention --------------------------------------------------------------------------------
// Causal grouped-query attention; q [B*T, Hq*D], k and v [B*T, Hkv*D] (strided views allowed),
// out [B*T, Hq*D] and lse [B, Hq, T] written (f32). q, k, v (and in the backward out) are all f32,
// or all bf16: then the bf16 kernels run (bf16 products, P and dS rounded to bf16,
// kernels/cpu/attention_bf16.hpp), and out may be bf16 (rounded as written); dout, dq, dk, dv are
// f32 either way.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                       int64_t Hkv, Tensor& out, Tensor& lse);
// dq, dk, dv (views with the strides of q, k, v) overwritten.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                        Tensor& dq, Tensor& dk, Tensor& dv);
// q [Tq, Hq*D] (the last Tq of L positions) against the cache k, v [>= L, Hkv*D].
void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                      int64_t Hkv, Tensor& out);
// One block of queries against one block of keys at arbitrary global positions (ring
// attention): q as above with Tq = q_pos.size(), k/v with Tk = k_pos.size(). `progress` is
// called between work units (kernels/cpu/attention_block.hpp). The positions are given twice:
// on the host, where the work estimate counts the tiles (on any device, meta included) and the
// CPU's kernels read them, and as int64 tensors on the op's device (index_tensor, made once per
// micro-batch), which a GPU's kernels read; on the CPU and meta these may be left out.
struct AttentionBlock {
  int64_t B = 0, Hq = 0, Hkv = 0;
  const std::vector<int64_t>* q_pos = nullptr;
  const std::vector<int64_t>* k_pos = nullptr;
  const Tensor* q_pos_device = nullptr;
  const Tensor* k_pos_device = nullptr;
};
void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, Tensor& out, Tensor& lse,
                             const std::function<void()>& progress = {});
// Adds this block pair's dq, dk, dv given the final lse and delta of the query rows.
void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& lse, const Tensor& delta,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const std::function<void()>& progress = {});
// Folds (out_b, lse_b) into the running (out, lse); out [B*T, Hq*D], lse [B, Hq, T].
void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b);
// delta [B, Hq, T] = rowsum(dout * out) per head.
void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout, Tensor& delta);

// ---- GLA (gated linear attention, kernels/cpu/gla*.hpp)
// ------------------------------------------ The chunked core: q [B*T, H*K], k and gk [B*T, Hkv*K],
// v [B*T, Hkv*V] (strided views allowed), h0 [B, H, K, V] or undefined (zero state); o [B*T, H*V]
// written, ht [B, H, K, V] written when defined. The scale is K^-1/2.
struct Gla {
  int64_t B = 0, H = 0, Hkv = 0;
  int64_t chunk = 64, sub_chunk = 16;
};
void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                 const Tensor& h0, Tensor& o, Tensor& ht);
// dq, dk, dv, dgk (views with the strides of q, k, v, gk) overwritten, dh0 when defined; dht may
// be undefined (zero).
void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                  const Tensor& h0, const Tensor& dout, const Tensor& dht, Tensor& dq, Tensor& dk,
                  Tensor& dv, Tensor& dgk, Tensor& dh0);
// Context parallelism by state passing: decay [B, Hkv, K] = the sum of gk [B*T, Hkv*K] over each
// sample's T tokens; S [B, H, K, V] <- Diag(e^decay) S + E (decay of each head's kv head).
void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay);
void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S);
// gk = max(logsigmoid(z + bias) / normalizer, clamp_min), z and gk contiguous [M, width] (gk may
// be z), bias [width] or undefined. Backward: dz overwritten, dbias accumulated (with bias).
void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                      Tensor& gk);
void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                       float clamp_min, Tensor& dz, Tensor& dbias);
// y [M, heads*dim] = rmsnorm per head of x times w [dim] times swish(g); g (a strided view allowed)
// and w may be undefined (no gate, no weight). rstd [M*heads] saved.
void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                           float eps, Tensor& y, Tensor& rstd);
// dx overwritten, dg (strides of g) overwritten when g is defined, dw accumulated when w is.
void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                            const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg, Tensor& dw);
// y [B*T, C] = silu(causal depthwise conv(x)), x a strided view allowed, w [C, W] (or fla's
// [C, 1, W]). dx overwritten (strides of dx's view), dw accumulated.
void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y);
void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B, Tensor& dx,
                         Tensor& dw);

// ---- mixture of experts (kernels/cpu/moe.hpp; docs/decisions/moe.md) -------------------------
// Every tensor of these ops is contiguous and on one device; expert and row indices are int32.
// The router's choice for M tokens over E experts: probs [M, E] f32 = softmax(logits [M, E] f32)
// (probs may be logits: in place); each token's k experts (k = experts' columns), chosen by
// probs + bias (bias [E] f32: DeepSeek-V3's selection-only bias; undefined: none), largest first,
// ties to the lower expert index: experts [M, k] i32; their weights [M, k] f32 = the chosen probs
// (never the bias), divided by their sum with `renormalize`. prob_sum [E] f32, where defined,
// gets the column sums of probs added (the auxiliary loss's P; summed in double in token order,
// added once). On cpu the bits do not depend on the thread count (kernels/cpu/moe.hpp).
void moe_route(const Tensor& logits, const Tensor& bias, bool renormalize, Tensor& probs,
               Tensor& experts, Tensor& weights, Tensor& prob_sum);
// dlogits [M, E] f32 overwritten (may be probs: in place): the gradient of the weights
// (dweights [M, k] f32) and, where defined, dprob [E] f32 added to every token's probability
// gradient (the auxiliary loss, linear in the probabilities), through the renormalization and the
// softmax.
void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                        const Tensor& dweights, bool renormalize, const Tensor& dprob,
                        Tensor& dlogits);
// Tokens grouped by expert: a stable counting sort of the M*k assignments (assignment a = t*k + j,
// token t's j-th choice). order [N] i32 lists the kept assignments expert by expert, each
// expert's in token order; pos [M*k] i32 is each assignment's row in that order (-1: dropped);
// counts[e] the rows of expert e (host memory: the GEMMs are sized by them). capacity > 0 keeps
// at most `capacity` rows per expert (the first in token order; `dropped` counts the rest); 0
// keeps every one (dropless). On meta (no data) the rows are spread evenly over the experts (the
// balanced case the planner prices): N = M*k, or min(M*k, E*capacity), the first N % E experts one
// row more than the others, dropped = M*k - N.
struct MoePermutation {
  Tensor order, pos;
  std::vector<int64_t> counts;
  int64_t dropped = 0;
  int64_t rows() const;  // N: the sum of counts
};
MoePermutation moe_permute(const Tensor& experts, int64_t E, int64_t capacity);
// The same with a capacity per expert (E values >= 0: expert e keeps its first capacity[e] rows;
// empty: every row). On meta each expert's even share is capped by its capacity.
MoePermutation moe_permute(const Tensor& experts, int64_t E, std::span<const int64_t> capacity);
// xs [N, d] = the rows of x [M, d] in `order` (row i is token order[i] / k); one dtype.
void moe_dispatch(const Tensor& x, const Tensor& order, int64_t k, Tensor& xs);
// dx [M, d] f32 = (+= with accumulate) the sum of each token's kept rows of dxs [N, d] f32, in
// choice order j = 0..k-1.
void moe_dispatch_backward(const Tensor& dxs, const Tensor& pos, int64_t k, Tensor& dx,
                           bool accumulate);
// y [M, d] f32 += sum over token t's kept choices j (in j order) of weights[t, j] *
// ys[pos[t*k + j]]; ys [N, d] f32 or bf16 (read widened). Each element: ((y + w0 ys0) + w1 ys1)
// + ..., f32 products and sums.
void moe_combine(const Tensor& ys, const Tensor& weights, const Tensor& pos, Tensor& y);
// For moe_combine: dys [N, d] = weights[t, j] * dy[t] at each kept row (f32, or bf16 rounded: the
// GEMM's input); dweights [M, k] f32 = dy[t] . ys[pos[t*k + j]] (0 where dropped).
void moe_combine_backward(const Tensor& dy, const Tensor& ys, const Tensor& weights,
                          const Tensor& pos, Tensor& dys, Tensor& dweights);
// Expert e's rows of x [N, K] (the counts[e] rows after those of experts 0..e-1) times its
// matrix: y rows = x rows w[e]^T, w[e] the expert's GEMM weight (its first parameter's tensor,
// read as y's columns of rows, as linear reads one). One ops::linear per expert with rows on row
// slices of x and y (so meta booking, the op profile and DeferWeightGrads see plain linears); an
// expert with none does nothing.
void grouped_linear(const Tensor& x, std::span<const Tensor> w, std::span<const int64_t> counts,
                    Tensor& y);
// For grouped_linear: dx [N, K] overwritten, dw[e] += expert e's dy^T x (linear_backward's, also
// under DeferWeightGrads, which keeps one copy of the whole dy: the same memory for any routing);
// an expert with no rows leaves its gradient as it is.
void grouped_linear_backward(const Tensor& dy, const Tensor& x, std::span<const Tensor> w,
                             std::span<const int64_t> counts, std::span<const WeightGrad> dw,
                             Tensor& dx);

// ---- biases and gates (Qwen2-MoE; kernels/cpu/bias_gate.hpp) ------------------------------------
// Every tensor f32 unless said otherwise, all on one device. On cpu the bits do not depend on the
// thread count.
// y [M, N] += b [N] on every row (the attention's q, k and v biases): y a 2-d f32 tensor or a
// strided 2-d view (a column slice of a fused GEMM's output), b f32 with N elements, contiguous.
void add_bias(Tensor& y, const Tensor& b);
// db [N] += the column sums of dy [M, N] (a strided 2-d view allowed), each column summed in
// double in row order and added once (the same bits for any thread count).
void bias_grad(const Tensor& dy, Tensor& db);
// Qwen2-MoE's shared expert: y [M, d] += sigmoid(z[t]) * ys[t, :] on each row t, z [M, 1] (the
// gate's logit), ys [M, d] f32 or bf16 (read widened); contiguous. The sigmoid is stable for any
// |z| (e^-|z| only); each element is the f32 product rounded, then added.
void sigmoid_gate_forward(const Tensor& z, const Tensor& ys, Tensor& y);
// Its backward for dy [M, d]: dys [M, d] = sigmoid(z[t]) * dy[t] (f32, or bf16 rounded: a GEMM's
// input); dz [M, 1] overwritten = (dy[t] . ys[t]) * s (1 - s), the dot accumulated in double;
// contiguous.
void sigmoid_gate_backward(const Tensor& dy, const Tensor& z, const Tensor& ys, Tensor& dys,
                           Tensor& dz);

// ---- loss -------------------------------------------------------------------------------------
// The output projection fused with cross-entropy (kernels/cpu/cross_entropy.hpp): x [N, D],
// w [V, D] in the compute dtype, dx [N, D] overwritten, dw [V, D] accumulated; targets int32 [N]
// on the op's device (index_tensor; < 0: ignored; >= V an error on the CPU, checked on the host
// where they are made for a GPU). The summed loss is written into `loss`, a float64 [1] tensor on
// the op's device, where a GPU leaves it for the caller to read with others (model/loss_slots.hpp);
// without one, the op returns it (a GPU waits for it). 0 on meta.
struct LinearCrossEntropy {
  Tensor x, w, dx;
  WeightGrad dw;  // its first write (WeightGrad::unwritten) is the first group of rows' dW
  Tensor targets;
  int64_t V = 0;
  float grad_scale = 1;
  int64_t chunk_rows = 0;
  int64_t grad_rows = 0;  // cpu::LinearCrossEntropyArgs::grad_rows
  Tensor loss;            // float64 [1]: the summed loss written here (optional)
};
double linear_cross_entropy(const LinearCrossEntropy& a);
// The pieces of a softmax over a vocabulary split across ranks (kernels/cpu/sharded.hpp).
// targets: int32 tensors on the op's device, one per row of logits (lse_all's columns).
void vocab_shard_lse(const Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                     Tensor& lse, Tensor& target_logit);
// The summed loss written into `loss` (float64 [1] on the op's device).
void vocab_shard_combine(const Tensor& lse_all, const Tensor& targets, const Tensor& target_logit,
                         Tensor& glse, Tensor& loss);
void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                         const Tensor& glse, float grad_scale);

}  // namespace loom::ops
