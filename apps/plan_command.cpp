// `loom plan --config FILE --world N`: the step of `loom train` on N ranks, planned one rank at a
// time on the meta device (train/rank_plan.hpp): per rank its peak allocated and reserved memory,
// the bytes of each group it communicates on, and the FLOPs of its kernels. `--ranks all` plans
// every rank (the parity checks compare each with the real run); the default plans the
// representative ranks.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "plan/expert_load.hpp"
#include "plan/hardware.hpp"
#include "plan/layout_plan.hpp"
#include "plan/search.hpp"
#include "plan/time_model.hpp"
#include "train/config.hpp"
#include "train/launch.hpp"
#include "train/rank_plan.hpp"

namespace loom {

namespace {

std::vector<int> parse_ranks(const std::string& s, int world) {
  std::vector<int> out;
  if (s == "all") {
    for (int r = 0; r < world; ++r) out.push_back(r);
    return out;
  }
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    int r = -1;
    try {
      size_t used = 0;
      r = std::stoi(item, &used);
      if (used != item.size()) r = -1;
    } catch (const std::exception&) {
    }
    LOOM_CHECK(r >= 0 && r < world, "plan --ranks: '", item, "' is not a rank of the world of ",
               world, " (expected all or a comma list of ranks)");
    out.push_back(r);
    pos = comma + 1;
  }
  return out;
}

// tokens: the job's per step; per_rank_flops: the model FLOPs of one token over the world's
// ranks, times the peak (torchtitan's MFU: model FLOPs of the job's tokens over the world's peak).
nlohmann::json time_json(const plan::StepTime& t, double tokens, double model_flops, double peak) {
  nlohmann::json by_group = nlohmann::json::object();
  for (const auto& [g, s] : t.comm_by_group) by_group[g] = s;
  return {{"step_s", t.step},
          {"compute_s", t.compute},
          {"optimizer_s", t.optimizer},
          {"comm_s", t.comm},
          {"exposed_comm_s", t.exposed},
          {"waits_s", t.waits},
          {"bubble", t.bubble},
          {"job_tokens_per_s", tokens / t.step},
          {"mfu", model_flops * tokens / t.step / peak},
          {"comm_by_group_s", by_group}};
}

nlohmann::json rank_json(const RankPlan& p) {
  nlohmann::json at_peak = nlohmann::json::object();
  for (size_t u = 0; u < kMemoryUses; ++u)
    at_peak[std::string(memory_use_name(MemoryUse(u)))] = p.at_peak[u];
  nlohmann::json groups = nlohmann::json::object();
  for (const GroupTraffic& g : p.groups) {
    nlohmann::json ops = nlohmann::json::object();
    for (const auto& o : g.ops) ops[o.op] = {{"calls", o.calls}, {"bytes", o.bytes}};
    groups[g.name] = {{"size", g.size}, {"calls", g.calls()}, {"bytes", g.bytes()}, {"ops", ops}};
  }
  return {{"rank", p.rank},
          {"coords", p.coords},
          {"role", p.role},
          {"peak_allocated_bytes", p.peak_allocated},
          {"peak_reserved_bytes", p.peak_reserved},
          {"cache_flushes", p.cache_flushes},
          {"state_bytes", p.states},
          {"optimizer_bytes", p.optimizer},
          {"host_bytes", p.host},
          {"params", p.num_params},
          {"tokens", p.tokens},
          {"flops", p.flops()},
          {"at_peak", at_peak},
          {"groups", groups}};
}

// A mixture of experts' routing, the load the figures assume and their worst case (dropless).
nlohmann::json worst_json(const std::optional<plan::EpWorstCase>& w) {
  if (!w) return nullptr;
  return {{"load", w->load},
          {"peak_allocated_bytes", w->peak},
          {"peak_reserved_bytes", w->reserved},
          {"fits", w->fits}};
}

void print_routing(const PlanJob& j, const std::optional<plan::EpWorstCase>& w,
                   const plan::Hardware& hw, const char* indent) {
  if (!j.model.is_moe()) return;
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  const int64_t ep = j.job.parallelism.ep;
  if (ep <= 1) {
    std::printf(
        "%sexperts: without ep each rank computes its own tokens' choices, however they route: "
        "the figures hold for any routing (dropless)\n",
        indent);
    return;
  }
  if (j.ep_load == 1)
    std::printf(
        "%sexperts: balanced routing assumed: each ep rank's experts get 1/%lld of every rank's "
        "rows (load 1, no headroom; --ep-load L plans the most loaded rank at L times that)\n",
        indent, (long long)ep);
  else
    std::printf(
        "%sexperts: the planned ranks are the most loaded: their experts get %.2f x 1/%lld of "
        "every rank's rows (--ep-load)\n",
        indent, j.ep_load, (long long)ep);
  if (!w) return;
  const MoeConfig& c = j.model.moe("plan");
  char fit[64] = "fits";
  if (!w->fits) std::snprintf(fit, sizeof fit, "DOES NOT FIT %.1f GiB", hw.capacity / GiB);
  std::printf(
      "%sexperts, worst case dropless (every rank's tokens send %lld of their %lld choices to one "
      "rank's %lld experts: load %.2f): peak allocated %.2f GiB%s, reserved %.2f GiB: %s\n",
      indent, (long long)std::min(c.num_experts_per_tok, c.num_experts / ep),
      (long long)c.num_experts_per_tok, (long long)(c.num_experts / ep), w->load, w->peak / GiB,
      w->fits ? "" : "+", w->reserved / GiB, fit);
}

int search_command(const PlanJob& j, const plan::Hardware& hw, bool oversubscribed, bool json) {
  const plan::SearchResult r = plan::search_layouts(j, hw, oversubscribed);
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  // The first layout's routing: what its figures assume and, under ep, their worst case.
  std::optional<plan::EpWorstCase> worst;
  std::optional<PlanJob> first;
  if (!r.entries.empty() && r.entries.front().fits) {
    first = j;
    first->job = r.entries.front().job;
    worst =
        plan::ep_worst_case(*first, representative_ranks(plan_layout(*first)), hw, oversubscribed);
  }
  if (json) {
    nlohmann::json out = {{"world", j.world},
                          {"hardware", hw.name},
                          {"refused", r.refused},
                          {"first_ep_worst_case", worst_json(worst)},
                          {"layouts", nlohmann::json::array()}};
    for (const auto& e : r.entries)
      out["layouts"].push_back({{"layout", e.layout},
                                {"fits", e.fits},
                                {"ep", e.job.parallelism.ep},
                                {"cpu_offload", e.job.training.enable_cpu_offload},
                                {"peak_allocated_bytes", e.peak},
                                {"peak_reserved_bytes", e.reserved},
                                {"tokens_per_step", e.job_tokens},
                                {"states_exceed_capacity", e.states_only},
                                {"step_s", e.step},
                                {"job_tokens_per_s", e.tokens_per_s},
                                {"mfu", e.mfu}});
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf(
        "loom plan --search: %d ranks of %s (%.1f GiB each); %zu layouts planned, %d "
        "refused by loom's checks%s\n",
        j.world, hw.name.c_str(), hw.capacity / GiB, r.entries.size(), r.refused,
        r.refused ? str_cat(" (e.g. ", r.first_refusal, ")").c_str() : "");
    std::printf("  %-62s %10s %10s %10s %12s %6s\n", "layout", "peak GiB", "tokens/step", "step s",
                "tokens/s", "MFU");
    for (const auto& e : r.entries) {
      if (e.states_only) {
        std::printf(
            "  %-62s %9.2f+ %10s %10s %12s %6s  does not fit: parameters, gradients and "
            "AdamW alone\n",
            e.layout.c_str(), e.peak / GiB, "-", "-", "-", "-");
        continue;
      }
      // A layout that does not fit is not timed, and its planning stopped at the first rank over
      // the capacity: its peak is a lower bound.
      if (!e.fits) {
        std::printf("  %-62s %9.2f+ %10.0f %10s %12s %6s  does not fit\n", e.layout.c_str(),
                    e.peak / GiB, e.job_tokens, "-", "-", "-");
        continue;
      }
      std::printf("  %-62s %10.2f %10.0f %10.3f %12.0f %5.1f%%\n", e.layout.c_str(), e.peak / GiB,
                  e.job_tokens, e.step, e.tokens_per_s, 100 * e.mfu);
    }
    if (first) {
      if (first->model.is_moe()) std::printf("  first layout:\n");
      print_routing(*first, worst, hw, "    ");
    }
  }
  return !r.entries.empty() && r.entries.front().fits ? 0 : 2;
}

}  // namespace

