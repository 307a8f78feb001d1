#include "model/moe.hpp"

#include <algorithm>
#include <any>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "distributed/group_sum.hpp"
#include "model/head.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

namespace {

// What a micro-batch's ActivationStore::extra holds.
struct MoeMicroBatch {
  RouterStats stats;
  double aux_loss = 0;
};

// Tensor parallelism splits the heads, a dense layer's and a shared expert's ffn and the experts
// (whole, E / (ep x tp) per rank); the router and the experts read every row of the tp group,
// gathered from the ranks' rows: sequence parallelism is required.
void check_tp(const MoeConfig& c, const TpOptions& tp, int ep) {
  const int n = tp.size();
  if (n == 1) return;
  LOOM_CHECK(tp.sequence_parallel,
             "parallelism.tp_sequence_parallel = false: a mixture-of-experts model (",
             c.model_type(),
             ") runs tensor parallelism with sequence parallelism (each tp rank normalizes its "
             "rows; the router and the experts read them gathered); expected true");
  const LlamaConfig& b = c.base;
  std::vector<std::pair<const char*, int64_t>> split{
      {"num_attention_heads", b.num_attention_heads},
      {"num_key_value_heads", b.num_key_value_heads}};
  if (c.num_sparse_layers() < b.num_hidden_layers)
    split.push_back({"intermediate_size", b.intermediate_size});
  if (c.shared_expert_intermediate_size > 0)
    split.push_back({"shared_expert_intermediate_size", c.shared_expert_intermediate_size});
  for (auto [what, v] : split)
    LOOM_CHECK(v % n == 0, "tensor parallelism: model ", what, " = ", v,
               " is not divisible by parallelism.tp = ", n, " (every tp rank holds ", what,
               " / tp)");
  LOOM_CHECK(c.num_experts % (int64_t(ep) * n) == 0, "parallelism.ep x parallelism.tp = ", ep,
             " x ", n, ": expected a divisor of the model's ", c.num_experts, " experts (",
             c.family == MoeConfig::Family::mixtral ? "num_local_experts" : "num_experts",
             "): each tp rank of an ep rank computes E / (ep x tp) of them");
}

std::vector<int64_t> sparse_layers(const MoeConfig& c) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < c.base.num_hidden_layers; ++l)
    if (c.sparse(l)) out.push_back(l);
  return out;
}

MoeMicroBatch& state(ActivationStore& s) {
  if (!s.extra.has_value()) s.extra = MoeMicroBatch();
  return std::any_cast<MoeMicroBatch&>(s.extra);
}

}  // namespace

MoeModel::MoeModel(const MoeConfig& config, DType compute, Device device, ShardLayout shard,
                   TpOptions tp, CpOptions cp, std::vector<bool> used, EpOptions ep)
    : Model(compute, device, shard, tp, cp, std::move(used), ep),
      config_(config),
      balance_(sparse_layers(config), config.num_experts, config.num_experts_per_tok,
               config.training.bias_update_rate, config.load_warning_threshold(),
               config.training.capacity_factor > 0) {
  config_.validate("model config");
  const LlamaConfig& c = config_.base;
  const int n = tp.size(), r = tp.rank();
  LOOM_CHECK(config_.num_experts % ep.size() == 0, "parallelism.ep = ", ep.size(),
             ": expected a divisor of the model's ", config_.num_experts, " experts (",
             config_.family == MoeConfig::Family::mixtral ? "num_local_experts" : "num_experts",
             "): each ep rank holds E / ep of them");
  check_tp(config_, tp, ep.size());
  const bool bf = compute == DType::bf16;
  const VocabSpecs vs =
      llama_vocab_specs(moe_plan(), c.vocab_size, c.hidden_size, c.tie_word_embeddings, r, n);
  auto embed = std::make_unique<ParamUnit>("embed", std::vector<ParamSpec>{vs.embedding}, bf,
                                           unit_device(0), shard);
  std::vector<ParamUnit*> block_units;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const Device dev = unit_device(block_units.size() + 1);
    attention_.push_back(std::make_unique<MoeAttentionBlock>(config_, l, bf, dev, shard, &par()));
    block_units.push_back(&attention_.back()->unit());
    order_.push_back({l, false});
    experts_.push_back(nullptr);
    if (!config_.sparse(l)) continue;
    experts_.back() = std::make_unique<MoeExpertsBlock>(config_, l, bf, dev, shard, &par());
    block_units.push_back(&experts_.back()->unit());
    order_.push_back({l, true});
  }
  const size_t head = block_units.size() + 1;
  set_units(std::move(embed), std::move(block_units),
            std::make_unique<ParamUnit>("head", vs.head, bf, unit_device(head), shard));
}

