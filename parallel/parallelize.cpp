#include "parallel/parallelize.hpp"

#include <optional>

#include "distributed/group_sum.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/pipeline/schedule_csv.hpp"
#include "parallel/pipeline_ddp.hpp"
#include "parallel/pipeline_fsdp.hpp"

namespace loom {

namespace {

TpOptions apply_tp(const ParallelGroups& g, const ParallelizeOptions& o) {
  TpOptions tp;
  tp.group = g.tp;
  tp.sequence_parallel = o.sequence_parallel;
  tp.recompute_allgather = o.tp_recompute_allgather;
  tp.async = o.tp_async;
  return tp;
}

CpOptions apply_cp(const ParallelGroups& g, const ParallelizeOptions& o) {
  CpOptions cp;
  cp.group = g.cp;
  cp.allgather = o.cp_allgather;
  return cp;
}

void apply_ac(Model& model, const ActivationCheckpoint& ac) {
  model.set_activation_checkpoint(ac);
}

void apply_fsdp(ParallelModel& m, const parallel::FsdpConfig& fc) {
  m.fsdp = std::make_unique<parallel::Fsdp>(*m.model, *m.groups.shard, m.groups.replicate, fc,
                                            m.groups.expert_shard);
}

void apply_ddp(ParallelModel& m, DType reduce) {
  m.ddp = std::make_unique<parallel::Ddp>(*m.model, *m.groups.dp, reduce);
}

struct PpPlan {
  pp::Schedule schedule;
  std::vector<pp::UnitRange> units;
};

// The schedule and the stage split, known before the model is built so that the units of other
// ranks' stages can be built on Device::elsewhere.
PpPlan plan_pp(const ModelConfig& config, const ParallelGroups& g, const ParallelizeOptions& o) {
  const int p = g.pp->size();
  pp::Schedule s =
      o.pp_schedule_csv.empty()
          ? pp::make_schedule(o.pp_schedule, p, o.pp_stages_per_rank, o.pp_microbatches)
          : pp::read_schedule_csv(o.pp_schedule_csv);
  LOOM_CHECK(s.ranks == p, "parallelism.pp_schedule_csv = \"", o.pp_schedule_csv, "\" has ",
             s.ranks, " rows (pp ranks); expected parallelism.pp = ", p);
  std::vector<int> layers;
  if (!o.pp_stage_layers.empty()) layers = pp::parse_stage_layers(o.pp_stage_layers);
  // The split is in layers; a layer of several blocks (a mixture of experts' attention and
  // experts blocks) stays on one stage.
  auto units =
      pp::layer_ranges_to_blocks(pp::stage_units(int(config.num_hidden_layers()), s.stages, layers),
                                 config.blocks_per_layer());
  return {std::move(s), std::move(units)};
}

void apply_pp(ParallelModel& m, PpPlan plan, PpFsdpGather pp_fsdp_gather) {
  m.pipeline = std::make_unique<PipelineExecutor>(*m.model, std::move(plan.schedule),
                                                  std::move(plan.units), m.groups.pp);
  // Data parallelism by the rank's action list: FSDP's gathers, releases and reduce-scatters
  // (parallel/pipeline_fsdp.hpp), DDP's all-reduces (parallel/pipeline_ddp.hpp).
  if (m.fsdp)
    m.pipeline->set_hooks(std::make_unique<PipelineFsdp>(*m.pipeline, *m.fsdp, m.model->num_units(),
                                                         m.model->tie_word_embeddings(),
                                                         pp_fsdp_gather));
  if (m.ddp)
    m.pipeline->set_hooks(
        std::make_unique<PipelineDdp>(*m.pipeline, *m.ddp, *m.model, *m.groups.dp));
}

}  // namespace

ParallelModel parallelize(const ModelConfig& config, DType compute, const ParallelGroups& groups,
                          const ParallelizeOptions& options) {
  ParallelModel m;
  m.groups = groups;
  LOOM_CHECK(!options.cpu_offload || groups.shard,
             "training.enable_cpu_offload = true needs FSDP's sharded states: parallelism.dp_shard "
             "x cp must be more than 1 rank (an unsharded model's GEMMs read its weights in place, "
             "so they cannot live in host memory)");
  const ShardLayout layout{groups.shard ? groups.shard->rank() : 0,
                           groups.shard ? groups.shard->size() : 1, options.cpu_offload};
  const TpOptions tp = apply_tp(groups, options);
  const CpOptions cp = apply_cp(groups, options);
  std::optional<PpPlan> pp_plan;
  std::vector<bool> used;
  if (groups.pp) {
    pp_plan = plan_pp(config, groups, options);
    used.assign(pp_plan->units.back().second, false);
    for (size_t u : pp_used_units(pp_plan->schedule, pp_plan->units, groups.pp->rank(),
                                  config.tie_word_embeddings()))
      used[u] = true;
  }
  EpOptions ep;
  if (groups.ep) {
    ep.group = groups.ep;
    ep.shard = {groups.expert_shard->rank(), groups.expert_shard->size(), options.cpu_offload};
  }
  m.model = make_model(config, compute, options.device, layout, tp, cp, std::move(used), ep);
  check_plan(*m.model, m.model->tp_plan());
  apply_ac(*m.model, options.ac);
  if (groups.shard)
    apply_fsdp(m, options.fsdp);
  else if (groups.dp && groups.dp->size() > 1)
    apply_ddp(m, options.fsdp.reduce_dtype);
  if (groups.pp) apply_pp(m, std::move(*pp_plan), options.pp_fsdp_gather);
  return m;
}

LocalBatch cp_local_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          int cp, int cp_rank, int sp_tp) {
  const auto pos = cp_positions(T, cp, cp_rank, sp_tp);
  LocalBatch out;
  out.B = B;
  out.T = int64_t(pos.size());
  const int64_t Tl = out.T;
  out.inputs.resize(size_t(B * Tl));
  out.targets.resize(size_t(B * Tl));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t) {
      out.inputs[size_t(b * Tl + t)] = inputs[b * T + pos[size_t(t)]];
      out.targets[size_t(b * Tl + t)] = targets[b * T + pos[size_t(t)]];
    }
  return out;
}

