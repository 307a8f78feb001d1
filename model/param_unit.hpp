#pragma once
// Parameters are grouped into units (one per transformer block, one for the embedding, one for the
// final norm + output head): the FSDP unit of docs/design.md decision 3. A unit owns one flat f32
// buffer of master weights, one flat f32 gradient buffer and, with bf16 mixed precision, a flat
// bf16 mirror that the GEMMs read. Each parameter is a view at an offset in those buffers, so
// adjacent parameters (q, k, v; gate, up) can be read as one fused matrix.
//
// Sharded units (docs/design.md decision 2). A unit sharded over N ranks pads its flat size to
// P = ceil(numel / N) * N and keeps only its shard of S = P / N elements, [rank * S, rank * S + S)
// of the flat layout: the f32 master shard and the f32 gradient shard (the padding is zero and
// never updated). The full weights and the full f32 gradient exist only between
// materialize_*() and release_*(); the parameter views point into them while they exist. Filling
// the full weights is the caller's job (parallel/: an all-gather of gather_input() into
// full_weights(), and, when needs_side(), an all-reduce (sum) of side_f32()), followed by
// finish_gather(). In which dtype the full weights are gathered:
//   - f32 mixed precision: f32;
//   - bf16, units whose f32-read parameters (f32_value: norms, the embedding table) are small:
//     bf16 (what the GEMMs read), plus the f32 values of those parameters in a side buffer that
//     every rank fills with its own elements and zeros (a sum then gives exact f32 values);
//   - bf16, units that are mostly f32-read (the embedding): f32, rounded locally to a bf16 copy
//     for the GEMMs (a tied output head), exactly as the unsharded mirror is made.
// An unsharded unit (N = 1) is the single-process unit: everything is always materialized, the
// master and gradient "shards" are the whole flat buffers, and materialize/release do nothing.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "ops/ops.hpp"

namespace loom {

enum class Init { normal, ones };

// How tensor parallelism splits a parameter (docs/design.md decision 5, Megatron): `rows` (column
// parallel: q, k, v, gate, up; the vocabulary rows of the embedding and the output head) keeps
// rows [rank R/tp, (rank + 1) R/tp), `cols` (row parallel: o, down) columns [rank C/tp, ...).
// `experts`: a mixture of experts' expert matrix, whole, held by one tp rank of each group (the
// experts are divided over tp: docs/decisions/moe.md), so its name says whose it is.
enum class TpSplit { none, rows, cols, experts };

struct ParamSpec {
  std::string name;  // global Hugging Face name
  Shape shape;       // this tp rank's local shape (the global shape without tensor parallelism)
  Init init = Init::normal;
  float std = 0.02f;
  bool decay = true;       // weight decay applies (not to norms)
  bool f32_value = false;  // read as f32 by non-GEMM kernels (norms, the embedding lookup)
  TpSplit split = TpSplit::none;
  int tp_rank = 0, tp_count = 1;
  // Rows split only: the rows of the whole tensor when they are fewer than rows x tp_count (a
  // vocabulary padded to a multiple of tp, as Megatron does). The rows past it are padding: zero,
  // never read from or written to a checkpoint. 0: no padding.
  int64_t global_rows = 0;
  // Only weight-gradient GEMMs write the gradient, through ParamUnit::weight_grad (the parameter
  // or the first of a fused matrix): zero_grad may leave it unwritten instead of zeroing it.
  bool gemm_grad = false;