std::string MoeModel::describe() const {
  const LlamaConfig& c = config_.base;
  return str_cat(config_.model_type(), ": dim ", c.hidden_size, ", ", c.num_hidden_layers,
                 " layers (", config_.num_sparse_layers(), " with experts), ",
                 c.num_attention_heads, "/", c.num_key_value_heads, " heads of ", config_.head_dim,
                 ", ", config_.num_experts, " experts of ffn ", config_.moe_intermediate_size,
                 ", top-", config_.num_experts_per_tok, ", vocab ", c.vocab_size, "; ",
                 config_.num_active_params(), " of ", config_.num_params(), " parameters active");
}

const RouterStats& MoeModel::router_stats(const ActivationStore& s) {
  static const RouterStats none;
  const auto* m = std::any_cast<MoeMicroBatch>(&s.extra);
  return m ? m->stats : none;
}

double MoeModel::aux_loss(const ActivationStore& s) {
  const auto* m = std::any_cast<MoeMicroBatch>(&s.extra);
  return m ? m->aux_loss : 0.0;
}

void MoeModel::load_hf(const SafetensorsDir& dir) {
  auto is_bias = [](const std::string& n) { return n.ends_with(".e_score_correction_bias"); };
  // A bias the model would not read changes the routing the weights were trained with.
  if (!config_.expert_bias)
    for (const std::string& n : dir.names())
      LOOM_CHECK(!is_bias(n), "the weights hold '", n,
                 "' (a selection-only bias) but the model has none: build it from their "
                 "config.json (\"loom_expert_bias\": true) or with moe.bias_update_rate > 0");
  load_units(dir, is_bias);
}

bool MoeModel::expert_unit(size_t unit) const {
  return par().ep.group && unit >= 1 && unit <= order_.size() && order_[unit - 1].experts;
}

std::vector<std::string> MoeModel::held_elsewhere() const {
  std::vector<std::string> out;
  const int64_t El = local_experts(config_, par()), first = first_expert(config_, par());
  if (El == config_.num_experts) return out;
  using M = MoeConfig::ExpertMatrix;
  for (int64_t l = 0; l < config_.base.num_hidden_layers; ++l) {
    if (!config_.sparse(l)) continue;
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      if (e >= first && e < first + El) continue;
      for (M m : {M::gate, M::up, M::down}) out.push_back(config_.expert_param(l, e, m));
    }
  }
  return out;
}

std::vector<ModelMetric> MoeModel::take_step_metrics() {
  balance_.close_step();
  const StepSums s = std::exchange(step_, StepSums());
  if (config_.num_sparse_layers() == 0) return {};
  // The same names on every rank, zeros where no head ran (a pipeline rank without the last
  // stage: its micro-batches' statistics travelled on to the head's rank).
  return {{"aux_loss", "aux", s.micro_batches > 0 ? s.aux / double(s.micro_batches) : 0.0},
          {"expert_load", "load", s.load},
          {"dropped", "drop", s.choices > 0 ? s.dropped / s.choices : 0.0}};
}