LocalBatch ParallelModel::local_batch(const MicroBatchView& mb) const {
  if (!groups.cp) {
    const size_t n = size_t(mb.B * mb.T);
    return {mb.B, mb.T, std::vector<int32_t>(mb.inputs, mb.inputs + n),
            std::vector<int32_t>(mb.targets, mb.targets + n)};
  }
  // The same samples on every cp rank of a dp rank, each taking its zigzag chunks.
  const int sp_tp = groups.tp && model->tp().sequence_parallel ? groups.tp->size() : 1;
  return cp_local_batch(mb.inputs, mb.targets, mb.B, mb.T, groups.cp->size(), groups.cp->rank(),
                        sp_tp);
}

PendingLoss ParallelModel::forward_backward_pending(const int32_t* inputs, const int32_t* targets,
                                                    int64_t B, int64_t T, float grad_scale,
                                                    bool last) {
  if (ddp) ddp->set_sync(last);
  PendingLoss loss;
  if (!groups.cp) {
    loss = model->forward_backward_pending(inputs, targets, B, T, grad_scale);
  } else {
    const LocalBatch mine = local_batch({inputs, targets, B, T});
    loss = model->forward_backward_pending(mine.inputs.data(), mine.targets.data(), B, mine.T,
                                           grad_scale);
  }
  if (fsdp) fsdp->finish_backward();
  return loss;
}

double ParallelModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T, float grad_scale, bool last) {
  // The loss is summed over the cp group.
  return group_sum(groups.cp, model->loss_slots().read(forward_backward_pending(
                                  inputs, targets, B, T, grad_scale, last)));
}

