// `loom bench step`: times whole training steps (forward, backward, gradient reduction, clip,
// AdamW) after warm-up and prints throughput, MFU against the GEMM peak measured on this machine
// at start (one process), and peak memory next to the step's run on the meta device.
//
// Under `mpirun -np N` it runs the [parallelism] layout exactly as `loom train` does (the same
// parallelize() and TrainStep) and prints one row per rank, gathered to rank 0: peak allocated
// bytes and bytes sent by collectives per step (the groups' counters, reset after warm-up,
// divided by the timed steps), each beside the same figure of the rank's step run on the meta
// device first (plan_rank, train/rank_plan.hpp: loom's one memory truth, also the pre-flight's
// and `loom plan`'s), and tokens/s. With --check the command fails unless every rank's bytes and
// peak equal the meta run's (--peak-tolerance=F: the peak within F of it instead).
//
// --profile[=HARDWARE] times every op of the timed steps and prints rank 0's sums by op beside the
// planner's price of the same work (apps/op_profile.hpp).
//
// With --json under a mesh, rank 0 prints after the table one more line, a JSON object with every
// rank's peaks and its calls and bytes per group per timed step (mesh_json below): what
// `loom plan` must reproduce on the meta device.
#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/median.hpp"
#include "apps/op_profile.hpp"
#include "apps/peak_seconds.hpp"
#include "apps/system_info.hpp"
#include "core/allocator.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/gemm.hpp"
#include "model/model_config.hpp"
#include "ops/devices.hpp"
#include "parallel/parallelize.hpp"
#include "train/config.hpp"
#include "train/launch.hpp"
#include "train/optimizer.hpp"
#include "train/rank_plan.hpp"
#include "train/step.hpp"