std::vector<std::string> MoeModel::after_update(dist::ProcessGroup* dp, dist::ProcessGroup* pp) {
  std::vector<std::pair<ParamUnit*, size_t>> biases;
  if (config_.expert_bias)
    for (auto& a : attention_)
      if (a->sparse()) biases.emplace_back(&a->unit(), a->bias_param());
  return balance_.after_update(dp, par().cp.group, pp, biases);
}

const ops::Rope& MoeModel::rope_for(int64_t T) {
  if (rope_.num_positions() >= T) return rope_;
  const LlamaConfig& c = config_.base;
  // On meta its size only, and the device copy where the meta run models a GPU (ops).
  rope_ = ops::rope_table(config_.head_dim, T, c.rope_theta, c.rope_scaling, device_);
  return rope_;
}

void MoeModel::prepare(ActivationStore& s, int64_t span) {
  s.ctx.rope = &rope_for(span);
  state(s);
}

void MoeModel::set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) {
  const SubBlock b = order_[block];
  if (b.experts)
    experts_[size_t(b.layer)]->set_checkpoint(mode);
  else
    attention_[size_t(b.layer)]->set_checkpoint(mode);
}

// An experts block reads the routing its layer's attention block (the block before it) saved.
Tensor MoeModel::block_forward(ActivationStore& s, size_t block, const Tensor& x) {
  const SubBlock b = order_[block];
  if (!b.experts) {
    if (!s.blocks[block].has_value()) s.blocks[block] = MoeAttentionActs();
    return attention_[size_t(b.layer)]->forward(
        s.ctx, x, std::any_cast<MoeAttentionActs&>(s.blocks[block]), state(s).stats);
  }
  if (!s.blocks[block].has_value()) s.blocks[block] = MoeExpertsActs();
  return experts_[size_t(b.layer)]->forward(
      s.ctx, std::any_cast<MoeAttentionActs&>(s.blocks[block - 1]).routing,
      std::any_cast<MoeExpertsActs&>(s.blocks[block]));
}

void MoeModel::block_backward(ActivationStore& s, size_t block, Tensor& dy) {
  const SubBlock b = order_[block];
  if (!b.experts) {
    attention_[size_t(b.layer)]->backward(
        s.ctx, dy, std::any_cast<MoeAttentionActs&>(s.blocks[block]), state(s).stats);
    return;
  }
  experts_[size_t(b.layer)]->backward(s.ctx, dy,
                                      std::any_cast<MoeAttentionActs&>(s.blocks[block - 1]).routing,
                                      std::any_cast<MoeExpertsActs&>(s.blocks[block]));
}

Tensor MoeModel::embedding_forward(ActivationStore& s) {
  Tensor x = Tensor::empty({residual_rows(s.ctx), config_.base.hidden_size}, DType::f32, device_);
  vocab_parallel_embedding_forward(par().tp, s.inputs, embed_unit().params()[0].value,
                                   vocab_first(), x);
  return x;
}

void MoeModel::embedding_backward(ActivationStore& s, const Tensor& dx) {
  vocab_parallel_embedding_backward(par().tp, s.inputs, dx, vocab_first(),
                                    embed_unit().params()[0].grad);
}

