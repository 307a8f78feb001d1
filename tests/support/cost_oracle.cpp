#include "tests/support/cost_oracle.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "parallel/pipeline/simulate.hpp"
#include "parallel/pipeline_fsdp.hpp"

namespace loom::oracle {

namespace {

uint64_t ring_all_gather(uint64_t in_bytes, int n) {
  return uint64_t(n - 1) * in_bytes;
}
uint64_t ring_all_reduce(uint64_t bytes, int n) {
  return n > 1 ? 2 * uint64_t(n - 1) * bytes / uint64_t(n) : 0;
}

// A pp rank's activations at their peak over a step (PipelineExecutor's lifetimes): per stage
// what one micro-batch holds of its units, run through the schedule by the simulator
// (pp::MemoryModel, unit costs F 1, B 2, I = W = 1), so the peak is the largest sum over the
// rank's stages in flight at any moment, with the message buffers and the working buffers of the
// backward running then (the head's workspace on its rank only).
size_t pp_activation_peak(ParallelModel& m, int64_t B, int64_t Tl) {
  Model& model = *m.model;
  const PipelineExecutor& pipe = *m.pipeline;
  const pp::Schedule& s = pipe.schedule();
  const bool sp = model.tp().size() > 1 && model.tp().sequence_parallel;
  const int64_t rows = sp ? B * Tl / model.tp().size() : B * Tl;
  pp::MemoryModel mem;
  mem.message = double(rows * model.hidden_size() * 4);
  const size_t head = model.num_units() - 1;
  for (int st = 0; st < s.stages; ++st) {
    const auto [first, last] = pipe.stage_units(st);
    pp::StageBytes b;
    // The backward runs the units last first: unit u's working buffers come on top of what the
    // units before it saved, the later ones' freed by then (in I but for their deferred
    // operands), the head's gradient made.
    double freed = 0, freed_i = 0, later = 0;
    for (size_t u = last; u-- > first;) {
      const UnitActivations a = unit_activation_bytes(model, u, B, Tl);
      // In F the units after u have saved nothing yet when u's working buffers peak.
      b.forward = std::max(b.forward, double(a.forward) - later);
      later += double(a.saved);
      b.saved += double(a.saved);
      b.deferred += double(a.deferred);
      b.backward = std::max(b.backward, double(a.backward) - freed);
      b.input = std::max(b.input, double(a.backward_input) - freed_i);
      freed += double(a.saved);
      freed_i += double(a.saved) - double(a.deferred);
      if (u == head) {
        freed -= mem.message;
        freed_i -= mem.message;
      }
    }
    mem.stages.push_back(b);
  }
  const pp::SimResult r = pp::simulate(s, pp::unit_costs(1, 2, 1, 1), 0, &mem);
  LOOM_CHECK(!r.deadlock, "pipeline schedule ", s.name, " deadlocks: ", r.blocked);
  return size_t(std::llround(r.peak_bytes[size_t(pipe.rank())]));
}

// FSDP's full weights and gradients on a pp rank (parallel/pipeline_fsdp.hpp), replacing the
// plain FSDP figures. `step`: every unit of the rank gathered and every gradient it writes
// materialized for the whole step. `microbatch`: as without pp, a backward holds its unit's
// weights and full gradient, the unit below's prefetch (within the stage) and the unit above's
// gradient being reduce-scattered; under zero bubble a unit's gradient waits for its W, so every
// gradient of the rank's stages is held (a bound: they are not all written at once).
void pp_fsdp_buffers(ParallelModel& m, MemoryCost& mc) {
  Model& model = *m.model;
  const PipelineExecutor& pipe = *m.pipeline;
  const pp::Schedule& s = pipe.schedule();
  const std::vector<ParamUnit*> units = model.units();
  const bool tied = model.tie_word_embeddings();
  auto w = [&](size_t u) { return units[u]->materialized_weight_bytes(); };
  auto g = [&](size_t u) { return 4 * size_t(units[u]->padded_numel()); };
  std::vector<pp::UnitRange> ranges;
  for (int stage = 0; stage < s.stages; ++stage) ranges.push_back(pipe.stage_units(stage));
  std::vector<bool> writes(units.size(), false);
  for (int stage : s.stages_of(pipe.rank()))
    for (size_t u : pp_grad_units(ranges, stage, units.size(), tied)) writes[u] = true;
  mc.gathered = mc.full_grad = 0;
  const bool step = m.fsdp->keeps_gathered(), split = s.split_backward();
  for (size_t u = 0; u < units.size(); ++u) {
    if (step && model.uses(u)) mc.gathered += w(u);
    if ((step || split) && writes[u]) mc.full_grad += g(u);
  }
  if (step) return;
  size_t weights = 0, grads = 0;
  for (int stage : s.stages_of(pipe.rank())) {
    const auto [first, last] = ranges[size_t(stage)];
    for (size_t u = first; u < last; ++u) {
      size_t wu = w(u) + (u > first ? w(u - 1) : 0);
      size_t gu = split ? 0 : g(u) + (u + 1 < last ? g(u + 1) : 0);
      // The tied head's backward also gathers the embedding and writes its gradient.
      if (tied && u + 1 == units.size() && first > 0) wu += w(0), gu += split ? 0 : g(0);
      if (wu + gu > weights + grads) weights = wu, grads = gu;
    }
  }
  mc.gathered = weights;
  mc.full_grad += grads;
}

}  // namespace

MemoryCost memory_cost(ParallelModel& m, int64_t B, int64_t T) {
  MemoryCost mc;
  Model& model = *m.model;
  const DType compute = model.compute_dtype();
  // With context parallelism a rank holds the activations of its T / cp tokens.
  const int64_t Tl = T / (m.groups.cp ? m.groups.cp->size() : 1);
  mc.num_params = size_t(model.num_params());
  std::vector<ParamUnit*> units = model.units();
  // A pp rank holds only the units it uses (Model::uses; a plan model on meta knows them too).
  for (size_t i = 0; i < units.size(); ++i) {
    if (!model.uses(i)) continue;
    const ParamUnit* u = units[i];
    const size_t S = size_t(u->shard_numel());
    if (u->offloaded()) {
      mc.host += 4 * Allocator::round_size(4 * S);
      continue;
    }
    mc.params += 4 * S;
    mc.grads += 4 * S;
    mc.optimizer += 8 * S;
    // One buffer each for the weights, the gradient and the two moments, rounded up to the
    // allocator's block sizes (up to 64 KiB each: 1-2% of a pp rank of the 8-layer benchmark).
    mc.rounding += 4 * (Allocator::round_size(4 * S) - 4 * S);
    if (!u->sharded() && compute == DType::bf16) {
      mc.mirror += 2 * S;
      mc.rounding += Allocator::round_size(2 * S) - 2 * S;
    }
  }
  if (m.fsdp) {
    // Under pp only the units this rank uses are ever gathered.
    const size_t head = units.size() - 1;
    for (size_t i = 0; i < units.size(); ++i)
      if (model.uses(i) && (i + 1 >= head || !m.fsdp->reshard_after_forward(i)))
        mc.gathered += units[i]->materialized_weight_bytes();
    if (model.uses(head)) mc.full_grad = 4 * size_t(units[head]->padded_numel());
    if (model.tie_word_embeddings() && model.uses(0))
      mc.full_grad += 4 * size_t(units[0]->padded_numel());
  }
  if (m.pipeline) {
    // Several micro-batches of this rank's stages at once; the head's workspace is in the peak
    // where the head is.
    mc.activations = pp_activation_peak(m, B, Tl);
    if (m.fsdp) pp_fsdp_buffers(m, mc);
  } else {
    // The peak is at the head (what the blocks saved plus its workspace) or in a block (its
    // transients, a recomputation), whichever is larger: the head's term is what it adds.
    mc.activations = saved_activation_bytes(model, B, Tl);
    const size_t at_head = saved_at_head_bytes(model, B, Tl) + head_workspace_bytes(model, B, Tl);
    mc.head = at_head > mc.activations ? at_head - mc.activations : 0;
    const size_t head = units.size() - 1;
    // With cp the ring's working set is priced on top of the head's figures instead (where
    // what the block frees and adds about cancel, see the header).
    if (m.fsdp && head >= 2 && ring_working_bytes(model, B, Tl) == 0) {
      // FSDP's buffers in the last block's backward: its gathered weights and full gradient, the
      // gather of the unit below it (prefetched), every unit kept gathered after forward, the
      // tied embedding's full gradient (made by the head, reduced after the embedding's
      // backward), and the head's gradient being reduce-scattered (its full f32 gradient as the
      // input and an output shard, priced as f32: a bf16 reduce holds less). They can outweigh
      // the head's (its gathered weights and full gradient) as the block's working buffers
      // outweigh the head's workspace: the peak is at whichever is larger.
      const size_t last = head - 1;
      size_t gathered = 0, full_grad = 0;
      for (size_t i = 0; i < head; ++i)
        if (i + 1 >= last || !m.fsdp->reshard_after_forward(i))
          gathered += units[i]->materialized_weight_bytes();
      full_grad = 4 * size_t(units[last]->padded_numel()) +
                  4 * size_t(units[head]->padded_numel() + units[head]->shard_numel());
      if (model.tie_word_embeddings()) full_grad += 4 * size_t(units[0]->padded_numel());
      const size_t in_block = backward_peak_bytes(model, B, Tl);
      if (gathered + full_grad + in_block > mc.gathered + mc.full_grad + mc.activations + mc.head) {
        mc.gathered = gathered;
        mc.full_grad = full_grad;
        mc.activations = in_block;
        mc.head = 0;
      }
    }
  }
  mc.comm = tp_comm_buffer_bytes(model, B, Tl);
  mc.ring = ring_working_bytes(model, B, Tl);
  return mc;
}

namespace {

// Per unit (units() order), FSDP's all-gathers and reduce-scatters on this pp rank in one step of
// `rounds` runs of the schedule (what PipelineFsdp issues by its reduce plan).
struct PpFsdpCounts {
  std::vector<int64_t> gathers, reduces;
};
PpFsdpCounts pp_fsdp_counts(const PipelineExecutor& pipe, size_t num_units,
                            bool tie_word_embeddings, PpFsdpGather mode, int64_t rounds) {
  const pp::Schedule& s = pipe.schedule();
  std::vector<pp::UnitRange> ranges;
  for (int st = 0; st < s.stages; ++st) ranges.push_back(pipe.stage_units(st));
  PpFsdpCounts c{std::vector<int64_t>(num_units, 0), std::vector<int64_t>(num_units, 0)};
  const bool step = mode == PpFsdpGather::step;
  const auto plan =
      pp_fsdp_reduce_plan(s, ranges, pipe.rank(), num_units, tie_word_embeddings, mode);
  for (const auto& units : plan)
    for (size_t u : units) c.reduces[u] += step ? 1 : rounds;
  if (step) {
    // Every unit the rank uses, once: its stages' units and the tied embedding's replica.
    for (size_t u : pp_used_units(s, ranges, pipe.rank(), tie_word_embeddings)) c.gathers[u] = 1;
    return c;
  }
  // Every F, B and I gathers the units it runs (all were released after the previous action; the
  // prefetch stays inside the stage), a B or I of the tied head the embedding too; W reads no
  // weights.
  for (const pp::Action& a : s.orders[size_t(pipe.rank())]) {
    if (a.op == pp::Op::W) continue;
    const auto [first, last] = ranges[size_t(a.stage)];
    for (size_t u = first; u < last; ++u) c.gathers[u] += rounds;
    if (a.op != pp::Op::F && tie_word_embeddings && last == num_units && first > 0)
      c.gathers[0] += rounds;
  }
  return c;
}

// The pp group's bytes per step (PipelineExecutor): per run of the schedule, each f32 activation
// and gradient this rank sends across a stage boundary to another rank (its residual stream's
// rows: this tp rank's with SP, this cp rank's tokens); per step, the tied embedding's gradient
// exchanged by the first and last stages, the gradient norm's per-unit squared sums and the
// loss's sum.
uint64_t pp_bytes_per_step(ParallelModel& m, int64_t B, int64_t Tl, int64_t G) {
  const ParallelGroups& g = m.groups;
  if (!m.pipeline || !g.pp || g.pp->size() == 1) return 0;
  Model& model = *m.model;
  const pp::Schedule& s = m.pipeline->schedule();
  const int rank = m.pipeline->rank(), n = g.pp->size();
  const bool sp = model.tp().size() > 1 && model.tp().sequence_parallel;
  const uint64_t rows = uint64_t(sp ? B * Tl / model.tp().size() : B * Tl);
  uint64_t messages = 0;
  for (const pp::Action& a : s.orders[size_t(rank)]) messages += pp::outputs_of(s, a).size();
  const uint64_t rounds = uint64_t(G / s.microbatches);
  uint64_t bytes = rounds * messages * rows * uint64_t(model.hidden_size()) * 4;
  if (m.pipeline->tied_across_ranks() &&
      (rank == s.stage_rank.front() || rank == s.stage_rank.back()))
    bytes += uint64_t(model.units().front()->shard_numel()) * 4;
  bytes += ring_all_gather(8 * model.num_units(), n) + ring_all_gather(8, n);
  return bytes;
}

}  // namespace

uint64_t bytes_per_step(ParallelModel& m, DType reduce, int64_t B, int64_t T, int64_t G) {
  const ParallelGroups& g = m.groups;
  Model& model = *m.model;
  const int64_t Tl = T / (g.cp ? g.cp->size() : 1);
  // Under pp a rank runs its stages' units only (not a tied embedding's replica).
  std::vector<bool> runs;
  if (m.pipeline) {
    runs.assign(model.num_units(), false);
    for (size_t u : m.pipeline->owned_units()) runs[u] = true;
  }
  // The 8-byte sum of the loss over cp: per micro-batch, under pp once a step on every rank
  // (train/step.cpp).
  const uint64_t cp_loss = g.cp ? ring_all_gather(8, g.cp->size()) : 0;
  // Per micro-batch: tp's and cp's collectives.
  const uint64_t tp = (tp_bytes_per_micro_batch(model, B, Tl, runs) +
                       cp_bytes_per_micro_batch(model, B, Tl, runs) + (m.pipeline ? 0 : cp_loss)) *
                          uint64_t(G) +
                      (m.pipeline ? cp_loss : 0) +
                      // + the gradient norm: one 8-byte squared sum per unit (train/optimizer.cpp)
                      (g.tp ? ring_all_gather(8 * model.num_units(), g.tp->size()) : 0);
  const uint64_t pp = pp_bytes_per_step(m, B, Tl, G);
  if (!m.fsdp && !m.ddp) return tp + pp;
  const uint64_t rsize = dtype_size(reduce);
  std::vector<ParamUnit*> units = model.units();
  uint64_t per_micro = 0, per_step = g.dp ? ring_all_gather(8, int(g.size)) : 0;  // the loss
  if (m.fsdp) {
    const int n = g.shard->size();
    // Under pp the gathers and reduce-scatters follow the rank's action list
    // (parallel/pipeline_fsdp.hpp), counted per step.
    std::optional<PpFsdpCounts> pc;
    if (m.pipeline)
      pc = pp_fsdp_counts(*m.pipeline, units.size(), model.tie_word_embeddings(),
                          m.fsdp->keeps_gathered() ? PpFsdpGather::step : PpFsdpGather::microbatch,
                          G / m.pipeline->schedule().microbatches);
    for (size_t i = 0; i < units.size(); ++i) {
      if (!model.uses(i)) continue;  // a pp rank's units of other stages
      const ParamUnit& u = *units[i];
      const uint64_t S = uint64_t(u.shard_numel());
      const uint64_t gather = ring_all_gather(S * dtype_size(u.gather_dtype()), n) +
                              ring_all_reduce(uint64_t(u.side_numel()) * 4, n);
      const uint64_t reduce = uint64_t(n - 1) * S * rsize;  // reduce-scatter
      if (pc) {
        per_step += gather * uint64_t(pc->gathers[i]) + reduce * uint64_t(pc->reduces[i]);
      } else {
        per_micro += gather * (m.fsdp->reshard_after_forward(i) ? 2 : 1) + reduce;
      }
      if (g.replicate && g.replicate->size() > 1)
        per_step += ring_all_reduce(S * rsize, g.replicate->size());
    }
    per_step += ring_all_gather(8 * units.size(), n);  // the gradient norm, per unit
  } else {
    for (ParamUnit* u : units)
      per_step += ring_all_reduce(uint64_t(u->numel()) * rsize, int(g.size));
  }
  return per_micro * uint64_t(G) + per_step + tp + pp;
}

}  // namespace loom::oracle