  // The shape of the whole tensor (the checkpoint's, Hugging Face's), without padding.
  Shape global_shape() const;
  // Elements of the whole tensor without padding: global element indices at or past it are
  // padding rows.
  int64_t global_numel() const { return shape_numel(global_shape()); }
  // Elements [local_begin, local_begin + count) of the local tensor, as runs of consecutive
  // global (row-major) element indices: fn(global_begin, n, local_offset) per run. A row-parallel
  // slice is one run per row.
  template <class Fn>
  void for_global_runs(int64_t local_begin, int64_t count, Fn&& fn) const;
};

template <class Fn>
void ParamSpec::for_global_runs(int64_t local_begin, int64_t count, Fn&& fn) const {
  const int64_t local_numel = shape_numel(shape);
  if (split == TpSplit::none || split == TpSplit::experts || tp_count == 1) {
    fn(local_begin, count, local_begin);
  } else if (split == TpSplit::rows) {
    fn(int64_t(tp_rank) * local_numel + local_begin, count, local_begin);
  } else {
    const int64_t lc = shape[1], gc = lc * tp_count;
    for (int64_t i = local_begin, end = local_begin + count; i < end;) {
      const int64_t r = i / lc, c = i % lc, n = std::min(end - i, lc - c);
      fn(r * gc + int64_t(tp_rank) * lc + c, n, i);
      i += n;
    }
  }
}

struct Param {
  ParamSpec spec;
  int64_t offset = 0;  // in elements, within the unit's flat buffers
  Tensor value;        // f32 weights (view; in sharded bf16 units only f32_value parameters)
  Tensor grad;         // f32 gradient (view)
  Tensor value_bf16;   // bf16 mirror (view; undefined without bf16 mixed precision)
};

// Elements [local_begin, local_begin + count) of this tp rank's part of `spec`, read from the
// global tensor `name` of a safetensors reader (SafetensorsDir or SafetensorsFile): only the
// rows that hold them are read.
template <class Reader>
void read_param_slice(const Reader& f, const std::string& name, const ParamSpec& spec,
                      int64_t local_begin, int64_t count, float* out) {
  const Shape g = spec.global_shape();
  const int64_t row = g.empty() ? 1 : shape_numel(g) / g[0];
  const int64_t real = spec.global_numel();
  // Whole rows go straight to `out`; a run that starts or ends inside a row reads that row into
  // one row of scratch, so a load holds no copy of a slice (a shard's runs start anywhere).
  Tensor scratch;
  spec.for_global_runs(local_begin, count, [&](int64_t gb, int64_t n, int64_t local) {
    // Padding rows (past the real ones) are not in the file: zero.
    const int64_t keep = std::clamp<int64_t>(real - gb, 0, n);
    float* dst = out + (local - local_begin);
    std::fill_n(dst + keep, n - keep, 0.0f);
    n = keep;
    while (n > 0) {
      const int64_t r = gb / row, c = gb % row;
      if (c == 0 && n >= row) {
        const int64_t whole = n / row;
        f.read_f32(name, g, dst, r, whole);
        gb += whole * row, dst += whole * row, n -= whole * row;
        continue;
      }
      if (!scratch.defined()) scratch = Tensor::empty({row}, DType::f32);
      const int64_t take = std::min(n, row - c);
      f.read_f32(name, g, scratch.data<float>(), r, 1);
      std::copy_n(scratch.data<float>() + c, take, dst);
      gb += take, dst += take, n -= take;
    }
  });
}

// This rank's place among the ranks that shard a unit, and where its shard lives.
struct ShardLayout {
  int rank = 0, count = 1;
  // CPU offload (docs/design.md decision 4, training.enable_cpu_offload): the f32 master and
  // gradient shards (and the optimizer's moments, which follow the master) are in the host pool;
  // the device holds a unit only while it is gathered. Sharded units only.
  bool offload = false;
  bool sharded() const { return count > 1; }
};

// Elements [begin, begin + count) of parameter `param` are elements
// [shard_offset, shard_offset + count) of this rank's shard.
struct ShardSlice {
  size_t param = 0;
  int64_t begin = 0, count = 0, shard_offset = 0;
};

class ParamUnit {
 public:
  ParamUnit(std::string name, std::vector<ParamSpec> specs, bool bf16_mirror, Device device,
            ShardLayout shard = {});