// transformers' load_balancing_loss_func over the micro-batch's sparse layers, their tokens
// concatenated: aux = E * sum_e f_e P_e, f_e = the share of the N = layers x tokens rows' top-k
// choices that went to expert e (summing to k), P_e = the mean probability of e. The training
// loss is the cross-entropy's mean plus coef x aux per micro-batch: in loom's summed loss
// (divided by the step's tokens) it weighs coef x aux x the micro-batch's tokens. f_e is a count:
// the gradient flows through P only, d/dp = coef x tokens x E x f_e / N for every row. Under
// context parallelism the micro-batch's tokens are spread over the cp ranks: the statistics are
// summed over them first (2E + 2 numbers, the dropped choices' too), each rank adds its tokens'
// share of the term.
void MoeModel::add_aux_loss(ActivationStore& s) {
  MoeMicroBatch& m = state(s);
  RouterStats& st = m.stats;
  const int64_t E = config_.num_experts;
  if (config_.num_sparse_layers() == 0) return;
  const bool train_aux = trains_aux();
  const int cp = par().cp.size();
  // counts [E], prob_sum [E], rows, dropped.
  std::vector<double> sums(size_t(2 * E + 2), 0.0);
  if (!st.counts.empty()) {
    std::copy(st.counts.begin(), st.counts.end(), sums.begin());
    std::copy(st.prob_sum.begin(), st.prob_sum.end(), sums.begin() + E);
    sums[size_t(2 * E)] = double(st.rows);
    sums[size_t(2 * E + 1)] = double(st.dropped);
  }
  if (cp > 1) sums = group_sum_each(par().cp.group, sums);  // on meta too: the same traffic
  step_.micro_batches += 1;
  if (!ops::computes(device_)) {
    // Nothing routed on meta; the step's metrics still travel (the same collectives as a run).
    if (train_aux) st.dprob = Tensor::empty({E}, DType::f32, device_);  // booked only
    return;
  }
  balance_.add(st.layer_counts);
  const double N = sums[size_t(2 * E)], tokens = double(s.ctx.tokens()) * cp;
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) aux += (sums[size_t(e)] / N) * (sums[size_t(E + e)] / N);
  m.aux_loss = double(E) * aux;
  step_.aux += m.aux_loss;
  for (double r : st.load_max_over_mean) step_.load = std::max(step_.load, r);
  step_.dropped += sums[size_t(2 * E + 1)];  // the micro-batch's, over the cp ranks
  step_.choices += N * double(config_.num_experts_per_tok);
  if (!train_aux) return;
  const double coef = config_.router_aux_loss_coef;
  s.loss.extra += coef * m.aux_loss * double(s.ctx.tokens());  // this rank's tokens' share
  Tensor g = Tensor::empty({E}, DType::f32, Device::cpu);
  for (int64_t e = 0; e < E; ++e)
    g.data<float>()[e] =
        float(double(s.grad_scale) * coef * tokens * double(E) * sums[size_t(e)] / (N * N));
  if (device_ == Device::cpu) {
    st.dprob = g;
  } else {
    st.dprob = Tensor::empty({E}, DType::f32, device_);
    ops::copy(g, st.dprob);
  }
}

// The final norm, then the output projection fused with the loss (model/head.hpp), then the
// auxiliary loss: its gradient is needed by every sparse block's backward, which follow.
Tensor MoeModel::head_forward_backward(ActivationStore& s) {
  const LlamaConfig& c = config_.base;
  const LlamaModel::LossChunks chunks = LlamaModel::loss_chunks(c, s.ctx.B, s.ctx.T, compute_);
  const LossHead head{.tp = par().tp,
                      .plan = moe_plan(),
                      .precision = MoeAttentionBlock::kPrecision,
                      .tied = c.tie_word_embeddings,
                      .M = s.ctx.tokens(),
                      .Mx = residual_rows(s.ctx),
                      .d = c.hidden_size,
                      .vocab = c.vocab_size,
                      .eps = float(c.rms_norm_eps),
                      .compute = compute_,
                      .chunk_rows = chunks.rows,
                      .grad_rows = chunks.grad_rows};
  Tensor dx = head.forward_backward(head_unit(), embed_unit(), s.head_input, s.targets,
                                    s.grad_scale, loss_slots_.slot(s.loss.slot));
  add_aux_loss(s);
  return dx;
}