namespace {

// The micro-batches' losses read back at once (one wait on a GPU), each summed over cp, then
// added in micro-batch order: the bits of reading and summing them one at a time.
double summed_losses(Model& model, dist::ProcessGroup* cp, const std::vector<PendingLoss>& p) {
  double loss = 0;
  for (double x : group_sum_each(cp, model.loss_slots().read(p))) loss += x;
  return loss;
}

}  // namespace

double ParallelModel::forward_backward_step(int64_t n,
                                            const std::function<MicroBatchView(int64_t)>& batch,
                                            float grad_scale) {
  model->loss_slots().clear();
  if (!pipeline) {
    std::vector<PendingLoss> losses;
    for (int64_t j = 0; j < n; ++j) {
      const MicroBatchView mb = batch(j);
      losses.push_back(
          forward_backward_pending(mb.inputs, mb.targets, mb.B, mb.T, grad_scale, j + 1 == n));
    }
    return summed_losses(*model, groups.cp, losses);
  }
  const int m = pipeline->schedule().microbatches;
  LOOM_CHECK(n % m == 0, "pipeline: ", n,
             " micro-batches in the step, not a multiple of the schedule's ", m,
             " (parallelism.pp_microbatches)");
  // The schedule touches its micro-batches in any order, and a store keeps pointers to its
  // tokens: each round's micro-batches are copied first (batch() is valid until its next call).
  // With cp each rank keeps its zigzag tokens of every sample (and sends its own rows).
  std::vector<LocalBatch> round(static_cast<size_t>(m));
  double loss = 0;
  for (int64_t first = 0; first < n; first += m) {
    for (int j = 0; j < m; ++j) round[size_t(j)] = local_batch(batch(first + j));
    loss = pipeline->run([&](int j) { return round[size_t(j)].view(); }, grad_scale, loss,
                         first + m == n);
  }
  return group_sum(groups.cp, loss);
}

void ParallelModel::finish_step() {
  if (fsdp) fsdp->finish_step();
  if (ddp) ddp->finish_backward();
  if (pipeline) pipeline->finish_step();
}

std::vector<bool> ParallelModel::counted_units() const {
  return pipeline ? pipeline->counted_units() : std::vector<bool>{};
}

double ParallelModel::validation_loss(int64_t n,
                                      const std::function<MicroBatchView(int64_t)>& batch) {
  // The model has no forward-only path yet: forward_backward with grad_scale 0 gives the loss,
  // and the (zero) gradients are cleared. Under pp a forward-only schedule runs the stages (the
  // head's fused loss still runs its backward, with scale 0).
  model->loss_slots().clear();
  if (!pipeline) {
    std::vector<PendingLoss> losses;
    for (int64_t j = 0; j < n; ++j) {
      const MicroBatchView mb = batch(j);
      losses.push_back(forward_backward_pending(mb.inputs, mb.targets, mb.B, mb.T, 0.0f, false));
    }
    model->zero_grad();
    return summed_losses(*model, groups.cp, losses);
  }
  std::vector<LocalBatch> mine(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) mine[size_t(j)] = local_batch(batch(j));
  const double loss = pipeline->run_forward([&](int j) { return mine[size_t(j)].view(); }, int(n));
  // FSDP's collectives completed after every action; its units are released here (kept gathered
  // under pp_fsdp_gather = "step", and the head's zero gradient is never reduced). DDP did not
  // sync (no backward action).
  if (fsdp) fsdp->finish_backward();
  model->zero_grad();
  // The loss is on the head's rank only: summed over pp (exact zeros elsewhere) it keeps its bits.
  return group_sum(groups.pp, group_sum(groups.cp, loss));
}

const char* ParallelModel::kind() const {
  if (pipeline) return "PP";
  if (fsdp) return groups.replicate && groups.replicate->size() > 1 ? "HSDP" : "FSDP";
  return ddp ? "DDP" : "single";
}

}  // namespace loom
