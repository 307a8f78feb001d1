#include "train/rank_plan.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/trace.hpp"
#include "distributed/sim_process_group.hpp"
#include "parallel/layers/expert_parallel.hpp"
#include "parallel/parallelize.hpp"
#include "parallel/pipeline/simulate.hpp"
#include "train/launch.hpp"
#include "train/optimizer.hpp"
#include "train/step.hpp"

namespace loom {

uint64_t GroupTraffic::calls() const {
  uint64_t n = 0;
  for (const Op& o : ops) n += o.calls;
  return n;
}

uint64_t GroupTraffic::bytes() const {
  uint64_t n = 0;
  for (const Op& o : ops) n += o.bytes;
  return n;
}

double RankPlan::flops() const {
  double f = 0;
  for (const PlannedKernel& k : kernels) f += k.work.flops;
  return f;
}

dist::MeshLayout plan_layout(const PlanJob& j) {
  LOOM_CHECK(j.world >= 1, "plan: --world must be at least 1, got ", j.world);
  const ParallelDims dims = parallel_dims(j.job).resolved(j.world);
  dims.validate(j.job.training.seq_len, j.world == 1);
  return dist::MeshLayout(dims.mesh_shape(), j.world);
}

std::vector<int> representative_ranks(const dist::MeshLayout& layout) {
  std::set<int> ranks;
  for (int s = 0; s < layout.size("pp"); ++s) ranks.insert(layout.world_rank_of({s, 0, 0, 0, 0}));
  ranks.insert(layout.world_size() - 1);
  return {ranks.begin(), ranks.end()};
}

namespace {

std::string role_of(const dist::MeshLayout& layout, int rank) {
  const auto c = layout.coords(rank);
  const int pp = layout.size("pp");
  std::string role = pp > 1 ? str_cat("pp stage rank ", c[0], " of ", pp) : "";
  bool first = true;
  for (int d = 1; d < dist::kMeshDims; ++d) first = first && c[size_t(d)] == 0;
  if (!first && rank == layout.world_size() - 1)
    role += str_cat(role.empty() ? "" : ", ", "last shard/tp/cp rank");
  if (role.empty()) role = "first shard/tp/cp rank";
  return role;
}

// Every group of the mesh the step may use, each once (ranges of dims with the same ranks share
// one group), largest span first.
std::vector<dist::ProcessGroup*> mesh_groups(const dist::Mesh& mesh) {
  std::vector<dist::ProcessGroup*> out;
  std::set<dist::ProcessGroup*> seen;
  for (int first = 0; first < dist::kMeshDims; ++first)
    for (int last = dist::kMeshDims - 1; last >= first; --last) {
      std::string dims;
      for (int d = first; d <= last; ++d)
        dims += str_cat(d > first ? "," : "", dist::kMeshDimNames[size_t(d)]);
      dist::ProcessGroup* g = &mesh.group(dims);
      if (g->size() > 1 && seen.insert(g).second) out.push_back(g);
    }
  if (mesh.ep() > 1)
    for (const char* dims : {"ep", "ep_shard"}) {
      dist::ProcessGroup* g = &mesh.group(dims);
      if (g->size() > 1 && seen.insert(g).second) out.push_back(g);
    }
  return out;
}

}  // namespace

RankPlan plan_rank(const PlanJob& j, int rank) {
  const JobConfig& job = j.job;
  const dist::MeshLayout layout = plan_layout(j);
  LOOM_CHECK(rank >= 0 && rank < j.world, "plan: rank ", rank, " is outside the world of ",
             j.world);
  // The meta run books the scratch of the kernels of the job's device (a GPU's:
  // ops::ModeledDevice).
  const ops::ModeledDevice modeled(job.training.device == "cuda" ? Device::cuda : Device::cpu);
  RankPlan out;
  out.rank = rank;
  out.coords = layout.coords(rank);
  out.role = role_of(layout, rank);

  auto& alloc = Allocator::get(Device::meta);
  LOOM_CHECK(alloc.stats().allocated == 0, "plan: the meta device still holds ",
             alloc.stats().allocated, " bytes of an earlier plan");
  alloc.empty_cache();
  alloc.reset_peak();
  // Held for this plan only, also when it throws (out of memory under the limit).
  struct Limit {
    Allocator& a;
    Limit(Allocator& alloc, size_t bytes) : a(alloc) { a.set_limit(bytes); }
    ~Limit() { a.set_limit(0); }
  } limit(alloc, j.memory_limit);
  auto& host = Allocator::get(Device::meta, Pool::host);  // CPU offload's states
  LOOM_CHECK(host.stats().allocated == 0, "plan: the meta host pool still holds ",
             host.stats().allocated, " bytes of an earlier plan");
  host.empty_cache();
  host.reset_peak();

  const PlannedExpertLoad load(j.ep_load);
  auto log = std::make_shared<dist::SimLog>();
  std::vector<int> everyone(static_cast<size_t>(j.world));
  std::iota(everyone.begin(), everyone.end(), 0);
  std::unique_ptr<dist::Mesh> mesh;
  if (j.world > 1) {
    mesh = std::make_unique<dist::Mesh>(
        parallel_dims(job).resolved(j.world).mesh_shape(),
        std::make_shared<dist::SimProcessGroup>("world", rank, everyone, log));
    if (job.parallelism.ep > 1) mesh->add_expert_groups(int(job.parallelism.ep));
  }

  const DType compute = dtype_from_name(job.training.mixed_precision_param);
  ParallelizeOptions options = parallelize_options(job);
  options.device = Device::meta;
  ParallelModel par = [&] {
    const MemoryUseScope use(Device::meta, MemoryUse::states);
    return parallelize(j.model, compute, parallel_groups(mesh.get()), options);
  }();
  Model& model = *par.model;
  if (par.pipeline) out.schedule = par.pipeline->schedule();
  const AdamWConfig oc{float(job.optimizer.lr), float(job.optimizer.beta1),
                       float(job.optimizer.beta2), float(job.optimizer.eps),
                       float(job.optimizer.weight_decay)};
  std::optional<AdamW> made;
  {
    const MemoryUseScope use(Device::meta, MemoryUse::optimizer);
    made.emplace(model.units(), oc);
  }
  AdamW& opt = *made;
  out.states = alloc.stats().allocated;
  out.optimizer = opt.state_bytes();
  out.host = host.stats().peak_allocated;
  out.num_params = model.num_params();
  if (j.states_only) {
    out.peak_allocated = out.run_peak_allocated = alloc.stats().peak_allocated;
    out.peak_reserved = alloc.stats().peak_reserved;
    out.at_peak = alloc.stats().by_use_at_peak;
    return out;
  }

  // The trainer's step: grad_accum_steps runs of the pipeline's micro-batches (1 without pp),
  // each B samples of T tokens; token ids do not matter on meta.
  const int64_t B = job.training.local_batch_size, T = job.training.seq_len;
  const int64_t G = job.training.grad_accum_steps * pipeline_microbatches(job);
  out.micro_batches = G;
  out.tokens = G * B * T;
  MicroBatch batch{B, T, std::vector<int32_t>(size_t(B * T), 0),
                   std::vector<int32_t>(size_t(B * T), 0)};
  TrainStep step(par, opt, job.training.max_norm, G * B * T * par.groups.size);
  auto next = [&](int64_t) -> const MicroBatch& { return batch; };

  const std::vector<dist::ProcessGroup*> groups =
      mesh ? mesh_groups(*mesh) : std::vector<dist::ProcessGroup*>{};
  {
    // The first step only warms up (AdamW's moments, the allocator's cache); its kernels count
    // for the collectives' completion (SimLog::kernels).
    ops::RecordWork count([&](const ops::KernelWork&) { ++log->kernels; });
    step.run(G, next, job.optimizer.lr);
  }

  const size_t first_peak = alloc.stats().peak_allocated;
  alloc.reset_peak();
  const size_t flushes = alloc.stats().num_cache_flushes;
  for (dist::ProcessGroup* g : groups) g->reset_counters();
  log->calls.clear();
  log->waits.clear();
  log->kernels = 0;
  std::map<const dist::ProcessGroup*, size_t> index;
  for (dist::ProcessGroup* g : groups) {
    index[g] = out.groups.size();
    out.groups.push_back({g->name(), g->size(), g->world_ranks(), {}});
  }
  // The pipeline executor's action spans (core/trace.hpp), on the clock that stamps the kernels.
  trace::Recorder actions(rank);
  {
    // Installed for this step only, also when it throws (the recorder dies with this frame).
    struct Installed {
      explicit Installed(trace::Recorder* r) { trace::set_recorder(r); }
      ~Installed() { trace::set_recorder(nullptr); }
    } installed(&actions);
    ops::RecordWork record([&](const ops::KernelWork& w) {
      out.kernels.push_back({w, actions.now_us()});
      ++log->kernels;
    });
    step.run(G, next, job.optimizer.lr);
  }
  std::vector<size_t> call_of(log->calls.size(), SIZE_MAX);  // log index -> out.calls index
  for (size_t i = 0; i < log->calls.size(); ++i) {
    const dist::SimCall& c = log->calls[i];
    const auto it = index.find(c.group);
    if (it == index.end()) continue;  // a group of one: nothing moves
    call_of[i] = out.calls.size();
    out.calls.push_back({it->second, std::string(c.op), c.bytes_sent, c.kernels});
  }
  for (const dist::SimWait& w : log->waits)
    if (call_of[w.call] != SIZE_MAX) out.waits.push_back({call_of[w.call], w.kernels});
  for (const trace::Event& e : actions.events())
    if (e.cat == "action") out.actions.push_back({e.name, e.ts_us, e.ts_us + e.dur_us});
  for (const PlannedCall& c : out.calls) {
    GroupTraffic& g = out.groups[c.group];
    auto it = std::find_if(g.ops.begin(), g.ops.end(),
                           [&](const GroupTraffic::Op& o) { return o.op == c.op; });
    if (it == g.ops.end()) it = g.ops.insert(g.ops.end(), {c.op, 0, 0});
    it->calls += 1;
    it->bytes += c.bytes;
  }
  const AllocatorStats st = alloc.stats();
  out.peak_allocated = st.peak_allocated;
  out.run_peak_allocated = std::max(first_peak, st.peak_allocated);
  out.peak_reserved = st.peak_reserved;
  out.cache_flushes = st.num_cache_flushes - flushes;
  out.at_peak = st.by_use_at_peak;
  out.host = host.stats().peak_allocated;
  return out;
}

}  // namespace loom