  const std::string& name() const { return name_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  const Param& param(const std::string& name) const;
  int64_t numel() const { return numel_; }
  Device device() const { return device_; }

  // Full flat buffers (unsharded: always; sharded: while materialized).
  Tensor& flat() { return flat_; }
  Tensor& grad_flat() { return grad_flat_; }
  Tensor& flat_bf16() { return flat_bf16_; }
  bool has_bf16() const { return bf16_; }

  // The weights a GEMM reads, starting at parameter `first` (adjacent parameters with the same
  // number of columns read as one fused matrix): the bf16 mirror if there is one, else f32.
  const void* gemm_weights(size_t first) const;
  // The same as a tensor: parameter `first`'s weights in the GEMM's dtype (ops::linear reads the
  // fused rows that follow it).
  const Tensor& gemm_weight(size_t first) const;
  float* grad_data(size_t first) { return params_[first].grad.data<float>(); }

  void init_weights(uint64_t seed);  // Philox, a function of (seed, name, element index)
  void refresh_bf16();               // mirror <- round(master) (unsharded)
  // The gradient shard (and full gradient if materialized) to zero. An unsharded unit leaves
  // the gradients of gemm_grad parameters as they are, marked unwritten: their first GEMM writes
  // instead of adding, so neither this pass nor the GEMM touches the stale values (a cold read of
  // every weight gradient: 2% of a bench-tiny bf16 step). A sharded unit's full gradient gets the
  // same treatment each time it is materialized.
  void zero_grad();
  // Parameters [first, first + count)'s gradient for a dW GEMM (count: a fused matrix).
  ops::WeightGrad weight_grad(size_t first, size_t count = 1);
  // Fails, naming the parameter, if a gradient zero_grad left unwritten was not written since:
  // its values are stale, not zero. Before anything reads the gradients as a whole.
  void check_grads_written() const;

  // Sharding. Unsharded: padded = shard = numel, shard_begin = 0.
  const ShardLayout& shard_layout() const { return shard_; }
  bool sharded() const { return shard_.sharded(); }
  int64_t padded_numel() const { return padded_; }
  int64_t shard_numel() const { return padded_ / shard_.count; }
  int64_t shard_begin() const { return shard_numel() * shard_.rank; }
  bool offloaded() const { return sharded() && shard_.offload; }  // the shards are in Pool::host
  Tensor& master_shard() { return sharded() ? master_ : flat_; }  // f32 [S]
  Tensor& grad_shard() { return sharded() ? grad_shard_ : grad_flat_; }  // f32 [S]
  std::vector<ShardSlice> shard_slices() const;

  bool weights_materialized() const { return !sharded() || full_.defined(); }
  bool grads_materialized() const { return !sharded() || grad_flat_.defined(); }
  void materialize_weights();  // allocates the full buffers (contents undefined until gathered)
  void release_weights();
  // Allocates the full f32 gradient, zeroed but for the gemm_grad parameters, marked unwritten
  // as zero_grad marks them (check_grads_written before it is reduced).
  void materialize_grads();
  void release_grads();

  // The gather of a materialized sharded unit (see the top of the file).
  DType gather_dtype() const;
  Tensor& full_weights() { return full_; }  // [P] in gather_dtype()
  Tensor gather_input();                    // this rank's block of full_weights(), filled
  bool needs_side() const { return side_numel_ > 0 && gather_dtype() == DType::bf16; }
  Tensor& side_f32() { return side_; }  // [side numel], filled with this rank's elements
  int64_t side_numel() const { return needs_side() ? side_numel_ : 0; }
  // Bytes allocated by materialize_weights() (0 when unsharded): the gathered buffer, plus the
  // locally rounded bf16 copy or the f32 side buffer.
  size_t materialized_weight_bytes() const;
  void finish_gather();  // after the collectives completed

 private:
  void bind_views();
  void mark_grads_unwritten();  // zeros grad_flat_ but for the gemm_grad parameters, marked

  std::string name_;
  Device device_;
  bool bf16_ = false;
  ShardLayout shard_;
  std::vector<Param> params_;
  int64_t numel_ = 0, padded_ = 0, side_numel_ = 0;
  std::vector<int64_t> side_offset_;  // per parameter: offset in side_ (-1: not f32_value)
  std::vector<uint8_t> unwritten_;    // per parameter: stale gradient (zero_grad, gemm_grad)
  Tensor flat_, grad_flat_, flat_bf16_;
  Tensor master_, grad_shard_;  // sharded only
  Tensor full_, side_;          // sharded only, while materialized
};

}  // namespace loom
