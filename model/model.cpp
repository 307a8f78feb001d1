#include "model/model.hpp"

#include <algorithm>
#include <utility>

#include "core/error.hpp"
#include "model/safetensors.hpp"

namespace loom {

Model::Model(DType compute, Device device, ShardLayout shard, TpOptions tp, CpOptions cp,
             std::vector<bool> used, EpOptions ep)
    : compute_(compute), device_(device), shard_(shard), used_(std::move(used)) {
  LOOM_CHECK(compute == DType::f32 || compute == DType::bf16,
             "compute dtype must be float32 or bfloat16, got ", dtype_name(compute));
  if (tp.size() <= 1) tp.group = nullptr;
  par_ = std::make_unique<ParallelContext>();
  par_->tp.opt = tp;
  par_->tp.pool = &pool_;
  if (cp.size() <= 1) cp.group = nullptr;
  par_->cp = cp;
  if (ep.size() <= 1) ep.group = nullptr;
  par_->ep = ep;
}

Model::~Model() = default;

void Model::set_units(std::unique_ptr<ParamUnit> embed, std::vector<ParamUnit*> blocks,
                      std::unique_ptr<ParamUnit> head) {
  LOOM_CHECK(used_.empty() || used_.size() == blocks.size() + 2, "model: `used` has ", used_.size(),
             " entries; expected one per unit: ", blocks.size() + 2, " (the embedding, ",
             blocks.size(), " blocks, the head)");
  embed_ = std::move(embed);
  blocks_ = std::move(blocks);
  head_ = std::move(head);
}

std::vector<ParamUnit*> Model::units() {
  std::vector<ParamUnit*> u{embed_.get()};
  u.insert(u.end(), blocks_.begin(), blocks_.end());
  u.push_back(head_.get());
  return u;
}

int64_t Model::num_params() const {
  int64_t n = embed_->numel() + head_->numel();
  for (const ParamUnit* b : blocks_) n += b->numel();
  return n;
}

void Model::init_weights(uint64_t seed) {
  // Initial weights are a pure function of (seed, name, index): a rank that skips the units it
  // does not hold gives the others' units no different bit.
  auto all = units();
  for (size_t i = 0; i < all.size(); ++i)
    if (uses(i)) all[i]->init_weights(seed);
}

void Model::load_units(const SafetensorsDir& dir,
                       const std::function<bool(const std::string&)>& zero_if_absent) {
  // A parameter the directory lacks that may start at zero reads as zeros.
  auto absent = [&](const std::string& name) {
    return zero_if_absent && !dir.has(name) && zero_if_absent(name);
  };
  auto all = units();
  for (size_t i = 0; i < all.size(); ++i) {
    if (!uses(i)) continue;
    ParamUnit* u = all[i];
    // The reads go to host memory: the unit's own on the CPU, a copy of a GPU's put back after.
    Tensor& buffer = u->master_shard();
    Tensor h = buffer.on_host();
    float* base = h.data<float>();
    if (!u->sharded()) {
      for (auto& p : u->params()) {
        if (absent(p.spec.name))
          std::fill_n(base + p.offset, shape_numel(p.spec.shape), 0.0f);
        else if (p.spec.split == TpSplit::none || p.spec.split == TpSplit::experts ||
                 p.spec.tp_count == 1)
          dir.read_f32(p.spec.name, p.spec.shape, base + p.offset);
        else
          read_param_slice(dir, p.spec.name, p.spec, 0, shape_numel(p.spec.shape), base + p.offset);
      }
    } else {
      for (const ShardSlice& s : u->shard_slices()) {
        const ParamSpec& spec = u->params()[s.param].spec;
        if (absent(spec.name))
          std::fill_n(base + s.shard_offset, s.count, 0.0f);
        else
          read_param_slice(dir, spec.name, spec, s.begin, s.count, base + s.shard_offset);
      }
    }
    if (buffer.device() != Device::cpu) buffer.copy_from(h);
    if (!u->sharded()) u->refresh_bf16();
  }
}

void Model::zero_grad() {
  auto all = units();
  for (size_t i = 0; i < all.size(); ++i)
    if (uses(i)) all[i]->zero_grad();
}

void Model::check_grads_written() {
  auto all = units();
  for (size_t i = 0; i < all.size(); ++i)
    if (uses(i)) all[i]->check_grads_written();
}

void Model::set_activation_checkpoint(const ActivationCheckpoint& ac) {
  LOOM_CHECK(ac.every_n >= 1, "activation checkpointing: every_n = ", ac.every_n,
             ", expected a positive integer");
  ac_ = ac;
  for (size_t l = 0; l < blocks_.size(); ++l) set_block_checkpoint(l, ac.block_mode(int64_t(l)));
}

void Model::hook(void (UnitHooks::*fn)(size_t), size_t unit) {
  if (hooks_) (hooks_->*fn)(unit);
}

int64_t Model::residual_rows(const StepContext& ctx) const {
  const TpRuntime& tp = par_->tp;
  return tp.sp() ? ctx.tokens() / tp.opt.size() : ctx.tokens();
}

ActivationStore Model::micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B,
                                   int64_t T, float grad_scale) {
  const TpRuntime& tp = par_->tp;
  const int tpn = tp.opt.size();
  const int64_t M = B * T;
  LOOM_CHECK(
      !tp.sp() || M % tpn == 0, "sequence parallelism: the micro-batch's B*T = ", B, "*", T, " = ",
      M, " rows are not divisible by parallelism.tp = ", tpn,
      " (each tp rank holds B*T / tp rows; or set parallelism.tp_sequence_parallel = false)");
  LOOM_CHECK(hooks_ || !shard_.sharded(),
             "forward_backward: a sharded model needs hooks that materialize its units");
  ActivationStore s;
  // The tokens on the run's device, once per micro-batch (the ops read no host arrays), checked
  // here, where they are on the host: a bad token or target names itself before any op runs.
  // Only the stages that read them copy them (the embedding's and the head's).
  const int64_t V = vocab_size();
  if (inputs && uses(0))
    s.inputs = ops::index_tensor({inputs, size_t(M)}, device_, "input token", 0, V);
  if (targets && uses(head_index()))
    s.targets = ops::index_tensor({targets, size_t(M)}, device_, "target token", INT32_MIN, V);
  if (uses(head_index())) s.loss.slot = loss_slots_.take();
  s.grad_scale = grad_scale;
  s.ctx.B = B;
  s.ctx.T = T;
  s.ctx.compute = compute_;
  const int64_t span =
      cp_micro_batch_positions(par_->cp, T, tp.sp() ? tpn : 1, s.ctx.positions, s.ctx.cp_pos);
  s.ctx.positions_device = ops::index_tensor(s.ctx.positions, device_, "position", 0, span);
  for (const std::vector<int64_t>& p : s.ctx.cp_pos)
    s.ctx.cp_pos_device.push_back(ops::index_tensor(p, device_, "position"));
  prepare(s, span);
  s.blocks.resize(blocks_.size());
  return s;
}