namespace loom {

namespace {

// Every group the data-parallel step communicates on, each once (ranges of dims with the same
// ranks share one group).
std::vector<dist::ProcessGroup*> comm_groups(dist::Mesh* mesh, const ParallelGroups& dp) {
  std::vector<dist::ProcessGroup*> out;
  if (!mesh) return out;
  std::set<dist::ProcessGroup*> seen;
  for (dist::ProcessGroup* g :
       {dp.dp, dp.shard, dp.replicate, dp.tp, dp.cp, dp.pp, dp.ep, dp.expert_shard, &mesh->world()})
    if (g && seen.insert(g).second) out.push_back(g);
  return out;
}

// Each rank's figures, gathered on every rank (as pairs of int32: MPI carries no 64-bit ints).
std::vector<std::vector<int64_t>> gather_rows(dist::Mesh* mesh, const std::vector<int64_t>& mine) {
  if (!mesh) return {mine};
  const int n = mesh->world_size();
  const int64_t k = int64_t(mine.size());
  Tensor in = Tensor::empty({2 * k}, DType::i32), all = Tensor::empty({2 * k * n}, DType::i32);
  for (int64_t i = 0; i < k; ++i) {
    const uint64_t v = uint64_t(mine[size_t(i)]);
    in.data<int32_t>()[2 * i] = int32_t(uint32_t(v >> 32));
    in.data<int32_t>()[2 * i + 1] = int32_t(uint32_t(v));
  }
  mesh->world().all_gather(in, all)->wait();
  std::vector<std::vector<int64_t>> rows(size_t(n), std::vector<int64_t>(static_cast<size_t>(k)));
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const int32_t* p = all.data<int32_t>() + 2 * (r * k + i);
      rows[size_t(r)][size_t(i)] =
          int64_t((uint64_t(uint32_t(p[0])) << 32) | uint64_t(uint32_t(p[1])));
    }
  return rows;
}

// FNV-1a of the group names in order: the ranks must list the same groups for the per-group
// counters to line up in one gather (they do, the groups follow the layout; this says so).
int64_t names_hash(const std::vector<dist::ProcessGroup*>& groups) {
  uint64_t h = 1469598103934665603ull;
  for (const dist::ProcessGroup* g : groups) {
    for (const char c : g->name() + ";") h = (h ^ uint64_t(uint8_t(c))) * 1099511628211ull;
  }
  return int64_t(h);
}

// The job's figures as one JSON object, gathered on every rank (each rank calls it):
//   {"world", "layout": {dim: size}, "warmup_steps", "timed_steps",
//    "ranks": [{"rank", "coords": {dim: i}, "peak_allocated_bytes", "peak_reserved_bytes",
//               "host_peak_bytes" (CPU offload's pool), "bytes_per_step", "step_s", "tokens_per_s",
//               "groups": {name: {"size", "calls", "bytes", "wait_s", "exact"}}}]}
// A group's calls and bytes are its counters over the timed steps divided by their number;
// "exact" is false where that division leaves a remainder (the steps differed), and then the
// figures are the floor. Doubles travel as their bits, so step_s is rank r's own median.
// `measured`: each group's counters at the end of the timed steps.
nlohmann::ordered_json mesh_json(dist::Mesh& mesh, const std::vector<dist::ProcessGroup*>& groups,
                                 const std::vector<dist::CommCounters>& measured,
                                 const AllocatorStats& st, size_t host_peak, uint64_t sent_per_step,
                                 double step_s, double tokens_per_s, int warmup, uint64_t timed) {
  const std::vector<std::vector<int64_t>> rows = gather_rows(
      &mesh, {int64_t(st.peak_allocated), int64_t(st.peak_reserved), int64_t(sent_per_step),
              std::bit_cast<int64_t>(step_s), std::bit_cast<int64_t>(tokens_per_s),
              int64_t(groups.size()), names_hash(groups), int64_t(host_peak)});
  for (size_t r = 1; r < rows.size(); ++r)
    LOOM_CHECK(rows[r][5] == rows[0][5] && rows[r][6] == rows[0][6], "bench step --json: rank ", r,
               " communicates on other groups than rank 0 (", rows[r][5], " against ", rows[0][5],
               ")");
  std::vector<int64_t> mine;
  for (size_t i = 0; i < groups.size(); ++i) {
    const dist::CommCounters& c = measured[i];
    mine.insert(mine.end(), {int64_t(groups[i]->size()), int64_t(c.calls), int64_t(c.bytes_sent),
                             std::bit_cast<int64_t>(c.wait_seconds)});
  }
  const std::vector<std::vector<int64_t>> counters = gather_rows(&mesh, mine);

  const dist::MeshLayout& layout = mesh.layout();
  auto dims_json = [](const std::array<int, dist::kMeshDims>& v) {
    nlohmann::ordered_json o;
    for (int d = 0; d < dist::kMeshDims; ++d) o[std::string(dist::kMeshDimNames[d])] = v[d];
    return o;
  };
  nlohmann::ordered_json out;
  out["world"] = mesh.world_size();
  out["layout"] = dims_json(layout.sizes());
  out["warmup_steps"] = warmup;
  out["timed_steps"] = timed;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<int64_t>& w = rows[r];
    nlohmann::ordered_json rank;
    rank["rank"] = r;
    rank["coords"] = dims_json(layout.coords(int(r)));
    rank["peak_allocated_bytes"] = w[0];
    rank["peak_reserved_bytes"] = w[1];
    rank["host_peak_bytes"] = w[7];
    rank["bytes_per_step"] = w[2];
    rank["step_s"] = std::bit_cast<double>(w[3]);
    rank["tokens_per_s"] = std::bit_cast<double>(w[4]);
    nlohmann::ordered_json per_group = nlohmann::ordered_json::object();
    for (size_t i = 0; i < groups.size(); ++i) {
      const int64_t* c = counters[r].data() + 4 * i;
      const uint64_t calls = uint64_t(c[1]), bytes = uint64_t(c[2]);
      // Names from this rank's groups: the hash check above says every rank has the same list.
      LOOM_CHECK(!per_group.contains(groups[i]->name()), "bench step --json: two groups named '",
                 groups[i]->name(), "'");
      per_group[groups[i]->name()] = {{"size", c[0]},
                                      {"calls", calls / timed},
                                      {"bytes", bytes / timed},
                                      {"wait_s", std::bit_cast<double>(c[3]) / double(timed)},
                                      {"exact", calls % timed == 0 && bytes % timed == 0}};
    }
    rank["groups"] = std::move(per_group);
    ranks.push_back(std::move(rank));
  }
  out["ranks"] = std::move(ranks);
  return out;
}

}  // namespace

