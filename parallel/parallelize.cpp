#include "parallel/parallelize.hpp"

#include <optional>

#include "distributed/group_sum.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/pipeline/schedule_csv.hpp"
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
  m.fsdp = std::make_unique<parallel::Fsdp>(*m.model, *m.groups.shard, m.groups.replicate, fc);
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
  pp::Schedule s = o.pp_schedule_csv.empty()
                       ? pp::make_schedule(pp::parse_schedule_kind(o.pp_schedule), p,
                                           o.pp_stages_per_rank, o.pp_microbatches)
                       : pp::read_schedule_csv(o.pp_schedule_csv);
  LOOM_CHECK(s.ranks == p, "parallelism.pp_schedule_csv = \"", o.pp_schedule_csv, "\" has ",
             s.ranks, " rows (pp ranks); expected parallelism.pp = ", p);
  std::vector<int> layers;
  if (!o.pp_stage_layers.empty()) layers = pp::parse_stage_layers(o.pp_stage_layers);
  auto units = pp::stage_units(int(config.num_hidden_layers()), s.stages, layers);
  return {std::move(s), std::move(units)};
}

void apply_pp(ParallelModel& m, PpPlan plan, const std::string& pp_fsdp_gather) {
  pp::Schedule s = std::move(plan.schedule);
  auto units = std::move(plan.units);
  m.pipeline =
      std::make_unique<PipelineExecutor>(*m.model, std::move(s), std::move(units), m.groups.pp);
  // FSDP's gathers, releases and reduce-scatters by the rank's action list
  // (parallel/pipeline_fsdp.hpp): per action and micro-batch, or once per step; under zero bubble
  // a unit's gradient is reduced after the W that completes it, not in the hook that I runs; with
  // tied embeddings across ranks the last stage's replica is reduced with the head's stage (its
  // unit 0 runs no hooks there), so the tied sum adds two shards of dp sums.
  if (m.fsdp)
    apply_pp_fsdp(*m.pipeline, *m.fsdp, m.model->num_units(), m.model->tie_word_embeddings(),
                  pp_fsdp_gather_from_name(pp_fsdp_gather), m.pp_last_round);
  // DDP all-reduces each unit once per step, in the backward of the step's last micro-batch
  // (TrainStep::run_pipeline sets *pp_last_round for the step's last run of the schedule).
  if (m.ddp) {
    const int last_mb = m.pipeline->schedule().microbatches - 1;
    const bool zb = m.pipeline->schedule().split_backward();
    m.pipeline->set_before_action(
        [d = m.ddp.get(), last = m.pp_last_round, last_mb, zb](const pp::Action& a) {
          d->set_sync(!zb && *last && a.op == pp::Op::B && a.mb == last_mb);
        });
    // Under zero bubble a unit's gradient is complete only after its stage's last W: its units
    // are all-reduced then (the hook of I would reduce before W adds the linear layers').
    if (zb)
      m.pipeline->set_after_action([d = m.ddp.get(), last = m.pp_last_round, last_mb,
                                    p = m.pipeline.get()](const pp::Action& a) {
        if (!*last || a.op != pp::Op::W || a.mb != last_mb) return;
        const auto [first, end] = p->stage_units(a.stage);
        d->set_sync(true);
        for (size_t u = end; u-- > first;) d->after_backward(u);
        d->set_sync(false);
      });
  }
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
    used.assign(size_t(config.num_hidden_layers()) + 2, false);
    for (size_t u : pp_used_units(pp_plan->schedule, pp_plan->units, groups.pp->rank(),
                                  config.tie_word_embeddings()))
      used[u] = true;
  }
  m.model = make_model(config, compute, options.device, layout, tp, cp, std::move(used));
  check_plan(*m.model, m.model->tp_plan());
  apply_ac(*m.model, options.ac);
  if (groups.shard)
    apply_fsdp(m, options.fsdp);
  else if (groups.dp && groups.dp->size() > 1)
    apply_ddp(m, options.fsdp.reduce_dtype);
  if (groups.pp) apply_pp(m, std::move(*pp_plan), options.pp_fsdp_gather);
  return m;
}

CpBatch cp_local_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, int cp,
                       int cp_rank, int sp_tp) {
  const auto pos = cp_positions(T, cp, cp_rank, sp_tp);
  CpBatch out;
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

double ParallelModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T, float grad_scale, bool last) {
  if (ddp) ddp->set_sync(last);
  if (!groups.cp) {
    const double loss = model->forward_backward(inputs, targets, B, T, grad_scale);
    if (fsdp) fsdp->finish_backward();
    return loss;
  }
  // The same samples on every cp rank of a dp rank; the loss is summed over the cp group.
  const int sp_tp = groups.tp && model->tp().sequence_parallel ? groups.tp->size() : 1;
  const CpBatch mine =
      cp_local_batch(inputs, targets, B, T, groups.cp->size(), groups.cp->rank(), sp_tp);
  const double loss =
      model->forward_backward(mine.inputs.data(), mine.targets.data(), B, mine.T, grad_scale);
  if (fsdp) fsdp->finish_backward();
  return group_sum(groups.cp, loss);
}

void ParallelModel::finish_step() {
  if (fsdp) fsdp->finish_step();
  if (ddp) ddp->finish_backward();
}

const char* ParallelModel::kind() const {
  if (pipeline) return "PP";
  if (fsdp) return groups.replicate && groups.replicate->size() > 1 ? "HSDP" : "FSDP";
  return ddp ? "DDP" : "single";
}

}  // namespace loom