Tensor Model::forward(ActivationStore& s, size_t first, size_t last, Tensor x) {
  LOOM_CHECK(first <= last && last <= num_units(), "forward: units [", first, ", ", last, ") of ",
             num_units());
  for (size_t u = first; u < last; ++u) {
    hook(&UnitHooks::before_forward, u);
    if (u == 0) {
      x = embedding_forward(s);
    } else if (u == head_index()) {
      // The head's projection and loss run fused with its backward: keep its input.
      s.head_input = std::exchange(x, Tensor());
    } else {
      x = block_forward(s, u - 1, x);
    }
    hook(&UnitHooks::after_forward, u);
  }
  return x;
}

Tensor Model::backward(ActivationStore& s, size_t first, size_t last, Tensor dy) {
  LOOM_CHECK(first <= last && last <= num_units(), "backward: units [", first, ", ", last, ") of ",
             num_units());
  for (size_t u = last; u-- > first;) {
    hook(&UnitHooks::before_backward, u);
    if (u == head_index()) {
      dy = head_forward_backward(s);
    } else if (u == 0) {
      embedding_backward(s, dy);
    } else {
      block_backward(s, u - 1, dy);
    }
    hook(&UnitHooks::after_backward, u);
    if (u == head_index()) s.head_input = Tensor();
    if (u == 0) dy = Tensor();
  }
  return dy;
}

Tensor Model::backward_input(ActivationStore& s, size_t first, size_t last, Tensor dy,
                             DeferredWeightGrads& deferred) {
  // Under tp the inputs may be gathered into pooled buffers that the next layer reuses (without
  // the copies pp2 x tp2 zb1p ended 1.7e-2 off one process in its final weights).
  const ops::DeferWeightGrads defer(deferred, tp().size() > 1);
  return backward(s, first, last, std::move(dy));
}

PendingLoss Model::forward_backward_pending(const int32_t* inputs, const int32_t* targets,
                                            int64_t B, int64_t T, float grad_scale) {
  ActivationStore s = micro_batch(inputs, targets, B, T, grad_scale);
  backward(s, 0, num_units(), forward(s, 0, num_units()));
  return s.loss;
}

double Model::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                               float grad_scale) {
  return loss_slots_.read(forward_backward_pending(inputs, targets, B, T, grad_scale));
}

}  // namespace loom