int bench_command(const Args& args) {
  const char* usage =
      "usage: loom bench step --config FILE [--json] [--check | --check-bytes] "
      "[--peak-tolerance=F] [--profile[=HARDWARE]] [--peak-seconds S] [--section.key=value ...]\n"
      "       loom bench attention [--device auto|cpu|cuda] [--dims 64,128] [--seq 2048,...] "
      "[--json] (--help: all its options)";
  if (!args.empty() && args[0] == "attention") return bench_attention_command(args);
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::printf("%s\n", usage);
    return 0;
  }
  LOOM_CHECK(!args.empty() && args[0] == "step", usage);
  std::string config_path, profile_hw;
  bool json = false, check = false, bytes_only = false;
  double tolerance = 0;       // of the measured peak against the meta run's
  double peak_seconds = 0.5;  // the GEMM peak's measurement (MFU's denominator)
  std::vector<std::string> overrides;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--check") {
      check = true;
    } else if (a == "--check-bytes") {
      // The bytes only, the peak printed but not checked.
      check = bytes_only = true;
    } else if (a.rfind("--peak-tolerance=", 0) == 0) {
      tolerance = std::stod(a.substr(17));
      LOOM_CHECK(tolerance >= 0 && tolerance < 1, "--peak-tolerance: a fraction in [0, 1), not ",
                 a.substr(17));
    } else if (a == "--profile" || a.rfind("--profile=", 0) == 0) {
      profile_hw = a == "--profile" ? "cpu-local" : a.substr(10);
    } else if (parse_peak_seconds(args, i, peak_seconds, usage)) {
      // read into peak_seconds
    } else if (a == "--config" && i + 1 < args.size()) {
      config_path = args[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else {
      overrides.push_back(a);
    }
  }
  LOOM_CHECK(!config_path.empty(), "bench step needs --config FILE");
  const JobConfig job = load_job_config(config_path, overrides);
  const std::string toml_dir = std::filesystem::path(config_path).parent_path().string();
  const ModelConfig mc = job_model_config(job, resolve_model_config(job.model.config, toml_dir));
  const DType compute = dtype_from_name(job.training.mixed_precision_param);
  const int64_t B = job.training.local_batch_size, T = job.training.seq_len;
  const int warmup = int(job.bench.warmup_steps), steps = int(job.bench.steps);

  // The trainer's step, whatever the layout: grad_accum_steps runs of the pipeline's micro-batches
  // (1 without pp).
  const int64_t G = job.training.grad_accum_steps * pipeline_microbatches(job);
  // Before the mesh's groups: MPI is finalized after every group is gone.
  const DistRuntime dist = start_distributed(job, "bench step");
  dist::Mesh* mesh = dist.mesh.get();
  const bool writer = !mesh || mesh->world_rank() == 0;

  // The header of `loom info`, GEMM peaks included (one process only: ranks sharing cores
  // would measure each other). Its load average is the one before the steps.
  const SystemInfo sys = collect_system_info(mesh ? 0 : peak_seconds);
  const std::string load_before = sys.load_average;
  const Device device = parallelize_options(job).device;
  // On a GPU the bf16 tensor-core rate, whatever the dtype (as published GPU runs count MFU).
  const double peak_flops = device == Device::cuda   ? sys.gpu.peak_bf16
                            : compute == DType::bf16 ? sys.peak_bf16
                                                     : sys.peak_f32;

  // This rank's step on the meta device first (before the real model books its other stages'
  // units there under pp): the expected peaks and bytes.
  const RankPlan meta =
      plan_rank({job, mc, mesh ? mesh->world_size() : 1}, mesh ? mesh->world_rank() : 0);
  auto& alloc = Allocator::get(device);
  auto& host = Allocator::get(device, Pool::host);  // CPU offload's states
  ParallelModel par = parallelize(mc, compute, parallel_groups(mesh), parallelize_options(job));
  Model& model = *par.model;
  model.init_weights(uint64_t(job.model.seed));
  AdamWConfig oc{float(job.optimizer.lr), float(job.optimizer.beta1), float(job.optimizer.beta2),
                 float(job.optimizer.eps), float(job.optimizer.weight_decay)};
  AdamW opt(model.units(), oc);

  // Random tokens, this dp rank's own: B rows of T + 1 (inputs are the first T, targets the last
  // T).
  const int64_t dp_size = par.groups.size;
  std::vector<float> u(size_t(B * (T + 1)));
  philox_uniform(philox_key(uint64_t(job.model.seed), "bench.tokens"),
                 par.groups.rank * int64_t(u.size()), int64_t(u.size()), u.data());
  std::vector<int32_t> inputs(size_t(B * T)), targets(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      inputs[b * T + t] = int32_t(u[b * (T + 1) + t] * mc.vocab_size());
      targets[b * T + t] = int32_t(u[b * (T + 1) + t + 1] * mc.vocab_size());
    }

  const std::vector<dist::ProcessGroup*> groups = comm_groups(mesh, par.groups);
  MicroBatch batch{B, T, std::move(inputs), std::move(targets)};
  TrainStep train_step(par, opt, job.training.max_norm, G * B * T * dp_size);
  std::optional<OpProfile> profile;
  std::optional<ops::ProfileOps> profiling;
  if (!profile_hw.empty()) {
    // Priced as `loom plan --oversubscribed` prices this machine's ranks.
    plan::Hardware hw = plan::load_hardware(profile_hw);
    const int world = mesh ? mesh->world_size() : 1;
    profile.emplace(hw, std::max(1.0, double(world) / std::max(1, hw.ranks_per_node)), device);
  }
  std::vector<double> times, losses;
  std::map<std::string, uint64_t> waits_before;  // the GPU's host waits before the timed steps
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      waits_before = ops::gpu_host_waits();
      alloc.reset_peak();
      for (dist::ProcessGroup* g : groups) g->reset_counters();
      if (profile) {
        profile->start();
        profiling.emplace(profile->sink());
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    const StepResult r = train_step.run(
        G, [&](int64_t) -> const MicroBatch& { return batch; }, job.optimizer.lr);
    auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    losses.push_back(r.loss);
  }
  profiling.reset();
  if (profile) profile->stop();
  // Taken now: the gathers of the figures below count on the world group too.
  std::vector<dist::CommCounters> measured;
  uint64_t bytes_measured = 0, ep_measured = 0;
  double wait_s = 0;
  // Expert parallelism's all-to-alls carry the tokens the router sent to other ranks' experts: the
  // meta run, which routes nothing, prices a balanced router. They (and the peak, which follows the
  // routing) are reported beside the check, not in it.
  const bool routed = par.groups.ep != nullptr;
  if (routed) bytes_only = true;
  for (dist::ProcessGroup* g : groups) {
    measured.push_back(g->counters());
    (g == par.groups.ep ? ep_measured : bytes_measured) += g->counters().bytes_sent;
    wait_s += g->counters().wait_seconds;
  }
  const auto st = alloc.stats();
  const double step_s = median(times);
  const double tokens_per_s = double(G * B * T) / step_s;  // this rank's tokens
  const double flops = mc.flops_per_token(T) * tokens_per_s;
  const double mfu = peak_flops > 0 ? flops / peak_flops : 0;

  const size_t n = size_t(model.num_params());
  // Peaks are reset after the warm-up steps, as the meta run's second step.
  const size_t peak_expected = warmup > 0 ? meta.peak_allocated : meta.run_peak_allocated;
  const double mem_ratio = double(st.peak_allocated) / double(peak_expected);
  const uint64_t timed = uint64_t(std::max(steps, 1));
  const uint64_t sent_per_step = bytes_measured / timed;
  uint64_t bytes_expected = 0, ep_expected = 0;
  for (const GroupTraffic& g : meta.groups)
    (g.name == "ep" ? ep_expected : bytes_expected) += g.bytes();
  // A per-step figure only if the timed steps sent the same bytes each.
  const bool bytes_ok = bytes_measured == bytes_expected * timed;
  const bool peak_ok = std::fabs(mem_ratio - 1) <= tolerance;
  const double MiB = 1024.0 * 1024.0;
  std::string uses;  // the meta run's peak by use
  for (size_t u = 0; u < kMemoryUses; ++u)
    if (meta.at_peak[u]) {
      char mib[32];
      std::snprintf(mib, sizeof mib, "%.2f", double(meta.at_peak[u]) / MiB);
      uses += str_cat(uses.empty() ? "" : " + ", memory_use_name(MemoryUse(u)), " ", mib);
    }

  if (mesh) {
    const std::vector<std::vector<int64_t>> rows =
        gather_rows(mesh, {int64_t(st.peak_allocated), int64_t(peak_expected),
                           int64_t(sent_per_step), int64_t(bytes_expected), int64_t(bytes_ok),
                           int64_t(std::llround(tokens_per_s)), int64_t(std::llround(step_s * 1e6)),
                           int64_t(std::llround(wait_s / double(timed) * 1e6)),
                           int64_t(host.stats().peak_allocated), int64_t(meta.host)});
    bool all_ok = true;
    double total_tps = 0;
    for (const auto& r : rows) {
      const double ratio = double(r[0]) / double(r[1]);
      // Offloaded states are allocated once: the host pool holds exactly them.
      all_ok =
          all_ok && r[4] == 1 && (bytes_only || std::fabs(ratio - 1) <= tolerance) && r[8] == r[9];
      total_tps += double(r[5]);
    }
    // Collective: every rank gathers, rank 0 prints.
    const nlohmann::ordered_json figures =
        json ? mesh_json(*mesh, groups, measured, st, host.stats().peak_allocated, sent_per_step,
                         step_s, tokens_per_s, warmup, timed)
             : nlohmann::ordered_json();
    if (writer) {
      std::fputs(format_system_info(sys).c_str(), stdout);
      std::printf("  precision     %s\n", describe_precision(job).c_str());
      std::printf(
          "loom bench step: %s (%s), %s over %d ranks (%s, reshard %s, reduce %s), local batch "
          "%ld x %ld x seq %ld, %zu parameters\n",
          config_path.c_str(), std::string(dtype_name(compute)).c_str(), par.kind(),
          mesh->world_size(), mesh->layout().describe().c_str(),
          job.parallelism.fsdp_reshard_after_forward.c_str(),
          job.training.mixed_precision_reduce.c_str(), long(G), long(B), long(T), n);
      std::printf("  load average %s (before)  %s (after); %d timed steps after %d warm-up\n",
                  load_before.c_str(), load_average().c_str(), steps, warmup);
      std::printf("  expected: rank 0's step on the meta device, peak %.2f MiB = %s MiB\n",
                  double(peak_expected) / MiB, uses.c_str());
      for (size_t r = 0; r < rows.size(); ++r)
        if (rows[r][8] || rows[r][9])
          std::printf("  rank %zu: CPU offload, host memory %.2f MiB, expected %.2f MiB %s\n", r,
                      double(rows[r][8]) / MiB, double(rows[r][9]) / MiB,
                      rows[r][8] == rows[r][9] ? "(equal)" : "MISMATCH");
      std::printf("  %4s | %12s %12s %7s | %14s %14s %8s | %9s %9s %9s\n", "rank", "peak MiB",
                  "expected", "ratio", "bytes/step", "expected", "bytes", "step ms", "wait ms",
                  "tokens/s");
      for (size_t r = 0; r < rows.size(); ++r) {
        const auto& w = rows[r];
        const double ratio = double(w[0]) / double(w[1]);
        std::printf("  %4zu | %12.2f %12.2f %7.4f%s| %14lld %14lld %8s | %9.1f %9.1f %9lld\n", r,
                    double(w[0]) / MiB, double(w[1]) / MiB, ratio,
                    std::fabs(ratio - 1) <= tolerance ? " " : "!", (long long)w[2], (long long)w[3],
                    w[4] ? "ok" : "MISMATCH", double(w[6]) / 1e3, double(w[7]) / 1e3,
                    (long long)w[5]);
      }
      char pct_text[32];
      std::snprintf(pct_text, sizeof pct_text, "%g%%", tolerance * 100);
      const std::string pct = pct_text;
      std::printf(
          "  job tokens/s %.0f; loss %.4f -> %.4f; %s\n", total_tps, losses.front(), losses.back(),
          (all_ok
               ? (bytes_only       ? std::string("all ranks: bytes equal the meta run's "
                                                       "(peak not checked: --check-bytes)")
                  : tolerance == 0 ? std::string("all ranks: bytes and peak equal the meta run's")
                                   : "all ranks: bytes equal the meta run's, peak within " + pct)
           : bytes_only ? std::string("FAILED: bytes differ from the meta run's")
                        : "FAILED: bytes differ from the meta run's or peak off by > " + pct)
              .c_str());
      if (routed)
        std::printf(
            "  expert parallelism: rank 0's ep all-to-alls sent %llu bytes/step (the meta run's "
            "balanced router: %llu); not in the check, nor the peak, which follow the routing\n",
            (unsigned long long)(ep_measured / timed), (unsigned long long)ep_expected);
      if (profile)
        std::fputs(profile->report(steps, step_s, wait_s / double(timed)).c_str(), stdout);
      if (json) std::printf("%s\n", figures.dump().c_str());
      std::fflush(stdout);
    }
    return check && !all_ok ? 1 : 0;
  }
  // A step's waits of the host for the GPU, by what waited: each one drains the GPU's queue.
  nlohmann::ordered_json waits_json = nlohmann::ordered_json::object();
  std::string waits_text;
  double waits_total = 0;
  if (device == Device::cuda) {
    for (const auto& [what, count] : ops::gpu_host_waits()) {
      const auto it = waits_before.find(what);
      const double per_step =
          double(count - (it == waits_before.end() ? 0 : it->second)) / double(timed);
      if (per_step == 0) continue;
      waits_json[what] = per_step;
      waits_total += per_step;
      char figure[32];
      std::snprintf(figure, sizeof figure, "%g", per_step);
      waits_text += str_cat(waits_text.empty() ? "" : ", ", what, " ", figure);
    }
  }
  const std::string load_after = load_average();
  const std::string profiled =
      profile ? profile->report(steps, step_s, wait_s / double(timed)) : std::string();

  if (json) {
    nlohmann::ordered_json by_use;  // the meta run's peak by use
    for (size_t u = 0; u < kMemoryUses; ++u)
      by_use[std::string(memory_use_name(MemoryUse(u)))] = meta.at_peak[u];
    std::fputs(profiled.c_str(), stdout);
    std::printf(
        "{\"config\": \"%s\", \"dtype\": \"%s\", \"batch\": %ld, \"seq_len\": %ld, "
        "\"params\": %zu, \"step_s\": %.6f, \"tokens_per_s\": %.1f, \"tflops\": %.4f, "
        "\"gemm_peak_tflops\": %.4f, \"mfu\": %.4f, \"peak_allocated_bytes\": %zu, "
        "\"peak_reserved_bytes\": %zu, \"expected_bytes\": %zu, \"expected_by_use\": %s, "
        "\"loss_first\": %.5f, \"loss_last\": %.5f, \"host_waits_per_step\": %s, "
        "\"load_before\": \"%s\", \"load_after\": \"%s\", \"precision\": %s, "
        "\"system\": %s}\n",
        config_path.c_str(), std::string(dtype_name(compute)).c_str(), long(B), long(T), n, step_s,
        tokens_per_s, flops / 1e12, peak_flops / 1e12, mfu, st.peak_allocated, st.peak_reserved,
        peak_expected, by_use.dump().c_str(), losses.front(), losses.back(),
        waits_json.dump().c_str(), load_before.c_str(), load_after.c_str(),
        nlohmann::json(describe_precision(job)).dump().c_str(),
        system_info_json(sys).dump().c_str());
    return check && !peak_ok ? 1 : 0;
  }
  std::fputs(format_system_info(sys).c_str(), stdout);
  std::printf("  precision     %s\n", describe_precision(job).c_str());
  std::printf("loom bench step: %s (%s), batch %ld x seq %ld, %zu parameters\n",
              config_path.c_str(), std::string(dtype_name(compute)).c_str(), long(B), long(T), n);
  std::printf("  load average        %s (before)  %s (after)\n", load_before.c_str(),
              load_after.c_str());
  std::printf("  step time (median)  %.2f ms over %d steps after %d warm-up\n", step_s * 1e3, steps,
              warmup);
  std::printf("  tokens/s            %.0f\n", tokens_per_s);
  std::printf("  achieved            %.1f GFLOP/s (%.1f MFLOP/token, %s)\n", flops / 1e9,
              mc.flops_per_token(T) / 1e6,
              mc.is_gla()   ? "6N + 12LHKV: GLA's recurrent core"
              : mc.is_moe() ? "6N + 12LHQT, N the active parameters"
                            : "6N + 12LHQT");
  std::printf("  GEMM peak measured  %.1f GFLOP/s (%s)\n", peak_flops / 1e9,
              std::string(dtype_name(compute)).c_str());
  std::printf("  MFU                 %.1f%% of the measured GEMM peak\n", 100 * mfu);
  std::printf("  peak allocated      %.1f MiB (reserved %.1f MiB)\n", st.peak_allocated / MiB,
              st.peak_reserved / MiB);
  std::printf(
      "  expected            %.2f MiB = %s MiB, the step on the meta device (measured/expected "
      "%.4f%s)\n",
      double(peak_expected) / MiB, uses.c_str(), mem_ratio, peak_ok ? "" : ", OFF");
  std::printf("  loss                %.4f -> %.4f\n", losses.front(), losses.back());
  if (device == Device::cuda)
    std::printf("  host waits/step     %g (%s): the host waiting for the GPU\n", waits_total,
                waits_text.empty() ? "none" : waits_text.c_str());
  std::fputs(profiled.c_str(), stdout);
  return check && !peak_ok ? 1 : 0;
}

}  // namespace loom