// Under pipeline parallelism a micro-batch's router statistics go forward with its activations, so
// that the head holds one process's RouterStats (the auxiliary loss, the metrics and the step's
// expert loads over every sparse layer, each sum added in layer order as one process adds it),
// and the auxiliary loss's gradient per expert goes back with its gradients to every stage's
// routers. Forward, as doubles travelling as their 64 bits in two int32 (no f64 dtype): the
// sparse layers run so far n, rows, dropped, counts [E], probability sums [E], then per sparse
// layer (L, zeros past n) its load max/mean and its E counts; backward: dprob [E].
namespace {
size_t carried_doubles(int64_t E, int64_t L) {
  return size_t(3 + 2 * E + L * (E + 1));
}
}  // namespace

Tensor MoeModel::carry_buffer(bool backward) const {
  const int64_t E = config_.num_experts, L = config_.num_sparse_layers();
  if (L == 0 || (backward && !trains_aux())) return {};
  return backward ? Tensor::empty({E}, DType::f32, device_)
                  : Tensor::empty({2 * int64_t(carried_doubles(E, L))}, DType::i32, device_);
}

Tensor MoeModel::carry_out(const ActivationStore& s, bool backward) const {
  Tensor t = carry_buffer(backward);
  if (!t.defined()) return t;
  const auto& m = std::any_cast<const MoeMicroBatch&>(s.extra);
  if (backward) {
    LOOM_CHECK(m.stats.dprob.defined(),
               "pipeline: the auxiliary loss's gradient of a micro-batch is sent back before its "
               "head computed it");
    return m.stats.dprob;
  }
  if (!ops::computes(device_)) return t;  // nothing routed on meta: the same bytes travel
  const RouterStats& st = m.stats;
  const size_t E = size_t(config_.num_experts), L = size_t(config_.num_sparse_layers());
  std::vector<double> v(carried_doubles(int64_t(E), int64_t(L)), 0.0);
  const size_t n = st.load_max_over_mean.size();
  v[0] = double(n);
  v[1] = double(st.rows);
  v[2] = double(st.dropped);
  std::copy(st.counts.begin(), st.counts.end(), v.begin() + 3);
  std::copy(st.prob_sum.begin(), st.prob_sum.end(), v.begin() + int64_t(3 + E));
  std::copy(st.load_max_over_mean.begin(), st.load_max_over_mean.end(),
            v.begin() + int64_t(3 + 2 * E));
  std::copy(st.layer_counts.begin(), st.layer_counts.end(), v.begin() + int64_t(3 + 2 * E + L));
  Tensor host = device_ == Device::cpu ? t : Tensor::empty(t.shape(), DType::i32, Device::cpu);
  std::memcpy(host.data<int32_t>(), v.data(), v.size() * sizeof(double));
  if (device_ != Device::cpu) ops::copy(host, t);
  return t;
}

void MoeModel::carry_in(ActivationStore& s, bool backward, const Tensor& carry) {
  RouterStats& st = state(s).stats;
  if (backward) {
    st.dprob = carry;
    return;
  }
  if (!ops::computes(device_)) return;
  const size_t E = size_t(config_.num_experts), L = size_t(config_.num_sparse_layers());
  std::vector<double> v(carried_doubles(int64_t(E), int64_t(L)));
  std::memcpy(v.data(), carry.on_host().data<int32_t>(), v.size() * sizeof(double));
  const size_t n = size_t(v[0]);
  LOOM_CHECK(n <= L, "pipeline: a router statistics carry of ", n, " sparse layers; the model has ",
             L);
  st.rows = int64_t(v[1]);
  st.dropped = int64_t(v[2]);
  // Before any sparse layer the sums are absent, as one process's.
  auto at = [&](size_t i) { return v.begin() + int64_t(i); };
  st.counts.assign(at(3), at(n > 0 ? 3 + E : 3));
  st.prob_sum.assign(at(3 + E), at(n > 0 ? 3 + 2 * E : 3 + E));
  st.load_max_over_mean.assign(at(3 + 2 * E), at(3 + 2 * E + n));
  st.layer_counts.assign(at(3 + 2 * E + L), at(3 + 2 * E + L + n * E));
}

}  // namespace loom