int plan_command(const Args& args) {
  if (!args.empty() && args[0] == "calibrate")
    return plan_calibrate_command(Args(args.begin() + 1, args.end()));
  const char* usage =
      "usage: loom plan --config FILE --world N [--ranks all|R,R...] [--hardware NAME|FILE] "
      "[--oversubscribed] [--search] [--json] [--ep-load L] "
      "[--section.key=value ...]";
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::printf("%s\n", usage);
    return 0;
  }
  std::string config_path, ranks_arg, hardware = "cpu-local";
  int world = 0;
  double ep_load = 1;
  bool json = false, oversubscribed = false, search = false;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const char* flag) -> std::string {
      const std::string f = flag;
      if (a.rfind(f + "=", 0) == 0) return a.substr(f.size() + 1);
      LOOM_CHECK(i + 1 < args.size(), flag, " needs a value; ", usage);
      return args[++i];
    };
    if (a == "--json") {
      json = true;
    } else if (a == "--search") {
      search = true;
    } else if (a == "--oversubscribed") {
      // Every rank on one node of the hardware (mpirun --oversubscribe on this machine).
      oversubscribed = true;
    } else if (a == "--hardware" || a.rfind("--hardware=", 0) == 0) {
      hardware = value("--hardware");
    } else if (a == "--config" || a.rfind("--config=", 0) == 0) {
      config_path = value("--config");
    } else if (a == "--world" || a.rfind("--world=", 0) == 0) {
      const std::string v = value("--world");
      try {
        world = std::stoi(v);
      } catch (const std::exception&) {
        world = 0;
      }
      LOOM_CHECK(world >= 1, "plan --world: '", v, "' is not a positive number of ranks");
    } else if (a == "--ranks" || a.rfind("--ranks=", 0) == 0) {
      ranks_arg = value("--ranks");
    } else if (a == "--ep-load" || a.rfind("--ep-load=", 0) == 0) {
      // The most loaded ep rank's experts, over the balanced share (PlanJob::ep_load).
      const std::string v = value("--ep-load");
      try {
        size_t used = 0;
        ep_load = std::stod(v, &used);
        if (used != v.size()) ep_load = 0;
      } catch (const std::exception&) {
        ep_load = 0;
      }
      LOOM_CHECK(ep_load >= 1, "plan --ep-load: '", v,
                 "' is not a load >= 1 (1: balanced routing; the rows the most loaded ep rank's "
                 "experts get over 1/ep of every rank's)");
    } else {
      overrides.push_back(a);
    }
  }
  LOOM_CHECK(!config_path.empty() && world >= 1, usage);

  const JobConfig job = load_job_config(config_path, overrides);
  const std::string toml_dir = std::filesystem::path(config_path).parent_path().string();
  PlanJob j{job, job_model_config(job, resolve_model_config(job.model.config, toml_dir)), world};
  if (ep_load != 1) {
    LOOM_CHECK(!search, "plan --ep-load: not with --search (which plans every ep, balanced)");
    const double most = plan::worst_ep_load(j);
    LOOM_CHECK(j.model.is_moe() && job.parallelism.ep > 1 && ep_load <= most, "plan --ep-load ",
               ep_load, ": expected a load from 1 to ", most,
               j.model.is_moe() && job.parallelism.ep > 1
                   ? " (each token's k choices are distinct experts: one ep rank's get at most "
                     "ep x min(k, E / ep) / k of the balanced rows)"
                   : " (a load needs a mixture of experts under parallelism.ep > 1)");
    j.ep_load = ep_load;
  }
  const dist::MeshLayout layout = plan_layout(j);
  const std::vector<int> ranks =
      ranks_arg.empty() ? representative_ranks(layout) : parse_ranks(ranks_arg, world);

  const plan::Hardware hw = plan::load_hardware(hardware);
  // The job planned on the hardware's device: a GPU's memory plan books its kernels' scratch.
  j.job.training.device = hw.device;
  if (search) return search_command(j, hw, oversubscribed, json);
  const plan::LayoutPlan lp = plan::plan_whole(j, ranks, hw, oversubscribed);
  const std::optional<plan::EpWorstCase> worst = plan::ep_worst_case(j, ranks, hw, oversubscribed);
  const std::vector<RankPlan>& plans = lp.ranks;
  const std::vector<plan::StepTime>& times = lp.times;
  const int pp = layout.size("pp");
  const double model_flops_per_token = lp.model_flops_per_token;
  const DType compute = dtype_from_name(j.job.training.mixed_precision_param);
  const double job_tokens = lp.job_tokens;
  const bool fits = lp.fits;

  if (json) {
    nlohmann::json out = {{"config", config_path},
                          {"world", world},
                          {"layout", layout.describe()},
                          {"micro_batches", plans.front().micro_batches},
                          {"ranks", nlohmann::json::array()}};
    out["hardware"] = hw.name;
    out["fits"] = fits;
    out["ep_load"] = j.ep_load;
    out["ep_worst_case"] = worst_json(worst);
    for (size_t i = 0; i < plans.size(); ++i) {
      nlohmann::json r = rank_json(plans[i]);
      r["time"] = time_json(times[i], job_tokens, model_flops_per_token, world * hw.peak(compute));
      out["ranks"].push_back(r);
    }
    std::printf("%s\n", out.dump().c_str());
    return fits ? 0 : 2;
  }
  const double MiB = 1024.0 * 1024.0;
  std::printf("loom plan: %s on %d ranks (%s), %lld micro-batches of %lld x %lld per step\n",
              config_path.c_str(), world, layout.describe().c_str(),
              (long long)plans.front().micro_batches, (long long)j.job.training.local_batch_size,
              (long long)j.job.training.seq_len);
  std::printf("  hardware %s (%s): %.1f GiB per rank, %d ranks per node%s\n", hw.name.c_str(),
              hw.source.c_str(), hw.capacity / (1024.0 * MiB), hw.ranks_per_node,
              oversubscribed ? ", every rank on one node (--oversubscribed)" : "");
  for (size_t i = 0; i < plans.size(); ++i) {
    const RankPlan& p = plans[i];
    const plan::StepTime& t = times[i];
    // A rank whose cache outgrew the capacity was planned again under it (plan_whole).
    const std::string fit =
        double(p.peak_allocated) > hw.capacity  ? "  DOES NOT FIT"
        : double(p.peak_reserved) > hw.capacity ? "  DOES NOT FIT under the capacity's limit"
        : p.cache_flushes
            ? str_cat("  (reserved held within the capacity: the allocator gives its cache back ",
                      p.cache_flushes, " times a step)")
            : "";
    std::printf("\n  rank %d (%s): peak allocated %.2f MiB, reserved %.2f MiB%s\n", p.rank,
                p.role.c_str(), p.peak_allocated / MiB, p.peak_reserved / MiB, fit.c_str());
    for (size_t u = 0; u < kMemoryUses; ++u)
      if (p.at_peak[u])
        std::printf("    %-38s %12.2f MiB\n", std::string(memory_use_name(MemoryUse(u))).c_str(),
                    p.at_peak[u] / MiB);
    if (p.host)
      std::printf("    %-38s %12.2f MiB (not on the device)\n", "host memory: offloaded states",
                  p.host / MiB);
    for (const auto& g : p.groups) {
      std::string ops;
      for (const auto& o : g.ops)
        ops += str_cat(ops.empty() ? "" : ", ", o.op, " ", o.calls, "x ", o.bytes, " B");
      std::printf("    group %-14s (%4d ranks) %14llu bytes/step: %s\n", g.name.c_str(), g.size,
                  (unsigned long long)g.bytes(), ops.c_str());
    }
    std::printf(
        "    time on %s: step %.2f ms = compute %.2f + exposed communication %.2f + AdamW %.2f"
        "%s (communication %.2f ms in all%s); job %.0f tokens/s, MFU %.1f%%\n",
        hw.name.c_str(), t.step * 1e3, t.compute * 1e3, t.exposed * 1e3, t.optimizer * 1e3,
        pp > 1 ? str_cat(", pipeline bubble ", int(t.bubble * 1000) / 10.0, "%").c_str() : "",
        t.comm * 1e3,
        t.waits > 0
            ? str_cat(", waits for the last rank ", int(t.waits * 1e5) / 100.0, " ms").c_str()
            : "",
        job_tokens / t.step,
        100 * model_flops_per_token * job_tokens / t.step / (world * hw.peak(compute)));
  }
  std::printf("\n");
  print_routing(j, worst, hw, "  ");
  std::printf("  %s\n",
              fits ? "every planned rank fits" : "some rank does not fit in the hardware's memory");
  return fits ? 0 : 2;
}

}  // namespace loom
